"""Runs every (communicator, compressor) pair under Horovod, in each mode asked for, and reports
each rank's outputs, byte counters and state.

    comm_check.py MODE[,MODE...] COMM[,COMM...] [TF_COMPRESSORS]
        MODE: torch | tf-eager | tf-graph; TF_COMPRESSORS (comma list of COMP or COMM/COMP)
        limits the TF modes to those pairs (TF traces are slow on a small machine)

torch and TensorFlow share the job (each framework's Horovod is initialised), so one launch
checks both. Each pair gets a fresh communicator (residual memory) and runs
``comm_common.STEPS`` steps over ``comm_common.TENSORS``: all tensors are sent before any is
received, as in a training step. In ``tf-graph`` mode the whole step is one ``tf.function``.
"""

import faulthandler
import os
import sys
import time

import comm_common as cc
import numpy as np

import mp
from counting import counting_hook

if os.environ.get("GRACE_HANG_DUMP_S"):  # debugging aid: stacks of a hung rank
    faulthandler.dump_traceback_later(int(os.environ["GRACE_HANG_DUMP_S"]), exit=True)
modes, comms = sys.argv[1].split(","), sys.argv[2].split(",")
tf_only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None
frameworks = {}
if "torch" in modes:
    import horovod.torch as hvd_torch
    import torch

    hvd_torch.init()
    frameworks["torch"] = (hvd_torch, torch.from_numpy)
if any(m.startswith("tf") for m in modes):
    import horovod.tensorflow as hvd_tf
    import tensorflow as tf

    hvd_tf.init()
    frameworks["tf"] = (hvd_tf, tf.constant)

hvd = next(iter(frameworks.values()))[0]
rank, size = hvd.rank(), hvd.size()
names = list(cc.TENSORS)


def run_pair(mode, comm_name, comp_name):
    tensor = frameworks["torch" if mode == "torch" else "tf"][1]
    comm = cc.build(comm_name, comp_name)
    calls = []   # the collectives' names, counted in eager torch only
    if mode == "torch":
        comm.collectives = counting_hook(comm, calls)

    def step(xs):
        handles = [comm.send(x, n) for x, n in zip(xs, names)]
        return [comm.receive(h) for h in handles]

    if mode == "tf-graph":
        step = tf.function(step)
    outs, counts, per_step = [], [], []
    for s in range(cc.STEPS):
        xs = [tensor(cc.make_input(rank, s, n)) for n in names]
        res = step(xs)
        outs.append([np.asarray(r.numpy()) for r in res])
        counts.append(comm.end_step())
        per_step.append(list(calls))
        calls.clear()
    return {"outs": outs, "bytes": counts, "state": comm.state_dict(), "calls": per_step}


start = time.perf_counter()
results, seconds = {}, {}
for mode in modes:
    for pair in cc.pairs(comms):
        if mode != "torch" and tf_only is not None and not {pair[1], "/".join(pair)} & tf_only:
            continue
        t = time.perf_counter()
        print(f"rank {rank}: {mode} {pair[0]} {pair[1]}", flush=True)
        results[(mode, *pair)] = run_pair(mode, *pair)
        seconds[(mode, *pair)] = time.perf_counter() - t
mp.report({"rank": rank, "size": size, "results": results, "seconds": seconds,
           "total_seconds": time.perf_counter() - start, "missing": cc.compressor_names()[1]})
