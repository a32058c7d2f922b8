"""Compressor micro-benchmark: bits per element on the wire, compress and decompress time, and
their sum against a plain copy of the tensor, for every built-in compressor, measured in one run.

    python benchmarks/compressors.py                    # torch, 1M and 16M fp32 elements
    python benchmarks/compressors.py --framework tf     # the same on TensorFlow (eager)
    python benchmarks/compressors.py --quick            # small tensors, two repeats
    python benchmarks/compressors.py --device cuda      # torch on the GPU (CUDA tensors)
    python benchmarks/compressors.py --threads 1        # one intra-op thread, as the workers

Inputs are standard normal fp32 matrices (1024 x 1024 and 4096 x 4096, so PowerSGD has a
matrix). Each time is the median of ``--repeats`` runs after one warm-up; "x copy" is
(compress + decompress) / (plain copy of the tensor into a new buffer), the issue's target being
<= 3 for every quantizer; "x memcpy" divides by a copy into a buffer allocated once, i.e. one
pass over memory with no page faults (torch's CPU allocator maps a fresh 64 MB buffer for every
16M clone, so the plain copy's time swings with page faults; TF's allocator reuses memory, so
there the two baselines are alike). A compressor whose module is not importable is reported as
missing. The run is added to ``--out`` (``benchmarks/records.py`` format; default: the
cache, ``benchmarks.records.scratch_dir``) with the machine, versions and date.

``--device cuda`` (torch only) puts the inputs on the GPU and synchronises the device around
every timed call; the table then adds *of copy bw*, the fraction of the GPU's copy bandwidth a
compress + decompress round trip reaches (memcpy time / its time, i.e. 1 / *x memcpy*); its
run's id is ``torch-cuda``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import records, tables  # noqa: E402
from grace_dl.backend import ops_for  # noqa: E402
from grace_dl.registry import BUILTIN, lookup  # noqa: E402

# Parameters for the table: sparsifiers keep 1%; threshold 2.576 keeps 1% of N(0, 1) values.
PARAMS = {"compress_ratio": 0.01, "threshold": 2.576}
QUANTIZERS = {"fp16", "bf16", "qsgd", "terngrad", "natural", "u8bit", "inceptionn", "sketch",
              "onebit", "signsgd", "signum", "efsignsgd"}
SIZES = {"1M": (1024, 1024), "16M": (4096, 4096)}
QUICK_SIZES = {"64K": (256, 256), "256K": (512, 512)}
DEVICE = "cpu"  # torch device of the inputs (--device)
THREADS = None  # --threads


def _sync():
    if DEVICE != "cpu":
        import torch

        torch.cuda.synchronize()


def build(name):
    cls = lookup("compressor", name)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in PARAMS.items() if k in accepted}
    return cls(**kwargs), kwargs


def median_ms(fn, repeats):
    fn()  # warm-up (lazy state, allocator)
    _sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def plain_copy(x):
    """A real copy into a new buffer (TF's ``identity``, hence ``ops.copy``, copies nothing)."""
    if ops_for(x).NAME == "torch":
        return x.clone()
    import tensorflow as tf

    return tf.raw_ops.DeepCopy(x=x)


def preallocated_copy(x):
    """A copy into a buffer allocated once: the memory-bandwidth floor of one pass."""
    if ops_for(x).NAME == "torch":
        import torch

        out = torch.empty_like(x)
        return lambda: out.copy_(x)
    return lambda: plain_copy(x)


def compress_all_rounds(comp, x, name):
    """compress, then every further round of a multi-round method with its own payload as the
    'reduced' one (one rank): returns the last payload, its ctx and the bytes of all rounds."""
    payload, ctx = comp.compress(x, name)
    sent = sum(int(ops_for(p).nbytes(p)) for p in payload)
    while (nxt := comp.next_round(payload, ctx)) is not None:
        payload, ctx = nxt
        sent += sum(int(ops_for(p).nbytes(p)) for p in payload)
    return payload, ctx, sent


def make_input(framework, shape):
    import numpy as np

    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    if framework == "torch":
        import torch

        return torch.from_numpy(x).to(DEVICE)
    import tensorflow as tf

    return tf.constant(x)


def measure_one(name, x, numel, repeats):
    """One compressor on one input: its row of the table (the ratio is filled in later). A
    copy is timed next to each compressor; the median of all of them is the baseline, which
    keeps the ratios steady on a machine whose load drifts during the run."""
    comp, kwargs = build(name)
    copy_ms = median_ms(lambda: plain_copy(x), repeats)
    memcpy_ms = median_ms(preallocated_copy(x), repeats)
    state = {}

    def compress():
        state["out"] = compress_all_rounds(comp, x, "bench")

    c_ms = median_ms(compress, repeats)
    payload, ctx, sent = state["out"]
    d_ms = median_ms(lambda: comp.decompress(payload, ctx), repeats)
    return {"params": kwargs, "bits": 8.0 * sent / numel, "compress": c_ms,
            "decompress": d_ms, "copy": copy_ms, "memcpy": memcpy_ms}


def measure(framework, names, sizes, repeats):
    rows = {}
    for label, shape in sizes.items():
        x = make_input(framework, shape)
        numel = ops_for(x).numel(x)
        rows[label] = {"results": {}}
        for name in names:
            try:
                row = measure_one(name, x, numel, repeats)
            except Exception as err:  # missing module or a failure: reported, not fatal
                row = {"missing": f"{type(err).__name__}: {err}"[:120]}
            rows[label]["results"][name] = row
        copies = [r["copy"] for r in rows[label]["results"].values() if "copy" in r]
        rows[label]["copy"] = statistics.median(copies) if copies else float("nan")
        rows[label]["copy_range"] = (min(copies), max(copies)) if copies else (0.0, 0.0)
        memcpys = [r["memcpy"] for r in rows[label]["results"].values() if "memcpy" in r]
        rows[label]["memcpy"] = statistics.median(memcpys) if memcpys else float("nan")
        for name, row in rows[label]["results"].items():
            if "copy" in row:
                work = row["compress"] + row["decompress"]
                row["ratio"] = work / rows[label]["copy"]
                row["ratio_memcpy"] = work / rows[label]["memcpy"]
            print(f"{label:>5} {name:<11} {fmt_row(row)}", flush=True)
    return rows


def fmt_row(r):
    if "missing" in r:
        return f"missing ({r['missing']})"
    return (f"{r['bits']:7.3f} bits/elem  compress {r['compress']:8.2f} ms  "
            f"decompress {r['decompress']:8.2f} ms  {r['ratio']:6.2f} x copy  "
            f"{r['ratio_memcpy']:6.2f} x memcpy")


TITLE = "Compressor micro-benchmark: bits on the wire, compress and decompress time"
ABOUT = (
    "Standard normal fp32 matrices (1024 x 1024 and 4096 x 4096, so PowerSGD has a matrix); "
    "each time is the median of the repeats after a warm-up. *x copy* = (compress + "
    "decompress) / a plain copy of the tensor into a new buffer (the median of copies timed "
    "next to every compressor); the target for quantizers (marked q) is <= 3. *x memcpy* = "
    "the same over a copy into a buffer allocated once: one pass over memory, no page "
    "faults. On a GPU, *of copy bw* is the fraction of the device's copy bandwidth a compress "
    "+ decompress round trip reaches.")
COLUMNS = ["elements", "compressor", "params", "bits/elem", "compress ms", "decompress ms",
           "x copy", "x memcpy", "of copy bw"]


def rows_of(blocks) -> list[dict]:
    """``measure``'s blocks as one record per size and compressor (formatted cells)."""
    out = []
    for label, block in blocks.items():
        for name, r in block["results"].items():
            row = {"elements": label, "compressor": f"{name} (q)" if name in QUANTIZERS else name}
            if "missing" in r:
                out.append({**row, "bits/elem": f"missing: {r['missing']}"})
                continue
            row.update({"params": ", ".join(f"{k}={v}" for k, v in r["params"].items()),
                        "bits/elem": f"{r['bits']:.3f}", "compress ms": f"{r['compress']:.2f}",
                        "decompress ms": f"{r['decompress']:.2f}", "x copy": f"{r['ratio']:.2f}",
                        "x memcpy": f"{r['ratio_memcpy']:.2f}"})
            if DEVICE != "cpu":
                row["of copy bw"] = f"{1 / r['ratio_memcpy']:.1%}"
            out.append(row)
    return out


def machine(framework) -> str:
    """``benchmarks.records.machine()`` plus the framework's threads and the GPU, if any."""
    extra = []
    if framework == "torch":
        import torch

        extra.append(f"{torch.get_num_threads()} torch threads")
        if DEVICE != "cpu":
            extra.append(f"device {torch.cuda.get_device_name()}")
    else:
        import tensorflow as tf

        intra = tf.config.threading.get_intra_op_parallelism_threads()
        extra.append(f"TensorFlow eager, {intra or 'default'} intra-op threads")
    return "; ".join([records.machine(), *extra])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--framework", choices=["torch", "tf"], default="torch")
    ap.add_argument("--quick", action="store_true", help="64K and 256K elements, 2 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--names", nargs="+", default=sorted(BUILTIN["compressor"]))
    ap.add_argument("--out", default=None,
                    help="results file (default: compressors.json in the cache, "
                         "benchmarks.records.scratch_dir; --quick prints only)")
    ap.add_argument("--id", default=None,
                    help="the run's id (default: the framework, and the device if not the "
                         "CPU); a run of the same id in --out is replaced")
    ap.add_argument("--device", default="cpu", help="torch device of the inputs (cpu, cuda)")
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads (torch.set_num_threads; TF intra-op parallelism); "
                    "the e2e/overhead/DDP workers run with 1. Default: the framework's own")
    args = ap.parse_args(argv)
    global THREADS
    THREADS = args.threads
    if args.threads:
        if args.framework == "torch":
            import torch

            torch.set_num_threads(args.threads)
        else:
            import tensorflow as tf

            tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    global DEVICE
    DEVICE = args.device
    if DEVICE != "cpu" and args.framework != "torch":
        ap.error(f"--device {DEVICE} needs --framework torch")
    if args.framework == "tf":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sizes = QUICK_SIZES if args.quick else SIZES
    repeats = args.repeats or (2 if args.quick else 5)
    rows = measure(args.framework, args.names, sizes, repeats)
    rows = rows_of(rows)
    print(tables.table([c for c in COLUMNS if any(c in r for r in rows)], rows))
    if not args.quick:
        out = Path(args.out) if args.out else records.default_out("compressors")
        run_id = args.id or "-".join([args.framework, *([DEVICE] if DEVICE != "cpu" else [])])
        command = " ".join(["python benchmarks/compressors.py",
                            *(sys.argv[1:] if argv is None else argv)])
        run = records.new_run(run_id, command, rows, repeats=repeats)
        run["machine"] = machine(args.framework)
        records.record_run(out, "compressors", TITLE, run, about=ABOUT, columns=COLUMNS)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
