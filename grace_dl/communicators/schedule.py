"""``Schedule``: switch the compression pipeline at chosen optimizer steps, on every rank together.

    from grace_dl import Schedule
    grc = Schedule({0: {"compressor": "none", "communicator": "allreduce"},      # dense warm-up
                    200: {"compressor": "topk", "compress_ratio": 0.01, "memory": "residual",
                          "communicator": "allgather"}})
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), grace=grc)

Dense warm-up before sparsification is DGC's (Lin et al. 2018, "Deep Gradient Compression",
§3.4: "warm-up training"); users of GRACE (issue 4) and Horovod (issue 2013) asked to change
the method or its ratio during training without rebuilding the optimizer and losing its state.

A ``Schedule`` is a ``grace=`` object like a communicator: the torch ``DistributedOptimizer``,
the TF ``DistributedGradientTape`` and Keras wrapper (eager), and anything else that drives
``send`` / ``receive`` / ``end_step`` take it. Each *stage* is a ``grace_from_params`` dict or
a ready ``grace=`` object (a communicator, a strategy dispatcher); the stage that starts at step
``s`` carries every gradient of optimizer steps ``s, s+1, ...`` until the next stage starts.

**When it switches.** The step counter is the number of ``end_step()`` calls, which the
framework glue makes exactly once per optimizer step after every gradient of the step has been
received; so every rank switches between the same two steps, and no handle is ever in flight
across a switch. Horovod's collectives are synchronous per step, so ranks cannot be at
different steps when they send.

**What is carried across a switch.** Error-feedback residuals are handed over, per tensor name,
from the stage that ends to the one that starts, so nothing the old stage left unsent is lost:

* the old memory's residual in gradient units is taken out: ``residual`` and ``powersgd``:
  their residual; ``dgc`` and ``momentum`` (with error feedback): the accumulated velocity (what
  was not sent); ``efsignsgd``: its error divided by its ``lr``; ``none``: nothing;
* the new stage receives it in its memory's residual slot when it has one (``residual``,
  ``powersgd``, ``dgc``/``momentum`` velocity, ``efsignsgd`` times its ``lr``); otherwise
  (memory ``none``, or ``momentum`` without error feedback) it is **flushed**: added once to
  that tensor's next gradient, so it travels with the first step of the new stage;
* a momentum buffer (memories ``dgc`` and ``momentum``) moves to the next stage when its
  memory has one too (warm-up with momentum in the memory, then sparsify with the same
  momentum); otherwise it is dropped, a smoothing of gradients already sent;
* the old stage's memory is then zeroed. A memory of another class may take part by defining
  ``residuals() -> {name: array}`` and ``add_residuals({name: array})``; any other memory's
  state stays where it is (and a ``UserWarning`` says so at construction);
* a two-phase communicator's server residuals (the aggregate's error on the chunk this rank
  serves) go to the communicator that carries the tensor next where that is two-phase with
  server error feedback too (same keys: the ranks serve the same chunks); elsewhere they are
  dropped, and a ``UserWarning`` at construction says so.

Compressor state (randomk's step counters, PowerSGD's warm-start Q) belongs to its stage and
is kept in the stage's ``state_dict``. A stage that is a strategy dispatcher (several
pipelines, e.g. ``SizeThreshold``'s compressed and dense ones) hands over and receives per
tensor: each tensor's residual and momentum go to the memory of the pipeline that carries that
tensor in the new stage (flushed if that one has no residual slot, as above).

**Checkpoints.** ``state_dict()`` holds the step counter, every stage's state and any residual
waiting to be flushed; ``load_state_dict()`` restores them, so a run resumed mid-schedule is in
the right stage and continues bit for bit. ``fingerprint()`` covers the stages and their start
steps (not the counter), so ranks and checkpoints of different schedules are told apart.

**Validation** at construction: the steps are non-negative integers, the first is 0, and each
stage builds (a bad stage raises ``ValueError`` naming its step and the reason).

**TensorFlow graph mode.** Inside ``tf.function`` the pipeline is traced once, so a Python-level
switch cannot take effect; ``send`` raises ``ValueError`` there. Use eager execution (Keras:
``run_eagerly=True``) with a ``Schedule``.
"""

from __future__ import annotations

import collections
import warnings

import numpy as np

from grace_dl.communicators.base import (
    AVERAGE,
    ByteCounter,
    FanOut,
    accumulator,
    advance_each,
    as_written,
    fingerprint_of,
    receive_each,
)
from grace_dl.communicators.twophase import TwoPhase
from grace_dl.contracts import check_grace
from grace_dl.params import grace_from_params
from grace_dl.recipes import communicators


class _ScheduleBytes(ByteCounter):
    """The schedule's byte counter: one entry per step in ``steps`` whatever stage ran it;
    ``sent``/``received`` are the running stage's counters for the step in progress."""

    def __init__(self, schedule):
        self._schedule = schedule
        self.steps: list[dict] = []

    @property
    def sent(self):
        return self._schedule.active.bytes.sent

    @property
    def received(self):
        return self._schedule.active.bytes.received

    def add(self, name, sent=0, received=0):
        self._schedule.active.bytes.add(name, sent, received)

    def end_step(self) -> dict:
        raise RuntimeError("call Schedule.end_step(), not Schedule.bytes.end_step()")

    def reset(self) -> None:
        self.steps.clear()
        for _, stage in self._schedule.stages:
            stage.bytes.reset()


class _Handle:
    """A stage's handle and the stage that made it."""

    __slots__ = ("stage", "inner")

    def __init__(self, stage, inner):
        self.stage = stage
        self.inner = inner

    @property
    def name(self):
        return self.inner.name


class Schedule(FanOut):
    """A ``grace=`` object that runs ``stages[s]`` from optimizer step ``s`` on (see the module
    docstring). ``stages``: ``{step: grace_from_params dict or grace= object}``."""

    def __init__(self, stages: dict):
        if not isinstance(stages, dict) or not stages:
            raise ValueError(f"Schedule takes a non-empty dict {{step: pipeline}} (a "
                             f"grace_from_params dict or a grace= object per step), got "
                             f"{stages!r}")
        for step in stages:
            if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
                raise ValueError(f"Schedule steps must be non-negative integers, got {step!r} "
                                 f"(steps given: {list(stages)})")
        steps = sorted(int(s) for s in stages)
        if steps[0] != 0:
            raise ValueError(f"Schedule's first step must be 0 (the pipeline training starts "
                             f"with), got first step {steps[0]} (steps given: {steps})")
        built = []
        seen = {}
        for step in steps:
            spec = stages[step]
            if isinstance(spec, dict):
                try:
                    stage = grace_from_params(spec)
                except ValueError as err:
                    raise ValueError(f"Schedule stage at step {step}: {err}") from None
            else:
                try:
                    check_grace(spec)
                except ValueError as err:
                    raise ValueError(f"Schedule stage at step {step} must be a grace_from_params "
                                     f"dict or a grace= object, got {spec!r}: {err}") from None
                if id(spec) in seen:
                    raise ValueError(f"Schedule stages at steps {seen[id(spec)]} and {step} are "
                                     f"the same object; give each stage its own (their state "
                                     f"and byte counters must not be shared)")
                seen[id(spec)] = step
                stage = spec
            if getattr(stage, "buckets", None):
                raise ValueError(f"Schedule stage at step {step} is a strategy that packs "
                                 f"variables into buckets ({len(stage.buckets)}: "
                                 f"AllReduceSynchronizer.bucket, as Auto writes them); the "
                                 f"framework glue lays out a step's buckets once, not per stage, "
                                 f"so a Schedule cannot carry them: build the strategy without "
                                 f"(Auto(..., bucket_bytes=None))")
            built.append((step, stage))
        for i, (step, stage) in enumerate(built):
            _warn_if_not_carried(step, stage, built[i + 1] if i + 1 < len(built) else None)
        self.stages: list[tuple[int, object]] = built
        self.step = 0
        self._index = 0
        self._carry: dict[str, np.ndarray] = {}
        self._process_set = None
        self.bytes = _ScheduleBytes(self)

    # ------------------------------------------------------------------ where we are
    @property
    def active(self):
        """The grace object of the running stage."""
        return self.stages[self._index][1]

    @property
    def stage_start(self) -> int:
        """The step the running stage started at."""
        return self.stages[self._index][0]

    def _index_for(self, step: int) -> int:
        index = 0
        for i, (start, _) in enumerate(self.stages):
            if start <= step:
                index = i
        return index

    # The running stage's compressor and memory, for code that inspects a communicator.
    @property
    def compressor(self):
        return getattr(self.active, "compressor", None)

    @property
    def memory(self):
        return getattr(self.active, "memory", None)

    def parts(self) -> list:
        return [stage for _, stage in self.stages]

    # ------------------------------------------------------------------ the grace= contract
    def check_op(self, op: str) -> str:
        for _, stage in self.stages:
            op = stage.check_op(op)
        return op

    def fuse(self, groups) -> None:
        """Every stage fuses the same groups."""
        for _, stage in self.stages:
            stage.fuse(groups)

    @as_written
    def send(self, tensor, name: str, op: str = AVERAGE, collectives=None, into=None):
        if type(tensor).__module__.startswith("tensorflow"):
            import tensorflow as tf

            if not tf.executing_eagerly():
                raise ValueError("a grace_dl Schedule cannot switch stages inside tf.function "
                                 "(the pipeline is traced once); run the training step eagerly "
                                 "(Keras: model.compile(..., run_eagerly=True))")
        carried = self._carry.pop(name, None)
        if carried is not None:
            tensor = tensor + _like(carried, tensor)
        stage = self.active
        return _Handle(stage, stage.send(tensor, name, op, collectives, into))

    @as_written
    def receive(self, handle, into=None):
        if not isinstance(handle, _Handle):
            raise ValueError(f"Schedule.receive takes a handle from Schedule.send, got "
                             f"{type(handle).__name__}")
        return handle.stage.receive(handle.inner, into)

    @as_written
    def receive_all(self, handles, intos=None) -> list:
        """``receive`` for several handles; those of one stage (a step's all are) go to its
        ``receive_all`` (phases in lockstep)."""
        handles = list(handles)
        for handle in handles:
            if not isinstance(handle, _Handle):
                raise ValueError(f"Schedule.receive_all takes handles from Schedule.send, got "
                                 f"{type(handle).__name__}")
        stages = {id(h.stage): h.stage for h in handles}
        if len(stages) == 1:
            (stage,) = stages.values()
            return receive_each(stage, [h.inner for h in handles], intos)
        intos = [None] * len(handles) if intos is None else list(intos)
        return [self.receive(h, into) for h, into in zip(handles, intos)]

    def synchronize(self, tensor, name: str, op: str = AVERAGE, collectives=None, into=None):
        return self.receive(self.send(tensor, name, op, collectives, into))

    def advance(self, pending) -> int:
        """The running stage's ``advance`` (``Router.advance``; every handle of a step is that
        stage's) on ``pending``'s handles, the deque left in the order the stage left them."""
        outer = {id(h.inner): h for h in pending}
        inner = collections.deque(h.inner for h in pending)
        done = advance_each(self.active, inner)
        pending.clear()
        pending.extend(outer[id(h)] for h in inner)
        return done

    def accumulator(self, name: str, like):
        """The running stage's slot for ``name`` (``communicators.base.accumulator``); None
        while a residual carried over from the last stage waits to be added to ``name``'s
        next gradient (``send`` adds it to the tensor, whose values the slot would not read)."""
        if name in self._carry:
            return None
        return accumulator(self.active, name, like)

    def end_step(self) -> dict:
        """Close the step in the running stage, count it, and switch stage if the next step
        starts one. Returns the step's byte summary with the ``stage`` (its start step)."""
        summary = dict(self.active.end_step())
        summary["stage"] = self.stage_start
        self.bytes.steps.append(summary)
        self.step += 1
        index = self._index_for(self.step)
        if index != self._index:
            self._switch(index)
        return summary

    def _switch(self, index: int) -> None:
        old, new = self.active, self.stages[index][1]
        momenta, carried = {}, {}
        for memory in _memories(old):
            momenta.update(_take_momenta(memory))
            carried.update(_take_residuals(memory))
        servers = {}
        for comm in communicators(old):
            servers.update(_take_server_residuals(comm))
        for name, value in self._carry.items():        # not yet flushed: keep it
            carried[name] = carried.get(name, 0) + value
        # each tensor's residual and momentum go to the memory that carries it in the new stage
        owners: dict[int, tuple] = {}
        for name in set(carried) | set(momenta):
            memory = _memory_for(new, name)
            entry = owners.setdefault(id(memory), (memory, {}, {}))
            if name in carried:
                entry[1][name] = carried[name]
            if name in momenta:
                entry[2][name] = momenta[name]
        self._carry = {}
        for memory, residuals, moms in owners.values():
            self._carry.update(_give_residuals(memory, residuals))
            _give_momenta(memory, moms)
        for key, value in servers.items():      # a two-phase server's, to the next one's
            comm = _communicator_for(new, key.rsplit("/chunk", 1)[0])
            if _keeps_server_residuals(comm):
                comm.server.load_state_dict({key: value})
        self._index = index

    def reset(self, name: str | None = None) -> None:
        """Zero the accumulated training state of tensor ``name`` (or of every tensor) in
        every stage (``Communicator.reset``: error feedback, momenta), and drop what a stage
        switch handed over and the next stage has not taken yet. The step count, and with it
        the running stage, is kept. Call it on every rank."""
        for _, stage in self.stages:
            stage.reset(name)
        if name is None:
            self._carry = {}
        else:
            self._carry.pop(name, None)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"step": int(self.step),
                "stages": {str(start): stage.state_dict() for start, stage in self.stages},
                "carry": {k: np.asarray(v) for k, v in self._carry.items()}}

    def load_state_dict(self, state: dict) -> None:
        stages = state.get("stages", {})
        unknown = sorted(set(stages) - {str(s) for s, _ in self.stages})
        if unknown:
            raise ValueError(f"checkpoint has schedule stages starting at {unknown}, this "
                             f"Schedule's start at {[s for s, _ in self.stages]}")
        for start, stage in self.stages:
            if str(start) in stages:
                stage.load_state_dict(stages[str(start)])
        self.step = int(np.asarray(state.get("step", 0)))
        self._index = self._index_for(self.step)
        self._carry = {k: np.asarray(v) for k, v in state.get("carry", {}).items()}

    def config(self) -> dict:
        return {"schedule": [[start, stage.config()] for start, stage in self.stages]}

    def fingerprint(self) -> str:
        return fingerprint_of(self.config())

    def __repr__(self) -> str:
        inner = ", ".join(f"{start}: {stage!r}" for start, stage in self.stages)
        return f"Schedule({{{inner}}})"


# ---------------------------------------------------------------------- residual hand-over
def _residual_keys(memory):
    """``(prefix, scale)``: where ``memory`` keeps a residual in its state and the factor from
    gradient units to its own, or None if it keeps none this module knows."""
    kind = type(memory).__name__
    if kind in ("ResidualMemory", "PowerSGDMemory"):
        return "", 1.0
    if kind == "EFSignSGDMemory":
        return "", float(memory.lr)
    if kind == "DgcMemory" or (kind == "MomentumMemory" and memory.error_feedback):
        return "velocity/", 1.0
    return None


def _knows(memory) -> bool:
    if memory is None or type(memory).__name__ in ("NoneMemory", "MomentumMemory"):
        return True
    if callable(getattr(memory, "residuals", None)):
        return True
    return _residual_keys(memory) is not None


def _memories(stage) -> list:
    """Every memory of a stage: a communicator's, or each pipeline's of a strategy dispatcher."""
    return [comm.memory for comm in communicators(stage)]


def _memory_for(stage, name: str):
    """The memory that carries tensor ``name`` in ``stage`` (None if no pipeline names it)."""
    return getattr(_communicator_for(stage, name), "memory", None)


def _communicator_for(stage, name: str):
    """The communicator that carries tensor ``name`` in ``stage`` (None if none names it)."""
    if callable(getattr(stage, "communicator", None)):      # a strategy dispatcher
        try:
            return stage.communicator(name)
        except ValueError:
            return None
    return stage


def _keeps_server_residuals(comm) -> bool:
    """Whether ``comm`` is a two-phase communicator with server-side error feedback."""
    return isinstance(comm, TwoPhase) and comm.server_error_feedback


def _take_server_residuals(comm) -> dict:
    """A two-phase communicator's server residuals (``<name>/chunk<j>``: the aggregate's
    error, in gradient units, of the chunk this rank serves), its slots zeroed."""
    if not _keeps_server_residuals(comm):
        return {}
    state = comm.server.state_dict()
    comm.server.load_state_dict({k: np.zeros_like(v) for k, v in state.items()})
    return state


def _warn_if_not_carried(step, stage, following=None) -> None:
    """A ``UserWarning`` for state of ``stage`` that the switch to ``following`` (the
    ``(step, stage)`` after it, if any) drops."""
    for memory in _memories(stage):
        if not _knows(memory):
            warnings.warn(f"Schedule stage at step {step}: memory {type(memory).__name__} "
                          f"defines no residuals()/add_residuals(); its error-feedback state is "
                          f"not handed to the next stage", UserWarning, stacklevel=3)
    if following is not None and any(map(_keeps_server_residuals, communicators(stage))) and \
            not all(map(_keeps_server_residuals, communicators(following[1]))):
        warnings.warn(f"Schedule stage at step {step}: its two-phase server residuals go to "
                      f"the next stage only where that is two-phase with server error "
                      f"feedback too; at step {following[0]} the others are dropped",
                      UserWarning, stacklevel=3)


def _has_momentum(memory) -> bool:
    return type(memory).__name__ in ("DgcMemory", "MomentumMemory")


def _take_momenta(memory) -> dict:
    """The momentum buffers of a ``dgc``/``momentum`` memory, by tensor name (else none)."""
    if not _has_momentum(memory):
        return {}
    return {k[len("momentum/"):]: v for k, v in memory.state.state_dict().items()
            if k.startswith("momentum/")}


def _give_momenta(memory, momenta: dict) -> None:
    if momenta and _has_momentum(memory):
        memory.state.load_state_dict({f"momentum/{k}": v for k, v in momenta.items()})


def _take_residuals(memory) -> dict:
    """Every residual of ``memory`` in gradient units, by tensor name; the memory is zeroed."""
    if memory is None:
        return {}
    if callable(getattr(memory, "residuals", None)):
        return dict(memory.residuals())
    state = memory.state.state_dict() if hasattr(memory, "state") else {}
    zeroed = {k: np.zeros_like(v) for k, v in state.items()}
    where = _residual_keys(memory)
    out = {}
    if where is not None:
        prefix, scale = where
        for key, value in state.items():
            if key.startswith(prefix):     # prefix "": every key is a tensor's residual
                out[key[len(prefix):]] = value / scale
    if zeroed and (where is not None or type(memory).__name__ == "MomentumMemory"):
        memory.state.load_state_dict(zeroed)
    return out


def _give_residuals(memory, residuals: dict) -> dict:
    """Put ``residuals`` into ``memory``'s residual slots; return what must be flushed into
    the next gradients instead."""
    if not residuals:
        return {}
    if memory is not None and callable(getattr(memory, "add_residuals", None)):
        memory.add_residuals(residuals)
        return {}
    where = _residual_keys(memory) if memory is not None else None
    if where is None:
        return {k: np.asarray(v) for k, v in residuals.items()}
    prefix, scale = where
    current = memory.state.state_dict()
    memory.state.load_state_dict({
        prefix + name: current.get(prefix + name, 0) + np.asarray(value) * scale
        for name, value in residuals.items()})
    return {}


def _like(array, tensor):
    """``array`` as a tensor of ``tensor``'s framework, dtype, shape and device."""
    from grace_dl.backend import ops_for

    ops = ops_for(tensor)
    value = ops.from_numpy(np.asarray(array), like=tensor)
    return ops.reshape(ops.cast(value, ops.dtype(tensor)), ops.shape(tensor))
