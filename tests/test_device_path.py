"""The device path (``grace_dl.torch.device``, the speed paths of kind ``"cuda"``) run on CPU
tensors under ``emulate_device()``: every compressor x memory x communicator the registry
builds runs its steps without a host synchronisation (``sync_guard``; payloads whose size is
data-dependent by definition read one size), sends as many bytes as the reference path, and
gives the reference's results (the same, where the method is deterministic; as close to the
input, where it draws its randomness from another generator).

On a GPU, ``GRACE_DL_TEST_DEVICE=cuda python -m pytest tests/test_device_path.py`` runs the
same pipelines on CUDA tensors under ``torch.cuda.set_sync_debug_mode``: "error" (any
synchronisation fails the test), "warn" (counted) for the data-dependent sizes."""

from __future__ import annotations

import collections
import contextlib
import os
import warnings

import numpy as np
import pytest
import torch
from sync_guard import guarded

from grace_dl.compressors.paths import Paths
from grace_dl.registry import BUILTIN, lookup
from grace_dl.torch.kernels import emulate_device, interpreting
from support import OneRank

COMMUNICATORS = ["allreduce", "allgather", "broadcast", "twophase"]
MEMORIES = ["none", "residual", "dgc", "momentum", "efsignsgd", "powersgd"]
#: the methods whose payloads do not depend on random draws (nor on a sample's threshold)
DETERMINISTIC = {"none", "fp16", "bf16", "onebit", "efsignsgd", "signsgd", "signum", "topk",
                 "threshold", "u8bit", "inceptionn", "adaq"}
#: deterministic, but the device path's kernels sum in another order than the reference: where
#: the kernels run (a GPU, or Triton's interpreter) their means differ in rounding, which
#: two-phase's re-compression can turn into a sign
SUMMED = {"onebit", "efsignsgd"}
#: payload size depends on the data by definition: compress reads one count
SIZED = {"threshold", "dgc", "adaq", "inceptionn", "signsgd", "signum"}
SHAPES = {"w": (300, 256), "b": (37,), "e": (0,)}
PARAMS = {"threshold": {"threshold": 1.0}, "dgc": {"compress_ratio": 0.01},
          "topk": {"compress_ratio": 0.01}, "randomk": {"compress_ratio": 0.05},
          "adaq": {"compress_ratio": 0.05}}


def _build(comp, mem, comm):
    compressor = lookup("compressor", comp)(**PARAMS.get(comp, {}))
    memory = lookup("memory", mem)()
    return lookup("communicator", comm)(compressor, memory)


def _combos():
    out = []
    for comp in sorted(BUILTIN["compressor"]):
        for mem in MEMORIES:
            for comm in COMMUNICATORS:
                try:
                    _build(comp, mem, comm)
                except ValueError:
                    continue
                out.append((comp, mem, comm))
    return out


COMBOS = _combos()
DEVICE = torch.device(os.environ.get("GRACE_DL_TEST_DEVICE", "cpu"))
#: whether the device path's Triton kernels run (elsewhere their torch twins, which sum in
#: the reference's order)
KERNELS = DEVICE.type == "cuda" or interpreting()


@contextlib.contextmanager
def _watched(sized: bool):
    """What records host synchronisations: the CPU guard, or CUDA's sync debug mode ("error"
    where none is allowed; "warn", recorded, where the data sets a size)."""
    if DEVICE.type == "cpu":
        with guarded() as guard:
            yield guard.calls
        return
    torch.cuda.synchronize()
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn" if sized else "error")
        try:
            yield calls
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()     # (after the mode is off: an explicit sync counts too)
    calls += [("sync", "device path") for w in caught if "synchroniz" in str(w.message)]


def exchanging(where: str) -> bool:
    """Whether a host read recorded at ``where`` (``sync_guard``'s ``file:line function``) is
    a communicator's exchange of sizes (its collectives; the ops that only the wire calls:
    ragged blocks' counts, splits by received sizes), not a compressor's."""
    return where.startswith(("communicators/", "collectives.py", "torch/distributed.py")) or \
        where.endswith((" pack_ragged", " unpack_ragged", " split_by"))


def _gradients(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def _step(grc, grads):
    handles = [grc.send(g.clone(), name, collectives=OneRank()) for name, g in grads.items()]
    out = {name: grc.receive(h) for name, h in zip(grads, handles)}
    grc.end_step()
    return out


def _error(result, grads):
    return sum(float((result[k].double() - grads[k].double()).norm()) for k in grads)


def test_the_device_path_covers_every_builtin_compressor_it_speeds_up():
    """Which compressors have a speed path on the device, and that a user's subclass runs
    the reference there, visibly (``Paths.describe``)."""
    x = torch.randn(8)
    with emulate_device():
        have = {name for name in BUILTIN["compressor"]
                if type(Paths(lookup("compressor", name)()).on(x)).__name__ != "Reference"}
        sub = type("MyTopK", (lookup("compressor", "topk"),), {})
        paths = Paths(sub())
        paths.on(x)
    assert {"qsgd", "terngrad", "natural", "u8bit", "onebit", "efsignsgd", "signsgd", "signum",
            "topk", "dgc"} <= have
    assert paths.describe() == {"cuda": "Reference"}


@pytest.mark.parametrize("comp,mem,comm", COMBOS)
def test_device_path_runs_without_host_synchronisation(comp, mem, comm):
    reference, device = _build(comp, mem, comm), _build(comp, mem, comm)
    steps = [_gradients(i) for i in range(2)]   # a warm-up step (state is made), one watched
    expected = [_step(reference, g) for g in steps]
    sized = comp in SIZED and comm in ("allgather", "broadcast", "twophase")
    on_device = [{k: v.to(DEVICE) for k, v in g.items()} for g in steps]
    with emulate_device():
        got = [_step(device, on_device[0])]
        with _watched(sized) as seen:
            got += [_step(device, g) for g in on_device[1:]]
    got = [{k: v.cpu() for k, v in g.items()} for g in got]
    calls = collections.Counter(seen)
    if sized:
        # compress reads one count per non-empty tensor (two-phase compresses twice: the
        # chunk, then the server's re-compression), but where the communicator exchanges
        # the sizes itself and the path leaves its payload whole (signs on allgather and
        # two-phase: ``Call.exchanges_sizes``); the rest is the communicator's exchange of
        # the ranks' sizes (on a GPU both show as syncs, counted together: the bound is
        # four a compression there)
        sends = sum(1 for shape in SHAPES.values() if np.prod(shape)) * (len(steps) - 1) * \
            (2 if comm == "twophase" else 1)
        in_compress = sum(n for (_, where), n in calls.items() if not exchanging(where))
        if DEVICE.type == "cuda":
            sends *= 4
        elif comp in ("signsgd", "signum") and comm in ("allgather", "twophase"):
            sends = 0
        assert in_compress <= sends, calls
    else:
        assert not calls, f"host synchronisations on the device path: {dict(calls)}"
    if comp != "dgc":      # dgc's count follows its sample: another draw, another size
        assert reference.bytes.steps == device.bytes.steps
    for want, have, grads in zip(expected, got, steps):
        for name in grads:
            assert have[name].shape == want[name].shape and have[name].dtype == want[name].dtype
        exact = comp in DETERMINISTIC and not (KERNELS and comp in SUMMED)
        if exact and mem in ("none", "residual", "efsignsgd"):
            for name in grads:
                np.testing.assert_allclose(have[name].numpy(), want[name].numpy(), rtol=1e-5,
                                           atol=1e-6, err_msg=name)
        else:
            assert _error(have, grads) <= 1.25 * _error(want, grads) + 1e-3


def test_the_cpu_guard_records_each_kind_of_host_synchronisation():
    """What ``sync_guard`` stands in for CUDA's sync debug mode with: each of these would make
    the host wait for a GPU (or copy to it), and each is recorded; static-shape work is not."""
    x = torch.randn(16)
    cases = {
        "item": lambda: x.sum().item(), "tolist": lambda: x.tolist(),
        "__bool__": lambda: bool(x.sum() > 0), "__format__": lambda: f"{x.sum():.3f}",
        "__array__": lambda: np.asarray(x), "nonzero": lambda: torch.nonzero(x > 0),
        "where(condition)": lambda: torch.where(x > 0),
        "__getitem__[bool]": lambda: x[x > 0],
        "repeat_interleave(tensor)": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
        "tensor": lambda: torch.tensor([1.0, 2.0], device=x.device),
    }
    for what, call in cases.items():
        with guarded() as guard:
            call()
        assert what in [c for c, _ in guard.calls], (what, guard.calls)
    with guarded() as guard:
        torch.topk(x.abs(), 4).indices.sort()
        torch.where(x > 0, x, 0.0).sum()
        torch.nonzero_static(x > 0, size=4)
        x.repeat_interleave(torch.full((16,), 2), output_size=32)
        torch.tensor([1, 2])        # (made on the host, where it stays)
    assert guard.calls == []
