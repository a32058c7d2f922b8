"""The CPU path: grace_dl's compiled kernels (``grace_dl.native``) as the speed paths of kind
``"cpu"`` (torch tensors in host memory; ``grace_dl.compressors.paths``).

Kept where a committed measurement shows that they change a training step by more than the
host's noise (the MLP's step with the kernels against their NumPy twins, in
``docs/DECISIONS.md``): signsgd and signum (planes, decoding, two-phase's server step), qsgd
(levels and values) and the sparsifiers (their selection: the exact top-k, the scan and the
radix select, ``COMPILED``; the ranks' values summed into one buffer). Each path gives the
reference's own bits (the kernels do the same float operations in the same order;
``tests/test_native.py`` holds each kernel to its twin) and falls back to the reference
wherever a kernel does not apply (not float32, not contiguous, no compiled library).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from grace_dl import native
from grace_dl.compressors import signbits, signsgd, sparse
from grace_dl.compressors.adaq import AdaqCompressor
from grace_dl.compressors.base import error_views
from grace_dl.compressors.dgc import DgcCompressor
from grace_dl.compressors.flat import Layout, dither_bits, pack, unpack
from grace_dl.compressors.paths import Reference, register
from grace_dl.compressors.qsgd import QSGDCompressor, QSGDPath, _bucket_norms
from grace_dl.compressors.randomk import RandomKCompressor, RandomKPath
from grace_dl.compressors.signum import SignumCompressor
from grace_dl.compressors.threshold import ThresholdCompressor
from grace_dl.compressors.topk import TopKCompressor
from grace_dl.torch import ops

KIND = "cpu"


def _arrays(*tensors):
    """NumPy views of CPU tensors (None stays None); None if any tensor is elsewhere or of a
    dtype NumPy lacks (bfloat16): the kernels' inputs."""
    out = []
    try:
        for t in tensors:
            if t is None:
                out.append(None)
            elif t.device.type != "cpu":
                return None
            else:
                out.append(t.detach().numpy())
    except TypeError:
        return None
    return out


def _from(array):
    return None if array is None else torch.from_numpy(array)


# ------------------------------------------------------------------ signs
def _flagged(packed) -> bool:
    """Whether a pure-sign payload's flag says its input held a NaN or an Inf (read on the
    host: the CPU path's payloads are there)."""
    return bool(signbits.flagged(ops, signbits.flag(ops, packed)))


@register(signsgd.SignSGDCompressor, KIND)
class SignSGDOnCpu(signsgd.SignSGDPath):
    """signsgd: both planes and the status in one compiled pass (``native.sign_planes``, with
    the error and decoding for error feedback), the signs decoded by another
    (``native.ternary``), two-phase's server step in a third (``native.sign_vote_feedback``)."""

    def _source(self, tensor, name):
        return tensor.reshape(-1)

    def _planes(self, flat, *outs):
        arrays = _arrays(flat, *outs)
        return _from(None if arrays is None else native.sign_planes(*arrays))

    def compress(self, tensor, name, call):
        flat = self._source(tensor, name)
        full = self._planes(flat)
        if full is None:
            return super().compress(tensor, name, call)
        return [signsgd.from_full(ops, full, flat.numel())], (tuple(tensor.shape),
                                                               ops.dtype(tensor))

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        outs = error_views(tensor, error, decoded, ops.dtype(tensor))
        full = None if outs is None else self._planes(tensor.reshape(-1), *outs)
        if full is None:
            return super().compress_with_error(tensor, name, call, error, decoded)
        payload = [signsgd.from_full(ops, full, tensor.numel())]
        if _flagged(payload[0]):
            signsgd.all_nan(ops, outs)     # as decoding gives
        return payload, (tuple(tensor.shape), ops.dtype(tensor))

    def error_finite(self, payload):
        """The payload's NaN/Inf flag, read on the host: without one, the error left is
        x - sign(x) of finite x (the chunk's, or the server's slot + vote), finite."""
        return not _flagged(payload[0])

    def _signs(self, pos, neg, status, ctx, out):
        shape, dtype = ctx
        n = math.prod(shape)
        flat = None if out is None else ops.flat_view(out)
        target = flat if flat is not None and flat.dtype == torch.float32 else None
        if dtype == "float32" and not bool(signbits.flagged(ops, status)):
            if target is None:
                target = torch.empty(n, dtype=torch.float32)
            arrays = _arrays(pos, neg, target)
            if arrays is not None and native.ternary(arrays[0], arrays[1], n, arrays[2]) \
                    is not None:
                return out if target is flat else target.reshape(shape)
        return signsgd.SignSGDCompressor._signs(ops, pos, neg, status, shape, dtype, out)

    def decompress(self, payload, ctx):
        return self.decompress_into(payload, ctx)

    def decompress_into(self, payload, ctx, out=None):
        packed = payload[0]
        neg, zero = signbits.planes(ops, packed, math.prod(ctx[0]))
        return self._signs(signbits.positive(ops, neg, zero), neg, signbits.flag(ops, packed),
                           ctx, out)

    def combine(self, payloads, ctx, out=None):
        pos, neg = signbits.vote(ops, [p[0] for p in payloads], math.prod(ctx[0]))
        return self._signs(pos, neg, signsgd.statuses(ops, payloads), ctx, out)

    def combine_with_feedback(self, payloads, ctx, slot, out):
        """The vote, added to the server's residual ``slot`` and re-encoded, its error left in
        ``slot`` and its signs in ``out``, in one compiled pass over the chunk: the same
        floats as the three steps. None where that does not apply (a rank's status byte set:
        the steps then spell out the NaN)."""
        shape, dtype = ctx
        slot_flat, out_flat = ops.flat_view(slot), ops.flat_view(out)
        if dtype != "float32" or slot_flat is None or out_flat is None or \
                bool(signbits.flagged(ops, signsgd.statuses(ops, payloads))):
            return None
        n = math.prod(shape)
        arrays = _arrays(slot_flat, out_flat, *(signsgd.to_full(ops, p[0], n) for p in payloads))
        full = None if arrays is None else native.sign_vote_feedback(arrays[2:], n, arrays[0],
                                                                     arrays[1])
        if full is None:
            return None
        payload = signsgd.from_full(ops, torch.from_numpy(full), n)
        if _flagged(payload):
            signsgd.all_nan(ops, (slot_flat, out_flat))
        return [payload]


@register(SignumCompressor, KIND)
class SignumOnCpu(SignSGDOnCpu):
    """signum: the momentum updated in its slot, then signsgd's compiled planes of it."""

    def _source(self, tensor, name):
        return self.compressor.momentum_step(ops, tensor, name)

    def compress(self, tensor, name, call):
        flat = self._source(tensor, name)
        full = self._planes(flat)
        if full is None:
            payload = self.compressor._encode(ops, flat)
        else:
            payload = [signsgd.from_full(ops, full, flat.numel())]
        return payload, (tuple(tensor.shape), ops.dtype(tensor))

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        return None     # signum decodes the signs of its momentum: the reference's rule


# ------------------------------------------------------------------ qsgd
def _qsgd_levels(x, scale, step, k, s, hi, error=None, decoded=None):
    arrays = _arrays(x, scale, step, k, error, decoded)
    if arrays is None:
        return None
    x_, scale_, step_, k_, err_, dec_ = arrays
    return _from(native.qsgd_levels(x_, scale_.reshape(-1), step_.reshape(-1), k_, s, hi, err_,
                                    dec_))


def _qsgd_values(codes, step, s, out, accumulate=False):
    arrays = _arrays(codes, step, out)
    if arrays is None or native.qsgd_values(arrays[0], arrays[1].reshape(-1), s, arrays[2],
                                            accumulate) is None:
        return None
    return out


@register(QSGDCompressor, KIND)
class QSGDOnCpu(QSGDPath):
    """qsgd: every bucket's levels (with the error and decoding) in one compiled pass
    (``native.qsgd_levels``) and its values in another (``native.qsgd_values``), the short last
    bucket padded to a row of its own, plain torch views around them: the reference's float
    operations in its order, so its bits, in a few Python calls. A float32 contiguous tensor
    (and outputs) only; any other goes the reference's way, its whole buckets by the same
    kernels where they apply."""

    def compress(self, tensor, name, call):
        return self._compress(tensor, name, call, ())

    def error_finite(self, payload):
        """From the bucket norms, read on the host (one float per bucket): where all are
        finite and below 1e38, every bucket's input and decoding are finite and at most its
        norm in magnitude, so the error (their difference) is finite."""
        norms = payload[1]
        return norms.numel() == 0 or bool(norms.abs().max() < 1e38)

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        if tensor.dtype != torch.float32:
            return None
        outs = error_views(tensor, error, decoded, "float32")
        return None if outs is None else self._compress(tensor, name, call, outs)

    def _compress(self, tensor, name, call, outs):
        c = self.compressor
        n = tensor.numel()
        if not (native._enabled and n and tensor.dtype == torch.float32
                and tensor.device.type == "cpu" and tensor.is_contiguous()):
            return c._compress(tensor, name, call, outs, fast_levels=_qsgd_levels)
        q, b = c.quantum_num, c.bucket_size
        s, hi = float(q), 2 * q
        nb, full = -(-n // b), n // b
        body, tail = full * b, n - full * b
        x = tensor.detach().reshape(-1)
        k = ops.dither(c.seed, name, c.next_step(name, tensor), nb * b, dither_bits(q), like=x,
                       stream=call.rank)
        # (rows of x, of the dither, of each output, the rows' buckets): the whole buckets and
        # the short last one (its x copied before any output, which may be x's memory, is
        # written; its outputs rows of their own). Loops, not comprehensions: a frame each.
        parts, norms = [], []
        if full:
            written = []
            for o in outs:
                written.append(o[:body].view(full, b))
            parts.append((x[:body].view(full, b), k[:body].view(full, b), written,
                          slice(0, full)))
        if tail:
            short = x.new_zeros(1, b)
            short[0, :tail] = x[body:]
            rows = []
            for _ in outs:
                rows.append(x.new_empty(1, b))
            parts.append((short, k[body:].view(1, b), rows, slice(full, nb)))
        for rows, _, _, at in parts:
            m = torch.linalg.vector_norm(rows, dim=1)
            norms.append(m if bool(torch.isfinite(torch.sum(m))) else
                         _bucket_norms(ops, rows, at.stop - at.start))
        norms = norms[0] if len(norms) == 1 else torch.cat(norms)
        scale = torch.where(norms > 0, s / norms, torch.zeros_like(norms)).numpy()
        step = (norms / s).numpy()
        codes = []
        for rows, dither, written, at in parts:
            codes.append(native.qsgd_levels(rows.numpy(), scale[at], step[at], dither.numpy(),
                                            s, hi, *map(torch.Tensor.numpy, written)))
        if tail:
            for o, row in zip(outs, parts[-1][2]):
                o[body:] = row[0, :tail]
        codes = torch.from_numpy(codes[0] if len(codes) == 1 else
                                 np.concatenate(codes).reshape(-1)).view(-1)[:n]
        return [pack(ops, codes, c._bits), norms], Layout(tuple(tensor.shape), "float32", n)

    def decompress(self, payload, ctx):
        return self._decode(payload, ctx)

    def decompress_into(self, payload, ctx, out=None):
        return self._decode(payload, ctx, out)

    def combine(self, payloads, ctx, out=None):
        """``QSGDCompressor._combine`` by this path's decoding: the first payload decoded into
        ``out``, each other one added to it."""
        total = self._decode(payloads[0], ctx, out)
        if len(payloads) == 1 or ctx.dtype != "float32" or not total.is_contiguous():
            return self.compressor.aggregate(
                [total, *(self.decompress(p, ctx) for p in payloads[1:])])
        for payload in payloads[1:]:
            self._decode(payload, ctx, total, accumulate=True)
        return total

    def _decode(self, payload, ctx, out=None, accumulate=False):
        """``QSGDCompressor._decode`` (into ``out`` where it is a float32 contiguous CPU
        tensor, else a new one), by the kernel on every bucket."""
        c = self.compressor
        packed, norms = payload
        n = ctx.numel
        if out is None and ctx.dtype == "float32" and not accumulate:
            out = torch.empty(ctx.shape)
        if not (native._enabled and n and ctx.dtype == "float32" and out is not None
                and out.dtype == torch.float32 and out.device.type == "cpu"
                and out.is_contiguous() and packed.device.type == "cpu"):
            return c._decode(payload, ctx, out, accumulate, fast_values=_qsgd_values)
        b, s = c.bucket_size, float(c.quantum_num)
        nb, full = -(-n // b), n // b
        body, tail = full * b, n - full * b
        codes = unpack(ops, packed, c._bits, n)
        step = (norms / s).numpy()
        flat = out.view(-1)
        if full:
            native.qsgd_values(codes[:body].view(full, b).numpy(), step[:full], s,
                               flat[:body].view(full, b).numpy(), accumulate)
        if tail:
            short, into = codes.new_zeros(1, b), flat.new_zeros(1, b)
            short[0, :tail] = codes[body:]
            if accumulate:
                into[0, :tail] = flat[body:]
            native.qsgd_values(short.numpy(), step[full:nb], s, into.numpy(), accumulate)
            flat[body:] = into[0, :tail]
        return out


# ------------------------------------------------------------------ sparsifiers
def _top_positions(flat, k, sign=None):
    """The positions ``sparse.top_of`` picks, by compiled passes and a compiled radix select
    (``native.top_positions``); None where that does not apply."""
    if flat.device.type != "cpu" or flat.dtype != torch.float32 or torch.is_tensor(k):
        return None
    return _from(native.top_positions(flat.detach().numpy(), int(k), sign))


def _sparse_sum(out, positions, values):
    """``out`` = the sparse tensors ``values[r]`` at ``positions[r]`` summed, zeroed and summed
    block by block in one compiled pass (``native.sparse_sum``: the bits of one scatter-add of
    them joined); None where that does not apply."""
    arrays = _arrays(out.view(-1), *positions, *values) if out.is_contiguous() else None
    if arrays is None:
        return None
    ranks = len(positions)
    got = native.sparse_sum(arrays[0], arrays[1:1 + ranks], arrays[1 + ranks:])
    return None if got is None else out


class _Compiled(sparse.Selection):
    """The sparsifiers' selection by compiled passes where they apply (host float32): the
    exact top-k (``native.top_positions``), the scan (``native.positions_at_least``) and the
    radix select (``native.kth_largest``); elsewhere the framework's ops."""

    def top(self, flat, k, sign=None):
        return _top_positions(flat, k, sign)

    def at_least(self, ops, flat, thr, sign=None):
        if flat.device.type == "cpu" and flat.dtype == torch.float32:
            got = native.positions_at_least(flat.detach().numpy(),
                                            thr.item() if torch.is_tensor(thr) else thr, sign)
            if got is not None:
                return torch.from_numpy(got)
        return ops.positions_at_least(flat, thr, sign)

    def kth_largest(self, ops, x, k):
        if x.device.type == "cpu" and x.dtype == torch.float32:
            got = native.kth_largest(x.detach().numpy(), int(k))
            if got is not None:
                return torch.tensor(got, dtype=x.dtype)
        return ops.kth_largest(x, k)


COMPILED = _Compiled()


class SparseOnCpu(sparse.SparsePath):
    """The ranks' values summed into the output buffer in one compiled pass."""

    fast_sum = staticmethod(_sparse_sum)


@register(TopKCompressor, KIND)
@register(DgcCompressor, KIND)
@register(ThresholdCompressor, KIND)
class SelectionOnCpu(SparseOnCpu):
    """topk, dgc and threshold: their positions found by compiled passes (``COMPILED``)."""

    def compress(self, tensor, name, call):
        return self.compressor._compress(tensor, name, select=COMPILED)


@register(AdaqCompressor, KIND)
class AdaqOnCpu(Reference):
    """adaq: each side's selection by compiled passes (``COMPILED``)."""

    def compress(self, tensor, name, call):
        return self.compressor._compress(tensor, name, select=COMPILED)


@register(RandomKCompressor, KIND)
class RandomKOnCpu(RandomKPath):
    """The ranks' summed values scattered into the output buffer in one compiled pass."""

    fast_sum = staticmethod(_sparse_sum)
