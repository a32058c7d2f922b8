"""Strategy dispatcher under Horovod (torch). Modes (argv[1]):

``exact``   rank 0 builds a strategy mixing topk/allgather (fused group), threshold/allgather
            (fused, unequal sizes), fp16/allreduce with spec RING, none/allreduce (fused),
            two PS nodes and twophase, and broadcasts it; every rank sends known tensors (rank 1
            in reverse order) and reports what it received and the byte counters.
``train``   a tiny torch model trained 3 steps with the DistributedOptimizer and a strategy
            mixing topk/allgather, fp16/allreduce and none.
``mismatch`` ranks load different strategies; reports the errors raised on each rank.
"""

import sys

import horovod.torch as hvd
import numpy as np
import torch

import mp
from grace_dl.strategy import broadcast_strategy, from_strategy, strategy_pb2
from grace_dl.strategy.pipeline import Pipeline

hvd.init()
torch.manual_seed(0)
MODE = sys.argv[1]
RANK, SIZE = hvd.rank(), hvd.size()

TOPK = {"compressor": "topk", "compress_ratio": 0.25, "memory": "residual",
        "communicator": "allgather"}


def node(s, name, shape, params, group=None, spec=0, ps_root=None):
    n = s.node_config.add(var_name=name)
    n.shape.extend(shape)
    if ps_root is None:
        n.AllReduceSynchronizer.group = group
        n.AllReduceSynchronizer.spec = spec
        Pipeline.from_params(params).write(n)
    else:
        n.PSSynchronizer.reduction_destination = str(ps_root)
        n.PSSynchronizer.sync = True
        Pipeline.from_params(params, ps=True).write(n)


def exact_strategy():
    s = strategy_pb2.Strategy(id="exact", version=1)
    ring = strategy_pb2.AllReduceSynchronizer.RING
    node(s, "a.weight", (16, 8), TOPK, group=0)
    node(s, "b.weight", (8, 8), TOPK, group=0)
    node(s, "c.weight", (32,), {"compressor": "fp16"}, group=1, spec=ring)
    node(s, "d.bias", (5,), {}, group=2)
    node(s, "e.bias", (7,), {}, group=2)
    node(s, "f.weight", (4, 6), {}, ps_root=1)
    node(s, "g.weight", (6, 4), {"compressor": "topk", "compress_ratio": 0.25}, ps_root=0)
    thr = {"compressor": "threshold", "threshold": 1.0, "communicator": "allgather"}
    node(s, "h.weight", (10, 3), thr, group=3)
    node(s, "i.weight", (9,), thr, group=3)
    node(s, "j.weight", (12,), {"communicator": "twophase"}, group=4)
    return s


def tensor_for(name, shape, rank):
    seed = sum(map(ord, name)) * 10 + rank
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def run_exact():
    strategy = broadcast_strategy(exact_strategy if RANK == 0 else None, framework="torch")
    grc = from_strategy(strategy)
    names = [n.var_name for n in strategy.node_config]
    shapes = {n.var_name: tuple(n.shape) for n in strategy.node_config}
    out = {"rank": RANK, "steps": [], "pipelines": {n: grc.pipeline(n).label() for n in names}}
    for step in range(2):
        order = names if RANK == 0 else names[::-1]
        handles = {n: grc.send(tensor_for(n, shapes[n], RANK) * (step + 1), n) for n in order}
        results = {n: grc.receive(handles[n]).numpy() for n in order[::-1]}
        out["steps"].append({"results": results, "bytes": grc.end_step()})
    # A fused group with a member missing this step: receive sends what the group has.
    h = grc.send(tensor_for("d.bias", shapes["d.bias"], RANK), "d.bias")
    try:
        grc.send(tensor_for("d.bias", shapes["d.bias"], RANK), "d.bias")
    except ValueError as err:
        out["twice"] = str(err)
    out["partial"] = grc.receive(h).numpy()
    try:
        grc.receive(h)
    except ValueError as err:
        out["received_twice"] = str(err)
    out["inputs"] = {n: [tensor_for(n, shapes[n], r).numpy() for r in range(SIZE)] for n in names}
    out["state_keys"] = sorted(grc.state_dict())
    mp.report(out)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.conv = torch.nn.Conv1d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, idx):
        h = self.emb(idx).transpose(1, 2)          # (B, 8, L)
        h = torch.relu(self.conv(h)).mean(dim=2)   # (B, 8)
        return self.fc(h)


def run_train():
    from grace_dl.strategy import SizeThreshold
    from grace_dl.torch.optimizer import DistributedOptimizer

    model = Tiny()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def build():
        s = SizeThreshold(100, TOPK).build(model.named_parameters())
        for n in s.node_config:       # the linear layer's weight rides fp16 over allreduce
            if n.var_name == "fc.weight":
                Pipeline.from_params({"compressor": "fp16"}).write(n)
        return s

    strategy = broadcast_strategy(build if RANK == 0 else None, framework="torch")
    grc = from_strategy(strategy, variables=model.named_parameters(), framework="torch")
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                               named_parameters=model.named_parameters(), grace=grc)
    rng = np.random.default_rng(RANK)
    idx = torch.from_numpy(rng.integers(0, 50, (16, 6)))
    target = torch.from_numpy(rng.integers(0, 4, 16))
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(idx), target)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    mp.report({"rank": RANK, "losses": losses, "bytes": grc.bytes.steps,
               "pipelines": {n: grc.pipeline(n).label() for n, _ in model.named_parameters()},
               "numel": {n: p.numel() for n, p in model.named_parameters()},
               "params": {n: p.detach().numpy().copy() for n, p in model.named_parameters()}})


def run_mismatch():
    s = strategy_pb2.Strategy(version=1)
    node(s, "w", (4, 4), TOPK if RANK == 1 else {"compressor": "fp16"}, group=0)
    node(s, "b", (4,), {}, group=1)
    errors = {}
    try:
        from_strategy(s, framework="torch")
    except ValueError as err:
        errors["from_strategy"] = str(err)
    grc = from_strategy(s)  # not checked yet: the first send checks
    try:
        grc.send(torch.ones(4, 4), "w")
    except ValueError as err:
        errors["send"] = str(err)
    from grace_dl.torch.optimizer import DistributedOptimizer

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4, 4))
    model.b = torch.nn.Parameter(torch.zeros(4))
    try:  # the optimizer's own check compares grace fingerprints at construction
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=model.named_parameters(), grace=from_strategy(s))
    except ValueError as err:
        errors["optimizer"] = str(err)
    mp.report({"rank": RANK, "errors": errors})


{"exact": run_exact, "train": run_train, "mismatch": run_mismatch}[MODE]()
