"""The ``Compressor`` abstraction (GRACE, Xu et al. 2021, "GRACE: A Compressed Communication
Framework for Distributed Machine Learning").

A compressor turns one gradient into a *payload* (a list of tensors: the only thing that crosses
the wire) plus a *ctx* that stays on the local rank, and back. It is written once against
``grace_dl.backend.ops_for(tensor)`` and serves torch and TensorFlow tensors alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from grace_dl.backend import ops_for
from grace_dl.state import Stateful
from grace_dl.validate import seed as check_seed


@dataclass(frozen=True)
class Call:
    """Who is compressing: passed to ``compress`` by the communicator (never stored on the
    compressor, which one object may serve several process sets or engines with)."""

    rank: int = 0
    size: int = 1


#: the call context of a compression outside any communicator (tests, benchmarks)
LOCAL = Call()


class Compressor(Stateful, ABC):
    """Base class of every compression method.

    Subclasses implement ``compress`` and ``decompress`` and declare what the wire may do with
    their payloads:

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
        compress several tensors flattened into one bucket.

    Training state (step counters, momenta, warm-start matrices) lives in ``self.state`` so
    that ``state_dict``/``load_state_dict`` carry it through checkpoints.

    ``compress`` receives a ``Call`` (the compressing rank and the job size). Draws that must
    agree across ranks (randomk's positions, PowerSGD's first Q) leave the rank out of their
    key; draws that must be independent across ranks (the dither of unbiased quantizers, so
    that their noise averages out over workers) pass ``call.rank`` as the ``stream`` of
    ``ops.dither``.

    Optional capabilities are methods with defaults here, so memories and the cost model call
    them without probing: ``next_round`` (multi-round methods), ``sent_indices`` (which
    positions a sparse payload carries), ``sent_entries`` (its positions and values),
    ``combine`` / ``decompress_into`` (every rank's payload decompressed and aggregated, or
    the reduced one decompressed, built in a given buffer where possible),
    ``compress_with_error`` (the error feedback's subtraction done while compressing),
    ``local_share`` (this rank's part of a multi-round result), ``payload_nbytes`` /
    ``payload_nbytes_for_shape`` (bytes on the wire).
    """

    allreduce_safe: bool = False
    equal_sizes: bool = True
    average: bool = True
    two_phase_safe: bool = False
    rounds: int = 1
    unbiased: bool = False
    needs_shape: bool = False
    #: payloads are sparse: ``sent_entries`` gives their positions and values
    sparse: bool = False
    #: the payload is the tensor itself, flattened (``decompress`` is a reshape): an
    #: allreduce may sum it in place when it is the caller's ``into``
    sends_tensor: bool = False

    @property
    def drops_nonfinite(self) -> bool:
        """Whether a NaN/Inf entry of the input may be left out of the payload (sparsifiers:
        NaN ranks below every magnitude; randomk sends only the entries it draws). The
        communicator then marks such a payload (``marked``), so that the step's result shows
        the NaN as uncompressed training would. Default: ``sparse``."""
        return self.sparse

    def marked(self, payload, mark):
        """``payload`` with the 0-d ``mark`` (-0.0, or NaN when the input held a non-finite
        entry) added to its floating-point parts (a sparsifier's k values, adaq's two means):
        O(k), and a NaN input decompresses to NaN wherever the payload carries a value."""
        ops = ops_for(mark)
        return [p + ops.cast(mark, ops.dtype(p)) if ops.is_floating(p) else p
                for p in payload]

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
        divides by the number of ranks for ``op=Average`` when ``average`` is True)."""
        total = tensors[0]
        for t in tensors[1:]:
            total = total + t
        return total

    def combine(self, payloads, ctx, out=None):
        """``aggregate`` of every rank's decompressed payload (``payloads[r]``: rank r's parts,
        in the layout of this rank's own parts, decompressed with this rank's ``ctx``), what
        a gathering communicator hands back. Sparse methods override it to add every rank's
        values into one buffer instead of building N dense tensors and summing them; they
        write into ``out`` (a torch tensor of the result's shape and dtype, or None) when
        given and return it, which the default ignores."""
        return self.aggregate([self.decompress(p, ctx) for p in payloads])

    def decompress_into(self, payload, ctx, out=None):
        """``decompress``, built in ``out`` (as in ``combine``) where the method can; what an
        allreduce does with the one reduced payload."""
        return self.decompress(payload, ctx)

    def combine_with_feedback(self, payloads, ctx, slot, out):
        """Two-phase's server step in one go, where a method can fuse it: ``combine`` of the
        ranks' payloads added to the server's residual ``slot``, that compressed, its error
        left in ``slot`` and its decompression written into ``out`` (both tensors of the
        chunk's length); returns the payload. None (the default): the communicator runs the
        steps one by one, with the same result."""
        return None

    def compress_with_error(self, tensor, name: str, call: Call, error, decoded=None):
        """``compress``, also writing ``tensor - decompress(payload, ctx)`` into ``error`` (a
        tensor of ``tensor``'s shape, possibly ``tensor`` itself) and, given ``decoded``, the
        decompression there, while compressing: error feedback without writing the dense
        approximation out and reading it back. Returns ``(payload, ctx)``, or ``None`` (having
        done nothing) where the method cannot for these tensors; the caller then decompresses."""
        return None

    def divided(self, payload, divisor):
        """A payload that decompresses (and ``combine``s, with the default sum) to this one's
        result divided by ``divisor``, made without touching a dense tensor (sparse methods
        divide their k values), or ``None`` where the method cannot: an average then divides
        the dense result. Communicators use it to average in O(k) instead of O(n), and only
        while ``aggregate`` is the default sum."""
        return None

    def sent_entries(self, payload, ctx):
        """``(positions, values)`` when ``decompress(payload, ctx)`` is zero except for
        ``values`` at the distinct flat ``positions`` (error feedback then updates O(k)
        entries instead of subtracting a dense tensor), else ``None``."""
        return None

    def next_round(self, reduced, ctx):
        """For multi-round compressors: given the reduced payload of the last round, return
        ``(payload, ctx)`` for another round, or ``None`` when ``reduced`` is final."""
        return None

    def sent_indices(self, payload, ctx):
        """Flat positions a sparse payload carries (int tensor), or ``None`` when the method
        does not send positions; the ``dgc`` memory masks its momentum there."""
        return None

    def local_share(self, ctx):
        """For multi-round methods: this rank's own share of the reduced result (what its
        error feedback subtracts), or ``None`` to use the averaged result."""
        return None

    def subtract_local_share(self, ctx, residual) -> bool:
        """``residual -= local_share(ctx)`` in place (``residual``: an error-feedback slot
        holding the compensated tensor); False, leaving it, where there is no share."""
        share = self.local_share(ctx)
        if share is None:
            return False
        ops_for(share).assign_sub(residual, share)
        return True

    def payload_nbytes(self, numel: int, dtype: str = "float32") -> int | None:
        """Bytes the payload of an ``numel``-element tensor has on the wire, from the method's
        formula; ``None`` where it depends on the data (threshold). Used by tests to check the
        honest-bytes promise and by the strategy cost model."""
        return None

    def payload_nbytes_for_shape(self, shape, dtype: str = "float32") -> int | None:
        """Like ``payload_nbytes`` for a tensor of ``shape``; methods whose bytes depend on
        the layout (PowerSGD) override it."""
        numel = 1
        for d in shape:
            numel *= int(d)
        return self.payload_nbytes(numel, dtype)

    # ------------------------------------------------------------------ helpers for subclasses
    def next_step(self, name: str, tensor):
        """Count one more compression of ``name``; returns the step (1, 2, ...). Used to key
        seeded randomness so ranks agree without sharing an RNG."""
        return self.state.next_step(f"step/{name}", ops_for(tensor))


def error_views(compressor, owner: type, tensor, error, decoded, dtype: str):
    """For a ``compress_with_error``: the 1-D views of ``error`` (and ``decoded``, when given)
    to write into, or None where the fusion does not apply: ``compressor``'s ``compress`` is
    not ``owner``'s own (a subclass that overrides it sends something else, so it decodes
    after unless it says otherwise), or an output is not a ``dtype`` tensor of ``tensor``'s
    length with a flat view (TF has none)."""
    if type(compressor).compress is not owner.compress:
        return None
    ops = ops_for(tensor)
    outs = [error] if decoded is None else [error, decoded]
    if any(ops.dtype(o) != dtype or ops.numel(o) != ops.numel(tensor)
           or ops.flat_view(o) is None for o in outs):
        return None
    return [ops.flat_view(o) for o in outs]
