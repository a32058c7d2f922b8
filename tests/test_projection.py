"""The GPU-cluster projection (benchmarks/projection.py): the measured one-GPU step plus the
wire time the step model gives its payload, checked on a handmade steps record against the
formulas, and its labelled table on the benchmarks page."""

import pytest

from benchmarks import projection, records, report, tables
from grace_dl.strategy.variables import Variable

TINY = {"tiny": lambda: [Variable("w", (2048, 2048)), Variable("b", (2048,))]}
NUMEL = 2048 * 2048 + 2048


def _doc(steps_ms: dict) -> dict:
    rows = [{"model": "tiny", "pipeline": p, "params": NUMEL, "step_ms": ms}
            for p, ms in steps_ms.items()]
    return {"format": records.FORMAT, "benchmark": "gpu_steps", "title": "DDP steps on a GPU",
            "runs": [{"id": "h", "machine": "m", "commit": "abc1234", "when": "w",
                      "command": "python x", "records": rows}]}


STEPS = _doc({"DDP": 10.0, "grace topk 1% + residual": 12.0,
              "grace randomk 1% + residual": 11.0, "grace qsgd two-phase": 15.0,
              "grace terngrad": 13.0})


def _rows():
    return {r["pipeline"]: r for r in projection.project(STEPS, TINY)}


def test_ddp_is_the_measured_step_plus_the_ring_allreduce_the_backward_does_not_hide():
    ddp = _rows()["DDP"]
    for (n, gbit), ms in ddp["at"].items():
        # one 16.8 MB bucket, ready when the backward pass ends: nothing hides its allreduce
        wire = 2 * (n - 1) / n * NUMEL * 4 / (gbit * 1e9 / 8) + 2 * (n - 1) * 25e-6
        assert ms == pytest.approx(10.0 + 1e3 * wire, rel=1e-9)
        assert ddp["x_ddp"][(n, gbit)] == 1.0


def test_ddp_grows_with_n_and_shrinks_with_bandwidth():
    at = _rows()["DDP"]["at"]
    for gbit in projection.GBITS:
        assert at[(8, gbit)] < at[(64, gbit)]
    for n in projection.WORKERS:
        assert at[(n, 25)] > at[(n, 100)] > at[(n, 400)] > 10.0


def test_gathered_payloads_grow_with_n_and_summed_ones_do_not():
    rows = _rows()

    def on_link(label, n, steps):   # the wire time less the latency (one bucket, exposed)
        return rows[label]["at"][(n, 25)] - rows[label]["measured_ms"] - 1e3 * steps * 25e-6

    # allgather: (N-1) x the payload per rank, 9 times the bytes from 8 to 64 GPUs
    topk = [on_link("grace topk 1% + residual", n, n - 1) for n in (8, 64)]
    assert topk[1] == pytest.approx(63 / 7 * topk[0], rel=1e-6) and topk[0] > 0
    # ring allreduce: 2 (N-1)/N x the payload, 1.125 times from 8 to 64 GPUs
    randomk = [on_link("grace randomk 1% + residual", n, 2 * (n - 1)) for n in (8, 64)]
    assert randomk[1] == pytest.approx(126 / 64 / (14 / 8) * randomk[0], rel=1e-6)
    assert randomk[0] > 0
    terngrad = rows["grace terngrad"]["at"]     # in pieces, so not one exposed call: grows
    assert terngrad[(64, 25)] - 13.0 > 5 * (terngrad[(8, 25)] - 13.0) > 0


def test_compression_pays_only_where_the_link_is_slow():
    rows = _rows()
    randomk = rows["grace randomk 1% + residual"]["x_ddp"]
    assert randomk[(8, 25)] < 1 < randomk[(8, 400)]
    assert all(ms >= rows[p]["measured_ms"] for p in rows for ms in rows[p]["at"].values())


def test_the_committed_models_have_the_step_tables_parameter_counts():
    assert sum(v.numel for v in projection.resnet50()) == 25557032
    assert len(projection.resnet50()) == 161
    assert sum(v.numel for v in projection.decoder()) == 110025216
    doc = _doc({"DDP": 1.0})
    doc["runs"][0]["records"][0]["params"] = 7
    with pytest.raises(ValueError, match="counted 7 parameters"):
        projection.project(doc, TINY)


def test_the_section_renders_the_measured_table_then_the_projection(monkeypatch):
    with pytest.raises(ValueError, match="no parameter shapes for model 'tiny'"):
        tables.gpu_steps(STEPS)
    monkeypatch.setattr(projection, "MODELS", TINY)
    text = tables.gpu_steps(STEPS)
    measured = text.index("| tiny | DDP | 4196352 | 10 |")
    assert measured < text.index("### Projection (model, not measured)")
    assert "| DDP | tiny | 10 |" in text and "(1.00x)" in text


def test_an_unknown_pipeline_is_refused_by_name():
    with pytest.raises(ValueError, match="no projection for pipeline 'mystery'"):
        projection.choice_of("mystery")


def test_the_page_labels_the_projection_as_a_model():
    section = report.PAGE.read_text().split("## DDP steps on a GPU")[1]
    assert "### Projection (model, not measured)" in section
    assert "**A model, not a measurement**" in section
    assert "| pipeline | model | 1 GPU ms (measured) | N=8, 25 Gbit/s |" in section
