"""The device path: each built-in compressor's speed path for torch tensors on a GPU (kind
``"cuda"`` of ``grace_dl.compressors.paths``), written for the device's rules.

- **Keyed randomness where the tensor lives**: dither words come from Philox inside the
  kernels, positions and samples from ``ops.choice`` on the device
  (``grace_dl.torch.kernels.philox``); nothing is drawn on the host.
- **No host synchronisation**: scalars (norms, scales, the status byte) stay device tensors
  that the kernels read; selections have static shapes (``select.top_positions``). Only
  payloads whose size depends on the data by definition (threshold, dgc, adaq, inceptionn)
  read one count.
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

from grace_dl.compressors import sparse
from grace_dl.compressors.adaq import AdaqCompressor
from grace_dl.compressors.dgc import DgcCompressor
from grace_dl.compressors.efsignsgd import EFSignSGDCompressor
from grace_dl.compressors.flat import dither_bits, flat_f32, restore
from grace_dl.compressors.inceptionn import InceptionnCompressor
from grace_dl.compressors.natural import NaturalCompressor
from grace_dl.compressors.onebit import OneBitCompressor
from grace_dl.compressors.paths import Reference, register
from grace_dl.compressors.qsgd import QSGDCompressor, QSGDPath
from grace_dl.compressors.signsgd import SignSGDCompressor, SignSGDPath
from grace_dl.compressors.signum import SignumCompressor
from grace_dl.compressors.sketch import SketchCompressor
from grace_dl.compressors.terngrad import TernGradCompressor
from grace_dl.compressors.threshold import ThresholdCompressor
from grace_dl.compressors.topk import TopKCompressor
from grace_dl.compressors.u8bit import _CELL_INDEX, _CELL_SPLIT, _TABLE, U8bitCompressor
from grace_dl.torch import ops
from grace_dl.torch.kernels import codes, philox, select

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
    views = [_flat_out(error, n)] if decoded is None else \
        [_flat_out(error, n), _flat_out(decoded, n)]
    return None if views[0] is None or views[-1] is None else views


# ------------------------------------------------------------------ table-coded methods
class TableCoded(Reference):
    """A method whose payload decodes through a table (``codes.decode``): one pass per
    payload, the ranks' payloads added into one buffer for ``combine``."""

    bits = 8

    def decoding(self, payload, ctx, n) -> dict:
        """``codes.decode``'s arguments for ``payload``: ``packed`` and ``table``, and as the
        method needs ``scale``, ``row``, ``divisor``, ``sign``."""
        raise NotImplementedError

    def shape_dtype(self, ctx):
        return ctx.shape, ctx.dtype, ctx.numel

    def finish(self, total):
        """What ``aggregate`` does to the sum of the decoded payloads (default: nothing)."""
        return total

    def _decode(self, payload, ctx, out=None, accumulate=False):
        shape, dtype, n = self.shape_dtype(ctx)
        args = self.decoding(payload, ctx, n)
        dtype = ops._DTYPES[dtype]
        flat = _flat_out(out, n) if dtype == torch.float32 else None
        target = flat if flat is not None else torch.empty(n, dtype=torch.float32,
                                                           device=args["packed"].device)
        codes.decode(bits=self.bits, n=n, out=target, accumulate=accumulate, **args)
        if flat is not None:
            return out
        return target.to(dtype).reshape(shape)

    def decompress(self, payload, ctx):
        return self._decode(payload, ctx)

    def decompress_into(self, payload, ctx, out=None):
        return self._decode(payload, ctx, out)

    def combine(self, payloads, ctx, out=None):
        shape, dtype, n = self.shape_dtype(ctx)
        if dtype != "float32":
            total = self._decode(payloads[0], ctx)
            for p in payloads[1:]:
                total = total + self._decode(p, ctx)
            return self.finish(total)
        total = self._decode(payloads[0], ctx, out)
        flat = total.view(-1)
        for p in payloads[1:]:
            codes.decode(bits=self.bits, n=n, out=flat, accumulate=True,
                         **self.decoding(p, ctx, n))
        return self.finish(total)


@register(QSGDCompressor, KIND)
class QSGDOnDevice(TableCoded, QSGDPath):
    """qsgd: one kernel for the codes (and the row norms, the error and the decoding)."""

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
        step = c.next_step(name, tensor)
        s = c.quantum_num
        packed, norms = codes.qsgd_encode(x.contiguous(), c.bucket_size, float(s), 2 * s,
                                          self.bits, dither_bits(s),
                                          philox.device_key(c.seed, name), step, call.rank,
                                          error, decoded)
        return [packed, norms], layout

    def decoding(self, payload, ctx, n):
        packed, norms = payload
        s, bits = self.compressor.quantum_num, self.bits
        table = codes.constant(("qsgd levels", s, bits), packed.device,
                               lambda: np.arange(1 << bits, dtype=np.float32) - s)
        return dict(packed=packed, table=table, scale=norms, row=self.compressor.bucket_size,
                    divisor=float(s))


@register(TernGradCompressor, KIND)
class TernGradOnDevice(TableCoded):
    """terngrad: one kernel for the largest magnitude, one for the codes."""

    bits = 2

    def compress(self, tensor, name, call):
        c = self.compressor
        _, x, layout = flat_f32(tensor)
        step = c.next_step(name, tensor)
        packed, scaler = codes.terngrad_encode(x.contiguous(), philox.device_key(c.seed, name),
                                               step, call.rank)
        return [packed, scaler], layout

    def decoding(self, payload, ctx, n):
        packed, scaler = payload
        table = codes.constant("-1..2", packed.device,
                               lambda: np.arange(4, dtype=np.float32) - 1.0)
        return dict(packed=packed, table=table, scale=scaler, row=n)


@register(NaturalCompressor, KIND)
class NaturalOnDevice(TableCoded):
    """natural: one kernel for the largest magnitude, one for the codes and the window."""

    def compress(self, tensor, name, call):
        c = self.compressor
        _, x, layout = flat_f32(tensor)
        step = c.next_step(name, tensor)
        out, base = codes.natural_encode(x.contiguous(), philox.device_key(c.seed, name), step,
                                         call.rank)
        return [out, base], layout

    def decoding(self, payload, ctx, n):
        packed, base = payload
        return dict(packed=packed, table=codes.natural_table(base))


@register(U8bitCompressor, KIND)
class U8bitOnDevice(TableCoded):
    """u8bit: one kernel for the largest magnitude, one for the codes."""

    def compress(self, tensor, name, call):
        _, x, layout = flat_f32(tensor)
        index = codes.constant("u8bit cell index", x.device, lambda: _CELL_INDEX)
        split = codes.constant("u8bit cell split", x.device, lambda: _CELL_SPLIT)
        return list(codes.u8bit_encode(x.contiguous(), index, split)), layout

    def decoding(self, payload, ctx, n):
        packed, scaler = payload
        table = codes.constant("u8bit table", packed.device,
                               lambda: np.concatenate([_TABLE, -_TABLE]))
        return dict(packed=packed, table=table, scale=scaler, row=n)


# ------------------------------------------------------------------ 1-bit sign codes
class OneBitCoded(TableCoded):
    """A 1-bit sign plane decoded through a 2-entry table (``signbits.decode``). float64
    tensors keep the reference (its sums are float64)."""

    bits = 1

    def shape_dtype(self, ctx):
        shape, dtype = ctx
        return shape, dtype, math.prod(shape)

    def compress(self, tensor, name, call):
        if tensor.dtype == torch.float64:
            return super().compress(tensor, name, call)
        return list(self.encode(tensor.reshape(-1).contiguous())), (tuple(tensor.shape),
                                                                    ops.dtype(tensor))


@register(OneBitCompressor, KIND)
class OneBitOnDevice(OneBitCoded):
    """onebit: one kernel for the sign plane and its partial sums, one for the two means."""

    encode = staticmethod(codes.onebit_encode)

    def decoding(self, payload, ctx, n):
        return dict(packed=payload[0], table=payload[1])


@register(EFSignSGDCompressor, KIND)
class EFSignSGDOnDevice(OneBitCoded):
    """efsignsgd: one kernel for the sign plane and its partial sums, one for the scale."""

    encode = staticmethod(codes.efsign_encode)

    def decoding(self, payload, ctx, n):
        return dict(packed=payload[0], table=payload[1], sign=True)

    def finish(self, total):
        return total / self.compressor.lr


# ------------------------------------------------------------------ pure signs
@register(SignSGDCompressor, KIND)
class SignSGDOnDevice(SignSGDPath):
    """signsgd: one kernel writes the planes into the payload's buffer and the NaN/zero flags (and,
    with an error slot, one more what the signs lose), one decodes a payload, and the vote is a
    kernel per rank's payload counting into one integer an element and one decoding the counts
    (NaN everywhere when a status says so). Whether the zero plane travels (the payload's size)
    is the one value compress reads, unless the communicator exchanges the payload's length
    itself (``call.exchanges_sizes``: allgather, two-phase): then the payload is the whole
    buffer, both planes and the status byte (a valid payload as it is: without exact zeros its
    zero plane is clear but for the status written over its first byte, which only a NaN step
    sets), and ``sent_lengths`` says on the device how much of it is sent, read in that
    exchange."""

    def _source(self, tensor, name):
        return tensor.reshape(-1)

    def compress(self, tensor, name, call):
        flat = self._source(tensor, name).contiguous()
        ctx = (tuple(tensor.shape), ops.dtype(tensor))
        n = flat.numel()
        if n == 0:
            return [torch.zeros(1, dtype=torch.uint8, device=flat.device)], ctx
        buf, flags = codes.sign_payload(flat)
        if call.exchanges_sizes:
            return [buf], ctx
        zeros = flags[1:2].tolist()[0]     # the one read-back: the payload's size
        nbytes = codes.packed_size(n, 1)
        return [buf[:(2 * nbytes if zeros else nbytes) + 1]], ctx

    def sent_lengths(self, payload, ctx):
        """The negative plane and the status byte, and the zero plane where the status
        byte (the buffer's last, whole or cut) says it travels."""
        packed = payload[0]
        nbytes = codes.packed_size(math.prod(ctx[0]), 1)
        # the length by the status byte (``NONFINITE | ZEROS``: 0 to 3), from a table
        table = codes.constant(("sign lengths", nbytes), packed.device, lambda: np.array(
            [nbytes + 1, nbytes + 1, 2 * nbytes + 1, 2 * nbytes + 1], dtype=np.int32))
        return table.index_select(0, packed[-1:].to(torch.int32))

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        n = tensor.numel()
        outs = [_flat_out(o, n, tensor.dtype) for o in
                ((error,) if decoded is None else (error, decoded))]
        if any(o is None for o in outs):
            return None
        payload, ctx = self.compress(tensor, name, call)
        codes.sign_error(tensor.reshape(-1).contiguous(), payload[0][-1:], *outs)
        return payload, ctx

    def error_finite(self, payload):
        """Always: ``codes.sign_error`` leaves a non-finite step's error at 0 itself (the
        clean-up the memory would run)."""
        return True

    def combine_with_feedback(self, payloads, ctx, slot, out):
        return None     # two-phase then runs the server's steps one by one, on this path

    @staticmethod
    def _signs(ctx, out, device, write):
        """``write(n, target)`` decodes the signs into a 1-D float32 ``target``: ``out``'s
        view where it can hold them, else a new tensor, returned in the ctx's dtype and
        shape."""
        shape, dtype = ctx
        n = math.prod(shape)
        flat = _flat_out(out, n)
        target = flat if flat is not None else torch.empty(n, dtype=torch.float32,
                                                           device=device)
        write(n, target)
        if flat is not None:
            return out
        return target.to(ops._DTYPES[dtype]).reshape(shape)

    def decompress(self, payload, ctx):
        return self.decompress_into(payload, ctx)

    def decompress_into(self, payload, ctx, out=None):
        packed = payload[0]
        return self._signs(ctx, out, packed.device,
                           lambda n, target: codes.sign_decode(packed, n, target))

    def combine(self, payloads, ctx, out=None):
        first = payloads[0][0]
        return self._signs(ctx, out, first.device, lambda n, target: codes.sign_vote(
            [p[0] for p in payloads], n, target))


@register(SignumCompressor, KIND)
class SignumOnDevice(SignSGDOnDevice):
    """signum: the momentum updated in its slot, then signsgd's planes of it."""

    def _source(self, tensor, name):
        return self.compressor.momentum_step(ops, tensor, name)

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        return None     # signum decodes the signs of its momentum: the reference's rule


# ------------------------------------------------------------------ sparsifiers
@register(TopKCompressor, KIND)
class TopKOnDevice(sparse.SparsePath):
    """topk: the k largest magnitudes by a selection of static shape
    (``select.top_positions``): from ``select.RADIX_MIN`` elements the reference's positions
    (ties to the lowest, ascending), below it ``torch.topk``'s (ties its own way)."""

    def compress(self, tensor, name, call):
        c = self.compressor
        n = tensor.numel()
        sparse.check_numel(n, "topk")
        if n == 0:
            return c.empty(ops, tensor)
        k = sparse.count_for(c.compress_ratio, n)
        return c.pack(ops, tensor, select.top_positions(tensor.reshape(-1), k))


@register(DgcCompressor, KIND)
class DgcOnDevice(sparse.SparsePath):
    """dgc: the sample's magnitudes drawn by one kernel (with replacement: the reference's
    distinct positions but for repeats, about ``s / 2n`` of the draws, without the sort that
    finds them) and its threshold on the device; the candidates' count (the payload's size,
    data-dependent by definition) is the one value read back; ``select.top_positions`` keeps the
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
        if n < sparse.APPROX_MIN_NUMEL:
            return c.pack(ops, tensor, select.top_positions(flat, k))
        s = sparse.sample_size(n)
        flat = flat.contiguous()
        sampled = philox.sampled_magnitudes(philox.device_key(c.seed, name), step, n, s, flat)
        above = sparse.ceil_count(ops, ratio * s, s)
        # the above-th largest sampled magnitude (a sort: kthvalue runs on one block of
        # threads for a single row, a sort on all of them); a NaN ranks as -1, below which
        # |x| >= thr keeps every number, as >= 0 does
        thr = torch.sort(sampled).values[s - above:s - above + 1].clamp(min=0.0)
        cand = torch.nonzero(codes.above(flat, thr, strict=False)).reshape(-1)  # one read-back
        if cand.numel() > k:
            cand = cand.index_select(0, select.top_positions(flat.index_select(0, cand), k))
        return c.pack(ops, tensor, cand)


@register(ThresholdCompressor, KIND)
class ThresholdOnDevice(sparse.SparsePath):
    """threshold: one comparison pass; the count of what passes is the one read-back."""

    def compress(self, tensor, name, call):
        c = self.compressor
        n = tensor.numel()
        sparse.check_numel(n, "threshold")
        if n == 0:
            return c.empty(ops, tensor)
        flat = tensor.reshape(-1).contiguous()
        keep = codes.above(flat, c.threshold, strict=True) if flat.dtype == torch.float32 \
            else flat.abs() > c.threshold
        return c.pack(ops, tensor, torch.nonzero(keep).reshape(-1))


@register(AdaqCompressor, KIND)
class AdaqOnDevice(Reference):
    """adaq: the counts of positive and negative entries (which set the payload's size) are
    the one read-back; ``select.top_positions`` of each sign takes each side's largest."""

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
        # the one read-back: the sides' sizes
        counts = torch.stack([(flat > 0).sum(), (flat < 0).sum()]).tolist()
        sides, means = [], []
        for sign, count in zip((1, -1), counts):
            if count == 0:
                sides.append(flat.new_zeros(0, dtype=torch.int64))
                means.append(flat.new_zeros(()))
                continue
            k = sparse.ceil_count(ops, count * c.compress_ratio, n)
            top = select.top_positions(flat, k, sign)     # k <= count: all of the side's sign
            sides.append(top)
            means.append((flat.index_select(0, top).to(torch.float64).sum() / k).to(flat.dtype))
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
        packed, sums, counts = codes.sketch_encode(x, codes.sketch_edge_keys(ranked, lo, hi, w),
                                                   q, self.bits)
        # (an empty bucket's sum is +0: the reference's where(counts > 0, ..., 0))
        return [packed, sums / torch.clamp(counts, min=1.0)], layout

    def decoding(self, payload, ctx, n):
        return dict(packed=payload[0], table=payload[1])


def _quantile_points(m: int, q: int):
    """The ranks ``(lo, hi)`` and weights ``w`` of sketch's ``q - 1`` inner quantiles of ``m``
    sorted values (linear interpolation: the reference's ``SketchCompressor._edges``)."""
    pos = np.arange(1, q) * (m - 1) / q
    lo = np.floor(pos).astype(np.int64)
    return lo, np.minimum(lo + 1, m - 1), (pos - lo).astype(np.float32)


@register(InceptionnCompressor, KIND)
class InceptionnOnDevice(Reference):
    """inceptionn: one kernel for the tags and each program's class counts, one that writes
    every element into its class's list; the classes' sizes (the payload's, data-dependent by
    definition) are the one read-back. Decoding: the counts from the tags, then one pass."""

    def compress(self, tensor, name, call):
        _, x, layout = flat_f32(tensor)
        return list(codes.inceptionn_encode(x.contiguous(), tensor.reshape(-1).contiguous(),
                                            self.compressor._step)), layout

    def decompress(self, payload, ctx):
        out = codes.inceptionn_decode(*payload, ctx.numel, self.compressor._step)
        return restore(ops, out, ctx)

    def decompress_into(self, payload, ctx, out=None):
        return self.decompress(payload, ctx)

    def combine(self, payloads, ctx, out=None):
        return self.compressor.aggregate([self.decompress(p, ctx) for p in payloads])
