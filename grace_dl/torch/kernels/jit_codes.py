"""Triton source of ``codes``: the quantizers' and sign methods' encoders and the one decoder,
each one pass over the tensor (twins: ``codes``).

Packed codes follow ``ops.pack_bits``: code ``i`` occupies bits ``[i b, i b + b)`` of a
little-endian bit stream, ``ceil(n b / 8)`` bytes, zero past the last code. Elementwise kernels
handle ``BLOCK`` elements per program (a multiple of 32, so a program's codes fill whole
bytes); dither words come from ``jit_random.word_block`` at the elements' own indices. A
tensor-wide scalar (a largest magnitude, a sum) is reduced into a small buffer by one kernel
and read by the next, never by the host. Launched with ``enable_fp_fusion=False``: no
multiply-add is contracted, so each float operation rounds as the twin's torch op does.
"""

import triton
import triton.language as tl

from grace_dl.torch.kernels.jit_random import word_block

#: the scalar arguments of a keyed draw: never compiled in as constants
KEYED = ["k0", "k1", "step", "stream"]
NAN_CODE = tl.constexpr(126)
INF_CODE = tl.constexpr(127)
INF_BITS = tl.constexpr(0x7F800000)


# ------------------------------------------------------------------ packing
@triton.jit
def packed_bytes(n, BITS: tl.constexpr):
    """``ceil(n * BITS / 8)``, the bytes of ``n`` packed codes, without the int32 product
    (which wraps from ``n * BITS >= 2**31``): ``n = 8q + r`` packs into ``q * BITS`` bytes and
    ``ceil(r * BITS / 8)`` more."""
    return (n // 8) * BITS + ((n % 8) * BITS + 7) // 8


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
        tl.store(out_ptr + off, tile.to(tl.uint8), mask=(m < BITS) & (off < packed_bytes(n, BITS)))


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
        hi = tl.load(packed_ptr + byte + 1, mask=mask & (byte + 1 < packed_bytes(n, BITS)),
                     other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> (s & 7).to(tl.int32)) & ((1 << BITS) - 1)
    return code


@triton.jit
def decode(packed_ptr, table_ptr, scale_ptr, out_ptr, n, row, divisor, BITS: tl.constexpr,
           SIGN: tl.constexpr, SCALED: tl.constexpr, ACCUMULATE: tl.constexpr,
           BLOCK: tl.constexpr):
    """``out[i] (+)= v_i``: ``v = table[code]`` (``SIGN``: ``table[0]``, negated where the
    code is 1), times ``scale[i // row] / divisor`` when ``SCALED``: every table decoder in
    one pass."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    code = load_codes(packed_ptr, idx, n, BITS)
    if SIGN:
        t = tl.load(table_ptr)
        v = tl.where(code != 0, t * -1.0, t)
    else:
        v = tl.load(table_ptr + code, mask=mask, other=0.0)
    if SCALED:
        v = v * (tl.load(scale_ptr + idx // row, mask=mask, other=0.0) / divisor)
    if ACCUMULATE:
        v = tl.load(out_ptr + idx, mask=mask, other=0.0).to(tl.float32) + v
    tl.store(out_ptr + idx, v, mask=mask)


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


# ------------------------------------------------------------------ scalars of a tensor
@triton.jit
def abs_max(x_ptr, acc_ptr, n, BLOCK: tl.constexpr):
    """``acc[0] = max(acc[0], the float32 bits of |x|)``: the largest magnitude's bits, which
    order as the magnitudes do (an infinity above every number, a NaN above that)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.atomic_max(acc_ptr, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0))


@triton.jit
def nonfinite(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out[0]`` (-0.0 before) set to NaN by every program that finds a NaN or an infinity."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    if tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0) >= INF_BITS:
        tl.store(out_ptr, float("nan"))


@triton.jit
def largest(acc_ptr):
    """The largest magnitude from ``abs_max``'s bits: NaN where the tensor holds a NaN or an
    infinity (``ops.abs_max``'s rule)."""
    bits = tl.load(acc_ptr)
    return tl.where(bits >= INF_BITS, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def magnitudes(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``|x|`` as float32, with NaN ranked below every number (-1)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    m = tl.abs(tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32))
    tl.store(out_ptr + idx, tl.where(m == m, m, -1.0), mask=mask)


@triton.jit
def above(x_ptr, thr_ptr, out_ptr, n, thr, FROM_PTR: tl.constexpr, STRICT: tl.constexpr,
          BLOCK: tl.constexpr):
    """``out = |x| > thr`` (``STRICT``) or ``|x| >= thr`` as uint8, in float32, false for NaN;
    ``thr`` read from ``thr_ptr`` with ``FROM_PTR``: a sparsifier's selection in one pass."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    m = tl.abs(tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32))
    if FROM_PTR:
        t = tl.load(thr_ptr).to(tl.float32)
    else:
        t = thr
    hit = m > t if STRICT else m >= t
    tl.store(out_ptr + idx, hit.to(tl.uint8), mask=mask)


# ------------------------------------------------------------------ dither
@triton.jit
def dither(pid, step, stream, k0, k1, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """The float32 dither ``k * 2**-BITS`` of a program's elements (``k`` the top ``BITS``
    bits of each element's word)."""
    w = word_block(pid * BLOCK, step, stream, k0, k1, BLOCK)
    return (w >> (32 - BITS)).to(tl.float32) * (1.0 / (1 << BITS))


# ------------------------------------------------------------------ qsgd
@triton.jit
def norm_of(x, AXIS: tl.constexpr):
    """The L2 norm along ``AXIS``; where the sum of squares overflows, from ``x`` scaled by
    its largest magnitude."""
    plain = tl.sqrt(tl.sum(x * x, axis=AXIS))
    peak = tl.max(tl.abs(x), axis=AXIS)
    safe = tl.where(peak > 0, peak, 1.0)
    y = x / tl.expand_dims(safe, AXIS)
    return tl.where(plain < float("inf"), plain, tl.sqrt(tl.sum(y * y, axis=AXIS)) * peak)


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


@triton.jit
def qsgd_codes(x, norm, idx, mask, out_ptr, err_ptr, dec_ptr, pid, n, s, hi, k0, k1, step,
               stream, DITHER: tl.constexpr, BITS: tl.constexpr, ERROR: tl.constexpr,
               DECODED: tl.constexpr, BLOCK: tl.constexpr):
    """qsgd's codes of one program's ``BLOCK`` elements (``norm``: each one's bucket norm),
    stored packed, with the error ``x - v`` and the decoded ``v`` when asked."""
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


@triton.jit(do_not_specialize=KEYED)
def qsgd_encode(x_ptr, norms_ptr, out_ptr, err_ptr, dec_ptr, n, row, s, hi, k0, k1, step,
                stream, DITHER: tl.constexpr, BITS: tl.constexpr, ERROR: tl.constexpr,
                DECODED: tl.constexpr, BLOCK: tl.constexpr):
    """qsgd's codes ``clamp(floor(s x / ||row|| + u) + s, 0, hi)`` from the row norms."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    norm = tl.load(norms_ptr + idx // row, mask=mask, other=1.0)
    qsgd_codes(x, norm, idx, mask, out_ptr, err_ptr, dec_ptr, pid, n, s, hi, k0, k1, step,
               stream, DITHER, BITS, ERROR, DECODED, BLOCK)


@triton.jit(do_not_specialize=KEYED)
def qsgd_rows(x_ptr, norms_ptr, out_ptr, err_ptr, dec_ptr, n, s, hi, k0, k1, step, stream,
              ROW: tl.constexpr, ROWS: tl.constexpr, DITHER: tl.constexpr, BITS: tl.constexpr,
              ERROR: tl.constexpr, DECODED: tl.constexpr, BLOCK: tl.constexpr):
    """``qsgd_encode`` with the norms of its ``ROWS`` whole rows of ``ROW`` elements
    (``ROWS * ROW == BLOCK``) computed (and stored) by the same program: one pass over the
    tensor."""
    pid = tl.program_id(0).to(tl.int64)
    r = pid * ROWS + tl.arange(0, ROWS)
    tile = r[:, None] * ROW + tl.arange(0, ROW)[None, :]
    x = tl.load(x_ptr + tile, mask=tile < n, other=0.0).to(tl.float32)
    norms = norm_of(x, 1)
    tl.store(norms_ptr + r, norms, mask=r * ROW < n)
    idx = tl.reshape(tile, (BLOCK,))
    norm = tl.reshape(tl.broadcast_to(norms[:, None], (ROWS, ROW)), (BLOCK,))
    qsgd_codes(tl.reshape(x, (BLOCK,)), norm, idx, idx < n, out_ptr, err_ptr, dec_ptr, pid, n,
               s, hi, k0, k1, step, stream, DITHER, BITS, ERROR, DECODED, BLOCK)


# ------------------------------------------------------------------ terngrad
@triton.jit(do_not_specialize=KEYED)
def terngrad_encode(x_ptr, acc_ptr, out_ptr, scaler_ptr, n, k0, k1, step, stream,
                    BLOCK: tl.constexpr):
    """TernGrad's 2-bit codes ``clamp(floor(x / m + u) + 1, 0, 2)`` (16-bit dither), ``m``
    the largest magnitude (``abs_max``), which program 0 stores as the scaler."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = largest(acc_ptr)
    if pid == 0:
        tl.store(scaler_ptr, m)
    inv = tl.where(m > 0, 1.0 / m, 0.0)
    t = x * inv
    t = t + dither(pid, step, stream, k0, k1, 16, BLOCK)
    t = t + (1.0 + 1.0 / (2 << 16))
    code = tl.minimum(t.to(tl.int32) & 0xFF, 2)
    store_codes(out_ptr, tl.where(mask, code, 0), pid, n, BLOCK, 2)


# ------------------------------------------------------------------ natural
@triton.jit(do_not_specialize=KEYED)
def natural_encode(x_ptr, acc_ptr, out_ptr, base_ptr, n, k0, k1, step, stream,
                   BLOCK: tl.constexpr):
    """Natural compression's 8-bit codes ``sign << 7 | c`` (``natural`` explains ``c``), every
    case of the reference's branches in one elementwise formula; the window's ``base`` comes
    from the largest magnitude (``abs_max``) and program 0 stores it."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    bc = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    top = tl.load(acc_ptr) >> 23
    base = tl.maximum(top - 124, 0)
    if pid == 0:
        tl.store(base_ptr, base)
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


@triton.jit
def natural_table(base_ptr, out_ptr):
    """The 256 decoded values of natural's codes under ``base``: ``+-2^(base + c - 127)``, 0,
    NaN (c = 126) and infinity (c = 127)."""
    c = tl.arange(0, 128)
    power = tl.minimum(tl.maximum(c + tl.load(base_ptr), 0), 255) << 23
    power = tl.where(c == 0, 0, tl.where(c == NAN_CODE, 0x7FC00000, power))
    power = tl.where(c == INF_CODE, 0x7F800000, power)
    tl.store(out_ptr + c, power.to(tl.float32, bitcast=True))
    tl.store(out_ptr + 128 + c, (power ^ -2147483648).to(tl.float32, bitcast=True))  # negated


# ------------------------------------------------------------------ u8bit
@triton.jit
def u8bit_encode(x_ptr, acc_ptr, index_ptr, split_ptr, out_ptr, scaler_ptr, n,
                 BLOCK: tl.constexpr):
    """The dynamic tree's nearest code of ``|x| / m`` (two table lookups and a comparison)
    with the sign as bit 7; ``m`` the largest magnitude, stored by program 0."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = largest(acc_ptr)
    if pid == 0:
        tl.store(scaler_ptr, m)
    v = tl.abs(x) * tl.where(m > 0, 1.0 / m, 0.0)
    cell = (v.to(tl.int32, bitcast=True) >> 17) & 0x3FFF   # the 16384 cells; a NaN may be signed
    code = tl.load(index_ptr + cell, mask=mask, other=0).to(tl.int32)
    code += (v >= tl.load(split_ptr + cell, mask=mask, other=0.0)).to(tl.int32)
    code = code | ((x.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 7)
    tl.store(out_ptr + idx, code.to(tl.uint8), mask=mask)


# ------------------------------------------------------------------ sign planes
@triton.jit
def sign_planes(x_ptr, neg_ptr, zero_ptr, part_ptr, flags_ptr, n, status_ptr, nbytes,
                ZERO: tl.constexpr, STATS: tl.constexpr, FLAGS: tl.constexpr,
                STATUS: tl.constexpr, BLOCK: tl.constexpr):
    """The packed plane of ``x < 0`` (with ``ZERO``, of ``x == 0`` too); with ``STATS`` this
    program's ``[sum x, sum |x|, count x < 0]`` in ``part[pid]``; with ``FLAGS``
    ``flags |= [any NaN or infinity, any exact zero]``; with ``STATUS`` the last program to
    finish (``flags[2]`` counts them) writes a pure-sign payload's status byte
    (``NONFINITE | ZEROS``) after both planes, ``status[2 nbytes]``, and where ``x`` has no
    zero also at ``status[nbytes]``, over the all-clear zero plane's first byte: where the
    payload cut to its size ends either way."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=1.0)
    neg = x < 0
    store_codes(neg_ptr, neg.to(tl.int32), pid, n, BLOCK, 1)
    if ZERO:
        store_codes(zero_ptr, (x == 0).to(tl.int32), pid, n, BLOCK, 1)
    if STATS:
        w = tl.where(mask, x.to(tl.float32), 0.0)
        tl.store(part_ptr + pid * 3, tl.sum(w, axis=0))
        tl.store(part_ptr + pid * 3 + 1, tl.sum(tl.abs(w), axis=0))
        tl.store(part_ptr + pid * 3 + 2, tl.sum(neg.to(tl.float32), axis=0))
    if FLAGS:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        tl.atomic_or(flags_ptr, tl.max((bits >= INF_BITS).to(tl.int32), axis=0))
        tl.atomic_or(flags_ptr + 1, tl.max((x == 0).to(tl.int32), axis=0))
    if STATUS:      # (the atomics order this program's stores before the last one's reads)
        if tl.atomic_add(flags_ptr + 2, 1) == tl.num_programs(0) - 1:
            nonfinite = tl.atomic_or(flags_ptr, 0)
            zeros = tl.atomic_or(flags_ptr + 1, 0)
            byte = (nonfinite | tl.where(zeros != 0, 2, 0)).to(tl.uint8)
            tl.store(status_ptr + 2 * nbytes, byte)
            if zeros == 0:
                tl.store(status_ptr + nbytes, byte)


@triton.jit(do_not_specialize=["programs", "n"])
def sign_scalars(part_ptr, programs, n, out_ptr, MEANS: tl.constexpr, CHUNK: tl.constexpr,
                 LOOPS: tl.constexpr):
    """From ``sign_planes``' partial sums, in program order: with ``MEANS`` onebit's
    ``[mean of x >= 0, mean of x < 0]`` (from ``S = sum x`` and ``A = sum |x|``: the
    non-negative sum is ``(S + A) / 2``, the negative ``(S - A) / 2``); else efsignsgd's scale
    ``A / n``."""
    total = tl.zeros((CHUNK,), tl.float32)
    mass = tl.zeros((CHUNK,), tl.float32)
    count = tl.zeros((CHUNK,), tl.float32)
    for i in range(LOOPS):      # LOOPS * CHUNK >= programs
        p = i * CHUNK + tl.arange(0, CHUNK)
        mask = p < programs
        total += tl.load(part_ptr + p * 3, mask=mask, other=0.0)
        mass += tl.load(part_ptr + p * 3 + 1, mask=mask, other=0.0)
        count += tl.load(part_ptr + p * 3 + 2, mask=mask, other=0.0)
    s = tl.sum(total, axis=0)
    a = tl.sum(mass, axis=0)
    if MEANS:
        n_neg = tl.sum(count, axis=0)
        n_pos = n_neg * -1.0 + n
        pos = (s + a) * 0.5
        neg = (s - a) * 0.5
        pos = tl.where(pos < 0, 0.0, pos)
        neg = tl.where(neg > 0, 0.0, neg)
        tl.store(out_ptr, pos / tl.maximum(n_pos, 1.0))
        tl.store(out_ptr + 1, neg / tl.maximum(n_neg, 1.0))
    else:
        tl.store(out_ptr, a / tl.maximum(n * 1.0, 1.0))


@triton.jit
def narrowed(v, ty: tl.constexpr):
    """float32 ``v`` as ``ty``, rounded to nearest even (bfloat16 by its bits: a GPU's
    conversion rounds so, Triton's interpreter truncates)."""
    if ty == tl.bfloat16:
        bits = tl.where(v == v, v.to(tl.int32, bitcast=True), 0x7FC00000)   # one quiet NaN
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return v.to(ty)


@triton.jit
def sign_of(x):
    """+1.0, -1.0 or 0.0 (for +-0 and NaN) as float32 ``x`` is positive, negative or neither."""
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))


@triton.jit
def sign_error(x_ptr, status_ptr, err_ptr, dec_ptr, n, DECODED: tl.constexpr,
               BLOCK: tl.constexpr):
    """What a pure-sign payload of ``x`` loses: ``err = x - sign(x)`` (with ``DECODED``
    ``dec = sign(x)``), computed in float32 and stored in the outputs' dtype; where the
    payload's status byte (at ``status_ptr``) says NaN or infinity, ``err`` is +0 (the slot a
    non-finite step leaves, cleaned: ``grace_dl.memory.base``) and ``dec`` NaN, as decoding
    gives."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    s = sign_of(x)
    bad = (tl.load(status_ptr).to(tl.int32) & 1) != 0
    tl.store(err_ptr + idx, narrowed(tl.where(bad, 0.0, x - s), err_ptr.dtype.element_ty),
             mask=mask)
    if DECODED:
        tl.store(dec_ptr + idx, narrowed(tl.where(bad, float("nan"), s),
                                         dec_ptr.dtype.element_ty), mask=mask)


@triton.jit
def pure_signs(packed_ptr, idx, n, nbytes, status_at, ZERO: tl.constexpr):
    """A pure-sign payload's codes at ``idx`` as int32 +1, -1 or 0 (the negative plane at
    ``packed[0:nbytes]``, with ``ZERO`` the zero plane after it), and its NaN/Inf bit (of the
    status byte at ``status_at``)."""
    neg = load_codes(packed_ptr, idx, n, 1)
    either = neg
    if ZERO:
        either = either | load_codes(packed_ptr + nbytes, idx, n, 1)
    return (1 - either) - neg, tl.load(packed_ptr + status_at).to(tl.int32) & 1


@triton.jit
def sign_count(packed_ptr, count_ptr, n, nbytes, status_at, ZERO: tl.constexpr,
               FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """One pure-sign payload's votes (``pure_signs``) added into ``count`` (``FIRST``: written
    there); ``count[n]`` or-ed with the payload's NaN/Inf bit, by program 0 alone."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    d, bad = pure_signs(packed_ptr, idx, n, nbytes, status_at, ZERO)
    if not FIRST:
        d += tl.load(count_ptr + idx, mask=mask, other=0).to(tl.int32)
        bad = bad | tl.load(count_ptr + n).to(tl.int32)
    tl.store(count_ptr + idx, d.to(count_ptr.dtype.element_ty), mask=mask)
    if pid == 0:
        tl.store(count_ptr + n, bad.to(count_ptr.dtype.element_ty))


@triton.jit
def vote_decode(count_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """The majority vote from ``sign_count``'s counts: +1 where positive, -1 where negative,
    0 where tied; NaN everywhere where ``count[n]`` says some payload's input held a NaN or an
    infinity."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    v = sign_of(tl.load(count_ptr + idx, mask=mask, other=0).to(tl.float32))
    tl.store(out_ptr + idx, tl.where(tl.load(count_ptr + n).to(tl.int32) != 0, float("nan"), v),
             mask=mask)


@triton.jit
def sign_decode(packed_ptr, out_ptr, n, nbytes, status_at, ZERO: tl.constexpr,
                BLOCK: tl.constexpr):
    """A pure-sign payload decoded in one pass: the negative plane at ``packed[0:nbytes]``,
    with ``ZERO`` the zero plane after it, the status byte at ``status_at``; +1 where neither
    plane's bit is set, -1 where the negative one's is, 0 where only the zero one's is, NaN
    everywhere where the status says the input held a NaN or an infinity."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    d, bad = pure_signs(packed_ptr, idx, n, nbytes, status_at, ZERO)
    tl.store(out_ptr + idx, tl.where(bad != 0, float("nan"), d.to(tl.float32)), mask=idx < n)


# ------------------------------------------------------------------ sketch
@triton.jit
def order_key(x):
    """int32 keys of float32 ``x`` ordered as the floats, -0 equal to +0 (twin:
    ``codes.order_key``)."""
    bits = x.to(tl.int32, bitcast=True)
    key = ((bits >> 31) & 0x7FFFFFFF) ^ bits
    return key + ((key >> 31) & 1)


@triton.jit
def sketch_edges(ranked_ptr, lo_ptr, hi_ptr, w_ptr, out_ptr, m, WIDTH: tl.constexpr):
    """The order keys of sketch's ``m`` edges, each interpolated between two ranks of the
    sorted sample: ``below + (above - below) * w``."""
    j = tl.arange(0, WIDTH)
    mask = j < m
    below = tl.load(ranked_ptr + tl.load(lo_ptr + j, mask=mask, other=0), mask=mask, other=0.0)
    above = tl.load(ranked_ptr + tl.load(hi_ptr + j, mask=mask, other=0), mask=mask, other=0.0)
    e = below + (above - below) * tl.load(w_ptr + j, mask=mask, other=0.0)
    tl.store(out_ptr + j, order_key(e), mask=mask)


@triton.jit
def sketch_encode(x_ptr, edges_ptr, n_edges, out_ptr, part_ptr, n, BITS: tl.constexpr,
                  Q: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr,
                  SUB: tl.constexpr):
    """Each element's bucket (the number of edge keys <= its order key: a binary search of
    ``STEPS`` rounds), packed ``BITS`` each; this program's per-bucket sums and counts in
    ``part[pid] = [sums(Q), counts(Q)]``: each ``SUB`` elements' values added into a
    ``(SUB, Q)`` one-hot accumulator held in registers, reduced once at the end, the counts
    by ``tl.histogram`` (no atomics: a program's elements crowd into few buckets, and no
    reduction across threads inside the loop)."""
    pid = tl.program_id(0).to(tl.int64)
    buckets = tl.arange(0, Q)
    acc = tl.zeros((SUB, Q), tl.float32)
    counts = tl.zeros((Q,), tl.int32)
    for c in range(BLOCK // SUB):
        chunk = pid * (BLOCK // SUB) + c
        idx = chunk * SUB + tl.arange(0, SUB)
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        key = order_key(x)
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
        store_codes(out_ptr, bucket, chunk, n, SUB, BITS)
        acc += tl.where((bucket[:, None] == buckets[None, :]) & mask[:, None], x[:, None], 0.0)
        counts += tl.histogram(bucket, Q, mask=mask)
    row = part_ptr + pid * 2 * Q
    tl.store(row + buckets, tl.sum(acc, axis=0))
    tl.store(row + Q + buckets, counts.to(tl.float32))


# ------------------------------------------------------------------ inceptionn
@triton.jit
def inception_tag(x, inv_d):
    """INCEPTIONN's tag of each float32 ``x``: 0, 1, 2 by ``|x| / d`` against 1, 2**7, 2**15;
    3 above, and for NaN (which is below nothing)."""
    q = tl.abs(x) * inv_d
    return tl.where(q < 1.0, 0, 1) + tl.where(q < 128.0, 0, 1) + tl.where(q < 32768.0, 0, 1)


@triton.jit
def class_ranks(tag):
    """Each element's rank among the program's earlier elements of its class, for classes 1,
    2, 3 at bits 0, 21, 42 of one int64: one running sum for the three (ranks below
    ``2**21``)."""
    one = tl.full(tag.shape, 1, tl.int64)
    packed = tl.where(tag == 1, one, 0) + tl.where(tag == 2, one << 21, 0) \
        + tl.where(tag == 3, one << 42, 0)
    return tl.cumsum(packed, axis=0) - packed


@triton.jit
def inceptionn_classify(x_ptr, tags_ptr, counts_ptr, n, inv_d, BLOCK: tl.constexpr):
    """Packed 2-bit tags, and this program's count of each tag (``counts[pid, t]``)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    tag = tl.where(mask, inception_tag(tl.load(x_ptr + idx, mask=mask, other=0.0)
                                       .to(tl.float32), inv_d), 0)
    store_codes(tags_ptr, tag, pid, n, BLOCK, 2)
    for t in tl.static_range(1, 4):
        tl.store(counts_ptr + pid * 4 + t, tl.sum((tag == t).to(tl.int32), axis=0))


@triton.jit
def inceptionn_compact(x_ptr, raw_ptr, offsets_ptr, v1_ptr, v2_ptr, v3_ptr, n, inv_d,
                       BLOCK: tl.constexpr):
    """Each element into its class's list at this program's offset plus its rank among the
    program's elements of that class: ``x / d`` as int8 (tag 1), as int16 (tag 2), the raw
    value (tag 3)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    tag = tl.where(mask, inception_tag(x, inv_d), 0)
    scaled = x * inv_d
    ranks = class_ranks(tag)
    for t in tl.static_range(1, 4):
        hit = tag == t
        at = tl.load(offsets_ptr + pid * 4 + t) + ((ranks >> (21 * (t - 1))) & 0x1FFFFF)
        if t == 1:
            tl.store(v1_ptr + at, scaled.to(tl.int8), mask=hit)
        elif t == 2:
            tl.store(v2_ptr + at, scaled.to(tl.int16), mask=hit)
        else:
            tl.store(v3_ptr + at, tl.load(raw_ptr + idx, mask=hit), mask=hit)


@triton.jit
def inceptionn_counts(tags_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    """This program's count of each tag, from the packed tags."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    tag = tl.where(idx < n, load_codes(tags_ptr, idx, n, 2), 0)
    for t in tl.static_range(1, 4):
        tl.store(counts_ptr + pid * 4 + t, tl.sum((tag == t).to(tl.int32), axis=0))


@triton.jit
def inceptionn_expand(tags_ptr, offsets_ptr, v1_ptr, v2_ptr, v3_ptr, out_ptr, n, d,
                      BLOCK: tl.constexpr):
    """float32 ``out``: 0 (tag 0), ``v1 * d``, ``v2 * d``, the raw value (tag 3), each read
    from its class's list at this program's offset plus its rank there."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    tag = tl.where(mask, load_codes(tags_ptr, idx, n, 2), 0)
    v = tl.zeros((BLOCK,), tl.float32)
    ranks = class_ranks(tag)
    for t in tl.static_range(1, 4):
        hit = tag == t
        at = tl.load(offsets_ptr + pid * 4 + t) + ((ranks >> (21 * (t - 1))) & 0x1FFFFF)
        if t == 1:
            v = tl.where(hit, tl.load(v1_ptr + at, mask=hit, other=0).to(tl.float32) * d, v)
        elif t == 2:
            v = tl.where(hit, tl.load(v2_ptr + at, mask=hit, other=0).to(tl.float32) * d, v)
        else:
            v = tl.where(hit, tl.load(v3_ptr + at, mask=hit, other=0.0).to(tl.float32), v)
    tl.store(out_ptr + idx, v, mask=mask)
