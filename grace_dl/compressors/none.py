"""``none``: no compression, the baseline.

Wire: the tensor itself, 32 bits per element for fp32 (its own width for other dtypes).
Unbiased (exact), allreduce-safe.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.registry import register_compressor


@register_compressor("none")
class NoneCompressor(Compressor):
    caps = Capabilities(allreduce_safe=True, two_phase_safe=True, unbiased=True, sends_tensor=True)

    def __init__(self):
        super().__init__()

    def compress(self, tensor, name, call=LOCAL):
        ops = ops_for(tensor)
        return [ops.flatten(tensor)], ops.shape(tensor)

    def decompress(self, payload, ctx):
        return ops_for(payload[0]).reshape(payload[0], ctx)

    def payload_nbytes(self, numel, dtype="float32"):
        return numel * {"float16": 2, "bfloat16": 2, "float64": 8}.get(dtype, 4)
