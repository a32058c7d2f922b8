"""Per-tensor training state: residuals, momenta, PowerSGD's Q, step counters.

Compressors and memories keep everything that must survive a checkpoint in a ``State``. Slots are
created lazily the first time a tensor name is seen (as backend variables: a torch tensor updated
in place, or a ``tf.Variable``), and ``load_state_dict`` may be called before any slot exists:
its values are then used when the slot is created, so a fresh process restored from a
checkpoint continues exactly where the saved one stopped. ``Stateful.load_state_dict`` (what
checkpoints and live roll-backs call) *replaces* the state: a slot the loaded dict lacks starts
over as if it had never been created, so loading into a live object that ran on gives the same
object as loading into a fresh one.
"""

from __future__ import annotations

import numpy as np

#: ``State._inits`` entry of a step counter (its initial value is 0)
_COUNTER = "counter"


class State:
    #: prefixes of the keys (``<prefix><tensor name>``) whose slots accumulate gradients over
    #: steps (a residual, a momentum): ``clean`` keeps them finite and ``Stateful.reset``
    #: zeroes them
    accumulates: tuple = ()

    def __init__(self, accumulates: tuple = ()):
        self.accumulates = tuple(accumulates)
        self._slots: dict = {}
        self._pending: dict[str, np.ndarray] = {}
        self._owner: dict[str, str] = {}  # key -> the ops module that created its variable
        # key -> what its slot started from (``slot``'s ``init``, or _COUNTER): what ``restore``
        # sets a live TF variable back to (a torch slot is dropped and made again instead)
        self._inits: dict = {}

    def slot(self, key: str, ops, init, dt: str, like=None):
        """The variable for ``key``; on first use it starts from ``init`` (a NumPy array, or a
        callable returning one), unless a loaded state dict supplied a value."""
        var = self._slots.get(key)
        if var is None:
            value = self._pending.pop(key, None)
            if value is None:
                value = init() if callable(init) else init
            var = ops.variable(value, dt, like=like, name=key)
            self._slots[key] = var
            self._owner[key] = ops.__name__
            self._inits[key] = init
        elif self._owner[key] != ops.__name__:
            self._refuse(key, ops)
        return var

    def zeros(self, key: str, ops, like):
        """A slot shaped and typed like the tensor ``like``, starting at zero."""
        var = self._slots.get(key)
        if var is not None and self._owner[key] == ops.__name__:
            return var          # (every step: the slot exists)
        shape = ops.shape(like)
        return self.slot(key, ops, lambda: np.zeros(shape, np.float32), ops.dtype(like), like)

    def next_step(self, key: str, ops):
        """Increment the counter ``key`` and return its new value (1 on the first call)."""
        var = self._slots.get(key)
        if var is None:
            start = self._pending.pop(key, None)
            var = ops.counter(0 if start is None else int(np.asarray(start)), name=key)
            self._slots[key] = var
            self._owner[key] = ops.__name__
            self._inits[key] = _COUNTER
        elif self._owner[key] != ops.__name__:
            self._refuse(key, ops)
        return ops.increment(var)

    def _refuse(self, key: str, ops) -> None:
        def framework(module):
            return module.split(".")[1]
        raise ValueError(f"state {key!r} was created for {framework(self._owner[key])} tensors "
                         f"and is now used with {framework(ops.__name__)} ones: per-name state "
                         f"serves one framework; use one grace object per framework (or other "
                         f"tensor names)")

    def existing(self, keys) -> list | None:
        """The slots of ``keys`` where every one exists already (a dict lookup each, for a
        caller that reads many every step), else None (``slot`` / ``zeros`` create them)."""
        slots = self._slots
        try:
            return [slots[k] for k in keys]
        except KeyError:
            return None

    def __contains__(self, key: str) -> bool:
        return key in self._slots or key in self._pending

    def keys(self):
        return list(self._slots) + [k for k in self._pending if k not in self._slots]

    def variables(self) -> dict:
        """The live backend variables by key (TensorFlow code tracks these for checkpoints)."""
        return dict(self._slots)

    def state_dict(self) -> dict[str, np.ndarray]:
        out = {k: np.asarray(v) for k, v in self._pending.items()}
        for key, var in self._slots.items():
            out[key] = _to_numpy(var)
        return out

    def load_state_dict(self, state: dict) -> None:
        """Merge ``state`` in: its keys take its values (now, or when their slot is created);
        other slots keep theirs (``restore`` replaces the whole state)."""
        for key, value in state.items():
            value = np.asarray(value)
            var = self._slots.get(key)
            if var is None:
                self._pending[key] = value
            else:
                _assign_numpy(var, value)

    def restore(self, state: dict) -> None:
        """Make this state the one ``state`` describes: its keys take its values, and every
        other slot starts over as if never created (a torch slot or host counter is dropped
        and made again on its next use; a TF variable, which a traced ``tf.function`` may hold,
        is set back to its initial value in place). Loading a checkpoint into a live object
        that ran past it thus gives what loading it into a fresh object gives."""
        for key in [k for k in self._slots if k not in state]:
            var, init = self._slots[key], self._inits.get(key)
            if not hasattr(var, "assign") or init is None:  # not TF (or an init lost to pickling)
                del self._slots[key]
                self._owner.pop(key, None)
                self._inits.pop(key, None)
            elif isinstance(init, str):     # _COUNTER
                _assign_numpy(var, np.asarray(0, np.int64))
            else:
                _assign_numpy(var, np.asarray(init() if callable(init) else init))
        self._pending = {}
        self.load_state_dict(state)

    def keep_finite(self, key: str) -> None:
        """Set the non-finite entries of ``key``'s slot (if it exists) to 0."""
        var = self._slots.get(key)
        if var is not None:
            _ops_of(self._owner[key]).assign_finite(var)

    def clean(self, name: str) -> None:
        """Set the non-finite entries of tensor ``name``'s accumulating slots to 0 (a NaN/Inf
        is sent once, never kept: ``grace_dl.memory.base``)."""
        slots = self._slots
        for prefix in self.accumulates:
            var = slots.get(prefix + name)
            if var is not None:
                _ops_of(self._owner[prefix + name]).assign_finite(var)

    def zero(self, keys) -> None:
        """Set the slots (and loaded values not yet used) of ``keys`` to zero."""
        for key in keys:
            var = self._slots.get(key)
            if var is not None:
                ops = _ops_of(self._owner[key])
                ops.assign(var, ops.zeros_like(ops.read(var)))
            elif key in self._pending:
                self._pending[key] = np.zeros_like(self._pending[key])

    def __getstate__(self) -> dict:
        """Picklable: the slots' initial values are kept only where they are arrays (a
        callable init may be a closure); a slot without one is dropped by ``restore``."""
        state = dict(self.__dict__)
        state["_inits"] = {k: v for k, v in self._inits.items() if not callable(v)}
        return state


class Stateful:
    """Base of compressors and memories: training state in ``self.state`` (checkpointed by
    ``state_dict``/``load_state_dict``; ``accumulates`` names the prefixes of its slots that
    accumulate gradients, a communicator keeps them finite after each compression), and
    configuration in the public attributes (``config_of``, which ranks compare and strategies
    record)."""

    def __init__(self, accumulates: tuple = ()):
        self.state = State(accumulates)

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Replace this object's training state by ``state`` (``State.restore``)."""
        self.state.restore(state)

    def reset(self, name: str | None = None) -> None:
        """Zero the accumulating state (``State.accumulates``) of tensor ``name``, or of every
        tensor (``None``); step counters and other state are kept."""
        self.state.zero([k for k in self.state.keys()
                         if any(k.startswith(p) for p in self.state.accumulates)
                         and (name is None or _claimed(k, {name}))])

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(config_of(self).items()))
        return f"{type(self).__name__}({args})"


def config_of(obj) -> dict:
    """The constructor arguments that define a compressor or memory: its public instance
    attributes (its training state and its declared ``caps`` left out)."""
    return {k: v for k, v in vars(obj).items()
            if not k.startswith("_") and k not in ("state", "caps")}


def _ops_of(module: str):
    """The ops backend module named ``module`` (``State._owner``'s entries)."""
    import sys

    ops = sys.modules.get(module)
    if ops is None:
        import importlib

        ops = importlib.import_module(module)
    return ops


def _to_numpy(var) -> np.ndarray:
    if isinstance(var, np.ndarray):     # a host counter
        return var.copy()
    if hasattr(var, "detach"):  # torch
        t = var.detach()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.cpu().numpy().copy()
    value = var.read_value() if hasattr(var, "read_value") else var
    if value.dtype.name == "bfloat16":
        import tensorflow as tf

        value = tf.cast(value, tf.float32)
    return value.numpy().copy()


def _assign_numpy(var, value: np.ndarray) -> None:
    if isinstance(var, np.ndarray):     # a host counter
        var[...] = value
    elif hasattr(var, "copy_"):  # torch
        import torch

        # np.array, not np.ascontiguousarray, which makes a 0-d array (a step counter) 1-d
        var.copy_(torch.from_numpy(np.array(value, copy=True, order="C")).to(var.dtype))
    else:
        import tensorflow as tf

        var.assign(tf.cast(value, var.dtype))


def unclaimed_keys(state: dict, names) -> list[str]:
    """Keys of a (nested) state dict's per-tensor slots (arrays) that belong to none of the
    tensor ``names``: a slot key is a name, or a name joined with ``/`` to a prefix (``step/``)
    or suffix (``/chunk0``). Plain numbers (a ``Schedule``'s step) are not slots."""
    names = set(names)
    out = []
    for key, value in state.items():
        if isinstance(value, dict):
            out += [f"{key}/{k}" for k in unclaimed_keys(value, names)]
        elif isinstance(value, (bool, int, float, str)):
            continue
        elif not _claimed(str(key), names):
            out.append(str(key))
    return out


def without_slots(state: dict, names, keep=()) -> dict:
    """A (nested) state dict without the per-tensor slots of tensors ``names`` (those also of
    a tensor in ``keep`` stay); plain numbers are kept."""
    names, keep = set(names), set(keep)
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = without_slots(value, names, keep)
        elif isinstance(value, (bool, int, float, str)) or not _claimed(str(key), names) \
                or _claimed(str(key), keep):
            out[key] = value
    return out


def _claimed(key: str, names: set) -> bool:
    if key in names:
        return True
    parts = key.split("/")
    return any("/".join(parts[i:j]) in names
               for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))
