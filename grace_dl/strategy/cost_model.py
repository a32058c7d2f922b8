"""Per-variable formulas behind the ``Auto`` builder: the alpha-beta time of one variable's
communication under one pipeline, payload bytes, and the compression throughput file. The step
model (``grace_dl.strategy.step_model``) uses them for whatever the running job did not measure
itself (``grace_dl.strategy.calibrate``).

    time = communication(pattern, payload bytes, N, bandwidth B, latency a)
         + compress passes * c(n) + decompressions * d(n)

Communication, per rank, with the alpha-beta model of ring collectives (Thakur et al. 2005,
"Optimization of Collective Communication Operations in MPICH"):

============  ==============================================  ===============================
pattern       bytes on the critical path                      message steps
============  ==============================================  ===============================
allreduce     2 (N-1)/N x payload                             2 (N-1)
allgather     (N-1) x payload                                 N-1
broadcast     (N-1) x payload (every rank broadcasts its own)  N-1
twophase      2 (N-1)/N x payload                             2 (N-1)
ps            (N-1) x payload to the root, then the dense      2 (N-1)
              result broadcast back
============  ==============================================  ===============================

Compute: ``c(n)`` and ``d(n)`` are linear, ``overhead_s + per_element_s * n`` per call. The
``none`` compressor costs nothing (its compress is a reshape). Other compressors use measured
numbers from a throughput file when it has them, else a deliberately pessimistic default
(50 us per call + 1 ns per element): a method is only chosen when the bytes it saves clearly
pay for it. Decompressions per step: 1 for allreduce (the sum is decompressed once), N for
allgather/broadcast/ps (every rank's payload), 2 for twophase (its two exchanges), plus 1 when
the memory is not ``none`` (error feedback decompresses the local payload).

Payload bytes come from the compressor: ``nbytes_for_shape(compressor, shape, dtype)``, its
``payload_nbytes`` of the shape (PowerSGD) or of the number of elements. A compressor that
returns ``None`` (its size depends on the data: threshold, DGC, adaq) cannot be predicted and
is not a candidate.

Throughput file (JSON; ``grace-dl strategy measure`` / ``grace_dl.strategy.measure`` writes one)::

    {"format": "grace_dl.compression_throughput/1",
     "device": "cpu",
     "entries": [
       {"compressor": "topk", "params": {"compress_ratio": 0.01},
        "compress":   {"overhead_s": 4.1e-05, "per_element_s": 2.3e-09},
        "decompress": {"overhead_s": 1.2e-05, "per_element_s": 6.0e-10}}]}

An entry matches a candidate with the same compressor name whose parameters include the
entry's ``params`` (an entry with ``{}`` matches any parameters); the most specific match wins.

**On a GPU** compression costs are a GPU's, not the host's: ``for_device("cuda")`` is the
throughput shipped in ``gpu_throughput.json`` beside this module, derived from the committed
GPU measurement (``benchmarks/results/gpu_compressors.json``, by ``python -m
benchmarks.gpu_costs --write``: each method's line through its 16M- and 64M-element calls, as
``grace_dl.strategy.measure`` fits its two sizes). Its entries match any parameters (``{}``;
the parameters they were measured with are in ``measured_with``). ``grace-dl strategy
measure`` times CPU tensors; a file it wrote says ``"device": "cpu (...)"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from grace_dl.compressors.base import nbytes_for_shape
from grace_dl.dtypes import itemsize
from grace_dl.strategy.pipeline import PS, Pipeline

FORMAT = "grace_dl.compression_throughput/1"
#: compression costs measured on a GPU, shipped with the package (module docstring)
GPU_THROUGHPUT = Path(__file__).resolve().parent / "gpu_throughput.json"
PATTERNS = ("allreduce", "allgather", "broadcast", "twophase", PS)


@dataclass(frozen=True)
class Linear:
    """``overhead_s + per_element_s * n`` seconds for one call on ``n`` elements."""

    overhead_s: float = 0.0
    per_element_s: float = 0.0

    def __call__(self, n: float) -> float:
        return self.overhead_s + self.per_element_s * n


FREE = Linear(0.0, 0.0)
DEFAULT = Linear(50e-6, 1e-9)


@dataclass(frozen=True)
class Network:
    workers: int
    bandwidth: float  # bytes per second
    latency: float    # seconds per message step

    @classmethod
    def of(cls, spec) -> Network:
        return cls(spec.workers, spec.bandwidth_bytes_per_s, spec.latency_s)


def communication_time(pattern: str, payload: float, dense: float, net: Network) -> float:
    n, beta, alpha = net.workers, net.bandwidth, net.latency
    if n <= 1:
        return 0.0
    if pattern in ("allreduce", "twophase"):
        return 2 * (n - 1) / n * payload / beta + 2 * (n - 1) * alpha
    if pattern in ("allgather", "broadcast"):
        return (n - 1) * payload / beta + (n - 1) * alpha
    if pattern == PS:
        return ((n - 1) * payload + dense) / beta + 2 * (n - 1) * alpha
    raise ValueError(f"no cost model for communicator {pattern!r}; modelled: {list(PATTERNS)}")


def device_kind(device) -> str:
    """``"cuda"`` for a GPU (``"cuda"``, ``"cuda:1"``, ``"gpu"``, a ``torch.device`` of type
    cuda, a TF device string naming a GPU), else ``"cpu"``."""
    if device is None:
        return "cpu"
    kind = str(getattr(device, "type", device)).lower()
    return "cuda" if kind.startswith("cuda") or "gpu" in kind else "cpu"


class Throughput:
    """Per-compressor compress/decompress cost, measured or default; ``device``: where it
    was measured (the document's ``device``), if it says."""

    def __init__(self, entries=(), source: str | None = None, device: str | None = None):
        self.entries = list(entries)
        self.source = source
        self.device = device

    @property
    def on_gpu(self) -> bool:
        """Whether these costs were measured on a GPU."""
        return self.device is not None and device_kind(self.device.split(" ")[0]) == "cuda"

    @classmethod
    def load(cls, path) -> Throughput:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"throughput file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"throughput file {str(path)!r} is not JSON: {err}") from None
        return cls.from_document(data, str(path))

    @classmethod
    def from_document(cls, data: dict, source: str = "<document>") -> Throughput:
        """The ``entries`` of a measurement document (the file's JSON, parsed)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"throughput file {source!r} must have \"format\": {FORMAT!r}")
        entries = []
        for i, raw in enumerate(data.get("entries", [])):
            try:
                entries.append((str(raw["compressor"]), dict(raw.get("params", {})),
                                Linear(**raw["compress"]), Linear(**raw["decompress"])))
            except (KeyError, TypeError) as err:
                raise ValueError(f"throughput file {source!r} entry {i} is malformed "
                                 f"({err}); see grace_dl.strategy.cost_model") from None
        return cls(entries, source, data.get("device"))

    def costs(self, compressor: str, params: dict) -> tuple[Linear, Linear]:
        best, best_size = None, -1
        for name, wanted, comp, decomp in self.entries:
            if name == compressor and all(params.get(k) == v for k, v in wanted.items()) \
                    and len(wanted) > best_size:
                best, best_size = (comp, decomp), len(wanted)
        if best is not None:
            return best
        return (FREE, FREE) if compressor == "none" else (DEFAULT, DEFAULT)


def for_device(device) -> Throughput:
    """The compression costs to assume on ``device`` when nothing was measured there: on a GPU
    the shipped GPU measurement (``GPU_THROUGHPUT``), on a CPU none (the pessimistic
    default)."""
    if device_kind(device) == "cuda":
        return Throughput.load(GPU_THROUGHPUT)
    return Throughput()


@dataclass(frozen=True)
class Prediction:
    pipeline: Pipeline
    payload_bytes: int
    communication_s: float
    compute_s: float

    @property
    def total_s(self) -> float:
        return self.communication_s + self.compute_s


def payload_bytes(compressor, shape: tuple, dtype: str) -> int | None:
    nbytes = nbytes_for_shape(compressor, shape, dtype)
    return None if nbytes is None else int(nbytes)


def predict(pipeline: Pipeline, shape: tuple, dtype: str, net: Network,
            throughput: Throughput, compressor=None) -> Prediction | None:
    """Predicted time of ``pipeline`` for one variable; ``None`` when its payload size cannot be
    known in advance. ``compressor``: an already built instance (saves rebuilding it)."""
    if compressor is None:
        compressor = pipeline.build_compressor()
    nbytes = payload_bytes(compressor, shape, dtype)
    if nbytes is None:
        return None
    numel = 1
    for d in shape:
        numel *= d
    workers = net.workers
    pattern = pipeline.communicator
    comm = communication_time(pattern, nbytes, numel * itemsize(dtype), net)
    compress, decompress = throughput.costs(pipeline.compressor, pipeline.params("compressor"))
    if pattern == "allreduce":
        compute = compress(numel) + decompress(numel)
    elif pattern == "twophase":
        chunk = numel / max(workers, 1)
        compute = 2 * workers * (compress(chunk) + decompress(chunk))
    else:
        compute = compress(numel) + workers * decompress(numel)
    if pipeline.memory != "none":
        compute += decompress(numel)
    return Prediction(pipeline, nbytes, comm, compute)
