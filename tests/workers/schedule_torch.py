"""A ``grace_dl.Schedule`` under the torch ``DistributedOptimizer`` across real Horovod jobs.

``schedule_torch.py save DIR``: train TOTAL steps without interruption, reporting per-step bytes,
the stage each step ran in, and the parameters; then, separately, train SPLIT steps (mid
schedule, after the first switch) and write each rank's checkpoint ``rank<r>.pt``.

``schedule_torch.py load DIR`` (a fresh job): resume from the checkpoint and train to TOTAL;
also resume without the grace state (the schedule then restarts at its first stage).
"""

import sys
from pathlib import Path

import torch
import torch_common as C

import grace_dl.torch.horovod as hvd
import mp
from grace_dl import Schedule

TOTAL, SPLIT = 9, 5
STAGES = {0: {"compressor": "none", "communicator": "allreduce"},
          3: {"compressor": "topk", "compress_ratio": 0.1, "memory": "residual",
              "communicator": "allgather"},
          6: {"compressor": "topk", "compress_ratio": 0.05, "memory": "residual",
              "communicator": "allgather"}}
phase, folder = sys.argv[1], Path(sys.argv[2])

torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()


def build():
    model = C.make_model()
    grc = Schedule({k: dict(v) for k, v in STAGES.items()})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), grace=grc)
    return model, opt, grc


def train(model, opt, grc, start, stop, out=None):
    for step in range(start, stop):
        opt.zero_grad()
        C.loss_of(model, rank, step).backward()
        opt.step()
        if out is not None:
            out.setdefault("sent", []).append(grc.bytes.steps[-1]["sent"])
            out.setdefault("stage", []).append(grc.bytes.steps[-1]["stage"])
        if out is not None and grc.step == 6:   # the switch to stage 6 just happened
            out["after_switch"] = {"old": grc.stages[1][1].memory.state_dict(),
                                   "new": grc.stages[2][1].memory.state_dict()}


def resume(path, keep_grace=True):
    model, opt, grc = build()
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    state = ckpt["opt"] if keep_grace else {k: v for k, v in ckpt["opt"].items() if k != "grace"}
    opt.load_state_dict(state)
    resumed_at = (grc.step, grc.stage_start)
    train(model, opt, grc, SPLIT, TOTAL)
    return C.params(model), resumed_at


out = {"rank": rank}
if phase == "save":
    model, opt, grc = build()
    train(model, opt, grc, 0, TOTAL, out)
    out["uninterrupted"] = C.params(model)
    out["numel"] = int(sum(p.numel() for p in model.parameters()))

    import warnings

    from grace_dl import grace_from_params

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = C.make_model()
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=m.named_parameters(),
                                 grace=grace_from_params({"compressor": "randomk",
                                                          "memory": "residual"}))
    out["warnings"] = [str(w.message) for w in caught]

    model, opt, grc = build()
    train(model, opt, grc, 0, SPLIT)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, folder / f"rank{rank}.pt")
    hvd.barrier()
else:
    out["resumed"], out["resumed_at"] = resume(folder / f"rank{rank}.pt")
    out["without_grace_state"], _ = resume(folder / f"rank{rank}.pt", keep_grace=False)
mp.report(out)
