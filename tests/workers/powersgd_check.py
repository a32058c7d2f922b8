"""PowerSGD through ``grace_from_params`` and the allreduce communicator under Horovod.

    powersgd_check.py torch|tf-eager|tf-graph RANK

Runs ``STEPS`` steps over ``TENSORS`` (given in torch's layout; TF ranks get them in Keras
layout) with memory ``powersgd``, all tensors sent before any is received, and reports every
output (back in torch layout), the byte counters and the state dicts. In ``tf-graph`` mode each
step is one ``tf.function``.
"""

import sys

import numpy as np

import mp
from grace_dl import grace_from_params

STEPS = 3
# torch layout: a conv kernel (O, I, H, W), a linear weight (out, in), a bias, a matrix too
# small to compress, and a layer that is zero on every rank at step 0
TENSORS = {"conv": (8, 3, 3, 3), "fc": (12, 10), "bias": (12,), "tiny": (3, 3), "dead": (10, 8)}


def torch_to_keras(rank):
    return (*range(2, rank), 1, 0) if rank >= 2 else (0,)


def keras_to_torch(rank):
    return (rank - 1, rank - 2, *range(rank - 2)) if rank >= 2 else (0,)


def make_input(rank, step, name):
    shape = TENSORS[name]
    if name == "dead" and step == 0:
        return np.zeros(shape, np.float32)
    index = list(TENSORS).index(name)
    return np.random.default_rng([rank, step, index]).standard_normal(shape).astype(np.float32)


def main():
    mode, compress_rank = sys.argv[1], int(sys.argv[2])
    if mode == "torch":
        import horovod.torch as hvd
        import torch

        def tensor(a):
            return torch.from_numpy(a)
    else:
        import horovod.tensorflow as hvd
        import tensorflow as tf

        def tensor(a):
            return tf.constant(a.transpose(torch_to_keras(a.ndim)))

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    grc = grace_from_params({"compressor": "powersgd", "memory": "powersgd",
                             "communicator": "allreduce", "compress_rank": compress_rank})
    names = list(TENSORS)

    def step(xs):
        handles = [grc.send(x, n) for x, n in zip(xs, names)]
        return [grc.receive(h) for h in handles]

    if mode == "tf-graph":
        step = tf.function(step)
    outs, counts = [], []
    for s in range(STEPS):
        res = step([tensor(make_input(rank, s, n)) for n in names])
        res = [np.asarray(r.numpy()) for r in res]
        if mode != "torch":
            res = [r.transpose(keras_to_torch(r.ndim)) for r in res]
        outs.append(res)
        counts.append(grc.end_step())
    mp.report({"rank": rank, "size": size, "outs": outs, "bytes": counts,
               "state": grc.state_dict(), "fingerprint": grc.fingerprint()})


if __name__ == "__main__":
    main()
