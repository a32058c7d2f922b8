"""Digits (scikit-learn) on every rank with one pipeline: test accuracy after each epoch.

Each rank trains on its own half of the training split (same seeds for every pipeline);
rank 0 writes ``{"pipeline", "accuracy": [per epoch], "steps_per_epoch"}`` as JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn as nn
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import grace_dl.torch.horovod as hvd
from benchmarks.pipelines import PIPELINES, make_grace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", default="none", choices=sorted(PIPELINES))
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    x_tr, y_tr = x_tr[hvd.rank()::hvd.size()], y_tr[hvd.rank()::hvd.size()]
    x_tr, y_tr = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    x_te, y_te = torch.from_numpy(x_te), torch.from_numpy(y_te)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    grc, kwargs = make_grace(args.pipeline, model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                   named_parameters=model.named_parameters(), grace=grc, **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)
    steps = len(x_tr) // args.batch
    accuracy = []
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
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"pipeline": args.pipeline, "accuracy": accuracy,
                       "steps_per_epoch": steps, "epochs": args.epochs}, f)


if __name__ == "__main__":
    main()
