"""The benchmarks page: ``docs/benchmarks.md`` (and its plots) from ``benchmarks/results/*.json``.

    python -m benchmarks.report            # renders into a scratch directory, prints its path
    python -m benchmarks.report --write    # writes docs/benchmarks.md and docs/img/*.png
    python -m benchmarks.report --check    # exit 1 if docs/benchmarks.md is not the rendering

Every results file (``benchmarks/records.py`` format) becomes one section: its title, what it
measures, a table of its runs (id, date, commit, machine, command), then its tables
(``benchmarks/tables.py``; a benchmark without its own renderer gets one table per run).
Sections come in ``ORDER``, then any other benchmark by file name. The page depends on the JSON
alone (no date, no machine of the renderer), so it regenerates byte for byte; the plots are
PNGs written beside it with ``--write`` or ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import records, tables

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
ORDER = ["e2e", "ddp", "overhead", "hook_calls", "convergence", "recipes", "kernels", "compressors"]
# Everything but the runs' ids, dates and commands is in the tables; these say what a run is.
RUN_COLUMNS = ["run", "when (UTC)", "commit", "machine", "command"]


def load_all(results: Path) -> list[tuple[Path, dict]]:
    """Every results file in ``results`` (``ValueError`` for a JSON file in another format),
    in page order."""
    docs = [(path, records.load(path)) for path in sorted(Path(results).glob("*.json"))]
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(docs, key=lambda d: (rank.get(d[1]["benchmark"], len(ORDER)), d[0].name))


def _plot_name(path: Path) -> str:
    return f"{path.stem}.png"


def plot_speedup(doc: dict, out: Path) -> None:
    """Speedup over uncompressed Horovod against link speed, one panel per model; a pipeline
    keeps its colour across panels, variants (``-bucket``, ``-fused``, ...) are dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ratio = tables.speedups([r for r in tables.records_of(doc) if "error" not in r])
    models = list(dict.fromkeys(m for m, _, _ in ratio))
    pipelines = list(dict.fromkeys(p for _, _, p in ratio))
    colours = plt.get_cmap("tab20")
    cols = min(2, len(models))
    rows = -(-len(models) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), squeeze=False)
    for ax, model in zip(axes.flat, models):
        for i, pipeline in enumerate(pipelines):
            pts = sorted((b, v) for (m, b, p), v in ratio.items() if (m, p) == (model, pipeline))
            if pts:
                ax.plot(*zip(*pts), marker="o", color=colours(i % 20), label=pipeline,
                        ls="--" if "-" in pipeline.replace("hvd-", "").replace("-2phase", "")
                        else "-")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("link bandwidth (Mbit/s)")
        ax.set_ylabel("speedup over uncompressed")
        ax.set_title(model)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    legend = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(out, dpi=80, metadata={"Software": None})
    plt.close(fig)


def plot_accuracy(doc: dict, out: Path) -> None:
    """Test accuracy against epochs, one line per pipeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in tables.records_of(doc):
        if "error" not in r:
            ax.plot(range(1, len(r["accuracy"]) + 1), r["accuracy"], marker=".",
                    label=r["pipeline"])
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=80, metadata={"Software": None})
    plt.close(fig)


PLOTS = {"e2e": plot_speedup, "convergence": plot_accuracy}


def _anchor(title: str) -> str:
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -")
    return keep.replace(" ", "-")


def runs_table(doc: dict) -> str:
    rows = [{"run": f"`{r['id']}`", "when (UTC)": r["when"], "commit": f"`{r['commit']}`",
             "machine": r["machine"], "command": f"`{r['command']}`"} for r in doc["runs"]]
    return tables.table(RUN_COLUMNS, rows)


def section(path: Path, doc: dict, results_link: str, plot: str | None) -> str:
    render = tables.SECTIONS.get(doc["benchmark"], tables.generic)
    return "\n".join([
        f"## {doc['title']}", "",
        f"From [`{path.name}`]({results_link}/{path.name}).", "",
        *([doc["about"], ""] if doc.get("about") else []),
        runs_table(doc), "",
        render(doc, plot=plot).rstrip("\n"), ""])


def render(results: Path, results_link: str = "../benchmarks/results",
           images: str = "img") -> tuple[str, list[tuple[str, dict, str]]]:
    """The page's Markdown and the plots it links: ``(file name, doc, benchmark)`` each."""
    docs = load_all(results)
    plots, sections = [], []
    for path, doc in docs:
        plot = None
        if doc["benchmark"] in PLOTS:
            plot = f"{images}/{_plot_name(path)}"
            plots.append((_plot_name(path), doc, doc["benchmark"]))
        sections.append(section(path, doc, results_link, plot))
    contents = [f"- [{doc['title']}](#{_anchor(doc['title'])}) (`{path.name}`)"
                for path, doc in docs]
    head = [
        "# Benchmarks", "",
        "<!-- Generated by `python -m benchmarks.report --write` from benchmarks/results/*.json;"
        " edit those, not this page. -->", "",
        "Every table below is rendered from a committed results file; each section names the "
        "machine, commit and command of every run it shows. Ratios are taken within one run "
        "(pipelines alternating on the same machine) unless a row says otherwise; numbers from "
        "different runs or machines are not comparable cell by cell. The CPU numbers come from "
        "a shared 2-core host and guard against regressions; why each optimisation was kept or "
        "dropped, and what it measured, is in [DECISIONS.md](DECISIONS.md).", "",
        *contents, ""]
    return "\n".join(head + sections).rstrip("\n") + "\n", plots


def write(results: Path, out_dir: Path, results_link: str = "../benchmarks/results",
          plots: bool = True) -> list[Path]:
    """The page as ``out_dir/benchmarks.md`` and its plots under ``out_dir/img``."""
    text, figures = render(results, results_link)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "benchmarks.md").write_text(text)
    written = [out_dir / "benchmarks.md"]
    if plots:
        (out_dir / "img").mkdir(exist_ok=True)
        for name, doc, benchmark in figures:
            PLOTS[benchmark](doc, out_dir / "img" / name)
            written.append(out_dir / "img" / name)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(records.RESULTS),
                    help="directory of results files (default benchmarks/results)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--write", action="store_true",
                       help=f"write {PAGE.relative_to(ROOT)} and its plots in the checkout")
    where.add_argument("--out", default=None, help="write the page and its plots here")
    where.add_argument("--check", action="store_true",
                       help=f"exit 1 unless {PAGE.relative_to(ROOT)} is the rendering "
                            "of --results")
    args = ap.parse_args(argv)
    if args.check:
        return records.up_to_date(PAGE, render(Path(args.results))[0],
                                  f"the rendering of {args.results}",
                                  "python -m benchmarks.report --write")
    if args.write:
        out_dir, link = PAGE.parent, "../benchmarks/results"
    else:
        out_dir = Path(args.out) if args.out else records.scratch_dir("report")
        link = str(Path(args.results).resolve())
    for path in write(Path(args.results), out_dir, link):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
