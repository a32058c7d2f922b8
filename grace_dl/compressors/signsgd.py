"""``signsgd``: signSGD with majority vote (Bernstein, Wang, Azizzadenesheli, Anandkumar 2018,
"signSGD: Compressed Optimisation for Non-Convex Problems"; Bernstein, Zhao, Azizzadenesheli,
Anandkumar 2019, "signSGD with Majority Vote is Communication Efficient and Fault Tolerant").

Each rank sends the sign of its gradient, -1, 0 or +1; the aggregate is the majority vote, the
sign of the sum of the ranks' signs (+1, -1, or 0 where the vote ties or every rank's entry is
zero), and it is *not* divided by the number of ranks (``average = False``). Zero is sent as
zero, not as +1: a parameter with no gradient (unused this step, frozen, an embedding row no
sample looked up) gets a vote of 0 and does not move, as under plain Horovod.

Wire, for ``n`` elements: one uint8 tensor (``signbits.pack_signs``): the packed sign bits
(1 bit per element, bit 1 = negative: see ``signbits``), then, only if the tensor holds an
exact zero, the packed zero bits (bit 1 = the element is exactly zero), then one status byte
(bit 0: the input held a NaN or an Inf; bit 1: the zero plane is there). So **1 bit per element**
plus 8 bits per tensor, ``ceil(n/8) + 1`` bytes, for a tensor without zeros, and 2 bits per
element for one with zeros; any dtype in, the same bytes out. Decompression gives -1, 0, +1 in
the input's dtype, or NaN everywhere when the status says NaN/Inf, and the vote keeps a NaN (in
torch as in TF), so a NaN/Inf gradient is not silently turned into a vote.

Biased (it keeps only signs); not allreduce-safe (signs must be gathered, not summed, for the
vote); the payload's size depends on the data (``equal_sizes`` False: whether it has zeros), so
on a GPU its size is read once: in the exchange of sizes of the gathering communicators
(allgather, two-phase: ``Call.exchanges_sizes``), else by compress; two-phase safe: the vote is
elementwise, so chunks vote independently (the second phase re-sends the voted signs, the
parameter-server scheme of the paper; a tie travels as 0).
"""

from __future__ import annotations

import math

from grace_dl.backend import ops_for
from grace_dl.compressors import paths, signbits
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor, error_views
from grace_dl.registry import register_compressor


@register_compressor("signsgd")
class SignSGDCompressor(Compressor):
    caps = Capabilities(equal_sizes=False, average=False, two_phase_safe=True)

    def __init__(self):
        super().__init__()

    def compress(self, tensor, name, call=LOCAL):
        ops = ops_for(tensor)
        return self._encode(ops, ops.flatten(tensor)), (ops.shape(tensor), ops.dtype(tensor))

    @staticmethod
    def _encode(ops, flat):
        return [signbits.pack_signs(ops, signbits.encode(ops, flat),
                                    ops.pack_compare(flat, "eq", 0), signbits.status(ops, flat))]

    def decompress(self, payload, ctx):
        return self._unpack(payload, ctx)

    def _unpack(self, payload, ctx, out=None):
        """The signs decoded from the two planes in one table-lookup pass
        (``signbits.ternary``), into ``out`` when it has a flat view (torch), else into a new
        tensor; NaN everywhere when the status byte is set."""
        shape, dtype = ctx
        packed = payload[0]
        ops = ops_for(packed)
        neg, zero = signbits.planes(ops, packed, math.prod(shape))
        return self._signs(ops, signbits.positive(ops, neg, zero), neg,
                           signbits.flag(ops, packed), shape, dtype, out)

    @staticmethod
    def _signs(ops, pos, neg, status, shape, dtype, out):
        """+1/-1/0 from the planes in ``shape`` and ``dtype`` (in ``out`` where it has a flat
        view), or NaN everywhere when ``status`` is set."""
        n = math.prod(shape)
        flat = None if out is None else ops.flat_view(out)
        if flat is not None and ops.dtype(flat) != dtype:
            flat = None

        def nan():
            full = ops.full([n], float("nan"), dtype, like=pos)
            return full if flat is None else ops.assign(flat, full)

        got = ops.cond(signbits.flagged(ops, status), nan,
                       lambda: signbits.ternary(ops, pos, neg, n, dtype, flat))
        return out if flat is not None else ops.reshape(got, shape)

    def aggregate(self, tensors):
        """Majority vote: the sign of the sum of the ranks' -1/0/+1 (0 where the vote ties);
        NaN where a rank sent NaN (``torch.sign`` alone would make it 0)."""
        total = super().aggregate(tensors)
        ops = ops_for(total)
        return ops.where(total == total, ops.sign(total), total)

    def payload_nbytes(self, numel, dtype="float32"):
        """``ceil(numel / 8)`` sign bytes + 1 status byte, whatever the input dtype, for a
        tensor without exact zeros (one with zeros sends ``ceil(numel / 8)`` more)."""
        return math.ceil(numel / 8) + 1


def statuses(ops, payloads):
    """The sum of the ranks' status bytes (int32): non-zero when any rank had a NaN or Inf."""
    status = None
    for (packed,) in payloads:
        flag = ops.cast(signbits.flag(ops, packed), "int32")
        status = flag if status is None else status + flag
    return status


def from_full(ops, full, n):
    """The payload (``signbits.pack_signs``) of both planes and a status byte laid out one
    after the other (the compiled kernels' output: ``2 ceil(n/8) + 1`` bytes)."""
    nbytes = -(-n // 8)
    return signbits.pack_signs(ops, ops.slice(full, 0, nbytes),
                               ops.slice(full, nbytes, 2 * nbytes),
                               ops.slice(full, 2 * nbytes, 2 * nbytes + 1))


def to_full(ops, packed, n):
    """A payload with both planes, as the compiled server step reads it."""
    neg, zero = signbits.planes(ops, packed, n)
    return ops.cat([neg, zero, signbits.flag(ops, packed)])


def all_nan(ops, outs) -> None:
    """Set every element of the tensors ``outs`` to NaN."""
    for o in outs:
        ops.assign(o, ops.full(ops.shape(o), float("nan"), ops.dtype(o), like=o))


@paths.register(SignSGDCompressor)
class SignSGDPath(paths.Reference):
    """signsgd's own faster composition on every device: the error written while encoding,
    the signs decoded into the output buffer, the majority vote counted on the packed
    planes."""

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        """``compress``, with the error ``tensor - sign(tensor)`` (NaN everywhere when the
        status byte is set, as the decoded payload is) and the decoded signs written block by
        block from the tensor itself, instead of unpacking the two bit planes again. Needs
        ``error``/``decoded`` of the tensor's dtype with flat views (torch); else None."""
        ops = ops_for(tensor)
        outs = error_views(tensor, error, decoded, ops.dtype(tensor))
        if outs is None:
            return None
        flat = ops.flatten(tensor)
        payload = self.compressor._encode(ops, flat)

        def error_of(xc, *dc):
            v = ops.sign(xc)
            if dc:
                ops.assign(dc[0], v)
            return xc - v

        ops.blockwise(error_of, flat, *outs[1:], out=outs[0])
        if bool(signbits.flagged(ops, signbits.flag(ops, payload[0]))):   # torch only here
            all_nan(ops, outs)      # as decoding gives
        return payload, (ops.shape(tensor), ops.dtype(tensor))

    def decompress_into(self, payload, ctx, out=None):
        return self.compressor._unpack(payload, ctx, out)

    def combine(self, payloads, ctx, out=None):
        """The majority vote counted on every rank's packed planes (``signbits.vote``: no
        rank's signs are unpacked) and decoded once, into ``out`` as in ``decompress_into``;
        NaN everywhere when any rank's status byte is set."""
        shape, dtype = ctx
        ops = ops_for(payloads[0][0])
        pos, neg = signbits.vote(ops, [p[0] for p in payloads], math.prod(shape))
        return self.compressor._signs(ops, pos, neg, statuses(ops, payloads), shape, dtype, out)
