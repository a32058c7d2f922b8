"""PowerSGD's bucket path in the DDP hook (``grace_dl.torch.ddp_powersgd``) against the reference
composition it replaces (``Allreduce`` per parameter, rounds fused per bucket): the same
parameters bit for bit, the same bytes counted and the same state, on the small decoder (its
bucket out of first-met order), with PowerSGD's options that change what is compressed, and
both averaging ops. One process on gloo (a world of one); test_ddp's 2-rank jobs compare the
sums and the resume, test_ddp_sync finds no host synchronisation on its device path."""

import pytest
import torch
from test_ddp_bucket_order import (
    _keys,
    _model,
    _train,
    group,  # noqa: F401  (its one-process gloo group)
)

from grace_dl import grace_from_params
from grace_dl.communicators.allreduce import Allreduce
from grace_dl.compressors.powersgd import PowerSGDCompressor
from grace_dl.torch import ddp as grace_ddp
from grace_dl.torch.ddp_powersgd import PowerSGDBuckets

POWERSGD = {"compressor": "powersgd", "compress_rank": 2, "memory": "powersgd",
            "communicator": "allreduce"}


def _run(params, op, bucket_path):
    state = grace_ddp.GraceState(grace_from_params(dict(params)), op=op)
    assert (state._powersgd is not None) == PowerSGDBuckets.serves(state.grace)
    if not bucket_path:
        state._powersgd = None
    _, got = _train(_model(), state, range(4))
    return got, state


@pytest.mark.parametrize("op", ["average", "sum"])
@pytest.mark.parametrize("extra", [{}, {"start_step": 2}, {"min_compression_rate": 0.5},
                                   {"compress_rank": 1}])
def test_the_bucket_path_gives_the_reference_compositions_bits(extra, op):
    params = {**POWERSGD, **extra}
    fast, on_path = _run(params, op, True)
    slow, reference = _run(params, op, False)
    assert on_path._powersgd is not None
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    assert on_path.last_step_names == reference.last_step_names
    assert on_path.grace.bytes.steps == reference.grace.bytes.steps
    mine, theirs = on_path.grace.state_dict(), reference.grace.state_dict()
    assert sorted(_keys(mine)) == sorted(_keys(theirs))
    for part in ("compressor", "memory"):
        for key, value in mine[part].items():
            assert (value == theirs[part][key]).all(), key


def test_only_grace_s_own_powersgd_takes_the_bucket_path():
    class Mine(PowerSGDCompressor):
        pass

    assert PowerSGDBuckets.serves(grace_from_params(dict(POWERSGD)))
    assert not PowerSGDBuckets.serves(grace_from_params({**POWERSGD, "memory": "none"}))
    assert not PowerSGDBuckets.serves(Allreduce(Mine(), grace_from_params(
        dict(POWERSGD)).memory))
    fused = grace_from_params(dict(POWERSGD))
    fused.fuse([["a", "b"]])
    assert not PowerSGDBuckets.serves(fused)
    # bucket granularity sends flat buckets, which PowerSGD leaves uncompressed: no path
    state = grace_ddp.GraceState(grace_from_params(dict(POWERSGD)), granularity="bucket")
    assert state._powersgd is None
