"""Markdown tables of each benchmark's records (``benchmarks/records.py`` format), for the page
``python -m benchmarks.report`` writes and for what a benchmark prints when it finishes.

Everything here is a pure function of the records: the same JSON gives the same bytes, so the
committed ``docs/benchmarks.md`` can be checked against a fresh rendering. A section renderer
takes one results file and returns its Markdown below the heading and the list of runs;
``SECTIONS`` maps a ``benchmark`` name to its renderer, and any other name gets ``generic``.
"""

from __future__ import annotations

import json
import statistics

E2E_COLUMNS = ["model", "Mbit/s", "pipeline", "run", "step ms", "predicted ms", "predicted / step",
               "speedup vs none",
               "speedup vs hvd-fp16", "sent MB/step", "recv MB/step", "compute ms",
               "compress ms", "communicate ms", "bytes/bandwidth ms", "communicate / bound"]
CONVERGENCE_COLUMNS = ["pipeline", "final acc", "best acc", "epochs to target"]
AUTO_COLUMNS = ["model", "Mbit/s", "auto ms", "auto vs none", "best fixed pipeline",
                "auto / best fixed", "predictions within 25%", "worst predicted / step"]
PHASES = ("compensate", "compress", "memory_update", "issue", "wait", "complete", "other")


def cell(value) -> str:
    """One table cell: floats to 4 significant digits (whole numbers from 1000 up), lists
    joined with '/', ``None`` empty, '|' escaped."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        text = f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    elif isinstance(value, (list, tuple)):
        text = "/".join(cell(v) for v in value)
    elif isinstance(value, dict):
        text = json.dumps(value, sort_keys=True)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def table(columns, rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def records_of(doc: dict) -> list[dict]:
    """Every run's records, each tagged with its run's id (``run``)."""
    return [{**r, "run": run["id"]} for run in doc["runs"] for r in run["records"]]


# ------------------------------------------------------------------------------------ generic
def generic(doc: dict, plot: str | None = None) -> str:
    """One table per run: the file's ``columns``, else every key in order of appearance."""
    out = []
    for run in doc["runs"]:
        columns = doc.get("columns") or list(dict.fromkeys(k for r in run["records"] for k in r))
        columns = [c for c in columns if any(c in r for r in run["records"])]
        if len(doc["runs"]) > 1:
            out += [f"Run `{run['id']}`:", ""]
        out += [table(columns, run["records"]), ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- e2e
def _baselines(records: list[dict], pipeline: str) -> tuple[dict, dict]:
    """``pipeline``'s step per (run, model, link), and per (model, link) over every run."""
    same_run, any_run = {}, {}
    for r in records:
        if r.get("pipeline") == pipeline and "step_s" in r:
            same_run[(r.get("run"), r["model"], r["mbit"])] = r["step_s"]
            any_run.setdefault((r["model"], r["mbit"]), r["step_s"])
    return same_run, any_run


def _baseline(tables: tuple[dict, dict], r: dict):
    same_run, any_run = tables
    return same_run.get((r.get("run"), r["model"], r["mbit"]), any_run.get((r["model"], r["mbit"])))


def e2e_rows(records: list[dict]) -> list[dict]:
    """One row per record; speedups against the two baselines a user compares with: fp32
    Horovod allreduce (``none``) and Horovod's fp16 compression (``hvd-fp16``), each from the
    same run where it ran there, else from the same model and link speed ("n/a" where that
    baseline did not run or failed)."""
    baseline = _baselines(records, "none")
    fp16 = _baselines(records, "hvd-fp16")
    rows = []
    for r in records:
        rounds = r.get("step_s_rounds")
        row = {"model": r["model"], "Mbit/s": f"{r['mbit']:g}", "pipeline": r["pipeline"],
               "run": str(r.get("run", ""))
               + (f", median of {len(rounds)} (" + "/".join(f"{x * 1e3:.0f}" for x in rounds)
                  + " ms)" if rounds else "")
               + (f", predicted at {r['predicted_at']}" if r.get("predicted_at") else "")}
        if "error" in r:
            row["step ms"] = "failed"
            rows.append(row)
            continue
        moved = max(r["sent_bytes"], r["received_bytes"])
        bound_s = moved * 8 / (r["mbit"] * 1e6)
        base, half = _baseline(baseline, r), _baseline(fp16, r)
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


def speedups(records: list[dict]) -> dict:
    """(model, link, pipeline) -> the pipeline's step speedup over uncompressed Horovod."""
    baseline = _baselines(records, "none")
    out = {}
    for r in records:
        base = _baseline(baseline, r) if "step_s" in r else None
        if base and r["pipeline"] != "none":
            out[(r["model"], r["mbit"], r["pipeline"])] = base / r["step_s"]
    return out


def speedup_summary(records: list[dict]) -> str:
    """Model x link rows, one column per pipeline (in order of first appearance)."""
    ratio = speedups(records)
    pipelines = list(dict.fromkeys(p for _, _, p in ratio))
    models = list(dict.fromkeys(r["model"] for r in records))
    cells = sorted(dict.fromkeys((r["model"], r["mbit"]) for r in records),
                   key=lambda c: (models.index(c[0]), c[1]))
    rows = [{"model": m, "link": f"{b:g} Mbit/s",
             **{p: f"{ratio[(m, b, p)]:.2f}x" if (m, b, p) in ratio else "n/a"
                for p in pipelines}} for m, b in cells]
    return table(["model", "link", *pipelines], rows)


def auto_rows(records: list[dict]) -> list[dict]:
    """Per model and link speed: Auto against uncompressed Horovod and against the fastest
    fixed pipeline, and how many rows' predictions fall within 25% of the step."""
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


def variant_rows(records: list[dict], variants: dict) -> list[dict]:
    """Each variant's step over its base pipeline's (``benchmarks.pipelines.VARIANTS``), same
    run, model and link."""
    step = {(r.get("run"), r["model"], r["mbit"], r["pipeline"]): r["step_s"]
            for r in records if "step_s" in r}
    rows = []
    for (run, model, mbit, pipeline), s in step.items():
        base = step.get((run, model, mbit, variants.get(pipeline, ("",))[0]))
        if pipeline in variants and base:
            rows.append({"model": model, "Mbit/s": f"{mbit:g}", "variant": pipeline,
                         "variant ms": f"{1000 * s:.1f}", "base ms": f"{1000 * base:.1f}",
                         "variant / base": f"{s / base:.2f}"})
    return rows


def e2e(doc: dict, plot: str | None = None) -> str:
    records = records_of(doc)
    ok = [r for r in records if "error" not in r]
    out = ["**Speedup of the step over uncompressed Horovod** (`none`, the same run where it "
           "ran there), per model and link:", "", speedup_summary(ok), ""]
    if plot:
        out += [f"![speedup against link speed per model]({plot})", ""]
    out += ["Every row:", "", table(E2E_COLUMNS, e2e_rows(records)), ""]
    autos = auto_rows(ok)
    if autos:
        out += ["**Auto against the fixed pipelines** of the same model and link (`none` and "
                "`hvd-fp16` count as fixed), and how many rows' predictions are within 25% of "
                "the measured step:", "", table(AUTO_COLUMNS, autos), ""]
    try:
        from benchmarks.pipelines import VARIANTS
    except ImportError:             # the page renders without torch, minus this table
        VARIANTS = {}
    variants = variant_rows(ok, VARIANTS)
    if variants:
        out += ["**Variants against their base pipeline**, same run:", "",
                table(["model", "Mbit/s", "variant", "variant ms", "base ms", "variant / base"],
                      variants), ""]
    return "\n".join(out)


# -------------------------------------------------------------------------------- convergence
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


def convergence(doc: dict, plot: str | None = None, target: float = 0.95) -> str:
    records = records_of(doc)
    epochs = max((len(r.get("accuracy", [])) for r in records), default=0)
    per_epoch = [{"pipeline": r["pipeline"], **{f"ep{i + 1}": f"{a:.3f}" for i, a in
                                                  enumerate(r.get("accuracy", []))}}
                 for r in records]
    out = [f"Target accuracy {target}.", "", table(CONVERGENCE_COLUMNS,
                                                    convergence_rows(records, target)), "",
           "Test accuracy per epoch:", "",
           table(["pipeline", *[f"ep{i + 1}" for i in range(epochs)]], per_epoch), ""]
    if plot:
        out += [f"![accuracy against epochs]({plot})", ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------ recipes
RECIPE_TARGETS = {"digits": 0.95, "mixture": 0.85}
LINKS_MBIT = (100, 1000, 10000)


def steps_to(acc, target, steps_per_epoch):
    for epoch, a in enumerate(acc, 1):
        if a >= target:
            return epoch * steps_per_epoch
    return None


def recipes(doc: dict, plot: str | None = None) -> str:
    """Per task: mean final accuracy over seeds against uncompressed, bytes per step, an
    estimated time to the target per link speed, and accuracy per epoch of the first seed."""
    try:
        from benchmarks.convergence_recipes import PIPELINES
        roles = {label: spec[2] for label, spec in PIPELINES.items()}
    except ImportError:
        roles = {}
    records = records_of(doc)
    lines = []
    reused = sum(1 for r in records if r.get("reused"))
    if reused:
        lines += [f"{reused} of the {len(records)} records were taken from an earlier run's "
                  "file (`--reuse`: same pipeline, spec, optimizer momentum, task, seed and "
                  "epochs; a run is deterministic per seed).", ""]
    for task in sorted({r["task"] for r in records}):
        rows = [r for r in records if r["task"] == task and "error" not in r]
        target = RECIPE_TARGETS.get(task, 0.9)
        by: dict[str, list] = {}
        for r in rows:
            by.setdefault(r["pipeline"], []).append(r)
        base = by.get("none")
        base_final = (sum(r["accuracy"][-1] for r in base) / len(base)) if base else None
        lines += [f"**{task}** (target {target}):", "",
                  "| pipeline | opt mom. | epochs | final (mean) | vs none | final per seed | "
                  "best (mean) | mean sent KB/step | s/step | "
                  + " | ".join(f"est. time to {target} @ {m / 1000:g} Gbit/s (s)"
                               for m in LINKS_MBIT) + " | role |",
                  "|" + "---|" * (10 + len(LINKS_MBIT))]
        for label, rs in by.items():
            finals = [r["accuracy"][-1] for r in rs]
            final = sum(finals) / len(finals)
            best = sum(max(r["accuracy"]) for r in rs) / len(rs)
            sent = [r["sent_bytes_per_step"][-1] for r in rs if r.get("sent_bytes_per_step")]
            sent_b = sum(sent) / len(sent) if sent else float(rs[0].get("dense_bytes", 0))
            per_step = sum(r["seconds"] / (r["epochs"] * r["steps_per_epoch"]) for r in rs) \
                / len(rs)
            reach = [steps_to(r["accuracy"], target, r["steps_per_epoch"]) for r in rs]
            times = []
            for mbit in LINKS_MBIT:
                if any(s is None for s in reach):
                    times.append(f"> {rs[0]['epochs']} ep")
                else:
                    steps = sum(reach) / len(reach)
                    times.append(f"{steps * (per_step + sent_b * 8 / (mbit * 1e6)):.1f}")
            diff = "" if base_final is None else f"{(final - base_final) * 100:+.1f}"
            lines.append(
                f"| {label} | {rs[0]['momentum']:g} | {rs[0]['epochs']} | {final:.4f} | {diff} | "
                f"{' '.join(f'{f:.3f}' for f in finals)} | {best:.4f} | {sent_b / 1e3:.1f} | "
                f"{per_step * 1e3:.1f} ms | " + " | ".join(times)
                + f" | {roles.get(label, '')} |")
        lines.append("")
        first = min(r["seed"] for r in rows)
        width = max(len(r["accuracy"]) for r in rows)
        lines += [f"Accuracy per epoch ({task}, seed {first}):", "",
                  "| pipeline | " + " | ".join(f"ep{i + 1}" for i in range(width)) + " |",
                  "|" + "---|" * (1 + width)]
        for label, rs in by.items():
            for r in rs:
                if r["seed"] == first:
                    lines.append(f"| {label} | " + " | ".join(f"{a:.3f}" for a in r["accuracy"])
                                 + " |")
        lines.append("")
    failed = [r for r in records if "error" in r]
    if failed:
        lines += ["Failed runs: " + ", ".join(f"{r['pipeline']} {r['task']} seed {r['seed']}"
                                              for r in failed), ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- overhead
def spread(values) -> str:
    """``"0.68 (0.63-0.74)"``: median, lowest and highest; empty without values."""
    if not values:
        return ""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def paired(rounds, base_rounds) -> str:
    """The median of a pipeline's per-round step over Horovod's in the same round, with the
    lowest and highest: ``"0.68 (0.63-0.74)"``; empty without both."""
    if not rounds or not base_rounds or len(rounds) != len(base_rounds):
        return ""
    return spread([a / b for a, b in zip(rounds, base_rounds)])


def overhead_table(group: list[dict]) -> str:
    """One job's rows (``benchmarks/overhead.py``) as a table: step, ratios to Horovod's own
    step, and the time in each of grace's phases."""
    ms = lambda s: f"{1000 * s:.1f}"  # noqa: E731
    base = next((r["total_s"] for r in group if r["pipeline"] == "none"), None)
    base_rounds = next((r.get("round_s") for r in group if r["pipeline"] == "none"), None)
    rows = []
    for r in group:
        timed = "sent_bytes" in r  # a grace pipeline (Horovod's own have no phases)
        row = {"pipeline": r["pipeline"], "step ms": ms(r["total_s"]),
               "÷ Horovod": f"{r['total_s'] / base:.2f}" if base else ""}
        if any("round_s" in g for g in group):
            row["÷ Horovod per round"] = paired(r.get("round_s"), base_rounds)
        if any("job_ratio" in g for g in group):
            row["÷ Horovod per job"] = spread(r.get("job_ratio"))
        row.update({
            "fwd+bwd ms": ms(r["backward_s"]), "step() ms": ms(r["step_s"]),
            **{f"{p} ms": ms(r.get(p + "_s", 0.0)) if timed or p == "other" else ""
               for p in PHASES},
            "sent MB": f"{r['sent_bytes'] / 1e6:.2f}" if r.get("sent_bytes") else ""})
        if any("early_phases" in g for g in group):
            row["early phases"] = f"{r['early_phases']:g}" if "early_phases" in r else ""
        if r["pipeline"] in ("compute", "lockstep", "floor"):
            row["other ms"] = ""
        rows.append(row)
    return table(list(rows[0]), rows)


def overhead(doc: dict, plot: str | None = None) -> str:
    out = []
    for run in doc["runs"]:
        first = run["records"][0]
        jobs = f", {first['jobs']} jobs pooled" if first.get("jobs") else ""
        out += [f"Run `{run['id']}`: {first['model']}, {first['ranks']} ranks, loopback{jobs}."
                + (f" {run['note']}" if run.get("note") else ""), "",
                overhead_table(run["records"]), ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- ddp
def ddp_table(records: list[dict], accuracy: dict) -> str:
    """Pipelines x link speeds: the median over rounds of each run's median step, its ratio
    to DDP's, bytes sent and digits accuracy."""
    speeds = sorted({r["mbit"] for r in records})
    by: dict[tuple, list] = {}
    for r in records:
        by.setdefault((r["mbit"], r["pipeline"]), []).append(r)
    out = ["| pipeline | " + " | ".join(f"{m:g} Mbit/s step ms (vs DDP)" for m in speeds)
           + " | sent MB/step | digits accuracy, final (best) |",
           "|---|" + "---:|" * (len(speeds) + 2)]
    for p in dict.fromkeys(r["pipeline"] for r in records):
        cells, sent = [], None
        for m in speeds:
            runs = [r for r in by.get((m, p), []) if "error" not in r]
            base = [r for r in by.get((m, "ddp"), []) if "error" not in r]
            if not runs:
                cells.append("failed")
                continue
            step = statistics.median(r["step_s"] for r in runs)
            sent = statistics.median(r["sent_bytes"] for r in runs)
            ratio = (f" ({statistics.median(r['step_s'] for r in base) / step:.2f}x)"
                     if base else "")
            cells.append(f"{1e3 * step:.0f}{ratio}")
        acc = accuracy.get(p, {})
        acc_cell = (f"{100 * acc['accuracy'][-1]:.1f}% ({100 * max(acc['accuracy']):.1f}%)"
                    if "accuracy" in acc else "failed" if acc else "")
        sent_cell = f"{sent / 1e6:.3f}" if sent is not None else ""
        out.append(f"| {p} | " + " | ".join(cells) + f" | {sent_cell} | {acc_cell} |")
    rounds: dict[tuple, list] = {}
    for r in records:
        if "error" not in r:
            rounds.setdefault((r["mbit"], r["pipeline"]), []).append(f"{1e3 * r['step_s']:.0f}")
    out += ["", "Each round's median step (ms), in run order: " + "; ".join(
        f"{m:g} {p}: {', '.join(v)}" for (m, p), v in rounds.items()) + "."]
    failed = [r for r in records if "error" in r]
    if failed:
        out += ["", "Failed runs: " + ", ".join(f"{r['mbit']:g} {r['pipeline']}"
                                                for r in failed) + "."]
    return "\n".join(out)


def ddp(doc: dict, plot: str | None = None) -> str:
    out = []
    for run in doc["runs"]:
        if len(doc["runs"]) > 1:
            out += [f"Run `{run['id']}`:", ""]
        out += [ddp_table(run["records"], run.get("accuracy", {})), ""]
    return "\n".join(out)


def gpu_steps(doc: dict, plot: str | None = None) -> str:
    """The measured table, then the step model's projection of it to a cluster
    (``benchmarks/projection.py``: a model, labelled so)."""
    from benchmarks import projection

    return generic(doc).rstrip("\n") + "\n\n" + projection.markdown(doc)


# --------------------------------------------------------------------------------- hook calls
HOOK_CALLS_COLUMNS = ["pipeline", "calls", "target calls", "files", "target files",
                      "torch ops", "non-view ops", "Triton kernels", "grace tensors",
                      "top files (calls)"]


def hook_calls_rows(records: list[dict]) -> list[dict]:
    """One row per pipeline: its calls and files per step beside the issue's targets."""
    out = []
    for r in records:
        if "error" in r:
            out.append({"pipeline": r["pipeline"], "calls": "failed"})
            continue
        steps = r.get("calls_per_step", [r["calls"]])
        out.append({
            "pipeline": r["pipeline"],
            "calls": r["calls"] if len(set(steps)) == 1
            else f"{r['calls']} (steps: {'/'.join(map(str, steps))})",
            "target calls": f"<= {r['target_calls']}" if r.get("target_calls") else "",
            "files": r["files"],
            "target files": f"<= {r['target_files']}" if r.get("target_files") else "",
            "torch ops": r.get("torch_ops", ""),
            "non-view ops": r["torch_ops"] - r["torch_views"] if "torch_views" in r else "",
            "Triton kernels": r.get("triton_kernels", "") if r.get("path") == "device" else "",
            "grace tensors": r.get("grace_tensors"),
            "top files (calls)": ", ".join(f"{f} {n}" for f, n in r["top_files"][:4])})
    return out


def hook_calls_table(records: list[dict]) -> str:
    """The counts beside the targets, then each pipeline's busiest functions."""
    out = [table(HOOK_CALLS_COLUMNS, hook_calls_rows(records))]
    for r in records:
        if "error" not in r and r["top_functions"]:
            out += ["", f"`{r['pipeline']}`: the {len(r['top_functions'])} functions called "
                        f"most of its {r['calls']} calls (file:line qualified name):", "",
                    table(["calls", "function"], [{"calls": n, "function": f"`{f}`"}
                                                  for f, n in r["top_functions"]])]
    failed = [r for r in records if "error" in r]
    if failed:
        out += ["", "Failed: " + "; ".join(f"{r['pipeline']}: {r['error']}" for r in failed)]
    return "\n".join(out) + "\n"


def hook_calls(doc: dict, plot: str | None = None) -> str:
    out = []
    for run in doc["runs"]:
        if len(doc["runs"]) > 1:
            out += [f"Run `{run['id']}`:", ""]
        out += [hook_calls_table(run["records"])]
    return "\n".join(out)


SECTIONS = {"e2e": e2e, "convergence": convergence, "recipes": recipes, "overhead": overhead,
            "ddp": ddp, "gpu_steps": gpu_steps, "hook_calls": hook_calls}
