"""The benchmark machinery in quick mode: 2 emulated hosts (network namespaces), one link
speed, a tiny model, uncompressed vs topk, one epoch of digits; the reports have every column."""

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from benchmarks import e2e, e2e_worker, records, run, tables
from benchmarks.network import EmulatedCluster, cleanup_stale

pytestmark = pytest.mark.multiproc


def test_cluster_links_are_shaped_and_cleaned_up():
    with EmulatedCluster(2, mbit=50, prefix="gracetest") as cluster:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(ns in names for ns in cluster.namespaces)
        qdisc = subprocess.run(["tc", "-n", cluster.namespaces[1], "qdisc", "show", "dev",
                                "eth0"], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "50Mbit" in qdisc
        # host 0 reaches host 1 over the bridge: nothing listens on port 9, so the answer is
        # a refusal from host 1 (an unreachable host would time out or say so)
        probe = subprocess.run(cluster.in_host(0, [
            "python3", "-c", "import socket; s=socket.create_connection(('%s', 9), 2)"
            % cluster.addresses[1]]), capture_output=True, text=True)
        assert "ConnectionRefusedError" in probe.stderr, probe.stderr
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "gracetest" not in names
    assert cleanup_stale("gracetest") == []


def test_bad_cluster_arguments_are_rejected():
    with pytest.raises(ValueError, match="n_hosts must be >= 2, got 1"):
        EmulatedCluster(1)
    with pytest.raises(ValueError, match=r"mbit must be in \(0, 100000\], got 0"):
        EmulatedCluster(2, mbit=0)


def _run(run_id, rows):
    return {"id": run_id, "machine": "m", "commit": "c", "when": "w", "command": "x",
            "records": rows}


def test_e2e_merge_drops_rerun_rows_from_older_runs():
    old = [_run("a", [{"model": "mlp", "mbit": 100, "pipeline": p, "step_s": 1}
                      for p in ("none", "auto")]),
           _run("b", [{"model": "mlp", "mbit": 100, "pipeline": "topk", "step_s": 1}])]
    new = [_run("c", [{"model": "mlp", "mbit": 100, "pipeline": "auto", "step_s": 2},
                      {"model": "mlp", "mbit": 100, "pipeline": "topk", "step_s": 3}])]
    merged = e2e.merge(old, new)
    assert [r["id"] for r in merged] == ["a", "c"]      # b had nothing left
    assert [r["pipeline"] for r in merged[0]["records"]] == ["none"]


def test_e2e_section_puts_each_variant_against_its_base_pipeline():
    rows = [{"model": "resnet18", "mbit": 1000.0, "pipeline": p, "step_s": s, "sent_bytes": 1,
             "received_bytes": 1, "compute_s": 0.2, "compress_s": 0.0, "communicate_s": 0.1}
            for p, s in (("none", 0.5), ("topk", 0.4), ("topk-bucket", 0.3))]
    text = tables.e2e({"runs": [_run("r", rows)]})
    assert "| resnet18 | 1000 | topk-bucket | 300.0 | 400.0 | 0.75 |" in text
    assert "| topk | " not in text.split("Variants against")[1]
    assert "| resnet18 | 1000 Mbit/s | 1.25x | 1.67x |" in text      # the summary


def test_e2e_rounds_keep_each_pipelines_median_run_whole():
    runs = [{"model": "mlp", "mbit": 100, "pipeline": "none", "step_s": s, "compute_s": c}
            for s, c in ((0.9, 1), (0.3, 2), (0.5, 3))]
    runs.insert(1, {"model": "mlp", "mbit": 100, "pipeline": "auto", "error": "boom"})
    none, auto = e2e.median_runs(runs)
    assert (none["step_s"], none["compute_s"]) == (0.5, 3)  # the median run, not a mix
    assert none["step_s_rounds"] == [0.9, 0.3, 0.5] and auto["error"] == "boom"


def test_e2e_repredict_recomputes_fixed_rows_from_their_runs_measurement(monkeypatch):
    """A step-model change re-predicts the fixed pipelines' rows from the measurement their run
    keeps and their own compute/update times; Auto's rows (its strategy ran) stay as they
    are."""
    from benchmarks import pipelines
    from grace_dl.strategy.cost_model import FORMAT

    measured = {"format": FORMAT, "entries": [], "job": {"workers": 2, "overlap": 0.0},
                "collectives": [{"collective": "allreduce", "dtype": "float32",
                                 "latency_s": 0.0, "per_byte_s": 1e-8, "floor_s": 2e-3}]}
    row = {"model": "tiny", "mbit": 1000, "step_s": 0.05, "compute_s": 0.01, "update_s": 0.001}
    rows = [{**row, "pipeline": "none", "predicted_s": 9.0},
            {**row, "pipeline": "auto", "predicted_s": 9.0}]
    (run,) = e2e.repredict([{**_run("r", rows), "calibration": {"1000": measured}}])
    none, auto = run["records"]
    assert none["predicted_at"] and auto == rows[1]
    assert 0.012 < none["predicted_s"] < 0.02  # serial: compute, one fused 2 ms floor, update
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.json"
        path.write_text(json.dumps(measured))
        monkeypatch.setenv("GRACE_BENCH_CALIBRATION", str(path))
        monkeypatch.setenv("GRACE_BENCH_MBIT", "1000")
        model = e2e_worker.build_model("tiny")[0]
        expected = pipelines.predict_step("none", model, compute_s=0.01) + 0.001
    assert none["predicted_s"] == pytest.approx(expected)


def test_quick_suite_writes_results_and_the_page(tmp_path, monkeypatch):
    monkeypatch.setenv("GRACE_DL_CACHE", str(tmp_path / "cache"))
    assert run.main(["--quick", "--results", str(tmp_path)]) == 0
    doc = records.load(tmp_path / "e2e.json")
    (e2e_run,) = doc["runs"]
    rows = e2e_run["records"]
    assert {r["pipeline"] for r in rows} == {"none", "topk"}
    assert not [r for r in rows if "error" in r], rows
    topk = next(r for r in rows if r["pipeline"] == "topk")
    none = next(r for r in rows if r["pipeline"] == "none")
    assert 0 < topk["sent_bytes"] < none["sent_bytes"]
    # every row carries the step model's prediction from the job's measurement, which the run
    # keeps beside its rows
    assert all(r["predicted_s"] > 0 for r in rows)
    assert e2e_run["calibration"]["1000"]["job"]["workers"] == 2
    assert e2e_run["machine"] and e2e_run["commit"] and "benchmarks.e2e" in e2e_run["command"]
    page = (tmp_path / "benchmarks.md").read_text()
    header = next(line for line in page.splitlines() if line.startswith("| model | Mbit/s |"))
    assert [c.strip() for c in header.strip("|").split("|")] == tables.E2E_COLUMNS
    assert page.count("| tiny | 1000 |") == 2 and "failed" not in page
    assert all(c in page for c in tables.CONVERGENCE_COLUMNS)
    assert (tmp_path / "img" / "e2e.png").stat().st_size > 0
    assert (tmp_path / "img" / "convergence.png").stat().st_size > 0


def test_pipeline_cpu_compares_code_trees_in_one_table(tmp_path):
    """The CPU benchmark runs every pipeline on every code tree (here the same tree twice)
    and writes a table with one column per tree and the ratio to the first."""
    from benchmarks import pipeline_cpu

    out = tmp_path / "cpu.json"
    root = str(pipeline_cpu.ROOT)
    assert pipeline_cpu.main(["--pipelines", "qsgd-2phase", "powersgd", "--shape", "50", "100",
                              "--steps", "2", "--warmup", "1", "--rounds", "1",
                              "--code", root, root, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["ms"]) == {"qsgd-2phase", "powersgd"} and result["shape"] == [50, 100]
    assert all(len(per_tree[root]) == 2 and min(per_tree[root]) > 0
               for per_tree in result["ms"].values())
    table = out.with_suffix(".md").read_text()
    assert "| qsgd-2phase |" in table and "÷" in table and "shape 50 x 100" in table
    with pytest.raises(SystemExit, match="unknown pipelines"):
        pipeline_cpu.main(["--pipelines", "nosuch"])
