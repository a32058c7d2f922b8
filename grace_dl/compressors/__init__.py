"""Algorithms, one module per method; see grace_dl.registry.BUILTIN for which is where."""
