"""Keras 3 ``model.fit`` under the ``mixed_float16`` policy on 2 Horovod ranks, where one rank's
gradients overflow float16 in some steps and the other's do not: Keras's
``LossScaleOptimizer`` skips a step whose gradients are not finite, and only the averaged
gradients can tell every rank the same thing.

    tf_keras_mixed.py

Cases, in one job: ``wrapped`` (our optimizer given to ``compile``, which wraps it in a
``LossScaleOptimizer``: refused on every rank at the first step, naming the fix), then ``plain``
and ``topk`` (``DistributedOptimizer(LossScaleOptimizer(SGD))``, Horovod's average and topk
5% + residual through grace), each over 10 batches of which rank 1's fourth and seventh
overflow: every rank skips those two steps.
"""

import keras
import numpy as np
from sklearn.datasets import load_digits

import grace_dl.tensorflow.horovod as hvd
import mp
from grace_dl import grace_from_params

hvd.init()
rank, size = hvd.rank(), hvd.size()
PIPELINES = {"plain": None, "topk": {"compressor": "topk", "memory": "residual",
                                     "communicator": "allgather", "compress_ratio": 0.05}}
BATCH, STEPS, BAD = 32, 10, (3, 6)

keras.mixed_precision.set_global_policy("mixed_float16")
x, y = load_digits(return_X_y=True)
x = (x[rank::size][:BATCH * STEPS] / 16.0).astype("float32")
y = y[rank::size][:BATCH * STEPS]
if rank == 1:       # inputs of 1e4 make float16 gradients of the scaled loss overflow
    for step in BAD:
        x[step * BATCH:(step + 1) * BATCH] *= 1e4


def model():
    keras.utils.set_random_seed(100)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10, dtype="float32")], name="digits")


report = {"rank": rank}
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
net = model()
net.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss=loss)
try:
    net.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    report["wrapped"] = None
except ValueError as err:
    report["wrapped"] = str(err)
for case, params in PIPELINES.items():
    net = model()
    grc = grace_from_params(dict(params)) if params else None
    opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.05)), grace=grc)
    net.compile(optimizer=opt, loss=loss)
    net.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    report[case] = {
        "weights": [np.asarray(v) for v in net.trainable_variables],
        "iterations": int(opt.iterations.numpy()), "scale": float(opt.dynamic_scale.numpy()),
        "compiled_with": type(net.optimizer).__name__,
        "inner": type(opt.inner_optimizer).__name__,
        "sent_steps": None if grc is None else len(grc.bytes.steps)}
mp.report(report, rank=rank)
