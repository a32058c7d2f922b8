"""``from_strategy``: a strategy made runnable. The object it returns is what ``grace=`` takes in
the torch ``DistributedOptimizer`` and the TF tape / Keras wrappers, like a communicator from
``grace_from_params``, but each named gradient goes through the pipeline its node names.

Protocol (the communicator's): ``send(tensor, name, op) -> handle``, ``receive(handle)``,
``synchronize(tensor, name, op)``, ``end_step()``, ``check_op(op)``, ``state_dict()`` /
``load_state_dict()``, ``config()`` / ``fingerprint()``, and ``bytes``, one byte counter shared
by all pipelines, per tensor name (``end_step()``'s summary says what each variable sent, so
which pipeline carried it shows in its bytes).

* **Routing.** One communicator per distinct pipeline (compressor, memory, communicator and
  their parameters), built as ``grace_from_params`` would; memories and compressors key their
  state by tensor name, so variables sharing a pipeline never share state. A gradient whose name
  has no node raises ``ValueError`` naming it and the strategy's variables.
* **Groups** (``AllReduceSynchronizer.group``): one fused collective per group, kind and dtype
  per step (``grace_dl.strategy.fusion``). All nodes of a group must name the same pipeline and
  spec. Every rank must send every member each step (the optimizers send zeros for parameters
  without a gradient, as Horovod does); if ``receive`` comes before a group is complete, the
  members sent so far go out together. A communicator that overrides ``send`` and starts its
  own collectives (``twophase``) cannot be held back: its nodes need groups of their own.
* **Spec**: ``AUTO`` leaves payloads where the gradient is, ``RING`` moves them to host memory
  for Gloo/MPI and back (not for ``twophase``, for the same reason), ``NCCL`` keeps them on the
  GPU and rejects a gradient that is not on one.
* **PSSynchronizer** (``sync: true``, ``staleness: 0``): reduce to ``reduction_destination`` and
  broadcast (``grace_dl.strategy.ps``). ``sync: false`` or ``staleness > 0`` raise "not
  supported": Horovod's collectives are synchronous.
* **Order.** The first ``receive`` of a step finishes every outstanding handle in the strategy's
  node order, so collectives started while finishing (later PowerSGD rounds, the PS broadcast)
  are issued in the same order on every rank, whatever order the framework receives in.
* **Agreement.** Before its first collective a dispatcher checks, with one small allgather,
  that every rank has the same fingerprint (strategy and built pipelines); on a mismatch every
  rank raises ``ValueError`` naming the variables whose nodes differ (``grace_dl.strategy.
  consensus``). Pass ``framework=`` to ``from_strategy`` to check at once instead.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from grace_dl.backend import collectives_for, ops_for
from grace_dl.communicators.base import AVERAGE, ByteCounter, Communicator, Handle, check_op
from grace_dl.strategy import strategy_pb2 as pb
from grace_dl.strategy.fusion import AUTO, NCCL, RING, GroupCollectives
from grace_dl.strategy.pipeline import Pipeline
from grace_dl.strategy.serialize import coerce, to_bytes

SUPPORTED_VERSION = 1
SPEC_NAMES = {AUTO: "AUTO", NCCL: "NCCL", RING: "RING"}


@dataclass
class Route:
    """Where one variable's gradient goes."""

    index: int            # position in the strategy (the fixed order on every rank)
    name: str
    pipeline: Pipeline
    root: int | None      # the reducing rank for PS nodes
    group: str            # fusion group label
    spec: int
    shape: tuple
    comm: object = None


class _Group:
    def __init__(self, label: str):
        self.label = label
        self.members: list[str] = []
        self.waiting: dict[str, tuple] = {}


def _own_send(comm) -> bool:
    """Whether ``comm`` overrides ``send`` (twophase): it then starts its collectives itself,
    which the dispatcher can neither hold back for fusion nor move to host memory."""
    return type(comm).send is not Communicator.send


def strategy_digest(strategy) -> str:
    """Digest of what a strategy asks for (its ``id`` and ``path`` left out)."""
    copy = pb.Strategy()
    copy.CopyFrom(strategy)
    copy.ClearField("id")
    copy.ClearField("path")
    return hashlib.sha256(to_bytes(copy)).hexdigest()[:16]


def destination_rank(node, replicas) -> int:
    dest = node.PSSynchronizer.reduction_destination
    if dest == "":
        return 0
    if dest in replicas:
        return list(replicas).index(dest)
    if dest.isdigit():
        return int(dest)
    raise ValueError(f"node {node.var_name!r}: reduction_destination {dest!r} is neither a rank "
                     f"number nor one of graph_config.replicas {list(replicas)}")


def _check_node(node) -> None:
    if not node.var_name:
        raise ValueError("a strategy node has an empty var_name")
    which = node.WhichOneof("synchronizer")
    if which is None:
        raise ValueError(f"node {node.var_name!r} has no synchronizer; set AllReduceSynchronizer "
                         f"or PSSynchronizer")
    if node.partitioner or len(node.part_config):
        raise ValueError(f"node {node.var_name!r}: variable partitioning (partitioner "
                         f"{node.partitioner!r}, {len(node.part_config)} part_config) is not "
                         f"supported by grace_dl; remove it")
    if which == "AllReduceSynchronizer" and node.AllReduceSynchronizer.group < 0:
        raise ValueError(f"node {node.var_name!r}: fusion group must be >= 0, got "
                         f"{node.AllReduceSynchronizer.group}")
    if which == "PSSynchronizer":
        ps = node.PSSynchronizer
        if not ps.sync:
            raise ValueError(f"node {node.var_name!r}: PSSynchronizer with sync=false "
                             f"(asynchronous updates) is not supported: Horovod's collectives are "
                             f"synchronous; set sync: true")
        if ps.staleness != 0:
            raise ValueError(f"node {node.var_name!r}: PSSynchronizer staleness={ps.staleness} "
                             f"is not supported (bounded-staleness training needs asynchronous "
                             f"servers); set staleness: 0")


class StrategyDispatcher:
    """Routes each named gradient to the pipeline its strategy node names (module doc)."""

    def __init__(self, strategy, process_set=None, variables=None):
        strategy = coerce(strategy)
        if strategy.version > SUPPORTED_VERSION:
            raise ValueError(f"strategy version {strategy.version} is newer than this grace_dl "
                             f"reads (versions 0..{SUPPORTED_VERSION}); upgrade grace_dl")
        self.strategy = pb.Strategy()
        self.strategy.CopyFrom(strategy)
        self.bytes = ByteCounter()
        self._process_set = process_set
        self._routes: dict[str, Route] = {}
        self._groups: dict[str, _Group] = {}
        self._comms: dict[str, object] = {}
        self._outstanding: dict[str, Handle] = {}
        self._verified = False
        self._build(process_set)
        if variables is not None:
            self.check_variables(variables)

    # ------------------------------------------------------------------ set-up
    def _build(self, process_set) -> None:
        replicas = list(self.strategy.graph_config.replicas)
        group_pipeline: dict[str, tuple] = {}
        for index, node in enumerate(self.strategy.node_config):
            _check_node(node)
            if node.var_name in self._routes:
                raise ValueError(f"variable {node.var_name!r} has more than one node")
            pipeline = Pipeline.from_node(node)
            if node.WhichOneof("synchronizer") == "PSSynchronizer":
                root, spec, group = destination_rank(node, replicas), AUTO, f"ps{index}"
            else:
                sync = node.AllReduceSynchronizer
                root, spec, group = None, int(sync.spec), f"g{sync.group}"
                first = group_pipeline.setdefault(group, (pipeline, spec, node.var_name))
                if first[:2] != (pipeline, spec):
                    raise ValueError(
                        f"group {sync.group} mixes pipelines: {first[2]!r} has "
                        f"{first[0].label()} spec {SPEC_NAMES.get(first[1], first[1])}, "
                        f"{node.var_name!r} has {pipeline.label()} spec "
                        f"{SPEC_NAMES.get(spec, spec)}; one fused collective needs one pipeline")
            key = pipeline.label() if root is None else f"{pipeline.label()}@{root}"
            if key not in self._comms:
                comm = pipeline.build(process_set, root=root or 0)
                comm.bytes = self.bytes
                self._comms[key] = comm
            route = Route(index, node.var_name, pipeline, root, group, spec, tuple(node.shape),
                          self._comms[key])
            if _own_send(route.comm) and spec == RING:
                raise ValueError(f"node {node.var_name!r}: communicator {pipeline.communicator!r} "
                                 f"starts its own collectives, so spec RING cannot move its "
                                 f"payloads; use spec AUTO")
            self._routes[node.var_name] = route
            self._groups.setdefault(group, _Group(group)).members.append(node.var_name)
        if not self._routes:
            raise ValueError("the strategy has no nodes")
        for group in self._groups.values():
            comm = self._routes[group.members[0]].comm
            if len(group.members) > 1 and _own_send(comm):
                raise ValueError(f"group {group.label[1:]} fuses {group.members} but their "
                                 f"communicator {comm.name!r} starts its own collectives and "
                                 f"cannot be fused; give each of its nodes its own group")

    @property
    def process_set(self):
        return self._process_set

    @process_set.setter
    def process_set(self, value) -> None:
        self._process_set = value
        for comm in self._comms.values():
            comm.process_set = value

    def check_variables(self, variables) -> None:
        """``ValueError`` unless the strategy has exactly one node per variable (names, and
        shapes where both sides know them). ``variables``: names, or what builders take."""
        from grace_dl.strategy.variables import variables_of

        items = list(variables.items()) if isinstance(variables, dict) else list(variables)
        if items and all(isinstance(v, str) for v in items):
            given = {v: () for v in items}
        else:
            given = {v.name: v.shape for v in variables_of(items)}
        missing = [n for n in given if n not in self._routes]
        extra = [n for n in self._routes if n not in given]
        problems = []
        if missing:
            problems.append(f"variables with no node in the strategy: {missing}")
        if extra:
            problems.append(f"nodes naming no variable of the model: {extra}")
        wrong = [f"{n} (strategy {self._routes[n].shape}, model {s})" for n, s in given.items()
                 if n in self._routes and s and self._routes[n].shape
                 and tuple(s) != self._routes[n].shape]
        if wrong:
            problems.append(f"shapes differ: {wrong}")
        if problems:
            raise ValueError("strategy does not match the model: " + "; ".join(problems))

    # ------------------------------------------------------------------ routing
    def route(self, name: str) -> Route:
        route = self._routes.get(name)
        if route is None and name.endswith(":0"):
            route = self._routes.get(name[:-2])
        if route is None:
            known = list(self._routes)
            shown = known if len(known) <= 20 else known[:20] + [f"... {len(known) - 20} more"]
            raise ValueError(f"gradient {name!r} has no node in the strategy; its variables "
                             f"are {shown}")
        return route

    def pipeline(self, name: str) -> Pipeline:
        return self.route(name).pipeline

    def communicator(self, name: str):
        return self.route(name).comm

    # ------------------------------------------------------------------ the communicator protocol
    def check_op(self, op: str) -> str:
        return check_op(op)

    def send(self, tensor, name: str, op: str = AVERAGE, collectives=None) -> Handle:
        op = self.check_op(op)
        route = self.route(name)
        ops = ops_for(tensor)
        shape = ops.shape(tensor)
        if route.shape and all(isinstance(d, int) for d in shape) and tuple(shape) != route.shape:
            raise ValueError(f"gradient {name!r} has shape {tuple(shape)}, its strategy node says "
                             f"{route.shape}")
        if route.spec == NCCL and ops.device_type(tensor) == "cpu":
            raise ValueError(f"node {name!r} has spec NCCL (payloads stay on the GPU) but its "
                             f"gradient is in host memory; use spec AUTO or RING")
        if name in self._outstanding:
            raise ValueError(f"gradient {name!r} sent again before its handle was received")
        if not self._verified:
            self.verify(tensor=tensor)
        group = self._groups[route.group]
        comm = route.comm
        if _own_send(comm):
            handle = comm.send(tensor, name, op, collectives)
            self._outstanding[name] = handle
            return handle
        coll = collectives_for(tensor, self._process_set) if collectives is None else collectives
        comm.compressor.rank = coll.rank()
        payload, ctx, compensated = comm.encode(tensor, name)
        handle = Handle(name=name, op=op, ctx=ctx, pending=None, coll=None,
                        extra={"compensated": compensated})
        self._outstanding[name] = handle
        group.waiting[name] = (payload, handle, coll)
        if len(group.waiting) == len(group.members):
            self._start(group)
        return handle

    def receive(self, handle: Handle):
        if "result" not in handle.extra:
            if self._outstanding.get(handle.name) is not handle:
                raise ValueError(f"handle for {handle.name!r} was already received or is not "
                                 f"from this dispatcher")
            self._drain()
        return handle.extra.pop("result")

    def synchronize(self, tensor, name: str, op: str = AVERAGE, collectives=None):
        return self.receive(self.send(tensor, name, op, collectives))

    def end_step(self) -> dict:
        return self.bytes.end_step()

    def _start(self, group: _Group) -> None:
        waiting, group.waiting = group.waiting, {}
        first_name = next(iter(waiting))
        route = self._routes[first_name]
        coll = GroupCollectives(waiting[first_name][2], group.label, route.spec,
                                collecting=len(group.members) > 1,
                                equal_sizes=route.comm.compressor.equal_sizes,
                                counter=self.bytes)
        for name in group.members:
            if name in waiting:
                payload, handle, _ = waiting[name]
                handle.coll = coll
                handle.pending = self._routes[name].comm._start(payload, handle)
        coll.close()

    def _drain(self) -> None:
        for group in self._groups.values():
            if group.waiting:
                self._start(group)
        pending = sorted(self._outstanding.values(), key=lambda h: self._routes[h.name].index)
        self._outstanding.clear()
        for handle in pending:
            handle.extra["result"] = self._routes[handle.name].comm.receive(handle)

    # ------------------------------------------------------------------ agreement
    def verify(self, framework: str | None = None, tensor=None) -> None:
        """Check that every rank runs this same strategy (a collective: every rank calls it,
        as the first ``send`` does). ``ValueError`` on every rank when they differ."""
        from grace_dl.strategy.consensus import verify

        verify(self, framework=framework, tensor=tensor)
        self._verified = True

    def summary(self) -> dict:
        """``{variable: "pipeline | group | spec"}``: what ranks compare when they disagree."""
        return {r.name: f"{r.comm.__class__.__name__}:{r.pipeline.label()}"
                        f"{'' if r.root is None else f' root={r.root}'} | group {r.group} | "
                        f"spec {SPEC_NAMES.get(r.spec, r.spec)} | shape {list(r.shape)}"
                for r in self._routes.values()}

    # ------------------------------------------------------------------ checkpoints, identity
    def state_dict(self) -> dict:
        return {key: comm.state_dict() for key, comm in self._comms.items()}

    def load_state_dict(self, state: dict) -> None:
        unknown = sorted(set(state) - set(self._comms))
        if unknown:
            raise ValueError(f"state has pipelines {unknown} that this strategy does not run "
                             f"(it runs {sorted(self._comms)})")
        for key, value in state.items():
            self._comms[key].load_state_dict(value)

    def config(self) -> dict:
        return {"strategy": strategy_digest(self.strategy), "version": self.strategy.version,
                "nodes": len(self._routes),
                "pipelines": {key: comm.config() for key, comm in sorted(self._comms.items())}}

    def fingerprint(self) -> str:
        text = json.dumps(self.config(), sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return (f"StrategyDispatcher({len(self._routes)} variables, {len(self._comms)} pipelines, "
                f"{len(self._groups)} groups, fingerprint {self.fingerprint()})")


def from_strategy(strategy_or_path, process_set=None, variables=None,
                  framework: str | None = None) -> StrategyDispatcher:
    """A ``grace=`` object for ``strategy_or_path`` (a ``Strategy``, a file, or its bytes).

    ``variables``: the model's parameters/variables (or names) to check the strategy against.
    ``framework``: ``"torch"`` or ``"tensorflow"`` to check agreement across ranks now (needs
    Horovod initialised); otherwise that happens before the first collective.
    """
    dispatcher = StrategyDispatcher(strategy_or_path, process_set=process_set,
                                    variables=variables)
    if framework is not None:
        dispatcher.verify(framework=framework)
    return dispatcher

