"""Triton source of ``select``: the exact top-k by magnitude as a radix select (three
histogram passes fix the k-th largest key a digit at a time) and a compaction (a count pass
and a write pass), with no host synchronisation and no sort (twin: ``select.top_twin``)."""

import triton
import triton.language as tl


@triton.jit
def rank_key(x, SIGN: tl.constexpr):
    """A non-negative int32 that orders as ``sparse.magnitudes`` ranks: the float32 bits of
    ``|x|`` plus one, 0 (below every number, as their -1) for NaN, and with ``SIGN`` +1 (-1)
    for the entries that are not positive (negative)."""
    wide = x.to(tl.float32)
    bits = wide.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if SIGN > 0:
        return tl.where(wide > 0, bits + 1, 0)
    elif SIGN < 0:
        return tl.where(wide < 0, bits + 1, 0)
    else:
        return tl.where(bits > 0x7F800000, 0, bits + 1)


@triton.jit(do_not_specialize=["n"])
def radix_hist(x_ptr, n, state_ptr, hist_ptr, SHIFT: tl.constexpr, BINS: tl.constexpr,
               BLOCK: tl.constexpr, LOOPS: tl.constexpr, SIGN: tl.constexpr):
    """Add to ``hist`` the count of each digit ``(key >> SHIFT) % BINS`` among the keys whose
    fixed bits (``state[1]``) equal the prefix found so far (``state[0]``); a program covers
    ``LOOPS`` blocks."""
    pid = tl.program_id(0).to(tl.int64)
    prefix = tl.load(state_ptr)
    fixed = tl.load(state_ptr + 1)
    local = tl.zeros((BINS,), tl.int32)
    for i in tl.static_range(LOOPS):
        idx = (pid * LOOPS + i) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        key = rank_key(tl.load(x_ptr + idx, mask=mask, other=0.0), SIGN)
        live = mask & ((key & fixed) == prefix)
        local += tl.histogram((key >> SHIFT) & (BINS - 1), BINS, mask=live)
    tl.atomic_add(hist_ptr + tl.arange(0, BINS), local)


@triton.jit(do_not_specialize=["k"])
def radix_pick(state_ptr, hist_ptr, k, SHIFT: tl.constexpr, BINS: tl.constexpr,
               FIRST: tl.constexpr):
    """The digit of the k-th largest key from ``radix_hist``'s counts: the prefix gains it,
    and the rank still to find (``state[2]``, ``k`` at the first pass) loses the count of keys
    above its bin."""
    b = tl.arange(0, BINS)
    h = tl.load(hist_ptr + b)
    want = k if FIRST else tl.load(state_ptr + 2)
    above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)
    hit = (above < want) & (above + h >= want)
    digit = tl.max(tl.where(hit, b, -1), axis=0)
    skipped = tl.sum(tl.where(b == digit, above, 0), axis=0)
    tl.store(state_ptr, tl.load(state_ptr) | (digit << SHIFT))
    tl.store(state_ptr + 1, tl.load(state_ptr + 1) | ((BINS - 1) << SHIFT))
    tl.store(state_ptr + 2, want - skipped)


@triton.jit(do_not_specialize=["n", "programs"])
def top_counts(x_ptr, n, state_ptr, counts_ptr, programs, BLOCK: tl.constexpr,
               SIGN: tl.constexpr):
    """This program's count of keys above the k-th largest (``counts[pid]``) and equal to it
    (``counts[programs + pid]``)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    key = rank_key(tl.load(x_ptr + idx, mask=mask, other=0.0), SIGN)
    kth = tl.load(state_ptr)
    tl.store(counts_ptr + pid, tl.sum((mask & (key > kth)).to(tl.int32), axis=0))
    tl.store(counts_ptr + programs + pid, tl.sum((mask & (key == kth)).to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["n", "programs"])
def top_write(x_ptr, n, state_ptr, before_ptr, programs, pos_ptr, val_ptr,
              BLOCK: tl.constexpr, SIGN: tl.constexpr):
    """The k kept entries, ascending by position: every key above the k-th largest, and of
    the keys equal to it the ``state[2]`` at the lowest positions; each at its slot (the kept
    entries before it: ``before`` holds the exclusive running counts over the programs)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0)
    key = rank_key(x, SIGN)
    kth = tl.load(state_ptr)
    ties = tl.load(state_ptr + 2)
    gt = mask & (key > kth)
    eq = (mask & (key == kth)).to(tl.int32)
    eq_before = tl.load(before_ptr + programs + pid)
    take = gt | ((eq != 0) & (eq_before + tl.cumsum(eq, axis=0) - eq < ties))
    t = take.to(tl.int32)
    slot = tl.load(before_ptr + pid) + tl.minimum(eq_before, ties) + tl.cumsum(t, axis=0) - t
    tl.store(pos_ptr + slot, idx.to(tl.int32), mask=take)
    tl.store(val_ptr + slot, x, mask=take)
