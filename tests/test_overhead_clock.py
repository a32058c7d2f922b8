"""The overhead benchmark's phase clock (benchmarks/overhead_worker.py), in one process."""

import torch

from benchmarks import overhead_worker
from benchmarks.overhead_worker import CLOCK, Clock, instrument
from grace_dl import grace_from_params
from grace_dl.communicators.base import Call, Communicator


class FakeTime:
    """``perf_counter`` that moves only when the test says so."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_a_phase_counts_its_own_time_less_the_timed_phases_inside_it(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(overhead_worker, "time", fake)
    clock = Clock()

    def inner():
        fake.now += 0.020

    def outer():
        fake.now += 0.010
        clock.timed("wait", inner)
        fake.now += 0.005

    clock.timed("complete", outer)
    clock.timed("wait", inner)
    spent = clock.take()
    assert spent.keys() == {"wait", "complete"}
    assert abs(spent["wait"] - 0.040) < 1e-12
    assert abs(spent["complete"] - 0.015) < 1e-12      # not the 35 ms the call took
    assert clock.take() == {}


def _unwrap(before: dict) -> None:
    """Undo what ``instrument`` wrapped since ``before`` (a copy of ``CLOCK.wrapped``)."""
    for (cls, method), had in list(CLOCK.wrapped.items()):
        if (cls, method) not in before:
            if had is None:
                delattr(cls, method)
            else:
                setattr(cls, method, had)
            del CLOCK.wrapped[(cls, method)]


def test_instrumenting_leaves_the_error_feedback_fused_into_compression():
    """The communicator's own ``compress`` stays unwrapped: the library fuses a dense
    compressor's error feedback into compression only where a communicator has not replaced
    it, so wrapping it had timed a pipeline without that fusion."""
    grc = grace_from_params({"compressor": "signsgd", "memory": "residual",
                             "communicator": "allgather"})
    before = dict(CLOCK.wrapped)
    instrument(grc)
    try:
        assert type(grc).compress is Communicator.compress
        encoded = grc.encode(torch.randn(1000), "w", Call(0, 2))
        assert encoded.approximation is None      # the error went in while compressing
        spent = CLOCK.take()
        assert spent["compress"] > 0 and spent["compensate"] > 0
    finally:    # the classes as they were, for the tests that run after this one
        _unwrap(before)


def test_instrumenting_leaves_buckets_adding_into_the_residual():
    """The timed ``encode`` says what it wraps, so a bucket's gradients are still added into
    the residual's slot (``communicators.base.accumulator``) in an instrumented job: with a
    bare lambda the benchmark had timed buckets that copy."""
    from grace_dl.communicators.base import accumulator

    grc = grace_from_params({"compressor": "randomk", "memory": "residual",
                             "communicator": "allreduce"})
    before = dict(CLOCK.wrapped)
    instrument(grc)
    try:
        assert type(grc).encode is not Communicator.encode      # wrapped
        assert accumulator(grc, "bucket", torch.zeros(10)) is not None
    finally:
        _unwrap(before)


def _job(base, topk, rounds):
    return [{"pipeline": "none", "total_s": base, "step_s": base / 2, "round_s": [base] * rounds,
             "label": "x"},
            {"pipeline": "topk", "total_s": topk, "step_s": topk / 2, "round_s": [topk] * rounds,
             "sent_bytes": 7, "label": "x"}]


def test_several_jobs_pool_into_medians_with_each_jobs_ratio():
    from benchmarks.overhead import pooled
    from benchmarks.tables import spread

    rows = pooled([_job(0.050, 0.035, 2), _job(0.070, 0.042, 2), _job(0.060, 0.040, 2)])
    none, topk = rows
    assert none["total_s"] == 0.060 and topk["total_s"] == 0.040 and topk["step_s"] == 0.020
    assert topk["round_s"] == [0.035, 0.035, 0.042, 0.042, 0.040, 0.040]
    assert topk["job_ratio"] == [0.035 / 0.050, 0.042 / 0.070, 0.040 / 0.060]
    assert topk["jobs"] == 3 and topk["sent_bytes"] == 7
    assert spread(topk["job_ratio"]) == "0.67 (0.60-0.70)" and spread([]) == ""
    one = _job(0.05, 0.04, 1)
    assert pooled([one]) is one


def test_jobs_below_one_are_refused_before_any_job_runs():
    import pytest

    from benchmarks import overhead

    with pytest.raises(SystemExit, match="--jobs must be at least 1, got 0"):
        overhead.main(["--jobs", "0", "--pipelines", "none"])
