"""``dgc``: Deep Gradient Compression's sparsifier (Lin et al. 2018, "Deep Gradient
Compression: Reducing the Communication Bandwidth for Distributed Training").

A threshold is estimated from a seeded sample of the tensor (``s = sparse.sample_size(n)``
distinct positions keyed by ``(seed, name, step)``; on a GPU the keyed stream's first ``s``
draws, with replacement: about ``s / 2n`` of them repeat an earlier one): the
``ceil(ratio * s)``-th largest sampled magnitude. Entries with ``|x| >= threshold`` are sent; if
there are more than ``k = max(1, ceil(ratio * n))`` of them, the k largest (DGC's hierarchical
top-k). Tensors under ``sparse.APPROX_MIN_NUMEL`` elements use the exact k-th magnitude instead,
so they send exactly k.

``warmup_steps`` (default 0) ramps the ratio exponentially from dense to ``compress_ratio``, as
the paper's warm-up (75%, 93.75%, 98.4%, 99.6%, 99.9% sparsity): at step ``t <= warmup_steps``
the ratio is ``compress_ratio ** (t / (warmup_steps + 1))``.

Wire: the kept values in the input dtype + their int32 flat positions, ``c * (itemsize + 4)``
bytes with ``c <= k`` depending on the data (``c >= 1`` unless every sampled entry is NaN;
``payload_nbytes`` is None, ``equal_sizes`` False: gather the payloads). Biased; pair it with
``dgc`` memory (momentum correction, factor masking, clipping) or ``residual``. Ties at the cut
go to the lowest positions; ``+-inf`` is the largest magnitude; NaN ranks below every number
(the sampled path never sends it; the exact one only when fewer than k numbers exist).
"""

from __future__ import annotations

from grace_dl.compressors import paths, sparse
from grace_dl.compressors.base import Capabilities
from grace_dl.compressors.sparse import SparseCompressor
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range


@register_compressor("dgc")
class DgcCompressor(SparseCompressor):
    caps = Capabilities(equal_sizes=False, sparse=True)

    def __init__(self, compress_ratio: float = 0.01, warmup_steps: int = 0, seed: int = 0):
        super().__init__(seed)
        self.compress_ratio = in_range("compress_ratio", compress_ratio, 0.0, 1.0, lo_open=True)
        self.warmup_steps = in_range("warmup_steps", warmup_steps, 0, None, kind=int)

    def ratio_at(self, ops, step):
        """The ratio in force at ``step`` (a number, or a tensor for a graph-mode step)."""
        span = self.warmup_steps + 1
        if self.warmup_steps == 0:
            return self.compress_ratio
        if ops.is_tensor(step):
            t = ops.minimum(ops.cast(step, "float64"), float(span))
            return self.compress_ratio ** (t / span)
        return self.compress_ratio ** (min(step, span) / span)

    def _positions(self, ops, tensor, flat, n, name, select):
        step = self.next_step(name, tensor)
        ratio = self.ratio_at(ops, step)
        k = sparse.ceil_count(ops, ratio * n, n)
        if n < sparse.APPROX_MIN_NUMEL:
            return sparse.exact_top(ops, flat, k, select=select)
        s = sparse.sample_size(n)
        thr = sparse.sampled_threshold(ops, flat, self.seed, name, step,
                                       sparse.ceil_count(ops, ratio * s, s), select=select)
        cand = select.at_least(ops, flat, thr)
        return ops.cond(
            ops.numel(cand) > k,
            lambda: sparse.keep_top(ops, cand, ops.abs(ops.gather(flat, cand)), k, select),
            lambda: cand)


paths.register(DgcCompressor)(sparse.SparsePath)
