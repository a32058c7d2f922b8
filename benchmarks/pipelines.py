"""The pipelines the end-to-end benchmarks compare, by name.

Each entry is the ``grace_from_params`` dict, or ``None`` for Horovod's own paths (plain
allreduce, and Horovod's built-in fp16 compression), which run with ``grace=None``.
"""

from __future__ import annotations

from pathlib import Path

from grace_dl import grace_from_params

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


def make_grace(pipeline: str, model, mbit: float | None = None, workers: int = 2):
    """``(grace object or None, extra DistributedOptimizer kwargs)`` for ``pipeline``."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {sorted(PIPELINES)}, got {pipeline!r}")
    spec = PIPELINES[pipeline]
    if pipeline == "none":
        return None, {}
    if pipeline == "hvd-fp16":
        import horovod.torch as hvd

        return None, {"compression": hvd.Compression.fp16}
    if spec == "auto":
        import os

        from grace_dl.strategy import Auto, ResourceSpec, from_strategy

        mbit = float(os.environ.get("GRACE_BENCH_MBIT", mbit or 1000))
        resources = ResourceSpec.local(workers, bandwidth_gbps=mbit / 1000)
        throughput = THROUGHPUT if THROUGHPUT.exists() else None
        strategy = Auto(throughput=throughput).build(model.named_parameters(), resources)
        return from_strategy(strategy), {}
    return grace_from_params(dict(spec)), {}


def make_spec(spec: dict, steps_per_epoch: int = 1, model=None):
    """A grace object from a JSON-able spec (``grace_dl.strategy.from_spec``)."""
    from grace_dl.strategy import from_spec

    return from_spec(spec, None if model is None else model.named_parameters(), steps_per_epoch)
