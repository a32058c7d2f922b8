"""``u8bit``: 8-bit dictionary codes with one scaler per tensor (Dettmers 2016, "8-Bit
Approximations for Parallelism in Deep Learning", the *dynamic tree* data type).

Elements are divided by ``m = max|v|`` and rounded to the nearest of 128 magnitudes in [0, 1]:
zero, and for each decade ``10^-e`` (e = 0..6) the ``2^(6-e)`` points
``10^-e (0.1 + 0.9 k / 2^(6-e))``, k = 1..2^(6-e) (the tree's leading zeros give the decade,
the bits after the indicator bit a linear fraction). Relative precision is thus ~1/64 of the
largest element near it and coarser, but never zero, down to 1e-6 of it. Deterministic
round-to-nearest: biased (use with error feedback).

Wire (tensor of n elements): ``n`` uint8 codes (``sign << 7 | index``), 8 bits per element,
plus the scaler ``m`` as one float32 (4 bytes). Not allreduce-safe (own scaler per rank):
gathered. Any 1-D chunk compresses on its own (two-phase safe). A NaN or Inf makes ``m``
non-finite and the whole tensor decodes to NaN.
"""

from __future__ import annotations

import numpy as np

from grace_dl.backend import ops_for
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.compressors.flat import flat_f32, restore
from grace_dl.registry import register_compressor


def dynamic_tree(magnitude_bits: int = 7) -> np.ndarray:
    """The ``2**magnitude_bits`` sorted magnitudes of the dynamic tree type, float32."""
    values = [0.0]
    for e in range(magnitude_bits - 1, -1, -1):
        r = magnitude_bits - 1 - e
        k = np.arange(1, 2**r + 1)
        values.extend(10.0**-e * (0.1 + 0.9 * k / 2**r))
    return np.asarray(values, np.float32)


_TABLE = dynamic_tree()
_MIDPOINTS = ((_TABLE[1:].astype(np.float64) + _TABLE[:-1]) / 2).astype(np.float32)

# Nearest-value search without a binary search: the top 14 bits of a non-negative float32
# (exponent and 6 mantissa bits) name a cell, and no cell holds more than one midpoint (the
# table's finest spacing, 0.9/64 near 1, is wider than any cell up to 1). Per cell: the index
# of the table value nearest its low end, and the midpoint above which the next one is nearest
# (inf when there is none in the cell). Encoding is then two table gathers and one comparison.
_CELL_SHIFT = 17


def _cell_tables():
    cells = np.arange(1 << (32 - _CELL_SHIFT - 1), dtype=np.int64)
    low = (cells << _CELL_SHIFT).astype(np.uint32).view(np.float32)
    high = (((cells + 1) << _CELL_SHIFT) - 1).astype(np.uint32).view(np.float32)
    first = np.searchsorted(_MIDPOINTS, low, side="right")
    last = np.searchsorted(_MIDPOINTS, high, side="right")
    finite = np.isfinite(high)
    assert np.all((last - first)[finite] <= 1)
    split = np.where(last > first, _MIDPOINTS[np.minimum(first, len(_MIDPOINTS) - 1)], np.inf)
    return first.astype(np.uint8), split.astype(np.float32)


_CELL_INDEX, _CELL_SPLIT = _cell_tables()


@register_compressor("u8bit")
class U8bitCompressor(Compressor):
    caps = Capabilities(two_phase_safe=True)

    def __init__(self):
        super().__init__()

    def compress(self, tensor, name, call=LOCAL):
        ops, x, layout = flat_f32(tensor)
        if layout.numel == 0:
            scaler = ops.zeros((1,), "float32", like=x)
        else:
            # max|x| without building |x|; "+ 0 * sum" makes it NaN when any x is NaN/Inf.
            scaler = ops.reshape(ops.maximum(ops.max(x), -ops.min(x)) + 0.0 * ops.sum(x), (1,))
        inv = ops.where(scaler > 0, 1.0 / scaler, ops.zeros_like(scaler))
        v = ops.abs(x)
        v *= inv
        cell = ops.shift_right(ops.bitcast(v, "int32"), _CELL_SHIFT)
        cell &= (1 << (32 - _CELL_SHIFT - 1)) - 1  # a NaN may carry a sign: keep it in range
        code = ops.gather(ops.from_numpy(_CELL_INDEX, like=x), cell)
        code += ops.cast(v >= ops.gather(ops.from_numpy(_CELL_SPLIT, like=x), cell), "uint8")
        code |= ops.shift_left(ops.cast(ops.bitcast(x, "int32") < 0, "uint8"), 7)
        return [code, scaler], layout

    def decompress(self, payload, ctx):
        codes, scaler = payload
        ops = ops_for(codes)
        table = ops.from_numpy(np.concatenate([_TABLE, -_TABLE]), like=codes) * scaler
        return restore(ops, ops.unpack_lookup(codes, 8, ctx.numel, table), ctx)

    def payload_nbytes(self, numel, dtype="float32"):
        return numel + 4
