"""grace ``fp16`` with no memory in the DDP hook: cast, summed in place and cast back by the hook
itself (``sums_in_half``), the send path's bits, bytes and names, on the small decoder; one
process on gloo (a world of one; test_ddp's 2-rank jobs train fp16 through the hook)."""

import pytest
import torch
from test_ddp_bucket_order import (
    _model,
    _train,
    group,  # noqa: F401  (its one-process gloo group)
)

from grace_dl import grace_from_params
from grace_dl.torch import ddp as grace_ddp

FP16 = {"compressor": "fp16", "memory": "none", "communicator": "allreduce"}


@pytest.mark.parametrize("op", ["average", "sum"])
def test_the_hook_s_fp16_gives_the_send_path_s_bits_bytes_and_names(op):
    runs = []
    for direct in (True, False):
        state = grace_ddp.GraceState(grace_from_params(dict(FP16)), op=op)
        assert state._sums_in_half
        state._sums_in_half = direct
        _, params = _train(_model(), state, range(4))
        runs.append((params, state.grace.bytes.steps, state.last_step_names))
    (fast, fast_bytes, fast_names), (slow, slow_bytes, slow_names) = runs
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    assert fast_bytes == slow_bytes and fast_names == slow_names


def test_only_grace_s_own_fp16_without_memory_is_cast_by_the_hook():
    assert grace_ddp.sums_in_half(grace_from_params(dict(FP16)))
    assert not grace_ddp.sums_in_half(grace_from_params({**FP16, "memory": "residual"}))
    assert not grace_ddp.sums_in_half(grace_from_params({**FP16, "compressor": "bf16",
                                                         "communicator": "allgather"}))
    assert not grace_ddp.sums_in_half(grace_from_params({**FP16, "compressor": "none"}))
