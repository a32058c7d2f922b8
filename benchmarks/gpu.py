"""grace_dl on a GPU: the compressor table and the DDP step table, measured in one run.

    python -m benchmarks.gpu compressors --out DIR   # every method, 16M and 64M fp32 elements
    python -m benchmarks.gpu steps --out DIR         # DDP step of ResNet-50 and a 110M decoder
    python -m benchmarks.gpu all --out DIR           # both
    make bench-gpu                                   # all, into benchmarks/results/

**Compressors.** For each built-in method on a CUDA tensor of standard normal fp32 values:
the bits per element its payload has on the wire, and the median time per call of compress
and of decompress through grace_dl's path for the device (``Paths(compressor).on(x)``: the
speed path of ``grace_dl.torch.device`` where there is one), in blocks of back-to-back calls
between CUDA events (``per_call``: the host issues while the device runs, as a training step
issues bucket after bucket; a call that reads a size back waits there). The sum is divided
by a device memcpy of the tensor (``x memcpy``) and by the same method written the textbook
way in plain torch (``benchmarks/gpu_textbook.py``: ``x textbook``, below 1 where grace_dl is
faster), all timed the same way, alternately in the same run. ``latency`` is one compress and
one decompress on an idle device: the host's time to issue them plus the device's.

**Steps.** One process, one GPU, ``torch.distributed`` on NCCL at world size 1 (the
collectives move nothing, so a step minus DDP's own step is what the pipeline's compression,
decompression and bookkeeping cost), bf16 autocast, SGD: torchvision's ResNet-50 at batch 64
(224 x 224) and a GPT-2-small-sized decoder (12 layers, width 768, 32000-token vocabulary,
about 110M parameters) on 8 x 512 tokens. Rows: DDP without a hook, PyTorch's
``fp16_compress_hook`` and ``powerSGD_hook`` (rank 4), and grace_dl's DDP hook with each
pipeline. ``overhead`` is the step minus DDP's; ``pays below`` is the link speed under which
sending 32-bit gradients (2 x their bits per step, a ring allreduce's traffic) takes longer
than that overhead, i.e. the fastest link on which the pipeline can pay at all.

Each table is a run in ``gpu_<table>.json`` (``benchmarks/records.py``'s format: the machine,
versions, commit and command with the rows), in the scratch folder unless ``--out`` names one;
``python -m benchmarks.report`` renders the committed ones into ``docs/benchmarks.md``.
``--device cpu`` runs the same code on small CPU tensors under ``emulate_device()`` (a dry run
of the script; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_textbook, records  # noqa: E402
from grace_dl.collectives import check_lengths, cut_parts  # noqa: E402
from grace_dl.compressors.base import Call  # noqa: E402
from grace_dl.compressors.paths import Paths  # noqa: E402
from grace_dl.registry import lookup  # noqa: E402

PARAMS = {"topk": {"compress_ratio": 0.01}, "randomk": {"compress_ratio": 0.01},
          "dgc": {"compress_ratio": 0.01}, "adaq": {"compress_ratio": 0.01},
          "threshold": {"threshold": gpu_textbook.THRESHOLD}}
QUANTIZERS = ("fp16", "bf16", "qsgd", "terngrad", "natural", "u8bit", "onebit", "signsgd",
              "signum", "efsignsgd", "sketch", "inceptionn")
SPARSIFIERS = ("topk", "randomk", "dgc", "threshold", "adaq")
METHODS = ("none", *QUANTIZERS, *SPARSIFIERS, "powersgd")
SIZES = {"16M": 1 << 24, "64M": 1 << 26}
CPU_SIZES = {"64K": 1 << 16}

#: grace pipelines of the step table (``grace_from_params`` dicts)
PIPELINES = {
    "grace none": {"compressor": "none", "memory": "none", "communicator": "allreduce"},
    "grace fp16": {"compressor": "fp16", "memory": "none", "communicator": "allreduce"},
    "grace topk 1% + residual": {"compressor": "topk", "compress_ratio": 0.01,
                                 "memory": "residual", "communicator": "allgather"},
    "grace randomk 1% + residual": {"compressor": "randomk", "compress_ratio": 0.01,
                                    "memory": "residual", "communicator": "allreduce"},
    "grace qsgd two-phase": {"compressor": "qsgd", "memory": "residual",
                             "communicator": "twophase"},
    "grace terngrad": {"compressor": "terngrad", "memory": "none", "communicator": "allgather"},
    "grace signsgd two-phase": {"compressor": "signsgd", "memory": "residual",
                                "communicator": "twophase"},
    "grace PowerSGD rank 4": {"compressor": "powersgd", "compress_rank": 4,
                              "memory": "powersgd", "communicator": "allreduce"},
}
#: the step table's rows of a pipeline with its buckets cut in 4 MiB pieces, as the hook's
#: ``piece_bytes="auto"`` does on a CPU (on a GPU it sends them whole): what "auto" buys there
PIECED = {"grace fp16, 4 MiB pieces": "grace fp16",
          "grace qsgd two-phase, 4 MiB pieces": "grace qsgd two-phase"}
#: rows of a pipeline whose buckets the hook completes together when DDP hands over the last
#: one, as it does on gloo (on NCCL it completes each in its own hook call): what that buys
TOGETHER = {"grace fp16, buckets completed together": "grace fp16",
            "grace qsgd two-phase, buckets completed together": "grace qsgd two-phase"}
#: a row of grace's PowerSGD sent tensor by tensor through the send path (fused per bucket):
#: the composition the hook's bucket path (``grace_dl.torch.ddp_powersgd``) replaces
PER_TENSOR = {"grace PowerSGD rank 4, per-tensor sends": "grace PowerSGD rank 4"}
#: a row of a pipeline whose buckets the hook completes one by one on the backward pass's own
#: stream, not on its side stream (``GraceState._side_stream``): what the side stream costs or
#: buys (at world size 1 its collectives are nearly free; the overlap it keeps shows on more)
ON_CURRENT = {"grace topk 1% + residual, on the backward pass's stream":
              "grace topk 1% + residual"}
#: every row that runs another row's pipeline with other hook options -> that row
VARIANTS = {**PIECED, **TOGETHER, **PER_TENSOR, **ON_CURRENT}


# ------------------------------------------------------------------ timing
class Clock:
    """Elapsed device time of a callable, with CUDA events (wall time on a CPU)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), out
        t0 = time.perf_counter()
        out = fn()
        return 1e3 * (time.perf_counter() - t0), out


def _machine(device) -> str:
    """The GPU (or the dry run's CPU) and the versions that shape a measurement, in one line."""
    parts = [platform.platform(), f"Python {platform.python_version()}",
             f"torch {torch.__version__}"]
    if device.type == "cuda":
        try:
            import triton
            parts.append(f"Triton {triton.__version__}")
        except ImportError:
            parts.append("no Triton")
        return f"{torch.cuda.get_device_name(device)}; " + "; ".join(parts)
    return "CPU dry run under emulate_device (numbers mean nothing); " + "; ".join(parts)


def _commit() -> str:
    """GRACE_DL_COMMIT: the commit whose tree was copied to a lent machine (its own checkout's
    git may say another); else this checkout's."""
    return os.environ.get("GRACE_DL_COMMIT") or records.commit()


ABOUT = {
    "compressors": "Compress + decompress of standard normal fp32 on one GPU through grace_dl's "
                   "path for the device (`Paths(compressor).on(x)`; `path` names it): ms per "
                   "call in blocks of 10 back-to-back calls between CUDA events (the host "
                   "issuing while the device runs, as in a training step), medians, grace_dl "
                   "and the textbook torch version of the method (`benchmarks/gpu_textbook.py`) "
                   "alternating, the memcpy timed the same way. x memcpy: over one device copy "
                   "of the tensor; x textbook: over the textbook version, below 1 where grace_dl "
                   "is faster; latency: one compress and one decompress on an idle device (the "
                   "host's time to issue them and the device's, added). Compress is called as "
                   "the gathering communicators call it (`Call.exchanges_sizes`): a payload "
                   "whose size depends on the data and whose path can leave it to the exchange "
                   "of sizes (signSGD's, Signum's) is not cut here; its bits are what is sent "
                   "of it (the path's `sent_lengths`).",
    "steps": "One GPU, NCCL at world size 1 (the collectives move nothing: a step minus DDP's "
             "is the pipeline's own cost), bf16 autocast, SGD; the median of the timed steps "
             "after 5 warm-ups. overhead: the step minus DDP's; pays below: the link speed "
             "under which a step's 32-bit gradient traffic (2 x its bits) takes longer than "
             "that overhead.",
}
TITLES = {"compressors": "Compressors on a GPU", "steps": "DDP steps on a GPU"}
COLUMNS = {
    "compressors": ["size", "method", "path", "bits_per_element", "compress_ms",
                    "decompress_ms", "textbook_ms", "memcpy_ms", "x_memcpy", "x_textbook",
                    "latency_ms"],
    "steps": ["model", "pipeline", "step_ms", "x_ddp", "overhead_ms", "pays_below_gbit"],
}


def _write(out_dir: Path, table: str, device, command: str, rows: list) -> None:
    """Add this run to ``<out_dir>/gpu_<table>.json`` (``benchmarks/records.py``'s format)."""
    run = {"id": f"{_commit()}-{device.type}", "machine": _machine(device), "commit": _commit(),
           "when": records.now(), "command": command, "records": rows}
    records.record_run(Path(out_dir) / f"gpu_{table}.json", f"gpu_{table}", TITLES[table], run,
                       about=ABOUT[table], columns=COLUMNS[table])
    print(f"wrote {Path(out_dir) / f'gpu_{table}.json'}", flush=True)


# ------------------------------------------------------------------ compressors
#: how the gathering communicators (allgather, two-phase) call a compression: the exchange of
#: sizes that a payload of data-dependent size needs is theirs
GATHERED = Call(exchanges_sizes=True)


def _grace_pair(name, x):
    """(compress, decompress) through grace_dl's path for ``x``'s device, the bytes sent of
    the payload, the path's name, and ``sent(pc)``: a compress's ``(payload, ctx)`` as it is
    sent, each part cut to its ``sent_lengths`` (a read of them: outside the timed calls;
    what a receiver decompresses)."""
    compressor = lookup("compressor", name)(**PARAMS.get(name, {}))
    path = Paths(compressor).on(x)
    tensor = x.view(int(math.isqrt(x.numel())), -1) if name == "powersgd" else x

    def compress():
        payload, ctx = path.compress(tensor, "w", GATHERED)
        if name == "powersgd":      # world size 1: the reduced P is this rank's own
            payload, ctx = compressor.next_round(payload, ctx)
        return payload, ctx

    def decompress(pc):
        return path.decompress(*pc)

    def sent(pc):
        lengths = path.sent_lengths(*pc)
        if lengths is None:
            return pc
        flat = [p.reshape(-1) for p in pc[0]]
        check_lengths(lengths, flat)
        return cut_parts(flat, lengths.tolist()), pc[1]

    payload, _ = sent(compress())
    nbytes = sum(p.numel() * p.element_size() for p in payload)
    if name == "powersgd":
        nbytes *= 2    # P and Q: both rounds
    return compress, decompress, nbytes, type(path).__name__, sent


#: calls of one timed block: back to back, the host issuing while the device runs
CALLS = 10


def per_call(clock, fn, calls: int = CALLS):
    """``(ms per call, last result)`` of ``calls`` back-to-back calls of ``fn`` in one timed
    block: a step's cost where the host runs ahead of the device (as in training, where the
    next bucket's work is issued while this one's runs), the larger of the host's time to
    issue a call and the device's to run it."""
    def block():
        out = None
        for _ in range(calls):
            out = fn()
        return out
    ms, out = clock(block)
    return ms / calls, out


def _time_method(clock, x, name, repeats: int) -> dict:
    """One method's row: grace_dl's compress and decompress and the textbook version's, each
    per call in a block of back-to-back calls, grace_dl and the textbook alternating (the
    first round a warm-up); and grace_dl's latency: one compress and one decompress on an
    idle device, the host's time and the device's added."""
    compress, decompress, nbytes, path, sent = _grace_pair(name, x)
    t_compress, t_decompress = gpu_textbook.METHODS[name]()
    comp_ms, dec_ms, book_ms, latency_ms = [], [], [], []
    for rep in range(repeats + 1):
        c, pc = per_call(clock, compress)
        pc = sent(pc)       # (what a receiver decompresses)
        d, _ = per_call(clock, lambda: decompress(pc))  # noqa: B023  (called at once)
        b1, payload = per_call(clock, lambda: t_compress(x))
        b2, _ = per_call(clock, lambda: t_decompress(x, payload))  # noqa: B023
        lc, pc = clock(compress)
        pc = sent(pc)
        ld, _ = clock(lambda: decompress(pc))  # noqa: B023
        if rep:
            comp_ms.append(c)
            dec_ms.append(d)
            book_ms.append(b1 + b2)
            latency_ms.append(lc + ld)
    return {"method": name, "path": path, "bits_per_element": 8 * nbytes / x.numel(),
            "compress_ms": statistics.median(comp_ms), "decompress_ms": statistics.median(dec_ms),
            "textbook_ms": statistics.median(book_ms),
            "latency_ms": statistics.median(latency_ms)}


def compressor_table(device, sizes, repeats: int) -> dict:
    clock = Clock(device)
    rows = []
    for label, n in sizes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(n, device=device, generator=gen)
        # (a CUDA normal draw holds an exact zero in about one of 2**24 values: the sign
        # methods would send their zero plane for that alone)
        x = torch.where(x == 0, torch.full_like(x, 1e-30), x)
        into = torch.empty_like(x)
        memcpy = statistics.median(per_call(clock, lambda: into.copy_(x))[0]  # noqa: B023
                                   for _ in range(repeats + 2))
        for name in METHODS:
            row = {"size": label, "numel": n}
            try:
                row.update(_time_method(clock, x, name, repeats), memcpy_ms=memcpy)
                total = row["compress_ms"] + row["decompress_ms"]
                row["x_memcpy"] = total / memcpy
                row["x_textbook"] = total / row["textbook_ms"] if name != "none" else None
            except Exception as err:  # noqa: BLE001  (a method that fails is reported)
                row.update(method=name, error=repr(err)[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ steps
class Decoder(torch.nn.Module):
    """A GPT-2-small-sized decoder: ``layers`` pre-norm blocks of causal self-attention and a
    4x MLP, tied input and output embeddings."""

    def __init__(self, vocab=32000, width=768, layers=12, heads=12, context=512):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, tokens):
        h = self.embed(tokens) + self.position(torch.arange(tokens.shape[1],
                                                            device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.norm(h) @ self.embed.weight.t()


class _Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, h):
        b, t, w = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return h + self.mlp(self.norm2(h))


def _model(kind, device, small: bool):
    if kind == "resnet50":
        import torchvision
        net = torchvision.models.resnet18() if small else torchvision.models.resnet50()
        batch = (torch.randn(4 if small else 64, 3, 64 if small else 224, 64 if small else 224,
                             device=device), torch.randint(0, 1000, (4 if small else 64,),
                                                           device=device))

        def loss(model):
            return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    else:
        net = Decoder(vocab=1000, width=64, layers=2, heads=4, context=64) if small \
            else Decoder()
        tokens = torch.randint(0, 1000 if small else 32000, (2 if small else 8,
                                                             64 if small else 512),
                               device=device)

        def loss(model):
            logits = model(tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     tokens[:, 1:].reshape(-1))
    return net.to(device), loss


def _hooked(label, model, device):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from grace_dl import grace_from_params
    from grace_dl.torch import ddp as grace_ddp
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    if label == "PyTorch fp16_compress_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif label == "PyTorch powerSGD_hook rank 4":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif label in PIPELINES or label in VARIANTS:
        from grace_dl.communicators.pieces import AUTO, DEFAULT_PIECE_BYTES

        grace = grace_from_params(dict(PIPELINES[VARIANTS.get(label, label)]))
        state = grace_ddp.GraceState(
            grace, piece_bytes=DEFAULT_PIECE_BYTES if label in PIECED else AUTO)
        if label in TOGETHER:
            state._per_bucket = False       # (the hook's own choice on gloo)
        if label in PER_TENSOR:
            state._powersgd = None          # (the reference composition)
        if label in ON_CURRENT:
            state._per_bucket = device.type == "cuda"      # (as on NCCL, without the side
            state._side_stream = lambda buffer: None        # stream)
        ddp.register_comm_hook(state, grace_ddp.comm_hook)
    return ddp


def step_table(device, models, steps: int, small: bool) -> dict:
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method="tcp://127.0.0.1:29731", rank=0, world_size=1)
    labels = ["DDP", "PyTorch fp16_compress_hook", "PyTorch powerSGD_hook rank 4",
              *PIPELINES, *VARIANTS]
    rows = []
    for kind in models:
        params = None
        for label in labels:
            try:
                torch.manual_seed(0)
                net, loss_of = _model(kind, device, small)
                params = sum(p.numel() for p in net.parameters())
                ddp = _hooked(label, net, device)
                opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
                times = []
                for i in range(steps + 5):
                    t0 = time.perf_counter()
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        loss = loss_of(ddp)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    if i >= 5:
                        times.append(1e3 * (time.perf_counter() - t0))
                row = {"model": kind, "pipeline": label, "params": params,
                       "step_ms": statistics.median(times), "fastest_ms": min(times),
                       "slowest_ms": max(times), "finite": bool(torch.isfinite(loss).item())}
            except Exception as err:  # noqa: BLE001
                row = {"model": kind, "pipeline": label, "error": repr(err)[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            ddp = net = opt = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        base = next((r["step_ms"] for r in rows if r["model"] == kind and r["pipeline"] == "DDP"
                     and "step_ms" in r), None)
        for r in rows:
            if r["model"] == kind and "step_ms" in r and base:
                r["overhead_ms"] = r["step_ms"] - base
                r["x_ddp"] = r["step_ms"] / base
                over = r["overhead_ms"] / 1e3
                r["pays_below_gbit"] = (2 * 32 * r["params"] / over / 1e9) if over > 0 \
                    else None
    return rows


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("compressors", "steps", "all"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of the results files (default: the scratch folder, "
                             "benchmarks.records.scratch_dir(); make bench-gpu passes "
                             "benchmarks/results)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=["resnet50", "gpt"],
                        choices=("resnet50", "gpt"))
    args = parser.parse_args(argv)
    out = args.out or records.scratch_dir()
    command = "python -m benchmarks.gpu " + " ".join(argv if argv is not None else sys.argv[1:])
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    from grace_dl.torch.kernels import emulate_device
    with emulate_device() if device.type == "cpu" else contextlib.nullcontext():
        if args.what in ("compressors", "all"):
            sizes = SIZES if device.type == "cuda" else CPU_SIZES
            _write(out, "compressors", device, command,
                   compressor_table(device, sizes, args.repeats))
        if args.what in ("steps", "all"):
            _write(out, "steps", device, command,
                   step_table(device, args.models, args.steps, small=device.type == "cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
