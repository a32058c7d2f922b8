"""What several test modules share in-process: a one-rank ``Collectives`` (so pipelines run
without Horovod or torch.distributed) and comparisons of parameter dicts."""

from __future__ import annotations

import numpy as np

from grace_dl.collectives import Collectives


class OneRank(Collectives):
    """The collectives of a one-process job: every collective returns (a copy of) its input."""

    def size(self):
        return 1

    def rank(self):
        return 0

    def allreduce_async(self, tensor, name):
        return tensor.clone()

    def allgather_async(self, tensor, name):
        return tensor.clone()

    def broadcast_async(self, tensor, root, name):
        return tensor.clone()

    def alltoall_async(self, tensor, splits, name):
        return tensor.clone(), splits

    def synchronize(self, handle):
        return handle


def assert_equal_dicts(a: dict, b: dict):
    """Same keys, bit-identical arrays."""
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def assert_dicts_differ(a: dict, b: dict):
    assert any(not np.array_equal(a[k], b[k]) for k in a)
