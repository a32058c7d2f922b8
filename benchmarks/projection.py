"""Where compression pays on a GPU cluster, on paper: the measured one-GPU steps
(``gpu_steps.json``, ``benchmarks/gpu.py steps``) carried to N GPUs by the step model. This is a
**model, not a measurement**: no step here ran on more than one GPU.

    python -m benchmarks.projection            # the table, from benchmarks/results/gpu_steps.json

For each model and pipeline of the step table, at N = ``WORKERS`` GPUs and a link of ``GBITS``
Gbit/s per GPU, ``grace_dl.strategy.step_model.predict_step`` simulates one step:

* **compute** (``compute_s``) is the pipeline's measured step at world size 1: forward,
  backward, optimizer, and, for a compressing pipeline, its compression, decompression and
  bookkeeping (at world size 1 the collectives move nothing, so that is all the step holds);
* **the wire**: each exchange costs the alpha-beta time of ``cost_model.communication_time``
  for its payload bytes (``compressors.base.nbytes_for_shape``, built from the registry
  as ``benchmarks/gpu.py`` builds the step table's pipelines), ``b`` the link's bytes per
  second, ``a`` ``LATENCY_S`` per message step:

  - DDP, ``fp16_compress_hook``, ``grace none``/``fp16``/``randomk``/PowerSGD (payloads that
    sum): ring allreduce, ``2 (N-1)/N x bytes / b + 2 (N-1) a``;
  - topk, terngrad (payloads that are gathered): allgather, ``(N-1) x bytes / b + (N-1) a``,
    every rank receiving every other rank's payload, so it grows with N;
  - two-phase (qsgd, signsgd): all-to-all of compressed chunks, then an allgather of the
    compressed reduced chunks, ``2 (N-1)/N x bytes / b + 2 (N-1) a``;

  no compression or decompression time is added to the wire: it is in the measured step.
* **what the DDP hook sends**: DDP's buckets (``DEFAULT_BUCKET_BYTES``, 25 MiB, packed in the
  backward pass's order by ``strategy.variables.bucketed``); grace pipelines whose compressor
  needs layer shapes (PowerSGD, and PyTorch's ``powerSGD_hook``, priced as grace's PowerSGD of
  the same rank) send per parameter, a bucket's tensors together (one latency per round and
  bucket: ``bucket_costs``), the others per bucket, quantizers in pieces of
  ``DEFAULT_PIECE_BYTES``, as ``grace_dl.torch.ddp`` sends them.
* **overlap**: the measurement is at world size 1, where nothing crosses a link, so it gives
  no overlap. We take ``OVERLAP`` = 1, the step model's ideal, for every pipeline alike: a
  bucket's exchange starts when its gradients are ready and runs while the backward pass
  continues (the backward is the last two thirds of the step), and the step ends when both
  are done. On a GPU the backward runs on the device and the bytes on the NIC, so neither
  waits for the other (``grace_dl.strategy.calibrate``: 1 is "compute elsewhere, a GPU"). The
  rounds that start only when the hook receives the step's buckets (two-phase's gather,
  PowerSGD's second allreduce: ``step_model.deferred_rounds``) run after the backward pass.
  NCCL's kernels do take some of the GPU's SMs, so a real step hides less: the projection
  is optimistic about overlap for every pipeline, DDP included.

The network is flat: every GPU has a link of the given speed to the ring (no NVLink inside a
node, no hierarchy), and ``LATENCY_S`` is the resource spec's default per message step.
"""

from __future__ import annotations

import argparse
import sys
from math import prod

from benchmarks import records, tables
from grace_dl.communicators.buckets import DEFAULT_BUCKET_BYTES
from grace_dl.communicators.pieces import DEFAULT_PIECE_BYTES
from grace_dl.strategy.cost_model import FREE, Network, Throughput
from grace_dl.strategy.pipeline import Pipeline
from grace_dl.strategy.resource_spec import DEFAULT_LATENCY_US
from grace_dl.strategy.step_model import (
    HOROVOD,
    HOROVOD_FP16,
    Calibration,
    Cost,
    predict_step,
    simulate,
    variable_cost,
)
from grace_dl.strategy.variables import Variable, bucket_layout, bucketed

WORKERS = (8, 64)
GBITS = (25, 100, 400)
LATENCY_S = DEFAULT_LATENCY_US * 1e-6
OVERLAP = 1.0
DDP = "DDP"
TITLE = "Projection (model, not measured)"

#: the step table's rows that are not grace pipelines (``benchmarks/gpu.py``): what the step
#: model prices them as
HOOKS = {
    DDP: HOROVOD,
    "PyTorch fp16_compress_hook": HOROVOD_FP16,
    "PyTorch powerSGD_hook rank 4": {"compressor": "powersgd", "compress_rank": 4,
                                     "memory": "powersgd", "communicator": "allreduce"},
}


# ------------------------------------------------------------------ the models' parameters
def resnet50() -> list[Variable]:
    """torchvision's ResNet-50 parameters, in ``named_parameters`` order (written out: the
    page renders without torchvision; 25,557,032 parameters, as the step table counted)."""
    out = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    cin = 64
    for layer, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), 1):
        for b in range(blocks):
            at = f"layer{layer}.{b}."
            convs = ((width, (cin, 1, 1)), (width, (width, 3, 3)), (4 * width, (width, 1, 1)))
            for i, (cout, kernel) in enumerate(convs, 1):
                out += [(f"{at}conv{i}.weight", (cout, *kernel)), (f"{at}bn{i}.weight", (cout,)),
                        (f"{at}bn{i}.bias", (cout,))]
            if b == 0:
                out += [(f"{at}downsample.0.weight", (4 * width, cin, 1, 1)),
                        (f"{at}downsample.1.weight", (4 * width,)),
                        (f"{at}downsample.1.bias", (4 * width,))]
            cin = 4 * width
    out += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return [Variable(name, shape) for name, shape in out]


def decoder() -> list[Variable]:
    """``benchmarks.gpu.Decoder``'s parameters, built on the meta device (no memory)."""
    import torch

    from benchmarks.gpu import Decoder

    with torch.device("meta"):
        model = Decoder()
    return [Variable(name, tuple(p.shape)) for name, p in model.named_parameters()]


#: the step table's models: their parameters, as the DDP hook meets them
MODELS = {"resnet50": resnet50, "gpt": decoder}


# ------------------------------------------------------------------ the projection
def choice_of(label: str):
    """``(step-model choice, per parameter)`` of a step-table row: DDP and the fp16 hook are
    the step model's plain and fp16 allreduce; every other row a ``Pipeline``, per parameter
    where the compressor needs layer shapes (the DDP hook's ``"auto"`` granularity); a row in
    4 MiB pieces or with other hook options (``benchmarks.gpu.VARIANTS``) is its pipeline's."""
    from benchmarks.gpu import PIPELINES, VARIANTS

    spec = HOOKS.get(label, PIPELINES.get(VARIANTS.get(label, label)))
    if spec is None:
        raise ValueError(f"no projection for pipeline {label!r}; known: "
                         f"{sorted([*HOOKS, *PIPELINES])}")
    if isinstance(spec, str):
        return spec, False
    pipeline = Pipeline.from_params(dict(spec))
    return pipeline, pipeline.build_compressor().caps.needs_shape


def calibration() -> Calibration:
    """Nothing measured but the overlap, and compression free: the measured step holds it."""
    names = {p["compressor"] for p in HOOKS.values() if isinstance(p, dict)}
    from benchmarks.gpu import PIPELINES

    names |= {p["compressor"] for p in PIPELINES.values()} | {"fp16"}
    return Calibration(Throughput([(name, {}, FREE, FREE) for name in sorted(names)]),
                       overlap=OVERLAP, cpu_overlap=OVERLAP)


def network(workers: int, gbit: float) -> Network:
    return Network(workers, gbit * 1e9 / 8, LATENCY_S)


def projected_step_s(label: str, compute_s: float, variables, workers: int, gbit: float,
                     calib: Calibration | None = None) -> float:
    """The projected step of step-table row ``label`` whose world-size-1 step was
    ``compute_s``, for a model of ``variables`` on ``workers`` GPUs over ``gbit`` Gbit/s."""
    choice, per_parameter = choice_of(label)
    calib, net, variables = calib or calibration(), network(workers, gbit), list(variables)
    if per_parameter:
        numels, costs = zip(*bucket_costs(choice, variables, calib, net))
        return simulate(list(costs), list(numels), compute_s, calib.overlap,
                        calib.cpu_overlap).step_s
    variables = bucketed(variables, DEFAULT_BUCKET_BYTES)
    piece = None if choice in (HOROVOD, HOROVOD_FP16) else DEFAULT_PIECE_BYTES
    return predict_step(variables, [choice] * len(variables), calib, net, compute_s,
                        piece_bytes=piece).step_s


def bucket_costs(pipeline: Pipeline, variables, calib: Calibration, net: Network) -> list:
    """``(numel, Cost)`` of each DDP bucket (forward order, as ``bucketed`` lists them) of a
    pipeline the hook sends per parameter: the hook sends a bucket's tensors together, one
    collective per round and kind (``grace_dl.torch.ddp``), so a bucket pays one latency (the
    largest of its members') and every member's transfer and encode."""
    compressor = pipeline.build_compressor()
    out = []
    for members in bucket_layout(variables, DEFAULT_BUCKET_BYTES)[::-1]:
        parts = [variable_cost(pipeline, variables[i].shape, variables[i].dtype, calib, net,
                               compressor) for i in members]
        out.append((sum(variables[i].numel for i in members),
                    Cost(sum(c.encode_s for c in parts), max(c.latency_s for c in parts),
                         sum(c.transfer_s for c in parts), pipeline.label(),
                         any(c.deferred for c in parts), max(c.early for c in parts),
                         wire_s=sum(c.wire_s for c in parts))))
    return out


def project(doc: dict, models=None, workers=WORKERS, gbits=GBITS) -> list[dict]:
    """One row per model and pipeline of ``doc``'s last run (``gpu_steps.json``): ``model``,
    ``pipeline``, ``measured_ms`` (world size 1) and, per ``(N, Gbit/s)``, ``ms`` and
    ``x_ddp`` (over DDP's projected step at the same N and link)."""
    models = MODELS if models is None else models
    run = doc["runs"][-1]
    calib = calibration()
    rows, shapes = [], {}
    for r in run["records"]:
        if "step_ms" not in r:
            continue
        if r["model"] not in shapes:
            if r["model"] not in models:
                raise ValueError(f"no parameter shapes for model {r['model']!r}; known: "
                                 f"{sorted(models)}")
            shapes[r["model"]] = models[r["model"]]()
            found = sum(prod(v.shape) for v in shapes[r["model"]])
            if r.get("params") not in (None, found):
                raise ValueError(f"model {r['model']!r}: the step table counted {r['params']} "
                                 f"parameters, the projection's shapes {found}")
        rows.append({"model": r["model"], "pipeline": r["pipeline"], "measured_ms": r["step_ms"],
                     "at": {(n, g): 1e3 * projected_step_s(r["pipeline"], r["step_ms"] / 1e3,
                                                           shapes[r["model"]], n, g, calib)
                            for n in workers for g in gbits}})
    for row in rows:
        base = next((b for b in rows if b["model"] == row["model"] and b["pipeline"] == DDP),
                    None)
        row["x_ddp"] = {k: None if base is None else ms / base["at"][k]
                        for k, ms in row["at"].items()}
    return rows


def markdown(doc: dict, models=None) -> str:
    """The projection's table for the benchmarks page, with what it assumes."""
    rows = project(doc, models)
    if not rows:
        return ""
    keys = list(rows[0]["at"])
    columns = ["pipeline", "model", "1 GPU ms (measured)", *[f"N={n}, {g} Gbit/s" for n, g in keys]]
    out = [{"pipeline": r["pipeline"], "model": r["model"],
            "1 GPU ms (measured)": r["measured_ms"],
            **{f"N={n}, {g} Gbit/s": _cell(r["at"][(n, g)], r["x_ddp"][(n, g)])
               for n, g in keys}}
           for r in sorted(rows, key=lambda r: (r["model"] != rows[0]["model"], r["model"]))]
    wins = sorted({(r["pipeline"], r["model"]) for r in rows
                   if any(x is not None and x < 1 for x in r["x_ddp"].values())})
    return "\n".join([
        f"### {TITLE}", "",
        "**A model, not a measurement**: nothing below ran on more than one GPU. Each cell is "
        "`benchmarks/projection.py`'s step for that many GPUs and that link per GPU: the step "
        "measured above at world size 1 (compute, and the pipeline's own compression cost) "
        "plus the time its payload takes on the wire (ring allreduce for payloads that sum, "
        "allgather for gathered ones, all-to-all + allgather for two-phase; "
        f"{DEFAULT_LATENCY_US:g} us per message step) that the backward pass does not hide, "
        "simulated by the step model (`grace_dl.strategy.step_model`). Overlap: ideal for every "
        "pipeline alike (the measurement, at world size 1, gives none: a bucket's exchange runs "
        "while the backward pass goes on), so every cell is optimistic there; the network is flat "
        "(no NVLink). Cells: ms per step (x DDP's projected step in the same column; below 1 "
        "the pipeline pays).", "",
        tables.table(columns, out), "",
        "Below DDP somewhere in the table: "
        + (", ".join(f"{p} ({m})" for p, m in wins) if wins else "nothing") + ".", ""])


def _cell(ms: float, x: float | None) -> str:
    text = f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}"
    return text if x is None else f"{text} ({x:.2f}x)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(records.RESULTS / "gpu_steps.json"))
    args = ap.parse_args(argv)
    print(markdown(records.load(args.results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
