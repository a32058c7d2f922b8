"""TensorFlow glue under real 2-rank ``horovodrun --gloo``: DistributedGradientTape and the Keras
DistributedOptimizer, with and without grace=, eager and in tf.function (issue 7's "Must show").

Three launches: the tape worker (which also writes a checkpoint), a fresh process resuming from
it (under mpirun), and Keras model.fit on digits; plus the torch twin fed the tape run's
gradients. Each launch
runs several checks; the results are shared between the tests through module fixtures.
"""

import pickle

import numpy as np
import pytest

import mp

N = 2
pytestmark = pytest.mark.multiproc


def _equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tf_ckpt")


@pytest.fixture(scope="module")
def tape(ckpt_dir):
    return mp.run("tf_tape.py", np=N, args=["main", ckpt_dir], timeout=420)


@pytest.fixture(scope="module")
def resumed(tape, ckpt_dir):
    # Saved under horovodrun --gloo, resumed under mpirun: the checkpoint does not depend on
    # the launcher. yield_when_idle: a rank waiting in MPI must not spin on the shared cores
    # while its peer traces the step.
    return mp.run("tf_tape.py", np=N, launcher="mpi", args=["resume", ckpt_dir], timeout=420,
                  env={"OMPI_MCA_mpi_yield_when_idle": "1"})


@pytest.fixture(scope="module")
def keras_fit(tmp_path_factory):
    return mp.run("tf_keras.py", np=N, args=["20", tmp_path_factory.mktemp("keras_ckpt")],
                  timeout=480)


def test_grace_none_tape_equals_horovod_tape(tape):
    for r in tape:
        _equal(r["none_ours"], r["none_stock"])
        _equal(r["none_keras"], r["none_keras_ref"])  # Keras 3 variables, where Horovod's fails
    # and it really is an average: the ranks' local batches differ, their results do not
    _equal(tape[0]["none_ours"], tape[1]["none_ours"])


def test_none_allreduce_through_grace_equals_horovod_average(tape):
    for r in tape:
        for key in ("allreduce_eager", "allreduce_graph"):
            ours, reference = r[key]
            _equal(ours, reference)
    _equal(tape[0]["allreduce_graph"][0], tape[1]["allreduce_graph"][0])


def test_partial_tape_keeps_local_layers_local(tape):
    for r in tape:
        # hidden layer averaged through grace (same result as the full tape's)...
        _equal(r["partial"][:2], r["allreduce_eager"][1][:2])
        # ...output layer local, divided by the number of ranks as in Horovod
        for got, local in zip(r["partial"][2:], r["partial_local"][2:]):
            np.testing.assert_allclose(got, local / N, rtol=1e-7)
    assert not np.array_equal(tape[0]["partial"][2], tape[1]["partial"][2])


def test_topk_residual_allgather_identical_on_all_ranks(tape):
    a, b = tape[0]["topk"], tape[1]["topk"]
    for step in range(len(a["weights"])):
        _equal(a["reduced"][step], b["reduced"][step])
        _equal(a["weights"][step], b["weights"][step])
    # the ranks' local gradients differ, so this is not trivially true
    assert not np.array_equal(a["local"][0][0], b["local"][0][0])
    # and compression happened: the reduced kernel is sparse (at most k per rank nonzero)
    kernel = a["reduced"][0][0]
    k = int(np.ceil(0.05 * kernel.size))
    assert 0 < np.count_nonzero(kernel) <= N * k
    assert tape[0]["names"] == sorted(tape[0]["var_names"]) == sorted(
        ["mlp/hidden/kernel", "mlp/hidden/bias", "mlp/out/kernel", "mlp/out/bias"])


def test_twenty_steps_in_one_trace_with_byte_counts(tape):
    for r in tape:
        assert r["topk"]["traces"] == 1
        assert r["topk"]["tracing_count"] == 1
        # end_step ran on each of the 20 executions, after the run-time byte counts
        assert r["bytes_steps"] == [r["payload_nbytes"]] * 20


def test_tf_matches_torch_for_the_same_gradients(tape, tmp_path):
    spec = {"params": tape[0]["params"], "names": tape[0]["var_names"],
            "local": [r["topk"]["local"] for r in tape]}
    path = tmp_path / "grads.pkl"
    path.write_bytes(pickle.dumps(spec))
    torch_results = mp.run("tf_torch_twin.py", np=N, args=[path], timeout=300)
    for tf_rank, torch_rank in zip(tape, torch_results):
        steps = tf_rank["topk"]["reduced"]
        assert len(torch_rank["reduced"]) == len(steps) == 20
        for tf_step, torch_step in zip(steps, torch_rank["reduced"]):
            for x, y in zip(tf_step, torch_step):
                np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
        assert torch_rank["bytes_steps"] == tf_rank["bytes_steps"]


def test_groups_fuse_payloads_into_fewer_collectives(tape):
    """groups=2 on the tape: fewer collectives per step, the same bytes and gradients, on both
    ranks, no warning."""
    for res in tape:
        alone, fused = res["groups"]["None"], res["groups"]["2"]
        assert fused["calls_per_step"] < alone["calls_per_step"]
        assert all(n.startswith("grace.fused.g") for n in fused["names"])
        assert fused["sent"] == alone["sent"] and fused["warnings"] == []
        for a, b in zip(fused["grads"], alone["grads"]):
            _equal(a, b)
    for a, b in zip(tape[0]["groups"]["2"]["grads"], tape[1]["groups"]["2"]["grads"]):
        _equal(a, b)


def test_bucket_bytes_sends_each_bucket_once(tape):
    """bucket_bytes=300 on the tape: 3 buckets for 4 variables (the output layer's two share
    one); ``none`` in buckets is the plain average; topk selects over each bucket's
    concatenation as torch's topk does on the same values (one residual per bucket), in
    tf.function as eagerly."""
    import torch

    from grace_dl import grace_from_params
    from grace_dl.communicators.buckets import bucket_name

    names = tape[0]["var_names"]
    layout = [[names[3], names[2]], [names[1]], [names[0]]]
    for res in tape:
        none = res["buckets"]["none"]
        for step in range(3):
            for i in range(4):
                local = np.mean([r["buckets"]["none"]["local"][step][i] for r in tape], axis=0)
                np.testing.assert_allclose(none["reduced"][step][i], local, rtol=1e-6,
                                           atol=1e-7)
        topk, graph = res["buckets"]["topk"], res["buckets"]["topk_graph"]
        assert topk["keys"] == graph["keys"] == sorted(bucket_name(b) for b in layout)
        assert topk["calls_per_step"] == graph["calls_per_step"] * 3  # traced (counted) once
        assert topk["calls_per_step"] * 4 == res["groups"]["None"]["calls_per_step"] * 3
        # a strategy naming the same bucket (its lone gradients under their own names)
        by_strategy = res["buckets"]["topk_strategy"]
        assert by_strategy["buckets"] == [layout[0]]
        assert by_strategy["keys"] == sorted([bucket_name(layout[0]), *layout[1], *layout[2]])
        for a, b in zip(topk["reduced"], by_strategy["reduced"]):
            _equal(a, b)
        for a, b in zip(topk["reduced"], graph["reduced"]):  # graph mode may round apart
            for x, y in zip(a, b):
                np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    grcs = [grace_from_params(dict(tape[0]["params"])) for _ in range(N)]
    position = {n: i for i, n in enumerate(names)}
    for step in range(3):
        for members in layout:
            name, decoded = bucket_name(members), []
            for grc, res in zip(grcs, tape):
                local = res["buckets"]["topk"]["local"][step]
                flat = torch.cat([torch.from_numpy(local[position[m]]).reshape(-1)
                                  for m in members])
                comp = grc.memory.compensate(flat, name)
                payload, ctx = grc.compressor.compress(comp, name)
                grc.memory.update(comp, name, grc.compressor, payload, ctx)
                decoded.append(grc.compressor.decompress(payload, ctx))
            expected = (grcs[0].compressor.aggregate(decoded) / N).numpy()
            for res in tape:
                got = np.concatenate([res["buckets"]["topk"]["reduced"][step][position[m]]
                                      .reshape(-1) for m in members])
                np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7,
                                           err_msg=f"{name} step {step}")


@pytest.mark.multiproc
def test_indexed_slices_from_embedding(tape):
    for r in tape:
        assert r["emb_local_type"] == "IndexedSlices"
        _equal(r["emb_none"], r["emb_ref"])
        assert r["emb_topk_eager"][0].shape == (50, 4)
    _equal(tape[0]["emb_topk_eager"], tape[1]["emb_topk_eager"])
    _equal(tape[0]["emb_topk_graph"], tape[1]["emb_topk_graph"])


def test_disagreeing_ranks_raise_everywhere(tape):
    for r in tape:
        assert len(r["errors"]) == 2
        assert "ranks disagree on the grace configuration" in r["errors"][0]
        assert "disagree on the gradients" in r["errors"][1] and "extra" in r["errors"][1]


def test_checkpoint_restore_in_fresh_process_continues_exactly(tape, resumed):
    for before, after in zip(tape, resumed):
        # restored before the first step: nothing existed yet, everything was pending
        assert after["pending_before_first_step"] == before["names"]
        assert after["warnings"] == []
        assert after["traces"] == 1
        assert len(after["renamed_warnings"]) == 1
        assert "mlp/hidden/kernel" in after["renamed_warnings"][0]
        continued = before["topk"]
        for step in range(len(after["weights"])):
            _equal(after["reduced"][step], continued["reduced"][12 + step])
            _equal(after["weights"][step], continued["weights"][12 + step])


def test_keras_fit_averages_and_topk_reaches_uncompressed_accuracy(keras_fit):
    r0, r1 = keras_fit
    for key in ("plain", "topk"):
        assert r0[key]["class"] == "grace_dl.tensorflow.keras.SGD" and r0[key]["isinstance_sgd"]
        # ranks started from different weights (seeded by rank) and saw different data
        _equal(r0[key]["weights"], r1[key]["weights"])
        _equal(r0[key]["optimizer_vars"], r1[key]["optimizer_vars"])
        assert r0[key]["test_accuracy"] == r1[key]["test_accuracy"]
    plain, topk = r0["plain"]["test_accuracy"], r0["topk"]["test_accuracy"]
    assert plain > 0.9, plain
    assert topk >= plain - 0.02, (topk, plain)
    # end_step ran once per executed model.fit step; bytes are topk's k values + k indices
    assert r0["topk"]["bytes_steps"] == r0["topk"]["steps"]
    assert r0["topk"]["bytes_per_step"] == r0["topk"]["payload_nbytes"]


def test_keras_optimizer_checkpoint_carries_grace_state(keras_fit):
    for r in keras_fit:
        assert "optimizer/grace_state/.ATTRIBUTES/py_state" in r["checkpoint_keys"]
        assert r["restored_equal"]


def test_keras_fit_with_embedding_equal_across_ranks(keras_fit):
    for key in ("emb_plain", "emb_topk"):
        _equal(keras_fit[0][key], keras_fit[1][key])


def test_keras_mixed_precision_skips_the_same_steps_on_every_rank():
    """``mixed_float16``: rank 1's gradients overflow in 2 of 10 steps. With the loss scaling
    inside ours (``DistributedOptimizer(LossScaleOptimizer(SGD))``) the scaler sees the
    averaged gradients, so both ranks skip the same steps, halve the scale alike and keep
    equal weights: through Horovod's average (exactly those 2 steps) and through grace's topk
    (whose residual keeps the overflowing steps' finite entries, which here, rank 1's inputs
    scaled by 1e4, overflow later steps too). Ours wrapped by ``compile`` instead is refused
    on both ranks, before any collective, naming the fix (before, rank 1 skipped alone and
    the ranks' collectives went out of step)."""
    res = mp.run("tf_keras_mixed.py", np=N, timeout=300)
    for out in res:
        assert out["wrapped"] is not None and "LossScaleOptimizer(optimizer)" in out["wrapped"]
        for case in ("plain", "topk"):
            run = out[case]
            assert run["compiled_with"] == "LossScaleOptimizer" and run["inner"] == "SGD"
        assert out["plain"]["iterations"] == 8     # 10 steps, 2 skipped
        assert out["plain"]["scale"] == 2.0 ** 15 / 4
        assert out["topk"]["iterations"] < 10 and out["topk"]["sent_steps"] == 10
    for case in ("plain", "topk"):
        assert res[0][case]["iterations"] == res[1][case]["iterations"]
        assert res[0][case]["scale"] == res[1][case]["scale"]
        for a, b in zip(res[0][case]["weights"], res[1][case]["weights"]):
            np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in
               zip(res[0]["plain"]["weights"], res[0]["topk"]["weights"]))


def test_a_step_retraced_on_one_rank_alone_goes_on():
    """An uneven last batch retraces the step on rank 1 only; the rank-agreement check, an
    eager collective, ran in every trace and hung the job there (stock Horovod goes on)."""
    ranks = mp.run("tf_uneven.py", np=N, timeout=240)
    for res in ranks:
        tape = res["tape"]
        for kind in ("ours", "none"):
            np.testing.assert_allclose(tape[kind], tape["stock"], rtol=1e-6, err_msg=kind)
    for kind in ("topk",):
        np.testing.assert_array_equal(ranks[0]["tape"][kind], ranks[1]["tape"][kind])
    for kind in ("plain", "topk"):
        np.testing.assert_array_equal(ranks[0]["keras"][kind], ranks[1]["keras"][kind])
