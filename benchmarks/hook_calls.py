"""How many Python calls inside grace_dl one DDP hook step makes: what the hook costs the host.

    python -m benchmarks.hook_calls                                  # Markdown table on stdout
    python -m benchmarks.hook_calls --json                           # + results file, in the cache
    python -m benchmarks.hook_calls --json benchmarks/results/hook_calls.json   # the page's

On a GPU a bucket compresses in less time than one round of Python (docs DESIGN, *Pieces and
per-bucket Python*), so the host work of the hook is what bounds a step there; this counts it
on any machine, without a GPU and without timing noise.

For each pipeline (``benchmarks/pipelines.py``'s ``GRACE`` table, the one the DDP benchmarks
use) one process builds a small MLP (``--model small``: 64-128-128-10, 6 parameter tensors,
26k parameters) under ``DistributedDataParallel`` with **one bucket**
(``bucket_cap_mb_list=[100]``), registers grace_dl's hook (``grace_dl.torch.ddp``, default
options) on a single-process gloo group (world size 1, a ``HashStore``: no port), runs
``--warmup`` steps (the first step's agreement check, DDP's bucket rebuild and lazy imports are
not counted), then counts ``--steps`` steps one by one. A step is counted from the start of
``loss.backward()`` to its return, which is where DDP waits on the hook's future and copies its
result into ``.grad`` (the forward pass and the optimizer step are outside it); the hook runs
inside it, on whichever thread runs the backward pass (a thin wrapper installs the profiler
there too), and grace_dl's futures have no callbacks of their own. Counted are ``sys.setprofile``
``"call"`` events (Python frames entered: functions, comprehensions and each resumption of a
generator; not C functions) whose code lies in a file inside the ``grace_dl`` package, with the
garbage collector off so that no finaliser lands in a step at random. ``files`` is how many
distinct grace_dl files those calls are in. ``torch_ops`` is how many torch operations (ATen
operators, as a ``TorchDispatchMode`` sees them) the hook's call issues in that step: on a GPU
each is a launch whose host cost (10-20 us on the lent H100's host, docs DECISIONS) adds to the
step where the device waits for it. Counted on the path the tensors take (the CPU's here: its
compiled kernels are C calls, not torch operations; a pipeline with a Triton kernel on the GPU
issues fewer there); ``--path device`` counts the GPU's code instead, on CPU tensors
(``kernels.emulate_device`` with Triton's interpreter), and its Triton launches beside the
torch operations: what a GPU launches per step, measured without one.

The issue's targets (``TARGETS``: calls per step, and files) stand beside the counts; a
pipeline without a target has none yet. ``--model mlp5m`` counts the DDP benchmark's 5.8M
MLP instead (one 23 MB bucket, which quantizers send as 4 MiB pieces: more grace tensors).
``--model resnet50`` / ``decoder`` count a model of the GPU step table's networks' parameter
shapes (``Shapes``: no compute) in DDP's default buckets, and ``--pipelines pytorch-fp16
pytorch-powersgd`` count PyTorch's own hooks the same way (their torch operations; no
grace_dl calls): a GPU step's host work against PyTorch's, measured without a GPU.
*non-view ops* are the torch operations that are not views (a view makes a tensor header;
the others are kernels on a GPU).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import grace_dl
from benchmarks import records, tables
from benchmarks.pipelines import GRACE

PACKAGE = Path(grace_dl.__file__).resolve().parent
#: the pipelines counted by default, in the table's order
PIPELINES = ("none", "topk", "qsgd-2phase", "fp16", "randomk", "signsgd-2phase", "powersgd")
#: issue 42's targets per pipeline: (calls per step, distinct grace_dl files)
TARGETS = {"none": (40, 8), "topk": (100, 8), "qsgd-2phase": (200, 8)}
TOP = 10


#: PyTorch's own DDP hooks, counted as baselines beside grace's pipelines (no grace_dl calls)
BASELINES = ("pytorch-fp16", "pytorch-powersgd")
#: models of a real network's parameter shapes (``Shapes``), sent in DDP's default buckets
SHAPES = ("resnet50", "decoder")


def small_mlp() -> nn.Module:
    """benchmarks/ddp_worker.py's digits model: 6 parameter tensors, 26k parameters."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def resnet50_shapes() -> list[tuple]:
    """torchvision's ResNet-50 parameter shapes, in its registration order (161 tensors,
    25.6M parameters): convolutions, batch norms' weights and biases, the classifier."""
    shapes, width = [(64, 3, 7, 7), (64,), (64,)], 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            for out, inp, k in ((planes, width, 1), (planes, planes, 3), (4 * planes, planes, 1)):
                shapes += [(out, inp, k, k), (out,), (out,)]
            if b == 0:          # the projection shortcut
                shapes += [(4 * planes, width, 1, 1), (4 * planes,), (4 * planes,)]
            width = 4 * planes
    return shapes + [(1000, 2048), (1000,)]


def decoder_shapes() -> list[tuple]:
    """benchmarks/gpu.py's decoder (GPT-2-small-sized, 110M parameters) parameter shapes."""
    from benchmarks.gpu import Decoder

    with torch.device("meta"):
        return [tuple(p.shape) for p in Decoder().parameters()]


class Shapes(nn.Module):
    """Parameters of given shapes whose gradients are dense tensors of those shapes: what a
    DDP hook sees of a real network, without its compute (the logits are the inputs scaled
    by the sum of each parameter's first element)."""

    def __init__(self, shapes):
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.full(s, 0.01)) for s in shapes)

    def forward(self, x):
        return x[:, :10] * sum(p.reshape(-1)[0] for p in self.params)


def _models():
    from benchmarks.ddp_worker import mlp_5m

    return {"small": (small_mlp, (64,)), "mlp5m": (mlp_5m, (1, 28, 28)),
            "resnet50": (lambda: Shapes(resnet50_shapes()), (64,)),
            "decoder": (lambda: Shapes(decoder_shapes()), (64,))}


def _baseline(pipeline: str):
    """(hook, state) of one of PyTorch's DDP hooks (``BASELINES``): its fp16 hook, or its
    PowerSGD hook at the rank of ``GRACE["powersgd"]``, compressing from its third step on
    (error feedback and warm start on, as grace's). The hook runs with every allreduce
    waited for before it returns (``_completed``), so that its futures' callbacks run on the
    hook's thread and are counted (at world size 1 the wait costs nothing)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if pipeline == "pytorch-fp16":
        hook, state = default_hooks.fp16_compress_hook, None
    else:
        hook = powerSGD_hook.powerSGD_hook
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=GRACE["powersgd"]["compress_rank"],
            start_powerSGD_iter=2, min_compression_rate=2)

    def completed(state, bucket):
        with _completed():
            return hook(state, bucket)
    return completed, state


@contextlib.contextmanager
def _completed():
    """``dist.all_reduce`` waits for its work before returning it (a completed future's
    ``then`` runs its callback at once, on the calling thread)."""
    all_reduce = dist.all_reduce

    def waited(*args, **kwargs):
        work = all_reduce(*args, **kwargs)
        if work is not None:
            work.wait()
        return work

    dist.all_reduce = waited
    try:
        yield
    finally:
        dist.all_reduce = all_reduce


class CallCounter:
    """``sys.setprofile`` ``"call"`` events by code object while active (``with counter:``);
    ``grace_calls()`` keeps those whose file is inside ``root`` (the grace_dl package)."""

    def __init__(self, root: Path = PACKAGE):
        self.prefix = str(Path(root).resolve()) + os.sep
        self.codes: collections.Counter = collections.Counter()
        self.threads: set[int] = set()
        self.active = False
        self.profile = self._profile        # one bound method: sys.getprofile() compares it

    def _profile(self, frame, event, arg):
        if event == "call":
            self.codes[frame.f_code] += 1

    def cover_this_thread(self):
        """A context that profiles the current thread too while the counter is active (the
        hook may run on an autograd worker thread, which ``sys.setprofile`` did not reach)."""
        if not self.active or sys.getprofile() is self.profile:
            return contextlib.nullcontext()
        self.threads.add(threading.get_ident())

        @contextlib.contextmanager
        def covered():
            before = sys.getprofile()
            sys.setprofile(self.profile)
            try:
                yield
            finally:
                sys.setprofile(before)
        return covered()

    def __enter__(self):
        self.codes.clear()
        self.threads = {threading.get_ident()}
        self._gc = gc.isenabled()
        gc.disable()
        self.active = True
        self._before = sys.getprofile(), threading.getprofile()
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._before[0])
        threading.setprofile(self._before[1])
        self.active = False
        if self._gc:
            gc.enable()

    def inside(self, code) -> bool:
        name = code.co_filename
        return not name.startswith("<") and os.path.realpath(name).startswith(self.prefix)

    def grace_calls(self) -> dict:
        """``{(file relative to the package, first line, qualified name): calls}``."""
        out: dict = {}
        for code, n in self.codes.items():
            if self.inside(code):
                rel = os.path.relpath(os.path.realpath(code.co_filename), self.prefix)
                key = (rel, code.co_firstlineno, getattr(code, "co_qualname", code.co_name))
                out[key] = out.get(key, 0) + n
        return out


class OpCounter(TorchDispatchMode):
    """Torch operations dispatched while active (``with counter:``, on this thread), and the
    Triton kernels launched meanwhile (``kernels``: only where ``launches_counted`` watches
    them, on the device path; a launch's own torch operations are not counted)."""

    _current = None

    def __init__(self, sites: list | None = None):
        super().__init__()
        self.ops = 0
        self.views = 0          # of ``ops``: views (no kernel: a new tensor header)
        self.kernels = 0
        #: with a list: each operation and launch, in order, with the grace_dl line issuing it
        self.sites = sites

    def __enter__(self):
        OpCounter._current = self
        return super().__enter__()

    def __exit__(self, *exc):
        OpCounter._current = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.views += func.is_view
        if self.sites is not None:
            self.sites.append((func.overloadpacket.__name__ + (" (view)" if func.is_view else ""),
                               issued_by()))
        return func(*args, **(kwargs or {}))


def issued_by() -> str:
    """The innermost grace_dl frame of the calling stack, as ``file:line function`` (``?``
    where none is: DDP's or torch's own work)."""
    frame = sys._getframe(2)
    prefix = str(PACKAGE) + os.sep
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(prefix):
            return f"{path[len(prefix):]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


@contextlib.contextmanager
def launches_counted(kind):
    """Each launch of a Triton kernel of class ``kind`` (``JITFunction`` on a GPU,
    ``InterpretedFunction`` in Triton's interpreter) counted as one kernel by the
    ``OpCounter`` active at the time; what the launch runs on the host (the interpreter's
    kernel body and copies, the JIT's launcher) is not counted as calls or operations."""
    run = kind.run

    def counted(self, *args, **kwargs):
        counter = OpCounter._current
        if counter is None:
            return run(self, *args, **kwargs)
        ops, profile = counter.ops, sys.getprofile()
        sites = counter.sites
        before = None if sites is None else len(sites)
        sys.setprofile(None)
        try:
            return run(self, *args, **kwargs)
        finally:
            sys.setprofile(profile)
            counter.ops, counter.kernels = ops, counter.kernels + 1
            if sites is not None:
                del sites[before:]
                fn = getattr(self, "fn", None)
                sites.append((f"Triton {getattr(fn, '__name__', 'kernel')}", issued_by()))

    kind.run = counted
    try:
        yield
    finally:
        kind.run = run


@contextlib.contextmanager
def device_path():
    """The device path on CPU tensors, as on a GPU: ``kernels.emulate_device()`` with the
    Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1``, set for this process),
    their launches counted (``launches_counted``)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:     # its own jit'd helpers are compiled, not interpreted
            raise RuntimeError("the device path's count needs Triton's interpreter, which "
                               "Triton sets up when imported: start Python with "
                               "TRITON_INTERPRET=1 (Triton was imported without it)")
        os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    from grace_dl.torch import kernels

    with launches_counted(InterpretedFunction), kernels.emulate_device():
        yield


def _process_group(device: str = "cpu"):
    """Start a single-process group (gloo; NCCL for ``device`` cuda) unless a group exists
    (then it is used); whether this started one (and should destroy it)."""
    if dist.is_initialized():
        return False
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                            store=dist.HashStore())
    return True


PATHS = ("cpu", "device")


def count(pipeline: str, warmup: int = 3, steps: int = 3, model: str = "small",
          batch: int = 32, device: str = "cpu", path: str = "cpu", where: bool = False) -> dict:
    """One pipeline's record: grace_dl calls and files per counted step, and where they go.
    ``path``: "cpu" (the path CPU tensors take) or "device" (``device_path``: the GPU's code
    on CPU tensors, Triton kernels interpreted and counted). ``where``: the record also lists
    the last step's torch operations and Triton launches in order, each with the grace_dl
    line that issued it (``sites``)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path == "device":
        counting = device_path()
    elif device == "cuda":      # the device path itself: its compiled kernels counted
        from triton.runtime.jit import JITFunction

        counting, path = launches_counted(JITFunction), "device"
    else:
        counting = contextlib.nullcontext()
    with counting:
        return {**_count(pipeline, warmup, steps, model, batch, device, where), "path": path}


def _count(pipeline, warmup, steps, model, batch, device, where=False) -> dict:
    from grace_dl import grace_from_params
    from grace_dl.torch import ddp as grace_ddp

    if pipeline not in GRACE and pipeline not in BASELINES:
        raise ValueError(f"pipeline must be one of {sorted(GRACE) + list(BASELINES)}, got "
                         f"{pipeline!r}")
    build, shape = _models()[model]
    created = _process_group(device)
    try:
        torch.manual_seed(0)
        # one bucket; a real network's shapes in DDP's default buckets, as on a GPU
        net = DDP(build().to(device), **({} if model in SHAPES else {"bucket_cap_mb_list": [100]}))
        if pipeline in BASELINES:
            inner, state = _baseline(pipeline)
        else:
            inner = grace_ddp.comm_hook
            state = grace_ddp.GraceState(grace_from_params(dict(GRACE[pipeline])))
        counter = CallCounter()
        hooked, ops, views, launched, sites = [], [], [], [], []

        def hook(state, bucket):            # unannotated: DDP checks only given annotations
            hooked.append(bucket.index())
            if not counter.active:
                return inner(state, bucket)
            with counter.cover_this_thread(), OpCounter(sites if where else None) as issued:
                future = inner(state, bucket)
            ops.append(issued.ops)
            views.append(issued.views)
            launched.append(issued.kernels)
            return future

        net.register_comm_hook(state, hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        loss_fn = nn.CrossEntropyLoss()
        x = torch.randn(batch, *shape, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        per_step, buckets, ops_per_step, kernels_per_step = [], [], [], []
        for step in range(warmup + steps):
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            hooked.clear()
            ops.clear()
            views.clear()
            launched.clear()
            sites.clear()
            if step < warmup:
                loss.backward()
            else:
                with counter:
                    loss.backward()
                per_step.append(counter.grace_calls())
                buckets.append(len(hooked))
                ops_per_step.append(sum(ops))
                kernels_per_step.append(sum(launched))
            opt.step()
        units = len(state.last_step_names) if pipeline in GRACE else None
    finally:
        if created:
            dist.destroy_process_group()
    last = per_step[-1]
    files: collections.Counter = collections.Counter()
    for (rel, _, _), n in last.items():
        files[rel] += n
    functions = sorted(last.items(), key=lambda kv: (-kv[1], kv[0]))
    target = None if model in SHAPES else TARGETS.get(pipeline)    # (targets: one bucket)
    return {
        "pipeline": pipeline, "grace": dict(GRACE.get(pipeline, {})), "model": model,
        "device": device,
        "params": sum(p.numel() for p in net.parameters()),
        "tensors": sum(1 for _ in net.parameters()),
        "buckets": max(buckets), "grace_tensors": units,
        "calls": sum(last.values()), "files": len(files),
        "calls_per_step": [sum(s.values()) for s in per_step],
        "torch_ops": ops_per_step[-1], "torch_ops_per_step": ops_per_step,
        "torch_views": sum(views),
        "triton_kernels": kernels_per_step[-1],
        "target_calls": target[0] if target else None,
        "target_files": target[1] if target else None,
        "top_files": [[f, n] for f, n in sorted(files.items(), key=lambda kv: (-kv[1], kv[0]))],
        "top_functions": [[f"{rel}:{line} {name}", n] for (rel, line, name), n in functions[:TOP]],
        "threads": len(counter.threads),
        **({"sites": [list(site) for site in sites]} if where else {}),
    }


TITLE = "DDP hook: Python calls and files per step"
ABOUT = (
    "One process, gloo at world size 1, `DistributedDataParallel` with one bucket "
    "(`bucket_cap_mb_list=[100]`) and grace_dl's hook with default options, each pipeline of "
    "`benchmarks/pipelines.py` (`benchmarks/hook_calls.py`). After the warm-up steps, *calls* "
    "are the `sys.setprofile` `call` events (Python frames entered, generator resumptions "
    "included; C functions not) whose code is in a grace_dl file, from the start of "
    "`loss.backward()` to its return (the hook, its future's completion, DDP's copy into "
    "`.grad`; not the forward pass or the optimizer step), for one step; *files* how many "
    "distinct grace_dl files they are in; *torch ops* the torch operations (ATen operators) the "
    "hook's call issues in that step (on a GPU each is a launch); *Triton kernels* the launches "
    "of grace_dl's kernels beside them. The first run takes the path CPU tensors take (its "
    "compiled kernels are C calls, not counted); the `-device` run the GPU's code on CPU "
    "tensors (`--path device`: `kernels.emulate_device`, Triton's interpreter); *non-view "
    "ops* those that are not views (kernels on a GPU). Runs on `resnet50` / `decoder` count "
    "a model of those networks' parameter shapes (no compute) in DDP's default buckets, "
    "beside PyTorch's own fp16 and PowerSGD hooks (`pytorch-*`: no grace_dl calls). "
    "*target*: issue 42's aim for that pipeline (none "
    "where it set none). The count does not depend on the machine; it moves with the code. "
    "Below: where the calls of each pipeline go, by function (file:line qualified name).")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pipelines", nargs="+", default=list(PIPELINES),
                    choices=sorted(GRACE) + list(BASELINES),
                    help="grace pipelines (benchmarks/pipelines.py), or PyTorch's own hooks "
                         "as baselines (pytorch-fp16: fp16_compress_hook; pytorch-powersgd: "
                         "powerSGD_hook at grace powersgd's rank)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps counted, one by one")
    ap.add_argument("--model", default="small", choices=("small", "mlp5m", *SHAPES),
                    help="small, mlp5m: one bucket; resnet50, decoder: the parameter shapes of "
                         "benchmarks/gpu.py's two models (no compute) in DDP's default "
                         "buckets, what the GPU step table's hook sees")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the model and its gradients live (cuda: NCCL at world size "
                         "1, the device paths, their Triton launches counted); the committed "
                         "tables are the CPU's")
    ap.add_argument("--path", default="cpu", choices=PATHS,
                    help="cpu: the path CPU tensors take (the committed table's first run); "
                         "device: the GPU's code on CPU tensors (kernels.emulate_device, "
                         "Triton's interpreter), its Triton launches counted")
    ap.add_argument("--where", action="store_true",
                    help="also list each pipeline's torch operations and Triton launches of "
                         "the last step, in order, with the grace_dl line issuing each (on "
                         "stdout after the table; not in the results file)")
    ap.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                    help="also write the results file (benchmarks/records.py's format) to PATH "
                         "(default: hook_calls.json in the cache, benchmarks.records."
                         "scratch_dir; the page's is benchmarks/results/hook_calls.json)")
    ap.add_argument("--id", default="hook_calls",
                    help="the run's id (a run of the same id in the results file is replaced)")
    args = ap.parse_args(argv)
    if args.warmup < 2 or args.steps < 1:
        raise SystemExit("--warmup must be at least 2 (DDP rebuilds its buckets after the "
                         "first step) and --steps at least 1")
    torch.set_num_threads(1)
    rows = []
    for p in args.pipelines:
        try:
            rows.append(count(p, args.warmup, args.steps, args.model, device=args.device,
                              path=args.path, where=args.where))
        except Exception as err:  # noqa: BLE001  (a pipeline that fails is reported)
            rows.append({"pipeline": p, "error": repr(err)[:300]})
        print(json.dumps({k: v for k, v in rows[-1].items()
                          if k not in ("top_files", "top_functions", "grace")}),
              file=sys.stderr, flush=True)
    sites = {r["pipeline"]: r.pop("sites") for r in rows if "sites" in r}
    print(tables.hook_calls_table(rows), end="")
    for pipeline, listed in sites.items():
        print(f"\n`{pipeline}`: its {len(listed)} torch operations and Triton launches of one "
              f"step, in order, and the grace_dl line issuing each:\n")
        print(tables.table(["operation", "issued by"],
                           [{"operation": op, "issued by": f"`{at}`"} for op, at in listed]))
    if args.json is not None:
        out = Path(args.json) if args.json else records.default_out("hook_calls")
        command = "python -m benchmarks.hook_calls " + " ".join(
            sys.argv[1:] if argv is None else argv)
        run = records.new_run(args.id, command, rows)
        records.record_run(out, "hook_calls", TITLE, run, about=ABOUT)
        print(f"wrote {out}", file=sys.stderr)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
