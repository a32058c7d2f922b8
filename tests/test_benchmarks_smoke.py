"""The benchmark machinery in quick mode: 2 emulated hosts (network namespaces), one link
speed, a tiny model, uncompressed vs topk, one epoch of digits; the reports have every column."""

import json
import subprocess

import pytest

from benchmarks import e2e, e2e_worker, report, run
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


def test_e2e_merge_replaces_rerun_rows_in_place():
    old = [{"model": "mlp", "mbit": 100, "pipeline": p, "step_s": 1} for p in ("none", "auto")]
    new = [{"model": "mlp", "mbit": 100, "pipeline": "auto", "step_s": 2},
           {"model": "cnn", "mbit": 100, "pipeline": "auto", "step_s": 3}]
    assert [r["step_s"] for r in e2e.merge(old, new)] == [1, 2, 3]


def test_e2e_markdown_puts_each_variant_against_its_base_pipeline():
    runs = [{"model": "resnet18", "mbit": 1000.0, "pipeline": p, "step_s": s, "sent_bytes": 1,
             "received_bytes": 1, "compute_s": 0.2, "compress_s": 0.0, "communicate_s": 0.1}
            for p, s in (("none", 0.5), ("topk", 0.4), ("topk-bucket", 0.3))]
    text = e2e.markdown(runs, "python -m benchmarks.e2e --md x")
    assert "`python -m benchmarks.e2e --md x`" in text
    assert "| resnet18 | 1000 | topk-bucket | 300.0 | 400.0 | 0.75 |" in text
    assert "| topk | " not in text.split("## Variants")[1]


def test_e2e_rounds_keep_each_pipelines_median_run_whole():
    runs = [{"model": "mlp", "mbit": 100, "pipeline": "none", "step_s": s, "compute_s": c}
            for s, c in ((0.9, 1), (0.3, 2), (0.5, 3))]
    runs.insert(1, {"model": "mlp", "mbit": 100, "pipeline": "auto", "error": "boom"})
    none, auto = e2e.median_runs(runs)
    assert (none["step_s"], none["compute_s"]) == (0.5, 3)  # the median run, not a mix
    assert none["step_s_rounds"] == [0.9, 0.3, 0.5] and auto["error"] == "boom"


def test_e2e_repredict_recomputes_fixed_rows_from_their_own_measurement(tmp_path, monkeypatch):
    """A step-model change re-predicts the fixed pipelines' rows from the measurement each row
    names and its own compute/update times; Auto's rows (its strategy ran) stay as they are."""
    from benchmarks import pipelines
    from grace_dl.strategy.cost_model import FORMAT

    measured = tmp_path / "m.json"
    measured.write_text(json.dumps({
        "format": FORMAT, "entries": [], "job": {"workers": 2, "overlap": 0.0},
        "collectives": [{"collective": "allreduce", "dtype": "float32", "latency_s": 0.0,
                         "per_byte_s": 1e-8, "floor_s": 2e-3}]}))
    row = {"model": "tiny", "mbit": 1000, "step_s": 0.05, "compute_s": 0.01,
           "update_s": 0.001, "calibration": str(measured)}
    rows = [{**row, "pipeline": "none", "predicted_s": 9.0},
            {**row, "pipeline": "auto", "predicted_s": 9.0}]
    none, auto = e2e.repredict(rows)
    monkeypatch.setenv("GRACE_BENCH_CALIBRATION", str(measured))
    monkeypatch.setenv("GRACE_BENCH_MBIT", "1000")
    model = e2e_worker.build_model("tiny")[0]
    expected = pipelines.predict_step("none", model, compute_s=0.01) + 0.001
    assert none["predicted_s"] == pytest.approx(expected) and none["predicted_at"]
    assert 0.012 < none["predicted_s"] < 0.02  # serial: compute, one fused 2 ms floor, update
    assert auto == rows[1]


def test_quick_suite_writes_reports_with_every_column(tmp_path):
    assert run.main(["--quick", "--results", str(tmp_path)]) == 0
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert {r["pipeline"] for r in e2e} == {"none", "topk"}
    assert not [r for r in e2e if "error" in r], e2e
    topk = next(r for r in e2e if r["pipeline"] == "topk")
    none = next(r for r in e2e if r["pipeline"] == "none")
    assert 0 < topk["sent_bytes"] < none["sent_bytes"]
    # every row carries the step model's prediction from the job's measurement on that link
    assert all(r["predicted_s"] > 0 for r in e2e)
    assert json.loads((tmp_path / "calibration" / "e2e-1000mbit.json").read_text())["job"][
        "workers"] == 2
    table = (tmp_path / "e2e.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| model"))
    assert [c.strip() for c in header.strip("|").split("|")] == report.E2E_COLUMNS
    assert table.count("| tiny |") == 2 and "failed" not in table
    conv = (tmp_path / "convergence.md").read_text()
    assert all(c in conv for c in report.CONVERGENCE_COLUMNS)
    assert (tmp_path / "speedup.png").stat().st_size > 0
    assert (tmp_path / "accuracy.png").stat().st_size > 0


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
