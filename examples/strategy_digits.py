"""Train an MLP on scikit-learn's 8x8 digits with a per-variable compression strategy.

    horovodrun -np 2 -H localhost:2 python examples/strategy_digits.py \\
        --bandwidth-gbps 0.1                       # Auto strategy for a slow network
    horovodrun -np 2 -H localhost:2 python examples/strategy_digits.py --strategy s.pbtxt

Rank 0 builds the strategy (``Auto`` over a one-host resource spec with the given bandwidth, or
``--resource-spec cluster.yaml``) or loads ``--strategy``, broadcasts it, and every rank trains
with ``grace=from_strategy(...)``. Rank 0 prints each variable's pipeline and the bytes it sent
per step; ``--save`` writes the strategy used.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import grace_dl.torch.horovod as hvd
from grace_dl.strategy import Auto, ResourceSpec, broadcast_strategy, from_strategy, load, save


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", help="a strategy file to use instead of building one")
    p.add_argument("--resource-spec", help="YAML resource spec for the Auto builder")
    p.add_argument("--bandwidth-gbps", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save", help="write the strategy used to this file (rank 0)")
    args = p.parse_args(argv)

    hvd.init()
    torch.manual_seed(0)
    rank, size = hvd.rank(), hvd.size()
    x, y = load_digits(return_X_y=True)
    x = torch.from_numpy((x / 16.0).astype(np.float32))[rank::size]
    y = torch.from_numpy(y)[rank::size]
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def build():
        if args.strategy:
            return load(args.strategy)
        spec = args.resource_spec or ResourceSpec.local(size, bandwidth_gbps=args.bandwidth_gbps)
        return Auto().build(model.named_parameters(), spec)

    strategy = broadcast_strategy(build if rank == 0 else None, framework="torch")
    grc = from_strategy(strategy, variables=model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), grace=grc)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(args.steps):
        idx = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
    if rank == 0:
        last = grc.bytes.steps[-1]["per_tensor"]
        for name, param in model.named_parameters():
            print(f"{name:10s} {param.numel():7d} elements  {grc.pipeline(name).label():48s} "
                  f"sent {last[name][0]:7d} B/step")
        print(f"loss {loss.item():.3f} after {args.steps} steps")
        if args.save:
            save(strategy, args.save)


if __name__ == "__main__":
    main()
