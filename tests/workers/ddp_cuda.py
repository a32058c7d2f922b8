"""The DDP hook and DistCollectives with CUDA tensors, on one GPU (run by hand on a GPU
machine; CI has none):

    PYTHONPATH=. torchrun --standalone --nproc-per-node 1 tests/workers/ddp_cuda.py nccl
    PYTHONPATH=. torchrun --standalone --nproc-per-node 1 tests/workers/ddp_cuda.py gloo

World size 1 (NCCL needs one GPU per rank). For every pipeline: an MLP on ``cuda:0`` wrapped in
DDP with the grace hook trains a few steps; the script checks that gradients stay on the GPU and
finite, that ``none``/``allreduce`` equals DDP's own reduction bit for bit (and that DDP's
``gradient_as_bucket_view`` changes no pipeline's bits), that the hook's state_dict round-trips,
and exercises each collective (sum, ragged allgather, broadcast, alltoall) on CUDA tensors.
Prints one line per check and exits non-zero if any failed.
"""

from __future__ import annotations

import io
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.pipelines import GRACE
from grace_dl import grace_from_params
from grace_dl.torch import ddp as grace_ddp
from grace_dl.torch.distributed import DistCollectives

PIPELINES = {
    **{k: GRACE[k] for k in ("none", "fp16", "topk", "randomk", "powersgd", "qsgd-2phase",
                             "signsgd", "signsgd-2phase")},
    "terngrad-bcast": {"compressor": "terngrad", "memory": "none", "communicator": "broadcast"},
    "dgc": {"compressor": "dgc", "compress_ratio": 0.01, "memory": "dgc",
            "communicator": "allgather"},
}
FAILED = []


def check(label, fn):
    try:
        detail = fn()
        print(f"PASS {label}{': ' + str(detail) if detail else ''}", flush=True)
    except Exception:  # noqa: BLE001 - every check reports, the exit code sums up
        FAILED.append(label)
        print(f"FAIL {label}\n{traceback.format_exc()}", flush=True)


def model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10)).to(device)


def assert_same_parameters(a, b, label) -> None:
    """The two DDP models' parameters (and buffers) are bit-equal."""
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), (label, k)


def repeated(device):
    """An MLP whose hidden layers share one shape (PowerSGD's bucket path factors them
    together)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)


class Mixed(nn.Module):
    """``model`` with a float64 scale and a complex64 phase of its logits: DDP keeps a bucket
    a dtype (a complex one as its real view)."""

    def __init__(self, device):
        super().__init__()
        self.mlp = model(device)
        self.scale = nn.Parameter(torch.ones(10, dtype=torch.float64, device=device))
        self.phase = nn.Parameter(torch.full((10,), 1 + 0j, dtype=torch.complex64,
                                             device=device))

    def forward(self, x):
        return self.mlp(x) * self.scale.float() * self.phase.abs()


def train(pipeline, device, steps=5, per_bucket=None, reference=False, net=model,
          bucket_cap_mb=0.5, **options):
    """``per_bucket``: force completing each bucket in its hook call (True) or the step's
    together (False); None: the hook's choice (NCCL: each in its call). ``reference``: no
    speed path of the hook's (PowerSGD's bucket path). ``net``: the model's maker.
    ``options``: DDP's."""
    net = DDP(net(device), device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=bucket_cap_mb, **options)
    state = None
    if pipeline is not None:
        state = grace_ddp.GraceState(grace_from_params(dict(PIPELINES[pipeline])))
        state._per_bucket = per_bucket
        if reference:
            state._powersgd = None
        net.register_comm_hook(state, grace_ddp.comm_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 256, generator=gen).to(device)
        y = torch.randint(0, 10, (64,), generator=gen).to(device)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        for p in net.parameters():
            assert p.grad.device == device, (p.grad.device, device)
            assert torch.isfinite(p.grad).all()
        opt.step()
    return net, state


def syncs_in_backward(net, device) -> int:
    """Host synchronisations in one backward pass of ``net`` (CUDA's sync debug mode, its
    warnings counted)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=gen).to(device)
    y = torch.randint(0, 10, (64,), generator=gen).to(device)
    loss = nn.functional.cross_entropy(net(x), y)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in seen)


def main() -> int:
    backend = sys.argv[1] if len(sys.argv) > 1 else "nccl"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(backend)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, backend {backend}, "
          f"world size {dist.get_world_size()}", flush=True)
    coll = DistCollectives()

    def sums():
        out = {}
        for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32):
            t = torch.arange(4, device=device).to(dt)
            res = coll.synchronize(coll.allreduce_async(t, "s"))
            assert res.device == device and res.dtype == dt and torch.equal(res, t), dt
            out[str(dt).replace("torch.", "")] = "ok"
        return out

    def gathers():
        t = torch.arange(6, device=device, dtype=torch.float32).reshape(3, 2)
        res = coll.synchronize(coll.allgather_async(t, "g"))
        assert res.device == device and torch.equal(res, t)
        b = torch.tensor([True, False, True], device=device)
        assert torch.equal(coll.synchronize(coll.allgather_async(b, "b")), b)
        lengths = torch.tensor([3, 5], dtype=torch.int32)  # a CPU tensor, as allgather's lengths
        got = coll.synchronize(coll.allgather_async(lengths, "len"))
        assert got.device.type == "cpu" and torch.equal(got, lengths)
        total = coll.synchronize(coll.allreduce_async(lengths, "len.sum"))
        assert total.device.type == "cpu" and torch.equal(total, lengths)
        return "float32 3x2, bool, int32 on the CPU"

    def broadcast():
        t = torch.full((5,), 3.0, device=device)
        res = coll.synchronize(coll.broadcast_async(t, 0, "bc"))
        assert res.device == device and torch.equal(res, t)

    def alltoall():
        t = torch.arange(8, device=device, dtype=torch.float32).reshape(4, 2)
        res, splits = coll.synchronize(coll.alltoall_async(t, [4], "a2a"))
        assert torch.equal(res, t) and splits.tolist() == [4]

    check(f"{backend} allreduce (sum) on CUDA", sums)
    check(f"{backend} allgather on CUDA", gathers)
    check(f"{backend} broadcast on CUDA", broadcast)
    check(f"{backend} alltoall on CUDA", alltoall)

    def equal_to_ddp():
        ref, _ = train(None, device)
        got, _ = train("none", device)
        assert_same_parameters(ref, got, "none")
        return "5 steps, parameters bit-equal"

    check(f"{backend} hook none/allreduce == DDP default", equal_to_ddp)

    def bucketwise_equals_together():
        done = []
        for pipeline in ("topk", "qsgd-2phase", "powersgd", "none", "signsgd-2phase", "dgc"):
            a, sa = train(pipeline, device)
            b, _ = train(pipeline, device, per_bucket=not sa._per_bucket)
            assert sa._per_bucket is (backend == "nccl"), (pipeline, sa._per_bucket)
            assert_same_parameters(a, b, pipeline)
            done.append(pipeline)
        return f"each bucket in its hook call == the step's together: {done}"

    check(f"{backend} buckets completed one by one == together", bucketwise_equals_together)

    def host_waits_in_a_step():
        """Host synchronisations in a hook step's backward pass, every pipeline (CUDA's sync
        debug mode, its warnings counted): none but where a payload's size depends on the data.
        On NCCL the exchange reads such sizes once a round of the step (``Collectives.sized``):
        signSGD on allgather waits once a step whatever its buckets, two-phase twice; dgc
        also reads its count in compress, once a bucket."""
        out = {}
        for pipeline in PIPELINES:
            net, state = train(pipeline, device)
            syncs = syncs_in_backward(net, device)
            out[pipeline] = f"{syncs} in {len(state.last_step_names)} grace tensors"
            if backend == "nccl":
                want = {"signsgd": 1, "signsgd-2phase": 2}.get(pipeline, 0)
                assert pipeline == "dgc" or syncs == want, (pipeline, syncs, want, out)
        return out

    check(f"{backend} host waits in a hook step", host_waits_in_a_step)

    def powersgd_bucket_path_near_reference():
        """PowerSGD's bucket path against the reference composition on CUDA: one batched QR
        per matrix shape of a bucket may round otherwise than one QR per matrix (on a CPU
        they are bit-equal: tests/test_ddp_powersgd.py), so the parameters after 5 steps
        are compared within 1e-4 of their scale; the bytes are equal."""
        a, sa = train("powersgd", device, net=repeated, bucket_cap_mb=25)
        b, sb = train("powersgd", device, net=repeated, bucket_cap_mb=25, reference=True)
        assert sa._powersgd is not None and sb._powersgd is None
        groups = [len(js) for plan in sa._powersgd._plans.values() for _, js in plan.groups]
        assert max(groups) >= 2, groups
        worst = 0.0
        for x, y in zip(a.state_dict().values(), b.state_dict().values()):
            scale = float(y.abs().max()) or 1.0
            worst = max(worst, float((x - y).abs().max()) / scale)
        assert worst < 1e-4, worst
        assert sa.grace.bytes.steps == sb.grace.bytes.steps
        syncs = syncs_in_backward(a, device)   # (its batched QR included)
        assert syncs == 0, syncs
        return (f"max difference {worst:.2e} of the parameters' scale; matrices a QR "
                f"{groups}; no host wait in a step")

    check(f"{backend} PowerSGD bucket path ~ the reference", powersgd_bucket_path_near_reference)

    def bucket_views_change_nothing():
        done = []
        for pipeline in ("none", "fp16", "topk", "qsgd-2phase", "powersgd"):
            a, _ = train(pipeline, device)
            b, _ = train(pipeline, device, gradient_as_bucket_view=True)
            assert_same_parameters(a, b, pipeline)
            done.append(pipeline)
        return f"gradient_as_bucket_view=True == default: {done}"

    check(f"{backend} hook with gradient_as_bucket_view", bucket_views_change_nothing)

    def delayed_allreduce_of_several_dtypes():
        """``static_graph``'s first iteration on a model of three dtypes: DDP's delayed
        allreduce hands every bucket over as bucket 0, none as the last, and waits for all:
        each pipeline's steps all complete (one hook step a backward pass), ``none`` equal to
        DDP's own reduction."""
        ref, _ = train(None, device, steps=3, net=Mixed, static_graph=True)
        done = {}
        for pipeline in ("none", "fp16", "topk", "qsgd-2phase", "powersgd"):
            net, state = train(pipeline, device, steps=3, net=Mixed, static_graph=True)
            assert state.iteration == len(state.grace.bytes.steps) == 3, (pipeline, state.iteration)
            if pipeline == "none":
                assert_same_parameters(ref, net, pipeline)
            done[pipeline] = len(state.last_step_names)
        return f"grace tensors in the last step: {done}"

    check(f"{backend} static_graph's delayed allreduce, three dtypes",
          delayed_allreduce_of_several_dtypes)

    for pipeline in PIPELINES:
        def one(pipeline=pipeline):
            net, state = train(pipeline, device)
            sd = state.state_dict()
            buf = io.BytesIO()
            torch.save(sd, buf)
            fresh = grace_ddp.GraceState(grace_from_params(dict(PIPELINES[pipeline])))
            fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
            step = state.grace.bytes.steps[-1]
            return (f"granularity {'parameter' if state.per_parameter else 'bucket'}, "
                    f"sent {step['sent']} B/step, tensors {state.last_step_names[:3]}, "
                    f"state_dict round-trips")

        check(f"{backend} hook {pipeline} on CUDA", one)
    print(f"horovod imported: {'horovod' in sys.modules}")
    dist.destroy_process_group()
    print(f"{len(FAILED)} failed: {FAILED}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
