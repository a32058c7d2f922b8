"""``inceptionn``: error-bounded lossy compression of float gradients (Li et al. 2018, "A
Network-Centric Hardware/Algorithm Co-Design to Accelerate Distributed Training of Deep
Neural Networks", INCEPTIONN, MICRO'18).

As in the paper, every element gets a 2-bit tag choosing one of four encodings, so that the
absolute error never exceeds ``error_bound``:

  ====  =====================================  ===========================
  tag   element                                 sent
  ====  =====================================  ===========================
  0     ``|v| < d``                             nothing (decodes to 0)
  1     ``d <= |v| < 2^7 d``                    int8: sign and 7-bit ``q``
  2     ``2^7 d <= |v| < 2^15 d``               int16: sign and 15-bit ``q``
  3     larger, or NaN/Inf                      the value itself, input dtype
  ====  =====================================  ===========================

where ``d = 2^floor(log2(error_bound))`` and ``q = floor(|v| / d)``: the paper's fixed-point
truncation of the value below its binary point, at the precision the error bound asks for
(|v - q d| < d <= error_bound). The paper keeps values >= 1 uncompressed and places its 8- and
16-bit windows by exponent; here the windows follow from ``d`` alone, so a value is
uncompressed only when 16 bits cannot hold it at that precision (with the default 2^-10,
|v| >= 32). The paper's hardware packs the variable-width values into one bit stream; here
each width is its own tensor.

Wire (tensor of n elements; n1, n2, n3 elements with tags 1, 2, 3, data dependent):
``ceil(n / 4)`` uint8 of packed tags + ``n1`` int8 + ``n2`` int16 + ``n3`` values in the
input's dtype: ``ceil(n/4) + n1 + 2 n2 + w n3`` bytes (w = 4 for fp32). Sizes differ between
ranks (``equal_sizes`` False); not allreduce-safe: gathered. Deterministic, biased towards zero
(truncation). Any 1-D chunk compresses on its own (two-phase safe).
"""

from __future__ import annotations

import math

from grace_dl.backend import ops_for
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.compressors.flat import flat_f32, restore
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range


@register_compressor("inceptionn")
class InceptionnCompressor(Compressor):
    caps = Capabilities(equal_sizes=False, two_phase_safe=True)

    def __init__(self, error_bound: float = 2.0**-10):
        super().__init__()
        # Below 2^-120 the fixed-point step's 2^15 multiples would underflow float32 ranges.
        self.error_bound = in_range("error_bound", error_bound, 2.0**-120, 1.0)
        self._step = 2.0 ** math.floor(math.log2(self.error_bound))

    def compress(self, tensor, name, call=LOCAL):
        ops, x, layout = flat_f32(tensor)
        d = self._step
        # q = |v| / d, exact (d is a power of two); NaN stays NaN and fails every "<" below.
        q = ops.abs(x)
        q *= 1.0 / d
        t0 = q < 1.0
        t1 = q < 128.0
        t2 = q < 32768.0
        tag = ops.cast(~t0, "uint8")
        tag += ops.cast(~t1, "uint8")
        tag += ops.cast(~t2, "uint8")
        # Casting v / d to an integer truncates towards zero: sign(v) * floor(|v| / d).
        i1 = ops.nonzero(ops.logical_and(t1, ~t0))
        i2 = ops.nonzero(ops.logical_and(t2, ~t1))
        v1 = ops.cast(ops.gather(x, i1) * (1.0 / d), "int8")
        v2 = ops.cast(ops.gather(x, i2) * (1.0 / d), "int16")
        v3 = ops.gather(ops.flatten(tensor), ops.nonzero(~t2))
        return [ops.pack_bits(tag, 2), v1, v2, v3], layout

    def decompress(self, payload, ctx):
        packed, v1, v2, v3 = payload
        ops = ops_for(packed)
        n, d = ctx.numel, self._step
        tag = ops.unpack_bits(packed, 2, n)
        out = ops.scatter(ops.nonzero(tag == 1), ops.cast(v1, "float32") * d, n)
        out += ops.scatter(ops.nonzero(tag == 2), ops.cast(v2, "float32") * d, n)
        out = restore(ops, out, ctx)
        raw = ops.scatter(ops.nonzero(tag == 3), v3, n)
        return out + ops.reshape(raw, ctx.shape)

    def payload_nbytes(self, numel, dtype="float32"):
        return None  # ceil(n/4) + n1 + 2 n2 + w n3: depends on the values (see the docstring)
