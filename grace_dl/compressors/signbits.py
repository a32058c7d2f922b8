"""The 1-bit sign code shared by ``onebit``, ``signsgd``, ``signum`` and ``efsignsgd``.

Code: bit 1 = negative (``x < 0``); bit 0 = everything else, i.e. positive, +0, -0 and NaN.
Bits are packed 8 per byte, little-endian within a byte (``ops.pack_bits`` layout): ``ceil(n/8)``
uint8 for ``n`` elements.

The sign of zero: a 1-bit code cannot carry -1, 0 and +1, so zero joins the positives and decodes
to the positive value (+scale, or the mean of the non-negative entries). This is GRACE's
``tensor >= 0`` convention, costs one comparison per element, and is harmless where a scale or
error feedback follows (efsignsgd, onebit: an all-zero tensor has scale 0, and the memory carries
the difference to the next step). The pure-sign methods (signsgd, signum) have neither, and a
parameter without a gradient must not move, so a tensor that holds exact zeros also sends a
second plane marking them (``pack_signs``); a tensor without zeros sends 1 bit per element.

NaN cannot be told apart in one bit either; each method makes it propagate through what it sends
besides the bits: the fp32 means/scale (a NaN or Inf input makes them non-finite), or, for the
pure-sign methods, a status byte (see ``status``).
"""

from __future__ import annotations

import sys

import numpy as np

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
    number. A sum costs one read of the tensor, much less than ``isfinite`` plus a count.
    (signsgd's compiled encoder, on the CPU path, and the device path test each element
    instead: no false alarm there.)"""
    total = ops.reshape(ops.sum(wide(ops, flat)), [1])
    return 1 - ops.cast(ops.isfinite(total), "uint8")


#: status byte bits of a pure-sign payload
NONFINITE, ZEROS = 1, 2


def pack_signs(ops, neg, zero, status):
    """A pure-sign payload: the negative plane, then the zero plane only where it has a bit
    set (the tensor holds an exact zero), then the status byte: bit 0 (``NONFINITE``) for a
    NaN or Inf in the input, bit 1 (``ZEROS``) when the zero plane is there. ``ceil(n/8) + 1``
    bytes, or ``2 ceil(n/8) + 1``: the size depends on the data (whether it has zeros)."""
    if ops.numel(zero) == 0:        # (no elements: nothing to look at)
        return ops.cat([neg, status])
    return ops.cond(ops.count_nonzero(zero) > 0,
                    lambda: ops.cat([neg, zero, ops.bit_or(status, ZEROS)]),
                    lambda: ops.cat([neg, status]))


def planes(ops, packed, n):
    """A pure-sign payload's (negative, zero) bit planes for ``n`` elements, ``ceil(n/8)`` uint8
    each; the zero plane all clear where the payload has none."""
    nbytes = -(-n // 8)
    neg = ops.slice(packed, 0, nbytes)
    return neg, ops.cond(ops.numel(packed) > nbytes + 1,
                         lambda: ops.slice(packed, nbytes, 2 * nbytes),
                         lambda: ops.bit_xor(neg, neg))


def positive(ops, neg, zero):
    """The positive plane: neither negative nor zero (padding bits past ``n`` included)."""
    return ops.bit_not(ops.bit_or(neg, zero))


def vote(ops, packed_payloads, n):
    """The majority vote of pure-sign payloads as (positive, negative) bit planes, counted on
    the packed bytes, 8 elements per byte operation: ``D = #positive - #negative`` is kept
    bit-sliced in two's complement over ``w = bit_length(N) + 1`` planes (plane i holds bit i
    of every element's D), each rank's positive plane added and negative plane subtracted
    with a ripple carry; the vote is +1 where D > 0 (sign bit clear, some bit set), -1 where
    D < 0 (sign bit set), 0 where D = 0."""
    width = len(packed_payloads).bit_length() + 1
    d = None
    for packed in packed_payloads:
        neg, zero = planes(ops, packed, n)
        pos = positive(ops, neg, zero)
        if d is None:
            d = [ops.bit_xor(pos, pos)] * width
        carry = pos                 # D += pos
        for i in range(width):
            d[i], carry = ops.bit_xor(d[i], carry), ops.bit_and(d[i], carry)
        borrow = neg                # D -= neg
        for i in range(width):
            d[i], borrow = ops.bit_xor(d[i], borrow), ops.bit_and(ops.bit_not(d[i]), borrow)
    sign = d[-1]
    nonzero = d[0]
    for plane in d[1:-1]:
        nonzero = ops.bit_or(nonzero, plane)
    return ops.bit_and(nonzero, ops.bit_not(sign)), sign


#: byte value -> its 8 bits spread to the even bits of a 16-bit word: two planes' bytes
#: interleave into 2-bit codes
_SPREAD = np.array([sum(((b >> i) & 1) << (2 * i) for i in range(8)) for b in range(256)],
                   np.int16)


def ternary(ops, pos, neg, n, dtype: str, out=None):
    """The ``n`` elements +1 where the ``pos`` plane's bit is set, -1 where ``neg``'s is, 0
    where neither: each byte pair interleaved into 2-bit codes (``pack_bits`` layout, code
    ``pos + 2 neg``) through a 256-entry table, then decoded by ``unpack_lookup``; one pass
    over the output, written into the 1-D ``out`` when given (torch)."""
    spread = ops.from_numpy(_SPREAD, like=pos)
    # int16 wraps at bit 15: only the bit pattern matters
    words = ops.bit_or(ops.gather(spread, ops.cast(pos, "int32")),
                       ops.shift_left(ops.gather(spread, ops.cast(neg, "int32")), 1))
    if sys.byteorder == "little":
        codes = ops.reshape(ops.bitcast(words, "uint8"), [-1])
    else:   # the low byte (elements 0-3) first, whatever the memory order
        low = ops.cast(ops.bit_and(words, 255), "uint8")
        high = ops.cast(ops.bit_and(ops.shift_right(words, 8), 255), "uint8")
        codes = ops.reshape(ops.stack([low, high], axis=1), [-1])
    table = ops.cast(ops.from_numpy(np.array([0, 1, -1, 0], np.float32), like=pos), dtype)
    return ops.unpack_lookup(codes, 2, n, table, out)


def flag(ops, packed):
    """A pure-sign payload's NaN/Inf flag, as a 1-element uint8 (1: NaN or Inf in the input):
    bit 0 of its last byte."""
    size = ops.numel(packed)
    return ops.bit_and(ops.slice(packed, size - 1, size), NONFINITE)


def flagged(ops, status):
    """Whether a status byte (or the sum of several ranks') says NaN or Inf: a scalar
    predicate for ``ops.cond``."""
    return ops.sum(ops.cast(status, "int32")) > 0
