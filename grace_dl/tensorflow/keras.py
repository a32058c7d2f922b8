"""A Keras 3 optimizer that really averages gradients across ranks, with or without ``grace=``.

Horovod 0.28.1's ``hvd.DistributedOptimizer(keras_optimizer)`` hooks ``_compute_gradients`` /
``_aggregate_gradients``, which Keras 3 no longer calls: under TF 2.21 / Keras 3 it trains
each rank on its own gradients and the ranks' weights drift apart. Ours is a subclass of the
user's optimizer class (same name, same config) whose ``apply`` reduces the gradients first;
``apply_gradients`` and ``model.fit`` (TF backend) both go through ``apply``.

    opt = grace_dl.tensorflow.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), grace=grc)
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(x, y, callbacks=[grace_dl.tensorflow.keras.BroadcastGlobalVariablesCallback(0)])

* ``grace=None``: gradients are reduced with Horovod's own allreduce (its fusion, compression=,
  sparse path and ``gradient_predivide_factor``), exactly what ``hvd.DistributedGradientTape``
  does.
* ``grace=grc``: each gradient goes through ``grc.send`` / ``grc.receive``; gradient names are
  the variables' Keras ``path``s (see ``grace_dl.tensorflow.gradients``).

Mixed precision (``"mixed_float16"``): pass ``DistributedOptimizer(keras.optimizers.
LossScaleOptimizer(opt))``, so that the loss scaler sees the averaged gradients and every rank
skips the same steps; an optimizer of ours that ``compile`` wraps in a ``LossScaleOptimizer``
itself is refused at the first step (each rank would test its own gradients).
Horovod ops cannot be XLA-compiled: compile with ``jit_compile=False`` (the default on CPU).
The optimizer's own ``gradient_accumulation_steps`` accumulates the already-reduced gradients.
The optimizer also tracks the grace state (``self.grace_state``), so ``tf.train.Checkpoint(
optimizer=opt)`` saves residuals and counters with the optimizer's slots.
"""

from __future__ import annotations

import sys

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from grace_dl.communicators.buckets import check_bucket_bytes
from grace_dl.tensorflow.checkpoint import checkpointable
from grace_dl.tensorflow.gradients import GraceReducer, HorovodReducer
from grace_dl.tensorflow.tape import reject_horovod_only_options


class _Distributed:
    """Mixed in front of the user's optimizer class."""

    def apply(self, grads, trainable_variables=None):
        _refuse_loss_scaling_outside(self)     # (a traced step: once; eager: a few frames)
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self._trainable_variables))
        grads = self._hvd_reducer(list(grads), variables)
        return super().apply(grads, trainable_variables)

    def register_local_var(self, var):
        """Gradients of ``var`` are not reduced (as in Horovod)."""
        self._hvd_reducer.register_local(var)


#: caller frames searched for a ``LossScaleOptimizer`` around ours (its ``apply``, its branch
#: for finite gradients, and TF's ``cond`` between them)
_CALLER_FRAMES = 12


def _refuse_loss_scaling_outside(opt) -> None:
    """Raise where ``opt`` is the inner optimizer of Keras's ``LossScaleOptimizer`` (its
    ``apply`` calling ours: ``model.compile`` wraps an optimizer so under the
    ``"mixed_float16"`` policy). That wrapper tests each rank's own gradients for overflow
    before ours averages them, so ranks whose gradients differ skip different steps and their
    collectives no longer match (a wrong average, then a crash or a hang). Raised while the
    first step is traced, on every rank alike, before any collective; checked at every call,
    so an optimizer compiled again under another policy is checked again."""
    frame = sys._getframe(2)
    for _ in range(_CALLER_FRAMES):
        if frame is None:
            return
        outer = frame.f_locals.get("self")
        if isinstance(outer, keras.optimizers.LossScaleOptimizer) and \
                getattr(outer, "inner_optimizer", None) is opt:
            raise ValueError(
                f"DistributedOptimizer({type(opt).__name__}) is the inner optimizer of "
                f"keras's LossScaleOptimizer (model.compile wraps it so under the "
                f"'mixed_float16' policy): the loss scale would be checked on each rank's own "
                f"gradients before they are averaged, and ranks that disagree on skipping a "
                f"step no longer match their collectives. Put the loss scaling inside: "
                f"DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer)), and "
                f"compile with that")
        frame = frame.f_back


_CLASSES: dict[type, type] = {}


def _distributed_class(opt_class: type) -> type:
    cls = _CLASSES.get(opt_class)
    if cls is None:
        cls = type(opt_class.__name__, (_Distributed, opt_class), {})
        _CLASSES[opt_class] = cls
    return cls


def is_keras_optimizer(optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.Optimizer)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=hvd.Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=hvd.Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=hvd.global_process_set,
                         scale_local_gradients=True, grace=None, bucket_bytes=None):
    """Horovod's Keras ``DistributedOptimizer`` arguments plus ``grace=`` (and ``bucket_bytes``,
    as ``DistributedGradientTape``'s); returns a new
    optimizer of the same class built from ``optimizer.get_config()`` (a fresh, unbuilt
    optimizer, as Horovod's). ``op`` is ``hvd.Average`` or ``hvd.Sum``.
    ``backward_passes_per_step`` must be 1 (use the optimizer's ``gradient_accumulation_steps``);
    ``average_aggregated_gradients`` only matters with it and is accepted for compatibility.
    With ``grace=``, ``compression`` is rejected (the grace object compresses), ``groups`` /
    ``num_groups`` become the grace object's fusion groups (``GraceReducer``) and sparse
    gradients are densified."""
    if not is_keras_optimizer(optimizer):
        raise ValueError(f"optimizer must be a keras.optimizers.Optimizer, got "
                         f"{type(optimizer).__name__}")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
    if backward_passes_per_step != 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r}: only 1 is "
                         "supported with Keras 3; set gradient_accumulation_steps on the Keras "
                         "optimizer instead")
    if num_groups and groups is None:
        groups = num_groups
    if grace is None:
        check_bucket_bytes(bucket_bytes, None)
    else:
        reject_horovod_only_options(compression=compression)
        from grace_dl.recipes import warn_known_problems

        warn_known_problems(grace, float(optimizer.get_config().get("momentum", 0.0) or 0.0))

    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    opt = _distributed_class(type(optimizer)).from_config(config)
    if grace is None:
        opt._hvd_reducer = HorovodReducer(
            config["name"], device_dense, device_sparse, compression, sparse_as_dense, op,
            gradient_predivide_factor, groups, process_set, scale_local_gradients)
    else:
        opt._hvd_reducer = GraceReducer(grace, op=op,
                                        gradient_predivide_factor=gradient_predivide_factor,
                                        process_set=process_set,
                                        scale_local_gradients=scale_local_gradients,
                                        device=device_dense, groups=groups,
                                        bucket_bytes=bucket_bytes)
        opt.grace_state = checkpointable(grace)
    return opt


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` before training
    starts, so that every rank begins from the same weights (Horovod's callback calls
    ``var.ref()`` and ``optimizer.variables()``, which Keras 3 variables/optimizers lack).

    The optimizer is built on the model's trainable variables first if it is not built yet.
    A model that is not built before ``fit`` (no input shape) is broadcast after its first
    batch instead, as Horovod does."""

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = int(root_rank)
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self):
        opt = self.model.optimizer
        if opt is not None and not opt.built:
            opt.build(self.model.trainable_variables)
        variables = list(self.model.variables) + (list(opt.variables) if opt is not None else [])
        broadcast_keras_variables(variables, self.root_rank)
        self.broadcast_done = True


def broadcast_keras_variables(variables, root_rank: int = 0) -> None:
    """Assign ``root_rank``'s values to Keras 3 (or tf) variables on every rank, eagerly.
    Collective names are the variables' paths, made unique by position."""
    for i, var in enumerate(variables):
        label = getattr(var, "path", None) or getattr(var, "name", "var")
        value = hvd.broadcast(tf.convert_to_tensor(var), root_rank,
                              name=f"grace.bcast.{i}.{label}".replace(":", "_"))
        var.assign(value)
