"""The benchmarks page (docs/benchmarks.md) is the rendering of the committed results, byte for
byte; results files share one format; a benchmark nobody registered still gets a section with
its machine, commit and command; rendering and benchmarks write into the checkout only when
asked."""

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import e2e, records, report, tables

ROOT = Path(__file__).resolve().parent.parent


def _run(run_id, rows, **extra):
    return {"id": run_id, "machine": "box; 1 CPU core", "commit": "abc1234",
            "when": "2026-11-27 10:00", "command": f"python -m benchmarks.x --id {run_id}",
            "records": rows, **extra}


def test_committed_page_is_the_rendering_of_the_committed_results():
    text, plots = report.render(records.RESULTS)
    assert report.PAGE.read_text() == text, "run: python -m benchmarks.report --write"
    for name, _, _ in plots:
        assert (report.PAGE.parent / "img" / name).stat().st_size > 0, name
    assert report.main(["--check"]) == 0


def test_results_are_few_and_all_in_the_one_format():
    files = [p for p in records.RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= 18, sorted(p.name for p in files)
    for path in files:
        assert path.suffix == ".json", path
        doc = records.load(path)
        for run in doc["runs"]:
            assert run["machine"] and run["commit"] and run["command"].startswith("python")


def test_a_new_benchmark_gets_a_section_with_its_provenance(tmp_path):
    doc = {"format": records.FORMAT, "benchmark": "gpu", "title": "GPU compressors",
           "about": "Each method against its textbook torch version.",
           "columns": ["method", "ms", "speedup"],
           "runs": [_run("h100", [{"method": "topk", "ms": 0.123456, "speedup": 3.0,
                                   "ignored": 1}])]}
    (tmp_path / "gpu.json").write_text(records.dump(doc))
    (tmp_path / "kernels.json").write_text((records.RESULTS / "kernels.json").read_text())
    text, plots = report.render(tmp_path)
    assert plots == []
    gpu = text.split("## GPU compressors")[1]
    assert text.index("## Compiled kernels") < text.index("## GPU compressors")  # ORDER first
    assert "Each method against its textbook torch version." in gpu
    assert "| `h100` | 2026-11-27 10:00 | `abc1234` | box; 1 CPU core | " \
           "`python -m benchmarks.x --id h100` |" in gpu
    assert "| method | ms | speedup |\n|---|---|---|\n| topk | 0.1235 | 3 |" in gpu
    assert "ignored" not in gpu


def test_a_json_file_in_another_format_is_refused_by_name(tmp_path):
    (tmp_path / "calibration.json").write_text(json.dumps({"format": "something/1"}))
    with pytest.raises(ValueError, match="calibration.json: not a grace_dl.results/1 file"):
        report.render(tmp_path)
    with pytest.raises(ValueError, match="run 'a' has no commit"):
        records.check({"format": records.FORMAT, "benchmark": "b", "title": "t",
                       "runs": [{k: v for k, v in _run("a", []).items() if k != "commit"}]})


def test_record_run_replaces_a_run_of_the_same_id_and_keeps_the_others(tmp_path):
    path = tmp_path / "x.json"
    records.record_run(path, "x", "X", _run("a", [{"v": 1}]), about="what")
    records.record_run(path, "x", "X", _run("b", [{"v": 2}]))
    doc = records.record_run(path, "x", "X", _run("a", [{"v": 3}]))
    assert [(r["id"], r["records"][0]["v"]) for r in doc["runs"]] == [("a", 3), ("b", 2)]
    assert records.load(path) == doc and doc["about"] == "what"
    alone = records.record_run(path, "x", "X", _run("c", []), keep=False)
    assert [r["id"] for r in alone["runs"]] == ["c"]
    with pytest.raises(ValueError, match="holds benchmark 'x', not 'y'"):
        records.record_run(path, "y", "Y", _run("d", []))


def test_e2e_speedups_take_the_baseline_of_the_same_run():
    rows = [{"run": run, "model": "m", "mbit": 100, "pipeline": p, "step_s": s}
            for run, p, s in (("a", "none", 2.0), ("a", "topk", 1.0),
                              ("b", "none", 4.0), ("b", "topk", 1.0), ("c", "topk", 0.5))]
    got = [row["speedup vs none"] for row in tables.e2e_rows(
        [{**r, "sent_bytes": 1, "received_bytes": 1, "compute_s": 0, "compress_s": 0,
          "communicate_s": 0} for r in rows])]
    # run c has no baseline of its own: the file's first one for that model and link
    assert got == ["1.00x", "2.00x", "1.00x", "4.00x", "4.00x"]


def _checkout_state() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--",
                           "docs", "benchmarks"], cwd=ROOT, capture_output=True,
                          text=True).stdout


def test_report_and_benchmarks_write_into_the_cache_unless_asked(tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.setenv("GRACE_DL_CACHE", str(tmp_path))
    before = _checkout_state()
    assert report.main([]) == 0
    out = tmp_path / "benchmarks" / "report"
    assert (out / "benchmarks.md").read_text().startswith("# Benchmarks")
    assert (out / "img" / "e2e.png").stat().st_size > 0
    # a bare benchmark command reads and writes its results file in the cache too
    assert records.default_out("e2e") == tmp_path / "benchmarks" / "e2e.json"
    records.default_out("e2e").write_text(records.dump(
        {"format": records.FORMAT, "benchmark": "e2e", "title": "t", "runs": []}))
    assert e2e.main(["--repredict"]) == 0
    assert "re-predicted 0 of 0 rows in " + str(tmp_path) in capsys.readouterr().out
    assert _checkout_state() == before
