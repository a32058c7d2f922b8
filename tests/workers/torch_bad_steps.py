"""Launched by tests/test_bad_steps.py under ``horovodrun -np 2 --gloo``: the torch
``DistributedOptimizer`` through a bad step, zero-element parameters and live reloads of its
state (issue #44). Each rank ``report``s one dict, keyed by mode then pipeline
(``compressor+memory+communicator``).

Modes (``torch_bad_steps.py MODE PIPELINE...``):
- ``nonfinite``: a NaN (step 1) and a +Inf (step 3) in one entry of rank 1's gradient; per
  step, whether the averaged gradients are finite on this rank. A non-finite step is skipped
  (a user's ``isfinite`` guard), so the parameters stay finite.
- ``amp``: ``torch.amp.GradScaler`` with an overflow injected into rank 1's gradient at step 2:
  the scale after each step and whether the parameters moved.
- ``zero``: a model with zero-element parameters (shapes (0,) and (5, 0)): three steps.
- ``reload``: 3 steps, a checkpoint (model, optimizer), 3 more; the checkpoint loaded into the
  live objects and the same 3 steps again; loaded into fresh objects and again.
"""

import copy
import sys

import numpy as np
import torch
import torch_common as C
from torch import nn

import grace_dl.torch.horovod as hvd
import mp
from grace_dl import grace_from_params
from support import parse_pipeline, state_finite

torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()


class WithEmpty(nn.Module):
    """TinyMLP's body plus two zero-element parameters, which get (empty) gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = C.make_model().body
        self.empty = nn.Parameter(torch.zeros(0))
        self.wide = nn.Parameter(torch.zeros(5, 0))

    def forward(self, x):
        return self.body(x) + self.empty.sum() + self.wide.sum()


def build(pipeline, model=None):
    model = C.make_model() if model is None else model
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   grace=grace_from_params(parse_pipeline(pipeline)))
    return model, opt


def inject(model) -> dict:
    """While the returned dict's ``"value"`` is not None, entry (3, 4) of the first layer's
    weight gradient becomes that value (before Horovod's hooks see it)."""
    where = {"value": None}

    def hook(grad):
        if where["value"] is None:
            return grad
        grad = grad.clone()
        grad[3, 4] = where["value"]
        return grad
    model.body[0].weight.register_hook(hook)
    return where


def finite_params(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def mode_nonfinite(pipelines) -> dict:
    out = {}
    bad = {1: float("nan"), 3: float("inf")}
    for pipeline in pipelines:
        try:
            model, opt = build(pipeline)
            where = inject(model)
            finite = []
            for step in range(6):
                where["value"] = bad.get(step) if rank == 1 else None
                opt.zero_grad()
                C.loss_of(model, rank, step).backward()
                opt.synchronize()
                ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
                finite.append(ok)
                if ok:      # the user's guard: a non-finite step is skipped
                    with opt.skip_synchronize():
                        opt.step()
            out[pipeline] = {"finite": finite, "params_finite": finite_params(model)}
        except Exception as err:  # noqa: BLE001 - reported, the test names it
            out[pipeline] = {"error": f"{type(err).__name__}: {err}"}
    return out


def mode_amp(pipelines) -> dict:
    out = {}
    for pipeline in pipelines:
        model, opt = build(pipeline)
        where = inject(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
        scales, moved = [], []
        for step in range(6):
            where["value"] = float("inf") if rank == 1 and step == 2 else None
            before = C.params(model)
            opt.zero_grad()
            scaler.scale(C.loss_of(model, rank, step)).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
            after = C.params(model)
            moved.append(any(not np.array_equal(before[k], after[k]) for k in after))
        out[pipeline] = {"scales": scales, "moved": moved, "params_finite": finite_params(model),
                         "state_finite": state_finite(opt.grace)}
    return out


def mode_zero(pipelines) -> dict:
    out = {}
    for pipeline in pipelines:
        try:
            model, opt = build(pipeline, WithEmpty())
            for step in range(3):
                opt.zero_grad()
                C.loss_of(model, rank, step).backward()
                opt.step()
            out[pipeline] = {"error": None, "params": C.params(model),
                             "empty_grads": [tuple(model.empty.grad.shape),
                                             tuple(model.wide.grad.shape)]}
        except Exception as err:  # noqa: BLE001
            out[pipeline] = {"error": f"{type(err).__name__}: {err}"}
    return out


def train(model, opt, steps) -> None:
    for step in steps:
        opt.zero_grad()
        C.loss_of(model, rank, step).backward()
        opt.step()


def mode_reload(pipelines) -> dict:
    out = {}
    for pipeline in pipelines:
        rec = {}
        try:
            model, opt = build(pipeline)
            train(model, opt, range(3))
            ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
            train(model, opt, range(3, 6))
            rec["straight"] = C.params(model)
            model.load_state_dict(ckpt["model"])      # live: roll back and run again
            opt.load_state_dict(ckpt["opt"])
            train(model, opt, range(3, 6))
            rec["live"] = C.params(model)
            model, opt = build(pipeline)              # fresh objects
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            train(model, opt, range(3, 6))
            rec["fresh"] = C.params(model)
            rec["error"] = None
        except Exception as err:  # noqa: BLE001
            rec["error"] = f"{type(err).__name__}: {err}"
        out[pipeline] = rec
    return out


MODES = {"nonfinite": mode_nonfinite, "amp": mode_amp, "zero": mode_zero,
         "reload": mode_reload}
result = {}
args = sys.argv[1:]
while args:     # MODE PIPELINE... [-- MODE PIPELINE...]
    cut = args.index("--") if "--" in args else len(args)
    mode, pipelines, args = args[0], args[1:cut], args[cut + 1:]
    result[mode] = MODES[mode](pipelines)
mp.report(result)
