"""Checks constructors use so bad values fail at construction with a message naming them."""

from __future__ import annotations

import numbers

SEED_RANGE = (0, 2**32 - 1)  # the seed enters the random key as 32 bits (grace_dl.seeding)


def in_range(name: str, value, lo=None, hi=None, *, lo_open=False, hi_open=False, kind=float):
    """Return ``kind(value)`` if it lies in the interval, else raise ``ValueError`` saying so.
    Only real numbers are accepted: not ``bool`` (``True`` is no ratio) and not strings."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'} (not "
                         f"{type(value).__name__}), got {value!r}")
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


def boolean(name: str, value) -> bool:
    """A flag argument: exactly ``True`` or ``False`` (not 1, 0 or a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def one_of(name: str, value, accepted):
    if value not in accepted:
        raise ValueError(f"{name} must be one of {sorted(accepted)}, got {value!r}")
    return value


def seed(value) -> int:
    """A compressor's ``seed``: an integer in ``SEED_RANGE``."""
    return in_range("seed", value, *SEED_RANGE, kind=int)


def process_set(value):
    """``value`` if it is ``None`` (Horovod's global set) or a Horovod ``ProcessSet``, else a
    ``ValueError`` naming it."""
    if value is None or all(callable(getattr(value, m, None))
                            for m in ("included", "rank", "size")):
        return value
    raise ValueError(f"process_set must be None (the global process set) or a Horovod "
                     f"ProcessSet (hvd.add_process_set / hvd.ProcessSet), got {value!r}")
