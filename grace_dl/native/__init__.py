"""Compiled kernels (``kernels.c``), loaded with ctypes. Where the library is missing, or
``GRACE_DL_NATIVE=0``, or an array is of a dtype or layout a kernel does not take, the kernel
returns None and its caller runs the code it replaces (``signbits``' and signsgd's framework
ops, qsgd's blockwise ops, the sparsifiers' selection by the framework's ops, NumPy's
``random_raw`` and ``SeedSequence``, and ``seeding.choice``'s NumPy path); the tests hold each
kernel equal to its twin on every SIMD path, ``native.use(False)`` switches them off at run
time. On a CPU with no SIMD path the scan, the sign code and the server step do the same
(``_vectorized``). Only the CPU path calls them (``grace_dl.native.paths``) and the seeding
they share with TF (``grace_dl.seeding``).

The library is built by ``pip install`` (``setup.py``, an optional extension: a machine without
a C compiler still installs, and runs the NumPy paths). It uses no Python API, so the ctypes
call releases the GIL and any framework can pass it a buffer.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
_MODE = {None: 0, 1: 1, -1: -1}


def _load():
    if os.environ.get("GRACE_DL_NATIVE", "1") == "0":
        return None
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _HERE / f"_kernels{suffix}"
        if path.exists():
            lib = ctypes.CDLL(str(path))
            lib.gd_positions_f32.restype = ctypes.c_int64
            lib.gd_positions_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                                             ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
            lib.gd_vector_bits.restype = ctypes.c_int
            lib.gd_vector_bits.argtypes = []
            lib.gd_sign_code_f32.restype = ctypes.c_int
            lib.gd_sign_code_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64,
                                             *[ctypes.c_void_p] * 4]
            lib.gd_ternary_f32.restype = None
            lib.gd_ternary_f32.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                           ctypes.c_void_p]
            lib.gd_qsgd_levels_f32.restype = None
            lib.gd_qsgd_levels_f32.argtypes = [
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.gd_qsgd_values_f32.restype = None
            lib.gd_qsgd_values_f32.argtypes = [
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float,
                ctypes.c_void_p, ctypes.c_int]
            lib.gd_sign_vote_feedback_f32.restype = ctypes.c_int
            lib.gd_sign_vote_feedback_f32.argtypes = [
                ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.gd_sfc64_raw.restype = None
            lib.gd_sfc64_raw.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
            lib.gd_sfc64_seed.restype = None
            lib.gd_sfc64_seed.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            lib.gd_choice_sorted.restype = ctypes.c_int64
            lib.gd_choice_sorted.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
            lib.gd_top_magnitudes_f32.restype = None
            lib.gd_top_magnitudes_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                                  ctypes.c_void_p]
            lib.gd_kth_largest_f32.restype = ctypes.c_float
            lib.gd_kth_largest_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                               ctypes.c_void_p]
            lib.gd_top_collect_f32.restype = None
            lib.gd_top_collect_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                               ctypes.c_float, ctypes.c_void_p]
            lib.gd_sparse_sum_f32.restype = ctypes.c_int
            lib.gd_sparse_sum_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                              ctypes.POINTER(ctypes.c_void_p),
                                              ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                              ctypes.c_int]
            lib.gd_limit_vector_bits.restype = None
            lib.gd_limit_vector_bits.argtypes = [ctypes.c_int]
            return lib
    return None


_lib = _load()
_enabled = _lib is not None
#: this CPU's SIMD width (before any ``limit_vector_bits``, which tests use to run the scalar
#: loops here too)
_CPU_BITS = _lib.gd_vector_bits() if _lib is not None else 0


def available() -> bool:
    """Whether the compiled library is loaded (False: every kernel runs its NumPy twin)."""
    return _lib is not None


def use(enabled: bool) -> None:
    """Run the compiled kernels (True, the default where the library loaded) or their twins
    (False) in this process from now on; the benchmarks switch between steps to compare both
    in one job. True without the library changes nothing."""
    global _enabled
    _enabled = bool(enabled) and _lib is not None


def in_use() -> bool:
    """Whether the kernels run now (the library loaded and ``use`` has not turned them off)."""
    return _enabled


def vector_bits() -> int:
    """The SIMD width the kernels use on this CPU (512, 256, 0 = scalar); 0 without the library."""
    return _lib.gd_vector_bits() if _lib is not None else 0


def limit_vector_bits(bits: int) -> None:
    """Keep the kernels to SIMD paths at most ``bits`` wide (512, 256, 0 = scalar), so that
    tests run every path on one CPU; 512 restores the default."""
    if _lib is not None:
        _lib.gd_limit_vector_bits(int(bits))


def _vectorized() -> bool:
    """Whether this CPU has a SIMD path (whatever ``limit_vector_bits`` says). The scan, the
    sign code and the server step need one to beat the framework ops they replace: their
    scalar loops are slower than NumPy's and torch's (the scalar column of
    ``docs/benchmarks.md``'s kernel table), so without one (a
    CPU that is not x86-64, or one without AVX2) those three leave the work to the framework
    ops, which have SIMD of their own. The other kernels' scalar loops beat their twins and
    stay."""
    return _CPU_BITS > 0


def positions_at_least(a: np.ndarray, thr: float, sign=None):
    """int64 positions of the 1-D array ``a``'s entries that reach ``thr``: ``|x| >= thr``
    (``sign`` None), ``x >= thr`` (1) or ``x <= -thr`` (-1); NaN never. One pass over ``a``
    (float32, C-contiguous, under 2**31 elements, a CPU with a SIMD path); None where the
    kernel does not apply (its twin: ``grace_dl.torch.ops._positions_numpy``)."""
    mode = _MODE[sign]
    if not _enabled or a.dtype != np.float32 or not a.flags.c_contiguous or a.size >= 2**31 \
            or not _vectorized():
        return None
    n = a.size
    t = float(thr)
    cap = max(1024, n >> 6)      # sparsifiers' candidates are a few percent at most
    out = np.empty(cap, np.int32)
    count = _lib.gd_positions_f32(a.ctypes.data, n, t, mode, out.ctypes.data, cap)
    if count > cap:
        out = np.empty(count, np.int32)
        count = _lib.gd_positions_f32(a.ctypes.data, n, t, mode, out.ctypes.data, count)
    return out[:count].astype(np.int64)


def _dense(a, dtype, size) -> bool:
    return a.dtype == dtype and a.flags.c_contiguous and a.size == size


def _all_dense(*specs) -> bool:
    """``_dense`` of each ``(array, dtype, size)`` (an array None passes), in one call."""
    for a, dtype, size in specs:
        if a is not None and not (a.dtype == dtype and a.flags.c_contiguous and a.size == size):
            return False
    return True


def _f32(a, n=None) -> bool:
    """A 1-D C-contiguous float32 array (of ``n`` elements when given)."""
    return a.ndim == 1 and _dense(a, np.float32, a.size if n is None else n)


def _bytes(planes, nbytes: int) -> bool:
    """uint8 C-contiguous arrays of at least ``nbytes`` each: bit planes a kernel reads."""
    return all(p.dtype == np.uint8 and p.flags.c_contiguous and p.size >= nbytes
               for p in planes)


def sign_planes(a: np.ndarray, err: np.ndarray | None = None, dec: np.ndarray | None = None):
    """signsgd's payload for the 1-D float32 ``a`` in one pass (``signbits``' layout): uint8,
    the negative plane (``x < 0``), the zero plane (``x == 0``), ``ceil(n/8)`` bytes each, then a
    status byte, 1 when ``a`` holds a NaN or an Inf. When given, ``dec <- sign(a)`` (+1, -1,
    +0 for zeros and NaN, as ``torch.sign``) and ``err <- a - dec``, float32 of ``a``'s length.
    None where the kernel does not apply."""
    if not _enabled or not _f32(a) or any(o is not None and not _f32(o, a.size)
                                          for o in (err, dec)) or not _vectorized():
        return None
    nb = -(-a.size // 8)
    out = np.empty(2 * nb + 1, np.uint8)
    ptr = out.ctypes.data
    out[2 * nb] = _lib.gd_sign_code_f32(a.ctypes.data, a.size, ptr, ptr + nb,
                                        None if err is None else err.ctypes.data,
                                        None if dec is None else dec.ctypes.data)
    return out


def ternary(pos: np.ndarray, neg: np.ndarray, n: int, out: np.ndarray):
    """``out[i] <- +1`` where bit i of the plane ``pos`` is set, -1 where ``neg``'s is, 0 where
    neither or both (``signbits.ternary``), for the float32 1-D ``out`` of ``n`` elements;
    returns ``out``, or None where the kernel does not apply."""
    nb = -(-n // 8)
    if not _enabled or not _f32(out, n) or not _bytes((pos, neg), nb):
        return None
    _lib.gd_ternary_f32(pos.ctypes.data, neg.ctypes.data, n, out.ctypes.data)
    return out


_DITHER_BITS = {np.dtype(np.uint8): 8, np.dtype(np.uint16): 16}


def qsgd_levels(x, scale, step, k, s: float, hi: int, err=None, dec=None):
    """qsgd's stochastic levels (``QSGDCompressor``) of the rows of the float32 ``x`` (rows x
    b): uint8 codes ``min(hi, trunc(x * scale[r] + u + s))`` with the dither ``u = (k + 1/2) /
    2**bits`` of the uint8 (8 bits) or uint16 (16 bits) ``k``; when given, ``dec <- (code - s) *
    step[r]`` and ``err <- x - dec`` (``err`` may be ``x``'s memory). The same float32 operations
    as the torch code, so the same bits. None where the kernel does not apply."""
    if not _enabled or x.ndim != 2 or k.dtype not in _DITHER_BITS:
        return None
    rows, f32 = x.shape[0], np.float32
    if not _all_dense((x, f32, x.size), (scale, f32, rows), (step, f32, rows),
                      (k, k.dtype, x.size), (err, f32, x.size), (dec, f32, x.size)):
        return None
    codes = np.empty(x.shape, np.uint8)
    _lib.gd_qsgd_levels_f32(x.ctypes.data, rows, x.shape[1], scale.ctypes.data,
                            step.ctypes.data, k.ctypes.data, _DITHER_BITS[k.dtype], s, hi,
                            codes.ctypes.data, None if err is None else err.ctypes.data,
                            None if dec is None else dec.ctypes.data)
    return codes


def qsgd_values(codes, step, s: float, out, accumulate: bool = False):
    """qsgd's decoded values of the uint8 ``codes`` (rows x b): ``out <- (code - s) *
    step[r]``, plus what ``out`` held when ``accumulate``; returns ``out`` (float32, of the codes'
    size), or None where the kernel does not apply."""
    if not _enabled or codes.ndim != 2 or not _all_dense(
            (codes, np.uint8, codes.size), (step, np.float32, codes.shape[0]),
            (out, np.float32, codes.size)):
        return None
    _lib.gd_qsgd_values_f32(codes.ctypes.data, codes.shape[0], codes.shape[1], step.ctypes.data, s,
                            out.ctypes.data, int(accumulate))
    return out


def sign_vote_feedback(payloads, n: int, slot, dec):
    """signsgd's two-phase server step in one pass: ``s = slot + vote``, the vote being the
    majority of the ranks' signsgd ``payloads`` (uint8, ``sign_planes``' layout, for ``n``
    elements), then ``slot <- s - sign(s)``, ``dec <- sign(s)`` and the payload of ``s`` as
    ``sign_planes`` builds it: the same float operations as the vote decoded, added and
    re-encoded one after the other. ``slot`` and ``dec``: float32, 1-D, ``n`` elements. None
    where the kernel does not apply."""
    nb = -(-n // 8)
    if (not _enabled or not payloads or not _f32(slot, n) or not _f32(dec, n)
            or not _bytes(payloads, 2 * nb) or not _vectorized()):
        return None
    ptrs = (ctypes.c_void_p * len(payloads))(*(p.ctypes.data for p in payloads))
    out = np.empty(2 * nb + 1, np.uint8)
    ptr = out.ctypes.data
    out[2 * nb] = _lib.gd_sign_vote_feedback_f32(ptrs, len(payloads), n, slot.ctypes.data, ptr,
                                                 ptr + nb, dec.ctypes.data)
    return out


def top_positions(a: np.ndarray, k: int, sign=None):
    """int64 positions, ascending, of the ``k`` largest magnitudes of the 1-D float32 ``a``
    (``|x|``, or with ``sign`` 1 / -1 the positive / negative part; NaN and the other sign
    rank lowest; of the ties at the k-th largest the lowest positions): the positions of
    ``grace_dl.compressors.sparse.top_of`` (its twin), by a compiled pass for the magnitudes,
    a compiled radix select for the k-th (``kth_largest``) and compiled passes for the
    positions, instead of the twin's dozen framework ops. None where the kernels do not
    apply."""
    n = a.size
    if not _enabled or a.ndim != 1 or a.dtype != np.float32 or not a.flags.c_contiguous \
            or not 0 < k <= n:
        return None
    mag = np.empty(n, np.float32)
    _lib.gd_top_magnitudes_f32(a.ctypes.data, n, _MODE[sign], mag.ctypes.data)
    kth = _kth_largest(mag, k)
    out = np.empty(k, np.int64)
    _lib.gd_top_collect_f32(mag.ctypes.data, n, k, kth, out.ctypes.data)
    return out


def kth_largest(a: np.ndarray, k: int):
    """The ``k``-th largest (``0 < k <= a.size``) of the 1-D float32 ``a``, which holds no NaN,
    as a Python float: NumPy's ``partition(a, n - k)[n - k]`` by a compiled radix select that
    reads ``a`` and does not move it. None where the kernel does not apply."""
    if not _enabled or not _f32(a) or not 0 < k <= a.size:
        return None
    return _kth_largest(a, k)


def _kth_largest(a: np.ndarray, k: int) -> float:
    """``kth_largest`` of an ``a`` known to qualify (``top_positions``' magnitudes)."""
    keep = np.empty(a.size, np.uint32)      # held here: the kernel writes into it
    return float(_lib.gd_kth_largest_f32(a.ctypes.data, a.size, k, keep.ctypes.data))


def sparse_sum(out: np.ndarray, positions: list, values: list):
    """``out`` (1-D float32) set to the sum of sparse vectors: ``values[r]`` (float32) at
    ``positions[r]`` (int32 or int64, one dtype for all; each strictly ascending, inside
    ``out``), zeroed and summed block by block in one pass: the bits of zeroing ``out`` and
    ``index_add_`` of the joined payloads (the twin, ``grace_dl.torch.ops.assign_scatter``).
    Returns ``out``, or None where the kernel does not apply (unsorted or out-of-range
    positions among them: the caller's scatter then handles, or reports, them)."""
    ranks = len(positions)
    if not _enabled or out.ndim != 1 or out.dtype != np.float32 or \
            not out.flags.c_contiguous or ranks == 0 or ranks != len(values) or ranks > 256:
        return None
    dtype = positions[0].dtype
    if dtype not in (np.int32, np.int64):
        return None
    idx, vals = (ctypes.c_void_p * ranks)(), (ctypes.c_void_p * ranks)()
    count = np.empty(ranks, np.int64)
    for r in range(ranks):      # (checked here, inline: ``_dense`` and ``_f32`` of each)
        p, v = positions[r], values[r]
        if p.ndim != 1 or p.dtype != dtype or not p.flags.c_contiguous or v.ndim != 1 \
                or v.dtype != np.float32 or not v.flags.c_contiguous or v.size != p.size:
            return None
        idx[r], vals[r], count[r] = p.ctypes.data, v.ctypes.data, p.size
    if _lib.gd_sparse_sum_f32(out.ctypes.data, out.size, ranks, idx, vals, count.ctypes.data,
                              int(dtype == np.int64)) != 0:
        return None
    return out


def sfc64_raw(state: np.ndarray, words: int):
    """``words`` uint64 outputs of NumPy's SFC64 from ``state`` (its ``bit_generator.state
    ["state"]["state"]``: a, b, c, counter), as its ``random_raw(words)`` would give them, in a
    compiled loop (NumPy's costs ~4 ns a word here); None where the kernel does not apply."""
    if not _enabled or not _dense(state, np.uint64, 4):
        return None
    out = np.empty(int(words), np.uint64)
    _lib.gd_sfc64_raw(state.ctypes.data, out.size, out.ctypes.data)
    return out


def sfc64_seed(entropy: list[int]):
    """The state (a, b, c, counter; uint64) of ``np.random.SFC64(np.random.SeedSequence(
    entropy))`` for a list of 32-bit words, computed in C without building NumPy's objects;
    None where the kernel does not apply (then build them: ``grace_dl.seeding.generator``)."""
    if not _enabled or not entropy or min(entropy) < 0 or max(entropy) > 0xFFFFFFFF:
        return None
    words = (ctypes.c_uint32 * len(entropy))(*entropy)
    state = np.empty(4, np.uint64)
    _lib.gd_sfc64_seed(words, len(entropy), state.ctypes.data)
    return state


def choice_sorted(state: np.ndarray, n: int, j: int, complement: bool):
    """The first ``j`` distinct positions ``(w * n) >> 64`` over the SFC64 words ``w`` that
    continue ``state`` (as ``sfc64_raw``), ascending (int64); with ``complement``, the ``n - j``
    positions not among them. One compiled loop over a bitmap of ``n`` bits; None where the
    kernel does not apply (its twin: ``grace_dl.seeding.choice``'s NumPy path)."""
    n, j = int(n), int(j)
    if not _enabled or not _dense(state, np.uint64, 4) or not 0 <= j <= n or n >= 2**63:
        return None
    bitmap = np.zeros((n + 63) >> 6, np.uint64)
    size = n - j if complement else j
    out = np.empty(size + 2, np.int64)      # the kernel's branch-free writes run 2 ahead
    wrote = _lib.gd_choice_sorted(state.ctypes.data, n, j, int(bool(complement)),
                                  bitmap.ctypes.data, out.ctypes.data)
    if wrote != size:
        raise RuntimeError(f"gd_choice_sorted wrote {wrote} positions, expected {size}")
    return out[:size]
