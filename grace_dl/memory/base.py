"""The ``Memory`` abstraction: error feedback (Seide et al. 2014; Karimireddy et al. 2019).

Before compression the memory *compensates* a gradient with what earlier compressions lost;
after compression it *updates* what was lost this time. Its per-tensor state is training state
and travels through ``state_dict``/``load_state_dict``.

**Non-finite values.** A memory never keeps a NaN or an infinity: after each update the
non-finite entries of a tensor's slots are set to 0 (``State.keep_finite``, one elementwise
pass per slot). A NaN/Inf in the compensated gradient is sent in the step it occurs in (the
compressor carries it, or the communicator marks the payload of one that may leave it out:
``Compressor.drops_nonfinite``), so the averaged gradient shows it as uncompressed training
would, and AMP's ``GradScaler`` or a user's ``isfinite`` guard sees it; the next step starts
from a finite memory instead of sending NaN forever. ``reset(name=None)`` zeroes the state of
one tensor or of all (after rolling the model back, for instance).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from grace_dl.state import Stateful


class Memory(Stateful, ABC):
    #: every slot of a memory accumulates (``reset`` zeroes them all); the plain-named one
    #: (``""``) is what ``keep_finite`` cleans unless a memory names its slots' prefixes
    accumulates: tuple = ("",)

    #: whether ``update`` reads its ``approximation`` (the communicator skips computing it
    #: otherwise)
    needs_approximation: bool = True

    @abstractmethod
    def compensate(self, tensor, name: str):
        """Return the tensor to compress: ``tensor`` corrected by the stored error for ``name``."""

    def compensate_for(self, tensor, name: str, compressor):
        """``compensate`` as a communicator calls it, knowing the compressor (a memory may
        then compensate in place: the result is only read until ``update``)."""
        return self.compensate(tensor, name)

    @abstractmethod
    def update(self, tensor, name: str, compressor, payload, ctx, approximation=None) -> None:
        """Record what compressing ``tensor`` (the compensated one) into ``payload`` lost.

        ``approximation`` is what the communicator counts as sent for this rank, computed once
        by it: ``compressor.decompress(payload, ctx)`` for single-round methods, the chunks'
        decompressions joined for two-phase (in a buffer it reuses next step: read it here,
        copy what must be kept), the ranks' average for multi-round methods. Called outside
        a communicator without it, ``sent`` decompresses the payload."""

    def accumulator(self, name: str, like, compressor):
        """The slot that ``compensate_for`` adds the tensor sent as ``name`` into, to add its
        parts into first (``like``: that tensor), or None where this memory has none. After
        this call the next ``compensate_for(tensor, name, ...)`` adds nothing: the caller has
        added the whole tensor into the slot by then and sends a tensor of ``like``'s shape
        whose values are not read (the torch optimizer's buckets add each member's gradient
        here instead of copying it into the bucket, one dense pass less per step)."""
        return None

    def error_slot(self, name: str, compressor):
        """The tensor that ``update`` would set to ``compensated - approximation``, when it
        holds the compensated tensor itself (compensated in place), else None. A communicator
        may have the compressor write its error there while compressing
        (``Compressor.compress_with_error``) and then call ``error_written`` instead of
        ``update``."""
        return None

    def error_written(self, name: str) -> None:
        """The compressor wrote this step's error into ``error_slot(name)``: the update for
        ``name`` is done."""
        raise NotImplementedError(f"{type(self).__name__} offers no error slot")

    @staticmethod
    def sent(compressor, payload, ctx, approximation):
        """``approximation``, or the payload decompressed when none was given."""
        return compressor.decompress(payload, ctx) if approximation is None else approximation

    def wants_approximation(self, compressor) -> bool:
        """Whether ``update`` reads ``approximation`` when it serves ``compressor`` (the
        communicator computes the approximation only then)."""
        return self.needs_approximation

    def refusal(self, compressor) -> str | None:
        """Why this memory cannot serve ``compressor`` (None when it can); the communicator
        raises it at construction."""
        return None

