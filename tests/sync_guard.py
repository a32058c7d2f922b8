"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: a ``TorchFunctionMode`` that
records every call which, on a GPU, would make the host wait for the device or copy host data
to it (reading a value back, a tensor's truth value, a nonzero/mask selection whose size
depends on the data, a tensor built from host data).

Used on the device path's code run on CPU tensors (``grace_dl.torch.kernels.emulate_device``):
the calls are the same there, only their cost differs.
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.overrides import TorchFunctionMode

#: calls that read a device value on the host
READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
         "__complex__", "equal", "allclose", "is_nonzero", "__array__", "__format__",
         "__repr__", "__str__", "__contains__"}
#: calls whose output size depends on the data (the host must read the size)
SIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
#: tensors made from host data on a given device (a copy there: on a GPU, from pageable memory,
#: after everything queued); one made without a device stays on the host
FROM_HOST = {"tensor", "as_tensor"}


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _bool_index(args) -> bool:
    """A mask among the indices (bool, or uint8: torch's older mask)."""
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _sized_repeat(args, kwargs) -> bool:
    """``repeat_interleave`` by a tensor of counts without ``output_size`` (its size is their
    sum), or its one-argument form."""
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
    if len(args) == 1 and "repeats" not in kwargs:
        return True
    return torch.is_tensor(repeats) and repeats.numel() > 1 and "output_size" not in kwargs


class SyncGuard(TorchFunctionMode):
    """Records ``(call, where)`` for every host synchronisation or host-to-device copy,
    ``where`` the grace_dl line that made it: ``file:line function``."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def _record(self, what: str) -> None:
        # (the stack without this frame and the one recording: the caller of the call last)
        frames = [f for f in traceback.extract_stack()[:-2] if "grace_dl" in f.filename]
        where = f"{frames[-1].filename.split('grace_dl/')[-1]}:{frames[-1].lineno} " \
            f"{frames[-1].name}" if frames else "?"
        self.calls.append((what, where))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name in READS or name in SIZED:
            self._record(name)
        elif name in FROM_HOST and args and not torch.is_tensor(args[0]) and \
                kwargs.get("device") is not None:
            self._record(name)
        elif name in ("__getitem__", "__setitem__", "index_put_") and _bool_index(args):
            self._record(f"{name}[bool]")
        elif name == "repeat_interleave" and _sized_repeat(args, kwargs):
            self._record("repeat_interleave(tensor)")
        elif name == "where" and len(args) == 1 and not kwargs:
            self._record("where(condition)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def guarded():
    """A ``SyncGuard`` active in the block, ``torch.from_numpy`` recorded too."""
    guard = SyncGuard()
    original = torch.from_numpy

    def from_numpy(arr):
        guard._record("from_numpy")
        return original(arr)

    torch.from_numpy = from_numpy
    try:
        with guard:
            yield guard
    finally:
        torch.from_numpy = original
