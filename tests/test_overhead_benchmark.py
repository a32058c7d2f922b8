"""The overhead benchmark (benchmarks/overhead.py) on a tiny model: a real 2-rank horovodrun
job, pipelines alternating, phases timed by wrapping, one run per label in the results file."""

import pytest

from benchmarks import overhead, records, tables

pytestmark = pytest.mark.multiproc


def test_overhead_rows_phases_and_labels(tmp_path):
    out = tmp_path / "overhead.json"
    args = ["--model", "tiny", "--pipelines", "none", "grace-none", "topk", "--rounds", "2",
            "--steps", "2", "--out", str(out)]
    assert overhead.main([*args, "--label", "one", "--note", "first run"]) == 0
    assert overhead.main([*args, "--label", "two", "--jobs", "2"]) == 0
    doc = records.load(out)
    assert [run["id"] for run in doc["runs"]] == ["one", "two"]
    assert doc["runs"][0]["note"] == "first run" and "--label two" in doc["runs"][1]["command"]
    assert len(doc["runs"][0]["records"]) == 6     # compute, lockstep, floor, 3 more
    by = {(run["id"], r["pipeline"]): r for run in doc["runs"] for r in run["records"]}
    topk, hvd = by[("two", "topk")], by[("two", "none")]
    assert topk["compress_s"] > 0 and topk["issue_s"] > 0 and topk["complete_s"] > 0
    assert 0 < topk["sent_bytes"] < by[("two", "grace-none")]["sent_bytes"]
    assert "sent_bytes" not in hvd and hvd["total_s"] > 0
    for floor in ("lockstep", "floor"):
        assert by[("two", floor)]["total_s"] > 0 and "sent_bytes" not in by[("two", floor)]
    table = tables.overhead(doc)
    assert "Run `one`" in table and "Run `two`" in table and "first run" in table
    assert "÷ Horovod" in table
    # each round's median step, paired with Horovod's in the same round; both jobs' rounds
    assert len(topk["round_s"]) == 4 and min(topk["round_s"]) > 0
    assert topk["jobs"] == 2 and len(topk["job_ratio"]) == 2 and "jobs" not in by[("one", "topk")]
    assert "÷ Horovod per job" in table and "2 jobs" in table
    line = [x for x in table.splitlines() if x.startswith("| topk |")][-1]   # label "two"
    want = tables.paired(topk["round_s"], hvd["round_s"])
    assert "÷ Horovod per round" in table and want in line and "(" in want


def test_paired_ratio_is_the_median_of_the_rounds():
    assert tables.paired([1.0, 3.0, 2.0], [2.0, 2.0, 2.0]) == "1.00 (0.50-1.50)"
    assert tables.paired([1.0, 2.0], [1.0, 1.0]) == "1.50 (1.00-2.00)"
    assert tables.paired([1.0], [1.0, 2.0]) == "" and tables.paired(None, [1.0]) == ""
