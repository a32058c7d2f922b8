"""A DDP bucket out of grace's canonical order (a transformer's: DDP orders it as gradients
become ready) is sent as it is where the order cannot change a bit (``sends_in_any_order``:
an elementwise compressor, a memory that keeps nothing; ``none`` summed in place), and
copied into canonical order and back otherwise. Same results either way, one process on
gloo (a world of one: the element-wise sum is a rank's own value; the 2-rank jobs of
test_ddp cover the sums)."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.gpu import Decoder
from grace_dl import grace_from_params
from grace_dl.torch import ddp as grace_ddp

PIPELINES = {
    "none": {"compressor": "none", "memory": "none", "communicator": "allreduce"},
    "fp16": {"compressor": "fp16", "memory": "none", "communicator": "allreduce"},
    "bf16": {"compressor": "bf16", "memory": "none", "communicator": "allgather"},
    "fp16 + residual": {"compressor": "fp16", "memory": "residual",
                        "communicator": "allreduce"},
}


class _Cats(TorchDispatchMode):
    """How many ``cat`` the hook issues (the copy into canonical order)."""

    def __init__(self):
        super().__init__()
        self.cats = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.cats += func is torch.ops.aten.cat.default
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module", autouse=True)
def group():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    if started:
        dist.destroy_process_group()


def _train(params, canonical=False):
    """Three SGD steps of a small decoder under the hook (``canonical``: made to copy the
    bucket into canonical order, as before ``sends_in_any_order``); the parameters after
    them, the hook's cats in the last step, and whether its bucket was in canonical
    order."""
    torch.manual_seed(0)
    net = DDP(Decoder(vocab=100, width=32, layers=2, heads=4, context=16))
    state = grace_ddp.GraceState(grace_from_params(dict(params)))
    if canonical:
        state._any_order = state._sums_in_place = False
    counter = _Cats()

    def hook(state, bucket):
        with counter:
            return grace_ddp.comm_hook(state, bucket)

    net.register_comm_hook(state, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        counter.cats = 0
        logits = net(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 100), tokens[:, 1:].reshape(-1)) \
            .backward()
        opt.step()
        opt.zero_grad()
    in_order = [layout.in_order for _, layout in state._bucket_layouts.values()]
    return [p.detach().clone() for p in net.parameters()], counter.cats, in_order


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_an_out_of_order_bucket_gives_the_same_results_sent_as_it_is(pipeline):
    params = PIPELINES[pipeline]
    got, cats, in_order = _train(params)
    assert in_order and not any(in_order)       # the decoder's bucket: graph order
    canonical, canonical_cats, _ = _train(params, canonical=True)
    for a, b in zip(got, canonical):
        assert torch.equal(a, b)
    assert canonical_cats >= 1                  # the copy into canonical order
    if pipeline == "fp16 + residual":           # a residual's layout: canonical order kept
        assert not grace_ddp.sends_in_any_order(grace_from_params(dict(params)))
        assert cats == canonical_cats
    else:
        assert grace_ddp.sends_in_any_order(grace_from_params(dict(params)))
        assert cats == 0                        # sent as DDP laid it out
