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
* **Groups** (``AllReduceSynchronizer.group``): the core's fusion (``Communicator.fuse``,
  ``grace_dl.communicators.fusion``): one fused collective per group, kind and dtype per step.
  All nodes of a group must name the same pipeline and spec. Every rank must send every member
  each step (the optimizers send zeros for parameters without a gradient, as Horovod does); if
  ``receive`` comes before a group is complete, the members sent so far go out together.
* **Buckets** (``AllReduceSynchronizer.bucket`` on every node of a group of two or more): the
  group's gradients travel as one flat tensor, members in reverse node order (the backward
  pass's), named ``bucket_name(members)`` (``grace_dl.communicators.buckets``), compressed once
  by the group's pipeline, whose compressor must take a flat tensor. ``buckets`` lists them;
  the torch optimizer and the TF glue pack and unpack them, and ``route`` knows their names.
* **Spec**: ``AUTO`` leaves payloads where the gradient is, ``RING`` moves them to host memory
  for Gloo/MPI and back (``HostCollectives``), ``NCCL`` keeps them on the GPU and rejects a
  gradient that is not on one.
* **PSSynchronizer** (``sync: true``, ``staleness: 0``): reduce to ``reduction_destination`` and
  broadcast (the core's ``ps`` communicator). ``sync: false`` or ``staleness > 0`` raise "not
  supported": Horovod's collectives are synchronous.
* **Order.** The first ``receive`` of a step finishes every outstanding handle whose completion
  starts collectives (later PowerSGD rounds, two-phase's gather, the PS broadcast) in the
  strategy's node order, so those are issued in the same order on every rank, whatever order
  the framework receives in; handles that only wait are finished by their own ``receive``.
* **Agreement.** Before its first collective a dispatcher checks, with one small allgather,
  that every rank has the same fingerprint (strategy and built pipelines); on a mismatch every
  rank raises ``ValueError`` naming the variables whose nodes differ (``grace_dl.strategy.
  consensus``). Pass ``framework=`` to ``from_strategy`` to check at once instead.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from math import prod

from grace_dl.backend import collectives_for, ops_for
from grace_dl.communicators.base import ByteCounter, FanOut, Handle, Router, accumulator
from grace_dl.communicators.fusion import AUTO, NCCL, RING, HostCollectives
from grace_dl.strategy import strategy_pb2 as pb
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


def strategy_digest(strategy) -> str:
    """Digest of what a strategy asks for (its ``id``, ``path`` and ``predicted_step_s`` left
    out)."""
    copy = pb.Strategy()
    copy.CopyFrom(strategy)
    for note in ("id", "path", "predicted_step_s"):
        copy.ClearField(note)
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


def _finishes_alone(handle: Handle) -> bool:
    """Whether finishing ``handle`` only waits: its collectives are all issued and its
    communicator starts no more (single-round allreduce or allgather)."""
    comm = handle.comm
    return handle.phase is not None and comm.name in ("allreduce", "allgather") \
        and comm.compressor.caps.rounds == 1


class StrategyDispatcher(Router, FanOut):
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
        self._groups: dict[str, list[str]] = {}
        self._bucket_routes: dict[str, Route] = {}  # bucket name -> its group's route
        self.buckets: list[list[str]] = []          # member names, in ready order
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
        bucketed: dict[str, bool] = {}
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
                if bucketed.setdefault(group, sync.bucket) != sync.bucket:
                    raise ValueError(f"group {sync.group}: {node.var_name!r} has bucket="
                                     f"{sync.bucket}, {first[2]!r} has bucket="
                                     f"{bucketed[group]}; every node of a bucket sets it")
            key = pipeline.label() if root is None else f"{pipeline.label()}@{root}"
            if key not in self._comms:
                comm = pipeline.build(process_set, root=root or 0)
                comm.bytes = self.bytes
                self._comms[key] = comm
            self._routes[node.var_name] = Route(index, node.var_name, pipeline, root, group, spec,
                                                tuple(node.shape), self._comms[key])
            self._groups.setdefault(group, []).append(node.var_name)
        if not self._routes:
            raise ValueError("the strategy has no nodes")
        for label, members in self._groups.items():
            if bucketed.get(label) and len(members) > 1:
                self._add_bucket(label, members)
        by_comm: dict[int, dict[str, list[str]]] = {}
        for label, members in self._groups.items():
            if len(members) > 1 and not bucketed.get(label):
                comm = self._routes[members[0]].comm
                by_comm.setdefault(id(comm), {})[label] = members
        for comm in self._comms.values():
            comm.fuse(by_comm.get(id(comm)))

    def _add_bucket(self, label: str, members: list[str]) -> None:
        from grace_dl.communicators.buckets import bucket_name

        first = self._routes[members[0]]
        if first.comm.compressor.caps.needs_shape:
            raise ValueError(f"group {label[1:]} is a bucket, but its compressor "
                             f"{first.pipeline.compressor!r} needs each variable's shape; "
                             f"clear bucket or choose a compressor that takes a flat tensor")
        ready = members[::-1]
        shapes = [self._routes[n].shape for n in ready]
        numel = sum(prod(s) for s in shapes) if all(shapes) else None
        name = bucket_name(ready)
        self.buckets.append(ready)
        self._bucket_routes[name] = Route(first.index, name, first.pipeline, None, label,
                                          first.spec, () if numel is None else (numel,),
                                          first.comm)

    def parts(self) -> list:
        return list(self._comms.values())

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
    def node(self, name: str) -> Route:
        route = self._routes.get(name) or self._bucket_routes.get(name)
        if route is None and name.endswith(":0"):
            route = self._routes.get(name[:-2])
        if route is None:
            known = list(self._routes)
            shown = known if len(known) <= 20 else known[:20] + [f"... {len(known) - 20} more"]
            raise ValueError(f"gradient {name!r} has no node in the strategy; its variables "
                             f"are {shown}")
        return route

    def pipeline(self, name: str) -> Pipeline:
        return self.node(name).pipeline

    def communicator(self, name: str):
        return self.node(name).comm

    def accumulator(self, name: str, like):
        """The slot of ``name``'s communicator (``communicators.base.accumulator``: its
        memory's residual, where the torch optimizer's buckets add their gradients), or
        None."""
        return accumulator(self.node(name).comm, name, like)

    # ------------------------------------------------------------------ the communicator protocol
    def route(self, tensor, name: str, collectives):
        """The communicator of ``name``'s node, on collectives that follow its spec."""
        node = self.node(name)
        ops = ops_for(tensor)
        shape = ops.shape(tensor)
        if node.shape and all(isinstance(d, int) for d in shape) and tuple(shape) != node.shape:
            raise ValueError(f"gradient {name!r} has shape {tuple(shape)}, its strategy node says "
                             f"{node.shape}")
        if node.spec == NCCL and ops.device_type(tensor) == "cpu":
            raise ValueError(f"node {name!r} has spec NCCL (payloads stay on the GPU) but its "
                             f"gradient is in host memory; use spec AUTO or RING")
        if name in self._outstanding:
            raise ValueError(f"gradient {name!r} sent again before its handle was received")
        if not self._verified:
            self.verify(tensor=tensor, collectives=collectives)
        coll = collectives_for(tensor, self._process_set) if collectives is None else collectives
        if node.spec == RING:
            coll = HostCollectives(coll)
        return node.comm, coll

    def on_send(self, handle: Handle) -> None:
        self._outstanding[handle.name] = handle

    def before_receive(self, handle: Handle) -> list:
        """Every outstanding handle whose completion starts collectives (two-phase, PowerSGD's
        later rounds, PS, broadcast's sized rounds, a held fusion group) is finished in node
        order at the first receive of a step. The others (issued allreduce or allgather of a
        single-round method) only wait, so each is left to its own receive, which writes the
        result straight into the caller's buffer (``into``) instead of allocating and copying."""
        if handle.done:
            return []
        if self._outstanding.get(handle.name) is not handle:
            raise ValueError(f"handle for {handle.name!r} was already received or is not from "
                             f"this dispatcher")
        ordered = sorted((h for h in self._outstanding.values() if not _finishes_alone(h)),
                         key=lambda h: self.node(h.name).index)
        for h in ordered:
            del self._outstanding[h.name]
        self._outstanding.pop(handle.name, None)
        return ordered

    def end_step(self) -> dict:
        return self.bytes.end_step()

    def fuse(self, groups) -> None:
        """A strategy's fusion groups come from its nodes (``AllReduceSynchronizer.group``)."""
        if groups:
            raise ValueError("a strategy sets its fusion groups per node "
                             "(AllReduceSynchronizer.group); pass groups=None with it")

    # ------------------------------------------------------------------ agreement
    def verify(self, framework: str | None = None, tensor=None, collectives=None) -> None:
        """Check that every rank runs this same strategy (a collective: every rank calls it,
        as the first ``send`` does, over the collectives it was given: the DDP hook's
        ``torch.distributed`` ones, say). ``ValueError`` on every rank when they differ."""
        from grace_dl.strategy.consensus import verify

        verify(self, framework=framework, tensor=tensor, collectives=collectives)
        self._verified = True

    def summary(self) -> dict:
        """``{variable: "pipeline | group | spec"}``: what ranks compare when they disagree."""
        return {r.name: f"{r.comm.__class__.__name__}:{r.pipeline.label()}"
                        f"{'' if r.root is None else f' root={r.root}'} | group {r.group} | "
                        f"spec {SPEC_NAMES.get(r.spec, r.spec)} | shape {list(r.shape)}"
                for r in self._routes.values()}

    # ------------------------------------------------------------------ checkpoints, identity
    def reset(self, name: str | None = None) -> None:
        """``Communicator.reset`` of the pipeline carrying ``name``, or of every pipeline."""
        for comm in self._comms.values() if name is None else [self.communicator(name)]:
            comm.reset(name)

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

