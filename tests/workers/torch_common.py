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
