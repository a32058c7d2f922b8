"""``adaq``: adaptive sparse ternary quantization (Dryden et al. 2016, "Communication
Quantization for Data-Parallel Training of Deep Neural Networks", MLHPC; the ``AdaqCompressor``
of GRACE's TensorFlow library).

Positive and negative entries are treated apart: of the ``p`` positive entries the
``max(1, ceil(compress_ratio * p))`` largest are kept and all replaced by their mean ``mu+``;
likewise the most negative ``ceil(compress_ratio * q)`` of the ``q`` negative entries, replaced by
their mean ``mu-``. Everything else decompresses to 0. GRACE hunted for a threshold giving
between 0.8x and 1.25x that count; this takes the exact count (ties to the lowest positions),
found for tensors of ``sparse.APPROX_MIN_NUMEL`` elements or more by topk's sampled-threshold
fast path (seeded by ``(seed, name, step)``; the draw changes the time, never the result).

Wire: ``[means, codes]`` -- ``means`` is ``(mu+, mu-)`` in the input dtype (2 values) and
``codes`` one int32 per kept entry: its flat position ``i`` if positive, ``-1 - i`` if negative
(so no count or sign bits travel separately). ``2 * itemsize + 4 * c`` bytes with c depending on
the signs of the data (``payload_nbytes`` is None, ``equal_sizes`` False: gather the payloads).
Biased; not allreduce-safe. Zeros and NaN are never kept; an infinite entry makes its side's mean
infinite.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.compressors import sparse
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range


@register_compressor("adaq")
class AdaqCompressor(Compressor):
    # NaN is never kept: the communicator marks the means
    caps = Capabilities(equal_sizes=False, drops_nonfinite=True)

    def __init__(self, compress_ratio: float = 0.01, seed: int = 0):
        super().__init__(seed)
        self.compress_ratio = in_range("compress_ratio", compress_ratio, 0.0, 1.0, lo_open=True)

    def _side(self, ops, flat, sign, name, step, select=sparse.REFERENCE):
        """Kept positions of the largest entries of sign ``sign`` and their mean."""
        n = ops.numel(flat)
        count = ops.cast(ops.sum(ops.cast(flat > 0 if sign > 0 else flat < 0, "int64")), "float64")
        k = sparse.ceil_count(ops, count * self.compress_ratio, n)
        if step is None:
            top = sparse.top_of(ops, sparse.magnitudes(ops, flat, sign), k, select)
        else:
            top = sparse.approx_top(ops, flat, k, self.seed, name, step, sign, select)
        kept = ops.gather(flat, top)
        top = ops.gather(top, ops.nonzero(kept > 0 if sign > 0 else kept < 0))
        values = ops.cast(ops.gather(flat, top), "float64")
        mean = ops.sum(values) / ops.clamp(ops.sum(ops.ones_like(values)), 1.0)
        return top, ops.cast(mean, ops.dtype(flat))

    def compress(self, tensor, name, call=LOCAL):
        return self._compress(tensor, name)

    def _compress(self, tensor, name, select=sparse.REFERENCE):
        """``compress``, its positions found by ``select`` (``sparse.Selection``)."""
        ops = ops_for(tensor)
        n = ops.numel(tensor)
        sparse.check_numel(n, "adaq")
        flat = ops.flatten(tensor)
        ctx = (ops.shape(tensor), n)
        if n == 0:
            return [ops.zeros(2, ops.dtype(flat), like=flat), ops.cast(flat, "int32")], ctx
        step = self.next_step(name, tensor) if n >= sparse.APPROX_MIN_NUMEL else None
        plus, mu_plus = self._side(ops, flat, 1, name, step, select)
        minus, mu_minus = self._side(ops, flat, -1, name, step, select)
        codes = ops.cat([plus, -1 - minus])
        return [ops.stack([mu_plus, mu_minus]), ops.cast(codes, "int32")], ctx

    def decompress(self, payload, ctx):
        means, codes = payload
        shape, n = ctx
        ops = ops_for(means)
        negative = codes < 0
        positions = ops.where(negative, -1 - codes, codes)
        values = ops.gather(means, ops.cast(negative, "int64"))
        return ops.reshape(ops.scatter(positions, values, n), shape)

    def sent_entries(self, payload, ctx):
        means, codes = payload
        ops = ops_for(codes)
        negative = codes < 0
        return (ops.where(negative, -1 - codes, codes),
                ops.gather(means, ops.cast(negative, "int64")))
