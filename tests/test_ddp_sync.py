"""A DDP hook step on the device path (the GPU's code on CPU tensors: ``emulate_device``) makes
the host wait for the device nowhere between buckets (issue 42): every pipeline of
``benchmarks/pipelines.py`` on a model of several buckets, under the CPU sync guard
(``sync_guard``, entered inside the hook: autograd runs hooks where a torch function mode
entered around ``backward`` does not reach), whichever way the hook completes its futures
(each bucket's in its own call, as on NCCL; all of them at the last bucket, as on gloo). Only
a payload whose size depends on the data reads it (signSGD's zero plane travels where a
tensor has exact zeros), in the communicator's exchange of sizes, not in compress: once a
round of the step where the collectives hold such sizes (on NCCL), else once a tensor. One
process on gloo (a world of one)."""

import collections

import pytest
import torch
import torch.nn as nn
from sync_guard import SyncGuard
from test_ddp_bucket_order import group  # noqa: F401  (its one-process gloo group)
from test_device_path import exchanging
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.pipelines import GRACE
from grace_dl import grace_from_params
from grace_dl.torch import ddp as grace_ddp
from grace_dl.torch.distributed import DistCollectives
from grace_dl.torch.kernels import emulate_device

#: host reads a step of a pipeline whose payload size depends on the data: (in compress, a
#: grace tensor; in the exchange of sizes, a grace tensor; in it, a round of the step where
#: the collectives hold the step's sizes for one read, as on NCCL; where they do not, a
#: grace tensor). Compress reads nothing (its payload is its whole buffer, the length sent of
#: it on the device: ``Call.exchanges_sizes``): signSGD on allgather reads the gathered
#: lengths; on two-phase, the all-to-all's matrix of them and the gathered lengths of the
#: server's payloads, and its received splits as a list (a host tensor: no wait on a GPU,
#: which the guard cannot tell apart).
SIZED = {"signsgd": (0, 0, 1), "signsgd-2phase": (0, 1, 2)}
STEPS, WATCHED = 5, 3       # (the first steps make slots, check agreement, rebuild buckets)


def _model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), *(m for _ in range(3) for m in
                                             (nn.ReLU(), nn.Linear(64, 64))),
                        nn.ReLU(), nn.Linear(64, 10))
    return DDP(net, bucket_cap_mb=0.01)     # ~10 KB a bucket: a 16 KB weight fills one


@pytest.mark.parametrize("per_bucket", [True, False], ids=["each-bucket", "at-the-last"])
@pytest.mark.parametrize("pipeline", sorted(GRACE))
def test_a_hook_step_on_the_device_path_waits_only_for_data_dependent_sizes(
        pipeline, per_bucket, monkeypatch):
    monkeypatch.setattr(DistCollectives, "waits_in_stream", lambda self: per_bucket)
    state = grace_ddp.GraceState(grace_from_params(dict(GRACE[pipeline])))
    guard = [None]

    def hook(state, bucket):
        if guard[0] is None:
            return grace_ddp.comm_hook(state, bucket)
        with guard[0]:
            return grace_ddp.comm_hook(state, bucket)

    net = _model()
    net.register_comm_hook(state, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    recorded = []
    with emulate_device():
        for step in range(STEPS):
            guard[0] = SyncGuard() if step >= WATCHED else None
            x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            if guard[0] is not None:
                recorded += guard[0].calls
    assert state._per_bucket is per_bucket and state.iteration == STEPS
    # (PowerSGD takes the hook's bucket path, grace_dl.torch.ddp_powersgd)
    assert (state._powersgd is not None) == (pipeline == "powersgd")
    units = len(state.last_step_names)
    assert units >= 3 or pipeline == "powersgd", state.last_step_names   # several buckets
    kinds = collections.Counter("exchange" if exchanging(where) else "compress"
                                for _, where in recorded)
    compress, exchange, rounds = SIZED.get(pipeline, (0, 0, 0))
    steps = STEPS - WATCHED
    expected = collections.Counter({
        "compress": compress * units * steps,
        "exchange": (exchange * units + rounds * (1 if per_bucket else units)) * steps})
    assert kinds == +expected, recorded     # (``+``: without the kinds counted 0)


class _FakeStream:
    """Stands in for a CUDA stream on a CPU: records what waits on it."""

    def __init__(self, device=None):
        self.device, self.waited = device, []

    def wait_stream(self, other):
        self.waited.append(other)


def test_a_gpu_bucket_runs_on_a_side_stream_that_waits_for_the_backward_pass(monkeypatch):
    """Where each bucket is finished in its hook call on a GPU (NCCL), its grace work runs on
    a side stream of the bucket's device, one a device, made to wait for the backward pass's
    stream at each bucket: waiting for a collective makes the waiting stream wait, so on the
    backward pass's own stream the rest of the backward pass would wait for every bucket's
    collectives. Elsewhere (the CPU; buckets finished at the last) none."""
    import types

    current = object()
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(DistCollectives, "waits_in_stream", lambda self: True)
    state = grace_ddp.GraceState(grace_from_params(dict(GRACE["topk"])))
    gpu0, gpu1 = (types.SimpleNamespace(device=torch.device("cuda", i)) for i in (0, 1))
    side = state._side_stream(gpu0)
    assert isinstance(side, _FakeStream) and side.waited == [current]
    assert state._side_stream(gpu0) is side and side.waited == [current, current]
    assert state._side_stream(gpu1) is not side
    assert state._side_stream(torch.zeros(1)) is None
    state._per_bucket = False       # (finished at the last bucket: the current stream)
    assert state._side_stream(gpu0) is None


@pytest.mark.parametrize("pipeline", ["topk", "signsgd"])
def test_the_whole_hook_runs_on_the_side_stream_and_sets_its_futures_there(pipeline,
                                                                           monkeypatch):
    """Every hook call's work (compress, collectives, the futures' results, which record the
    events DDP waits for) runs inside the side stream's context, buckets held for the step's
    sizes (signSGD) included."""
    side, inside, seen = _FakeStream(), [False], collections.Counter()

    class _On:
        def __init__(self, stream):
            assert stream is side
            seen["entered"] += 1

        def __enter__(self):
            inside[0] = True

        def __exit__(self, *exc):
            inside[0] = False

    set_result = torch.futures.Future.set_result

    def recorded(fut, value):
        seen["inside" if inside[0] else "outside"] += 1
        return set_result(fut, value)

    monkeypatch.setattr(DistCollectives, "waits_in_stream", lambda self: True)
    monkeypatch.setattr(grace_ddp.GraceState, "_side_stream", lambda self, buffer: side)
    monkeypatch.setattr(torch.cuda, "stream", _On)
    monkeypatch.setattr(torch.futures.Future, "set_result", recorded)
    state = grace_ddp.GraceState(grace_from_params(dict(GRACE[pipeline])))
    state._per_bucket = True
    net = _model()
    net.register_comm_hook(state, grace_ddp.comm_hook)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        nn.functional.cross_entropy(net(x), y).backward()
    buckets = len(state.last_step_names)
    # (the first step has DDP's first layout, of fewer buckets; later ones its rebuilt one)
    assert buckets >= 3 and seen["entered"] >= 2 * buckets + 1, (seen, buckets)
    assert seen["outside"] == 0 and seen["inside"] == seen["entered"], seen
