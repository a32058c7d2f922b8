"""What the communicators share: laying payload parts out for the wire, counting their bytes,
and saying which communicators can carry a compressor.

Every payload part travels flattened to 1-D (scalars become one element); the receiver gives
each piece back the layout of its own part of the same index (``unflatten``), which is how
compressors' ``decompress`` can treat another rank's payload like its own.

A payload of several parts whose sizes every rank knows in advance (``equal_sizes``) travels
**packed** (``pack``): its parts' bytes one after another in one uint8 buffer, one collective
instead of one per part. Horovod fuses only collectives of one dtype, so topk's float32 values
and int64 indices went as two allgathers, each with its own negotiation (one part could
wait behind the other), and two-phase's all-to-alls (never fused) as one per part. Packing
moves the same bytes (no padding: a part that does not start on a multiple of its width is
copied out, not viewed).
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.registry import lookup, names

#: bytes per part of the int32 lengths vector that goes with a payload of data-dependent size
#: (``Collectives.allgather_parts_async``)
LENGTH_NBYTES = 4


def flatten(payload):
    """(1-D parts, their original shapes)."""
    return ops_for(payload[0]).flat_parts(payload)


def packable(flats) -> bool:
    """Whether 1-D parts ``flats`` travel packed: more than one part, none of them ``bool``
    (TF cannot reinterpret a bool's bytes)."""
    return len(flats) > 1 and ops_for(flats[0]).part_layout(flats) is not None


def pack(flats):
    """The 1-D parts' bytes, one after another, as one 1-D uint8 tensor (no padding: a part
    with no elements adds none)."""
    return ops_for(flats[0]).pack_parts(flats)


def layout(flats) -> list:
    """``(dtype, bytes)`` of each 1-D part: what ``unpack`` needs to cut a packed buffer."""
    return ops_for(flats[0]).part_layout(flats)


def unpack(buffer, parts: list) -> list:
    """A ``pack``-ed 1-D uint8 ``buffer`` of parts laid out as ``parts`` (``layout``) cut back
    into its 1-D parts."""
    return [p[0] for p in ops_for(buffer).unpack_parts(buffer, [parts])]


def unpack_all(buffer, layouts: list) -> list:
    """Segments of packed payloads one after another in ``buffer`` (a gather: one per rank, or
    per chunk), laid out as ``layouts`` (``[]`` for an empty segment), cut into
    ``pieces[i][s]``: part i of (non-empty) segment s."""
    return ops_for(buffer).unpack_parts(buffer, layouts)


def unflatten(piece, shape, equal_sizes: bool = True):
    """``piece`` in the layout of a local part of ``shape``: that exact shape when sizes are
    equal across ranks, else the same trailing dimensions with a free first one."""
    return ops_for(piece).shaped_parts([[piece]], [shape], 1, equal_sizes)[0][0]


def combine(comm, pieces, shapes, handle, ranks: int, average: bool = False, ops=None):
    """Every rank's payload decompressed and aggregated (``compressor.combine``;
    ``pieces[i][r]``: part i of rank r's payload, flat). This rank's own payload is taken from
    what came back too: reusing its encode-time approximation instead would leave its own
    collective's result unused, and ``tf.function`` prunes an op whose result is unused (a
    root's broadcast never starts). ``average``: the result is this rank's final one, so an
    average may be folded into the payloads' values (``base.divided_payloads``). ``ops``:
    the pieces' backend, where the caller has it."""
    from grace_dl.communicators.base import divided_payloads

    payloads = (ops or ops_for(pieces[0][0])).shaped_parts(
        pieces, shapes, ranks, comm.compressor.caps.equal_sizes) if pieces else [[]] * ranks
    path = comm.paths.on(payloads)
    if average:
        payloads = divided_payloads(handle, payloads, path)
    return path.combine(payloads, handle.encoded.ctx, handle.into)


def nbytes(tensors):
    """Total bytes of ``tensors`` (a Python int, or a scalar tensor inside ``tf.function``
    when a size is only known at run time)."""
    return ops_for(tensors[0]).total_nbytes(tensors) if tensors else 0


def ragged_sent(pieces, me: int):
    """Bytes rank ``me`` sent in a ragged gather (``Collectives.synchronize_parts``'s
    ``pieces[i][r]``): its own parts, as they arrived, and its lengths vector."""
    return nbytes([part[me] for part in pieces]) + LENGTH_NBYTES * len(pieces)


def ragged_received(pieces, me: int):
    """Bytes rank ``me`` received of a ragged gather (``Collectives.synchronize_parts``'s
    ``pieces[i][r]``): every other rank's parts and its lengths vector."""
    others = [p for part in pieces for r, p in enumerate(part) if r != me]
    return nbytes(others) + LENGTH_NBYTES * len(pieces) * (len(pieces[0]) - 1)


def count(comm, ops, name: str, sent=0, received=0) -> None:
    """Add to ``comm.bytes`` for tensor ``name`` each time this runs (also under
    ``tf.function``, where the values may be run-time scalars)."""
    counter = comm.bytes
    if ops.NAME == "torch" and type(sent) is int and type(received) is int:
        # torch runs this each step: no callback (``ByteCounter.add``, inline)
        counter.sent[name] += sent
        counter.received[name] += received
    else:   # (TF inside tf.function: a callback, or the count would be taken once, at trace)
        ops.host_callback(lambda s, r: counter.add(name, sent=s, received=r), sent, received)


def ring_allreduce_bytes(nbytes_: int, size: int) -> int:
    """Bytes a rank sends (and receives) in a bandwidth-optimal ring allreduce of an
    ``nbytes_`` buffer over ``size`` ranks: 2 (N-1)/N of it (reduce-scatter, then allgather)."""
    return (2 * (size - 1) * nbytes_) // size if size > 1 else 0


def chunk_sizes(numel: int, size: int) -> list[int]:
    """Split ``numel`` elements into ``min(size, numel)`` contiguous chunks as evenly as
    possible (the first ``numel % size`` one element longer)."""
    m = min(size, numel)
    base, extra = divmod(numel, m) if m else (0, 0)
    return [base + 1] * extra + [base] * (m - extra)


def describe(compressor) -> str:
    name = getattr(compressor, "registry_name", None) or type(compressor).__name__
    return repr(name)


def carriers(compressor) -> list[str]:
    """Names of the registered communicators that accept ``compressor``."""
    out = []
    for name in names("communicator"):
        try:
            cls = lookup("communicator", name)
        except (ImportError, ValueError):
            continue
        if cls.refusal(compressor) is None:
            out.append(name)
    return out


def refuse(communicator: str, compressor, reason: str):
    """The ``ValueError`` a communicator raises for a compressor it cannot carry."""
    others = [c for c in carriers(compressor) if c != communicator]
    instead = (f"use communicator {' or '.join(repr(c) for c in others)} instead" if others
               else "no registered communicator carries it")
    return ValueError(f"communicator {communicator!r} cannot carry compressor "
                      f"{describe(compressor)}: {reason}; {instead}")
