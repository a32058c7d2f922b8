"""Measure compress/decompress cost on this machine for the ``Auto`` builder's cost model, and
write it in the throughput file format (``grace_dl.strategy.cost_model``).

    grace-dl strategy measure -o compression_throughput.json

For each candidate's compressor, random normal float32 tensors of two sizes are compressed and
decompressed ``repeats`` times after a warm-up; the medians give a line ``overhead_s +
per_element_s * n`` through the two points (clipped at zero). torch tensors on the CPU by
default; ``framework="tensorflow"`` measures eager TF instead.

Started under horovodrun or mpirun (or with ``job=True``), ``measure`` also times the job
itself, its collectives and every candidate pipeline end to end (``grace_dl.strategy.calibrate``),
and adds those sections to the same document; ``grace_dl.strategy.step_model.Calibration``
reads all of it.
"""

from __future__ import annotations

import importlib
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from grace_dl.strategy import calibrate
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


def line(small: int, t_small: float, large: int, t_large: float) -> dict:
    """A throughput entry's ``{"overhead_s", "per_element_s"}``: the line through the seconds
    of one call at two sizes (elements), both clipped at zero."""
    per = max(0.0, (t_large - t_small) / (large - small))
    return {"overhead_s": max(0.0, t_small - per * small), "per_element_s": per}


def measure(candidates, sizes=(4096, 262144), repeats: int = 5,
            framework: str = "torch", job: bool | None = None, mbit: float | None = None) -> dict:
    """The measurement document (a dict, ready for ``json.dump``) for ``candidates`` (dicts of
    GRACE keys); ``sizes`` are the two tensor sizes the compression line is fitted through.
    ``job``: also measure the running Horovod job (default: when started by a launcher);
    ``mbit``: the link speed to record with it, if known."""
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
            entry[what] = line(small, points[small][i], large, points[large][i])
        entries.append(entry)
    document = {"format": FORMAT,
                "device": f"cpu ({platform.processor() or platform.machine()})",
                "framework": framework, "sizes": [small, large], "entries": entries}
    if calibrate.in_job() if job is None else job:
        if framework != "torch":
            raise ValueError(f"measuring the job needs framework='torch', got {framework!r}")
        document.update(calibrate.measure_job(candidates, mbit=mbit))
    return document


def write(document: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path
