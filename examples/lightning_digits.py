"""PyTorch Lightning with grace's DDP communication hook: digits, 2 processes.

    torchrun --nproc-per-node 2 examples/lightning_digits.py --compressor topk

Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers the hook only when
the model is on CUDA; on CPU it is silently not used (the byte counters stay at 0). The
``GraceHook`` callback below covers both: it registers the hook on the DDP-wrapped model
(``trainer.strategy.model``) at the start of fit unless Lightning already did. On GPUs, passing
the state and hook to ``DDPStrategy`` alone is enough.

Prints, on rank 0, the final accuracy and the bytes grace sent; ``--out FILE`` also writes them
with a checksum of the parameters, per rank (``FILE.<rank>``).
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from grace_dl import grace_from_params
from grace_dl.torch import ddp as grace_ddp

PARAMS = {"topk": {"compressor": "topk", "memory": "residual", "communicator": "allgather",
                   "compress_ratio": 0.05},
          "qsgd": {"compressor": "qsgd", "memory": "residual", "communicator": "twophase",
                   "quantum_num": 64},
          "none": {"compressor": "none", "memory": "none", "communicator": "allreduce"}}


class GraceHook(L.Callback):
    """Registers grace's DDP hook on the wrapped model where Lightning did not (CPU)."""

    def __init__(self, state: grace_ddp.GraceState):
        self.state = state

    def on_fit_start(self, trainer, pl_module):
        strategy = trainer.strategy
        if strategy.root_device.type == "cuda" and getattr(strategy, "_ddp_comm_hook", None):
            return                       # DDPStrategy registered it (CUDA only)
        strategy.model.register_comm_hook(self.state, grace_ddp.comm_hook)


class Digits(L.LightningModule):
    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 10))
        self.lr = lr

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def data():
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    return x, torch.tensor(y)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compressor", choices=sorted(PARAMS), default="topk")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-callback", dest="callback", action="store_false",
                    help="rely on DDPStrategy alone (on CPU the hook then goes unused)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    state = grace_ddp.GraceState(grace_from_params(PARAMS[args.compressor]))
    strategy = DDPStrategy(process_group_backend="gloo" if not torch.cuda.is_available()
                           else "nccl", ddp_comm_state=state,
                           ddp_comm_hook=grace_ddp.comm_hook)
    callbacks = [GraceHook(state)] if args.callback else []
    # under torchrun: one process per device, as many as torchrun started on this node
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = L.Trainer(accelerator="auto", devices=local,
                        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
                        strategy=strategy,
                        max_epochs=args.epochs, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    x, y = data()
    train = TensorDataset(x, y)
    loader = DataLoader(train, batch_size=32, shuffle=True)   # Lightning shards it per rank
    model = Digits()
    trainer.fit(model, loader)
    with torch.no_grad():
        accuracy = (model.net(x).argmax(1) == y).float().mean().item()
    total = state.grace.bytes.total
    result = {"rank": trainer.global_rank, "accuracy": accuracy, "steps": total["steps"],
              "sent_bytes": total["sent"],
              "checksum": float(sum(p.detach().double().sum() for p in model.parameters()))}
    if trainer.global_rank == 0:
        print(f"{args.compressor}: accuracy {accuracy:.3f}; grace sent {total['sent']} bytes "
              f"in {total['steps']} steps")
    if args.out:
        with open(f"{args.out}.{trainer.global_rank}", "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
