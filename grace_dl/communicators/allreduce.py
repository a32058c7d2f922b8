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
decompressed. Each later round is a phase of its own, started inside ``receive``. A memory that
wants the approximation (``residual``) is then updated with the ranks' *average* (M - P Q^T with
the reduced, averaged P and Q, as in PyTorch's ``powerSGD_hook``). One that does not (``powersgd``:
this rank's own share, from ``compressor.local_share``) needs nothing from the other ranks once
this rank's last payload is issued, so it is updated then, before that round is waited for: its
pass over the tensor runs while the last round is on the wire (in ``receive_all``'s lockstep,
after every tensor's last round has been issued), given the payload this rank sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grace_dl.backend import ops_for
from grace_dl.communicators import wire
from grace_dl.communicators.base import (
    AVERAGE,
    Communicator,
    Encoded,
    Handle,
    InFlight,
    divided_payloads,
)
from grace_dl.registry import register_communicator


@dataclass
class Reducing(InFlight):
    """Round ``round``'s allreduces in flight (``handles``), with the ctx that decompresses
    their sum; ``in_place``: the one allreduce sums (and averages) in the handle's ``into``;
    ``sent``: this rank's payload of a later round (what its memory update is given)."""

    ctx: Any
    round: int = 1
    in_place: bool = False
    sent: list | None = None


@register_communicator("allreduce")
class Allreduce(Communicator):
    @classmethod
    def refusal(cls, compressor) -> str | None:
        """Why this communicator cannot carry ``compressor`` (None when it can)."""
        if not compressor.caps.allreduce_safe:
            return "its payloads cannot be summed on the wire (allreduce_safe is False)"
        if not compressor.caps.equal_sizes:
            return "its payload sizes differ across ranks (equal_sizes is False)"
        return None

    def _count(self, payload, handle: Handle) -> None:
        moved = wire.ring_allreduce_bytes(sum(map(handle.coll.allreduce_nbytes, payload)),
                                          handle.encoded.call.size)
        wire.count(self, ops_for(payload[0]), handle.name, sent=moved, received=moved)

    def _payload_is_free(self) -> bool:
        """Whether no one reads a payload once it is sent (one round, not the tensor itself,
        a memory that keeps nothing): the engine may then sum it in place, without the
        fresh buffer ``allreduce_async`` takes (fp16's payload: one copy a bucket less)."""
        caps = self.compressor.caps
        return caps.rounds == 1 and not caps.sends_tensor and self.feedback.keeps_nothing

    def _reduce(self, payload, handle: Handle, tag: str) -> list:
        coll = handle.coll
        free = self._payload_is_free()
        pending = []
        for i, part in enumerate(payload):
            name = self.wire_name(handle.name, f"{tag}{i}")
            started = coll.allreduce_async_(part, name) if free else None
            pending.append(coll.allreduce_async(part, name) if started is None else started)
        self._count(payload, handle)
        return pending

    def _reduce_in_place(self, encoded: Encoded, handle: Handle):
        """The allreduce of an uncompressed tensor that is the caller's ``into`` (Horovod's
        ``allreduce_async_`` on ``p.grad``), averaged by its postscale; None when it cannot."""
        payload = encoded.payload
        if not (self.compressor.caps.sends_tensor and len(payload) == 1 and handle.into is not None
                and ops_for(payload[0]).aliases(payload[0], handle.into)):
            return None
        coll = handle.coll
        scale = 1.0 / coll.size() if handle.op == AVERAGE and self.compressor.caps.average else 1.0
        pending = coll.allreduce_async_(payload[0], self.wire_name(handle.name, "p0"), scale)
        if pending is None:
            return None
        self._count(payload, handle)
        return Reducing([pending], encoded.ctx, in_place=True)

    def issue(self, encoded: Encoded, handle: Handle) -> Reducing:
        in_place = self._reduce_in_place(encoded, handle)
        if in_place is not None:
            return in_place
        return Reducing(self._reduce(encoded.payload, handle, "p"), encoded.ctx)

    def complete(self, phase: Reducing, handle: Handle):
        coll = handle.coll
        # a later, last round whose memory keeps this rank's own share, known now: update while
        # the round is on the wire
        own_share_first = phase.round > 1 and phase.round == self.compressor.caps.rounds and \
            not self.feedback.wants_approximation(self.compressor)
        if own_share_first:
            self.feedback.update(handle.encoded.compensated, handle.name, self.compressor,
                               phase.sent, phase.ctx)
        reduced = list(map(coll.synchronize, phase.handles))
        if phase.in_place:
            handle.finished_in_place = True
            return handle.into
        step = self.compressor.next_round(reduced, phase.ctx) \
            if self.compressor.caps.rounds > 1 else None    # (a multi-round method's only)
        if step is not None:
            payload, ctx = step
            rnd = phase.round + 1
            return Reducing(self._reduce(payload, handle, f"r{rnd}p"), ctx, rnd, sent=payload)
        # the average folded into the reduced payload where the compressor can (sparse values,
        # qsgd's norms, PowerSGD's Q: not a pass over the dense result)
        payload = divided_payloads(handle, [reduced])[0]
        out = self.paths.on(payload).decompress_into(payload, phase.ctx, handle.into)
        if self.compressor.caps.rounds == 1 or own_share_first:
            return out
        average = None
        if self.feedback.wants_approximation(self.compressor):
            average = out if handle.finished_in_place else out / coll.size()
        self.feedback.update(handle.encoded.compensated, handle.name, self.compressor, reduced,
                           phase.ctx, average)
        return out
