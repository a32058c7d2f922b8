"""One end-to-end benchmark run, executed on every rank (launched by benchmarks/e2e.py).

Trains a synthetic-data model for ``--steps`` steps after ``--warmup`` steps with one pipeline
and writes, on rank 0, a JSON record: median step time, bytes this rank sent and received per
step (from the communicator's counters; for Horovod's own paths, the tensor sizes that
Horovod's ring allreduce moves), and the time split:

- compute: forward + backward with no communication, timed in the same process beforehand;
- compress: compress + decompress of every gradient through the pipeline's compressor, timed
  locally (no collectives);
- communicate: step time − compute − compress (what the network and the collectives cost,
  minus what overlapped with the backward pass);
- predicted: the step model's time for this pipeline (``grace_dl.strategy.step_model``, from the
  measurement ``GRACE_BENCH_CALIBRATION`` names, the job's own on this link) with this run's
  compute time (averaged over the ranks, so every rank's Auto decides the same) plus the
  optimizer's own update, timed alone.

Models (``--model``; synthetic inputs from ``torch.randn``, labels from ``torch.randint``, no
downloads). Tensors = gradient tensors, i.e. one collective or one compression call each
without fusion; compute = forward + backward at batch 32 on one thread, one process alone on
this 2-core machine (median of 5). Two ranks sharing the cores measure several times more (the
committed e2e run: mlp 45-80 ms, cnn 870-1260 ms), so compare models by their ratio here:

| model | input | parameters | tensors | fp32 MB | compute |
|---|---|---:|---:|---:|---:|
| ``tiny`` | 1x8x8 | 19K | 4 | 0.08 | < 1 ms |
| ``mlp`` | 1x28x28 | 5.8M | 6 | 23.3 | ~11 ms |
| ``cnn`` | 3x32x32 | 2.5M | 10 | 10.0 | ~205 ms |
| ``resnet18`` | 3x32x32 | 11.2M | 62 | 44.7 | ~270 ms |
| ``transformer`` | 3x32x32 | 6.4M | 103 | 25.5 | ~185 ms |

``resnet18`` is ResNet-18 (He et al. 2016: basic blocks [2, 2, 2, 2], widths 64-512, batch norm
after every convolution, 1x1 projection shortcuts) with a 3x3 stride-2 stem and no max-pool for
32x32 inputs and a 10-way head: 60 convolution and batch-norm tensors plus the head. Batch norm
makes it realistic for compression too: the 40 small affine tensors (64-512 elements) cost a
collective each and save almost nothing. ``transformer`` is a small ViT-style encoder: 8x8
patches (16 tokens) embedded to width 256, learned positions, 8 pre-norm encoder layers (8
heads, feed-forward 1024; 12 tensors each: fused QKV, output projection, two feed-forward
layers, two layer norms, with biases), a final layer norm, mean pooling, a linear head.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn

import grace_dl.torch.horovod as hvd
from benchmarks.pipelines import PIPELINES, VARIANTS, kernels_on, make_grace, predict_step
from grace_dl import native
from grace_dl.compressors.base import LOCAL
from grace_dl.strategy.dispatcher import StrategyDispatcher

MODELS = ("tiny", "mlp", "cnn", "resnet18", "transformer")


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv + batch norm, identity or 1x1 projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18(classes: int = 10) -> nn.Module:
    layers, cin = [nn.Conv2d(3, 64, 3, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()], 64
    for stage, width in enumerate((64, 128, 256, 512)):
        for block in range(2):
            layers.append(BasicBlock(cin, width, 2 if block == 0 and stage > 0 else 1))
            cin = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


class PatchTransformer(nn.Module):
    """A ViT-style encoder classifier over 3x32x32 inputs (see the module docstring)."""

    def __init__(self, width: int = 256, depth: int = 8, heads: int = 8, ff: int = 1024,
                 patch: int = 8, image: int = 32, classes: int = 10):
        super().__init__()
        self.embed = nn.Conv2d(3, width, patch, patch)
        self.pos = nn.Parameter(0.02 * torch.randn(1, (image // patch) ** 2, width))
        layer = nn.TransformerEncoderLayer(width, heads, ff, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, norm=nn.LayerNorm(width),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        tokens = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.encoder(tokens).mean(1))


def build_model(kind: str) -> tuple[nn.Module, tuple]:
    """One of ``MODELS`` (the table above), with the shape of one input sample."""
    if kind == "tiny":  # quick mode / smoke test
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), (
            1, 8, 8)
    if kind == "mlp":  # 5.8M parameters
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(),
                             nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)), (1, 28, 28)
    if kind == "cnn":  # 2.5M parameters, most in conv kernels
        return nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(256, 512, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(512, 256, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(256, 10)), (3, 32, 32)
    if kind == "resnet18":  # 11.2M parameters in 62 tensors
        return resnet18(), (3, 32, 32)
    if kind == "transformer":  # 6.4M parameters in 103 tensors
        return PatchTransformer(), (3, 32, 32)
    raise ValueError(f"model must be one of {', '.join(MODELS)}, got {kind!r}")


def time_compute(model, x, y, loss_fn, repeats: int, warmup: int = 3) -> float:
    """Median forward + backward after ``warmup`` untimed passes: the first passes allocate
    and fault in the activations and gradients: the MLP's first three took 24, 20 and 15 ms
    and the rest 13 ms (one process, this host); the median of five cold passes said 15."""
    times = []
    for i in range(warmup + repeats):
        model.zero_grad()
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_update(model, repeats: int) -> float:
    """The wrapped optimizer's own ``step()`` (SGD on every parameter), no communication."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_compress(grc, model, repeats: int, warmup: int = 1) -> float:
    """Median of ``repeats`` local replays of compress (+ later rounds) + decompress of every
    gradient, after ``warmup`` untimed ones (the first creates the compressor's state), each
    through the path training runs it on (the communicator's ``paths``: the CPU kernels, the
    device path)."""
    if grc is None:
        return 0.0
    grads = [(n, p.grad.detach().clone()) for n, p in model.named_parameters()]
    if isinstance(grc, StrategyDispatcher):  # each gradient's own pipeline
        comms = {n: grc.node(n).comm for n, _ in grads}
    else:
        comms = dict.fromkeys((n for n, _ in grads), grc)
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        for name, g in grads:
            comp, path = comms[name].compressor, comms[name].paths.on(g)
            payload, ctx = path.compress(g, "bench/" + name, LOCAL)
            reduced = payload
            # multi-round (PowerSGD): the local-only replay uses this rank's payloads as "reduced"
            nxt = comp.next_round(reduced, ctx)
            while nxt is not None:
                reduced, ctx = nxt
                nxt = comp.next_round(reduced, ctx)
            path.decompress(reduced, ctx)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--pipeline", default="none", choices=sorted([*PIPELINES, *VARIANTS]))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    native.use(kernels_on(args.pipeline))
    hvd.init()
    model, shape = build_model(args.model)
    x = torch.randn(args.batch, *shape)
    y = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()
    n_params = sum(p.numel() for p in model.parameters())

    compute_s = time_compute(model, x, y, loss_fn, repeats=9)
    update_s = time_update(model, repeats=5)
    # Every rank must build the same strategy: they share one (average) compute time.
    compute_s, update_s = hvd.allreduce(torch.tensor([compute_s, update_s], dtype=torch.float64),
                                        name="e2e.compute").tolist()
    grc, hvd_kwargs = make_grace(args.pipeline, model, compute_s=compute_s)
    predicted = predict_step(args.pipeline, model, compute_s=compute_s)
    compress_s = time_compress(grc, model, repeats=5)

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), grace=grc,
                                   **hvd_kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    step_times = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if step >= args.warmup:
            step_times.append(time.perf_counter() - t0)

    if grc is not None and getattr(grc, "bytes", None) is not None and grc.bytes.steps:
        measured = grc.bytes.steps[args.warmup:] or grc.bytes.steps
        sent = statistics.median(s["sent"] for s in measured)
        received = statistics.median(s["received"] for s in measured)
    else:
        # Horovod's own ring allreduce: each rank sends and receives 2(N-1)/N of the buffer.
        width = 2 if args.pipeline == "hvd-fp16" else 4
        size = hvd.size()
        sent = received = 2 * (size - 1) / size * n_params * width

    step_s = statistics.median(step_times)
    if hvd.rank() == 0:
        record = {
            "model": args.model, "pipeline": args.pipeline, "ranks": hvd.size(),
            "params": n_params, "step_s": step_s, "compute_s": compute_s,
            "compress_s": compress_s, "communicate_s": max(0.0, step_s - compute_s - compress_s),
            "update_s": update_s,
            "predicted_s": None if predicted is None else predicted + update_s,
            "sent_bytes": sent, "received_bytes": received, "steps": args.steps,
        }
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
