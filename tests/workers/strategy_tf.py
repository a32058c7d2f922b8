"""A strategy under Horovod with TensorFlow: rank 0 builds it and broadcasts it, and a Keras MLP
trains with ``DistributedGradientTape(grace=from_strategy(...))``, two steps eagerly, then four
inside one ``tf.function``. Its pipelines: topk/allgather (hidden kernel), PS to rank 1 with
topk (mid kernel), fp16/allreduce over RING (out kernel) and none for the three biases, fused
into one allreduce."""

import keras
import numpy as np
import tensorflow as tf

import grace_dl.tensorflow.horovod as hvd
import mp
from grace_dl.strategy import broadcast_strategy, from_strategy, strategy_pb2
from grace_dl.strategy.pipeline import Pipeline

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
TOPK = {"compressor": "topk", "compress_ratio": 0.25, "memory": "residual",
        "communicator": "allgather"}

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, name="hidden"),
                          keras.layers.Dense(8, activation="tanh", name="mid"),
                          keras.layers.Dense(4, name="out")], name="mlp")
opt = keras.optimizers.SGD(0.2)


def build():
    plan = {"hidden/kernel": (TOPK, 0), "hidden/bias": ({}, 1), "mid/bias": ({}, 1),
            "out/kernel": ({"compressor": "fp16"}, 2), "out/bias": ({}, 1)}
    s = strategy_pb2.Strategy(version=1)
    for v in model.trainable_variables:
        n = s.node_config.add(var_name=v.path)
        n.shape.extend(v.shape)
        key = v.path.split("/", 1)[1]
        if key == "mid/kernel":
            n.PSSynchronizer.reduction_destination, n.PSSynchronizer.sync = "1", True
            Pipeline.from_params({"compressor": "topk", "compress_ratio": 0.25}, ps=True).write(n)
            continue
        params, group = plan[key]
        n.AllReduceSynchronizer.group = group
        if key == "out/kernel":
            n.AllReduceSynchronizer.spec = strategy_pb2.AllReduceSynchronizer.RING
        Pipeline.from_params(params).write(n)
    return s


strategy = broadcast_strategy(build if RANK == 0 else None, framework="tensorflow")
grc = from_strategy(strategy, variables=model.trainable_variables)

rng = np.random.default_rng(RANK)
x = tf.constant(rng.standard_normal((16, 12)), tf.float32)
y = tf.constant(rng.standard_normal((16, 4)), tf.float32)


def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    tape = hvd.DistributedGradientTape(tape, grace=grc)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


graph_step = tf.function(step)
losses = [float(step(x, y)) for _ in range(2)] + [float(graph_step(x, y)) for _ in range(4)]
mp.report({"rank": RANK, "losses": losses, "bytes": grc.bytes.steps,
           "pipelines": {v.path: grc.pipeline(v.path).label() for v in model.trainable_variables},
           "numel": {v.path: int(np.prod(v.shape)) for v in model.trainable_variables},
           "weights": {v.path: v.numpy() for v in model.trainable_variables},
           "traces": graph_step.experimental_get_tracing_count()})
