"""PowerSGD's bucket path in the DDP hook: a bucket's gradients compensated, compressed,
reduced and decompressed in one loop per round, with the same calls to the compressor and
the memory as the reference composition, without its per-tensor plumbing.

The reference (``Allreduce`` carrying each parameter as its own grace tensor, each round of a
bucket fused into one collective per dtype by ``GroupCollectives``) runs every tensor through
``Router.send`` and ``receive_all``: a handle, phases, recorded collective calls, byte counts
and an average per tensor and round, some 80 Python calls per tensor and step where PowerSGD's
own work (compensate, P = M Q, orthonormalize, Q^T = P^T M, the product into the gradient, the
residual) is a third of that. On a GPU that host work is what the step waits for; PyTorch's
``powerSGD_hook`` loops over a bucket's tensors as this does.

**Chosen once**, when the ``GraceState`` is built (``serves``): per-parameter granularity and
grace's own ``Allreduce`` (its exact class, no fusion groups) carrying its own
``PowerSGDCompressor`` with memory ``powersgd``; anything else (a subclass, another memory)
takes the reference. **Same bits** as the reference composition: the same compressor and
memory methods in the same order on the same tensors, the same sums, the same divisions
(``tests/test_ddp.py`` trains both on 2 ranks and compares every parameter). **Same wire**:
per bucket one allreduce per dtype of its Ps and uncompressed tensors, then one of its Q^Ts,
as the reference's fused rounds (and ``powerSGD_hook``) send; the same bytes counted per tensor
name in ``grc.bytes``. Each fused buffer is a fresh concatenation, summed in place.
"""

from __future__ import annotations

from grace_dl.communicators.allreduce import Allreduce
from grace_dl.communicators.base import AVERAGE
from grace_dl.communicators.exchange import Unit
from grace_dl.communicators.wire import ring_allreduce_bytes
from grace_dl.compressors.base import Call
from grace_dl.compressors.powersgd import PowerSGDCompressor
from grace_dl.memory.powersgd import PowerSGDFeedback
from grace_dl.torch import ops


class _Tensor:
    """One gradient of a bucket in flight: where its result goes (``grad``, DDP's view of the
    bucket), what was compressed and sent, and PowerSGD's ctx."""

    __slots__ = ("grad", "name", "compensated", "sent", "ctx", "reduced")

    def __init__(self, grad, name, compensated, sent, ctx):
        self.grad, self.name, self.compensated = grad, name, compensated
        self.sent, self.ctx, self.reduced = sent, ctx, None


class _Bucket:
    """A bucket's tensors, its collectives and the round they are in."""

    __slots__ = ("tensors", "coll", "call", "label", "pending", "low_rank")

    def __init__(self, tensors, coll, call, label, pending):
        self.tensors, self.coll, self.call, self.label = tensors, coll, call, label
        self.pending = pending
        self.low_rank = None    # the tensors in the second round


class PowerSGDBuckets:
    """The bucket path of ``grace`` (``serves``) for a hook of ``op``."""

    @staticmethod
    def serves(grace) -> bool:
        """Whether ``grace`` is exactly what this path reproduces (module docstring)."""
        return (type(grace) is Allreduce and grace.fusion is None
                and type(grace.compressor) is PowerSGDCompressor
                and type(grace.feedback) is PowerSGDFeedback)

    def __init__(self, grace, op: str):
        self.grace = grace
        self.compressor, self.feedback = grace.compressor, grace.feedback
        self.average = op == AVERAGE and grace.compressor.caps.average

    def start(self, grads, names, coll, label: str) -> _Bucket:
        """Compensate and compress ``grads`` (DDP's views of one bucket, named ``names``) and
        start the first round's allreduce (``Communicator.encode`` and ``Allreduce.issue``)."""
        compressor, feedback = self.compressor, self.feedback
        call = Call(coll.rank(), coll.size())
        path = None
        tensors = []
        for grad, name in zip(grads, names):
            compensated = feedback.compensate(grad, name, compressor)
            if path is None:
                path = self.grace.paths.on(compensated)
            payload, ctx = path.compress(compensated, name, call)
            tensors.append(_Tensor(grad, name, compensated, payload[0], ctx))
        return _Bucket(tensors, coll, call, label,
                       self._allreduce(tensors, coll, call, label + ".p"))

    def exchange(self, buckets) -> list:
        """Finish ``buckets`` (started by ``start``, in the same order on every rank) in
        lockstep, as ``Router.receive_all`` does: every bucket's second round is started
        before any is waited for. Their results are in DDP's buckets; returns the step's
        units (one per gradient, named as the reference names them)."""
        compressor, feedback, grace = self.compressor, self.feedback, self.grace
        for bucket in buckets:      # first round: the summed Ps (and the uncompressed tensors)
            divisor = bucket.call.size if self.average else None
            self._received(bucket)
            low_rank = []
            for t in bucket.tensors:
                step = compressor.next_round([t.reduced], t.ctx)
                if step is None:    # sent uncompressed: its result is the average
                    out = grace.paths.on(t.reduced).decompress_into([t.reduced], t.ctx,
                                                                    t.grad)
                    feedback.update(t.compensated, t.name, compressor, [t.reduced], t.ctx)
                    ops.assign_div(t.grad, out, divisor)
                else:
                    t.sent = step[0][0]
                    low_rank.append(t)
            bucket.low_rank = low_rank
            bucket.pending = self._allreduce(low_rank, bucket.coll, bucket.call,
                                             bucket.label + ".q") if low_rank else None
        for bucket in buckets:      # second round: the summed Q^Ts
            tensors = bucket.low_rank
            for t in tensors:       # this rank's share is known: the residual, meanwhile
                feedback.update(t.compensated, t.name, compressor, [t.sent], t.ctx)
            if tensors:
                self._received(bucket)
            divisor = bucket.call.size if self.average else None
            for t in tensors:
                path = grace.paths.on(t.reduced)
                # the average folded into Q where the path can (then nothing divides after)
                payload = None if divisor is None else path.divided([t.reduced], divisor)
                out = path.decompress_into(payload or [t.reduced], t.ctx, t.grad)
                ops.assign_div(t.grad, out, None if payload is not None else divisor)
        return [Unit(t.name, [t.name], None, t.grad, [], None, None)
                for bucket in buckets for t in bucket.tensors]

    def _allreduce(self, tensors, coll, call, name: str):
        """Start the sum of every tensor's ``sent`` payload, one in-place allreduce of their
        concatenation per dtype, and count each one's bytes as ``Allreduce`` counts them."""
        counter = self.grace.bytes
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault(t.sent.dtype, []).append(t)
            moved = ring_allreduce_bytes(coll.allreduce_nbytes(t.sent), call.size)
            counter.add(t.name, moved, moved)
        pending = []
        for dtype, group in by_dtype.items():
            flat = ops.cat([ops.flatten(t.sent) for t in group])
            wire = f"grace.ddp.{name}.{str(dtype).removeprefix('torch.')}"
            handle = coll.allreduce_async_(flat, wire)
            pending.append((group, handle if handle is not None
                            else coll.allreduce_async(flat, wire)))
        return pending

    @staticmethod
    def _received(bucket) -> None:
        """Wait for the bucket's pending allreduces; each tensor's ``reduced``: its part of the
        sum, shaped as it was sent."""
        coll = bucket.coll
        for group, handle in bucket.pending:
            out = coll.synchronize(handle)
            parts = ops.split(out, [t.sent.numel() for t in group])
            for t, part in zip(group, parts):
                t.reduced = part.reshape(t.sent.shape)
