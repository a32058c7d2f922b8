"""``efsignsgd``: scaled sign for error feedback (Karimireddy, Rebjock, Stich, Jaggi 2019,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", Algorithm 1, EF-SIGNSGD).

The paper's step, with step size ``lr``, written once for torch and TF:

    p_t     = lr * g_t + e_t                 memory ``efsignsgd``: compensate
    Delta_t = (||p_t||_1 / d) * sign(p_t)    this compressor: what a rank sends
    x_t+1   = x_t - mean over ranks of Delta_t
    e_t+1   = p_t - Delta_t                  memory ``efsignsgd``: update (what it stores)

The compressor's input is ``p_t``, already in parameter units (lr applied). ``decompress`` gives
``Delta_t`` in those units (the memory subtracts it from ``p_t``). ``aggregate`` sums the ranks'
``Delta_t`` and divides by ``lr``, and the communicator divides by the number of ranks, so the
optimizer receives ``mean(Delta_t) / lr``: a gradient-like tensor that plain SGD with the same
``lr`` turns back into exactly the paper's update ``x -= mean(Delta_t)``. Hence: pair it with
memory ``efsignsgd`` of the same ``lr`` (``grace_from_params`` hands ``lr`` to both; the memory
refuses a compressor whose ``lr`` differs). With another memory the aggregate is ``1/lr`` times
too large.

For a fixed ``lr`` shared by both, its value cancels: with ``e = lr * e'`` every step above is
``lr`` times the same step in gradient units, and the aggregate divides it out again. So ``lr``
only sets the units the memory stores ``e`` in, and results are the same (up to rounding) for
every ``lr``; the default 1.0 stores it in gradient units, the optimizer's lr gives the paper's
parameter units.

Wire, for ``n`` elements: ``ceil(n/8)`` uint8 of packed signs (1 bit/element, zero counts as
positive, see ``signbits``) and a 1-element float32 scale ``||p||_1 / n`` (computed in float32,
float64 for float64 input): ``ceil(n/8) + 4`` bytes, whatever the input dtype. A NaN or Inf input
makes the scale non-finite, and the decoded tensor with it.

Biased (error feedback makes up for it), not allreduce-safe (per-rank scales), equal sizes,
two-phase safe (a chunk is scaled by its own L1 mean, which is the same compressor on a
smaller vector).
"""

from __future__ import annotations

import math

from grace_dl.backend import ops_for
from grace_dl.compressors import signbits
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range


@register_compressor("efsignsgd")
class EFSignSGDCompressor(Compressor):
    caps = Capabilities(two_phase_safe=True)

    def __init__(self, lr: float = 1.0):
        super().__init__()
        self.lr = in_range("lr", lr, 0.0, None, lo_open=True)

    def compress(self, tensor, name, call=LOCAL):
        ops = ops_for(tensor)
        flat = ops.flatten(tensor)
        scale = ops.abs_sum(signbits.wide(ops, flat)) / max(ops.numel(flat), 1)
        payload = [signbits.encode(ops, flat), ops.reshape(ops.cast(scale, "float32"), [1])]
        return payload, (ops.shape(tensor), ops.dtype(tensor))

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        bits, scale = payload
        ops = ops_for(bits)
        table = ops.cat([scale, scale * -1.0])
        return ops.reshape(signbits.decode(ops, bits, math.prod(shape), table, dtype), shape)

    def aggregate(self, tensors):
        """The ranks' ``Delta_t`` summed, divided by ``lr`` (back to gradient units)."""
        return super().aggregate(tensors) / self.lr

    def payload_nbytes(self, numel, dtype="float32"):
        """``ceil(numel / 8)`` bytes of signs + 1 float32 scale."""
        return math.ceil(numel / 8) + 4
