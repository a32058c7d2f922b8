"""grace_dl's compiled kernels against their twins in a real 2-rank job: each pipeline trained
the same few steps with the kernels on and with ``native.use(False)``. Usage:
``native_twins.py``; tests/test_native_multiproc.py checks the report.
"""

import torch
from torch import nn

import grace_dl.torch.horovod as hvd
import mp
from grace_dl import grace_from_params, native

STEPS = 3

torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()

PIPELINES = {
    "signsgd-2phase": ({"compressor": "signsgd", "memory": "residual",
                        "communicator": "twophase"}, {}),
    "signsgd-2phase-pieces": ({"compressor": "signsgd", "memory": "residual",
                               "communicator": "twophase"}, {"piece_bytes": 4096}),
    "signsgd-2phase-no-feedback": ({"compressor": "signsgd", "memory": "residual",
                                    "communicator": "twophase",
                                    "server_error_feedback": False}, {}),
    "signsgd-allgather": ({"compressor": "signsgd", "memory": "residual",
                           "communicator": "allgather"}, {}),
    "qsgd-2phase": ({"compressor": "qsgd", "quantum_num": 64, "memory": "residual",
                     "communicator": "twophase"}, {}),
    "topk": ({"compressor": "topk", "compress_ratio": 0.05, "memory": "residual",
              "communicator": "allgather"}, {}),
    "threshold": ({"compressor": "threshold", "threshold": 0.01, "memory": "residual",
                   "communicator": "allgather"}, {}),
}

calls = {"sign_vote_feedback": 0}
_fused = native.sign_vote_feedback


def counted(*args, **kwargs):
    got = _fused(*args, **kwargs)
    calls["sign_vote_feedback"] += got is not None
    return got


native.sign_vote_feedback = counted


def train(params, kernels, **kwargs):
    native.use(kernels)
    calls["sign_vote_feedback"] = 0
    torch.manual_seed(0)
    # odd sizes: every SIMD body and its scalar tail
    model = nn.Sequential(nn.Linear(37, 301), nn.Tanh(), nn.Linear(301, 5))
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   grace=grace_from_params(dict(params)), **kwargs)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        x, y = torch.randn(64, 37, generator=g), torch.randn(64, 5, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    native.use(True)
    return {"params": {k: v.detach().clone().numpy() for k, v in model.named_parameters()},
            "fused": calls["sign_vote_feedback"]}


out = {"rank": rank, "available": native.available()}
for name, (params, kwargs) in PIPELINES.items():
    out[name] = {"kernels": train(params, True, **kwargs), "twins": train(params, False, **kwargs)}
mp.report(out)
