"""The recipes (``grace_dl.recipes``) against the defaults they replace, on digits and on a
harder synthetic 100-class task, 2 ranks, several seeds; with estimated time to accuracy at
each link speed.

    python -m benchmarks.convergence_recipes --tasks digits mixture --seeds 0 1 2 \\
        --out benchmarks/results/recipes.json

writes ``recipes.json`` (one record per pipeline, task and seed: accuracy per epoch, bytes per
step, wall time) and ``recipes.md`` (the tables and the command that made them). Runs on this
machine's loopback (``horovodrun --gloo -H localhost:2``).

**Time to accuracy** is an estimate, not a measurement over shaped links: for each link speed
B it is ``steps to target x (measured wall seconds per step on loopback + max(sent, received)
bytes per step / B)``. The bytes are the communicators' own counts (ring model for allreduce);
the wall time per step is this shared 2-core machine's, compression work included. Measuring
over ``tc``-shaped network namespaces (``benchmarks/network.py``, ``make bench``) is what
``benchmarks/e2e.py`` does for the step time of the default pipelines.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.jobs import local_horovodrun, worker_env
from grace_dl.recipes import recipe

ROOT = Path(__file__).resolve().parent.parent
TOPK1 = {"compressor": "topk", "compress_ratio": 0.01, "communicator": "allgather"}
RANDK10 = {"compressor": "randomk", "compress_ratio": 0.1, "communicator": "allreduce"}
MOMENTUM_NO_EF = {"memory": "momentum", "error_feedback": False, "factor_masking": False}


def topk_recipe(memory_momentum: float) -> dict:
    """``grace_dl.recipes``' top-k spec, its dgc memory's momentum set to ``memory_momentum``."""
    spec = recipe("topk")[0]
    spec["schedule"]["1e"]["size_threshold"]["params"]["momentum"] = memory_momentum
    return spec


# label -> (spec for --spec, or None for uncompressed Horovod; optimizer momentum; role)
PIPELINES: dict[str, tuple[dict | None, float, str]] = {
    "none": (None, 0.9, "baseline: uncompressed Horovod, SGD momentum 0.9"),
    "topk1-residual": ({**TOPK1, "memory": "residual"}, 0.9, "default until now"),
    "topk1-dgc": ({**TOPK1, "memory": "dgc"}, 0.0, "DGC's memory alone, every tensor"),
    "topk1-dgc-20ep": ({**TOPK1, "memory": "dgc"}, 0.0, "DGC's memory alone, twice the epochs"),
    "topk1-recipe": (*recipe("topk"),
                     "recipe: 1 dense epoch, then topk 1% + dgc (momentum 0.8) on weights of "
                     "2000+ elements, the rest dense (momentum 0.9 in the memory)"),
    "topk1-recipe-m0.9": (topk_recipe(0.9), 0.0, "the recipe with dgc momentum 0.9"),
    "topk1-recipe-m0.7": (topk_recipe(0.7), 0.0, "the recipe with dgc momentum 0.7"),
    "randk10-residual": ({**RANDK10, "memory": "residual"}, 0.9, "default until now"),
    "randk10-dgc": ({**RANDK10, "memory": "dgc"}, 0.0, "DGC's memory"),
    "randk10-unbiased-momentum": (*recipe("randomk"),
                                  "recipe (digits only; diverges on the mixture)"),
    "qsgd-2phase": (*recipe("qsgd"), "recipe (unchanged)"),
    "powersgd-r2": (*recipe("powersgd"), "recipe (unchanged)"),
}
TARGETS = {"digits": 0.95, "mixture": 0.85}
EPOCHS = {"topk1-dgc-20ep": 2}     # multiple of --epochs
LINKS_MBIT = (100, 1000, 10000)


def run_one(label, task, seed, epochs, env) -> dict:
    spec, momentum, _ = PIPELINES[label]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    which = ["--pipeline", "none"] if spec is None else ["--spec", json.dumps(spec)]
    cmd = local_horovodrun([sys.executable, "-m", "benchmarks.convergence_worker", *which,
                            "--label", label, "--task", task, "--seed", str(seed),
                            "--momentum", str(momentum),
                            "--epochs", str(epochs * EPOCHS.get(label, 1)), "--out", out])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800,
                          cwd=str(ROOT))
    if proc.returncode != 0:
        return {"pipeline": label, "task": task, "seed": seed, "error": proc.stderr[-1500:]}
    record = json.loads(Path(out).read_text())
    Path(out).unlink(missing_ok=True)
    return record


def steps_to(acc, target, steps_per_epoch):
    for epoch, a in enumerate(acc, 1):
        if a >= target:
            return epoch * steps_per_epoch
    return None


def tables(records, command: str) -> str:
    from benchmarks.report import machine

    reused = sum(1 for r in records if r.get("reused"))
    lines = ["# Recipes: accuracy under momentum SGD, 2 ranks", "",
             f"Machine: {machine()}", "", f"Command: `{command}`", ""]
    if reused:
        lines += [f"{reused} of the {len(records)} records were taken from `--reuse`'s file "
                  f"(same pipeline, spec, optimizer momentum, task, seed and epochs; a run is "
                  f"deterministic per seed), the rest were run now.", ""]
    lines += [
             "SGD lr 0.05, batch 32 per rank; the optimizer's momentum is the column *opt "
             "mom.* (0 where the memory holds the momentum). *final* is the test accuracy "
             "after the last epoch, mean over seeds (each seed: model initialisation and batch "
             "order); *vs none* is its difference to uncompressed Horovod in points. "
             "**Time to target is an estimate, not a run over a shaped link**: steps to the "
             "target x (s/step measured on this machine's loopback + bytes/step / link "
             "speed), from the mean over seeds of the steps needed; '> N ep' where a seed did "
             "not reach it in its N epochs (see `benchmarks/convergence_recipes.py`). On these "
             "small models (digits 26k, mixture 108k parameters) the bytes are few and "
             "per-tensor Python work dominates the step on this shared 2-core machine; "
             "`e2e.md` measures step times over `tc`-shaped links on larger models.", ""]
    for task in sorted({r["task"] for r in records}):
        rows = [r for r in records if r["task"] == task and "error" not in r]
        target = TARGETS.get(task, 0.9)
        by = {}
        for r in rows:
            by.setdefault(r["pipeline"], []).append(r)
        base = by.get("none")
        base_final = (sum(r["accuracy"][-1] for r in base) / len(base)) if base else None
        lines += [f"## {task} (target {target})", "",
                  "| pipeline | opt mom. | epochs | final (mean) | vs none | final per seed | "
                  "best (mean) | mean sent KB/step | s/step | "
                  + " | ".join(f"est. time to {target} @ {m / 1000:g} Gbit/s (s)"
                               for m in LINKS_MBIT) + " | role |",
                  "|" + "---|" * (10 + len(LINKS_MBIT))]
        for label in PIPELINES:
            rs = by.get(label)
            if not rs:
                continue
            finals = [r["accuracy"][-1] for r in rs]
            final = sum(finals) / len(finals)
            best = sum(max(r["accuracy"]) for r in rs) / len(rs)
            sent = [r["sent_bytes_per_step"][-1] for r in rs if r.get("sent_bytes_per_step")]
            sent_b = sum(sent) / len(sent) if sent else _dense_bytes(rs[0])
            per_step = sum(r["seconds"] / (r["epochs"] * r["steps_per_epoch"]) for r in rs) \
                / len(rs)
            reach = [steps_to(r["accuracy"], target, r["steps_per_epoch"]) for r in rs]
            times = []
            for mbit in LINKS_MBIT:
                if any(s is None for s in reach):
                    times.append(f"> {rs[0]['epochs']} ep")
                else:
                    steps = sum(reach) / len(reach)
                    times.append(f"{steps * (per_step + sent_b * 8 / (mbit * 1e6)):.1f}")
            diff = "" if base_final is None else f"{(final - base_final) * 100:+.1f}"
            lines.append(
                f"| {label} | {rs[0]['momentum']:g} | {rs[0]['epochs']} | {final:.4f} | {diff} | "
                f"{' '.join(f'{f:.3f}' for f in finals)} | {best:.4f} | {sent_b / 1e3:.1f} | "
                f"{per_step * 1e3:.1f} ms | " + " | ".join(times)
                + f" | {PIPELINES[label][2]} |")
        lines.append("")
        lines += [f"Accuracy per epoch ({task}, seed {min(r['seed'] for r in rows)}):", "",
                  "| pipeline | " + " | ".join(f"ep{i + 1}" for i in range(
                      max(len(r["accuracy"]) for r in rows))) + " |",
                  "|" + "---|" * (1 + max(len(r["accuracy"]) for r in rows))]
        first = min(r["seed"] for r in rows)
        for label in PIPELINES:
            for r in by.get(label, []):
                if r["seed"] == first:
                    lines.append(f"| {label} | " + " | ".join(f"{a:.3f}" for a in r["accuracy"])
                                 + " |")
        lines.append("")
    failed = [r for r in records if "error" in r]
    if failed:
        lines += ["## Failed runs", ""] + [f"- {r['pipeline']} {r['task']} seed {r['seed']}"
                                           for r in failed]
    return "\n".join(lines) + "\n"


def _reusable(records, label, task, seed, epochs) -> dict | None:
    spec, momentum, _ = PIPELINES[label]
    for r in records:
        if ("error" not in r and r["pipeline"] == label and r["task"] == task
                and r["seed"] == seed and r["spec"] == spec and r["momentum"] == momentum
                and r["epochs"] == epochs * EPOCHS.get(label, 1)):
            return {**r, "reused": True}
    return None


def _dense_bytes(record) -> float:
    """Uncompressed Horovod (grace=None) counts nothing: the ring allreduce of every fp32
    parameter, 2(N-1)/N of the model's bytes with N = 2."""
    return float(record.get("dense_bytes", 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["digits", "mixture"])
    ap.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=list(PIPELINES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--mixture-seeds", nargs="+", type=int, default=None,
                    help="seeds for the mixture task (default: --seeds)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/recipes.json"))
    ap.add_argument("--reuse", default=None,
                    help="a recipes.json whose records are taken instead of a run where "
                         "pipeline, spec, optimizer momentum, task, seed and epochs are the "
                         "same (runs are deterministic per seed)")
    args = ap.parse_args(argv)
    env = worker_env()
    old = json.loads(Path(args.reuse).read_text()) if args.reuse else []
    records = []
    for task in args.tasks:
        seeds = args.mixture_seeds if task == "mixture" and args.mixture_seeds else args.seeds
        for seed in seeds:
            for label in args.pipelines:
                r = _reusable(old, label, task, seed, args.epochs)
                if r is None:
                    r = run_one(label, task, seed, args.epochs, env)
                records.append(r)
                status = r.get("error", "")[-300:] or " ".join(f"{a:.3f}" for a in r["accuracy"])
                print(f"{task} seed {seed} {label}: {status}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1))
    command = "python -m benchmarks.convergence_recipes " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    out.with_suffix(".md").write_text(tables(records, command))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
