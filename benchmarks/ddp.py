"""DDP side by side: uncompressed DDP, PyTorch's own hooks and grace's hooks, over emulated
links, plus accuracy on digits.

    python -m benchmarks.ddp --mbit 100 1000 --rounds 2                 # into the cache
    python -m benchmarks.ddp ... --out benchmarks/results/ddp.json        # into the page

For each link speed the namespaces of ``benchmarks/network.py`` are re-shaped and every
pipeline (``benchmarks/ddp_worker.py``) runs on 2 hosts, one rank each, launched by one
``torchrun`` per host (gloo over the shaped ``eth0``). Pipelines alternate: ``--rounds`` passes
over all of them at each speed, and a pipeline's step time is the median over its rounds of
its per-run median, so every ratio against uncompressed DDP comes from one run on one machine.
Accuracy (digits, each pipeline once, no shaping: bandwidth does not change the arithmetic)
is measured with ``torchrun --standalone --nproc-per-node 2``.
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
from benchmarks.ddp_worker import PIPELINES
from benchmarks.jobs import worker_env
from benchmarks.network import EmulatedCluster

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "benchmarks" / "ddp_worker.py")


def run_timed(cluster: EmulatedCluster, pipeline: str, steps: int, warmup: int, port: int,
              timeout: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    argv = [WORKER, "--pipeline", pipeline, "--mode", "time", "--steps", str(steps),
            "--warmup", str(warmup), "--out", out]
    env = worker_env(cluster.env(), GLOO_SOCKET_IFNAME="eth0")
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=str(ROOT)) for cmd in cluster.torchrun(argv, port)]
    logs, failed = [], False
    deadline = time.time() + timeout
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.time()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs.append(f"timed out after {timeout}s")
            failed = True
            break
        failed |= p.returncode != 0
    if failed or not Path(out).exists() or Path(out).stat().st_size == 0:
        return {"pipeline": pipeline, "error": "\n".join(x[-1500:] for x in logs)}
    record = json.loads(Path(out).read_text())
    Path(out).unlink(missing_ok=True)
    return record


def run_accuracy(pipeline: str, epochs: int, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2",
           WORKER, "--pipeline", pipeline, "--mode", "accuracy", "--epochs", str(epochs),
           "--out", out]
    env = worker_env(GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT))
    if proc.returncode != 0:
        return {"pipeline": pipeline, "error": (proc.stdout[-1500:] + proc.stderr[-1500:])}
    record = json.loads(Path(out).read_text())
    Path(out).unlink(missing_ok=True)
    return record


TITLE = "DDP: PyTorch's hooks and grace's hooks side by side"
ABOUT = (
    "2 emulated hosts (network namespaces, `tc tbf` on both directions of each link, no added "
    "delay), one rank each on a core of its own, gloo, launched by one `torchrun` per host. "
    "Model: the e2e MLP (5.8M parameters, one 23 MB fp32 gradient in one DDP bucket), batch "
    "32, synthetic data. Step: the median over the rounds of each run's median step (after "
    "warm-up), pipelines alternating; *vs DDP*: DDP's step / the pipeline's. *sent*: bytes a "
    "rank sends per step (grace: its counters; DDP and PyTorch's hooks: 2(N-1)/N of the buffers "
    "they allreduce). Accuracy: digits, 2 ranks, SGD momentum 0.9, lr 0.05, 10 epochs. "
    "`-whole`: the bucket sent whole instead of in 4 MiB pieces.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mbit", type=float, nargs="+", default=[100, 1000])
    ap.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=PIPELINES)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--prefix", default="graceddp",
                    help="namespace name prefix; a run removes stale namespaces of its prefix")
    ap.add_argument("--subnet", type=int, default=78)
    ap.add_argument("--out", default=None,
                    help="results file (default: ddp.json in the cache, "
                         "benchmarks.records.scratch_dir; the page's is "
                         "benchmarks/results/ddp.json)")
    ap.add_argument("--id", default="ddp",
                    help="the run's id (a run of the same id in --out is replaced)")
    ap.add_argument("--no-bind", dest="bind", action="store_false",
                    help="leave the ranks to the scheduler on the shared cores; by default "
                         "each rank runs on a core of its own (benchmarks/bind.py)")
    args = ap.parse_args(argv)
    command = "python -m benchmarks.ddp " + " ".join(sys.argv[1:] if argv is None else argv)

    accuracy = {}
    if not args.no_accuracy:
        for p in args.pipelines:
            accuracy[p] = run_accuracy(p, args.epochs, args.timeout)
            print(f"accuracy {p}: {accuracy[p].get('accuracy', accuracy[p].get('error'))}",
                  flush=True)
    rows = []
    port = 29611
    with EmulatedCluster(2, mbit=args.mbit[0], subnet_id=args.subnet,
                         prefix=args.prefix, bind=args.bind) as cluster:
        for mbit in args.mbit:
            if cluster.mbit != mbit:
                cluster.set_bandwidth(mbit)
            for rnd in range(args.rounds):
                for p in args.pipelines:
                    port += 1  # a fresh rendezvous port: the last one may linger in TIME_WAIT
                    rec = run_timed(cluster, p, args.steps, args.warmup, port, args.timeout)
                    rec.update({"mbit": mbit, "round": rnd})
                    rows.append(rec)
                    msg = rec.get("error", "")[-300:] if "error" in rec else \
                        f"{1e3 * rec['step_s']:.0f} ms, {rec['sent_bytes'] / 1e6:.3f} MB sent"
                    print(f"{mbit:g} Mbit/s round {rnd} {p}: {msg}", flush=True)
    out = Path(args.out) if args.out else records.default_out("ddp")
    run = records.new_run(args.id, command, rows, accuracy=accuracy, bound=args.bind)
    records.record_run(out, "ddp", TITLE, run, about=ABOUT)
    print(tables.ddp_table(rows, accuracy))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
