"""Single-process checks of the TensorFlow glue: lazy imports, the drop-in module's names,
argument validation, gradient naming, and the checkpoint format (no Horovod job needed)."""

import os
import subprocess
import sys

import horovod.tensorflow as stock
import keras
import numpy as np
import pytest
import tensorflow as tf

import grace_dl.tensorflow.horovod as hvd
from grace_dl import grace_from_params
from grace_dl.tensorflow import checkpoint, gradients, ops


@pytest.fixture
def grc():
    return grace_from_params({"compressor": "topk", "memory": "residual",
                              "communicator": "allgather", "compress_ratio": 0.1})


def test_importing_ops_or_package_does_not_import_horovod():
    code = ("import sys, grace_dl.tensorflow, grace_dl.tensorflow.ops; "
            "print(any(m.startswith('horovod') for m in sys.modules))")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_lazy_package_exports():
    import grace_dl.tensorflow as gtf

    assert gtf.DistributedGradientTape is hvd.DistributedGradientTape
    assert gtf.DistributedOptimizer is hvd.DistributedOptimizer
    assert gtf.checkpointable is checkpoint.checkpointable
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        gtf.nope  # noqa: B018


def test_drop_in_has_every_public_horovod_name():
    ours = {"DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer"}
    public = [k for k in dir(stock) if not k.startswith("_")]
    assert len(public) > 50
    for name in public:
        assert hasattr(hvd, name), name
        assert name in hvd.__all__
        if name not in ours:
            assert getattr(hvd, name) is getattr(stock, name), name


@pytest.mark.parametrize("kwargs, match", [
    ({"op": stock.Adasum}, "op must be hvd.Average or hvd.Sum"),
    ({"compression": stock.Compression.fp16}, "Horovod's compression"),
    ({"groups": -2}, "groups must be a positive integer"),
    ({"groups": "all"}, "groups must be a positive integer"),
    ({"op": stock.Sum, "gradient_predivide_factor": 2.0}, "only supported with op=hvd.Average"),
    ({"gradient_predivide_factor": -1.0}, "must be > 0"),
    ({"process_set": stock.ProcessSet([0])}, "differs from the grace object's"),
    ({"bucket_bytes": 0}, "bucket_bytes must be a positive int or None, got 0"),
    ({"bucket_bytes": 1024, "groups": 2}, "bucket_bytes=1024 and groups=2 cannot be combined"),
])
def test_tape_rejects_options_grace_cannot_honour(grc, kwargs, match):
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match=match):
        hvd.DistributedGradientTape(tape, grace=grc, **kwargs)


def test_grace_must_be_a_communicator():
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match=r"object lacks \['send'"):
        hvd.DistributedGradientTape(tape, grace=object())


def test_keras_optimizer_validation(grc):
    sgd = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="backward_passes_per_step=2"):
        hvd.DistributedOptimizer(sgd, backward_passes_per_step=2)
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Sum"):
        hvd.DistributedOptimizer(sgd, op=stock.Adasum)
    with pytest.raises(ValueError, match="Horovod's compression"):
        hvd.DistributedOptimizer(sgd, grace=grc, compression=stock.Compression.fp16)
    with pytest.raises(ValueError, match="Keras 3 optimizers"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), grace=grc)


def test_bucket_bytes_needs_a_grace_that_takes_flat_buckets():
    from grace_dl import grace_from_params

    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match="bucket_bytes=64 needs grace="):
        hvd.DistributedGradientTape(tape, bucket_bytes=64)
    with pytest.raises(ValueError, match="bucket_bytes=64 needs grace="):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), bucket_bytes=64)
    powersgd = grace_from_params({"compressor": "powersgd", "memory": "powersgd",
                                  "communicator": "allreduce"})
    with pytest.raises(ValueError, match="PowerSGD.* needs each parameter's shape"):
        hvd.DistributedGradientTape(tape, grace=powersgd, bucket_bytes=64)


def test_keras_wrapper_is_the_users_class_with_its_config(grc):
    adam = keras.optimizers.Adam(0.003, beta_1=0.8, name="myadam")
    wrapped = hvd.DistributedOptimizer(adam, grace=grc)
    assert isinstance(wrapped, keras.optimizers.Adam)
    assert type(wrapped).__name__ == "Adam"
    assert wrapped.get_config() == adam.get_config()
    assert isinstance(wrapped.grace_state, checkpoint.GraceCheckpoint)
    assert type(hvd.DistributedOptimizer(keras.optimizers.Adam())) is type(wrapped)


def test_tape_wrapper_keeps_the_tape_class_and_flags(grc):
    class MyTape(tf.GradientTape):
        pass

    with MyTape(persistent=True, watch_accessed_variables=False) as tape:
        pass
    wrapped = hvd.DistributedGradientTape(tape, grace=grc)
    assert isinstance(wrapped, MyTape)
    assert wrapped._persistent and not wrapped._watch_accessed_variables


def test_gradient_names_are_unique_and_stable():
    names = gradients.Names()
    a, b = tf.Variable(1.0), tf.Variable(2.0)  # both named "Variable"
    dense = keras.layers.Dense(2, name="d")
    dense.build((None, 3))
    assert [names(a, 0), names(b, 1), names(a, 0), names(dense.kernel, 2)] == [
        "Variable", "Variable_1", "Variable", "d/kernel"]
    assert names(tf.constant([1.0]), 5) == "source.5"
    assert gradients.variable_name(tf.Variable(0.0, name="scope_w")) == "scope_w"


def test_grace_op_mapping():
    assert gradients.grace_op(stock.Average) == "average"
    assert gradients.grace_op(stock.Sum) == "sum"
    with pytest.raises(ValueError, match="got"):
        gradients.grace_op(stock.Max)


def test_densify_indexed_slices_sums_duplicate_rows():
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([1, 1]),
                              tf.constant([3, 2]))
    np.testing.assert_array_equal(gradients.densify(slices), [[0, 0], [4, 6], [0, 0]])


def test_state_dict_bytes_round_trip():
    state = {"compressor": {"step/a/b": np.int64(3)}, "memory": {},
             "pipelines": {"x": {"memory": {"w/kernel": np.arange(6, dtype=np.float32)}}}}
    back = checkpoint.loads(checkpoint.dumps(state))
    assert back["memory"] == {}
    assert int(back["compressor"]["step/a/b"]) == 3
    np.testing.assert_array_equal(back["pipelines"]["x"]["memory"]["w/kernel"], np.arange(6))
    with pytest.raises(ValueError, match="keys must be strings"):
        checkpoint.dumps({1: np.zeros(1)})


def test_checkpoint_restores_into_slots_created_later(grc, tmp_path):
    # State written eagerly into a grace object, then restored into a fresh one before any slot
    # exists: the slot starts from the saved value when first created.
    memory = grc.memory
    memory.state.zeros("w", ops, tf.zeros([3]))
    ops.assign(memory.state.variables()["w"], tf.constant([1.0, -2.0, 3.0]))
    path = tf.train.Checkpoint(grace=hvd.checkpointable(grc)).write(str(tmp_path / "c"))

    fresh = grace_from_params({"compressor": "topk", "memory": "residual",
                               "communicator": "allgather", "compress_ratio": 0.1})
    tf.train.Checkpoint(grace=hvd.checkpointable(fresh)).read(path).assert_consumed()
    assert "w" in fresh.memory.state and not fresh.memory.state.variables()
    var = fresh.memory.state.zeros("w", ops, tf.zeros([3]))
    np.testing.assert_array_equal(var.numpy(), [1.0, -2.0, 3.0])


def test_checkpointable_needs_state_dict():
    with pytest.raises(ValueError, match="state_dict"):
        hvd.checkpointable(object())


def test_tf1_graph_mode_is_refused_at_construction(grc):
    hvd.init()  # a one-process job
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.ones((4,)))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        with pytest.raises(ValueError, match="TF1 graph mode .* is not supported"):
            hvd.DistributedGradientTape(tape, grace=grc)
        assert hvd.DistributedGradientTape(tape).gradient(loss, [w])[0] is not None


def test_tf_function_and_eager_are_accepted(grc):
    @tf.function
    def traced():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.ones(3))
        hvd.DistributedGradientTape(tape, grace=grc)
        return loss
    assert float(traced()) == 3.0
    with tf.GradientTape() as tape:
        tf.reduce_sum(tf.ones(3))
    hvd.DistributedGradientTape(tape, grace=grc)


def test_the_send_path_runs_as_written_inside_tf_function():
    """AutoGraph does not transpile grace_dl's send path (``communicators.base.as_written``:
    the mark ``tf.autograph.experimental.do_not_convert`` sets), so a ``tf.function`` step
    traces the code as written and gives eager's values; a method that branched on a tensor
    with Python ``if`` would get TF's own error there (``ops.cond`` is the way)."""
    from tensorflow.python.autograph.impl.api import is_autograph_artifact

    from grace_dl.communicators.schedule import Schedule

    params = {"compressor": "qsgd", "memory": "residual", "communicator": "twophase"}
    grc = grace_from_params(dict(params))
    for entry in (grc.send, grc.receive, grc.receive_all, grc.advance, Schedule.send,
                  Schedule.receive, Schedule.receive_all):
        assert is_autograph_artifact(entry), entry
    hvd.init()
    x = tf.constant(np.random.default_rng(0).standard_normal((40, 30)).astype(np.float32))

    def step(comm, t):
        return comm.receive(comm.send(t, "w"))

    eager = step(grc, x).numpy()
    other = grace_from_params(dict(params))
    traced = tf.function(lambda t: step(other, t))(x).numpy()
    np.testing.assert_array_equal(eager, traced)


def test_the_tapes_gradient_takes_horovods_positional_arguments():
    """``gradient(target, sources, output_gradients, use_generic_names)`` as Horovod's tape
    takes them (``unconnected_gradients`` came fourth: a positional ``True`` meant it)."""
    import inspect

    import horovod.tensorflow as stock

    hvd.init()  # a one-process job
    w = tf.Variable(tf.ones((3,)))
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(w * w)
    theirs = inspect.signature(stock.DistributedGradientTape(tape).gradient).parameters
    none = grace_from_params({"compressor": "none", "communicator": "allreduce"})
    for ours in (hvd.DistributedGradientTape(tape), hvd.DistributedGradientTape(tape, grace=none)):
        assert list(inspect.signature(ours.gradient).parameters)[:4] == list(theirs)
        np.testing.assert_array_equal(ours.gradient(loss, [w], None, True)[0].numpy(),
                                      [2.0, 2.0, 2.0])
