"""Accuracy per epoch on digits for every pipeline, 2 ranks, same seeds and epochs.

    python -m benchmarks.convergence --epochs 10                     # into the cache
    python -m benchmarks.convergence --out benchmarks/results/convergence.json

Runs on this machine's loopback (``horovodrun --gloo -H localhost:2``): convergence does not
depend on the link.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import records as results
from benchmarks import tables
from benchmarks.jobs import local_horovodrun, worker_env
from benchmarks.pipelines import PIPELINES

ROOT = Path(__file__).resolve().parent.parent
TITLE = "Convergence on digits, every pipeline (2 ranks)"
ABOUT = ("scikit-learn's digits, 2 ranks on loopback (`benchmarks/convergence_worker.py`), the "
         "same seed, model and epochs for every pipeline of `benchmarks/pipelines.py`; test "
         "accuracy after each epoch.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pipelines", nargs="+", default=[p for p in PIPELINES if p != "auto"])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out", default=None,
                    help="results file (default: convergence.json in the cache, "
                         "benchmarks.records.scratch_dir)")
    ap.add_argument("--id", default="convergence", help="the run's id in the file")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    env = worker_env()
    rows = []
    for pipeline in tqdm(args.pipelines, desc="convergence", unit="pipeline"):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out = tmp.name
        cmd = local_horovodrun([sys.executable, "-m", "benchmarks.convergence_worker",
                                "--pipeline", pipeline, "--epochs", str(args.epochs),
                                "--out", out])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                              cwd=str(ROOT))
        if proc.returncode != 0:
            rows.append({"pipeline": pipeline, "error": proc.stderr[-1500:]})
            tqdm.write(f"FAILED {pipeline}: {proc.stderr[-400:]}")
            continue
        rows.append(json.loads(Path(out).read_text()))
        Path(out).unlink(missing_ok=True)
    out = Path(args.out) if args.out else results.default_out("convergence")
    command = "python -m benchmarks.convergence " + " ".join(
        sys.argv[1:] if argv is None else argv)
    doc = results.record_run(out, "convergence", TITLE, results.new_run(args.id, command, rows),
                             about=ABOUT)
    print(tables.convergence(doc))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
