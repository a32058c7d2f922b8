"""Bad input and faults under a 2-rank TensorFlow job (tests/test_faults.py): sign methods and
zero gradients, checkpoints restored into the wrong grace or rank, a gradient that is None on
one rank only. Usage: ``faults_tf.py CKPT_DIR``."""

import os
import sys

import numpy as np
import tensorflow as tf

import grace_dl.tensorflow.horovod as hvd
import mp
from grace_dl import grace_from_params
from grace_dl.tensorflow import checkpointable
from grace_dl.tensorflow.checkpoint import dumps

hvd.init()
rank = hvd.rank()
CKPT_DIR = sys.argv[1]
out = {"rank": rank}


def reduce(grc, loss_fn, variables):
    with tf.GradientTape() as tape:
        loss = loss_fn()
    return hvd.DistributedGradientTape(tape, grace=grc).gradient(loss, variables)


# Item 1: an embedding's rows nobody looked up and a variable with an all-zero gradient stay put.
for method, extra in (("signsgd", {}), ("signum", {"momentum": 0.9})):
    grc = grace_from_params({"compressor": method, "communicator": "allgather", **extra})
    emb = tf.Variable(tf.random.stateless_normal((10, 5), (1, 2)), name=f"{method}_emb")
    zero = tf.Variable(tf.ones((3,)), name=f"{method}_zero")
    start = [emb.numpy(), zero.numpy()]
    for step in range(3):
        def loss_fn(emb=emb, zero=zero, step=step):
            rows = tf.gather(emb, [rank, 2 + step % 2])
            return tf.reduce_sum(rows) + 0.0 * tf.reduce_sum(zero)
        grads = reduce(grc, loss_fn, [emb, zero])
        for v, g in zip([emb, zero], grads):
            v.assign_sub(0.1 * tf.convert_to_tensor(g))
    out[f"{method}_rows"] = (emb.numpy() != start[0]).any(axis=1).tolist()
    out[f"{method}_zero_moved"] = bool((zero.numpy() != start[1]).any())

# Item 3: checkpoints check configuration, rank and size.
topk = grace_from_params({"compressor": "topk", "memory": "residual",
                          "communicator": "allgather", "compress_ratio": 0.5})
w = tf.Variable(tf.range(8, dtype=tf.float32), name="ckpt_w")
reduce(topk, lambda: tf.reduce_sum(w * w), [w])
path = tf.train.Checkpoint(grace=checkpointable(topk)).save(
    os.path.join(CKPT_DIR, f"rank{rank}", "ckpt"))
hvd.allreduce(tf.constant(0.0), name="saved")   # a barrier: rank 1 reads rank 0's file next


def restore(grc, ckpt_path):
    try:
        tf.train.Checkpoint(grace=checkpointable(grc)).restore(ckpt_path)
        return "no error"
    except ValueError as err:
        return str(err)


randomk = grace_from_params({"compressor": "randomk", "memory": "residual",
                             "communicator": "allreduce", "compress_ratio": 0.5})
same = grace_from_params({"compressor": "topk", "memory": "residual",
                          "communicator": "allgather", "compress_ratio": 0.5})
out["ckpt_other_config"] = restore(randomk, path)
out["ckpt_rank0_file"] = restore(same, path.replace(f"rank{rank}", "rank0"))
out["ckpt_own"] = restore(same, path)
try:
    checkpointable(same).deserialize(dumps({"state": {}, "meta": {
        "fingerprint": np.asarray(same.fingerprint()), "rank": np.asarray(rank),
        "size": np.asarray(3)}}))
    out["ckpt_size"] = "no error"
except ValueError as err:
    out["ckpt_size"] = str(err)

# Item 6: a gradient that is None on rank 1 only, from the second step on.
grc = grace_from_params({"compressor": "topk", "memory": "residual",
                         "communicator": "allgather", "compress_ratio": 0.5})
a = tf.Variable(tf.ones((4,)), name="none_a")
b = tf.Variable(tf.ones((4,)), name="none_b")
out["none_grad"] = []
for step in range(3):
    try:
        def loss_fn(step=step):
            uses_b = rank == 0 or step == 0
            return tf.reduce_sum(a * a) + (tf.reduce_sum(b * b) if uses_b else 0.0)
        reduce(grc, loss_fn, [a, b])
        out["none_grad"].append("ok")
    except ValueError as err:
        out["none_grad"].append(str(err))
        break
mp.report(out)
