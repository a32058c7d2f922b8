"""``qsgd``: stochastic multi-level quantization with one norm per bucket (Alistarh et al. 2017,
"QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding").

The flat gradient is cut into buckets of ``bucket_size`` elements (the last may be shorter).
Within a bucket of norm ``||v||``, each element becomes ``||v|| / s * l`` with the integer
``l`` in ``[-s, s]`` (``s = quantum_num``) drawn so that ``E[l] = s * v_i / ||v||``: ``l`` is
``s * v_i / ||v||`` rounded down or up, up with probability equal to the fractional part.
This is the paper's ``sign(v_i) * xi_i(v, s)``, hence unbiased; Lemma 3.1 bounds the variance by
``min(n/s^2, sqrt(n)/s) * ||v||^2`` per bucket of n elements.

Wire (per tensor of n elements, B = ceil(n / bucket_size) buckets):
  * codes ``l + s``, ``bits = ceil(log2(2s + 1))`` each, bit-packed into
    ``ceil(n * bits / 8)`` uint8 (s = 127, the default, gives 8 bits; s = 7 gives 4 bits);
  * the B bucket norms, float32 (4 bytes each).
Not allreduce-safe (each rank's codes mean something only with its own norms): gathered.
Buckets are independent, so any 1-D chunk compresses on its own (two-phase safe). The paper's
Elias coding of the levels is not used: it gives variable sizes and a serial decoder.

All-zero buckets send norm 0 and decode to exact zeros; a NaN or Inf in a bucket makes its norm
non-finite and the whole bucket decodes to NaN. A finite bucket whose sum of squares overflows
float32 (an element >= ~1e19) has its norm recomputed from the bucket scaled by its largest
magnitude, so one large value does not turn its bucket into NaN.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.compressors.base import LOCAL, Compressor
from grace_dl.compressors.flat import bits_for, flat_f32, pack, restore, unpack
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range


@register_compressor("qsgd")
class QSGDCompressor(Compressor):
    unbiased = True
    two_phase_safe = True

    def __init__(self, quantum_num: int = 127, bucket_size: int = 512, seed: int = 0):
        super().__init__(seed)
        # 2s + 1 codes must fit the 8-bit packing width.
        self.quantum_num = in_range("quantum_num", quantum_num, 1, 127, kind=int)
        self.bucket_size = in_range("bucket_size", bucket_size, 1, None, kind=int)
        self._bits = bits_for(2 * self.quantum_num + 1)

    def _buckets(self, n):
        return -(-n // self.bucket_size)

    def compress(self, tensor, name, call=LOCAL):
        ops, x, layout = flat_f32(tensor)
        n, b, s = layout.numel, self.bucket_size, float(self.quantum_num)
        nb = self._buckets(n)
        u = ops.uniform(self.seed, name, self.next_step(name, tensor), n, like=x,
                        stream=call.rank)

        xb = ops.reshape(ops.pad(x, nb * b - n), (nb, b))
        norms = _bucket_norms(ops, xb, nb)
        scale = ops.where(norms > 0, s / norms, ops.zeros_like(norms))
        # floor(s*v/||v|| + u) + s: the stochastic level, shifted to [0, 2s].
        t = ops.slice(ops.flatten(xb * ops.reshape(scale, (nb, 1))), 0, n)
        t += u
        t += s
        # Truncation is floor here (t >= -tiny); the clamp only catches float rounding at +s.
        codes = ops.clamp(ops.cast(t, "uint8"), None, 2 * self.quantum_num)
        return [pack(ops, codes, self._bits), norms], layout

    def decompress(self, payload, ctx):
        packed, norms = payload
        ops, n, b = ops_for(packed), ctx.numel, self.bucket_size
        nb = self._buckets(n)
        s = float(self.quantum_num)
        codes = ops.pad(unpack(ops, packed, self._bits, n), nb * b - n)
        v = ops.reshape(ops.cast(codes, "float32"), (nb, b))
        v -= s
        v *= ops.reshape(norms / s, (nb, 1))
        return restore(ops, ops.slice(ops.flatten(v), 0, n), ctx)

    def payload_nbytes(self, numel, dtype="float32"):
        return -(-numel * self._bits // 8) + 4 * self._buckets(numel)



def _bucket_norms(ops, xb, nb):
    """The L2 norm of each row of ``xb``, without float32 overflow for large finite rows: only
    when some norm comes out non-finite are the rows rescaled by their largest magnitude."""
    norms = ops.norm(xb, axis=1)

    def rescaled():
        peak = ops.max(ops.abs(xb), axis=1)
        peak = ops.where(peak > 0, peak, ops.ones_like(peak))
        return ops.norm(xb / ops.reshape(peak, (nb, 1)), axis=1) * peak

    return ops.cond(ops.isfinite(ops.sum(norms)), lambda: norms, rescaled)
