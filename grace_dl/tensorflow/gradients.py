"""One step's gradients through a ``grace=`` object, keyed by variable names: the part that
``DistributedGradientTape`` and the Keras ``DistributedOptimizer`` share.

**Tensor names.** Horovod matches collectives across ranks by name and the grace state
(residuals, counters) is keyed by name, so every gradient gets a name derived from its variable,
identical on all ranks and in a fresh process that runs the same script:

* a Keras 3 variable: its ``path`` (``"sequential/dense/kernel"``);
* a ``tf.Variable``: its ``name`` without the ``":0"`` suffix;
* anything else (a watched tensor): ``"source.<i>"``, ``i`` its position in the sources.

Two different variables with the same name (eager ``tf.Variable``s default to ``"Variable"``)
get ``"_1"``, ``"_2"``, ... appended in the order they are first seen, which is the same on
every rank.

**Sparse gradients.** A ``tf.IndexedSlices`` gradient (from ``tf.gather`` / ``Embedding``) is
densified (``tf.convert_to_tensor``, duplicate rows summed) and compressed like any dense
gradient; the reduced gradient comes back dense. Compressors decide what travels, so a sparse
embedding gradient under ``topk`` still sends only k values and k indices.

**Agreement.** The first time a grace object meets a set of gradients, ranks exchange its
``fingerprint()`` together with the (name, shape, dtype) list they are about to send; any
difference raises ``ValueError`` on every rank (instead of a Horovod hang). Inside
``tf.function`` the exchange runs eagerly at trace time (``tf.init_scope``).

**Byte counters.** ``grace.end_step()`` is called after each step's gradients are received.
Inside ``tf.function`` that code runs once per trace, so the counters hold the traced step's
traffic (one entry per trace), not one entry per executed step.
"""

from __future__ import annotations

import hashlib
import itertools
import json

import horovod.tensorflow as hvd
import tensorflow as tf

from grace_dl.communicators.base import AVERAGE, SUM

# Horovod's reduce ops that grace= can carry, and what they mean to a communicator.
_OPS = {int(hvd.Average): AVERAGE, int(hvd.Sum): SUM}
_agreement_calls = itertools.count()


def grace_op(op) -> str:
    """Horovod's ``hvd.Average`` / ``hvd.Sum`` (or the strings) as a communicator op."""
    if isinstance(op, str) and op in (AVERAGE, SUM):
        return op
    try:
        return _OPS[int(op)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"op must be hvd.Average or hvd.Sum with grace=, got {op!r}") from None


def variable_name(source) -> str | None:
    """The name a gradient of ``source`` travels under, before de-duplication; ``None`` for
    a source without a stable name (a tensor)."""
    path = getattr(source, "path", None)
    if isinstance(path, str) and path:
        return path
    if isinstance(source, tf.Variable):
        name = source.name
        return name[:-2] if name.endswith(":0") else name
    return None


class Names:
    """Gives each variable one unique name for the lifetime of a grace object."""

    def __init__(self):
        self._by_id: dict[int, tuple[object, str]] = {}
        self._used: set[str] = set()

    def __call__(self, source, position: int) -> str:
        base = variable_name(source)
        if base is None:
            return f"source.{position}"
        known = self._by_id.get(id(source))
        if known is not None and known[0] is source:
            return known[1]
        name, k = base, 0
        while name in self._used:
            k += 1
            name = f"{base}_{k}"
        self._used.add(name)
        self._by_id[id(source)] = (source, name)  # the reference keeps id() from being reused
        return name


def densify(grad):
    """A dense tensor for ``grad`` (``tf.IndexedSlices`` rows are scattered, duplicates summed)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


class GraceReducer:
    """Sends a step's gradients through ``grace`` and returns the reduced ones.

    ``op``: ``hvd.Average`` or ``hvd.Sum``. ``gradient_predivide_factor`` (Average only, as in
    Horovod) scales gradients by ``1/f`` before compression and the result by ``f`` after.
    ``process_set`` must be the grace object's own (set it when building the communicator).
    """

    def __init__(self, grace, op=hvd.Average, gradient_predivide_factor: float = 1.0,
                 process_set=hvd.global_process_set, scale_local_gradients: bool = True,
                 device: str = ""):
        for method in ("send", "receive", "end_step", "fingerprint"):
            if not callable(getattr(grace, method, None)):
                raise ValueError(f"grace must be a grace_dl communicator (from grace_from_params) "
                                 f"or a strategy dispatcher; {type(grace).__name__} has no "
                                 f"{method}()")
        self.grace = grace
        self.op = grace_op(op)
        self.predivide = float(gradient_predivide_factor)
        if self.predivide <= 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, "
                             f"got {gradient_predivide_factor!r}")
        if self.predivide != 1.0 and self.op != AVERAGE:
            raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average, "
                             f"got op={op!r}")
        own = getattr(grace, "process_set", None)
        if process_set is not hvd.global_process_set and process_set is not own:
            raise ValueError(f"process_set={process_set!r} differs from the grace object's "
                             f"({own!r}); build the communicator with that process set, e.g. "
                             "grace_from_params({..., 'process_set': ps})")
        self.process_set = own if own is not None else hvd.global_process_set
        self.scale_local_gradients = bool(scale_local_gradients)
        self.device = device
        self.names = _names_for(grace)
        self._local: dict[int, object] = {}

    # ------------------------------------------------------------------ local sources
    def register_local(self, source) -> None:
        """Gradients of ``source`` stay on this rank (divided by the number of ranks when
        ``scale_local_gradients``, as Horovod does)."""
        self._local[id(source)] = source

    def is_local(self, source) -> bool:
        return self._local.get(id(source)) is source

    # ------------------------------------------------------------------ one step
    def __call__(self, grads, sources) -> list:
        grads, sources = list(grads), list(sources)
        if len(grads) != len(sources):
            raise ValueError(f"{len(grads)} gradients for {len(sources)} variables")
        out = list(grads)
        todo = []
        for i, (g, s) in enumerate(zip(grads, sources)):
            if g is None:
                continue
            if self.is_local(s):
                if self.scale_local_gradients:
                    out[i] = _scale(g, 1.0 / self.process_set.size())
                continue
            todo.append((i, self.names(s, i), densify(g), s))
        if not todo:
            return out
        _check_agreement(self.grace, [(n, tuple(s.shape), g.dtype.name) for _, n, g, s in todo],
                         self.process_set)
        with tf.device(self.device):
            handles = []
            for i, name, g, _ in todo:
                if self.predivide != 1.0:
                    g = g * tf.cast(1.0 / self.predivide, g.dtype)
                handles.append((i, self.grace.send(g, name, self.op)))
            for i, handle in handles:
                reduced = self.grace.receive(handle)
                if self.predivide != 1.0:
                    reduced = reduced * tf.cast(self.predivide, reduced.dtype)
                out[i] = reduced
        self.grace.end_step()
        return out


def _scale(grad, factor):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


# Per grace object: the variable-name table and the gradient sets already agreed on.
_TABLES: dict[int, tuple[object, Names, set]] = {}


def _entry(grace):
    entry = _TABLES.get(id(grace))
    if entry is None or entry[0] is not grace:
        entry = (grace, Names(), set())
        _TABLES[id(grace)] = entry
    return entry


def _names_for(grace) -> Names:
    return _entry(grace)[1]


def _check_agreement(grace, signature, process_set) -> None:
    """Ranks compare ``grace.fingerprint()`` and the gradients they send; ``ValueError`` on
    every rank if any differ."""
    agreed = _entry(grace)[2]
    digest = hashlib.sha256(json.dumps(signature).encode()).hexdigest()[:16]
    if digest in agreed:
        return
    mine = {"fingerprint": grace.fingerprint(), "tensors": signature}
    with tf.init_scope():
        everyone = hvd.allgather_object(mine, name=f"grace.agreement.{next(_agreement_calls)}",
                                        process_set=process_set)
    for rank, theirs in enumerate(everyone):
        if theirs["fingerprint"] != everyone[0]["fingerprint"]:
            raise ValueError(
                f"grace configuration differs across ranks: rank 0 has fingerprint "
                f"{everyone[0]['fingerprint']}, rank {rank} has {theirs['fingerprint']} (this "
                f"rank's config: {_config(grace)}); build the grace object identically everywhere")
        if theirs["tensors"] != everyone[0]["tensors"]:
            diff = sorted(set(map(tuple, theirs["tensors"]))
                          ^ set(map(tuple, everyone[0]["tensors"])), key=repr)
            raise ValueError(
                f"ranks 0 and {rank} reduce different gradients (name, shape, dtype); they "
                f"differ in {diff[:6]}; every rank must train the same variables")
    agreed.add(digest)


def _config(grace):
    config = getattr(grace, "config", None)
    return config() if callable(config) else repr(grace)
