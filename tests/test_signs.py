"""The 1-bit sign methods (onebit, signsgd, signum, efsignsgd + its memory), torch and TF.

Each check runs on both frameworks and, where it makes sense, compares them element by element
and against a NumPy transcription of the paper's formulas."""

import math

import numpy as np
import pytest
import tensorflow as tf
import torch
from workers.signs_allgather import CONFIGS, SHAPE, STEPS, grad

import mp
from grace_dl import grace_from_params, lookup
from grace_dl.compressors.paths import own
from grace_dl.tensorflow import ops as tf_ops
from grace_dl.torch import ops as torch_ops

FRAMEWORKS = ["torch", "tf"]
METHODS = {"onebit": {}, "signsgd": {}, "signum": {"momentum": 0.9}, "efsignsgd": {"lr": 0.1}}
SCALAR_BYTES = {"onebit": 8, "signsgd": 1, "signum": 1, "efsignsgd": 4}
BIT_PLANES = {"onebit": 1, "signsgd": 1, "signum": 1, "efsignsgd": 1}  # tensors without zeros
PURE_SIGN = ("signsgd", "signum")     # their tensors with exact zeros send a zero plane too


def tensor(fw, arr, dtype="float32"):
    arr = np.asarray(arr)
    if fw == "torch":
        return torch_ops.cast(torch.from_numpy(np.array(arr, np.float64)), dtype)
    return tf_ops.cast(tf.constant(np.array(arr, np.float64)), dtype)


def ops_of(fw):
    return torch_ops if fw == "torch" else tf_ops


def np_of(t):
    return ops_of("torch" if isinstance(t, torch.Tensor) else "tf").to_numpy(t).astype(np.float64)


def make(name, **override):
    return lookup("compressor", name)(**{**METHODS[name], **override})


def round_trip(comp, x, name="w"):
    payload, ctx = comp.compress(x, name)
    return payload, comp.decompress(payload, ctx)


def wire_bytes(payload):
    return sum(int(ops_of("torch" if isinstance(p, torch.Tensor) else "tf").nbytes(p))
               for p in payload)


def np_sign(x):
    """The documented 1-bit sign: -1 for x < 0, +1 otherwise (zero included)."""
    return np.where(np.asarray(x) < 0, -1.0, 1.0)


# ------------------------------------------------------------------ the new ops
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 1001])
def test_pack_mask_matches_pack_bits(n):
    rng = np.random.default_rng(n)
    mask = rng.random(n) < 0.5
    ref = torch_ops.pack_bits(torch.from_numpy(mask.astype(np.uint8)), 1).numpy()
    assert torch_ops.pack_mask(torch.from_numpy(mask)).numpy().tolist() == ref.tolist()
    assert tf_ops.pack_mask(tf.constant(mask)).numpy().tolist() == ref.tolist()
    # unaligned and strided views of a bigger mask
    big = torch.from_numpy(rng.random(3 * n + 3) < 0.5)
    for view in (big[1:n + 1], big[3::3][:n]):
        expect = torch_ops.pack_bits(view.to(torch.uint8), 1)
        assert torch.equal(torch_ops.pack_mask(view), expect)
    # nonzero-ness of a non-bool tensor
    vals = np.where(mask, 2.5, 0.0).astype(np.float32)
    assert torch_ops.pack_mask(torch.from_numpy(vals)).numpy().tolist() == ref.tolist()
    assert tf_ops.pack_mask(tf.constant(vals)).numpy().tolist() == ref.tolist()


def test_pack_mask_every_byte_value():
    bits = ((np.arange(256)[:, None] >> np.arange(8)) & 1).astype(bool).reshape(-1)
    assert torch_ops.pack_mask(torch.from_numpy(bits)).numpy().tolist() == list(range(256))
    assert tf_ops.pack_mask(tf.constant(bits)).numpy().tolist() == list(range(256))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 5, 33])
def test_unpack_lookup(bits, n):
    rng = np.random.default_rng(bits + 10 * n)
    codes = rng.integers(0, 2**bits, n).astype(np.uint8)
    table = rng.standard_normal(2**bits).astype(np.float32)
    packed = torch_ops.pack_bits(torch.from_numpy(codes), bits)
    got_t = torch_ops.unpack_lookup(packed, bits, n, torch.from_numpy(table)).numpy()
    got_f = tf_ops.unpack_lookup(tf.constant(packed.numpy()), bits, n, tf.constant(table)).numpy()
    np.testing.assert_array_equal(got_t, table[codes])
    np.testing.assert_array_equal(got_f, table[codes])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_unpack_lookup_rejects_bad_widths_and_tables(fw):
    ops = ops_of(fw)
    packed = ops.pack_bits(tensor(fw, [1, 0, 1], "uint8"), 1)
    with pytest.raises(ValueError, match="bits must be one of"):
        ops.unpack_lookup(packed, 3, 3, tensor(fw, np.zeros(8)))
    with pytest.raises(ValueError, match="table must have 2 entries"):
        ops.unpack_lookup(packed, 1, 3, tensor(fw, np.zeros(3)))


def test_small_reductions_and_lerp_agree():
    x = np.array([1.5, -2.0, 0.0, 3.25], np.float32)
    for ops, t in ((torch_ops, torch.from_numpy(x)), (tf_ops, tf.constant(x))):
        assert float(ops.abs_sum(t)) == 6.75
        assert int(ops.count_nonzero(t < 0)) == 1
    for w in (0.1, 0.75):
        vt = torch_ops.variable(np.ones(4, np.float32), "float32")
        vf = tf_ops.variable(np.ones(4, np.float32), "float32")
        torch_ops.assign_lerp(vt, torch.from_numpy(x), w)
        tf_ops.assign_lerp(vf, tf.constant(x), w)
        np.testing.assert_allclose(vt.numpy(), 1 + w * (x - 1), rtol=1e-6)
        np.testing.assert_allclose(vf.numpy(), vt.numpy(), rtol=1e-6)


# ------------------------------------------------------------------ declared properties
def test_declared_properties():
    for name in METHODS:
        comp = make(name)
        assert comp.caps.allreduce_safe is False
        assert comp.caps.equal_sizes is (name not in PURE_SIGN)
        assert comp.caps.unbiased is False
    assert make("signsgd").caps.average is False and make("signum").caps.average is False
    assert make("onebit").caps.average is True and make("efsignsgd").caps.average is True
    assert make("signsgd").caps.two_phase_safe and make("onebit").caps.two_phase_safe
    assert make("efsignsgd").caps.two_phase_safe and not make("signum").caps.two_phase_safe


@pytest.mark.parametrize("kwargs,match", [
    ({"momentum": 1.0}, r"momentum must be in \[0.0, 1.0\)"),
    ({"momentum": -0.1}, "momentum must be in"),
    ({"momentum": "fast"}, "momentum must be a number \\(not str\\), got 'fast'"),
])
def test_signum_rejects_bad_momentum(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lookup("compressor", "signum")(**kwargs)


@pytest.mark.parametrize("kind", ["compressor", "memory"])
@pytest.mark.parametrize("lr", [0, -0.5, "x"])
def test_efsignsgd_rejects_bad_lr(kind, lr):
    with pytest.raises(ValueError, match="lr must be"):
        lookup(kind, "efsignsgd")(lr=lr)


def test_grace_from_params_hands_lr_to_both():
    grc = grace_from_params({"compressor": "efsignsgd", "memory": "efsignsgd",
                             "communicator": "allgather", "lr": 0.05})
    assert grc.compressor.lr == 0.05 and grc.memory.lr == 0.05


# ------------------------------------------------------------------ wire size
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 4099])
def test_bytes_on_the_wire(fw, name, n):
    comp = make(name)
    payload, _ = comp.compress(tensor(fw, np.linspace(-1, 1, n) + 1e-3), "w")   # no zeros
    sent = wire_bytes(payload)
    planes = BIT_PLANES[name]
    assert sent == comp.payload_nbytes(n) == planes * math.ceil(n / 8) + SCALAR_BYTES[name]
    packed = payload[0]
    assert ops_of(fw).dtype(packed) == "uint8"
    if n >= 1000:  # 1 bit per element and plane, plus a fixed few bytes
        assert 8 * sent / n < planes + 8 * SCALAR_BYTES[name] / n + 0.01


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_wire_is_the_same_for_every_input_dtype(fw, name, dtype):
    comp = make(name)
    payload, decoded = round_trip(comp, tensor(fw, np.linspace(-3, 3, 21) + 0.1, dtype))
    assert wire_bytes(payload) == comp.payload_nbytes(21, dtype) == \
        3 * BIT_PLANES[name] + SCALAR_BYTES[name]
    assert ops_of(fw).dtype(decoded) == dtype


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", PURE_SIGN)
@pytest.mark.parametrize("n", [1, 8, 9, 1000])
def test_pure_signs_send_a_zero_plane_only_with_exact_zeros(fw, name, n):
    """signsgd and signum: 1 bit per element, and the zero plane (with status bit 1) only for
    a tensor that holds an exact zero, whose decoding then keeps the zeros."""
    x = np.linspace(-1, 1, n) + 1e-3
    x[n // 2] = 0.0
    comp = make(name, **({"momentum": 0.0} if name == "signum" else {}))
    payload, out = round_trip(comp, tensor(fw, x))
    assert wire_bytes(payload) == 2 * math.ceil(n / 8) + 1 == comp.payload_nbytes(n) + \
        math.ceil(n / 8)
    assert int(np_of(payload[0])[-1]) == 2          # ZEROS set, NONFINITE clear
    np.testing.assert_array_equal(np_of(out), np.sign(x))
    payload, out = round_trip(make(name), tensor(fw, x + 1.0))    # no zeros: one plane
    assert wire_bytes(payload) == comp.payload_nbytes(n) and int(np_of(payload[0])[-1]) == 0


# ------------------------------------------------------------------ shapes, dtypes, edge cases
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("shape", [(), (1,), (0,), (3, 5), (2, 0, 3), (17,)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_round_trip_shape_and_dtype(fw, name, shape, dtype):
    x = np.random.default_rng(7).standard_normal(shape)
    _, out = round_trip(make(name), tensor(fw, x, dtype))
    ops = ops_of(fw)
    assert ops.shape(out) == shape and ops.dtype(out) == dtype
    assert np.all(np.isfinite(np_of(out)))


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", list(METHODS))
def test_all_zero_tensor(fw, name):
    _, out = round_trip(make(name), tensor(fw, np.zeros((4, 3))))
    np.testing.assert_array_equal(np_of(out), np.zeros((4, 3)))


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_propagate(fw, name, bad):
    x = np.array([1.0, -2.0, bad, 0.5, -0.25])
    _, out = round_trip(make(name), tensor(fw, x))
    out = np_of(out)
    assert out.shape == (5,)
    assert not np.all(np.isfinite(out)), out
    if name in ("signsgd", "signum") or np.isnan(bad):
        assert np.isnan(out).any()


@pytest.mark.parametrize("name", list(METHODS))
def test_non_contiguous_torch_input(name):
    base = torch.from_numpy(np.random.default_rng(3).standard_normal((6, 9)).astype(np.float32))
    view = base.t()[::2]
    assert not view.is_contiguous()
    _, a = round_trip(make(name), view)
    _, b = round_trip(make(name), view.contiguous())
    assert a.shape == view.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------ signsgd / signum values
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_signs_decode_to_minus_one_zero_plus_one(fw, name):
    x = np.array([[3.0, -0.0, 0.0], [-1e-30, 7.5, -4.0]])
    _, out = round_trip(make(name), tensor(fw, x))
    np.testing.assert_array_equal(np_of(out), [[1, 0, 0], [-1, 1, -1]])


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_majority_vote_of_three_ranks(fw, name):
    rng = np.random.default_rng(11)
    grads = rng.standard_normal((3, 50))
    grads[:, :3] = [[1, -1, 0], [1, -1, 0], [-1, 1, -2]]  # 2:1 votes, and zero voting 0
    ranks = [make(name) for _ in range(3)]  # each rank its own compressor (and momentum)
    payloads = [r.compress(tensor(fw, g), "w") for r, g in zip(ranks, grads)]
    decoded = [ranks[0].decompress(p, ctx) for p, ctx in payloads]
    voted = np_of(ranks[0].aggregate(decoded))
    majority = np.sign(np.sign(grads).sum(axis=0))
    np.testing.assert_array_equal(voted, majority)
    np.testing.assert_array_equal(voted[:3], [1, -1, -1])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_majority_vote_ties_give_zero(fw):
    comp = make("signsgd")
    decoded = [comp.decompress(*comp.compress(tensor(fw, g), "w"))
               for g in ([1.0, -1.0, 2.0], [-1.0, -3.0, 5.0])]
    np.testing.assert_array_equal(np_of(comp.aggregate(decoded)), [0, -1, 1])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_signum_momentum_evolves(fw):
    beta = 0.75
    comp = make("signum", momentum=beta)
    rng = np.random.default_rng(5)
    m = np.zeros(40)
    for step in range(4):
        g = rng.standard_normal(40)
        if step == 3:  # a gradient that disagrees in sign with the momentum in places
            g = -0.5 * m / (1 - beta) + 0.1 * rng.standard_normal(40)
        m = beta * m + (1 - beta) * g
        _, out = round_trip(comp, tensor(fw, g))
        np.testing.assert_array_equal(np_of(out), np_sign(m))
        np.testing.assert_allclose(comp.state_dict()["momentum/w"], m, rtol=1e-5, atol=1e-6)
    assert np.any(np_sign(g) != np_sign(m))  # the last step really sent the momentum's signs


@pytest.mark.parametrize("src_fw,dst_fw", [("torch", "torch"), ("tf", "tf"), ("torch", "tf"),
                                           ("tf", "torch")])
def test_signum_state_survives_checkpoint(src_fw, dst_fw):
    rng = np.random.default_rng(9)
    grads = rng.standard_normal((6, 3, 4))
    a = make("signum", momentum=0.6)
    for g in grads[:3]:
        a.compress(tensor(src_fw, g), "layer.weight")
    state = a.state_dict()
    assert set(state) == {"momentum/layer.weight"}
    b = make("signum", momentum=0.6)
    b.load_state_dict(state)  # before any slot exists: used when the slot is created
    for g in grads[3:]:
        pa, _ = a.compress(tensor(src_fw, g), "layer.weight")
        pb, _ = b.compress(tensor(dst_fw, g), "layer.weight")
        np.testing.assert_array_equal(np_of(pa[0]), np_of(pb[0]))
    np.testing.assert_allclose(a.state_dict()["momentum/layer.weight"],
                               b.state_dict()["momentum/layer.weight"], rtol=1e-6)


# ------------------------------------------------------------------ onebit
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_onebit_two_means_reconstruct(fw, dtype):
    x = np.random.default_rng(2).standard_normal((10, 13)) + 0.3
    x[0, :3] = 0.0
    x = np_of(tensor(fw, x, dtype))  # the values the compressor really sees
    payload, out = round_trip(make("onebit"), tensor(fw, x, dtype))
    neg = x < 0
    means = np_of(payload[1])
    tol = {"float16": 1e-3, "float32": 1e-6, "float64": 1e-6}[dtype]
    np.testing.assert_allclose(means, [x[~neg].mean(), x[neg].mean()], rtol=tol)
    expect = np.where(neg, x[neg].mean(), x[~neg].mean())
    np.testing.assert_allclose(np_of(out), expect, rtol=tol * 10)
    assert np.all(np.sign(np_of(out))[neg] < 0) and np.all(np_of(out)[~neg] > 0)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_onebit_one_sided_tensors(fw):
    comp = make("onebit")
    _, out = round_trip(comp, tensor(fw, [-1.0, -2.0, -6.0]))
    np.testing.assert_allclose(np_of(out), [-3.0, -3.0, -3.0])
    _, out = round_trip(comp, tensor(fw, [4.0, 0.0, 2.0]))
    np.testing.assert_allclose(np_of(out), [2.0, 2.0, 2.0])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_onebit_skewed_tensor_keeps_signs_and_l1_error_small(fw):
    # One tiny positive among many large negatives: its group sum drowns in rounding.
    x = -np.abs(np.random.default_rng(4).standard_normal(20000)) - 1.0
    x[123] = 1e-6
    payload, out = round_trip(make("onebit"), tensor(fw, x))
    pos_mean, neg_mean = np_of(payload[1])
    assert pos_mean >= 0 and neg_mean < 0
    np.testing.assert_allclose(neg_mean, x[x < 0].mean(), rtol=1e-5)
    assert abs(np_of(out)[123] - 1e-6) < 1e-5 * np.abs(x).sum()


# ------------------------------------------------------------------ efsignsgd + memory
def reference_ef_signsgd(grads, lr):
    """Karimireddy et al. 2019, Algorithm 1, in NumPy (float64)."""
    e = np.zeros_like(grads[0])
    sent = []
    for g in grads:
        p = lr * g + e
        delta = np.abs(p).mean() * np_sign(p)
        e = p - delta
        sent.append(delta)
    return sent, e


def run_ef(fw, grads, lr, name="w"):
    comp = lookup("compressor", "efsignsgd")(lr=lr)
    mem = lookup("memory", "efsignsgd")(lr=lr)
    sent = []
    for g in grads:
        p = mem.compensate(tensor(fw, g), name)
        payload, ctx = comp.compress(p, name)
        mem.update(p, name, comp, payload, ctx)
        sent.append(comp.decompress(payload, ctx))
    return comp, mem, sent


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_efsignsgd_error_feedback_conserves(fw):
    lr = 0.1
    grads = np.random.default_rng(8).standard_normal((6, 5, 7))
    _, mem, sent = run_ef(fw, grads, lr)
    residual = mem.state_dict()["w"]
    total_sent = sum(np_of(s) for s in sent)
    np.testing.assert_allclose(total_sent, lr * grads.sum(axis=0) - residual, atol=1e-5)
    ref_sent, ref_e = reference_ef_signsgd(grads, lr)
    for got, want in zip(sent, ref_sent):
        np.testing.assert_allclose(np_of(got), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(residual, ref_e, rtol=1e-4, atol=1e-6)


def test_efsignsgd_torch_equals_tf_over_steps():
    grads = np.random.default_rng(12).standard_normal((5, 64)).astype(np.float32)
    _, mem_t, sent_t = run_ef("torch", grads, 0.03)
    _, mem_f, sent_f = run_ef("tf", grads, 0.03)
    for a, b in zip(sent_t, sent_f):
        np.testing.assert_allclose(np_of(a), np_of(b), rtol=1e-6, atol=0)
    np.testing.assert_allclose(mem_t.state_dict()["w"], mem_f.state_dict()["w"], rtol=1e-5,
                               atol=1e-7)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_efsignsgd_first_step_applies_lr_and_aggregate_divides_by_it(fw):
    lr = 0.5
    comp, mem, sent = run_ef(fw, [np.array([2.0, -4.0, 6.0])], lr)
    np.testing.assert_allclose(np_of(sent[0]), [2.0, -2.0, 2.0])  # mean |lr g| = 2
    np.testing.assert_allclose(mem.state_dict()["w"], [-1.0, 0.0, 1.0])
    np.testing.assert_allclose(np_of(comp.aggregate([sent[0], sent[0]])), [8.0, -8.0, 8.0])


def test_efsignsgd_memory_refuses_a_compressor_with_another_lr():
    """At construction, naming both learning rates."""
    comp = lookup("compressor", "efsignsgd")(lr=0.1)
    mem = lookup("memory", "efsignsgd")(lr=0.2)
    with pytest.raises(ValueError, match="lr=0.2 but its compressor .* lr=0.1"):
        lookup("communicator", "allgather")(comp, mem)


def test_efsignsgd_memory_checkpoint_round_trip():
    grads = np.random.default_rng(13).standard_normal((4, 10))
    _, mem, _ = run_ef("torch", grads[:2], 0.2)
    fresh = lookup("memory", "efsignsgd")(lr=0.2)
    fresh.load_state_dict(mem.state_dict())
    for g in grads[2:]:
        a = mem.compensate(torch.from_numpy(g), "w")
        b = fresh.compensate(torch.from_numpy(g), "w")
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ torch == TF, graph mode
@pytest.mark.parametrize("name", list(METHODS))
def test_torch_equals_tf_over_steps(name):
    rng = np.random.default_rng(21)
    ct, cf = make(name), make(name)
    for _ in range(4):
        g = rng.standard_normal((9, 11)).astype(np.float32)
        pt, ot = round_trip(ct, torch.from_numpy(g))
        pf, of = round_trip(cf, tf.constant(g))
        np.testing.assert_array_equal(np_of(pt[0]), np_of(pf[0]))  # same bytes
        for a, b in zip(pt[1:], pf[1:]):
            np.testing.assert_allclose(np_of(a), np_of(b), rtol=1e-6)
        np.testing.assert_allclose(np_of(ot), np_of(of), rtol=1e-6)


@pytest.mark.parametrize("name", list(METHODS))
def test_inside_tf_function(name):
    eager, graph = make(name), make(name)

    @tf.function
    def step(x):
        payload, ctx = graph.compress(x, "w")
        return payload, graph.decompress(payload, ctx)

    rng = np.random.default_rng(31)
    for _ in range(3):
        g = tf.constant(rng.standard_normal((4, 6)).astype(np.float32))
        pe, oe = round_trip(eager, g)
        pg, og = step(g)
        np.testing.assert_array_equal(np_of(pe[0]), np_of(pg[0]))
        np.testing.assert_allclose(np_of(oe), np_of(og), rtol=1e-6)
    assert step.experimental_get_tracing_count() == 1


def test_efsignsgd_memory_inside_tf_function():
    comp = lookup("compressor", "efsignsgd")(lr=0.1)
    mem = lookup("memory", "efsignsgd")(lr=0.1)

    @tf.function
    def step(g):
        p = mem.compensate(g, "w")
        payload, ctx = comp.compress(p, "w")
        mem.update(p, "w", comp, payload, ctx)
        return comp.decompress(payload, ctx)

    grads = np.random.default_rng(41).standard_normal((5, 12)).astype(np.float32)
    sent = [np_of(step(tf.constant(g))) for g in grads]
    ref_sent, ref_e = reference_ef_signsgd(grads.astype(np.float64), 0.1)
    np.testing.assert_allclose(sent, ref_sent, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(mem.state_dict()["w"], ref_e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_efsignsgd_result_does_not_depend_on_a_shared_lr(fw):
    grads = np.random.default_rng(14).standard_normal((4, 30))
    results = []
    for lr in (1.0, 0.01):
        comp, _, sent = run_ef(fw, grads, lr)
        results.append([np_of(comp.aggregate([s])) for s in sent])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert lookup("compressor", "efsignsgd")().lr == lookup("memory", "efsignsgd")().lr == 1.0


# ------------------------------------------------------------------ real Horovod, 2 ranks
def replay_allgather(params, grads_by_rank):
    """Single-process replay of what the allgather communicator computes, per step: each rank
    compensates, compresses and updates its own memory; every rank decompresses all payloads
    and aggregates them in rank order; the result is averaged when the compressor says so."""
    ranks = []
    for _ in grads_by_rank:
        grc = grace_from_params({**params, "communicator": "allgather"})  # no collective used
        ranks.append((grc.compressor, grc.memory))
    results = []
    for step in range(len(grads_by_rank[0])):
        decoded = []
        for (comp, mem), grads in zip(ranks, grads_by_rank):
            p = mem.compensate(torch.from_numpy(grads[step]), "w")
            payload, ctx = comp.compress(p, "w")
            mem.update(p, "w", comp, payload, ctx)
            decoded.append(comp.decompress(payload, ctx))
        out = ranks[0][0].aggregate(decoded)
        if ranks[0][0].caps.average:
            out = out / len(ranks)
        results.append(out.numpy())
    return results


@pytest.mark.multiproc
@pytest.mark.parametrize("mode,launcher", [("torch", "gloo"), ("tf-graph", "mpi")])
def test_sign_methods_through_allgather_on_two_ranks(mode, launcher):
    size = 2
    results = mp.run("signs_allgather.py", np=size, launcher=launcher, args=[mode], timeout=300)
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == size for r in results)
    grads = [[grad(r, s) for s in range(STEPS)] for r in range(size)]
    n = int(np.prod(SHAPE))
    for key, params in CONFIGS.items():
        expect = replay_allgather(params, grads)
        comp = lookup("compressor", key)()
        # a payload whose size varies travels with its int32 length
        nbytes = comp.payload_nbytes(n) + (0 if comp.caps.equal_sizes else 4)
        for res in results:
            for step in range(STEPS):
                got = res[key]["out"][step]
                assert got.shape == SHAPE
                np.testing.assert_allclose(got, expect[step], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{key} step {step}")
                counted = res[key]["bytes"][step]
                assert counted["sent"] == nbytes and counted["received"] == nbytes * (size - 1)
        if key == "signsgd":  # the majority vote itself, from the raw gradients
            for step in range(STEPS):
                vote = np.sign(sum(np.sign(grads[r][step]) for r in range(size)))
                for res in results:
                    np.testing.assert_array_equal(res[key]["out"][step], vote)
                assert np.any(vote == 0) and np.any(vote != 0)  # ties and agreements both seen
    np.testing.assert_array_equal(results[0]["onebit"]["out"], results[1]["onebit"]["out"])


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_vote_keeps_a_ranks_nan(fw, name):
    ranks = [make(name) for _ in range(3)]
    grads = [[1.0, -2.0, np.nan], [1.0, -1.0, 3.0], [2.0, -1.0, 3.0]]
    decoded = [r.decompress(*r.compress(tensor(fw, g), "w")) for r, g in zip(ranks, grads)]
    voted = np_of(ranks[0].aggregate(decoded))
    assert np.isnan(voted).all(), voted


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_entries_zero_on_every_rank_vote_zero(fw, name):
    ranks = [make(name) for _ in range(2)]
    grads = [[0.0, 0.0, 1.0, 0.0], [0.0, -1.0, 2.0, 0.0]]
    decoded = [r.decompress(*r.compress(tensor(fw, g), "w")) for r, g in zip(ranks, grads)]
    np.testing.assert_array_equal(np_of(ranks[0].aggregate(decoded)), [0, -1, 1, 0])


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7, 8, 9])
def test_vote_on_packed_planes_equals_the_vote_of_decoded_signs(fw, ranks):
    """``combine`` counts the vote bit-sliced on the packed planes (two's complement over
    bit_length(N) + 1 planes): the same -1/0/+1 as the sign of the decoded signs' sum, for
    any number of ranks, with ties, zeros, a length that leaves padding bits, and (torch)
    written into a given buffer."""
    rng = np.random.default_rng(ranks)
    n = 8 * 37 + 5
    grads = rng.integers(-1, 2, (ranks, n)).astype(np.float32) * rng.random((ranks, n))
    grads[:, :4] = 0.0
    grads[: ranks // 2, 4] = 1.0        # an even split where N is even: a tie
    grads[ranks // 2:, 4] = -1.0 if ranks % 2 == 0 else 0.0
    comp = make("signsgd")
    sent = [comp.compress(tensor(fw, g), "w") for g in grads]
    ctx = sent[0][1]
    expected = np.sign(np.sign(grads).sum(axis=0))
    np.testing.assert_array_equal(np_of(own(comp).combine([p for p, _ in sent], ctx)), expected)
    np.testing.assert_array_equal(
        np_of(comp.aggregate([comp.decompress(p, c) for p, c in sent])), expected)
    if fw == "torch":
        out = torch.full((n,), 5.0)
        got = own(comp).combine([p for p, _ in sent], ctx, out)
        assert got is out
        np.testing.assert_array_equal(out.numpy(), expected)
