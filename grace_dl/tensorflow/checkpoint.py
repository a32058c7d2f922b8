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

The entry also records the grace ``fingerprint()`` and the rank and job size that wrote it;
restoring it into another configuration (topk state into randomk), another rank, or a job of
another size raises ``ValueError``, as the torch optimizer's ``load_state_dict`` does.
"""

from __future__ import annotations

import io
import json

import numpy as np
import tensorflow as tf

from grace_dl.communicators.exchange import check_saved
from grace_dl.contracts import check_grace

STATE, META = "state", "meta"


class GraceCheckpoint(tf.train.experimental.PythonState):
    """A trackable view of ``grace``'s ``state_dict`` (see the module docstring)."""

    def __init__(self, grace):
        check_grace(grace)
        self.grace = grace

    def serialize(self) -> bytes:
        return dumps({STATE: self.grace.state_dict(), META: {
            k: np.asarray(v) for k, v in self._identity().items()}})

    def deserialize(self, string_value) -> None:
        saved = loads(string_value)
        meta = {k: v.item() for k, v in saved.get(META, {}).items()}
        check_saved(meta, self._identity(), self.grace,
                    "give each rank its own checkpoint")
        self.grace.load_state_dict(saved.get(STATE, {}))

    def _identity(self) -> dict:
        import horovod.tensorflow as hvd

        fingerprint = getattr(self.grace, "fingerprint", None)
        out = {"fingerprint": fingerprint() if callable(fingerprint) else "", "rank": 0,
               "size": 1}
        if hvd.is_initialized():
            ps = getattr(self.grace, "process_set", None) or hvd.global_process_set
            out["rank"], out["size"] = ps.rank(), ps.size()
        return out


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
