"""Cross-rank agreement: before collectives that every rank must start identically, ranks
compare what they are about to do, and a difference raises ``ValueError`` on every rank instead
of a hang (or a Horovod error about dtypes) later.

Each rank describes itself with ``labels``, a dict of JSON-able values (the grace configuration,
the tensors it will send, ``None`` for ``grace=None``, ...). ``check`` runs one allgather of a
16-byte digest of them; only when digests differ does it gather the labels themselves, to say
what differs. Every rank sees the same digests, so every rank takes the same branch and raises
the same error together. Framework-neutral: the caller passes ``allgather(array, name)``, which
concatenates every rank's 1-D NumPy array (uint8 or int64) in rank order; ``allgather_for``
builds it for torch or TensorFlow.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

import numpy as np

DIGEST_BYTES = 16
Allgather = Callable[[np.ndarray, str], np.ndarray]


def encode(labels: dict) -> bytes:
    return json.dumps(labels, sort_keys=True, default=repr).encode()


def digest(labels: dict) -> bytes:
    return hashlib.sha256(encode(labels)).digest()[:DIGEST_BYTES]


def gather_bytes(data: bytes, allgather: Allgather, name: str) -> list[bytes]:
    """Every rank's ``data`` (lengths may differ), in rank order."""
    lengths = allgather(np.array([len(data)], np.int64), f"{name}.len")
    gathered = allgather(np.frombuffer(data, np.uint8).copy(), name)
    out, offset = [], 0
    for n in map(int, lengths):
        out.append(bytes(gathered[offset:offset + n]))
        offset += n
    return out


def check(labels: dict, allgather: Allgather, name: str = "grace.agreement", rank: int = 0,
          mismatch: Callable[[list[dict], int], str] | None = None) -> None:
    """Return if every rank passed equal ``labels``; else raise ``ValueError`` on every rank
    with ``mismatch(labels_by_rank, rank)`` (default: ``describe``)."""
    rows = allgather(np.frombuffer(digest(labels), np.uint8).copy(), f"{name}.digest")
    rows = [bytes(r) for r in np.asarray(rows).reshape(-1, DIGEST_BYTES)]
    if len(set(rows)) == 1:
        return
    everyone = [json.loads(b) for b in gather_bytes(encode(labels), allgather, name)]
    raise ValueError((mismatch or describe)(everyone, rank))


def describe(everyone: list[dict], rank: int) -> str:
    """What differs between the ranks' labels, key by key."""
    parts = []
    for key in sorted({k for labels in everyone for k in labels}):
        values = [labels.get(key) for labels in everyone]
        if all(v == values[0] for v in values):
            continue
        if parts and any(key not in labels for labels in everyone):
            continue  # e.g. the tensors of grace ranks, once grace=None ranks are reported
        parts.append(f"ranks disagree on the {key}: " + _differences(values))
    return "; ".join(parts) + f" (this is rank {rank}); every rank must build the same grace " \
        "object (or grace=None on all) and train the same variables"


def _differences(values: list) -> str:
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(json.dumps(v, sort_keys=True, default=repr), []).append(r)
    if len(groups) == 2 and all(isinstance(v, list) for v in values):
        (a, ra), (b, rb) = groups.items()
        a, b = {json.dumps(x) for x in json.loads(a)}, {json.dumps(x) for x in json.loads(b)}
        return (f"only ranks {ra} have {sorted(a - b)[:6]}, only ranks {rb} have "
                f"{sorted(b - a)[:6]}")
    return ", ".join(f"ranks {ranks} have {_short(json.loads(v))}"
                     for v, ranks in groups.items())


def _short(value, limit: int = 300) -> str:
    text = "grace=None" if value is None else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def grace_label(grace):
    """What ranks compare about a ``grace=`` argument (``None``: the framework's own
    reduction)."""
    if grace is None:
        return None
    return {"fingerprint": grace.fingerprint(), "config": grace.config()}


def allgather_for(framework: str, process_set=None) -> Allgather:
    """``allgather(array, name)`` over Horovod's collectives of ``framework`` (eager in TF,
    also when called while a ``tf.function`` is traced)."""
    if framework == "torch":
        import horovod.torch as hvd
        import torch

        ps = hvd.global_process_set if process_set is None else process_set

        def gather_torch(array, name):
            return hvd.allgather(torch.from_numpy(array), name=name, process_set=ps).numpy()
        return gather_torch
    if framework == "tensorflow":
        import horovod.tensorflow as hvd
        import tensorflow as tf

        ps = hvd.global_process_set if process_set is None else process_set

        def gather_tf(array, name):
            with tf.init_scope():
                return hvd.allgather(tf.constant(array), name=name, process_set=ps).numpy()
        return gather_tf
    raise ValueError(f"framework must be one of ['tensorflow', 'torch'], got {framework!r}")
