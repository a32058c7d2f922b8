"""Binning float32 values against a few sorted edges (``bucketize``, sketch's quantile bins) in
a handful of whole-tensor passes (``torch.bucketize``'s per-element binary search costs ~100x a
copy on CPU).

Values and edges are first mapped to int32 keys that order like the floats (-0 equal to +0;
exact in TF too, which flushes subnormal floats to zero in float comparisons). The top 15 bits
of a key name one of 32768 cells; per cell we know how many edges lie below it and, when all
the edges inside it are equal, where that one split is. An element's bucket is then two small
table gathers and one comparison. Should a cell hold distinct edges (edges closer than ~1/64 of
their magnitude), every element takes the exact binary search instead.
"""

from __future__ import annotations

import numpy as np

_SHIFT = 17
_CELLS = 1 << (32 - _SHIFT)
_HIGHS = (((np.arange(_CELLS, dtype=np.int64) - _CELLS // 2) << _SHIFT)
          + (1 << _SHIFT) - 1).astype(np.int32)


def order_key(ops, x):
    """int32 keys of float32 ``x`` with key(a) <= key(b) exactly when a <= b (for non-NaN)."""
    bits = ops.bitcast(x, "int32")
    key = ops.shift_right(bits, 31)  # -1 for negative floats, else 0
    key &= 0x7FFFFFFF
    key ^= bits                      # negative floats: magnitude bits reversed
    fix = ops.shift_right(key, 31)
    fix &= 1
    key += fix                       # negatives move up one, so -0 meets +0
    return key


def bucketize(ops, x, edges):
    """int32 bucket of each float32 element of 1-D ``x``: the number of ``edges`` (sorted,
    float32, at least one) that are <= the element, as ``ops.bucketize``."""
    key = order_key(ops, x)
    edge_keys = order_key(ops, edges)
    last = ops.numel(edges) - 1
    upto = ops.bucketize(ops.from_numpy(_HIGHS, like=x), edge_keys)  # edges <= cell's top
    before = ops.cat([ops.zeros((1,), "int32", like=x), ops.slice(upto, 0, _CELLS - 1)])
    count = upto - before
    first = ops.gather(edge_keys, ops.clamp(before, 0, last))
    final = ops.gather(edge_keys, ops.clamp(upto - 1, 0, last))
    ambiguous = ops.count_nonzero(ops.logical_and(count > 1, first != final)) > 0

    def by_cells():
        split = ops.where(count > 0, first, ops.full((_CELLS,), 2**31 - 1, "int32", like=x))
        cell = ops.shift_right(key, _SHIFT)
        cell += _CELLS // 2
        above = ops.cast(key >= ops.gather(split, cell), "int32")
        cell += cell
        cell += above
        return ops.gather(ops.reshape(ops.stack([before, upto], axis=1), (-1,)), cell)

    return ops.cond(ambiguous, lambda: ops.bucketize(key, edge_keys), by_cells)
