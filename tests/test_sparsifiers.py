"""Sparsifiers (topk, randomk, threshold, dgc, adaq) and the dgc memory, in torch and TF."""

import math

import numpy as np
import pytest
import tensorflow as tf
import torch

from grace_dl import seeding
from grace_dl.backend import ops_for
from grace_dl.compressors import sparse
from grace_dl.compressors.adaq import AdaqCompressor
from grace_dl.compressors.dgc import DgcCompressor
from grace_dl.compressors.randomk import RandomKCompressor
from grace_dl.compressors.threshold import ThresholdCompressor
from grace_dl.compressors.topk import TopKCompressor
from grace_dl.memory.dgc import DgcMemory
from grace_dl.memory.residual import ResidualMemory

FRAMEWORKS = ["torch", "tf"]


def tensor(fw, arr):
    return torch.from_numpy(np.array(arr)) if fw == "torch" else tf.constant(arr)


def numpy(x):
    return x.detach().float().numpy() if isinstance(x, torch.Tensor) and \
        x.dtype == torch.bfloat16 else np.asarray(x)


def gaussian(n, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


def sent_positions(payload):
    return np.sort(numpy(payload[1]).astype(np.int64))


# ------------------------------------------------------------------ topk
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("n, ratio", [(1000, 0.01), (1000, 0.37), (200_000, 0.01)])
def test_topk_keeps_exactly_the_k_largest_magnitudes(fw, approximate, n, ratio):
    x = gaussian(n, seed=n)
    comp = TopKCompressor(ratio, approximate=approximate)
    payload, ctx = comp.compress(tensor(fw, x), "w")
    k = math.ceil(ratio * n)
    assert numpy(payload[1]).dtype == np.int32 and numpy(payload[0]).shape == (k,)
    np.testing.assert_array_equal(sent_positions(payload), np.sort(np.argsort(-np.abs(x))[:k]))
    np.testing.assert_array_equal(numpy(payload[0]), x[numpy(payload[1])])
    dense = numpy(comp.decompress(payload, ctx))
    expect = np.zeros_like(x)
    expect[numpy(payload[1])] = x[numpy(payload[1])]
    np.testing.assert_array_equal(dense, expect)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_topk_ties_go_to_the_lowest_positions(fw):
    x = np.array([1.0, -3.0, 3.0, 0.5, 3.0, -3.0, 2.0], np.float32)
    payload, _ = TopKCompressor(3 / 7, approximate=False).compress(tensor(fw, x), "t")
    np.testing.assert_array_equal(sent_positions(payload), [1, 2, 4])
    zeros = TopKCompressor(0.25, approximate=False).compress(tensor(fw, np.zeros(8, np.float32)),
                                                             "z")[0]
    np.testing.assert_array_equal(sent_positions(zeros), [0, 1])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_approximate_topk_matches_exact_magnitude_on_gaussian_data(fw):
    n, ratio = 300_000, 0.01
    x = gaussian(n, seed=7)
    exact = TopKCompressor(ratio, approximate=False).compress(tensor(fw, x), "g")[0]
    approx_comp = TopKCompressor(ratio, approximate=True, seed=3)
    for _ in range(3):  # a fresh sample each step
        approx = approx_comp.compress(tensor(fw, x), "g")[0]
        assert numpy(approx[0]).shape == (math.ceil(ratio * n),)
        kept = np.abs(numpy(approx[0])).sum(dtype=np.float64)
        best = np.abs(numpy(exact[0])).sum(dtype=np.float64)
        assert abs(kept - best) <= 0.01 * best
        np.testing.assert_array_equal(sent_positions(approx), sent_positions(exact))


@pytest.mark.parametrize("fw, graph", [("torch", False), ("tf", False), ("tf", True)])
def test_approximate_topk_falls_back_to_exact_when_the_sample_overshoots(fw, graph):
    # Plant large values exactly where the sample looks: the estimated threshold lies above
    # the k-th magnitude, fewer than k entries pass it, and the exact path must take over.
    n, ratio, seed, name = 4 * sparse.APPROX_MIN_NUMEL, 0.1, 5, "planted"
    x = gaussian(n, seed=1) * 1e-3
    sampled = seeding.choice(seed, name, 1, n, sparse.sample_size(n))
    x[sampled] = 10.0 + np.arange(sampled.size, dtype=np.float32) * 1e-3
    k = math.ceil(ratio * n)
    assert sampled.size < k
    comp = TopKCompressor(ratio, approximate=True, seed=seed)
    fn = tf.function(comp.compress) if graph else comp.compress
    payload, _ = fn(tensor(fw, x), name)
    np.testing.assert_array_equal(sent_positions(payload), np.sort(np.argsort(-np.abs(x))[:k]))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_topk_nan_ranks_last_and_inf_first(fw):
    x = np.array([np.nan, 1.0, -np.inf, 2.0, np.nan, 0.5], np.float32)
    payload, ctx = TopKCompressor(0.5, approximate=False).compress(tensor(fw, x), "n")
    np.testing.assert_array_equal(sent_positions(payload), [1, 2, 3])
    all_nan = TopKCompressor(0.5).compress(tensor(fw, np.full(4, np.nan, np.float32)), "m")[0]
    assert numpy(all_nan[0]).shape == (2,)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_sparsifiers_keep_the_input_dtype(fw, dtype):
    x32 = gaussian(300, seed=2)
    if fw == "torch":
        x = torch.from_numpy(x32).to(getattr(torch, dtype))
    else:
        x = tf.cast(tf.constant(x32), dtype)
    for comp in [TopKCompressor(0.1), RandomKCompressor(0.1), ThresholdCompressor(1.0),
                 DgcCompressor(0.1), AdaqCompressor(0.1)]:
        payload, ctx = comp.compress(x, "d")
        out = comp.decompress(payload, ctx)
        assert ops_for(out).dtype(out) == dtype, (comp, out.dtype)
        assert tuple(out.shape) == (300,)


def test_non_contiguous_torch_input():
    base = torch.from_numpy(gaussian(400, seed=4).reshape(20, 20))
    x = base.t()
    assert not x.is_contiguous()
    for comp in [TopKCompressor(0.05), RandomKCompressor(0.05), DgcCompressor(0.05),
                 ThresholdCompressor(1.0), AdaqCompressor(0.05)]:
        payload, ctx = comp.compress(x, "nc")
        out = comp.decompress(payload, ctx)
        kept = out != 0
        assert torch.equal(out[kept], x[kept]) or isinstance(comp, AdaqCompressor)
        assert out.shape == x.shape


# ------------------------------------------------------------------ randomk
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_randomk_indices_shared_across_instances_whatever_the_order(fw):
    names = ["a", "b", "c"]
    x = {nm: tensor(fw, gaussian(5000, seed=i)) for i, nm in enumerate(names)}
    first, second = RandomKCompressor(0.02, seed=11), RandomKCompressor(0.02, seed=11)
    drawn_1 = {(nm, s): first.compress(x[nm], nm)[1][2] for s in (1, 2) for nm in names}
    drawn_2 = {(nm, s): second.compress(x[nm], nm)[1][2]
               for s in (1, 2) for nm in reversed(names)}
    for key in drawn_1:
        idx = numpy(drawn_1[key])
        np.testing.assert_array_equal(idx, numpy(drawn_2[key]))
        assert idx.size == 100 and np.unique(idx).size == 100  # without replacement
    sets = {key: frozenset(numpy(v).tolist()) for key, v in drawn_1.items()}
    assert len(set(sets.values())) == len(sets)  # every (name, step) draws its own positions
    assert sets[("a", 1)] != sets[("a", 2)] and sets[("a", 1)] != sets[("b", 1)]


def test_randomk_torch_and_tf_draw_the_same_and_sums_decompress_once():
    x = gaussian(3000, seed=9)
    pt, ct = RandomKCompressor(0.05, seed=2).compress(torch.from_numpy(x), "r")
    pf, cf = RandomKCompressor(0.05, seed=2).compress(tf.constant(x), "r")
    np.testing.assert_array_equal(numpy(ct[2]), numpy(cf[2]))
    np.testing.assert_array_equal(numpy(pt[0]), numpy(pf[0]))
    # allreduce-safe: two ranks' payloads summed decompress to the sum of their decompressions
    other = RandomKCompressor(0.05, seed=2).compress(torch.from_numpy(2 * x), "r")[0]
    comp = RandomKCompressor(0.05, seed=2)
    summed = comp.decompress([pt[0] + other[0]], ct)
    np.testing.assert_allclose(numpy(summed), 3 * numpy(comp.decompress(pt, ct)), rtol=1e-6)
    assert pt[0].numel() * 4 == comp.payload_nbytes(3000)


# ------------------------------------------------------------------ threshold
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_threshold_below_everything_sends_nothing(fw):
    comp = ThresholdCompressor(0.5)
    x = np.array([[0.1, -0.5], [0.49, 0.0]], np.float32)
    payload, ctx = comp.compress(tensor(fw, x), "q")
    assert numpy(payload[0]).size == 0 and numpy(payload[1]).size == 0
    np.testing.assert_array_equal(numpy(comp.decompress(payload, ctx)), np.zeros((2, 2)))
    assert comp.payload_nbytes(4) is None and comp.caps.equal_sizes is False


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_threshold_compares_magnitudes(fw):
    x = np.array([0.7, -0.9, 0.2, -0.1, np.inf, np.nan], np.float32)
    payload, ctx = ThresholdCompressor(0.5).compress(tensor(fw, x), "m")
    np.testing.assert_array_equal(sent_positions(payload), [0, 1, 4])
    np.testing.assert_array_equal(numpy(payload[0]), x[[0, 1, 4]])


def test_threshold_variable_count_in_tf_graph():
    comp = ThresholdCompressor(1.0)

    @tf.function(input_signature=[tf.TensorSpec([500], tf.float32)])
    def round_trip(t):
        payload, ctx = comp.compress(t, "g")
        return payload[1], comp.decompress(payload, ctx)

    for seed in (0, 1):
        x = gaussian(500, seed=seed)
        idx, dense = round_trip(tf.constant(x))
        np.testing.assert_array_equal(idx.numpy(), np.nonzero(np.abs(x) > 1.0)[0])
        np.testing.assert_array_equal(dense.numpy(), np.where(np.abs(x) > 1.0, x, 0))


# ------------------------------------------------------------------ dgc compressor
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_dgc_sends_at_most_k_of_the_largest(fw):
    n, ratio = 200_000, 0.01
    x = gaussian(n, seed=12)
    comp = DgcCompressor(ratio, seed=1)
    k = math.ceil(ratio * n)
    for _ in range(3):
        payload, _ = comp.compress(tensor(fw, x), "d")
        got = sent_positions(payload)
        assert 0.8 * k <= got.size <= k
        # what is sent is a top set: nothing left out is larger than anything sent
        left_out = np.delete(np.abs(x), got)
        assert left_out.max() <= np.abs(x[got]).min()


def test_dgc_warmup_ramps_the_ratio_exponentially():
    n, ratio, warm = 1000, 0.001, 4
    comp = DgcCompressor(ratio, warmup_steps=warm)
    x = torch.from_numpy(gaussian(n, seed=3))
    counts = [comp.compress(x, "w")[0][0].numel() for _ in range(7)]
    expect = [math.ceil(ratio ** (min(t, warm + 1) / (warm + 1)) * n) for t in range(1, 8)]
    assert counts == expect == [252, 64, 16, 4, 1, 1, 1]


def test_dgc_warmup_in_tf_graph_matches_eager():
    x = gaussian(100_000, seed=8)
    eager, graph = DgcCompressor(0.01, warmup_steps=2), DgcCompressor(0.01, warmup_steps=2)
    fn = tf.function(lambda t: graph.compress(t, "w")[0])
    for _ in range(4):
        e = eager.compress(tf.constant(x), "w")[0]
        g = fn(tf.constant(x))
        np.testing.assert_array_equal(e[1].numpy(), g[1].numpy())
        np.testing.assert_array_equal(e[0].numpy(), g[0].numpy())


# ------------------------------------------------------------------ adaq
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("n, planted", [(2000, False), (100_000, False), (2 * 65536, True)])
def test_adaq_is_sparse_ternary_with_per_sign_means(fw, n, planted):
    x = gaussian(n, seed=21)
    x[:100] = 0.0
    ratio = 0.05
    if planted:  # the sampled threshold overshoots on the positive side: exact path
        ratio = 0.3
        x[seeding.choice(0, "a", 1, n, sparse.sample_size(n))] = 10.0
    comp = AdaqCompressor(ratio)
    payload, ctx = comp.compress(tensor(fw, x), "a")
    out = numpy(comp.decompress(payload, ctx))
    pos, neg = np.nonzero(x > 0)[0], np.nonzero(x < 0)[0]
    top_pos = pos[np.argsort(-x[pos], kind="stable")[:math.ceil(ratio * pos.size)]]
    top_neg = neg[np.argsort(x[neg], kind="stable")[:math.ceil(ratio * neg.size)]]
    expect = np.zeros_like(x)
    expect[top_pos] = x[top_pos].mean()
    expect[top_neg] = x[top_neg].mean()
    np.testing.assert_allclose(out, expect, rtol=1e-5)
    codes = numpy(payload[1])
    assert codes.dtype == np.int32 and codes.size == top_pos.size + top_neg.size
    assert numpy(payload[0]).shape == (2,)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_adaq_one_signed_and_all_zero_tensors(fw):
    comp = AdaqCompressor(0.5)
    payload, ctx = comp.compress(tensor(fw, np.array([1.0, 2.0, 3.0, 4.0], np.float32)), "p")
    np.testing.assert_allclose(numpy(comp.decompress(payload, ctx)), [0, 0, 3.5, 3.5])
    payload, ctx = comp.compress(tensor(fw, np.zeros((2, 3), np.float32)), "z")
    assert numpy(payload[1]).size == 0
    np.testing.assert_array_equal(numpy(comp.decompress(payload, ctx)), np.zeros((2, 3)))


# ------------------------------------------------------------------ every sparsifier
def make_all():
    return [TopKCompressor(0.05, approximate=False), TopKCompressor(0.01, approximate=True),
            RandomKCompressor(0.05, seed=4), ThresholdCompressor(1.5), DgcCompressor(0.02),
            DgcCompressor(0.01, warmup_steps=2), AdaqCompressor(0.05)]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("index", range(len(make_all())))
def test_residual_error_feedback_loses_nothing(fw, index):
    comp, memory = make_all()[index], ResidualMemory()
    n = 70_000 if isinstance(comp, TopKCompressor) and comp.approximate else 3000
    total_grad, total_sent = np.zeros(n), np.zeros(n)
    for step in range(4):
        g = gaussian(n, seed=100 + step, dtype=np.float64)
        compensated = memory.compensate(tensor(fw, g), "ef")
        payload, ctx = comp.compress(compensated, "ef")
        memory.update(compensated, "ef", comp, payload, ctx)
        total_grad += g
        total_sent += numpy(comp.decompress(payload, ctx))
    residual = memory.state_dict()["ef"]
    assert np.abs(total_sent).sum() > 0
    np.testing.assert_allclose(total_sent, total_grad - residual, atol=1e-12)


@pytest.mark.parametrize("index", range(len(make_all())))
def test_torch_equals_tf_eager_and_graph(index):
    x = gaussian(70_000, seed=31)
    ct, ce, cg = make_all()[index], make_all()[index], make_all()[index]
    fn = tf.function(lambda t: cg.compress(t, "same"))
    for _ in range(2):
        pt, xt = ct.compress(torch.from_numpy(x), "same")
        pe, xe = ce.compress(tf.constant(x), "same")
        pg, xg = fn(tf.constant(x))
        for a, b, c in zip(pt, pe, pg):
            np.testing.assert_array_equal(numpy(a), numpy(b))
            np.testing.assert_array_equal(numpy(a), numpy(c))
        np.testing.assert_array_equal(numpy(ct.decompress(pt, xt)),
                                      numpy(ce.decompress(pe, xe)))


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("shape", [(), (1,), (0,), (3, 0)])
def test_tiny_and_empty_tensors(fw, shape):
    x = np.full(shape, 2.5, np.float32)
    for comp in make_all():
        payload, ctx = comp.compress(tensor(fw, x), "tiny")
        out = numpy(comp.decompress(payload, ctx))
        assert out.shape == shape
        nbytes = sum(numpy(p).nbytes for p in payload)
        expect = comp.payload_nbytes(x.size, "float32")
        if expect is not None:
            assert nbytes == expect
        if x.size and not isinstance(comp, ThresholdCompressor):
            np.testing.assert_array_equal(out, x)  # k = 1 keeps the single element


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_payload_bytes_match_the_formula(fw):
    for dtype in ["float32", "float64"]:
        x = tensor(fw, gaussian(1234, seed=5, dtype=dtype))
        for comp in [TopKCompressor(0.03), RandomKCompressor(0.03)]:
            payload, _ = comp.compress(x, "b")
            assert sum(numpy(p).nbytes for p in payload) == comp.payload_nbytes(1234, dtype)
    assert TopKCompressor(0.01).payload_nbytes(1000, "float16") == 10 * 6
    assert RandomKCompressor(0.01).payload_nbytes(1001, "float32") == 11 * 4


@pytest.mark.parametrize("cls", [TopKCompressor, RandomKCompressor, DgcCompressor])
def test_state_dict_round_trip_continues_the_same_draws(cls):
    x = torch.from_numpy(gaussian(100_000, seed=41))
    a = cls(0.01, seed=6)
    for _ in range(3):
        a.compress(x, "s")
    b = cls(0.01, seed=6)
    b.load_state_dict(a.state_dict())
    pa, ca = a.compress(x, "s")
    pb, cb = b.compress(x, "s")
    np.testing.assert_array_equal(numpy(a.decompress(pa, ca)), numpy(b.decompress(pb, cb)))
    assert int(a.state_dict()["step/s"]) == 4


# ------------------------------------------------------------------ dgc memory
def dgc_step(memory, comp, g, name="m"):
    compensated = memory.compensate(g, name)
    payload, ctx = comp.compress(compensated, name)
    memory.update(compensated, name, comp, payload, ctx)
    return numpy(compensated), numpy(comp.decompress(payload, ctx))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_dgc_memory_momentum_correction_and_factor_masking(fw):
    m = 0.9
    memory, comp = DgcMemory(momentum=m), TopKCompressor(0.25, approximate=False)
    u, v = np.zeros(8), np.zeros(8)
    for step in range(5):
        g = gaussian(8, seed=50 + step, dtype=np.float64)
        u = m * u + g
        v = v + u
        compensated, sent = dgc_step(memory, comp, tensor(fw, g))
        np.testing.assert_allclose(compensated, v, rtol=1e-12)
        mask = sent != 0
        assert mask.sum() == 2
        np.testing.assert_allclose(sent[mask], v[mask])
        v[mask] = 0.0
        u[mask] = 0.0
        state = memory.state_dict()
        np.testing.assert_allclose(state["velocity/m"], v, atol=1e-12)
        np.testing.assert_allclose(state["momentum/m"], u, atol=1e-12)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_dgc_memory_clips_by_norm(fw):
    memory = DgcMemory(momentum=0.5, gradient_clipping=2.0)
    big = np.array([3.0, 4.0, 0.0, 0.0])          # norm 5 -> scaled to norm 2
    out = numpy(memory.compensate(tensor(fw, big), "c"))
    np.testing.assert_allclose(out, big * 2.0 / 5.0, rtol=1e-6)
    small = np.array([0.3, 0.4, 0.0, 0.0])        # norm 0.5 -> untouched
    fresh = DgcMemory(momentum=0.5, gradient_clipping=2.0)
    np.testing.assert_allclose(numpy(fresh.compensate(tensor(fw, small), "c")), small, rtol=1e-6)


def test_dgc_memory_state_dict_round_trip_and_tf_graph():
    grads = [gaussian(6, seed=60 + i) for i in range(4)]
    a, comp = DgcMemory(0.8, gradient_clipping=3.0), TopKCompressor(0.34, approximate=False)
    for g in grads[:2]:
        dgc_step(a, comp, torch.from_numpy(g))
    b = DgcMemory(0.8, gradient_clipping=3.0)
    b.load_state_dict(a.state_dict())
    graph_mem = DgcMemory(0.8, gradient_clipping=3.0)
    graph_mem.load_state_dict(a.state_dict())
    graph_step = tf.function(lambda g: graph_mem.compensate(g, "m"))
    for g in grads[2:]:
        ca, sa = dgc_step(a, comp, torch.from_numpy(g))
        cb, sb = dgc_step(b, comp, tf.constant(g))
        np.testing.assert_allclose(ca, cb, rtol=1e-6)
        np.testing.assert_allclose(sa, sb, rtol=1e-6)
    np.testing.assert_allclose(graph_step(tf.constant(grads[2])).numpy(),
                               _replay(grads, 0.8, 3.0), rtol=1e-5)


def _replay(grads, momentum, clip):
    """v after two masked steps and one more compensate, recomputed with NumPy."""
    u, v = np.zeros(6), np.zeros(6)
    for i, g in enumerate(grads[:3]):
        g = g * min(1.0, clip / np.linalg.norm(g))
        u = momentum * u + g
        v = v + u
        if i < 2:
            keep = np.sort(np.argsort(-np.abs(v), kind="stable")[:math.ceil(0.34 * 6)])
            v[keep] = 0.0
            u[keep] = 0.0
    return v


def test_dgc_memory_and_compressor_in_one_tf_function_match_eager():
    grads = [gaussian(70_000, seed=70 + i) for i in range(3)]
    eager = (DgcMemory(0.9, gradient_clipping=50.0), DgcCompressor(0.01, warmup_steps=1))
    graph = (DgcMemory(0.9, gradient_clipping=50.0), DgcCompressor(0.01, warmup_steps=1))

    @tf.function
    def graph_step(g):
        compensated = graph[0].compensate(g, "m")
        payload, ctx = graph[1].compress(compensated, "m")
        graph[0].update(compensated, "m", graph[1], payload, ctx)
        return graph[1].decompress(payload, ctx)

    for g in grads:
        _, sent = dgc_step(eager[0], eager[1], tf.constant(g))
        np.testing.assert_allclose(graph_step(tf.constant(g)).numpy(), sent, rtol=1e-6)
    for key, value in eager[0].state_dict().items():
        np.testing.assert_allclose(graph[0].state_dict()[key], value, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ construction
@pytest.mark.parametrize("build, match", [
    (lambda: TopKCompressor(0.0), "compress_ratio"),
    (lambda: TopKCompressor(1.5), "compress_ratio"),
    (lambda: TopKCompressor(float("nan")), "compress_ratio"),
    (lambda: TopKCompressor(0.1, approximate="yes"), "approximate"),
    (lambda: RandomKCompressor(0.1, seed=-1), "seed"),
    (lambda: ThresholdCompressor(-1.0), "threshold"),
    (lambda: ThresholdCompressor(float("inf")), "threshold"),
    (lambda: DgcCompressor(0.01, warmup_steps=-2), "warmup_steps"),
    (lambda: DgcCompressor(0.01, warmup_steps=1.5), "warmup_steps"),
    (lambda: AdaqCompressor(2.0), "compress_ratio"),
    (lambda: DgcMemory(momentum=1.0), "momentum"),
    (lambda: DgcMemory(gradient_clipping=True), "gradient_clipping"),
    (lambda: DgcMemory(gradient_clipping=-1.0), "gradient_clipping"),
])
def test_bad_parameters_are_rejected(build, match):
    with pytest.raises(ValueError, match=match):
        build()
