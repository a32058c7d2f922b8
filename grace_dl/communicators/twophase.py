"""``twophase``: compressed allreduce as scatter-reduce then gather (DeepSpeed's 1-bit Adam,
Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed"; CGX, Markov et al. 2022), with error feedback on both sides.

1. The compensated tensor (the memory's error feedback, applied to the whole tensor) is split
   into ``m = min(N, numel)`` contiguous chunks, as even as possible; chunk j is compressed as
   ``<name>/chunk<j>`` and sent to rank j by one ``alltoall`` of every chunk's payload, its
   parts packed into one byte buffer (``wire.pack``; ``grace.<tensor>.a2a.p``; with
   ``pack_parts=False`` one per part, ``grace.<tensor>.a2a.p<i>``: Horovod never fuses
   all-to-alls, so each is a cycle of its own). The memory is updated with what the N chunk
   compressions lost.
2. Rank j decompresses the N payloads of its chunk, aggregates them (sum, or majority vote for
   signs), adds its server-side residual for that chunk, re-compresses the result as
   ``<name>/chunk<j>/server`` and keeps what that lost as the new server residual.
3. One ``allgather`` (``grace.<tensor>.ag.p``, packed; unpacked one per part,
   ``grace.<tensor>.ag.p<i>``) gives every rank every chunk's
   re-compressed payload; each is decompressed and the chunks are joined in order.

Ranks j >= m (tensors with fewer elements than ranks) own no chunk: they receive nothing in
phase 1 and contribute an empty piece to phase 2. Phase 2 needs phase 1's result, so it is the
second ``Phase``, started in ``receive``.

Wire, per rank and step: it sends the N-1 other chunks' payloads and its re-compressed chunk,
and receives N-1 payloads of its chunk plus the other m-1 re-compressed chunks: about
2 (N-1)/N of one whole-tensor payload each way, whatever N (allgather receives N-1 payloads).
The byte counters record exactly these amounts.

For compressors that compress any 1-D chunk on its own (``two_phase_safe``: quantizers and
signs, ``none``). Where payload sizes are set by the chunk's length (``equal_sizes``) every rank
knows every size up front; where they depend on the data (signsgd's zero plane, inceptionn's
classes) each part travels in a collective of its own, the all-to-all's received splits say how
long each rank's part is, and the gather carries an int32 vector of the parts' lengths (as the
``allgather`` communicator's). Those exchanges of sizes are where a path that can cut its
payloads after compressing (signSGD's on a GPU: ``Call.exchanges_sizes``) has their sizes read
(``Collectives.alltoall_parts_async``, ``allgather_parts_async``). Not unbiased in general,
since the aggregate is compressed twice; the server residual feeds the second compression's
error back in the next step. Server residuals are training state: they are in ``state_dict``
under ``"server"``. Like the memories (``grace_dl.memory.base``) they never keep a NaN/Inf:
after each server step its non-finite entries are set to 0."""

from __future__ import annotations

from dataclasses import dataclass

from grace_dl import validate
from grace_dl.backend import ops_for
from grace_dl.collectives import issued
from grace_dl.communicators import wire
from grace_dl.communicators.base import (
    Encoded,
    Handle,
    InFlight,
    PackingCommunicator,
    Phase,
    Ready,
    average_divisor,
    divided_payloads,
)
from grace_dl.compressors.base import Call
from grace_dl.compressors.paths import overrides
from grace_dl.dtypes import itemsize
from grace_dl.registry import register_communicator
from grace_dl.state import State


@dataclass
class Scattering(InFlight):
    """Phase 1: the all-to-alls of every chunk's payload parts in flight (``handles``).
    ``flat[j]`` is chunk j's payload as (1-D parts, their shapes)."""

    flat: list
    #: whether the payload parts travel packed (``wire.pack``): one collective, not one per part
    packed: bool = False
    #: whether payload sizes differ across ranks: each part's all-to-all says how long it is
    #: (``handles`` are then its ``Sized`` all-to-alls, one a part, whose ``splits``, once
    #: issued, are the rows sent to each rank)
    ragged: bool = False


@dataclass
class Gathering(InFlight):
    """Phase 2: the allgathers of every rank's re-compressed chunk in flight (``handles``)."""

    flat: list
    #: this rank's chunk as the gather will deliver it (decoded for the server's error
    #: feedback already), or None
    own: object = None
    packed: bool = False
    #: ``own`` is already written in the handle's ``into`` (``_server_step`` fused)
    own_in_place: bool = False
    #: for payload sizes that differ across ranks: the parts' dtypes (``handles`` holds the
    #: one ``Collectives.allgather_parts_async`` handle)
    ragged_dtypes: list | None = None


@register_communicator("twophase")
class TwoPhase(PackingCommunicator):
    def __init__(self, compressor, memory, process_set=None, server_error_feedback: bool = True,
                 pack_parts: bool = True):
        super().__init__(compressor, memory, process_set, pack_parts)
        self.server_error_feedback = validate.boolean("server_error_feedback",
                                                      server_error_feedback)
        # a ragged payload's lengths travel in the all-to-all's and the gather's exchanges of
        # sizes (not for a subclass that changed what a payload is or how it is sent)
        self.exchanges_sizes = not compressor.caps.equal_sizes and not any(
            overrides(type(self), TwoPhase, m) for m in
            ("compress", "compress_with_error", "_recompress", "issue", "complete"))
        self.server = State()
        # per key, a reused buffer for values that live within one step (not training state)
        self._scratch: dict = {}

    @classmethod
    def refusal(cls, compressor) -> str | None:
        """Why this communicator cannot carry ``compressor`` (None when it can)."""
        if compressor.caps.rounds > 1:
            return "it needs several rounds (rounds > 1)"
        if not compressor.caps.two_phase_safe:
            return ("it cannot compress tensor chunks independently and re-compress their "
                    "aggregate (two_phase_safe is False)")
        return None

    # ------------------------------------------------------------------ encode: per chunk
    def compress(self, compensated, name: str, call: Call):
        """Payload and ctx are per-chunk lists: chunk j compressed as ``<name>/chunk<j>``."""
        ops = ops_for(compensated)
        numel = ops.numel(compensated)
        if not isinstance(numel, int):
            raise ValueError(f"twophase needs a statically shaped tensor; {name!r} has shape "
                             f"{ops.shape(compensated)}")
        if numel == 0:  # nothing to move; every rank sees the same shape, so all skip
            return [], []
        chunks = ops.split(ops.flatten(compensated), wire.chunk_sizes(numel, call.size))
        compressed = [self.paths.on(c).compress(c, f"{name}/chunk{j}", call)
                      for j, c in enumerate(chunks)]
        payloads, ctxs = zip(*compressed)
        return list(payloads), list(ctxs)

    def compress_with_error(self, compensated, name: str, call: Call, error):
        """``compress``, each chunk writing its error into its slice of ``error``."""
        ops = ops_for(compensated)
        numel = ops.numel(compensated)
        flat = ops.flat_view(error)
        if not isinstance(numel, int) or numel == 0 or flat is None:
            return None
        sizes = wire.chunk_sizes(numel, call.size)
        chunks = ops.split(ops.flatten(compensated), sizes)
        errors = ops.split(flat, sizes)
        compressed = []
        for j, (c, e) in enumerate(zip(chunks, errors)):
            got = self.paths.on(c).compress_with_error(c, f"{name}/chunk{j}", call, e)
            if got is None:
                if j:   # the chunks differ only in length: cannot happen after the first
                    raise RuntimeError(f"twophase: chunk {j} of {name!r} could not write "
                                       f"its error after chunk 0 did")
                return None
            compressed.append(got)
        payloads, ctxs = zip(*compressed)
        return list(payloads), list(ctxs)

    def error_finite(self, payload) -> bool:
        for p in payload:
            if not self.paths.on(p).error_finite(p):
                return False
        return True

    def approximate(self, encoded: Encoded):
        """The chunks' decompressions joined in the tensor's shape."""
        like = encoded.compensated
        if not encoded.payload:
            return like
        return self._decompress_chunks(encoded.payload, encoded.ctx,
                                       self._buffer(f"{encoded.name}/approximation", like))

    # ------------------------------------------------------------------ phase 1
    def issue(self, encoded: Encoded, handle: Handle) -> Phase:
        if not encoded.payload:
            return Ready(encoded.compensated)
        coll = handle.coll
        size, me = handle.encoded.call.size, handle.encoded.call.rank  # (coll's)
        ops = ops_for(encoded.compensated)
        flat = list(map(ops.flat_parts, encoded.payload))   # per chunk: (1-D parts, shapes)
        m, n_parts = len(flat), len(flat[0][0])
        ragged = not self.compressor.caps.equal_sizes
        packed = not ragged and self.packed_layout(flat[0][0], ops) is not None
        # every rank sends chunk j's payload of the same length: sizes known up front
        if packed:
            buffers, splits = [], []
            for j in range(m):
                buffers.append(ops.pack_parts(flat[j][0]))
                splits.append(ops.numel(buffers[j]))
            splits += [0] * (size - m)
            exchanges = [coll.alltoall_known_async(ops.cat(buffers), splits, [splits] * size,
                                                   self.wire_name(handle.name, "a2a.p"))]
        else:
            exchanges = []
            # a ragged payload's parts may be longer than sent (``call.exchanges_sizes``):
            # the path's lengths, one a part, of each chunk
            lengths = [self.paths.on(p).sent_lengths(p, c)
                       for p, c in zip(encoded.payload, encoded.ctx)] \
                if ragged and encoded.call.exchanges_sizes else None
            if lengths is not None and lengths[0] is None:
                lengths = None
            for i in range(n_parts):
                pieces = [flat[j][0][i] for j in range(m)]
                name = self.wire_name(handle.name, f"a2a.p{i}")
                if ragged:
                    part_lengths = lengths
                    if lengths is not None:         # (part i's, one a chunk)
                        part_lengths = lengths[0] if m == 1 and n_parts == 1 else \
                            ops.cat([ops.slice(lens, i, i + 1) for lens in lengths])
                    exchanges.append(coll.alltoall_parts_async(pieces, part_lengths, name))
                    continue
                splits = [ops.numel(p) for p in pieces] + [0] * (size - m)
                exchanges.append(coll.alltoall_known_async(ops.cat(pieces), splits,
                                                           [splits] * size, name))
        if ragged:      # counted when the all-to-all is in (``_reduce_and_gather``)
            return Scattering(exchanges, flat, packed, ragged)
        sent = 0
        for j in range(m):
            if j != me:
                sent += ops.total_nbytes(flat[j][0])
        received = (size - 1) * ops.total_nbytes(flat[me][0]) if me < m else 0
        wire.count(self, ops, handle.name, sent=sent, received=received)
        return Scattering(exchanges, flat, packed, ragged)

    # ------------------------------------------------------------------ phases 2 and 3
    def complete(self, phase: Phase, handle: Handle):
        if isinstance(phase, Scattering):
            return self._reduce_and_gather(phase, handle)
        return self._join(phase, handle)

    def _reduce_and_gather(self, phase: Scattering, handle: Handle) -> Gathering:
        coll = handle.coll
        size, me = handle.encoded.call.size, handle.encoded.call.rank  # (coll's)
        flat, ctxs = phase.flat, handle.encoded.ctx
        m, n_parts = len(flat), len(flat[0][0])
        ops = ops_for(flat[0][0][0])
        mine = own = None
        own_in_place = False
        results, got = [], []       # (loops, not comprehensions: a frame each on 3.11)
        for h in phase.handles:
            results.append(coll.synchronize(issued(h)))
            got.append(results[-1][0])
        if phase.ragged:        # what went to every other rank, and this rank's own rows
            sent = own_nbytes = 0
            for i, exchange in enumerate(phase.handles):      # (``Sized``: issued now)
                splits = exchange.splits
                width = itemsize(ops.dtype(flat[0][0][i]))
                own_nbytes += splits[me] * width
                sent += (sum(splits) - splits[me]) * width
            wire.count(self, ops, handle.name, sent=sent)
        if me < m:
            # from each rank, part i of its payload for my chunk: the length of my own, or as
            # the all-to-all says where sizes differ
            if phase.packed:
                per_rank = ops.unpack_parts(got[0], [ops.part_layout(flat[me][0])] * size)
            elif phase.ragged:
                per_rank = [_split_received(ops, g, r[1]) for g, r in zip(got, results)]
                received = wire.nbytes(got) - own_nbytes
                wire.count(self, ops, handle.name, received=received)
            else:
                per_rank = [ops.split(g, [ops.numel(flat[me][0][i])] * size)
                            for i, g in enumerate(got)]
            lengths = wire.chunk_sizes(ops.numel(handle.encoded.compensated), m)
            start = sum(lengths[:me])
            like = ops.slice(ops.flatten(handle.encoded.compensated), start, start + lengths[me])
            payloads = ops.shaped_parts(per_rank, flat[me][1], size, not phase.ragged)
            key = f"{handle.name}/chunk{me}"
            fused = self._server_step(payloads, ctxs[me], like, handle, key, start)
            if fused is not None:
                mine, own, own_in_place = fused
            else:
                reduced = self.paths.on(payloads).combine(payloads, ctxs[me],
                                                  self._buffer(f"{handle.name}/reduced", like))
                mine, own = self._recompress(reduced, key, handle.encoded.call)

        # A rank that owns no chunk received nothing and contributes that empty piece;
        # using it keeps its alltoall alive in tf.function, which prunes unused ops.
        ragged_dtypes = None
        if phase.packed:
            piece = ops.pack_parts(mine) if mine is not None else got[0]
            counts = []
            for j in range(m):
                counts.append(ops.total_nbytes(flat[j][0]))
            counts += [0] * (size - m)
            gathers = [coll.allgather_known_async(piece, counts,
                                                  self.wire_name(handle.name, "ag.p"))]
        elif phase.ragged:
            pieces = [mine[i] if mine is not None else got[i] for i in range(n_parts)]
            lengths = None if mine is None or not handle.encoded.call.exchanges_sizes else \
                self.paths.on(mine).sent_lengths(mine, ctxs[me])
            gathers = [coll.allgather_parts_async(
                pieces, [self.wire_name(handle.name, f"ag.p{i}") for i in range(n_parts)],
                self.wire_name(handle.name, "ag.len"), lengths)]
            ragged_dtypes = [ops.dtype(p) for p in pieces]
        else:
            gathers = []
            for i in range(n_parts):
                piece = mine[i] if mine is not None else got[i]
                counts = [ops.numel(flat[j][0][i]) for j in range(m)] + [0] * (size - m)
                gathers.append(coll.allgather_known_async(
                    piece, counts, self.wire_name(handle.name, f"ag.p{i}")))
        if ragged_dtypes is None:       # (ragged: counted when the gather is in, ``_join``)
            sent = ops.total_nbytes(mine) if mine is not None else 0
            received = 0
            for j in range(m):
                if j != me:
                    received += ops.total_nbytes(flat[j][0])
            wire.count(self, ops, handle.name, sent=sent, received=received)
        return Gathering(gathers, flat, own, phase.packed, own_in_place, ragged_dtypes)

    def _join(self, phase: Gathering, handle: Handle):
        coll = handle.coll
        size, me = handle.encoded.call.size, handle.encoded.call.rank  # (coll's)
        flat, ctxs = phase.flat, handle.encoded.ctx
        m, n_parts = len(flat), len(flat[0][0])
        if phase.ragged_dtypes is not None:
            pieces = coll.synchronize_parts(phase.handles[0], phase.ragged_dtypes)
            ops = ops_for(pieces[0][0])
            wire.count(self, ops, handle.name, sent=wire.ragged_sent(pieces, me),
                       received=wire.ragged_received(pieces, me))
        elif phase.packed:
            gathered = []
            for h in phase.handles:
                gathered.append(coll.synchronize(h))
            ops = ops_for(gathered[0])
            layouts = []
            for j in range(m):
                layouts.append(ops.part_layout(flat[j][0]))
            pieces = ops.unpack_parts(gathered[0], layouts + [[]] * (size - m))
        else:
            gathered = [coll.synchronize(h) for h in phase.handles]
            ops = ops_for(gathered[0])
            lengths = [[ops.numel(flat[j][0][i]) for j in range(m)] + [0] * (size - m)
                       for i in range(n_parts)]
            pieces = [ops.split(g, lengths[i]) for i, g in enumerate(gathered)]
        equal = phase.ragged_dtypes is None
        payloads = []
        for j in range(m):
            column = []
            for i in range(n_parts):
                column.append([pieces[i][j]])
            payloads.append(ops.shaped_parts(column, flat[j][1], 1, equal)[0])
        if handle.into is not None and ops.flat_view(handle.into) is not None:
            # decoded straight into ``into``: the average may be folded into the payloads
            payloads = divided_payloads(handle, payloads)
        # this rank's own chunk as it decoded it, unless the payloads were divided: then from
        # its divided payload, as every other rank decodes it (a decoding divided by N and
        # the decoding of a payload divided by N differ in rounding unless N is a power of
        # two, and the ranks would disagree on the chunk)
        known = {} if phase.own is None or handle.finished_in_place else {me: phase.own}
        done = {me} if phase.own_in_place else set()
        return self._decompress_chunks(payloads, ctxs, handle.into, handle.encoded.compensated,
                                       known, done)

    def _decompress_chunks(self, payloads, ctxs, out, like=None, known=None, done=()):
        """Every chunk's payload decompressed and joined in the tensor's shape: each straight
        into its slice of ``out`` where ``out`` has a flat view (torch), else joined by a
        concatenation shaped like ``like``. ``known``: chunks already decoded, by index;
        ``done``: chunks already in their slice of ``out``."""
        ops = ops_for(payloads[0][0])
        known = known or {}
        flat = None if out is None else ops.flat_view(out)
        if flat is None:
            chunks = [known[j] if j in known else self.paths.on(p).decompress(p, c)
                      for j, (p, c) in enumerate(zip(payloads, ctxs))]
            return ops.reshape(ops.cat([ops.flatten(c) for c in chunks]),
                               ops.shape(like if out is None else out))
        start = 0
        for j, (payload, ctx, n) in enumerate(zip(payloads, ctxs,
                                                  wire.chunk_sizes(ops.numel(out),
                                                                   len(payloads)))):
            piece = ops.slice(flat, start, start + n)
            start += n
            if j in done:
                continue
            if j in known:
                ops.assign_div(piece, ops.flatten(known[j]))
            else:
                chunk = self.paths.on(payload).decompress_into(payload, ctx, piece)
                if not ops.aliases(chunk, piece):
                    ops.assign(piece, ops.flatten(chunk))
        return out

    def _server_step(self, payloads, ctx, like, handle: Handle, key: str, start: int):
        """This rank's chunk combined, fed back and re-compressed in one go where the
        compressor fuses it (its path's ``combine_with_feedback``), its decoding written
        straight into the handle's ``into`` when that is a float32 tensor with a flat view
        and nothing divides it (else into a buffer). ``(flattened payload, decoded,
        written in into)``, or None: run ``combine`` and ``_recompress``."""
        if not self.server_error_feedback or self.compressor.caps.sends_tensor:
            return None
        ops = ops_for(like)
        slot = self.server.zeros(key, ops, like)   # the slot ``_recompress`` feeds back in
        into = None if handle.into is None else ops.flat_view(handle.into)
        in_place = (into is not None and ops.dtype(into) == "float32"
                    and average_divisor(handle) is None)
        out = (ops.slice(into, start, start + ops.numel(like)) if in_place
               else self._buffer(f"{handle.name}/reduced", like))
        path = self.paths.on(payloads)
        payload = path.combine_with_feedback(payloads, ctx, slot, out)
        if payload is None:
            return None
        if not path.error_finite(payload):
            self.server.keep_finite(key)
        return wire.flatten(payload)[0], out, in_place

    def _recompress(self, reduced, key: str, call: Call):
        """Compress this rank's reduced chunk with server-side error feedback; returns its
        payload flattened for the wire, and the payload decoded where the feedback computed
        it (else None). The feedback is kept in its slot, which is also where the chunk is
        compensated (unless the payload would be that slot itself: ``none``)."""
        ops = ops_for(reduced)
        if not self.server_error_feedback:
            payload = self.paths.on(reduced).compress(reduced, f"{key}/server", call)[0]
            return wire.flatten(payload)[0], None
        slot = self.server.zeros(key, ops, reduced)
        if self.compressor.caps.sends_tensor:
            compensated = reduced + ops.read(slot)
        else:
            compensated = ops.read(ops.assign_add(slot, reduced))
        if not self.compressor.caps.sends_tensor:
            # ``reduced`` is in the slot now and the payload never holds it: decode there
            path = self.paths.on(compensated)
            got = path.compress_with_error(compensated, f"{key}/server", call, slot, reduced)
            if got is not None:
                if not path.error_finite(got[0]):
                    self.server.keep_finite(key)
                return wire.flatten(got[0])[0], reduced
        payload, ctx = self.paths.on(compensated).compress(compensated, f"{key}/server", call)
        if self.compressor.caps.sends_tensor:
            decoded = self.paths.on(payload).decompress(payload, ctx)
            ops.assign(slot, compensated - decoded)
        else:
            # ``reduced`` is in the slot now and the payload never holds it: decode there
            decoded = self.paths.on(payload).decompress_into(payload, ctx, reduced)
            ops.assign_sub(slot, decoded)
        self.server.keep_finite(key)
        return wire.flatten(payload)[0], decoded

    def _buffer(self, key: str, like):
        """A tensor shaped like ``like`` to build values in that live within one step (the
        encode-time approximation, the reduced chunk), kept per ``key`` and reused every step
        instead of a fresh allocation (on CPU every large fresh tensor costs page faults). Not
        training state: its contents are overwritten before they are read. Where tensors have
        no writable views (TF) it is a fresh ``zeros_like``, only a shape to build in."""
        buf = self._scratch.get(key)
        # (a kept buffer is a torch tensor: its shape, dtype and device compare as they are)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or \
                buf.device != like.device:
            ops = ops_for(like)
            buf = ops.zeros_like(like)
            if ops.flat_view(buf) is None:
                return buf
            self._scratch[key] = buf
        return buf

    # ------------------------------------------------------------------ checkpointing
    def config(self) -> dict:
        return {**super().config(), "server_error_feedback": self.server_error_feedback}

    def reset(self, name: str | None = None) -> None:
        """``Communicator.reset``, and the server residuals of ``name``'s chunks (or all)."""
        super().reset(name)
        self.server.zero([k for k in self.server.keys()
                          if name is None or k.startswith(f"{name}/chunk")])

    def state_dict(self) -> dict:
        return {**super().state_dict(), "server": self.server.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.server.restore(state.get("server", {}))


def _split_received(ops, tensor, splits):
    """``tensor`` cut into each rank's segment by an all-to-all's received splits (a tensor,
    or the list a one-process test's collectives give back)."""
    if isinstance(splits, (list, tuple)):
        return ops.split(tensor, [int(v) for v in splits])
    return ops.split_by(tensor, ops.cast(ops.reshape(splits, [-1]), "int32"))
