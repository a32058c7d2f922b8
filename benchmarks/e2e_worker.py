"""One end-to-end benchmark run, executed on every rank (launched by benchmarks/e2e.py).

Trains a synthetic-data model for ``--steps`` steps after ``--warmup`` steps with one pipeline
and writes, on rank 0, a JSON record: median step time, bytes this rank sent and received per
step (from the communicator's counters; for Horovod's own paths, the tensor sizes that
Horovod's ring allreduce moves), and the time split:

- compute: forward + backward with no communication, timed in the same process beforehand;
- compress: compress + decompress of every gradient through the pipeline's compressor, timed
  locally (no collectives);
- communicate: step time − compute − compress (what the network and the collectives cost,
  minus what overlapped with the backward pass).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn

import grace_dl.torch.horovod as hvd
from benchmarks.pipelines import PIPELINES, make_grace
from grace_dl.strategy.dispatcher import StrategyDispatcher


def build_model(kind: str) -> tuple[nn.Module, tuple]:
    """Models whose gradients are 1M–25M parameters, with the shape of one input batch."""
    if kind == "tiny":  # quick mode / smoke test
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), (
            1, 8, 8)
    if kind == "mlp":  # 5.8M parameters
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(),
                             nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)), (1, 28, 28)
    if kind == "cnn":  # 3.3M parameters, most in conv kernels
        return nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(256, 512, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(512, 256, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(256, 10)), (3, 32, 32)
    raise ValueError(f"model must be tiny, mlp or cnn, got {kind!r}")


def time_compute(model, x, y, loss_fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        model.zero_grad()
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_compress(grc, model, repeats: int) -> float:
    if grc is None:
        return 0.0
    grads = [(n, p.grad.detach().clone()) for n, p in model.named_parameters()]
    if isinstance(grc, StrategyDispatcher):  # each gradient's own pipeline
        compressors = {n: grc.node(n).comm.compressor for n, _ in grads}
    else:
        compressors = dict.fromkeys((n for n, _ in grads), grc.compressor)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for name, g in grads:
            comp = compressors[name]
            payload, ctx = comp.compress(g, "bench/" + name)
            reduced = payload
            # multi-round (PowerSGD): the local-only replay uses this rank's payloads as "reduced"
            nxt = comp.next_round(reduced, ctx)
            while nxt is not None:
                reduced, ctx = nxt
                nxt = comp.next_round(reduced, ctx)
            comp.decompress(reduced, ctx)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--pipeline", default="none", choices=sorted(PIPELINES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    hvd.init()
    model, shape = build_model(args.model)
    x = torch.randn(args.batch, *shape)
    y = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()
    n_params = sum(p.numel() for p in model.parameters())

    compute_s = time_compute(model, x, y, loss_fn, repeats=5)
    grc, hvd_kwargs = make_grace(args.pipeline, model)
    compress_s = time_compress(grc, model, repeats=3)

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), grace=grc,
                                   **hvd_kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    step_times = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if step >= args.warmup:
            step_times.append(time.perf_counter() - t0)

    if grc is not None and getattr(grc, "bytes", None) is not None and grc.bytes.steps:
        measured = grc.bytes.steps[args.warmup:] or grc.bytes.steps
        sent = statistics.median(s["sent"] for s in measured)
        received = statistics.median(s["received"] for s in measured)
    else:
        # Horovod's own ring allreduce: each rank sends and receives 2(N-1)/N of the buffer.
        width = 2 if args.pipeline == "hvd-fp16" else 4
        size = hvd.size()
        sent = received = 2 * (size - 1) / size * n_params * width

    step_s = statistics.median(step_times)
    if hvd.rank() == 0:
        record = {
            "model": args.model, "pipeline": args.pipeline, "ranks": hvd.size(),
            "params": n_params, "step_s": step_s, "compute_s": compute_s,
            "compress_s": compress_s, "communicate_s": max(0.0, step_s - compute_s - compress_s),
            "sent_bytes": sent, "received_bytes": received, "steps": args.steps,
        }
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
