"""One step's exchange of grace tensors: the part of a training step every framework glue
shares (the torch ``DistributedOptimizer``, the DDP hook, the TF tape and Keras optimizer).

A *unit* is one grace tensor of the step: one gradient, a bucket of them (DDP's bucket, a
``bucket_bytes`` bucket, a strategy's), or a large tensor sent in pieces
(``grace_dl.communicators.pieces``: each piece its own grace tensor, sent from and received
into its slice). The glue lays its gradients out in units (that stays the glue's: it knows
its framework's buffers), starts each unit as soon as it is ready (``Exchange.start``: the
memory compensates, the compressor compresses and the collectives start; nothing waits),
and finishes what it started (``Exchange.finish``): the units' handles received in one
lockstep pass (``Router.receive_all``, so the later rounds of every unit, two-phase's gathers
and PowerSGD's Qs, are in flight together), in an order the same on every rank. A glue
finishes once a step where waiting blocks the host (Horovod, gloo), or after each DDP bucket
where it only orders a GPU's stream (NCCL: ``grace_dl.torch.ddp``). Each unit comes back with
its result, for the glue to write back where it did not land by itself: a unit sent ``into``
the framework's own buffer (DDP's bucket, ``p.grad``), or in pieces from such a buffer, is
already there. ``check_saved`` is what every glue's checkpoint records beside the grace state
and refuses to load into another configuration, job size or rank.

The Python of a step is the glue's layout plus this module's two calls per unit; what goes on
the wire is the communicator's (its module docstring).
"""

from __future__ import annotations

from collections import deque

from grace_dl.backend import ops_for
from grace_dl.communicators.base import advance_each, receive_each
from grace_dl.communicators.pieces import send_pieces


class Unit:
    """One grace tensor of a step, as ``Exchange.start`` started it.

    ``members``: what the glue writes the result to (parameter names, positions, parameters),
    in the unit's order; ``numels``: their lengths in the unit's flat tensor (None: the unit
    is one member, shaped as it is); ``into``: the framework buffer the result lands in by
    itself (None: the glue writes it back); ``handles``: the pieces' handles (one where the
    unit goes whole); ``whole``: the 1-D tensor pieces were cut from, which holds the result
    once they are received; ``summed``: a collective the glue started itself, in place
    (DDP's allreduce of an uncompressed bucket, or of its 16-bit cast), finished by waiting on
    it and then calling its ``then`` on the result, where given. ``lands``: the
    result is in the framework's buffer once received. ``out``: the result, once
    ``Exchange.finish`` has received it."""

    __slots__ = ("name", "members", "numels", "into", "handles", "whole", "summed", "lands",
                 "out")

    def __init__(self, name, members, numels, into, handles, whole, summed):
        self.name, self.members, self.numels, self.into = name, members, numels, into
        self.handles, self.whole, self.summed = handles, whole, summed
        self.lands = into is not None or summed is not None
        self.out = None

    def parts(self, out) -> list:
        """``out`` (the unit's result) as its members' flat parts (one member: ``[out]``)."""
        if self.numels is None:
            return [out]
        return ops_for(out).split(out, self.numels)


class Exchange:
    """A step's units, started one by one and finished together (module docstring).

    ``grace``: any ``grace=`` object (the ``Grace`` protocol); ``op``: ``"average"`` or
    ``"sum"``. One ``Exchange`` serves every step of its glue: ``finish`` (or ``clear``, after
    an error) empties it for the next."""

    def __init__(self, grace, op: str):
        self.grace, self.op = grace, op
        #: the grace object's own ``receive_all`` (phases in lockstep), found once; None: it
        #: has none (``receive_each`` then receives one handle after the other)
        self._receive_all = getattr(grace, "receive_all", None)
        self.units: list[Unit] = []
        #: handles sent this step, oldest first, for ``advance`` (the glue's early rounds)
        self.pending: deque = deque()

    def start(self, tensor, name: str, members=None, numels=None, into=None, sizes=None,
             collectives=None) -> Unit:
        """Start ``tensor`` as the grace tensor ``name``: whole (``sizes`` None), or as pieces
        of those lengths (``tensor`` 1-D and contiguous: each piece sent from its slice and
        its result written there). ``into``: the framework buffer the whole result goes to
        (``Router.send``'s). ``collectives``: the engine (None: the grace object's own)."""
        if sizes is None:
            handles = [self.grace.send(tensor, name, self.op, collectives, into=into)]
            unit = Unit(name, members, numels, into, handles, None, None)
        else:
            handles = send_pieces(self.grace, tensor, name, self.op, collectives, sizes)
            unit = Unit(name, members, numels, into, handles, tensor, None)
        self.units.append(unit)
        return unit

    def summed(self, pending, name: str, members, numels, collectives, then=None) -> Unit:
        """Record a collective the glue started itself in place, in the framework's buffer
        (``pending``, waited on through ``collectives.synchronize``), as a unit of the step;
        ``then``: what makes the unit's result of the summed tensor (None: it is the result)."""
        unit = Unit(name, members, numels, None, [], None, (collectives, pending, then))
        self.units.append(unit)
        return unit

    def advance(self, unit) -> int:
        """Queue ``unit``'s handles (None: nothing new) and complete the queued exchanges
        whose collectives have finished (``Router.advance``); how many phases it completed."""
        if unit is not None:
            self.pending.extend(unit.handles)
        return advance_each(self.grace, self.pending)

    def finish(self, units=None) -> list[Unit]:
        """Receive ``units`` (default: every unit, in the order started; the order must be the
        same on every rank) in lockstep, set each one's ``out`` (a piece-sent unit's is its
        ``whole``, a summed one's its ``pending``'s) and return them. Every unit of the step
        is forgotten, received or not."""
        units = self.units if units is None else units
        self.units, self.pending = [], deque()
        handles, intos = [], []
        for u in units:
            # (pieces land in their slices of ``whole``; a summed unit has no handles)
            handles.extend(u.handles)
            intos.extend([u.into if u.whole is None else None] * len(u.handles))
        receive_all = self._receive_all
        outs = iter(() if not handles else receive_all(handles, intos) if receive_all else
                    receive_each(self.grace, handles, intos))
        for u in units:
            if u.summed is not None:
                collectives, pending, then = u.summed
                u.out = collectives.synchronize(pending)
                if then is not None:
                    u.out = then(u.out)
                continue
            out = next(outs)
            for _ in u.handles[1:]:
                next(outs)
            u.out = out if u.whole is None else u.whole
        return units

    def clear(self) -> None:
        """Forget a half-started step (after an error)."""
        self.units, self.pending = [], deque()


#: what ``check_saved`` says of a checkpoint whose key differs (its value, then this one's)
_SAVED_DIFFERS = {
    "fingerprint": "is for configuration {}, this grace is {} ({!r}); restore it into the "
                   "grace it was saved from",
    "size": "was written by a job of {} ranks; this job has {}",
    "rank": "was written by rank {}, this is rank {}: grace state (a residual, a momentum) is "
            "per rank",
}


def check_saved(saved: dict, mine: dict, grace, advice: str = "", lenient=()) -> None:
    """Refuse grace state saved for another configuration, by a job of another size, or by
    another rank: what every glue's checkpoint records beside the state. Every key of
    ``mine`` (``"fingerprint"``, ``"size"``, ``"rank"``), in its order, is compared with the
    checkpoint's: ``ValueError`` naming both values. A key in ``lenient`` is not compared
    where either side has none (absent or None: a checkpoint older than the key, a state
    saved before its process group existed). ``advice``: what to do instead of loading
    another rank's state."""
    for key, ours in mine.items():
        theirs = saved.get(key)
        if key in lenient and (theirs is None or ours is None):
            continue
        if theirs != ours:
            raise ValueError("checkpoint grace state " +
                             _SAVED_DIFFERS[key].format(theirs, ours, grace)
                             + (f"; {advice}" if key == "rank" and advice else ""))
