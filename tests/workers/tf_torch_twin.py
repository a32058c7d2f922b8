"""The torch half of the TF/torch comparison: feed the gradients a TensorFlow run recorded
(per rank, per step, per tensor name) through a torch grace object built from the same params,
under horovod.torch, and report what it returns.

    tf_torch_twin.py INPUT.pkl      INPUT: {"params": {...}, "names": [...],
                                            "local": [rank][step][tensor] arrays}
"""

import pickle
import sys

import horovod.torch as hvd
import numpy as np
import torch

import mp
from grace_dl import grace_from_params

hvd.init()
rank = hvd.rank()
with open(sys.argv[1], "rb") as f:
    spec = pickle.load(f)
grc = grace_from_params(dict(spec["params"]))
reduced = []
for step in spec["local"][rank]:
    handles = [grc.send(torch.from_numpy(np.array(g)), name, "average")
               for name, g in zip(spec["names"], step)]
    reduced.append([grc.receive(h).numpy() for h in handles])
    grc.end_step()
mp.report({"rank": rank, "reduced": reduced, "bytes_steps": [s["sent"] for s in grc.bytes.steps]})
