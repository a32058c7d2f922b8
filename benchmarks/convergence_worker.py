"""One pipeline on every rank, one task: test accuracy after each epoch.

Each rank trains on its own share of the training split (same seeds for every pipeline);
rank 0 writes ``{"pipeline", "accuracy": [per epoch], "steps_per_epoch", ...}`` as JSON.

Tasks:

* ``digits``: scikit-learn's 8x8 digits (1347 training images, 10 classes), an MLP 64-128-128-10.
* ``mixture``: a synthetic 100-class task generated in-process from a fixed seed: 400 Gaussian
  clusters in 64 dimensions (centres ~ N(0, I), spread ``sigma`` = 1.1), four per class, so
  classes are not linearly separable; 24000 training and 6000 test samples; an MLP
  64-256-256-100 (108k parameters). Harder than digits (10x the classes, 18x the steps per
  epoch, overlapping clusters), about a minute per pipeline here. (A teacher-student task, labels
  from a random tanh network, was tried first: the student overfit within 2-3 epochs at 30-58%
  test accuracy for every teacher size tried, which would rank pipelines by overfitting.)

The pipeline is a name from ``benchmarks.pipelines.PIPELINES`` (``--pipeline``) or a JSON
spec (``--spec``) in ``grace_dl.strategy.from_spec``'s form (a ``grace_from_params`` dict, a
``size_threshold`` strategy, or a ``schedule`` of those); ``--momentum`` is the wrapped SGD's
momentum.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn as nn

import grace_dl.torch.horovod as hvd
from benchmarks.pipelines import PIPELINES, make_grace, make_spec


def digits(rank: int, size: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    def model():
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                             nn.Linear(128, 10))
    return x_tr[rank::size], y_tr[rank::size], x_te, y_te, model


def mixture(rank: int, size: int, n_train: int = 24000, n_test: int = 6000,
            classes: int = 100, clusters: int = 4, dim: int = 64, sigma: float = 1.1):
    rng = np.random.default_rng(1234)
    centers = rng.standard_normal((classes * clusters, dim)).astype(np.float32)
    which = rng.integers(0, classes * clusters, n_train + n_test)
    x = (centers[which] + sigma * rng.standard_normal((n_train + n_test, dim))).astype(np.float32)
    y = which % classes
    x_tr, y_tr, x_te, y_te = x[:n_train], y[:n_train], x[n_train:], y[n_train:]
    def model():
        return nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, classes))
    return x_tr[rank::size], y_tr[rank::size], x_te, y_te, model


TASKS = {"digits": digits, "mixture": mixture}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", default="none", choices=sorted(PIPELINES))
    ap.add_argument("--spec", default=None, help="JSON pipeline spec (overrides --pipeline)")
    ap.add_argument("--label", default=None, help="name written to the record")
    ap.add_argument("--task", default="digits", choices=sorted(TASKS))
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and batch order")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    x_tr, y_tr, x_te, y_te, model_fn = TASKS[args.task](hvd.rank(), hvd.size())
    torch.manual_seed(args.seed)
    model = model_fn()
    x_tr, y_tr = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    x_te, y_te = torch.from_numpy(x_te), torch.from_numpy(y_te)

    steps = len(x_tr) // args.batch
    if args.spec is not None:
        grc, kwargs = make_spec(json.loads(args.spec), steps, model), {}
    else:
        grc, kwargs = make_grace(args.pipeline, model)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum),
        named_parameters=model.named_parameters(), grace=grc, **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1 + args.seed)
    accuracy, sent = [], []
    start = time.perf_counter()
    for _ in range(args.epochs):
        order = torch.randperm(len(x_tr), generator=gen)
        model.train()
        for s in range(steps):
            idx = order[s * args.batch:(s + 1) * args.batch]
            opt.zero_grad()
            loss_fn(model(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            accuracy.append(float((model(x_te).argmax(1) == y_te).float().mean()))
        if grc is not None:
            sent.append(sum(s["sent"] for s in grc.bytes.steps) / max(1, len(grc.bytes.steps)))
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"pipeline": args.label or args.pipeline, "accuracy": accuracy,
                       "steps_per_epoch": steps, "epochs": args.epochs, "task": args.task,
                       "lr": args.lr, "momentum": args.momentum, "seed": args.seed,
                       "spec": json.loads(args.spec) if args.spec else PIPELINES[args.pipeline],
                       "sent_bytes_per_step": sent,
                       # what uncompressed Horovod's ring allreduce sends per step (model)
                       "dense_bytes": 2 * (hvd.size() - 1) * sum(
                           p.numel() * p.element_size() for p in model.parameters())
                       // hvd.size(),
                       "seconds": time.perf_counter() - start}, f)


if __name__ == "__main__":
    main()
