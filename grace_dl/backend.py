"""Pick the framework backend (tensor ops, Horovod collectives) from a tensor's type.

Algorithms are written once against ``ops_for(tensor)``; nothing in ``grace_dl.compressors``,
``grace_dl.memory`` or ``grace_dl.communicators`` imports torch or TensorFlow.
"""

from __future__ import annotations

import importlib


def framework_of(tensor) -> str:
    """'torch' or 'tensorflow', from the tensor's class (without importing either)."""
    for klass in type(tensor).__mro__:
        module = klass.__module__ or ""
        if module.startswith("torch"):
            return "torch"
        if module.startswith(("tensorflow", "keras", "tf_keras")):
            return "tensorflow"
    raise TypeError(
        f"grace_dl supports torch.Tensor and tf.Tensor/tf.Variable, got {type(tensor).__name__}"
    )


_OPS: dict = {}   # tensor class -> its ops module (ops_for runs dozens of times a step)


def ops_for(tensor):
    """The ``ops`` module (``grace_dl.torch.ops`` or ``grace_dl.tensorflow.ops``) for ``tensor``."""
    kind = type(tensor)
    ops = _OPS.get(kind)
    if ops is None:
        ops = _OPS[kind] = importlib.import_module(f"grace_dl.{framework_of(tensor)}.ops")
    return ops


def collectives_for(tensor, process_set=None):
    """The Horovod collectives of ``tensor``'s framework (see ``grace_dl.collectives``)."""
    module = importlib.import_module(f"grace_dl.{framework_of(tensor)}.collectives")
    return module.collectives(process_set)
