"""Bad input and faults end with the right result or a clear error on every rank (issue #17):
2-rank horovodrun jobs of tests/workers/faults_*.py."""

import re
import time

import pytest

import mp


@pytest.fixture(scope="module")
def torch_ranks():
    return mp.run("faults_torch.py", np=2, timeout=300)


@pytest.mark.multiproc
@pytest.mark.parametrize("method", ["signsgd", "signum"])
def test_sign_methods_leave_parameters_without_gradient_alone_torch(torch_ranks, method):
    for res in torch_ranks:
        moved = res[f"{method}_moved"]
        assert moved["unused.weight"] is False and moved["unused.bias"] is False
        assert moved["frozen.bias"] is False and moved["frozen.weight"] is False
        assert moved["head.weight"] and moved["emb.weight"]
        # rows 0, 1 (one rank each), 2, 3 (both) are looked up; 4..9 never are
        assert res[f"{method}_rows"] == [True] * 4 + [False] * 6


@pytest.mark.multiproc
@pytest.mark.parametrize("method", ["signsgd", "signum"])
def test_sign_vote_keeps_one_ranks_nan_torch(torch_ranks, method):
    assert all(res[f"{method}_nan"] for res in torch_ranks)


@pytest.mark.multiproc
def test_torch_checkpoint_with_unknown_names_raises_and_missing_grace_warns(torch_ranks):
    for res in torch_ranks:
        assert "matches no parameter name" in res["renamed"]
        assert "head.weight" in res["renamed"] and "module.head.weight" in res["renamed"]
        assert any("no 'grace' entry" in m for m in res["no_grace_key"])
        assert res["same_names_ok"]


@pytest.fixture(scope="module")
def tf_ranks(tmp_path_factory):
    return mp.run("faults_tf.py", np=2, args=[tmp_path_factory.mktemp("ckpt")], timeout=300)


@pytest.mark.multiproc
@pytest.mark.parametrize("method", ["signsgd", "signum"])
def test_sign_methods_leave_zero_gradients_alone_tf(tf_ranks, method):
    for res in tf_ranks:
        assert res[f"{method}_rows"] == [True] * 4 + [False] * 6
        assert res[f"{method}_zero_moved"] is False


@pytest.mark.multiproc
def test_tf_checkpoint_checks_configuration_rank_and_size(tf_ranks):
    for res in tf_ranks:
        assert "is for configuration" in res["ckpt_other_config"]
        assert "2 ranks; this job has 2" not in res["ckpt_size"]
        assert "a job of 3 ranks; this job has 2" in res["ckpt_size"]
        assert res["ckpt_own"] == "no error"
    assert tf_ranks[0]["ckpt_rank0_file"] == "no error"
    assert "written by rank 0, this is rank 1" in tf_ranks[1]["ckpt_rank0_file"]


@pytest.mark.multiproc
def test_tf_gradient_none_on_one_rank_raises_value_error_on_every_rank(tf_ranks):
    for res in tf_ranks:
        assert res["none_grad"][0] == "ok" and len(res["none_grad"]) == 2
        assert "ranks disagree on the gradients" in res["none_grad"][1]
        assert "none_b" in res["none_grad"][1]


@pytest.mark.multiproc
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_grace_on_some_ranks_only_fails_on_every_rank_within_60s(framework):
    start = time.monotonic()
    errors = mp.run("mixed_grace.py", np=2, args=[framework], timeout=60)
    assert time.monotonic() - start < 60
    for error in errors:
        assert re.match(r"ValueError: ranks disagree on the grace configuration: ranks \[0\] "
                        r"have .*TopKCompressor.*, ranks \[1\] have grace=None", error), error
