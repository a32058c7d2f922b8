"""PowerSGD's bucket path in the DDP hook (``grace_dl.torch.ddp_powersgd``) against the reference
composition it replaces (``Allreduce`` per parameter, rounds fused per bucket): the same
parameters bit for bit, the same bytes counted and the same state, on the small decoder (its
bucket out of first-met order), with PowerSGD's options that change what is compressed, and
both averaging ops. One process on gloo (a world of one); test_ddp's 2-rank jobs compare the
sums and the resume, test_ddp_sync finds no host synchronisation on its device path."""

import collections

import pytest
import torch
from test_ddp_bucket_order import (
    _keys,
    _model,
    _tokens,
    _train,
    group,  # noqa: F401  (its one-process gloo group)
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

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


class _Ops(TorchDispatchMode):
    """The torch operations issued inside it, by name."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def test_the_bucket_path_orthonormalizes_each_matrix_shape_of_a_bucket_at_once():
    """The small decoder's two blocks give pairs of matrices of one shape in its bucket: one
    QR per shape (and round), not one per matrix, where the reference factors each."""
    seen = {}
    for bucket_path in (True, False):
        state = grace_ddp.GraceState(grace_from_params(dict(POWERSGD)))
        if not bucket_path:
            state._powersgd = None
        counter = _Ops()

        def hook(state, bucket, counter=counter):
            with counter:
                return grace_ddp.comm_hook(state, bucket)
        net = _model()
        net.register_comm_hook(state, hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        tokens = _tokens()
        for step in range(2):
            logits = net(tokens[step, :, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, 100),
                                              tokens[step, :, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        seen[bucket_path] = counter.seen
    # 10 matrices in 6 shapes (two blocks' qkv, proj, fc1, fc2; embeddings), 2 steps
    assert seen[False]["linalg_qr"] == 2 * 10
    assert seen[True]["linalg_qr"] == 2 * 6
    assert seen[True]["stack"] > 0 and seen[True]["mm"] < seen[False]["mm"] + 1


def _bf16_model():
    net = _model().module
    return DDP(net.to(torch.bfloat16))


class _Convs(torch.nn.Module):
    """Two convolutions in ``channels_last`` (their gradients strided in DDP's bucket)
    before a linear layer."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3)
        self.c2 = torch.nn.Conv2d(8, 8, 3)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        h = self.c2(torch.relu(self.c1(x)))
        return self.fc(h.mean((2, 3)))


def _train_convs(state):
    torch.manual_seed(0)
    net = _Convs().to(memory_format=torch.channels_last)
    ddp = DDP(net)
    ddp.register_comm_hook(state, grace_ddp.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(4, 3, 9, 9, generator=gen).to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (4,), generator=gen)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()]


def test_channels_last_parameters_give_the_reference_s_bits():
    """DDP hands a hook row-major views of its bucket whatever the parameters' memory format
    (a channels_last weight's gradient is its buffer stretch read row-major, for PyTorch's own
    hooks too), so such buckets take the bucket path, with the reference's bits."""
    fast = grace_ddp.GraceState(grace_from_params(dict(POWERSGD)))
    got = _train_convs(fast)
    slow = grace_ddp.GraceState(grace_from_params(dict(POWERSGD)))
    slow._powersgd = None
    want = _train_convs(slow)
    layouts = list(fast._powersgd._layouts.values())
    assert len(layouts) == 2 and None not in layouts and len(fast._powersgd._plans) == 2
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert fast.grace.bytes.steps == slow.grace.bytes.steps
    assert fast.last_step_names == slow.last_step_names


class _Bucket:
    """A stand-in for DDP's GradBucket whose first gradient is a strided view of its buffer
    (what DDP's own views are not: the bucket path's guard)."""

    def __init__(self):
        self._buffer = torch.randn(16 * 16 + 3)
        self._grads = [self._buffer[:256].view(16, 16).t(), self._buffer[256:]]

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads


@pytest.mark.parametrize("start_step", [0, 2])
def test_a_bucket_whose_gradients_are_not_its_buffer_in_row_major_order_is_left_alone(
        start_step):
    path = PowerSGDBuckets(grace_from_params({**POWERSGD, "start_step": start_step}),
                           "average")
    grace = path.grace
    bucket = _Bucket()
    before = bucket.buffer().clone()
    for _ in range(2):
        assert path.start(bucket, ["w", "b"], [256, 3], None, "bucket0") is None
    assert torch.equal(bucket.buffer(), before)
    # nothing kept, sent or counted: the reference composition counts its steps itself
    assert grace.state_dict() == {"compressor": {}, "memory": {}}, grace.state_dict()
    assert grace.bytes.sent == {} and path._plans == {}
    assert list(path._layouts.values()) == [None]


def _switched(bucket_path, dtype):
    """Two steps of an MLP under DDP, then two more after it is cast to ``dtype`` (a new DDP,
    the same ``GraceState``): its parameters and the last step's bytes."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    state = grace_ddp.GraceState(grace_from_params(dict(POWERSGD)))
    if not bucket_path:
        state._powersgd = None
    gen = torch.Generator().manual_seed(1)
    for phase in range(2):
        if phase:
            net.to(dtype)
        ddp = DDP(net)
        ddp.register_comm_hook(state, grace_ddp.comm_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            x = torch.randn(4, 16, generator=gen).to(next(net.parameters()).dtype)
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()], state


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_cast_under_the_same_state_goes_on_as_the_reference_does(dtype):
    """Its slots stay in the first dtype: the bucket path leaves such buckets to the
    reference composition, which mixes the dtypes (the path's products into its buffers
    cannot)."""
    (fast, on_path), (slow, reference) = _switched(True, dtype), _switched(False, dtype)
    assert all(p.dtype == dtype for p in fast)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    assert on_path.grace.bytes.steps == reference.grace.bytes.steps
    assert None in on_path._powersgd._layouts.values()


@pytest.mark.parametrize("extra", [{}, {"compress_rank": 1, "start_step": 1}])
def test_the_bucket_path_gives_the_reference_s_bits_in_bfloat16(extra):
    params = {**POWERSGD, **extra}
    got, on_path = [], None
    for bucket_path in (True, False):
        state = grace_ddp.GraceState(grace_from_params(dict(params)))
        if not bucket_path:
            state._powersgd = None
        else:
            on_path = state
        _, params_after = _train(_bf16_model(), state, range(3))
        got.append((params_after, state))
    (fast, a), (slow, b) = got
    assert all(p.dtype == torch.bfloat16 for p in fast)
    assert any(p.narrow for p in on_path._powersgd._plans.values())
    for x, y in zip(fast, slow):
        assert torch.equal(x, y)
    assert a.grace.bytes.steps == b.grace.bytes.steps


class _Group:
    """Collectives of a group of ``n`` ranks, as far as byte counts go."""

    def __init__(self, n):
        self.n = n

    def allreduce_nbytes(self, tensor):
        return tensor.numel() * tensor.element_size()


def test_a_plans_byte_counts_follow_the_group_it_is_sent_on():
    """A live ``GraceState`` moved to another process group (``state.process_group = ...``)
    counts that group's ring bytes, as the reference does for every send."""
    path = PowerSGDBuckets(grace_from_params(dict(POWERSGD)), "average")
    bucket = _Bucket()
    bucket._grads = [bucket._buffer[:256].view(16, 16), bucket._buffer[256:]]
    plan = path._plan(bucket, ("w", "b"), [256, 3])
    # rank 2: P is 16 x 2 and Q^T 2 x 16 (32 floats each), the bias 3 floats
    assert plan.count(_Group(1), 1, torch.float32) == ([("w", 0), ("b", 0)], [("w", 0)])
    assert plan.count(_Group(2), 2, torch.float32) == ([("w", 128), ("b", 12)], [("w", 128)])
    assert plan.count(_Group(4), 4, torch.float32) == ([("w", 192), ("b", 18)], [("w", 192)])
