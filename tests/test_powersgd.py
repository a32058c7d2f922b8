"""PowerSGD compressor and memory. Single process: the communicator's two-round loop is
simulated (payloads of W instances summed), for torch and TensorFlow tensors, eager and in
tf.function, against a NumPy float64 reference of the paper's algorithm. Multi-process: real
2-rank horovodrun/mpirun jobs through grace_from_params and the allreduce communicator, against
that simulation."""

import numpy as np
import pytest
import tensorflow as tf
import torch
from workers import powersgd_check as job

import mp
from grace_dl import grace_from_params, seeding
from grace_dl.backend import ops_for
from grace_dl.compressors.paths import own
from grace_dl.compressors.powersgd import PowerSGDCompressor
from grace_dl.memory.none import NoneMemory
from grace_dl.memory.powersgd import PowerSGDMemory
from support import OneRank

FRAMEWORKS = ["torch", "tensorflow"]


def as_tensor(fw, arr, dtype="float32"):
    arr = np.asarray(arr, np.float64 if dtype == "float64" else np.float32)
    if fw == "torch":
        return torch.tensor(arr).to(getattr(torch, dtype))
    return tf.cast(tf.constant(arr), dtype)


def as_numpy(x):
    return ops_for(x).to_numpy(x).astype(np.float64)


def layer(fw, mat):
    """A weight matrix given in torch's (out, in) layout, as ``fw`` stores it (Keras: (in, out))."""
    return as_tensor(fw, mat if fw == "torch" else mat.T)


def unlayer(fw, x):
    """Back to torch's (out, in) layout, as NumPy."""
    return as_numpy(x) if fw == "torch" else as_numpy(x).T


def reduce_all(comps, mems, grads, name):
    """One step of the allreduce communicator's loop over W simulated ranks: returns each rank's
    averaged result, and the per-round payloads of rank 0."""
    compensated = [m.compensate(g, name) for m, g in zip(mems, grads)]
    outs = [c.compress(x, name) for c, x in zip(comps, compensated)]
    sent = []
    while True:
        sent.append(outs[0][0])
        reduced = [sum(o[0][i] for o in outs) for i in range(len(outs[0][0]))]
        nxt = [c.next_round(reduced, ctx) for c, (_, ctx) in zip(comps, outs)]
        if all(n is None for n in nxt):
            break
        assert not any(n is None for n in nxt), "ranks disagree on the number of rounds"
        outs = nxt
    results = [c.decompress(reduced, ctx) for c, (_, ctx) in zip(comps, outs)]
    for m, c, x, (_, ctx) in zip(mems, comps, compensated, outs):
        m.update(x, name, c, reduced, ctx)
    return [r / len(comps) for r in results], sent


def make(world, memory=True, **kw):
    comps = [PowerSGDCompressor(**kw) for _ in range(world)]
    mems = [PowerSGDMemory() if memory else NoneMemory() for _ in range(world)]
    return comps, mems


def low_rank(rng, n, m, r):
    return rng.standard_normal((n, r)) @ rng.standard_normal((r, m))


def reference(steps, seed, name, r, memory=True):
    """The paper's Algorithm 1 in float64 NumPy: steps[t][w] is rank w's gradient (n x m) at
    step t; returns the averaged result of each step. Orthonormalization by QR: another basis of
    the same span than Gram–Schmidt's, and the results depend only on the span."""
    world = len(steps[0])
    n, m = steps[0][0].shape
    q = seeding.normal(seed, name, 0, (m, r)).astype(np.float64)
    errors = [np.zeros((n, m)) for _ in range(world)]
    out = []
    for grads in steps:
        ms = [g + e for g, e in zip(grads, errors)] if memory else list(grads)
        p_hat = np.linalg.qr(sum(mw @ q for mw in ms))[0]
        qs = [mw.T @ p_hat for mw in ms]
        out.append(p_hat @ sum(qs).T / world)
        if memory:
            errors = [mw - p_hat @ qw.T for mw, qw in zip(ms, qs)]
        q = sum(qs)
    return out


def rel_err(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


# ------------------------------------------------------------------ exactness, power iteration
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rank_r_matrix_is_reconstructed_exactly(fw, r, dtype):
    rng = np.random.default_rng(r)
    target = low_rank(rng, 24, 18, r)
    comps, mems = make(1, compress_rank=r)
    (out,), _ = reduce_all(comps, mems, [as_tensor(fw, target, dtype)], "w")
    assert ops_for(out).shape(out) == (24, 18)
    # float32: one power step from a random Q can meet an ill-conditioned P (cond ~ 500 here)
    assert rel_err(as_numpy(out), target) < (1e-4 if dtype == "float32" else 1e-10)
    # a rank-(r+1) matrix is not: the test can fail
    comps, mems = make(1, compress_rank=r)
    full = target + low_rank(rng, 24, 18, 1)
    (out,), _ = reduce_all(comps, mems, [as_tensor(fw, full)], "w")
    assert rel_err(as_numpy(out), full) > 1e-2


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_two_ranks_match_the_reference_and_average_exactly_in_a_shared_subspace(fw):
    rng = np.random.default_rng(7)
    basis = rng.standard_normal((16, 2))
    grads = [basis @ rng.standard_normal((2, 12)) for _ in range(2)]
    comps, mems = make(2, compress_rank=2, seed=3)
    outs, _ = reduce_all(comps, mems, [layer(fw, g) for g in grads], "layer")
    np.testing.assert_array_equal(as_numpy(outs[0]), as_numpy(outs[1]))
    assert rel_err(unlayer(fw, outs[0]), (grads[0] + grads[1]) / 2) < 1e-4

    steps = [[rng.standard_normal((16, 12)) for _ in range(2)] for _ in range(4)]
    comps, mems = make(2, compress_rank=2, seed=3)
    expected = reference(steps, 3, "layer", 2)
    for grads, want in zip(steps, expected):
        outs, _ = reduce_all(comps, mems, [layer(fw, g) for g in grads], "layer")
        assert rel_err(unlayer(fw, outs[0]), want) < 1e-4
        np.testing.assert_array_equal(as_numpy(outs[0]), as_numpy(outs[1]))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_warm_start_power_iteration_improves_the_approximation_every_step(fw):
    rng = np.random.default_rng(1)
    u = np.linalg.qr(rng.standard_normal((30, 30)))[0]
    v = np.linalg.qr(rng.standard_normal((20, 20)))[0]
    spectrum = 0.7 ** np.arange(20)
    g = (u[:, :20] * spectrum) @ v.T
    r = 2
    best = np.linalg.norm(spectrum[r:])  # Eckart–Young: the best rank-2 error
    comps, mems = make(1, memory=False, compress_rank=r)
    errors = []
    for _ in range(12):
        (out,), _ = reduce_all(comps, mems, [as_tensor(fw, g)], "fc")
        errors.append(np.linalg.norm(as_numpy(out) - g))
    assert all(b <= a * (1 + 1e-5) for a, b in zip(errors, errors[1:])), errors
    assert errors[0] > 1.02 * best
    assert errors[-1] < 1.001 * best


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_error_feedback_loses_nothing_and_the_running_mean_converges(fw):
    rng = np.random.default_rng(2)
    g = rng.standard_normal((12, 10))
    comps, mems = make(2, compress_rank=2)
    total = np.zeros_like(g)
    gaps = []
    for t in range(1, 17):
        outs, _ = reduce_all(comps, mems, [as_tensor(fw, g + 0.1), as_tensor(fw, g - 0.1)], "x")
        total += as_numpy(outs[0])
        gaps.append(np.linalg.norm(total / t - g))
        residual = sum(as_numpy(mems[w].state.variables()["x"]) for w in range(2)) / 2
        # what was applied plus the average residual is exactly the average gradient sum
        np.testing.assert_allclose(total + residual, t * g, atol=1e-4)
    assert gaps[-1] < 0.3 * gaps[0], gaps


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_memory_keeps_this_ranks_share_not_the_average(fw):
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal((10, 8)) for _ in range(2)]
    comps, mems = make(2, compress_rank=1)
    reduce_all(comps, mems, [layer(fw, x) for x in grads], "y")
    q0 = seeding.normal(0, "y", 0, (8, 1)).astype(np.float64)
    p_hat = np.linalg.qr((grads[0] + grads[1]) @ q0)[0]
    for w in range(2):
        want = grads[w] - p_hat @ (p_hat.T @ grads[w])
        np.testing.assert_allclose(unlayer(fw, mems[w].state.variables()["y"]), want, atol=1e-5)


# ------------------------------------------------------------------ edge cases
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_zero_tensor_gives_zeros_and_the_next_step_still_finds_the_subspace(fw):
    comps, mems = make(1, compress_rank=2)
    (out,), _ = reduce_all(comps, mems, [as_tensor(fw, np.zeros((12, 9)))], "z")
    got = as_numpy(out)
    assert np.isfinite(got).all() and not got.any()
    q = as_numpy(comps[0].state.variables()["q/z"])
    assert not q.any()  # the reduced Q of a zero layer is zero ...
    target = low_rank(np.random.default_rng(0), 12, 9, 2)
    (out,), _ = reduce_all(comps, mems, [as_tensor(fw, target)], "z")
    assert rel_err(as_numpy(out), target) < 1e-5  # ... and is refilled, not stuck at zero


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_lower_rank_step_does_not_shrink_later_steps(fw):
    rng = np.random.default_rng(4)
    comps, mems = make(1, memory=False, compress_rank=2)
    reduce_all(comps, mems, [as_tensor(fw, low_rank(rng, 14, 10, 1))], "k")
    target = low_rank(rng, 14, 10, 2)
    (out,), _ = reduce_all(comps, mems, [as_tensor(fw, target)], "k")
    assert rel_err(as_numpy(out), target) < 1e-4


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("shape,dtype", [((7,), "float32"), ((3, 3), "float32"),
                                         ((40, 2), "float32"), ((5, 4), "int32")])
def test_small_one_dimensional_and_integer_tensors_go_uncompressed(fw, shape, dtype):
    comp = PowerSGDCompressor(compress_rank=1)
    arr = np.arange(np.prod(shape)).reshape(shape) - 3
    x = as_tensor(fw, arr, dtype)
    payload, ctx = comp.compress(x, "b")
    assert len(payload) == 1 and ops_for(payload[0]).shape(payload[0]) == (int(np.prod(shape)),)
    assert comp.next_round(payload, ctx) is None
    out = comp.decompress(payload, ctx)
    assert ops_for(out).dtype(out) == dtype
    np.testing.assert_array_equal(as_numpy(out), arr)
    if dtype != "int32":  # (5, 4) floats would be compressed
        assert comp.payload_nbytes(shape, "float32") == 4 * int(np.prod(shape))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_start_step_sends_the_first_steps_uncompressed(fw):
    rng = np.random.default_rng(6)
    comps, mems = make(1, compress_rank=1, start_step=2)
    g = rng.standard_normal((16, 16))
    rounds = []
    for _ in range(4):
        (out,), sent = reduce_all(comps, mems, [as_tensor(fw, g)], "s")
        rounds.append([[ops_for(t).shape(t) for t in p] for p in sent])
        if len(rounds) <= 2:
            np.testing.assert_allclose(as_numpy(out), g, rtol=1e-6)
            assert not as_numpy(mems[0].state.variables()["s"]).any()
    # the second round sends Q^T (r x m), row-major as computed
    assert rounds == [[[(256,)]], [[(256,)]], [[(16, 1)], [(1, 16)]], [[(16, 1)], [(1, 16)]]]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_dtype_and_shape_round_trip(fw, dtype):
    target = low_rank(np.random.default_rng(8), 32, 24, 1) / 4
    comps, mems = make(1, compress_rank=1)
    (out,), sent = reduce_all(comps, mems, [as_tensor(fw, target, dtype)], "h")
    ops = ops_for(out)
    assert ops.dtype(out) == dtype and ops.shape(out) == (32, 24)
    assert all(ops_for(t).dtype(t) == dtype for p in sent for t in p)
    # 16-bit: P = M q rounds in 16 bits, and q0 is nearly orthogonal to this M's rows
    tol = {"float16": 5e-3, "bfloat16": 5e-2, "float64": 1e-10}[dtype]
    assert rel_err(as_numpy(out), target) < tol


# ------------------------------------------------------------------ layouts, bytes, config
@pytest.mark.parametrize("oihw", [(8, 3, 3, 3), (6, 4, 5), (12, 10)])
def test_conv_and_dense_kernels_give_the_same_result_in_torch_and_keras_layouts(oihw):
    rng = np.random.default_rng(9)
    steps = [rng.standard_normal(oihw) for _ in range(3)]
    to_keras = (*range(2, len(oihw)), 1, 0)
    ct, mt = make(1, compress_rank=2)
    ck, mk = make(1, compress_rank=2)
    for kernel in steps:
        (out_t,), sent_t = reduce_all(ct, mt, [as_tensor("torch", kernel)], "conv")
        (out_k,), sent_k = reduce_all(ck, mk, [as_tensor("tensorflow", kernel.transpose(to_keras))],
                                      "conv")
        assert tuple(out_k.shape) == tuple(kernel.transpose(to_keras).shape)
        np.testing.assert_allclose(as_numpy(out_k), as_numpy(out_t).transpose(to_keras),
                                   rtol=1e-4, atol=1e-5)
        assert [[tuple(t.shape) for t in p] for p in sent_t] == [[(oihw[0], 2)],
                                                                  [(2, int(np.prod(oihw[1:])))]]
        assert [[tuple(t.shape) for t in p] for p in sent_k] == \
            [[tuple(t.shape) for t in p] for p in sent_t]


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_rank_one_conv_kernel_is_rebuilt_in_its_own_layout(fw):
    rng = np.random.default_rng(10)
    oihw = np.einsum("o,ihw->oihw", rng.standard_normal(6), rng.standard_normal((4, 3, 3)))
    kernel = oihw if fw == "torch" else oihw.transpose(2, 3, 1, 0)
    comps, mems = make(1, compress_rank=1)
    (out,), _ = reduce_all(comps, mems, [as_tensor(fw, kernel)], "c")
    assert rel_err(as_numpy(out), kernel) < 1e-5


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_payload_bytes_match_the_formula(fw):
    comp = PowerSGDCompressor(compress_rank=2)
    assert comp.payload_nbytes(1000) is None
    layout = "torch" if fw == "torch" else "tensorflow"
    shapes = [(64, 3, 3, 3), (100, 50), (50, 100), (40, 2)]
    if fw == "tensorflow":
        shapes = [(3, 3, 3, 64), (50, 100), (100, 50), (2, 40)]
    for shape, dtype in zip(shapes, ["float32", "float16", "float64", "float32"]):
        x = as_tensor(fw, np.ones(shape), dtype)
        payload, ctx = comp.compress(x, f"p{shape}")
        nxt = comp.next_round(payload, ctx)
        second = [] if nxt is None else nxt[0]
        assert (nxt is None) == (shape in ((40, 2), (2, 40)))
        nbytes = sum(int(ops_for(t).nbytes(t)) for t in payload + second)
        assert nbytes == comp.payload_nbytes(shape, dtype, layout)
    assert comp.payload_nbytes((64, 3, 3, 3)) == 2 * (64 + 27) * 4
    assert comp.payload_nbytes((3, 3, 3, 64), layout="tensorflow") == 2 * (64 + 27) * 4
    assert comp.payload_nbytes((100, 50), "float16") == 2 * 150 * 2


def test_min_compression_rate_boundary():
    # 4x4 at rank 1 saves exactly 16 / 8 = 2
    assert PowerSGDCompressor(1, 2.0).matrix_shape((4, 4)) == (4, 4, 1)
    assert PowerSGDCompressor(1, 2.01).matrix_shape((4, 4)) is None
    assert PowerSGDCompressor(5, 0).matrix_shape((3, 2)) == (3, 2, 2)  # rank capped at min(n, m)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_same_initial_q_on_every_instance_and_different_for_other_seeds_or_names(fw):
    x = as_tensor(fw, np.random.default_rng(11).standard_normal((20, 10)))

    def first_payload(seed, name):
        return as_numpy(PowerSGDCompressor(2, seed=seed).compress(x, name)[0][0])

    np.testing.assert_array_equal(first_payload(4, "a"), first_payload(4, "a"))
    assert not np.allclose(first_payload(4, "a"), first_payload(5, "a"))
    assert not np.allclose(first_payload(4, "a"), first_payload(4, "b"))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_state_dict_round_trip_continues_warm_start_identically(fw):
    rng = np.random.default_rng(12)
    steps = [[rng.standard_normal((18, 14))] for _ in range(5)]
    comps, mems = make(1, compress_rank=2, start_step=1)
    outs = []
    for t, grads in enumerate(steps):
        if t == 3:
            saved = (comps[0].state_dict(), mems[0].state_dict())
        (out,), _ = reduce_all(comps, mems, [as_tensor(fw, g) for g in grads], "w")
        outs.append(as_numpy(out))
    assert set(saved[0]) == {"q/w", "q0/w", "step/w"} and set(saved[1]) == {"w"}
    fresh, fresh_mem = make(1, compress_rank=2, start_step=1)
    fresh[0].load_state_dict(saved[0])
    fresh_mem[0].load_state_dict(saved[1])
    for t in (3, 4):
        (out,), _ = reduce_all(fresh, fresh_mem, [as_tensor(fw, steps[t][0])], "w")
        np.testing.assert_allclose(as_numpy(out), outs[t], rtol=1e-6, atol=1e-6)
    # without the state, step 4 differs (the test can fail)
    cold, cold_mem = make(1, compress_rank=2, start_step=1)
    (out,), _ = reduce_all(cold, cold_mem, [as_tensor(fw, steps[3][0])], "w")
    assert not np.allclose(as_numpy(out), outs[3], atol=1e-3)


def test_torch_equals_tensorflow_over_several_steps_with_error_feedback():
    rng = np.random.default_rng(13)
    steps = [[rng.standard_normal((3, 3, 4, 10)) for _ in range(2)] for _ in range(4)]
    ct, mt = make(2, compress_rank=2, seed=9)
    ck, mk = make(2, compress_rank=2, seed=9)
    for grads in steps:
        ot, _ = reduce_all(ct, mt, [as_tensor("torch", g.transpose(3, 2, 0, 1)) for g in grads],
                           "k")
        ok, _ = reduce_all(ck, mk, [as_tensor("tensorflow", g) for g in grads], "k")
        np.testing.assert_allclose(as_numpy(ok[0]), as_numpy(ot[0]).transpose(2, 3, 1, 0),
                                   rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ tf.function
def test_graph_mode_matches_eager():
    rng = np.random.default_rng(14)
    steps = [[rng.standard_normal((3, 3, 2, 8)), rng.standard_normal((3, 3, 2, 8))]
             for _ in range(3)]
    eager_c, eager_m = make(2, compress_rank=2)
    graph_c, graph_m = make(2, compress_rank=2)

    @tf.function
    def step(a, b):
        outs, _ = reduce_all(graph_c, graph_m, [a, b], "g")
        return outs[0]

    for grads in steps:
        want, _ = reduce_all(eager_c, eager_m, [as_tensor("tensorflow", g) for g in grads], "g")
        got = step(*[as_tensor("tensorflow", g) for g in grads])
        np.testing.assert_allclose(got.numpy(), want[0].numpy(), rtol=1e-5, atol=1e-5)
    assert step.experimental_get_tracing_count() == 1
    np.testing.assert_allclose(graph_c[0].state_dict()["q/g"], eager_c[0].state_dict()["q/g"],
                               rtol=1e-5, atol=1e-5)


def test_start_step_in_graph_mode_raises_a_clear_error():
    comp = PowerSGDCompressor(compress_rank=1, start_step=3)

    @tf.function
    def step(x):
        return comp.compress(x, "late")[0][0]

    with pytest.raises(ValueError, match="start_step=3 cannot be used inside tf.function"):
        step(tf.ones((16, 16)))
    # 1-D tensors never compress, so they do not need the step
    assert PowerSGDCompressor(start_step=3).compress(tf.ones(5), "bias")[0][0].shape == (5,)


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("kwargs,match", [
    ({"compress_rank": 0}, "compress_rank must be in \\[1, inf\\], got 0"),
    ({"compress_rank": 1.5}, "compress_rank must be an integer, got 1.5"),
    ({"min_compression_rate": -1}, "min_compression_rate must be in \\[0.0, inf\\], got -1"),
    ({"start_step": -2}, "start_step must be in \\[0, inf\\], got -2"),
    ({"seed": -1}, "seed must be in"),
    ({"compress_rank": "two"}, "compress_rank must be an integer \\(not str\\), got 'two'"),
])
def test_bad_parameters_are_rejected_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PowerSGDCompressor(**kwargs)


def test_bad_layout_is_rejected():
    with pytest.raises(ValueError, match="layout must be one of"):
        PowerSGDCompressor().payload_nbytes((4, 4), layout="nchw")


def test_memory_refuses_a_multi_round_compressor_it_cannot_split():
    """At construction: a multi-round compressor that is not PowerSGD (no ``local_share``)."""
    from dataclasses import replace

    from grace_dl.communicators.allreduce import Allreduce
    from grace_dl.compressors.none import NoneCompressor

    class TwoRounds(NoneCompressor):
        caps = replace(NoneCompressor.caps, rounds=2)

        def next_round(self, reduced, ctx):
            return None

    with pytest.raises(ValueError, match="needs compressor powersgd .* got TwoRounds with "
                                         "rounds=2"):
        Allreduce(TwoRounds(), PowerSGDMemory())


def test_memory_is_plain_error_feedback_for_a_single_round_compressor():
    from grace_dl.compressors.none import NoneCompressor

    mem = PowerSGDMemory()
    x = torch.arange(6.0)
    comp = NoneCompressor()
    payload, ctx = comp.compress(mem.compensate(x, "n"), "n")
    mem.update(x, "n", comp, payload, ctx)
    assert not mem.state.variables()["n"].any()


# ------------------------------------------------------------------ real 2-rank Horovod jobs
@pytest.mark.multiproc
@pytest.mark.parametrize("mode,launcher,r", [("torch", "gloo", 2), ("tf-graph", "gloo", 2),
                                             ("tf-eager", "mpi", 1)])
def test_two_rank_horovod_job_matches_the_single_process_simulation(mode, launcher, r):
    results = mp.run("powersgd_check.py", np=2, launcher=launcher, args=[mode, r], timeout=400)
    assert [res["rank"] for res in results] == [0, 1]
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
    names = list(job.TENSORS)
    comps, mems = make(2, compress_rank=r)
    steps = [[[job.make_input(w, s, n) for w in range(2)] for n in names]
             for s in range(job.STEPS)]
    fc = names.index("fc")
    fc_ref = reference([per_name[fc] for per_name in steps], 0, "fc", r)
    for s in range(job.STEPS):
        for i, name in enumerate(names):
            want, _ = reduce_all(comps, mems, [torch.from_numpy(g) for g in steps[s][i]], name)
            want = want[0].numpy()
            got0, got1 = (res["outs"][s][i] for res in results)
            np.testing.assert_array_equal(got0, got1)  # identical on both ranks
            tol = 1e-6 if mode == "torch" else 1e-4
            np.testing.assert_allclose(got0, want, rtol=tol, atol=tol, err_msg=f"{name} {s}")
            if name == "dead" and s == 0:
                assert not got0.any()
        assert rel_err(results[0]["outs"][s][fc], fc_ref[s]) < 1e-4
        # for 2 ranks a ring allreduce moves each buffer once: the payload formula exactly
        layout = "torch" if mode == "torch" else "tensorflow"
        shapes = [job.TENSORS[n] if layout == "torch" else
                  tuple(job.TENSORS[n][a] for a in job.torch_to_keras(len(job.TENSORS[n])))
                  for n in names]
        want_bytes = sum(comps[0].payload_nbytes(shp, "float32", layout)
                         for shp in shapes)
        assert [res["bytes"][s]["sent"] for res in results] == [want_bytes] * 2
    states = [res["state"]["compressor"] for res in results]
    assert set(states[0]) == {f"{k}/{n}" for k in ("q", "q0") for n in ("conv", "fc", "dead")}
    for key in states[0]:
        np.testing.assert_array_equal(states[0][key], states[1][key])
    # a tensor PowerSGD never compresses (bias, tiny) keeps no residual: it would stay zero
    assert results[0]["state"]["memory"].keys() == {"conv", "fc", "dead"}


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("shape", [(64, 48), (8, 4, 3, 3)])
def test_subtracting_the_local_share_in_place_equals_subtracting_the_product(fw, shape):
    """The error feedback's ``residual -= P_hat Q_w^T`` done as rank-r updates of the residual
    (torch: any shape, as a matrix view; TensorFlow: a 2-D kernel as its transpose; a conv
    kernel by the product) leaves what ``residual - local_share`` leaves."""
    rng = np.random.default_rng(9)
    grad = rng.standard_normal(shape if fw == "torch" else
                               tuple(shape[i] for i in (2, 3, 1, 0)[:len(shape)])
                               if len(shape) == 4 else shape[::-1]).astype(np.float32)
    comp = PowerSGDCompressor(compress_rank=2)
    x = as_tensor(fw, grad)
    payload, ctx = comp.compress(x, "w")
    comp.next_round([payload[0] * 2], ctx)
    want = grad - as_numpy(comp.local_share(ctx))
    if fw == "torch":
        residual = torch.tensor(grad)
    else:
        residual = tf.Variable(grad)
    assert comp.subtract_local_share(ctx, residual) is True
    np.testing.assert_allclose(as_numpy(residual), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_uncompressed_tensor_has_no_local_share_to_subtract(fw):
    comp = PowerSGDCompressor(compress_rank=2)
    x = as_tensor(fw, np.ones(7, np.float32))
    payload, ctx = comp.compress(x, "b")
    residual = torch.ones(7) if fw == "torch" else tf.Variable(tf.ones(7))
    assert comp.subtract_local_share(ctx, residual) is False
    np.testing.assert_array_equal(as_numpy(residual), np.ones(7))


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("world", [2, 3])
def test_the_divided_payload_averages_without_changing_the_warm_start(fw, world):
    """``divided`` (what the allreduce communicator folds an average into): decompressing it
    gives the result over ``world`` (bit for bit when ``world`` is a power of two) and stores the
    same warm start as the undivided payload, so the next steps are unchanged; an uncompressed
    tensor's values are left to the communicator (None: it divides them as it writes them
    out, ``test_ddp``'s PowerSGD jobs)."""
    rng = np.random.default_rng(5)
    comp = PowerSGDCompressor()
    payload, ctx = comp.compress(as_tensor(fw, np.ones(7)), "b")
    assert not ctx.low_rank and own(comp).divided(payload, world) is None
    for shape in [(40, 30)]:
        arrays = [rng.standard_normal(shape) for _ in range(world)]
        states = []
        for divide in (False, True):
            comps, mems = make(world, memory=False, compress_rank=2)
            grads = [as_tensor(fw, a) for a in arrays]
            compensated = [m.compensate(g, "w") for m, g in zip(mems, grads)]
            outs = [c.compress(x, "w") for c, x in zip(comps, compensated)]
            while True:
                reduced = [sum(o[0][i] for o in outs) for i in range(len(outs[0][0]))]
                nxt = [c.next_round(reduced, ctx) for c, (_, ctx) in zip(comps, outs)]
                if nxt[0] is None:
                    break
                outs = nxt
            payload = own(comps[0]).divided(reduced, world) if divide else reduced
            got = as_numpy(comps[0].decompress(payload, outs[0][1]))
            states.append((got if divide else got / world, comps[0].state_dict()))
        (want, want_state), (got, got_state) = states
        if world == 2:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert want_state.keys() == got_state.keys()
        for key in want_state:
            np.testing.assert_equal(want_state[key], got_state[key])


class _Logged(OneRank):
    """One rank whose waits are written into ``log``."""

    def __init__(self, log):
        self.log = log

    def synchronize(self, handle):
        self.log.append("wait")
        return handle


@pytest.mark.parametrize("memory, early", [("powersgd", True), ("residual", False)])
def test_own_share_memory_updates_before_the_last_round_is_waited_for(memory, early):
    """``powersgd`` memory needs only this rank's Q: its update runs while round 2 is in flight
    (before that wait), and leaves the same residual as M - P_hat Q^T; ``residual`` needs the
    ranks' average: after every wait."""
    log = []
    grc = grace_from_params({"compressor": "powersgd", "compress_rank": 1, "memory": memory})
    inner = type(grc.feedback).update

    def update(self, *args, **kwargs):
        log.append("update")
        return inner(self, *args, **kwargs)

    rng = np.random.default_rng(3)
    g = torch.tensor(rng.standard_normal((12, 9)), dtype=torch.float32)
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(type(grc.feedback), "update", update)
        out = grc.receive(grc.send(g.clone(), "w", collectives=_Logged(log)))
    assert log == (["wait", "update", "wait"] if early else ["wait", "wait", "update"])
    # one rank: its own share is the average, so both leave M - P_hat Q^T
    residual = grc.memory.state.variables()["w"].numpy()
    np.testing.assert_allclose(residual, g.numpy() - out.numpy(), atol=1e-6)


def test_a_skinny_row_major_right_factor_is_multiplied_column_major_on_the_cpu():
    """P = M Q with the warm start Q row-major (as its slot is): torch's CPU GEMM (MKL) on this
    project's hosts takes 3.5 ms for 2048 x 2048 times a row-major 2048 x 2 and 1.3 ms with
    Q copied column-major first, so ``ops.matmul`` does that copy: the product is the one a
    column-major Q gives, bit for bit (and the warm start is row-major, so the copy is needed)."""
    from grace_dl.torch import ops

    c = PowerSGDCompressor(compress_rank=2)
    q = c._warm_q(ops, "w", 300, 2, torch.zeros(4, 300))
    assert tuple(q.shape) == (300, 2) and q.is_contiguous()
    m = torch.randn(257, 300, generator=torch.Generator().manual_seed(0))
    column_major = q.t().contiguous().t()
    assert torch.equal(ops.matmul(m, q), torch.mm(m, column_major))
    assert torch.allclose(ops.matmul(m, q).double(), m.double() @ q.double(), atol=1e-4)


# ------------------------------------------------------------------ orthonormalization
def gram_schmidt(x):
    """Classical Gram–Schmidt in float64 NumPy, each column divided by max(norm, 1e-20)."""
    out = []
    for j in range(x.shape[1]):
        v = x[:, j].astype(np.float64)
        for u in out:
            v = v - (v @ u) * u
        out.append(v / max(np.linalg.norm(v), 1e-20))
    return np.stack(out, 1)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_orthonormalize_gives_gram_schmidts_columns_up_to_their_signs(fw, r, dtype):
    from grace_dl.compressors.powersgd import orthonormalize

    rng = np.random.default_rng(r)
    x = rng.standard_normal((40, r))
    x[:, -1] *= 1e-6            # a small last column keeps its direction (not a zero one)
    t = as_tensor(fw, x, dtype)
    out = orthonormalize(ops_for(t), t)
    assert ops_for(out).dtype(out) == dtype and ops_for(out).shape(out) == (40, r)
    tol = {"float32": 2e-5, "float64": 1e-12, "bfloat16": 1e-2}[dtype]
    want = gram_schmidt(as_numpy(t))    # of the input as the dtype holds it
    got = as_numpy(out)
    signs = np.sign(np.sum(got * want, axis=0))
    assert set(signs) <= {-1.0, 1.0}
    np.testing.assert_allclose(got * signs, want, atol=tol)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_orthonormalize_gives_unit_columns_for_zero_ones_and_powersgd_does_not_see_the_signs(fw):
    """A zero matrix or column still gets orthonormal columns (QR's), and a zero layer's
    result stays 0; flipping P_hat's column signs leaves the results and residuals of later
    steps as they are (what lets ``orthonormalize`` keep QR's signs)."""
    from grace_dl.compressors import powersgd as powersgd_module
    from grace_dl.compressors.powersgd import orthonormalize

    rng = np.random.default_rng(0)
    for cols in ([0, 1, 2], [1], [2]):
        x = rng.standard_normal((12, 3))
        x[:, cols] = 0
        out = as_numpy(orthonormalize(ops_for(t := as_tensor(fw, x)), t))
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out.T @ out, np.eye(3), atol=1e-5)
    comps, mems = make(1, compress_rank=2)
    (out,), _ = reduce_all(comps, mems, [as_tensor(fw, np.zeros((10, 8)))], "z")
    np.testing.assert_array_equal(as_numpy(out), 0)
    steps = [rng.standard_normal((10, 8)) for _ in range(3)]
    runs = []
    for flip in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            if flip:        # P_hat's first column negated: another sign convention
                patch.setattr(powersgd_module, "orthonormalize",
                              lambda ops, x: orthonormalize(ops, x) * as_tensor(fw, [-1.0, 1.0]))
            comps, mems = make(1, compress_rank=2)
            runs.append([(as_numpy(reduce_all(comps, mems, [as_tensor(fw, g)], "w")[0][0]),
                          as_numpy(mems[0].state.variables()["w"])) for g in steps])
    for (out, residual), (out_f, residual_f) in zip(*runs):
        np.testing.assert_allclose(out_f, out, atol=1e-5)
        np.testing.assert_allclose(residual_f, residual, atol=1e-5)
