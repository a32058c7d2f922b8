"""``onebit``: 1-bit quantization with two reconstruction values (Seide, Fu, Droppo, Li, Yu 2014,
"1-Bit Stochastic Gradient Descent and its Application to Data-Parallel Distributed Training of
Speech DNNs").

Every element is sent as one bit, whether it is negative, and decodes to the mean of the
negative entries or the mean of the non-negative ones (zero and NaN count as non-negative; see
``signbits``). The paper pairs it with error feedback: use memory ``residual``.

Wire, for ``n`` elements: ``ceil(n/8)`` uint8 of packed bits (1 bit/element) and one float32
tensor of 2 elements, ``[mean of non-negative entries, mean of negative entries]`` (8 bytes);
``ceil(n/8) + 8`` bytes in all, whatever the input dtype. Decompression returns the input's dtype.

The group sums come from two reductions, ``S = sum(x)`` and ``A = sum(|x|)``: non-negative sum
= ``(S + A) / 2``, negative sum = ``(S - A) / 2``, in float32 (float64 for float64 input). That
avoids building a masked copy of the tensor; each group's sum is accurate to about float epsilon
times ``||x||_1``, so the error this adds to the reconstruction is a rounding-size fraction of
``||x||_1``. A group so small that its sum rounds across zero is clamped to 0. NaN or Inf input
makes the means non-finite, so the decoded tensor carries it.

Biased, not allreduce-safe (each rank has its own means), equal sizes, two-phase safe (any chunk
can be quantized with its own means); ranks' decoded tensors are summed and averaged.
"""

from __future__ import annotations

import math

from grace_dl.backend import ops_for
from grace_dl.compressors import signbits
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.registry import register_compressor


@register_compressor("onebit")
class OneBitCompressor(Compressor):
    caps = Capabilities(two_phase_safe=True)

    def __init__(self):
        super().__init__()

    def compress(self, tensor, name, call=LOCAL):
        ops = ops_for(tensor)
        flat = ops.flatten(tensor)
        neg = flat < 0
        wide = signbits.wide(ops, flat)
        total, mass = ops.sum(wide), ops.abs_sum(wide)
        n_neg = ops.cast(ops.count_nonzero(neg), ops.dtype(wide))
        n_pos = n_neg * -1 + ops.numel(flat)
        sum_pos, sum_neg = (total + mass) * 0.5, (total - mass) * 0.5
        zero = ops.zeros_like(total)
        sum_pos = ops.where(sum_pos < 0, zero, sum_pos)
        sum_neg = ops.where(sum_neg > 0, zero, sum_neg)
        means = ops.stack([sum_pos / ops.clamp(n_pos, 1), sum_neg / ops.clamp(n_neg, 1)])
        payload = [ops.pack_mask(neg), ops.cast(means, "float32")]
        return payload, (ops.shape(tensor), ops.dtype(tensor))

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        bits, means = payload
        ops = ops_for(bits)
        return ops.reshape(signbits.decode(ops, bits, math.prod(shape), means, dtype), shape)

    def payload_nbytes(self, numel, dtype="float32"):
        """``ceil(numel / 8)`` bytes of bits + 2 float32 means."""
        return math.ceil(numel / 8) + 8
