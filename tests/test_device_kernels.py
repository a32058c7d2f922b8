"""The device path's Triton kernels, run by Triton's interpreter on the CPU, equal their torch
twins (``tests/kernel_checks.py``; a subprocess, since ``TRITON_INTERPRET`` is read when
Triton compiles the kernels' source). And the keyed Philox words are Philox-4x32-10's."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import torch

from grace_dl.torch.kernels import philox

ROOT = Path(__file__).resolve().parent.parent


def test_triton_kernels_equal_their_twins_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "kernel_checks.py")], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("kernels equal their twins") == 3


def test_every_kernel_compiles_for_a_hopper_gpu():
    """What the interpreter does not check: each kernel goes through Triton's compiler and
    ptxas for sm_90 (no GPU needed)."""
    from kernel_checks import SIGNATURES, compile_all

    assert compile_all(90) == [name for _, name, _, _ in SIGNATURES]


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox-4x32-10 (counter, key -> output)."""
    def one(counter, key):
        c = [torch.tensor([v], dtype=torch.int64) for v in counter]
        return [int(o) for o in philox._rounds_twin(*c, *key)]
    assert one((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert one((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == \
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert one((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_keyed_draws_depend_on_every_part_of_the_key():
    like = torch.empty(0)
    base = philox.words(philox.device_key(1, "a"), 2, 0, 64, like)
    assert torch.equal(base, philox.words(philox.device_key(1, "a"), 2, 0, 64, like))
    for other in (philox.words(philox.device_key(2, "a"), 2, 0, 64, like),
                  philox.words(philox.device_key(1, "b"), 2, 0, 64, like),
                  philox.words(philox.device_key(1, "a"), 3, 0, 64, like),
                  philox.words(philox.device_key(1, "a"), 2, 1, 64, like)):
        assert (other != base).float().mean() > 0.9
    # a longer draw starts with the shorter one
    assert torch.equal(philox.words(philox.device_key(1, "a"), 2, 0, 13, like), base[:13])
    assert int(base.min()) >= 0 and int(base.max()) < 2**32


def test_device_choice_is_distinct_ascending_and_uniform():
    like = torch.empty(0)
    n, k, draws = 50, 10, 4000
    counts = torch.zeros(n)
    for step in range(draws):
        got = philox.choice(philox.device_key(0, "u"), step, n, k, like)
        assert got.numel() == k and torch.equal(got, torch.unique(got))
        counts[got] += 1
    expected = draws * k / n
    # each position's count is Binomial(draws, k/n): within 5 standard deviations
    assert float((counts - expected).abs().max()) < 5 * (expected * (1 - k / n)) ** 0.5
    for n, k in ((10, 10), (10, 0), (7, 6), (100000, 1000)):
        got = philox.choice(philox.device_key(0, "c"), 1, n, k, like)
        assert got.numel() == k and torch.equal(got, torch.unique(got))
        assert k == 0 or (int(got.min()) >= 0 and int(got.max()) < n)


def test_a_kernel_launches_on_its_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device: ``kernels.launch`` makes it the first
    argument's (a model on ``cuda:1`` without ``torch.cuda.set_device(1)``), and leaves the
    current device alone where it already is (no GPU needed: the device calls are recorded)."""
    from grace_dl.torch import kernels

    current, seen = [0], []

    @contextlib.contextmanager
    def device(where):
        before, current[0] = current[0], torch.device(where).index
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, current[0], kw))

    class OnCuda:
        def __init__(self, index):
            self.device = torch.device("cuda", index)

    kernels.launch(Kernel(), 3, OnCuda(1), 7, BLOCK=8)
    kernels.launch(Kernel(), 0, OnCuda(0), BLOCK=8)
    kernels.launch(Kernel(), 2, torch.empty(1), BLOCK=8)
    assert seen == [((3,), 1, {"BLOCK": 8}), ((1,), 0, {"BLOCK": 8}), ((2,), 0, {"BLOCK": 8})]
    assert current[0] == 0
