"""``threshold``: send every entry with ``|x| > threshold`` (Strom 2015, "Scalable Distributed
DNN Training Using Commodity GPU Cloud Computing").

Wire: the kept values in the input dtype + their int32 flat positions, ``c * (itemsize + 4)``
bytes where the count c depends on the data (``payload_nbytes`` is None, ``equal_sizes`` False:
gather the payloads). A tensor entirely at or below the threshold sends 0 elements and
decompresses to zeros. Biased (use it with ``residual`` memory); not allreduce-safe.

GRACE compared the signed value (``x > threshold``, dropping every negative entry); this
compares the magnitude. ``+-inf`` is always sent; NaN never is (with residual memory it stays
in the residual).
"""

from __future__ import annotations

import math

import numpy as np

from grace_dl.compressors import paths, sparse
from grace_dl.compressors.base import Capabilities
from grace_dl.compressors.sparse import SparseCompressor
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range

_F32_TINY = float(np.finfo(np.float32).tiny)


@register_compressor("threshold")
class ThresholdCompressor(SparseCompressor):
    caps = Capabilities(equal_sizes=False, sparse=True)

    def __init__(self, threshold: float = 0.01):
        super().__init__()
        self.threshold = in_range("threshold", threshold, 0.0, None)
        if math.isinf(self.threshold):
            raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")

    def _positions(self, ops, tensor, flat, n, name, select):
        thr = self.threshold
        if ops.dtype(flat) == "float32" and thr >= _F32_TINY:
            # |x| > t is |x| >= the next float32 above t: the sparsifiers' one-pass scan (not
            # for subnormal t, which a CPU flushing subnormals to zero would compare as 0)
            above = float(np.nextafter(np.float32(thr), np.float32(np.inf)))
            return select.at_least(ops, flat, above)
        return ops.nonzero((flat > thr) | (flat < -thr))


paths.register(ThresholdCompressor)(sparse.SparsePath)
