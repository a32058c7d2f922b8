"""Tables (Markdown) and plots (PNG) from the benchmark JSON records.

    python -m benchmarks.report --results benchmarks/results

Writes ``e2e.md`` (speedup of every pipeline over uncompressed Horovod and over Horovod's fp16
compression at every link speed, bytes per step, time split, and how close communication gets
to bytes ÷ bandwidth),
``convergence.md`` (accuracy per epoch, epochs and estimated time to a target accuracy),
``speedup.png`` and ``accuracy.png``; each Markdown file records the machine and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

E2E_COLUMNS = ["model", "Mbit/s", "pipeline", "run", "step ms", "predicted ms", "predicted / step",
               "speedup vs none",
               "speedup vs hvd-fp16", "sent MB/step", "recv MB/step", "compute ms",
               "compress ms", "communicate ms", "bytes/bandwidth ms", "communicate / bound"]
CONVERGENCE_COLUMNS = ["pipeline", "final acc", "best acc", "epochs to target"]


def _version(*dists: str) -> str:
    """The installed version of the first of ``dists`` found, read from package metadata:
    importing TensorFlow only to read its version would print its start-up logging."""
    from importlib import metadata

    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "n/a"


def machine() -> str:
    versions = {"torch": _version("torch"),
                "tensorflow": _version("tensorflow", "tensorflow-cpu", "tensorflow-gpu"),
                "horovod": _version("horovod"), "numpy": _version("numpy")}
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
            f"{platform.platform()}; {os.cpu_count()} CPU cores{cpu()}; Python "
            f"{platform.python_version()}; " + ", ".join(f"{k} {v}" for k, v in versions.items())
            + f"; grace_dl kernels: {kernels()}")


def cpu() -> str:
    """`` (<model name>, family F model M)`` from /proc/cpuinfo, or "" where it cannot be
    read. Two hosts behind one kernel string can differ several times over: Zen 4 (AMD family
    25) runs the sparsifier scan's old AVX-512 compress-store in microcode, 7x slower."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return ""
    name = fields.get("model name")
    if not name:
        return ""
    ids = [f"{k} {fields[k]}" for k in ("cpu family", "model") if k in fields]
    return f" ({', '.join([name, *ids])})"


def kernels() -> str:
    """Whether grace_dl runs its compiled kernels here, and at what SIMD width."""
    from grace_dl import native

    if not native.available():
        return "NumPy twins (no compiled library)"
    bits = native.vector_bits()
    return f"compiled, {bits}-bit SIMD" if bits else "compiled, scalar"


def _table(columns, rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _step_times(records: list[dict], pipeline: str) -> dict:
    return {(r["model"], r["mbit"]): r["step_s"] for r in records
            if r.get("pipeline") == pipeline and "step_s" in r}


def e2e_rows(records: list[dict]) -> list[dict]:
    """One row per record; speedups against the two baselines a user compares with: fp32
    Horovod allreduce (``none``) and Horovod's fp16 compression (``hvd-fp16``), each from the
    same model and link speed ("n/a" where that baseline did not run or failed)."""
    baseline = _step_times(records, "none")
    fp16 = _step_times(records, "hvd-fp16")
    rows = []
    for r in records:
        row = {"model": r["model"], "Mbit/s": f"{r['mbit']:g}", "pipeline": r["pipeline"],
               "run": r.get("run", "older")
               + (f", median of {len(r['step_s_rounds'])} runs ("
                  + "/".join(f"{x * 1e3:.0f}" for x in r["step_s_rounds"]) + " ms)"
                  if r.get("step_s_rounds") else "")
               + (f", predicted at {r['predicted_at']}" if r.get("predicted_at") else "")}
        if "error" in r:
            row["step ms"] = "failed"
            rows.append(row)
            continue
        moved = max(r["sent_bytes"], r["received_bytes"])
        bound_s = moved * 8 / (r["mbit"] * 1e6)
        base = baseline.get((r["model"], r["mbit"]))
        half = fp16.get((r["model"], r["mbit"]))
        hidden = r["step_s"] <= r["compute_s"] + r["compress_s"]
        predicted = r.get("predicted_s")
        row.update({
            "step ms": f"{r['step_s'] * 1e3:.1f}",
            "predicted ms": f"{predicted * 1e3:.1f}" if predicted else "n/a",
            "predicted / step": f"{predicted / r['step_s']:.2f}" if predicted else "n/a",
            "speedup vs none": f"{base / r['step_s']:.2f}x" if base else "n/a",
            "speedup vs hvd-fp16": f"{half / r['step_s']:.2f}x" if half else "n/a",
            "sent MB/step": f"{r['sent_bytes'] / 1e6:.3f}",
            "recv MB/step": f"{r['received_bytes'] / 1e6:.3f}",
            "compute ms": f"{r['compute_s'] * 1e3:.1f}",
            "compress ms": f"{r['compress_s'] * 1e3:.1f}",
            "communicate ms": f"{r['communicate_s'] * 1e3:.1f}" if not hidden else "hidden",
            "bytes/bandwidth ms": f"{bound_s * 1e3:.1f}",
            "communicate / bound": (f"{r['communicate_s'] / bound_s:.2f}"
                                    if bound_s and not hidden else "n/a"),
        })
        rows.append(row)
    return rows


AUTO_COLUMNS = ["model", "Mbit/s", "auto ms", "auto vs none", "best fixed pipeline",
                "auto / best fixed", "predictions within 25%", "worst predicted / step"]


def auto_rows(records: list[dict]) -> list[dict]:
    """Per model and link speed of the same run: Auto against uncompressed Horovod and against
    the fastest fixed pipeline, and how many rows' predictions fall within 25% of the step."""
    rows = []
    groups = sorted({(r["model"], r["mbit"]) for r in records}, key=lambda k: (k[0], k[1]))
    for model, mbit in groups:
        rs = [r for r in records if (r["model"], r["mbit"]) == (model, mbit) and "step_s" in r]
        auto = next((r for r in rs if r["pipeline"] == "auto"), None)
        none = next((r for r in rs if r["pipeline"] == "none"), None)
        fixed = [r for r in rs if r["pipeline"] != "auto"]
        if auto is None or none is None or not fixed:
            continue
        best = min(fixed, key=lambda r: r["step_s"])
        ratios = [r["predicted_s"] / r["step_s"] for r in rs if r.get("predicted_s")]
        worst = max(ratios, key=lambda x: abs(x - 1), default=None)
        rows.append({
            "model": model, "Mbit/s": f"{mbit:g}", "auto ms": f"{auto['step_s'] * 1e3:.1f}",
            "auto vs none": f"{none['step_s'] / auto['step_s']:.2f}x",
            "best fixed pipeline": f"{best['pipeline']} {best['step_s'] * 1e3:.1f} ms",
            "auto / best fixed": f"{auto['step_s'] / best['step_s']:.2f}",
            "predictions within 25%": (f"{sum(0.75 <= x <= 1.25 for x in ratios)} of "
                                       f"{len(ratios)}" if ratios else "n/a"),
            "worst predicted / step": f"{worst:.2f}" if worst is not None else "n/a"})
    return rows


def convergence_rows(records: list[dict], target: float) -> list[dict]:
    rows = []
    for r in records:
        if "error" in r:
            rows.append({"pipeline": r["pipeline"], "final acc": "failed"})
            continue
        acc = r["accuracy"]
        reached = next((i + 1 for i, a in enumerate(acc) if a >= target), None)
        rows.append({"pipeline": r["pipeline"], "final acc": f"{acc[-1]:.4f}",
                     "best acc": f"{max(acc):.4f}",
                     "epochs to target": reached if reached else f"> {len(acc)}"})
    return rows


def time_to_accuracy(e2e: list[dict], conv: list[dict], target: float, model: str) -> list[dict]:
    """Estimated seconds to ``target`` accuracy = steps the digits run needed × the measured
    step time of ``model`` at each link speed (two measurements combined; labelled as such)."""
    steps_needed = {}
    for r in conv:
        if "error" in r:
            continue
        reached = next((i + 1 for i, a in enumerate(r["accuracy"]) if a >= target), None)
        if reached:
            steps_needed[r["pipeline"]] = reached * r["steps_per_epoch"]
    rows = []
    for r in e2e:
        if r.get("model") != model or "error" in r or r["pipeline"] not in steps_needed:
            continue
        rows.append({"Mbit/s": f"{r['mbit']:g}", "pipeline": r["pipeline"],
                     "steps to target": steps_needed[r["pipeline"]],
                     "est. seconds to target": f"{steps_needed[r['pipeline']] * r['step_s']:.1f}"})
    return rows


def plot_speedup(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in records})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        base = {r["mbit"]: r["step_s"] for r in records
                if r["model"] == model and r["pipeline"] == "none" and "step_s" in r}
        for pipeline in sorted({r["pipeline"] for r in records}):
            pts = sorted((r["mbit"], base[r["mbit"]] / r["step_s"]) for r in records
                         if r["model"] == model and r["pipeline"] == pipeline
                         and "step_s" in r and r["mbit"] in base)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=pipeline)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("link bandwidth (Mbit/s)")
        ax.set_ylabel("speedup over uncompressed Horovod")
        ax.set_title(model)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in records:
        if "error" not in r:
            ax.plot(range(1, len(r["accuracy"]) + 1), r["accuracy"], marker=".",
                    label=r["pipeline"])
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (digits)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: Path, target: float = 0.95, tta_model: str = "mlp") -> list[Path]:
    written = []
    stamp = f"Machine: {machine()}\n"
    e2e_path = results / "e2e.json"
    conv_path = results / "convergence.json"
    e2e = json.loads(e2e_path.read_text()) if e2e_path.exists() else []
    conv = json.loads(conv_path.read_text()) if conv_path.exists() else []
    if e2e:
        hosts = e2e[0].get("hosts")
        text = (f"# End-to-end step time over emulated hosts\n\n{stamp}\n"
                f"{hosts} hosts (network namespaces on one machine), each link shaped with tc "
                f"tbf in both directions, launcher {e2e[0].get('launcher')}. Every pipeline ran "
                "back to back at each link speed; speedup vs none = uncompressed (fp32) Horovod "
                "step time / pipeline step time, speedup vs hvd-fp16 = the same against "
                "Horovod's own fp16 compression, both from the same run. compute and compress "
                "are timed locally in the same process; communicate = step − compute − "
                "compress, \"hidden\" where compute + compress timed alone already exceed the "
                "step (sends overlap the backward pass). "
                "bytes/bandwidth = max(sent, received) bytes per step ÷ link speed. "
                "run = when and at which commit the row was measured (\"older\": before runs "
                "were labelled); predicted = the step model's time for the pipeline "
                "(grace_dl.strategy.step_model) from the job's own measurement on that link "
                "(benchmarks/results/calibration/), with the run's compute and update time; "
                "\"predicted at\" = the prediction was recomputed at that commit from the "
                "same measurement and times (python -m benchmarks.e2e --repredict); \"median of "
                "N runs\" = the pipeline ran N times round-robin with the others (--rounds N) and "
                "the row is its median run, every run's step listed.\n\n"
                + _table(E2E_COLUMNS, e2e_rows(e2e)) + "\n\n## Auto against the fixed pipelines"
                "\n\nPer model and link speed: Auto's step against uncompressed Horovod and "
                "against the fastest fixed pipeline of the same run (\"none\" and \"hvd-fp16\" "
                "count as fixed pipelines), and how many of the rows' predictions are within "
                "25% of the measured step.\n\n"
                + _table(AUTO_COLUMNS, auto_rows(e2e)) + "\n\n![speedup](speedup.png)\n")
        (results / "e2e.md").write_text(text)
        plot_speedup([r for r in e2e if "error" not in r], results / "speedup.png")
        written += [results / "e2e.md", results / "speedup.png"]
    if conv:
        text = (f"# Convergence on digits (2 ranks)\n\n{stamp}\n"
                f"Target accuracy {target}.\n\n"
                + _table(CONVERGENCE_COLUMNS, convergence_rows(conv, target)) + "\n\n")
        epochs = max((len(r.get("accuracy", [])) for r in conv), default=0)
        per_epoch = [{"pipeline": r["pipeline"], **{f"ep{i + 1}": f"{a:.3f}" for i, a in
                                                      enumerate(r.get("accuracy", []))}}
                     for r in conv]
        text += _table(["pipeline", *[f"ep{i + 1}" for i in range(epochs)]], per_epoch)
        tta = time_to_accuracy(e2e, conv, target, tta_model)
        if tta:
            text += (f"\n\n## Estimated time to {target} accuracy\n\nSteps the digits run "
                     f"needed × the measured `{tta_model}` step time at each link speed "
                     "(two measurements combined).\n\n"
                     + _table(["Mbit/s", "pipeline", "steps to target",
                               "est. seconds to target"], tta))
        text += "\n\n![accuracy](accuracy.png)\n"
        (results / "convergence.md").write_text(text)
        plot_accuracy(conv, results / "accuracy.png")
        written += [results / "convergence.md", results / "accuracy.png"]
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--target", type=float, default=0.95)
    args = ap.parse_args(argv)
    for path in write(Path(args.results), args.target):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
