"""The ``Compressor`` abstraction (GRACE, Xu et al. 2021, "GRACE: A Compressed Communication
Framework for Distributed Machine Learning").

A compressor turns one gradient into a *payload* (a list of tensors: the only thing that crosses
the wire) plus a *ctx* that stays on the local rank, and back. It is written once against
``grace_dl.backend.ops_for(tensor)`` and serves torch and TensorFlow tensors alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields

from grace_dl.backend import ops_for
from grace_dl.state import Stateful
from grace_dl.validate import seed as check_seed


@dataclass(frozen=True)
class Call:
    """Who is compressing: passed to ``compress`` by the communicator (never stored on the
    compressor, which one object may serve several process sets or engines with)."""

    rank: int = 0
    size: int = 1
    #: the communicator exchanges every rank's part lengths of this payload itself (a gather
    #: of data-dependent sizes, reading them there): a speed path's ``compress`` may then
    #: return parts longer than what is sent, their sent lengths in its ``sent_lengths``,
    #: instead of reading a size on its own
    exchanges_sizes: bool = False


#: the call context of a compression outside any communicator (tests, benchmarks)
LOCAL = Call()


@dataclass(frozen=True)
class Capabilities:
    """What a compressor declares about its payloads, one record per class (a class declares
    ``caps = Capabilities(...)``; an instance whose arguments change one replaces its own
    ``self.caps = dataclasses.replace(self.caps, ...)``). Communicators, memories and the
    cost model read it; nothing probes for methods.

    ``allreduce_safe``
        Payloads from different ranks may be summed element-wise on the wire and the sum
        decompressed once (fp16, randomk with shared indices, PowerSGD's P and Q). Otherwise
        payloads must be gathered and decompressed one by one (topk, signs, qsgd with
        per-rank norms, ...).
    ``equal_sizes``
        Every rank's payload has the same shapes (False for threshold or DGC, whose number of
        kept elements varies).
    ``average``
        After aggregation, ``op=Average`` divides by the number of ranks. False for methods
        whose aggregate is already a normalised quantity (majority-vote signs).
    ``two_phase_safe``
        The method may be carried by the two-phase (scatter-reduce / gather) communicator: it
        compresses any 1-D chunk of a tensor independently (quantizers, signs).
    ``rounds``
        Collective rounds a compression takes (1, or 2 for PowerSGD). A multi-round compressor
        implements ``next_round``; its communicator calls ``memory.update`` once this rank's
        last payload is issued (a memory that wants the ranks' average: after the last round).
    ``unbiased``
        E[decompress(compress(x))] == x over the method's randomness (tests check it).
    ``needs_shape``
        ``compress`` needs the tensor in its own shape (PowerSGD's matrix view), so it cannot
        compress several tensors flattened into one bucket; ``payload_nbytes`` then takes the
        shape.
    ``sparse``
        ``decompress`` is zero except at the positions ``sent_entries`` gives.
    ``sends_tensor``
        The payload is the tensor itself, flattened (``decompress`` is a reshape): an
        allreduce may sum it in place when it is the caller's ``into``.
    ``drops_nonfinite``
        A NaN/Inf entry of the input may be left out of the payload (sparsifiers: NaN ranks
        below every magnitude; randomk sends only the entries it draws). The communicator then
        marks such a payload, so that the step's result shows the NaN as uncompressed training
        would. Default: ``sparse``.
    """

    allreduce_safe: bool = False
    equal_sizes: bool = True
    average: bool = True
    two_phase_safe: bool = False
    rounds: int = 1
    unbiased: bool = False
    needs_shape: bool = False
    sparse: bool = False
    sends_tensor: bool = False
    drops_nonfinite: bool | None = None

    def __post_init__(self):
        if self.drops_nonfinite is None:
            object.__setattr__(self, "drops_nonfinite", self.sparse)


_CAPABILITIES = {f.name for f in fields(Capabilities)}


class Compressor(Stateful, ABC):
    """Base class of every compression method.

    Subclasses implement ``compress`` and ``decompress`` and declare what the wire may do with
    their payloads in ``caps`` (``Capabilities``). A multi-round method (``caps.rounds > 1``)
    implements ``next_round``; a sparse one (``caps.sparse``) ``sent_entries``;
    ``payload_nbytes`` gives the bytes on the wire where the method knows them.

    Training state (step counters, momenta, warm-start matrices) lives in ``self.state`` so
    that ``state_dict``/``load_state_dict`` carry it through checkpoints.

    ``compress`` receives a ``Call`` (the compressing rank and the job size). Draws that must
    agree across ranks (randomk's positions, PowerSGD's first Q) leave the rank out of their
    key; draws that must be independent across ranks (the dither of unbiased quantizers, so
    that their noise averages out over workers) pass ``call.rank`` as the ``stream`` of
    ``ops.dither``.

    Faster ways to run these methods on one kind of device (fused kernels, N payloads
    decompressed into one buffer, the error written while compressing) are not methods here:
    they are speed paths behind one seam (``grace_dl.compressors.paths``), registered for a
    compressor's exact class and tested against the methods above.
    """

    caps: Capabilities = Capabilities()

    def __init_subclass__(cls, **kwargs):
        """A capability declared as a class attribute of its own (how grace_dl declared them
        before ``caps``) would be ignored: refuse it, naming the record to write instead."""
        super().__init_subclass__(**kwargs)
        loose = sorted(set(vars(cls)) & _CAPABILITIES)
        if loose:
            raise TypeError(f"{cls.__name__} declares {loose} as class attributes; declare "
                            f"them in one record: caps = grace_dl.Capabilities("
                            f"{', '.join(f'{n}=...' for n in loose)})")

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = check_seed(seed)

    # ------------------------------------------------------------------ the contract
    @abstractmethod
    def compress(self, tensor, name: str, call: Call = LOCAL):
        """Compress ``tensor`` (identified across ranks and steps by ``name``) on the rank
        ``call`` names.

        Returns ``(payload, ctx)``: ``payload`` is a list of tensors to communicate, ``ctx``
        anything the local rank needs to decompress (never communicated).
        """

    @abstractmethod
    def decompress(self, payload, ctx):
        """Rebuild a tensor with the original shape and dtype from ``payload`` and ``ctx``."""

    def aggregate(self, tensors):
        """Combine the decompressed tensors of all ranks (default: their sum; the communicator
        divides by the number of ranks for ``op=Average`` when ``caps.average`` is True)."""
        total = tensors[0]
        for t in tensors[1:]:
            total = total + t
        return total

    def next_round(self, reduced, ctx):
        """For multi-round compressors: given the reduced payload of the last round, return
        ``(payload, ctx)`` for another round, or ``None`` when ``reduced`` is final."""
        return None

    def sent_entries(self, payload, ctx):
        """For sparse compressors: ``(positions, values)`` when ``decompress(payload, ctx)``
        is zero except for ``values`` at the distinct flat ``positions`` (error feedback then
        updates O(k) entries instead of subtracting a dense tensor; the ``dgc`` memory masks
        its momentum there), else ``None``."""
        return None

    def payload_nbytes(self, size, dtype: str = "float32") -> int | None:
        """Bytes the payload of a tensor has on the wire, from the method's formula; ``None``
        where it depends on the data (threshold). ``size`` is the number of elements, or the
        tensor's shape for a method that ``caps.needs_shape`` (PowerSGD). Used by tests to
        check the honest-bytes promise and by the strategy cost model (``nbytes_for_shape``)."""
        return None

    # ------------------------------------------------------------------ helpers for subclasses
    def next_step(self, name: str, tensor):
        """Count one more compression of ``name``; returns the step (1, 2, ...). Used to key
        seeded randomness so ranks agree without sharing an RNG."""
        return self.state.next_step(f"step/{name}", ops_for(tensor))


def nbytes_for_shape(compressor, shape, dtype: str = "float32") -> int | None:
    """``compressor.payload_nbytes`` of a tensor of ``shape``: the shape itself for a method
    that ``caps.needs_shape``, else its number of elements."""
    if compressor.caps.needs_shape:
        return compressor.payload_nbytes(tuple(shape), dtype)
    numel = 1
    for d in shape:
        numel *= int(d)
    return compressor.payload_nbytes(numel, dtype)


def error_views(tensor, error, decoded, dtype: str):
    """For a path's ``compress_with_error``: the 1-D views of ``error`` (and ``decoded``, when
    given) to write into, or None where an output is not a ``dtype`` tensor of ``tensor``'s
    length with a flat view (TF has none)."""
    ops = ops_for(tensor)
    n = ops.numel(tensor)
    views = []
    for o in (error,) if decoded is None else (error, decoded):
        view = ops.flat_view(o) if ops.dtype(o) == dtype and ops.numel(o) == n else None
        if view is None:
            return None
        views.append(view)
    return views
