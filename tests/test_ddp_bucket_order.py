"""A DDP bucket whose gradients DDP orders otherwise than the parameters were met (a
transformer's: DDP's rebuilt buckets follow the order gradients become ready, the graph's) is
sent as DDP lays it out, for every pipeline: its buffer is the grace tensor, with no copy into
another order and none back, and its state (a residual's element layout) is named by its
members in that order. One process on gloo (a world of one; the 2-rank jobs of test_ddp cover
the sums and the MLP's resume)."""

import io

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.gpu import Decoder
from grace_dl import grace_from_params
from grace_dl.state import unclaimed_keys
from grace_dl.torch import ddp as grace_ddp

PIPELINES = {
    "none": {"compressor": "none", "memory": "none", "communicator": "allreduce"},
    "fp16": {"compressor": "fp16", "memory": "none", "communicator": "allreduce"},
    "bf16": {"compressor": "bf16", "memory": "none", "communicator": "allgather"},
    "fp16 + residual": {"compressor": "fp16", "memory": "residual",
                        "communicator": "allreduce"},
    "topk + residual": {"compressor": "topk", "memory": "residual",
                        "communicator": "allgather", "compress_ratio": 0.05},
    "randomk + residual": {"compressor": "randomk", "memory": "residual",
                           "communicator": "allreduce", "compress_ratio": 0.05, "seed": 3},
    "qsgd two-phase + residual": {"compressor": "qsgd", "memory": "residual",
                                  "communicator": "twophase", "quantum_num": 127, "seed": 3},
}
STEPS = 4


class _Copies(TorchDispatchMode):
    """How many ``_foreach_copy_`` (the copy of results back into the gradients) the hook
    issues."""

    def __init__(self):
        super().__init__()
        self.copies = 0
        self.buffers = []       # the data pointers of the buckets the hook was given

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.copies += func is torch.ops.aten._foreach_copy_.default
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module", autouse=True)
def group():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    if started:
        dist.destroy_process_group()


def _tokens():
    return torch.randint(0, 100, (STEPS, 2, 16), generator=torch.Generator().manual_seed(1))


def _model():
    torch.manual_seed(0)
    return DDP(Decoder(vocab=100, width=32, layers=2, heads=4, context=16))


def _train(net, state, steps, counter=None):
    """SGD steps of the decoder under ``state``'s hook (``state`` None: DDP's own allreduce,
    or PyTorch's fp16 hook for ``"pytorch-fp16"``), on ``steps`` of ``_tokens()``; the
    parameters after them."""
    if state == "pytorch-fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif state is not None:
        def hook(state, bucket):
            if counter is not None:
                counter.buffers.append(bucket.buffer().data_ptr())
            with counter or _Copies():
                return grace_ddp.comm_hook(state, bucket)
        net.register_comm_hook(state, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    tokens = _tokens()
    for step in steps:
        if counter is not None:
            counter.copies = 0
        logits = net(tokens[step, :, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 100),
                                          tokens[step, :, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return net, [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_an_out_of_order_bucket_is_sent_as_ddp_lays_it_out(pipeline):
    counter = _Copies()
    state = grace_ddp.GraceState(grace_from_params(dict(PIPELINES[pipeline])))
    sent = []          # (the tensor sent, its result's destination) of each unit started
    start = state._exchange.start

    def recorded(tensor, name, members, numels, into, *args):
        sent.append((tensor.data_ptr(), None if into is None else into.data_ptr()))
        return start(tensor, name, members, numels, into, *args)

    state._exchange.start = recorded
    net, _ = _train(_model(), state, range(STEPS), counter)
    (_, layout), = state._bucket_layouts.values()           # the decoder's one bucket
    met = sorted(layout.names, key=lambda n: -state._index[n])
    assert layout.names != met and layout.names != met[::-1]  # graph order, not first-met
    assert counter.copies == 0, counter.copies              # no copy back
    if pipeline not in ("none", "fp16"):      # (summed in place by the hook: sums_in_*)
        # the last step's one unit: DDP's buffer itself, its result written there
        assert sent[-1] == (counter.buffers[-1], counter.buffers[-1]), sent[-1]
    name = grace_ddp.GraceState.bucket_name(layout.names)
    assert state.last_step_names == [name]
    if not state.grace.feedback.keeps_nothing:               # its residual: named so
        assert any(name in key for key in _keys(state.grace.state_dict()))
    # the first iteration's bucket (DDP's initial layout, another order) had another name;
    # its state was dropped after DDP's rebuild: only the live bucket's is left
    assert unclaimed_keys(state.grace.state_dict(), [name]) == []
    assert unclaimed_keys(state.state_dict()["grace"], [name]) == []


def _keys(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _keys(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}"


@pytest.mark.parametrize("pipeline, baseline", [("none", None), ("fp16", "pytorch-fp16")])
def test_an_out_of_order_bucket_gives_ddp_and_pytorch_results(pipeline, baseline):
    state = grace_ddp.GraceState(grace_from_params(dict(PIPELINES[pipeline])))
    _, got = _train(_model(), state, range(STEPS))
    _, want = _train(_model(), baseline, range(STEPS))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pipeline", ["topk + residual", "randomk + residual",
                                      "qsgd two-phase + residual"])
def test_an_out_of_order_bucket_resumes_bit_for_bit(pipeline):
    """Checkpointed after two steps and resumed on a fresh DDP (whose first step lays the
    bucket out in its first-iteration order again, regrouped as saved): the same parameters
    as four straight steps, and not the same without the checkpoint's state."""
    params = dict(PIPELINES[pipeline])
    state = grace_ddp.GraceState(grace_from_params(params))
    _, straight = _train(_model(), state, range(STEPS))
    names = list(state.last_step_names)

    state = grace_ddp.GraceState(grace_from_params(params))
    net, _ = _train(_model(), state, range(2))
    buf = io.BytesIO()
    torch.save({"model": net.module.state_dict(), "grace": state.state_dict()}, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()))
    assert saved["grace"]["layout"] == [list(names_) for names_ in [state._layout[0]]]

    for load in (True, False):
        net = _model()
        net.module.load_state_dict(saved["model"])
        state = grace_ddp.GraceState(grace_from_params(params))
        if load:
            state.load_state_dict(saved["grace"])
        _, resumed = _train(net, state, range(2, STEPS))
        same = all(torch.equal(a, b) for a, b in zip(resumed, straight))
        assert same == load, pipeline
        if load:
            assert state.last_step_names == names
