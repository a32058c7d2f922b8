"""Predicted time of one training **step** under a per-variable choice of pipelines.

    calibration = Calibration.load("compression_throughput.json")   # grace-dl strategy measure
    step = predict_step(variables, choices, calibration, network, compute_s=0.012)

A step is simulated, not summed:

1. **Forward** takes a third of ``compute_s``, the **backward** pass the rest, shared among the
   variables by size; gradients become ready in reverse order of the variables (the last layer
   first), as the post-accumulate hooks fire.
2. When a gradient is ready its pipeline **encodes** it on the training thread (compensate,
   compress, memory update): that time delays the rest of the backward pass, so it is on the
   critical path.
3. Its **exchange** (collectives, the wait, decode and aggregate) runs on one channel, Horovod's
   background thread: one operation at a time, in the order they were issued. Operations of the
   same kind that are queued when the channel frees are **fused** as Horovod's cycle fuses them:
   one latency for the batch, the per-byte part of each. An exchange with a round that starts
   only in ``receive`` (two-phase, PowerSGD: ``deferred_rounds``) runs after the backward pass
   and the channel. The optimizer receives a step's tensors in lockstep
   (``Router.receive_all``), so their later rounds are in flight together and fuse, while
   each tensor's first round (two-phase's all-to-all, which Horovod never fuses) went alone:
   half of such an exchange's latency is paid per tensor, half once per kind, and the
   per-byte part (and decode) of each. (The half is an assumption, checked against the e2e
   runs after lockstep: 74 of 84 fixed rows predicted within 25%, against 69 with all of
   the latency paid once and 68 with all of it paid per tensor.) Two-phase's all-to-all
   starts when the tensor is sent, though: half of its exchange (``Cost.early``) goes on the
   channel as soon as the tensor is encoded, alone, and only the gather's half waits for
   ``receive``, where the gathers fuse: the same latencies (half per tensor, half once), but
   the first half overlaps the backward pass. (Checked against the e2e rows after large
   gradients began travelling in pieces: 87 of 96 rows within 25%, 22 of the 24 two-phase
   ones, against 82 and 17 with the whole exchange deferred.)
4. A gradient the optimizer sends in pieces (``piece_bytes``: compressors that take any chunk
   alone, ``grace_dl.communicators.pieces``) costs what the job measured sending that size
   in pieces (``Calibration.pieced``); in a file without that, it is that many variables of
   a piece's size, each encoded and exchanged on its own (``pieces_of``). A strategy's
   dispatcher sends whole.
5. The step ends when both the training thread and the channel are done. That is the ideal
   overlap; the job's measured overlaps (``grace_dl.strategy.calibrate``) move the prediction
   from the serial sum (forward + backward + every encode + every exchange) towards it:
   ``ideal + (serial - ideal) * (w * (1 - overlap) + (1 - w) * (1 - cpu_overlap))``, where
   ``w`` is the share of the channel's time that is bytes on the link (``Cost.wire_s``:
   payload bytes over the link's bandwidth), ``overlap`` how much of an in-flight
   allreduce (of many MB) a compute loop hides, and ``cpu_overlap`` how much of a second
   thread's CPU work it hides (0 where ranks and Horovod's threads share too few cores). The
   rest of an exchange (latency, copies, reductions, Horovod's and gloo's work per call) is
   CPU on the rank's host: over a slow link a compute loop hides a large allreduce whole,
   because it is waiting on the link, but not a step's 60 small ones. A file without
   ``cpu_overlap`` uses ``overlap`` for both.
   A float16 allreduce is summed on the CPU while its bytes travel: there compute hides what
   the job measured of one (``fp16_overlap``, ``link_share_s``), not its bytes' time.

Each variable's cost comes from what was measured in the running job (``grace_dl.strategy.
calibrate``, stored in the measurement file): a pipeline measured end to end has an encode fit
and an exchange fit (latency + seconds per element); otherwise the cost is built from the
compressor's payload bytes, the measured collective fit (latency + seconds per byte, which
includes the reduction: Horovod's fp16 sum on the CPU is slow and the fit shows it) and the
measured compression throughput; with no measured collectives, from the alpha-beta formulas
of ``grace_dl.strategy.cost_model`` and the resource spec's bandwidth and latency. No measured
call costs less than the cheapest call of its kind measured (``Fit.floor_s``): that is what a
batch-norm vector's exchange costs, whatever its bytes.

Two choices are not grace pipelines: ``HOROVOD`` (Horovod's own fp32 allreduce, what a strategy
with no compression runs as: ``grace=None``) and ``HOROVOD_FP16`` (Horovod's
``Compression.fp16``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from grace_dl.dtypes import itemsize
from grace_dl.strategy.cost_model import (
    FORMAT,
    Network,
    Throughput,
    communication_time,
    device_kind,
    for_device,
    payload_bytes,
)
from grace_dl.strategy.pipeline import Pipeline

HOROVOD = "horovod"
HOROVOD_FP16 = "horovod-fp16"
#: collectives a communicator's pattern issues (two-phase: a scatter then a gather)
PATTERN_COLLECTIVES = {"allreduce": ("allreduce",), "allgather": ("allgather",),
                       "broadcast": ("broadcast",), "twophase": ("alltoall", "allgather")}


@dataclass(frozen=True)
class Fit:
    """A cost in seconds as a function of size (units: bytes for collectives, elements for
    pipelines): the line ``latency_s + per_unit_s * units`` (the sustained rate: its slope is
    the two largest points'), or, where it is higher, the cost through the measured
    ``points``; never under ``floor_s``.

    ``points`` (``(units, seconds)``, ascending) are read as a cost that does not shrink with
    size: each point is lowered to the cheapest measured at its size or above, so one slow
    small call does not inflate the rest. Between two points the cost is interpolated, beyond
    the largest it grows with the last two points' slope, below the smallest it is the
    smallest's. The line alone is wrong in between where the cost is concave (topk's exchange
    rises steeply to a few million elements, then flattens: the line through the two largest
    points put a bucket between them at less than half of what the points say). The points
    alone are wrong
    where a shaped link let a lone small call through at burst speed (a 100 Mbit/s token
    bucket), which a step's many calls do not get: there the line is higher and holds.

    ``floor_s`` is the cheapest call measured at any size: no call costs less, however small.
    The line alone puts a 64-element batch-norm tensor at microseconds, while every call of
    this job measured a millisecond or more (Horovod's cycle, the collective's round trips, a
    second phase): for ResNet-18's 62 tensors, or a transformer's 103, that is most of a
    step's communication."""

    latency_s: float = 0.0
    per_unit_s: float = 0.0
    floor_s: float = 0.0
    points: tuple = ()

    def __post_init__(self):
        if self.points:
            pts = sorted((float(x), float(y)) for x, y in self.points)
            for i in range(len(pts) - 2, -1, -1):
                pts[i] = (pts[i][0], min(pts[i][1], pts[i + 1][1]))
            object.__setattr__(self, "points", tuple(pts))

    def __call__(self, units: float) -> float:
        line = max(self.floor_s, self.latency_s + self.per_unit_s * units)
        pts = self.points
        if len(pts) < 2:
            return line
        if units <= pts[0][0]:
            return max(line, pts[0][1])
        i = next((i for i in range(1, len(pts)) if units <= pts[i][0]), len(pts) - 1)
        (x1, y1), (x2, y2) = pts[i - 1], pts[i]
        return max(line, y1 + (y2 - y1) * (units - x1) / (x2 - x1))

    def split(self, units: float) -> tuple[float, float]:
        """``(latency, transfer)`` of one call, summing to ``self(units)``: the latency is what
        a batch of fused calls pays once (the floor, or the line's intercept if higher)."""
        latency = max(self.floor_s, self.latency_s)
        return latency, self(units) - latency

    @classmethod
    def through(cls, points: dict) -> Fit:
        """The fit of ``points`` (``units -> seconds``): the points themselves, the slope of
        the two largest, under every point (the latency is the least remainder), both clipped
        at zero; the floor is the least time measured."""
        xs = sorted(points)
        if len(xs) < 2:
            raise ValueError(f"a fit needs two or more sizes, got {xs}")
        x1, x2 = xs[-2:]
        per = max(0.0, (points[x2] - points[x1]) / (x2 - x1))
        return cls(max(0.0, min(points[x] - per * x for x in xs)), per,
                   max(0.0, min(points.values())), tuple((x, points[x]) for x in xs))

    @classmethod
    def from_entry(cls, entry: dict, per_key: str = "per_unit_s", points=None) -> Fit:
        """A fit as a measurement file stores it, through its measured ``points`` (``units ->
        seconds``) where the file has them; files written before ``floor_s`` was stored get it
        from the points (the least time), else none."""
        points = {float(x): float(y) for x, y in (points or {}).items()}
        floor = entry.get("floor_s")
        if floor is None:
            floor = min(points.values()) if points else 0.0
        return cls(entry["latency_s"], entry[per_key], float(floor),
                   tuple(points.items()) if len(points) >= 2 else ())

    def as_dict(self) -> dict:
        return {"latency_s": self.latency_s, "per_unit_s": self.per_unit_s,
                "floor_s": self.floor_s}


@dataclass(frozen=True)
class Cost:
    """One variable's cost under one choice: ``encode_s`` on the training thread, then an
    exchange of ``latency_s + transfer_s`` on the channel; ``kind`` says what it fuses with.
    ``deferred``: the exchange has rounds that start only when the optimizer receives it, after
    the backward pass, fused with the other deferred exchanges of its kind for half its
    latency (``deferred_rounds``, module docstring). ``early``: the share of a deferred
    exchange (latency and per-byte part) that starts when the tensor is sent, on the channel
    like any other (two-phase's all-to-all: half). ``pieces``: the variable travels as that
    many even pieces (``grace_dl.communicators.pieces``), each costing what this says.
    ``wire_s``: the part of the exchange that is payload bytes on the link."""

    encode_s: float
    latency_s: float
    transfer_s: float
    kind: str
    deferred: bool = False
    early: float = 0.0
    pieces: int = 1
    wire_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.pieces * (self.encode_s + self.latency_s + self.transfer_s)


class Calibration:
    """What a measurement file holds: compression throughput (``entries``), collective fits
    (``collectives``: name and dtype -> seconds per byte) and pipeline fits (``pipelines``:
    label -> encode and exchange, seconds per element), with the job size they were taken at."""

    def __init__(self, throughput: Throughput | None = None, collectives=None, pipelines=None,
                 workers: int | None = None, mbit: float | None = None, overlap: float = 1.0,
                 pieced=None, cpu_overlap: float | None = None,
                 fp16_overlap: float | None = None):
        self.throughput = throughput or Throughput()
        self.overlap = overlap
        #: measured apart (``calibrate.measure_cpu_overlap``), else None: ``overlap``'s
        self.measured_cpu_overlap = cpu_overlap
        #: how much of a float16 allreduce a compute loop hides (``calibrate.measure_job``),
        #: else None: its bytes on the link are what compute hides (``link_share_s``)
        self.fp16_overlap = fp16_overlap
        self.collectives: dict[tuple[str, str], Fit] = dict(collectives or {})
        self.pipelines: dict[str, tuple[Fit, Fit]] = dict(pipelines or {})
        #: label -> (piece_bytes, (encode, exchange)): the pipeline timed as the optimizer sends
        #: gradients larger than a piece (``grace_dl.strategy.calibrate``)
        self.pieced: dict[str, tuple[int, tuple[Fit, Fit]]] = dict(pieced or {})
        self.workers = workers
        self.mbit = mbit

    @classmethod
    def from_document(cls, data: dict, source: str = "<document>") -> Calibration:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"measurement file {source!r} must have \"format\": {FORMAT!r}")
        try:
            collectives = {(c["collective"], c["dtype"]): Fit.from_entry(
                c, "per_byte_s", c.get("points")) for c in data.get("collectives", [])}
            pipelines = {p["pipeline"]: _pipeline_fits(p) for p in data.get("pipelines", [])}
            pieced = {p["pipeline"]: (int(p["pieces"]["piece_bytes"]),
                                      _pipeline_fits(p["pieces"]))
                      for p in data.get("pipelines", []) if p.get("pieces")}
        except (KeyError, TypeError) as err:
            raise ValueError(f"measurement file {source!r}: a collective or pipeline entry is "
                             f"malformed ({err}); see grace_dl.strategy.calibrate") from None
        job = data.get("job") or {}
        overlaps = {k: job.get(k, default)
                    for k, default in (("overlap", 1.0), ("cpu_overlap", None),
                                       ("fp16_overlap", None))}
        for key, value in overlaps.items():
            if value is not None and (not isinstance(value, (int, float))
                                      or not 0.0 <= value <= 1.0):
                raise ValueError(f"measurement file {source!r}: job {key} must be a number in "
                                 f"[0, 1], got {value!r}")
        return cls(Throughput.from_document(data, source), collectives, pipelines,
                   job.get("workers"), job.get("mbit"), float(overlaps["overlap"]), pieced,
                   overlaps["cpu_overlap"], overlaps["fp16_overlap"])

    @classmethod
    def load(cls, path) -> Calibration:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"measurement file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"measurement file {str(path)!r} is not JSON: {err}") from None
        return cls.from_document(data, str(path))

    @classmethod
    def coerce(cls, value) -> Calibration:
        """``None`` (nothing measured), a ``Calibration``, a ``Throughput`` or a file path."""
        if value is None:
            return cls()
        if isinstance(value, Calibration):
            return value
        if isinstance(value, Throughput):
            return cls(value)
        return cls.load(value)

    @property
    def cpu_overlap(self) -> float:
        """How much of an exchange's CPU (not its bytes on the link) compute hides."""
        return self.overlap if self.measured_cpu_overlap is None else self.measured_cpu_overlap

    def collective(self, name: str, dtype: str) -> Fit | None:
        return self.collectives.get((name, dtype))


def calibration_for(device, calib=None) -> Calibration:
    """The calibration a job whose tensors live on ``device`` predicts with (``calib``: what
    was given, anything ``Calibration.coerce`` takes). On a CPU, ``calib`` as it is. On a GPU
    (``cost_model.device_kind``), compression costs must be the GPU's: unless ``calib``'s
    throughput was measured on a GPU (its document's ``device``), it is replaced by the
    shipped GPU measurement (``cost_model.for_device``), and pipelines timed end to end
    with it (``pipelines``, ``pieced``: compression on host tensors) are dropped; the job's
    collectives and overlaps stay, since they measured the network."""
    calib = Calibration.coerce(calib)
    if device_kind(device) != "cuda" or calib.throughput.on_gpu:
        return calib
    return Calibration(for_device(device), calib.collectives, None, calib.workers, calib.mbit,
                       calib.overlap, None, calib.measured_cpu_overlap, calib.fp16_overlap)


def _pipeline_fits(entry: dict) -> tuple[Fit, Fit]:
    """``(encode, exchange)`` of a measurement file's pipeline entry (or its ``pieces``)."""
    points = entry.get("points") or {}
    return tuple(Fit.from_entry(entry[part], points={n: v[i] for n, v in points.items()})
                 for i, part in enumerate(("encode", "exchange")))


def _alpha_beta(net: Network, pattern: str) -> Fit:
    """The resource spec's formula as a fit in bytes (``cost_model.communication_time``)."""
    per = communication_time(pattern, 1.0, 1.0, net) - communication_time(pattern, 0.0, 0.0, net)
    return Fit(communication_time(pattern, 0.0, 0.0, net), per)


def variable_cost(choice, shape: tuple, dtype: str, calib: Calibration, net: Network,
                  compressor=None, piece_bytes: int | None = None) -> Cost | None:
    """What ``choice`` (a ``Pipeline``, ``HOROVOD`` or ``HOROVOD_FP16``) costs one variable;
    ``None`` when its payload size cannot be known in advance. ``piece_bytes``: what the
    optimizer sends large gradients in (``DistributedOptimizer(piece_bytes=...)``, only where
    the compressor takes any chunk alone: ``pieces_of``); None: whole (a strategy's
    dispatcher). A gradient in pieces costs what the job measured in pieces of that size
    (``Calibration.pieced``), else as many pieces as whole tensors of a piece's size."""
    numel = 1
    for d in shape:
        numel *= int(d)
    if choice in (HOROVOD, HOROVOD_FP16):
        wire = "float16" if choice == HOROVOD_FP16 else dtype
        fit = calib.collective("allreduce", wire) or _alpha_beta(net, "allreduce")
        encode = decode = 0.0
        if choice == HOROVOD_FP16:
            cast, uncast = calib.throughput.costs("fp16", {})
            encode, decode = cast(numel), uncast(numel)
        nbytes = numel * itemsize(wire)
        latency, transfer = fit.split(nbytes)
        return Cost(encode, latency, transfer + decode, f"{choice}:{wire}",
                    wire_s=_wire_s("allreduce", nbytes, nbytes, net, latency + transfer,
                                   calib, wire))
    compressor = compressor or choice.build_compressor()
    if sent_raw(compressor, shape):
        return variable_cost(Pipeline(communicator=choice.communicator), shape, dtype, calib,
                             net, None, piece_bytes)
    pieces = pieces_of(compressor, numel, dtype, piece_bytes)
    as_sent = calib.pieced.get(choice.label())
    if pieces > 1 and as_sent is not None and as_sent[0] == piece_bytes:
        measured, pieces = as_sent[1], 1   # timed in pieces, as the optimizer sends
    else:
        measured = calib.pipelines.get(choice.label())
        if pieces > 1:
            numel = -(-numel // pieces)
            shape = (numel,)
    if measured is not None:
        encode, exchange = measured
        latency, transfer = exchange.split(numel)
        nbytes = payload_bytes(compressor, shape, dtype)
        wire = 0.0 if nbytes is None else _wire_s(
            choice.communicator, nbytes, numel * itemsize(dtype), net, latency + transfer,
            calib, _allreduce_dtype(choice, dtype))
        return Cost(encode(numel), latency, transfer, choice.label(),
                    deferred_rounds(choice, compressor, shape), early_share(choice), pieces,
                    wire)
    cost = _analytic_cost(choice, shape, numel, dtype, calib, net, compressor)
    return cost if cost is None or pieces == 1 else replace(cost, pieces=pieces)


def _wire_s(pattern: str, nbytes: float, dense: float, net: Network, most: float,
            calib: Calibration, summed: str | None) -> float:
    """``Cost.wire_s`` of an exchange that takes ``most`` (its measured time): the seconds the
    payload's bytes take on the link (``cost_model.communication_time`` with no latency), at
    most ``most``, as ``link_share_s`` takes them for an allreduce summing ``summed``."""
    link = 0.0
    if net.bandwidth > 0:
        bare = Network(net.workers, net.bandwidth, 0.0)
        link = min(most, communication_time(pattern, nbytes, dense, bare))
    return link_share_s(calib, summed, link, most)


def _allreduce_dtype(pipeline: Pipeline, dtype: str) -> str | None:
    """What ``pipeline``'s allreduce sums (None: it does not allreduce)."""
    if pipeline.communicator != "allreduce":
        return None
    return "float16" if pipeline.compressor == "fp16" else dtype


def link_share_s(calib: Calibration, summed: str | None, link_s: float, busy_s: float) -> float:
    """``Cost.wire_s`` of an exchange that is ``busy_s`` on the channel: the seconds a compute
    loop hides of it as it hides waiting on the link. That is ``link_s``, its payload bytes on
    the link, except for an allreduce that sums float16 (``summed``) where the job measured
    ``fp16_overlap``: Horovod sums float16 on the CPU, element by element, while the bytes
    travel, so over a link slow enough to hide that sum behind the transfer the exchange takes
    its bytes' time, yet the sum still takes the rank's core from the backward pass. The
    measured share a compute loop hides is then expressed as the link share that the step's
    formula (module docstring, 5) turns into the same hidden time. (From the bytes' time alone,
    Horovod's fp16 steps were predicted well short of what they measured.)"""
    hides = calib.fp16_overlap
    if summed != "float16" or hides is None or calib.overlap <= calib.cpu_overlap:
        return link_s
    share = (hides - calib.cpu_overlap) / (calib.overlap - calib.cpu_overlap)
    return busy_s * min(1.0, max(0.0, share))


def sent_raw(compressor, shape) -> bool:
    """Whether ``compressor`` sends a tensor of ``shape`` as it is, in one round of its
    communicator: PowerSGD leaves vectors (biases, batch norm) and matrices too small to gain
    (``matrix_shape`` None) uncompressed. Such a tensor costs what the plain pipeline
    (``none+none+<communicator>``) costs, not what the job measured for PowerSGD's two-round
    matrix exchange, which costs several times as much a call."""
    plan = getattr(compressor, "matrix_shape", None)
    return compressor.caps.rounds > 1 and plan is not None and plan(tuple(shape)) is None


def pieces_of(compressor, numel: int, dtype: str, piece_bytes: int | None) -> int:
    """How many pieces the optimizer sends a gradient of ``numel`` elements in
    (``grace_dl.communicators.pieces.piece_sizes``): 1 unless ``piece_bytes`` is set and the
    compressor compresses any 1-D chunk alone and does compress (``two_phase_safe``, not
    ``sends_tensor``)."""
    from grace_dl.communicators.pieces import piece_sizes

    if piece_bytes is None or not compressor.caps.two_phase_safe or compressor.caps.sends_tensor:
        return 1
    sizes = piece_sizes(numel, itemsize(dtype), piece_bytes)
    return 1 if sizes is None else len(sizes)


def early_share(pipeline: Pipeline) -> float:
    """The share of ``pipeline``'s exchange that starts at ``send``: two-phase's all-to-all
    (phase 1 of 2, as many bytes as the gather) goes out as soon as the tensor is encoded, and
    only its gather waits for ``receive``; in pieces (``grace_dl.communicators.pieces``) one
    piece's all-to-all is on the wire while the next is encoded."""
    return 0.5 if pipeline.communicator == "twophase" else 0.0


def deferred_rounds(pipeline: Pipeline, compressor, shape) -> bool:
    """Whether ``pipeline``'s exchange of a tensor of ``shape`` has a round that starts only in
    ``receive``: two-phase's gather needs the scatter's result, PowerSGD's second allreduce the
    first's. ``DistributedOptimizer.synchronize`` receives a step's tensors in lockstep
    (``Router.receive_all``): those rounds run after the backward pass, all in flight
    together, so the later round's latency is paid once per kind (half of the exchange's, as
    the module docstring says) but nothing of theirs overlaps the backward pass. (Received one
    tensor after another, as before lockstep, each paid its whole latency: for 62-103 tensors
    most of the step.)"""
    if pipeline.communicator == "twophase":
        return True
    return compressor.caps.rounds > 1 and not sent_raw(compressor, shape)


def _analytic_cost(pipeline: Pipeline, shape, numel: int, dtype: str, calib: Calibration,
                   net: Network, compressor) -> Cost | None:
    """Payload bytes over the measured (or formula) collectives, plus measured compression."""
    compressor = compressor or pipeline.build_compressor()
    nbytes = payload_bytes(compressor, shape, dtype)
    if nbytes is None:
        return None
    pattern = pipeline.communicator
    workers = max(net.workers, 1)
    compress, decompress = calib.throughput.costs(pipeline.compressor,
                                                  pipeline.params("compressor"))
    summed = _allreduce_dtype(pipeline, dtype)
    names = PATTERN_COLLECTIVES.get(pattern)
    fits = [calib.collective(c, summed if c == "allreduce" else dtype) for c in names or ()]
    if names and all(fits):
        share = nbytes / workers if pattern == "twophase" else nbytes
        parts = [f.split(share) for f in fits]
        latency = sum(a for a, _ in parts)
        transfer = sum(b for _, b in parts)
    else:
        formula = communication_time(pattern, nbytes, numel * itemsize(dtype), net)
        latency = communication_time(pattern, 0.0, 0.0, net) if pattern != "ps" else 0.0
        transfer = formula - latency
    encode = compress(numel) + (decompress(numel) if pipeline.memory != "none" else 0.0)
    if pattern == "allreduce":
        decode = decompress(numel)
    elif pattern == "twophase":
        chunk = numel / workers
        encode, decode = workers * compress(chunk), 2 * workers * decompress(chunk)
    else:
        decode = workers * decompress(numel)
    return Cost(encode, latency, transfer + decode, pipeline.label(),
                deferred_rounds(pipeline, compressor, shape), early_share(pipeline),
                wire_s=_wire_s(pattern, nbytes, numel * itemsize(dtype), net,
                               latency + transfer, calib, summed))


@dataclass
class StepPrediction:
    """A simulated step: ``step_s`` in total; ``ideal_s`` and ``serial_s``, the step with full
    and with no overlap; when the training thread and the channel finished (ideal overlap);
    each variable's cost."""

    step_s: float
    compute_s: float
    ideal_s: float
    serial_s: float
    main_s: float
    channel_s: float
    costs: list = field(default_factory=list)


def simulate(costs: list[Cost], numels: list[int], compute_s: float = 0.0,
             overlap: float = 1.0, cpu_overlap: float | None = None) -> StepPrediction:
    """One step for variables in model order with these ``costs`` (module docstring); a cost
    in ``pieces`` is that many variables, each a share of the size. ``cpu_overlap``: for the
    part of the channel's time that is not bytes on the link (None: ``overlap``)."""
    if any(c.pieces > 1 for c in costs):
        costs, numels = zip(*[(replace(c, pieces=1), n / c.pieces)
                              for c, n in zip(costs, numels) for _ in range(c.pieces)])
    forward = compute_s / 3
    backward = compute_s - forward
    total = sum(numels) or 1
    t, ready = forward, []
    for i in reversed(range(len(costs))):
        c = costs[i]
        t += backward * numels[i] / total + c.encode_s
        if not c.deferred:
            ready.append((t, c))
        elif c.early:   # the round that starts at send, alone (Horovod never fuses alltoall)
            ready.append((t, Cost(0.0, c.latency_s * c.early, c.transfer_s * c.early,
                                  f"{c.kind}:early:{i}", wire_s=c.wire_s * c.early)))
    # deferred exchanges (``deferred_rounds``): the rest after the backward pass and the
    # channel, in flight together, every transfer; latency: half once per kind and half per
    # tensor (the first round went alone), or, where the first round went early, the later
    # round's once per kind (fused)
    once: dict = {}
    each = 0.0
    for c in costs:
        if c.deferred:
            later = c.latency_s * (1.0 - c.early) if c.early else c.latency_s / 2
            once[c.kind] = max(once.get(c.kind, 0.0), later)
            each += (0.0 if c.early else c.latency_s / 2) + c.transfer_s * (1.0 - c.early)
    after = sum(once.values()) + each
    free, j, channel, wire = 0.0, 0, 0.0, 0.0
    while j < len(ready):
        start = max(free, ready[j][0])
        kind, busy = ready[j][1].kind, ready[j][1].latency_s
        while j < len(ready) and ready[j][0] <= start and ready[j][1].kind == kind:
            busy += ready[j][1].transfer_s
            wire += ready[j][1].wire_s
            j += 1
        free = start + busy
        channel += busy
    ideal, serial = max(t, free) + after, t + channel + after
    on_link = min(1.0, wire / channel) if channel > 0 else 0.0
    cpu_overlap = overlap if cpu_overlap is None else cpu_overlap
    hidden = on_link * (1.0 - overlap) + (1.0 - on_link) * (1.0 - cpu_overlap)
    return StepPrediction(ideal + hidden * (serial - ideal), compute_s, ideal, serial,
                          t, free + after, costs)


def predict_step(variables, choices, calib, net: Network, compute_s: float = 0.0,
                 compressors=None, piece_bytes: int | None = None) -> StepPrediction:
    """``simulate`` for ``variables`` (``grace_dl.strategy.variables.Variable``) under
    ``choices`` (one per variable: a ``Pipeline``, ``HOROVOD`` or ``HOROVOD_FP16``), large
    gradients in pieces of ``piece_bytes`` where the optimizer sends them so
    (``variable_cost``)."""
    calib = Calibration.coerce(calib)
    costs = []
    for var, choice in zip(variables, choices):
        cost = variable_cost(choice, var.shape, var.dtype, calib, net,
                             (compressors or {}).get(choice), piece_bytes)
        if cost is None:
            raise ValueError(f"cannot predict the payload of {choice.label()!r} for variable "
                             f"{var.name!r} (its size depends on the data)")
        costs.append(cost)
    return simulate(costs, [v.numel for v in variables], compute_s, calib.overlap,
                    calib.cpu_overlap)
