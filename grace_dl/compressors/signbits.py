"""The 1-bit sign code shared by ``onebit``, ``signsgd``, ``signum`` and ``efsignsgd``.

Code: bit 1 = negative (``x < 0``); bit 0 = everything else, i.e. positive, +0, -0 and NaN.
Bits are packed 8 per byte, little-endian within a byte (``ops.pack_bits`` layout): ``ceil(n/8)``
uint8 for ``n`` elements.

The sign of zero: a 1-bit code cannot carry -1, 0 and +1, so zero joins the positives and decodes
to the positive value (+scale, or the mean of the non-negative entries). This is GRACE's
``tensor >= 0`` convention, costs one comparison per element, and is harmless where a scale or
error feedback follows (efsignsgd, onebit: an all-zero tensor has scale 0, and the memory carries
the difference to the next step). The pure-sign methods (signsgd, signum) have neither, so they
send a second bit plane marking exact zeros: a parameter without a gradient must not move.

NaN cannot be told apart in one bit either; each method makes it propagate through what it sends
besides the bits: the fp32 means/scale (a NaN or Inf input makes them non-finite), or, for the
pure-sign methods, a status byte (see ``status``).
"""

from __future__ import annotations

NEGATIVE = 1
_WIDE = {"float16": "float32", "bfloat16": "float32"}


def encode(ops, flat):
    """``ceil(n/8)`` uint8: the packed sign bits of the 1-D tensor ``flat``."""
    return ops.pack_compare(flat, "lt", 0)


def decode(ops, bits, n, table, dtype: str):
    """The ``n`` elements coded in ``bits``: ``table[0]`` where the bit is 0 (non-negative),
    ``table[1]`` where it is 1 (negative); ``table`` is a 2-element float tensor, the result has
    ``dtype``. One table-lookup pass."""
    return ops.unpack_lookup(bits, 1, n, ops.cast(table, dtype))


def wide(ops, flat):
    """``flat`` in a dtype fit for summing: half types go to float32 (a float16 sum of a large
    tensor overflows at 65504), float32/float64 stay as they are."""
    target = _WIDE.get(ops.dtype(flat))
    return flat if target is None else ops.cast(flat, target)


def status(ops, flat):
    """A 1-element uint8: 1 if ``flat`` holds a NaN or an Inf, else 0.

    Read from the sum of ``flat`` (float32 for half inputs, float64 for float64): a NaN or Inf
    element makes it non-finite. The only false alarm is a finite tensor whose sum exceeds
    float range (|sum| > 3.4e38 in float32); decoding then gives NaN, loudly, not a wrong
    number. A sum costs one read of the tensor, much less than ``isfinite`` plus a count."""
    total = ops.reshape(ops.sum(wide(ops, flat)), [1])
    return 1 - ops.cast(ops.isfinite(total), "uint8")


def nan_if(ops, flag):
    """A 1-element float32: NaN where the status byte ``flag`` is set, else 0 (added to a decode
    table, it turns every decoded element into NaN)."""
    like = flag
    return ops.where(flag > 0, ops.full([1], float("nan"), "float32", like=like),
                     ops.zeros([1], "float32", like=like))



def codes(ops, packed, n):
    """The ``n`` elements of a pure-sign payload (sign plane, zero plane, status byte: see
    ``signsgd``) as int8 ``1 - sign``: 0 where positive, 1 where zero, 2 where negative. From
    the unpacked bytes of the two planes, without any float pass."""
    nbytes = (ops.numel(packed) - 1) // 2
    neg = ops.unpack_bits(ops.slice(packed, 0, nbytes), 1, n)
    zero = ops.unpack_bits(ops.slice(packed, nbytes, 2 * nbytes), 1, n)
    return ops.cast(neg * 2 + zero, "int8")


def flag(ops, packed):
    """A pure-sign payload's status byte, as a 1-element uint8 (1: NaN or Inf in the input)."""
    nbytes = (ops.numel(packed) - 1) // 2
    return ops.slice(packed, 2 * nbytes, 2 * nbytes + 1)


def values(ops, signs, status, dtype: str, out=None):
    """``signs`` (-1/0/+1 integers) in ``dtype``, or NaN everywhere when ``status`` is set;
    written into the 1-D ``out`` (cast on the copy: one pass) when given."""
    def nan():
        full = ops.full(ops.shape(signs), float("nan"), dtype, like=signs)
        return full if out is None else ops.assign(out, full)

    def finite():
        return ops.cast(signs, dtype) if out is None else ops.assign(out, signs)

    return ops.cond(ops.sum(ops.cast(status, "int32")) > 0, nan, finite)
