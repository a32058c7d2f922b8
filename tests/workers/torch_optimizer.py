"""grace_dl.torch.horovod.DistributedOptimizer against horovod.torch's, on every rank.

One launch runs several short trainings of the tiny MLP in tests/workers/torch_common.py, each
with a fresh optimizer, and reports what tests/test_torch_optimizer.py compares. Usage:
``torch_optimizer.py TOPK_PARAMS_JSON``.
"""

import json
import sys
import warnings

import horovod.torch as real_hvd
import torch
import torch_common as C

import grace_dl.torch.horovod as hvd
import mp
from counting import counting_hook
from grace_dl import grace_from_params

STEPS = 3
NONE = {"compressor": "none", "memory": "none", "communicator": "allreduce"}
TOPK = json.loads(sys.argv[1])

torch.set_num_threads(1)
RANK0 = hvd.ProcessSet([0])
hvd.init(process_sets=[RANK0])
rank = hvd.rank()
out = {"rank": rank, "size": hvd.size()}


def run(grace_params=None, horovod=False, steps=STEPS, bpps=1, extra=False, clip=False,
        record=False, **kwargs):
    """Train ``steps`` optimizer steps; returns (model, opt, grace, records)."""
    model = C.make_model(extra)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grc = None if grace_params is None else grace_from_params(dict(grace_params))
    wrap = real_hvd.DistributedOptimizer if horovod else hvd.DistributedOptimizer
    extra_kw = {} if horovod else {"grace": grc}
    opt = wrap(base, named_parameters=model.named_parameters(), backward_passes_per_step=bpps,
               **kwargs, **extra_kw)
    records = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(bpps):
            C.loss_of(model, rank, step, micro).backward()
        if record or clip:
            local = C.grads(model)
            opt.synchronize()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            records.append({"local": local, "synced": C.grads(model)})
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return model, opt, grc, records


# 1. grace=None is Horovod's optimizer, bit for bit.
m_ref, o_ref, _, _ = run(horovod=True)
m_none, o_none, _, _ = run(grace_params=None)
out["grace_none_class_module"] = type(o_none).__module__
out["hvd"] = C.params(m_ref)
out["grace_None"] = C.params(m_none)

# 2. The `none` pipeline equals Horovod's averaging.
m, _, grc, _ = run(NONE)
out["none_pipeline"] = C.params(m)
out["none_bytes"] = [s["sent"] for s in grc.bytes.steps]

# 3. topk + residual + allgather: what each rank had and what it applied, step by step.
m_topk, _, grc, records = run(TOPK, record=True)
out["topk"] = C.params(m_topk)
out["topk_records"] = records
out["topk_bytes"] = [s["sent"] for s in grc.bytes.steps]

# 4. backward_passes_per_step=2: nothing is sent until the second pass; result as Horovod's.
out["bpps_hvd"] = C.params(run(horovod=True, bpps=2)[0])
out["bpps_grace"] = C.params(run(NONE, bpps=2)[0])
model = C.make_model()
grc = grace_from_params(dict(NONE))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), grace=grc,
                               backward_passes_per_step=2)
C.loss_of(model, rank, 0, 0).backward()
out["bpps_sent_after_pass1"] = sum(grc.bytes.sent.values())
C.loss_of(model, rank, 0, 1).backward()
out["bpps_sent_after_pass2"] = sum(grc.bytes.sent.values())
try:
    C.loss_of(model, rank, 0, 2).backward()
    out["bpps_third_pass"] = "no error"
except AssertionError as err:
    out["bpps_third_pass"] = str(err)
opt.step()

# 5. synchronize() + gradient clipping + skip_synchronize(), as in Horovod's docs.
out["skip_hvd"] = C.params(run(horovod=True, clip=True)[0])
m, opt, grc, records = run(NONE, clip=True)
out["skip_grace"] = C.params(m)
out["skip_steps_counted"] = len(grc.bytes.steps)
out["skip_synced_norm"] = float(sum((torch.from_numpy(g) ** 2).sum()
                                    for g in records[-1]["synced"].values()) ** 0.5)
opt.zero_grad()
C.loss_of(model, rank, 9).backward()
opt.synchronize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.step()
out["skip_warning"] = [str(w.message) for w in caught]

# 6. op=Sum and gradient_predivide_factor, against Horovod's.
out["sum_hvd"] = C.params(run(horovod=True, op=hvd.Sum)[0])
out["sum_grace"] = C.params(run(NONE, op=hvd.Sum)[0])
out["pre_hvd"] = C.params(run(horovod=True, gradient_predivide_factor=4.0)[0])
out["pre_grace"] = C.params(run(NONE, gradient_predivide_factor=4.0)[0])
out["pre_topk"] = C.params(run(TOPK, gradient_predivide_factor=4.0)[0])
out["topk_again"] = C.params(run(TOPK)[0])

# 7. A layer only rank 1 uses (rank 0 has no gradient) and a non-float parameter.
out["nograd_hvd"] = C.params(run(horovod=True, extra=True)[0])
out["nograd_grace"] = C.params(run(NONE, extra=True)[0])
out["nograd_topk"] = C.params(run(TOPK, extra=True)[0])

# 8. A process set holding rank 0 only: rank 1 trains alone, rank 0 "averages" with itself.
out["ps_hvd"] = C.params(run(horovod=True, process_set=RANK0)[0])
m, _, grc, _ = run(NONE, process_set=RANK0)
out["ps_grace"] = C.params(m)
out["ps_grace_steps"] = len(grc.bytes.steps)
out["ps_attached"] = grc.process_set is RANK0

# 8b. groups= with grace: the core's fusion. Collectives handed to Horovod are counted through
# the communicator's one routing hook (``collectives(tensor)``).
def counted(params, groups):
    model = C.make_model()
    grc = grace_from_params(dict(params))
    calls = []
    grc.collectives = counting_hook(grc, calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), groups=groups,
                                       grace=grc)
        for step in range(STEPS):
            opt.zero_grad()
            C.loss_of(model, rank, step).backward()
            opt.step()
    return {"params": C.params(model), "calls_per_step": len(calls) / STEPS,
            "names": sorted(set(calls)), "sent": [s["sent"] for s in grc.bytes.steps],
            "warnings": [str(w.message) for w in caught if w.category is UserWarning]}


out["groups"] = {label: {str(g): counted(params, g) for g in (None, 2)}
                 for label, params in (("none", NONE), ("topk", TOPK))}

# 8c. Two-phase in lockstep: step() starts every tensor's gather before it waits for any (the
# optimizer receives through ``receive_all``), with the same result as one tensor at a time.
def two_phase(lockstep):
    model = C.make_model()
    grc = grace_from_params({"compressor": "qsgd", "quantum_num": 64, "memory": "residual",
                             "communicator": "twophase"})
    if not lockstep:
        grc.receive_all = None   # the glue then receives handle by handle
    calls, events = [], []
    grc.collectives = counting_hook(grc, calls, events)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), grace=grc)
    for step in range(STEPS):
        events.clear()
        opt.zero_grad()
        C.loss_of(model, rank, step).backward()
        opt.step()
    gathers = [i for i, (kind, name) in enumerate(events) if ".ag." in name]
    issued = [i for i in gathers if events[i][0] == "issue"]
    waited = [i for i in gathers if events[i][0] == "wait"]
    return {"params": C.params(model), "tensors": len(issued),
            "all_issued_before_a_wait": max(issued) < min(waited)}


out["two_phase"] = {"lockstep": two_phase(True), "one_by_one": two_phase(False)}

# 8d. Pieces: gradients over piece_bytes (64 bytes here: every weight of the tiny MLP) go in
# pieces, each its own grace tensor written back into its slice of p.grad (``none``: never).
QSGD2 = {"compressor": "qsgd", "quantum_num": 64, "memory": "residual",
         "communicator": "twophase"}
FP16 = {"compressor": "fp16", "memory": "none", "communicator": "allreduce"}
m, opt, _, _ = run(FP16, piece_bytes=64)
out["pieces_fp16"] = C.params(m)
out["pieces_fp16_layout"] = opt.state_dict()["grace"]["pieces"]
out["whole_fp16"] = C.params(run(FP16, piece_bytes=None)[0])
_, opt_none, _, _ = run(NONE, piece_bytes=64, steps=1)
out["pieces_none_layout"] = opt_none.state_dict()["grace"]["pieces"]
m, opt, grc, _ = run(QSGD2, piece_bytes=64)


def flat_keys(tree, prefix=""):
    if not isinstance(tree, dict):
        return [prefix]
    return [k for key, v in tree.items() for k in flat_keys(v, f"{prefix}/{key}")]


out["pieces_qsgd"] = {"params": C.params(m), "keys": sorted(flat_keys(grc.state_dict())),
                      "pieces": opt.state_dict()["grace"]["pieces"]}
saved = opt.state_dict()
_, whole, _, _ = run(QSGD2, piece_bytes=None, steps=0)
try:
    whole.load_state_dict(saved)
    out["pieces_refused"] = None
except ValueError as err:
    out["pieces_refused"] = str(err)
_, again, _, _ = run(QSGD2, piece_bytes=64, steps=0)
again.load_state_dict(saved)
out["pieces_reloaded"] = True

# 9. zero_grad() between backward() and step() is refused, as in Horovod.
model = C.make_model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(),
                               grace=grace_from_params(dict(NONE)))
C.loss_of(model, rank, 0).backward()
try:
    opt.zero_grad()
    out["zero_grad_race"] = "no error"
except AssertionError as err:
    out["zero_grad_race"] = str(err)
opt.step()


# 10. Ranks that disagree raise ValueError on every rank (no hang).
def mismatch(params, extra):
    model = C.make_model(extra)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(),
                                 grace=grace_from_params(params))
    except ValueError as err:
        return str(err)
    return "no error"


out["mismatch_config"] = mismatch({**TOPK, "compress_ratio": TOPK["compress_ratio"] * (rank + 1)},
                                  False)
out["mismatch_model"] = mismatch(dict(TOPK), rank == 1)


# 11. broadcast_optimizer_state initialises momentum without a grace exchange.
model = C.make_model()
grc = grace_from_params(dict(TOPK))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters(), grace=grc)
hvd.broadcast_optimizer_state(opt, root_rank=0)
out["bcast_state_entries"] = len(opt.state_dict()["state"])
out["bcast_grace_steps"] = len(grc.bytes.steps)


# 12. Sparse gradients (nn.Embedding(sparse=True)): densified with sparse_as_dense, else refused.
def sparse_run(horovod, sparse_as_dense=True):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    kw = {} if horovod else {"grace": grace_from_params(dict(NONE))}
    wrap = real_hvd.DistributedOptimizer if horovod else hvd.DistributedOptimizer
    opt = wrap(torch.optim.SGD(emb.parameters(), lr=0.5), named_parameters=emb.named_parameters(),
               sparse_as_dense=sparse_as_dense, **kw)
    for step in range(2):
        opt.zero_grad()
        emb(torch.tensor([rank + step, 7])).sum().backward()
        opt.step()
    return emb.weight.detach().clone().numpy()


out["sparse_hvd"] = sparse_run(True)
out["sparse_grace"] = sparse_run(False)
try:
    sparse_run(False, sparse_as_dense=False)
    out["sparse_refused"] = "no error"
except ValueError as err:
    out["sparse_refused"] = str(err)

mp.report(out)
