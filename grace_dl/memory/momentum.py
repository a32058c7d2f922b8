"""``momentum``: momentum kept *before* compression, with or without error feedback: the memory
for sparsifiers under momentum SGD (the optimizer's own momentum set to 0).

Deep Gradient Compression (Lin et al. 2018, §3.2 "momentum correction", §3.3 "momentum factor
masking") showed that sparsifying the gradient and applying momentum *after* the exchange makes
the delayed, accumulated coordinates arrive as bursts that the optimizer's momentum then keeps
applying for ~1/(1-momentum) steps, long after they are stale. The cure is to move momentum in
front of the sparsifier. Per tensor this memory keeps a momentum ``u`` and, with error feedback,
a velocity ``v`` (what was not sent yet):

    compensate(g):  g <- g * min(1, gradient_clipping / ||g||_2)      (if clipping is on)
                    u <- momentum * u + g
                    error_feedback:    v <- v + u;  return v
                    no error feedback: return u
    update:         error_feedback:    v <- v - decompress(payload)
                    factor_masking:    u <- 0 where the payload carries a value

``error_feedback=True, factor_masking=True`` is exactly DGC's memory (``dgc``). With a
magnitude-based sparsifier (``topk``, ``threshold``, ``dgc``) that is the right choice: a
coordinate waits only until it is large. With **random-k** error feedback is the wrong tool:
a coordinate waits a geometric number of steps (mean n/k) whatever its size, so every
coordinate is a stale burst; measured on digits (``docs/benchmarks.md``, recipes;
2 ranks, SGD momentum 0.9 uncompressed: 0.97) random-k 10% with error feedback ends at
0.29-0.75 in every placement of momentum tried (0.80 with no momentum anywhere), while random-k
10% scaled to be unbiased (``randomk`` with ``unbiased=True``, Wangni et al. 2018,
"Gradient Sparsification for Communication-Efficient Distributed Optimization") under this
memory with ``error_feedback=False`` matches uncompressed momentum SGD on digits (not on the
longer 100-class mixture of the same table, where its variance adds up over
3750 steps and ``dgc`` is better): each step applies an
unbiased estimate of the *current* momentum, and the momentum averages random-k's variance
away over ~1/(1-momentum) steps. (The same unbiased random-k with the optimizer's momentum
instead diverged: the optimizer keeps re-applying each n/k-times amplified coordinate.)

Which coordinates were sent comes from the compressor's ``sent_entries(payload, ctx)`` (every
grace_dl sparsifier has it); where that is ``None`` the nonzero entries of the decompressed
payload are taken as sent. Use it with optimizer momentum 0 (the torch ``DistributedOptimizer``
warns otherwise): momentum is applied here.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.compressors import paths
from grace_dl.memory import base
from grace_dl.memory.dgc import DgcMemory
from grace_dl.registry import register_memory
from grace_dl.validate import one_of


@register_memory("momentum")
class MomentumMemory(DgcMemory):
    def __init__(self, momentum: float = 0.9, error_feedback: bool = True,
                 factor_masking: bool = True, gradient_clipping=None):
        super().__init__(momentum=momentum, gradient_clipping=gradient_clipping)
        self.error_feedback = one_of("error_feedback", error_feedback, (False, True))
        self.factor_masking = one_of("factor_masking", factor_masking, (False, True))
        if factor_masking and not error_feedback:
            raise ValueError("factor_masking=True needs error_feedback=True (it masks the "
                             "momentum of what the velocity sent); accepted without error "
                             "feedback: factor_masking=False")

    def compensate(self, tensor, name):
        if self.error_feedback:
            return super().compensate(tensor, name)
        ops = ops_for(tensor)
        tensor = self._clip(ops, tensor)
        momentum = self.state.zeros(f"momentum/{name}", ops, tensor)
        u = ops.read(momentum) * self.momentum + tensor
        ops.assign(momentum, u)
        return u

    def update(self, tensor, name, compressor, payload, ctx, approximation=None):
        if self.error_feedback and self.factor_masking:
            return super().update(tensor, name, compressor, payload, ctx, approximation)
        if self.error_feedback:
            ops = ops_for(tensor)
            ops.assign(self.state.zeros(f"velocity/{name}", ops, tensor),
                       tensor - base.sent(compressor, payload, ctx, approximation))
        self.state.clean(name)      # the momentum too: a NaN/Inf is sent once, never kept

    def _clip(self, ops, tensor):
        if self.gradient_clipping is None:
            return tensor
        norm = ops.norm(ops.cast(tensor, "float32"))
        limit = self.gradient_clipping
        return tensor * ops.cast(limit / ops.maximum(norm, limit + ops.zeros_like(norm)),
                                 ops.dtype(tensor))


@paths.register(MomentumMemory)
class MomentumFeedback(base.Feedback):
    """Without error feedback ``update`` reads no approximation: the communicator need not
    decompress this rank's own payload."""

    def wants_approximation(self, compressor) -> bool:
        return self.memory.error_feedback
