"""Triton source of ``codes``: the quantizers' and sign methods' encoders and the one decoder,
each one pass over the tensor (twins: ``codes``).

Packed codes follow ``ops.pack_bits``: code ``i`` occupies bits ``[i b, i b + b)`` of a
little-endian bit stream, ``ceil(n b / 8)`` bytes, zero past the last code. Elementwise kernels
handle ``BLOCK`` elements per program (a multiple of 32, so a program's codes fill whole
bytes); dither words come from ``jit_random.word_block`` at the elements' own indices.
Launched with ``enable_fp_fusion=False``: no multiply-add is contracted, so each float
operation rounds as the twin's torch op does.
"""

import triton
import triton.language as tl

from grace_dl.torch.kernels.jit_random import word_block

#: the scalar arguments of a keyed draw: never compiled in as constants
KEYED = ["k0", "k1", "step", "stream"]
NAN_CODE = tl.constexpr(126)
INF_CODE = tl.constexpr(127)


# ------------------------------------------------------------------ packing
@triton.jit
def store_codes(out_ptr, codes, pid, n, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Store a program's ``BLOCK`` codes (int32, zero past ``n``) packed ``BITS`` each."""
    if BITS == 8:
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + idx, codes.to(tl.uint8), mask=idx < n)
    else:
        groups = tl.reshape(codes.to(tl.uint64), (BLOCK // 8, 8))
        lanes = tl.arange(0, 8)
        word = tl.sum(groups << (lanes * BITS).to(tl.uint64)[None, :], axis=1)
        tile = (word[:, None] >> (lanes * 8).to(tl.uint64)[None, :]) & 0xFF
        g = tl.arange(0, BLOCK // 8)[:, None]
        m = lanes[None, :]
        off = pid * (BLOCK // 8 * BITS) + g * BITS + m
        tl.store(out_ptr + off, tile.to(tl.uint8), mask=(m < BITS) & (off < (n * BITS + 7) // 8))


@triton.jit
def load_codes(packed_ptr, idx, n, BITS: tl.constexpr):
    """The int32 codes of elements ``idx`` (int64) of a ``BITS``-bit packed stream."""
    mask = idx < n
    if BITS == 8:
        code = tl.load(packed_ptr + idx, mask=mask, other=0).to(tl.int32)
    else:
        s = idx * BITS
        byte = s >> 3
        lo = tl.load(packed_ptr + byte, mask=mask, other=0).to(tl.int32)
        hi = tl.load(packed_ptr + byte + 1, mask=mask & (byte + 1 < (n * BITS + 7) // 8),
                     other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> (s & 7).to(tl.int32)) & ((1 << BITS) - 1)
    return code


@triton.jit
def decode(packed_ptr, table_ptr, scale_ptr, out_ptr, n, row, BITS: tl.constexpr,
           SCALED: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i] (+)= table[code_i] (* scale[i // row])``: every table decoder in one pass."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    v = tl.load(table_ptr + load_codes(packed_ptr, idx, n, BITS), mask=mask, other=0.0)
    if SCALED:
        v = v * tl.load(scale_ptr + idx // row, mask=mask, other=0.0)
    if ACCUMULATE:
        v = tl.load(out_ptr + idx, mask=mask, other=0.0).to(tl.float32) + v
    tl.store(out_ptr + idx, v, mask=mask)


# ------------------------------------------------------------------ dither
@triton.jit
def dither(pid, step, stream, k0, k1, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """The float32 dither ``k * 2**-BITS`` of a program's elements (``k`` the top ``BITS``
    bits of each element's word)."""
    w = word_block(pid * BLOCK, step, stream, k0, k1, BLOCK)
    return (w >> (32 - BITS)).to(tl.float32) * (1.0 / (1 << BITS))


# ------------------------------------------------------------------ qsgd
@triton.jit
def row_norms(x_ptr, norms_ptr, n, row, rows, ROWS: tl.constexpr, COLS: tl.constexpr,
              TILES: tl.constexpr):
    """The L2 norm of each ``row``-element row of ``x`` (the last may be short), from a
    running sum of squares; where that overflows, from the squares scaled by the row's
    running largest magnitude. ``TILES`` tiles of ``COLS`` columns cover a row."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    total = tl.zeros((ROWS,), tl.float32)
    peak = tl.zeros((ROWS,), tl.float32)
    scaled = tl.zeros((ROWS,), tl.float32)
    for t in range(TILES):
        c = t * COLS + tl.arange(0, COLS)
        idx = r[:, None] * row + c[None, :]
        mask = (r[:, None] < rows) & (c[None, :] < row) & (idx < n)
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        total += tl.sum(x * x, axis=1)
        m = tl.maximum(peak, tl.max(tl.abs(x), axis=1))
        safe = tl.where(m > 0, m, 1.0)
        ratio = peak / safe
        y = x / safe[:, None]
        scaled = scaled * (ratio * ratio) + tl.sum(y * y, axis=1)
        peak = m
    plain = tl.sqrt(total)
    norm = tl.where(plain < float("inf"), plain, tl.sqrt(scaled) * peak)
    tl.store(norms_ptr + r, norm, mask=r < rows)


@triton.jit(do_not_specialize=KEYED)
def qsgd_encode(x_ptr, norms_ptr, out_ptr, err_ptr, dec_ptr, n, row, s, hi, k0, k1, step,
                stream, DITHER: tl.constexpr, BITS: tl.constexpr, ERROR: tl.constexpr,
                DECODED: tl.constexpr, BLOCK: tl.constexpr):
    """qsgd's codes ``clamp(floor(s x / ||row|| + u) + s, 0, hi)``; with ``ERROR`` / ``DECODED``
    also ``x - v`` and ``v = (code - s) * ||row|| / s``."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    norm = tl.load(norms_ptr + idx // row, mask=mask, other=1.0)
    scale = tl.where(norm > 0, s / norm, 0.0)
    t = x * scale
    t = t + dither(pid, step, stream, k0, k1, DITHER, BLOCK)
    t = t + (s + 1.0 / (2 << DITHER))
    code = tl.minimum(t.to(tl.int32) & 0xFF, hi)
    code = tl.where(mask, code, 0)
    store_codes(out_ptr, code, pid, n, BLOCK, BITS)
    if ERROR or DECODED:
        v = (code.to(tl.float32) - s) * (norm / s)
        if DECODED:
            tl.store(dec_ptr + idx, v, mask=mask)
        if ERROR:
            tl.store(err_ptr + idx, x - v, mask=mask)


# ------------------------------------------------------------------ terngrad
@triton.jit(do_not_specialize=KEYED)
def terngrad_encode(x_ptr, scaler_ptr, out_ptr, n, k0, k1, step, stream,
                    BLOCK: tl.constexpr):
    """TernGrad's 2-bit codes ``clamp(floor(x / m + u) + 1, 0, 2)`` (16-bit dither)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(scaler_ptr)
    inv = tl.where(m > 0, 1.0 / m, 0.0)
    t = x * inv
    t = t + dither(pid, step, stream, k0, k1, 16, BLOCK)
    t = t + (1.0 + 1.0 / (2 << 16))
    code = tl.minimum(t.to(tl.int32) & 0xFF, 2)
    store_codes(out_ptr, tl.where(mask, code, 0), pid, n, BLOCK, 2)


# ------------------------------------------------------------------ natural
@triton.jit(do_not_specialize=KEYED)
def natural_encode(x_ptr, base_ptr, out_ptr, n, k0, k1, step, stream, BLOCK: tl.constexpr):
    """Natural compression's 8-bit codes ``sign << 7 | c`` (``natural`` explains ``c``), every
    case of the reference's branches in one elementwise formula."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    bc = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    base = tl.load(base_ptr)
    mag = bc & 0x7FFFFFFF
    e = mag >> 23
    lowered = mag - (base << 23)
    mant = (mag & 0x007FFFFF) | ((e > 0).to(tl.int32) << 23)
    k = tl.minimum(tl.maximum(base + 1 - tl.maximum(e, 1), 0), 31)
    shifted = tl.where(e > base, lowered, mant >> k)
    mag = tl.where(base > 0, shifted, mag)
    w = word_block(pid * BLOCK, step, stream, k0, k1, BLOCK)
    mag = mag + (((w >> 16).to(tl.int32) << 7) + (1 << 6))
    c = tl.minimum(mag >> 23, INF_CODE)
    c = tl.where((bc & 0x7FFFFFFF) > 0x7F800000, NAN_CODE, c)
    c = c | ((bc >> 24) & 0x80)
    tl.store(out_ptr + idx, c.to(tl.uint8), mask=mask)


# ------------------------------------------------------------------ u8bit
@triton.jit
def u8bit_encode(x_ptr, scaler_ptr, index_ptr, split_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """The dynamic tree's nearest code of ``|x| / m`` (two table lookups and a comparison)
    with the sign as bit 7."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(scaler_ptr)
    v = tl.abs(x) * tl.where(m > 0, 1.0 / m, 0.0)
    cell = (v.to(tl.int32, bitcast=True) >> 17) & 0x7FFF
    code = tl.load(index_ptr + cell, mask=mask, other=0).to(tl.int32)
    code += (v >= tl.load(split_ptr + cell, mask=mask, other=0.0)).to(tl.int32)
    code = code | ((x.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 7)
    tl.store(out_ptr + idx, code.to(tl.uint8), mask=mask)


# ------------------------------------------------------------------ sign planes
@triton.jit
def sign_planes(x_ptr, neg_ptr, zero_ptr, n, ZERO: tl.constexpr, BLOCK: tl.constexpr):
    """The packed plane of ``x < 0`` (and, with ``ZERO``, of ``x == 0``)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=1.0)
    store_codes(neg_ptr, (x < 0).to(tl.int32), pid, n, BLOCK, 1)
    if ZERO:
        store_codes(zero_ptr, (x == 0).to(tl.int32), pid, n, BLOCK, 1)


@triton.jit
def ternary(pos_ptr, neg_ptr, out_ptr, n, NAN_FLAG, BLOCK: tl.constexpr):
    """+1 / -1 / 0 from the packed positive and negative planes (NaN everywhere where the
    status at ``NAN_FLAG`` is set)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    p = load_codes(pos_ptr, idx, n, 1)
    q = load_codes(neg_ptr, idx, n, 1)
    v = (p - q).to(tl.float32)
    flag = tl.load(NAN_FLAG)
    v = tl.where(flag != 0, float("nan"), v)
    tl.store(out_ptr + idx, v, mask=mask)


# ------------------------------------------------------------------ sketch
@triton.jit
def sketch_encode(x_ptr, edges_ptr, n_edges, out_ptr, part_ptr, n, BITS: tl.constexpr,
                  Q: tl.constexpr, STEPS: tl.constexpr, SUB: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Each element's bucket (the number of edge keys <= its order key: a binary search of
    ``STEPS`` rounds), packed ``BITS`` each, and this program's per-bucket sums and counts
    (``part[pid] = [sums(Q), counts(Q)]``)."""
    pid = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, Q)
    sums = tl.zeros((Q,), tl.float32)
    counts = tl.zeros((Q,), tl.float32)
    for sub in range(0, BLOCK, SUB):
        idx = pid * BLOCK + sub + tl.arange(0, SUB)
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        key = ((bits >> 31) & 0x7FFFFFFF) ^ bits
        key += (key >> 31) & 1
        lo = tl.zeros((SUB,), tl.int32)
        hi = tl.zeros((SUB,), tl.int32) + n_edges
        for _ in tl.static_range(STEPS):
            active = lo < hi
            mid = (lo + hi) >> 1
            e = tl.load(edges_ptr + mid, mask=active, other=0)
            le = e <= key
            lo = tl.where(active & le, mid + 1, lo)
            hi = tl.where(active & (e > key), mid, hi)
        bucket = tl.where(mask, lo, 0)
        store_codes(out_ptr, bucket, (pid * BLOCK + sub) // SUB, n, SUB, BITS)
        hit = (bucket[:, None] == bins[None, :]) & mask[:, None]
        sums += tl.sum(tl.where(hit, x[:, None], 0.0), axis=0)
        counts += tl.sum(hit.to(tl.float32), axis=0)
    tl.store(part_ptr + pid * 2 * Q + bins, sums)
    tl.store(part_ptr + pid * 2 * Q + Q + bins, counts)


# ------------------------------------------------------------------ generic codes and magnitudes
@triton.jit
def pack(codes_ptr, out_ptr, n, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """uint8 codes (below ``2**BITS``) packed ``BITS`` each."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    code = tl.load(codes_ptr + idx, mask=idx < n, other=0).to(tl.int32)
    store_codes(out_ptr, code, pid, n, BLOCK, BITS)


@triton.jit
def unpack(packed_ptr, out_ptr, n, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """The first ``n`` codes of a ``BITS``-bit packed stream, as uint8."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + idx, load_codes(packed_ptr, idx, n, BITS).to(tl.uint8), mask=idx < n)


@triton.jit
def magnitudes(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``|x|`` as float32, with NaN ranked below every number (-1)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = tl.abs(x)
    tl.store(out_ptr + idx, tl.where(m == m, m, -1.0), mask=mask)
