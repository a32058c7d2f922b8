"""Fusion: several tensors' payloads in one collective per group, kind and dtype, and where
payloads live while they travel (the strategy's collective spec).

**Fusion in an async send/receive API.** Gradients of one group arrive one by one (hooks fire
during the backward pass, in an order that may differ across ranks). A communicator with fusion
groups (``Communicator.fuse``) encodes each as it arrives (so error feedback stays per tensor)
but *holds* it (``Fusion``); when the last member of the group has been sent it issues the
members in the group's fixed order (the same on every rank) on a ``GroupCollectives`` in
*collecting* mode, which records their collective calls instead of starting them. Closing the
group issues the recorded calls bucketed by (kind, dtype, root): one collective per bucket on
the concatenation of the flattened tensors, named
``grace.fused.<label>.<n>.<kind>.<dtype>``. Each member's handle resolves to its own slice. A
``receive`` that comes before its group is complete issues the members sent so far. Calls made
after the group is closed (later rounds of multi-round compressors, two-phase's gather, the PS
broadcast) go out at once, unfused, under their own names. Fusing does not change the bytes of
the payloads; it removes per-collective latency and negotiation. All-to-all calls are never
fused.

Fused allgather: every rank contributes one flat buffer; when sizes may differ across ranks
(``equal_sizes`` False) an int32 vector of the members' element counts is allgathered with it
(4 bytes per member per rank, counted under the group's label in the byte counters) so each
rank's buffer can be cut back into members.

**Spec** (``HostCollectives``). ``AUTO``: payloads stay where the gradient is. ``RING``: each
(fused) buffer is copied to host memory before the collective and the result back to the
gradient's device after, so Gloo/MPI's ring algorithms carry it. ``NCCL``: payloads stay on the
GPU (the strategy dispatcher rejects a gradient that is not on one).
"""


from __future__ import annotations

from itertools import repeat

from grace_dl.backend import ops_for
from grace_dl.collectives import Wrapping

AUTO, NCCL, RING = 0, 1, 2


class _Call:
    """One collective call of a member; ``value`` once resolved."""

    __slots__ = ("kind", "tensor", "name", "root", "resolve", "value", "done")

    def __init__(self, kind, tensor, name, root=None):
        self.kind, self.tensor, self.name, self.root = kind, tensor, name, root
        self.resolve = None  # set when issued: a function that fills ``value`` (and siblings')
        self.value = None
        self.done = False


class HostCollectives(Wrapping):
    """Spec ``RING``: ``inner``'s collectives on host copies of the tensors, results moved back
    to the device of the tensor they answer."""

    def allreduce_async(self, tensor, name: str):
        return (self.inner.allreduce_async(_host(tensor), name), tensor)

    def allgather_async(self, tensor, name: str):
        return (self.inner.allgather_async(_host(tensor), name), tensor)

    def broadcast_async(self, tensor, root: int, name: str):
        return (self.inner.broadcast_async(_host(tensor), root, name), tensor)

    def alltoall_async(self, tensor, splits, name: str):
        return (self.inner.alltoall_async(_host(tensor), splits, name), tensor)

    def allgather_known_async(self, tensor, counts, name: str):
        return (self.inner.allgather_known_async(_host(tensor), counts, name), tensor)

    def alltoall_known_async(self, tensor, splits, matrix, name: str):
        return (self.inner.alltoall_known_async(_host(tensor), splits, matrix, name), tensor)

    def synchronize(self, handle):
        inner, like = handle
        out = self.inner.synchronize(inner)
        if isinstance(out, tuple):
            return (_device(out[0], like), out[1])
        return _device(out, like)


def _host(tensor):
    return ops_for(tensor).to_host(tensor)


def _device(tensor, like):
    return ops_for(tensor).to_device(tensor, like)


def split_evenly(names: list, groups: int) -> list[list]:
    """``names`` in order, cut into ``groups`` contiguous groups as even as possible (the
    first ones one longer), as Horovod's ``groups=<int>`` splits its tensors."""
    size, extra = divmod(len(names), groups)
    out, start = [], 0
    for i in range(min(groups, len(names))):
        stop = start + size + (1 if i < extra else 0)
        out.append(list(names[start:stop]))
        start = stop
    return out


class Fusion:
    """A communicator's fusion groups: which tensor names travel together, and the members of
    each group encoded so far this step (see module doc)."""

    def __init__(self, groups):
        if isinstance(groups, dict):
            items = [(str(label), list(names)) for label, names in groups.items()]
        else:
            items = [(f"g{i}", list(names)) for i, names in enumerate(groups)]
        self.groups: dict[str, list[str]] = {}
        self.group_of: dict[str, str] = {}
        for label, names in items:
            for name in names:
                if not isinstance(name, str):
                    raise ValueError(f"fusion group {label!r} has a member {name!r} that is not "
                                     f"a tensor name")
                if name in self.group_of:
                    raise ValueError(f"tensor {name!r} is in fusion groups "
                                     f"{self.group_of[name]!r} and {label!r}; a tensor can only "
                                     f"be in one group")
                self.group_of[name] = label
            self.groups[label] = names
        self.waiting: dict[str, dict] = {label: {} for label in self.groups}

    def holds(self, name: str) -> bool:
        """Whether ``name`` belongs to a group of more than one member."""
        label = self.group_of.get(name)
        return label is not None and len(self.groups[label]) > 1

    def hold(self, comm, handle) -> None:
        """Keep ``handle`` until its group is complete, then issue the group."""
        label = self.group_of[handle.name]
        waiting = self.waiting[label]
        if handle.name in waiting:
            raise ValueError(f"tensor {handle.name!r} was sent twice before its fusion group "
                             f"{label!r} went out")
        waiting[handle.name] = handle
        if len(waiting) == len(self.groups[label]):
            self.issue(comm, label)

    def flush(self, comm, name: str) -> None:
        """Issue ``name``'s group with the members sent so far (a receive came first)."""
        self.issue(comm, self.group_of[name])

    def issue(self, comm, label: str) -> None:
        waiting, self.waiting[label] = self.waiting[label], {}
        if not waiting:
            return
        first = next(iter(waiting.values()))
        coll = GroupCollectives(first.coll, label, collecting=len(waiting) > 1,
                                equal_sizes=comm.compressor.caps.equal_sizes, counter=comm.bytes)
        for name in self.groups[label]:
            handle = waiting.get(name)
            if handle is not None:
                handle.coll = coll
                handle.phase = comm.issue(handle.encoded, handle)
        coll.close()

    def config(self) -> dict:
        return {label: list(names) for label, names in self.groups.items()}


class GroupCollectives(Wrapping):
    """``Collectives`` for one fusion group's members during one step (see module doc)."""

    def __init__(self, inner, label: str, collecting: bool = False, equal_sizes: bool = True,
                 counter=None):
        super().__init__(inner)
        self.label = label
        self.collecting = collecting
        self.equal_sizes = equal_sizes
        self.counter = counter
        self._recorded: list[_Call] = []
        self._batches = 0

    # ------------------------------------------------------------------ Collectives
    def allreduce_async(self, tensor, name: str):
        return self._call(_Call("allreduce", tensor, name))

    def allgather_async(self, tensor, name: str):
        return self._call(_Call("allgather", tensor, name))

    def broadcast_async(self, tensor, root: int, name: str):
        return self._call(_Call("broadcast", tensor, name, root))

    def alltoall_async(self, tensor, splits, name: str):
        return self.alltoall_known_async(tensor, splits, None, name)

    def alltoall_known_async(self, tensor, splits, matrix, name: str):
        call = _Call("alltoall", tensor, name)
        handle = self.inner.alltoall_async(tensor, splits, name) if matrix is None else \
            self.inner.alltoall_known_async(tensor, splits, matrix, name)

        def resolve():
            call.value, call.done = self.inner.synchronize(handle), True
        call.resolve = resolve
        return call

    def synchronize(self, handle):
        if not isinstance(handle, _Call):
            raise ValueError(f"not a handle of this group's collectives: {handle!r}")
        if handle.resolve is None:  # still recorded: issue what the group has so far
            self.flush()
        if not handle.done:
            handle.resolve()
        return handle.value


    # ------------------------------------------------------------------ fusion
    def collect(self) -> None:
        """Record calls again until the next ``close`` (one lockstep pass of
        ``Router.receive_all``, which fuses later rounds). Later rounds' sizes may differ
        across ranks even where the first payloads' do not (two-phase's gathered chunks), so
        fused allgathers then carry their lengths."""
        self.collecting = True
        self.equal_sizes = False

    def close(self) -> None:
        """Issue every recorded call; later calls go out at once."""
        self.flush()
        self.collecting = False

    def flush(self) -> None:
        recorded, self._recorded = self._recorded, []
        if not recorded:
            return
        ops = ops_for(recorded[0].tensor)       # (one framework per group)
        buckets: dict[tuple, list[_Call]] = {}
        for call in recorded:
            key = (call.kind, ops.dtype(call.tensor), call.root)
            buckets.setdefault(key, []).append(call)
        for (kind, dtype, root), calls in buckets.items():
            if len(calls) == 1:
                self._issue(calls[0])
            else:
                self._issue_fused(kind, dtype, root, calls)

    def _call(self, call: _Call) -> _Call:
        if self.collecting:
            self._recorded.append(call)
        else:
            self._issue(call)
        return call

    # ------------------------------------------------------------------ issuing
    def _start(self, kind, tensor, name, root):
        if kind == "allreduce":
            return self.inner.allreduce_async(tensor, name)
        if kind == "allgather":
            return self.inner.allgather_async(tensor, name)
        return self.inner.broadcast_async(tensor, root, name)

    def _issue(self, call: _Call) -> None:
        handle = self._start(call.kind, call.tensor, call.name, call.root)

        def resolve():
            call.value, call.done = self.inner.synchronize(handle), True
        call.resolve = resolve

    def _issue_fused(self, kind, dtype, root, calls) -> None:
        ops = ops_for(calls[0].tensor)
        flats = [ops.flatten(c.tensor) for c in calls]
        numels = [ops.numel(f) for f in flats]
        name = f"grace.fused.{self.label}.{self._batches}.{kind}.{dtype}"
        self._batches += 1
        fused = ops.cat(flats)
        # the concatenation is ours alone: summed in place where the engine can (else into
        # the fresh buffer ``allreduce_async`` takes, a second copy of it)
        handle = (self.inner.allreduce_async_(fused, name) if kind == "allreduce" else None) \
            or self._start(kind, fused, name, root)
        lengths = None
        static = all(map(isinstance, numels, repeat(int)))     # (no frame per tensor)
        if kind == "allgather" and not (self.equal_sizes and static):
            counts = ops.numels(flats)
            lengths = self._start("allgather", counts, f"{name}.len", None)
            if self.counter is not None:
                size, label, counter = self.size(), self.label, self.counter
                ops.host_callback(lambda s: counter.add(label, sent=s, received=s * (size - 1)),
                                  ops.nbytes(counts))

        def resolve():
            out = self.inner.synchronize(handle)
            if kind != "allgather":
                pieces = ops.split(out, numels) if static else ops.split_by(out, ops.numels(flats))
                for call, piece in zip(calls, pieces):
                    call.value = ops.reshape(piece, ops.shape(call.tensor))
            else:
                k, size = len(calls), self.size()
                if lengths is None:
                    pieces = ops.split(out, numels * size)
                else:
                    counts = self.inner.synchronize(lengths)
                    pieces = ops.split_by(out, ops.flatten(counts))
                for j, call in enumerate(calls):
                    shape = ops.shape(call.tensor)
                    rows = [pieces[r * k + j] for r in range(size)]
                    if len(shape) >= 2:
                        rows = [ops.reshape(p, (-1, *shape[1:])) for p in rows]
                    call.value = ops.cat(rows)
            for call in calls:
                call.done = True

        for call in calls:
            call.resolve = resolve
