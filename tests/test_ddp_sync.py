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

