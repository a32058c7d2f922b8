"""The sign methods through the ``allgather`` communicator under real Horovod. Each rank
reports what ``synchronize`` returned and the byte counters, step by step; the test replays the
ranks' known inputs in one process and checks the vote / means / error feedback.

    signs_allgather.py torch|tf-graph
"""

import sys

import numpy as np

import mp
from grace_dl import grace_from_params

STEPS = 3
SHAPE = (5, 7)
CONFIGS = {
    "signsgd": {"compressor": "signsgd", "memory": "none"},
    "signum": {"compressor": "signum", "memory": "none", "momentum": 0.5},
    "onebit": {"compressor": "onebit", "memory": "residual"},
    "efsignsgd": {"compressor": "efsignsgd", "memory": "efsignsgd", "lr": 0.1},
}


def grad(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng([rank, step]).standard_normal(SHAPE).astype(np.float32)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "torch":
        import horovod.torch as hvd
        import torch

        to_tensor = torch.from_numpy
    else:
        import horovod.tensorflow as hvd
        import tensorflow as tf

        to_tensor = tf.constant
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    report = {"rank": rank, "size": size}
    for key, params in CONFIGS.items():
        grc = grace_from_params({**params, "communicator": "allgather"})

        def step_fn(x, grc=grc):
            return grc.synchronize(x, "w")

        if mode == "tf-graph":
            step_fn = tf.function(step_fn)
        outs, counts = [], []
        for step in range(STEPS):
            outs.append(np.asarray(step_fn(to_tensor(grad(rank, step)))))
            counts.append(grc.end_step())
        report[key] = {"out": outs, "bytes": counts}
    mp.report(report)
