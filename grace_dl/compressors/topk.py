"""``topk``: send the ``k = max(1, ceil(compress_ratio * n))`` entries of largest magnitude
(Aji & Heafield 2017, "Sparse Communication for Distributed Gradient Descent"; Stich et al.
2018, "Sparsified SGD with Memory").

Wire: k values in the input dtype + k int32 flat positions, i.e. ``k * (itemsize + 4)`` bytes
(for fp32 and ratio r: 64 * r bits per element). Biased (use it with ``residual`` memory);
not allreduce-safe (ranks keep different positions: gather them); equal sizes on every rank.

Which entries: the k largest ``|x|``; ties at the k-th magnitude go to the lowest positions,
``+-inf`` counts as the largest magnitude, NaN as the smallest (kept only if fewer than k
numbers exist). torch and TensorFlow pick the same entries.

``approximate=True`` (the default) finds the *same* k entries faster, the way DGC (Lin et al.
2018) estimates its threshold: a seeded sample of the tensor gives a threshold just below the
k-th magnitude, a cheap pass keeps the entries above it, and an exact top-k over those few picks
the k. When the estimate overshoots (rare: it is padded by four standard deviations) the exact
path runs, so the draw never changes the result, only the time. Tensors under
``sparse.APPROX_MIN_NUMEL`` elements always take the exact path.
"""

from __future__ import annotations

from grace_dl.compressors import paths, sparse
from grace_dl.compressors.base import Capabilities
from grace_dl.compressors.sparse import SparseCompressor
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range, one_of


@register_compressor("topk")
class TopKCompressor(SparseCompressor):
    caps = Capabilities(sparse=True)

    def __init__(self, compress_ratio: float = 0.01, approximate: bool = True, seed: int = 0):
        super().__init__(seed)
        self.compress_ratio = in_range("compress_ratio", compress_ratio, 0.0, 1.0, lo_open=True)
        self.approximate = one_of("approximate", approximate, (False, True))

    def _positions(self, ops, tensor, flat, n, name, select):
        k = sparse.count_for(self.compress_ratio, n)
        if self.approximate and n >= sparse.APPROX_MIN_NUMEL and k < n:
            step = self.next_step(name, tensor)
            return sparse.approx_top(ops, flat, k, self.seed, name, step, select=select)
        return sparse.exact_top(ops, flat, k, select=select)

    def payload_nbytes(self, numel, dtype="float32"):
        return sparse.count_for(self.compress_ratio, numel) * (sparse.itemsize(dtype) + 4)


paths.register(TopKCompressor)(sparse.SparsePath)
