"""Horovod collectives for TensorFlow tensors (``grace_dl.collectives.Collectives`` on
``horovod.tensorflow``'s ops), in eager mode and inside ``tf.function``.

A "handle" is the op's output itself: inside ``tf.function`` TF schedules the Horovod ops (they
are asynchronous kernels, so independent collectives overlap), and ``synchronize`` just returns
the output; in eager mode each op completes when called. Ranks must therefore start their
collectives in the same order in eager mode, as they do when they run the same code.

Names are passed with ``ignore_name_scope=True`` so the collective is keyed by the name we give,
whatever ``tf.name_scope`` the caller is in; characters TF does not allow in op names (and
``/``, which would start a scope) become ``_``.

Horovod's TF ops are not marked stateful, so inside ``tf.function`` TF's constant folding would
run one whose input is a graph constant (a zeros buffer, a statically known lengths vector)
while the function is being instantiated; when that happens on some ranks only, the ranks
deadlock. Every input is therefore passed through a stateful, zero-copy pass-through
(``Print`` with nothing to print), which folding never evaluates.

dtypes Horovod's TF ops lack travel as in ``grace_dl.torch.collectives``: ``bfloat16`` is
moved as a bit-exact ``int16`` view, summed as ``float32``; ``int8``/``uint8``/``int16`` are summed
as ``int32``; every result comes back in the dtype that went in. A widened sum puts the wider
type on the wire, and ``allreduce_nbytes`` says so to the byte counters.
"""

from __future__ import annotations

import re

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.common.process_sets import global_process_set

from grace_dl.collectives import Collectives

_SUM_AS = {tf.int8: tf.int32, tf.uint8: tf.int32, tf.int16: tf.int32, tf.bfloat16: tf.float32}
_SUMMABLE = (tf.int32, tf.int64, tf.float16, tf.float32, tf.float64)


def op_name(name: str) -> str:
    """``name`` made acceptable as a TF op name without a scope."""
    name = re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
    return name if re.match(r"[A-Za-z0-9.]", name) else f"g{name}"


def _opaque(tensor):
    """``tensor`` itself, but never a constant to TF's graph optimisers (see module doc)."""
    if tf.executing_eagerly():
        return tensor
    return tf.raw_ops.Print(input=tensor, data=[], first_n=0)


def _move(tensor):
    """(tensor as a dtype Horovod moves, function restoring the original)."""
    if tensor.dtype == tf.bfloat16:
        return tf.bitcast(tensor, tf.int16), lambda t: tf.bitcast(t, tf.bfloat16)
    return tensor, None


class TFCollectives(Collectives):
    def __init__(self, process_set=None):
        self.process_set = global_process_set if process_set is None else process_set

    def size(self) -> int:
        return self.process_set.size()

    def rank(self) -> int:
        return self.process_set.rank()

    def _global_rank(self, rank: int) -> int:
        ranks = self.process_set.ranks
        return ranks[rank] if ranks else rank

    def allreduce_async(self, tensor, name: str):
        tensor = tf.convert_to_tensor(tensor)
        dt = tensor.dtype
        wire = _opaque(tf.cast(tensor, _SUM_AS[dt]) if dt in _SUM_AS else tensor)
        if wire.dtype not in _SUMMABLE:
            raise ValueError(f"allreduce cannot sum {dt.name} tensors (name {name!r}); "
                             f"summable: {[d.name for d in (*_SUMMABLE, *_SUM_AS)]}")
        out = hvd.allreduce(wire, op=hvd.Sum, name=op_name(name), process_set=self.process_set,
                            ignore_name_scope=True)
        return tf.cast(out, dt) if dt in _SUM_AS else out

    def allreduce_nbytes(self, tensor):
        from grace_dl.tensorflow import ops

        return ops.numel(tensor) * _SUM_AS.get(tensor.dtype, tensor.dtype).size

    def allgather_async(self, tensor, name: str):
        wire, post = _move(tf.convert_to_tensor(tensor))
        out = hvd.allgather(_opaque(wire), name=op_name(name), ignore_name_scope=True,
                            process_set=self.process_set)
        return post(out) if post else out

    def broadcast_async(self, tensor, root: int, name: str):
        wire, post = _move(tf.convert_to_tensor(tensor))
        out = hvd.broadcast(_opaque(wire), self._global_rank(root), name=op_name(name),
                            ignore_name_scope=True, process_set=self.process_set)
        return post(out) if post else out

    def alltoall_async(self, tensor, splits, name: str):
        wire, post = _move(tf.convert_to_tensor(tensor))
        splits = _opaque(tf.cast(tf.convert_to_tensor(splits), tf.int32))
        out, received = hvd.alltoall(_opaque(wire), splits=splits, name=op_name(name),
                                     ignore_name_scope=True, process_set=self.process_set)
        return (post(out) if post else out), received

    def synchronize(self, handle):
        return handle

    def barrier(self) -> None:
        """Horovod TF has no barrier op: a one-element allreduce completes only when every
        rank has started it."""
        hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="grace.barrier", ignore_name_scope=True,
                      process_set=self.process_set)


def collectives(process_set=None) -> TFCollectives:
    """The Horovod TF collectives over ``process_set`` (the global one by default)."""
    return TFCollectives(process_set)
