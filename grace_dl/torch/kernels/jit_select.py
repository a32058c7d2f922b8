"""Triton source of ``select``: the positions of a tensor's ``k`` largest magnitudes by a radix
select over the magnitudes' float32 bits, then one pass that writes them in ascending order
(twin: ``select``).

An element's key is ``key_of``: its float32 magnitude's bits plus one, or 0 for an element that
is never a candidate (NaN; with ``SIGN`` the other sign's entries and zeros), so keys order as
the magnitudes do and fit 31 bits. The k-th largest key is found one digit at a time
(``select.DIGITS``; at most 7 bits each, since ``tl.histogram``'s work per element grows with
its bins: docs DECISIONS): each ``histogram`` pass counts the digit of the keys that match the
digits chosen so far, and ``decided`` (run at the start of the next pass by every program, and
stored by program 0 for the pass after) picks the digit holding the k-th. ``tally`` counts, per
program, the keys above the k-th and those equal to it; ``place`` writes each kept position at
its rank (keys above the k-th, then the first ``need`` ties by position: the reference's rule,
``sparse.keep_top``). Nothing is read by the host.
"""

import triton
import triton.language as tl

INF_BITS = tl.constexpr(0x7F800000)


@triton.jit
def key_of(x, SIGN: tl.constexpr):
    """The rank key of float32 ``x``: ``|x|``'s bits + 1, or 0 for NaN (with ``SIGN`` 1 or -1:
    also for zeros and entries of the other sign)."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    if SIGN == 0:
        keep = mag <= INF_BITS
    elif SIGN > 0:
        keep = (bits > 0) & (mag <= INF_BITS)
    else:
        keep = (bits < 0) & (mag != 0) & (mag <= INF_BITS)
    return tl.where(keep, mag + 1, 0)


@triton.jit
def decided(state_ptr, hist_ptr, FROM_STATE: tl.constexpr, k, BINS: tl.constexpr,
            BITS: tl.constexpr):
    """``(prefix, need)`` after a digit's histogram at ``hist_ptr``: the keys' bits chosen so
    far and how many of the keys with those bits are still to be kept. Before it: ``state``'s
    pair (``FROM_STATE``), or ``(0, k)``."""
    if FROM_STATE:
        prefix = tl.load(state_ptr)
        need = tl.load(state_ptr + 1)
    else:
        prefix = 0
        need = k
    bins = tl.arange(0, BINS)
    h = tl.load(hist_ptr + bins)
    at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
    digit = tl.max(tl.where(at_or_above >= need, bins, -1), axis=0)
    above = tl.sum(tl.where(bins == digit, at_or_above - h, 0), axis=0)
    return (prefix << BITS) | digit, need - above


@triton.jit
def histogram(x_ptr, state_ptr, prev_ptr, out_state_ptr, hist_ptr, n, k, tiles,
              SIGN: tl.constexpr, PREV: tl.constexpr, FROM_STATE: tl.constexpr,
              PREV_BINS: tl.constexpr, PREV_BITS: tl.constexpr, SHIFT: tl.constexpr,
              BITS: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """Adds into ``hist`` the digit ``(key >> SHIFT) % BINS`` (``BINS = 2**BITS``) of every key
    whose higher bits are the prefix chosen so far; with ``PREV`` that prefix is ``decided``
    from the previous digit's histogram at ``prev_ptr`` (program 0 stores it at
    ``out_state_ptr``), else 0. Each program takes ``tiles`` consecutive blocks (a ``while``
    loop: Triton's interpreter cannot take a ``range`` of a runtime bound)."""
    pid = tl.program_id(0)
    if PREV:
        prefix, need = decided(state_ptr, prev_ptr, FROM_STATE, k, PREV_BINS, PREV_BITS)
        if pid == 0:
            tl.store(out_state_ptr, prefix)
            tl.store(out_state_ptr + 1, need)
    else:
        prefix = 0
    counts = tl.zeros([BINS], dtype=tl.int32)
    t = 0
    while t < tiles:
        idx = (pid * tiles + t).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        key = key_of(tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32), SIGN)
        match = mask & ((key >> (SHIFT + BITS)) == prefix)
        counts += tl.histogram((key >> SHIFT) & (BINS - 1), BINS, mask=match)
        t += 1
    tl.atomic_add(hist_ptr + tl.arange(0, BINS), counts)


@triton.jit
def tally(x_ptr, state_ptr, hist_ptr, out_state_ptr, counts_ptr, n, programs,
          SIGN: tl.constexpr, BINS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Decides the last digit (the k-th key itself, stored with how many of its ties are kept
    at ``out_state_ptr`` by program 0) and counts this program's block: keys above the k-th at
    ``counts[pid]``, keys equal to it at ``counts[programs + pid]``."""
    pid = tl.program_id(0)
    kth, need = decided(state_ptr, hist_ptr, True, 0, BINS, BITS)
    if pid == 0:
        tl.store(out_state_ptr, kth)
        tl.store(out_state_ptr + 1, need)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    key = key_of(tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32), SIGN)
    tl.store(counts_ptr + pid, tl.sum((mask & (key > kth)).to(tl.int64), axis=0))
    tl.store(counts_ptr + programs + pid, tl.sum((mask & (key == kth)).to(tl.int64), axis=0))


@triton.jit
def place(x_ptr, state_ptr, offsets_ptr, out_ptr, n, programs, SIGN: tl.constexpr,
          BLOCK: tl.constexpr):
    """Writes this block's kept positions at their ranks: a key above the k-th is kept, a tie
    while fewer than ``need`` ties come before it; its rank is the kept keys before it
    (``offsets``: each program's keys above and ties before its block)."""
    pid = tl.program_id(0)
    kth = tl.load(state_ptr)
    need = tl.load(state_ptr + 1).to(tl.int64)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    key = key_of(tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32), SIGN)
    over = (mask & (key > kth)).to(tl.int64)
    tie = (mask & (key == kth)).to(tl.int64)
    over_before = tl.load(offsets_ptr + pid) + tl.cumsum(over, axis=0) - over
    ties_before = tl.load(offsets_ptr + programs + pid) + tl.cumsum(tie, axis=0) - tie
    keep = (over > 0) | ((tie > 0) & (ties_before < need))
    tl.store(out_ptr + over_before + tl.minimum(ties_before, need), idx, mask=keep)
