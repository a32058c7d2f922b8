"""The ``Memory`` abstraction: error feedback (Seide et al. 2014; Karimireddy et al. 2019).

Before compression the memory *compensates* a gradient with what earlier compressions lost;
after compression it *updates* what was lost this time. Its per-tensor state is training state
and travels through ``state_dict``/``load_state_dict``.

**Non-finite values.** A memory never keeps a NaN or an infinity: after each update the
non-finite entries of a tensor's slots are set to 0 (``State.keep_finite``, one elementwise
pass per slot; skipped where a CPU path already knows the slot finite:
``error_written(finite=True)``). A NaN/Inf in the compensated gradient is sent in the step it
occurs in (the compressor carries it, or the communicator marks the payload of one that may
leave it out: ``Capabilities.drops_nonfinite``), so the averaged gradient shows it as
uncompressed training would, and AMP's ``GradScaler`` or a user's ``isfinite`` guard sees it;
the next step starts from a finite memory instead of sending NaN forever. ``reset(name=None)``
zeroes the state of one tensor or of all (after rolling the model back, for instance).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from grace_dl.state import Stateful


class Memory(Stateful, ABC):
    """Base class of every error-feedback memory: ``compensate`` before compression,
    ``update`` after it, and ``refusal`` to name a compressor it cannot serve. Its state's
    plain-named slots (``""``) accumulate (``State.accumulates``: kept finite after each
    update, zeroed by ``reset``); a memory with other accumulating slots names their
    prefixes in its ``__init__``.

    Faster ways to run a memory (compensating in its own slot, the error written while
    compressing) are speed paths behind the one seam (``grace_dl.compressors.paths``,
    ``feedback_of``), registered for a memory's exact class."""

    def __init__(self):
        super().__init__(accumulates=("",))

    @abstractmethod
    def compensate(self, tensor, name: str):
        """Return the tensor to compress: ``tensor`` corrected by the stored error for ``name``."""

    @abstractmethod
    def update(self, tensor, name: str, compressor, payload, ctx, approximation=None) -> None:
        """Record what compressing ``tensor`` (the compensated one) into ``payload`` lost.

        ``approximation`` is what the communicator counts as sent for this rank, computed once
        by it: ``compressor.decompress(payload, ctx)`` for single-round methods, the chunks'
        decompressions joined for two-phase (in a buffer it reuses next step: read it here,
        copy what must be kept), the ranks' average for multi-round methods. Called outside
        a communicator without it, ``sent`` decompresses the payload."""

    def refusal(self, compressor) -> str | None:
        """Why this memory cannot serve ``compressor`` (None when it can); the communicator
        raises it at construction."""
        return None


def sent(compressor, payload, ctx, approximation):
    """``approximation``, or the payload decompressed when none was given."""
    return compressor.decompress(payload, ctx) if approximation is None else approximation


class Feedback:
    """A memory as a communicator runs it (``grace_dl.compressors.paths.feedback_of``): the
    reference path, the memory's own ``compensate`` and ``update``. Speed paths derive from
    it, registered for a memory's exact class, and may

    - compensate in the memory's own slot (``compensate``, knowing the compressor), and offer
      that slot to the framework glue to add a tensor's parts into first (``accumulator``;
      the next ``compensate`` of that name then adds nothing: the caller has added the whole
      tensor and sends a tensor of ``like``'s shape whose values are not read);
    - offer the slot that ``update`` would set to ``compensated - approximation`` while it
      holds the compensated tensor (``error_slot``), for the compressor's path to write its
      error there while compressing; the communicator then calls ``error_written`` (with
      ``finite=True`` where it knows the error holds no NaN/Inf, so the slot's clean-up is
      skipped);
    - say that ``update`` does not read ``approximation`` (``wants_approximation``), so the
      communicator does not compute it."""

    #: the memory compensates with nothing and keeps nothing (memory ``none``): the
    #: communicator then calls neither ``compensate`` nor ``update``
    keeps_nothing = False

    def __init__(self, memory):
        self.memory = memory

    def compensate(self, tensor, name, compressor):
        return self.memory.compensate(tensor, name)

    def update(self, tensor, name, compressor, payload, ctx, approximation=None):
        self.memory.update(tensor, name, compressor, payload, ctx, approximation)

    def accumulator(self, name, like, compressor):
        return None

    def error_slot(self, name, compressor):
        return None

    def error_written(self, name, finite: bool = False) -> None:
        raise NotImplementedError(f"{type(self.memory).__name__} offers no error slot")

    def wants_approximation(self, compressor) -> bool:
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.memory).__name__})"
