"""Checkpoint and resume of a grace optimizer across separate Horovod jobs.

``torch_resume.py save DIR PARAMS_JSON``: train TOTAL steps without interruption (reported), and
separately train SPLIT steps and write checkpoints: every rank its own ``rank<r>.pt``
(``state_dict()``), and rank 0 alone ``gathered.pt`` (``gathered_state_dict()``).

``torch_resume.py load DIR PARAMS_JSON`` (a fresh job): resume from each kind of checkpoint and
train to TOTAL; also resume without the grace state, and try loading another rank's file.
"""

import json
import sys
from pathlib import Path

import torch
import torch_common as C

import grace_dl.torch.horovod as hvd
import mp
from grace_dl import grace_from_params

TOTAL, SPLIT = 6, 3
phase, folder, params = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])

torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()


def build():
    model = C.make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   grace=grace_from_params(dict(params)))
    return model, opt


def train(model, opt, start, stop):
    for step in range(start, stop):
        opt.zero_grad()
        C.loss_of(model, rank, step).backward()
        opt.step()


def resume(path, keep_grace=True):
    model, opt = build()
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    state = ckpt["opt"] if keep_grace else {k: v for k, v in ckpt["opt"].items() if k != "grace"}
    opt.load_state_dict(state)
    train(model, opt, SPLIT, TOTAL)
    return C.params(model)


out = {"rank": rank}
if phase == "save":
    model, opt = build()
    train(model, opt, 0, TOTAL)
    out["uninterrupted"] = C.params(model)

    model, opt = build()
    train(model, opt, 0, SPLIT)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
               folder / f"rank{rank}.pt")
    gathered = opt.gathered_state_dict()
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": gathered}, folder / "gathered.pt")
    out["grace_keys"] = sorted(opt.state_dict()["grace"]["ranks"][rank]["memory"])
    hvd.barrier()
else:
    out["from_own_file"] = resume(folder / f"rank{rank}.pt")
    out["from_gathered"] = resume(folder / "gathered.pt")
    out["without_grace_state"] = resume(folder / f"rank{rank}.pt", keep_grace=False)
    model, opt = build()
    try:
        opt.load_state_dict(torch.load(folder / "rank0.pt", weights_only=True)["opt"])
        out["other_rank_file"] = "no error"
    except ValueError as err:
        out["other_rank_file"] = str(err)
mp.report(out)
