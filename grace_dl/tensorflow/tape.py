"""``DistributedGradientTape(tape, ..., grace=grc)``: Horovod's tape, with gradients reduced by
a grace_dl communicator.

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape, grace=grc)
    grads = tape.gradient(loss, model.trainable_variables)   # reduced across ranks

Works eagerly and inside ``tf.function`` (state variables are created on the first trace; later
calls reuse the graph). With ``grace=None`` the gradients are reduced by Horovod's own function,
exactly as ``horovod.tensorflow.DistributedGradientTape`` does; the tape is ours because
Horovod's calls ``.ref()`` on the sources, which Keras 3 variables
(``model.trainable_variables``) do not have. Gradient names, sparse gradients, the rank
agreement check and byte counters: see ``grace_dl.tensorflow.gradients``.
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf

from grace_dl.communicators.buckets import check_bucket_bytes
from grace_dl.tensorflow.gradients import GraceReducer, HorovodReducer


class _ReducingTape:
    """Mixed into a subclass of the user's tape class, so ``isinstance`` still holds."""

    _reducer: GraceReducer | HorovodReducer

    def register_local_source(self, source):
        """Gradients of ``source`` are not reduced (as in Horovod)."""
        self._reducer.register_local(source)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """The local gradients reduced across ranks (``use_generic_names``: Horovod's, for
        ``grace=None``; with ``grace`` names always come from the variables). Positional
        arguments as Horovod's ``gradient`` takes them; ``unconnected_gradients`` (TF's, which
        Horovod's does not pass on) after them."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_grads = tf.nest.flatten(grads)
        flat_sources = tf.nest.flatten(sources)
        reduced = self._reducer(flat_grads, flat_sources, use_generic_names)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """``(local [(source, grad)], global [(source, grad)])`` as in Horovod."""
        grads = self.gradient(target, sources, output_gradients,
                              use_generic_names=use_generic_names)
        local, global_ = [], []
        for s, g in zip(tf.nest.flatten(sources), tf.nest.flatten(grads)):
            (local if self._reducer.is_local(s) else global_).append((s, g))
        return local, global_


_CLASSES: dict[type, type] = {}


def _tape_class(tape_class: type) -> type:
    cls = _CLASSES.get(tape_class)
    if cls is None:
        cls = type(tape_class.__name__, (_ReducingTape, tape_class), {})
        _CLASSES[tape_class] = cls
    return cls


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression=hvd.Compression.none, sparse_as_dense=False,
                            op=hvd.Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=hvd.global_process_set,
                            scale_local_gradients=True, grace=None, bucket_bytes=None):
    """Horovod's ``DistributedGradientTape`` plus ``grace=`` and ``bucket_bytes``.

    With ``grace`` (a communicator from ``grace_from_params`` or a strategy dispatcher) every
    gradient goes through ``grace.send`` / ``grace.receive``: the compressor, memory and
    collective decide what crosses the wire. ``op`` is ``hvd.Average`` or ``hvd.Sum``;
    ``gradient_predivide_factor`` and ``scale_local_gradients`` behave as in Horovod;
    ``device_dense`` places the compression. ``groups`` / ``num_groups`` become the grace
    object's fusion groups (``GraceReducer``). ``compression`` is Horovod's own and is rejected
    together with ``grace=``. ``sparse_as_dense`` is implied: sparse gradients are densified.
    ``bucket_bytes`` (grace only): gradients packed into flat buckets of about this many bytes,
    each compressed and sent as one tensor (``grace_dl.communicators.buckets``).

    With ``grace=None`` every argument means what it means to Horovod (its own reduction).
    """
    if groups is None and num_groups:
        groups = num_groups
    if grace is None:
        check_bucket_bytes(bucket_bytes, None)
        if groups is not None and not (isinstance(groups, list) or groups > 0):
            raise ValueError(f"groups must be a positive integer or a list of lists of "
                             f"variables, got {groups!r}")
        reducer = HorovodReducer("DistributedGradientTape", device_dense, device_sparse,
                                 compression, sparse_as_dense, op, gradient_predivide_factor,
                                 groups, process_set, scale_local_gradients)
    else:
        reject_horovod_only_options(compression=compression)
        reducer = GraceReducer(grace, op=op, gradient_predivide_factor=gradient_predivide_factor,
                               process_set=process_set,
                               scale_local_gradients=scale_local_gradients, device=device_dense,
                               groups=groups, bucket_bytes=bucket_bytes)
    cls = _tape_class(type(gradtape))
    tape = cls.__new__(cls)
    tf.GradientTape.__init__(tape, persistent=gradtape._persistent,
                             watch_accessed_variables=gradtape._watch_accessed_variables)
    tape._tape = gradtape._tape
    tape._watched_variables = gradtape._watched_variables
    tape._reducer = reducer
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=hvd.Compression.none, sparse_as_dense=False,
                                   op=hvd.Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=hvd.global_process_set,
                                   local_layers=None, scale_local_gradients=True, grace=None,
                                   bucket_bytes=None):
    """Horovod's ``PartialDistributedGradientTape`` (the variables of ``local_layers`` are not
    reduced, only divided by the number of ranks when ``scale_local_gradients``) plus
    ``grace=``."""
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    tape = DistributedGradientTape(
        gradtape, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense, op=op,
        gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
        grace=grace, bucket_bytes=bucket_bytes)
    for layer in local_layers:
        if not hasattr(layer, "trainable_weights"):
            raise ValueError(f"local_layers must be Keras layers, got {type(layer).__name__}")
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


def reject_horovod_only_options(compression=hvd.Compression.none,
                                backward_passes_per_step=1) -> None:
    """Horovod options that ``grace=`` replaces: a clear error instead of ignoring them."""
    if compression is not hvd.Compression.none:
        raise ValueError(f"compression={compression!r} is Horovod's compression; with grace= the "
                         "grace object compresses: pass compression=hvd.Compression.none")
    if backward_passes_per_step != 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r}: with grace= only "
                         "1 is supported; accumulate locally with the Keras optimizer's "
                         "gradient_accumulation_steps instead")
