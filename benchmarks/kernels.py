"""grace_dl's compiled kernels against their twins, one process, one thread: the same call
with ``grace_dl.native.use(True)`` and ``use(False)`` alternating, medians of the repeats.

    python -m benchmarks.kernels            # 4M fp32, 25 repeats, into the cache
    python -m benchmarks.kernels --out benchmarks/results/kernels.json   # into the page
    python -m benchmarks.kernels --quick    # 64K elements, 3 repeats, printed only

*twin / kernel* is the speed-up; *x memcpy* is the kernel's time over one copy of the input
into a buffer allocated once (one pass over memory), timed in the same alternation; then the
same kernels held to each narrower SIMD path this CPU can run (AVX2, scalar).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import records, tables
from grace_dl import native, seeding
from grace_dl.compressors import sparse
from grace_dl.compressors.base import LOCAL
from grace_dl.compressors.paths import Paths
from grace_dl.compressors.qsgd import QSGDCompressor
from grace_dl.compressors.signsgd import SignSGDCompressor
from grace_dl.compressors.threshold import ThresholdCompressor
from grace_dl.compressors.topk import TopKCompressor
from grace_dl.native.paths import COMPILED
from grace_dl.torch import ops

ROOT = Path(__file__).resolve().parent.parent
TITLE = "Compiled kernels against their twins (one thread)"
ABOUT = (
    "One process, one thread, standard normal fp32 input; each call with grace_dl's compiled "
    "kernels and with their twins (`native.use(False)`: the framework's or NumPy's ops) "
    "alternating, each first in turn; medians of the repeats. *x memcpy* = the kernel's time "
    "over a copy of the input into a buffer allocated once, timed in the same loop. The last "
    "columns hold the same kernels to narrower SIMD paths (`native.limit_vector_bits`): what "
    "an AVX2-only CPU and one with no SIMD path would run (on the latter the scan, the sign "
    "code and the server step hand the work to their twins instead: `native._vectorized`).")


def cases(n: int) -> dict:
    """name -> a call timed with the kernels on and off (each builds what it needs first)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    err, dec, out = torch.empty(n), torch.empty(n), torch.empty(n)
    a = x.numpy()
    thr = float(np.quantile(np.abs(a[: 1 << 16]), 0.986))   # ~1.4% candidates, as topk 1% scans
    # the CPU path of each method (``grace_dl.native.paths``): with the kernels off, each of
    # its calls falls back to the reference's torch code
    sign, qsgd, topk, threshold = (Paths(c).on(x) for c in (
        SignSGDCompressor(), QSGDCompressor(quantum_num=64), TopKCompressor(0.01),
        ThresholdCompressor(2.576)))
    s_payload, s_ctx = sign.compress(x, "s", LOCAL)
    q_payload, q_ctx = qsgd.compress(x, "q", LOCAL)
    q_other, _ = qsgd.compress(x.flip(0).contiguous(), "q2", LOCAL)
    s_other, _ = sign.compress(x.flip(0).contiguous(), "s2", LOCAL)
    slot = torch.zeros(n)
    small = x[: min(n, 20480)]                 # the size of the MLP's output layer
    cand = ops.positions_at_least(x, thr)
    t_payload, t_ctx = topk.compress(x, "t", LOCAL)
    t_other, _ = topk.compress(x.flip(0).contiguous(), "t2", LOCAL)

    def server_step():
        """two-phase signSGD's server step: fused, or (kernels off) the steps one by one"""
        if sign.combine_with_feedback([s_payload, s_other], s_ctx, slot, out) is None:
            reduced = sign.combine([s_payload, s_other], s_ctx, dec)
            slot.add_(reduced)
            sign.compress_with_error(slot, "s/server", LOCAL, slot, reduced)

    return {
        "sparsifier scan, abs(x) >= t (~1.4% kept)": lambda: COMPILED.at_least(ops, x, thr),
        "topk 1% compress": lambda: topk.compress(x, "t", LOCAL),
        "threshold 2.576 compress": lambda: threshold.compress(x, "h", LOCAL),
        "topk combine into the gradient, 2 ranks (sparse sum)":
            lambda: topk.combine([t_payload, t_other], t_ctx, out),
        "exact top 1% of 20K (topk below its sampling size)":
            lambda: sparse.exact_top(ops, small, max(1, small.numel() // 100), select=COMPILED),
        "top 1% of x among the scan's candidates (topk's last step)":
            lambda: sparse.top_among(ops, x, cand, max(1, n // 100), select=COMPILED),
        "signsgd compress with error": lambda: sign.compress_with_error(x, "s", LOCAL, err),
        "signsgd decompress into": lambda: sign.decompress_into(s_payload, s_ctx, out),
        "signsgd two-phase server step, 2 ranks": server_step,
        "qsgd (s=64) compress with error": lambda: qsgd.compress_with_error(x, "q", LOCAL, err,
                                                                          dec),
        "qsgd decompress into": lambda: qsgd.decompress_into(q_payload, q_ctx, out),
        "qsgd combine, 2 ranks": lambda: qsgd.combine([q_payload, q_other], q_ctx, out),
        "randomk 1% positions (seeding.choice)": lambda: seeding.choice(0, "r", 1, n,
                                                                        max(1, n // 100)),
        "seeding one key (SeedSequence + SFC64)": lambda: seeding.dither(0, "d", 1, 1, 8),
        "dither, 8 bits": lambda: seeding.dither(0, "d", 1, n, 8),
        "dither, 16 bits": lambda: seeding.dither(0, "d", 1, n, 16),
    }


def narrower_paths() -> list[int]:
    """The SIMD widths below this CPU's own that the kernels also have (256, then 0 = the
    scalar loops): what the same build runs on an AVX2-only CPU and on one with no SIMD path."""
    return [b for b in (256, 0) if b < native.vector_bits()]


def path_column(bits: int) -> str:
    return "scalar ms" if bits == 0 else f"{bits}-bit ms"


def _timed(call, way) -> float:
    """Seconds of one ``call`` with the kernels at this CPU's width (``way`` "kernel"), the
    twins ("twin") or the kernels held to ``way`` bits (an int)."""
    native.use(way != "twin")
    native.limit_vector_bits(way if isinstance(way, int) else 512)
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def measure(n: int, repeats: int) -> list[dict]:
    x = torch.randn(n)
    buf = torch.empty(n)
    paths = narrower_paths()
    ways = ["kernel", "twin", *paths]   # the kernels at this CPU's width, the twins, narrower
    rows = []
    for name, call in cases(n).items():
        times = {**{way: [] for way in ways}, "copy": []}
        for way in ways:                # warm-up, each way
            _timed(call, way)
        for r in range(repeats):
            for way in ways[r % len(ways):] + ways[:r % len(ways)]:   # each way first in turn
                times[way].append(_timed(call, way))
            t0 = time.perf_counter()
            buf.copy_(x)
            times["copy"].append(time.perf_counter() - t0)
        native.use(True)
        native.limit_vector_bits(512)
        kernel, twin, copy = (statistics.median(times[k]) for k in ("kernel", "twin", "copy"))
        rows.append({"case": name, "kernel ms": f"{kernel * 1e3:.2f}",
                     "twin ms": f"{twin * 1e3:.2f}", "twin / kernel": f"{twin / kernel:.2f}",
                     "x memcpy": f"{kernel / copy:.2f}",
                     **{path_column(b): f"{statistics.median(times[b]) * 1e3:.2f}"
                        for b in paths}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64K elements, 3 repeats, printed only")
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--out", default=None,
                    help="results file (default: kernels.json in the cache, "
                         "benchmarks.records.scratch_dir; --quick prints only)")
    ap.add_argument("--id", default="kernels",
                    help="the run's id (a run of the same id in --out is replaced)")
    args = ap.parse_args(argv)
    if not native.available():
        raise SystemExit("grace_dl's compiled kernels are not built here "
                         "(grace_dl.native.available() is False): nothing to compare")
    n, repeats = (1 << 16, 3) if args.quick else (args.numel, args.repeats)
    if n < 1 or repeats < 1:
        raise SystemExit(f"--numel and --repeats must be >= 1, got {n} and {repeats}")
    torch.set_num_threads(1)
    rows = measure(n, repeats)
    columns = ["case", "kernel ms", "twin ms", "twin / kernel", "x memcpy",
               *map(path_column, narrower_paths())]
    print(f"{n} fp32 elements, {repeats} repeats, kernels: {records.kernels()}\n")
    print(tables.table(columns, rows))
    if not args.quick:
        out = Path(args.out) if args.out else records.default_out("kernels")
        command = " ".join(["python -m benchmarks.kernels", *(argv or sys.argv[1:])])
        run = records.new_run(args.id, command, rows, elements=n, repeats=repeats)
        records.record_run(out, "kernels", TITLE, run, about=ABOUT, columns=columns)
        print(f"wrote {out}")
    return 0 if all(math.isfinite(float(r["twin / kernel"])) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
