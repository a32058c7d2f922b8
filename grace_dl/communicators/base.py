"""The ``Communicator`` abstraction: one compressor, one memory, one way of moving payloads.

``send(tensor, name)`` compensates with the memory, compresses, updates the memory and *starts*
the collectives (it returns at once with a handle, so communication overlaps the rest of the
backward pass); ``receive(handle)`` waits, decompresses, aggregates and averages. The object
returned by ``grace_from_params`` is a communicator: it is what ``grace=`` takes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from grace_dl import validate
from grace_dl.backend import collectives_for, ops_for
from grace_dl.communicators import wire
from grace_dl.counters import ByteCounter  # noqa: F401 - re-exported (dispatcher imports it here)

AVERAGE = "average"
SUM = "sum"
OPS = (AVERAGE, SUM)


def check_op(op: str) -> str:
    """``op`` if it is one a communicator can do, else a ``ValueError`` listing them."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return op


@dataclass
class Handle:
    """What ``send`` gives back; pass it to ``receive``."""

    name: str
    op: str
    ctx: Any
    pending: Any          # the subclass's in-flight collectives
    coll: Any             # the Collectives the tensor travels on
    extra: dict = field(default_factory=dict)


class Communicator(ABC):
    """Base of every communicator. Subclasses implement ``_start`` and ``_finish`` and may
    restrict the compressors they carry by overriding ``check_compressor``."""

    #: registry name, set by ``register_communicator``
    name: str = ""

    def __init__(self, compressor, memory, process_set=None):
        self.check_compressor(compressor)
        self.compressor = compressor
        self.memory = memory
        self.process_set = validate.process_set(process_set)
        self.bytes = ByteCounter()

    # ------------------------------------------------------------------ compatibility
    @classmethod
    def refusal(cls, compressor) -> str | None:
        """Why this communicator cannot carry ``compressor`` (None when it can). Subclasses
        that restrict what they carry override this one method."""
        return None

    @classmethod
    def check_compressor(cls, compressor) -> None:
        """Raise ``ValueError`` naming ``compressor``, the reason and the communicators that
        would carry it, if this one cannot carry it correctly."""
        reason = cls.refusal(compressor)
        if reason is not None:
            raise wire.refuse(cls.name or cls.__name__, compressor, reason)

    def check_op(self, op: str) -> str:
        return check_op(op)

    # ------------------------------------------------------------------ the async pair
    def send(self, tensor, name: str, op: str = AVERAGE, collectives=None) -> Handle:
        op = self.check_op(op)
        coll = self.collectives(tensor) if collectives is None else collectives
        self.compressor.rank = coll.rank()
        payload, ctx, compensated = self.encode(tensor, name)
        handle = Handle(name=name, op=op, ctx=ctx, pending=None, coll=coll,
                        extra={"compensated": compensated})
        handle.pending = self._start(payload, handle)
        return handle

    def encode(self, tensor, name: str):
        """Error-compensate, compress and update the memory: (payload, ctx, compensated).
        For multi-round compressors the memory is updated in ``_finish`` instead."""
        compensated = self.memory.compensate(tensor, name)
        payload, ctx = self.compressor.compress(compensated, name)
        if self.compressor.rounds == 1:
            self.memory.update(compensated, name, self.compressor, payload, ctx)
        return payload, ctx, compensated

    def receive(self, handle: Handle):
        out = self._finish(handle)
        if handle.op == AVERAGE and self.compressor.average:
            out = out / handle.coll.size()
        return out

    def end_step(self) -> dict:
        """Close a training step in the byte counters; returns that step's summary. The
        framework glue calls it once per optimizer step."""
        return self.bytes.end_step()

    def synchronize(self, tensor, name: str, op: str = AVERAGE, collectives=None):
        """``receive(send(...))``: the blocking form."""
        return self.receive(self.send(tensor, name, op, collectives))

    def collectives(self, tensor):
        """The collectives ``tensor``'s payloads travel on: Horovod's, for its framework and
        this communicator's process set. A subclass or a dispatcher may route them elsewhere
        (a fused group, a host copy) by overriding this one method."""
        return collectives_for(tensor, self.process_set)

    @abstractmethod
    def _start(self, payload, handle: Handle):
        """Start the collectives for ``payload``; return what ``_finish`` needs."""

    @abstractmethod
    def _finish(self, handle: Handle):
        """Wait for the collectives and return the aggregated (summed) tensor."""

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def wire_name(name: str, part: str) -> str:
        """Collective name for one piece of one tensor's traffic."""
        return f"grace.{name}.{part}"

    def count(self, name: str, tensors, sent: bool = True, received_from: int = 0) -> None:
        """Add ``tensors``' bytes to the counters: as sent, and/or as received from
        ``received_from`` other ranks."""
        n = sum(int(ops_for(t).nbytes(t)) for t in tensors) if tensors else 0
        self.bytes.add(name, sent=n if sent else 0, received=n * received_from)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {"compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state.get("compressor", {}))
        self.memory.load_state_dict(state.get("memory", {}))

    def config(self) -> dict:
        """Everything that must agree across ranks (see ``fingerprint``)."""
        return {"communicator": self.name or type(self).__name__,
                "compressor": type(self.compressor).__name__, **{
                    f"compressor.{k}": v for k, v in self.compressor.config().items()},
                "memory": type(self.memory).__name__, **{
                    f"memory.{k}": v for k, v in self.memory.config().items()}}

    def fingerprint(self) -> str:
        """A short digest of ``config()``; ranks compare it before the first step."""
        import hashlib
        import json

        text = json.dumps(self.config(), sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.compressor!r}, {self.memory!r})"
