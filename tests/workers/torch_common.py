"""Model and data shared by the torch optimizer workers and the single-process references in
tests/test_torch_optimizer.py: a tiny MLP and per-(rank, step) batches, both deterministic."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 6


class TinyMLP(nn.Module):
    def __init__(self, extra_branch: bool):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
        if extra_branch:
            self.extra = nn.Linear(IN, OUT)
            self.counter = nn.Parameter(torch.arange(3), requires_grad=False)

    def forward(self, x):
        return self.body(x)


def make_model(extra_branch: bool = False) -> nn.Module:
    """Same initial weights in every process. ``extra_branch`` adds a layer that only rank 1
    uses (so rank 0 has no gradient for it) and a non-float parameter."""
    torch.manual_seed(0)
    return TinyMLP(extra_branch)


def batch(rank: int, step: int, micro: int = 0):
    g = np.random.default_rng([rank, step, micro])
    x = torch.from_numpy(g.standard_normal((BATCH, IN)).astype(np.float32))
    y = torch.from_numpy(g.standard_normal((BATCH, OUT)).astype(np.float32))
    return x, y


def loss_of(model, rank: int, step: int, micro: int = 0):
    x, y = batch(rank, step, micro)
    out = model(x)
    if getattr(model, "extra", None) is not None and rank == 1:
        out = out + model.extra(x)
    return ((out - y) ** 2).mean()


def params(model) -> dict:
    return {k: v.detach().clone().numpy() for k, v in model.named_parameters()}


def grads(model) -> dict:
    return {k: v.grad.detach().clone().numpy() for k, v in model.named_parameters()
            if v.grad is not None}


def watch_local_grads(model) -> dict:
    """A dict that holds each parameter's gradient as this rank accumulated it, copied by a
    hook registered before the optimizer's (hooks run in registration order): once the
    optimizer's hook has sent it, ``p.grad`` is the exchange's (a sparse pipeline zeroes it
    while compensating), so it is not read back before ``synchronize``."""
    seen = {}
    for k, v in model.named_parameters():
        if v.requires_grad:
            v.register_post_accumulate_grad_hook(
                lambda p, k=k: seen.__setitem__(k, p.grad.detach().clone().numpy()))
    return seen
