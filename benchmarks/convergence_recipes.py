"""The recipes (``grace_dl.recipes``) against the defaults they replace, on digits and on a
harder synthetic 100-class task, 2 ranks, several seeds; with estimated time to accuracy at
each link speed.

    python -m benchmarks.convergence_recipes --tasks digits mixture --seeds 0 1 2 \\
        --out benchmarks/results/recipes.json

writes one run (``benchmarks/records.py`` format; default file: the cache) with one record per
pipeline, task and seed: accuracy per epoch, bytes per step, wall time; it prints the tables
the benchmarks page shows. Runs on this machine's loopback (``horovodrun --gloo -H
localhost:2``).

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

from benchmarks import records as results
from benchmarks import tables
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
EPOCHS = {"topk1-dgc-20ep": 2}     # multiple of --epochs
TITLE = "Recipes: accuracy under momentum SGD (2 ranks)"
ABOUT = (
    "SGD lr 0.05, batch 32 per rank, 2 ranks on loopback; digits (3 seeds) and a synthetic "
    "100-class Gaussian mixture. *opt mom.* is the optimizer's momentum (0 where the memory "
    "holds the momentum). *final* is the test accuracy after the last epoch, mean over seeds "
    "(each seed: model initialisation and batch order); *vs none* its difference to "
    "uncompressed Horovod in points. **Time to target is an estimate, not a run over a shaped "
    "link**: steps to the target x (s/step measured on loopback + bytes/step / link speed); "
    "'> N ep' where a seed did not reach it. On these small models (digits 26k, mixture 108k "
    "parameters) per-tensor Python work dominates the step; the end-to-end section measures "
    "step times over shaped links on larger models.")


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


def _reusable(records, label, task, seed, epochs) -> dict | None:
    spec, momentum, _ = PIPELINES[label]
    for r in records:
        if ("error" not in r and r["pipeline"] == label and r["task"] == task
                and r["seed"] == seed and r["spec"] == spec and r["momentum"] == momentum
                and r["epochs"] == epochs * EPOCHS.get(label, 1)):
            return {**r, "reused": True}
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["digits", "mixture"])
    ap.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=list(PIPELINES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--mixture-seeds", nargs="+", type=int, default=None,
                    help="seeds for the mixture task (default: --seeds)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out", default=None,
                    help="results file (default: recipes.json in the cache, "
                         "benchmarks.records.scratch_dir)")
    ap.add_argument("--id", default="recipes", help="the run's id in the file")
    ap.add_argument("--reuse", default=None,
                    help="a recipes results file whose records are taken instead of a run where "
                         "pipeline, spec, optimizer momentum, task, seed and epochs are the "
                         "same (runs are deterministic per seed)")
    args = ap.parse_args(argv)
    env = worker_env()
    old = [r for run in results.load(Path(args.reuse))["runs"] for r in run["records"]] \
        if args.reuse else []
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
    out = Path(args.out) if args.out else results.default_out("recipes")
    command = "python -m benchmarks.convergence_recipes " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    doc = results.record_run(out, "recipes", TITLE, results.new_run(args.id, command, records),
                             about=ABOUT)
    print(tables.recipes(doc))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
