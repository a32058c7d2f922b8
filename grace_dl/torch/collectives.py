"""Horovod collectives for PyTorch tensors (``grace_dl.collectives.Collectives`` on
``horovod.torch``'s async handles).

Every call returns at once with a handle; ``synchronize`` waits for it. Horovod's torch ops do
not take every dtype, so this layer carries the others without changing their meaning:

- ``allgather`` / ``broadcast`` / ``alltoall`` move bytes: ``bool`` travels as ``uint8`` and
  ``bfloat16`` as ``int16`` (a bit-exact view), and come back as they went.
- ``allreduce`` sums: ``int8``/``uint8``/``int16`` are summed as ``int32`` and ``bfloat16`` as
  ``float32`` (Horovod 0.28.1 refuses to sum bf16), then cast back once (so a bf16 sum is
  rounded once, not once per addition). The widened type is what crosses the wire, and what
  ``allreduce_nbytes`` reports to the byte counters.

Ranks and roots are relative to the process set, as ``size()``/``rank()`` are.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch
from horovod.common.process_sets import global_process_set

from grace_dl.collectives import Collectives, Sized, issued

# dtype the wire uses for a dtype Horovod's torch ops lack: (wire dtype, reinterpret bits?)
_MOVE_AS = {torch.bool: (torch.uint8, False), torch.bfloat16: (torch.int16, True)}
_SUM_AS = {torch.int8: torch.int32, torch.uint8: torch.int32, torch.int16: torch.int32,
           torch.bfloat16: torch.float32}
_SUMMABLE = (torch.int32, torch.int64, torch.float16, torch.float32, torch.float64)


class _Pending:
    """A Horovod handle plus how to turn its result back into the caller's dtype."""

    __slots__ = ("handle", "post")

    def __init__(self, handle, post):
        self.handle = handle
        self.post = post


def _to_wire(tensor, table):
    """(tensor as the wire dtype, function restoring the original dtype)."""
    tensor = tensor.contiguous()
    dt = tensor.dtype
    if table is _MOVE_AS and dt in _MOVE_AS:
        wire, bits = _MOVE_AS[dt]
        if bits:
            return tensor.view(wire), lambda t: t.view(dt)
        return tensor.to(wire), lambda t: t.to(dt)
    if table is _SUM_AS and dt in _SUM_AS:
        return tensor.to(_SUM_AS[dt]), lambda t: t.to(dt)
    return tensor, None


class TorchCollectives(Collectives):
    any_order = True     # Horovod negotiates each collective by name

    def __init__(self, process_set=None):
        self.process_set = global_process_set if process_set is None else process_set

    def size(self) -> int:
        return self.process_set.size()

    def rank(self) -> int:
        return self.process_set.rank()

    def _global_rank(self, rank: int) -> int:
        ranks = self.process_set.ranks
        return ranks[rank] if ranks else rank

    def allreduce_async(self, tensor, name: str):
        wire, post = _to_wire(tensor, _SUM_AS)
        if wire.dtype not in _SUMMABLE:
            raise ValueError(f"allreduce cannot sum {tensor.dtype} tensors (name {name!r}); "
                             f"summable: {[str(d) for d in (*_SUMMABLE, *_SUM_AS)]}")
        handle = hvd.allreduce_async(wire, name=name, op=hvd.Sum, process_set=self.process_set)
        return _Pending(handle, post)

    def allreduce_async_(self, tensor, name: str, scale: float = 1.0):
        """In place, for contiguous tensors Horovod sums as they are (not the widened types)."""
        if tensor.dtype not in _SUMMABLE or not tensor.is_contiguous():
            return None
        handle = hvd.allreduce_async_(tensor, name=name, op=hvd.Sum, postscale_factor=scale,
                                      process_set=self.process_set)
        return _Pending(handle, None)

    def allreduce_nbytes(self, tensor) -> int:
        return tensor.numel() * _SUM_AS.get(tensor.dtype, tensor.dtype).itemsize

    def allgather_async(self, tensor, name: str):
        wire, post = _to_wire(tensor, _MOVE_AS)
        return _Pending(hvd.allgather_async(wire, name=name, process_set=self.process_set), post)

    def broadcast_async(self, tensor, root: int, name: str):
        wire, post = _to_wire(tensor, _MOVE_AS)
        handle = hvd.broadcast_async(wire, self._global_rank(root), name=name,
                                     process_set=self.process_set)
        return _Pending(handle, post)

    def alltoall_async(self, tensor, splits, name: str):
        wire, post = _to_wire(tensor, _MOVE_AS)
        splits = torch.as_tensor(splits, dtype=torch.int32)
        handle = hvd.alltoall_async(wire, splits, name=name, process_set=self.process_set)
        return _Pending(handle, (lambda out: (post(out[0]), out[1])) if post else None)

    def synchronize(self, handle):
        if type(handle) is Sized:
            handle = issued(handle)
        out = hvd.synchronize(handle.handle)
        return handle.post(out) if handle.post else out

    def done(self, handle) -> bool:
        if type(handle) is Sized:
            if handle.handle is None:
                return False        # (held for the step's read of sizes)
            handle = handle.handle
        return hvd.poll(handle.handle)

    def holds_sizes(self, lengths) -> bool:
        """Sizes on a GPU: reading one makes the host wait for it, so the step's are read
        together, at the first wait for any of them."""
        return lengths.is_cuda

    def barrier(self) -> None:
        hvd.barrier(process_set=self.process_set)


#: process set (None: the global one) -> its collectives: one a process set, so that every
#: tensor sent on it shares the collectives held for the step's one read of sizes
_BY_SET: dict = {}


def collectives(process_set=None) -> TorchCollectives:
    """The Horovod torch collectives over ``process_set`` (the global one by default): the
    same object for the same process set."""
    coll = _BY_SET.get(process_set)
    if coll is None:
        coll = _BY_SET[process_set] = TorchCollectives(process_set)
    return coll
