"""``terngrad``: stochastic ternary gradients with one scaler per tensor (Wen et al. 2017,
"TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning").

With ``m = max|v|`` over the tensor, each element becomes ``m * b_i``, ``b_i`` in {-1, 0, 1},
``b_i = sign(v_i)`` with probability ``|v_i| / m`` and 0 otherwise: unbiased. The dither has 16
random bits per element, so that probability is exact within ``2^-17`` (``seeding.dither``): a
bias of at most ``m / 131072`` per element. (The paper's optional 2.5-sigma gradient clipping is
left to the training script.)

Wire (tensor of n elements): codes ``b_i + 1`` at 2 bits each, packed into ``ceil(n / 4)``
uint8, plus the scaler ``m`` as one float32 (4 bytes). Not allreduce-safe (each rank has its
own scaler): gathered. Any 1-D chunk compresses on its own (two-phase safe).

An all-zero tensor sends m = 0 and decodes to zeros; a NaN or Inf anywhere makes m non-finite
and the whole tensor decodes to NaN.
"""

from __future__ import annotations

import numpy as np

from grace_dl.backend import ops_for
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.compressors.flat import add_dither, dither_bits, flat_f32, restore
from grace_dl.registry import register_compressor

_DITHER = dither_bits(1)  # one step per max|v|: 16 bits, bias <= max|v| / 2**17


@register_compressor("terngrad")
class TernGradCompressor(Compressor):
    caps = Capabilities(two_phase_safe=True, unbiased=True)

    def __init__(self, seed: int = 0):
        super().__init__(seed)

    def compress(self, tensor, name, call=LOCAL):
        ops, x, layout = flat_f32(tensor)
        n = layout.numel
        k = ops.dither(self.seed, name, self.next_step(name, tensor), n, _DITHER, like=x,
                       stream=call.rank)
        if n == 0:
            scaler = ops.zeros((1,), "float32", like=x)
        else:
            scaler = ops.reshape(ops.abs_max(x), (1,))  # NaN if any x is NaN/Inf
        inv = ops.where(scaler > 0, 1.0 / scaler, ops.zeros_like(scaler))

        def ternary(xc, kc):
            # floor(v/m + u) is in {-1, 0, 1} with E = v/m; + 1 makes a 2-bit code.
            t = add_dither(ops, xc * inv, kc, _DITHER, 1.0)
            return ops.pack_bits(ops.clamp(ops.cast(t, "uint8"), None, 2), 2)

        return [ops.blockwise(ternary, x, k), scaler], layout

    def decompress(self, payload, ctx):
        packed, scaler = payload
        ops = ops_for(packed)
        # Code c decodes to (c - 1) * m (code 3 is never sent).
        table = (ops.from_numpy(np.arange(4, dtype=np.float32), like=packed) - 1.0) * scaler
        return restore(ops, ops.unpack_lookup(packed, 2, ctx.numel, table), ctx)

    def payload_nbytes(self, numel, dtype="float32"):
        return -(-numel // 4) + 4
