"""Where a step's time goes, per pipeline, run on every rank (launched by benchmarks/overhead.py).

Every pipeline gets its own copy of the model and its own optimizer, and the pipelines take
turns in one job (``--rounds`` rounds of ``--steps`` steps each), so their ratios come from the
same minutes of a shared, noisy machine. ``compute`` is the same model with no communication,
taking its turn too; ``lockstep`` is compute with one 4-byte Horovod allreduce before each SGD
update, as Horovod's optimizer synchronizes there: the ranks then run in step, both doing
their memory-bound update at once on the shared memory, with Horovod's background thread
alive. Every synchronized pipeline pays that (on the 2-core Zen 4 host Horovod's own SGD
update took 7.2 ms after its synchronize, 4.5 in ``compute``, 5.0 when its start was delayed
4 ms), so ``lockstep`` is the floor a pipeline's step is compared with. ``floor`` is lockstep
plus the two dense passes over the gradients that a sparsifier with residual error feedback
cannot skip (``Floor``): each gradient added into its residual in its hook, and ``p.grad``
rewritten (zeroed) before the update, where the result of a sparse exchange is written. What
a sparsifier's step takes beyond ``floor`` is its O(k) work, Python, and waiting for the
other rank.

Per step, rank 0 records (medians over the measured steps):

- ``backward_s``: forward + backward; grace's hooks encode and issue inside it;
- ``step_s``: ``optimizer.step()``: waiting for the collectives, completing them (decompress and
  aggregate), writing the gradients, the SGD update;
- ``total_s``: the two together: what a training loop sees; ``round_s`` its median in each
  round (the turns of one round are seconds apart, so ``benchmarks.overhead`` pairs them).

For grace pipelines, the phases are timed by wrapping the pipeline object's methods (no timer
lives in the library), each phase's time without the other phases timed inside it:
``compensate`` (the memory path's ``compensate``), ``compress`` (the communicator's ``encode``
without its compensate and memory update: with ``compress_with_error``, which writes the error
feedback while compressing, ``memory_update`` is ~0), ``memory_update`` (the memory's
``update``, and the local approximation), ``issue``, ``wait`` (``Collectives.synchronize``),
``complete``. The communicator's ``compress`` is not wrapped: the library checks that a
communicator has not replaced it before fusing the error feedback into it. ``other`` is
``total − compute − the phases``: the optimizer's own bookkeeping, the averaging division,
gradient writes, the SGD update and whatever the phases' allocations cost outside them.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time
from collections import defaultdict

import torch
import torch.nn as nn

import grace_dl.torch.horovod as hvd
from benchmarks.e2e_worker import build_model
from benchmarks.pipelines import GRACE, PIPELINES, VARIANTS, kernels_on, make_grace
from grace_dl import native
from grace_dl.collectives import Collectives

PHASES = ("compensate", "compress", "memory_update", "issue", "wait", "complete")


def resolve(pipeline: str, model):
    """``make_grace`` for the e2e names, and ``grace-<name>`` for ``GRACE[name]``."""
    if pipeline.startswith("grace-"):
        from grace_dl import grace_from_params

        return grace_from_params(dict(GRACE[pipeline[len("grace-"):]])), {}
    return make_grace(pipeline, model)


class Clock:
    """Seconds spent in each phase, for the pipeline whose turn it is: each timed call counts
    its own time less that of the timed calls inside it."""

    def __init__(self):
        self.spent = defaultdict(float)
        self.wrapped = {}     # (class, method name) -> what the class had before
        self.inside = []    # per timed call in progress: the time of the timed calls in it

    def timed(self, phase: str, fn, *args, **kwargs):
        self.inside.append(0.0)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total = time.perf_counter() - t0
            self.spent[phase] += total - self.inside.pop()
            if self.inside:
                self.inside[-1] += total

    def wrap(self, obj, method: str, phase: str):
        """Time ``method`` of ``obj``'s class (the class, not the instance: an instance
        attribute would enter the configuration that ranks compare)."""
        cls = type(obj)
        if (cls, method) in self.wrapped:
            return
        inner = getattr(cls, method)
        self.wrapped[(cls, method)] = vars(cls).get(method)

        @functools.wraps(inner)     # says what it wraps: the library's checks look through it
        def timed(*args, **kwargs):
            return self.timed(phase, inner, *args, **kwargs)

        setattr(cls, method, timed)

    def take(self) -> dict:
        out, self.spent = dict(self.spent), defaultdict(float)
        return out


CLOCK = Clock()


def instrument(grc) -> None:
    if grc is None or not hasattr(grc, "compressor"):
        return
    CLOCK.wrap(grc.feedback, "compensate", "compensate")   # the memory's path
    CLOCK.wrap(grc, "encode", "compress")     # less the compensate and update inside it
    CLOCK.wrap(grc.feedback, "update", "memory_update")
    CLOCK.wrap(grc, "approximate", "memory_update")
    CLOCK.wrap(grc, "issue", "issue")
    CLOCK.wrap(grc, "complete", "complete")


def instrument_waits() -> None:
    """Every engine's ``synchronize`` counts as waiting."""
    for cls in _subclasses(Collectives):
        if "synchronize" in vars(cls):
            inner = cls.synchronize
            cls.synchronize = lambda self, handle, _inner=inner: CLOCK.timed("wait", _inner,
                                                                             self, handle)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


class Lockstep:
    """``sgd`` whose ``step`` first waits for a 4-byte allreduce across the ranks."""

    def __init__(self, sgd):
        self.sgd = sgd
        self.token = torch.zeros(1)

    def zero_grad(self):
        self.sgd.zero_grad()

    def step(self):
        hvd.allreduce(self.token, name="overhead.lockstep")
        self.sgd.step()


class Floor(Lockstep):
    """``Lockstep`` plus the dense passes of residual error feedback with a sparse result: a
    post-accumulate hook adds each gradient into a residual of its own (what
    ``ResidualFeedback.compensate`` does), and ``step`` zeroes every ``p.grad`` after the
    allreduce (where ``sparse_sum`` writes the k values' sum) before the SGD update."""

    def __init__(self, sgd, model):
        super().__init__(sgd)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.residuals = {p: torch.zeros_like(p) for p in self.params}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.compensate)

    def compensate(self, p):
        self.residuals[p].add_(p.grad)

    def step(self):
        hvd.allreduce(self.token, name="overhead.floor")
        for p in self.params:
            p.grad.zero_()
        self.sgd.step()


FLOORS = {"compute": lambda sgd, model: sgd, "lockstep": lambda sgd, model: Lockstep(sgd),
          "floor": Floor}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--pipelines", nargs="+", required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    unknown = [p for p in args.pipelines
               if p not in PIPELINES and p not in VARIANTS
               and not (p.startswith("grace-") and p[6:] in GRACE)]
    if unknown:
        raise SystemExit(f"unknown pipelines {unknown}; known: {sorted([*PIPELINES, *VARIANTS])} "
                         f"and {['grace-' + g for g in GRACE]}")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    hvd.init()
    import grace_dl.torch.collectives  # noqa: F401  (the engine whose waits are timed)

    instrument_waits()
    base, shape = build_model(args.model)
    x = torch.randn(args.batch, *shape)
    y = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()

    runs = {}
    for name in [*FLOORS, *args.pipelines]:
        model = copy.deepcopy(base)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if name in FLOORS:
            runs[name] = (model, FLOORS[name](sgd, model), None)
            continue
        grc, kwargs = resolve(name, model)
        instrument(grc)
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), grace=grc,
                                       **kwargs)
        runs[name] = (model, opt, grc)

    times = {name: defaultdict(list) for name in runs}

    def one_step(name, record: bool):
        model, opt, _ = runs[name]
        native.use(kernels_on(name))
        CLOCK.take()
        opt.zero_grad()
        early = getattr(opt, "phases_completed_early", None)
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        spent = CLOCK.take()
        if record:
            row = times[name]
            row["backward_s"].append(t1 - t0)
            row["step_s"].append(t2 - t1)
            row["total_s"].append(t2 - t0)
            for phase in PHASES:
                row[phase + "_s"].append(spent.get(phase, 0.0))
            if early is not None:
                row["early_phases"].append(opt.phases_completed_early - early)

    for name in runs:
        for _ in range(args.warmup):
            one_step(name, False)
    for _ in range(args.rounds):
        for name in runs:
            for _ in range(args.steps):
                one_step(name, True)

    if hvd.rank() == 0:
        compute = statistics.median(times["compute"]["total_s"])
        rows = []
        for name, row in times.items():
            rec = {"model": args.model, "pipeline": name, "ranks": hvd.size(),
                   **{k: statistics.median(v) for k, v in row.items()}}
            # each round's median step: the rounds pair every pipeline with Horovod's own
            # turn seconds apart, so per-round ratios see less of the host's drift
            totals = row["total_s"]
            rec["round_s"] = [statistics.median(totals[i:i + args.steps])
                              for i in range(0, len(totals), args.steps)]
            phases = sum(rec.get(p + "_s", 0.0) for p in PHASES)
            rec["compute_s"] = compute
            rec["other_s"] = max(0.0, rec["total_s"] - compute - phases) if name != "compute" \
                else 0.0
            grc = runs[name][2]
            if grc is not None and getattr(grc, "bytes", None) is not None:
                steps = grc.bytes.steps[-args.rounds * args.steps:]
                if steps:   # a 1-rank job sends nothing
                    rec["sent_bytes"] = statistics.median(s["sent"] for s in steps)
            rows.append(rec)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
