"""``natural``: natural compression, stochastic rounding to a power of two (Horváth et al. 2019,
"Natural Compression for Distributed Deep Learning").

Each element ``v = +-2^p (1 + f)``, ``0 <= f < 1``, becomes ``+-2^p`` with probability
``1 - f`` and ``+-2^(p+1)`` with probability ``f``: unbiased, variance at most ``1/8 v^2``.
The rounding is done on the float32 bits: adding a uniform 23-bit integer to the magnitude bits
carries into the exponent with probability exactly ``f`` (subnormals round to 0 or 2^-126 with
the right probabilities as well).

Wire (tensor of n elements): **8 bits per element**, ``n`` uint8 codes, plus one int32 (4 bytes)
``base``. A code is ``sign << 7 | c``: ``c = 0`` is zero, ``c = 1..126`` is ``2^(base + c - 127)``
(the 126 binades at and below the tensor's largest rounded magnitude), ``c = 127`` is +-inf
and ``0x80`` is NaN. The exponent range is thus clipped per tensor, not globally: an element
below the window (smaller than ``2^-125`` times the largest) is rounded to 0 or to the
window's smallest power, again with the unbiased probabilities, so nothing is lost to the
clipping but variance on values a float32 sum with the largest element could not resolve
anyway. (9 bits, sign + the full 8-bit exponent, would need no base.) A magnitude of 2^127 or
more may round up to 2^128, which decodes as inf.

Not allreduce-safe (codes do not add): gathered. Any 1-D chunk compresses on its own
(two-phase safe). NaN and +-inf elements decode to NaN and +-inf.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.compressors.base import Compressor
from grace_dl.compressors.flat import flat_f32, restore
from grace_dl.registry import register_compressor

_MAG = 0x7FFFFFFF        # float32 bits without the sign
_INF = 0x7F800000        # float32 bits of +inf (exponent all ones)
_MANT = 1 << 23          # one unit of the float32 exponent field


@register_compressor("natural")
class NaturalCompressor(Compressor):
    unbiased = True
    two_phase_safe = True

    def __init__(self, seed: int = 0):
        super().__init__(seed)

    def compress(self, tensor, name):
        ops, x, layout = flat_f32(tensor)
        n = layout.numel
        u = ops.uniform(self.seed, name, self.next_step(name, tensor), n, like=x)
        bits = ops.bitcast(x, "int32")
        mag = bits & _MAG
        # Window: biased exponents base+1 .. base+126, topped by the largest possible rounding.
        top = ops.shift_right(ops.max(mag), 23) if n else ops.zeros((), "int32", like=x)
        base = ops.maximum(top - 125, ops.zeros_like(top))
        floor_bits = ops.shift_left(base + 1, 23)

        # Below the window: 2^(base+1-127) with probability |v| / 2^(base+1-127), else 0.
        below = mag < floor_bits
        rel = ops.bitcast(mag, "float32") * ops.exp2(ops.cast(126 - base, "float32"))
        below_up = ops.cast(u < rel, "int32")
        nonfinite = mag >= _INF
        isnan = mag > _INF

        u *= float(_MANT)
        mag += ops.cast(u, "int32")          # the carry is the stochastic round-up
        c = ops.shift_right(mag, 23) - base
        c = ops.where(below, below_up, c)
        c = ops.where(nonfinite, 127, c)
        sign = ops.shift_right(bits, 24) & 0x80
        c = ops.where(c == 0, c, c | sign)  # -0 is sent as 0: 0x80 means NaN
        c = ops.where(isnan, 0x80, c)
        return [ops.cast(c, "uint8"), ops.reshape(base, (1,))], layout

    def decompress(self, payload, ctx):
        codes, base = payload
        ops = ops_for(codes)
        c = ops.cast(codes, "int32")
        e = c & 0x7F
        # Biased float32 exponent base + e for e = 1..126 (255 and beyond: inf); e = 0: zero.
        e = ops.where(e > 0, ops.clamp(e + base, None, 255), e)
        e = ops.where(e == 127 + base, 255, e)
        out = ops.shift_left(e, 23) | ops.shift_left(c & 0x80, 24)
        out = ops.where(c == 0x80, 0x7FC00000, out)
        return restore(ops, ops.bitcast(out, "float32"), ctx)

    def payload_nbytes(self, numel, dtype="float32"):
        return numel + 4
