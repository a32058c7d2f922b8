"""Sparsifiers under real 2-rank Horovod jobs (horovodrun --gloo and mpirun)."""

import math

import numpy as np
import pytest

import mp

N = 2


def _sparse_top(x, k):
    out = np.zeros_like(x)
    keep = np.argsort(-np.abs(x), kind="stable")[:k]
    out[keep] = x[keep]
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("mode, launcher", [("torch", "gloo"), ("tf-graph", "mpi")])
def test_sparsifiers_across_ranks(mode, launcher):
    results = mp.run("sparse_ranks.py", np=N, launcher=launcher, args=[mode], timeout=300)
    grads = [res["grads"][0] for res in results]
    # randomk: same positions on every rank whatever the order, new ones per name and step
    first = results[0]["drawn"]
    for res in results[1:]:
        for key, idx in first.items():
            np.testing.assert_array_equal(res["drawn"][key], idx)
    assert len({frozenset(v.tolist()) for v in first.values()}) == len(first)
    # randomk over allreduce: the mean of every rank's values at the shared positions
    got = results[0]["averaged"]["randomk"]
    kept = got != 0
    assert kept.sum() == math.ceil(0.05 * grads[0].size)
    np.testing.assert_allclose(got[kept], np.mean(grads, axis=0)[kept], rtol=1e-5)
    # threshold with a different threshold (hence count) per rank, over allgather
    expect = np.mean([np.where(np.abs(g) > 1.0 + r, g, 0) for r, g in enumerate(grads)], axis=0)
    # dgc on a small tensor keeps exactly the top k of each rank
    expect_dgc = np.mean([_sparse_top(g, math.ceil(0.05 * g.size)) for g in grads], axis=0)
    for res in results:
        np.testing.assert_allclose(res["averaged"]["randomk"], got, rtol=1e-6)
        np.testing.assert_allclose(res["averaged"]["threshold"], expect, rtol=1e-6)
        np.testing.assert_allclose(res["averaged"]["dgc"], expect_dgc, rtol=1e-6)
