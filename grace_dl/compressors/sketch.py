"""``sketch``: quantile-bucket quantization (Jiang et al. 2018, "SketchML: Accelerating
Distributed Machine Learning with Data Sketches", its quantile-bucket step).

The values are split at ``quantiles - 1`` quantiles of their distribution into ``quantiles``
buckets of (about) equal population; each element is sent as its bucket index and decoded as
its bucket's mean. The quantiles are exact for tensors up to ``sample_size`` elements and
otherwise taken from a seeded sample of ``sample_size`` elements (SketchML uses a streaming
quantile sketch for the same purpose). Deterministic given the sample; biased per element, but
each bucket's sum, hence the tensor's sum, is kept exactly (to float rounding). The mapping is
monotone: larger inputs never decode smaller.

Wire (tensor of n elements, q = ``quantiles``): bucket indices at ``ceil(log2 q)`` bits each,
packed into ``ceil(n * ceil(log2 q) / 8)`` uint8, plus the q bucket means as float32
(``4 q`` bytes). Not allreduce-safe (each rank has its own buckets): gathered. Any 1-D chunk
compresses on its own (two-phase safe). NaN/Inf elements fall in an edge bucket and make its
mean non-finite.
"""

from __future__ import annotations

import numpy as np

from grace_dl.backend import ops_for
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.compressors.binning import bucketize
from grace_dl.compressors.flat import bits_for, flat_f32, pack, restore, unpack
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range


@register_compressor("sketch")
class SketchCompressor(Compressor):
    caps = Capabilities(two_phase_safe=True)

    def __init__(self, quantiles: int = 64, sample_size: int = 16384, seed: int = 0):
        super().__init__(seed)
        self.quantiles = in_range("quantiles", quantiles, 2, 256, kind=int)
        self.sample_size = in_range("sample_size", sample_size, 2, None, kind=int)
        self._bits = bits_for(self.quantiles)

    def _edges(self, ops, x, n, name, step):
        """The ``quantiles - 1`` inner quantiles of ``x`` (linear interpolation)."""
        if n > self.sample_size:
            idx = ops.choice(self.seed, name, step, n, self.sample_size, like=x)
            x, n = ops.gather(x, idx), self.sample_size
        ranked = ops.sort(x)
        pos = np.arange(1, self.quantiles) * (n - 1) / self.quantiles
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, n - 1)
        w = ops.from_numpy((pos - lo).astype(np.float32), like=x)
        below = ops.gather(ranked, ops.from_numpy(lo, like=x))
        above = ops.gather(ranked, ops.from_numpy(hi, like=x))
        return below + (above - below) * w

    def compress(self, tensor, name, call=LOCAL):
        ops, x, layout = flat_f32(tensor)
        n, q = layout.numel, self.quantiles
        step = self.next_step(name, tensor)
        if n == 0:
            return [pack(ops, ops.zeros((0,), "uint8", like=x), self._bits),
                    ops.zeros((q,), "float32", like=x)], layout
        bucket = bucketize(ops, x, self._edges(ops, x, n, name, step))
        sums = ops.scatter_add(bucket, x, q)
        counts = ops.bincount(bucket, q)
        means = ops.where(counts > 0, sums / ops.maximum(counts, ops.ones_like(counts)),
                          ops.zeros_like(sums))
        return [pack(ops, ops.cast(bucket, "uint8"), self._bits), means], layout

    def decompress(self, payload, ctx):
        packed, means = payload
        ops = ops_for(packed)
        bucket = ops.cast(unpack(ops, packed, self._bits, ctx.numel), "int32")
        return restore(ops, ops.gather(means, bucket), ctx)

    def payload_nbytes(self, numel, dtype="float32"):
        return -(-numel * self._bits // 8) + 4 * self.quantiles
