"""TensorFlow side: tensor ops backend, Horovod TF collectives, tape and Keras glue.

Names are loaded on first use, so ``import grace_dl.tensorflow.ops`` does not import Horovod:

* ``DistributedGradientTape``, ``PartialDistributedGradientTape``, ``DistributedOptimizer``
  (``grace_dl.tensorflow.horovod``, the drop-in for ``horovod.tensorflow``);
* ``checkpointable(grc)`` (``grace_dl.tensorflow.checkpoint``);
* ``BroadcastGlobalVariablesCallback`` (``grace_dl.tensorflow.keras``).
"""

import importlib

_LAZY = {
    "DistributedGradientTape": "grace_dl.tensorflow.tape",
    "PartialDistributedGradientTape": "grace_dl.tensorflow.tape",
    "DistributedOptimizer": "grace_dl.tensorflow.horovod",
    "checkpointable": "grace_dl.tensorflow.checkpoint",
    "BroadcastGlobalVariablesCallback": "grace_dl.tensorflow.keras",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'grace_dl.tensorflow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
