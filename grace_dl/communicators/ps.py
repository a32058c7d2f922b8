"""``ps``: AutoDist's synchronous PSSynchronizer carried on Horovod collectives: every rank's
payload goes to one rank (the "parameter server", ``root``), which decompresses and aggregates
them, and the aggregate is broadcast back (Li et al. 2014, "Scaling Distributed Machine
Learning with the Parameter Server", in its synchronous form).

Wire: one all-to-all per payload part in which each rank sends its whole part to ``root`` and
nothing to anyone else (Horovod has no reduce-to-one; an all-to-all with one non-empty column is
exactly a gather), then one broadcast of the dense aggregate (the gradient's dtype, n elements)
from ``root``. A non-root rank sends its payload bytes and receives the n-element result; the
root receives N-1 payloads and sends the result to N-1 ranks. Named ``grace.<tensor>.ps<i>``
and ``grace.<tensor>.ps.result``.

Carries every single-round compressor (payloads are decompressed one by one, as with
allgather, so they need not be summable or of equal sizes); exact for ``none``. The broadcast
is a second phase, started in ``receive`` once the root has aggregated. A strategy's
``PSSynchronizer`` node runs on this communicator (its ``reduction_destination`` is ``root``);
``grace_from_params({"communicator": "ps", "root": 0, ...})`` builds it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from grace_dl.backend import ops_for
from grace_dl.communicators import wire
from grace_dl.communicators.allgather import gather_rounds_refusal
from grace_dl.communicators.base import Communicator, Encoded, Handle, Phase
from grace_dl.registry import register_communicator
from grace_dl.validate import in_range


@dataclass
class Gathering(Phase):
    """Every rank's payload parts on their way to ``root`` (one all-to-all per part)."""

    parts: list
    shapes: list


@dataclass
class Returning(Phase):
    """The root's dense aggregate being broadcast back."""

    result: object
    received: object


@register_communicator("ps")
class PSCommunicator(Communicator):
    def __init__(self, compressor, memory, root: int = 0, process_set=None):
        super().__init__(compressor, memory, process_set)
        self.root = in_range("root", root, 0, None, kind=int)

    refusal = staticmethod(gather_rounds_refusal)

    def issue(self, encoded: Encoded, handle: Handle) -> Gathering:
        coll = handle.coll
        size, rank = coll.size(), coll.rank()
        if self.root >= size:
            raise ValueError(f"PS root rank {self.root} does not exist in a job of {size} ranks")
        ops = ops_for(encoded.payload[0])
        pending, shapes, sent = [], [], 0
        for i, part in enumerate(encoded.payload):
            flat = ops.flatten(part)
            shapes.append(ops.shape(part))
            n = ops.numel(flat)
            splits = [n if r == self.root else 0 for r in range(size)]
            pending.append(coll.alltoall_async(flat, splits,
                                               self.wire_name(handle.name, f"ps{i}")))
            if rank != self.root:
                sent = sent + ops.nbytes(flat)
        wire.count(self, ops, handle.name, sent=sent)
        return Gathering(pending, shapes)

    def complete(self, phase: Phase, handle: Handle):
        coll = handle.coll
        size, rank = coll.size(), coll.rank()
        like = handle.encoded.compensated
        ops = ops_for(like)
        if isinstance(phase, Returning):
            out = coll.synchronize(phase.result)
            dense = ops.nbytes(out)
            if rank == self.root:
                wire.count(self, ops, handle.name, sent=dense * (size - 1), received=phase.received)
            else:
                wire.count(self, ops, handle.name, received=dense)
            return out
        received = [coll.synchronize(h) for h in phase.parts]
        got = 0
        if rank == self.root:
            pieces = []
            for values, splits in received:
                per_rank = ops.split_by(values, splits)
                pieces.append(per_rank)
                got = got + wire.nbytes([p for r, p in enumerate(per_rank) if r != rank])
            result = wire.combine(self, pieces, phase.shapes, handle, size)
        else:
            # A non-root rank receives nothing, but in a TF graph its all-to-all (its send!) only
            # runs if something uses its output; a control dependency is not kept (measured), so
            # the zeros depend on the empty output's sum, which is exactly 0.
            result = ops.zeros_like(like)
            for values, _ in received:
                result = result + ops.cast(ops.sum(ops.cast(values, "float32")), ops.dtype(like))
        return Returning(coll.broadcast_async(result, self.root,
                                              self.wire_name(handle.name, "ps.result")), got)

    def config(self) -> dict:
        return {**super().config(), "root": self.root}
