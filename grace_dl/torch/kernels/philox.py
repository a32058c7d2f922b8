"""Keyed random words made where the tensor lives: Philox-4x32-10 (Salmon, Moraes, Dror, Shaw
2011, "Parallel Random Numbers: As Easy as 1, 2, 3"), a counter-based generator.

Word ``i`` of the draw keyed by ``(seed, name, step, stream)`` is a pure function of the key and
``i``: Philox's 64-bit key is a hash of ``(seed, name)`` (``device_key``), its 128-bit counter
``(q mod 2**32, q div 2**32, step, stream)`` for ``q = i // 4``, and words ``4q .. 4q + 3`` are
that counter's four outputs. Nothing is drawn on the host or copied, and no draw depends on
how the work is split into programs, so a shared draw (stream 0) is the same on every rank,
whatever its GPU, and the Triton kernel (``words`` on CUDA) and its torch twin (``words``
elsewhere, in int64 arithmetic) give the same words. They differ from the CPU reference
path's draws (``grace_dl.seeding``, SFC64 through NumPy, which TensorFlow shares): a method's
randomness on a GPU has the same distribution as on a CPU, not the same bits.

Fused kernels call ``philox4`` on their own counters; ``words`` serves the draws that are used
as a tensor (random-k's positions, samples, PowerSGD's first Q).
"""

from __future__ import annotations

import hashlib
import math

import torch

from grace_dl.torch.kernels import BLOCK, grid, launch, triton_for

MASK = 0xFFFFFFFF
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57   # Philox-4x32 multipliers
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85       # Weyl key increments
ROUNDS = 10


def device_key(seed: int, name: str) -> tuple[int, int]:
    """Philox's key (two 32-bit words) for the draws of ``name`` under ``seed``."""
    digest = hashlib.blake2b(f"{int(seed)}\x00{name}".encode(), digest_size=8).digest()
    key = int.from_bytes(digest, "little")
    return key & MASK, key >> 32


def _rounds_twin(c0, c1, c2, c3, k0: int, k1: int):
    """Philox's rounds on int64 tensors holding uint32 values (products wrap in int64; the
    masks keep the low and high words)."""
    for _ in range(ROUNDS):
        p0, p1 = c0 * ROUND_A, c2 * ROUND_B
        c0, c1, c2, c3 = ((p1 >> 32) & MASK) ^ c1 ^ k0, p1 & MASK, \
            ((p0 >> 32) & MASK) ^ c3 ^ k1, p0 & MASK
        k0, k1 = (k0 + KEY_A) & MASK, (k1 + KEY_B) & MASK
    return c0, c1, c2, c3


def words_twin(key, step: int, stream: int, n: int, like):
    """``words`` in torch ops (any device)."""
    quads = -(-n // 4)
    q = torch.arange(quads, dtype=torch.int64, device=like.device)
    c2 = torch.full_like(q, int(step) & MASK)
    c3 = torch.full_like(q, int(stream) & MASK)
    out = _rounds_twin(q & MASK, q >> 32, c2, c3, *key)
    return torch.stack(out, dim=1).reshape(-1)[:n]


def words(key, step: int, stream: int, n: int, like):
    """``n`` random 32-bit words (int64 tensor, values in ``[0, 2**32)``) on ``like``'s device,
    keyed by ``key`` (``device_key``), ``step`` and ``stream``."""
    n = int(n)
    if n == 0 or not triton_for(like):
        return words_twin(key, step, stream, n, like)
    out = torch.empty(n, dtype=torch.int64, device=like.device)
    launch(_kernels().words, grid(n)[0], out, n, key[0], key[1], int(step) & MASK,
           int(stream) & MASK, BLOCK=BLOCK)
    return out


def uniform_twin_of(w):
    """Words as float32 uniforms in ``[0, 1)`` (the top 24 bits: every value exact)."""
    return (w >> 8).to(torch.float32) * 2.0**-24


def normal(key, step: int, shape, like):
    """Standard normal float32 draws of ``shape`` (Box–Muller on pairs of words)."""
    n = math.prod(shape)
    w = words(key, step, 0, 2 * n, like).reshape(n, 2)
    u1 = ((w[:, 0] >> 8).to(torch.float32) + 0.5) * 2.0**-24       # (0, 1): log is finite
    u2 = uniform_twin_of(w[:, 1])
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).reshape(shape)


def scaled(w_hi, w_lo, n: int):
    """``(w * n) >> 64`` for the 64-bit words ``w = w_hi << 32 | w_lo`` (int64 tensors of uint32
    values) and ``0 < n < 2**31``: a position in ``[0, n)``, off uniform by under
    ``n / 2**64`` (Lemire's multiply-shift)."""
    return (w_hi * n + ((w_lo * n) >> 32)) >> 32


def choice(key, step: int, n: int, k: int, like):
    """``k`` distinct positions in ``[0, n)``, ascending (int64): the first ``j = min(k, n - k)``
    distinct values of the stream ``scaled(word 2t, word 2t + 1, n)``, t = 0, 1, ..., and for
    ``k > n / 2`` every position but those. Keeping the first distinct values of an i.i.d.
    stream makes every ``j``-subset equally likely (the reference's ``seeding.choice`` does the
    same on SFC64's stream).

    With static shapes: a fixed number of candidates is drawn, enough that fewer than ``j``
    distinct among them has a probability under ``1e-30`` (the count needed has mean
    ``n ln(n / (n - j))`` and variance under ``2 j``; 12 standard deviations and 64 more are
    drawn); a stable sort finds each value's first draw, a cumulative count in draw order the
    ``j`` earliest. In that unreachable case positions repeat rather than the host being asked."""
    n, k = int(n), int(k)
    if not 0 <= k <= n:
        raise ValueError(f"choice needs 0 <= k <= n, got k={k}, n={n}")
    complement = 2 * k > n
    j = n - k if complement else k
    device = like.device
    if j == 0:
        kept = torch.empty(0, dtype=torch.int64, device=device)
    else:
        draws = math.ceil(n * math.log(n / (n - j)) + 12 * math.sqrt(2 * j) + 64)
        if triton_for(like):
            kept = _choice_kernels(key, step, n, j, draws, device)
        else:
            kept = _choice_twin(key, step, n, j, draws, like)
    if not complement:
        return kept
    left = torch.ones(n, dtype=torch.bool, device=device)
    left[kept] = False
    slot = torch.where(left, torch.cumsum(left, 0) - 1, k)
    out = torch.zeros(k + 1, dtype=torch.int64, device=device)
    return out.scatter_(0, slot, torch.arange(n, device=device))[:k]


def sampled_magnitudes(key, step: int, n: int, s: int, flat):
    """``|flat[p]|`` in float32 (NaN as -1, as ``codes.magnitudes`` ranks it) at the ``s``
    positions ``p`` first drawn by ``choice``'s stream for ``n`` (``key``, ``step``), with
    replacement: ``choice``'s distinct values are these up to the repeats (each draw repeats
    an earlier one with a probability under ``s / n``). One kernel; ``flat`` 1-D, contiguous."""
    s = int(s)
    if triton_for(flat):
        out = torch.empty(s, dtype=torch.float32, device=flat.device)
        launch(_kernels().sampled_magnitudes, grid(s)[0], flat, out, s, int(n), key[0], key[1],
               int(step) & MASK, 0, BLOCK=BLOCK)
        return out
    from grace_dl.torch.kernels import codes  # (codes imports this module)

    w = words(key, step, 0, 2 * s, flat).reshape(s, 2)
    return codes.magnitudes(flat.index_select(0, scaled(w[:, 0], w[:, 1], int(n))))


def _choice_kernels(key, step: int, n: int, j: int, draws: int, device):
    """``choice``'s first ``j`` distinct values of ``draws`` draws, by four kernels, a sort
    and two running sums (``_choice_twin``'s steps, fused)."""
    kernels = _kernels()
    values = torch.empty(draws, dtype=torch.int32, device=device)
    programs = grid(draws)[0]
    launch(kernels.positions, programs, values, draws, n, key[0], key[1], int(step) & MASK, 0,
           BLOCK=BLOCK)
    ranked, order = torch.sort(values, stable=True)
    first = torch.empty(draws, dtype=torch.int32, device=device)
    launch(kernels.first_draws, programs, ranked, order, first, draws, BLOCK=BLOCK)
    keep = torch.empty(draws, dtype=torch.int32, device=device)
    launch(kernels.kept, programs, ranked, order, torch.cumsum(first, 0, dtype=torch.int32),
           keep, draws, j, BLOCK=BLOCK)
    out = torch.zeros(j, dtype=torch.int64, device=device)
    launch(kernels.place, programs, ranked, keep, torch.cumsum(keep, 0, dtype=torch.int32), out,
           draws, BLOCK=BLOCK)
    return out


def _choice_twin(key, step: int, n: int, j: int, draws: int, like):
    """``choice``'s first ``j`` distinct values of ``draws`` draws, in torch ops."""
    device = like.device
    w = words(key, step, 0, 2 * draws, like).reshape(draws, 2)
    values = scaled(w[:, 0], w[:, 1], n).to(torch.int32)     # n < 2**31
    ranked, order = torch.sort(values, stable=True)
    first = torch.ones_like(ranked, dtype=torch.bool)
    first[1:] = ranked[1:] != ranked[:-1]
    # each value's first draw, ranked in draw order; the j earliest kept, in value order
    in_draw_order = torch.empty_like(first).scatter_(0, order, first)
    rank = (torch.cumsum(in_draw_order, 0) - 1).index_select(0, order)
    keep = first & (rank < j)
    slot = torch.where(keep, torch.cumsum(keep, 0) - 1, j)
    kept = torch.zeros(j + 1, dtype=torch.int64, device=device).scatter_(
        0, slot, ranked.to(torch.int64))[:j]
    return kept


def _kernels():
    """The Triton kernels (imported where they run)."""
    from grace_dl.torch.kernels import jit_random
    return jit_random
