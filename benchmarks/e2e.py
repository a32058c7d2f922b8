"""End-to-end runs over emulated hosts: every (bandwidth, model, pipeline), side by side.

    python -m benchmarks.e2e --mbit 100 1000 --models mlp resnet18 --out benchmarks/results/e2e.json

Models (benchmarks/e2e_worker.py has their parameter and tensor counts): ``mlp`` (6 large
tensors), ``cnn``, ``resnet18`` (62 tensors, batch norm) and ``transformer`` (103 tensors), all
by default; ``tiny`` for smoke tests.

For each link speed the same cluster of namespaces is re-shaped, and every pipeline runs on it
back to back, so ratios against uncompressed Horovod are taken in one run on one machine.
``--launcher mpi`` uses mpirun instead of horovodrun --gloo.

Before the pipelines of a link speed, the job measures itself on that link (``python -m
grace_dl strategy measure`` on the same hosts: collectives, every pipeline end to end,
compression; ``grace_dl.strategy.calibrate``) into ``--calibration-dir``; Auto chooses from that
measurement and every row's ``predicted_s`` is the step model's time from it (the row's
``calibration`` names the file). ``--reuse-calibration`` takes a link's existing file instead of
measuring again, so that a re-run row (Auto after a change to the step model) is predicted from
the same measurement as the rows beside it.

``--repredict`` runs nothing: it recomputes ``predicted_s`` of the fixed pipelines' rows in
``--out`` with the current step model, from each row's own measurement and its recorded compute
and update times (what the worker computes), and marks them ``predicted_at`` this commit.
Auto's rows are left as they are: their step belongs to the strategy chosen when they ran.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def _key(record: dict) -> tuple:
    return record["model"], record["mbit"], record["pipeline"]


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each record that ``new`` re-ran replaced in place; new ones appended."""
    fresh = {_key(r): r for r in new}
    merged = [fresh.pop(_key(r), r) for r in old]
    return merged + [r for r in new if _key(r) in fresh]


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


def _relative(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def calibration_of(record: dict) -> Path:
    """The measurement a row was predicted from: its ``calibration``, else (rows from before
    it was recorded) ``benchmarks/results/calibration/<model>/`` where that exists, else the
    directory's own file for the link."""
    if record.get("calibration"):
        return ROOT / record["calibration"]
    base = ROOT / "benchmarks/results/calibration"
    if (base / record["model"]).is_dir():
        base = base / record["model"]
    return base / f"e2e-{record['mbit']:g}mbit.json"


def repredict(records: list[dict]) -> list[dict]:
    """``records`` with every fixed pipeline's ``predicted_s`` recomputed (module docstring)."""
    import os

    import torch

    from benchmarks.e2e_worker import build_model
    from benchmarks.pipelines import PIPELINES, predict_step

    commit, out = _commit(), []
    for r in records:
        if "error" in r or PIPELINES.get(r["pipeline"]) == "auto" or "compute_s" not in r:
            out.append(r)
            continue
        saved = {k: os.environ.get(k) for k in ("GRACE_BENCH_CALIBRATION", "GRACE_BENCH_MBIT")}
        os.environ["GRACE_BENCH_CALIBRATION"] = str(calibration_of(r))
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
        out.append({**r, "predicted_s": None if predicted is None
                    else predicted + r["update_s"], "predicted_at": commit})
    return out


def markdown(records: list[dict], command: str) -> str:
    """This run's rows (``benchmarks.report``'s e2e table) and each variant's step against its
    base pipeline's, per model and link speed. ``command``: what wrote the table (the run, or
    a ``--repredict`` of it: the rows' own ``command`` says what measured them)."""
    from benchmarks.pipelines import VARIANTS
    from benchmarks.report import E2E_COLUMNS, _table, e2e_rows, machine

    ok = [r for r in records if "error" not in r]
    step = {(r["model"], r["mbit"], r["pipeline"]): r["step_s"] for r in ok}
    ratios = [{"model": model, "Mbit/s": f"{mbit:g}", "variant": pipeline,
               "variant ms": f"{1000 * s:.1f}",
               "base ms": f"{1000 * step[(model, mbit, VARIANTS[pipeline][0])]:.1f}",
               "variant / base": f"{s / step[(model, mbit, VARIANTS[pipeline][0])]:.2f}"}
              for (model, mbit, pipeline), s in step.items()
              if pipeline in VARIANTS and (model, mbit, VARIANTS[pipeline][0]) in step]
    measured = list(dict.fromkeys(r["command"] for r in records if r.get("command")))
    made = "; ".join(f"`{c}`" for c in measured or [command])
    if measured and command not in measured:
        made += f", predictions recomputed with `{command}`"
    return (f"# End-to-end step time over emulated hosts\n\nMachine: {machine()}\n\n"
            f"Made with {made}; columns as in `e2e.md`.\n\n"
            + _table(E2E_COLUMNS, e2e_rows(records))
            + "\n\n## Variants against their base pipeline\n\nStep time of each variant "
              "(`benchmarks.pipelines.VARIANTS`) over its base pipeline's, same run.\n\n"
            + _table(["model", "Mbit/s", "variant", "variant ms", "base ms", "variant / base"],
                     ratios) + "\n")


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=str(ROOT))
    return proc.stdout.strip() or "unknown commit"


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
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/e2e.json"))
    ap.add_argument("--md", default=None,
                    help="also write this run's table (and its -bucket/-whole variants against "
                         "their base pipelines) to this markdown file")
    ap.add_argument("--merge", action="store_true",
                    help="keep --out's other records; replace those of the same model, link "
                         "speed and pipeline")
    ap.add_argument("--calibration-dir", default=str(ROOT / "benchmarks/results/calibration"),
                    help="where each link's measurement is written (e2e-<mbit>mbit.json)")
    ap.add_argument("--reuse-calibration", action="store_true",
                    help="use a link's existing measurement in --calibration-dir, if any")
    ap.add_argument("--no-bind", dest="bind", action="store_false",
                    help="leave the ranks to the scheduler on the shared cores (every row "
                         "before the binding was); by default each rank runs on cores of its "
                         "own (benchmarks/bind.py)")
    ap.add_argument("--repredict", action="store_true",
                    help="recompute the fixed pipelines' predictions in --out; run nothing")
    args = ap.parse_args(argv)
    command = "python -m benchmarks.e2e " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.repredict:
        records = repredict(json.loads(Path(args.out).read_text()))
        Path(args.out).write_text(json.dumps(records, indent=1))
        if args.md:
            Path(args.md).write_text(markdown(records, command))
        print(f"re-predicted {sum('predicted_at' in r for r in records)} of {len(records)} "
              f"rows in {args.out}")
        return 0

    from tqdm import tqdm

    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    runs = [(m, model, p) for m in args.mbit for _ in range(args.rounds)
            for model in args.models for p in args.pipelines]
    records, measured = [], {}
    run = f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} {_commit()}"
    Path(args.calibration_dir).mkdir(parents=True, exist_ok=True)
    with EmulatedCluster(args.hosts, mbit=args.mbit[0], prefix=args.prefix,
                         bind=args.bind) as cluster:
        bar = tqdm(runs, desc="e2e", unit="run")
        for mbit, model, pipeline in bar:
            if cluster.mbit != mbit:
                cluster.set_bandwidth(mbit)
            path = Path(args.calibration_dir) / f"e2e-{mbit:g}mbit.json"
            if mbit not in measured and args.reuse_calibration and path.exists():
                measured[mbit] = path
            if mbit not in measured:
                bar.set_postfix_str(f"{mbit:g} Mbit/s: measuring the job")
                measured[mbit] = calibrate(cluster, args.launcher, path, args.timeout)
            bar.set_postfix_str(f"{mbit:g} Mbit/s {model} {pipeline}")
            rec = run_one(cluster, args.launcher, model, pipeline, args.steps, args.warmup,
                          args.timeout, measured[mbit])
            rec.update({"mbit": mbit, "hosts": args.hosts, "launcher": args.launcher,
                        "run": run, "calibration": _relative(measured[mbit]),
                        "command": command, "bound": args.bind})
            records.append(rec)
            if "error" in rec:
                tqdm.write(f"FAILED {mbit:g} {model} {pipeline}: {rec['error'][-400:]}")
    records = median_runs(records)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.merge and Path(args.out).exists():
        records = merge(json.loads(Path(args.out).read_text()), records)
    Path(args.out).write_text(json.dumps(records, indent=1))
    if args.md:
        Path(args.md).write_text(markdown(records, command))
    print(f"wrote {args.out} ({len(records)} runs, {sum('error' in r for r in records)} failed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
