"""Foundation smoke test: Horovod TensorFlow allreduce/allgather/broadcast, eager and in
tf.function."""

import horovod.tensorflow as hvd
import tensorflow as tf

import mp

hvd.init()
r, n = hvd.rank(), hvd.size()
x = tf.range(6, dtype=tf.float32) + 10.0 * r


@tf.function
def graph_sum(t):
    return hvd.allreduce(t, op=hvd.Sum, name="smoke.graph_sum")


mp.report({
    "rank": r, "size": n,
    "sum": hvd.allreduce(x, op=hvd.Sum, name="smoke.sum").numpy(),
    "graph_sum": graph_sum(x).numpy(),
    "gather": hvd.allgather(tf.fill([r + 1, 2], float(r)), name="smoke.gather").numpy(),
    "bcast": hvd.broadcast(tf.constant([float(r), 7.0]), root_rank=n - 1,
                           name="smoke.bcast").numpy(),
})
