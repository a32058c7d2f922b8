"""DistributedOptimizer(bucket_bytes=...) on every rank: gradients packed into buckets, each
compressed once (grace_dl.torch.buckets), against horovod.torch's optimizer and against what
tests/test_torch_buckets.py recomputes in one process. Usage: ``torch_buckets.py``.
"""

import copy
from unittest import mock

import horovod.torch as real_hvd
import torch
import torch_common as C

import grace_dl.torch.horovod as hvd
import mp
from counting import counting_hook
from grace_dl import grace_from_params
from grace_dl.memory.base import Feedback
from grace_dl.memory.residual import ResidualFeedback
from grace_dl.strategy import Pipeline, from_strategy
from grace_dl.strategy.builders import assemble
from grace_dl.strategy.variables import bucket_layout, variables_of

STEPS = 3
NONE = {"compressor": "none", "memory": "none", "communicator": "allreduce"}
TOPK = {"compressor": "topk", "memory": "residual", "communicator": "allgather",
        "compress_ratio": 0.1}
QSGD2 = {"compressor": "qsgd", "quantum_num": 64, "memory": "residual",
         "communicator": "twophase"}
SMALL = 300   # bytes: the tiny MLP's 4 gradients (512, 64, 256, 16 bytes) in 3 buckets
WHOLE = 25 << 20

torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()
out = {"rank": rank}


def run(grace_params=None, horovod=False, steps=STEPS, bpps=1, extra=False, record=False,
        model=None, set_to_none=True, **kwargs):
    """Train ``steps`` steps; returns (model, opt, grace, records, collective calls)."""
    model = C.make_model(extra) if model is None else model
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grc = grace_params if grace_params is None or not isinstance(grace_params, dict) else \
        grace_from_params(dict(grace_params))
    calls = []
    if isinstance(grace_params, dict):   # a strategy dispatcher routes its own collectives
        grc.collectives = counting_hook(grc, calls)
    wrap = real_hvd.DistributedOptimizer if horovod else hvd.DistributedOptimizer
    extra_kw = {} if horovod else {"grace": grc}
    opt = wrap(base, named_parameters=model.named_parameters(), backward_passes_per_step=bpps,
               **kwargs, **extra_kw)
    records = []
    for step in range(steps):
        opt.zero_grad(**({} if set_to_none else {"set_to_none": False}))
        for micro in range(bpps):
            C.loss_of(model, rank, step, micro).backward()
        if record:
            local = C.grads(model)
            opt.synchronize()
            records.append({"local": local, "synced": C.grads(model)})
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return model, opt, grc, records, calls


# 1. none: a bucket's allreduce is Horovod's average, whatever the bucket size; one collective
# per bucket and step.
out["hvd"] = C.params(run(horovod=True)[0])
for label, size in (("small", SMALL), ("whole", WHOLE)):
    m, opt, grc, _, calls = run(NONE, bucket_bytes=size)
    out[f"none_{label}"] = {"params": C.params(m), "calls_per_step": len(calls) / STEPS,
                            "layout": opt.state_dict()["grace"]["buckets"],
                            "sent": [s["sent"] for s in grc.bytes.steps]}

# the gradients of a bucket's members are its buffer's slices after a step (no copy back), and
# accumulating into them (zero_grad(set_to_none=False)) gives the same result
m, opt, _, _, _ = run(NONE, bucket_bytes=SMALL)
flat = opt._buckets[0].flat
out["adopted"] = [flat.data_ptr() <= p.grad.data_ptr() < flat.data_ptr() + flat.nbytes
                  for p in opt._buckets[0].params]
out["keep_grads"] = C.params(run(NONE, bucket_bytes=SMALL, set_to_none=False)[0])
out["keep_grads_topk"] = C.params(run(TOPK, bucket_bytes=SMALL, set_to_none=False)[0])

# 2. topk over buckets: each step's applied gradient, for the in-process reference.
m, opt, grc, records, calls = run(TOPK, bucket_bytes=SMALL, record=True)
out["topk"] = {"params": C.params(m), "records": records, "calls_per_step": len(calls) / STEPS,
               "layout": opt.state_dict()["grace"]["buckets"],
               "keys": sorted(grc.state_dict().get("memory", {}).keys()),
               "sent": [s["sent"] for s in grc.bytes.steps],
               # each bucket of several gradients added them into the residual's slot
               "accumulated": [b.sums is not None for b in opt._buckets if len(b.params) > 1]}
m, _, _, _, calls = run(TOPK)
out["topk_per_parameter"] = {"params": C.params(m), "calls_per_step": len(calls) / STEPS}

# 3. op=Sum, gradient_predivide_factor, backward_passes_per_step=2 and a parameter only rank 1
# has a gradient for, bucketed `none` against Horovod's optimizer.
for label, kw in (("sum", {"op": hvd.Sum}), ("pre", {"gradient_predivide_factor": 4.0}),
                  ("bpps", {"bpps": 2}), ("nograd", {"extra": True})):
    out[f"{label}_hvd"] = C.params(run(horovod=True, **kw)[0])
    out[f"{label}_grace"] = C.params(run(NONE, bucket_bytes=SMALL, **kw)[0])
out["nograd_topk"] = C.params(run(TOPK, bucket_bytes=SMALL, extra=True)[0])

# 4. qsgd two-phase, buckets sent in pieces (piece_bytes=64): ranks stay identical; the
# checkpoint names the buckets and an optimizer with other buckets refuses it.
m, opt, grc, _, _ = run(QSGD2, bucket_bytes=SMALL, piece_bytes=64)
saved = copy.deepcopy(opt.state_dict())   # state_dict() shares the live momentum buffers
out["qsgd"] = {"params": C.params(m), "pieces": saved["grace"]["pieces"],
               "layout": saved["grace"]["buckets"],
               "accumulated": [len(b.sums) if b.sums else 0 for b in opt._buckets
                               if len(b.params) > 1]}
refusals = {}
for label, kw in (("per_parameter", {}), ("other_buckets", {"bucket_bytes": WHOLE})):
    _, other, _, _, _ = run(QSGD2, steps=0, piece_bytes=64, **kw)
    try:
        other.load_state_dict(saved)
        refusals[label] = None
    except ValueError as err:
        refusals[label] = str(err)
out["refusals"] = refusals
# resumed: two more steps from the checkpoint equal two more steps of the saved run
model = C.make_model()
model.load_state_dict({k: torch.from_numpy(v) for k, v in out["qsgd"]["params"].items()})
_, again, _, _, _ = run(QSGD2, steps=0, model=model, bucket_bytes=SMALL, piece_bytes=64)
again.load_state_dict(saved)
for step in range(STEPS, STEPS + 2):
    for o, mm in ((opt, m), (again, model)):
        o.zero_grad()
        C.loss_of(mm, rank, step).backward()
        o.step()
out["resume"] = {"continued": C.params(m), "resumed": C.params(model)}

# 4b. Gradients added into the residual (Feedback.accumulator, a whole bucket and one in pieces)
# train to the same bits as gradients copied into the bucket first (the path without it).
ACCUMULATED = (("topk", TOPK, {}), ("qsgd", QSGD2, {"piece_bytes": 64}))
out["added"] = {label: C.params(run(params, bucket_bytes=SMALL, **kw)[0])
                for label, params, kw in ACCUMULATED}
with mock.patch.object(ResidualFeedback, "accumulator", Feedback.accumulator):
    out["copied"] = {label: C.params(run(params, bucket_bytes=SMALL, **kw)[0])
                     for label, params, kw in ACCUMULATED}

# 5. A strategy's buckets (AllReduceSynchronizer.bucket, as Auto writes them): the layout of
# bucket_bytes=SMALL, the same training as bucket_bytes (lone parameters under their own names).
model = C.make_model()
variables = variables_of(model.named_parameters())
strategy = assemble(variables, [Pipeline.from_params(dict(TOPK))] * len(variables),
                    buckets=bucket_layout(variables, SMALL))
m, opt, grc, _, calls = run(from_strategy(strategy), model=model)
out["strategy"] = {"params": C.params(m), "buckets": grc.buckets,
                   "layout": opt.state_dict()["grace"]["buckets"],
                   "sent": [s["sent"] for s in grc.bytes.steps]}

mp.report(out)
