"""Rank 1's last batch is smaller than rank 0's (an uneven shard): a ``tf.function`` step and
Keras's ``train_on_batch`` retrace on rank 1 alone, with a new static shape. Stock Horovod's
tape goes on; ours ran its rank-agreement check, an eager allgather, in that trace, and waited
there for rank 0, which ran the graph it had (a hang). One job: the tape (stock Horovod's, ours
with ``grace=None``, ours with grace ``none`` and with topk + residual) and Keras (``grace=None``
and topk + residual), each reporting its final weights.

    tf_uneven.py
"""

import horovod.tensorflow as stock
import keras
import numpy as np
import tensorflow as tf

import grace_dl.tensorflow.horovod as hvd
import mp
from grace_dl import grace_from_params

hvd.init()
rank = hvd.rank()
STEPS = 4
NONE = {"compressor": "none", "memory": "none", "communicator": "allreduce"}
TOPK = {"compressor": "topk", "compress_ratio": 0.5, "memory": "residual",
        "communicator": "allgather"}


def rows(step: int, full: int) -> int:
    return full * 5 // 8 if rank == 1 and step == STEPS - 1 else full


def tape_run(kind):
    grc = grace_from_params(dict(kind)) if isinstance(kind, dict) else None
    w = tf.Variable(np.random.default_rng(0).standard_normal((3, 2)).astype("float32"))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((x @ w) ** 2)
        tape = stock.DistributedGradientTape(tape) if kind == "stock" else \
            hvd.DistributedGradientTape(tape, grace=grc)
        w.assign_sub(0.1 * tape.gradient(loss, [w])[0])

    for s in range(STEPS):
        step(tf.constant(np.random.default_rng([rank, s]).standard_normal(
            (rows(s, 8), 3)).astype("float32")))
    return w.numpy()


def keras_run(pipeline):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="d")])
    grc = None if pipeline is None else grace_from_params(dict(pipeline))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), grace=grc),
                  loss="mse")
    rng = np.random.default_rng(rank)
    for s in range(STEPS):
        n = rows(s, 16)
        model.train_on_batch(rng.standard_normal((n, 4)).astype("float32"),
                             rng.standard_normal((n, 1)).astype("float32"))
    return np.asarray(model.get_layer("d").kernel)


mp.report({"tape": {"stock": tape_run("stock"), "ours": tape_run(None),
                    "none": tape_run(NONE), "topk": tape_run(TOPK)},
           "keras": {"plain": keras_run(None), "topk": keras_run(TOPK)}})
