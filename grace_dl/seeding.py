"""Deterministic randomness for compressors.

Every random draw is keyed by ``(seed, tensor name, step)``: the same key gives the same numbers
on every rank, in torch and in TensorFlow, whatever order tensors are compressed in. Draws that
must *differ* across ranks (the dither of unbiased quantizers, whose noise should average out
over workers) add a ``stream``, the rank. Nothing here touches a global RNG. Draws are made with
NumPy (SFC64) and handed to the framework backend, so torch and TF see bit-identical random
streams.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from grace_dl import native


@functools.lru_cache(maxsize=1 << 14)     # the same names come back every step
def stable_hash(name: str) -> int:
    """A 64-bit hash of ``name`` that is the same in every process (unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def generator(seed: int, name: str, step: int, stream: int = 0) -> np.random.Generator:
    """A fresh generator for one (seed, name, step[, stream]) draw. Stream 0 is the shared one;
    any other stream is independent of it and of every other stream.

    SFC64 (a small chaotic counter generator that passes BigCrush) seeded through NumPy's
    SeedSequence from the parts of the key: on the host it draws float32 uniforms faster than
    NumPy's Philox, and the draw is on every stochastic quantizer's hot path. (Tensors on a
    GPU draw there instead: ``grace_dl.torch.kernels.philox``.)
    """
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence(
        _entropy(seed, name, step, stream))))


def _entropy(seed: int, name: str, step: int, stream: int = 0) -> list[int]:
    """The 32-bit words a key seeds SeedSequence with."""
    h = stable_hash(name)
    entropy = [h & 0xFFFFFFFF, h >> 32, int(seed) & 0xFFFFFFFF, int(step) & 0xFFFFFFFF]
    if stream:
        entropy.append(int(stream) & 0xFFFFFFFF)
    return entropy


def _raw_state(seed: int, name: str, step: int, stream: int = 0):
    """``generator(...)``'s SFC64 state (a, b, c, counter) computed by the kernels without
    NumPy's objects, for the kernels that continue it; None where they do not run."""
    return native.sfc64_seed(_entropy(seed, name, step, stream))


def uniform(seed: int, name: str, step: int, n: int, stream: int = 0) -> np.ndarray:
    """``n`` float32 draws from U[0, 1)."""
    return generator(seed, name, step, stream).random(int(n), dtype=np.float32)


DITHER_BITS = (8, 16)


def dither(seed: int, name: str, step: int, n: int, bits: int = 16,
           stream: int = 0) -> np.ndarray:
    """``n`` uniform integers ``k`` in ``[0, 2**bits)`` (uint8 for 8 bits, uint16 for 16): the
    dither of a stochastic rounding, ``u = (k + 1/2) / 2**bits``, drawn as ``64 // bits`` values
    per 64-bit SFC64 output (the raw words viewed as bytes in host order, so torch and TF, which
    both take this array, agree): a quarter of the bytes of float32 uniforms. The first ``n``
    values of a longer draw are the same as those of a shorter one.

    **Bias bound.** ``u`` lies on the grid ``(k + 1/2) / 2**bits``, not in all of [0, 1). For
    any real ``t`` with fractional part ``f``, ``P(floor(t + u) = floor(t) + 1)`` is the share
    of grid points ``>= 1 - f``, which is ``f`` rounded to a multiple of ``2**-bits``, so

        ``|E[floor(t + u)] - t| <= 2**-(bits + 1)``

    (one part in 512 of a quantization step for 8 bits, in 131072 for 16 bits); a ``t`` within
    ``2**-(bits+1)`` of an integer rounds to that integer with probability 1. Float32 rounding
    of ``t + u`` itself adds at most one ulp of ``t`` on top.
    ``tests/test_quantizers.py::test_dither_grid_and_bias_bound`` checks both statements.
    """
    if bits not in DITHER_BITS:
        raise ValueError(f"bits must be one of {list(DITHER_BITS)}, got {bits}")
    n = int(n)
    words = -(-n * bits // 64)
    state = _raw_state(seed, name, step, stream)
    raw = None if state is None else native.sfc64_raw(state, words)
    if raw is None:
        raw = generator(seed, name, step, stream).bit_generator.random_raw(words)
    return raw.view(np.uint8 if bits == 8 else np.uint16)[:n]


def normal(seed: int, name: str, step: int, shape) -> np.ndarray:
    """Standard normal float32 draws of ``shape``."""
    return generator(seed, name, step).standard_normal(tuple(shape), dtype=np.float32)


def choice(seed: int, name: str, step: int, n: int, k: int) -> np.ndarray:
    """``k`` distinct indices in ``[0, n)``, without replacement, ascending (int64).

    The draw: the positions ``(w * n) >> 64`` of successive 64-bit SFC64 words ``w`` (Lemire's
    multiply-shift), keeping the first ``j = min(k, n - k)`` distinct ones; for ``k > n / 2``
    those ``j`` are the positions left out. Keeping the first distinct values of an i.i.d.
    stream makes every ``j``-subset equally likely, up to the multiply-shift's rounding: a
    position's chance per word differs from ``1/n`` by less than ``2**-64``. At most ``n / 2``
    distinct values are collected, so the stream is under ``1.4 j`` words long on average.

    Compiled (``native.choice_sorted``: one loop over a bitmap of ``n`` bits, then its set bits
    in order) or, without the kernels, the same positions from NumPy (sorting the drawn
    values). Ascending positions also make the
    gathers and scatters of a sparsifier walk memory forward.
    """
    n, k = int(n), int(k)
    if not 0 <= k <= n:
        raise ValueError(f"choice needs 0 <= k <= n, got k={k}, n={n}")
    complement = 2 * k > n
    j = n - k if complement else k
    state = _raw_state(seed, name, step)
    out = None if state is None else native.choice_sorted(state, n, j, complement)
    if out is not None:
        return out
    kept = _first_distinct(generator(seed, name, step).bit_generator, n, j)
    if not complement:
        return kept
    mask = np.ones(n, bool)
    mask[kept] = False
    return np.flatnonzero(mask)


def _first_distinct(bits_gen, n: int, j: int) -> np.ndarray:
    """The first ``j`` distinct values of ``(w * n) >> 64`` over ``bits_gen``'s next words,
    ascending: ``native.choice_sorted``'s twin."""
    if j == 0:
        return np.empty(0, np.int64)
    batch = j + 2 * j * j // n + 64     # covers the expected duplicates for j <= n / 2
    raw = bits_gen.random_raw(batch)
    while True:
        values, first = np.unique(_scaled(raw, n), return_index=True)
        if values.size >= j:
            break
        raw = np.concatenate([raw, bits_gen.random_raw(batch)])
    if values.size > j:     # the j whose first appearance comes earliest
        values = values[first <= np.partition(first, j - 1)[j - 1]]
    return values.astype(np.int64)


def _scaled(w: np.ndarray, n: int) -> np.ndarray:
    """``(w * n) >> 64`` for uint64 ``w`` and ``0 < n < 2**64``, exact, in 32-bit halves."""
    low = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    wl, wh = w & low, w >> s32
    nl, nh = np.uint64(n & 0xFFFFFFFF), np.uint64(n >> 32)
    p0, p1, p2 = wl * nl, wl * nh, wh * nl
    mid = (p0 >> s32) + (p1 & low) + (p2 & low)
    return wh * nh + (p1 >> s32) + (p2 >> s32) + (mid >> s32)
