"""``natural``: natural compression, stochastic rounding to a power of two (Horváth et al. 2019,
"Natural Compression for Distributed Deep Learning").

Each element ``v = +-2^p (1 + f)``, ``0 <= f < 1``, becomes ``+-2^p`` with probability
``1 - f`` and ``+-2^(p+1)`` with probability ``f``: unbiased, variance at most ``v^2 / 8``.
The rounding is done on the float32 bits with integer operations only (TensorFlow flushes
subnormal floats to zero, torch does not): adding the dither ``(k + 1/2) 2^-16`` of one exponent
unit (a 16-bit ``k``, ``seeding.dither``) to the magnitude bits carries into the exponent with
probability within ``2^-17`` of ``f`` (a relative bias of at most ``2^-17``; exact zeros and
powers of two never move), and a subnormal rounds to 0 or to the smallest normal power with
the same probabilities.

Wire (tensor of n elements): **8 bits per element**, ``n`` uint8 codes, plus one int32 (4 bytes)
``base``. A code is ``sign << 7 | c``: ``c = 0`` is zero, ``c = 1..125`` is
``2^(base + c - 127)``, ``c = 126`` is NaN and ``c = 127`` is +-inf. The exponent range is thus
clipped per tensor (9 bits, sign + the full 8-bit exponent, would need no base): ``base`` is 0
unless the largest magnitude reaches 2^-2, and then shifts the 125-binade window up to it.
Elements below the window (smaller than about ``2^-124`` times the largest) are shifted into
float32's subnormal range first and rounded from there to 0 or the window's smallest power,
unbiased up to the truncation of mantissa bits beyond the subnormal range (below 2^-23 of that
power) and the dither's 2^-17. A magnitude of 2^127 or more may round up to 2^128, which decodes
as inf.

Not allreduce-safe (codes do not add): gathered. Any 1-D chunk compresses on its own
(two-phase safe). NaN and +-inf elements decode to NaN and +-inf.
"""

from __future__ import annotations

import numpy as np

from grace_dl.backend import ops_for
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.compressors.flat import flat_f32, restore
from grace_dl.registry import register_compressor

# Dither bits: a round-up probability within 2^-17 of the mantissa fraction, i.e. a relative bias
# of at most 2^-17 (seeding.dither); 8 bits would allow 2^-9, more than float16's precision.
_DITHER = 16

_MAG = 0x7FFFFFFF        # float32 bits without the sign
_INF = 0x7F800000        # float32 bits of +inf
_FRAC = 0x007FFFFF       # mantissa field
_ONE = 1 << 23           # one unit of the exponent field (the implicit leading 1)
_NAN_BITS = 0x7FC00000
NAN_CODE, INF_CODE = 126, 127


def _shift_down(ops, mag, base):
    """float32 magnitude bits divided by 2^base (base > 0): exact where the result is normal;
    smaller results become subnormal (mantissa shifted right, bits beyond it truncated)."""
    floor_bits = ops.shift_left(base + 1, 23)
    below = ops.count_nonzero(ops.logical_and(mag > 0, mag < floor_bits))
    return ops.cond(below > 0, lambda: _shift_down_all(ops, mag, base),
                    lambda: _shift_down_normal(ops, mag, base))


def _shift_down_normal(ops, mag, base):
    """``_shift_down`` when every nonzero magnitude stays normal (zeros go negative: clamped)."""
    mag -= ops.shift_left(base, 23)
    return ops.clamp(mag, 0, None)


def _shift_down_all(ops, mag, base):
    e = ops.shift_right(mag, 23)
    lowered = mag - ops.shift_left(base, 23)
    mant = (mag & _FRAC) | ops.shift_left(ops.cast(e > 0, "int32"), 23)
    k = ops.clamp(base + 1 - ops.maximum(e, ops.ones_like(e)), 0, 31)
    return ops.where(e > base, lowered, ops.shift_right(mant, k))


@register_compressor("natural")
class NaturalCompressor(Compressor):
    caps = Capabilities(two_phase_safe=True, unbiased=True)

    def __init__(self, seed: int = 0):
        super().__init__(seed)

    def compress(self, tensor, name, call=LOCAL):
        ops, x, layout = flat_f32(tensor)
        n = layout.numel
        k = ops.dither(self.seed, name, self.next_step(name, tensor), n, _DITHER, like=x,
                       stream=call.rank)
        bits = ops.bitcast(x, "int32")
        # The exponent of the largest magnitude: 255 when some element is inf or NaN.
        top = ops.shift_right(ops.bitcast(ops.abs_max(x), "int32") & _MAG, 23) if n else \
            ops.zeros((), "int32", like=x)
        base = ops.maximum(top - 124, ops.zeros((), "int32", like=x))
        special = top >= 255  # else every code is at most 125: no clamp, no NaN to replace
        nan_code = ops.full((), NAN_CODE, "int32", like=x)
        base8 = ops.cast(base, "uint8")
        one8 = ops.full((), 1, "uint8", like=x)

        def dither(kc):
            # The carry into the exponent is the stochastic round-up: the dither (k + 1/2) 2^-b
            # of one unit of the exponent field, i.e. 23 - b bits up, plus half a grid step.
            d = ops.shift_left(ops.cast(kc, "int32"), 23 - _DITHER)
            d += 1 << (22 - _DITHER)
            return d

        def exact(bc, kc):  # any input: subnormal shifts, inf and NaN codes
            mag = bc & _MAG
            mag = ops.cond(base > 0, lambda: _shift_down(ops, mag, base), lambda: mag)
            mag += dither(kc)
            # Finite magnitudes give 0..125; inf 255 - base or more (clamped to its code); NaN
            # anything (replaced).
            c = ops.clamp(ops.shift_right(mag, 23), None, INF_CODE)
            c = ops.where((bc & _MAG) > _INF, nan_code, c)
            c |= ops.shift_right(bc, 24) & 0x80  # the sign bit, as bit 7
            return ops.cast(c, "uint8")

        def shifted(bc, kc, t, c):
            # Down by base: zeros stay 0. A nonzero exponent <= base (rounded: 1..base) needs
            # the subnormal shift of ``exact``; an exponent 0 that did not round up gives 0
            # there too.
            hit = ops.min(c - one8) < base8  # (uint8: a 0 wraps to 255)
            return ops.cond(hit, lambda: exact(bc, kc),
                            lambda: (ops.maximum(c, base8) - base8) | sign(t))

        def sign(t):
            return ops.cast(ops.shift_right(t, 1), "uint8") & 0x80

        def fast(bc, kc):  # all finite: the same codes in fewer passes
            y = dither(kc)
            y += bc  # on the signed bits: a finite element's carry stops below the sign bit
            t = ops.shift_right(y, 23)  # low byte: the rounded exponent; bit 8: the sign
            c = ops.cast(t, "uint8")
            return ops.cond(base > 0, lambda: shifted(bc, kc, t, c), lambda: c | sign(t))

        def codes(bc, kc):
            return ops.cond(special, lambda: exact(bc, kc), lambda: fast(bc, kc))

        return [ops.blockwise(codes, bits, k), ops.reshape(base, (1,))], layout

    def decompress(self, payload, ctx):
        codes, base = payload
        ops = ops_for(codes)
        c = ops.from_numpy(np.arange(128, dtype=np.int32), like=codes)
        power = ops.shift_left(ops.clamp(c + base, 0, 255), 23)
        power = ops.where(c == 0, 0, ops.where(c == NAN_CODE, _NAN_BITS, power))
        power = ops.bitcast(ops.where(c == INF_CODE, _INF, power), "float32")
        table = ops.cat([power, -power])
        return restore(ops, ops.unpack_lookup(codes, 8, ctx.numel, table), ctx)

    def payload_nbytes(self, numel, dtype="float32"):
        return numel + 4
