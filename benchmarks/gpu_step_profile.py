"""Where a DDP training step's time goes with grace's hook against PyTorch's own: the host's
time to issue a step, the device's time to run it, the Python inside the hook, and the
launches. The step table (``benchmarks/gpu.py steps``) gives each pipeline's step; this says
why one is slower than another: a step is host-bound where the host's issue time reaches the
step's, and then the hook's Python and its launches are what to cut.

    python -m benchmarks.gpu_step_profile --out DIR [--models resnet50 gpt] \\
        [--labels "grace fp16" "PyTorch fp16_compress_hook" ...] [--steps 5]

For each model and step row (``benchmarks/gpu.py``'s labels: DDP, PyTorch's hooks, grace's
pipelines and their variants), after 5 warm-up steps, ``--steps`` steps each measured three
ways:

- ``step_ms``: wall time of a step, the device waited for (median);
- ``issue_ms``: wall time until the step's Python returns, the device not waited for
  (median; each step starts on an idle device): where it reaches ``step_ms`` the host bounds
  the step;
- the DDP hook's calls, each timed and under a cProfile (``HookProfile``: on a GPU the hook
  runs on autograd's device thread): ``hook_ms`` (their wall time per step: grace's whole
  exchange where it completes inside them; PyTorch's hooks without their futures'
  callbacks, which run on the collective's thread), ``grace_ms`` (own time of the functions
  in grace_dl files), and the top functions by own time;
- a ``torch.profiler`` run: ``launches`` (CUDA kernel launches per step, ``cudaLaunchKernel``
  and friends), ``device_ms`` (the kernels' time per step), ``ops`` (ATen operators per step)
  and the top operators by host (self CPU) time.

bf16 autocast and SGD as in the step table, world size 1 (NCCL on a GPU, gloo on a CPU, where
``--small`` takes the small models and the device columns stay empty). Writes
``step_profile.json`` and ``step_profile.txt`` under ``--out``; nothing is committed from here.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu  # noqa: E402

#: the rows profiled by default: the targets of issue 42 that the H200 run missed
LABELS = ("DDP", "grace none", "PyTorch fp16_compress_hook", "grace fp16",
          "grace fp16, buckets completed together", "PyTorch powerSGD_hook rank 4",
          "grace PowerSGD rank 4", "grace PowerSGD rank 4, per-tensor sends")
GRACE_DIR = str(ROOT / "grace_dl")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
WARMUP = 5


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _stepper(label, kind, device, small):
    torch.manual_seed(0)
    net, loss_of = gpu._model(kind, device, small)
    ddp = gpu._hooked(label, net, device)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(ddp)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _times(step, device, steps):
    """(median step ms, device waited for; median ms until the step's Python returns)."""
    full, issue = [], []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        issue.append(1e3 * (time.perf_counter() - t0))
        _sync(device)
        full.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(full), statistics.median(issue)


class HookProfile:
    """Wraps the DDP hooks ``benchmarks/gpu.py`` registers (grace's ``comm_hook``, PyTorch's
    ``fp16_compress_hook`` and ``powerSGD_hook``) while the step's model is built, so that
    each call runs under one cProfile and a clock when ``active``: on a GPU the hook runs on
    autograd's device thread, where a profile of the main thread does not reach. PyTorch's
    hooks' future callbacks run on the collective's thread, outside the hook call: not
    counted."""

    def __init__(self):
        self.profile = cProfile.Profile()
        self.seconds = 0.0
        self.active = False

    def _wrap(self, hook):
        def profiled(state, bucket):
            if not self.active:
                return hook(state, bucket)
            t0 = time.perf_counter()
            self.profile.enable()
            try:
                return hook(state, bucket)
            finally:
                self.profile.disable()
                self.seconds += time.perf_counter() - t0
        return profiled

    @contextlib.contextmanager
    def installed(self):
        """Within it, the hooks' modules hold the wrapped hooks."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        from grace_dl.torch import ddp as grace_ddp

        places = [(grace_ddp, "comm_hook"), (default_hooks, "fp16_compress_hook"),
                  (powerSGD_hook, "powerSGD_hook")]
        kept = [getattr(m, n) for m, n in places]
        for (m, n), hook in zip(places, kept):
            setattr(m, n, self._wrap(hook))
        try:
            yield
        finally:
            for (m, n), hook in zip(places, kept):
                setattr(m, n, hook)


def _python(step, device, steps, hooks: HookProfile, top=12):
    """Per step: the hook calls' wall time and grace_dl's own time inside them; the top
    functions inside the hook calls by own time."""
    _sync(device)
    hooks.active = True
    for _ in range(steps):
        step()
    _sync(device)
    hooks.active = False
    grace, rows = 0.0, []
    stats = pstats.Stats(hooks.profile).stats if hooks.seconds else {}  # (DDP: no hook)
    for (file, line, name), (_, calls, own, _, _) in stats.items():
        if file.startswith(GRACE_DIR):
            grace += own
        rows.append((own, calls, f"{Path(file).name}:{line} {name}"))
    rows.sort(reverse=True)
    return {"hook_ms": 1e3 * hooks.seconds / steps, "grace_ms": 1e3 * grace / steps,
            "top_python": [{"own_ms": round(1e3 * own / steps, 3), "calls": calls // steps,
                            "function": fn} for own, calls, fn in rows[:top]]}


def _launches(step, device, steps, top=10):
    """Per step: CUDA launches, the kernels' time, ATen operators; top operators by host
    time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    launches = ops = 0
    device_us = 0.0
    rows = []
    for ev in prof.key_averages():
        if ev.key in LAUNCHES:
            launches += ev.count
        elif ev.key.startswith("aten::"):
            ops += ev.count
            rows.append((ev.self_cpu_time_total / steps, ev.count // steps, ev.key))
        if getattr(ev, "device_type", None) is not None and \
                str(ev.device_type).endswith("CUDA"):
            device_us += getattr(ev, "self_device_time_total", 0) or 0
    rows.sort(reverse=True)
    return {"launches": launches // steps if device.type == "cuda" else None,
            "device_ms": device_us / 1e3 / steps if device.type == "cuda" else None,
            "ops": ops // steps,
            "top_ops": [{"self_cpu_us": round(us, 1), "calls": n, "op": k}
                        for us, n, k in rows[:top]]}


def profile_row(label, kind, device, steps, small=False) -> dict:
    """One step row's profile (module docstring)."""
    hooks = HookProfile()
    with hooks.installed():
        step = _stepper(label, kind, device, small)
    for _ in range(WARMUP):
        step()
    step_ms, issue_ms = _times(step, device, steps)
    row = {"model": kind, "pipeline": label, "step_ms": step_ms, "issue_ms": issue_ms}
    row.update(_python(step, device, steps, hooks))
    row.update(_launches(step, device, steps))
    return row


def _process_group(device) -> bool:
    """Start a single-process group unless one exists; whether this started it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0,
                            world_size=1, store=dist.HashStore())
    return True


def _text(row) -> list[str]:
    head = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
            if k not in ("top_python", "top_ops")}
    out = [f"\n=== {json.dumps(head)}"]
    out += [f"  py {r['own_ms']:8.3f} ms x{r['calls']:<6} {r['function']}"
            for r in row.get("top_python", [])]
    out += [f"  op {r['self_cpu_us']:8.1f} us x{r['calls']:<6} {r['op']}"
            for r in row.get("top_ops", [])]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/grace_dl_profile"))
    parser.add_argument("--models", nargs="+", default=["resnet50", "gpt"],
                        choices=("resnet50", "gpt"))
    known = ["DDP", "PyTorch fp16_compress_hook", "PyTorch powerSGD_hook rank 4",
             *gpu.PIPELINES, *gpu.VARIANTS]
    parser.add_argument("--labels", nargs="+", default=list(LABELS), choices=known)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true",
                        help="the step table's small models (a CPU's quick check)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    created = _process_group(device)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, text = [], []
    try:
        for kind in args.models:
            for label in args.labels:
                try:
                    row = profile_row(label, kind, device, args.steps, args.small)
                except Exception as err:  # noqa: BLE001  (a failing row is reported)
                    row = {"model": kind, "pipeline": label, "error": repr(err)[:300]}
                rows.append(row)
                head = _text(row)
                text += head
                print(head[0], flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()
    (args.out / "step_profile.json").write_text(json.dumps(rows, indent=1))
    (args.out / "step_profile.txt").write_text("\n".join(text) + "\n")
    print(f"wrote {args.out / 'step_profile.json'}", flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
