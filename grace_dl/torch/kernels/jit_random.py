"""Triton source of ``philox``: Philox-4x32-10 on a program's counters, the kernel that
writes a draw's words (twin: ``philox.words_twin``), and the kernels of ``philox.choice``
(twin: its torch ops)."""

import triton
import triton.language as tl

ROUND_A = tl.constexpr(0xD2511F53)
ROUND_B = tl.constexpr(0xCD9E8D57)
KEY_A = tl.constexpr(0x9E3779B9)
KEY_B = tl.constexpr(0xBB67AE85)


@triton.jit
def philox4(q, step, stream, k0, k1):
    """The four uint32 outputs of Philox-4x32-10 for the counters ``(q, 0, step, stream)`` (``q``
    an int32/int64 tensor of quad indices below 2**32) and the key ``(k0, k1)``."""
    c0 = q.to(tl.uint32)
    c1 = (q.to(tl.int64) >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + step.to(tl.uint32)
    c3 = tl.zeros_like(c0) + stream.to(tl.uint32)
    a = k0.to(tl.uint32)
    b = k1.to(tl.uint32)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, ROUND_A)
        lo0 = c0 * ROUND_A
        hi1 = tl.umulhi(c2, ROUND_B)
        lo1 = c2 * ROUND_B
        c0 = hi1 ^ c1 ^ a
        c1 = lo1
        c2 = hi0 ^ c3 ^ b
        c3 = lo0
        a = a + KEY_A
        b = b + KEY_B
    return c0, c1, c2, c3


@triton.jit
def word_block(base, step, stream, k0, k1, BLOCK: tl.constexpr):
    """Words ``base .. base + BLOCK - 1`` of a draw (``base`` a multiple of 4), in order."""
    q = base // 4 + tl.arange(0, BLOCK // 4)
    r0, r1, r2, r3 = philox4(q, step, stream, k0, k1)
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK,))


@triton.jit(do_not_specialize=["n", "k0", "k1", "step", "stream"])
def words(out_ptr, n, k0, k1, step, stream, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    w = word_block(pid * BLOCK, step, stream, k0, k1, BLOCK)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, w.to(tl.int64), mask=offs < n)


@triton.jit
def drawn(pid, n, k0, k1, step, stream, BLOCK: tl.constexpr):
    """Draws ``pid * BLOCK ..`` of ``positions`` (uint64, below ``n``): draw ``t`` is
    ``(w * n) >> 64`` for the 64-bit word ``w = word 2t << 32 | word 2t + 1``; a quad's words
    0, 1 make draw ``2q``, its words 2, 3 draw ``2q + 1``."""
    q = pid * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    r0, r1, r2, r3 = philox4(q, step, stream, k0, k1)
    m = n.to(tl.uint64)
    even = (r0.to(tl.uint64) * m + ((r1.to(tl.uint64) * m) >> 32)) >> 32
    odd = (r2.to(tl.uint64) * m + ((r3.to(tl.uint64) * m) >> 32)) >> 32
    return tl.reshape(tl.join(even, odd), (BLOCK,))


@triton.jit(do_not_specialize=["draws", "n", "k0", "k1", "step", "stream"])
def positions(out_ptr, draws, n, k0, k1, step, stream, BLOCK: tl.constexpr):
    """int32 ``out[t]``, ``t < draws``: the draws ``drawn`` (``philox.scaled``'s positions)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, drawn(pid, n, k0, k1, step, stream, BLOCK).to(tl.int32),
             mask=offs < draws)


@triton.jit(do_not_specialize=["draws", "n", "k0", "k1", "step", "stream"])
def sampled_magnitudes(x_ptr, out_ptr, draws, n, k0, k1, step, stream, BLOCK: tl.constexpr):
    """``out[t] = |x[p]|`` as float32 (NaN as -1) for ``positions``' draw ``p`` number ``t``,
    ``t < draws``: a sample drawn with replacement."""
    pid = tl.program_id(0).to(tl.int64)
    at = drawn(pid, n, k0, k1, step, stream, BLOCK).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < draws
    v = tl.abs(tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32))
    tl.store(out_ptr + offs, tl.where(v == v, v, -1.0), mask=mask)


@triton.jit
def is_first(ranked_ptr, i, mask):
    """Whether sorted position ``i`` holds the first of its value's run."""
    here = tl.load(ranked_ptr + i, mask=mask, other=0)
    before = tl.load(ranked_ptr + i - 1, mask=mask & (i > 0), other=0)
    return (i == 0) | (here != before)


@triton.jit
def first_draws(ranked_ptr, order_ptr, out_ptr, draws, BLOCK: tl.constexpr):
    """``out[order[i]] = 1`` where sorted position ``i`` is its value's first (the stable
    sort's first is the value's earliest draw), 0 elsewhere: the flags in draw order."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < draws
    first = is_first(ranked_ptr, i, mask)
    at = tl.load(order_ptr + i, mask=mask, other=0)
    tl.store(out_ptr + at, first.to(tl.int32), mask=mask)


@triton.jit
def kept(ranked_ptr, order_ptr, running_ptr, out_ptr, draws, j, BLOCK: tl.constexpr):
    """``out[i] = 1`` where sorted position ``i`` is its value's first draw and fewer than
    ``j`` values were first drawn before it (``running``: the flags' inclusive running sum in
    draw order)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < draws
    first = is_first(ranked_ptr, i, mask)
    at = tl.load(order_ptr + i, mask=mask, other=0)
    rank = tl.load(running_ptr + at, mask=mask, other=0) - 1
    tl.store(out_ptr + i, (first & (rank < j)).to(tl.int32), mask=mask)


@triton.jit
def place(ranked_ptr, keep_ptr, running_ptr, out_ptr, draws, BLOCK: tl.constexpr):
    """The kept values, in sorted order, at their slot (``running``: the kept flags'
    inclusive running sum), as int64."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < draws
    keep = tl.load(keep_ptr + i, mask=mask, other=0) != 0
    slot = tl.load(running_ptr + i, mask=mask, other=1) - 1
    value = tl.load(ranked_ptr + i, mask=mask, other=0)
    tl.store(out_ptr + slot, value.to(tl.int64), mask=mask & keep)
