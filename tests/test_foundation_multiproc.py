"""Real 2-rank Horovod jobs (Gloo and Open MPI) for both frameworks: the stack set-up builds
works end to end, and tests/mp.py collects every rank's result."""

import numpy as np
import pytest

import mp

N = 2


def _check(results, keys=("sum",)):
    assert [res["rank"] for res in results] == list(range(N))
    expected_sum = sum(np.arange(6, dtype=np.float32) + 10 * r for r in range(N))
    expected_gather = np.concatenate([np.full((r + 1, 2), float(r)) for r in range(N)])
    for res in results:
        assert res["size"] == N
        for key in keys:
            np.testing.assert_array_equal(res[key], expected_sum)
        np.testing.assert_array_equal(res["gather"], expected_gather)
        np.testing.assert_array_equal(res["bcast"], [float(N - 1), 7.0])


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_torch_collectives(launcher):
    results = mp.run("smoke_torch.py", np=N, launcher=launcher, timeout=180)
    _check(results)
    if launcher == "gloo":
        assert all(res["gloo"] for res in results)
    else:
        assert all(res["mpi"] for res in results)


@pytest.mark.multiproc
def test_torch_init_from_mpi4py_communicator():
    results = mp.run("smoke_torch.py", np=N, launcher="mpi", args=["--mpi4py-comm"], timeout=180)
    _check(results)


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_tensorflow_collectives_eager_and_graph(launcher):
    results = mp.run("smoke_tf.py", np=N, launcher=launcher, timeout=240)
    _check(results, keys=("sum", "graph_sum"))
