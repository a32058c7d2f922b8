"""``randomk``: send ``k = max(1, ceil(compress_ratio * n))`` entries at random positions
(Stich et al. 2018, "Sparsified SGD with Memory").

The positions are drawn without replacement from ``(seed, name, step)`` alone, so every rank
draws the same ones, whatever order its tensors are compressed in, and they are never sent:
wire = k values in the input dtype, ``k * itemsize`` bytes (for fp32 and ratio r: 32 * r bits
per element). Payloads of different ranks hold the same positions, so they can be summed on the
wire: **allreduce-safe**. The positions come ascending, from a stream of seeded draws whose
first k distinct values are kept (``grace_dl.seeding.choice``): O(k) draws plus one pass over an
n-bit bitmap, compiled.

Biased as sent by default (it keeps x on k of n coordinates, E = (k/n) x), which is what error
feedback (``residual``, ``dgc`` memory) wants: the residual is exactly what was not sent.
``unbiased=True`` scales the kept values by n/k (Wangni et al. 2018, "Gradient Sparsification
for Communication-Efficient Distributed Optimization"), so E[decompress(compress(x))] = x with
variance (n/k - 1) x**2 per coordinate; use it *without* error feedback (a residual
x - (n/k) x would grow without bound), e.g. under memory ``momentum`` with
``error_feedback=False``, the recipe that matches uncompressed momentum SGD on digits
(README, recipes; on a longer 100-class task its variance costs accuracy).
NaN/Inf are sent like any other value when drawn.
"""

from __future__ import annotations

from dataclasses import replace

from grace_dl.backend import ops_for
from grace_dl.compressors import paths, sparse
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range, one_of


@register_compressor("randomk")
class RandomKCompressor(Compressor):
    caps = Capabilities(allreduce_safe=True, sparse=True)

    def __init__(self, compress_ratio: float = 0.01, seed: int = 0, unbiased: bool = False):
        super().__init__(seed)
        self.compress_ratio = in_range("compress_ratio", compress_ratio, 0.0, 1.0, lo_open=True)
        self.unbiased = one_of("unbiased", unbiased, (False, True))
        self.caps = replace(self.caps, unbiased=self.unbiased)

    def compress(self, tensor, name, call=LOCAL):
        """Payload ``[values]``; ctx ``(shape, numel, positions)`` (int64, local only)."""
        ops = ops_for(tensor)
        n = ops.numel(tensor)
        flat = ops.flatten(tensor)
        if n == 0:
            return [flat], (ops.shape(tensor), 0, ops.cast(flat, "int64"))
        k = sparse.count_for(self.compress_ratio, n)
        step = self.next_step(name, tensor)
        positions = ops.choice(self.seed, name, step, n, k, like=flat)
        values = ops.gather(flat, positions)
        if self.unbiased and k < n:
            values = values * (n / k)
        return [values], (ops.shape(tensor), n, positions)

    def decompress(self, payload, ctx):
        shape, n, positions = ctx
        ops = ops_for(payload[0])
        return ops.reshape(ops.scatter(positions, payload[0], n), shape)

    def sent_entries(self, payload, ctx):
        return ctx[2], payload[0]

    def payload_nbytes(self, numel, dtype="float32"):
        return sparse.count_for(self.compress_ratio, numel) * sparse.itemsize(dtype)


@paths.register(RandomKCompressor)
class RandomKPath(paths.Reference):
    """randomk's own faster composition on every device: the ranks' values (the same
    positions on every rank) summed in rank order, then scattered once (``fast_sum``: a
    device's speed path gives one); an average folded into the k values."""

    #: ``sparse.scatter_sum``'s ``fast_sum`` (None: the ops' scatter)
    fast_sum = None

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        """The error as a fill of the sent positions (``sparse.compress_with_error``), where
        the values sent are the tensor's own (not ``unbiased``'s scaled ones)."""
        if self.compressor.unbiased:
            return None
        return sparse.compress_with_error(self, tensor, name, call, error, decoded)

    def divided(self, payload, divisor):
        return [payload[0] / divisor]

    def combine(self, payloads, ctx, out=None):
        total = payloads[0][0]
        for p in payloads[1:]:
            total = total + p[0]
        return self.decompress_into([total], ctx, out)

    def decompress_into(self, payload, ctx, out=None):
        if ctx[1] == 0:
            return self.compressor.decompress(payload, ctx)
        return sparse.scatter_sum(ops_for(payload[0]), [ctx[2]], [payload[0]], ctx, out,
                                  self.fast_sum)
