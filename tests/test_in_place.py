"""``send(..., into=)``: an uncompressed allreduce of the caller's own gradient sums it in place
(Horovod's ``allreduce_async_``, the average taken by its postscale), a payload no one reads
after sending (fp16 without a memory) is summed in place too, and every other case keeps the
result out of place. Driven in one process by ``Twin``, a two-rank job whose other
rank holds the same tensor (so the sum is twice it), recording which verb each call used."""

from __future__ import annotations

import pytest
import torch

from grace_dl import grace_from_params
from grace_dl.collectives import Collectives


class Twin(Collectives):
    def __init__(self):
        self.calls = []

    def size(self):
        return 2

    def rank(self):
        return 0

    def allreduce_async(self, tensor, name):
        self.calls.append("allreduce")
        return tensor * 2

    def allreduce_async_(self, tensor, name, scale=1.0):
        self.calls.append(f"allreduce_ x{scale}")
        return tensor.mul_(2 * scale)

    def allgather_async(self, tensor, name):
        return torch.cat([tensor, tensor])

    def broadcast_async(self, tensor, root, name):
        return tensor.clone()

    def alltoall_async(self, tensor, splits, name):
        return tensor.clone(), splits

    def synchronize(self, handle):
        return handle


def test_uncompressed_allreduce_of_into_sums_in_place_and_averages_by_postscale():
    grc, coll = grace_from_params({"compressor": "none"}), Twin()
    grad = torch.arange(6.0).reshape(2, 3)
    handle = grc.send(grad, "w", collectives=coll, into=grad)
    out = grc.receive(handle)
    assert coll.calls == ["allreduce_ x0.5"]
    assert out is grad and out.data_ptr() == grad.data_ptr()
    torch.testing.assert_close(out, torch.arange(6.0).reshape(2, 3), rtol=0, atol=0)


def test_op_sum_in_place_has_no_postscale():
    grc, coll = grace_from_params({"compressor": "none"}), Twin()
    grad = torch.ones(4)
    grc.receive(grc.send(grad, "w", op="sum", collectives=coll, into=grad))
    assert coll.calls == ["allreduce_ x1.0"]
    torch.testing.assert_close(grad, torch.full((4,), 2.0), rtol=0, atol=0)


def test_receive_into_another_tensor_copies_the_in_place_result():
    grc, coll = grace_from_params({"compressor": "none"}), Twin()
    grad, other = torch.ones(4), torch.zeros(4)
    out = grc.receive(grc.send(grad, "w", collectives=coll, into=grad), into=other)
    assert out is other
    torch.testing.assert_close(other, torch.ones(4), rtol=0, atol=0)


@pytest.mark.parametrize("params, into", [
    ({"compressor": "none"}, "none"),                           # no target given
    ({"compressor": "none"}, "other"),                          # a target that is not the input
    ({"compressor": "none", "memory": "residual"}, "grad"),     # the payload is the residual's
    ({"compressor": "fp16", "memory": "residual"}, "grad"),     # its payload is read again
])
def test_everything_else_stays_out_of_place(params, into):
    grc, coll = grace_from_params(params), Twin()
    grad = torch.arange(4.0)
    target = {"none": None, "other": torch.zeros(4), "grad": grad}[into]
    out = grc.receive(grc.send(grad, "w", collectives=coll, into=target))
    assert coll.calls == ["allreduce"]
    torch.testing.assert_close(out, torch.arange(4.0), rtol=0, atol=0)
    if target is not None:
        assert out is target


@pytest.mark.parametrize("into", ["none", "grad"])
def test_a_payload_no_one_reads_again_is_summed_in_place_not_the_gradient(into):
    """fp16 without a memory: its payload is a new tensor that nothing reads after sending, so
    the engine sums it in place (no fresh buffer); the caller's gradient is not what is
    summed (untouched unless it is the ``into`` the result lands in)."""
    grc, coll = grace_from_params({"compressor": "fp16"}), Twin()
    grad = torch.arange(4.0)
    target = grad if into == "grad" else None
    out = grc.receive(grc.send(grad, "w", collectives=coll, into=target))
    assert coll.calls == ["allreduce_ x1.0"]
    torch.testing.assert_close(out, torch.arange(4.0), rtol=0, atol=0)
    if target is None:
        assert out is not grad and torch.equal(grad, torch.arange(4.0))
    else:
        assert out is grad


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("comm", ["allreduce", "allgather", "twophase"])
def test_half_gradient_in_the_wire_dtype_is_sent_not_its_update(name, dtype, comm):
    """A gradient already in the wire dtype: the payload is not a view of the residual's slot,
    which the memory's update zeroes (it sent zeros)."""
    from support import OneRank

    if name == "bf16" and comm == "allreduce":
        return      # bf16 is not allreduce-safe (refused at construction)
    grc = grace_from_params({"compressor": name, "memory": "residual", "communicator": comm})
    x = torch.randn(1000).to(dtype)
    out = grc.receive(grc.send(x.clone(), "w", collectives=OneRank()))
    assert torch.equal(out, x)
