"""Hugging Face Accelerate with grace's DDP communication hook: digits, 2 processes.

    torchrun --nproc-per-node 2 examples/accelerate_digits.py --compressor topk

``accelerator.prepare(model)`` wraps the model in DDP when the job has several processes;
grace's hook is registered on that prepared model, before the first backward pass.
(``DistributedDataParallelKwargs(comm_hook=...)`` takes only PyTorch's built-in hooks.) On one
process ``prepare`` returns the model unwrapped and there is nothing to compress; without a GPU,
``Accelerator(cpu=True)`` (or ``ACCELERATE_USE_CPU=1``) is what makes the torchrun processes one
gloo job.

Prints, on rank 0, the final accuracy and the bytes grace sent; ``--out FILE`` also writes
them with a checksum of the parameters, per rank (``FILE.<rank>``).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from grace_dl import grace_from_params
from grace_dl.torch import ddp as grace_ddp

PARAMS = {"topk": {"compressor": "topk", "memory": "residual", "communicator": "allgather",
                   "compress_ratio": 0.05},
          "qsgd": {"compressor": "qsgd", "memory": "residual", "communicator": "twophase",
                   "quantum_num": 64}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compressor", choices=sorted(PARAMS), default="topk")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    # Without a GPU, Accelerate runs a multi-process CPU job only when told it is on CPU;
    # otherwise every torchrun process trains alone and prepare() wraps nothing.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = grace_ddp.GraceState(grace_from_params(PARAMS[args.compressor]))
    if isinstance(model, DistributedDataParallel):
        model.register_comm_hook(state, grace_ddp.comm_hook)
    for _ in range(args.epochs):
        for xb, yb in loader:
            opt.zero_grad()
            accelerator.backward(F.cross_entropy(model(xb), yb))
            opt.step()
    net = accelerator.unwrap_model(model)
    with torch.no_grad():
        accuracy = (net(x).argmax(1) == y).float().mean().item()
    total = state.grace.bytes.total
    rank = accelerator.process_index
    if accelerator.is_main_process:
        print(f"{args.compressor}: accuracy {accuracy:.3f}; grace sent {total['sent']} bytes "
              f"in {total['steps']} steps")
    if args.out:
        checksum = float(sum(p.detach().double().sum() for p in net.parameters()))
        with open(f"{args.out}.{rank}", "w") as f:
            json.dump({"rank": rank, "accuracy": accuracy, "steps": total["steps"],
                       "sent_bytes": total["sent"], "checksum": checksum}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
