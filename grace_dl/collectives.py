"""The small collectives interface communicators are written against.

``grace_dl.torch.collectives`` and ``grace_dl.tensorflow.collectives`` implement it on Horovod
(``horovod.torch``'s async handles; ``horovod.tensorflow``'s ops, which TF schedules itself).
Every call takes an explicit ``name``: Horovod matches collectives across ranks by name, so
names derived from tensor names keep ranks independent of hook or trace order.

A payload whose size depends on the data (``allgather_parts_async``, ``alltoall_parts_async``)
needs its sizes read on the host before its collective can be sized or cut. Where that read
makes the host wait for a GPU, an engine holds such collectives (``holds_sizes``) and reads
the sizes of all it holds at once, at the first wait for any of them (``Sized``, ``issued``):
one read a round of the step instead of one a tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


def check_lengths(lengths, parts) -> None:
    """``ValueError`` unless ``lengths`` (a path's ``sent_lengths``) has one entry a part."""
    if lengths.numel() != len(parts):
        raise ValueError(f"sent lengths must be one a part: {len(parts)} parts, "
                         f"{lengths.numel()} lengths")


def cut_parts(parts, counts) -> list:
    """The 1-D ``parts`` each cut to its entry of ``counts`` (ints)."""
    from grace_dl.backend import ops_for

    ops = ops_for(parts[0])
    return [ops.slice(p, 0, c) for p, c in zip(parts, counts)]


class Sized:
    """A collective of data-dependent size, issued once its sizes are read
    (``Collectives.sized``): ``splits``, what an all-to-all sent to each rank, once issued.
    Wait for it through ``issued``."""

    __slots__ = ("owner", "lengths", "issue", "handle", "splits")

    def __init__(self, owner, lengths, issue):
        self.owner, self.lengths, self.issue = owner, lengths, issue
        self.handle = self.splits = None


def issued(handle):
    """``handle`` as its engine's own: a ``Sized`` one issued first (held ones: every size its
    engine holds read at once, ``Collectives.read_sizes``), any other as it is."""
    if type(handle) is Sized:
        if handle.handle is None:
            handle.owner.read_sizes()
            if handle.handle is None:
                raise RuntimeError("a collective of data-dependent size was never issued: the "
                                   "read of its step's sizes failed earlier")
        return handle.handle
    return handle


class Collectives(ABC):
    #: Whether ranks may start these collectives in different orders and still meet (Horovod
    #: matches them by name). Only then may a tensor's later phases start before ``receive``,
    #: as soon as ``done`` says its earlier collectives finished (``Router.advance``); an
    #: engine whose calls must come in the same order on every rank (``torch.distributed``)
    #: leaves it False.
    any_order = False

    @abstractmethod
    def size(self) -> int:
        """Number of ranks taking part."""

    @abstractmethod
    def rank(self) -> int:
        """This process's rank within them."""

    @abstractmethod
    def allreduce_async(self, tensor, name: str):
        """Start an element-wise **sum** of ``tensor`` over ranks; returns a handle."""

    def allreduce_nbytes(self, tensor):
        """Bytes one rank's ``tensor`` occupies in ``allreduce_async``: its own, unless the
        implementation sums it in a wider type (what the byte counters must record)."""
        from grace_dl.backend import ops_for

        return ops_for(tensor).nbytes(tensor)

    def allreduce_async_(self, tensor, name: str, scale: float = 1.0):
        """Start an element-wise sum of ``tensor`` over ranks **in place**, multiplied by
        ``scale`` (Horovod's ``allreduce_async_`` with a postscale factor); ``synchronize``
        then returns ``tensor``. ``None`` when this engine cannot do it for ``tensor`` (the
        caller then uses ``allreduce_async``): the default, and for frameworks whose tensors
        are values (TF)."""
        return None

    @abstractmethod
    def allgather_async(self, tensor, name: str):
        """Start concatenating every rank's ``tensor`` along dim 0 (first dims may differ)."""

    @abstractmethod
    def broadcast_async(self, tensor, root: int, name: str):
        """Start sending ``root``'s ``tensor`` to every rank."""

    @abstractmethod
    def alltoall_async(self, tensor, splits, name: str):
        """Start an all-to-all: rows ``splits[j]`` of ``tensor`` go to rank j. The handle
        resolves to ``(received, received_splits)``."""

    def allgather_known_async(self, tensor, counts, name: str):
        """``allgather_async`` when the caller knows every rank's first dimension
        (``counts[r]`` for rank r, the same list on every rank): an engine that must size its
        buffers before the transfer (torch.distributed) then skips its exchange of sizes, a
        blocking round trip behind every collective already queued. Default:
        ``allgather_async``."""
        return self.allgather_async(tensor, name)

    def allgather_parts_async(self, parts, names, lengths_name: str, lengths=None):
        """Start gathering every rank's 1-D ``parts`` when their lengths may differ across
        ranks (what a payload of data-dependent size sends), each rank's int32 vector of
        those lengths going with them; ``synchronize_parts`` waits for the handle. ``names``:
        one per part, for engines that send the parts one by one. ``lengths``: None (each part
        is sent whole), or an int32 tensor on the parts' device, one entry a part, of how
        much of each is sent (a path's ``sent_lengths``: the parts may be longer). Default
        (engines that size a gather themselves: Horovod): ``lengths`` read (``sized``: where
        the engine holds sizes, with the step's others), then one allgather, sent as
        ``lengths_name``, of each rank's block of its lengths then its parts' bytes
        (``ops.pack_ragged``): the sizes travel inside the gather instead of in a collective
        beside it."""
        from grace_dl.backend import ops_for

        ops = ops_for(parts[0])
        if lengths is None:
            return self.allgather_async(ops.pack_ragged(parts), lengths_name)
        check_lengths(lengths, parts)
        return self.sized(lengths, lambda counts: (self.allgather_async(
            ops.pack_ragged(cut_parts(parts, counts)), lengths_name), None))

    def synchronize_parts(self, handle, dtypes: list) -> list:
        """Wait for an ``allgather_parts_async`` of parts of ``dtypes`` (every rank's are the
        same): ``pieces[i][r]``, rank r's part i. Its lengths vectors were on the wire:
        ``wire.LENGTH_NBYTES`` a part a rank."""
        from grace_dl.backend import ops_for

        gathered = self.synchronize(issued(handle))
        return ops_for(gathered).unpack_ragged(gathered, dtypes, self.size())

    def alltoall_parts_async(self, parts, lengths, name: str) -> Sized:
        """Start an all-to-all of ``parts[j]`` (1-D, of one dtype) to rank j, for ``j <
        len(parts)`` (nothing to the others), each cut to its entry of ``lengths`` (an int32
        tensor on the parts' device, a path's ``sent_lengths``: the parts may be longer).
        ``lengths`` None: each part is sent whole. Returns a ``Sized`` handle: wait for
        ``issued(handle)``, which resolves as ``alltoall_async``'s; its ``splits`` are then
        the rows this rank sent to each rank. Default (engines that size an all-to-all
        themselves: Horovod): ``lengths`` read (``sized``), then ``alltoall_async`` of the
        parts cut and joined."""
        from grace_dl.backend import ops_for

        ops = ops_for(parts[0])
        cat = ops.cat
        pad = [0] * (self.size() - len(parts))
        if lengths is None:     # (sizes known: issued now, its parts uncut)
            return self.sized([ops.numel(p) for p in parts], lambda counts: (
                self.alltoall_async(cat(parts), counts + pad, name), counts + pad))
        check_lengths(lengths, parts)
        return self.sized(lengths, lambda counts: (
            self.alltoall_async(cat(cut_parts(parts, counts)), counts + pad, name), counts + pad))

    # ------------------------------------------------------------ data-dependent sizes
    def holds_sizes(self, lengths) -> bool:
        """Whether this engine holds a collective of data-dependent size (``sized``, of sizes
        ``lengths``) until one read of all the sizes it holds (``read_sizes``): where reading
        them makes the host wait for a device (torch's engines, for sizes on a GPU). Default:
        False, each read at once."""
        return False

    def sized(self, lengths, issue) -> Sized:
        """A collective of data-dependent size: ``lengths`` (an integer tensor, or a function
        returning one, of the sizes it needs read; a list: ints known already, issued now),
        ``issue(counts)`` (``lengths`` as ints) starting it and returning ``(its handle, the
        splits it sent or None)``. Issued now, or, where the engine ``holds_sizes``, held
        until ``read_sizes`` (at the first wait for any held one, ``issued``): held
        collectives start in the order made, the same on every rank."""
        handle = Sized(self, lengths, issue)
        if type(lengths) is list:       # (known on the host: nothing to read)
            handle.handle, handle.splits = issue(lengths)
            return handle
        held = self.__dict__.setdefault("held", [])
        held.append(handle)
        if not self.holds_sizes(lengths):
            self.read_sizes()
        return handle

    def read_sizes(self) -> None:
        """Read the sizes of every held collective at once (one host read of them all) and
        issue them, in the order made. (Sizes are torch tensors: only torch's device paths
        and engines leave them on a device.)"""
        held = self.__dict__.pop("held", None)
        if not held:
            return
        if len(held) == 1:      # (one read of one table: what an engine that holds none does)
            h = held[0]
            table = h.lengths() if callable(h.lengths) else h.lengths
            h.handle, h.splits = h.issue(table.reshape(-1).tolist())
            return
        import torch

        tables = [h.lengths() if callable(h.lengths) else h.lengths for h in held]
        by_device: dict = {}        # (tables on other devices are read apart, each at once)
        for t in tables:
            by_device.setdefault(t.device, []).append(t.reshape(-1))
        counts = {d: iter((torch.cat(ts) if len(ts) > 1 else ts[0]).tolist())   # (the read)
                  for d, ts in by_device.items()}
        for h, t in zip(held, tables):
            mine = counts[t.device]
            h.handle, h.splits = h.issue([next(mine) for _ in range(t.numel())])

    def holding(self) -> bool:
        """Whether collectives are held for ``read_sizes``."""
        return bool(self.__dict__.get("held"))

    def drop_held(self) -> None:
        """Forget the collectives held for ``read_sizes`` (a step given up after an error:
        they are never issued)."""
        self.__dict__.pop("held", None)

    def alltoall_known_async(self, tensor, splits, matrix, name: str):
        """``alltoall_async`` when the caller knows every rank's splits: ``matrix[r][j]``,
        the rows rank r sends to rank j, the same on every rank (row ``rank()`` is
        ``splits``). As with ``allgather_known_async``, no exchange of sizes. Default:
        ``alltoall_async``."""
        return self.alltoall_async(tensor, splits, name)

    @abstractmethod
    def synchronize(self, handle):
        """Wait for a handle; returns its result tensor (a tuple for ``alltoall``)."""

    def done(self, handle) -> bool:
        """Whether ``handle`` has finished, so ``synchronize`` would not block; never waits.
        False where the engine cannot tell (the default)."""
        return False

    def barrier(self) -> None:
        """Block until every rank gets here (used by tests and set-up checks)."""


class Wrapping(Collectives):
    """Collectives that change how another's calls go out (fusion, host copies, counting):
    the ranks, sizes, byte widths and barrier are ``inner``'s (its own bound methods, set on
    the instance: a communicator asks them for every tensor, through no frame of ours; a
    subclass that changes one sets it after ``Wrapping.__init__``)."""

    def __init__(self, inner):
        self.inner = inner
        self.size, self.rank = inner.size, inner.rank
        self.allreduce_nbytes, self.barrier = inner.allreduce_nbytes, inner.barrier

    def size(self) -> int:
        return self.inner.size()

    def rank(self) -> int:
        return self.inner.rank()

    def allreduce_nbytes(self, tensor):
        return self.inner.allreduce_nbytes(tensor)

    def barrier(self) -> None:
        self.inner.barrier()
