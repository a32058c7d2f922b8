"""Runs every (communicator, compressor) pair named on the command line under Horovod and
reports each rank's outputs and byte counters.

    comm_check.py torch|tf-eager|tf-graph COMM[,COMM...]

Each pair gets a fresh communicator (residual memory) and runs ``comm_common.STEPS`` steps over
``comm_common.TENSORS``: all tensors are sent before any is received, as a training step does.
In ``tf-graph`` mode the whole step is one ``tf.function``.
"""

import sys

import comm_common as cc
import numpy as np

import mp

mode, comms = sys.argv[1], sys.argv[2].split(",")
if mode == "torch":
    import horovod.torch as hvd
    import torch

    def tensor(a):
        return torch.from_numpy(a)
else:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    def tensor(a):
        return tf.constant(a)

hvd.init()
rank, size = hvd.rank(), hvd.size()
names = list(cc.TENSORS)


def run_pair(comm_name, comp_name):
    comm = cc.build(comm_name, comp_name)

    def step(xs):
        handles = [comm.send(x, n) for x, n in zip(xs, names)]
        return [comm.receive(h) for h in handles]

    if mode == "tf-graph":
        step = tf.function(step)
    outs, counts = [], []
    for s in range(cc.STEPS):
        xs = [tensor(cc.make_input(rank, s, n)) for n in names]
        res = step(xs)
        outs.append([np.asarray(r.numpy() if hasattr(r, "numpy") else r) for r in res])
        counts.append(comm.end_step())
    return {"outs": outs, "bytes": counts, "state": comm.state_dict()}


results = {pair: run_pair(*pair) for pair in cc.pairs(comms)}
mp.report({"rank": rank, "size": size, "results": results, "missing": cc.compressor_names()[1]})
