"""The pipelines the end-to-end benchmarks compare, by name.

Each entry is the ``grace_from_params`` dict, or ``None`` for Horovod's own paths (plain
allreduce, and Horovod's built-in fp16 compression), which run with ``grace=None``.
"""

from __future__ import annotations

from pathlib import Path

from grace_dl import grace_from_params
from grace_dl.communicators.buckets import DEFAULT_BUCKET_BYTES

# Measured compression throughput for Auto's cost model (`make bench` writes it first).
THROUGHPUT = Path(__file__).resolve().parent / "results" / "compression_throughput.json"

#: Named grace pipelines (``grace_from_params`` dicts) that the benchmarks and the DDP
#: checks share; variants override a key (``{**GRACE["topk"], "compress_ratio": 0.1}``).
GRACE: dict[str, dict] = {
    "none": {"compressor": "none", "memory": "none", "communicator": "allreduce"},
    "fp16": {"compressor": "fp16", "memory": "none", "communicator": "allreduce"},
    "topk": {"compressor": "topk", "compress_ratio": 0.01, "memory": "residual",
             "communicator": "allgather"},
    "randomk": {"compressor": "randomk", "compress_ratio": 0.01, "memory": "residual",
                "communicator": "allreduce"},
    "qsgd-2phase": {"compressor": "qsgd", "quantum_num": 64, "memory": "residual",
                    "communicator": "twophase"},
    "signsgd": {"compressor": "signsgd", "memory": "residual", "communicator": "allgather"},
    "signsgd-2phase": {"compressor": "signsgd", "memory": "residual",
                       "communicator": "twophase"},
    "powersgd": {"compressor": "powersgd", "compress_rank": 2, "memory": "powersgd",
                 "communicator": "allreduce"},
}

PIPELINES: dict[str, dict | str | None] = {
    "none": None,                      # uncompressed Horovod: the baseline
    "hvd-fp16": None,                  # Horovod's own Compression.fp16
    **{k: GRACE[k] for k in ("topk", "randomk", "qsgd-2phase", "signsgd-2phase", "powersgd")},
    "auto": "auto",                    # the strategy builder's cost-model pick
}

#: variants of a pipeline with other ``DistributedOptimizer`` options, not in the default runs:
#: ``-whole`` sends every gradient whole (``piece_bytes=None``), to show what pieces buy;
#: ``-bucket`` packs the gradients into DDP-sized buckets, each compressed once
#: (``bucket_bytes``, ``grace_dl.torch.buckets``); ``-bucket-whole`` sends those buckets whole,
#: as a strategy's dispatcher does; ``-unpacked`` sends a payload's parts in one collective each
#: (``pack_parts=False``: the layout before packing, ``grace_dl.communicators.wire``);
#: ``-early`` lets the gradient hooks complete exchanges whose collectives have finished
#: (``early_rounds=True``, ``Router.advance``): later rounds start during the backward pass;
#: ``-fused`` puts every parameter in one fusion group (``groups=1``, ``Communicator.fuse``):
#: each gradient compressed on its own as per parameter, the payloads issued together in one
#: collective per kind after the last hook (no overlap with the backward pass). The
#: ``-twins`` runs the pipeline with grace_dl's compiled kernels off (``kernels_on``). The
#: ``"grace"`` option overrides the pipeline's GRACE keys, the others go to the optimizer.
VARIANTS: dict[str, tuple[str, dict]] = {
    **{f"{k}-whole": (k, {"piece_bytes": None}) for k in ("qsgd-2phase", "signsgd-2phase")},
    **{f"{k}-bucket": (k, {"bucket_bytes": DEFAULT_BUCKET_BYTES})
       for k in ("topk", "randomk", "qsgd-2phase", "signsgd-2phase")},
    **{f"{k}-bucket-whole": (k, {"bucket_bytes": DEFAULT_BUCKET_BYTES, "piece_bytes": None})
       for k in ("topk", "randomk")},
    **{f"{k}-unpacked": (k, {"grace": {"pack_parts": False}})
       for k in ("topk", "qsgd-2phase", "signsgd-2phase")},
    **{f"{k}-early": (k, {"early_rounds": True})
       for k in ("topk", "randomk", "qsgd-2phase", "signsgd-2phase", "powersgd")},
    **{f"{k}-fused": (k, {"groups": 1})
       for k in ("topk", "randomk", "qsgd-2phase", "signsgd-2phase")},
    **{f"{k}-twins": (k, {"kernels": False})
       for k in ("topk", "randomk", "qsgd-2phase", "signsgd-2phase")},
}


def kernels_on(pipeline: str) -> bool:
    """Whether ``pipeline`` runs grace_dl's compiled kernels (``-twins`` variants run their
    framework twins: the code before the kernels, to compare in one job; the workers call
    ``grace_dl.native.use`` with this before each step)."""
    return VARIANTS.get(pipeline, ("", {}))[1].get("kernels", True)


def _variant(pipeline: str) -> tuple[str, dict, dict]:
    """``(base pipeline, GRACE keys it overrides, DistributedOptimizer options)``."""
    base, options = VARIANTS[pipeline]
    options = dict(options)
    options.pop("kernels", None)    # not an optimizer option: see kernels_on
    return base, options.pop("grace", {}), options


def calibration():
    """The measurement Auto and the predictions use: the job's own (``GRACE_BENCH_CALIBRATION``,
    which benchmarks/e2e.py measures on each emulated link), else the committed compression
    throughput, else nothing measured."""
    import os

    path = os.environ.get("GRACE_BENCH_CALIBRATION")
    if path:
        return path
    return THROUGHPUT if THROUGHPUT.exists() else None


def _resources(mbit: float | None, workers: int):
    import os

    from grace_dl.strategy import ResourceSpec

    mbit = float(os.environ.get("GRACE_BENCH_MBIT", mbit or 1000))
    return ResourceSpec.local(workers, bandwidth_gbps=mbit / 1000)


def build_auto(model, mbit: float | None = None, workers: int = 2, compute_s: float = 0.0):
    """``(Auto builder, strategy)`` for ``model`` on this link (every rank gets the same one
    when they pass the same ``compute_s``)."""
    from grace_dl.strategy import Auto

    builder = Auto(throughput=calibration(), compute_s=compute_s)
    return builder, builder.build(model.named_parameters(), _resources(mbit, workers))


def make_grace(pipeline: str, model, mbit: float | None = None, workers: int = 2,
               compute_s: float = 0.0):
    """``(grace object or None, extra DistributedOptimizer kwargs)`` for ``pipeline``;
    ``compute_s`` (forward + backward, the same on every rank) is for Auto's step model."""
    if pipeline in VARIANTS:
        base, keys, options = _variant(pipeline)
        if keys:
            return grace_from_params({**PIPELINES[base], **keys}), options
        grc, kwargs = make_grace(base, model, mbit, workers, compute_s)
        return grc, {**kwargs, **options}
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {sorted([*PIPELINES, *VARIANTS])}, got "
                         f"{pipeline!r}")
    spec = PIPELINES[pipeline]
    if pipeline == "none":
        return None, {}
    if pipeline == "hvd-fp16":
        import horovod.torch as hvd

        return None, {"compression": hvd.Compression.fp16}
    if spec == "auto":
        from grace_dl.strategy import from_strategy
        from grace_dl.strategy.builders import horovod_path

        _, strategy = build_auto(model, mbit, workers, compute_s)
        return (None, {}) if horovod_path(strategy) else (from_strategy(strategy), {})
    return grace_from_params(dict(spec)), {}


def predict_step(pipeline: str, model, mbit: float | None = None, workers: int = 2,
                 compute_s: float = 0.0) -> float | None:
    """The step model's time (seconds, without the optimizer's update) for ``pipeline`` on
    ``model``, from ``calibration()``; ``None`` when nothing was measured."""
    from grace_dl.communicators.pieces import DEFAULT_PIECE_BYTES
    from grace_dl.strategy import Pipeline
    from grace_dl.strategy.cost_model import Network
    from grace_dl.strategy.step_model import HOROVOD, HOROVOD_FP16
    from grace_dl.strategy.step_model import predict_step as step
    from grace_dl.strategy.variables import bucketed, variables_of

    if calibration() is None:
        return None
    variables = variables_of(model.named_parameters())
    options, keys = {}, {}
    if pipeline in VARIANTS:
        pipeline, keys, options = _variant(pipeline)
        if "bucket_bytes" in options:
            variables = bucketed(variables, options["bucket_bytes"])
    if PIPELINES.get(pipeline) == "auto":
        return build_auto(model, mbit, workers, compute_s)[0].prediction.step_s
    choice = {"none": HOROVOD, "hvd-fp16": HOROVOD_FP16}.get(pipeline)
    if choice is None:
        choice = Pipeline.from_params({**PIPELINES[pipeline], **keys})
    return step(variables, [choice] * len(variables), calibration(),
                Network.of(_resources(mbit, workers)), compute_s,
                piece_bytes=options.get("piece_bytes", DEFAULT_PIECE_BYTES)).step_s


def make_spec(spec: dict, steps_per_epoch: int = 1, model=None):
    """A grace object from a JSON-able spec (``grace_dl.strategy.from_spec``)."""
    from grace_dl.strategy import from_spec

    return from_spec(spec, None if model is None else model.named_parameters(), steps_per_epoch)
