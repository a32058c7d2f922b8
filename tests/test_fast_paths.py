"""The overhead cuts give the same bits as the plain paths they replace: sparse ``combine``
against decompress-each-then-aggregate, the residual memory's sparse update against its dense
one, and ``receive(into=...)`` against ``receive``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grace_dl import grace_from_params
from grace_dl.backend import ops_for
from grace_dl.communicators.base import accumulator, marked, nonfinite_mark
from grace_dl.compressors.base import Call
from grace_dl.compressors.paths import Paths, Reference, feedback_of, own
from grace_dl.registry import lookup
from support import OneRank

SPARSE = {"topk": {"compress_ratio": 0.05}, "randomk": {"compress_ratio": 0.05},
          "randomk-unbiased": {"compress_ratio": 0.05, "unbiased": True},
          "threshold": {"threshold": 1.0}, "dgc": {"compress_ratio": 0.05}}


def _compressor(key):
    name = key.split("-")[0]
    return lookup("compressor", name)(**SPARSE[key])


def _tensor(seed, shape=(37, 29)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[0, :3] = torch.tensor([float("inf"), -0.0, 5.0])
    return x


@pytest.mark.parametrize("key", sorted(SPARSE))
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_sparse_combine_equals_decompress_then_aggregate(key, ranks):
    comp = _compressor(key)
    assert comp.caps.sparse
    sent = [comp.compress(_tensor(r), "w", Call(r, ranks)) for r in range(ranks)]
    ctx = sent[0][1]
    expected = Reference(comp).combine([p for p, _ in sent], ctx)
    got = own(comp).combine([p for p, _ in sent], ctx)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_array_equal(got.numpy(), expected.numpy())


@pytest.mark.parametrize("key", sorted(SPARSE))
@pytest.mark.parametrize("ranks", [1, 2])
def test_sparse_combine_into_a_buffer(key, ranks):
    """``combine(..., out)`` builds the result in ``out`` (whatever it held) and returns it."""
    comp = _compressor(key)
    sent = [comp.compress(_tensor(r), "w", Call(r, ranks)) for r in range(ranks)]
    ctx = sent[0][1]
    expected = Reference(comp).combine([p for p, _ in sent], ctx)
    out = torch.full_like(expected, float("nan"))
    got = own(comp).combine([p for p, _ in sent], ctx, out)
    assert got is out
    np.testing.assert_array_equal(out.numpy(), expected.numpy())


@pytest.mark.parametrize("key", sorted(SPARSE))
def test_sent_entries_rebuild_the_decompressed_payload(key):
    comp = _compressor(key)
    x = _tensor(4)
    payload, ctx = comp.compress(x, "w")
    positions, values = comp.sent_entries(payload, ctx)
    dense = torch.zeros(x.numel())
    dense[positions.long()] = values
    np.testing.assert_array_equal(dense.view(x.shape).numpy(),
                                  comp.decompress(payload, ctx).numpy())


@pytest.mark.parametrize("key", sorted(SPARSE))
def test_residual_sparse_update_equals_the_dense_one(key):
    """Three steps through a communicator (compensation in the residual's slot, k entries
    subtracted) against the memory updated with the dense approximation."""
    fast = grace_from_params({"compressor": key.split("-")[0], **SPARSE[key],
                              "memory": "residual", "communicator": "allgather"})
    slow = grace_from_params({"compressor": key.split("-")[0], **SPARSE[key],
                              "memory": "residual", "communicator": "allgather"})
    for step in range(3):
        x = _tensor(10 + step)
        out = fast.synchronize(x, "w", collectives=OneRank())
        compensated = slow.memory.compensate(x, "w")
        # the tensor holds an inf: the communicator marks the payload (Communicator.encode)
        mark = nonfinite_mark(compensated, ops_for(compensated))
        payload, ctx = slow.compressor.compress(compensated, "w", Call(0, 1))
        slow.memory.update(compensated, "w", slow.compressor, payload, ctx,
                           slow.compressor.decompress(payload, ctx))
        sent = slow.compressor.decompress(marked(payload, mark), ctx)
        np.testing.assert_array_equal(out.numpy(), sent.numpy())
        np.testing.assert_array_equal(fast.memory.state_dict()["w"],
                                      slow.memory.state_dict()["w"])
    assert not fast.feedback._in_slot


def test_residual_update_called_directly_with_a_sparse_compressor():
    """Outside a communicator (compensate, then update without an approximation) the sparse
    update still starts from the compensated tensor."""
    mem = lookup("memory", "residual")()
    comp = _compressor("topk")
    for step in range(2):
        x = _tensor(step)
        compensated = mem.compensate(x, "w")
        payload, ctx = comp.compress(compensated, "w")
        mem.update(compensated, "w", comp, payload, ctx)
        # the inf's slot is reset (a memory keeps nothing non-finite: memory.base)
        expected = (compensated - comp.decompress(payload, ctx)).nan_to_num(0.0, 0.0, 0.0)
        np.testing.assert_array_equal(mem.state_dict()["w"], expected.numpy())


def test_residual_accumulator_takes_the_parts_and_compensation_then_adds_nothing():
    """``Feedback.accumulator``: the parts added into the residual's slot, then sent through a
    communicator, give the payload and residual of sending the whole tensor; the step after
    compensates as usual. None where the slot is not where compensation happens."""
    params = {"compressor": "topk", "compress_ratio": 0.1, "memory": "residual",
              "communicator": "allgather"}
    whole, parts = grace_from_params(dict(params)), grace_from_params(dict(params))
    for step in range(3):
        x = _tensor(step)
        sent = [whole.encode(x, "w", Call(0, 1))]
        if step < 2:
            slot = parts.feedback.accumulator("w", x, parts.compressor)
            slot.view(-1)[:50].add_(x.view(-1)[:50])
            slot.view(-1)[50:].add_(x.view(-1)[50:])
            garbage = torch.full_like(x, float("nan"))   # its values are not read
            sent.append(parts.encode(garbage, "w", Call(0, 1)))
        else:
            sent.append(parts.encode(x, "w", Call(0, 1)))
        for a, b in zip(sent[0].payload, sent[1].payload):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        np.testing.assert_array_equal(whole.memory.state_dict()["w"],
                                      parts.memory.state_dict()["w"])
    x = _tensor(0)
    assert accumulator(whole, "w", x) is not None

    class OwnEncode(type(whole)):    # may not compensate through the memory
        def encode(self, tensor, name, call):
            return super().encode(tensor, name, call)

    mine = OwnEncode(whole.compressor, lookup("memory", "residual")())
    assert mine.feedback.accumulator("w", x, mine.compressor) is not None and \
        accumulator(mine, "w", x) is None

    def slot_of(memory, compressor):
        return feedback_of(memory).accumulator("w", x, compressor)

    assert slot_of(lookup("memory", "residual")(beta=0.5), _compressor("topk")) is None
    assert slot_of(lookup("memory", "residual")(), lookup("compressor", "none")()) is None
    assert slot_of(lookup("memory", "none")(), _compressor("topk")) is None


@pytest.mark.parametrize("params", [
    {"compressor": "none", "memory": "none", "communicator": "allreduce"},
    {"compressor": "topk", "compress_ratio": 0.1, "memory": "residual",
     "communicator": "allgather"},
    {"compressor": "qsgd", "quantum_num": 16, "memory": "residual", "communicator": "twophase"},
    {"compressor": "randomk", "compress_ratio": 0.1, "memory": "residual",
     "communicator": "allreduce"},
    {"compressor": "topk", "compress_ratio": 0.1, "memory": "none", "communicator": "broadcast"},
    {"compressor": "powersgd", "memory": "powersgd", "communicator": "allreduce"},
])
def test_receive_into_writes_the_average(params):
    a, b = grace_from_params(dict(params)), grace_from_params(dict(params))
    x = _tensor(3)
    plain = a.receive(a.send(x.clone(), "w", collectives=OneRank()))
    into = torch.full_like(x, 7.0)
    got = b.receive(b.send(x.clone(), "w", collectives=OneRank()), into=into)
    assert got is into
    np.testing.assert_array_equal(into.numpy(), plain.numpy())


class _Mirrored(OneRank):
    """Two ranks that sent the same tensors: a sum doubles, a gather repeats."""

    def size(self):
        return 2

    def allreduce_async(self, tensor, name):
        return tensor * 2

    def allgather_async(self, tensor, name):
        return torch.cat([tensor, tensor])


@pytest.mark.parametrize("params,folded", [
    ({"compressor": "topk", "compress_ratio": 0.1, "memory": "residual",
      "communicator": "allgather"}, True),
    ({"compressor": "randomk", "compress_ratio": 0.1, "memory": "residual",
      "communicator": "allreduce"}, True),
    ({"compressor": "topk", "compress_ratio": 0.1, "memory": "none",
      "communicator": "broadcast"}, True),
    ({"compressor": "fp16", "memory": "none", "communicator": "allgather"}, False),
])
def test_a_sparse_average_divides_the_values_not_the_dense_result(params, folded):
    """Received into a gradient, a sparse average divides the N*k values before scattering
    them (the handle is finished in place: no O(n) division after); the result is the one
    the dense division gives."""
    a, b = grace_from_params(dict(params)), grace_from_params(dict(params))
    x = _tensor(4)
    plain = a.receive(a.send(x.clone(), "w", collectives=_Mirrored()))
    into = torch.full_like(x, 7.0)
    handle = b.send(x.clone(), "w", collectives=_Mirrored())
    assert b.receive(handle, into=into) is into
    assert handle.finished_in_place is folded
    np.testing.assert_array_equal(into.numpy(), plain.numpy())
    assert np.count_nonzero(into.numpy()) < into.numel() or not folded


def test_receive_into_after_the_handle_was_finished_for_another():
    """A dispatcher may finish a handle before its own receive: ``into`` is still written."""
    from grace_dl.communicators.base import _finish

    grc = grace_from_params({"compressor": "none", "memory": "none",
                             "communicator": "allreduce"})
    x = _tensor(5)
    handle = grc.send(x, "w", collectives=OneRank())
    early = _finish(handle).clone()
    into = torch.zeros_like(x)
    grc.receive(handle, into=into)
    np.testing.assert_array_equal(into.numpy(), early.numpy())


@pytest.mark.parametrize("traced", [False, True])
def test_residual_sparse_update_in_tensorflow(traced):
    """The TF variables take the same in-slot path (``assign_add``, ``assign_sub_at``)."""
    tf = pytest.importorskip("tensorflow")
    fast = feedback_of(lookup("memory", "residual")())
    slow = lookup("memory", "residual")()
    comp = _compressor("topk")

    def step(x):
        compensated = fast.compensate(x, "w", comp)
        payload, ctx = comp.compress(compensated, "w")
        fast.update(compensated, "w", comp, payload, ctx)
        return payload[0]

    run = tf.function(step) if traced else step
    for i in range(3):
        x = _tensor(20 + i).numpy()
        run(tf.constant(x))
        compensated = slow.compensate(tf.constant(x), "w")
        payload, ctx = comp.compress(compensated, "w")
        slow.update(compensated, "w", comp, payload, ctx, comp.decompress(payload, ctx))
        np.testing.assert_array_equal(fast.memory.state_dict()["w"], slow.state_dict()["w"])


def test_tensorflow_assign_zero_at_and_known_finite():
    """TF's twins of the ops the torch paths use: zeros at flat positions of a 2-D variable
    (as torch writes them); a float tensor is never known finite in a graph."""
    tf = pytest.importorskip("tensorflow")
    from grace_dl.tensorflow import ops as tf_ops
    from grace_dl.torch import ops as torch_ops

    x = _tensor(3, (4, 6))
    var = tf.Variable(x.numpy())
    idx = [0, 5, 23]
    tf_ops.assign_zero_at(var, tf.constant(idx, tf.int32))
    torch_ops.assign_zero_at(x, torch.tensor(idx))
    np.testing.assert_array_equal(var.numpy(), x.numpy())
    assert not tf_ops.known_finite(tf.ones(3)) and tf_ops.known_finite(tf.range(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("sign", [None, 1, -1])
@pytest.mark.parametrize("thr", [1.5, 0.0, -1.0, float("inf")])
def test_positions_at_least_match_the_mask_in_torch_and_tf(dtype, sign, thr):
    """Chunked NumPy on CPU (several chunks here), torch's compare elsewhere, TF's: one set."""
    from grace_dl.torch import ops as tops

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3 * (1 << 16) + 123, generator=g) * 2).to(dtype)
    x[[0, 70000, 140001]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    x[5] = -0.0
    t = torch.tensor(thr, dtype=dtype)
    mag = x.abs() if sign is None else (x if sign > 0 else -x)
    expected = np.flatnonzero((mag >= t).numpy())
    got = tops.positions_at_least(x, t, sign)
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), expected)
    if dtype != torch.float16:
        tf = pytest.importorskip("tensorflow")
        from grace_dl.tensorflow import ops as fops

        tx = tf.constant(x.numpy())
        got_tf = fops.positions_at_least(tx, tf.constant(thr, tx.dtype), sign)
        np.testing.assert_array_equal(got_tf.numpy(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("k", [1, 2, 500, 999, 1000])
def test_kth_largest_is_the_min_of_the_top_k_in_torch_and_tf(dtype, k):
    """A selection (NumPy's partition on CPU, kthvalue elsewhere, TF's top_k) gives the value
    the partial sort gave, ties and infinities included."""
    from grace_dl.torch import ops as tops

    g = torch.Generator().manual_seed(k)
    x = torch.randint(-40, 40, (1000,), generator=g).to(dtype) / 8   # many ties
    x[[3, 9]] = torch.tensor([float("inf"), -float("inf")], dtype=dtype)
    expected = torch.topk(x, k).values.min()
    got = tops.kth_largest(x, k)
    assert got.dtype == x.dtype and got.item() == expected.item()
    assert tops.kth_largest(x, torch.tensor(k)).item() == expected.item()
    if dtype != torch.float16:
        tf = pytest.importorskip("tensorflow")
        from grace_dl.tensorflow import ops as fops

        assert fops.kth_largest(tf.constant(x.numpy()), k).numpy() == expected.item()


def test_receive_into_a_channels_last_gradient():
    """Sparse results land in row-major positions even when the gradient's memory is not."""
    grc = grace_from_params({"compressor": "topk", "compress_ratio": 0.2, "memory": "none",
                             "communicator": "allgather"})
    x = torch.randn(2, 3, 4, 5)
    plain = grace_from_params({"compressor": "topk", "compress_ratio": 0.2, "memory": "none",
                               "communicator": "allgather"})
    expected = plain.receive(plain.send(x.clone(), "w", collectives=OneRank()))
    into = torch.empty_like(x).to(memory_format=torch.channels_last)
    assert not into.is_contiguous()
    grc.receive(grc.send(x.clone(), "w", collectives=OneRank()), into=into)
    np.testing.assert_array_equal(into.numpy(), expected.numpy())


@pytest.mark.parametrize("name", ["efsignsgd", "signsgd", "topk", "randomk", "qsgd", "fp16"])
def test_combine_of_one_rank_still_aggregates(name):
    """A one-rank gather aggregates its one payload (efsignsgd's aggregate divides by lr):
    ``combine`` never skips ``aggregate``; only ``decompress_into`` (allreduce) does."""
    comp = lookup("compressor", name)(**({"lr": 0.1} if name == "efsignsgd" else {}))
    x = torch.randn(37, 29, generator=torch.Generator().manual_seed(7))  # finite: a scale
    payload, ctx = comp.compress(x, "w")
    expected = comp.aggregate([comp.decompress(payload, ctx)])
    np.testing.assert_array_equal(own(comp).combine([payload], ctx).numpy(), expected.numpy())
    np.testing.assert_array_equal(own(comp).decompress_into(payload, ctx).numpy(),
                                  comp.decompress(payload, ctx).numpy())


@pytest.mark.parametrize("n,bucket", [(1, 512), (511, 512), (512, 512), (1537, 512),
                                      (3000, 100), (40, 1)])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_qsgd_combine_and_decompress_into_equal_the_plain_paths(n, bucket, ranks):
    """qsgd decodes into ``out`` (and sums the ranks' payloads there) with the same bits as
    decompressing each payload into a fresh tensor and aggregating; ``out`` may hold
    anything. A float64 ``out`` cannot be written: a new float32 tensor comes back."""
    comp = lookup("compressor", "qsgd")(quantum_num=64, bucket_size=bucket)
    g = torch.Generator().manual_seed(n)
    sent = [comp.compress(torch.randn(n, generator=g) * (r + 1), "w", Call(r, ranks))
            for r in range(ranks)]
    ctx = sent[0][1]
    expected = Reference(comp).combine([p for p, _ in sent], ctx)
    out = torch.full((n,), float("nan"))
    assert own(comp).combine([p for p, _ in sent], ctx, out) is out
    np.testing.assert_array_equal(out.numpy(), expected.numpy())
    np.testing.assert_array_equal(own(comp).combine([p for p, _ in sent], ctx).numpy(),
                                  expected.numpy())
    plain = comp.decompress(*sent[-1])
    out = torch.full((n,), float("nan"))
    assert own(comp).decompress_into(*sent[-1], out) is out
    np.testing.assert_array_equal(out.numpy(), plain.numpy())
    wide = torch.zeros(n, dtype=torch.float64)
    got = own(comp).decompress_into(*sent[-1], wide)
    assert got is not wide and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), plain.numpy())


class _Mirror(OneRank):
    """Two ranks as rank 0 sees them when the other rank sends exactly what it does: every
    collective hands back this rank's own piece once per rank."""

    def size(self):
        return 2

    def allgather_async(self, tensor, name):
        return torch.cat([tensor, tensor])

    def alltoall_async(self, tensor, splits, name):
        mine = tensor[:splits[0]]
        return torch.cat([mine, mine]), [splits[0], splits[0]]


def test_twophase_reuses_its_step_buffers_with_the_same_results():
    """Two-phase builds its approximation and reduced chunk in buffers kept across steps
    (no fresh tensors a step); results, residuals and server residuals stay those of fresh
    buffers every step."""
    params = {"compressor": "qsgd", "quantum_num": 64, "bucket_size": 128,
              "memory": "residual", "communicator": "twophase"}
    reused, fresh = grace_from_params(dict(params)), grace_from_params(dict(params))
    fresh._buffer = lambda key, like: torch.zeros_like(like)
    kept = None
    for step in range(3):
        x = _tensor(20 + step, (60, 40))  # even chunks (the mirror), a short last bucket
        a = reused.receive(reused.send(x.clone(), "w", collectives=_Mirror()))
        b = fresh.receive(fresh.send(x.clone(), "w", collectives=_Mirror()))
        np.testing.assert_array_equal(a.numpy(), b.numpy())
        sa, sb = reused.state_dict(), fresh.state_dict()
        np.testing.assert_array_equal(sa["memory"]["w"], sb["memory"]["w"])
        assert sa["server"].keys() == sb["server"].keys() and sa["server"]
        for k in sa["server"]:
            np.testing.assert_array_equal(sa["server"][k], sb["server"][k])
        buffers = {k: id(v) for k, v in reused._scratch.items()}
        # (qsgd writes its error while compressing: no approximation buffer)
        assert sorted(buffers) == ["w/reduced"]
        assert kept is None or buffers == kept
        kept = buffers


class _DecodesAfter:
    """A compressor's ``compress_with_error`` switched off: the error feedback decodes the
    payload after compressing, the path every compressor without the fusion takes."""

    def compress_with_error(self, *args, **kwargs):
        return None


@pytest.mark.parametrize("compressor", [{"compressor": "qsgd", "quantum_num": 64,
                                          "bucket_size": 128},
                                         {"compressor": "signsgd"}],
                         ids=["qsgd", "signsgd"])
@pytest.mark.parametrize("communicator", ["twophase", "allgather"])
@pytest.mark.parametrize("shape", [(60, 40), (7, 300), (1, 6)])
def test_error_written_while_compressing_equals_decoding_after(compressor, communicator, shape):
    """The fused error feedback (``compress_with_error``, for the residual's slot and the
    two-phase server's) leaves the same results, residuals and server residuals, bit for
    bit, as compressing and then decoding the payload; with a short last bucket, a tensor
    shorter than a bucket, and an Inf in the input (every test tensor has one: NaN
    everywhere for signs, in its bucket for qsgd). The mirror needs chunks of equal length;
    the multi-process tests run the fused path with unequal ones against their references."""
    params = {**compressor, "memory": "residual", "communicator": communicator}
    fused, plain = grace_from_params(dict(params)), grace_from_params(dict(params))
    cls = type(plain.compressor)
    plain.compressor.__class__ = type("Plain", (_DecodesAfter, cls), {})
    calls = []
    path = fused.paths.on(torch.empty(1))         # the CPU path's fusion, or the reference's
    real = path.compress_with_error
    path.compress_with_error = lambda *a, **k: calls.append(1) or real(*a, **k)
    for step in range(3):
        x = _tensor(40 + step, shape)
        if step == 2:   # a finite step too (the Inf's NaN stays in the residual otherwise)
            fused, plain = grace_from_params(dict(params)), grace_from_params(dict(params))
            plain.compressor.__class__ = type("Plain", (_DecodesAfter, cls), {})
            x = torch.nan_to_num(x, posinf=1.0)
        a = fused.receive(fused.send(x.clone(), "w", collectives=_Mirror()))
        b = plain.receive(plain.send(x.clone(), "w", collectives=_Mirror()))
        np.testing.assert_array_equal(a.numpy(), b.numpy())
        sa, sb = fused.state_dict(), plain.state_dict()
        np.testing.assert_array_equal(sa["memory"]["w"], sb["memory"]["w"])
        for k in sa.get("server", {}):
            np.testing.assert_array_equal(sa["server"][k], sb["server"][k])
    assert calls    # the fused path ran


@pytest.mark.parametrize("key,communicator",
                         [(k, "allgather") for k in sorted(SPARSE)] +
                         [("randomk", "allreduce"), ("randomk-unbiased", "allreduce")])
def test_sparse_error_written_as_a_fill_equals_subtracting_what_was_sent(key, communicator):
    """The sparsifiers' ``compress_with_error`` (the residual's slot with +0.0 at the sent
    positions, O(k)) leaves the same results and residuals, bit for bit, as subtracting the
    sent values after compressing: with an Inf and a NaN in the tensor (the Inf is sent by
    the magnitude rules, then its slot entry is 0 either way; the NaN stays until the memory
    clears it), then finite steps, where the CPU skips the mark and the slot's clean-up
    (``ops.known_finite``). randomk ``unbiased`` sends scaled values: no fill (None)."""
    params = {"compressor": key.split("-")[0], **SPARSE[key], "memory": "residual",
              "communicator": communicator}
    fused, plain = grace_from_params(dict(params)), grace_from_params(dict(params))
    cls = type(plain.compressor)
    plain.compressor.__class__ = type("Plain", (_DecodesAfter, cls), {})
    got = []
    path = fused.paths.on(torch.empty(1))
    real = path.compress_with_error
    path.compress_with_error = lambda *a, **k: got.append(real(*a, **k)) or got[-1]
    for step in range(4):
        x = _tensor(60 + step)
        if step < 2:
            x[5, 7] = float("nan")
        else:
            x = torch.nan_to_num(x, posinf=1.0)
        a = fused.receive(fused.send(x.clone(), "w", collectives=_Mirror()))
        b = plain.receive(plain.send(x.clone(), "w", collectives=_Mirror()))
        np.testing.assert_array_equal(a.numpy(), b.numpy())
        ra, rb = fused.state_dict()["memory"]["w"], plain.state_dict()["memory"]["w"]
        np.testing.assert_array_equal(ra, rb)
        assert np.isfinite(ra).all()
    assert len(got) == 4 and all((g is None) == (key == "randomk-unbiased") for g in got)


@pytest.mark.parametrize("key", ["topk", "randomk", "threshold", "dgc"])
def test_sparse_error_into_a_buffer_of_its_own(key):
    """Given an ``error`` that is not the tensor's own memory (and a tensor without a flat
    view), the path copies the tensor there first: ``error`` = tensor - decompress."""
    comp = _compressor(key)
    path = own(comp)
    x = _tensor(7).t()            # not contiguous
    error = torch.full((x.numel(),), 3.0)
    payload, ctx = path.compress_with_error(x, "w", Call(0, 1), error)
    expected = (x - comp.decompress(payload, ctx)).reshape(-1)
    sent = comp.sent_entries(payload, ctx)[0].long()
    # the Inf, where it was sent: x - x is NaN there, which the memory sets to 0 anyway
    expected[sent] = expected[sent].nan_to_num(0.0, 0.0, 0.0)
    np.testing.assert_array_equal(error.numpy(), expected.numpy())
    assert path.compress_with_error(x, "w", Call(0, 1), error, decoded=torch.empty_like(x)) \
        is None


def test_sign_paths_tell_a_finite_error_from_the_payloads_flag():
    """The CPU signsgd path knows its error is finite from the payload's NaN/Inf flag (so
    the communicator skips the slot's clean-up), for the worker and the server's step; the
    reference never claims it."""
    comp = lookup("compressor", "signsgd")()
    path = Paths(comp).on(torch.empty(1))
    assert type(path).__name__ == "SignSGDOnCpu"
    x = _tensor(5).reshape(-1)
    finite = torch.nan_to_num(x, posinf=2.0)
    for t, expected in ((finite, True), (x, False)):
        error = torch.empty_like(t)
        payload, _ = path.compress_with_error(t.clone(), "w", Call(0, 1), error)
        assert path.error_finite(payload) is expected
        assert bool(torch.isfinite(error).all()) is expected
    assert Reference(comp).error_finite(comp.compress(finite, "w")[0]) is False


def test_qsgd_cpu_path_tells_a_finite_error_from_the_norms():
    """qsgd's CPU path: bucket norms finite and below 1e38 prove the error finite; a NaN, an
    Inf or norms near the float32 range (where input minus decoding could overflow) do not."""
    comp = lookup("compressor", "qsgd")(quantum_num=64, bucket_size=128)
    path = Paths(comp).on(torch.empty(1))
    assert type(path).__name__ == "QSGDOnCpu"
    x = _tensor(9).reshape(-1)
    for t, expected in ((torch.nan_to_num(x, posinf=2.0), True), (x, False),
                        (torch.full((300,), 3e37), False)):
        error = torch.empty_like(t)
        payload, _ = path.compress_with_error(t.clone(), "w", Call(0, 1), error)
        assert path.error_finite(payload) is expected
        if expected:
            assert bool(torch.isfinite(error).all())


def test_known_finite_only_where_a_host_read_proves_it():
    from grace_dl.torch import ops

    assert ops.known_finite(torch.ones(5)) and ops.known_finite(torch.arange(3))
    assert not ops.known_finite(torch.tensor([1.0, float("nan")]))
    assert not ops.known_finite(torch.tensor([3e38, 3e38]))     # a finite sum out of range
    v = torch.arange(12.0).view(3, 4).t()                      # not contiguous
    ops.assign_zero_at(v, torch.tensor([0, 5], dtype=torch.int32))
    assert v.reshape(-1)[[0, 5]].tolist() == [0.0, 0.0] and v.sum() == 66 - 9


def test_signum_feeds_back_the_error_of_its_momentum_signs():
    """signum subclasses signsgd but sends its momentum's signs: the inherited fused error
    feedback must not apply (it would send and subtract the gradient's own signs); the
    residual is the compensated gradient minus what was sent."""
    grc = grace_from_params({"compressor": "signum", "momentum": 0.5, "memory": "residual",
                             "communicator": "allgather"})
    assert own(grc.compressor).compress_with_error(torch.ones(4), "w", Call(0, 1),
                                              torch.zeros(4)) is None
    x = torch.tensor([1.0, -2.0, 3.0, -4.0])
    grc.receive(grc.send(x.clone(), "w", collectives=OneRank()))
    x2 = torch.tensor([-3.0, 2.0, 0.5, 4.0])
    grc.receive(grc.send(x2.clone(), "w", collectives=OneRank()))
    # step 1: momentum 0.5 x, sent sign(x); residual r1 = x - sign(x)
    r1 = x - torch.sign(x)
    comp = x2 + r1
    momentum = 0.5 * (0.5 * x) + 0.5 * comp
    np.testing.assert_allclose(grc.state_dict()["memory"]["w"],
                               (comp - torch.sign(momentum)).numpy(), rtol=1e-6)


def test_a_memory_subclass_runs_its_own_methods_and_an_unhashable_one_works():
    """The seam for memories: a subclass of ``residual`` gets the reference path (its own
    ``compensate``/``update``, which it may have changed), and a memory that cannot be a
    weak key (``__eq__`` without ``__hash__``) still gets a path; both train as the plain
    composition does."""
    from grace_dl.memory.base import Feedback
    from grace_dl.memory.residual import ResidualMemory

    class Mine(ResidualMemory):
        pass

    class Unhashable(ResidualMemory):
        def __eq__(self, other):
            return self is other

    assert type(feedback_of(Mine())) is Feedback
    assert type(feedback_of(ResidualMemory())).__name__ == "ResidualFeedback"
    for memory in (Mine(), Unhashable()):
        fast = lookup("communicator", "allgather")(_compressor("topk"), memory)
        assert fast.feedback.memory is memory
        slow = lookup("memory", "residual")()
        for step in range(2):
            x = _tensor(step)
            out = fast.synchronize(x.clone(), "w", collectives=OneRank())
            compensated = slow.compensate(x, "w")
            payload, ctx = fast.compressor.compress(compensated, "w")   # the same draw-free top
            slow.update(compensated, "w", fast.compressor, payload, ctx)
            np.testing.assert_array_equal(memory.state_dict()["w"], slow.state_dict()["w"])
            assert out.shape == x.shape
