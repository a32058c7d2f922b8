"""Train an MLP on scikit-learn's 8x8 digits with a custom ``tf.function`` training step,
``DistributedGradientTape(tape, grace=grc)`` and checkpoints that carry the grace state.

    horovodrun -np 2 -H localhost:2 python examples/tensorflow_tape_digits.py \\
        --compressor topk --memory residual --communicator allgather --compress-ratio 0.01 \\
        --ckpt-dir /tmp/digits_ckpt

Same flags as ``tensorflow_keras_digits.py``, plus ``--ckpt-dir``: each rank saves the model,
the optimizer and the grace state (residuals differ per rank) under ``CKPT_DIR/rank<r>`` after
every epoch, and a later run with the same directory resumes from the last save, before its
first step. Rank 0 shows a progress bar and prints the test accuracy and bytes sent per step.
"""

from __future__ import annotations

import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf
from tensorflow_keras_digits import data, finish, grace_params, mlp, parse_args
from tqdm import tqdm

import grace_dl.tensorflow.horovod as hvd
from grace_dl import grace_from_params


def main(argv=None):
    parser = parse_args(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt-dir", default=None, help="save/resume here (one dir per rank)")
    args = parser.parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(args.seed)
    x_tr, y_tr, x_te, y_te = data(rank, size)

    model = mlp()
    opt = keras.optimizers.SGD(args.lr, momentum=0.9)
    opt.build(model.trainable_variables)
    params = grace_params(args)
    grc = None if params is None else grace_from_params(params)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
    manager = None
    if args.ckpt_dir:
        objects = {"model": model, "optimizer": opt, "epoch": epoch}
        if grc is not None:
            objects["grace"] = hvd.checkpointable(grc)
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(**objects),
                                             os.path.join(args.ckpt_dir, f"rank{rank}"), 2)
        if manager.latest_checkpoint:
            manager.checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
            if rank == 0:
                print(f"resumed from {manager.latest_checkpoint} (epoch {int(epoch.numpy())})")
    if not (manager and manager.latest_checkpoint):
        hvd.broadcast_variables([v.value for v in model.variables + opt.variables], root_rank=0)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, grace=grc)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    steps = len(x_tr) // args.batch_size
    rng = np.random.default_rng([args.seed, rank])
    step_times = []
    first = int(epoch.numpy())
    # A bar only on rank 0 and only on a terminal: under horovodrun stderr is a pipe whose every
    # refresh comes back as a line of its own, prefixed with the rank.
    bar = tqdm(total=(args.epochs - first) * steps, disable=rank != 0 or not sys.stderr.isatty(),
               desc=params["compressor"] if params else "horovod")
    for _ in range(first, args.epochs):
        order = rng.permutation(len(x_tr))
        for s in range(steps):
            idx = order[s * args.batch_size:(s + 1) * args.batch_size]
            t0 = time.perf_counter()
            loss = train_step(x_tr[idx], y_tr[idx])
            step_times.append(time.perf_counter() - t0)
            if not bar.disable:
                bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
            bar.update()
        epoch.assign_add(1)
        if manager:
            manager.save()
    bar.close()

    logits = model(x_te, training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_te))
    finish(args, params, grc, model, accuracy, step_times, len(step_times), rank, size)


if __name__ == "__main__":
    main()
