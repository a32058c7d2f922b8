"""A ``grace_dl.Schedule`` under the TF ``DistributedGradientTape`` (eager) on real Horovod
ranks: the stage switches at the step on every rank, bytes drop there, the variables stay equal
across ranks, a ``tf.train.Checkpoint`` mid-schedule resumes in the right stage; inside
``tf.function`` the Schedule refuses with a clear error."""

import keras
import numpy as np
import tensorflow as tf

import grace_dl.tensorflow.horovod as hvd
import mp
from grace_dl import Schedule
from grace_dl.tensorflow import checkpointable

hvd.init()
rank = hvd.rank()
STAGES = {0: {"compressor": "none", "communicator": "allreduce"},
          2: {"compressor": "topk", "compress_ratio": 0.1, "memory": "residual",
              "communicator": "allgather"}}


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, name="hidden"),
                              keras.layers.Dense(4, name="out")], name="mlp")
    return model, keras.optimizers.SGD(0.1), Schedule({k: dict(v) for k, v in STAGES.items()})


def train(model, opt, grc, start, stop):
    for step in range(start, stop):
        rng = np.random.default_rng(1000 * rank + step)
        x = tf.constant(rng.standard_normal((8, 20)), tf.float32)
        y = tf.constant(rng.standard_normal((8, 4)), tf.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = hvd.DistributedGradientTape(tape, grace=grc)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))


out = {}
model, opt, grc = build()
train(model, opt, grc, 0, 5)
out["sent"] = [s["sent"] for s in grc.bytes.steps]
out["stage"] = [s["stage"] for s in grc.bytes.steps]
out["weights"] = [np.asarray(v) for v in model.trainable_variables]

model, opt, grc = build()
train(model, opt, grc, 0, 3)
ckpt = tf.train.Checkpoint(model=model, optimizer=opt, grace=checkpointable(grc))
path = ckpt.write(f"/tmp/grace_schedule_tf_{rank}_{np.random.randint(1 << 30)}/ckpt")
model2, opt2, grc2 = build()
opt2.build(model2.trainable_variables)
tf.train.Checkpoint(model=model2, optimizer=opt2, grace=checkpointable(grc2)).read(path)
out["resumed_at"] = (grc2.step, grc2.stage_start)
train(model2, opt2, grc2, 3, 5)
out["resumed"] = [np.asarray(v) for v in model2.trainable_variables]


@tf.function
def traced(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(x * x)
    return hvd.DistributedGradientTape(tape, grace=Schedule(dict(STAGES))).gradient(loss, [x])


try:
    traced(tf.ones([3]))
    out["in_function"] = "no error"
except ValueError as err:
    out["in_function"] = str(err)
mp.report(out)
