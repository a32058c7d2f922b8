"""``torch.distributed`` collectives for PyTorch tensors: ``grace_dl.collectives.Collectives``
on a process group (gloo, NCCL, MPI), so every communicator runs without Horovod.

    from grace_dl.torch.distributed import DistCollectives
    coll = DistCollectives(process_group=None)   # None: the default group
    handle = grc.send(grad, "fc.weight", collectives=coll)
    avg = grc.receive(handle)

Matching: torch.distributed matches collectives across ranks by **issue order**, not by name,
so every rank must start the same collectives in the same order (the DDP hook does: DDP's
buckets come in a fixed order, and multi-round compressors start their later rounds inside
``receive``, which the hook calls in bucket order). ``name`` is only used in error messages.

What goes on the wire, per call (``N`` ranks of the group):

- ``allreduce_async``: one ``all_reduce`` (SUM) of a **copy** of the tensor (the caller's tensor
  is never modified, as with Horovod). ``int8``/``uint8``/``int16`` are summed as ``int32`` and
  ``bfloat16`` as ``float32``, then cast back once; the widened type is what crosses the wire
  and what ``allreduce_nbytes`` reports. ``bool`` cannot be summed (``ValueError``).
- ``allgather_async``: the tensor travels as raw bytes (any dtype, bit-exact). A first
  ``all_gather`` of one int64 per rank (its first dimension) is **waited for** inside the call,
  so that every rank can pad its rows to the largest; then one ``all_gather`` of the padded
  bytes starts and the call returns. Each rank receives ``N * max_rows`` rows; the padding is
  dropped on arrival. (Horovod negotiates sizes itself; torch.distributed's ``all_gather``
  needs equal sizes.)
- ``broadcast_async``: one ``broadcast`` of the bytes; a non-root's buffer is a copy of its
  tensor (it must have the root's shape), so the caller's tensor is never overwritten.
- ``alltoall_async``: rows ``splits[j]`` go to rank j. A first ``all_to_all_single`` of one
  int64 per peer (the splits), **waited for** inside the call, tells each rank what it will
  receive; then one ``all_to_all_single`` of the bytes starts. Resolves to
  ``(received, received_splits)`` like Horovod's.

Ranks and roots are relative to the process group, as ``size()``/``rank()`` are. CUDA tensors
work with NCCL (one GPU per rank) and with gloo; on NCCL a CPU tensor travels through the
current CUDA device and comes back to the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grace_dl.collectives import Collectives

_SUM_AS = {torch.int8: torch.int32, torch.uint8: torch.int32, torch.int16: torch.int32,
           torch.bfloat16: torch.float32}
_SUMMABLE = (torch.int32, torch.int64, torch.float16, torch.float32, torch.float64)


class _Pending:
    """An in-flight ``torch.distributed`` work object plus how to turn its output into the
    caller's result."""

    __slots__ = ("work", "finish")

    def __init__(self, work, finish):
        self.work = work
        self.finish = finish


def _as_bytes(tensor):
    """``tensor`` as a 2-D uint8 view (rows = first dim, a scalar is one row) and the shape of
    one row."""
    tensor = tensor.contiguous()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    trailing = tuple(tensor.shape[1:])
    width = tensor.element_size() * _prod(trailing)
    return tensor.reshape(-1).view(torch.uint8).reshape(tensor.shape[0], width), trailing


def _from_bytes(raw, dtype, trailing):
    """Inverse of ``_as_bytes`` for ``raw`` (rows x bytes per row)."""
    return raw.reshape(-1).view(dtype).reshape(-1, *trailing)


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


class DistCollectives(Collectives):
    """Collectives on a ``torch.distributed`` process group (``None``: the default group).

    The default process group must be initialised (``dist.init_process_group``) before the
    first call; construction itself communicates nothing."""

    def __init__(self, process_group=None):
        self.process_group = process_group

    def _group(self):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group(...) first")
        return self.process_group

    def size(self) -> int:
        return dist.get_world_size(self._group())

    def rank(self) -> int:
        return dist.get_rank(self._group())

    def _wire(self, tensor):
        """(``tensor`` on a device the group's backend can move, function back). NCCL moves
        only CUDA tensors: a CPU tensor (a communicator's int32 lengths, say) travels through
        the current CUDA device and comes back to the CPU."""
        if tensor.device.type == "cpu" and dist.get_backend(self._group()) == "nccl":
            return tensor.to(torch.device("cuda", torch.cuda.current_device())), \
                (lambda t: t.cpu())
        return tensor, (lambda t: t)

    def _global_rank(self, rank: int) -> int:
        group = self._group()
        if group is None or group is dist.group.WORLD:
            return rank
        return dist.get_global_rank(group, rank)

    # ------------------------------------------------------------------ sums
    def allreduce_async(self, tensor, name: str):
        dt = tensor.dtype
        wire_dt = _SUM_AS.get(dt, dt)
        if wire_dt not in _SUMMABLE:
            raise ValueError(f"allreduce cannot sum {dt} tensors (name {name!r}); summable: "
                             f"{[str(d) for d in (*_SUMMABLE, *_SUM_AS)]}")
        # always a fresh buffer: the collective works in place, the caller's tensor stays
        moved, back = self._wire(tensor.detach())
        wire = moved.to(wire_dt, copy=True).contiguous()
        work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self._group(), async_op=True)
        return _Pending(work, lambda: back(wire.to(dt)))

    def allreduce_nbytes(self, tensor) -> int:
        return tensor.numel() * _SUM_AS.get(tensor.dtype, tensor.dtype).itemsize

    # ------------------------------------------------------------------ moves (bytes)
    def allgather_async(self, tensor, name: str):
        group = self._group()
        size = self.size()
        moved, back = self._wire(tensor.detach())
        raw, trailing = _as_bytes(moved)
        rows = torch.tensor([raw.shape[0]], dtype=torch.int64, device=raw.device)
        all_rows = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(all_rows, rows, group=group)       # waited for: sizes the buffers
        counts = [int(r.item()) for r in all_rows]
        width = raw.shape[1]
        longest = max(counts) if counts else 0
        padded = raw
        if raw.shape[0] < longest:
            padded = torch.zeros(longest, width, dtype=torch.uint8, device=raw.device)
            padded[:raw.shape[0]] = raw
        outs = [torch.empty(longest, width, dtype=torch.uint8, device=raw.device)
                for _ in range(size)]
        work = dist.all_gather(outs, padded.contiguous(), group=group, async_op=True)
        dtype = tensor.dtype

        def finish():
            joined = torch.cat([o[:n] for o, n in zip(outs, counts)])
            return back(_from_bytes(joined, dtype, trailing))

        return _Pending(work, finish)

    def broadcast_async(self, tensor, root: int, name: str):
        if not 0 <= int(root) < self.size():
            raise ValueError(f"broadcast root must be a rank in [0, {self.size()}), got "
                             f"{root!r} (name {name!r})")
        moved, back = self._wire(tensor.detach())
        raw, trailing = _as_bytes(moved)
        # a non-root receives into a copy: the caller's tensor is never overwritten
        buf = raw if self.rank() == root else raw.clone()
        work = dist.broadcast(buf, src=self._global_rank(int(root)), group=self._group(),
                              async_op=True)
        dtype = tensor.dtype
        return _Pending(work, lambda: back(_from_bytes(buf, dtype, trailing)
                                           .reshape(tensor.shape)))

    def alltoall_async(self, tensor, splits, name: str):
        group = self._group()
        size = self.size()
        splits = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
        moved, back = self._wire(tensor.detach())
        raw, trailing = _as_bytes(moved)
        if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != raw.shape[0]:
            raise ValueError(f"alltoall splits must be {size} non-negative row counts summing "
                             f"to {raw.shape[0]} (name {name!r}), got {splits}")
        mine = torch.tensor(splits, dtype=torch.int64, device=raw.device)
        theirs = torch.empty_like(mine)
        dist.all_to_all_single(theirs, mine, group=group)  # waited for: sizes the buffer
        received_splits = [int(s) for s in theirs.tolist()]
        width = raw.shape[1]
        out = torch.empty(sum(received_splits), width, dtype=torch.uint8, device=raw.device)
        work = dist.all_to_all_single(out, raw, output_split_sizes=received_splits,
                                      input_split_sizes=splits, group=group, async_op=True)
        dtype = tensor.dtype
        recv_splits = torch.tensor(received_splits, dtype=torch.int32)
        return _Pending(work, lambda: (back(_from_bytes(out, dtype, trailing)), recv_splits))

    # ------------------------------------------------------------------ waiting
    def synchronize(self, handle):
        if not isinstance(handle, _Pending):
            raise ValueError(f"synchronize takes a handle from this DistCollectives, got "
                             f"{type(handle).__name__}")
        handle.work.wait()
        return handle.finish()

    def barrier(self) -> None:
        dist.barrier(group=self._group())


def collectives(process_group=None) -> DistCollectives:
    """The torch.distributed collectives over ``process_group`` (the default group if None)."""
    return DistCollectives(process_group)
