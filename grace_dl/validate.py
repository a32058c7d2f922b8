"""Checks constructors use so bad values fail at construction with a message naming them."""

from __future__ import annotations


def in_range(name: str, value, lo=None, hi=None, *, lo_open=False, hi_open=False, kind=float):
    """Return ``kind(value)`` if it lies in the interval, else raise ``ValueError`` saying so."""
    try:
        v = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a {kind.__name__}, got {value!r}") from None
    if kind is int and float(value) != v:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    bad = v != v or \
          (lo is not None and (v < lo or (lo_open and v == lo))) or \
          (hi is not None and (v > hi or (hi_open and v == hi)))
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise ValueError(f"{name} must be in {left}{lo_s}, {hi_s}{right}, got {value!r}")
    return v


def one_of(name: str, value, accepted):
    if value not in accepted:
        raise ValueError(f"{name} must be one of {sorted(accepted)}, got {value!r}")
    return value
