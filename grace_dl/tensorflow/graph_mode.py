"""TF1 graph mode (``tf.Graph`` + ``Session``, or ``tf.compat.v1.disable_eager_execution()``)
is refused when a ``grace=`` reducer is built.

grace_dl runs under TensorFlow 2: eagerly, or traced by ``tf.function``. In a TF1 graph two
things break silently: tensor comparisons in Python (``Tensor.__eq__`` is identity there, which
topk's tie handling relies on), and per-name state variables created lazily at the first step,
after the user's ``global_variables_initializer`` has run (residual memory). Horovod's own
reduction (``grace=None``) still works in graph mode.
"""

from __future__ import annotations

import tensorflow as tf


def check_not_tf1_graph() -> None:
    """``ValueError`` unless TensorFlow executes eagerly or traces a ``tf.function``."""
    if tf.executing_eagerly() or tf.inside_function():
        return
    raise ValueError("grace= needs TensorFlow 2 execution (eager, or inside tf.function); TF1 "
                     "graph mode (tf.Graph + Session, tf.compat.v1.disable_eager_execution) is "
                     "not supported: build the step as a tf.function, or use grace=None "
                     "(Horovod's own reduction) in graph mode")
