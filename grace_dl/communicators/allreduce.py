"""``allreduce``: sum the payloads on the wire, decompress once (GRACE, Xu et al. 2021, §3;
the collective is Horovod's ring allreduce, Sergeev & Del Balso 2018).

Wire: one allreduce (sum) per payload part, named ``grace.<tensor>.p<i>``; each rank sends and
receives 2 (N-1)/N of its payload's bytes (ring algorithm), which is what the byte counters
record: a model of Horovod's ring, computed from the bytes the collectives really hand to it
(a bf16 ``none`` payload is summed as fp32, so it counts 4 bytes an element). Only for
compressors whose payloads may be summed (``allreduce_safe``: none, fp16, randomk with shared
indices, PowerSGD's P and Q). Exact for ``none``; otherwise as biased or
unbiased as the compressor.

Multi-round compressors (``rounds > 1``, PowerSGD: Vogels et al. 2019): after the round-1
payload is reduced, ``compressor.next_round(reduced, ctx)`` gives the next payload to reduce
(named ``grace.<tensor>.r<k>p<i>``) until it returns ``None``; the final reduced payload is
decompressed. The memory is then updated with that **reduced** payload, through a view of the
compressor whose ``decompress`` divides by the number of ranks: the residual is the compensated
local tensor minus the ranks' *average* approximation (M - P Q^T with the reduced, averaged
P and Q), as in PyTorch's ``powerSGD_hook``.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.communicators import wire
from grace_dl.communicators.base import Communicator, Handle
from grace_dl.registry import register_communicator


class _Averaged:
    """``compressor`` seen by the memory after a multi-round reduction: ``decompress`` of a
    summed payload gives the mean over ranks; every other attribute is the compressor's."""

    def __init__(self, compressor, size: int):
        self._compressor = compressor
        self._size = size

    def decompress(self, payload, ctx):
        return self._compressor.decompress(payload, ctx) / self._size

    def __getattr__(self, attr):
        return getattr(self._compressor, attr)


@register_communicator("allreduce")
class Allreduce(Communicator):
    @classmethod
    def refusal(cls, compressor) -> str | None:
        """Why this communicator cannot carry ``compressor`` (None when it can)."""
        if not getattr(compressor, "allreduce_safe", False):
            return "its payloads cannot be summed on the wire (allreduce_safe is False)"
        if not getattr(compressor, "equal_sizes", True):
            return "its payload sizes differ across ranks (equal_sizes is False)"
        return None

    def _reduce(self, payload, handle: Handle, tag: str):
        coll = handle.coll
        ops = ops_for(payload[0])
        pending = [coll.allreduce_async(part, self.wire_name(handle.name, f"{tag}{i}"))
                   for i, part in enumerate(payload)]
        moved = wire.ring_allreduce_bytes(sum(coll.allreduce_nbytes(p) for p in payload),
                                          coll.size())
        wire.count(self, ops, handle.name, sent=moved, received=moved)
        return pending

    def _start(self, payload, handle: Handle):
        return self._reduce(payload, handle, "p")

    def _finish(self, handle: Handle):
        coll = handle.coll
        reduced = [coll.synchronize(h) for h in handle.pending]
        ctx = handle.ctx
        rnd = 1
        while True:
            step = self.compressor.next_round(reduced, ctx)
            if step is None:
                break
            payload, ctx = step
            rnd += 1
            reduced = [coll.synchronize(h) for h in self._reduce(payload, handle, f"r{rnd}p")]
        if self.compressor.rounds > 1:
            self.memory.update(handle.extra["compensated"], handle.name,
                               _Averaged(self.compressor, coll.size()), reduced, ctx)
        return self.compressor.decompress(reduced, ctx)
