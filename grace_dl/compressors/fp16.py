"""``fp16`` and ``bf16``: send the gradient in a 16-bit float format.

Wire: one tensor of ``numel`` float16 (IEEE half) or bfloat16 values, 16 bits per element,
whatever the input dtype (fp32, fp64, or already 16-bit). Decompression casts back to the input
dtype. Round-to-nearest, so not unbiased (bias below one 16-bit ulp); fp16 overflows to +-inf
above 65504, bf16 keeps fp32's range with 8 mantissa bits.

fp16 is allreduce-safe: 16-bit payloads from all ranks are summed on the wire (as Horovod's own
``Compression.fp16``). bf16 is not, on Horovod 0.28.1: its torch and TF allreduce refuse
bfloat16 (measured), and summing it as float32 would put 32 bits on the wire, so bf16 travels by
``allgather``, ``broadcast`` or ``twophase``, as a bit-exact int16 view: 16 bits. Any 1-D chunk
compresses independently (two-phase safe).
Reference: Micikevicius et al. 2018, "Mixed Precision Training"; Kalamkar et al. 2019,
"A Study of BFLOAT16 for Deep Learning Training".
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.registry import register_compressor


class _HalfCompressor(Compressor):
    caps = Capabilities(allreduce_safe=True, two_phase_safe=True)
    wire_dtype = "float16"

    def __init__(self):
        super().__init__()

    def compress(self, tensor, name, call=LOCAL):
        ops = ops_for(tensor)
        dt = ops.dtype(tensor)
        flat = ops.flatten(tensor)
        # a gradient already in the wire dtype is copied: the payload must not be a view of
        # what a memory then updates in place (its slot), or it would send the update
        flat = ops.cast(flat, self.wire_dtype) if dt != self.wire_dtype else ops.cat([flat])
        return [flat], (ops.shape(tensor), dt)

    def decompress(self, payload, ctx):
        shape, dt = ctx
        ops = ops_for(payload[0])
        out = payload[0]
        if dt != self.wire_dtype:
            out = ops.cast(out, dt)
        return ops.reshape(out, shape)

    def payload_nbytes(self, numel, dtype="float32"):
        return 2 * numel


@register_compressor("fp16")
class FP16Compressor(_HalfCompressor):
    wire_dtype = "float16"


@register_compressor("bf16")
class BF16Compressor(_HalfCompressor):
    wire_dtype = "bfloat16"
    caps = Capabilities(two_phase_safe=True)
