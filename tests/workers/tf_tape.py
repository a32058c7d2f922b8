"""DistributedGradientTape under real Horovod (2 ranks): grace=None vs Horovod's tape,
none/allreduce vs Horovod averaging, topk+residual+allgather in tf.function (one trace, 20
steps, per-step local and reduced gradients kept for the torch comparison), IndexedSlices from
an Embedding, checkpoint save/continue, and the rank-agreement errors.

    tf_tape.py main CKPT_DIR     everything above; writes a checkpoint before step SAVE_AT
    tf_tape.py resume CKPT_DIR   fresh process: restore it before the first step, continue
"""

import sys
import warnings

import keras
import numpy as np
import tensorflow as tf

import grace_dl.tensorflow.horovod as hvd
import mp
from counting import counting_hook
from grace_dl import grace_from_params
from grace_dl.tensorflow import checkpointable

hvd.init()
rank, size = hvd.rank(), hvd.size()
MODE, CKPT_DIR = sys.argv[1], sys.argv[2]
TOPK = {"compressor": "topk", "memory": "residual", "communicator": "allgather",
        "compress_ratio": 0.05}
STEPS, SAVE_AT = 20, 12


def mlp(seed):
    keras.utils.set_random_seed(seed)
    # Named layers: grace state is keyed by variable paths, which must not depend on how many
    # layers the process built before (Keras numbers unnamed ones globally).
    return keras.Sequential([keras.Input((20,)),
                             keras.layers.Dense(16, activation="tanh", name="hidden"),
                             keras.layers.Dense(4, name="out")], name="mlp")


def batch(step):
    rng = np.random.default_rng(1000 * rank + step)
    return (tf.constant(rng.standard_normal((8, 20)), tf.float32),
            tf.constant(rng.standard_normal((8, 4)), tf.float32))


def loss_fn(model, x, y):
    return tf.reduce_mean((model(x) - y) ** 2)


def numpy(xs):
    return [None if x is None else np.asarray(tf.convert_to_tensor(x)) for x in xs]


def train_topk(model, opt, grc, steps, first_step, ckpt=None):
    """SGD steps ``first_step..`` through one tf.function (a checkpoint is written before step
    ``SAVE_AT`` when ``ckpt`` is given); returns per-step local and reduced gradients, the
    variables after each step, and how many times the step was traced."""
    traces = []

    @tf.function
    def step(x, y):
        traces.append(1)
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn(model, x, y)
        local = tape.gradient(loss, model.trainable_variables)
        dtape = hvd.DistributedGradientTape(tape, grace=grc)
        reduced = dtape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(reduced, model.trainable_variables))
        return local, reduced

    out = {"local": [], "reduced": [], "weights": []}
    for s in range(first_step, first_step + steps):
        if ckpt is not None and s == SAVE_AT:
            ckpt.write(f"{CKPT_DIR}/rank{rank}/ckpt")
        local, reduced = step(*batch(s))
        out["local"].append(numpy(local))
        out["reduced"].append(numpy(reduced))
        out["weights"].append(numpy(model.trainable_variables))
    out["traces"] = len(traces)
    out["tracing_count"] = step.experimental_get_tracing_count()
    return out


def make_topk():
    model = mlp(7)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(model.trainable_variables)  # so the step creates no Keras variables
    grc = grace_from_params(dict(TOPK))
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, grace=checkpointable(grc))
    return model, opt, grc, ckpt


def main():
    report = {"rank": rank, "size": size}

    # 1. grace=None: Horovod's reduction. Horovod's own tape needs tf.Variables (it calls
    # .ref(), which Keras 3 variables lack), so compare on those; ours also takes Keras ones.
    import horovod.tensorflow as stock
    model = mlp(1)
    x, y = batch(0)
    plain = [tf.Variable(tf.convert_to_tensor(v), name=f"plain{i}")
             for i, v in enumerate(model.trainable_variables)]

    def plain_loss():
        h = tf.tanh(x @ plain[0] + plain[1])
        return tf.reduce_mean((h @ plain[2] + plain[3] - y) ** 2)

    grads = {}
    for label, make in (("ours", hvd.DistributedGradientTape),
                        ("stock", stock.DistributedGradientTape)):
        with tf.GradientTape() as tape:
            loss = plain_loss()
        grads[label] = numpy(make(tape).gradient(loss, plain))
    report["none_ours"], report["none_stock"] = grads["ours"], grads["stock"]
    with tf.GradientTape(persistent=True) as tape:
        loss = loss_fn(model, x, y)
    local = tape.gradient(loss, model.trainable_variables)
    report["none_keras"] = numpy(hvd.DistributedGradientTape(tape).gradient(
        loss, model.trainable_variables))
    report["none_keras_ref"] = numpy([hvd.allreduce(g, op=hvd.Average, name=f"kref.{i}")
                                      for i, g in enumerate(local)])

    # 2. none/allreduce through grace vs hvd.allreduce(Average), eager and in tf.function.
    grc = grace_from_params({"compressor": "none", "memory": "none",
                             "communicator": "allreduce"})

    def both(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn(model, x, y)
        local = tape.gradient(loss, model.trainable_variables)
        grace = hvd.DistributedGradientTape(tape, grace=grc).gradient(
            loss, model.trainable_variables)
        avg = [hvd.allreduce(g, op=hvd.Average, name=f"ref.{i}") for i, g in enumerate(local)]
        return grace, avg

    report["allreduce_eager"] = [numpy(r) for r in both(x, y)]

    # PartialDistributedGradientTape: the output layer stays local (divided by size).
    with tf.GradientTape(persistent=True) as tape:
        loss = loss_fn(model, x, y)
    report["partial_local"] = numpy(tape.gradient(loss, model.trainable_variables))
    report["partial"] = numpy(hvd.PartialDistributedGradientTape(
        tape, local_layers=[model.layers[-1]], grace=grc).gradient(
            loss, model.trainable_variables))
    report["allreduce_graph"] = [numpy(r) for r in tf.function(both)(*batch(1))]

    # 3. topk + residual + allgather: 20 steps of one tf.function, checkpoint before step 12.
    model, opt, grc, ckpt = make_topk()
    report["topk"] = train_topk(model, opt, grc, STEPS, 0, ckpt)
    report["bytes_steps"] = [s["sent"] for s in grc.bytes.steps]
    report["payload_nbytes"] = sum(grc.compressor.payload_nbytes(int(np.prod(v.shape)))
                                   for v in model.trainable_variables)
    report["names"] = sorted(grc.memory.state.variables())
    report["var_names"] = [v.path for v in model.trainable_variables]
    report["params"] = dict(TOPK)

    # 4. groups=2: the grace object's fusion groups; fewer collectives, the same gradients.
    report["groups"] = {str(g): grouped(g) for g in (None, 2)}

    # 4b. bucket_bytes=300: the step's gradients in 3 buckets (reverse order: the output
    # layer's two share one), eager and in tf.function.
    report["buckets"] = {label: bucketed(params, graph) for label, params, graph in
                         (("none", NONE, False), ("topk", TOPK, False),
                          ("topk_graph", TOPK, True))}
    report["buckets"]["topk_strategy"] = bucketed(TOPK, False, strategy=True)

    # 5. Embedding (IndexedSlices gradients), eager and tf.function, topk and none.
    keras.utils.set_random_seed(3)
    emb = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(50, 4),
                            keras.layers.Flatten(), keras.layers.Dense(1)], name="emb")
    ids = tf.constant(np.random.default_rng(rank).integers(0, 50, (6, 5)), tf.int32)
    grc_e = grace_from_params(dict(TOPK, compress_ratio=0.1))
    grc_n = grace_from_params({"compressor": "none", "memory": "none",
                               "communicator": "allreduce"})

    def emb_grads(grace):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(emb(ids) ** 2)
        local = tape.gradient(loss, emb.trainable_variables)
        reduced = hvd.DistributedGradientTape(tape, grace=grace).gradient(
            loss, emb.trainable_variables)
        return local, reduced

    local, reduced = emb_grads(grc_n)
    report["emb_local_type"] = type(local[0]).__name__
    report["emb_none"] = numpy(reduced)
    report["emb_ref"] = numpy([hvd.allreduce(tf.convert_to_tensor(g), op=hvd.Average,
                                             name=f"embref.{i}") for i, g in enumerate(local)])
    report["emb_topk_eager"] = numpy(emb_grads(grc_e)[1])
    report["emb_topk_graph"] = numpy(tf.function(lambda: emb_grads(grc_e)[1])())

    # 6. ranks that disagree get a ValueError each, not a hang.
    errors = []
    bad = grace_from_params(dict(TOPK, compress_ratio=0.05 * (rank + 1)))
    with tf.GradientTape() as tape:
        loss = loss_fn(model, x, y)
    try:
        hvd.DistributedGradientTape(tape, grace=bad).gradient(loss, model.trainable_variables)
    except ValueError as err:
        errors.append(str(err))
    extra = tf.Variable(tf.ones([3 + rank]), name="extra")
    with tf.GradientTape() as tape:
        loss = loss_fn(model, x, y) + tf.reduce_sum(extra)
    try:
        hvd.DistributedGradientTape(tape, grace=grace_from_params(dict(TOPK))).gradient(
            loss, model.trainable_variables + [extra])
    except ValueError as err:
        errors.append(str(err))
    report["errors"] = errors
    return report


def grouped(groups):
    """Three eager steps of topk through a tape with ``groups``, collectives counted."""
    model = mlp(5)
    grc = grace_from_params(dict(TOPK))
    calls = []
    grc.collectives = counting_hook(grc, calls)
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            with tf.GradientTape() as tape:
                loss = loss_fn(model, *batch(step))
            out.append(numpy(hvd.DistributedGradientTape(tape, grace=grc, groups=groups)
                             .gradient(loss, model.trainable_variables)))
    return {"grads": out, "calls_per_step": len(calls) / 3, "names": sorted(set(calls)),
            "sent": [s["sent"] for s in grc.bytes.steps],
            "warnings": [str(w.message) for w in caught if w.category is UserWarning]}


NONE = {"compressor": "none", "memory": "none", "communicator": "allreduce"}


def bucketed(params, graph, strategy=False):
    """Three steps' local and reduced gradients of a tape with ``bucket_bytes=300`` (no
    update: the model stays put), collectives counted; ``strategy``: the same buckets named
    by a strategy (``AllReduceSynchronizer.bucket``) instead."""
    from grace_dl.strategy import Pipeline, from_strategy
    from grace_dl.strategy.builders import assemble
    from grace_dl.strategy.variables import bucket_layout, variables_of

    model = mlp(5)
    calls, size = [], 300
    if strategy:
        variables = variables_of(model.trainable_variables)
        grc = from_strategy(assemble(variables, [Pipeline.from_params(dict(params))] * 4,
                                     buckets=bucket_layout(variables, size)))
        size = None
    else:
        grc = grace_from_params(dict(params))
        grc.collectives = counting_hook(grc, calls)

    def step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn(model, x, y)
        local = tape.gradient(loss, model.trainable_variables)
        reduced = hvd.DistributedGradientTape(tape, grace=grc, bucket_bytes=size).gradient(
            loss, model.trainable_variables)
        return local, reduced

    if graph:
        step = tf.function(step)
    out = {"local": [], "reduced": []}
    for s in range(3):
        local, reduced = step(*batch(s))
        out["local"].append(numpy(local))
        out["reduced"].append(numpy(reduced))
    memory = grc.state_dict()
    memory = memory["memory"] if not strategy else next(iter(memory.values()))["memory"]
    out.update(calls_per_step=len(calls) / 3, keys=sorted(memory), buckets=grc.buckets
               if strategy else None,
               sent=[s["sent"] for s in grc.bytes.steps])
    return out


def resume():
    model, opt, grc, ckpt = make_topk()
    status = ckpt.read(f"{CKPT_DIR}/rank{rank}/ckpt")
    status.assert_existing_objects_matched()
    pending = sorted(grc.memory.state.keys())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train_topk(model, opt, grc, STEPS - SAVE_AT, SAVE_AT)
    report = {"rank": rank, "pending_before_first_step": pending,
              "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
              **out}

    # The same checkpoint restored into a model whose layers are named differently: the
    # grace state cannot be matched to the new names, and the first step says so.
    keras.utils.set_random_seed(7)
    renamed = keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, name="h2"),
                                keras.layers.Dense(4, name="o2")], name="other")
    grc2 = grace_from_params(dict(TOPK))
    tf.train.Checkpoint(grace=checkpointable(grc2)).read(
        f"{CKPT_DIR}/rank{rank}/ckpt").expect_partial()
    with tf.GradientTape() as tape:
        loss = loss_fn(renamed, *batch(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.DistributedGradientTape(tape, grace=grc2).gradient(loss, renamed.trainable_variables)
    report["renamed_warnings"] = [str(w.message) for w in caught
                                  if w.category is RuntimeWarning]
    return report


mp.report(main() if MODE == "main" else resume())
