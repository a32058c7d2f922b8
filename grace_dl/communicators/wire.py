"""What the communicators share: laying payload parts out for the wire, counting their bytes,
and saying which communicators can carry a compressor.

Every payload part travels flattened to 1-D (scalars become one element), one collective per
part; the receiver gives each piece back the layout of its own part of the same index
(``unflatten``), which is how compressors' ``decompress`` can treat another rank's payload like
its own.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.registry import lookup, names


def flatten(payload):
    """(1-D parts, their original shapes)."""
    ops = ops_for(payload[0])
    return [ops.flatten(p) for p in payload], [ops.shape(p) for p in payload]


def unflatten(piece, shape, equal_sizes: bool = True):
    """``piece`` in the layout of a local part of ``shape``: that exact shape when sizes are
    equal across ranks, else the same trailing dimensions with a free first one."""
    ops = ops_for(piece)
    if equal_sizes or len(shape) == 0:
        return ops.reshape(piece, shape)
    if len(shape) == 1:
        return piece
    return ops.reshape(piece, (-1, *shape[1:]))


def combine(comm, pieces, shapes, handle, ranks: int, average: bool = False):
    """Every rank's payload decompressed and aggregated (``compressor.combine``;
    ``pieces[i][r]``: part i of rank r's payload, flat). This rank's own payload is taken from
    what came back too: reusing its encode-time approximation instead would leave its own
    collective's result unused, and ``tf.function`` prunes an op whose result is unused (a
    root's broadcast never starts). ``average``: the result is this rank's final one, so an
    average may be folded into the payloads' values (``base.divided_payloads``)."""
    from grace_dl.communicators.base import divided_payloads

    equal = comm.compressor.equal_sizes
    payloads = [[unflatten(p[r], s, equal) for p, s in zip(pieces, shapes)]
                for r in range(ranks)]
    if average:
        payloads = divided_payloads(handle, payloads)
    return comm.compressor.combine(payloads, handle.encoded.ctx, handle.into)


def nbytes(tensors):
    """Total bytes of ``tensors`` (a Python int, or a scalar tensor inside ``tf.function``
    when a size is only known at run time)."""
    total = 0
    for t in tensors:
        total = total + ops_for(t).nbytes(t)
    return total


def count(comm, ops, name: str, sent=0, received=0) -> None:
    """Add to ``comm.bytes`` for tensor ``name`` each time this runs (also under
    ``tf.function``, where the values may be run-time scalars)."""
    counter = comm.bytes
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
    return [base + (1 if j < extra else 0) for j in range(m)]


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
