"""The compiled kernels in a 2-rank horovodrun job (tests/workers/native_twins.py): every
pipeline that runs them gives the same parameters bit for bit as with ``native.use(False)``,
and signsgd two-phase's server step really ran fused (``sign_vote_feedback``) on every rank."""

import numpy as np
import pytest

import mp

PIPELINES = ("signsgd-2phase", "signsgd-2phase-pieces", "signsgd-2phase-no-feedback",
             "signsgd-allgather", "qsgd-2phase", "topk", "threshold")


@pytest.fixture(scope="module")
def ranks():
    return mp.run("native_twins.py", np=2, timeout=300)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PIPELINES)
def test_kernels_and_twins_train_to_the_same_parameters(ranks, name):
    for res in ranks:
        assert res["available"]
        with_kernels, twins = res[name]["kernels"]["params"], res[name]["twins"]["params"]
        assert with_kernels.keys() == twins.keys()
        for k in twins:
            assert np.array_equal(with_kernels[k], twins[k]), (name, k)
        assert not any(np.array_equal(v, 0 * v) for v in twins.values())


@pytest.mark.multiproc
def test_the_two_phase_server_step_runs_fused(ranks):
    """Each rank's chunk of each of the 4 parameters, every step: 12 fused steps a rank (more
    in pieces); none without server feedback, on allgather, or with the kernels off."""
    for res in ranks:
        assert res["signsgd-2phase"]["kernels"]["fused"] == 4 * 3
        assert res["signsgd-2phase-pieces"]["kernels"]["fused"] > 4 * 3
        for name in PIPELINES:
            assert res[name]["twins"]["fused"] == 0
        for name in ("signsgd-2phase-no-feedback", "signsgd-allgather", "qsgd-2phase"):
            assert res[name]["kernels"]["fused"] == 0
