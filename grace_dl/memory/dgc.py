"""``dgc`` memory: momentum correction, factor masking and local gradient clipping of Deep
Gradient Compression (Lin et al. 2018, "Deep Gradient Compression: Reducing the Communication
Bandwidth for Distributed Training", sections 3.2-3.3).

Per tensor it keeps a momentum ``u`` and an accumulated velocity ``v``:

    compensate(g):  g <- g * min(1, gradient_clipping / ||g||_2)     (if clipping is on)
                    u <- momentum * u + g
                    v <- v + u;  return v
    update:         v <- v - decompress(payload)                      (what was not sent stays)
                    u <- 0 at the positions the payload carries        (factor masking)

Momentum is applied here, before sparsification, so the optimizer should run plain SGD
(momentum 0) when this memory is used. Clipping is by L2 norm of the local gradient, before it
enters the momentum (the paper's local clipping; pass the global max-norm scaled by
``N ** -0.5`` for N ranks to match it). Positions come from the compressor's
``sent_entries(payload, ctx)`` (every grace_dl sparsifier has it); where that is ``None`` the
nonzero entries of the decompressed payload are taken as sent. A NaN or infinite gradient norm
makes the clipped gradient NaN. After each update the non-finite entries of ``u`` and ``v`` are
set to 0 (``grace_dl.memory.base``): a NaN/Inf is sent in its own step, not kept for later ones.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.memory import base
from grace_dl.registry import register_memory
from grace_dl.validate import in_range


@register_memory("dgc")
class DgcMemory(base.Memory):
    def __init__(self, momentum: float = 0.9, gradient_clipping=None):
        super().__init__()
        self.state.accumulates = ("momentum/", "velocity/")
        self.momentum = in_range("momentum", momentum, 0.0, 1.0, hi_open=True)
        if gradient_clipping is None or gradient_clipping is False:
            self.gradient_clipping = None
        elif gradient_clipping is True:
            raise ValueError("gradient_clipping must be None/False (off) or the maximum L2 norm "
                             "of a gradient as a positive number, got True")
        else:
            self.gradient_clipping = in_range("gradient_clipping", gradient_clipping, 0.0, None,
                                              lo_open=True)

    def compensate(self, tensor, name):
        ops = ops_for(tensor)
        if self.gradient_clipping is not None:
            norm = ops.norm(ops.cast(tensor, "float32"))
            limit = self.gradient_clipping
            tensor = tensor * ops.cast(limit / ops.maximum(norm, limit + ops.zeros_like(norm)),
                                       ops.dtype(tensor))
        momentum = self.state.zeros(f"momentum/{name}", ops, tensor)
        velocity = self.state.zeros(f"velocity/{name}", ops, tensor)
        u = ops.read(momentum) * self.momentum + tensor
        ops.assign(momentum, u)
        v = ops.read(velocity) + u
        ops.assign(velocity, v)
        return v

    def update(self, tensor, name, compressor, payload, ctx, approximation=None):
        ops = ops_for(tensor)
        approximation = base.sent(compressor, payload, ctx, approximation)
        ops.assign(self.state.zeros(f"velocity/{name}", ops, tensor), tensor - approximation)
        n = ops.numel(tensor)
        entries = compressor.sent_entries(payload, ctx)
        if entries is None:     # a dense payload: what it carries is where it is nonzero
            kept = ops.reshape(ops.flatten(approximation) == 0, ops.shape(tensor))
        else:
            positions = entries[0]
            hit = ops.scatter(positions, ops.ones_like(ops.cast(positions, "float32")), n)
            kept = ops.reshape(hit == 0, ops.shape(tensor))
        momentum = self.state.zeros(f"momentum/{name}", ops, tensor)
        u = ops.read(momentum)
        ops.assign(momentum, ops.where(kept, u, ops.zeros_like(u)))
        self.state.clean(name)
