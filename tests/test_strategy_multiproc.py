"""The strategy dispatcher in real 2-rank Horovod jobs (horovodrun --gloo, and mpirun)."""

import time

import numpy as np
import pytest

import mp
from grace_dl.registry import lookup

N = 2


def _reference(label, inputs, name):
    """Mean over ranks of decompress(compress(x_r)) with a fresh compressor (first step, empty
    memory), i.e. what the pipeline must deliver."""
    import torch

    if label.startswith("topk"):
        ratio = float(label.split("compress_ratio=")[1].split(")")[0])
        comp = lookup("compressor", "topk")(compress_ratio=ratio)
    elif label.startswith("threshold"):
        comp = lookup("compressor", "threshold")(threshold=1.0)
    else:
        return np.mean(inputs, axis=0)
    outs = []
    for x in inputs:
        payload, ctx = comp.compress(torch.from_numpy(x), name)
        outs.append(comp.decompress(payload, ctx).numpy())
    return np.mean(outs, axis=0)


@pytest.mark.multiproc
def test_mixed_strategy_routes_fuses_and_reduces_exactly():
    """topk/allgather (fused pair), threshold/allgather (fused, unequal sizes), fp16/allreduce
    over RING, none/allreduce (fused pair), PS to rank 1 and to rank 0 (with topk), twophase.
    Rank 1 sends and receives in reverse order; results must still be right and identical."""
    r0, r1 = mp.run("strategy_torch.py", np=N, args=["exact"], timeout=240)
    labels = r0["pipelines"]
    assert labels == r1["pipelines"]  # broadcast from rank 0 reached rank 1
    for name, label in labels.items():
        inputs = r0["inputs"][name]
        for step in (0, 1):
            a = r0["steps"][step]["results"][name]
            b = r1["steps"][step]["results"][name]
            np.testing.assert_array_equal(a, b, err_msg=name)
        got = r0["steps"][0]["results"][name]
        want = _reference(label, inputs, name)
        tol = 2e-3 if label.startswith("fp16") else 1e-6
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{name} {label}")
        if not label.startswith(("topk", "threshold", "fp16")):
            # exact pipelines: step 2 doubled the inputs
            np.testing.assert_allclose(r0["steps"][1]["results"][name], 2 * want, rtol=1e-6)
    # d.bias alone (its group partner e.bias not sent): still the exact mean
    for res in (r0, r1):
        np.testing.assert_allclose(res["partial"], np.mean(r0["inputs"]["d.bias"], axis=0),
                                   rtol=1e-6)
        assert "'d.bias' sent again before its handle was received" in res["twice"]
        assert "already received" in res["received_twice"]
    # topk with residual memory: step 2 carries step 1's error, so it differs from a fresh
    # compression of the doubled inputs
    ref2 = _reference(labels["a.weight"], [2 * x for x in r0["inputs"]["a.weight"]], "a.weight")
    assert not np.allclose(r0["steps"][1]["results"]["a.weight"], ref2)

    # Byte counters: each variable moved what its own pipeline says.
    for rank, res in enumerate((r0, r1)):
        per = res["steps"][0]["bytes"]["per_tensor"]
        assert per["a.weight"] == (32 * 8, 32 * 8)          # k = 0.25 * 128, value + int32 index
        assert per["b.weight"] == (16 * 8, 16 * 8)
        assert per["c.weight"] == (32 * 2, 32 * 2)          # fp16, ring: 2 (N-1)/N = 1 x payload
        assert per["d.bias"] == (20, 20) and per["e.bias"] == (28, 28)
        dense = 24 * 4
        # PS to rank 1: rank 0 sends its (none) payload and gets the dense result; rank 1 gets
        # rank 0's payload and sends the result back.
        assert per["f.weight"] == (dense, dense)
        # PS to rank 0 with topk 0.25 of 24 (6 values + 6 indices = 48 bytes)
        assert per["g.weight"] == ((dense, 48) if rank == 0 else (48, dense))
        assert per["j.weight"] == (48, 48)                   # twophase: 2 (N-1)/N of 12 floats
        # fused threshold allgathers: per-member element counts, a member a tensor (each
        # tensor's ragged payload is one block of its lengths and parts: 2 members x 4 bytes)
        assert per["g3"] == (8, 8)
        assert per["h.weight"][0] < 30 * 4  # threshold sends fewer bytes than the dense tensor
    # threshold sizes differ across ranks: what one sends, the other receives
    p0, p1 = r0["steps"][0]["bytes"]["per_tensor"], r1["steps"][0]["bytes"]["per_tensor"]
    for name in ("h.weight", "i.weight"):
        assert p0[name][1] == p1[name][0] and p1[name][1] == p0[name][0]
    assert r0["state_keys"] == [
        "fp16+none+allreduce", "none+none+allreduce", "none+none+ps@1", "none+none+twophase",
        "threshold(threshold=1.0)+none+allgather", "topk(compress_ratio=0.25)+none+ps@0",
        "topk(compress_ratio=0.25)+residual+allgather"]

@pytest.mark.multiproc
def test_torch_training_with_mixed_strategy():
    """topk/allgather for the embedding and conv weights, fp16/allreduce for the linear weight,
    none for the biases: the model trains and every variable's bytes are its pipeline's."""
    r0, r1 = mp.run("strategy_torch.py", np=N, args=["train"], timeout=300)
    assert r0["pipelines"] == {
        "emb.weight": "topk(compress_ratio=0.25)+residual+allgather",
        "conv.weight": "topk(compress_ratio=0.25)+residual+allgather",
        "conv.bias": "none+none+allreduce",
        "fc.weight": "fp16+none+allreduce",
        "fc.bias": "none+none+allreduce"}
    numel = r0["numel"]
    expected = {"emb.weight": (numel["emb.weight"] // 4) * 8,
                "conv.weight": (numel["conv.weight"] // 4) * 8,
                "fc.weight": numel["fc.weight"] * 2,
                "conv.bias": numel["conv.bias"] * 4, "fc.bias": numel["fc.bias"] * 4}
    for res in (r0, r1):
        assert len(res["bytes"]) == 6  # one summary per optimizer step
        for step in res["bytes"]:
            assert {k: v[0] for k, v in step["per_tensor"].items()} == expected
        assert res["losses"][-1] < res["losses"][0]
    for name in r0["params"]:  # every rank applied the same aggregated gradients
        np.testing.assert_array_equal(r0["params"][name], r1["params"][name])


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_mismatched_strategies_fail_fast_on_every_rank(launcher):
    start = time.monotonic()
    results = mp.run("strategy_torch.py", np=N, launcher=launcher, args=["mismatch"],
                     timeout=180)
    assert time.monotonic() - start < 150
    for res in results:
        errors = res["errors"]
        assert set(errors) == {"from_strategy", "send", "optimizer"}, errors
        for where in ("from_strategy", "send"):
            msg = errors[where]
            assert "ranks run different strategies" in msg
            assert f"this is rank {res['rank']}" in msg
            assert "'w': rank 0 'Allreduce:fp16+none+allreduce" in msg
            assert "rank 1 'Allgather:topk(compress_ratio=0.25)+residual+allgather" in msg
            assert "'b'" not in msg  # the agreeing variable is not blamed
        assert "disagree on the grace configuration" in errors["optimizer"]


@pytest.mark.multiproc
def test_tensorflow_tape_with_mixed_strategy_eager_and_tf_function():
    """Keras MLP through DistributedGradientTape under mpirun: topk/allgather, PS to rank 1 with
    topk, fp16 over RING and three biases fused into one allreduce, two eager steps then four
    in one traced tf.function."""
    r0, r1 = mp.run("strategy_tf.py", np=N, launcher="mpi", timeout=300)
    assert r0["pipelines"] == r1["pipelines"] == {
        "mlp/hidden/kernel": "topk(compress_ratio=0.25)+residual+allgather",
        "mlp/hidden/bias": "none+none+allreduce",
        "mlp/mid/kernel": "topk(compress_ratio=0.25)+none+ps",
        "mlp/mid/bias": "none+none+allreduce",
        "mlp/out/kernel": "fp16+none+allreduce",
        "mlp/out/bias": "none+none+allreduce"}
    numel = r0["numel"]
    topk = numel["mlp/hidden/kernel"] // 4 * 8
    ps_payload, dense = numel["mlp/mid/kernel"] // 4 * 8, numel["mlp/mid/kernel"] * 4
    for rank, res in enumerate((r0, r1)):
        assert res["traces"] == 1
        assert len(res["bytes"]) == 6  # every executed step, eager or traced
        for step in res["bytes"]:
            per = step["per_tensor"]
            assert per["mlp/hidden/kernel"] == (topk, topk)
            assert per["mlp/mid/kernel"] == ((ps_payload, dense) if rank == 0
                                             else (dense, ps_payload))
            assert per["mlp/out/kernel"] == (numel["mlp/out/kernel"] * 2,) * 2
            for bias in ("mlp/hidden/bias", "mlp/mid/bias", "mlp/out/bias"):
                assert per[bias] == (numel[bias] * 4,) * 2
        assert res["losses"][-1] < res["losses"][0]
    for name in r0["weights"]:
        np.testing.assert_array_equal(r0["weights"][name], r1["weights"][name])
