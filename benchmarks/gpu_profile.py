"""Where a compressor's time goes on a GPU: the host's time to issue compress and decompress
against the device's time to run them, the Python functions that take the host's time, and
the kernels that take the device's. The compressor table (``benchmarks/gpu.py``) gives the
sum; this says which side to work on.

    python -m benchmarks.gpu_profile --out DIR [--methods qsgd topk ...] [--sizes 16M 64M]

For each method and size: ``host_*_us``, the wall time of issuing one call (nothing waits
for the GPU, unless the call reads a value back); ``device_*_us``,
the CUDA-event time of one call issued while the device is held behind a sleep kernel (the
kernels' own time, back to back); ``event_*_us``, the compressor table's measure (CUDA events
around the call on an idle device: the larger of the two, plus gaps). Then the top functions
of a cProfile of the calls (by own time) and the top kernels of a ``torch.profiler`` run.
Writes ``profile.json`` and ``profile.txt`` under ``--out``; nothing is committed from here.

    python -m benchmarks.gpu_profile --out DIR --selection 1M 4M 16M 64M

instead times the sparsifiers' two selections of the top 1% at each size, the radix select
(``select.radix_positions``) and ``torch.topk`` of the magnitudes (what ``top_positions`` takes
below ``select.RADIX_MIN``): host and event microseconds a call, to set ``RADIX_MIN`` where
the radix select starts to win (``selection.json``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
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


def _host_us(fn, calls):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _events_us(fn, calls, held: bool):
    """Median CUDA-event time of one call; with ``held`` the device first runs a sleep kernel
    while the host issues the call (the kernels' own time, back to back), else it is idle
    (the compressor table's latency: the host's time and the device's, added)."""
    clock = gpu.Clock(torch.device("cuda"))
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        if held:
            torch.cuda._sleep(20_000_000)
        times.append(clock(fn)[0] * 1e3)
    return statistics.median(times)


def _cprofile(fn, calls, top=14):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in text.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return "\n".join(lines[start:start + top + 1])


def _kernels(fn, calls, top=8):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us:
            rows.append((us / calls, ev.count // calls, ev.key[:90]))
    rows.sort(reverse=True)
    return [{"us_per_call": round(us, 1), "launches": c, "kernel": k} for us, c, k in rows[:top]]


def _launch_costs():
    """What the host pays per launch on this machine: a torch op, an empty Triton kernel."""
    out = {}
    x = torch.zeros(1024, device="cuda")
    out["torch add_ us"] = _host_us(lambda: x.add_(1.0), 2000)
    out["torch empty us"] = _host_us(lambda: torch.empty(1024, device="cuda"), 2000)
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def touch(p, n, a, b, c, BLOCK: tl.constexpr, FLAG: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(p + i, mask=i < n)
            if FLAG:
                v = v + a
            tl.store(p + i, v, mask=i < n)

        touch[(1,)](x, 1024, 1.0, 2, 3, BLOCK=1024, FLAG=True)
        out["triton launch us"] = _host_us(
            lambda: touch[(1,)](x, 1024, 1.0, 2, 3, BLOCK=1024, FLAG=True), 2000)
        touch[(1,)](x, 1024, 1.0, 2, 3, BLOCK=1024, FLAG=True, enable_fp_fusion=False)
        out["triton launch, enable_fp_fusion=False us"] = _host_us(
            lambda: touch[(1,)](x, 1024, 1.0, 2, 3, BLOCK=1024, FLAG=True,
                                enable_fp_fusion=False), 2000)
    except Exception as err:  # noqa: BLE001
        out["triton"] = repr(err)[:200]
    torch.cuda.synchronize()
    return out


def _profile(x, label, name, calls, with_cprofile):
    """One method's row at one size."""
    compress, decompress, _, path, _ = gpu._grace_pair(name, x)
    pc = compress()
    for _ in range(3):
        pc = compress()
        decompress(pc)
    row = {"size": label, "method": name, "path": path}
    for part, fn in (("compress", compress), ("decompress", lambda: decompress(pc))):
        row[f"host_{part}_us"] = round(_host_us(fn, calls), 1)
        row[f"device_{part}_us"] = round(_events_us(fn, calls, held=True), 1)
        row[f"event_{part}_us"] = round(_events_us(fn, calls, held=False), 1)
    row["kernels"] = _kernels(lambda: decompress(compress()), calls)
    if with_cprofile:
        row["cprofile"] = _cprofile(lambda: decompress(compress()), calls)
    return row


def _selection_row(label: str, calls: int) -> dict:
    """One size's row of ``--selection``: the top 1% by each way, host and event times."""
    import math

    from grace_dl.torch.kernels import codes, select

    n = int(float(label[:-1]) * {"K": 1 << 10, "M": 1 << 20}[label[-1]])
    x = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    k = max(1, math.ceil(0.01 * n))
    ways = {"radix": lambda: select.radix_positions(x, k),
            "topk": lambda: torch.topk(codes.magnitudes(x), k, sorted=False).indices}
    row = {"size": label, "numel": n, "k": k, "radix_min": select.RADIX_MIN}
    for way, fn in ways.items():
        for _ in range(3):
            fn()
        row[f"host_{way}_us"] = round(_host_us(fn, calls), 1)
        row[f"event_{way}_us"] = round(_events_us(fn, calls, held=False), 1)
        row[f"device_{way}_us"] = round(_events_us(fn, calls, held=True), 1)
    return row


def _selection(out: Path, sizes, calls):
    """The radix select against ``torch.topk`` at each size (``--selection``)."""
    rows = []
    for label in sizes:
        rows.append(_selection_row(label, calls))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    (out / "selection.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / 'selection.json'}", flush=True)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/grace_dl_profile"))
    parser.add_argument("--methods", nargs="+", default=list(gpu.METHODS))
    parser.add_argument("--sizes", nargs="+", default=["16M"])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--cprofile", nargs="*", default=None,
                        help="methods to cProfile (default: all of --methods)")
    parser.add_argument("--selection", nargs="+", default=None, metavar="SIZE",
                        help="time the radix select against torch.topk at these sizes "
                             "(e.g. 1M 4M 16M) instead")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.selection:
        return _selection(args.out, args.selection, args.calls)
    device = torch.device("cuda")
    report = {"launch": _launch_costs(), "rows": []}
    text = [json.dumps(report["launch"])]
    print(text[0], flush=True)
    for label in args.sizes:
        n = gpu.SIZES[label]
        x = torch.randn(n, device=device, generator=torch.Generator(device).manual_seed(0))
        x = torch.where(x == 0, torch.full_like(x, 1e-30), x)
        for name in args.methods:
            try:
                row = _profile(x, label, name, args.calls,
                               args.cprofile is None or name in args.cprofile)
            except Exception as err:  # noqa: BLE001  (a failing method is reported)
                row = {"size": label, "method": name, "error": repr(err)[:300]}
            report["rows"].append(row)
            head = {k: v for k, v in row.items() if k not in ("kernels", "cprofile")}
            print(json.dumps(head), flush=True)
            text.append(f"\n=== {json.dumps(head)}")
            for k in row.get("kernels", []):
                text.append(f"  {k['us_per_call']:9.1f} us x{k['launches']:<3} {k['kernel']}")
            if "cprofile" in row:
                text.append(row["cprofile"])
            torch.cuda.empty_cache()
    (args.out / "profile.json").write_text(json.dumps(report, indent=1))
    (args.out / "profile.txt").write_text("\n".join(text) + "\n")
    print(f"wrote {args.out / 'profile.json'}", flush=True)


if __name__ == "__main__":
    main()
