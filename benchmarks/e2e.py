"""End-to-end runs over emulated hosts: every (bandwidth, model, pipeline), side by side.

    python -m benchmarks.e2e --mbit 100 1000 --models mlp resnet18          # into the cache
    python -m benchmarks.e2e ... --merge --out benchmarks/results/e2e.json  # into the page

Models (benchmarks/e2e_worker.py has their parameter and tensor counts): ``mlp`` (6 large
tensors), ``cnn``, ``resnet18`` (62 tensors, batch norm) and ``transformer`` (103 tensors), all
by default; ``tiny`` for smoke tests.

For each link speed the same cluster of namespaces is re-shaped, and every pipeline runs on it
back to back, so ratios against uncompressed Horovod are taken in one run on one machine.
``--launcher mpi`` uses mpirun instead of horovodrun --gloo.

Before the pipelines of a link speed, the job measures itself on that link (``python -m
grace_dl strategy measure`` on the same hosts: collectives, every pipeline end to end,
compression; ``grace_dl.strategy.calibrate``) into ``--calibration-dir`` (default: a cache
directory, ``benchmarks.records.scratch_dir``); Auto chooses from that measurement and every
row's ``predicted_s`` is the step model's time from it. The run keeps each link's measurement
(its ``calibration``), so the results file alone can re-predict its rows.
``--reuse-calibration`` takes a link's existing file instead of measuring again, so that a
re-run row (Auto after a change to the step model) is predicted from the same measurement as
the rows beside it.

The results (``benchmarks/records.py`` format, one run per invocation) go to ``--out``, by
default the cache; ``--merge`` keeps the file's other runs and drops their rows of the same
model, link speed and pipeline, so the page shows one row for each.

``--repredict`` runs nothing: it recomputes ``predicted_s`` of the fixed pipelines' rows in
``--out`` with the current step model, from each run's own measurement and each row's recorded
compute and update times (what the worker computes), and marks them ``predicted_at`` this
commit. Auto's rows are left as they are: their step belongs to the strategy chosen when they
ran.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import records, tables
from benchmarks.jobs import worker_env
from benchmarks.network import EmulatedCluster
from benchmarks.pipelines import GRACE, PIPELINES
from grace_dl.strategy.builders import DEFAULT_CANDIDATES

ROOT = Path(__file__).resolve().parent.parent


def calibrate(cluster: EmulatedCluster, launcher: str, out: Path, timeout: float) -> Path:
    """Measure the job on the cluster's current link (Auto's candidates and every grace
    pipeline of the benchmarks) into ``out``."""
    candidates = list(DEFAULT_CANDIDATES) + list(GRACE.values())
    argv = [sys.executable, "-m", "grace_dl", "strategy", "measure", "--candidates",
            json.dumps(candidates), "--mbit", f"{cluster.mbit:g}", "-o", str(out)]
    cmd = cluster.horovodrun(argv) if launcher == "gloo" else cluster.mpirun(argv)
    proc = subprocess.run(cmd, env=worker_env(cluster.env()), capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"measuring the job at {cluster.mbit:g} Mbit/s failed:\n"
                           f"{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    return out


def run_one(cluster: EmulatedCluster, launcher: str, model: str, pipeline: str, steps: int,
            warmup: int, timeout: float, calibration: Path | None = None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    argv = [sys.executable, "-m", "benchmarks.e2e_worker", "--model", model, "--pipeline",
            pipeline, "--steps", str(steps), "--warmup", str(warmup), "--out", out]
    cmd = cluster.horovodrun(argv) if launcher == "gloo" else cluster.mpirun(argv)
    env = worker_env(cluster.env(), GRACE_BENCH_MBIT=str(cluster.mbit),
                     **({"GRACE_BENCH_CALIBRATION": str(calibration)} if calibration else {}))
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT))
    if proc.returncode != 0:
        return {"model": model, "pipeline": pipeline, "error":
                (proc.stdout[-1500:] + proc.stderr[-1500:]).strip()}
    record = json.loads(Path(out).read_text())
    Path(out).unlink(missing_ok=True)
    record["wall_s"] = time.time() - t0
    return record


TITLE = "End-to-end step time over emulated links"
ABOUT = (
    "Two hosts made of network namespaces on one machine (`benchmarks/network.py`), each link "
    "shaped with `tc tbf` in both directions (bandwidth only, no added delay), one rank per "
    "host bound to a core of its own, launched by stock `horovodrun`. Models with synthetic "
    "data (`benchmarks/e2e_worker.py`): an MLP (5.8M parameters in 6 tensors), a plain CNN "
    "(2.5M, 10), ResNet-18 with batch norm (11.2M, 62) and a ViT-style transformer encoder "
    "(6.4M, 103). Every pipeline (`benchmarks/pipelines.py`; `-bucket`: `bucket_bytes=25 << "
    "20`, `-fused`: `groups=1`) ran back to back at each link speed; with `--rounds N` each "
    "ran N times round-robin and the row is its median run. *speedup vs none* = uncompressed "
    "(fp32) Horovod's step / the pipeline's, *vs hvd-fp16* the same against Horovod's own fp16 "
    "compression. compute and compress are timed apart in the same process; communicate = "
    "step - compute - compress (\"hidden\" where those two alone exceed the step); "
    "bytes/bandwidth = max(sent, received) bytes per step / link speed. *predicted* = the step "
    "model's time (`grace_dl.strategy.step_model`) from the job's own measurement on that link, "
    "kept in the run.")


def _key(record: dict) -> tuple:
    return record["model"], record["mbit"], record["pipeline"]


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` runs with every row that a ``new`` run re-ran dropped (runs left empty go), then
    ``new``: one row per model, link speed and pipeline across the file."""
    fresh = {_key(r) for run in new for r in run["records"]}
    kept = []
    for run in old:
        rows = [r for r in run["records"] if _key(r) not in fresh]
        if rows and run["id"] not in {n["id"] for n in new}:
            kept.append({**run, "records": rows})
    return kept + new


def median_runs(records: list[dict]) -> list[dict]:
    """One record per model, link speed and pipeline: with several runs (``--rounds``), the run
    of median step time (the lower middle of an even number), whole, so its compute, bytes and
    prediction belong to that step; ``step_s_rounds`` lists every run's step time in run order.
    Failed runs are dropped while one succeeded."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for runs in groups.values():
        ok = [r for r in runs if "error" not in r]
        if len(runs) == 1 or not ok:
            out.append(runs[0])
            continue
        middle = sorted(ok, key=lambda r: r["step_s"])[(len(ok) - 1) // 2]
        out.append({**middle, "step_s_rounds": [r["step_s"] for r in ok]})
    return out


def repredict(runs: list[dict]) -> list[dict]:
    """``runs`` with every fixed pipeline's ``predicted_s`` recomputed (module docstring)."""
    import os

    import torch

    from benchmarks.e2e_worker import build_model
    from benchmarks.pipelines import PIPELINES, predict_step

    commit, out = records.commit(), []
    saved = {k: os.environ.get(k) for k in ("GRACE_BENCH_CALIBRATION", "GRACE_BENCH_MBIT")}
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            rows = []
            for r in run["records"]:
                measured = run.get("calibration", {}).get(f"{r.get('mbit', 0):g}")
                if ("error" in r or PIPELINES.get(r["pipeline"]) == "auto"
                        or "compute_s" not in r or measured is None):
                    rows.append(r)
                    continue
                path = Path(tmp) / f"{run['id']}-{r['mbit']:g}.json"
                path.write_text(json.dumps(measured))
                os.environ["GRACE_BENCH_CALIBRATION"] = str(path)
                os.environ["GRACE_BENCH_MBIT"] = str(r["mbit"])
                try:
                    torch.manual_seed(0)
                    model = build_model(r["model"])[0]
                    predicted = predict_step(r["pipeline"], model, compute_s=r["compute_s"])
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                rows.append({**r, "predicted_s": None if predicted is None
                             else predicted + r["update_s"], "predicted_at": commit})
            out.append({**run, "records": rows})
    return out


def _run_id(args) -> str:
    return f"{records.commit().split('+')[0]}-{args.prefix}-{time.strftime('%m%d%H%M')}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mbit", type=float, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--models", nargs="+", default=["mlp", "cnn", "resnet18", "transformer"])
    ap.add_argument("--pipelines", nargs="+", default=list(PIPELINES))
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every pipeline this many times, round-robin, and keep each one's "
                         "median run (its other runs' step times in step_s_rounds)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--launcher", choices=["gloo", "mpi"], default="gloo")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--prefix", default="gracebench",
                    help="namespace name prefix; a run removes stale namespaces of its prefix")
    ap.add_argument("--out", default=None,
                    help="results file (default: e2e.json in the cache, "
                         "benchmarks.records.scratch_dir; the page's is "
                         "benchmarks/results/e2e.json)")
    ap.add_argument("--merge", action="store_true",
                    help="keep --out's other runs, less their rows of the same model, link "
                         "speed and pipeline")
    ap.add_argument("--calibration-dir", default=None,
                    help="where each link's measurement is written (e2e-<mbit>mbit.json; "
                         "default: the cache's calibration/ directory)")
    ap.add_argument("--reuse-calibration", action="store_true",
                    help="use a link's existing measurement in --calibration-dir, if any")
    ap.add_argument("--no-bind", dest="bind", action="store_false",
                    help="leave the ranks to the scheduler on the shared cores; by default each "
                         "rank runs on cores of its own (benchmarks/bind.py)")
    ap.add_argument("--repredict", action="store_true",
                    help="recompute the fixed pipelines' predictions in --out; run nothing")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else records.default_out("e2e")
    command = "python -m benchmarks.e2e " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.repredict:
        doc = records.load(out)
        doc["runs"] = repredict(doc["runs"])
        out.write_text(records.dump(doc))
        rows = [r for run in doc["runs"] for r in run["records"]]
        print(f"re-predicted {sum('predicted_at' in r for r in rows)} of {len(rows)} rows "
              f"in {out}")
        return 0

    from tqdm import tqdm

    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    calibration_dir = Path(args.calibration_dir or records.scratch_dir("calibration"))
    calibration_dir.mkdir(parents=True, exist_ok=True)
    runs = [(m, model, p) for m in args.mbit for _ in range(args.rounds)
            for model in args.models for p in args.pipelines]
    rows, measured = [], {}
    with EmulatedCluster(args.hosts, mbit=args.mbit[0], prefix=args.prefix,
                         bind=args.bind) as cluster:
        bar = tqdm(runs, desc="e2e", unit="run")
        for mbit, model, pipeline in bar:
            if cluster.mbit != mbit:
                cluster.set_bandwidth(mbit)
            path = calibration_dir / f"e2e-{mbit:g}mbit.json"
            if mbit not in measured and args.reuse_calibration and path.exists():
                measured[mbit] = path
            if mbit not in measured:
                bar.set_postfix_str(f"{mbit:g} Mbit/s: measuring the job")
                measured[mbit] = calibrate(cluster, args.launcher, path, args.timeout)
            bar.set_postfix_str(f"{mbit:g} Mbit/s {model} {pipeline}")
            rec = run_one(cluster, args.launcher, model, pipeline, args.steps, args.warmup,
                          args.timeout, measured[mbit])
            rec.update({"mbit": mbit, "hosts": args.hosts, "launcher": args.launcher,
                        "bound": args.bind})
            rows.append(rec)
            if "error" in rec:
                tqdm.write(f"FAILED {mbit:g} {model} {pipeline}: {rec['error'][-400:]}")
    run = records.new_run(_run_id(args), command, median_runs(rows), calibration={
        f"{mbit:g}": json.loads(Path(path).read_text()) for mbit, path in measured.items()})
    doc = records.record_run(out, "e2e", TITLE, run, about=ABOUT, keep=args.merge)
    if args.merge:
        doc["runs"] = merge(doc["runs"][:-1], doc["runs"][-1:])
        out.write_text(records.dump(doc))
    print(tables.e2e({**doc, "runs": [run]}))
    print(f"wrote {out} ({len(run['records'])} rows, "
          f"{sum('error' in r for r in run['records'])} failed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
