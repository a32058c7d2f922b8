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

**Agreement.** Every time gradients are reduced through a grace object (each eager step; each
trace of a ``tf.function``), ranks compare its ``fingerprint()`` and the (name, shape, dtype)
list they are about to send (one 16-byte allgather; ``grace_dl.communicators.agreement``): a
gradient that is None on one rank only, or a different configuration, raises ``ValueError`` on
every rank instead of a Horovod hang or dtype error. A ``grace=None`` reducer joins that check
on its first call, so a job with ``grace=`` on some ranks only fails on every rank at the first
step. Inside ``tf.function`` the exchange runs eagerly at trace time (``tf.init_scope``).

**Byte counters.** ``grace.end_step()`` is called once per step, after the step's gradients
are received; inside ``tf.function`` it runs through ``ops.host_callback`` on every execution
of the traced step (after the communicators' own run-time byte counts), so
``grace.bytes.steps`` gets one entry per executed step in graph mode too.
"""

from __future__ import annotations

import warnings

import horovod.tensorflow as hvd
import tensorflow as tf

from grace_dl.communicators import agreement
from grace_dl.communicators.base import AVERAGE, SUM
from grace_dl.communicators.buckets import bucket_name, check_bucket_bytes, pack
from grace_dl.communicators.exchange import Exchange
from grace_dl.communicators.fusion import split_evenly
from grace_dl.contracts import check_grace
from grace_dl.tensorflow import ops as tf_ops
from grace_dl.tensorflow.graph_mode import check_not_tf1_graph

# Horovod's reduce ops that grace= can carry, and what they mean to a communicator.
_OPS = {int(hvd.Average): AVERAGE, int(hvd.Sum): SUM}


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


class _Reducer:
    """Reduces a step's gradients across ranks, except those of sources registered as local
    (divided by the number of ranks when ``scale_local_gradients``, as Horovod does)."""

    def __init__(self, process_set, scale_local_gradients: bool):
        self.process_set = process_set
        self.scale_local_gradients = bool(scale_local_gradients)
        self._local: dict[int, object] = {}

    def register_local(self, source) -> None:
        self._local[id(source)] = source

    def is_local(self, source) -> bool:
        return self._local.get(id(source)) is source

    def __call__(self, grads, sources, use_generic_names: bool = False) -> list:
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
            todo.append(i)
        if todo:
            reduced = self._reduce([grads[i] for i in todo], [sources[i] for i in todo],
                                   todo, use_generic_names)
            for i, r in zip(todo, reduced):
                out[i] = r
        return out

    def _reduce(self, grads, sources, positions, use_generic_names):
        raise NotImplementedError


class HorovodReducer(_Reducer):
    """Horovod's own reduction (``grace=None``): the function ``hvd.DistributedGradientTape``
    uses (fusion ``groups``, ``compression=``, the allgather path for ``tf.IndexedSlices``,
    ``gradient_predivide_factor``), fed ``tf.Variable``s where Keras 3 variables are given
    (Horovod calls ``.ref()``, which Keras 3 variables lack)."""

    def __init__(self, name, device_dense="", device_sparse="", compression=hvd.Compression.none,
                 sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
                 groups=None, process_set=hvd.global_process_set, scale_local_gradients=True):
        super().__init__(process_set, scale_local_gradients)
        if gradient_predivide_factor != 1.0 and op != hvd.Average:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} is only "
                             f"supported with op=hvd.Average, got op={op!r}")
        if isinstance(groups, list):
            groups = [[tf_variable(v) for v in group] for group in groups]
        self.groups = groups
        self._agreed = False
        self._fn = hvd._make_allreduce_grads_fn(name, device_dense, device_sparse, compression,
                                                sparse_as_dense, op, gradient_predivide_factor,
                                                groups, process_set)

    def _reduce(self, grads, sources, positions, use_generic_names):
        if not self._agreed:  # once: grace ranks check every call, so a mix fails on call 1
            self._agreed = True
            if self.process_set.size() > 1:
                _check_agreement(None, None, self.process_set)
        # Horovod looks at the variables only to match fusion groups.
        variables = ([tf_variable(v) for v in sources] if isinstance(self.groups, list)
                     else None)
        return self._fn(grads, variables, use_generic_names)


def tf_variable(var):
    """The ``tf.Variable`` behind a Keras 3 variable (``var`` itself for a ``tf.Variable``)."""
    return var if isinstance(var, tf.Variable) else getattr(var, "value", var)


class GraceReducer(_Reducer):
    """Sends a step's gradients through ``grace`` and returns the reduced ones.

    ``op``: ``hvd.Average`` or ``hvd.Sum``. ``gradient_predivide_factor`` (Average only, as in
    Horovod) scales gradients by ``1/f`` before compression and the result by ``f`` after.
    ``process_set`` must be the grace object's own (set it when building the communicator).
    ``groups``: Horovod's fusion groups, as the grace object's (``Communicator.fuse``): an int
    splits the step's gradients, in order, into that many groups as even as possible; a list
    of lists of variables names them. They are resolved to gradient names on the first step.
    ``bucket_bytes``: pack each step's gradients (in reverse order: the backward pass's) into
    flat buckets of about this many bytes, each compressed once and sent as one tensor named
    after its members (``grace_dl.communicators.buckets``); ``None``: one per variable.
    """

    def __init__(self, grace, op=hvd.Average, gradient_predivide_factor: float = 1.0,
                 process_set=hvd.global_process_set, scale_local_gradients: bool = True,
                 device: str = "", groups=None, bucket_bytes=None):
        check_not_tf1_graph()
        check_grace(grace)
        self.groups = _check_groups(groups)
        self.bucket_bytes = check_bucket_bytes(bucket_bytes, grace, groups)
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
        super().__init__(own if own is not None else hvd.global_process_set,
                         scale_local_gradients)
        self.device = device
        self.names = _names_for(grace)
        #: a step's grace tensors (``grace_dl.communicators.exchange``)
        self._exchange = Exchange(grace, self.op)

    # The grace code never branches in Python on tensor values (data-dependent branches use
    # ops.cond), so AutoGraph has nothing to convert below this point; skipping it keeps
    # tracing fast and quiet.
    @tf.autograph.experimental.do_not_convert
    def _reduce(self, grads, sources, positions, use_generic_names):
        names = [self.names(s, i) for s, i in zip(sources, positions)]
        if self.groups is not None:
            self.grace.fuse(_fusion_groups(self.groups, names, sources))
            self.groups = None
        grads = [densify(g) for g in grads]
        _check_agreement(self.grace, [(n, tuple(s.shape), g.dtype.name)
                                      for n, g, s in zip(names, grads, sources)],
                         self.process_set)  # every call: a None gradient may differ per rank
        out = [None] * len(grads)
        with tf.device(self.device):
            if self.predivide != 1.0:
                grads = [g * tf.cast(1.0 / self.predivide, g.dtype) for g in grads]
            exchange = self._exchange
            try:
                for name, members, tensor in self._units(names, grads):
                    exchange.start(tensor, name, members, None if len(members) == 1 else
                                  [grads[i].shape.num_elements() for i in members])
                units = exchange.finish()
            except BaseException:
                exchange.clear()
                raise
            for unit in units:
                reduced = unit.out
                if self.predivide != 1.0:
                    reduced = reduced * tf.cast(self.predivide, reduced.dtype)
                for i, part in zip(unit.members, unit.parts(reduced)):
                    out[i] = part if unit.numels is None else tf.reshape(part, grads[i].shape)
        grace = self.grace
        tf_ops.host_callback(lambda: grace.end_step())
        _warn_unused_restored_state(grace, [unit.name for unit in units])
        return out


    def _units(self, names, grads) -> list:
        """What this step sends: ``[(name, positions of its gradients, tensor)]``: a gradient
        each; with ``bucket_bytes`` the buckets (all named ``bucket_name``, a lone gradient
        sent as itself); with a strategy's buckets those, and every other gradient under its
        own name."""
        if self.bucket_bytes is not None:
            for n, g in zip(names, grads):
                if g.shape.num_elements() is None:
                    raise ValueError(f"bucket_bytes needs gradients of known shape; {n!r} has "
                                     f"shape {g.shape}: pass bucket_bytes=None")
            ready = list(range(len(grads)))[::-1]   # the backward pass's order
            layout = pack([((grads[i].dtype.name, grads[i].device),
                            grads[i].shape.num_elements() * grads[i].dtype.size)
                           for i in ready], self.bucket_bytes)
            return [self._unit(names, grads, [ready[j] for j in members], True)
                    for members in layout]
        position = {n: i for i, n in enumerate(names)}
        units, inside = [], set()
        for members in getattr(self.grace, "buckets", None) or []:
            present = [n for n in members if n in position]
            if present and len(present) < len(members):
                raise ValueError(f"the strategy's bucket {members[:3]}... has gradients for "
                                 f"{present[:3]} but not for "
                                 f"{[n for n in members if n not in position][:3]}: every "
                                 f"member of a bucket needs a gradient each step")
            if present:
                units.append(self._unit(names, grads, [position[n] for n in members], True))
                inside.update(members)
        return units + [self._unit(names, grads, [i], False) for i, n in enumerate(names)
                        if n not in inside]

    @staticmethod
    def _unit(names, grads, members, bucket: bool):
        tensor = grads[members[0]] if len(members) == 1 else \
            tf.concat([tf.reshape(grads[i], [-1]) for i in members], 0)
        name = bucket_name([names[i] for i in members]) if bucket else names[members[0]]
        return name, members, tensor


def _check_groups(groups):
    if groups is None or (isinstance(groups, list) and all(isinstance(g, (list, tuple))
                                                           for g in groups)):
        return groups
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise ValueError(f"groups must be a positive integer or a list of lists of variables, "
                         f"got {groups!r}")
    return groups


def _fusion_groups(groups, names, sources) -> list[list[str]]:
    """``groups`` as lists of the gradient names this step sends."""
    if isinstance(groups, int):
        return split_evenly(names, groups)
    by_var = {id(tf_variable(s)): n for s, n in zip(sources, names)}
    out = []
    for group in groups:
        missing = [v for v in group if id(tf_variable(v)) not in by_var]
        if missing:
            raise ValueError(f"groups holds {len(missing)} variable(s) that get no gradient here, "
                             f"e.g. {getattr(missing[0], 'path', missing[0])!r}")
        out.append([by_var[id(tf_variable(v))] for v in group])
    return out


def _scale(grad, factor):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


class _PerGrace:
    """What this module remembers about one grace object."""

    def __init__(self, grace):
        self.grace = grace          # keeps id(grace) from being reused while we hold it
        self.names = Names()
        self.restore_checked = False


_TABLES: dict[int, _PerGrace] = {}


def _entry(grace) -> _PerGrace:
    entry = _TABLES.get(id(grace))
    if entry is None or entry.grace is not grace:
        entry = _PerGrace(grace)
        _TABLES[id(grace)] = entry
    return entry


def _names_for(grace) -> Names:
    return _entry(grace).names


def _warn_unused_restored_state(grace, names) -> None:
    """After the first step: state loaded from a checkpoint that no gradient name has claimed
    means the variables are named differently than when it was saved (e.g. Keras numbered
    unnamed layers differently); that state would be silently dropped, so say so."""
    entry = _entry(grace)
    if entry.restore_checked:
        return
    entry.restore_checked = True
    unused = []
    for part in ("compressor", "memory"):
        state = getattr(getattr(grace, part, None), "state", None)
        if state is None or not hasattr(state, "variables"):
            continue
        live = state.variables()
        unused += [k for k in state.keys() if k not in live
                   and not any(k == n or k.endswith("/" + n) for n in names)]
    if unused:
        warnings.warn(f"grace state restored for {sorted(unused)[:5]} (of {len(unused)}) matches "
                      f"none of this step's gradient names {sorted(names)[:5]}...; if the "
                      "variables were named differently when the checkpoint was saved, name "
                      "the layers explicitly so that restored residuals/counters are used",
                      RuntimeWarning, stacklevel=4)


#: (process set, labels) the ranks agreed on while tracing (``_check_agreement``)
_AGREED_IN_TRACES: set = set()


def _check_agreement(grace, signature, process_set) -> None:
    """Ranks compare ``grace.fingerprint()`` (``None`` for ``grace=None``) and the gradients
    they send; ``ValueError`` on every rank if any differ (``grace_dl.communicators.agreement``).

    Eagerly on every call (every rank makes each call). While a ``tf.function`` is traced, only
    labels not agreed on before: a trace is not a step, and one rank may retrace alone (its
    uneven last batch, a new static shape) where the others run the graph they have; the check,
    an eager allgather, would wait there for ranks that never join it."""
    labels = {"grace configuration": None if grace is None else {
        "fingerprint": grace.fingerprint(), "config": _config(grace)}}
    if signature is not None:
        labels["gradients (name, shape, dtype)"] = [[n, list(s), d] for n, s, d in signature]
    key = None
    if not tf.executing_eagerly():
        key = (getattr(process_set, "process_set_id", id(process_set)), repr(labels))
        if key in _AGREED_IN_TRACES:
            return
    rank = process_set.rank() if process_set.rank() is not None else hvd.rank()
    agreement.check(labels, agreement.allgather_for("tensorflow", process_set),
                    "grace.tensorflow.agreement", rank)
    if key is not None:
        _AGREED_IN_TRACES.add(key)


def _config(grace):
    config = getattr(grace, "config", None)
    return config() if callable(config) else repr(grace)
