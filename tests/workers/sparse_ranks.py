"""Sparsifiers across real Horovod ranks.

    sparse_ranks.py torch|tf-graph

Each rank compresses the same names with randomk in a rank-dependent order and reports the
positions it drew; then it averages a randomk gradient over ``allreduce`` and threshold / dgc
gradients (whose kept counts differ per rank) over ``allgather``.
"""

import sys

import numpy as np

import mp
from grace_dl import grace_from_params
from grace_dl.compressors.randomk import RandomKCompressor

mode = sys.argv[1]
if mode == "torch":
    import horovod.torch as hvd
    import torch

    def tensor(a):
        return torch.from_numpy(a)

    def wrap(fn):
        return fn
else:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    def tensor(a):
        return tf.constant(a)

    def wrap(fn):
        return tf.function(fn)

hvd.init()
rank = hvd.rank()
NAMES = ["a", "b", "c"]


def grad(name, step, n=600):
    return np.random.default_rng([rank, step, NAMES.index(name)]).standard_normal(n).astype(
        np.float32)


# randomk positions, names visited in a rank-dependent order
comp = RandomKCompressor(0.05, seed=7)
order = NAMES[rank:] + NAMES[:rank]
drawn = {}
for step in (1, 2):
    for name in order:
        drawn[(name, step)] = np.asarray(comp.compress(tensor(grad(name, step)), name)[1][2])

averaged = {}
for method, comm_name, extra in [("randomk", "allreduce", {"compress_ratio": 0.05, "seed": 7}),
                                 ("threshold", "allgather", {"threshold": 1.0 + rank}),
                                 ("dgc", "allgather", {"compress_ratio": 0.05})]:
    comm = grace_from_params({"compressor": method, "memory": "none",
                              "communicator": comm_name, **extra})
    sync = wrap(lambda x, comm=comm: comm.synchronize(x, "a"))
    averaged[method] = np.asarray(sync(tensor(grad("a", 0))))

mp.report({"rank": rank, "drawn": drawn, "averaged": averaged,
           "grads": [grad("a", 0)]})
