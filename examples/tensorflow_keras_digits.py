"""Train a Keras 3 MLP on scikit-learn's 8x8 digits with ``model.fit``, Horovod and grace_dl.

    horovodrun -np 2 -H localhost:2 python examples/tensorflow_keras_digits.py \\
        --compressor topk --memory residual --communicator allgather --compress-ratio 0.01

Every GRACE key can be given with ``--param key=value``; ``--no-grace`` averages with Horovod's
allreduce (through ``grace_dl.tensorflow.keras.DistributedOptimizer``, which really averages
under Keras 3, unlike Horovod 0.28.1's own wrapper). Each rank trains on its own shard; rank 0
shows Keras' progress bar and prints the test accuracy and the bytes this rank sent per step.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import time

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import grace_dl.tensorflow.horovod as hvd
from grace_dl import grace_from_params


def parse_args(argv=None, description=None):
    p = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    p.add_argument("--compressor", default="none")
    p.add_argument("--memory", default="none")
    p.add_argument("--communicator", default="allreduce")
    p.add_argument("--compress-ratio", type=float, default=None)
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="any other grace_from_params key (repeatable)")
    p.add_argument("--no-grace", action="store_true", help="Horovod's own averaging")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    return p


def grace_params(args) -> dict | None:
    if args.no_grace:
        return None
    params = {"compressor": args.compressor, "memory": args.memory,
              "communicator": args.communicator}
    if args.compress_ratio is not None:
        params["compress_ratio"] = args.compress_ratio
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param takes KEY=VALUE, got {item!r}")
        try:
            params[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            params[key] = value
    return params


def data(rank: int, size: int):
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return x_tr[rank::size], y_tr[rank::size], x_te, y_te


def mlp():
    # Named layers: grace state is keyed by variable paths ("digits/hidden/kernel").
    return keras.Sequential([keras.Input((64,)),
                             keras.layers.Dense(128, activation="relu", name="hidden"),
                             keras.layers.Dense(10, name="out")], name="digits")


def bytes_sent_per_step(grc, model, size: int) -> float:
    if grc is not None:
        return statistics.mean(s["sent"] for s in grc.bytes.steps) if grc.bytes.steps else 0.0
    # Horovod's ring allreduce of fp32 gradients: 2 (N-1)/N of the buffer per rank
    return 2 * (size - 1) / size * model.count_params() * 4


def finish(args, params, grc, model, accuracy, step_times, steps, rank, size):
    sent = bytes_sent_per_step(grc, model, size)
    timed = step_times[5:] or step_times
    result = {"pipeline": "horovod" if params is None else params, "ranks": size,
              "accuracy": accuracy, "bytes_sent_per_step": sent,
              "dense_bytes": model.count_params() * 4, "steps": steps,
              "step_time_ms": 1e3 * statistics.mean(timed) if timed else None}
    if rank == 0:
        print(f"accuracy {accuracy:.4f}  bytes sent/step {sent:,.0f} "
              f"(fp32 gradients: {model.count_params() * 4:,})")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f)
    return result


class StepTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._t0)


def main(argv=None):
    args = parse_args().parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(args.seed)
    x_tr, y_tr, x_te, y_te = data(rank, size)

    model = mlp()
    params = grace_params(args)
    grc = None if params is None else grace_from_params(params)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9), grace=grc)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    timer = StepTimer()
    model.fit(x_tr, y_tr, batch_size=args.batch_size, epochs=args.epochs,
              verbose=2 if rank == 0 else 0,
              callbacks=[hvd.BroadcastGlobalVariablesCallback(0), timer])
    accuracy = float(model.evaluate(x_te, y_te, verbose=0)[1])
    finish(args, params, grc, model, accuracy, timer.times, len(timer.times), rank, size)


if __name__ == "__main__":
    main()
