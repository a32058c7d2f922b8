"""The ``Communicator`` abstraction: one compressor, one memory, one way of moving payloads.

Every tensor takes the same path, and only ``Router`` (the base of communicators and of the
strategy dispatcher) defines it:

1. **encode** (``send``): the memory compensates the gradient, the compressor compresses it
   (``compress``), and, for single-round methods, the memory is updated once with the local
   approximation (``approximate``, computed here once and reused).
2. **issue** (``send``): the subclass starts its collectives on a ``Collectives`` and returns
   its typed in-flight state, a ``Phase``. Members of a fusion group are held until the whole
   group is encoded and then issued together on one ``GroupCollectives`` (``fuse``).
3. **complete** (``receive``): the subclass waits, decompresses and aggregates, or starts
   further collectives and returns the next ``Phase`` (two-phase's gather, PowerSGD's later
   rounds, the PS broadcast); ``receive`` runs phases until a tensor comes out, then averages.

``send`` returns at once with a ``Handle``, so communication overlaps the rest of the backward
pass. The object returned by ``grace_from_params`` is a communicator: it is what ``grace=``
takes (``grace_dl.contracts.Grace``).
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from grace_dl import validate
from grace_dl.backend import collectives_for, ops_for
from grace_dl.communicators import wire
from grace_dl.communicators.counters import ByteCounter
from grace_dl.compressors.base import Call
from grace_dl.compressors.paths import Paths, feedback_of, overrides
from grace_dl.state import config_of

AVERAGE = "average"
SUM = "sum"
OPS = (AVERAGE, SUM)

__all__ = ["AVERAGE", "SUM", "OPS", "ByteCounter", "Communicator", "Encoded", "Handle", "Phase",
           "Ready", "Router", "check_op", "fingerprint_of"]


def check_op(op: str) -> str:
    """``op`` if it is one a communicator can do, else a ``ValueError`` listing them."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return op


def fingerprint_of(config: dict) -> str:
    """A short digest of a configuration dictionary (what ranks compare)."""
    text = json.dumps(config, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Encoded:
    """One tensor after encode: the payload that travels and what stays on this rank."""

    name: str
    payload: list
    ctx: Any
    #: the compressed tensor; read its values only until the memory update (a memory may
    #: have compensated in its own slot, which the update then overwrites)
    compensated: Any
    call: Call
    #: what this rank counts as sent (None until known: multi-round methods, no memory)
    approximation: Any = None


class Phase:
    """In-flight state of one tensor's exchange. Each communicator defines its phases as
    dataclasses deriving from this; ``complete`` turns one into the next or into a tensor."""

    def waits_on(self) -> list | None:
        """The collective handles ``complete`` will synchronize on, so that ``Router.advance``
        can run ``complete`` early once they are all ``done``; None (the default): unknown,
        the phase is only completed in ``receive``."""
        return None


@dataclass
class InFlight(Phase):
    """A phase whose ``complete`` synchronizes exactly the collective handles ``handles``."""

    handles: list

    def waits_on(self) -> list:
        return self.handles


@dataclass
class Ready(Phase):
    """Nothing left to wait for: ``value`` is the aggregated (summed) tensor."""

    value: Any


@dataclass
class Handle:
    """What ``send`` gives back; pass it to ``receive``."""

    name: str
    op: str
    comm: Communicator              # the communicator that carries the tensor
    coll: Any                       # the Collectives it travels on
    encoded: Encoded
    phase: Phase | None = None      # None while held for its fusion group
    #: where ``receive`` wants the result (a sparse ``combine`` may build it there; an
    #: uncompressed allreduce may sum in it), or None
    into: Any = None
    #: set by a communicator whose result already sits in ``into``, averaged as asked
    finished_in_place: bool = False
    done: bool = False
    value: Any = None
    received: bool = field(default=False)


def as_written(fn):
    """Mark ``fn`` for TensorFlow's AutoGraph as graph-safe as written: inside a
    ``tf.function`` it runs as it is, its callees too, instead of being transpiled (grace_dl
    branches on tensor values only through ``ops.cond``; AutoGraph would rewrite every function
    a send reaches, at every trace: docs/DECISIONS.md). The mark is the attribute
    ``tf.autograph.experimental.do_not_convert`` sets; where AutoGraph stops reading it, the
    code is transpiled as before, to the same graph."""
    fn.autograph_info__ = None
    return fn


class Router:
    """The send path every ``grace=`` object shares: ``send`` picks the communicator and
    collectives for a named tensor (``route``), encodes it and issues it (or holds it for its
    fusion group); ``receive`` runs its phases to the end. A communicator routes every tensor
    to itself; a strategy dispatcher routes each to its node's pipeline."""

    def route(self, tensor, name: str, collectives):
        """``(communicator, collectives)`` for ``tensor``; ``collectives`` is the caller's
        choice of engine, or None."""
        raise NotImplementedError

    def on_send(self, handle: Handle) -> None:
        """Called with every handle ``send`` makes (a dispatcher tracks what is in flight)."""

    def before_receive(self, handle: Handle) -> list:
        """Handles to finish, in this order, before ``handle`` (a fixed order on every rank,
        for communicators that start collectives while finishing)."""
        return []

    def check_op(self, op: str) -> str:
        return op if op in OPS else check_op(op)

    @as_written
    def send(self, tensor, name: str, op: str = AVERAGE, collectives=None,
             into=None) -> Handle:
        """Encode ``tensor`` and start its collectives (on ``collectives``, or Horovod's for
        its framework and the process set); returns at once. ``into``: where ``receive`` will
        write the result (its default there). Given here, the pipeline may work in it from the
        start: an uncompressed allreduce of ``into`` itself sums there in place, as Horovod's
        own optimizer does with ``p.grad``; ``tensor`` may then be overwritten."""
        op = op if op in OPS else self.check_op(op)
        comm, coll = self.route(tensor, name, collectives)
        handle = Handle(name=name, op=op, comm=comm, coll=coll, into=into,
                        encoded=comm.encode(tensor, name, Call(coll.rank(), coll.size(),
                                                               comm.exchanges_sizes)))
        if comm.fusion is not None and comm.fusion.holds(name):
            comm.fusion.hold(comm, handle)
        else:
            handle.phase = comm.issue(handle.encoded, handle)
        self.on_send(handle)
        return handle

    @as_written
    def receive(self, handle: Handle, into=None):
        """Wait for ``handle``'s exchange and return the aggregated tensor (divided by the
        number of ranks for ``op="average"`` when the compressor averages). ``into``: a
        tensor of the result's shape and dtype (torch) or a variable (TF) to write the result
        into and return instead, which saves the result's own allocation and a copy; by
        default the ``into`` given to ``send``."""
        if handle.received:
            raise ValueError(f"handle for {handle.name!r} was already received")
        for other in self.before_receive(handle):
            _finish(other)
        handle.received = True
        return _finish(handle, into)

    @as_written
    def receive_all(self, handles, intos=None) -> list:
        """``receive`` for several handles (``intos``: their ``into``, or None), their phases
        advanced in lockstep: each pass starts every handle's next collectives before it waits
        for any, so later rounds (PowerSGD's second, two-phase's gather) are in flight
        together, and handles issued on one fusion group's ``GroupCollectives`` send each
        later round fused too (one collective per kind and dtype). Every rank must pass the
        same handles in the same order."""
        handles = list(handles)
        intos = [None] * len(handles) if intos is None else list(intos)
        if len(intos) != len(handles):
            raise ValueError(f"receive_all got {len(handles)} handles and {len(intos)} intos")
        order, seen = [], set()
        for handle in handles:
            if handle.received:
                raise ValueError(f"handle for {handle.name!r} was already received")
            if id(handle) in seen:    # a dispatcher's before_receive listed it already
                continue
            for h in (*self.before_receive(handle), handle):
                if id(h) not in seen:
                    seen.add(id(h))
                    order.append(h)
        live = []
        for handle, into in zip(handles, intos):
            handle.received = True
            if into is not None:
                handle.into = into
        for h in order:
            if not h.done:
                live.append(h)
        _advance_together(live)
        out = []
        for h, into in zip(handles, intos):
            out.append(_finish(h, into))
        return out

    @as_written
    def advance(self, pending) -> int:
        """Start later phases early, before ``receive``: ``pending`` is a ``collections.deque``
        of this step's handles in the order they were sent. From its left, each handle whose
        collectives have all finished (``Collectives.done``) is completed once: its next
        collectives start now (two-phase's gather, PowerSGD's next round) and it goes to the
        back of the deque, or its result is built (in ``into``) and kept as ``Ready``; handles
        with nothing to start early leave the deque. It stops at the first handle still
        waiting, so a call costs O(1) amortized per handle and never blocks. Only for
        collectives that ranks may start in any order (``Collectives.any_order``: Horovod's),
        outside fusion groups and before ``receive``; the results are the same bits as
        completing in ``receive``. Returns how many phases it completed."""
        advanced = 0
        for _ in range(len(pending)):
            handle = pending.popleft()
            phase = handle.phase
            waits = None if handle.received or handle.done or not isinstance(phase, Phase) \
                or isinstance(phase, Ready) or not handle.coll.any_order else phase.waits_on()
            if waits is None:
                continue
            if not all(handle.coll.done(h) for h in waits):
                pending.appendleft(handle)
                break
            advanced += 1
            if _complete_phase(handle):
                pending.append(handle)
        return advanced

    def synchronize(self, tensor, name: str, op: str = AVERAGE, collectives=None, into=None):
        """``receive(send(...))``: the blocking form."""
        return self.receive(self.send(tensor, name, op, collectives, into))

    def fingerprint(self) -> str:
        """A short digest of ``config()``; ranks compare it before the first step."""
        return fingerprint_of(self.config())


class FanOut:
    """A ``grace=`` object made of others (``parts()``): setting its process set sets theirs."""

    _process_set = None

    def parts(self) -> list:
        return []

    def accumulator(self, name: str, like):
        """Where the tensor sent next as ``name`` may be added in parts first
        (``accumulator``), or None (default: none)."""
        return None

    @property
    def process_set(self):
        return self._process_set

    @process_set.setter
    def process_set(self, value) -> None:
        self._process_set = value
        for part in self.parts():
            part.process_set = value


def receive_each(grace, handles, intos=None) -> list:
    """Every handle's result, in order: ``grace.receive_all`` where the ``grace=`` object has
    it (phases in lockstep, so two-phase's gathers and PowerSGD's later rounds of all the
    tensors are in flight together), else ``receive`` one handle after the other (a
    user's object that implements only the ``Grace`` protocol). The framework glue
    receives a step's gradients through this."""
    handles = list(handles)
    intos = [None] * len(handles) if intos is None else list(intos)
    receive_all = getattr(grace, "receive_all", None)
    if receive_all is not None:
        return receive_all(handles, intos)
    return [grace.receive(h, into) for h, into in zip(handles, intos)]


def advance_each(grace, pending) -> int:
    """``grace.advance(pending)`` where the ``grace=`` object has it (a ``Router``), else
    nothing (a user's object that implements only the ``Grace`` protocol completes in
    ``receive``). The framework glue calls it from its gradient hooks."""
    advance = getattr(grace, "advance", None)
    return 0 if advance is None else advance(pending)


def accumulator(grace, name: str, like):
    """Where the parts of the tensor ``grace`` will send as ``name`` (shaped like ``like``) may
    be added before it is sent (``Feedback.accumulator``: the residual's slot, whose send then
    adds nothing), or None: only for a communicator whose ``encode`` is the base one, which
    compensates through its memory's path (decided when it was built), or a ``grace=`` object
    made of others that says where (a ``Schedule``: its running stage's; a strategy
    dispatcher: that of the communicator it routes ``name`` to)."""
    if isinstance(grace, FanOut):
        return grace.accumulator(name, like)
    if not isinstance(grace, Communicator) or not grace.compensates_in_memory:
        return None
    return grace.feedback.accumulator(name, like, grace.compressor)


def average_divisor(handle: Handle):
    """What ``handle``'s aggregate is divided by: the number of ranks for an average of a
    compressor that averages, else None (a sum)."""
    return handle.encoded.call.size \
        if handle.op == AVERAGE and handle.comm.compressor.caps.average else None


def divided_payloads(handle: Handle, payloads: list, path=None) -> list:
    """``payloads`` (every rank's, or the one reduced) with the average folded into their
    values when the result is built in ``handle.into`` and the compressor can
    (the path's ``divided``: sparse values, O(k)); the handle is then finished in place, so
    ``receive`` does not divide the dense result again. Else ``payloads`` unchanged.
    ``path``: the compressor's path for them, where the caller has it."""
    divisor = average_divisor(handle)
    if handle.into is None or divisor is None:
        return payloads
    # (a path's ``divided`` is its exact class's: one whose ``aggregate`` is a sum)
    path = path or handle.comm.paths.on(payloads)
    divided = []
    for p in payloads:
        d = path.divided(p, divisor)
        if d is None:
            return payloads
        divided.append(d)
    handle.finished_in_place = True
    return divided


def marked(payload, mark):
    """``payload`` with the 0-d ``mark`` (``nonfinite_mark``) added to its floating-point
    parts (a sparsifier's k values, adaq's two means): O(k), and a NaN input decompresses to
    NaN wherever the payload carries a value."""
    return ops_for(mark).add_to_floating(payload, mark)


def nonfinite_mark(tensor, ops):
    """A 0-d tensor of ``tensor``'s dtype and device: -0.0 when every entry is finite (adding
    it leaves every value's bits alone, a -0.0 included), else NaN (one pass,
    ``ops.nonfinite_mark`` of ``tensor``'s backend ``ops``; an empty tensor gives None)."""
    n = ops.numel(tensor)
    if isinstance(n, int) and n == 0:
        return None
    return ops.nonfinite_mark(tensor)


def _finish(handle: Handle, into=None):
    """Run ``handle``'s phases to the end (once) and return its averaged or summed result
    (written into ``into`` when given, else into the ``into`` given to ``send``)."""
    into = handle.into if into is None else into
    if handle.done:   # finished earlier, for another handle's sake (before_receive)
        if into is None:
            return handle.value
        return ops_for(handle.value).assign_div(into, handle.value)
    comm = handle.comm
    if handle.into is None:
        handle.into = into
    if handle.phase is None:
        comm.fusion.flush(comm, handle.name)
    out = handle.phase
    while isinstance(out, Phase):
        out = out.value if isinstance(out, Ready) else comm.complete(out, handle)
    if into is not None:    # finished in place: averaged (or summed) already, maybe in into
        out = ops_for(out).assign_div(
            into, out, None if handle.finished_in_place else average_divisor(handle))
    else:
        divisor = average_divisor(handle)
        if divisor is not None:
            out = out / divisor
    handle.phase, handle.done, handle.value = None, True, out
    return out


def _complete_phase(handle: Handle) -> bool:
    """Complete ``handle``'s current phase once; a finished result is kept as ``Ready``.
    Whether phases with collectives in flight remain."""
    out = handle.comm.complete(handle.phase, handle)
    handle.phase = out if isinstance(out, Phase) else Ready(out)
    return not isinstance(handle.phase, Ready)


def _advance_together(handles) -> None:
    """Run the phases of ``handles`` in lockstep passes (``Router.receive_all``); a finished
    handle's result is left as ``Ready``. Fusion groups' collectives record each pass's calls
    (``collect``) and send them fused when the pass ends."""
    live = []
    for handle in handles:
        if handle.phase is None:
            handle.comm.fusion.flush(handle.comm, handle.name)
        if not isinstance(handle.phase, Ready):
            live.append(handle)
    while live:
        groups = {}
        for h in live:
            if hasattr(h.coll, "collect"):
                groups[id(h.coll)] = h.coll
        for coll in groups.values():
            coll.collect()
        nxt = []
        for handle in live:     # (``_complete_phase``, inline)
            out = handle.comm.complete(handle.phase, handle)
            handle.phase = out if isinstance(out, Phase) else Ready(out)
            if not isinstance(handle.phase, Ready):
                nxt.append(handle)
        for coll in groups.values():
            coll.close()
        live = nxt


class Communicator(Router, ABC):
    """Base of every communicator. Subclasses implement ``issue`` and ``complete`` (and may
    override ``compress``/``approximate`` to change what one payload is, as two-phase does)
    and restrict the compressors they carry by overriding ``refusal``."""

    #: registry name, set by ``register_communicator``
    name: str = ""
    #: whether ``issue`` exchanges every rank's payload part lengths itself and takes them
    #: from the path's ``sent_lengths`` (``Call.exchanges_sizes``)
    exchanges_sizes: bool = False

    def __init__(self, compressor, memory, process_set=None):
        self.check_compressor(compressor)
        reason = memory.refusal(compressor)
        if reason is not None:
            raise ValueError(f"memory {getattr(memory, 'registry_name', type(memory).__name__)!r}"
                             f" cannot serve compressor {wire.describe(compressor)}: {reason}")
        self.compressor = compressor
        #: the path (reference or speed path) that runs the compressor on each device kind
        self.paths = Paths(compressor)
        self.memory = memory
        #: the path that runs the memory (its own methods, or a speed path of its class)
        self.feedback = feedback_of(memory)
        cls = type(self)
        #: whether ``encode`` is the base one, compensating through ``feedback`` (else a
        #: tensor's parts are never added into the memory's slot before it is sent)
        self.compensates_in_memory = not overrides(cls, Communicator, "encode")
        #: whether one payload is what the compressor's path makes of the tensor (else the
        #: error is not written while compressing: a subclass changed what it sends)
        self._plain_compress = not overrides(cls, Communicator, "compress") and \
            not overrides(cls, Communicator, "compress_with_error")
        self.process_set = validate.process_set(process_set)
        self.bytes = ByteCounter()
        self.fusion = None

    # ------------------------------------------------------------------ compatibility
    @classmethod
    def refusal(cls, compressor) -> str | None:
        """Why this communicator cannot carry ``compressor`` (None when it can). The one
        method a subclass overrides to restrict what it carries."""
        return None

    @classmethod
    def check_compressor(cls, compressor) -> None:
        """Raise ``ValueError`` naming ``compressor``, the reason and the communicators that
        would carry it, if this one cannot carry it correctly."""
        reason = cls.refusal(compressor)
        if reason is not None:
            raise wire.refuse(cls.name or cls.__name__, compressor, reason)

    # ------------------------------------------------------------------ fusion
    def fuse(self, groups) -> None:
        """Carry the payloads of each group's tensors in one collective per (kind, dtype) per
        step. ``groups``: lists of tensor names, or ``{label: names}``; tensors in no group
        travel alone (``grace_dl.communicators.fusion``)."""
        from grace_dl.communicators.fusion import Fusion

        self.fusion = Fusion(groups) if groups else None

    # ------------------------------------------------------------------ routing
    def route(self, tensor, name: str, collectives):
        """Every tensor travels on this communicator."""
        return self, self.collectives(tensor) if collectives is None else collectives

    def end_step(self) -> dict:
        """Close a training step in the byte counters; returns that step's summary. The
        framework glue calls it once per optimizer step."""
        return self.bytes.end_step()

    def collectives(self, tensor):
        """The collectives ``tensor``'s payloads travel on when ``send`` is given none:
        Horovod's, for its framework and this communicator's process set."""
        return collectives_for(tensor, self.process_set)

    # ------------------------------------------------------------------ phase 1: encode
    def encode(self, tensor, name: str, call: Call) -> Encoded:
        """Compensate, compress, and (single-round methods) update the memory once.

        Non-finite values are sent in the step they occur in and kept nowhere
        (``grace_dl.memory.base``): for a compressor that may leave a NaN/Inf out of its
        payload (``caps.drops_nonfinite``) the payload is marked (``marked``) with a 0/NaN
        scalar read from the compensated tensor (one reduction over it, no host sync; on the
        CPU a finite sum proves every entry finite and both the mark and the error slot's
        clean-up are skipped: ``ops.known_finite``); the
        compressor's accumulating state (signum's momentum) is cleaned after compressing."""
        keeps_nothing = self.feedback.keeps_nothing     # memory ``none``: skipped
        compensated = tensor if keeps_nothing else \
            self.feedback.compensate(tensor, name, self.compressor)
        mark, finite = None, False
        if self.compressor.caps.drops_nonfinite:
            # where a host read is free (CPU) and proves every entry finite, the mark (-0.0)
            # would change no bit and the error slot needs no clean-up: both skipped
            ops = ops_for(compensated)
            finite = ops.known_finite(compensated)
            if not finite:
                mark = nonfinite_mark(compensated, ops)
        # where ``compress`` is the path's, the path found once here
        compressing = self.paths.on(compensated) if self._plain_compress else self
        encoded = None
        if keeps_nothing:
            encoded = Encoded(name, *compressing.compress(compensated, name, call),
                              compensated, call)
        elif self.compressor.caps.rounds == 1:
            slot = self.feedback.error_slot(name, self.compressor)
            got = None if slot is None else \
                compressing.compress_with_error(compensated, name, call, slot)
            if got is not None:
                self.feedback.error_written(name, finite or compressing.error_finite(got[0]))
                encoded = Encoded(name, *got, compensated, call)
        if encoded is None:
            payload, ctx = compressing.compress(compensated, name, call)
            encoded = Encoded(name, payload, ctx, compensated, call)
            if self.compressor.caps.rounds == 1:
                if self.feedback.wants_approximation(self.compressor):
                    encoded.approximation = self.approximate(encoded)
                self.feedback.update(compensated, name, self.compressor, payload, ctx,
                                     encoded.approximation)
        if self.compressor.state.accumulates:
            self.compressor.state.clean(name)
        if mark is not None:
            encoded.payload = ops.add_to_floating(encoded.payload, mark)     # (``marked``)
        return encoded

    def compress(self, compensated, name: str, call: Call):
        """``(payload, ctx)`` for one tensor; two-phase compresses chunk by chunk."""
        return self.paths.on(compensated).compress(compensated, name, call)

    def compress_with_error(self, compensated, name: str, call: Call, error):
        """``compress``, also writing what it loses (``compensated`` minus its
        approximation) into ``error``, the memory's slot (the path's ``compress_with_error``);
        None where the compressor cannot, or where a subclass changed what one payload is
        (overrode ``compress``) without saying how its error is written."""
        if not self._plain_compress:
            return None
        return self.paths.on(compensated).compress_with_error(compensated, name, call, error)

    def error_finite(self, payload) -> bool:
        """Whether the error ``compress_with_error`` just wrote with ``payload`` is known to
        hold no NaN/Inf (its path's ``error_finite``; ``encode`` asks the path directly where
        it compressed with it)."""
        return self._plain_compress and self.paths.on(payload).error_finite(payload)

    def approximate(self, encoded: Encoded):
        """This rank's own payload decompressed: what its error feedback counts as sent."""
        return self.paths.on(encoded.payload).decompress(encoded.payload, encoded.ctx)

    # ------------------------------------------------------------------ phases 2 and 3
    @abstractmethod
    def issue(self, encoded: Encoded, handle: Handle) -> Phase:
        """Start the collectives for ``encoded`` on ``handle.coll``; return the phase
        ``complete`` continues from."""

    @abstractmethod
    def complete(self, phase: Phase, handle: Handle):
        """Wait for ``phase``'s collectives; return the next ``Phase`` (after starting its
        collectives) or the aggregated, summed tensor."""

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def wire_name(name: str, part: str) -> str:
        """Collective name for one piece of one tensor's traffic."""
        return f"grace.{name}.{part}"

    # ------------------------------------------------------------------ checkpointing
    def reset(self, name: str | None = None) -> None:
        """Zero the accumulated training state of tensor ``name`` (or of every tensor): the
        memory's error feedback and momenta, the compressor's momentum (signum), two-phase's
        server residuals. Step counters and warm starts (PowerSGD's Q) are kept. For users
        who roll the model back after a bad step (the memories never keep a non-finite value
        anyway: ``grace_dl.memory.base``). Call it on every rank."""
        self.memory.reset(name)
        self.compressor.reset(name)

    def state_dict(self) -> dict:
        return {"compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state.get("compressor", {}))
        self.memory.load_state_dict(state.get("memory", {}))

    def config(self) -> dict:
        """Everything that must agree across ranks (see ``fingerprint``)."""
        config = {"communicator": self.name or type(self).__name__,
                  "compressor": type(self.compressor).__name__,
                  **{f"compressor.{k}": v for k, v in config_of(self.compressor).items()},
                  "memory": type(self.memory).__name__,
                  **{f"memory.{k}": v for k, v in config_of(self.memory).items()}}
        if self.fusion is not None:
            config["fusion"] = self.fusion.config()
        return config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.compressor!r}, {self.memory!r})"


class PackingCommunicator(Communicator):
    """Base of the communicators that can send a multi-part payload packed, its parts' bytes in
    one collective per round (``wire.pack``): allgather, broadcast, two-phase. ``pack_parts``
    (agreed across ranks through ``config``) False sends one collective per part."""

    def __init__(self, compressor, memory, process_set=None, pack_parts: bool = True):
        super().__init__(compressor, memory, process_set)
        self.pack_parts = validate.boolean("pack_parts", pack_parts)

    def packed_layout(self, flats, ops):
        """The 1-D parts ``flats`` (of backend ``ops``) of one payload's ``wire.layout``
        where they travel packed (``pack_parts``, more than one part, none ``bool``), else
        None."""
        return ops.part_layout(flats) if self.pack_parts and len(flats) > 1 else None

    def config(self) -> dict:
        return {**super().config(), "pack_parts": self.pack_parts}
