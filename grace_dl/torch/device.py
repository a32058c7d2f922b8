"""The device path: each built-in compressor's speed path for torch tensors on a GPU (kind
``"cuda"`` of ``grace_dl.compressors.paths``), written for the device's rules.

- **Keyed randomness where the tensor lives**: dither words come from Philox inside the
  kernels, positions and samples from ``ops.choice`` on the device
  (``grace_dl.torch.kernels.philox``); nothing is drawn on the host.
- **No host synchronisation**: scalars (norms, scales, the status byte) stay device tensors
  that the kernels read; selections have static shapes (``torch.topk``). Only payloads whose
  size depends on the data by definition (threshold, dgc, adaq, inceptionn) read one count.
- **One pass where the method allows**: a quantizer's codes (with its error and decoding,
  for error feedback) come from one kernel, and one table decoder (``codes.decode``)
  decompresses every table-coded method, adding into an output for ``combine``.

Payloads and contexts are the reference's own (``grace_dl/compressors/``): either path decodes
the other's payload. Deterministic methods send the same bits as the reference, except where
a float sum is reduced in another order (onebit's means, qsgd's norms); random ones draw their
dither from Philox instead of SFC64, so they agree with the reference in distribution, not in
bits. ``tests/test_device_path.py`` holds each path to the reference on CPU tensors (under
``kernels.emulate_device()``, the Triton kernels in Triton's interpreter) and checks that no
step synchronises.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from grace_dl.compressors import signbits, sparse
from grace_dl.compressors.adaq import AdaqCompressor
from grace_dl.compressors.dgc import DgcCompressor
from grace_dl.compressors.efsignsgd import EFSignSGDCompressor
from grace_dl.compressors.flat import dither_bits, flat_f32, restore
from grace_dl.compressors.inceptionn import InceptionnCompressor
from grace_dl.compressors.natural import NAN_CODE, NaturalCompressor
from grace_dl.compressors.onebit import OneBitCompressor
from grace_dl.compressors.paths import Reference, register
from grace_dl.compressors.qsgd import QSGDCompressor
from grace_dl.compressors.signsgd import SignSGDCompressor
from grace_dl.compressors.signum import SignumCompressor
from grace_dl.compressors.sketch import SketchCompressor
from grace_dl.compressors.terngrad import TernGradCompressor
from grace_dl.compressors.threshold import ThresholdCompressor
from grace_dl.compressors.topk import TopKCompressor
from grace_dl.compressors.u8bit import _CELL_INDEX, _CELL_SPLIT, _TABLE, U8bitCompressor
from grace_dl.torch import ops
from grace_dl.torch.kernels import codes, philox

KIND = "cuda"


def _flat_out(out, n: int, dtype=torch.float32):
    """``out``'s 1-D view when a result of ``n`` ``dtype`` elements can be written there."""
    if out is None or out.dtype != dtype or out.numel() != n or not out.is_contiguous():
        return None
    return out.view(-1)


def _error_views(tensor, error, decoded):
    """The 1-D float32 views of ``error`` (and ``decoded``) for a ``compress_with_error`` of
    the float32 ``tensor``, or None where they cannot be written."""
    n = tensor.numel()
    if tensor.dtype != torch.float32:
        return None
    views = [_flat_out(o, n) for o in ((error,) if decoded is None else (error, decoded))]
    return None if any(v is None for v in views) else views


# ------------------------------------------------------------------ table-coded methods
class TableCoded(Reference):
    """A method whose payload decodes as ``table[code]`` (times a per-row scale): one
    ``codes.decode`` pass per payload, the ranks' payloads added into one buffer."""

    bits = 8

    def table(self, payload, ctx):
        """``(codes, float32 table, per-row scale or None, row)``."""
        raise NotImplementedError

    def shape_dtype(self, ctx):
        return ctx.shape, ctx.dtype, ctx.numel

    def finish(self, total):
        """What ``aggregate`` does to the sum of the decoded payloads (default: nothing)."""
        return total

    def _decode(self, payload, ctx, out=None, accumulate=False):
        shape, dtype, n = self.shape_dtype(ctx)
        packed, table, scale, row = self.table(payload, ctx)
        if isinstance(dtype, str):
            dtype = ops._DTYPES[dtype]
        flat = _flat_out(out, n) if dtype == torch.float32 else None
        target = flat if flat is not None else torch.empty(n, dtype=torch.float32,
                                                           device=packed.device)
        codes.decode(packed, self.bits, n, table, target, scale, row, accumulate)
        if flat is not None:
            return out
        return target.to(dtype).reshape(shape)

    def decompress(self, payload, ctx):
        return self._decode(payload, ctx)

    def decompress_into(self, payload, ctx, out=None):
        return self._decode(payload, ctx, out)

    def combine(self, payloads, ctx, out=None):
        shape, dtype, n = self.shape_dtype(ctx)
        if dtype not in ("float32", torch.float32):
            total = self._decode(payloads[0], ctx)
            for p in payloads[1:]:
                total = total + self._decode(p, ctx)
            return self.finish(total)
        total = self._decode(payloads[0], ctx, out)
        flat = total.view(-1)
        for p in payloads[1:]:
            packed, table, scale, row = self.table(p, ctx)
            codes.decode(packed, self.bits, n, table, flat, scale, row, accumulate=True)
        return self.finish(total)


@register(QSGDCompressor, KIND)
class QSGDOnDevice(TableCoded):
    """qsgd: one kernel for the row norms, one for the codes (and error, decoding)."""

    def __init__(self, compressor):
        super().__init__(compressor)
        self.bits = compressor._bits

    def compress(self, tensor, name, call):
        return self._compress(tensor, name, call)

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        views = _error_views(tensor, error, decoded)
        return None if views is None else self._compress(tensor, name, call, *views)

    def _compress(self, tensor, name, call, error=None, decoded=None):
        c = self.compressor
        _, x, layout = flat_f32(tensor)
        x = x.contiguous()
        step = c.next_step(name, tensor)
        norms = codes.row_norms(x, c.bucket_size)
        s = c.quantum_num
        packed = codes.qsgd_encode(x, norms, c.bucket_size, float(s), 2 * s, self.bits,
                                   dither_bits(s), philox.device_key(c.seed, name), step,
                                   call.rank, error, decoded)
        return [packed, norms], layout

    def table(self, payload, ctx):
        packed, norms = payload
        s = self.compressor.quantum_num
        table = codes.constant(("qsgd levels", s, self.bits), packed.device,
                               lambda: np.arange(1 << self.bits, dtype=np.float32) - s)
        return packed, table, norms / float(s), self.compressor.bucket_size


@register(TernGradCompressor, KIND)
class TernGradOnDevice(TableCoded):
    bits = 2

    def compress(self, tensor, name, call):
        c = self.compressor
        _, x, layout = flat_f32(tensor)
        x = x.contiguous()
        step = c.next_step(name, tensor)
        n = layout.numel
        scaler = ops.abs_max(x).reshape(1) if n else x.new_zeros(1)
        packed = codes.terngrad_encode(x, scaler, philox.device_key(c.seed, name), step,
                                       call.rank)
        return [packed, scaler], layout

    def table(self, payload, ctx):
        packed, scaler = payload
        base = codes.constant("0..3", packed.device, lambda: np.arange(4, dtype=np.float32))
        return packed, (base - 1.0) * scaler, None, 1


@register(NaturalCompressor, KIND)
class NaturalOnDevice(TableCoded):
    def compress(self, tensor, name, call):
        c = self.compressor
        _, x, layout = flat_f32(tensor)
        x = x.contiguous()
        step = c.next_step(name, tensor)
        if layout.numel:
            top = (ops.abs_max(x).view(torch.int32) & 0x7FFFFFFF) >> 23
        else:
            top = torch.zeros((), dtype=torch.int32, device=x.device)
        base = torch.clamp(top - 124, min=0).to(torch.int32)
        out = codes.natural_encode(x, base, philox.device_key(c.seed, name), step, call.rank)
        return [out, base.reshape(1)], layout

    def table(self, payload, ctx):
        packed, base = payload
        c = codes.constant("0..127", packed.device, lambda: np.arange(128, dtype=np.int32))
        power = torch.clamp(c + base, 0, 255) << 23
        power = torch.where(c == 0, 0, torch.where(c == NAN_CODE, 0x7FC00000, power))
        power = torch.where(c == 127, 0x7F800000, power).to(torch.int32).view(torch.float32)
        return packed, torch.cat([power, -power]), None, 1


@register(U8bitCompressor, KIND)
class U8bitOnDevice(TableCoded):
    def compress(self, tensor, name, call):
        _, x, layout = flat_f32(tensor)
        x = x.contiguous()
        scaler = ops.abs_max(x).reshape(1) if layout.numel else x.new_zeros(1)
        index = codes.constant("u8bit cell index", x.device, lambda: _CELL_INDEX)
        split = codes.constant("u8bit cell split", x.device, lambda: _CELL_SPLIT)
        return [codes.u8bit_encode(x, scaler, index, split), scaler], layout

    def table(self, payload, ctx):
        packed, scaler = payload
        t = codes.constant("u8bit table", packed.device,
                           lambda: np.concatenate([_TABLE, -_TABLE]))
        return packed, t * scaler, None, 1


# ------------------------------------------------------------------ 1-bit sign codes
class OneBitCoded(TableCoded):
    """A 1-bit sign plane decoded through a 2-entry table (``signbits.decode``)."""

    bits = 1

    def shape_dtype(self, ctx):
        shape, dtype = ctx
        return shape, dtype, math.prod(shape)


@register(OneBitCompressor, KIND)
class OneBitOnDevice(OneBitCoded):
    def compress(self, tensor, name, call):
        flat = tensor.reshape(-1)
        neg, _ = codes.sign_planes(flat.contiguous(), zero=False)
        wide = signbits.wide(ops, flat)
        total, mass = wide.sum(), ops.abs_sum(wide)
        n_neg = (flat < 0).sum().to(wide.dtype)
        n_pos = n_neg * -1 + flat.numel()
        sum_pos, sum_neg = (total + mass) * 0.5, (total - mass) * 0.5
        zero = torch.zeros_like(total)
        sum_pos = torch.where(sum_pos < 0, zero, sum_pos)
        sum_neg = torch.where(sum_neg > 0, zero, sum_neg)
        means = torch.stack([sum_pos / torch.clamp(n_pos, 1), sum_neg / torch.clamp(n_neg, 1)])
        return [neg, means.to(torch.float32)], (tuple(tensor.shape), ops.dtype(tensor))

    def table(self, payload, ctx):
        return payload[0], payload[1], None, 1


@register(EFSignSGDCompressor, KIND)
class EFSignSGDOnDevice(OneBitCoded):
    def compress(self, tensor, name, call):
        flat = tensor.reshape(-1)
        neg, _ = codes.sign_planes(flat.contiguous(), zero=False)
        scale = ops.abs_sum(signbits.wide(ops, flat)) / max(flat.numel(), 1)
        return [neg, scale.to(torch.float32).reshape(1)], (tuple(tensor.shape),
                                                           ops.dtype(tensor))

    def table(self, payload, ctx):
        scale = payload[1]
        return payload[0], torch.cat([scale, scale * -1.0]), None, 1

    def finish(self, total):
        return total / self.compressor.lr


# ------------------------------------------------------------------ pure signs
@register(SignSGDCompressor, KIND)
class SignSGDOnDevice(Reference):
    """signsgd: the planes from one kernel, the vote on the packed planes (``signbits.vote``),
    the signs decoded by one kernel that writes NaN everywhere when a status byte is set.
    Whether the zero plane travels (the payload's size) is the one value compress reads."""

    def _source(self, tensor, name):
        return tensor.reshape(-1)

    def compress(self, tensor, name, call):
        flat = self._source(tensor, name).contiguous()
        neg, zero = codes.sign_planes(flat, zero=True)
        # whether the zero plane travels (the payload's size) is the one value read back
        payload = signbits.pack_signs(ops, neg, zero, signbits.status(ops, flat))
        return [payload], (tuple(tensor.shape), ops.dtype(tensor))

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        n = tensor.numel()
        outs = [_flat_out(o, n, tensor.dtype) for o in
                ((error,) if decoded is None else (error, decoded))]
        if any(o is None for o in outs):
            return None
        payload, ctx = self.compress(tensor, name, call)
        flat = tensor.reshape(-1)
        signs = torch.sign(flat)
        bad = signbits.flag(ops, payload[0]) != 0
        nan = torch.full((), float("nan"), dtype=flat.dtype, device=flat.device)
        if len(outs) > 1:
            outs[1].copy_(torch.where(bad, nan, signs))
        outs[0].copy_(torch.where(bad, nan, flat - signs))
        return payload, ctx

    def combine_with_feedback(self, payloads, ctx, slot, out):
        return None     # two-phase then runs the server's steps one by one, on this path

    def _signs(self, pos, neg, status, ctx, out):
        shape, dtype = ctx
        n = math.prod(shape)
        flat = _flat_out(out, n)
        target = flat if flat is not None else torch.empty(n, dtype=torch.float32,
                                                           device=pos.device)
        codes.ternary(pos, neg, n, status, target)
        if flat is not None:
            return out
        return target.to(ops._DTYPES[dtype]).reshape(shape)

    def decompress(self, payload, ctx):
        return self.decompress_into(payload, ctx)

    def decompress_into(self, payload, ctx, out=None):
        packed = payload[0]
        neg, zero = signbits.planes(ops, packed, math.prod(ctx[0]))
        return self._signs(signbits.positive(ops, neg, zero), neg,
                           signbits.flag(ops, packed), ctx, out)

    def combine(self, payloads, ctx, out=None):
        pos, neg = signbits.vote(ops, [p[0] for p in payloads], math.prod(ctx[0]))
        status = sum(signbits.flag(ops, p[0]).to(torch.int32) for p in payloads)
        return self._signs(pos, neg, status, ctx, out)


@register(SignumCompressor, KIND)
class SignumOnDevice(SignSGDOnDevice):
    """signum: the momentum updated in its slot, then signsgd's planes of it."""

    def _source(self, tensor, name):
        c = self.compressor
        flat = tensor.reshape(-1)
        slot = c.state.zeros(f"momentum/{name}", ops, flat)
        ops.assign_lerp(slot, flat, 1.0 - c.momentum)
        return slot

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        return None     # signum decodes the signs of its momentum: the reference's rule


# ------------------------------------------------------------------ sparsifiers
@register(TopKCompressor, KIND)
class TopKOnDevice(Reference):
    """topk: ``torch.topk`` of the magnitudes, a selection of static shape. The same entries
    as the reference's, except that ties at the k-th magnitude may go to other positions
    (the reference gives them to the lowest) and the positions are not sorted."""

    def compress(self, tensor, name, call):
        return self._compress(tensor, name, take=False)

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        if decoded is not None or error is not tensor:
            return None
        return self._compress(tensor, name, take=True)

    def _compress(self, tensor, name, take):
        c = self.compressor
        n = tensor.numel()
        sparse.check_numel(n, "topk")
        if n == 0:
            return c.empty(ops, tensor)
        k = sparse.count_for(c.compress_ratio, n)
        flat = tensor.reshape(-1)
        positions = torch.topk(codes.magnitudes(flat), k, sorted=False).indices
        return c.pack(ops, tensor, positions, take)


@register(DgcCompressor, KIND)
class DgcOnDevice(Reference):
    """dgc: the sample and its threshold on the device; the candidates' count (the payload's
    size, data-dependent by definition) is the one value read back; ``torch.topk`` keeps the
    k largest of them when there are more."""

    def compress(self, tensor, name, call):
        c = self.compressor
        n = tensor.numel()
        sparse.check_numel(n, "dgc")
        if n == 0:
            return c.empty(ops, tensor)
        flat = tensor.reshape(-1)
        step = c.next_step(name, tensor)
        ratio = c.ratio_at(ops, step)
        k = sparse.ceil_count(ops, ratio * n, n)
        mag = codes.magnitudes(flat)
        if n < sparse.APPROX_MIN_NUMEL:
            return c.pack(ops, tensor, torch.topk(mag, k, sorted=False).indices)
        s = sparse.sample_size(n)
        picks = ops.choice(c.seed, name, step, n, s, like=flat)
        sampled = mag.index_select(0, picks)
        above = sparse.ceil_count(ops, ratio * s, s)
        thr = torch.kthvalue(sampled, s - above + 1).values
        cand = torch.nonzero(flat.abs() >= thr).reshape(-1)   # the one read-back: its length
        if cand.numel() > k:
            cand = cand.index_select(0, torch.topk(mag.index_select(0, cand), k,
                                                   sorted=False).indices)
        return c.pack(ops, tensor, cand)


@register(ThresholdCompressor, KIND)
class ThresholdOnDevice(Reference):
    """threshold: one comparison pass; the count of what passes is the one read-back."""

    def compress(self, tensor, name, call):
        c = self.compressor
        n = tensor.numel()
        sparse.check_numel(n, "threshold")
        if n == 0:
            return c.empty(ops, tensor)
        flat = tensor.reshape(-1)
        return c.pack(ops, tensor, torch.nonzero(flat.abs() > c.threshold).reshape(-1))


@register(AdaqCompressor, KIND)
class AdaqOnDevice(Reference):
    """adaq: the counts of positive and negative entries (which set the payload's size) are
    the one read-back; ``torch.topk`` takes each side's largest."""

    def compress(self, tensor, name, call):
        c = self.compressor
        n = tensor.numel()
        sparse.check_numel(n, "adaq")
        flat = tensor.reshape(-1)
        ctx = (tuple(tensor.shape), n)
        if n == 0:
            return [flat.new_zeros(2), flat.to(torch.int32)], ctx
        if n >= sparse.APPROX_MIN_NUMEL:
            c.next_step(name, tensor)    # the reference's step counter, kept in step
        counts = torch.stack([(flat > 0).sum(), (flat < 0).sum()]).tolist()
        sides, means = [], []
        for sign, count in zip((1, -1), counts):
            if count == 0:
                sides.append(flat.new_zeros(0, dtype=torch.int64))
                means.append(flat.new_zeros(()))
                continue
            k = sparse.ceil_count(ops, count * c.compress_ratio, n)
            where = _positions(flat > 0 if sign > 0 else flat < 0, count)
            values = flat.index_select(0, where)
            top = torch.topk(values if sign > 0 else -values, k, sorted=False).indices
            sides.append(where.index_select(0, top))
            means.append((values.index_select(0, top).to(torch.float64).sum() / k)
                         .to(flat.dtype))
        codes_ = torch.cat([sides[0], -1 - sides[1]]).to(torch.int32)
        return [torch.stack(means), codes_], ctx


@register(SketchCompressor, KIND)
class SketchOnDevice(TableCoded):
    """sketch: the sample sorted on the device, then one kernel for every element's bucket
    (a binary search of the edges' order keys) with each program's bucket sums and counts."""

    def __init__(self, compressor):
        super().__init__(compressor)
        self.bits = compressor._bits

    def compress(self, tensor, name, call):
        c = self.compressor
        _, x, layout = flat_f32(tensor)
        x = x.contiguous()
        n, q = layout.numel, c.quantiles
        step = c.next_step(name, tensor)
        if n == 0:
            return [x.new_zeros(0, dtype=torch.uint8), x.new_zeros(q)], layout
        sample = x
        if n > c.sample_size:
            sample = x.index_select(0, ops.choice(c.seed, name, step, n, c.sample_size, like=x))
        ranked = torch.sort(sample).values
        m = sample.numel()
        lo, hi, w = (codes.constant(("sketch", part, m, q), x.device,
                                    lambda part=part: _quantile_points(m, q)[part])
                     for part in range(3))
        below, above = ranked.index_select(0, lo), ranked.index_select(0, hi)
        edges = below + (above - below) * w
        packed, sums, counts = codes.sketch_encode(x, edges, q, self.bits)
        means = torch.where(counts > 0, sums / torch.clamp(counts, min=1.0),
                            torch.zeros_like(sums))
        return [packed, means], layout

    def table(self, payload, ctx):
        return payload[0], payload[1], None, 1


def _quantile_points(m: int, q: int):
    """The ranks ``(lo, hi)`` and weights ``w`` of sketch's ``q - 1`` inner quantiles of ``m``
    sorted values (linear interpolation: the reference's ``SketchCompressor._edges``)."""
    pos = np.arange(1, q) * (m - 1) / q
    lo = np.floor(pos).astype(np.int64)
    return lo, np.minimum(lo + 1, m - 1), (pos - lo).astype(np.float32)


@register(InceptionnCompressor, KIND)
class InceptionnOnDevice(Reference):
    """inceptionn: the tags in one pass; the three classes' counts (the payload's sizes) are
    the one read-back, then each class is gathered with a selection of that static size."""

    def compress(self, tensor, name, call):
        c = self.compressor
        _, x, layout = flat_f32(tensor)
        d = c._step
        q = x.abs() * (1.0 / d)
        tag = (~(q < 1.0)).to(torch.uint8) + (~(q < 128.0)).to(torch.uint8) \
            + (~(q < 32768.0)).to(torch.uint8)
        counts = torch.stack([(tag == t).sum() for t in (1, 2, 3)]).tolist()
        i1, i2, i3 = (_positions(tag == t, count) for t, count in zip((1, 2, 3), counts))
        v1 = (x.index_select(0, i1) * (1.0 / d)).to(torch.int8)
        v2 = (x.index_select(0, i2) * (1.0 / d)).to(torch.int16)
        v3 = tensor.reshape(-1).index_select(0, i3)
        return [codes.pack(tag, 2), v1, v2, v3], layout

    def decompress(self, payload, ctx):
        packed, v1, v2, v3 = payload
        n, d = ctx.numel, self.compressor._step
        tag = codes.unpack(packed, 2, n)
        out = torch.zeros(n, dtype=torch.float32, device=packed.device)
        out.index_copy_(0, _positions(tag == 1, v1.numel()), v1.to(torch.float32) * d)
        out.index_copy_(0, _positions(tag == 2, v2.numel()), v2.to(torch.float32) * d)
        out = restore(ops, out, ctx)
        raw = torch.zeros(n, dtype=v3.dtype, device=packed.device)
        raw.index_copy_(0, _positions(tag == 3, v3.numel()), v3)
        return out + raw.reshape(ctx.shape)


    def decompress_into(self, payload, ctx, out=None):
        return self.decompress(payload, ctx)

    def combine(self, payloads, ctx, out=None):
        return self.compressor.aggregate([self.decompress(p, ctx) for p in payloads])


def _positions(mask, count: int):
    """The positions of ``mask``'s set elements, of which there are ``count`` (known, so the
    selection has a static size: no read-back), ascending."""
    try:
        return torch.nonzero_static(mask, size=count).reshape(-1)
    except (NotImplementedError, RuntimeError):   # a device without nonzero_static
        rank = torch.cumsum(mask.reshape(-1), 0) - 1
        slot = torch.where(mask.reshape(-1), rank, count)
        out = torch.zeros(count + 1, dtype=torch.int64, device=mask.device)
        return out.scatter_(0, slot, torch.arange(mask.numel(), device=mask.device))[:count]

