"""The one format of ``benchmarks/results/*.json``, and where a benchmark's scratch output goes.

Every committed results file is one JSON object::

    {"format": "grace_dl.results/1",
     "benchmark": "e2e",                 # picks the section renderer in benchmarks/report.py;
                                         # a name it does not know gets the generic table
     "title": "End-to-end step time over emulated links",   # the section's heading
     "about": "what is measured and how to read it",          # optional, Markdown
     "columns": ["pipeline", "step ms"],  # optional: the generic table's columns, in order
     "runs": [{"id": "7a090af-gpm",       # unique in the file; a re-run with the same id
                                          # replaces it
               "machine": "Linux-...; 2 CPU cores (...); Python 3.11.7; torch 2.13.0+cpu, ...",
               "commit": "7a090af",        # the code that was measured
               "when": "2026-11-24 19:58",  # UTC
               "command": "python -m benchmarks.e2e --mbit 100 ...",
               "records": [{"pipeline": "topk", "step_s": 0.031}, ...],
               ...}]}                       # a run may carry more keys (e2e: its calibration)

``python -m benchmarks.report`` turns every such file into a section of ``docs/benchmarks.md``
with the machine, commit and command of each run, so a new benchmark appears there by writing
this shape (``record_run``); nothing else needs registering.

A benchmark writes into the checkout only when asked (``--out benchmarks/results/...``); by
default its results and its scratch files (calibrations, partial runs) go under
``scratch_dir()``, so a bare run leaves the work tree clean.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

FORMAT = "grace_dl.results/1"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RUN_KEYS = ("id", "machine", "commit", "when", "command", "records")


def scratch_dir(*parts: str) -> Path:
    """``$GRACE_DL_CACHE/benchmarks/<parts>`` (default ``~/.cache/grace_dl``, as scripts/setup.sh
    caches Horovod's wheel), created: where results and calibrations go unless a command is
    given ``--out`` / ``--calibration-dir``."""
    base = os.environ.get("GRACE_DL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "grace_dl")
    path = Path(base, "benchmarks", *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_out(name: str) -> Path:
    """Where benchmark ``name`` writes its results file when not given ``--out``."""
    return scratch_dir() / f"{name}.json"


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


def cpu() -> str:
    """`` (<model name>, cpu family F, model M)`` from /proc/cpuinfo, or "" where it cannot be
    read. Two hosts behind one kernel string can differ several times over (the family says
    which generation ran the numbers)."""
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


def machine() -> str:
    """This machine and the versions that shape a measurement, in one line (no date: a run's
    ``when`` holds that)."""
    versions = {"torch": _version("torch"),
                "tensorflow": _version("tensorflow", "tensorflow-cpu", "tensorflow-gpu"),
                "horovod": _version("horovod"), "numpy": _version("numpy")}
    return (f"{platform.platform()}; {os.cpu_count()} CPU cores{cpu()}; Python "
            f"{platform.python_version()}; " + ", ".join(f"{k} {v}" for k, v in versions.items())
            + f"; grace_dl kernels: {kernels()}")


def commit() -> str:
    """The checkout's short commit, ``+uncommitted changes`` when tracked files differ."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
        return head + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def now() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"


def new_run(run_id: str, command: str, records: list, **extra) -> dict:
    """A run measured here, now, at this checkout's commit."""
    return {"id": run_id, "machine": machine(), "commit": commit(), "when": now(),
            "command": command, "records": records, **extra}


def check(doc: dict, where: str = "results") -> dict:
    """``doc`` if it is a results file, else ``ValueError`` saying what is missing."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{where}: not a {FORMAT} file (its 'format' must be {FORMAT!r})")
    for key in ("benchmark", "title", "runs"):
        if key not in doc:
            raise ValueError(f"{where}: no {key!r}")
    ids = [run.get("id") for run in doc["runs"]]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: run ids repeat: {ids}")
    for run in doc["runs"]:
        missing = [k for k in RUN_KEYS if k not in run]
        if missing:
            raise ValueError(f"{where}: run {run.get('id')!r} has no {', '.join(missing)}")
    return doc


def load(path: Path) -> dict:
    return check(json.loads(Path(path).read_text()), str(path))


def dump(doc: dict) -> str:
    return json.dumps(check(doc), indent=1) + "\n"


def record_run(path: Path, benchmark: str, title: str, run: dict, about: str | None = None,
               columns: list[str] | None = None, keep: bool = True) -> dict:
    """Add ``run`` to the results file at ``path`` (created if missing) and write it back.

    With ``keep`` the file's other runs stay (a run with the same id is replaced in place);
    without, the file holds this run alone. ``about`` and ``columns`` are set when given."""
    path = Path(path)
    doc = load(path) if path.exists() else {"format": FORMAT, "benchmark": benchmark,
                                            "title": title, "runs": []}
    if doc["benchmark"] != benchmark:
        raise ValueError(f"{path} holds benchmark {doc['benchmark']!r}, not {benchmark!r}")
    runs = doc["runs"] if keep else []
    ids = [r["id"] for r in runs]
    if run["id"] in ids:
        runs[ids.index(run["id"])] = run
    else:
        runs.append(run)
    doc.update(runs=runs, title=title)
    if about is not None:
        doc["about"] = about
    if columns is not None:
        doc["columns"] = list(columns)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(doc))
    return doc


def up_to_date(path: Path, fresh: str, made_from: str, command: str) -> int:
    """A ``--check``: 0 (and says so) when the committed ``path`` holds ``fresh``, the text
    its generator makes now, else 1 and the ``command`` that regenerates it."""
    shown = path.relative_to(ROOT)
    if path.exists() and path.read_text() == fresh:
        print(f"{shown} is up to date")
        return 0
    print(f"{shown} differs from {made_from}: run {command}", file=sys.stderr)
    return 1
