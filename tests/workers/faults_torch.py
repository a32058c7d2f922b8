"""Bad input and faults under a 2-rank torch job (tests/test_faults.py): sign methods and
parameters without a gradient, a NaN on one rank, checkpoint names that no longer exist."""

import warnings

import torch
from torch import nn

import grace_dl.torch.horovod as hvd
import mp
from grace_dl import grace_from_params

torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()
out = {"rank": rank}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 5)       # rows 0..3 looked up, 4..9 never
        self.head = nn.Linear(5, 1)
        self.unused = nn.Linear(3, 3)        # in the optimizer, never in the graph
        self.frozen = nn.Linear(5, 1)
        self.frozen.weight.requires_grad_(False)

    def forward(self, idx):
        return self.head(self.emb(idx)).sum()


def train(params, steps=3, nan_on=None):
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   grace=grace_from_params(dict(params)))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    for step in range(steps):
        opt.zero_grad()
        loss = model(torch.tensor([rank, 2 + step % 2]))
        if nan_on == rank:  # a NaN in one entry of this rank's head.weight gradient
            loss = loss + model.head.weight[0, 0] * float("nan")
        loss.backward()
        opt.step()
    moved = {k: bool((v.detach() != before[k]).any()) for k, v in model.named_parameters()}
    rows = (model.emb.weight.detach() != before["emb.weight"]).any(dim=1).tolist()
    return model, opt, moved, rows


# Items 1 and 2: parameters without a gradient stay put; a rank's NaN reaches every rank.
for method, extra in (("signsgd", {}), ("signum", {"momentum": 0.9})):
    params = {"compressor": method, "communicator": "allgather", **extra}
    _, _, moved, rows = train(params)
    out[f"{method}_moved"], out[f"{method}_rows"] = moved, rows
    model, _, _, _ = train(params, steps=1, nan_on=1)
    out[f"{method}_nan"] = bool(torch.isnan(model.head.weight).any())

# Item 4: saved grace state under names this model no longer has.
topk = {"compressor": "topk", "memory": "residual", "communicator": "allgather",
        "compress_ratio": 0.5}
model, opt, _, _ = train(topk, steps=2)
state = opt.state_dict()


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = Net()


wrapped = Wrapped()
opt2 = hvd.DistributedOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1),
                                named_parameters=wrapped.named_parameters(),
                                grace=grace_from_params(dict(topk)))
try:
    opt2.load_state_dict(state)
    out["renamed"] = "no error"
except ValueError as err:
    out["renamed"] = str(err)
plain = dict(state)
plain.pop("grace")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.load_state_dict(plain)
out["no_grace_key"] = [str(w.message) for w in caught]
out["same_names_ok"] = opt.load_state_dict(state) is None
mp.report(out)
