"""Measure the running Horovod job for the step model (``grace_dl.strategy.step_model``).

    horovodrun -np 2 -H a:1,b:1 python -m grace_dl strategy measure -o measured.json

Run on every rank of the job (torch). Two things are timed, each call after a barrier, each
time the slowest rank's, the median of several calls after a warm-up (at least ``repeats``,
up to 8x as many where calls are cheap and Horovod's cycle makes single times noisy):

* **collectives**: Horovod's allreduce (float32 and float16: the fp16 sum runs on the CPU here
  and is slow), allgather, alltoall and broadcast, at three sizes in bytes; each gets a line
  ``latency_s + per_byte_s * bytes`` (``Fit.through``), so the per-byte part includes the wire,
  the copies and the reduction as this job does them, and a ``floor_s``, the cheapest call
  measured: no call costs less, however small the tensor.
* **pipelines**: every candidate pipeline end to end on square float32 tensors of three sizes:
  ``encode`` (``send``: compensate, compress, memory update, on the training thread) and
  ``exchange`` (``receive``: collectives, wait, decode, aggregate), each fitted per element.
  Where ``DistributedOptimizer`` sends a large gradient in pieces (``piece_bytes``, 4 MiB by
  default, for compressors that take any chunk alone: ``grace_dl.communicators.pieces``), the
  sizes above one piece are timed again sent that way, pieces received in lockstep, and stored
  as the entry's ``pieces``: what the optimizer's gradient costs, where a strategy's
  dispatcher (which sends whole) costs the whole tensor's.

* **overlap**: how much of an in-flight float32 allreduce a CPU-bound loop of matrix products
  hides, from 0 (none: communication and compute share the cores, as 2 ranks on 2 cores do) to
  1 (all: compute elsewhere, a GPU, or spare cores): ``(comm + work - both) / min(comm,
  work)``, clipped. Over a slow link that allreduce is mostly waiting on the link, which
  any loop hides. Its size is the largest allreduce measured under 0.1 s, 1 MB or more
  (``overlap_bytes``): over a fast link a small fixed call is over too soon for the ratio to
  mean anything (it scattered across the whole range from job to job; ``docs/DECISIONS.md``).
* **fp16_overlap**: the same for a float16 allreduce, sized the same way. Horovod sums float16
  on the CPU while the bytes travel, so over a link slow enough to hide the sum the call takes
  its bytes' time, yet the sum takes the core from the compute loop, so a loop hides much less
  of it than of a float32 call.
* **cpu_overlap**: the same ratio for a second thread's CPU work (copies of 4 MB, as Horovod's
  background thread copies and reduces) against the loop, on every rank at once: whether a
  rank's communication thread has a core of its own. The step model applies it to the part
  of the communication that is not bytes on the link.

Sizes grow (collectives to 32 MB, tensors to 8.4M elements) while a call is expected to take
under ``MAX_CALL_S``, so a measurement stays short even over a slow link, and the largest sizes
are as large as a step's traffic where that is cheap: a token-bucket link (tc tbf) lets a lone
burst-sized call through faster than a step's traffic.
"""

from __future__ import annotations

import os
import time

from grace_dl.communicators.base import AVERAGE
from grace_dl.communicators.pieces import (
    DEFAULT_PIECE_BYTES,
    effective_piece_bytes,
    piece_sizes,
    send_pieces,
)
from grace_dl.dtypes import itemsize
from grace_dl.strategy.pipeline import Pipeline
from grace_dl.strategy.step_model import Fit

COLLECTIVES = (("allreduce", "float32"), ("allreduce", "float16"), ("allgather", "float32"),
               ("alltoall", "float32"), ("broadcast", "float32"))
SIZES_BYTES = (4096, 1 << 20, 8 << 20, 32 << 20)
SHAPES = ((32, 32), (512, 512), (1448, 1448), (2896, 2896))
#: a size is measured only while its call is expected (from the last size, scaled) to take
#: less than this; the first two sizes always are
MAX_CALL_S = 0.25
#: seconds of calls per measured point beyond the minimum number of repeats
BUDGET_S = 0.25
_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def in_job() -> bool:
    """Whether this process was started by horovodrun or mpirun."""
    return any(v in os.environ for v in _RANK_VARS)


def _too_slow(points: dict, size: int) -> bool:
    """Whether a call at ``size`` is expected to exceed ``MAX_CALL_S`` (two sizes always run;
    the measured times are every rank's slowest, so every rank decides the same)."""
    if len(points) < 2:
        return False
    last = max(points)
    return points[last] * size / last > MAX_CALL_S


def _timed(fn):
    """``fn`` made to return the seconds it took."""
    def timed():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return timed


def _median_of_slowest(hvd, torch, fn, repeats: int):
    """Median of the slowest rank's seconds over several calls of ``fn`` (after one warm-up,
    each after a barrier), as ``fn()`` returns them: a number, or a tuple of parts (each part's
    median). At least ``repeats`` calls, more (up to 8x) where a call is cheap: as many as fit
    in ``BUDGET_S``, from the slowest rank's warm-up, so every rank makes the same number."""
    first = fn()
    warm = sum(first) if isinstance(first, tuple) else first
    warm = hvd.allreduce(torch.tensor([warm], dtype=torch.float64), op=hvd.Max,
                         name="grace.calibrate.warm").item()
    calls = int(min(8 * repeats, max(repeats, BUDGET_S / max(warm, 1e-6))))
    samples = []
    for _ in range(calls):
        hvd.barrier()
        out = fn()
        samples.append(out if isinstance(out, tuple) else (out,))
    worst = hvd.allreduce(torch.tensor(samples, dtype=torch.float64), op=hvd.Max,
                          name="grace.calibrate.times")
    medians = tuple(float(m) for m in worst.median(dim=0).values)
    return medians if isinstance(first, tuple) else medians[0]


def measure_collectives(repeats: int = 4, sizes=SIZES_BYTES, collectives=COLLECTIVES) -> list:
    """Fits of Horovod's collectives in this job (see the module docstring)."""
    import horovod.torch as hvd
    import torch

    size = hvd.size()
    out = []
    for name, dtype in collectives:
        wire = getattr(torch, dtype)
        points = {}
        for nbytes in sizes:
            if _too_slow(points, nbytes):
                break
            numel = max(size, nbytes // wire.itemsize // size * size)  # alltoall splits evenly
            # random values: the CPU's fp16 sum is several times slower on them than on ones
            data = torch.randn(numel, generator=torch.Generator().manual_seed(nbytes))
            call = _collective(hvd, name, data.to(wire),
                               f"grace.calibrate.{name}.{dtype}.{nbytes}")
            points[numel * wire.itemsize] = _median_of_slowest(hvd, torch, _timed(call), repeats)
        fit = Fit.through(points)
        out.append({"collective": name, "dtype": dtype, "latency_s": fit.latency_s,
                    "per_byte_s": fit.per_unit_s, "floor_s": fit.floor_s,
                    "points": {str(k): v for k, v in sorted(points.items())}})
    return out


def _collective(hvd, name: str, x, tag: str):
    """A blocking call of Horovod's ``name`` collective on ``x``."""
    if name == "allreduce":
        return lambda: hvd.synchronize(hvd.allreduce_async(x, name=tag, op=hvd.Sum))
    if name == "broadcast":
        return lambda: hvd.synchronize(hvd.broadcast_async(x, root_rank=0, name=tag))
    start = getattr(hvd, f"{name}_async")
    return lambda: hvd.synchronize(start(x, name=tag))


def measure_pipelines(candidates, repeats: int = 4, shapes=SHAPES,
                      piece_bytes: int | None = DEFAULT_PIECE_BYTES) -> list:
    """Encode and exchange fits of each candidate pipeline (dicts of GRACE keys) in this job,
    and where the optimizer would send in pieces of ``piece_bytes``, the fits of the sizes
    above one piece sent that way (``pieces``: the smaller sizes' points are the whole
    ones')."""
    import horovod.torch as hvd
    import torch

    out, seen = [], set()
    for params in candidates:
        pipeline = Pipeline.from_params(params)
        if pipeline in seen:
            continue
        seen.add(pipeline)
        comm = pipeline.build()
        points = _points(hvd, torch, comm, shapes, repeats, None)
        entry = {"pipeline": pipeline.label(), "params": pipeline.as_params(),
                 **_fits(points)}
        pieced = effective_piece_bytes(comm, piece_bytes)
        whole = {n for n in points if piece_sizes(n, itemsize("float32"), pieced) is None}
        large = [s for s in shapes if s[0] * s[1] in set(points) - whole]
        if large:
            points = {**{n: v for n, v in points.items() if n in whole},
                      **_points(hvd, torch, comm, large, repeats, pieced)}
            if len(points) >= 2:
                entry["pieces"] = {"piece_bytes": pieced, **_fits(points)}
        out.append(entry)
    return out


def _points(hvd, torch, comm, shapes, repeats: int, piece_bytes) -> dict:
    """``numel -> (encode s, exchange s)`` of float32 gradients of ``shapes`` (while a call is
    expected to be quick enough), sent whole or in pieces of ``piece_bytes``."""
    encode, exchange = {}, {}
    for shape in shapes:
        numel = shape[0] * shape[1]
        if _too_slow({n: encode[n] + exchange[n] for n in encode}, numel):
            break
        grad = torch.randn(*shape, generator=torch.Generator().manual_seed(numel))
        tag = f"calibrate.{numel}" if piece_bytes is None else f"calibrate.pieces.{numel}"
        encode[numel], exchange[numel] = _median_of_slowest(
            hvd, torch, _round_trip(comm, grad, tag, piece_bytes), repeats)
    return {n: (encode[n], exchange[n]) for n in encode}


def _fits(points: dict) -> dict:
    """A measurement entry's ``encode``/``exchange`` fits and ``points`` from ``points``."""
    enc = Fit.through({n: e for n, (e, _) in points.items()})
    exc = Fit.through({n: x for n, (_, x) in points.items()})
    return {"encode": enc.as_dict(), "exchange": exc.as_dict(),
            "points": {str(n): list(points[n]) for n in sorted(points)}}


def _round_trip(comm, grad, name: str, piece_bytes=None):
    """A function that sends ``grad`` through ``comm`` (whole, or in pieces of
    ``piece_bytes`` as ``DistributedOptimizer`` does, received in lockstep), receives it,
    closes the step, and returns the seconds of ``(send, receive)``."""
    sizes = piece_sizes(grad.numel(), grad.element_size(), piece_bytes)

    def round_trip():
        tensor = grad.clone()
        start = time.perf_counter()
        if sizes is None:
            handles = [comm.send(tensor, name, into=tensor)]  # as the optimizers send p.grad
        else:
            handles = send_pieces(comm, tensor.view(-1), name, AVERAGE, None, sizes)
        sent = time.perf_counter()
        if sizes is None:
            comm.receive(handles[0])
        else:
            comm.receive_all(handles)
        done = time.perf_counter()
        comm.end_step()
        return sent - start, done - sent
    return round_trip


def _sized_loop(hvd, torch, fn, seconds: float, repeats: int):
    """A function that calls ``fn`` for about ``seconds`` (as many calls as the slowest rank's
    median call fits, so every rank makes the same number)."""
    once = _median_of_slowest(hvd, torch, _timed(fn), 2 * repeats)
    calls = max(1, round(seconds / max(once, 1e-7)))

    def loop():
        for _ in range(calls):
            fn()
    return loop


def _hidden(t_a: float, t_b: float, t_both: float) -> float:
    """How much of the shorter of two activities ran hidden behind the other when both ran
    at once: ``(a + b - both) / min(a, b)``, clipped to [0, 1]."""
    return min(1.0, max(0.0, (t_a + t_b - t_both) / max(min(t_a, t_b), 1e-9)))


def measure_overlap(repeats: int = 4, nbytes: int = 1 << 20, dtype: str = "float32") -> float:
    """The fraction of an allreduce of ``nbytes`` of ``dtype`` that overlapping compute hides
    in this job (module docstring)."""
    import horovod.torch as hvd
    import torch

    wire = getattr(torch, dtype)
    data = torch.randn(nbytes // wire.itemsize,
                       generator=torch.Generator().manual_seed(1)).to(wire)
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(2))
    tag = f"grace.calibrate.overlap.{dtype}"

    def comm():
        hvd.synchronize(hvd.allreduce_async(data, name=tag, op=hvd.Sum))

    t_comm = _median_of_slowest(hvd, torch, _timed(comm), repeats)
    work = _sized_loop(hvd, torch, lambda: a @ a, t_comm, repeats)

    def both():
        handle = hvd.allreduce_async(data, name=tag, op=hvd.Sum)
        work()
        hvd.synchronize(handle)

    t_work = _median_of_slowest(hvd, torch, _timed(work), repeats)
    t_both = _median_of_slowest(hvd, torch, _timed(both), repeats)
    return _hidden(t_comm, t_work, t_both)


def overlap_bytes(collectives: list, dtype: str, most_s: float = 0.1) -> int:
    """The size for ``overlap`` (``dtype`` float32) or ``fp16_overlap`` (float16): the largest
    allreduce of ``dtype`` measured (``collectives``, as ``measure_collectives`` returns) that
    took under ``most_s``, and at least 1 MB. A call of a few ms is mostly Horovod's cycle and
    the ranks' scheduling, which swamp the ratio; a step's traffic is fused into buffers of
    many MB anyway."""
    sizes = [int(size) for c in collectives
             if (c["collective"], c["dtype"]) == ("allreduce", dtype)
             for size, seconds in c["points"].items() if seconds < most_s]
    return max([1 << 20, *sizes])


def measure_cpu_overlap(repeats: int = 4, nbytes: int = 4 << 20) -> float:
    """The fraction of a second thread's CPU work that a compute loop on this thread hides,
    on every rank at once (module docstring): NumPy copies, which release the GIL, against
    single-threaded matrix products, sized so that the thread's start is a small part."""
    import threading

    import horovod.torch as hvd
    import numpy as np
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(256, 256, generator=torch.Generator().manual_seed(2))
        src = np.random.default_rng(3).standard_normal(nbytes // 8)
        dst = np.empty_like(src)
        work = _sized_loop(hvd, torch, lambda: a @ a, 0.02, repeats)
        copy = _sized_loop(hvd, torch, lambda: np.copyto(dst, src), 0.02, repeats)

        def both():
            helper = threading.Thread(target=copy)
            helper.start()
            work()
            helper.join()

        t_work = _median_of_slowest(hvd, torch, _timed(work), repeats)
        t_copy = _median_of_slowest(hvd, torch, _timed(copy), repeats)
        t_both = _median_of_slowest(hvd, torch, _timed(both), repeats)
    finally:
        torch.set_num_threads(threads)
    return _hidden(t_work, t_copy, t_both)


def measure_job(candidates, repeats: int = 4, mbit: float | None = None) -> dict:
    """The job's sections of a measurement document: ``job`` (size, link, overlaps, seconds
    taken, in all and by part), ``collectives``, ``pipelines``."""
    import horovod.torch as hvd

    hvd.init()
    marks = [time.perf_counter()]

    def timed(measure, *args):
        out = measure(*args)
        marks.append(time.perf_counter())
        return out

    collectives = timed(measure_collectives, repeats)
    overlap = timed(measure_overlap, repeats, overlap_bytes(collectives, "float32"))
    fp16_overlap = timed(measure_overlap, repeats, overlap_bytes(collectives, "float16"),
                         "float16")
    cpu_overlap = timed(measure_cpu_overlap, repeats)
    pipelines = timed(measure_pipelines, candidates, repeats)
    parts = ("collectives", "overlap", "fp16_overlap", "cpu_overlap", "pipelines")
    return {"job": {"workers": hvd.size(), "mbit": mbit, "overlap": overlap,
                    "fp16_overlap": fp16_overlap, "cpu_overlap": cpu_overlap,
                    "seconds": round(marks[-1] - marks[0], 2),
                    "seconds_by_part": {k: round(b - a, 2)
                                        for k, a, b in zip(parts, marks, marks[1:])}},
            "collectives": collectives, "pipelines": pipelines}
