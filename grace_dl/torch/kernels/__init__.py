"""Triton kernels for the device path (``grace_dl.torch.device``), each with a plain-torch twin.

A kernel runs where ``triton_for(tensor)`` says so: a CUDA tensor with Triton importable, or
any tensor when the process was started with ``TRITON_INTERPRET=1`` (Triton's interpreter
runs kernels on the CPU; the tests compare each kernel with its twin that way). Everywhere
else the twin runs: the same bits from torch ops (the device path on CPU tensors, a GPU
without Triton). Kernels and twins never synchronise with the host.
"""

from __future__ import annotations

import contextlib
import functools
import os

#: elements per Triton program of the elementwise kernels
BLOCK = 4096


@functools.lru_cache(maxsize=1)
def _triton():
    """The ``triton`` module, or None where it cannot be imported."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001  (a broken install is as good as none)
        return None
    return triton


_EMULATED = [False]


def on_device(tensor) -> bool:
    """Whether ``tensor`` takes the device path: it is on a GPU, or CPU tensors are made to
    (``emulate_device``)."""
    return tensor.device.type == "cuda" or _EMULATED[0]


@contextlib.contextmanager
def emulate_device():
    """Within this context CPU tensors take the device path (its speed paths, keyed draws
    made by Philox, Triton kernels where interpreting, their twins elsewhere): how tests run
    the GPU code on a CPU."""
    before = _EMULATED[0]
    _EMULATED[0] = True
    try:
        yield
    finally:
        _EMULATED[0] = before


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_for(tensor) -> bool:
    """Whether the Triton kernels run for ``tensor``: on CUDA, or anywhere when interpreting;
    and only where Triton imports. (``interpreting``'s test inline: a frame a launch where
    tests emulate the device, none on a GPU.)"""
    if tensor.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    return _triton() is not None


def grid(n: int, block: int = BLOCK) -> tuple:
    """Programs for ``n`` elements, ``block`` each."""
    return (max(1, -(-n // block)),)


def launch(kernel, programs: int, *args, **constants):
    """``kernel`` on ``programs`` programs, on the device of its first argument (a tensor).
    Triton launches on the current CUDA device and its stream, which need not be the
    tensors' (a model moved to ``cuda:1`` without ``torch.cuda.set_device(1)``): there the
    launch runs under ``torch.cuda.device`` of the tensors', as torch's own ops do."""
    run = kernel[(max(1, programs),)]
    where = args[0].device
    if where.type == "cuda":
        import torch

        if where.index != torch.cuda.current_device():
            with torch.cuda.device(where):
                return run(*args, **constants)
    return run(*args, **constants)
