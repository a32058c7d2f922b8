"""Strategy builders (AutoDist's ``StrategyBuilder``): each makes a ``Strategy`` from a model's
variables and, optionally, a resource spec.

    strategy = SizeThreshold(1024, {"compressor": "topk", "compress_ratio": 0.01,
                                    "memory": "residual", "communicator": "allgather"}
                             ).build(model.named_parameters(), "cluster.yaml")

``build(named_parameters_or_shapes, resource_spec=None)`` takes torch ``named_parameters()``,
TF/Keras variables or a dict ``name -> shape`` (see ``grace_dl.strategy.variables``), and a
``ResourceSpec``, a dict or a YAML path (``grace_dl.strategy.resource_spec``); with a resource
spec the strategy lists its replicas, and the dispatcher checks their number against Horovod's.

Every builder checks each pipeline it writes by constructing it once, so a bad name or value
raises ``ValueError`` at build time, not on the first step.

**Fusion groups.** ``chunk_size`` consecutive variables *of the same pipeline* share a group
(one fused collective per group and step). With one pipeline for all variables this is
AutoDist's ``group = index // chunk_size``; ``chunk_size=1`` means no fusion. Every
communicator fuses (``grace_dl.communicators.fusion``); a strategy only says which variables.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import datetime, timezone

from grace_dl.strategy import strategy_pb2 as pb
from grace_dl.strategy.cost_model import (
    PATTERNS,
    Network,
    Prediction,
    Throughput,
    predict,
)
from grace_dl.strategy.pipeline import LEGACY_NAMES, Pipeline
from grace_dl.strategy.resource_spec import ResourceSpec
from grace_dl.strategy.variables import Variable, variables_of
from grace_dl.validate import in_range, one_of

VERSION = 1
SPECS = tuple(pb.AllReduceSynchronizer.Spec.keys())
NONE = Pipeline()


def _spec_value(spec) -> int:
    if isinstance(spec, str):
        return pb.AllReduceSynchronizer.Spec.Value(one_of("spec", spec.upper(), SPECS))
    return int(one_of("spec", spec, tuple(pb.AllReduceSynchronizer.Spec.values())))


class StrategyBuilder(ABC):
    """Base: subclasses implement ``choose`` (one ``Pipeline`` per variable)."""

    def __init__(self, chunk_size: int = 1, spec="AUTO"):
        self.chunk_size = in_range("chunk_size", chunk_size, 1, None, kind=int)
        self.spec = _spec_value(spec)

    @abstractmethod
    def choose(self, variables: list[Variable], resources: ResourceSpec | None) -> list[Pipeline]:
        """The pipeline of each variable."""

    def build(self, named_parameters_or_shapes, resource_spec=None):
        variables = variables_of(named_parameters_or_shapes)
        resources = ResourceSpec.coerce(resource_spec)
        pipelines = self.choose(variables, resources)
        for pipeline in set(pipelines):
            pipeline.build()  # bad values and refused pairings fail here, naming them
        return assemble(variables, pipelines, self.chunk_size, self.spec, resources)


def assemble(variables, pipelines, chunk_size: int = 1, spec: int = 0, resources=None,
             ps_destination: str | None = None):
    """A ``Strategy`` with one AllReduce (or PS) node per variable, groups of up to
    ``chunk_size`` variables per pipeline."""
    strategy = pb.Strategy(version=VERSION,
                           id=datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ"))
    if resources is not None:
        strategy.graph_config.replicas.extend(resources.replicas())
    groups: dict[Pipeline, list] = {}  # pipeline -> [group id, members so far]
    next_group = 0
    for var, pipeline in zip(variables, pipelines):
        node = strategy.node_config.add(var_name=var.name)
        node.shape.extend(var.shape)
        pipeline.write(node)
        if ps_destination is not None:
            node.PSSynchronizer.reduction_destination = ps_destination
            node.PSSynchronizer.sync = True
            continue
        current = groups.get(pipeline)
        if current is None or current[1] >= chunk_size:
            current = groups[pipeline] = [next_group, 0]
            next_group += 1
        current[1] += 1
        node.AllReduceSynchronizer.spec = spec
        node.AllReduceSynchronizer.group = current[0]
    return strategy


class AllReduce(StrategyBuilder):
    """AutoDist's AllReduce builder: every variable allreduced, ``chunk_size`` variables per
    fused group, one compressor for all. ``compressor`` is a grace_dl name or one of AutoDist's
    enum names (``HorovodCompressor`` = fp16, ``HorovodCompressorEF`` = fp16 + residual);
    ``params`` are further GRACE keys (``memory``, ``communicator``, compressor arguments)."""

    def __init__(self, chunk_size: int = 128, spec="AUTO", compressor: str = "none", **params):
        super().__init__(chunk_size, spec)
        if compressor in LEGACY_NAMES and params.get("memory", "none") != "none":
            raise ValueError(f"compressor {compressor!r} fixes the memory; do not pass memory="
                             f"{params['memory']!r}")
        self.pipeline = Pipeline.from_params({"compressor": compressor, **params})

    def choose(self, variables, resources):
        return [self.pipeline] * len(variables)


class Uniform(StrategyBuilder):
    """The same pipeline (a dict of GRACE keys, as ``grace_from_params`` takes) for every
    variable."""

    def __init__(self, params: dict, chunk_size: int = 1, spec="AUTO"):
        super().__init__(chunk_size, spec)
        self.pipeline = Pipeline.from_params(params)

    def choose(self, variables, resources):
        return [self.pipeline] * len(variables)


class SizeThreshold(StrategyBuilder):
    """``params``' pipeline for variables of at least ``min_elements`` elements and two or more
    dimensions; ``small`` (default: plain allreduce, ``none``) for the rest. Small tensors and
    1-D ones (biases, norm scales) gain little from compression and are where it hurts accuracy
    most; the rule is PowerSGD's ``min_compression_rate`` / BytePS's ``min_compress_bytes`` in
    its simplest form, and DGC's (Lin et al. 2018) dense exchange of small layers.

    ``small`` is its own pipeline so that it can keep what the compressed one moved out of
    the optimizer: with momentum in the memory (``dgc``, ``momentum``) and the optimizer's at 0,
    the dense tensors need ``{"memory": "momentum", "error_feedback": False,
    "factor_masking": False}`` or they train without momentum."""

    def __init__(self, min_elements: int, params: dict, chunk_size: int = 1, spec="AUTO",
                 small: dict | None = None):
        super().__init__(chunk_size, spec)
        self.min_elements = in_range("min_elements", min_elements, 0, None, kind=int)
        self.pipeline = Pipeline.from_params(params)
        self.small = NONE if small is None else Pipeline.from_params(small)

    def choose(self, variables, resources):
        return [self.pipeline if v.numel >= self.min_elements and v.ndim >= 2 else self.small
                for v in variables]


class PS(StrategyBuilder):
    """AutoDist's PS builder: every variable reduced on one rank (``reduction_destination``,
    a rank number) which broadcasts the result; ``params`` may name a compressor and memory
    for the way to that rank."""

    def __init__(self, reduction_destination: int | str = 0, params: dict | None = None):
        super().__init__(1, "AUTO")
        self.destination = str(in_range("reduction_destination", reduction_destination, 0, None,
                                        kind=int))
        self.pipeline = Pipeline.from_params(dict(params or {}), ps=True)

    def choose(self, variables, resources):
        return [self.pipeline] * len(variables)

    def build(self, named_parameters_or_shapes, resource_spec=None):
        variables = variables_of(named_parameters_or_shapes)
        resources = ResourceSpec.coerce(resource_spec)
        if resources is not None and int(self.destination) >= resources.workers:
            raise ValueError(f"reduction_destination {self.destination} is not a rank of the "
                             f"{resources.workers} workers in the resource spec")
        self.pipeline.build()
        return assemble(variables, self.choose(variables, resources),
                        resources=resources, ps_destination=self.destination)


DEFAULT_CANDIDATES = (
    {"compressor": "none"},
    {"compressor": "fp16"},
    {"compressor": "topk", "compress_ratio": 0.01, "memory": "residual",
     "communicator": "allgather"},
)


class Auto(StrategyBuilder):
    """Per variable, the candidate pipeline with the least predicted time in
    ``grace_dl.strategy.cost_model`` (network from the resource spec: workers, the slowest
    node's bandwidth, latency; compression cost from ``throughput``, a JSON path or
    ``Throughput``, else the spec's ``compression_throughput``, else pessimistic defaults).

    ``none`` (plain allreduce) is always a candidate and wins ties, so in its own model a
    strategy from ``Auto`` is never slower than no compression. Candidates whose payload size
    depends on the data (threshold, DGC) cannot be predicted and raise ``ValueError``.
    After ``build``, ``report`` holds each variable's predictions (seconds) for inspection.
    """

    def __init__(self, candidates=DEFAULT_CANDIDATES, chunk_size: int = 1, spec="AUTO",
                 throughput=None):
        super().__init__(chunk_size, spec)
        pipelines = [Pipeline.from_params(c) for c in candidates]
        if NONE not in pipelines:
            pipelines.insert(0, NONE)
        else:
            pipelines.insert(0, pipelines.pop(pipelines.index(NONE)))
        self.candidates = list(dict.fromkeys(pipelines))
        for p in self.candidates:
            if p.communicator not in PATTERNS:
                raise ValueError(f"Auto has no cost model for communicator {p.communicator!r}; "
                                 f"modelled: {list(PATTERNS)}")
            p.build()
        self._compressors = {p: p.build_compressor() for p in self.candidates}
        if throughput is None or isinstance(throughput, Throughput):
            self.throughput = throughput
        else:
            self.throughput = Throughput.load(throughput)
        self.report: list[tuple[Variable, list[Prediction]]] = []

    def _throughput(self, resources) -> Throughput:
        if self.throughput is not None:
            return self.throughput
        if resources is not None and resources.throughput_path:
            return Throughput.load(resources.throughput_path)
        return Throughput()

    def choose(self, variables, resources):
        if resources is None:
            raise ValueError("Auto needs a resource spec (workers, bandwidth, latency) to "
                             "predict times; pass one to build()")
        net, throughput = Network.of(resources), self._throughput(resources)
        self.report = []
        chosen = []
        for var in variables:
            predictions = []
            for p in self.candidates:
                pred = predict(p, var.shape, var.dtype, net, throughput, self._compressors[p])
                if pred is None:
                    raise ValueError(f"Auto cannot predict the payload of compressor "
                                     f"{p.compressor!r} (its size depends on the data); "
                                     f"leave it out of the candidates")
                predictions.append(pred)
            best = min(predictions, key=lambda q: q.total_s)  # first (none) wins ties
            self.report.append((var, predictions))
            chosen.append(best.pipeline)
        return chosen
