"""The positions of a tensor's ``k`` largest magnitudes on the device, with a static shape
and no host read (``top_positions``).

From ``RADIX_MIN`` elements, what the reference sparsifiers select (``sparse.exact_top``: NaN
below every number, ties at the k-th magnitude to the lowest positions, positions ascending),
by ``radix_positions``: where ``triton_for`` allows, a radix select (``jit_select``), one pass
over the tensor per digit of the magnitudes' float32 bits (``DIGITS``), then one that counts
each block's keys above and at the k-th and one that writes the kept positions in order: seven
reads of the tensor and ten launches, whatever k; elsewhere its twin in torch ops (the k-th
magnitude's value from ``torch.topk``, then the same rule). Below ``RADIX_MIN``, where a call's
launches cost more than its passes, ``torch.topk`` of the magnitudes: the same entries but
for ties at the k-th (``torch.topk``'s own choice), positions in no order.
"""

from __future__ import annotations

import torch

from grace_dl.compressors import sparse
from grace_dl.torch import ops
from grace_dl.torch.kernels import BLOCK, grid, launch, triton_for
from grace_dl.torch.kernels.codes import magnitudes, positions

#: the digits of a 31-bit key, highest first: (shift, bits)
DIGITS = ((25, 6), (19, 6), (13, 6), (7, 6), (0, 7))
#: programs of a histogram pass at most (each takes consecutive blocks)
HISTOGRAM_PROGRAMS = 512
#: the dtypes whose magnitudes the kernels rank (as float32, which keeps their order)
RANKED = (torch.float32, torch.float16, torch.bfloat16)
#: tensors of fewer elements take ``torch.topk`` (docs DECISIONS: an estimate, to be measured)
RADIX_MIN = 1 << 22


def _jit():
    from grace_dl.torch.kernels import jit_select
    return jit_select


def top_positions(flat, k: int, sign: int = 0):
    """int64 positions of the ``k`` largest magnitudes of the 1-D ``flat``
    (``sparse.magnitudes(flat, sign)``; ``0 < k <= numel``; for a ``sign``, at least ``k``
    entries of that sign): ``radix_positions`` from ``RADIX_MIN`` elements, else those of
    ``torch.topk`` (ties its own way, in no order)."""
    if flat.numel() >= RADIX_MIN:
        return radix_positions(flat, k, sign)
    ranked = magnitudes(flat) if sign == 0 else sparse.magnitudes(ops, flat, sign)
    return torch.topk(ranked, k, sorted=False).indices


def radix_positions_twin(flat, k: int, sign: int = 0):
    """``radix_positions`` in torch ops (any floating dtype)."""
    mag = sparse.magnitudes(ops, flat.reshape(-1), sign or None)
    kth = torch.topk(mag, k, sorted=False).values.amin()
    over, tie = mag > kth, mag == kth
    need = k - over.sum()
    keep = over | (tie & (torch.cumsum(tie, 0) <= need))
    return positions(keep, k)


def radix_positions(flat, k: int, sign: int = 0):
    """int64 positions (ascending) of the ``k`` largest magnitudes of the 1-D ``flat``
    (``sparse.magnitudes(flat, sign)``; ``0 < k <= numel``), ties at the k-th going to the
    lowest positions. Needs at least ``k`` entries of magnitude >= 0 for a ``sign``."""
    n = flat.numel()
    if not triton_for(flat) or flat.dtype not in RANKED:
        return radix_positions_twin(flat, k, sign)
    x = flat.contiguous()
    jit = _jit()
    bins = [1 << bits for _, bits in DIGITS]
    # every digit's histogram, then each pass's (prefix, need): one buffer, zeroed once
    scratch = torch.zeros(sum(bins) + 2 * len(DIGITS), dtype=torch.int32, device=x.device)
    hists = torch.split(scratch[:sum(bins)], bins)
    states = torch.split(scratch[sum(bins):], 2)
    blocks = grid(n)[0]
    tiles = -(-blocks // HISTOGRAM_PROGRAMS)
    for p, (shift, bits) in enumerate(DIGITS):
        prev = max(p - 1, 0)
        launch(
            jit.histogram, -(-blocks // tiles), x, states[max(p - 2, 0)], hists[prev],
            states[prev], hists[p], n, k, tiles,
            SIGN=sign, PREV=p > 0, FROM_STATE=p > 1, PREV_BINS=bins[prev],
            PREV_BITS=DIGITS[prev][1], SHIFT=shift, BITS=bits, BINS=bins[p], BLOCK=BLOCK)
    counts = torch.empty(2, blocks, dtype=torch.int64, device=x.device)
    last = len(DIGITS) - 1
    launch(jit.tally, blocks, x, states[last - 1], hists[last], states[last], counts, n, blocks,
           SIGN=sign, BINS=bins[last], BITS=DIGITS[last][1], BLOCK=BLOCK)
    offsets = torch.cumsum(counts, 1) - counts
    out = torch.empty(k, dtype=torch.int64, device=x.device)
    launch(jit.place, blocks, x, states[last], offsets, out, n, blocks, SIGN=sign, BLOCK=BLOCK)
    return out
