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
A builder that packs variables into **buckets** (``Auto``) gives each bucket its own group
with ``AllReduceSynchronizer.bucket`` set: its gradients travel as one flat tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import datetime, timezone

from grace_dl.communicators.buckets import DEFAULT_BUCKET_BYTES
from grace_dl.strategy import strategy_pb2 as pb
from grace_dl.strategy.cost_model import PATTERNS, Network, device_kind
from grace_dl.strategy.pipeline import LEGACY_NAMES, Pipeline
from grace_dl.strategy.resource_spec import ResourceSpec
from grace_dl.strategy.step_model import (
    HOROVOD,
    Calibration,
    Cost,
    StepPrediction,
    calibration_for,
    simulate,
    variable_cost,
)
from grace_dl.strategy.variables import (
    Variable,
    bucket_layout,
    bucketed,
    device_of,
    variables_of,
)
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

    #: what ``choose`` packed into buckets (positions of variables), if anything
    buckets: list[list[int]] | None = None

    def build(self, named_parameters_or_shapes, resource_spec=None):
        variables = variables_of(named_parameters_or_shapes)
        resources = ResourceSpec.coerce(resource_spec)
        pipelines = self.choose(variables, resources)
        for pipeline in set(pipelines):
            pipeline.build()  # bad values and refused pairings fail here, naming them
        return assemble(variables, pipelines, self.chunk_size, self.spec, resources,
                        buckets=self.buckets)


def assemble(variables, pipelines, chunk_size: int = 1, spec: int = 0, resources=None,
             ps_destination: str | None = None, buckets=None):
    """A ``Strategy`` with one AllReduce (or PS) node per variable, groups of up to
    ``chunk_size`` variables per pipeline; ``buckets`` (positions of variables, two or more
    each) become groups of their own with ``bucket`` set."""
    strategy = pb.Strategy(version=VERSION,
                           id=datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ"))
    if resources is not None:
        strategy.graph_config.replicas.extend(resources.replicas())
    groups: dict[Pipeline, list] = {}  # pipeline -> [group id, members so far]
    in_bucket = {i: k for k, members in enumerate(b for b in buckets or [] if len(b) > 1)
                 for i in members}
    next_group = len(set(in_bucket.values()))
    for position, (var, pipeline) in enumerate(zip(variables, pipelines)):
        node = strategy.node_config.add(var_name=var.name)
        node.shape.extend(var.shape)
        pipeline.write(node)
        if ps_destination is not None:
            node.PSSynchronizer.reduction_destination = ps_destination
            node.PSSynchronizer.sync = True
            continue
        node.AllReduceSynchronizer.spec = spec
        if position in in_bucket:
            node.AllReduceSynchronizer.group = in_bucket[position]
            node.AllReduceSynchronizer.bucket = True
            continue
        current = groups.get(pipeline)
        if current is None or current[1] >= chunk_size:
            current = groups[pipeline] = [next_group, 0]
            next_group += 1
        current[1] += 1
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
    {"compressor": "randomk", "compress_ratio": 0.01, "memory": "residual",
     "communicator": "allreduce"},
    {"compressor": "qsgd", "quantum_num": 64, "memory": "residual", "communicator": "twophase"},
    {"compressor": "signsgd", "memory": "residual", "communicator": "twophase"},
    {"compressor": "powersgd", "compress_rank": 2, "memory": "powersgd",
     "communicator": "allreduce"},
)


class Auto(StrategyBuilder):
    """Per variable, the candidate pipeline that makes the **step** fastest in
    ``grace_dl.strategy.step_model`` (gradients ready in reverse order during the backward
    pass, encode on the training thread, exchanges fused on one channel).

    Costs come from ``throughput``: a measurement file (``grace-dl strategy measure``; run under
    horovodrun it holds the job's collectives and every candidate pipeline timed end to end), a
    ``Calibration`` or ``Throughput``; else the resource spec's ``compression_throughput``; else
    the spec's bandwidth and latency with pessimistic compression costs. On a GPU (``device``
    "cuda", or, with ``device=None``, parameters on a CUDA device) compression costs are the
    GPU's: a measurement not taken on a GPU gives way to the shipped GPU one
    (``step_model.calibration_for``). ``compute_s``: the
    model's forward + backward time, which communication can overlap (0: none to hide behind).

    Choice: each variable's cheapest candidate alone (kept only when ``margin`` better than
    ``none``), every candidate for all variables, and, with ``bucket_bytes`` (default DDP's 25
    MiB; ``None``: never), every candidate whose compressor takes a flat tensor for all
    variables packed into buckets of that size (``strategy.variables.bucket_layout``: one
    compression and one exchange per bucket, priced on the bucket's size), are simulated;
    the fastest is taken only when it is predicted ``margin`` faster than no compression at
    all, run as Horovod's own allreduce. Otherwise every variable gets ``none``: such a
    strategy is meant to run with ``grace=None`` (``horovod_path(strategy)`` says so), and it
    is what the prediction assumed. So Auto never picks a pipeline it predicts to lose to
    uncompressed Horovod.

    After ``build``: ``prediction`` (the chosen step, a ``StepPrediction``), ``baseline`` (the
    uncompressed step), ``report`` (each variable's cost under every candidate), ``device``
    (``"cuda"`` or ``"cpu"``: whose compression costs it used); the strategy's
    ``predicted_step_s`` holds the prediction. Candidates whose payload size depends on the
    data (threshold, DGC) cannot be predicted and raise ``ValueError``.
    """

    def __init__(self, candidates=DEFAULT_CANDIDATES, chunk_size: int = 1, spec="AUTO",
                 throughput=None, compute_s: float = 0.0, margin: float = 0.1,
                 bucket_bytes: int | None = DEFAULT_BUCKET_BYTES, device=None):
        super().__init__(chunk_size, spec)
        self._device = None if device is None else device_kind(device)
        self.device = self._device
        self.bucket_bytes = None if bucket_bytes is None else \
            in_range("bucket_bytes", bucket_bytes, 1, None, kind=int)
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
        self.calibration = None if throughput is None else Calibration.coerce(throughput)
        self.compute_s = in_range("compute_s", compute_s, 0.0, None)
        self.margin = in_range("margin", margin, 0.0, None)
        self.report: list[tuple[Variable, list[tuple[Pipeline, Cost]]]] = []
        self.prediction: StepPrediction | None = None
        self.baseline: StepPrediction | None = None

    def _calibration(self, resources) -> Calibration:
        given = self.calibration
        if given is None:
            given = Calibration.coerce(resources.throughput_path)
        return calibration_for(self.device, given)

    def build(self, named_parameters_or_shapes, resource_spec=None):
        source = named_parameters_or_shapes
        if not isinstance(source, dict):
            try:
                source = list(source)   # read twice: for the device and for the variables
            except TypeError:
                pass                    # variables_of says what it expected
        self.device = self._device or device_kind(device_of(source))
        strategy = super().build(source, resource_spec)
        strategy.predicted_step_s = self.prediction.step_s
        return strategy

    def choose(self, variables, resources):
        if resources is None:
            raise ValueError("Auto needs a resource spec (workers, bandwidth, latency) to "
                             "predict times; pass one to build()")
        net, calib = Network.of(resources), self._calibration(resources)
        table = []
        for var in variables:
            row = []
            for p in self.candidates:
                cost = variable_cost(p, var.shape, var.dtype, calib, net, self._compressors[p])
                if cost is None:
                    raise ValueError(f"Auto cannot predict the payload of compressor "
                                     f"{p.compressor!r} (its size depends on the data); "
                                     f"leave it out of the candidates")
                row.append(cost)
            table.append(row)
        self.report = [(v, list(zip(self.candidates, row))) for v, row in zip(variables, table)]
        numels = [v.numel for v in variables]
        self.baseline = simulate([variable_cost(HOROVOD, v.shape, v.dtype, calib, net)
                                  for v in variables], numels, self.compute_s, calib.overlap,
                                 calib.cpu_overlap)
        options = [[_cheapest(row, self.margin) for row in table]]
        options += [[i] * len(variables) for i in range(1, len(self.candidates))]
        best, best_step, best_buckets = None, None, None
        for option in options:
            step = simulate([row[i] for row, i in zip(table, option)], numels, self.compute_s,
                            calib.overlap, calib.cpu_overlap)
            if best_step is None or step.step_s < best_step.step_s:
                best, best_step = option, step
        for i, step, layout in self._bucketed_options(variables, calib, net):
            if step.step_s < best_step.step_s:
                best, best_step, best_buckets = [i] * len(variables), step, layout
        self.buckets = None
        if best_step is not None and best_step.step_s * (1 + self.margin) < self.baseline.step_s:
            self.prediction = best_step
            self.buckets = best_buckets
            return [self.candidates[i] for i in best]
        self.prediction = self.baseline
        return [NONE] * len(variables)

    def _bucketed_options(self, variables, calib, net):
        """``(candidate index, simulated step, bucket layout)`` for every compressing candidate
        that takes a flat tensor, all variables in buckets of ``bucket_bytes``."""
        if self.bucket_bytes is None:
            return
        layout = bucket_layout(variables, self.bucket_bytes)
        if all(len(members) == 1 for members in layout):
            return  # nothing shares a bucket: the per-variable options cover it
        flat = bucketed(variables, self.bucket_bytes)
        for i, p in enumerate(self.candidates[1:], 1):
            if self._compressors[p].caps.needs_shape:
                continue
            costs = [variable_cost(p, v.shape, v.dtype, calib, net, self._compressors[p])
                     for v in flat]
            yield i, simulate(costs, [v.numel for v in flat], self.compute_s,
                              calib.overlap, calib.cpu_overlap), layout


def _cheapest(row: list[Cost], margin: float) -> int:
    """Index of the cheapest cost in ``row`` (index 0 is ``none``), kept only when it beats
    ``none`` by ``margin``."""
    best = min(range(len(row)), key=lambda i: row[i].total_s)
    return best if row[best].total_s * (1 + margin) < row[0].total_s else 0


def horovod_path(strategy) -> bool:
    """Whether every node of ``strategy`` is plain, uncompressed allreduce: then run it as
    ``grace=None`` (Horovod's own optimizer), which is what ``Auto`` predicted for it."""
    return all(node.WhichOneof("synchronizer") != "PSSynchronizer"
               and Pipeline.from_node(node) == NONE for node in strategy.node_config)
