"""Keras 3 ``model.fit`` under real Horovod (2 ranks) with our DistributedOptimizer: digits with
plain averaging and with topk 1% + residual, an Embedding model (IndexedSlices) with grace, and
the grace state riding in a tf.train.Checkpoint of the optimizer.

Every rank starts from different weights (seeded by rank): BroadcastGlobalVariablesCallback
must make them equal, and averaging must keep them equal.

    tf_keras.py EPOCHS CKPT_DIR
"""

import sys

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import grace_dl.tensorflow.horovod as hvd
import mp
from grace_dl import grace_from_params

hvd.init()
rank, size = hvd.rank(), hvd.size()
EPOCHS, CKPT_DIR = int(sys.argv[1]), sys.argv[2]
BATCH = 32
TOPK = {"compressor": "topk", "memory": "residual", "communicator": "allgather",
        "compress_ratio": 0.01}

X, Y = load_digits(return_X_y=True)
X = (X / 16.0).astype("float32")
x_train, x_test, y_train, y_test = train_test_split(X, Y, test_size=0.25, random_state=0,
                                                    stratify=Y)
x_train, y_train = x_train[rank::size], y_train[rank::size]
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def digits_model():
    keras.utils.set_random_seed(100 + rank)
    return keras.Sequential([keras.Input((64,)),
                             keras.layers.Dense(64, activation="relu", name="hidden"),
                             keras.layers.Dense(10, name="out")], name="digits")


def fit(params):
    model = digits_model()
    grc = grace_from_params(dict(params)) if params else None
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), grace=grc)
    model.compile(optimizer=opt, loss=LOSS, metrics=["accuracy"])
    hist = model.fit(x_train, y_train, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                     callbacks=[hvd.BroadcastGlobalVariablesCallback(0)])
    steps = EPOCHS * int(np.ceil(len(x_train) / BATCH))
    return model, opt, grc, {
        "test_accuracy": float(model.evaluate(x_test, y_test, verbose=0)[1]),
        "train_accuracy": hist.history["accuracy"],
        "weights": [np.asarray(v) for v in model.trainable_variables],
        "optimizer_vars": [np.asarray(v) for v in opt.variables],
        "class": f"{type(opt).__module__}.{type(opt).__name__}",
        "isinstance_sgd": isinstance(opt, keras.optimizers.SGD),
        "steps": steps,
        "bytes_steps": None if grc is None else len(grc.bytes.steps),
        "bytes_per_step": None if grc is None else grc.bytes.steps[-1]["sent"],
        "payload_nbytes": None if grc is None else sum(
            grc.compressor.payload_nbytes(int(np.prod(v.shape)))
            for v in model.trainable_variables),
    }


report = {"rank": rank}
report["plain"] = fit(None)[3]
model, opt, grc, report["topk"] = fit(TOPK)

# The optimizer tracks the grace state: a checkpoint of the optimizer carries the residuals.
path = tf.train.Checkpoint(model=model, optimizer=opt).write(f"{CKPT_DIR}/rank{rank}/ckpt")
report["checkpoint_keys"] = [k for k, _ in tf.train.list_variables(path)]
fresh_grc = grace_from_params(dict(TOPK))
fresh = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), grace=fresh_grc)
tf.train.Checkpoint(optimizer=fresh).read(path).expect_partial()
saved, restored = grc.state_dict(), fresh_grc.state_dict()
report["restored_equal"] = (
    sorted(saved["memory"]) == sorted(restored["memory"]) and
    all(np.array_equal(saved["memory"][k], restored["memory"][k]) for k in saved["memory"]))

# Embedding: IndexedSlices gradients through model.fit, with grace and without.
for label, params in (("emb_plain", None), ("emb_topk", dict(TOPK, compress_ratio=0.1))):
    keras.utils.set_random_seed(rank)
    emb = keras.Sequential([keras.Input((5,), dtype="int32"),
                            keras.layers.Embedding(40, 4, name="emb"), keras.layers.Flatten(),
                            keras.layers.Dense(1, name="head")], name="embmodel")
    grace = grace_from_params(params) if params else None
    emb.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), grace=grace),
                loss="mse")
    rng = np.random.default_rng(rank)
    emb.fit(rng.integers(0, 40, (64, 5)), rng.standard_normal((64, 1)), batch_size=16,
            epochs=2, verbose=0, callbacks=[hvd.BroadcastGlobalVariablesCallback(0)])
    report[label] = [np.asarray(v) for v in emb.trainable_variables]

mp.report(report)
