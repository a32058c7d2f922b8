"""Measure compress/decompress cost on this machine for the ``Auto`` builder's cost model, and
write it in the throughput file format (``grace_dl.strategy.cost_model``).

    grace-dl strategy measure -o benchmarks/results/compression_throughput.json

For each candidate's compressor, random normal float32 tensors of two sizes are compressed and
decompressed ``repeats`` times after a warm-up; the medians give a line ``overhead_s +
per_element_s * n`` through the two points (clipped at zero). torch tensors on the CPU by
default; ``framework="tensorflow"`` measures eager TF instead.
"""

from __future__ import annotations

import importlib
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from grace_dl.strategy.cost_model import FORMAT
from grace_dl.strategy.pipeline import Pipeline
from grace_dl.validate import in_range


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up (lazy state, caches)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(candidates, sizes=(4096, 262144), repeats: int = 5,
            framework: str = "torch") -> dict:
    """The throughput document (a dict, ready for ``json.dump``) for ``candidates`` (dicts of
    GRACE keys); ``sizes`` are the two tensor sizes the line is fitted through."""
    small, large = (in_range("size", s, 1, None, kind=int) for s in sizes)
    if large <= small:
        raise ValueError(f"sizes must be two increasing element counts, got {sizes!r}")
    repeats = in_range("repeats", repeats, 1, None, kind=int)
    ops = importlib.import_module(f"grace_dl.{framework}.ops")
    rng = np.random.default_rng(0)
    entries, seen = [], set()
    for params in candidates:
        pipeline = Pipeline.from_params(params)
        key = (pipeline.compressor, pipeline.compressor_params)
        if key in seen:
            continue
        seen.add(key)
        comp = pipeline.build_compressor()
        points = {}
        for n in (small, large):
            x = ops.from_numpy(rng.standard_normal(n).astype(np.float32))
            name = f"measure.{n}"
            payload, ctx = comp.compress(x, name)
            points[n] = (_median_time(lambda c=comp, x=x, m=name: c.compress(x, m), repeats),
                         _median_time(lambda c=comp, p=payload, k=ctx: c.decompress(p, k),
                                      repeats))
        entry = {"compressor": pipeline.compressor, "params": pipeline.params("compressor")}
        for i, what in enumerate(("compress", "decompress")):
            t_small, t_large = points[small][i], points[large][i]
            per = max(0.0, (t_large - t_small) / (large - small))
            entry[what] = {"overhead_s": max(0.0, t_small - per * small), "per_element_s": per}
        entries.append(entry)
    return {"format": FORMAT, "device": f"cpu ({platform.processor() or platform.machine()})",
            "framework": framework, "sizes": [small, large], "entries": entries}


def write(document: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path
