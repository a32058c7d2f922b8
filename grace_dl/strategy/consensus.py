"""Making every rank run the same strategy: broadcast it from one rank, and check before the
first step that all ranks hold the same one.

    strategy = broadcast_strategy(lambda: Auto().build(model.named_parameters(), "cluster.yaml"),
                                  framework="torch")      # built on rank 0 only
    grc = from_strategy(strategy)

Both are collectives (every rank calls them) over the Horovod collectives of ``framework``
(``"torch"`` or ``"tensorflow"``), so they work under ``horovodrun`` (Gloo) and ``mpirun``
alike. A failure on the building rank is announced to the others, which raise too instead of
waiting. Inside ``tf.function`` they run eagerly (``tf.init_scope``).
"""

from __future__ import annotations

import contextlib
import importlib

import numpy as np

from grace_dl.backend import framework_of
from grace_dl.communicators import agreement
from grace_dl.strategy.serialize import coerce, from_bytes, to_bytes

FRAMEWORKS = ("torch", "tensorflow")


def _backend(framework: str | None, tensor, process_set, collectives=None):
    """``(framework, ops, collectives)``: ``collectives`` when given, else Horovod's of the
    framework (named, or ``tensor``'s)."""
    if framework is None:
        if tensor is None:
            raise ValueError("give framework='torch' or 'tensorflow' (or a tensor)")
        framework = framework_of(tensor)
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {list(FRAMEWORKS)}, got {framework!r}")
    ops = importlib.import_module(f"grace_dl.{framework}.ops")
    if collectives is None:
        collectives = importlib.import_module(
            f"grace_dl.{framework}.collectives").collectives(process_set)
    return framework, ops, collectives


def _eager(framework: str):
    if framework == "tensorflow":
        import tensorflow as tf

        return tf.init_scope()
    return contextlib.nullcontext()


def _allgather(ops, coll, like=None):
    """``grace_dl.communicators.agreement``'s ``allgather(array, name)`` over ``coll`` (on
    ``like``'s device: NCCL gathers GPU tensors)."""
    def gather(array, name):
        return ops.to_numpy(coll.synchronize(coll.allgather_async(ops.from_numpy(array, like),
                                                                  name)))
    return gather


def verify(dispatcher, framework: str | None = None, tensor=None, collectives=None) -> None:
    """``ValueError`` on every rank unless all ranks' dispatchers have the same fingerprint (and
    the strategy's replicas and PS ranks fit the job). Over ``collectives`` when given (those
    a send was given: the DDP hook's ``torch.distributed`` ones), else Horovod's of
    ``framework``."""
    framework, ops, coll = _backend(framework, tensor, dispatcher.process_set, collectives)
    with _eager(framework):
        agreement.check({"strategy": dispatcher.fingerprint(), "summary": dispatcher.summary()},
                        _allgather(ops, coll, tensor), "grace.strategy.fingerprint", coll.rank(),
                        mismatch=lambda everyone, rank: _mismatch(
                            [e["strategy"] for e in everyone], [e["summary"] for e in everyone],
                            rank))
    size = coll.size()
    replicas = list(dispatcher.strategy.graph_config.replicas)
    if replicas and len(replicas) != size:
        raise ValueError(f"the strategy was built for {len(replicas)} replicas ({replicas[:8]}"
                         f"{' ...' if len(replicas) > 8 else ''}) but the job has {size} ranks; "
                         f"rebuild it with this job's resource spec")
    roots = sorted({r.root for r in dispatcher._routes.values() if r.root is not None})
    if roots and roots[-1] >= size:
        raise ValueError(f"PSSynchronizer reduction_destination rank {roots[-1]} does not exist "
                         f"in a job of {size} ranks")


def _mismatch(fingerprints, summaries, rank: int) -> str:
    lines = [f"ranks run different strategies (fingerprints by rank: {fingerprints}); this is "
             f"rank {rank}. Build or load the strategy on one rank and broadcast it "
             f"(grace_dl.strategy.broadcast_strategy)."]
    base = summaries[0]
    for r, other in enumerate(summaries[1:], start=1):
        if fingerprints[r] == fingerprints[0]:
            continue
        only0 = [n for n in base if n not in other]
        only_r = [n for n in other if n not in base]
        differ = [n for n in base if n in other and base[n] != other[n]]
        parts = []
        if only0:
            parts.append(f"only rank 0 has {only0[:5]}")
        if only_r:
            parts.append(f"only rank {r} has {only_r[:5]}")
        for n in differ[:3]:
            parts.append(f"{n!r}: rank 0 {base[n]!r} vs rank {r} {other[n]!r}")
        if len(differ) > 3:
            parts.append(f"... {len(differ) - 3} more differing variables")
        if not parts:
            parts.append("same nodes, different pipeline settings or grace_dl versions")
        lines.append(f"rank {r} vs rank 0: " + "; ".join(parts))
    return "\n".join(lines)


def broadcast_strategy(strategy_or_builder=None, framework: str = "torch", root: int = 0,
                       process_set=None):
    """The strategy of rank ``root`` on every rank. On ``root``, ``strategy_or_builder`` is a
    ``Strategy``, a path, bytes, or a function returning one of those (called on ``root``
    only); other ranks may pass anything (it is ignored)."""
    framework, ops, coll = _backend(framework, None, process_set)
    error = None
    data = b""
    if coll.rank() == root:
        try:
            obj = strategy_or_builder() if callable(strategy_or_builder) else strategy_or_builder
            data = to_bytes(coerce(obj))
        except Exception as err:  # noqa: BLE001 - re-raised below, after telling the others
            error = err
    with _eager(framework):
        header = np.array([-1 if error is not None else len(data)], np.int64)
        length = int(ops.to_numpy(coll.synchronize(coll.broadcast_async(
            ops.from_numpy(header), root, "grace.strategy.broadcast.len")))[0])
        if error is not None:
            raise error
        if length < 0:
            raise ValueError(f"rank {root} could not build or load the strategy (see its error)")
        if length == 0:
            return from_bytes(b"")
        buf = np.frombuffer(data, np.uint8).copy() if coll.rank() == root \
            else np.zeros(length, np.uint8)
        out = ops.to_numpy(coll.synchronize(coll.broadcast_async(
            ops.from_numpy(buf), root, "grace.strategy.broadcast")))
    return from_bytes(out.tobytes())
