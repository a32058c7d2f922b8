"""A ``Schedule`` whose stages are one pipeline trains as that pipeline does, under the torch
``DistributedOptimizer`` on real Horovod ranks: ``schedule_same.py CASE`` trains STEPS steps
with the plain communicator and with ``Schedule({0: P, SWITCH: P})`` and reports both runs'
parameters after every step, bytes per step and piece layouts (what a switch hands over: the
memory's residuals and two-phase's server residuals; what the glue lays out: pieces,
buckets)."""

import sys

import torch
import torch_common as C

import grace_dl.torch.horovod as hvd
import mp
from grace_dl import Schedule, grace_from_params

STEPS, SWITCH = 5, 2
ONEBIT = {"compressor": "onebit", "memory": "residual", "communicator": "allgather"}
TWOPHASE = {**ONEBIT, "communicator": "twophase"}
TOPK = {"compressor": "topk", "compress_ratio": 0.25, "memory": "residual",
        "communicator": "allgather"}
CASES = {"twophase": (TWOPHASE, {}), "twophase-early": (TWOPHASE, {"early_rounds": True}),
         "pieces": (ONEBIT, {"piece_bytes": 64}),
         "twophase-pieces": (TWOPHASE, {"piece_bytes": 64}),
         "buckets": (TOPK, {"bucket_bytes": 300})}

torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()


def train(grc, options) -> dict:
    model = C.make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), grace=grc,
                                   **options)
    params = []
    for step in range(STEPS):
        opt.zero_grad()
        C.loss_of(model, rank, step).backward()
        opt.step()
        params.append(C.params(model))
    return {"params": params, "sent": [s["sent"] for s in grc.bytes.steps],
            "pieces": opt.state_dict()["grace"]["pieces"],
            "buckets": opt.state_dict()["grace"]["buckets"]}


pipeline, options = CASES[sys.argv[1]]
mp.report({"plain": train(grace_from_params(dict(pipeline)), options),
           "schedule": train(Schedule({0: dict(pipeline), SWITCH: dict(pipeline)}), options)})
