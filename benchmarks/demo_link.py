"""``make demo``'s second half: where compression pays, over an emulated 100 Mbit/s link.

    python -m benchmarks.demo_link                      # as root; about a minute on 2 cores
    python -m benchmarks.demo_link --model tiny --steps 2 --warmup 1   # quick check

Two emulated hosts (network namespaces joined by a bridge, every link shaped with ``tc tbf``;
``benchmarks/network.py``), one rank each under ``horovodrun --gloo``, run the e2e worker's
synthetic-data model (default: the 5.8M-parameter MLP) with each pipeline back to back, and
this prints the median step time, the bytes each rank sent per step and the speedup against
uncompressed (fp32) Horovod and against Horovod's own fp16 compression.

Network namespaces need root (and ``ip`` and ``tc`` from iproute2). Without them this prints
one line saying why it skipped and exits 0, so ``make demo`` still succeeds as a normal user.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from benchmarks.e2e import run_one
from benchmarks.network import EmulatedCluster

LABELS = {
    "none": "none: fp32 Horovod allreduce",
    "hvd-fp16": "hvd-fp16: Horovod's fp16",
    "topk": "topk 1% + residual, allgather",
    "randomk": "randomk 1% + residual, allreduce",
}


def open_cluster(mbit: float, prefix: str) -> tuple[EmulatedCluster | None, str]:
    """``(cluster, "")`` with the namespaces up, or ``(None, why)`` when they cannot be made."""
    try:
        cluster = EmulatedCluster(2, mbit=mbit, prefix=prefix)
        cluster.create()
    except (PermissionError, FileNotFoundError) as exc:
        return None, str(exc)
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or "").strip().splitlines()
        return None, (f"'{' '.join(exc.cmd[:4])} ...' failed: "
                      f"{detail[-1] if detail else f'exit status {exc.returncode}'}")
    return cluster, ""


def table(records: list[dict], mbit: float) -> str:
    steps = {r["pipeline"]: r["step_s"] for r in records if "step_s" in r}
    lines = [f"{'pipeline':34} {'step ms':>9} {'sent MB/step':>13} {'speedup vs none':>16} "
             f"{'vs hvd-fp16':>12}"]
    for r in records:
        label = LABELS.get(r["pipeline"], r["pipeline"])
        if "error" in r:
            lines.append(f"{label:34} {'failed':>9}")
            continue
        vs = {b: f"{steps[b] / r['step_s']:.2f}x" if b in steps else "n/a"
              for b in ("none", "hvd-fp16")}
        lines.append(f"{label:34} {r['step_s'] * 1e3:9.1f} {r['sent_bytes'] / 1e6:13.3f} "
                     f"{vs['none']:>16} {vs['hvd-fp16']:>12}")
    first = next((r for r in records if "params" in r), None)
    if first:
        n = first["params"]
        size = f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"
        lines.append(f"\n2 hosts, 1 rank each, median of {first['steps']} steps per pipeline, "
                     f"model {first['model']} ({size} parameters, {n * 4 / 1e6:.2f} MB of fp32 "
                     f"gradients), batch 32; {mbit:g} Mbit/s each way per host.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mbit", type=float, default=100)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--pipelines", nargs="+", default=["none", "hvd-fp16", "topk"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--prefix", default="gracedemo",
                    help="namespace name prefix; stale namespaces of this prefix are removed")
    args = ap.parse_args(argv)

    cluster, why = open_cluster(args.mbit, args.prefix)
    if cluster is None:
        print(f"skipped the emulated {args.mbit:g} Mbit/s link: {why}")
        return 0
    print(f"== {args.model} over an emulated {args.mbit:g} Mbit/s link "
          f"(2 network namespaces, tc tbf) ==", flush=True)
    records = []
    try:
        for pipeline in args.pipelines:
            rec = run_one(cluster, "gloo", args.model, pipeline, args.steps, args.warmup,
                          args.timeout)
            if "error" in rec:
                print(f"FAILED {pipeline}: {rec['error'][-600:]}", file=sys.stderr)
            records.append(rec)
    finally:
        cluster.destroy()
    print(table(records, args.mbit))
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
