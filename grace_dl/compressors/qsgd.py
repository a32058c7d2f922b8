"""``qsgd``: stochastic multi-level quantization with one norm per bucket (Alistarh et al. 2017,
"QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding").

The flat gradient is cut into buckets of ``bucket_size`` elements (the last may be shorter).
Within a bucket of norm ``||v||``, each element becomes ``||v|| / s * l`` with the integer
``l`` in ``[-s, s]`` (``s = quantum_num``) drawn so that ``E[l] = s * v_i / ||v||``: ``l`` is
``s * v_i / ||v||`` rounded down or up, up with probability equal to the fractional part.
This is the paper's ``sign(v_i) * xi_i(v, s)``, hence unbiased; Lemma 3.1 bounds the variance by
``min(n/s^2, sqrt(n)/s) * ||v||^2`` per bucket of n elements. The rounding's dither has
``b = 8`` random bits per element for ``s >= 64`` (16 below; ``flat.dither_bits``), so the
round-up probability is the fractional part within ``2^-(b+1)`` (``seeding.dither``): a bias of
at most ``||v|| / (s * 2^(b+1))`` per element, ``||v|| / 65024`` at the default s = 127.

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
from grace_dl.compressors import paths
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor, error_views
from grace_dl.compressors.flat import (
    add_dither,
    bits_for,
    dither_bits,
    flat_f32,
    pack,
    restore,
    unpack,
)
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range


@register_compressor("qsgd")
class QSGDCompressor(Compressor):
    caps = Capabilities(two_phase_safe=True, unbiased=True)

    def __init__(self, quantum_num: int = 127, bucket_size: int = 512, seed: int = 0):
        super().__init__(seed)
        # 2s + 1 codes must fit the 8-bit packing width.
        self.quantum_num = in_range("quantum_num", quantum_num, 1, 127, kind=int)
        self.bucket_size = in_range("bucket_size", bucket_size, 1, None, kind=int)
        self._bits = bits_for(2 * self.quantum_num + 1)

    def _buckets(self, n):
        return -(-n // self.bucket_size)

    def _rows(self, ops, flat, n):
        """``flat``'s first ``n`` elements as rows of ``bucket_size``: the whole buckets (a view,
        no copy) and the last, shorter bucket zero-padded to one row; empty parts left out
        (``n = 0``: one part of no rows).
        ``flat`` may be longer than ``n`` (a dither drawn for whole buckets)."""
        b = self.bucket_size
        full = n // b
        rows = [ops.reshape(ops.slice(flat, 0, full * b), (full, b))] \
            if full or n == 0 else []
        if n > full * b:
            tail = ops.slice(flat, full * b, min(ops.numel(flat), (full + 1) * b))
            rows.append(ops.reshape(ops.pad(tail, b - ops.numel(tail)), (1, b)))
        return rows

    def compress(self, tensor, name, call=LOCAL):
        return self._compress(tensor, name, call)

    def _error_outs(self, tensor, error, decoded):
        """``compress_with_error``'s 1-D outputs, or None where it does not apply."""
        if ops_for(tensor).dtype(tensor) != "float32":
            return None
        return error_views(tensor, error, decoded, "float32")

    def _compress(self, tensor, name, call, outs=(), fast_levels=None):
        """``(payload, ctx)``; ``outs``: 1-D float32 tensors of the input's length, the first
        set to the error (input - decompression), the second (if any) to the decompression.
        The first may be the input's own memory: each block is read before it is written.
        ``fast_levels``: a faster way (a speed path's kernel) to the whole buckets' codes, called
        as ``fast_levels(x, scale, step, k, s, hi, *outs)`` with the buckets as rows, returning
        the codes (and writing ``outs``) or None where it does not apply."""
        ops, x, layout = flat_f32(tensor)
        n, b, s = layout.numel, self.bucket_size, float(self.quantum_num)
        nb = self._buckets(n)
        db = dither_bits(self.quantum_num)
        k = ops.dither(self.seed, name, self.next_step(name, tensor), nb * b, db, like=x,
                       stream=call.rank)
        # whole buckets are quantized from views of x; only the last, short one is padded
        xs, ks = self._rows(ops, x, n), self._rows(ops, k, n)
        norms = [_bucket_norms(ops, r, ops.shape(r)[0]) for r in xs]
        norms = norms[0] if len(norms) == 1 else ops.cat(norms)
        scale = ops.reshape(ops.where(norms > 0, s / norms, ops.zeros_like(norms)), (nb, 1))
        step = ops.reshape(norms / s, (nb, 1))
        sizes = [ops.shape(r)[0] for r in xs]
        scales, steps = ([scale], [step]) if len(xs) == 1 else \
            (ops.split(scale, sizes), ops.split(step, sizes))
        hi = 2 * self.quantum_num

        def levels(xc, sc, kc):
            # floor(s*v/||v|| + u) + s: the stochastic level, shifted to [0, 2s]. Truncation is
            # floor here (t >= -tiny); the clamp only catches float rounding at +s. (Through
            # int32: float to uint8 directly is twice as slow on CPU, same values in range.)
            t = add_dither(ops, xc * sc, kc, db, s)
            return ops.clamp(ops.cast(ops.cast(t, "int32"), "uint8"), None, hi)

        def write(out, xc, v):
            # the decoded values ``v`` into ``out[1]`` (if asked), ``xc - v`` into ``out[0]``
            if len(out) > 1:
                ops.assign(out[1], v)
            if ops.aliases(out[0], xc):
                ops.assign_sub(out[0], v)
            else:
                ops.assign(out[0], xc - v)

        def levels_and_error(xc, sc, kc, st, *out):
            codes = levels(xc, sc, kc)
            write(out, xc, self._values(ops, codes, st))
            return codes

        full = n // b
        codes = []
        for i, (xr, sr, kr, st) in enumerate(zip(xs, scales, ks, steps)):
            whole = i == 0 and full     # the whole buckets: views of the outputs row by row
            rows = [ops.reshape(ops.slice(o, 0, full * b), (full, b)) for o in outs] \
                if whole else []
            fast = fast_levels(xr, sr, st, kr, s, hi, *rows) if whole and fast_levels else None
            if fast is not None:        # in one compiled pass
                codes.append(ops.flatten(fast))
            elif not outs:
                codes.append(ops.blockwise(levels, xr, sr, kr))
            elif whole:
                codes.append(ops.blockwise(levels_and_error, xr, sr, kr, st, *rows))
            else:                   # the padded last bucket: its real elements only
                c = levels(xr, sr, kr)
                write([ops.slice(o, full * b, n) for o in outs], ops.slice(x, full * b, n),
                      ops.slice(ops.flatten(self._values(ops, c, st)), 0, n - full * b))
                codes.append(ops.flatten(c))
        codes = codes[0] if len(codes) == 1 else ops.cat(codes)
        return [pack(ops, ops.slice(codes, 0, n), self._bits), norms], layout

    def _values(self, ops, codes, step, *acc):
        """``step * (code - s)`` of uint8 ``codes`` (rows, with one step per row), plus
        ``acc[0]`` when given: the decoded values."""
        v = ops.cast(codes, "float32")
        v -= float(self.quantum_num)
        v *= step
        if acc:
            v += acc[0]
        return v

    def decompress(self, payload, ctx):
        return self._decode(payload, ctx)

    def _combine(self, payloads, ctx, out=None, fast_values=None):
        """``combine``, with ``_decode``'s ``fast_values``."""
        total = self._decode(payloads[0], ctx, out, fast_values=fast_values)
        ops = ops_for(total)
        if len(payloads) == 1 or ctx.dtype != "float32" or ops.flat_view(total) is None:
            return self.aggregate([total, *(self.decompress(p, ctx) for p in payloads[1:])])
        for payload in payloads[1:]:
            self._decode(payload, ctx, total, accumulate=True, fast_values=fast_values)
        return total

    def _decode(self, payload, ctx, out=None, accumulate=False, fast_values=None):
        """The payload's values (``norm / s * (code - s)``), into ``out``'s flat view when it
        has one and the values are float32 (added to what ``out`` holds when ``accumulate``),
        else in a new tensor of ``ctx``'s shape and dtype. ``fast_values``: a faster way (a
        speed path's kernel) to the whole buckets' values, called as ``fast_values(codes, step,
        s, out, accumulate)`` with the buckets as rows, returning ``out`` or None where it does
        not apply."""
        packed, norms = payload
        ops, n, b = ops_for(packed), ctx.numel, self.bucket_size
        nb = self._buckets(n)
        s = float(self.quantum_num)
        codes = unpack(ops, packed, self._bits, n)
        step = ops.reshape(norms / s, (nb, 1))

        def values(cc, st, *acc):
            return self._values(ops, cc, st, *acc)

        flat = None
        if out is not None and ctx.dtype == "float32" and ops.dtype(out) == "float32":
            flat = ops.flat_view(out)
        if flat is None:
            if accumulate:
                raise ValueError("qsgd: accumulate needs an out with a float32 flat view")
            codes = ops.reshape(ops.pad(codes, nb * b - n), (nb, b))
            v = ops.blockwise(values, codes, step)
            return restore(ops, ops.slice(v, 0, n), ctx)
        full = n // b
        rows = self._rows(ops, codes, n)
        steps = ops.split(step, [ops.shape(r)[0] for r in rows]) if len(rows) > 1 else [step]
        if full:
            into = ops.slice(flat, 0, full * b)
            if fast_values is None or \
                    fast_values(rows[0], steps[0], s, into, accumulate) is None:
                acc = (ops.reshape(into, (full, b)),) if accumulate else ()
                ops.blockwise(values, rows[0], steps[0], *acc, out=into)
        if n > full * b:
            into = ops.slice(flat, full * b, n)
            acc = (ops.reshape(ops.pad(into, (full + 1) * b - n), (1, b)),) if accumulate else ()
            ops.assign(into, ops.slice(ops.flatten(values(rows[-1], steps[-1], *acc)),
                                       0, n - full * b))
        return out

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


@paths.register(QSGDCompressor)
class QSGDPath(paths.Reference):
    """qsgd's own faster composition on every device: the error written while compressing,
    decodings built in the output buffer (N payloads added into one), an average folded
    into the norms."""

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        """``compress``, also writing ``tensor - decompress(payload)`` into ``error`` and the
        decompression into ``decoded`` (when given) block by block, from the codes while they
        are in cache (the same float operations as ``decompress``, so the same values). Needs
        a float32 ``tensor`` and ``error``/``decoded`` with flat views (torch); else None."""
        outs = self.compressor._error_outs(tensor, error, decoded)
        return None if outs is None else self.compressor._compress(tensor, name, call, outs)

    def decompress_into(self, payload, ctx, out=None):
        """``decompress`` written straight into ``out`` where it has a float32 flat view
        (torch) and the input was float32; else into a new tensor."""
        return self.compressor._decode(payload, ctx, out)

    def combine(self, payloads, ctx, out=None):
        """The sum of every rank's decoded payload, built in one buffer (``out`` when it can
        be written, as in ``decompress_into``): the first payload is decoded into it, each
        other one added block by block, in rank order (the same float sums as ``aggregate``
        of the decompressed tensors, without N dense tensors)."""
        return self.compressor._combine(payloads, ctx, out)

    def divided(self, payload, divisor):
        """The payload with its norms divided by ``divisor``: it decodes to the values divided
        (exactly for a power of two, else within a rounding), without a pass over them."""
        packed, norms = payload
        return [packed, norms / divisor]

