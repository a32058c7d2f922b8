"""Launched by tests/test_bad_steps.py under ``torchrun --nproc-per-node 2`` (gloo): the grace
DDP hook through a bad step and through reloads of its state (issue #44). One ``mode`` per job;
each rank ``report``s a dict.

Modes:
- ``nonfinite <pipeline>...``: a NaN (step 1) and an Inf (step 3) in one entry of rank 1's
  gradient; per step, whether the averaged gradients are finite on this rank. The loop skips
  the optimizer step when they are not (a user's ``isfinite`` guard).
- ``amp <pipeline>...``: ``torch.amp.GradScaler`` with an overflow injected into rank 1's
  gradient at one step: the scale per step and whether the parameters moved.
- ``reload <pipeline>...``: k steps, a checkpoint, k more; the checkpoint loaded into the live
  objects and the same k steps again; loaded into fresh objects and again: three parameter
  sets. ``weights_only``: the hook state saved by ``torch.save`` and read by ``torch.load``
  with its defaults.
- ``pickle <pipeline>...``: 2k steps straight; k steps, the model saved, the ``GraceState``
  pickled (``torch.save``) and deep-copied, the model and DDP rebuilt, k more steps with each
  copy; also on a ``new_group`` process group.
- ``sparse``: a model with ``nn.Embedding(sparse=True)``: the error each rank gets.
- ``some_ranks`` (alone in its job): rank 0 registers the grace hook, rank 1 trains with plain
  DDP; each rank prints its error and when it came, and the job exits non-zero.

``ddp_bad_steps.py MODE ARGS... [-- MODE ARGS...]`` runs several modes in one job.
"""

from __future__ import annotations

import copy
import gc
import io
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mp
from grace_dl import grace_from_params
from grace_dl.torch import ddp as grace_ddp
from support import parse_pipeline, state_finite

#: the pipelines by name (GRACE keys)
PIPELINES = {
    "topk": {"compressor": "topk", "compress_ratio": 0.1, "memory": "residual",
             "communicator": "allgather"},
    "topk-dgc": {"compressor": "topk", "compress_ratio": 0.1, "memory": "dgc",
                 "communicator": "allgather"},
    "dgc": {"compressor": "dgc", "compress_ratio": 0.1, "memory": "dgc",
            "communicator": "allgather"},
    "randomk": {"compressor": "randomk", "compress_ratio": 0.2, "memory": "residual",
                "communicator": "allreduce"},
    "qsgd-2phase": {"compressor": "qsgd", "quantum_num": 64, "memory": "residual",
                    "communicator": "twophase"},
    "signsgd-2phase": {"compressor": "signsgd", "memory": "residual",
                       "communicator": "twophase"},
    "terngrad": {"compressor": "terngrad", "memory": "residual", "communicator": "allgather"},
    "powersgd": {"compressor": "powersgd", "compress_rank": 2, "memory": "powersgd",
                 "communicator": "allreduce"},
    "signsgd": {"compressor": "signsgd", "memory": "none", "communicator": "allgather"},
    "signum": {"compressor": "signum", "memory": "none", "communicator": "allgather"},
    "fp16": {"compressor": "fp16", "memory": "none", "communicator": "allreduce"},
}


def pipeline_params(name: str) -> dict:
    """GRACE keys of ``name``: a ``PIPELINES`` entry, or ``compressor+memory+communicator``."""
    return dict(PIPELINES[name]) if name in PIPELINES else parse_pipeline(name)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def data(steps: int, seed: int = 1):
    """``steps`` batches of this rank (different on each rank)."""
    gen = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    return [(torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(steps)]


def params_of(model) -> dict:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def build(pipeline, model=None, process_group=None, **kwargs):
    model = mlp() if model is None else model
    ddp = DDP(model, bucket_cap_mb=0.004, process_group=process_group)
    state = None
    if pipeline is not None:
        state = grace_ddp.GraceState(grace_from_params(pipeline_params(pipeline)),
                                     process_group=process_group, **kwargs)
        ddp.register_comm_hook(state, grace_ddp.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    return ddp, opt, state


def inject(model) -> dict:
    """A hook on the first layer's weight: while the returned dict's ``"value"`` is not None,
    entry (3, 4) of its gradient becomes that value."""
    where = {"value": None}

    def hook(grad):
        if where["value"] is None:
            return grad
        grad = grad.clone()
        grad[3, 4] = where["value"]
        return grad
    next(model.parameters()).register_hook(hook)
    return where


def train(ddp, opt, batches, state=None) -> None:
    loss_fn = nn.CrossEntropyLoss()
    for x, y in batches:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()


# ---------------------------------------------------------------- modes
def mode_nonfinite(pipelines) -> dict:
    out = {}
    bad = {1: float("nan"), 3: float("inf")}
    for pipeline in pipelines:
        ddp, opt, _ = build(pipeline)
        where = inject(ddp.module)
        finite = []
        loss_fn = nn.CrossEntropyLoss()
        for step, (x, y) in enumerate(data(6)):
            where["value"] = bad.get(step) if dist.get_rank() == 1 else None
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            ok = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())
            finite.append(ok)
            if ok:          # the user's guard: a non-finite step is skipped
                opt.step()
        out[pipeline] = {"finite": finite,
                         "params_finite": all(np.isfinite(v).all()
                                              for v in params_of(ddp.module).values())}
    return out


def mode_amp(pipelines) -> dict:
    out = {}
    loss_fn = nn.CrossEntropyLoss()
    for pipeline in pipelines:
        ddp, opt, state = build(pipeline)
        where = inject(ddp.module)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
        scales, moved = [], []
        for step, (x, y) in enumerate(data(6)):
            where["value"] = float("inf") if dist.get_rank() == 1 and step == 2 else None
            before = params_of(ddp.module)
            opt.zero_grad()
            scaler.scale(loss_fn(ddp(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
            after = params_of(ddp.module)
            moved.append(any(not np.array_equal(before[k], after[k]) for k in after))
        out[pipeline] = {"scales": scales, "moved": moved,
                         "state_finite": state_finite(state.grace),
                         "params_finite": all(np.isfinite(v).all()
                                              for v in params_of(ddp.module).values())}
    return out


def _checkpoint(ddp, opt, state) -> dict:
    return copy.deepcopy({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                          "grace": state.state_dict()})


def _load(ddp, opt, state, ckpt) -> None:
    ddp.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["grace"])


def mode_reload(pipelines, steps: int) -> dict:
    out = {}
    batches = data(2 * steps)
    for pipeline in pipelines:
        rec = {}
        try:
            ddp, opt, state = build(pipeline)
            train(ddp, opt, batches[:steps])
            ckpt = _checkpoint(ddp, opt, state)
            train(ddp, opt, batches[steps:])
            rec["straight"] = params_of(ddp.module)
            _load(ddp, opt, state, ckpt)                 # live: roll back and run again
            train(ddp, opt, batches[steps:])
            rec["live"] = params_of(ddp.module)
            ddp, opt, state = build(pipeline)            # fresh objects
            _load(ddp, opt, state, ckpt)
            train(ddp, opt, batches[steps:])
            rec["fresh"] = params_of(ddp.module)
            rec["error"] = None
        except Exception as err:  # noqa: BLE001 - reported, the test names it
            rec["error"] = f"{type(err).__name__}: {err}"
        out[pipeline] = rec
    # the hook state through torch.save / torch.load with its defaults (weights_only=True)
    ddp, opt, state = build("qsgd-2phase")
    train(ddp, opt, batches[:steps])
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    try:
        loaded = torch.load(io.BytesIO(buf.getvalue()))
        fresh = grace_ddp.GraceState(grace_from_params(pipeline_params("qsgd-2phase")))
        fresh.load_state_dict(loaded)
        out["weights_only"] = None
    except Exception as err:  # noqa: BLE001
        out["weights_only"] = f"{type(err).__name__}: {err}"
    return out


def _pickle_case(pipeline, group, batches, steps: int) -> dict:
    """Parameters after 2k steps straight, and after k steps, a pickled / deep-copied /
    re-bound copy of the hook state on a rebuilt model and DDP, and k more."""
    rec = {"error": None}
    ddp, opt, state = build(pipeline, process_group=group)
    train(ddp, opt, batches)
    rec["straight"] = params_of(ddp.module)

    ddp, opt, state = build(pipeline, process_group=group)
    train(ddp, opt, batches[:steps])
    buf = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict()}, buf)
    pickled = io.BytesIO()
    torch.save(state, pickled)
    copied = copy.deepcopy(state)
    ckpt = torch.load(io.BytesIO(buf.getvalue()))
    for how in ("pickled", "deepcopy", "rebound"):
        model = mlp()
        model.load_state_dict(ckpt["model"])
        st = copied if how == "deepcopy" else \
            torch.load(io.BytesIO(pickled.getvalue()), weights_only=False)
        if how == "rebound":
            st.process_group = group     # bound by the user, as PowerSGDState's
        ddp = DDP(model, bucket_cap_mb=0.004, process_group=group)
        ddp.register_comm_hook(st, grace_ddp.comm_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        opt.load_state_dict(ckpt["opt"])
        train(ddp, opt, batches[steps:])
        rec[how] = params_of(ddp.module)
    return rec


def mode_pickle(pipelines, steps: int) -> dict:
    out = {}
    batches = data(2 * steps)
    world = dist.new_group(list(range(dist.get_world_size())))
    for pipeline in pipelines:
        for label, group in (("default", None), ("new_group", world)):
            try:
                out[f"{pipeline}/{label}"] = _pickle_case(pipeline, group, batches, steps)
            except Exception as err:  # noqa: BLE001 - reported, the test names it
                out[f"{pipeline}/{label}"] = {"error": f"{type(err).__name__}: {err}"}
    # a copy of a state on a group of other ranks than the world refuses to run unbound
    sub = dist.new_group([0])
    if dist.get_rank() == 0:
        try:
            state = grace_ddp.GraceState(grace_from_params(pipeline_params("topk")),
                                         process_group=sub)
            copied = copy.deepcopy(state)
            model = DDP(mlp(), process_group=sub)
            model.register_comm_hook(copied, grace_ddp.comm_hook)
            model(torch.randn(4, 16)).sum().backward()
            out["unbound"] = None
        except Exception as err:  # noqa: BLE001 - DDP may wrap the hook's ValueError
            out["unbound"] = f"{type(err).__name__}: {err}"
    return out


def mode_sparse() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 2))
    ddp = DDP(model)
    state = grace_ddp.GraceState(grace_from_params(pipeline_params("topk")))
    ddp.register_comm_hook(state, grace_ddp.comm_hook)
    try:
        ddp(torch.tensor([[1, 2], [3, 4]])).sum().backward()
        return {"error": None}
    except Exception as err:  # noqa: BLE001 - DDP may wrap the hook's ValueError
        return {"error": f"{type(err).__name__}: {err}"}


def mode_some_ranks() -> None:
    """Rank 0 with the grace hook, rank 1 plain DDP: prints the error the rank gets (a
    rank's output says when it failed), then exits non-zero."""
    start = time.monotonic()
    ddp = DDP(mlp())
    if dist.get_rank() == 0:
        state = grace_ddp.GraceState(grace_from_params(pipeline_params("topk")),
                                     agreement_timeout=5)
        ddp.register_comm_hook(state, grace_ddp.comm_hook)
    try:
        ddp(torch.randn(4, 16)).sum().backward()
    except Exception as err:  # noqa: BLE001
        print(f"rank {dist.get_rank()} after {time.monotonic() - start:.1f} s: "
              f"{type(err).__name__}: {err}", flush=True)
        raise SystemExit(1) from None
    print(f"rank {dist.get_rank()}: no error", flush=True)
    raise SystemExit(0)


MODES = {"nonfinite": lambda args: mode_nonfinite(args),
         "amp": lambda args: mode_amp(args),
         "reload": lambda args: mode_reload(args[1:], int(args[0])),
         "pickle": lambda args: mode_pickle(args[1:], int(args[0])),
         "sparse": lambda args: mode_sparse()}


def main() -> None:
    """``ddp_bad_steps.py MODE ARGS... [-- MODE ARGS...]``: each mode's result under its name
    (``some_ranks`` runs alone)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    args = sys.argv[1:]
    if args == ["some_ranks"]:
        mode_some_ranks()
        return
    result = {}
    while args:
        cut = args.index("--") if "--" in args else len(args)
        mode, rest, args = args[0], args[1:cut], args[cut + 1:]
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}")
        result[mode] = MODES[mode](rest)
    mp.report(result, rank=dist.get_rank())
    del result
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
