"""The quantizers through real Horovod collectives: ``allgather`` for each of them, and
``allreduce`` for the allreduce-safe fp16. Each rank reports what ``synchronize``
returned and the byte counters, step by step; the test replays the ranks' known inputs in one
process.

    quantizers_allgather.py torch|tf-graph
"""

import sys

import numpy as np

import mp
from grace_dl import grace_from_params

STEPS = 2
SHAPE = (40, 30)  # 1200 elements: three qsgd buckets, the last one short
CONFIGS = {
    "qsgd": {"compressor": "qsgd", "quantum_num": 7, "bucket_size": 512},
    "terngrad": {"compressor": "terngrad"},
    "natural": {"compressor": "natural"},
    "u8bit": {"compressor": "u8bit"},
    "inceptionn": {"compressor": "inceptionn", "error_bound": 1e-3},
    "sketch": {"compressor": "sketch", "quantiles": 16},
    "fp16": {"compressor": "fp16"},
    "bf16": {"compressor": "bf16"},
}
COMMUNICATORS = {name: ["allgather"] for name in CONFIGS}
COMMUNICATORS["fp16"] = ["allgather", "allreduce"]


def grad(rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng([rank, step, 7])
    return (rng.standard_normal(SHAPE) * np.exp(rng.uniform(-8, 1, SHAPE))).astype(np.float32)


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
        for comm in COMMUNICATORS[key]:
            grc = grace_from_params({**params, "memory": "none", "communicator": comm})

            def step_fn(x, grc=grc):
                return grc.synchronize(x, "w")

            if mode == "tf-graph":
                step_fn = tf.function(step_fn)
            outs, counts = [], []
            for step in range(STEPS):
                outs.append(np.asarray(step_fn(to_tensor(grad(rank, step)))))
                counts.append(grc.end_step())
            report[(key, comm)] = {"out": outs, "bytes": counts}
    mp.report(report)
