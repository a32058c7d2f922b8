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
- ``alltoall_async``: rows ``splits[j]`` go to rank j. A first ``all_gather`` of every rank's
  splits (N int64 each), **waited for** inside the call, tells each rank what it will receive
  and how long the longest segment is; then ``all_to_all_single`` of the bytes starts: one
  call, or on gloo one per 256 KiB of the longest segment (gloo carries one large message at
  about half the link rate when all ranks send at once; in pieces it runs at the link rate).
  Resolves to ``(received, received_splits)`` like Horovod's.
- ``allgather_known_async`` / ``alltoall_known_async``: the same transfers when the caller
  knows every rank's sizes (two-phase does: its payload lengths follow from the chunk
  lengths), without the size exchange. That exchange is a blocking collective, so it waits
  behind every collective already queued on the group: without it a caller can start one
  tensor's exchange and go on compressing the next while the first is on the wire (the DDP
  hook's pieces). The given sizes are checked against this rank's own (``ValueError``).
- ``allgather_parts_async`` / ``alltoall_parts_async`` (payloads whose size depends on the
  data): every rank's int32 part lengths gathered first (given on the device by the caller,
  as they are; this rank's parts are cut by its row), then, once the gathered table is
  **read**, the parts' transfers with every size known. On NCCL that read makes the host wait
  for the device, so the parts' transfers are held (``Collectives.sized``) and the step's
  tables read together at the first wait for any of them: one read of sizes a round of the
  step, not one a tensor. Elsewhere each table is read at once.
- ``allreduce_async_``: one ``all_reduce`` (SUM) in the caller's tensor, then scaled in place
  (DDP's own allreduce of its bucket; ``None`` for types summed widened, non-contiguous
  tensors and CPU tensors on NCCL).

Ranks and roots are relative to the process group, as ``size()``/``rank()`` are. CUDA tensors
work with NCCL (one GPU per rank) and with gloo; on NCCL a CPU tensor travels through the
current CUDA device and comes back to the CPU.
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist

from grace_dl.collectives import Collectives, Sized, check_lengths, cut_parts, issued

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


#: gloo moves one large all_to_all_single message at about half the link rate when every
#: rank sends at once; in pieces of at most this many bytes per peer it runs at about the
#: link rate. Smaller pieces lose on fast links to per-message cost, larger ones on slow
#: links to the same halving (the sizes tried: docs/DECISIONS.md).
_A2A_PIECE_BYTES = 256 * 1024


def _alltoall_pieces(out, raw, splits, received, longest: int, piece: int, group) -> list:
    """Start ``all_to_all_single`` of ``raw`` (rows ``splits[j]`` to rank j) into ``out``
    (rows ``received[j]`` from rank j): one call, or, with ``piece`` > 0, one call per
    ``piece`` rows of every peer's segment (``longest``: the longest segment of any pair of
    ranks, so every rank makes the same number of calls)."""
    if not piece or longest <= piece:
        return [dist.all_to_all_single(out, raw, output_split_sizes=received,
                                       input_split_sizes=splits, group=group, async_op=True)]
    send_at = _offsets(splits)
    recv_at = _offsets(received)
    works = []
    for lo in range(0, longest, piece):
        ins = [min(max(s - lo, 0), piece) for s in splits]
        outs = [min(max(r - lo, 0), piece) for r in received]
        src = torch.cat([raw[a + lo:a + lo + n] for a, n in zip(send_at, ins)])
        dst = torch.empty(sum(outs), raw.shape[1], dtype=torch.uint8, device=raw.device)
        works.append(_Placed(dist.all_to_all_single(dst, src, output_split_sizes=outs,
                                                    input_split_sizes=ins, group=group,
                                                    async_op=True),
                             dst, out, [(a + lo, n) for a, n in zip(recv_at, outs)]))
    return works


class _Placed:
    """A piece's work: waiting for it also copies its rows to their places in ``out``."""

    def __init__(self, work, got, out, places):
        self.work, self.got, self.out, self.places = work, got, out, places

    def wait(self):
        self.work.wait()
        at = 0
        for start, n in self.places:
            self.out[start:start + n] = self.got[at:at + n]
            at += n


def _known(counts, size: int, own: int, rank: int, what: str, name: str) -> list:
    """A caller's row counts per rank as ints, checked as far as this rank can: one per rank,
    none negative, and this rank's own as given (``own``)."""
    counts = list(map(int, counts.tolist() if torch.is_tensor(counts) else counts))
    if len(counts) != size or min(counts, default=0) < 0 or counts[rank] != own:
        raise ValueError(f"{what} must be {size} non-negative row counts with this rank's "
                         f"({rank}) equal to {own} (name {name!r}), got {counts}")
    return counts


def _offsets(counts) -> list:
    at, out = 0, []
    for c in counts:
        out.append(at)
        at += c
    return out


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
        self._ranks = None      # (rank, size), read once the group exists
        self._is_nccl = False   # whether its backend is NCCL, read with them

    def _group(self):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group(...) first")
        return self.process_group

    def _rank_size(self) -> tuple:
        """This rank and the group's size, asked of torch.distributed once (a group's
        membership does not change)."""
        if self._ranks is None:
            group = self._group()
            self._ranks = dist.get_rank(group), dist.get_world_size(group)
            self._is_nccl = dist.get_backend(group) == "nccl"
        return self._ranks

    def size(self) -> int:
        ranks = self._ranks
        return (ranks or self._rank_size())[1]

    def rank(self) -> int:
        ranks = self._ranks
        return (ranks or self._rank_size())[0]

    def _wire(self, tensor):
        """(``tensor`` on a device the group's backend can move, function back). NCCL moves
        only CUDA tensors: a CPU tensor (a communicator's int32 lengths, say) travels through
        the current CUDA device and comes back to the CPU."""
        if tensor.device.type == "cpu" and self._nccl():
            return tensor.to(torch.device("cuda", torch.cuda.current_device())), \
                (lambda t: t.cpu())
        return tensor, (lambda t: t)

    def waits_in_stream(self) -> bool:
        """Whether waiting for a collective of this group holds the device's stream rather
        than the host (NCCL: ``work.wait()`` returns at once, later kernels queue behind the
        collective), so a caller may wait for each collective as soon as it is started."""
        return self._nccl()

    def _nccl(self) -> bool:
        """Whether the group's backend is NCCL (asked once: it does not change)."""
        if self._ranks is None:
            self._rank_size()
        return self._is_nccl

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

    def allreduce_async_(self, tensor, name: str, scale: float = 1.0):
        """In place (DDP's own allreduce of its bucket), then multiplied by ``scale``; for
        contiguous tensors summed as they are (not the widened types) on a device the backend
        moves."""
        if tensor.dtype not in _SUMMABLE or not tensor.is_contiguous() or \
                self._wire(tensor)[0] is not tensor:
            return None
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group(), async_op=True)
        return _Pending(work, lambda: tensor if scale == 1.0 else tensor.mul_(scale))

    def allreduce_nbytes(self, tensor) -> int:
        return tensor.numel() * _SUM_AS.get(tensor.dtype, tensor.dtype).itemsize

    # ------------------------------------------------------------------ moves (bytes)
    def allgather_async(self, tensor, name: str):
        return self.allgather_known_async(tensor, None, name)

    def allgather_known_async(self, tensor, counts, name: str):
        group = self._group()
        rank, size = self._ranks or self._rank_size()
        moved = tensor.detach()
        if moved.device.type == "cpu" and self._is_nccl:     # (set with ``_ranks``)
            moved, back = self._wire(moved)
        else:
            back = None
        if moved.dim() == 1 and moved.is_contiguous():     # (``_as_bytes``, inline)
            raw = (moved if moved.dtype == torch.uint8 else moved.view(torch.uint8)) \
                .reshape(-1, moved.element_size())
            trailing = ()
        else:
            raw, trailing = _as_bytes(moved)
        if counts is None:
            rows = torch.full((1,), raw.shape[0], dtype=torch.int64, device=raw.device)
            all_rows = [torch.empty_like(rows) for _ in range(size)]
            dist.all_gather(all_rows, rows, group=group)       # waited for: sizes the buffers
            counts = torch.cat(all_rows).tolist()      # (one read of them all)
        else:
            counts = _known(counts, size, raw.shape[0], rank, "counts", name)
        width = raw.shape[1]
        longest = max(counts) if counts else 0
        padded = raw
        if raw.shape[0] < longest:
            padded = torch.zeros(longest, width, dtype=torch.uint8, device=raw.device)
            padded[:raw.shape[0]] = raw
        joined = torch.empty(size, longest, width, dtype=torch.uint8, device=raw.device)
        outs = list(joined.unbind(0))
        work = dist.all_gather(outs, padded.contiguous(), group=group, async_op=True)
        dtype = tensor.dtype
        padded_rows = counts.count(longest) != size

        def finish():
            rows = joined.reshape(size * longest, width)
            if padded_rows:     # drop the padding
                rows = torch.cat([o[:n] for o, n in zip(outs, counts)])
            rows = rows.reshape(-1).view(dtype)
            if trailing:
                rows = rows.reshape(-1, *trailing)
            return rows if back is None else back(rows)

        return _Pending(work, finish)

    def allgather_parts_async(self, parts, names, lengths_name: str, lengths=None):
        """The lengths gathered first (the exchange of sizes: each part's buffers are sized
        from them), then every part with its ranks' lengths known, cut by them where they
        arrive; the gathered table is read when the parts are issued (``sized``: on NCCL with
        the step's other sizes, at the first wait for any of them). ``lengths`` given (a
        path's, on the parts' device) are gathered as they are, and this rank's parts cut by
        its row of the table."""
        size, n = self.size(), len(parts)
        if lengths is None:
            numels = self._numels(parts)
        else:
            check_lengths(lengths, parts)
            numels = lengths
        every = self.allgather_known_async(numels, [n] * size, lengths_name)

        def issue(flat):
            table = [flat[r * n:(r + 1) * n] for r in range(size)]
            cut = parts if lengths is None else cut_parts(parts, table[self.rank()])
            pending = []
            for i, (p, name) in enumerate(zip(cut, names)):
                counts = [row[i] for row in table]
                pending.append((self.allgather_known_async(p, counts, name), counts))
            return _Pending([h.work for h, _ in pending],
                            lambda: [list(torch.split(h.finish(), c)) for h, c in pending]), None

        return self.sized(lambda: self.synchronize(every), issue)

    def synchronize_parts(self, handle, dtypes: list) -> list:
        return self.synchronize(handle)

    def _numels(self, parts):
        """The int32 lengths of ``parts``, where their exchange of sizes runs: on NCCL on the
        parts' device (the table stays there, read with the others; a pinned copy to the
        device waits for nothing)."""
        numels = torch.tensor([p.numel() for p in parts], dtype=torch.int32)
        if self._is_nccl and parts[0].is_cuda:
            numels = numels.pin_memory().to(parts[0].device, non_blocking=True)
        return numels

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
        return self.alltoall_known_async(tensor, splits, None, name)

    def alltoall_parts_async(self, parts, lengths, name: str):
        """Every rank's ``lengths`` gathered as they are, on the device (None: the parts'
        own; the all-to-all's matrix: its read, ``sized``, is the exchange of sizes), then
        this rank's parts cut by its row and sent with every rank's splits known."""
        size, me, m = self.size(), self.rank(), len(parts)
        whole = lengths is None
        if whole:
            lengths = self._numels(parts)
        else:
            check_lengths(lengths, parts)
        mine = lengths if m == size else torch.cat(
            [lengths, lengths.new_zeros(size - m)])
        every = self.allgather_known_async(mine, [size] * size, name)

        def issue(flat):
            matrix = [flat[r * size:(r + 1) * size] for r in range(size)]   # [from][to] rows
            splits = matrix[me]
            joined = torch.cat(parts if whole else cut_parts(parts, splits[:m]))
            return self.alltoall_known_async(joined, splits, matrix, name), splits

        return self.sized(lambda: self.synchronize(every), issue)

    def holds_sizes(self, lengths) -> bool:
        """On NCCL (``waits_in_stream``): a read of sizes there makes the host wait for the
        device, so the step's are read together."""
        return self.waits_in_stream()

    def alltoall_known_async(self, tensor, splits, matrix, name: str):
        group = self._group()
        size, me = self.size(), self.rank()
        # (``map`` of builtins, not comprehensions: this runs for every tensor of a step)
        splits = list(map(int, splits.tolist() if torch.is_tensor(splits) else splits))
        moved, back = self._wire(tensor.detach())
        raw, trailing = _as_bytes(moved)
        if len(splits) != size or min(splits, default=0) < 0 or sum(splits) != raw.shape[0]:
            raise ValueError(f"alltoall splits must be {size} non-negative row counts summing "
                             f"to {raw.shape[0]} (name {name!r}), got {splits}")
        if matrix is None:
            mine = torch.tensor(splits, dtype=torch.int64)
            if raw.is_cuda:     # (a pinned copy waits for nothing)
                mine = mine.pin_memory().to(raw.device, non_blocking=True)
            every = [torch.empty_like(mine) for _ in range(size)]
            dist.all_gather(every, mine, group=group)          # waited for: sizes the buffers
            matrix = torch.stack(every).tolist()       # [from][to] rows, one read
        else:
            rows, matrix = matrix, []
            for row in rows:
                row = list(map(int, row))
                if len(row) != size or min(row, default=0) < 0:
                    matrix = None
                    break
                matrix.append(row)
            if matrix is None or len(matrix) != size or matrix[me] != splits:
                raise ValueError(f"alltoall matrix must be {size} rows of {size} non-negative "
                                 f"row counts, row {me} equal to splits {splits} "
                                 f"(name {name!r}), got {[list(r) for r in rows]}")
        received_splits = list(map(operator.itemgetter(me), matrix))
        longest = max(map(max, matrix))
        width = raw.shape[1]
        out = torch.empty(sum(received_splits), width, dtype=torch.uint8, device=raw.device)
        gloo = dist.get_backend(group) == "gloo"
        piece = max(1, _A2A_PIECE_BYTES // max(width, 1)) if gloo else 0
        works = _alltoall_pieces(out, raw, splits, received_splits, longest, piece, group)
        dtype = tensor.dtype
        recv_splits = torch.tensor(received_splits, dtype=torch.int32)
        return _Pending(works, lambda: (back(_from_bytes(out, dtype, trailing)), recv_splits))

    # ------------------------------------------------------------------ waiting
    def synchronize(self, handle):
        if type(handle) is Sized:
            handle = issued(handle)
        if not isinstance(handle, _Pending):
            raise ValueError(f"synchronize takes a handle from this DistCollectives, got "
                             f"{type(handle).__name__}")
        for work in handle.work if isinstance(handle.work, list) else [handle.work]:
            work.wait()
        return handle.finish()

    def barrier(self) -> None:
        dist.barrier(group=self._group())


def collectives(process_group=None) -> DistCollectives:
    """The torch.distributed collectives over ``process_group`` (the default group if None)."""
    return DistCollectives(process_group)
