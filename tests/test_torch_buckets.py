"""DistributedOptimizer(bucket_bytes=...): argument checks in this process, and a 2-rank
horovodrun job (tests/workers/torch_buckets.py) compared with horovod.torch's optimizer and with
a single-process reference that compresses each bucket's concatenated gradients."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mp
from grace_dl import grace_from_params
from grace_dl.communicators.buckets import DEFAULT_BUCKET_BYTES, bucket_name
from grace_dl.torch.buckets import plan
from support import assert_dicts_differ, assert_equal_dicts

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
import torch_common as C  # noqa: E402

N = 2
NONE = {"compressor": "none", "memory": "none", "communicator": "allreduce"}
TOPK = {"compressor": "topk", "memory": "residual", "communicator": "allgather",
        "compress_ratio": 0.1}
POWERSGD = {"compressor": "powersgd", "compress_rank": 1, "memory": "powersgd",
            "communicator": "allreduce"}


def _close(a: dict, b: dict, **tol):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], err_msg=k, **tol)


# ---------------------------------------------------------------- in-process checks
def test_a_bucket_adds_each_gradient_into_the_slots_of_the_pieces_it_spans():
    """``Bucket.add``: members of 5, 7 and 3 elements over pieces of 6, 6 and 3 (one member
    reaches a piece by a single element, one spans two pieces) land, added, where the bucket's
    flat buffer would hold them."""
    from grace_dl.torch.buckets import Bucket

    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(7, 1)),
              torch.nn.Parameter(torch.zeros(3))]
    bucket = Bucket(params, ["a", "b", "c"])
    base = torch.arange(15, dtype=torch.float32)
    slots = [base[:6].clone(), base[6:12].clone(), base[12:].clone()]
    bucket.sums = [(0, slots[0]), (6, slots[1]), (12, slots[2])]
    grads = [torch.randn(p.shape) for p in params]
    for i, g in enumerate(grads):
        bucket.add(i, g)
    want = base + torch.cat([g.reshape(-1) for g in grads])
    assert torch.equal(torch.cat(slots), want)


def test_plan_packs_reverse_order_per_dtype_up_to_the_size():
    a, b, c = torch.zeros(100), torch.zeros(100), torch.zeros(300)   # 400, 400, 1200 bytes
    h = torch.zeros(10, dtype=torch.float16)
    names = {a: "a", b: "b", c: "c", h: "h"}
    buckets = plan([c, h, b, a], names, 1000)
    assert [bk.names for bk in buckets] == [["c"], ["b", "a"], ["h"]]
    assert buckets[1].name == bucket_name(["b", "a"])
    assert [bk.names for bk in plan([c, b, a], names, DEFAULT_BUCKET_BYTES)] == [["c", "b", "a"]]
    view = buckets[1].view(1)
    view.fill_(3.0)
    assert view.shape == a.shape and buckets[1].flat[100:].eq(3.0).all()
    assert buckets[1].flat[:100].data_ptr() == buckets[1].view(0).data_ptr()


def test_step_model_prices_the_buckets_the_optimizer_sends():
    """``strategy.variables.bucketed``: the optimizer's buckets, as flat variables in forward
    order (a bucket is ready in the step model's reverse pass when its last member is)."""
    from grace_dl.strategy.variables import bucketed, variables_of

    model = C.make_model()
    names = {p: n for n, p in model.named_parameters()}
    sent = plan(reversed(list(model.parameters())), names, 300)
    priced = bucketed(variables_of(model.named_parameters()), 300)
    assert [v.name for v in priced] == [b.name for b in sent][::-1]
    assert [v.numel for v in priced] == [sum(b.numels) for b in sent][::-1] == [128, 16, 68]


@pytest.mark.parametrize("kwargs, grace, words", [
    ({"bucket_bytes": 0}, NONE, ["bucket_bytes", "positive int or None", "got 0"]),
    ({"bucket_bytes": True}, NONE, ["bucket_bytes", "True"]),
    ({"bucket_bytes": "25MB"}, NONE, ["bucket_bytes", "'25MB'"]),
    ({"bucket_bytes": 1024}, POWERSGD, ["bucket_bytes=1024", "PowerSGD", "needs each parameter's "
                                        "shape", "bucket_bytes=None", "topk"]),
    ({"bucket_bytes": 1024, "groups": 2}, NONE, ["bucket_bytes=1024", "groups=2"]),
    ({"bucket_bytes": 1024}, None, ["bucket_bytes=1024", "needs grace=",
                                    "HOROVOD_FUSION_THRESHOLD"]),
])
def test_bad_bucket_arguments_raise_value_error_naming_them(kwargs, grace, words):
    import grace_dl.torch.horovod as hvd

    sgd = torch.optim.SGD(C.make_model().parameters(), lr=0.1)
    with pytest.raises(ValueError) as err:
        hvd.DistributedOptimizer(sgd, grace=grace and grace_from_params(dict(grace)), **kwargs)
    for word in words:
        assert word in str(err.value)


# ---------------------------------------------------------------- the 2-rank job
@pytest.fixture(scope="module")
def ranks():
    return mp.run("torch_buckets.py", np=N, timeout=300)


@pytest.mark.multiproc
def test_uncompressed_buckets_are_horovods_average_one_collective_per_bucket(ranks):
    """``none`` in buckets gives Horovod's parameters; the tiny MLP's 4 gradients go in 3
    buckets of at most 300 bytes (reverse order: the 16-byte bias shares one) or 1 of 25 MiB,
    one in-place allreduce each per step, and the same bytes as per parameter."""
    for res in ranks:
        small, whole = res["none_small"], res["none_whole"]
        for run in (small, whole):
            _close(run["params"], res["hvd"], rtol=1e-6, atol=1e-7)
            assert run["sent"] == [sum(p.numel() for p in C.make_model().parameters()) * 4] * 3
        assert small["calls_per_step"] == 3 and whole["calls_per_step"] == 1
        assert list(small["layout"].values()) == [["body.2.bias", "body.2.weight"],
                                                  ["body.0.bias"], ["body.0.weight"]]
        assert list(whole["layout"].values()) == [["body.2.bias", "body.2.weight", "body.0.bias",
                                                   "body.0.weight"]]
        assert all(name == bucket_name(members) for name, members in small["layout"].items())
        assert res["adopted"] == [True, True]
        _close(res["keep_grads"], res["hvd"], rtol=1e-6, atol=1e-7)


@pytest.mark.multiproc
def test_topk_selects_over_each_bucket_as_the_reference_computes(ranks):
    """topk + residual + allgather over buckets: every step's applied gradient is the reference
    math on the concatenation of both ranks' gradients in bucket order (one top-k per bucket,
    residuals keyed by bucket), not the per-parameter result; one allgather per bucket."""
    topk = ranks[0]["topk"]
    layout = topk["layout"]
    grcs = [grace_from_params(dict(TOPK)) for _ in range(N)]
    model = C.make_model()
    shapes = {k: v.shape for k, v in model.named_parameters()}
    for step in range(3):
        for name, members in layout.items():
            flats = []
            for grc, res in zip(grcs, ranks):
                local = res["topk"]["records"][step]["local"]
                flat = torch.cat([torch.as_tensor(local[m]).reshape(-1) for m in members])
                comp = grc.memory.compensate(flat, name)
                payload, ctx = grc.compressor.compress(comp, name)
                grc.memory.update(comp, name, grc.compressor, payload, ctx)
                flats.append(grc.compressor.decompress(payload, ctx))
            expected = grcs[0].compressor.aggregate(flats) / N
            for res in ranks:
                synced = res["topk"]["records"][step]["synced"]
                got = torch.cat([torch.as_tensor(synced[m]).reshape(-1) for m in members])
                np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6, atol=1e-8,
                                           err_msg=f"{name} step {step}")
    for res in ranks:
        # the same collectives per grace tensor: 3 buckets where there are 4 parameters
        per_parameter = res["topk_per_parameter"]
        assert res["topk"]["calls_per_step"] * 4 == per_parameter["calls_per_step"] * 3
        assert sorted(res["topk"]["keys"]) == sorted(layout)
        assert res["topk"]["accumulated"] and all(res["topk"]["accumulated"])
        assert_dicts_differ(res["topk"]["params"], per_parameter["params"])
        assert all(tuple(res["topk"]["params"][k].shape) == tuple(shapes[k]) for k in shapes)
    assert_equal_dicts(ranks[0]["topk"]["params"], ranks[1]["topk"]["params"])
    for res in ranks:   # gradients kept between steps (the bucket's slices) change nothing
        assert_equal_dicts(res["keep_grads_topk"], res["topk"]["params"])
    per_bucket = grcs[0].compressor.payload_nbytes
    assert ranks[0]["topk"]["sent"] == [sum(per_bucket(sum(np.prod(shapes[m]) for m in members))
                                            for members in layout.values())] * 3


@pytest.mark.multiproc
def test_buckets_keep_horovods_sum_predivide_accumulation_and_missing_gradients(ranks):
    for res in ranks:
        for label in ("sum", "pre", "bpps", "nograd"):
            _close(res[f"{label}_grace"], res[f"{label}_hvd"], rtol=1e-6, atol=1e-7)
        assert_dicts_differ(res["sum_hvd"], res["hvd"])
        assert_dicts_differ(res["bpps_hvd"], res["hvd"])
        init = C.params(C.make_model(extra_branch=True))
        assert not np.array_equal(res["nograd_topk"]["extra.weight"], init["extra.weight"])
    assert_equal_dicts(ranks[0]["nograd_topk"], ranks[1]["nograd_topk"])


@pytest.mark.multiproc
def test_buckets_in_pieces_checkpoint_and_resume(ranks):
    """qsgd two-phase in buckets sent as 64-byte pieces keeps the ranks identical; the
    checkpoint records buckets and pieces; an optimizer per parameter or with other buckets
    refuses it, naming bucket_bytes; one with the same buckets resumes bit for bit."""
    for res in ranks:
        qsgd = res["qsgd"]
        assert set(qsgd["pieces"]) <= set(qsgd["layout"]) and qsgd["pieces"]
        # a bucket in pieces adds its gradients into its pieces' residuals (one slot each)
        assert qsgd["accumulated"] and all(n > 1 for n in qsgd["accumulated"])
        # gradients added into the residual train to the bits of gradients copied first
        for label in ("topk", "qsgd"):
            assert_equal_dicts(res["added"][label], res["copied"][label])
        assert all(n > 1 for n in qsgd["pieces"].values())
        for refusal in res["refusals"].values():
            assert refusal is not None and "other buckets" in refusal \
                and "bucket_bytes=" in refusal, refusal
        assert_equal_dicts(res["resume"]["resumed"], res["resume"]["continued"])
    assert_equal_dicts(ranks[0]["qsgd"]["params"], ranks[1]["qsgd"]["params"])


@pytest.mark.multiproc
def test_a_strategys_buckets_train_as_bucket_bytes_does(ranks):
    """A strategy whose groups are buckets (``AllReduceSynchronizer.bucket``, as Auto writes
    them) with bucket_bytes=300's layout: the dispatcher lists the bucket, the optimizer sends
    it as one tensor and the other parameters alone, and training is bit for bit the same."""
    for res in ranks:
        strategy = res["strategy"]
        assert strategy["buckets"] == [["body.2.bias", "body.2.weight"]]
        assert list(strategy["layout"].values()) == list(res["topk"]["layout"].values())
        assert strategy["sent"] == res["topk"]["sent"]
        assert_equal_dicts(strategy["params"], res["topk"]["params"])
