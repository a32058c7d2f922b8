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
allgather, so they need not be summable or of equal sizes); exact for ``none``.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.communicators import wire
from grace_dl.communicators.base import Communicator, Handle
from grace_dl.validate import in_range


class PSCommunicator(Communicator):
    name = "ps"

    def __init__(self, compressor, memory, root: int = 0, process_set=None):
        super().__init__(compressor, memory, process_set)
        self.root = in_range("root", root, 0, None, kind=int)

    @classmethod
    def check_compressor(cls, compressor) -> None:
        if getattr(compressor, "rounds", 1) > 1:
            raise ValueError(f"communicator 'ps' cannot carry compressor "
                             f"{type(compressor).__name__}: it needs {compressor.rounds} rounds "
                             f"whose later payloads depend on the reduced earlier ones; use an "
                             f"AllReduceSynchronizer with communicator 'allreduce'")

    def _start(self, payload, handle: Handle):
        coll = handle.coll
        size, rank = coll.size(), coll.rank()
        if self.root >= size:
            raise ValueError(f"PS reduction_destination rank {self.root} does not exist in a job "
                             f"of {size} ranks")
        ops = ops_for(payload[0])
        pending, shapes, sent = [], [], 0
        for i, part in enumerate(payload):
            flat = ops.flatten(part)
            shapes.append(ops.shape(part))
            n = ops.numel(flat)
            splits = [n if r == self.root else 0 for r in range(size)]
            pending.append(coll.alltoall_async(flat, splits, self.wire_name(handle.name,
                                                                            f"ps{i}")))
            if rank != self.root:
                sent = sent + ops.nbytes(flat)
        ops.host_callback(lambda s: self.bytes.add(handle.name, sent=s), sent)
        return {"parts": pending, "shapes": shapes}

    def _finish(self, handle: Handle):
        coll = handle.coll
        size, rank = coll.size(), coll.rank()
        like = handle.extra["compensated"]
        ops = ops_for(like)
        received = [coll.synchronize(h) for h in handle.pending["parts"]]
        equal = self.compressor.equal_sizes
        if rank == self.root:
            per_rank = [[] for _ in range(size)]
            got = 0
            for (values, splits), shape in zip(received, handle.pending["shapes"]):
                pieces = ops.split_by(values, splits)
                for r, piece in enumerate(pieces):
                    per_rank[r].append(wire.unflatten(piece, shape, equal))
                    if r != rank:
                        got = got + ops.nbytes(piece)
            tensors = [self.compressor.decompress(p, handle.ctx) for p in per_rank]
            result = self.compressor.aggregate(tensors)
        else:
            # A non-root rank receives nothing, but in a TF graph its all-to-all (its send!) only
            # runs if something uses its output; a control dependency is not kept (measured), so
            # the zeros depend on the empty output's sum, which is exactly 0.
            result = ops.zeros_like(like)
            for values, _ in received:
                result = result + ops.cast(ops.sum(ops.cast(values, "float32")), ops.dtype(like))
            got = 0
        out = coll.synchronize(coll.broadcast_async(result, self.root,
                                                    self.wire_name(handle.name, "ps.result")))
        dense = ops.nbytes(out)
        if rank == self.root:
            ops.host_callback(lambda s, r: self.bytes.add(handle.name, sent=s, received=r),
                              dense * (size - 1), got)
        else:
            ops.host_callback(lambda r: self.bytes.add(handle.name, received=r), dense)
        return out

    def config(self) -> dict:
        return {**super().config(), "root": self.root}

