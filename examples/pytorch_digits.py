"""Train an MLP on scikit-learn's 8x8 digits with Horovod and grace_dl gradient compression.

    horovodrun -np 2 -H localhost:2 python examples/pytorch_digits.py \\
        --compressor topk --memory residual --communicator allgather --compress-ratio 0.01

Every GRACE key can be given with ``--param key=value`` (e.g. ``--param quantum_num=64``);
``--no-grace`` runs plain Horovod. The data ships with scikit-learn (no download); each rank
trains on its own shard. At the end rank 0 prints the test accuracy, the bytes this rank sent
per step (from the communicator's counters) and the mean step time, and with ``--json-out``
writes them to a file (examples/demo.sh builds its table from those).
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import grace_dl.torch.horovod as hvd
from grace_dl import grace_from_params


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressor", default="none")
    p.add_argument("--memory", default="none")
    p.add_argument("--communicator", default="allreduce")
    p.add_argument("--compress-ratio", type=float, default=None)
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="any other grace_from_params key (repeatable)")
    p.add_argument("--no-grace", action="store_true", help="plain horovod.torch optimizer")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def grace_params(args) -> dict:
    params = {"compressor": args.compressor, "memory": args.memory,
              "communicator": args.communicator}
    if args.compress_ratio is not None:
        params["compress_ratio"] = args.compress_ratio
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param takes KEY=VALUE, got {item!r}")
        try:
            params[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            params[key] = value
    return params


def data(rank: int, size: int):
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    x_tr, y_tr = x_tr[rank::size], y_tr[rank::size]
    return [torch.from_numpy(a) for a in (x_tr, y_tr, x_te, y_te)]


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rank, size = hvd.rank(), hvd.size()
    x_tr, y_tr, x_te, y_te = data(rank, size)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    params = None if args.no_grace else grace_params(args)
    grc = None if params is None else grace_from_params(params)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                   named_parameters=model.named_parameters(), grace=grc)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(args.seed + 1)
    steps = len(x_tr) // args.batch_size
    step_times = []
    # A bar only on rank 0 and only on a terminal: under horovodrun stderr is a pipe whose every
    # refresh comes back as a line of its own, prefixed with the rank.
    bar = tqdm(total=args.epochs * steps, desc=params and params["compressor"],
               disable=rank != 0 or not sys.stderr.isatty())
    for _ in range(args.epochs):
        order = torch.randperm(len(x_tr), generator=gen)
        for s in range(steps):
            idx = order[s * args.batch_size:(s + 1) * args.batch_size]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
            step_times.append(time.perf_counter() - t0)
            if not bar.disable:
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            bar.update()
    bar.close()

    with torch.no_grad():
        accuracy = float((model(x_te).argmax(1) == y_te).float().mean())
    n_params = sum(p.numel() for p in model.parameters())
    if grc is not None:
        sent = statistics.mean(s["sent"] for s in grc.bytes.steps)
    else:  # Horovod's ring allreduce of fp32 gradients: 2 (N-1)/N of the buffer per rank
        sent = 2 * (size - 1) / size * n_params * 4
    timed = step_times[5:] or step_times  # the first steps warm up
    result = {"pipeline": "horovod" if params is None else params, "ranks": size,
              "accuracy": accuracy, "bytes_sent_per_step": sent, "dense_bytes": n_params * 4,
              "step_time_ms": 1e3 * statistics.mean(timed), "steps": len(step_times)}
    if rank == 0:
        print(f"accuracy {accuracy:.4f}  bytes sent/step {sent:,.0f} "
              f"(fp32 gradients: {n_params * 4:,})  step {result['step_time_ms']:.2f} ms")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f)


if __name__ == "__main__":
    main()
