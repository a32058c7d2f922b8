"""``broadcast``: each rank in turn broadcasts its payload to all others (N collectives per part),
then every rank decompresses all N payloads and aggregates them, as ``allgather`` does (GRACE,
Xu et al. 2021, §3, lists it as the collective for stacks without an allgather of ragged tensors).

Wire: for root r, one broadcast of its payload, the parts flattened to 1-D and packed into one
byte buffer (``wire.pack``), named ``grace.<tensor>.b<r>p``; where the payload does not pack
(sizes that differ across ranks, bool parts, or ``pack_parts=False``), one broadcast per part,
``grace.<tensor>.b<r>p<i>``. A rank sends its own payload once (as root) and receives the N-1
others' (the counters record that; how the library relays a broadcast is not counted).
Non-roots pass a buffer of the root's size, so when payload sizes differ across ranks
(``equal_sizes`` False) an int32 allgather, ``grace.<tensor>.len``, first says every rank's
part lengths (4 bytes per part per rank). It starts in ``send``; the broadcasts, which need its
answer to size their buffers, are a second phase started in ``receive``. With equal sizes
everything starts in ``send``.

Carries every single-round compressor; the aggregation runs in rank order, so every rank gets
the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grace_dl.backend import ops_for
from grace_dl.communicators import wire
from grace_dl.communicators.allgather import gather_rounds_refusal
from grace_dl.communicators.base import Encoded, Handle, PackingCommunicator, Phase
from grace_dl.registry import register_communicator


@dataclass
class Sizing(Phase):
    """Ragged payloads: the allgather of every rank's part lengths in flight."""

    flats: list
    shapes: list
    lengths: Any
    sent: Any


@dataclass
class Broadcasting(Phase):
    """Every root's broadcast of every part in flight (``rounds[r][i]``)."""

    flats: list
    shapes: list
    rounds: list
    sent: Any
    lengths: Any = None
    #: the parts' ``wire.layout`` when each root's parts travel packed in ``rounds[r][0]``
    packed: Any = None


@register_communicator("broadcast")
class Broadcast(PackingCommunicator):
    refusal = staticmethod(gather_rounds_refusal)

    def _broadcasts(self, coll, name, flats, buffer, packed=False):
        """Start every root's broadcast of every part (``packed``: of its one packed buffer,
        ``flats == [buffer]``); ``buffer(r, i)`` is this rank's receive buffer for root r's
        part i."""
        me = coll.rank()
        return [[coll.broadcast_async(f if r == me else buffer(r, i), r,
                                      self.wire_name(name, f"b{r}p" if packed else f"b{r}p{i}"))
                 for i, f in enumerate(flats)]
                for r in range(coll.size())]

    def issue(self, encoded: Encoded, handle: Handle) -> Phase:
        coll = handle.coll
        ops = ops_for(encoded.payload[0])
        flats, shapes = wire.flatten(encoded.payload)
        sent = wire.nbytes(flats)
        layout = self.packed_layout(flats, ops) if self.compressor.caps.equal_sizes else None
        if layout is not None:
            # one buffer per root; a non-root's own packed payload has the root's size and
            # serves as its receive buffer
            packed = wire.pack(flats)
            rounds = self._broadcasts(coll, handle.name, [packed], lambda r, i: packed,
                                      packed=True)
            phase = Broadcasting(flats, shapes, rounds, sent, packed=layout)
        elif self.compressor.caps.equal_sizes:
            # a non-root's own part has the root's shape: it serves as the receive buffer
            phase = Broadcasting(flats, shapes, self._broadcasts(coll, handle.name, flats,
                                                                 lambda r, i: flats[i]), sent)
        else:
            numels = ops.numels(flats)
            sent = sent + ops.nbytes(numels)
            phase = Sizing(flats, shapes,
                           coll.allgather_known_async(numels, [len(flats)] * coll.size(),
                                                      self.wire_name(handle.name, "len")),
                           sent)
        wire.count(self, ops, handle.name, sent=sent)
        return phase

    def complete(self, phase: Phase, handle: Handle):
        coll = handle.coll
        size = coll.size()
        flats = phase.flats
        ops = ops_for(flats[0])
        if isinstance(phase, Sizing):
            lengths = ops.reshape(coll.synchronize(phase.lengths), (size, len(flats)))
            rounds = self._broadcasts(
                coll, handle.name, flats,
                lambda r, i: ops.zeros((lengths[r][i],), ops.dtype(flats[i]), like=flats[i]))
            return Broadcasting(flats, phase.shapes, rounds, phase.sent, lengths)
        received = [[coll.synchronize(h) for h in parts] for parts in phase.rounds]
        total = wire.nbytes([t for parts in received for t in parts]) - phase.sent
        if phase.lengths is not None:
            total = total + ops.nbytes(phase.lengths)
        wire.count(self, ops, handle.name, received=total)
        if phase.packed is not None:
            received = [wire.unpack(parts[0], phase.packed) for parts in received]
        pieces = [[parts[i] for parts in received] for i in range(len(flats))]
        return wire.combine(self, pieces, phase.shapes, handle, size, average=True)
