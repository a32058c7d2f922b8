"""What the quantizers share: a flat float32 working view of a gradient, the layout that turns
the result back into the gradient's shape and dtype, and byte-aligned bit packing.

fp16/bf16/fp64 gradients are quantized from a float32 copy (fp64 magnitudes beyond the float32
range become +-inf); decompression returns the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from grace_dl.backend import ops_for


@dataclass(frozen=True)
class Layout:
    """The local ctx of a quantizer: what ``restore`` needs (never sent)."""

    shape: tuple
    dtype: str
    numel: int


def flat_f32(tensor):
    """``(ops, x, layout)``: ``x`` is ``tensor`` flattened to 1-D float32. ``x`` may share
    memory with ``tensor``, so callers must not modify it in place."""
    ops = ops_for(tensor)
    layout = Layout(ops.shape(tensor), ops.dtype(tensor), ops.numel(tensor))
    x = ops.flatten(tensor)
    if layout.dtype != "float32":
        x = ops.cast(x, "float32")
    return ops, x, layout


def restore(ops, x, layout: Layout):
    """The 1-D float32 ``x`` back in ``layout``'s dtype and shape."""
    if layout.dtype != "float32":
        x = ops.cast(x, layout.dtype)
    return ops.reshape(x, layout.shape)


def bits_for(levels: int) -> int:
    """Bits needed for ``levels`` distinct codes: ceil(log2(levels)), at least 1."""
    return max(1, (int(levels) - 1).bit_length())


def pack(ops, codes, bits: int):
    """uint8 ``codes`` packed ``bits`` each (8-bit codes are sent as they are, no copy)."""
    return codes if bits == 8 else ops.pack_bits(codes, bits)


def unpack(ops, packed, bits: int, n):
    """The first ``n`` codes of ``pack``'s output, as uint8."""
    return ops.slice(packed, 0, n) if bits == 8 else ops.unpack_bits(packed, bits, n)


def dither_bits(levels: int) -> int:
    """Random bits per element for the dither of a stochastic rounding onto ``levels`` steps per
    unit of the quantizer's range (QSGD's s, TernGrad's 1): the fewer of 8 and 16 bits whose
    bias bound, ``2**-(bits+1)`` of a step (``seeding.dither``), is at most ``2**-15`` of the
    range. 8 bits from ``levels >= 64`` (QSGD's default s = 127: bias <= ||v|| / (127 * 512)),
    16 bits below (TernGrad: bias <= max|v| / 131072)."""
    return 8 if levels >= 64 else 16


def add_dither(ops, t, k, bits: int, offset: float = 0.0):
    """``t + (k + 1/2) / 2**bits + offset``: the float32 ``t`` plus the dither ``u`` of the
    integers ``k`` (``ops.dither``), so that ``floor`` of the result rounds ``t + offset`` up
    with probability within ``2**-(bits+1)`` of its fractional part (``offset`` an integer, or
    any constant exact in float32 with the half step added). ``t`` must be a fresh local tensor
    (torch adds in place)."""
    u = ops.cast(k, "float32")
    u *= 2.0**-bits
    t += u
    t += offset + 2.0**-(bits + 1)
    return t
