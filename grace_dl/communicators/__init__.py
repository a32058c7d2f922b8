"""Communicators, one module each, written on grace_dl.collectives."""
