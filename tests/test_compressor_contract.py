"""The contract every built-in compressor keeps, checked for each name in the registry, in torch
and in TensorFlow: it builds with defaults; decompress(compress(x)) has x's shape and dtype;
the payload is as big as ``payload_nbytes`` says; torch and TF give the same result for the same
input and seed (also over several steps, for stateful methods, and inside ``tf.function``);
unbiased methods are unbiased; and the edge cases (zeros, 0-d, 1 element, empty, NaN/Inf,
non-contiguous input) neither crash nor lose the shape.
"""

import numpy as np
import pytest
import tensorflow as tf
import torch

from grace_dl.backend import ops_for
from grace_dl.registry import BUILTIN, lookup

NAMES = sorted(BUILTIN["compressor"])
FRAMEWORKS = ["torch", "tf"]
DTYPES = ["float32", "float16", "bfloat16", "float64"]

# Methods that by design cannot carry a NaN/Inf of the input into their output.
NO_NONFINITE_PROPAGATION = {
    "randomk": "sends only the seeded random positions, which need not hold the NaN/Inf",
}


# Methods that read a 2-D tensor in its framework's layout (Keras Dense kernels are torch Linear
# weights transposed): TF gets the same logical kernel, x.T, and its result is transposed back.
FRAMEWORK_LAYOUT = {"powersgd"}


def make(name, **kwargs):
    return lookup("compressor", name)(**kwargs)


def sample(shape, seed=0):
    """Gradient-like values: normal, spread over a few orders of magnitude, one exact zero."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 1, shape))
    if x.size:
        x.reshape(-1)[x.size // 2] = 0.0
    return x.astype(np.float32)


def to_fw(arr, fw, dtype="float32"):
    if fw == "torch":
        return torch.from_numpy(np.array(arr, np.float32)).to(getattr(torch, dtype))
    return tf.cast(tf.constant(np.array(arr, np.float32)), dtype)


def to_np(t):
    return np.asarray(ops_for(t).to_numpy(t), np.float64)


def round_trip(comp, t, name="w"):
    """Compress (every round of a multi-round method, its own payload standing for the reduced
    one, as on a single rank), decompress; returns everything sent and the result."""
    payload, ctx = comp.compress(t, name)
    sent = list(payload)
    while (nxt := comp.next_round(payload, ctx)) is not None:
        payload, ctx = nxt
        sent += list(payload)
    return sent, comp.decompress(payload, ctx)


def nbytes(payload):
    return sum(int(ops_for(p).nbytes(p)) for p in payload)


def dtype_name(t):
    return ops_for(t).dtype(t)


@pytest.mark.parametrize("name", NAMES)
def test_builds_with_defaults(name):
    comp = make(name)
    assert isinstance(comp.caps.unbiased, bool) and isinstance(comp.caps.allreduce_safe, bool)
    assert isinstance(comp.caps.two_phase_safe, bool) and isinstance(comp.caps.equal_sizes, bool)
    assert name in repr(type(comp).registry_name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_keeps_shape_and_dtype(name, fw, dtype):
    x = sample((6, 35))
    payload, out = round_trip(make(name), to_fw(x, fw, dtype))
    assert tuple(out.shape) == x.shape
    assert dtype_name(out) == dtype
    assert np.isfinite(to_np(out)).all()
    # Scalars travel as 1-element tensors: Horovod refuses to allgather 0-d ones.
    assert all(len(p.shape) >= 1 for p in payload)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", NAMES)
def test_payload_bytes_follow_the_formula(name, fw):
    comp = make(name)
    slack = set()
    for shape in [(6, 35), (4099,)]:
        x = sample(shape, seed=1)
        payload, _ = round_trip(comp, to_fw(x, fw), name=f"w{len(shape)}")
        formula = comp.payload_nbytes(x.size, "float32")
        if formula is None:  # data-dependent size (threshold, inceptionn): checked per method
            assert nbytes(payload) > 0
            continue
        if name in ("signsgd", "signum") and np.any(x == 0):   # their zero plane, only then
            formula += -(-x.size // 8)
        slack.add(nbytes(payload) - formula)
    # At most a fixed few bytes above the formula per tensor, the same at every size.
    assert len(slack) <= 1 and all(0 <= s <= 16 for s in slack), slack


@pytest.mark.parametrize("name", NAMES)
def test_torch_and_tf_agree_over_steps(name):
    comps = {fw: make(name) for fw in FRAMEWORKS}
    for step in range(3):
        x = sample((5, 41), seed=10 + step)
        outs = {}
        for fw, comp in comps.items():
            keras = fw == "tf" and name in FRAMEWORK_LAYOUT
            payload, out = round_trip(comp, to_fw(x.T if keras else x, fw))
            outs[fw] = (to_np(out).T if keras else to_np(out), nbytes(payload))
        np.testing.assert_allclose(outs["torch"][0], outs["tf"][0], rtol=1e-5,
                                   atol=1e-5 * np.abs(x).max(), err_msg=f"step {step}")
        assert outs["torch"][1] == outs["tf"][1]


@pytest.mark.parametrize("name", NAMES)
def test_tf_function_matches_eager(name):
    x = tf.constant(sample((5, 41), seed=3))
    eager, graph = make(name), make(name)
    fn = tf.function(lambda t: round_trip(graph, t)[1])
    for _ in range(2):
        expected = to_np(round_trip(eager, x)[1])
        np.testing.assert_allclose(to_np(fn(x)), expected, rtol=1e-5,
                                   atol=1e-5 * float(tf.reduce_max(tf.abs(x))))


UNBIASED = [name for name in NAMES if lookup("compressor", name).caps.unbiased]


def test_the_stochastic_quantizers_claim_unbiasedness():
    assert {"none", "qsgd", "terngrad", "natural"} <= set(UNBIASED), UNBIASED


@pytest.mark.parametrize("name", UNBIASED)
def test_unbiased_methods_are_unbiased(name):
    comp = make(name)
    x = sample((64,), seed=5)
    draws = 2000
    outs = np.stack([to_np(round_trip(comp, torch.from_numpy(x))[1]) for _ in range(draws)])
    mean, std = outs.mean(0), outs.std(0, ddof=1)
    # Five standard errors of the observed spread, plus float rounding. An element whose
    # outcome is a rare event (TernGrad keeps x with probability |x| / max|x|) may see no event
    # in `draws` tries, and then its observed spread is 0: the resolution of five events,
    # 5 * max|outcome| / draws, bounds what such an element can show.
    tol = 5 * std / np.sqrt(draws) + 5 * np.abs(outs).max() / draws + 1e-5 * np.abs(x).max()
    assert np.all(np.abs(mean - x) <= tol), np.max(np.abs(mean - x) - tol)
    if std.max() == 0:  # deterministic and unbiased: exact
        np.testing.assert_allclose(outs[0], x, rtol=1e-6)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", NAMES)
def test_all_zero_tensor(name, fw):
    comp = make(name)
    _, out = round_trip(comp, to_fw(np.zeros((4, 9)), fw))
    out = to_np(out)
    assert out.shape == (4, 9) and np.isfinite(out).all()
    if comp.caps.unbiased:
        assert np.all(out == 0)


@pytest.mark.parametrize("shape", [(), (1,), (0,), (3, 0)], ids=["0d", "1elem", "empty", "3x0"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", NAMES)
def test_tiny_shapes(name, fw, shape):
    comp = make(name)
    x = np.full(shape, 0.7, np.float32)
    payload, out = round_trip(comp, to_fw(x, fw))
    assert tuple(out.shape) == shape and dtype_name(out) == "float32"
    assert np.isfinite(to_np(out)).all()
    formula = comp.payload_nbytes(x.size, "float32")
    if formula is not None:
        assert formula <= nbytes(payload) <= formula + 16


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", NAMES)
def test_nan_and_inf_do_not_crash_and_propagate(name, fw):
    x = sample((6, 35), seed=7)
    x[1, 3], x[4, 20] = np.nan, np.inf
    _, out = round_trip(make(name), to_fw(x, fw))
    out = to_np(out)
    assert out.shape == x.shape
    if name not in NO_NONFINITE_PROPAGATION:
        assert not np.isfinite(out).all(), "a NaN/Inf in the input vanished without trace"


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_torch_input(name):
    base = torch.from_numpy(sample((41, 5), seed=8))
    view = base.t()
    assert not view.is_contiguous()
    _, out_view = round_trip(make(name), view)
    _, out_copy = round_trip(make(name), view.contiguous())
    assert tuple(out_view.shape) == (5, 41)
    # Equal up to float rounding (a matmul may take another path for a transposed view).
    np.testing.assert_allclose(to_np(out_view), to_np(out_copy), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(base.numpy(), sample((41, 5), seed=8))  # input untouched


def test_the_core_contracts_are_what_a_method_author_needs():
    """Issue 42: ``Compressor`` at most 12 public names, ``Memory`` at most 6; every speed
    path lives behind the seam (``compressors.paths``), not as more methods here."""
    from grace_dl.compressors.base import Compressor
    from grace_dl.memory.base import Memory

    def public(cls):
        return sorted(n for n in dir(cls) if not n.startswith("_"))

    assert public(Compressor) == ["aggregate", "caps", "compress", "decompress",
                                  "load_state_dict", "next_round", "next_step",
                                  "payload_nbytes", "reset", "sent_entries", "state_dict"]
    assert public(Memory) == ["compensate", "load_state_dict", "refusal", "reset",
                              "state_dict", "update"]


def test_no_speed_path_is_chosen_by_comparing_methods():
    """No ``type(x).method is Base.method`` in grace_dl: a speed path is registered for an
    exact class and chosen when a communicator is built (``compressors.paths``)."""
    import re
    from pathlib import Path

    import grace_dl

    pattern = re.compile(r"type\([^)]*\)\.\w+\)? is (not )?\w+\.\w+")
    found = [f"{path.name}:{i}" for path in Path(grace_dl.__file__).parent.rglob("*.py")
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert found == []
