"""The pipelines' own overhead on loopback (no link shaping), phase by phase, in one 2-rank job.

    python -m benchmarks.overhead --model mlp \
        --pipelines none hvd-fp16 grace-none topk randomk signsgd-2phase --label after

Every pipeline takes turns with the others in the same ``horovodrun --gloo`` job
(``benchmarks/overhead_worker.py``), so the ratios against Horovod's own uncompressed step
(``none``) are taken alternately on the same machine. ``--label`` names the run; a run is added
to ``--out`` (default: the cache; a run of the same label is replaced), so a "before" and an
"after" run sit in one file and print side by side. ``--jobs N`` runs the job N times and pools
them: Horovod's own step moves from one job to the next on a shared host, and a ratio from one
job moves with it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import records, tables
from benchmarks.jobs import local_horovodrun, worker_env

ROOT = Path(__file__).resolve().parent.parent


def run(model: str, pipelines: list[str], rounds: int, steps: int, ranks: int,
        timeout: float, bind: bool = True) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    cmd = local_horovodrun([sys.executable, "-m", "benchmarks.overhead_worker", "--model", model,
                            "--rounds", str(rounds), "--steps", str(steps), "--out", out,
                            "--pipelines", *pipelines], ranks, bind)
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT))
    if proc.returncode != 0:
        raise SystemExit(f"overhead job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = json.loads(Path(out).read_text())
    Path(out).unlink(missing_ok=True)
    return rows


def pooled(jobs: list[list[dict]]) -> list[dict]:
    """One row per pipeline from several jobs' rows: each timing the median over the jobs,
    ``round_s`` every job's rounds in turn (so the per-round pairing covers them all), and
    ``job_ratio`` each job's step over Horovod's step in that job."""
    if len(jobs) == 1:
        return jobs[0]
    out = []
    for i, row in enumerate(jobs[0]):
        same = [job[i] for job in jobs]
        rec = dict(row)
        for key, value in row.items():
            if key.endswith("_s") and isinstance(value, (int, float)):
                rec[key] = statistics.median(r[key] for r in same)
        if "round_s" in row:
            rec["round_s"] = [x for r in same for x in r["round_s"]]
        base = [next(r for r in job if r["pipeline"] == "none") for job in jobs]
        rec["job_ratio"] = [r["total_s"] / b["total_s"] for r, b in zip(same, base)]
        rec["jobs"] = len(jobs)
        out.append(rec)
    return out


TITLE = "Pipeline overhead on loopback, phase by phase"
ABOUT = (
    "One 2-rank `horovodrun --gloo` job on loopback (no shaping), each rank bound to a core, "
    "every pipeline taking turns with the others. Medians per step, rank 0. `none` is "
    "Horovod's own uncompressed allreduce and *÷ Horovod* the ratio of the medians; *per "
    "round* the median, lowest and highest of each round's ratio (a round runs every "
    "pipeline's turn, seconds apart); with several jobs (`--jobs`) every timing is the median "
    "over the jobs and *per job* each job's ratio. `hvd-fp16` is Horovod's fp16 compression, "
    "`grace-<name>` a grace pipeline, `compute` the model with no communication, `lockstep` "
    "compute with a 4-byte allreduce before each update (the floor of a synchronized step), "
    "`floor` lockstep plus the two dense passes a sparsifier with residual error feedback "
    "cannot skip. Phases are wall time inside grace's methods "
    "(`benchmarks/overhead_worker.py`): compensate + compress + memory_update run in the "
    "backward pass's hooks; wait is time blocked on Horovod; other = step - compute - phases.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--pipelines", nargs="+",
                    default=["none", "hvd-fp16", "grace-none", "topk", "randomk",
                             "signsgd-2phase"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=1,
                    help="run the job this many times, one after another, and pool them "
                         "(each job's ratio to Horovod moves with the host's state)")
    ap.add_argument("--label", default="after")
    ap.add_argument("--note", default="", help="what this run's code changed, for the table")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--no-bind", dest="bind", action="store_false",
                    help="leave the ranks to the scheduler on the shared cores; by default "
                         "each rank runs on cores of its own (benchmarks/bind.py)")
    ap.add_argument("--out", default=None,
                    help="results file (default: overhead.json in the cache, "
                         "benchmarks.records.scratch_dir; the page's is "
                         "benchmarks/results/overhead.json)")
    args = ap.parse_args(argv)

    if args.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
    rows = pooled([run(args.model, args.pipelines, args.rounds, args.steps, args.ranks,
                       args.timeout, args.bind) for _ in range(args.jobs)])
    command = "python -m benchmarks.overhead " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
    out = Path(args.out) if args.out else records.default_out("overhead")
    this = records.new_run(args.label, command, rows, note=args.note, bound=args.bind)
    doc = records.record_run(out, "overhead", TITLE, this, about=ABOUT)
    print(tables.overhead(doc))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
