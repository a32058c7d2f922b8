"""One DDP benchmark run on every rank (launched by benchmarks/ddp.py through torchrun).

``--mode time``: the e2e MLP (5.8M parameters) on synthetic data, ``--warmup`` then
``--steps`` steps; rank 0 writes the median step time and the bytes this rank sent per step:
the grace communicator's counters for grace hooks; for DDP and PyTorch's hooks, what a ring
allreduce of their buffers moves, 2 (N-1)/N of them (the same model grace's allreduce counters
use): fp32 for DDP, fp16 for ``fp16_compress_hook``, and for ``powerSGD_hook`` its P and Q of
every compressed matrix plus the uncompressed tensors.
``--mode accuracy``: digits (scikit-learn), each rank its half of the training split, SGD with
momentum 0.9; rank 0 writes the test accuracy after each epoch.

Pipelines: ``ddp`` (no hook), ``torch-fp16`` (``default_hooks.fp16_compress_hook``),
``torch-powersgd`` (``PowerSGDState(rank=2, start_powerSGD_iter=2)`` + ``powerSGD_hook``), and
grace hooks ``grace-fp16``, ``grace-powersgd`` (rank 2), ``grace-topk`` (1%, residual,
allgather), ``grace-qsgd-2phase`` (64 levels, residual, twophase), ``grace-signsgd-2phase``
(1 bit, residual, twophase) through
``grace_dl.torch.ddp``, each bucket in pieces of 4 MiB (the hook's default ``piece_bytes``);
``grace-fp16-whole``, ``grace-qsgd-2phase-whole`` and ``grace-signsgd-2phase-whole`` send the
bucket whole (``piece_bytes=None``), to show what the pieces' overlap buys.

Every pipeline runs with **one DDP bucket** (``bucket_cap_mb_list=[100]``). With DDP's default
two buckets here, PyTorch's ``powerSGD_hook`` aborted on gloo ("Received data size doesn't
match expected size. Is there a distributed collective mismatch"): it starts each bucket's
second allreduce from a future callback, on another thread than the next bucket's first, so
the ranks can issue them in different orders. (grace's hook starts later rounds in bucket
order when the last bucket arrives, so it does not depend on that.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.pipelines import GRACE as PIPES
from grace_dl import grace_from_params
from grace_dl.torch import ddp as grace_ddp

RANK = PIPES["powersgd"]["compress_rank"]  # PowerSGD's rank, both implementations
GRACE = {f"grace-{k}": PIPES[k]
         for k in ("fp16", "powersgd", "topk", "qsgd-2phase", "signsgd-2phase")}
#: the same pipelines with each bucket sent whole (``piece_bytes=None``): what pieces buy
WHOLE = ("fp16", "qsgd-2phase", "signsgd-2phase")
GRACE.update({f"grace-{k}-whole": PIPES[k] for k in WHOLE})
HOOK_OPTIONS = {f"grace-{k}-whole": {"piece_bytes": None} for k in WHOLE}
PIPELINES = ["ddp", "torch-fp16", "torch-powersgd", *GRACE]


def mlp_5m() -> nn.Module:
    """benchmarks/e2e_worker.py's ``mlp`` (5.8M parameters), without its Horovod import."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def attach(model: DDP, pipeline: str):
    """Register ``pipeline``'s hook on ``model``; returns the grace state (or None)."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    if pipeline == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif pipeline == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=RANK,
                                   start_powerSGD_iter=2, min_compression_rate=2)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    elif pipeline in GRACE:
        state = grace_ddp.GraceState(grace_from_params(dict(GRACE[pipeline])),
                                     **HOOK_OPTIONS.get(pipeline, {}))
        model.register_comm_hook(state, grace_ddp.comm_hook)
        return state
    return None


def modelled_bytes(pipeline: str, model: nn.Module, size: int) -> float:
    """Bytes a rank sends per step in a ring allreduce of what PyTorch's paths reduce."""
    ring = 2 * (size - 1) / size
    params = [p for p in model.parameters() if p.requires_grad]
    if pipeline == "ddp":
        return ring * sum(p.numel() for p in params) * 4
    if pipeline == "torch-fp16":
        return ring * sum(p.numel() for p in params) * 2
    total = 0
    for p in params:  # powerSGD_hook: P and Q of compressible matrices, the rest as is
        n = p.shape[0]
        m = p.numel() // n
        r = min(RANK, n, m)
        if p.dim() > 1 and (n + m) * r * 2 < n * m:
            total += (n + m) * r
        else:
            total += p.numel()
    return ring * total * 4


def run_time(args) -> dict:
    torch.manual_seed(0)
    model = DDP(mlp_5m(), bucket_cap_mb_list=[100])  # one bucket: see the module docstring
    state = attach(model, args.pipeline)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(args.batch, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch,))
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()  # every step starts together: the time is the step's, not the skew's
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    if state is not None:
        sent = statistics.median(s["sent"] for s in state.grace.bytes.steps[args.warmup:])
    else:
        sent = modelled_bytes(args.pipeline, model.module, dist.get_world_size())
    return {"step_s": statistics.median(times), "step_times": times, "sent_bytes": sent,
            "params": sum(p.numel() for p in model.parameters()),
            "bytes_source": "grace counters" if state is not None else "ring model"}


def run_accuracy(args) -> dict:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    r, n = dist.get_rank(), dist.get_world_size()
    x_tr, y_tr = torch.from_numpy(x_tr[r::n]), torch.from_numpy(y_tr[r::n])
    x_te, y_te = torch.from_numpy(x_te), torch.from_numpy(y_te)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                              nn.Linear(128, 10)))
    attach(model, args.pipeline)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)
    steps = len(x_tr) // args.batch
    accuracy = []
    for _ in range(args.epochs):
        order = torch.randperm(len(x_tr), generator=gen)
        for s in range(steps):
            idx = order[s * args.batch:(s + 1) * args.batch]
            opt.zero_grad()
            loss_fn(model(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
        with torch.no_grad():
            accuracy.append(float((model(x_te).argmax(1) == y_te).float().mean()))
    return {"accuracy": accuracy, "epochs": args.epochs, "lr": args.lr}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", required=True, choices=PIPELINES)
    ap.add_argument("--mode", choices=["time", "accuracy"], default="time")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    record = run_time(args) if args.mode == "time" else run_accuracy(args)
    record.update({"pipeline": args.pipeline, "ranks": dist.get_world_size(),
                   "horovod_imported": "horovod" in sys.modules})
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
