"""Triton source of ``philox``: Philox-4x32-10 on a program's counters, and the kernel that
writes a draw's words (twin: ``philox.words_twin``)."""

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
