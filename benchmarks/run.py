"""The whole benchmark suite in one command (``make bench``), or a smoke run (``--quick``).

Full: the compressor micro table, the compiled kernels against their twins, the pipelines'
overhead on loopback, end-to-end runs at 100 Mbit/s, 1 Gbit/s and 10 Gbit/s for the MLP, the
CNN, ResNet-18 and the transformer encoder and every pipeline, convergence on digits; each
replaces its run in ``benchmarks/results/`` (``--results`` elsewhere), and the page
``docs/benchmarks.md`` is rendered from them. Quick: a tiny model, 2 hosts, one link speed, two
pipelines, one epoch, into a directory of your choice (default: a temporary one) with the page
rendered there, so committed results stay as they are. Calibrations (each link's measurement)
go to the cache (``benchmarks.records.scratch_dir``) in full runs, and under the results
directory in quick ones; the e2e run keeps them in its results file either way.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import convergence, e2e, kernels, overhead, records, report

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default=None)
    args = ap.parse_args(argv)

    if args.quick:
        results = Path(args.results or tempfile.mkdtemp(prefix="grace_bench_"))
        results.mkdir(parents=True, exist_ok=True)
        e2e.main(["--mbit", "1000", "--models", "tiny", "--pipelines", "none", "topk",
                  "--steps", "3", "--warmup", "1", "--prefix", "gracequick",
                  "--out", str(results / "e2e.json"),
                  "--calibration-dir", str(results / "calibration")])
        convergence.main(["--pipelines", "none", "topk", "--epochs", "1",
                          "--out", str(results / "convergence.json")])
        page = results
    else:
        results = Path(args.results or records.RESULTS)
        results.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "grace_dl", "strategy", "measure", "-o",
                        str(records.scratch_dir() / "compression_throughput.json")],
                       check=True, cwd=str(ROOT))
        subprocess.run([sys.executable, str(ROOT / "benchmarks/compressors.py"), "--threads",
                        "1", "--out", str(results / "compressors.json")], check=True,
                       cwd=str(ROOT))
        kernels.main(["--out", str(results / "kernels.json")])
        overhead.main(["--label", "make bench", "--out", str(results / "overhead.json")])
        e2e.main(["--merge", "--out", str(results / "e2e.json")])
        convergence.main(["--out", str(results / "convergence.json")])
        page = report.PAGE.parent if results == records.RESULTS else results
    link = "../benchmarks/results" if page == report.PAGE.parent else str(results.resolve())
    for path in report.write(results, page, link):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
