"""DistributedOptimizer(early_rounds=...) on every rank: the gradient hooks complete exchanges
whose collectives have finished (``Router.advance``), so later rounds start during the
backward pass. A pause in the backward pass between layers lets each layer's collectives
finish before the next layer's hook. Usage: ``torch_early.py``; tests/test_torch_early_rounds.py
checks the report.
"""

import contextlib
import time

import torch
from torch import nn

import grace_dl.torch.horovod as hvd
import mp
from grace_dl import Schedule, grace_from_params
from grace_dl.strategy import Pipeline, from_strategy
from grace_dl.strategy.builders import assemble
from grace_dl.strategy.variables import variables_of

STEPS = 3
PAUSE_S = 0.1

torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()


class Pause(torch.autograd.Function):
    """Identity; its backward sleeps, as a long layer's backward would."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(PAUSE_S)
        return grad


class Paused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        x = Pause.apply(torch.tanh(self.a(x)))
        x = Pause.apply(torch.tanh(self.b(x)))
        return self.c(x)


PIPELINES = {
    "powersgd": ({"compressor": "powersgd", "compress_rank": 1, "memory": "powersgd",
                  "communicator": "allreduce"}, {}),
    "signsgd-2phase": ({"compressor": "signsgd", "memory": "residual",
                        "communicator": "twophase"}, {}),
    "qsgd-2phase": ({"compressor": "qsgd", "quantum_num": 64, "memory": "residual",
                     "communicator": "twophase"}, {}),
    "topk": ({"compressor": "topk", "compress_ratio": 0.1, "memory": "residual",
              "communicator": "allgather"}, {}),
    "randomk": ({"compressor": "randomk", "compress_ratio": 0.1, "memory": "residual",
                 "communicator": "allreduce"}, {}),
    "signsgd-2phase-pieces": ({"compressor": "signsgd", "memory": "residual",
                               "communicator": "twophase"}, {"piece_bytes": 256}),
    "topk-buckets": ({"compressor": "topk", "compress_ratio": 0.1, "memory": "residual",
                      "communicator": "allgather"}, {"bucket_bytes": 600}),
    "qsgd-2phase-grouped": ({"compressor": "qsgd", "quantum_num": 64, "memory": "residual",
                             "communicator": "twophase"}, {"groups": 1}),
    "strategy": (None, {}),
    # a Schedule: PowerSGD for a step, then signSGD two-phase (its running stage's advance)
    "schedule": ("schedule", {}),
    # signSGD on the device path (a GPU's code on CPU tensors), its data-dependent sizes held
    # for one read at the step's first wait, as on a GPU (``Collectives.holds_sizes``)
    "signsgd-2phase-held": ({"compressor": "signsgd", "memory": "residual",
                             "communicator": "twophase"}, {"held": True}),
    "signsgd-held": ({"compressor": "signsgd", "memory": "residual",
                      "communicator": "allgather"}, {"held": True}),
    "signsgd": ({"compressor": "signsgd", "memory": "residual",
                 "communicator": "allgather"}, {}),
}


#: reads of held sizes so far (``held_sizes``)
READS = [0]


@contextlib.contextmanager
def held_sizes():
    """The device path, with Horovod's collectives holding sizes as they do on a GPU; their
    reads of held sizes counted in ``READS``."""
    from grace_dl.torch.collectives import TorchCollectives
    from grace_dl.torch.kernels import emulate_device

    holds, read = TorchCollectives.holds_sizes, TorchCollectives.read_sizes

    def counted(self):
        READS[0] += self.holding()
        return read(self)

    TorchCollectives.holds_sizes = lambda self, lengths: True
    TorchCollectives.read_sizes = counted
    try:
        with emulate_device():
            yield
    finally:
        TorchCollectives.holds_sizes, TorchCollectives.read_sizes = holds, read


def strategy(model):
    """A strategy dispatcher: PowerSGD for the weights, signsgd two-phase for the biases, one
    node per variable."""
    variables = variables_of(model.named_parameters())
    pipelines = [Pipeline.from_params(dict(PIPELINES["powersgd" if len(v.shape) == 2 else
                                                     "signsgd-2phase"][0]))
                 for v in variables]
    return from_strategy(assemble(variables, pipelines))


def train(params, early, held=False, **kwargs):
    with held_sizes() if held else contextlib.nullcontext():
        return _train(params, early, **kwargs)


def _train(params, early, **kwargs):
    model = Paused()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if params is None:
        grace = strategy(model)
    elif params == "schedule":
        grace = Schedule({0: dict(PIPELINES["powersgd"][0]),
                          1: dict(PIPELINES["signsgd-2phase"][0])})
    else:
        grace = grace_from_params(dict(params))
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   grace=grace, early_rounds=early, **kwargs)
    g = torch.Generator().manual_seed(rank)
    per_step, reads = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        before, read = opt.phases_completed_early, READS[0]
        ((model(x) - y) ** 2).mean().backward()
        per_step.append(opt.phases_completed_early - before)
        opt.step()
        reads.append(READS[0] - read)
    return {"params": {k: v.detach().clone().numpy() for k, v in model.named_parameters()},
            "early_per_step": per_step, "reads_per_step": reads}


out = {"rank": rank}
for name, (params, kwargs) in PIPELINES.items():
    out[name] = {"early": train(params, True, **kwargs), "late": train(params, False, **kwargs)}
mp.report(out)
