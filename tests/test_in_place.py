"""``send(..., into=)``: an uncompressed allreduce of the caller's own gradient sums it in place
(Horovod's ``allreduce_async_``, the average taken by its postscale), and every other case
keeps the result out of place. Driven in one process by ``Twin``, a two-rank job whose other
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
    ({"compressor": "fp16"}, "grad"),                           # the payload is a new tensor
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


SPARSE = [
    {"compressor": "topk", "compress_ratio": 0.05, "memory": "residual",
     "communicator": "allgather"},
    {"compressor": "randomk", "compress_ratio": 0.05, "memory": "residual",
     "communicator": "allreduce"},
    {"compressor": "topk", "compress_ratio": 0.05, "memory": "residual",
     "communicator": "broadcast"},
]


def _steps(params, into_grad: bool, steps=4):
    """Each step's result and the residual after it, for the gradient sent from (and its
    result written into) itself, or from a copy into another tensor; and whether each
    step's encode cleared its input."""
    grc, coll = grace_from_params(params), Twin()
    gen = torch.Generator().manual_seed(1)
    results, cleared = [], []
    for _ in range(steps):
        grad = torch.randn(3000, generator=gen)
        grad[:7] = -0.0
        into = grad if into_grad else torch.full((3000,), 9.0)
        handle = grc.send(grad, "w", collectives=coll, into=into)
        cleared.append(handle.encoded.cleared)
        if into_grad:
            assert (grad.view(torch.int32) == 0).all()    # +0.0 until the result lands
        out = grc.receive(handle)
        assert out is into
        results.append((out.clone(), grc.memory.state.variables()["w"].clone()))
    return results, cleared


@pytest.mark.parametrize("params", SPARSE, ids=lambda p: f"{p['compressor']}-{p['communicator']}")
def test_a_sparse_result_into_the_gradient_clears_it_while_compensating(params):
    """Sent from ``p.grad`` into ``p.grad`` (the glue's case), the residual memory zeroes the
    gradient in its compensation pass and the sparse result writes only its values there:
    the same bits, step after step, as sending a copy into another tensor."""
    got, cleared = _steps(params, True)
    want, kept = _steps(params, False)
    assert all(cleared) and not any(kept)
    for (out, res), (out_w, res_w) in zip(got, want):
        assert torch.equal(out.view(torch.int32), out_w.view(torch.int32))
        assert torch.equal(res.view(torch.int32), res_w.view(torch.int32))


@pytest.mark.parametrize("params", [
    {"compressor": "qsgd", "memory": "residual", "communicator": "allgather"},  # dense result
    {"compressor": "topk", "compress_ratio": 0.05, "memory": "none",
     "communicator": "allgather"},                   # the payload is gathered from the input
    {"compressor": "topk", "compress_ratio": 0.05, "memory": "residual", "beta": 0.5,
     "communicator": "allgather"},                   # compensated out of the slot
], ids=["dense", "no-memory", "beta"])
def test_the_gradient_is_kept_where_clearing_would_not_pay_or_not_hold(params):
    grc, coll = grace_from_params(params), Twin()
    grad = torch.randn(3000, generator=torch.Generator().manual_seed(2))
    keep = grad.clone()
    handle = grc.send(grad, "w", collectives=coll, into=grad)
    assert not handle.encoded.cleared
    assert torch.equal(grad, keep)      # read by the pipeline until receive
    grc.receive(handle)


def test_without_the_kernels_nothing_is_cleared_and_the_result_is_the_same():
    from grace_dl import native

    params = SPARSE[0]
    want, _ = _steps(params, True)
    native.use(False)
    try:
        got, cleared = _steps(params, False)
        grc, coll = grace_from_params(params), Twin()
        grad = torch.ones(3000)
        assert not grc.send(grad, "w", collectives=coll, into=grad).encoded.cleared
    finally:
        native.use(True)
    assert not any(cleared)
    for (out, _), (out_w, _) in zip(got, want):
        assert torch.equal(out, out_w)


def test_a_cleared_gradient_received_into_another_tensor_gets_the_whole_result():
    params = SPARSE[0]
    ((want, _),), _ = _steps(params, False, steps=1)
    grc, coll = grace_from_params(params), Twin()
    grad = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    grad[:7] = -0.0
    other = torch.full((3000,), 9.0)
    out = grc.receive(grc.send(grad, "w", collectives=coll, into=grad), into=other)
    assert out is other and torch.equal(other, want)
