"""What the sparsifiers (topk, randomk, threshold, dgc, adaq) share: picking entries of a flat
tensor by magnitude, and scattering sent values back into a dense tensor.

Wire format of every index-carrying sparsifier: the kept values in the input dtype, and their
positions in the flattened tensor as int32 (tensors must therefore have < 2**31 elements).

Selection rules, identical in torch and TensorFlow (so both backends pick the same entries):

- magnitude is ``|x|``; ``+-inf`` is the largest magnitude; NaN ranks below every number (it is
  never kept while k numbers are available);
- ties at the k-th magnitude go to the lowest indices.
"""

from __future__ import annotations

import math
import operator

from grace_dl.backend import ops_for
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor, error_views
from grace_dl.compressors.paths import Reference
from grace_dl.dtypes import itemsize  # noqa: F401  (re-exported for the sparsifiers)

INDEX_DTYPE = "int32"
MAX_NUMEL = 2**31 - 1
#: Below this many elements the exact top-k is cheaper than estimating a threshold by sampling.
APPROX_MIN_NUMEL = 65536
SAMPLE_MIN = 8192
SAMPLE_DIVISOR = 256

def count_for(ratio: float, n: int) -> int:
    """Entries a ratio keeps of ``n``: ``max(1, ceil(ratio * n))`` for ``n > 0``, else 0."""
    return 0 if n == 0 else min(n, max(1, math.ceil(ratio * n)))


def ceil_count(ops, x, hi: int):
    """``max(1, min(hi, ceil(x)))``: a Python int for a number ``x``, an int32 tensor for a
    tensor ``x`` (a ratio that depends on a graph-mode step)."""
    if ops.is_tensor(x):
        return ops.clamp(ops.cast(ops.ceil(x), "int32"), 1, hi)
    return max(1, min(hi, math.ceil(x)))


def check_numel(n, method: str) -> None:
    if isinstance(n, int) and n > MAX_NUMEL:
        raise ValueError(f"{method} sends int32 indices: tensors must have at most {MAX_NUMEL} "
                         f"elements, got {n}")


def sample_size(n: int) -> int:
    """Entries drawn to estimate a magnitude threshold for an ``n``-element tensor."""
    return min(n, max(SAMPLE_MIN, n // SAMPLE_DIVISOR))


def magnitudes(ops, flat, sign=None):
    """What entries are ranked by: ``|flat|`` (``sign=None``), the positive part (``sign=1``:
    ``x`` where ``x > 0``) or the negative part (``sign=-1``: ``-x`` where ``x < 0``); -1 for
    NaN and for entries of the other sign, so they rank below every candidate."""
    if sign is None:
        mag = ops.abs(flat)
        keep = mag == mag
    else:
        mag = flat if sign > 0 else -flat
        keep = mag > 0
    return ops.where(keep, mag, ops.zeros_like(mag) - 1)


class Selection:
    """How the sparsifiers find their positions: by the framework's ops (this class, the
    reference), or by a speed path's kernels (a subclass: ``grace_dl.native.paths``), each
    giving the same positions and values."""

    def top(self, flat, k, sign=None):
        """The positions ``top_of(magnitudes(flat, sign), k)`` picks, or None: ``top_of``
        finds them."""
        return None

    def at_least(self, ops, flat, thr, sign=None):
        """``ops.positions_at_least``: the positions whose magnitude reaches ``thr``."""
        return ops.positions_at_least(flat, thr, sign)

    def kth_largest(self, ops, x, k):
        """``ops.kth_largest``: the ``k``-th largest entry of ``x`` (no NaN)."""
        return ops.kth_largest(x, k)


#: the framework's ops
REFERENCE = Selection()


def keep_top(ops, cand, cmag, k, select=REFERENCE):
    """Exactly ``k`` of the candidate positions ``cand`` (with magnitudes ``cmag``, at least
    ``k`` of them): the largest magnitudes, ties at the k-th going to the lowest positions
    (``cand`` is ascending). Returns int64 positions, ascending (every sparsifier's are, so
    a sum of payloads is written in one pass: ``ops.assign_sparse_sum``)."""
    kth = select.kth_largest(ops, cmag, k)
    above, tied = cmag > kth, cmag == kth
    # the k-th itself is tied, so at least one tie is kept; the last one kept bounds the rest
    need = k - ops.numel(ops.nonzero(above))
    last = ops.slice(ops.gather(cand, ops.nonzero(tied)), need - 1, need)
    chosen = ops.gather(cand, ops.nonzero(above | (tied & (cand <= last))))
    return ops.reshape(chosen, [k]) if isinstance(k, int) else chosen


def top_of(ops, mag, k, select=REFERENCE):
    """Positions of the ``k`` largest entries of ``mag`` (no NaN; ``0 < k <= numel``)."""
    kth = select.kth_largest(ops, mag, k)
    cand = ops.nonzero(mag >= kth)
    return keep_top(ops, cand, ops.gather(mag, cand), k, select)


def exact_top(ops, flat, k, sign=None, select=REFERENCE):
    """Positions of the ``k`` largest ``magnitudes(flat, sign)`` (``0 < k <= numel``):
    ``select.top``, or ``top_of`` where it gives none."""
    fast = select.top(flat, k, sign)
    return top_of(ops, magnitudes(ops, flat, sign), k, select) if fast is None else fast


def top_among(ops, flat, cand, k, sign=None, select=REFERENCE):
    """``keep_top`` of the candidate positions ``cand`` (ascending) of ``flat``: the ``k``
    largest magnitudes among them, ascending."""
    values = ops.gather(flat, cand)
    fast = select.top(values, k, sign)
    if fast is None:
        return keep_top(ops, cand, magnitudes(ops, values, sign), k, select)
    return ops.gather(cand, fast)


def sampled_threshold(ops, flat, seed, name, step, above, sign=None, select=REFERENCE):
    """A magnitude threshold from a seeded sample of ``flat`` (Lin et al. 2018, DGC): the
    ``above``-th largest sampled magnitude, so about ``above / sample_size`` of the tensor lies
    at or over it. The sample is ``sample_size(n)`` distinct positions keyed by
    ``(seed, name, step)``, so every rank and both frameworks draw the same one."""
    n = ops.numel(flat)
    picks = ops.choice(seed, name, step, n, sample_size(n), like=flat)
    smag = magnitudes(ops, ops.gather(flat, picks), sign)
    return select.kth_largest(ops, smag, above)


def approx_top(ops, flat, k, seed, name, step, sign=None, select=REFERENCE):
    """The same positions as ``exact_top`` (same set, same tie rule), found faster; with
    ``sign`` the ``k`` largest ``magnitudes(flat, sign)`` (``k`` may be an int tensor).

    A threshold estimated from a sample is set a little *below* the k-th magnitude (the sample
    count above it is padded by 4 standard deviations), so ``|x| >= threshold`` selects a bit more
    than k candidates; an exact top-k over those few picks the k. In the rare case the estimate
    lands above the k-th magnitude (fewer than k candidates) the exact path runs instead, so the
    result never depends on the draw."""
    n = ops.numel(flat)
    s = sample_size(n)
    if ops.is_tensor(k):
        mean_above = ops.cast(k, "float64") * (s / n)
        above = ceil_count(ops, mean_above + ops.sqrt(mean_above) * 4 + 2, s)
    else:
        mean_above = s * k / n
        above = min(s, math.ceil(mean_above + 4 * math.sqrt(mean_above) + 2))
    thr = sampled_threshold(ops, flat, seed, name, step, above, sign, select)
    cand = select.at_least(ops, flat, thr, sign)
    return ops.cond(ops.numel(cand) >= k, lambda: top_among(ops, flat, cand, k, sign, select),
                    lambda: exact_top(ops, flat, k, sign, select))


class SparseCompressor(Compressor):
    """Base of the sparsifiers whose payload is ``[values, int32 positions]`` (topk, threshold,
    dgc). The ctx is ``(shape, numel)``. Subclasses choose the positions (``_positions``)."""

    caps = Capabilities(sparse=True)
    #: the name errors give (a registered subclass's own)
    registry_name = "sparsifier"

    def compress(self, tensor, name, call=LOCAL):
        return self._compress(tensor, name)

    def _compress(self, tensor, name, select=REFERENCE):
        """``compress``, the positions found by ``select`` (a speed path's ``Selection``)."""
        ops = ops_for(tensor)
        n = ops.numel(tensor)
        check_numel(n, self.registry_name)
        if n == 0:
            return self.empty(ops, tensor)
        flat = ops.flatten(tensor)
        return self.pack(ops, tensor, self._positions(ops, tensor, flat, n, name, select))

    def _positions(self, ops, tensor, flat, n, name, select):
        """The positions (ascending, int) of the flat ``tensor`` (``flat``, ``n > 0``
        elements) to send, found with ``select``."""
        raise NotImplementedError(f"{type(self).__name__} must choose its positions "
                                  f"(_positions) or override compress")

    def pack(self, ops, tensor, positions):
        """Payload and ctx for sending ``tensor``'s flat entries at ``positions``."""
        flat = ops.flatten(tensor)
        values = ops.gather(flat, positions)
        return ([values, ops.cast(positions, INDEX_DTYPE)],
                (ops.shape(tensor), ops.numel(flat)))

    def empty(self, ops, tensor):
        """Payload and ctx of a tensor with no elements."""
        flat = ops.flatten(tensor)
        return [flat, ops.cast(flat, INDEX_DTYPE)], (ops.shape(tensor), 0)

    def decompress(self, payload, ctx):
        values, positions = payload
        shape, n = ctx
        ops = ops_for(values)
        return ops.reshape(ops.scatter(positions, values, n), shape)

    def sent_entries(self, payload, ctx):
        return payload[1], payload[0]


class SparsePath(Reference):
    """A ``SparseCompressor``'s own faster composition on every device (``paths.ANY``; the
    registering class names it): a decompression, or every rank's values, added into one
    buffer at their positions by one scatter (``fast_sum``: a device's speed path gives one);
    an average folded into the k values."""

    #: ``scatter_sum``'s ``fast_sum`` (None: the ops' scatter)
    fast_sum = None

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        return compress_with_error(self, tensor, name, call, error, decoded)

    def divided(self, payload, divisor):
        return [payload[0] / divisor, payload[1]]

    def decompress_into(self, payload, ctx, out=None):
        return scatter_sum(ops_for(payload[0]), [payload[1]], [payload[0]], ctx, out,
                           self.fast_sum)

    def combine(self, payloads, ctx, out=None):
        """Every rank's values added into one dense buffer at their positions, in rank order
        (the same sums as adding the ranks' decompressed tensors in rank order)."""
        return scatter_sum(ops_for(payloads[0][0]), list(map(_POSITIONS, payloads)),
                           list(map(_VALUES, payloads)), ctx, out, self.fast_sum)


def compress_with_error(path, tensor, name, call, error, decoded=None):
    """``path.compress``, also writing ``tensor - decompress(payload)`` into ``error``, for a
    payload whose values are ``tensor``'s own entries: that is ``tensor`` with +0.0 at the
    sent positions (x - x for a finite x, and the memory sets a NaN/Inf there to 0), so a
    residual compensated in its own slot costs O(k) (a fill) instead of a subtraction of the
    sent values. None, before compressing, for a ``decoded`` output or an ``error`` without
    a flat view of ``tensor``'s dtype and length (TF): the caller then decompresses."""
    ops = ops_for(tensor)
    views = None if decoded is not None else error_views(tensor, error, None, ops.dtype(tensor))
    if views is None:
        return None
    payload, ctx = path.compress(tensor, name, call)
    positions = path.compressor.sent_entries(payload, ctx)[0]
    own = ops.flat_view(tensor)     # the slot itself when compensated in place
    if own is None or not ops.aliases(views[0], own):
        ops.assign(views[0], ops.flatten(tensor))
    ops.assign_zero_at(views[0], positions)
    return payload, ctx


#: a sparse payload's values and positions
_VALUES, _POSITIONS = operator.itemgetter(0), operator.itemgetter(1)


def scatter_sum(ops, positions: list, values: list, ctx, out=None, fast_sum=None):
    """The sum of N sparse tensors (rank r: ``values[r]`` at distinct ``positions[r]``) of
    the dense shape in ``ctx`` = ``(shape, numel, ...)``: one buffer (``out`` when given),
    one scatter-add; into ``out`` by ``fast_sum(out, positions, values)`` where a speed path
    gives one (the same sums, None where it does not apply)."""
    shape, n = ctx[0], ctx[1]
    if out is not None and fast_sum is not None:
        fast = fast_sum(out, positions, values)
        if fast is not None:
            return fast
    idx, vals = (positions[0], values[0]) if len(values) == 1 else (ops.cat(positions),
                                                                    ops.cat(values))
    if out is not None:
        return ops.assign_scatter(out, idx, vals)
    if len(values) == 1:
        return ops.reshape(ops.scatter(idx, vals, n), shape)
    return ops.reshape(ops.scatter_add(idx, vals, n), shape)
