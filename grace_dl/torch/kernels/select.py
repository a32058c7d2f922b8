"""The exact top-k by magnitude on the device, with a static shape and no host
synchronisation: the reference's selection (``sparse.exact_top``: the k largest ``|x|``, NaN
below every number, ties at the k-th to the lowest positions, positions ascending), for the
device path's top-k.

Where ``triton_for`` allows, a radix select (``jit_select``): three histogram passes over the
tensor fix the k-th largest magnitude's bits, 11, 10 and 10 at a time, then a count pass and
a write pass put the kept values and positions in place; about five reads of the tensor and
no sort, where ``torch.topk`` makes four radix passes plus its gather and the magnitudes a
pass of their own. Elsewhere its twin in torch ops (``top_twin``) gives the same entries.
"""

from __future__ import annotations

import torch

from grace_dl.torch.kernels import BLOCK, grid, triton_for

#: the radix passes: (shift, bins) of each digit of the 31-bit keys, most significant first
PASSES = ((20, 2048), (10, 1024), (0, 1024))
#: blocks of a histogram pass's program (its counts are added to the global ones once)
HIST_LOOPS = 4
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _jit():
    from grace_dl.torch.kernels import jit_select
    return jit_select


def top(flat, k: int, sign: int = 0):
    """``(int32 positions, values)`` of the ``k`` largest ``sparse.magnitudes(flat, sign)``
    of the 1-D ``flat`` (``0 < k <= numel``; ``sign`` 0: ``|x|``, 1: the positive entries,
    -1: the negative ones by magnitude): ascending positions, values in ``flat``'s dtype."""
    n = flat.numel()
    if not triton_for(flat) or flat.dtype not in KERNEL_DTYPES:
        return top_twin(flat, k, sign)
    flat = flat.contiguous()
    device = flat.device
    state = torch.zeros(3, dtype=torch.int32, device=device)   # prefix, its bits, rank
    hist = torch.zeros(sum(bins for _, bins in PASSES), dtype=torch.int32, device=device)
    blocks = grid(n)[0]
    kernels, start = _jit(), 0
    for i, (shift, bins) in enumerate(PASSES):
        part = hist[start:start + bins]
        kernels.radix_hist[(-(-blocks // HIST_LOOPS),)](flat, n, state, part, SHIFT=shift,
                                                        BINS=bins, BLOCK=BLOCK,
                                                        LOOPS=HIST_LOOPS, SIGN=sign)
        kernels.radix_pick[(1,)](state, part, k, SHIFT=shift, BINS=bins, FIRST=i == 0)
        start += bins
    counts = torch.empty(2, blocks, dtype=torch.int32, device=device)
    kernels.top_counts[(blocks,)](flat, n, state, counts, blocks, BLOCK=BLOCK, SIGN=sign)
    before = torch.cumsum(counts, 1, dtype=torch.int32) - counts
    positions = torch.empty(k, dtype=torch.int32, device=device)
    values = torch.empty(k, dtype=flat.dtype, device=device)
    kernels.top_write[(blocks,)](flat, n, state, before, blocks, positions, values,
                                 BLOCK=BLOCK, SIGN=sign)
    return positions, values


def top_twin(flat, k: int, sign: int = 0):
    """``top`` in torch ops: the k-th largest magnitude by ``torch.topk``, every entry above
    it and the lowest-placed of those equal to it."""
    wide = flat.to(torch.float32)
    mag = wide.abs()
    keep = mag == mag if sign == 0 else (wide > 0 if sign > 0 else wide < 0)
    mag = torch.where(keep, mag, torch.full_like(mag, -1.0))
    kth = torch.topk(mag, k).values[k - 1:k]
    above, tied = mag > kth, mag == kth
    need = k - above.sum()
    take = above | (tied & (torch.cumsum(tied, 0) <= need))
    kept = positions(take, k)
    return kept.to(torch.int32), flat.index_select(0, kept)


def positions(mask, count: int):
    """The positions of ``mask``'s set elements, of which there are ``count`` (known, so the
    selection has a static size: no read-back), ascending."""
    try:
        return torch.nonzero_static(mask, size=count).reshape(-1)
    except (NotImplementedError, RuntimeError):   # a device without nonzero_static
        rank = torch.cumsum(mask, 0) - 1
        slot = torch.where(mask, rank, count)
        out = torch.zeros(count + 1, dtype=torch.int64, device=mask.device)
        return out.scatter_(0, slot, torch.arange(mask.numel(), device=mask.device))[:count]
