"""The pipelines' own overhead on loopback (no link shaping), phase by phase, in one 2-rank job.

    python -m benchmarks.overhead --model mlp \
        --pipelines none hvd-fp16 grace-none topk randomk signsgd-2phase \
        --label after --out benchmarks/results/overhead.json

Every pipeline takes turns with the others in the same ``horovodrun --gloo`` job
(``benchmarks/overhead_worker.py``), so the ratios against Horovod's own uncompressed step
(``none``) are taken alternately on the same machine. ``--label`` tags the rows; a run appends
its rows to ``--out`` (rows of the same label are replaced) and rewrites the markdown table
beside it, so a "before" and an "after" run sit in one table. ``--jobs N`` runs the job N
times and pools them: Horovod's own step moves by 20-30% from one job to the next on a shared
host, and a ratio from one job moves with it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.jobs import local_horovodrun, worker_env
from benchmarks.report import _table, machine

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("compensate", "compress", "memory_update", "issue", "wait", "complete", "other")


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


def spread(values) -> str:
    """``"0.68 (0.63-0.74)"``: median, lowest and highest; empty without values."""
    if not values:
        return ""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def paired(rounds, base_rounds) -> str:
    """The median of a pipeline's per-round step over Horovod's in the same round, with the
    lowest and highest: ``"0.68 (0.63-0.74)"``; empty without both."""
    if not rounds or not base_rounds or len(rounds) != len(base_rounds):
        return ""
    return spread([a / b for a, b in zip(rounds, base_rounds)])


def markdown(rows: list[dict]) -> str:
    ms = lambda s: f"{1000 * s:.1f}"  # noqa: E731
    lines = []
    for label in dict.fromkeys(r["label"] for r in rows):
        group = [r for r in rows if r["label"] == label]
        first = group[0]
        base = next((r["total_s"] for r in group if r["pipeline"] == "none"), None)
        base_rounds = next((r.get("round_s") for r in group if r["pipeline"] == "none"), None)
        table = []
        for r in group:
            timed = "sent_bytes" in r  # a grace pipeline (Horovod's own have no phases)
            table.append({
                "pipeline": r["pipeline"], "step ms": ms(r["total_s"]),
                "÷ Horovod": f"{r['total_s'] / base:.2f}" if base else ""})
            if any("round_s" in g for g in group):
                table[-1]["÷ Horovod per round"] = paired(r.get("round_s"), base_rounds)
            if any("job_ratio" in g for g in group):
                table[-1]["÷ Horovod per job"] = spread(r.get("job_ratio"))
            table[-1].update({
                "fwd+bwd ms": ms(r["backward_s"]), "step() ms": ms(r["step_s"]),
                **{f"{p} ms": ms(r.get(p + "_s", 0.0)) if timed or p == "other" else ""
                   for p in PHASES},
                "sent MB": f"{r['sent_bytes'] / 1e6:.2f}" if r.get("sent_bytes") else ""})
            if any("early_phases" in g for g in group):
                table[-1]["early phases"] = f"{r['early_phases']:g}" if "early_phases" in r \
                    else ""
            if r["pipeline"] in ("compute", "lockstep", "floor"):
                table[-1]["other ms"] = ""
        jobs = f", {first['jobs']} jobs" if first.get("jobs") else ""
        lines += [f"### {label}", "",
                  f"{first['model']}, {first['ranks']} ranks, loopback{jobs}, "
                  f"{first.get('when', '')}, code at `{first.get('commit', '?')}`; made with "
                  f"`{first.get('command', '?')}`.", ""]
        if first.get("note"):
            lines += [first["note"], ""]
        lines += [_table(list(table[0]), table), ""]
    return ("# Pipeline overhead on loopback\n\n"
            f"Machine: {machine()}.\n\n"
            "Medians per step, rank 0. `none` is Horovod's own uncompressed allreduce, "
            "÷ Horovod the ratio of the medians; ÷ Horovod per round (where shown) the median, "
            "lowest and highest of each round's ratio (a round runs every pipeline's turn, "
            "seconds apart, so it sees less of the host's drift than the whole job); with "
            "several jobs (`--jobs`) every timing is the median over the jobs, the per-round "
            "ratios pool all their rounds, and ÷ Horovod per job is the median, lowest and "
            "highest of each job's ratio (Horovod's own step moves between jobs); "
            "`hvd-fp16` Horovod's fp16 compression, `grace-<name>` a grace pipeline from "
            "`benchmarks.pipelines.GRACE`, `compute` the same model with no communication "
            "(its step is forward + backward + the SGD update), `lockstep` compute with a 4-byte "
            "allreduce before each update (the ranks in step, as every synchronized pipeline's "
            "are: the floor for their steps), `floor` lockstep plus the two dense passes a "
            "sparsifier with residual error feedback cannot skip (each gradient added into a "
            "residual in its hook, `p.grad` rewritten before the update). Phases are wall time "
            "inside grace's methods (`benchmarks/overhead_worker.py`): encode is compensate + "
            "compress + memory_update and runs inside the backward pass (hooks); wait is time "
            "blocked on Horovod; other = step − compute − phases (for Horovod's own rows: "
            "everything beyond compute); early phases (where shown) = the exchanges' phases the "
            "gradient hooks completed per step, before `step()` (`early_rounds`, `Router.advance`; "
            "their complete and wait time is then inside fwd+bwd).\n\n" + "\n".join(lines))


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
        return head + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


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
                    help="leave the ranks to the scheduler on the shared cores (every run "
                         "before round 10 was); by default each rank runs on cores of its own "
                         "(benchmarks/bind.py)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/overhead.json"))
    args = ap.parse_args(argv)

    if args.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
    rows = pooled([run(args.model, args.pipelines, args.rounds, args.steps, args.ranks,
                       args.timeout, args.bind) for _ in range(args.jobs)])
    command = "python -m benchmarks.overhead " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
    stamp = {"label": args.label, "when": time.strftime("%Y-%m-%d"), "commit": commit(),
             "command": command, "note": args.note, "bound": args.bind}
    for r in rows:
        r.update(stamp)
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else []
    rows = [r for r in old if r.get("label") != args.label] + rows
    out.write_text(json.dumps(rows, indent=1))
    out.with_suffix(".md").write_text(markdown(rows))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
