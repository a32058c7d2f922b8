"""Save and restore a grace object's training state with ``tf.train.Checkpoint``.

    ckpt = tf.train.Checkpoint(model=model, optimizer=opt,
                               grace=grace_dl.tensorflow.checkpointable(grc))
    ckpt.restore(tf.train.latest_checkpoint(ckpt_dir))   # before or after the first step
    ...
    ckpt.save(ckpt_dir + "/ckpt")

The grace state (residuals, momenta, PowerSGD's Q, step counters: everything in
``grc.state_dict()``) is stored as one serialized entry of the checkpoint
(``tf.train.experimental.PythonState``), written at save time from ``grc.state_dict()`` and
read back through ``grc.load_state_dict()``. That is what makes restore-before-first-step
exact: the state's ``tf.Variable``s are created lazily when a gradient name is first seen, so
at restore time most do not exist yet; ``load_state_dict`` keeps their values pending and the
variables start from them when created (``grace_dl.state.State``). Variables that already exist
are assigned at once. Each rank saves and restores its own state (residuals differ per rank):
give each rank its own checkpoint directory, or save on every rank.

Save eagerly (``Checkpoint.save`` / ``CheckpointManager.save`` outside ``tf.function``), as
usual.
"""

from __future__ import annotations

import io
import json

import numpy as np
import tensorflow as tf


class GraceCheckpoint(tf.train.experimental.PythonState):
    """A trackable view of ``grace``'s ``state_dict`` (see the module docstring)."""

    def __init__(self, grace):
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(grace, method, None)):
                raise ValueError(f"grace must have state_dict()/load_state_dict(); "
                                 f"{type(grace).__name__} has no {method}()")
        self.grace = grace

    def serialize(self) -> bytes:
        return dumps(self.grace.state_dict())

    def deserialize(self, string_value) -> None:
        self.grace.load_state_dict(loads(string_value))


def checkpointable(grace) -> GraceCheckpoint:
    """The object to put in a ``tf.train.Checkpoint`` next to the model and optimizer."""
    return GraceCheckpoint(grace)


# ------------------------------------------------------------------ nested state dict <-> bytes
def dumps(state: dict) -> bytes:
    """A nested ``{str: dict | array}`` as ``.npz`` bytes (no pickle)."""
    paths, empty, arrays = [], [], {}
    for path, value in _flatten(state, ()):
        if isinstance(value, dict):
            empty.append(list(path))
            continue
        arrays[f"a{len(paths)}"] = np.asarray(value)
        paths.append(list(path))
    arrays["paths"] = np.asarray(json.dumps({"arrays": paths, "empty": empty}))
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def loads(data) -> dict:
    if isinstance(data, np.ndarray):
        data = data.item()
    with np.load(io.BytesIO(bytes(data)), allow_pickle=False) as npz:
        index = json.loads(str(npz["paths"]))
        state: dict = {}
        for path in index["empty"]:
            _node(state, path).setdefault(path[-1], {})
        for i, path in enumerate(index["arrays"]):
            _node(state, path)[path[-1]] = npz[f"a{i}"]
    return state


def _node(state: dict, path) -> dict:
    for key in path[:-1]:
        state = state.setdefault(key, {})
    return state


def _flatten(state, prefix):
    if not isinstance(state, dict):
        raise ValueError(f"state_dict values must be dicts or arrays, got {type(state).__name__} "
                         f"at {'/'.join(prefix)}")
    for key, value in state.items():
        if not isinstance(key, str):
            raise ValueError(f"state_dict keys must be strings, got {key!r}")
        if isinstance(value, dict) and value:
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value
