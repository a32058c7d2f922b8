"""Launched by tests/test_ddp.py under ``torchrun --nproc-per-node 2`` (gloo): the grace DDP
hook against DDP's own averaging, training on digits, resume, collectives. One ``mode`` per
job; each rank ``report``s a dict.

Modes:
- ``equal``: DDP's default reduction vs the ``none``/``allreduce`` hook, plain, with
  ``no_sync()`` accumulation, and with ``find_unused_parameters=True`` (a branch used only on
  odd steps), several buckets (small ``bucket_cap_mb``); parameters after each run.
- ``train <pipeline>...``: digits, SGD momentum, a few epochs per pipeline; accuracy, final
  parameters, bytes per step, state_dict round trip.
- ``resume``: for some pipelines, run 2k steps; run k, checkpoint (model, optimizer, hook
  state per rank), build everything anew, load, run k more; both parameter sets.
- ``disagree``: ranks with different grace configurations; the hook's first call raises.
- ``collectives``: DistCollectives directly: dtypes, ragged allgather, broadcast from each
  root, alltoall with uneven splits (short, and in several gloo pieces), in-place allreduce.
- ``fused <steps>``: PowerSGD per parameter in one bucket, with the hook's per-bucket fusion
  and with each unit sent alone: all_reduce calls per step, parameters after the steps.
- ``join <pipeline>...``: uneven inputs under ``model.join()`` (rank 0 six batches, rank 1
  four; the joined rank's DDP runs the hook on zero buckets for the others' steps):
  parameters, the hook's steps.
- ``strategy <steps>``: per-variable strategies under the hook, over torch.distributed: a
  size-threshold strategy (topk on the large weights, the rest dense) and the top-k recipe
  (a dense epoch of 3 steps, then that): parameters, bytes per step, Horovod never imported;
  and the error of a strategy given without ``named_parameters``.
- ``device <steps> <pipeline>...``: each pipeline on the CPU path and on the device path
  (``emulate_device``; Triton's interpreter under ``TRITON_INTERPRET=1``), one ~100K-element
  bucket: parameters and bytes per step of each.
- ``delayed <steps> <pipeline>...``: each pipeline on a model with float32, float64 and
  complex64 parameters, with and without ``static_graph`` (whose first iteration is DDP's
  delayed allreduce): parameters, the hook's steps and units per step.
- ``options <steps> <pipeline>...``: each pipeline under DDP's other options
  (``gradient_as_bucket_view``, ``static_graph``, both) and on a half-precision model: parameters
  after the steps, bytes per step, the hook's state keys.
"""

from __future__ import annotations

import contextlib
import gc
import io
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mp
from benchmarks.pipelines import GRACE
from grace_dl import grace_from_params
from grace_dl.collectives import Collectives
from grace_dl.torch import ddp as grace_ddp
from grace_dl.torch.distributed import DistCollectives

PIPELINES = {
    **{k: GRACE[k] for k in ("none", "fp16", "powersgd", "qsgd-2phase", "signsgd")},
    "topk": {**GRACE["topk"], "compress_ratio": 0.1},
    "randomk": {**GRACE["randomk"], "compress_ratio": 0.2},
    "threshold-bcast": {"compressor": "threshold", "threshold": 0.002, "memory": "residual",
                        "communicator": "broadcast"},
    "signsgd-2phase": GRACE["signsgd-2phase"],
    "dgc": {"compressor": "dgc", "compress_ratio": 0.05, "memory": "residual",
            "communicator": "allgather"},
}


def params_of(model) -> dict:
    """The model's state as float32 arrays (a half-precision model's widened exactly, a
    complex one as its real view)."""
    return {k: (torch.view_as_real(v) if v.is_complex() else v).detach().float().cpu().numpy()
            .copy() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- digits
def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    r, n = dist.get_rank(), dist.get_world_size()
    return (torch.from_numpy(x_tr[r::n]), torch.from_numpy(y_tr[r::n]),
            torch.from_numpy(x_te), torch.from_numpy(y_te))


def mlp(width=128):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 128), nn.ReLU(),
                         nn.Linear(128, 10))


#: ``<pipeline>@pieces``: the hook sends each bucket in pieces of 4 KiB (``piece_bytes``)
PIECES = "@pieces"
#: ``<pipeline>@bucketwise``: each bucket completed in its own hook call, as on NCCL
#: (``GraceState._per_bucket``; on gloo the step's buckets are completed together), and
#: collectives of data-dependent size held for one read of the step's sizes, as on NCCL
#: (``Collectives.holds_sizes``)
BUCKETWISE = "@bucketwise"
#: ``<pipeline>@static``: on ``Mixed`` (buckets of three dtypes) under ``static_graph=True``,
#: whose first iteration is DDP's delayed allreduce and whose buckets DDP rebuilds after its
#: second (``make``)
STATIC = "@static"
#: ``<pipeline>@parameter``: the hook in ``"parameter"`` granularity (a unit a gradient)
PARAMETER = "@parameter"


def hook_state(pipeline, **kwargs):
    base, *flags = pipeline.split("@")
    if PIECES[1:] in flags:
        kwargs["piece_bytes"] = 4096
    if PARAMETER[1:] in flags:
        kwargs["granularity"] = "parameter"
    state = grace_ddp.GraceState(grace_from_params(dict(PIPELINES[base])), **kwargs)
    if BUCKETWISE[1:] in flags:
        state._per_bucket = True
        state.collectives.holds_sizes = lambda lengths: True
    return state


def make(pipeline, bucket_cap_mb=0.02, granularity="auto", dtype=torch.float32, width=128,
         **options):
    """The MLP in ``dtype`` under DDP (``options``: DDP's), the hook of ``pipeline`` (None:
    none), SGD with momentum; ``Mixed`` under ``static_graph`` for ``@static``."""
    if pipeline is not None and STATIC[1:] in pipeline.split("@"):
        model = DDP(Mixed(), bucket_cap_mb=bucket_cap_mb, static_graph=True, **options)
    else:
        model = DDP(mlp(width).to(dtype), bucket_cap_mb=bucket_cap_mb, **options)
    state = None
    if pipeline is not None:
        state = hook_state(pipeline, granularity=granularity)
        model.register_comm_hook(state, grace_ddp.comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, state


def batches(data, epochs, batch=32, seed=1):
    x_tr, y_tr = data[0], data[1]
    gen = torch.Generator().manual_seed(seed)
    steps = len(x_tr) // batch
    for _ in range(epochs):
        order = torch.randperm(len(x_tr), generator=gen)
        for s in range(steps):
            idx = order[s * batch:(s + 1) * batch]
            yield x_tr[idx], y_tr[idx]


def accuracy(model, data) -> float:
    with torch.no_grad():
        return float((model(data[2]).argmax(1) == data[3]).float().mean())


def plain_steps(model, opt, loss_fn, data, steps: int = 8) -> dict:
    """``steps`` optimizer steps on the first batches; the parameters after them."""
    for _, (x, y) in zip(range(steps), batches(data, 1)):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return params_of(model)


# ---------------------------------------------------------------- modes
def mode_equal() -> dict:
    data = digits()
    loss_fn = nn.CrossEntropyLoss()
    out = {}
    for label, hook in (("default", False), ("hook", True)):
        # plain steps
        model, opt, _ = make("none" if hook else None)
        out[f"plain/{label}"] = plain_steps(model, opt, loss_fn, data)
        if hook:    # fp16: buckets of 20 KiB whole, and in pieces of 4 KiB: the same sums
            for case, pipeline in (("default", "fp16"), ("hook", "fp16" + PIECES)):
                model, opt, state = make(pipeline, bucket_cap_mb=0.02)
                out[f"pieces/{case}"] = plain_steps(model, opt, loss_fn, data)
                out[f"pieces/{case}/tensors"] = sorted(state.grace.bytes.steps[-1]["per_tensor"])
        # no_sync accumulation: 2 micro-batches per step, the first inside no_sync()
        model, opt, state = make("none" if hook else None)
        for i, (x, y) in enumerate(batches(data, 1, batch=16)):
            if i == 12:
                break
            if i % 2 == 0:
                opt.zero_grad()
                with model.no_sync():
                    loss_fn(model(x), y).backward()
            else:
                loss_fn(model(x), y).backward()
                opt.step()
        out[f"no_sync/{label}"] = params_of(model)
        if state is not None:
            out["no_sync/hook_steps"] = len(state.grace.bytes.steps)
            out["no_sync/iteration"] = state.iteration
        # unused parameters: a second head used on odd steps only
        torch.manual_seed(0)

        class Two(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = mlp()
                self.extra = nn.Linear(10, 10)

            def forward(self, x, use_extra):
                h = self.body(x)
                return self.extra(h) if use_extra else h

        model = DDP(Two(), bucket_cap_mb=0.02, find_unused_parameters=True)
        if hook:
            st = grace_ddp.GraceState(grace_from_params(dict(PIPELINES["none"])))
            model.register_comm_hook(st, grace_ddp.comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for i, (x, y) in enumerate(batches(data, 1)):
            if i == 6:
                break
            opt.zero_grad()
            loss_fn(model(x, i % 2 == 1), y).backward()
            opt.step()
        out[f"unused/{label}"] = params_of(model)
    return out


def mode_train(pipelines, epochs) -> dict:
    data = digits()
    loss_fn = nn.CrossEntropyLoss()
    out = {"horovod_before": "horovod" in sys.modules}
    for pipeline in pipelines:
        model, opt, state = make(None if pipeline == "ddp" else pipeline, bucket_cap_mb=25)
        acc = []
        step = 0
        for x, y in batches(data, epochs):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            step += 1
            if step % (len(data[0]) // 32) == 0:
                acc.append(accuracy(model, data))
        rec = {"accuracy": acc, "params": params_of(model)}
        if state is not None:
            sd = state.state_dict()
            buf = io.BytesIO()
            torch.save(sd, buf)
            fresh = hook_state(pipeline)
            fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
            again = fresh.state_dict()
            rec["roundtrip"] = _same_tree(sd["grace"], again["grace"])
            rec["state_keys"] = sorted(k for k, _ in _flat_items(sd["grace"]))
            rec["sent_per_step"] = [s["sent"] for s in state.grace.bytes.steps]
            rec["last_step_names"] = state.last_step_names
            rec["granularity"] = "parameter" if state.per_parameter else "bucket"
        out[pipeline] = rec
    out["horovod_after"] = "horovod" in sys.modules
    return out


def _flat_items(tree, prefix=""):
    """``(key, array)`` of a nested state dict's leaves, keyed by their ``/``-joined path."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_items(v, f"{prefix}/{k}")
    else:
        yield prefix, np.asarray(tree)


def _same_tree(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same_tree(a[k], b[k]) for k in a)
    return np.array_equal(np.asarray(a), np.asarray(b))


def mode_resume(pipelines, steps) -> dict:
    data = digits()
    loss_fn = nn.CrossEntropyLoss()
    all_batches = list(b for _, b in zip(range(2 * steps), batches(data, 10)))
    out = {}

    def train(model, opt, chunk, state=None):
        names = []
        for x, y in chunk:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            if state is not None:
                names.append(list(state.last_step_names))
        return names

    for pipeline in pipelines:
        model, opt, state = make(pipeline)
        names_per_step = train(model, opt, all_batches, state)
        straight = params_of(model)
        names_straight = list(state.last_step_names)

        model, opt, state = make(pipeline)
        train(model, opt, all_batches[:steps])
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "grace": state.state_dict()}, buf)
        del model, opt, state
        ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        model, opt, state = make(pipeline)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        state.load_state_dict(ckpt["grace"])
        names_resumed = train(model, opt, all_batches[steps:], state)
        out[pipeline] = {"straight": straight, "resumed": params_of(model),
                         "names_per_step": names_per_step, "names_resumed_per_step":
                         names_resumed,
                         "names": names_straight, "names_resumed": list(state.last_step_names),
                         "iteration": state.iteration,
                         "keys": sorted(k for k, _ in _flat_items(state.grace.state_dict()))}
        # without the hook state the run differs (the test checks state matters)
        model, opt, state = make(pipeline)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        train(model, opt, all_batches[steps:])
        out[pipeline]["no_state"] = params_of(model)
    return out


def mode_collectives() -> dict:
    coll = DistCollectives()
    r, n = coll.rank(), coll.size()
    out = {"size": n, "rank": r}
    sums = {}
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
               torch.int32, torch.int64, torch.float64):
        t = torch.arange(5).to(dt) + r
        before = t.clone()
        res = coll.synchronize(coll.allreduce_async(t, f"sum.{dt}"))
        sums[str(dt)] = (str(res.dtype), res.tolist(), torch.equal(t, before))
    out["sums"] = sums
    try:
        coll.allreduce_async(torch.ones(2, dtype=torch.bool), "bad")
        out["bool_sum_error"] = None
    except ValueError as err:
        out["bool_sum_error"] = str(err)
    # ragged allgather, several dtypes and trailing shapes
    gathers = {}
    for dt in (torch.float32, torch.bool, torch.bfloat16, torch.uint8, torch.int32):
        t = (torch.arange((r + 1) * 3 * 2).reshape(r + 1, 3, 2) % 3).to(dt)
        res = coll.synchronize(coll.allgather_async(t, f"ag.{dt}"))
        gathers[str(dt)] = (str(res.dtype), list(res.shape), res.float().flatten().tolist())
    empty = torch.zeros(0 if r == 0 else 4)
    gathers["empty"] = coll.synchronize(coll.allgather_async(empty, "ag.empty")).tolist()
    out["gathers"] = gathers
    # broadcast from every root; the caller's tensor is never overwritten
    bc = {}
    for root in range(n):
        t = torch.full((3,), float(r * 10 + 1))
        before = t.clone()
        res = coll.synchronize(coll.broadcast_async(t, root, f"bc{root}"))
        bc[root] = (res.tolist(), torch.equal(t, before))
    out["broadcast"] = bc
    try:
        coll.broadcast_async(torch.ones(1), n, "bad")
        out["bad_root_error"] = None
    except ValueError as err:
        out["bad_root_error"] = str(err)
    # alltoall, uneven: rank r sends j+r+1 rows to rank j, each row (value 100 r + j, r)
    splits = [j + r + 1 for j in range(n)]
    rows = torch.cat([torch.tensor([[100.0 * r + j, r]] * s) for j, s in enumerate(splits)])
    recv, recv_splits = coll.synchronize(coll.alltoall_async(rows, splits, "a2a"))
    out["alltoall"] = (recv.tolist(), recv_splits.tolist())
    # alltoall with segments longer than one gloo piece (256 KiB): rank r sends
    # (j + r + 1) * 80000 float32 values to rank j, value 1e6 r + 1e5 j + position
    splits = [(j + r + 1) * 80000 for j in range(n)]
    rows = torch.cat([1e6 * r + 1e5 * j + torch.arange(s, dtype=torch.float32)
                      for j, s in enumerate(splits)])
    recv, recv_splits = coll.synchronize(coll.alltoall_async(rows, splits, "a2a.big"))
    expect = torch.cat([1e6 * j + 1e5 * r + torch.arange((r + j + 1) * 80000,
                                                         dtype=torch.float32)
                        for j in range(n)])
    out["alltoall_big"] = (torch.equal(recv, expect), recv_splits.tolist())
    # the same exchanges with every rank's sizes given (no size exchange): same results
    matrix = [[(j + i + 1) * 80000 for j in range(n)] for i in range(n)]
    recv, recv_splits = coll.synchronize(coll.alltoall_known_async(rows, splits, matrix,
                                                                   "a2a.known"))
    out["alltoall_known"] = (torch.equal(recv, expect), recv_splits.tolist())
    ragged = (torch.arange((r + 1) * 3 * 2).reshape(r + 1, 3, 2) % 3).float()
    counts = [i + 1 for i in range(n)]
    out["gather_known"] = torch.equal(
        coll.synchronize(coll.allgather_known_async(ragged, counts, "ag.known")),
        coll.synchronize(coll.allgather_async(ragged, "ag.unknown")))
    # a ragged payload's parts and their lengths: the lengths once, then each part sized
    # from them (n + 1 all_gather calls), against the default (one gather of every rank's
    # block of lengths and parts, which this engine sizes with an exchange of sizes): the
    # same pieces
    parts = [torch.arange(2 * r + 1, dtype=torch.float32) + 10 * r,
             torch.full((r + 3,), r, dtype=torch.uint8), torch.zeros(0, dtype=torch.int32)]
    dtypes = ["float32", "uint8", "int32"]
    calls = []
    all_gather = dist.all_gather
    dist.all_gather = lambda *a, **k: (calls.append(1), all_gather(*a, **k))[1]
    try:
        mine = coll.allgather_parts_async(parts, ["pp0", "pp1", "pp2"], "pp.len")
        one_exchange = len(calls)
        plain = Collectives.allgather_parts_async(coll, parts, ["pd0", "pd1", "pd2"], "pd.len")
        plain_calls = len(calls) - one_exchange
    finally:
        dist.all_gather = all_gather
    got = [coll.synchronize_parts(mine, dtypes),
           Collectives.synchronize_parts(coll, plain, dtypes)]
    out["gather_parts"] = (one_exchange, plain_calls,
                           all(torch.equal(a, b) and a.dtype == b.dtype
                               for pa, pb in zip(*got) for a, b in zip(pa, pb)),
                           [[g.tolist() for g in part] for part in got[0]])
    known_errors = []
    for call in (lambda: coll.allgather_known_async(ragged, [5] * n, "bad.counts"),
                 lambda: coll.alltoall_known_async(rows, splits, [[1] * n] * n, "bad.matrix")):
        try:
            call()
            known_errors.append(None)
        except ValueError as err:
            known_errors.append(str(err))
    out["known_errors"] = known_errors
    # in place, scaled; None where the sum would need a wider type
    t = torch.arange(5, dtype=torch.float32) + r
    res = coll.synchronize(coll.allreduce_async_(t, "in_place", 0.5))
    out["in_place"] = (res.data_ptr() == t.data_ptr(), t.tolist(),
                       coll.allreduce_async_(torch.ones(2, dtype=torch.int8), "int8") is None)
    try:
        coll.alltoall_async(rows, [1] * n, "bad")
        out["bad_splits_error"] = None
    except ValueError as err:
        out["bad_splits_error"] = str(err)
    coll.barrier()
    return out


def mode_fused(steps: int) -> dict:
    """PowerSGD per parameter, one bucket: all_reduce calls per step, the parameters, the bytes
    counted and the grace state after ``steps`` steps, on the hook's PowerSGD bucket path
    (``fused``), on the reference composition with its per-bucket fusion (``reference``), and
    with every unit sent alone (``alone``)."""
    from grace_dl.collectives import Wrapping

    class Alone(Wrapping):
        """Issues every call at once (no recording, no ``collect``): no fusion."""

        def __init__(self, inner, label, **_):
            super().__init__(inner)

        def allreduce_async(self, tensor, name):
            return self.inner.allreduce_async(tensor, name)

        def allgather_async(self, tensor, name):
            return self.inner.allgather_async(tensor, name)

        def broadcast_async(self, tensor, root, name):
            return self.inner.broadcast_async(tensor, root, name)

        def alltoall_async(self, tensor, splits, name):
            return self.inner.alltoall_async(tensor, splits, name)

        def synchronize(self, handle):
            return self.inner.synchronize(handle)

        def close(self):
            pass

    data = digits()
    loss_fn = nn.CrossEntropyLoss()
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    out = {}
    fused = grace_ddp.GroupCollectives
    for label, group in (("fused", fused), ("reference", fused), ("alone", Alone)):
        grace_ddp.GroupCollectives = group
        model, opt, state = make("powersgd", bucket_cap_mb=100)
        bucket_path = state._powersgd is not None
        if label != "fused":
            state._powersgd = None
        per_step = []
        for x, y in list(batches(data, 1))[:steps]:
            opt.zero_grad()
            dist.all_reduce = counting
            calls.clear()
            loss_fn(model(x), y).backward()
            dist.all_reduce = real
            per_step.append(len(calls))
            opt.step()
        out[label] = {"calls": per_step, "params": params_of(model), "bucket_path": bucket_path,
                      "bytes": [step["per_tensor"] for step in state.grace.bytes.steps],
                      "state": dict(_flat_items(state.grace.state_dict())),
                      "names": state.last_step_names}
    grace_ddp.GroupCollectives = fused
    return out


def mode_join(pipelines) -> dict:
    """Each pipeline (``ddp``: no hook) with rank 0 taking 6 steps and rank 1 taking 4 under
    DDP's ``join()``: the parameters after it, and how many steps the hook ran."""
    data = digits()
    loss_fn = nn.CrossEntropyLoss()
    steps = 6 if dist.get_rank() == 0 else 4
    out = {}
    for pipeline in pipelines:
        model, opt, state = make(None if pipeline == "ddp" else pipeline)
        with model.join():
            for _, (x, y) in zip(range(steps), batches(data, 1)):
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
        out[pipeline] = {"params": params_of(model), **({} if state is None else {
            "steps": len(state.grace.bytes.steps), "iteration": state.iteration})}
    return out


#: DDP's options a user sets for speed or memory, by label (the first is DDP's defaults)
DDP_OPTIONS = {"default": {}, "bucket_view": {"gradient_as_bucket_view": True},
               "static": {"static_graph": True},
               "both": {"gradient_as_bucket_view": True, "static_graph": True}}


def mode_options(steps: int, pipelines) -> dict:
    """Each pipeline ``steps`` steps under each of ``DDP_OPTIONS`` (several buckets, SGD with
    momentum), and on the model cast to bfloat16 and float16 (DDP's defaults); pipeline
    ``ddp`` is DDP without a hook. ``names``: the grace tensors of each step."""
    data = digits()
    loss_fn = nn.CrossEntropyLoss()
    out = {}
    for pipeline in pipelines:
        runs = [(label, opts, torch.float32) for label, opts in DDP_OPTIONS.items()]
        for label, opts, dtype in runs + [("bfloat16", {}, torch.bfloat16),
                                          ("float16", {}, torch.float16)]:
            model, opt, state = make(None if pipeline == "ddp" else pipeline, dtype=dtype,
                                     **opts)
            names = []
            for _, (x, y) in zip(range(steps), batches(data, 1)):
                opt.zero_grad()
                loss_fn(model(x.to(dtype)), y).backward()
                opt.step()
                if state is not None:
                    names.append(list(state.last_step_names))
            out[f"{pipeline}/{label}"] = {
                "params": params_of(model), **({} if state is None else {
                    "sent": [s["sent"] for s in state.grace.bytes.steps],
                    "keys": sorted(k for k, _ in _flat_items(state.grace.state_dict())),
                    "names": names})}
    return out


class Mixed(nn.Module):
    """The MLP with parameters of two more dtypes: a float64 scale and a complex64 phase of
    the logits (DDP keeps a bucket per dtype, a complex one as its real view)."""

    def __init__(self):
        super().__init__()
        self.mlp = mlp()
        self.scale = nn.Parameter(torch.ones(10, dtype=torch.float64))
        self.phase = nn.Parameter(torch.full((10,), 1 + 0j, dtype=torch.complex64))

    def forward(self, x):
        return self.mlp(x) * self.scale.float() * self.phase.abs()


def mode_delayed(steps: int, pipelines) -> dict:
    """Each pipeline (``ddp``: no hook) ``steps`` steps on ``Mixed`` with and without
    ``static_graph``, whose first iteration DDP ends by its *delayed allreduce* (every bucket
    handed over at the end of the pass as bucket 0, none as the last): the parameters, and the
    hook's completed steps, byte-counted steps and units per step."""
    data = digits()
    loss_fn = nn.CrossEntropyLoss()
    out = {}
    for pipeline in pipelines:
        for label, options in (("default", {}), ("static", {"static_graph": True})):
            model = DDP(Mixed(), bucket_cap_mb=0.02, **options)
            state = None
            if pipeline != "ddp":
                state = hook_state(pipeline)
                model.register_comm_hook(state, grace_ddp.comm_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            units = []
            for _, (x, y) in zip(range(steps), batches(data, 1)):
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                if state is not None:
                    units.append(len(state.last_step_names))
            out[f"{pipeline}/{label}"] = {"params": params_of(model), **({} if state is None else {
                "iteration": state.iteration, "steps": len(state.grace.bytes.steps),
                "units": units})}
    return out


def mode_aborted(steps: int, pipelines) -> dict:
    """Each pipeline's ``GraceState`` on ``Mixed`` under ``static_graph``, the first backward
    pass failed in DDP's delayed allreduce after two of its three buckets were handed over (a
    hook around grace's raises there; DDP refuses to go on after it), then registered on a new
    DDP of the same module for ``steps`` steps: the parameters, the failed pass's error, the
    hook's completed steps and units per step; and the same ``steps`` steps of a new DDP and
    state without the failed pass before them (``<pipeline>/clean``)."""
    data = digits()
    loss_fn = nn.CrossEntropyLoss()
    out = {}

    def wrapped(fail):
        calls = []

        def hook(state, bucket):
            fut = grace_ddp.comm_hook(state, bucket)
            calls.append(bucket.index())
            if fail and len(calls) == 2:
                raise RuntimeError("injected after the second bucket")
            return fut
        return hook

    for pipeline in pipelines:
        for label, fail in (("failed", True), ("clean", False)):
            module = Mixed()
            state = hook_state(pipeline)
            batch = iter(batches(data, 2))
            x, y = next(batch)      # (the failed pass's batch, skipped by the clean run)
            error = None
            if fail:
                model = DDP(module, bucket_cap_mb=0.02, static_graph=True)
                model.register_comm_hook(state, wrapped(True))
                try:
                    loss_fn(model(x), y).backward()
                except RuntimeError as err:
                    error = str(err)
                del model
                gc.collect()
                module.zero_grad()
            model = DDP(module, bucket_cap_mb=0.02, static_graph=True)
            model.register_comm_hook(state, wrapped(False))
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            units = []
            for _, (x, y) in zip(range(steps), batch):
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                units.append(len(state.last_step_names))
            out[f"{pipeline}/{label}"] = {"params": params_of(model), "error": error,
                                          "iteration": state.iteration, "units": units}
            del model
            gc.collect()
    return out


def mode_device(steps: int, pipelines) -> dict:
    """Each pipeline ``steps`` steps on the path CPU tensors take and on the device path (a
    GPU's code on CPU tensors: ``emulate_device``, its Triton kernels in Triton's interpreter
    when the job runs with ``TRITON_INTERPRET=1``), in one bucket of ~100K elements (dgc's
    sampled threshold): parameters and bytes per step of each."""
    from grace_dl.torch.kernels import emulate_device, triton_for

    data = digits()
    loss_fn = nn.CrossEntropyLoss()
    out = {"kernels": triton_for(torch.empty(0))}
    for pipeline in pipelines:
        for path in ("cpu", "device"):
            with emulate_device() if path == "device" else contextlib.nullcontext():
                model, opt, state = make(pipeline, bucket_cap_mb=25, width=512)
                for _, (x, y) in zip(range(steps), batches(data, 1)):
                    opt.zero_grad()
                    loss_fn(model(x), y).backward()
                    opt.step()
            out[f"{pipeline}/{path}"] = {
                "params": params_of(model), "sent": [s["sent"] for s in state.grace.bytes.steps],
                "units": len(state.last_step_names)}
            del model, opt, state
            gc.collect()
    return out


def mode_disagree() -> dict:
    """Rank 1 uses another compress_ratio: the first hook call must raise on both ranks."""
    ratio = 0.1 if dist.get_rank() == 0 else 0.2
    model = DDP(mlp())
    state = grace_ddp.GraceState(grace_from_params(
        {"compressor": "topk", "compress_ratio": ratio, "communicator": "allgather"}))
    model.register_comm_hook(state, grace_ddp.comm_hook)
    try:
        model(torch.randn(4, 64)).sum().backward()
        return {"error": None}
    except Exception as err:  # noqa: BLE001 - DDP wraps the hook's ValueError
        return {"error": f"{type(err).__name__}: {err}"}


def mode_strategy(steps: int) -> dict:
    from grace_dl import recipes
    from grace_dl.strategy import from_spec

    data = digits()
    loss_fn = nn.CrossEntropyLoss()
    topk = {"compressor": "topk", "compress_ratio": 0.1, "memory": "residual",
            "communicator": "allgather"}
    specs = {"size_threshold": {"size_threshold": {"min_elements": 2000, "params": topk}},
             "recipe": recipes.recipe("topk")[0]}
    out = {}
    for label, spec in specs.items():
        model = DDP(mlp(), bucket_cap_mb=0.02)
        grc = from_spec(spec, model.module.named_parameters(), steps_per_epoch=3)
        state = grace_ddp.GraceState(grc, named_parameters=model.module.named_parameters())
        model.register_comm_hook(state, grace_ddp.comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _, (x, y) in zip(range(steps), batches(data, 1)):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        out[label] = {"params": params_of(model),
                      "sent_per_step": [s["sent"] for s in grc.bytes.steps]}
    try:
        grace_ddp.GraceState(from_spec(specs["size_threshold"], mlp().named_parameters()))
        out["unnamed"] = None
    except ValueError as err:
        out["unnamed"] = str(err)
    out["horovod"] = "horovod" in sys.modules
    return out


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mode = sys.argv[1]
    if mode == "equal":
        result = mode_equal()
    elif mode == "train":
        epochs = int(sys.argv[2])
        result = mode_train(sys.argv[3:], epochs)
    elif mode == "resume":
        steps = int(sys.argv[2])
        result = mode_resume(sys.argv[3:], steps)
    elif mode == "collectives":
        result = mode_collectives()
    elif mode == "fused":
        result = mode_fused(int(sys.argv[2]))
    elif mode == "join":
        result = mode_join(sys.argv[2:])
    elif mode == "options":
        result = mode_options(int(sys.argv[2]), sys.argv[3:])
    elif mode == "delayed":
        result = mode_delayed(int(sys.argv[2]), sys.argv[3:])
    elif mode == "aborted":
        result = mode_aborted(int(sys.argv[2]), sys.argv[3:])
    elif mode == "device":
        result = mode_device(int(sys.argv[2]), sys.argv[3:])
    elif mode == "disagree":
        result = mode_disagree()
    elif mode == "strategy":
        result = mode_strategy(int(sys.argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    mp.report(result, rank=dist.get_rank())
    # DDP models hold the process group: free them (reference cycles included) before it is
    # destroyed, with no rank still sending, so that gloo's threads are not torn down at
    # interpreter exit (a rare SIGABRT, "terminate called without an active exception")
    del result
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
