"""The byte counters keep a bounded window of per-step history and exact running totals."""

import tracemalloc

import pytest

from grace_dl import grace_from_params
from grace_dl.communicators.counters import DEFAULT_WINDOW, ByteCounter


def _step(counter, i):
    for t in range(20):
        counter.add(f"layer{t}.weight", sent=100 + t, received=200 + i % 7)
    return counter.end_step()


def test_100k_end_steps_keep_memory_flat():
    counter = ByteCounter()
    tracemalloc.start()
    try:
        used = []
        for i in range(100_000):
            _step(counter, i)
            if (i + 1) % 25_000 == 0:
                used.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    # One step's summary here is ~3 KB: unbounded history grows ~75 MB per 25,000 steps.
    assert max(used) - min(used) < 500_000, used
    assert len(counter.steps) == DEFAULT_WINDOW
    assert counter.total["steps"] == 100_000


def test_window_keeps_the_latest_steps_and_totals_count_all():
    counter = ByteCounter(window=3)
    sums = [_step(counter, i) for i in range(10)]
    assert counter.steps == sums[-3:]
    assert counter.total == {"steps": 10, "sent": sum(s["sent"] for s in sums),
                             "received": sum(s["received"] for s in sums)}
    counter.reset()
    assert counter.steps == [] and counter.total == {"steps": 0, "sent": 0, "received": 0}


@pytest.mark.parametrize("window", [0, -1, 1.5, True, "10"])
def test_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="window must be a positive integer"):
        ByteCounter(window=window)


def test_communicators_use_the_bounded_counter():
    grc = grace_from_params({"compressor": "topk", "memory": "residual",
                             "communicator": "allgather", "compress_ratio": 0.1})
    assert isinstance(grc.bytes, ByteCounter)
    for _ in range(DEFAULT_WINDOW + 5):
        grc.end_step()
    assert len(grc.bytes.steps) == DEFAULT_WINDOW


@pytest.mark.parametrize("framework", ["torch", "tf-function"])
def test_bytes_are_counted_on_every_step_also_inside_a_traced_function(framework):
    """``wire.count`` with sizes known when the code is written (Python ints): torch adds them
    each time the line runs; inside ``tf.function`` a callback does, so a traced step counts on
    every call, not once at trace."""
    from types import SimpleNamespace

    from grace_dl.communicators import wire

    comm = SimpleNamespace(bytes=ByteCounter())
    if framework == "torch":
        from grace_dl.torch import ops

        def step():
            wire.count(comm, ops, "w", sent=40, received=8)
    else:
        tf = pytest.importorskip("tensorflow")
        from grace_dl.tensorflow import ops

        @tf.function
        def step():
            wire.count(comm, ops, "w", sent=40, received=8)
            return tf.constant(0)
    for _ in range(3):
        step()
    assert (comm.bytes.sent["w"], comm.bytes.received["w"]) == (120, 24)
