"""The quantizers' and sign methods' encoders and the one table decoder of the device path:
a Triton kernel each where ``triton_for`` allows (``jit_codes``), else its twin here, in torch
ops with the same float operations. Neither synchronises with the host: scalars such as a
tensor's largest magnitude, norms or sums stay on the device, reduced by one kernel and read
by the next.

Packed codes follow ``ops.pack_bits`` (``bits`` per code, little-endian stream), so payloads
are the reference compressors' own and either path decodes the other's. Where a kernel sums
(norms, means, bucket sums) it adds in another order than the twin, so those agree to float
rounding; everything else is the same bits.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from grace_dl.torch.kernels import BLOCK, grid, launch, philox, triton_for

#: rows of at most this many elements are reduced by one program's columns at a time
NORM_TILE = 4096
MAG = 0x7FFFFFFF
INF_BITS = 0x7F800000


def _jit():
    from grace_dl.torch.kernels import jit_codes
    return jit_codes


#: ``launch`` with no multiply-add contraction
_launch = functools.partial(launch, enable_fp_fusion=False)


def packed_size(n: int, bits: int) -> int:
    return -(-n * bits // 8)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_CONSTANTS: dict = {}


def constant(key, device, make):
    """A constant tensor, made once per device from the NumPy array ``make()`` (so that no
    step copies it there); ``key`` names it."""
    got = _CONSTANTS.get((key, device))
    if got is None:
        got = _CONSTANTS[(key, device)] = torch.from_numpy(np.ascontiguousarray(make())).to(
            device)
    return got


def positions(mask, count: int):
    """The positions of ``mask``'s set elements, of which there are ``count`` (known, so the
    selection has a static size: no read-back), ascending."""
    try:
        return torch.nonzero_static(mask, size=count).reshape(-1)
    except (NotImplementedError, RuntimeError):   # a device without nonzero_static
        rank = torch.cumsum(mask.reshape(-1), 0) - 1
        slot = torch.where(mask.reshape(-1), rank, count)
        out = torch.zeros(count + 1, dtype=torch.int64, device=mask.device)
        return out.scatter_(0, slot, torch.arange(mask.numel(), device=mask.device))[:count]


# ------------------------------------------------------------------ twins' bit packing
def pack_twin(codes, bits: int):
    """``ops.pack_bits`` in torch ops only (uint8 codes below ``2**bits``)."""
    n = codes.numel()
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8 or n == 0:
        return codes.clone() if bits == 8 else codes.new_zeros(0)
    codes = torch.cat([codes, codes.new_zeros((-n) % 8)]).view(-1, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (codes.to(torch.int64) << shifts).sum(dim=1)
    lanes = torch.arange(8, device=codes.device, dtype=torch.int64) * 8
    stream = ((words[:, None] >> lanes) & 0xFF).to(torch.uint8)[:, :bits]
    return stream.reshape(-1)[:packed_size(n, bits)]


def unpack_twin(packed, bits: int, n: int):
    """The first ``n`` codes (int64) of a ``bits``-bit packed stream, in torch ops only."""
    if bits == 8:
        return packed[:n].to(torch.int64)
    s = torch.arange(n, device=packed.device, dtype=torch.int64) * bits
    wide = torch.cat([packed.reshape(-1), packed.new_zeros(1)]).to(torch.int64)
    word = wide[s >> 3] | (wide[(s >> 3) + 1] << 8)
    return (word >> (s & 7)) & ((1 << bits) - 1)


def pack(codes, bits: int):
    """uint8 ``codes`` (1-D, below ``2**bits``) packed ``bits`` each (``ops.pack_bits``)."""
    n = codes.numel()
    if bits == 8:
        return codes.clone()
    if not triton_for(codes) or n == 0:
        return pack_twin(codes, bits)
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=codes.device)
    _launch(_jit().pack, grid(n)[0], codes, out, n, BITS=bits, BLOCK=BLOCK)
    return out


def unpack(packed, bits: int, n: int):
    """The first ``n`` codes of a ``bits``-bit packed stream, as uint8."""
    if not triton_for(packed) or n == 0:
        return unpack_twin(packed, bits, n).to(torch.uint8)
    out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    _launch(_jit().unpack, grid(n)[0], packed, out, n, BITS=bits, BLOCK=BLOCK)
    return out


# ------------------------------------------------------------------ the decoder
def decode(packed, bits: int, n: int, table, out, scale=None, row: int = 1,
           divisor: float = 1.0, sign: bool = False, accumulate: bool = False):
    """``out[i] = v_i`` (added to ``out`` with ``accumulate``) for the first ``n`` codes of
    ``packed``: ``v = table[code]``, or with ``sign`` ``table[0]`` negated where the code is 1;
    times ``scale[i // row] / divisor`` when ``scale`` is given. ``out`` a contiguous tensor of
    ``n`` elements; ``table`` and ``scale`` float32. Returns ``out``."""
    flat = out.view(-1)
    if n == 0:
        return out
    if triton_for(packed):
        _launch(_jit().decode, grid(n)[0], packed, table, table if scale is None else scale,
                flat, n, max(int(row), 1), float(divisor), BITS=bits, SIGN=sign,
                SCALED=scale is not None, ACCUMULATE=accumulate, BLOCK=BLOCK)
        return out
    code = unpack_twin(packed, bits, n)
    if sign:
        t = table.reshape(-1)[:1]
        v = torch.where(code != 0, t * -1.0, t)
    else:
        v = table.reshape(-1)[code]
    if scale is not None:
        v = v * (torch.repeat_interleave(scale.reshape(-1), max(int(row), 1))[:n] / divisor)
    if accumulate:
        v = flat.to(torch.float32) + v
    flat.copy_(v)
    return out


# ------------------------------------------------------------------ scalars of a tensor
def abs_max_bits(x):
    """A 1-element int32 tensor: the largest float32 bits of ``|x|`` (0 for no elements), the
    largest magnitude's bits (infinity above every number, NaN above that)."""
    if triton_for(x) and x.numel():
        acc = torch.zeros(1, dtype=torch.int32, device=x.device)
        _launch(_jit().abs_max, grid(x.numel())[0], x, acc, x.numel(), BLOCK=BLOCK)
        return acc
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=x.device)
    return (x.to(torch.float32).view(torch.int32) & MAG).amax().reshape(1)


def nonfinite_mark(x):
    """``ops.nonfinite_mark`` of torch: a 0-d tensor of ``x``'s dtype, -0.0 when every entry
    of ``x`` (at least one) is finite, else NaN. One read of ``x``; for 16- and 32-bit floats
    where the kernels run, one launch."""
    if x.dtype in NARROW and triton_for(x):
        out = torch.full((), -0.0, dtype=x.dtype, device=x.device)
        n = x.numel()
        _launch(_jit().nonfinite, -(-n // BLOCK), x.reshape(-1), out, n, BLOCK=BLOCK)
        return out
    lo, hi = torch.aminmax(x)
    return -(torch.maximum(hi, -lo) * 0).abs()     # (an all-zero x's max may be -0.0)


#: the float dtypes a kernel reads as float32 without losing a bit (float64 keeps the twin)
NARROW = (torch.float32, torch.float16, torch.bfloat16)


def largest_twin(acc):
    """``abs_max_bits`` as the largest magnitude: NaN where the tensor holds a NaN or an
    infinity (``ops.abs_max``'s rule)."""
    return torch.where(acc >= INF_BITS, torch.full(acc.shape, float("nan"), device=acc.device),
                       acc.view(torch.float32))


def magnitudes(flat):
    """``|flat|`` in float32 with NaN as -1: what the sparsifiers rank (``sparse.magnitudes``)."""
    n = flat.numel()
    if not triton_for(flat) or n == 0:
        mag = flat.abs().to(torch.float32)
        return torch.where(mag == mag, mag, torch.full_like(mag, -1.0))
    out = torch.empty(n, dtype=torch.float32, device=flat.device)
    _launch(_jit().magnitudes, -(-n // BLOCK), flat.contiguous(), out, n, BLOCK=BLOCK)
    return out


def above(flat, thr, strict: bool):
    """A mask of ``|flat| > thr`` (``strict``) or ``|flat| >= thr``, compared in float32 and
    false for NaN: what a sparsifier keeps, for ``torch.nonzero``. ``thr`` a Python float or
    a 1-element float32 tensor on ``flat``'s device (read by the kernel, not the host)."""
    n = flat.numel()
    if not triton_for(flat) or n == 0:
        mag = flat.abs().to(torch.float32)
        return mag > thr if strict else mag >= thr
    out = torch.empty(n, dtype=torch.uint8, device=flat.device)
    on_device = torch.is_tensor(thr)
    _launch(_jit().above, grid(n)[0], flat, thr if on_device else out, out, n,
            0.0 if on_device else float(thr), FROM_PTR=on_device, STRICT=strict, BLOCK=BLOCK)
    return out


# ------------------------------------------------------------------ qsgd
def _dither_twin(key, step, stream, n, bits, like):
    w = philox.words(key, step, stream, n, like)
    return (w >> (32 - bits)).to(torch.float32) * 2.0**-bits


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
        cols = min(next_power_of_2(row), NORM_TILE)
        per = max(1, NORM_TILE // cols)
        _launch(_jit().row_norms, -(-rows // per), x, norms, n, row, rows, ROWS=per,
                COLS=cols, TILES=-(-row // cols))
        return norms
    padded = torch.cat([x, x.new_zeros(rows * row - n)]).view(rows, row)
    plain = torch.linalg.vector_norm(padded, dim=1)
    peak = padded.abs().amax(dim=1)
    safe = torch.where(peak > 0, peak, torch.ones_like(peak))
    rescaled = torch.linalg.vector_norm(padded / safe[:, None], dim=1) * peak
    return norms.copy_(torch.where(plain < float("inf"), plain, rescaled))


def qsgd_encode(x, row: int, s: float, hi: int, bits: int, dither_bits: int, key, step: int,
                stream: int, error=None, decoded=None):
    """``(packed codes, row norms)`` of qsgd for the 1-D float32 ``x``; the error ``x - v``
    into ``error`` and the decoded ``v`` into ``decoded`` when given (1-D float32 tensors of
    ``x``'s length; ``error`` may be ``x`` itself). Rows of a power-of-two length up to a
    program's ``BLOCK`` are normed and coded by one kernel."""
    n = x.numel()
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=x.device)
    if n == 0:
        return out, torch.empty(0, dtype=torch.float32, device=x.device)
    if triton_for(x):
        common = (x, None, out, x if error is None else error, x if decoded is None else decoded)
        keyed = (*key, int(step) & philox.MASK, int(stream) & philox.MASK)
        flags = dict(DITHER=dither_bits, BITS=bits, ERROR=error is not None,
                     DECODED=decoded is not None, BLOCK=BLOCK)
        if row & (row - 1) == 0 and row <= BLOCK:
            norms = torch.empty(-(-n // row), dtype=torch.float32, device=x.device)
            _launch(_jit().qsgd_rows, grid(n)[0], common[0], norms, *common[2:], n, float(s),
                    int(hi), *keyed, ROW=row, ROWS=BLOCK // row, **flags)
        else:
            norms = row_norms(x, row)
            _launch(_jit().qsgd_encode, grid(n)[0], common[0], norms, *common[2:], n, row,
                    float(s), int(hi), *keyed, **flags)
        return out, norms
    norms = row_norms(x, row)
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
    return out.copy_(pack_twin(code, bits)), norms


# ------------------------------------------------------------------ terngrad
def terngrad_encode(x, key, step: int, stream: int):
    """``(2-bit codes, 1-element scaler)`` of TernGrad for the 1-D float32 ``x``."""
    n = x.numel()
    out = torch.empty(packed_size(n, 2), dtype=torch.uint8, device=x.device)
    acc = abs_max_bits(x)
    if triton_for(x) and n:
        scaler = torch.empty(1, dtype=torch.float32, device=x.device)
        _launch(_jit().terngrad_encode, grid(n)[0], x, acc, out, scaler, n, *key,
                int(step) & philox.MASK, int(stream) & philox.MASK, BLOCK=BLOCK)
        return out, scaler
    scaler = largest_twin(acc)
    inv = torch.where(scaler > 0, 1.0 / scaler, torch.zeros_like(scaler))
    t = x * inv
    t = t + _dither_twin(key, step, stream, n, 16, x)
    t = t + (1.0 + 2.0**-17)
    return out.copy_(pack_twin(torch.clamp(t.to(torch.int32) & 0xFF, max=2), 2)), scaler


# ------------------------------------------------------------------ natural
def natural_encode(x, key, step: int, stream: int):
    """``(uint8 codes, 1-element int32 base)`` of natural compression for the 1-D float32
    ``x``."""
    n = x.numel()
    out = torch.empty(n, dtype=torch.uint8, device=x.device)
    acc = abs_max_bits(x)
    if triton_for(x) and n:
        base = torch.empty(1, dtype=torch.int32, device=x.device)
        _launch(_jit().natural_encode, grid(n)[0], x, acc, out, base, n, *key,
                int(step) & philox.MASK, int(stream) & philox.MASK, BLOCK=BLOCK)
        return out, base
    base = torch.clamp((acc >> 23) - 124, min=0).to(torch.int32)
    bc = x.view(torch.int32)
    mag = bc & MAG
    e = mag >> 23
    lowered = mag - (base << 23)
    mant = (mag & 0x007FFFFF) | ((e > 0).to(torch.int32) << 23)
    k = torch.clamp(base + 1 - torch.clamp(e, min=1), 0, 31)
    shifted = torch.where(e > base, lowered, mant >> k)
    mag = torch.where(base > 0, shifted, mag)
    w = philox.words(key, step, stream, n, x)
    mag = mag + (((w >> 16) << 7) + (1 << 6)).to(torch.int32)
    c = torch.clamp(mag >> 23, max=127)
    c = torch.where((bc & MAG) > INF_BITS, torch.full_like(c, 126), c)
    c = c | ((bc >> 24) & 0x80)
    return out.copy_(c.to(torch.uint8)), base


def natural_table(base):
    """The 256 float32 values natural's codes decode to under the 1-element ``base``."""
    out = torch.empty(256, dtype=torch.float32, device=base.device)
    if triton_for(base):
        _launch(_jit().natural_table, 1, base, out)
        return out
    c = torch.arange(128, dtype=torch.int32, device=base.device)
    power = torch.clamp(c + base, 0, 255) << 23
    power = torch.where(c == 0, 0, torch.where(c == 126, 0x7FC00000, power))
    power = torch.where(c == 127, INF_BITS, power).to(torch.int32).view(torch.float32)
    return out.copy_(torch.cat([power, -power]))


# ------------------------------------------------------------------ u8bit
def u8bit_encode(x, cell_index, cell_split):
    """``(uint8 codes, 1-element scaler)`` of u8bit for the 1-D float32 ``x`` (``cell_index``
    uint8 and ``cell_split`` float32: ``u8bit``'s cell tables on ``x``'s device)."""
    n = x.numel()
    out = torch.empty(n, dtype=torch.uint8, device=x.device)
    acc = abs_max_bits(x)
    if triton_for(x) and n:
        scaler = torch.empty(1, dtype=torch.float32, device=x.device)
        _launch(_jit().u8bit_encode, grid(n)[0], x, acc, cell_index, cell_split, out, scaler,
                n, BLOCK=BLOCK)
        return out, scaler
    scaler = largest_twin(acc)
    v = x.abs() * torch.where(scaler > 0, 1.0 / scaler, torch.zeros_like(scaler))
    cell = ((v.view(torch.int32) >> 17) & 0x3FFF).to(torch.int64)   # a NaN may be signed
    code = cell_index[cell].to(torch.int32) + (v >= cell_split[cell]).to(torch.int32)
    code = code | ((x.view(torch.int32) < 0).to(torch.int32) << 7)
    return out.copy_(code.to(torch.uint8)), scaler


# ------------------------------------------------------------------ signs
#: partial sums ``sign_scalars`` adds per step of its loop
SCALARS_CHUNK = 1024


def _planes(x):
    """The packed plane of ``x < 0`` and each program's ``[sum x, sum |x|, count x < 0]``."""
    n = x.numel()
    neg = torch.empty(packed_size(n, 1), dtype=torch.uint8, device=x.device)
    programs = grid(n)[0]
    part = torch.empty(programs, 3, dtype=torch.float32, device=x.device)
    _launch(_jit().sign_planes, programs, x, neg, neg, part, neg, n, neg, 0, ZERO=False,
            STATS=True, FLAGS=False, STATUS=False, BLOCK=BLOCK)
    return neg, part


def _twin_neg(x):
    return pack_twin((x < 0).to(torch.uint8), 1)


def sign_payload(x):
    """``(buffer, flags)`` for a pure-sign payload of the 1-D ``x`` (``signbits.pack_signs``'
    layout): a ``2 ceil(n/8) + 1``-byte uint8 buffer holding the negative plane, then the zero
    plane, then the status byte; and int32 flags ``[any NaN or infinity, any exact zero]``
    (the kernel's count of finished programs after them). Where ``x`` has no exact zero
    the payload is the buffer's first ``ceil(n/8) + 1`` bytes, the status byte written over
    the all-clear zero plane's first byte as well as at the end (both on the device: the host
    reads the flags only to cut the payload to its size, and the whole buffer is a valid
    payload too, its zero plane all clear but for a NaN step's status bit)."""
    n = x.numel()
    nbytes = packed_size(n, 1)
    buf = torch.empty(2 * nbytes + 1, dtype=torch.uint8, device=x.device)
    if triton_for(x) and n:
        flag = torch.zeros(3, dtype=torch.int32, device=x.device)   # and the programs done
        _launch(_jit().sign_planes, grid(n)[0], x, buf[:nbytes], buf[nbytes:2 * nbytes], buf,
                flag, n, buf, nbytes, ZERO=True, STATS=False, FLAGS=True, STATUS=True,
                BLOCK=BLOCK)
        return buf, flag
    bits = x.to(torch.float32).view(torch.int32) & MAG
    flag = torch.stack([(bits >= INF_BITS).any(), (x == 0).any()]).to(torch.int32)
    buf[:nbytes].copy_(_twin_neg(x))
    buf[nbytes:2 * nbytes].copy_(pack_twin((x == 0).to(torch.uint8), 1))
    zeros = flag[1:2] != 0
    status = flag[:1].to(torch.uint8) | zeros.to(torch.uint8) * 2
    buf[2 * nbytes:].copy_(status)
    if n:
        buf[nbytes:nbytes + 1].copy_(torch.where(zeros, buf[nbytes:nbytes + 1], status))
    return buf, flag


def sign_decode(packed, n: int, out):
    """``out`` (1-D float32 of ``n``): a pure-sign payload decoded (``signbits.pack_signs``'
    layout; its size tells whether the zero plane is there): +1, -1, or 0 where the zero
    plane's bit is set; NaN everywhere when the status byte's ``NONFINITE`` bit is."""
    if n == 0:
        return out
    nbytes = packed_size(n, 1)
    zero = packed.numel() > nbytes + 1
    if triton_for(packed):
        _launch(_jit().sign_decode, grid(n)[0], packed, out, n, nbytes, packed.numel() - 1,
                ZERO=zero, BLOCK=BLOCK)
        return out
    d, flag = _pure_signs_twin(packed, n)
    v = d.to(torch.float32)
    return out.copy_(torch.where(flag != 0, torch.full_like(v, float("nan")), v))


def _pure_signs_twin(packed, n: int):
    """A pure-sign payload's ``n`` codes as int64 +1, -1 or 0 and its 1-element NaN/Inf bit
    (the kernels' ``pure_signs``)."""
    nbytes = packed_size(n, 1)
    neg = unpack_twin(packed[:nbytes], 1, n)
    either = neg | unpack_twin(packed[nbytes:2 * nbytes], 1, n) if packed.numel() > nbytes + 1 \
        else neg
    return (1 - either) - neg, packed[-1:].to(torch.int64) & 1


def onebit_encode(x):
    """``(negative plane, [mean of x >= 0, mean of x < 0] as float32)`` of the 1-D ``x``
    (float32 or 16-bit: summed in float32)."""
    n = x.numel()
    if triton_for(x) and n:
        neg, part = _planes(x)
        means = torch.empty(2, dtype=torch.float32, device=x.device)
        _launch(_jit().sign_scalars, 1, part, part.shape[0], n, means, MEANS=True,
                CHUNK=SCALARS_CHUNK, LOOPS=-(-part.shape[0] // SCALARS_CHUNK))
        return neg, means
    wide = x.to(torch.float32)
    total, mass = wide.sum(), torch.linalg.vector_norm(wide, 1)
    n_neg = (x < 0).sum().to(torch.float32)
    n_pos = n_neg * -1 + n
    pos, negs = (total + mass) * 0.5, (total - mass) * 0.5
    pos = torch.where(pos < 0, torch.zeros_like(pos), pos)
    negs = torch.where(negs > 0, torch.zeros_like(negs), negs)
    return _twin_neg(x), torch.stack([pos / torch.clamp(n_pos, 1), negs / torch.clamp(n_neg, 1)])


def efsign_encode(x):
    """``(negative plane, [sum |x| / n] as float32)`` of the 1-D ``x``."""
    n = x.numel()
    if triton_for(x) and n:
        neg, part = _planes(x)
        scale = torch.empty(1, dtype=torch.float32, device=x.device)
        _launch(_jit().sign_scalars, 1, part, part.shape[0], n, scale, MEANS=False,
                CHUNK=SCALARS_CHUNK, LOOPS=-(-part.shape[0] // SCALARS_CHUNK))
        return neg, scale
    scale = torch.linalg.vector_norm(x.to(torch.float32), 1) / max(n, 1)
    return _twin_neg(x), scale.reshape(1)


def sign_error(x, status, err, dec=None):
    """What a pure-sign payload of the 1-D ``x`` loses, written into ``err`` (1-D, ``x``'s
    length): ``x - sign(x)``, and ``sign(x)`` into ``dec`` when given, as ``x``'s dtype
    computes them; where the payload's status byte (``status``: a 1-element uint8 tensor)
    says NaN or infinity, ``err`` is +0 (the non-finite step's slot, cleaned) and ``dec``
    NaN. One pass (a kernel for 16- and 32-bit floats)."""
    n = x.numel()
    if n == 0:
        return
    if x.dtype in NARROW and triton_for(x):
        _launch(_jit().sign_error, grid(n)[0], x, status, err, err if dec is None else dec, n,
                DECODED=dec is not None, BLOCK=BLOCK)
        return
    signs = torch.sign(x)
    bad = (status.reshape(()) & 1) != 0
    err.copy_(torch.where(bad, torch.zeros((), dtype=x.dtype, device=x.device), x - signs))
    if dec is not None:
        dec.copy_(torch.where(bad, torch.full((), float("nan"), dtype=x.dtype, device=x.device),
                              signs))


def sign_vote(payloads, n: int, out):
    """``out`` (1-D float32 of ``n``): the majority vote of pure-sign payloads
    (``signbits.pack_signs``' layout; a payload's size says whether its zero plane is there):
    +1 where more of them code +1 than -1, -1 where fewer, 0 on a tie; NaN everywhere when a
    status byte says its input held a NaN or an infinity. The votes are counted one integer
    an element (8 bits up to 127 payloads): a launch per payload, then one decoding them."""
    if n == 0:
        return out
    nbytes = packed_size(n, 1)
    if triton_for(payloads[0]):
        m = len(payloads)
        count = torch.empty(n + 1, device=out.device, dtype=torch.int8 if m < 128 else
                            torch.int16 if m < 1 << 15 else torch.int32)
        for i, p in enumerate(payloads):
            _launch(_jit().sign_count, grid(n)[0], p, count, n, nbytes, p.numel() - 1,
                    ZERO=p.numel() > nbytes + 1, FIRST=i == 0, BLOCK=BLOCK)
        _launch(_jit().vote_decode, grid(n)[0], count, out, n, BLOCK=BLOCK)
        return out
    total, bad = 0, 0
    for p in payloads:
        d, flag = _pure_signs_twin(p, n)
        total, bad = total + d, bad | flag
    v = torch.sign(total).to(torch.float32)
    return out.copy_(torch.where(bad.reshape(()) != 0, torch.full_like(v, float("nan")), v))


# ------------------------------------------------------------------ sketch
#: elements of a sketch program
SKETCH_BLOCK = 2048


def order_key(x):
    """int32 keys of float32 ``x`` ordered as the floats (``compressors.binning.order_key``)."""
    bits = x.view(torch.int32)
    key = ((bits >> 31) & 0x7FFFFFFF) ^ bits
    return key + ((key >> 31) & 1)


def sketch_edge_keys(ranked, lo, hi, w):
    """The order keys of sketch's edges: ``ranked[lo] + (ranked[hi] - ranked[lo]) * w`` for the
    sorted float32 sample ``ranked`` (``lo``, ``hi`` int64 ranks, ``w`` float32 weights)."""
    m = lo.numel()
    if triton_for(ranked) and m:
        out = torch.empty(m, dtype=torch.int32, device=ranked.device)
        _launch(_jit().sketch_edges, 1, ranked, lo, hi, w, out, m, WIDTH=next_power_of_2(m))
        return out
    below, above = ranked.index_select(0, lo), ranked.index_select(0, hi)
    return order_key((below + (above - below) * w).contiguous())


#: a sketch program's one-hot tile holds at most this many (element, bucket) pairs
SKETCH_TILE = 8192


def sketch_encode(x, edge_keys, q: int, bits: int):
    """``(packed buckets, sums, counts)`` of the 1-D float32 ``x`` against the sorted edges'
    order keys (``sketch_edge_keys``): bucket = the number of edges <= the element (by order
    keys, -0 equal to +0), and the sum and count of each of the ``q`` buckets."""
    n = x.numel()
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=x.device)
    if triton_for(x) and n:
        width = next_power_of_2(q)
        programs = -(-n // SKETCH_BLOCK)
        part = torch.empty(programs, 2, width, dtype=torch.float32, device=x.device)
        _launch(_jit().sketch_encode, programs, x, edge_keys, edge_keys.numel(), out, part, n,
                BITS=bits, Q=width, STEPS=max(1, (edge_keys.numel() + 1).bit_length()),
                BLOCK=SKETCH_BLOCK, SUB=min(SKETCH_BLOCK, max(32, SKETCH_TILE // width)))
        total = part.sum(dim=0)
        return out, total[0, :q], total[1, :q]
    bucket = torch.bucketize(order_key(x), edge_keys, right=True)
    sums = torch.zeros(q, dtype=torch.float32, device=x.device).index_add_(0, bucket, x)
    counts = torch.zeros(q, dtype=torch.float32, device=x.device).index_add_(
        0, bucket, torch.ones_like(x))
    return out.copy_(pack_twin(bucket, bits)), sums, counts


# ------------------------------------------------------------------ inceptionn
def _offsets(counts):
    """Each program's first slot in each class's list (exclusive running sums over the
    programs, per class) and the classes' totals. The sums run along rows of the transpose
    (a running sum down the columns of a tall ``(programs, 4)`` tensor takes CUDA's slow
    outer-dimension scan)."""
    per_class = counts.t().contiguous()
    running = torch.cumsum(per_class, 1)
    return (running - per_class).t().contiguous(), running[:, -1]


def inceptionn_encode(x, raw, d: float):
    """``(packed tags, v1 int8, v2 int16, v3 raw)`` of INCEPTIONN for the 1-D float32 ``x``
    (``raw``: the same elements in the input's dtype, ``d`` the fixed-point step). The
    classes' sizes are the one value read back."""
    n = x.numel()
    if n == 0:
        return (x.new_zeros(0, dtype=torch.uint8), x.new_zeros(0, dtype=torch.int8),
                x.new_zeros(0, dtype=torch.int16), raw[:0])
    if triton_for(x):
        programs = grid(n)[0]
        tags = torch.empty(packed_size(n, 2), dtype=torch.uint8, device=x.device)
        counts = torch.zeros(programs, 4, dtype=torch.int64, device=x.device)
        _launch(_jit().inceptionn_classify, programs, x, tags, counts, n, 1.0 / d, BLOCK=BLOCK)
        offsets, totals = _offsets(counts)
        _, n1, n2, n3 = totals.tolist()        # the one read-back: the payload's sizes
        v1 = torch.empty(n1, dtype=torch.int8, device=x.device)
        v2 = torch.empty(n2, dtype=torch.int16, device=x.device)
        v3 = torch.empty(n3, dtype=raw.dtype, device=x.device)
        _launch(_jit().inceptionn_compact, programs, x, raw, offsets, v1, v2, v3, n, 1.0 / d,
                BLOCK=BLOCK)
        return tags, v1, v2, v3
    q = x.abs() * (1.0 / d)
    tag = (~(q < 1.0)).to(torch.uint8) + (~(q < 128.0)).to(torch.uint8) \
        + (~(q < 32768.0)).to(torch.uint8)
    counts = torch.stack([(tag == t).sum() for t in (1, 2, 3)]).tolist()
    i1, i2, i3 = (positions(tag == t, count) for t, count in zip((1, 2, 3), counts))
    v1 = (x.index_select(0, i1) * (1.0 / d)).to(torch.int8)
    v2 = (x.index_select(0, i2) * (1.0 / d)).to(torch.int16)
    return pack(tag, 2), v1, v2, raw.index_select(0, i3)


def inceptionn_decode(tags, v1, v2, v3, n: int, d: float):
    """INCEPTIONN's float32 values of ``n`` elements (tags 1 and 2 times ``d``, tag 3 the raw
    value cast, tag 0 zero)."""
    if triton_for(tags) and n:
        out = torch.empty(n, dtype=torch.float32, device=tags.device)   # every element written
        programs = grid(n)[0]
        counts = torch.zeros(programs, 4, dtype=torch.int64, device=tags.device)
        _launch(_jit().inceptionn_counts, programs, tags, counts, n, BLOCK=BLOCK)
        offsets, _ = _offsets(counts)
        _launch(_jit().inceptionn_expand, programs, tags, offsets, v1, v2, v3, out, n, float(d),
                BLOCK=BLOCK)
        return out
    out = torch.zeros(n, dtype=torch.float32, device=tags.device)
    tag = unpack(tags, 2, n)
    out.index_copy_(0, positions(tag == 1, v1.numel()), v1.to(torch.float32) * d)
    out.index_copy_(0, positions(tag == 2, v2.numel()), v2.to(torch.float32) * d)
    return out.index_copy_(0, positions(tag == 3, v3.numel()), v3.to(torch.float32))
