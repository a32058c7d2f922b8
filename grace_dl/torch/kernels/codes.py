"""The quantizers' and sign methods' encoders and the one table decoder of the device path:
a Triton kernel each where ``triton_for`` allows (``jit_codes``), else its twin here, in torch
ops with the same float operations. Neither synchronises with the host: scalars such as a
tensor's norm or scale stay on the device and are read by the kernels.

Packed codes follow ``ops.pack_bits`` (``bits`` per code, little-endian stream), so payloads
are the reference compressors' own and either path decodes the other's.
"""

from __future__ import annotations

import numpy as np
import torch

from grace_dl.torch.kernels import BLOCK, grid, philox, triton_for

#: rows of at most this many elements are reduced by one program's columns at a time
NORM_TILE = 4096


def _jit():
    from grace_dl.torch.kernels import jit_codes
    return jit_codes


def packed_size(n: int, bits: int) -> int:
    return -(-n * bits // 8)


# ------------------------------------------------------------------ twins' bit packing
def pack_twin(codes, bits: int):
    """``ops.pack_bits`` in torch ops only (uint8 codes below ``2**bits``)."""
    n = codes.numel()
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8 or n == 0:
        return codes.clone() if bits == 8 else codes.new_zeros(0)
    codes = torch.cat([codes, codes.new_zeros((-n) % 8)]).view(8 * ((n + 7) // 8) // 8, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (codes.to(torch.int64) << shifts).sum(dim=1)
    lanes = torch.arange(8, device=codes.device, dtype=torch.int64) * 8
    stream = ((words[:, None] >> lanes) & 0xFF).to(torch.uint8)[:, :bits]
    return stream.reshape(-1)[:packed_size(n, bits)]


def unpack_twin(packed, bits: int, n: int):
    """The first ``n`` codes (int64) of a ``bits``-bit packed stream, in torch ops only."""
    idx = torch.arange(n, device=packed.device, dtype=torch.int64)
    if bits == 8:
        return packed[:n].to(torch.int64)
    s = idx * bits
    byte = s >> 3
    wide = torch.cat([packed.reshape(-1), packed.new_zeros(1)]).to(torch.int64)
    word = wide[byte] | (wide[byte + 1] << 8)
    return (word >> (s & 7)) & ((1 << bits) - 1)


# ------------------------------------------------------------------ the decoder
def decode(packed, bits: int, n: int, table, out, scale=None, row: int = 1,
           accumulate: bool = False):
    """``out[i] = table[code_i]`` (times ``scale[i // row]`` when given; added to ``out`` with
    ``accumulate``) for the first ``n`` codes of ``packed``; ``out`` a contiguous tensor of
    ``n`` elements, ``table`` and ``scale`` float32. Returns ``out``."""
    flat = out.view(-1)
    if n == 0:
        return out
    if triton_for(packed):
        _jit().decode[grid(n)](packed, table, table if scale is None else scale, flat, n,
                               max(int(row), 1), BITS=bits, SCALED=scale is not None,
                               ACCUMULATE=accumulate, BLOCK=BLOCK)
        return out
    v = table.reshape(-1)[unpack_twin(packed, bits, n)]
    if scale is not None:
        v = v * torch.repeat_interleave(scale.reshape(-1), row)[:n]
    if accumulate:
        v = flat.to(torch.float32) + v
    flat.copy_(v)
    return out


# ------------------------------------------------------------------ qsgd
def row_norms(x, row: int):
    """The L2 norm of each ``row``-element row of the 1-D float32 ``x`` (the last may be
    short); a row whose sum of squares overflows float32 gets its norm from the row scaled by
    its largest magnitude."""
    n = x.numel()
    rows = -(-n // row)
    norms = torch.empty(rows, dtype=torch.float32, device=x.device)
    if n == 0:
        return norms
    if triton_for(x):
        cols = min(triton_next_power_of_2(row), NORM_TILE)
        per = max(1, NORM_TILE // cols)
        _jit().row_norms[(-(-rows // per),)](x, norms, n, row, rows, ROWS=per, COLS=cols,
                                             TILES=-(-row // cols))
        return norms
    padded = torch.cat([x, x.new_zeros(rows * row - n)]).view(rows, row)
    plain = torch.linalg.vector_norm(padded, dim=1)
    peak = padded.abs().amax(dim=1)
    safe = torch.where(peak > 0, peak, torch.ones_like(peak))
    rescaled = torch.linalg.vector_norm(padded / safe[:, None], dim=1) * peak
    return norms.copy_(torch.where(plain < float("inf"), plain, rescaled))


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _dither_twin(key, step, stream, n, bits, like):
    w = philox.words(key, step, stream, n, like)
    return (w >> (32 - bits)).to(torch.float32) * 2.0**-bits


def qsgd_encode(x, norms, row: int, s: float, hi: int, bits: int, dither_bits: int, key,
                step: int, stream: int, error=None, decoded=None):
    """qsgd's packed codes of the 1-D float32 ``x`` (``norms``: one per ``row`` elements); the
    error ``x - v`` into ``error`` and the decoded ``v`` into ``decoded`` when given (1-D
    float32 tensors of ``x``'s length; ``error`` may be ``x`` itself)."""
    n = x.numel()
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=x.device)
    if n == 0:
        return out
    if triton_for(x):
        _jit().qsgd_encode[grid(n)](
            x, norms, out, x if error is None else error, x if decoded is None else decoded, n,
            row, float(s), int(hi), *key, int(step) & philox.MASK, int(stream) & philox.MASK,
            DITHER=dither_bits, BITS=bits, ERROR=error is not None,
            DECODED=decoded is not None, BLOCK=BLOCK, enable_fp_fusion=False)
        return out
    norm = torch.repeat_interleave(norms, row)[:n]
    scale = torch.where(norm > 0, s / norm, torch.zeros_like(norm))
    t = x * scale
    t = t + _dither_twin(key, step, stream, n, dither_bits, x)
    t = t + (s + 2.0 ** -(dither_bits + 1))
    code = torch.clamp(t.to(torch.int32) & 0xFF, max=hi)
    if error is not None or decoded is not None:
        v = (code.to(torch.float32) - s) * (norm / s)
        if decoded is not None:
            decoded.copy_(v)
        if error is not None:
            error.copy_(x - v)
    return out.copy_(pack_twin(code, bits))


# ------------------------------------------------------------------ terngrad
def terngrad_encode(x, scaler, key, step: int, stream: int):
    """TernGrad's 2-bit codes of the 1-D float32 ``x`` with the 1-element ``scaler``."""
    n = x.numel()
    out = torch.empty(packed_size(n, 2), dtype=torch.uint8, device=x.device)
    if n == 0:
        return out
    if triton_for(x):
        _jit().terngrad_encode[grid(n)](x, scaler, out, n, *key, int(step) & philox.MASK,
                                        int(stream) & philox.MASK, BLOCK=BLOCK,
                                        enable_fp_fusion=False)
        return out
    inv = torch.where(scaler > 0, 1.0 / scaler, torch.zeros_like(scaler))
    t = x * inv
    t = t + _dither_twin(key, step, stream, n, 16, x)
    t = t + (1.0 + 2.0**-17)
    return out.copy_(pack_twin(torch.clamp(t.to(torch.int32) & 0xFF, max=2), 2))


# ------------------------------------------------------------------ natural
def natural_encode(x, base, key, step: int, stream: int):
    """Natural compression's uint8 codes of the 1-D float32 ``x`` (``base``: a 0-d int32)."""
    n = x.numel()
    out = torch.empty(n, dtype=torch.uint8, device=x.device)
    if n == 0:
        return out
    if triton_for(x):
        _jit().natural_encode[grid(n)](x, base, out, n, *key, int(step) & philox.MASK,
                                       int(stream) & philox.MASK, BLOCK=BLOCK)
        return out
    bc = x.view(torch.int32)
    mag = bc & 0x7FFFFFFF
    e = mag >> 23
    lowered = mag - (base << 23)
    mant = (mag & 0x007FFFFF) | ((e > 0).to(torch.int32) << 23)
    k = torch.clamp(base + 1 - torch.clamp(e, min=1), 0, 31)
    shifted = torch.where(e > base, lowered, mant >> k)
    mag = torch.where(base > 0, shifted, mag)
    w = philox.words(key, step, stream, n, x)
    mag = mag + (((w >> 16) << 7) + (1 << 6)).to(torch.int32)
    c = torch.clamp(mag >> 23, max=127)
    c = torch.where((bc & 0x7FFFFFFF) > 0x7F800000, torch.full_like(c, 126), c)
    c = c | ((bc >> 24) & 0x80)
    return out.copy_(c.to(torch.uint8))


# ------------------------------------------------------------------ u8bit
def u8bit_encode(x, scaler, cell_index, cell_split):
    """u8bit's uint8 codes of the 1-D float32 ``x`` (``cell_index`` uint8 and ``cell_split``
    float32: ``u8bit``'s cell tables on ``x``'s device)."""
    n = x.numel()
    out = torch.empty(n, dtype=torch.uint8, device=x.device)
    if n == 0:
        return out
    if triton_for(x):
        _jit().u8bit_encode[grid(n)](x, scaler, cell_index, cell_split, out, n, BLOCK=BLOCK)
        return out
    v = x.abs() * torch.where(scaler > 0, 1.0 / scaler, torch.zeros_like(scaler))
    cell = ((v.view(torch.int32) >> 17) & 0x7FFF).to(torch.int64)
    code = cell_index[cell].to(torch.int32) + (v >= cell_split[cell]).to(torch.int32)
    code = code | ((x.view(torch.int32) < 0).to(torch.int32) << 7)
    return out.copy_(code.to(torch.uint8))


# ------------------------------------------------------------------ signs
def sign_planes(x, zero: bool):
    """The packed planes ``x < 0`` and (``zero``) ``x == 0`` of the 1-D ``x``: ``(neg, zero
    plane or None)``, ``ceil(n / 8)`` uint8 each."""
    n = x.numel()
    nbytes = packed_size(n, 1)
    neg = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    zer = torch.empty(nbytes, dtype=torch.uint8, device=x.device) if zero else None
    if n == 0:
        return neg, zer
    if triton_for(x):
        _jit().sign_planes[grid(n)](x, neg, neg if zer is None else zer, n, ZERO=zero,
                                    BLOCK=BLOCK)
        return neg, zer
    neg.copy_(pack_twin((x < 0).to(torch.uint8), 1))
    if zero:
        zer.copy_(pack_twin((x == 0).to(torch.uint8), 1))
    return neg, zer


def ternary(pos, neg, n: int, flag, out):
    """``out`` (1-D float32 of ``n``) = +1 where ``pos``'s bit is set, -1 where ``neg``'s is,
    0 elsewhere; NaN everywhere when the 1-element ``flag`` is nonzero."""
    if n == 0:
        return out
    if triton_for(pos):
        _jit().ternary[grid(n)](pos, neg, out, n, flag, BLOCK=BLOCK)
        return out
    v = (unpack_twin(pos, 1, n) - unpack_twin(neg, 1, n)).to(torch.float32)
    return out.copy_(torch.where(flag.reshape(()) != 0, torch.full_like(v, float("nan")), v))


_CONSTANTS: dict = {}


def constant(key, device, make):
    """A constant tensor, made once per device from the NumPy array ``make()`` (so that no
    step copies it there); ``key`` names it."""
    got = _CONSTANTS.get((key, device))
    if got is None:
        got = _CONSTANTS[(key, device)] = torch.from_numpy(np.ascontiguousarray(make())).to(
            device)
    return got


# ------------------------------------------------------------------ sketch
#: elements of a sketch program, and of each of its one-hot tiles
SKETCH_BLOCK, SKETCH_SUB = 2048, 64


def order_key(x):
    """int32 keys of float32 ``x`` ordered as the floats (``compressors.buckets.order_key``)."""
    bits = x.view(torch.int32)
    key = ((bits >> 31) & 0x7FFFFFFF) ^ bits
    return key + ((key >> 31) & 1)


def sketch_encode(x, edges, q: int, bits: int):
    """``(packed buckets, sums, counts)`` of the 1-D float32 ``x`` against the sorted float32
    ``edges``: bucket = the number of edges <= the element (by order keys, -0 equal to +0),
    and the sum and count of each of the ``q`` buckets."""
    n = x.numel()
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=x.device)
    edge_keys = order_key(edges.contiguous())
    if triton_for(x) and n:
        width = triton_next_power_of_2(q)
        programs = -(-n // SKETCH_BLOCK)
        part = torch.empty(programs, 2, width, dtype=torch.float32, device=x.device)
        _jit().sketch_encode[(programs,)](
            x, edge_keys, edge_keys.numel(), out, part, n, BITS=bits, Q=width,
            STEPS=max(1, (edge_keys.numel() + 1).bit_length()), SUB=SKETCH_SUB,
            BLOCK=SKETCH_BLOCK)
        total = part.sum(dim=0)
        return out, total[0, :q], total[1, :q]
    bucket = torch.bucketize(order_key(x), edge_keys, right=True)
    sums = torch.zeros(q, dtype=torch.float32, device=x.device).index_add_(0, bucket, x)
    counts = torch.zeros(q, dtype=torch.float32, device=x.device).index_add_(
        0, bucket, torch.ones_like(x))
    return out.copy_(pack_twin(bucket, bits)), sums, counts


# ------------------------------------------------------------------ generic codes and magnitudes
def pack(codes, bits: int):
    """uint8 ``codes`` (1-D, below ``2**bits``) packed ``bits`` each (``ops.pack_bits``)."""
    n = codes.numel()
    if bits == 8:
        return codes.clone()
    if not triton_for(codes) or n == 0:
        return pack_twin(codes, bits)
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=codes.device)
    _jit().pack[grid(n)](codes, out, n, BITS=bits, BLOCK=BLOCK)
    return out


def unpack(packed, bits: int, n: int):
    """The first ``n`` codes of a ``bits``-bit packed stream, as uint8."""
    if not triton_for(packed) or n == 0:
        return unpack_twin(packed, bits, n).to(torch.uint8)
    out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    _jit().unpack[grid(n)](packed, out, n, BITS=bits, BLOCK=BLOCK)
    return out


def magnitudes(flat):
    """``|flat|`` in float32 with NaN as -1: what the sparsifiers rank (``sparse.magnitudes``)."""
    n = flat.numel()
    if not triton_for(flat) or n == 0:
        mag = flat.abs().to(torch.float32)
        return torch.where(mag == mag, mag, torch.full_like(mag, -1.0))
    out = torch.empty(n, dtype=torch.float32, device=flat.device)
    _jit().magnitudes[grid(n)](flat.contiguous(), out, n, BLOCK=BLOCK)
    return out
