"""``allgather``: every rank gets every rank's payload, decompresses each with its own ctx and
combines them with ``compressor.aggregate`` (GRACE, Xu et al. 2021, §3: the collective for
sparsifiers, signs and quantizers with per-rank scales).

Wire: one allgather of the payload, its parts flattened to 1-D and packed into one byte buffer
(``wire.pack``; ``pack_parts=False``: one allgather per part), named ``grace.<tensor>.p``
(unpacked: ``grace.<tensor>.p<i>``). A rank sends its payload once and receives the N-1 others'
(the byte counters record exactly that). With equal sizes every rank's payload is as long as
this rank's, so the allgather says so (``allgather_known_async``): an engine that sizes its
buffers first (torch.distributed) then exchanges no sizes, a blocking round trip per tensor.
When payload sizes differ across ranks (``equal_sizes`` False: threshold, DGC, the signs'
zero plane) the int32 element count of each part travels too (4 bytes per part per rank:
``Collectives.allgather_parts_async``; on Horovod inside the one gather, on torch.distributed
in a gather of its own, read before the parts' gathers are sized; where that read makes the
host wait for a GPU, held to be read with the step's other sizes: ``Collectives.sized``). That
exchange of sizes is the one read of them: a path whose payload can be cut after compressing
(signSGD's, Signum's on a GPU) leaves it whole and says on the device how much of it is sent
(``sent_lengths``, ``Call.exchanges_sizes``), instead of reading its size itself. A rank may
send 0 elements.

Carries every single-round compressor; the result is exact when the compressor is, and the
aggregation (sum, or majority vote for signs) runs in rank order, so all ranks get the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grace_dl.backend import ops_for
from grace_dl.communicators import wire
from grace_dl.communicators.base import Encoded, Handle, InFlight, PackingCommunicator
from grace_dl.compressors.paths import overrides
from grace_dl.registry import register_communicator


def gather_rounds_refusal(compressor) -> str | None:
    """Why a communicator that gathers payloads (allgather, broadcast, PS) cannot carry
    ``compressor`` (None when it can): its ``refusal``."""
    if compressor.caps.rounds > 1:
        return (f"it needs {compressor.caps.rounds} rounds whose later payloads depend on the "
                f"reduced earlier ones (rounds > 1)")
    return None


@dataclass
class Gathering(InFlight):
    """The payload parts' allgathers in flight (``handles``; for a ragged payload, the one
    ``Collectives.allgather_parts_async``)."""

    #: the parts' dtypes where their sizes differ across ranks (``handles`` holds the one
    #: ``allgather_parts_async`` handle), else None
    ragged_dtypes: list | None
    shapes: list
    numels: list | None     # the parts' element counts (None: they travel packed)
    sent: Any               # (ragged: counted when the gather says what this rank sent)
    #: the parts' ``wire.layout`` when they travel packed in ``handles[0]``, else None
    packed: Any = None


@register_communicator("allgather")
class Allgather(PackingCommunicator):
    refusal = staticmethod(gather_rounds_refusal)

    def __init__(self, compressor, memory, process_set=None, pack_parts: bool = True):
        super().__init__(compressor, memory, process_set, pack_parts)
        # a ragged payload's lengths travel in the gather: a path need not read its size (not
        # for a subclass that changed what a payload is or how it is sent)
        self.exchanges_sizes = not compressor.caps.equal_sizes and self._plain_compress and \
            not overrides(type(self), Allgather, "issue")

    def issue(self, encoded: Encoded, handle: Handle) -> Gathering:
        coll = handle.coll
        ops = ops_for(encoded.payload[0])
        flats, shapes = ops.flat_parts(encoded.payload)         # (``wire.flatten``)
        sent = ops.total_nbytes(flats)
        ragged_dtypes = None
        size = encoded.call.size
        if not self.compressor.caps.equal_sizes:
            # sizes differ across ranks: the parts and an int32 vector of their lengths (the
            # path's, on the device, where its parts may be longer than what they send)
            names = [self.wire_name(handle.name, f"p{i}") for i in range(len(flats))]
            lengths = self.paths.on(flats).sent_lengths(encoded.payload, encoded.ctx) \
                if encoded.call.exchanges_sizes else None
            parts = [coll.allgather_parts_async(flats, names,
                                                self.wire_name(handle.name, "len"), lengths)]
            ragged_dtypes = [ops.dtype(f) for f in flats]
            packed = numels = sent = None
        elif (packed := self.packed_layout(flats, ops)) is not None:
            # equal sizes: every rank's part is as long as this rank's, so an engine that sizes
            # its buffers first (torch.distributed) needs no exchange of sizes (``_known``)
            buffer = ops.pack_parts(flats)
            parts = [coll.allgather_known_async(buffer, [ops.numel(buffer)] * size,
                                                self.wire_name(handle.name, "p"))]
            numels = None
        else:
            parts, numels = [], []
            for i, f in enumerate(flats):
                numels.append(ops.numel(f))
                parts.append(coll.allgather_known_async(f, [numels[i]] * size,
                                                        self.wire_name(handle.name, f"p{i}")))
        if sent is not None:
            wire.count(self, ops, handle.name, sent=sent)
        return Gathering(parts, ragged_dtypes, shapes, numels, sent, packed)

    def complete(self, phase: Gathering, handle: Handle):
        coll = handle.coll
        size = handle.encoded.call.size
        if phase.packed is not None:
            gathered = coll.synchronize(phase.handles[0])
            ops = ops_for(gathered)
            pieces = ops.unpack_parts(gathered, [phase.packed] * size)   # (``wire.unpack_all``)
            received = phase.sent * (size - 1)
        elif phase.ragged_dtypes is None:
            gathered = [coll.synchronize(h) for h in phase.handles]
            ops = ops_for(gathered[0])
            pieces = [ops.split(g, [n] * size) for g, n in zip(gathered, phase.numels)]
            received = phase.sent * (size - 1)
        else:
            pieces = coll.synchronize_parts(phase.handles[0], phase.ragged_dtypes)
            ops = ops_for(pieces[0][0])
            me = handle.encoded.call.rank
            wire.count(self, ops, handle.name, sent=wire.ragged_sent(pieces, me),
                       received=wire.ragged_received(pieces, me))
            return wire.combine(self, pieces, phase.shapes, handle, size, average=True, ops=ops)
        wire.count(self, ops, handle.name, received=received)
        return wire.combine(self, pieces, phase.shapes, handle, size, average=True, ops=ops)
