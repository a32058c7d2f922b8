"""Loose parameters are refused at construction, naming the parameter and what is accepted."""

import numpy as np
import pytest

from grace_dl import grace_from_params


@pytest.mark.parametrize("value", [True, False, "0.5", "1e-2", b"0.1", None, [0.1]])
def test_compress_ratio_must_be_a_real_number(value):
    with pytest.raises(ValueError, match=r"compress_ratio must be a number .*got"):
        grace_from_params({"compressor": "topk", "communicator": "allgather",
                           "compress_ratio": value})


def test_numpy_numbers_are_still_accepted():
    grc = grace_from_params({"compressor": "topk", "communicator": "allgather",
                             "compress_ratio": np.float32(0.25), "seed": np.int64(3)})
    assert grc.compressor.compress_ratio == 0.25 and grc.compressor.seed == 3


@pytest.mark.parametrize("compressor", ["qsgd", "terngrad", "natural", "sketch", "topk",
                                        "randomk"])
@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "7", True])
def test_seed_is_range_checked_and_named(compressor, seed):
    comm = "allreduce" if compressor == "randomk" else "allgather"
    with pytest.raises(ValueError, match=r"seed must be (in \[0, 4294967295\]|an integer)"):
        grace_from_params({"compressor": compressor, "communicator": comm, "seed": seed})


@pytest.mark.parametrize("value", ["garbage", 3, object()])
def test_process_set_must_be_a_horovod_process_set(value):
    with pytest.raises(ValueError, match="process_set must be None .* ProcessSet"):
        grace_from_params({"compressor": "fp16", "process_set": value})


def test_horovod_process_set_is_accepted():
    import horovod.common.process_sets as ps

    grc = grace_from_params({"compressor": "fp16", "process_set": ps.global_process_set})
    assert grc.process_set is ps.global_process_set
