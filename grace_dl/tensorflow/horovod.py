"""Drop-in for ``horovod.tensorflow``: every public name of it, plus ``grace=``.

    import grace_dl.tensorflow.horovod as hvd
    hvd.init()
    tape = hvd.DistributedGradientTape(tape, grace=grc)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), grace=grc)

``DistributedGradientTape`` / ``PartialDistributedGradientTape`` / ``DistributedOptimizer`` take
Horovod's arguments plus ``grace=`` (a communicator from ``grace_from_params`` or a strategy
dispatcher). With ``grace=None`` the tapes are Horovod's own; ``DistributedOptimizer`` of a
Keras 3 optimizer is ours in both cases, because Horovod's does not average under Keras 3
(see ``grace_dl.tensorflow.keras``); a ``tf.compat.v1.train.Optimizer`` goes to Horovod's.
``checkpointable(grc)`` gives the object to add to a ``tf.train.Checkpoint``.
"""

from __future__ import annotations

import horovod.tensorflow as _hvd

from grace_dl.communicators.buckets import check_bucket_bytes as _check_bucket_bytes
from grace_dl.tensorflow import keras as _keras
from grace_dl.tensorflow.checkpoint import checkpointable as checkpointable
from grace_dl.tensorflow.tape import DistributedGradientTape as DistributedGradientTape
from grace_dl.tensorflow.tape import (
    PartialDistributedGradientTape as PartialDistributedGradientTape,
)

_OURS = {"DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer"}
globals().update({k: getattr(_hvd, k) for k in dir(_hvd)
                  if not k.startswith("_") and k not in _OURS})

BroadcastGlobalVariablesCallback = _keras.BroadcastGlobalVariablesCallback


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=_hvd.Compression.none,
                         sparse_as_dense=False, backward_passes_per_step=1, op=_hvd.Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=_hvd.global_process_set,
                         scale_local_gradients=True, grace=None, bucket_bytes=None):
    """``horovod.tensorflow.DistributedOptimizer``'s arguments plus ``grace=`` and
    ``bucket_bytes`` (as ``DistributedGradientTape``'s).

    A Keras 3 optimizer gets ``grace_dl.tensorflow.keras.DistributedOptimizer`` (which averages
    with or without ``grace``); a legacy ``tf.compat.v1.train.Optimizer`` with ``grace=None``
    gets Horovod's. Anything else raises ``ValueError``.
    """
    if _keras.is_keras_optimizer(optimizer):
        return _keras.DistributedOptimizer(
            optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
            compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
            groups=groups, process_set=process_set,
            scale_local_gradients=scale_local_gradients, grace=grace, bucket_bytes=bucket_bytes)
    if grace is not None:
        raise ValueError(f"grace= works with Keras 3 optimizers and DistributedGradientTape; got "
                         f"a {type(optimizer).__name__} (for a tf.compat.v1 optimizer use "
                         "DistributedGradientTape(tape, grace=...) and apply_gradients)")
    _check_bucket_bytes(bucket_bytes, None)
    return _hvd.DistributedOptimizer(
        optimizer, name=name, use_locking=use_locking, device_dense=device_dense,
        device_sparse=device_sparse, compression=compression, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


__all__ = sorted({k for k in dir(_hvd) if not k.startswith("_")} | _OURS
                 | {"checkpointable", "BroadcastGlobalVariablesCallback"})
