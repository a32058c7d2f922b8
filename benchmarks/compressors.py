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
missing. The table is written to benchmarks/results/compressors.md (or ``--out``) with the
machine, versions and date.

``--device cuda`` (torch only) puts the inputs on the GPU and synchronises the device around
every timed call; the table then adds *of copy bw*, the fraction of the GPU's copy bandwidth a
compress + decompress round trip reaches (memcpy time / its time, i.e. 1 / *x memcpy*), and is
written to benchmarks/results/compressors_cuda.md.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.report import kernels  # noqa: E402
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


def environment(framework):
    import numpy as np

    lines = [f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"]
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    lines.append(f"- machine: {cpu}, {os.cpu_count()} logical CPUs, {platform.system()} "
                 f"{platform.release()}")
    versions = [f"Python {platform.python_version()}", f"NumPy {np.__version__}"]
    if framework == "torch":
        import torch

        versions.append(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
        if DEVICE != "cpu":
            versions.append(f"device {torch.cuda.get_device_name()}")
    else:
        import tensorflow as tf

        intra = tf.config.threading.get_intra_op_parallelism_threads()
        versions.append(f"TensorFlow {tf.__version__} (eager"
                        + (f", {intra} intra-op threads" if intra else "") + ")")
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
        versions.append(f"grace_dl {rev}")
    except (OSError, subprocess.CalledProcessError):
        pass
    lines.append("- versions: " + ", ".join(versions))
    lines.append(f"- grace_dl kernels: {kernels()}")
    try:
        load = os.getloadavg()
        lines.append(f"- load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    except OSError:
        pass
    return lines


def markdown(framework, rows, repeats):
    gpu = DEVICE != "cpu"
    out = [f"# Compressor micro-benchmark ({framework}{', ' + DEVICE if gpu else ''})", "",
           "Generated by `python benchmarks/compressors.py"
           + (" --framework tf" if framework == "tf" else "")
           + (f" --device {DEVICE}" if gpu else "")
           + (f" --threads {THREADS}" if THREADS else "")
           + (f" --repeats {repeats}" if repeats != 5 else "") + "`.", ""]
    out += environment(framework)
    out += ["", f"Input: standard normal fp32; times are medians of {repeats} runs after a "
            "warm-up. *x copy* = (compress + decompress) / plain copy of the tensor into a new "
            "buffer (the median of copies timed next to every compressor); target for "
            "quantizers (marked q): <= 3. *x memcpy* = the same over a copy into a buffer "
            "allocated once: one pass over memory, no page faults. Compressors allocate fresh "
            "buffers, so their times include page faults where the allocator maps new memory "
            "(large tensors); so does the plain copy, whose time therefore varies, while "
            "*x memcpy* counts memory passes against a steady floor.", ""]
    for label, block in rows.items():
        lo, hi = block["copy_range"]
        out += [f"## {label} elements (copy: median {block['copy']:.2f} ms, "
                f"range {lo:.2f} to {hi:.2f} ms; memcpy: median {block['memcpy']:.2f} ms)", "",
                "| compressor | params | bits/elem | compress ms | decompress ms | x copy "
                "| x memcpy |" + (" of copy bw |" if gpu else ""),
                "|---|---|---:|---:|---:|---:|---:|" + ("---:|" if gpu else "")]
        for name, r in block["results"].items():
            mark = f"{name} (q)" if name in QUANTIZERS else name
            if "missing" in r:
                out.append(f"| {mark} | | missing: {r['missing']} | | | | |"
                           + (" |" if gpu else ""))
                continue
            params = ", ".join(f"{k}={v}" for k, v in r["params"].items())
            out.append(f"| {mark} | {params} | {r['bits']:.3f} | {r['compress']:.2f} | "
                       f"{r['decompress']:.2f} | {r['ratio']:.2f} | {r['ratio_memcpy']:.2f} |"
                       + (f" {1 / r['ratio_memcpy']:.1%} |" if gpu else ""))
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--framework", choices=["torch", "tf"], default="torch")
    ap.add_argument("--quick", action="store_true", help="64K and 256K elements, 2 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--names", nargs="+", default=sorted(BUILTIN["compressor"]))
    ap.add_argument("--out", default=None, help="markdown file (default: "
                    "benchmarks/results/compressors[_tf].md; --quick prints only)")
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
    text = markdown(args.framework, rows, repeats)
    out = args.out
    if out is None and not args.quick:
        suffix = "" if args.framework == "torch" else "_tf"
        suffix = "_cuda" if DEVICE.startswith("cuda") else suffix
        out = str(ROOT / f"benchmarks/results/compressors{suffix}.md")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
