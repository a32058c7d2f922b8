"""Per-tensor training state: residuals, momenta, PowerSGD's Q, step counters.

Compressors and memories keep everything that must survive a checkpoint in a ``State``. Slots are
created lazily the first time a tensor name is seen (as backend variables: a torch tensor updated
in place, or a ``tf.Variable``), and ``load_state_dict`` may be called before any slot exists:
its values are then used when the slot is created, so a fresh process restored from a
checkpoint continues exactly where the saved one stopped.
"""

from __future__ import annotations

import numpy as np


class State:
    def __init__(self):
        self._slots: dict = {}
        self._pending: dict[str, np.ndarray] = {}
        self._owner: dict[str, str] = {}  # key -> the ops module that created its variable

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
        elif self._owner[key] != ops.__name__:
            self._refuse(key, ops)
        return var

    def zeros(self, key: str, ops, like):
        """A slot shaped and typed like the tensor ``like``, starting at zero."""
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
        for key, value in state.items():
            value = np.asarray(value)
            var = self._slots.get(key)
            if var is None:
                self._pending[key] = value
            else:
                _assign_numpy(var, value)


class Stateful:
    """Base of compressors and memories: training state in ``self.state`` (checkpointed by
    ``state_dict``/``load_state_dict``), configuration in the public attributes (``config``,
    which ranks compare and strategies record)."""

    def __init__(self):
        self.state = State()

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)

    def config(self) -> dict:
        """The constructor arguments that define this object."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_") and k != "state"}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(self.config().items()))
        return f"{type(self).__name__}({args})"


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

        var.copy_(torch.from_numpy(np.ascontiguousarray(value)).to(var.dtype))
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


def _claimed(key: str, names: set) -> bool:
    if key in names:
        return True
    parts = key.split("/")
    return any("/".join(parts[i:j]) in names
               for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))
