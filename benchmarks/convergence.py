"""Accuracy per epoch on digits for every pipeline, 2 ranks, same seeds and epochs.

    python -m benchmarks.convergence --epochs 10 --out benchmarks/results/convergence.json

Runs on this machine's loopback (``horovodrun --gloo -H localhost:2``): convergence does not
depend on the link; time-to-accuracy is derived in report.py from these epochs and the
end-to-end step times.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.jobs import local_horovodrun, worker_env
from benchmarks.pipelines import PIPELINES

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pipelines", nargs="+", default=[p for p in PIPELINES if p != "auto"])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/convergence.json"))
    args = ap.parse_args(argv)
    from tqdm import tqdm

    env = worker_env()
    records = []
    for pipeline in tqdm(args.pipelines, desc="convergence", unit="pipeline"):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out = tmp.name
        cmd = local_horovodrun([sys.executable, "-m", "benchmarks.convergence_worker",
                                "--pipeline", pipeline, "--epochs", str(args.epochs),
                                "--out", out])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                              cwd=str(ROOT))
        if proc.returncode != 0:
            records.append({"pipeline": pipeline, "error": proc.stderr[-1500:]})
            tqdm.write(f"FAILED {pipeline}: {proc.stderr[-400:]}")
            continue
        records.append(json.loads(Path(out).read_text()))
        Path(out).unlink(missing_ok=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(records, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
