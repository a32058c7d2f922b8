"""Tensor-ops backend for PyTorch tensors.

``grace_dl.tensorflow.ops`` has the same functions with the same meaning; algorithms in
``grace_dl.compressors`` / ``grace_dl.memory`` / ``grace_dl.communicators`` call them through
``grace_dl.backend.ops_for(tensor)`` and never import a framework themselves. Python operators
(``+ - * / < >= &``) work on tensors of both frameworks and are used directly.

Conventions: dtypes are named by strings ("float32", "float16", "bfloat16", "float64", "uint8",
"int8", "int32", "int64", "bool"); ``like`` arguments give the device of newly created tensors;
index tensors returned here are int64.
"""

from __future__ import annotations

import functools
import math
import sys

import numpy as np
import torch

from grace_dl import seeding
from grace_dl.torch.kernels import _EMULATED, codes, philox
from grace_dl.torch.kernels import on_device as _on_device_path

NAME = "torch"

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "uint16": torch.uint16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


# ------------------------------------------------------------------ dtype, shape
def dtype(x) -> str:
    return _NAMES[x.dtype]


def cast(x, dt: str):
    return x.to(_DTYPES[dt])


def shape(x) -> tuple:
    return tuple(x.shape)


# The framework's own functions where they mean exactly the protocol's (no Python frame of
# ours on a step's path: a step calls these dozens of times per tensor).
numel = torch.numel
is_floating = torch.Tensor.is_floating_point


def nbytes(x) -> int:
    return x.numel() * x.element_size()


reshape = torch.reshape
flatten = torch.flatten      # (a 1-D view, or x itself where it is 1-D; a copy only where needed)


def transpose(x):
    return x.t()


def permute(x, perm):
    """Reorder the axes of ``x``: axis ``i`` of the result is axis ``perm[i]`` of ``x``
    (``numpy.transpose(x, perm)``)."""
    return x.permute(*perm)


# ------------------------------------------------------------------ creation
def zeros(shp, dt: str = "float32", like=None):
    shp = (shp,) if isinstance(shp, int) else tuple(shp)
    return torch.zeros(shp, dtype=_DTYPES[dt], device=None if like is None else like.device)


def zeros_like(x):
    return torch.zeros_like(x)


def ones_like(x):
    return torch.ones_like(x)


def full(shp, value, dt: str = "float32", like=None):
    shp = (shp,) if isinstance(shp, int) else tuple(shp)
    return torch.full(shp, value, dtype=_DTYPES[dt], device=None if like is None else like.device)


def from_numpy(arr, like=None):
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return t if like is None or like.device.type == "cpu" else t.to(like.device)


def to_numpy(x) -> np.ndarray:
    x = x.detach()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.cpu().numpy()


# ------------------------------------------------------------------ devices
def _host(x) -> bool:
    """Whether ``x`` takes the host (CPU) code: a CPU tensor off the device path
    (``grace_dl.torch.kernels.emulate_device`` puts CPU tensors on it, as on a GPU)."""
    return x.device.type == "cpu" and not _on_device_path(x)


def device_type(x) -> str:
    """Where ``x`` lives: ``"cpu"``, ``"gpu"``, or ``""`` when not known yet (TF graph tensors
    before placement)."""
    kind = x.device.type
    return "gpu" if kind == "cuda" else kind


def to_host(x):
    """``x`` in host (CPU) memory; ``x`` itself when it is there already."""
    return x.cpu()


def to_device(x, like):
    """``x`` on ``like``'s device; ``x`` itself when it is there already."""
    return x.to(like.device)


# ------------------------------------------------------------------ math
abs = torch.abs  # noqa: A001
sign = torch.sign
sqrt = torch.sqrt
ceil = torch.ceil
maximum = torch.maximum
minimum = torch.minimum
isfinite = torch.isfinite


clamp = torch.clamp      # (x, lo, hi): lo or hi may be None
where = torch.where


def cond(pred, true_fn, false_fn):
    """``true_fn()`` if the scalar ``pred`` holds, else ``false_fn()`` (``tf.cond`` in TF, so a
    data-dependent branch also works inside ``tf.function``)."""
    return true_fn() if bool(pred) else false_fn()


def logical_and(a, b):
    return a & b


def bit_and(a, b):
    return a & b


def bit_or(a, b):
    return a | b


def bit_xor(a, b):
    return a ^ b


def bit_not(x):
    return ~x


def bitcast(x, dt: str):
    """Reinterpret the bits of ``x`` as dtype ``dt`` of the same width (float32 <-> int32)."""
    return x.view(_DTYPES[dt])


def to_bytes(x):
    """The bytes of ``x`` (any shape, row-major) as a 1-D uint8 tensor: a view where ``x`` is
    contiguous."""
    x = x.reshape(-1)
    if x.numel() == 0:      # (an empty tensor may have stride 0, which ``view`` refuses)
        return x.new_empty(0, dtype=torch.uint8)
    return x if x.dtype == torch.uint8 else x.contiguous().view(torch.uint8)


def from_bytes(b, dt: str):
    """1-D uint8 ``b`` read as a 1-D tensor of dtype ``dt``: a view where ``b`` starts on a
    multiple of ``dt``'s width in its storage, else a copy."""
    want = _DTYPES[dt]
    if want == torch.uint8:
        return b
    if b.storage_offset() % want.itemsize or not b.is_contiguous():
        b = b.clone()
    return b.view(want)


def shift_left(x, n: int):
    """``x << n`` for integer tensors."""
    return x << n


def shift_right(x, n: int):
    """``x >> n`` for integer tensors (arithmetic for signed dtypes, as TF's)."""
    return x >> n


def _reduce(fn, x, axis):
    return fn(x) if axis is None else fn(x, dim=axis)


def sum(x, axis=None):  # noqa: A001
    return _reduce(torch.sum, x, axis)


def mean(x, axis=None):
    return _reduce(torch.mean, x, axis)


def max(x, axis=None):  # noqa: A001
    return torch.amax(x) if axis is None else torch.amax(x, dim=axis)


def min(x, axis=None):  # noqa: A001
    return torch.amin(x) if axis is None else torch.amin(x, dim=axis)


def norm(x, axis=None):
    """L2 norm (of everything, or along ``axis``)."""
    return torch.linalg.vector_norm(x) if axis is None else torch.linalg.vector_norm(x, dim=axis)


def abs_sum(x):
    """Sum of ``|x|`` over all elements (the L1 norm), in ``x``'s dtype, without building |x|."""
    return torch.linalg.vector_norm(x, 1)


def abs_max(x):
    """``max |x|`` over all (at least one) elements, 0-d, without building |x|; NaN when ``x``
    holds a NaN or an infinity. One pass (``aminmax``)."""
    lo, hi = torch.aminmax(x)
    m = torch.maximum(hi, -lo)
    return m + 0.0 * m


#: a 0-d tensor of ``x``'s dtype: -0.0 when every entry of ``x`` (at least one) is finite,
#: else NaN; one pass, and on the device path one kernel (``grace_dl.torch.kernels.codes``)
nonfinite_mark = codes.nonfinite_mark


def count_nonzero(x):
    """Number of nonzero (True) elements, an int64 scalar tensor."""
    return torch.count_nonzero(x)


#: on the CPU, a product over an inner dimension this small is a sum of outer products
OUTER_MAX_INNER = 4


def matmul(a, b):
    """``a @ b``; 2-D products over a small inner dimension as outer products (``_product``)."""
    return _product(a, b)


#: the reduced QR factors ``(q, r)`` of a k x r matrix (k >= r), by Householder reflections
#: (LAPACK on the CPU, cuSOLVER on a GPU)
qr = torch.linalg.qr


def _product(a, b, out=None, alpha=None):
    """``a @ b`` (into ``out`` when given; ``out += alpha * a @ b`` with ``alpha``). On the
    CPU a product over an inner dimension of at most ``OUTER_MAX_INNER`` with a large result
    (PowerSGD's ``P @ Q.T`` and its error feedback) is a sum of outer products: torch's CPU
    GEMM is several times slower there on matrices whose rows are a power of two floats long
    (for the same reason PowerSGD computes ``P.T @ M``, not ``M.T @ P``; measured in
    ``docs/DECISIONS.md``). Each element is the same sum of products, added in another order.
    A product by a row-major skinny right factor (PowerSGD's ``M @ Q``: at most
    ``OUTER_MAX_INNER`` columns) takes it column-major: the same GEMM is 3-4x faster there
    (2048 x 2048 times 2048 x 2: 3.5 against 1.3 ms with the copy, this project's 2-core host)."""
    if a.dim() == 2 and b.dim() == 2 and a.device.type == "cpu":
        (n, k), m = a.shape, b.shape[1]
        if 0 < k <= OUTER_MAX_INNER and n * m > k * (n + m):
            rows = b.contiguous()
            if alpha is None:
                out = torch.outer(a[:, 0], rows[0], out=out)
            for i in range(0 if alpha is not None else 1, k):
                out.addr_(a[:, i], rows[i], alpha=1 if alpha is None else alpha)
            return out
        if 1 < m <= OUTER_MAX_INNER and b.is_contiguous() and n * k > m * (n + k):
            b = b.t().contiguous().t()     # a row-major skinny right factor: column-major
    if alpha is None:
        return torch.matmul(a, b, out=out)
    if a.dim() == 2 and b.dim() == 2:
        return out.addmm_(a, b, alpha=alpha)
    return out.add_(a @ b, alpha=alpha)


# ------------------------------------------------------------------ joining, slicing, indexing
def cat(xs, axis=0):
    return torch.cat(list(xs), dim=axis)


def stack(xs, axis=0):
    return torch.stack(list(xs), dim=axis)


def split(x, sizes):
    return list(torch.split(x, list(sizes)))


def numels(xs):
    """A 1-D int32 tensor holding the element count of each tensor in ``xs``."""
    return torch.tensor([x.numel() for x in xs], dtype=torch.int32)


def split_by(x, lengths):
    """Split 1-D ``x`` into pieces whose lengths are the entries of the 1-D int tensor
    ``lengths`` (known only at run time, e.g. received from other ranks)."""
    return list(torch.split(x, [int(n) for n in lengths.tolist()]))


def slice(x, start: int, stop: int):  # noqa: A001
    return x[start:stop]


def pad(x, n: int):
    """Append ``n`` zeros to a 1-D tensor."""
    if n == 0:
        return x
    return torch.cat([x, x.new_zeros(n)])


def topk(x, k: int):
    """The ``k`` largest entries of a 1-D tensor: (values, int64 indices)."""
    return torch.topk(x, k, sorted=False)


def kth_largest(x, k):
    """The ``k``-th largest entry of a 1-D tensor with no NaN (``0 < k <= numel``): the value
    ``min(topk(x, k)[0])`` is, by a selection instead of a partial sort (on CPU NumPy's
    introselect, far cheaper than ``torch.topk``'s partial sort there; the CPU path's radix
    select is ``grace_dl.native.paths``')."""
    k = int(k)
    n = x.numel()
    if _host(x) and x.dtype in (torch.float32, torch.float64):
        a = x.detach().numpy()
        return torch.tensor(np.partition(a, n - k)[n - k], dtype=x.dtype)
    return torch.kthvalue(x, n - k + 1).values


def gather(x, idx):
    if idx.dim() == 1 and idx.dtype in (torch.int64, torch.int32):
        return torch.index_select(x, 0, idx)  # same result as x[idx], several times faster
    return x[idx]


def scatter(idx, values, n: int):
    """A dense 1-D tensor of length ``n``: zeros, with ``values`` at ``idx`` (idx distinct)."""
    out = values.new_zeros(n)
    out[idx] = values
    return out


def scatter_add(idx, values, n: int):
    """Like ``scatter`` but duplicate indices add up."""
    out = values.new_zeros(n)
    out.index_add_(0, idx, values)
    return out


def bincount(idx, n: int):
    """How often each of 0..n-1 occurs in the 1-D int tensor ``idx`` (all in range), as
    float32 (the counts of ``scatter_add(idx, ones, n)``, without building the ones)."""
    return torch.bincount(idx, minlength=n).to(torch.float32)


def nonzero(mask):
    """int64 indices where a 1-D bool tensor is true."""
    if _host(mask):  # NumPy's is several times faster than torch's on CPU
        return torch.from_numpy(np.flatnonzero(mask.numpy()).astype(np.int64, copy=False))
    return torch.nonzero(mask, as_tuple=False).reshape(-1)


def positions_at_least(flat, thr, sign=None):
    """int64 positions of the 1-D ``flat``'s entries whose magnitude reaches the scalar
    ``thr``: ``|x| >= thr`` (``sign`` None), ``x >= thr`` (1) or ``x <= -thr`` (-1); NaN never.
    On CPU, fp32/fp64 through NumPy chunk by chunk (cheaper than torch's compare, or and
    nonzero over the whole tensor; the CPU path's one compiled pass is
    ``grace_dl.native.paths``')."""
    if not _host(flat) or flat.dtype not in (torch.float32, torch.float64):
        if sign is None:
            return nonzero(flat.abs() >= thr)
        return nonzero(flat >= thr if sign > 0 else flat <= -thr)
    t = thr.item() if torch.is_tensor(thr) else thr
    return torch.from_numpy(_positions_numpy(flat.detach().numpy(), t, sign))


_CHUNK = 1 << 16   # elements NumPy compares at a time: the mask stays in cache


def _positions_numpy(a: np.ndarray, thr: float, sign=None) -> np.ndarray:
    """``positions_at_least`` of a NumPy array, chunk by chunk (the compiled scan's twin)."""
    t = a.dtype.type(thr)
    found = []
    for start in range(0, a.size, _CHUNK):
        c = a[start:start + _CHUNK]
        mask = np.abs(c) >= t if sign is None else (c >= t if sign > 0 else c <= -t)
        idx = np.flatnonzero(mask)
        if idx.size:
            found.append(idx + start if start else idx)
    return np.concatenate(found) if found else np.empty(0, np.int64)


def sort(x):
    """The elements of a 1-D tensor in ascending order."""
    return torch.sort(x).values


def bucketize(x, boundaries):
    """int32 bucket of each element of 1-D ``x`` against the sorted 1-D ``boundaries``: the number
    of boundaries <= the element (so bucket i holds boundaries[i-1] <= x < boundaries[i])."""
    return torch.bucketize(x, boundaries, right=True, out_int32=True)


# ------------------------------------------------------------------ the wire (payload parts)
# ``grace_dl.communicators.wire``'s layout work on a payload's parts, each in one call: a
# step runs them for every tensor it sends, so the loops stay here, in the framework's terms.
def flat_parts(payload):
    """(each part of ``payload`` as 1-D, the parts' shapes)."""
    flats, shapes = [], []
    for p in payload:
        flats.append(p.reshape(-1))
        shapes.append(tuple(p.shape))
    return flats, shapes


def part_layout(flats):
    """``(dtype, bytes)`` of each 1-D part, or None where one is ``bool`` (its bytes do not
    travel packed)."""
    out = []
    for f in flats:
        if f.dtype == torch.bool:
            return None
        out.append((_NAMES[f.dtype], f.numel() * f.element_size()))
    return out


def pack_parts(flats):
    """The 1-D parts' bytes one after another, as one 1-D uint8 tensor."""
    chunks = []
    for f in flats:     # (``to_bytes`` of each, inline)
        if f.dtype == torch.uint8:
            chunks.append(f)
        elif f.numel() == 0:
            chunks.append(f.new_empty(0, dtype=torch.uint8))
        else:
            chunks.append(f.contiguous().view(torch.uint8))
    return torch.cat(chunks)


def pack_ragged(flats):
    """One rank's block for a gather of parts whose lengths differ across ranks: the parts'
    element counts (int32), then their bytes, as one 1-D uint8 tensor (``unpack_ragged``)."""
    counts = torch.tensor([f.numel() for f in flats], dtype=torch.int32,
                          device=flats[0].device)
    return torch.cat([counts.view(torch.uint8), *(to_bytes(f) for f in flats)])


def unpack_ragged(buffer, dtypes: list, size: int) -> list:
    """``size`` ``pack_ragged`` blocks one after another in ``buffer`` (a gather, in rank
    order) cut into ``pieces[i][r]``: rank r's part i, read as ``dtypes[i]``. Each block's
    counts are read where it starts (one host read a rank: the blocks' sizes are data)."""
    n, at = len(dtypes), 0
    widths = [_DTYPES[d].itemsize for d in dtypes]
    cuts = []
    for _ in range(size):
        counts = buffer[at:at + 4 * n].clone().view(torch.int32).tolist()
        cuts.append(4 * n)
        at += 4 * n
        for c, w in zip(counts, widths):
            cuts.append(c * w)
            at += c * w
    if at != buffer.numel():
        raise ValueError(f"a gather of {size} ragged blocks of {n} parts ({dtypes}) holds "
                         f"{buffer.numel()} bytes; its blocks' counts say {at}")
    cut = torch.split(buffer, cuts)
    return [[from_bytes(cut[r * (n + 1) + 1 + i], d) for r in range(size)]
            for i, d in enumerate(dtypes)]


def unpack_parts(buffer, layouts: list) -> list:
    """``buffer``'s segments (one per entry of ``layouts``, each ``part_layout``'s list of its
    packed parts; ``[]``: an empty segment) cut into ``pieces[i][s]``: part i of non-empty
    segment s, read as its dtype."""
    sizes = []
    for parts in layouts:
        total = 0
        for _, n in parts:
            total += n
        sizes.append(total)
    segments = torch.split(buffer, sizes)
    pieces = None
    for b, parts in zip(segments, layouts):
        if not parts:
            continue
        if pieces is None:
            pieces = []
            for _ in parts:
                pieces.append([])
        at = 0
        for i, (dt, n) in enumerate(parts):
            pieces[i].append(from_bytes(b[at:at + n], dt))
            at += n
    return pieces or []


def add_to_floating(parts, scalar) -> list:
    """``parts`` with the 0-d ``scalar`` (cast to each one's dtype) added to the floating-point
    ones (``communicators.base.marked``)."""
    out = []
    for p in parts:
        out.append(p + scalar.to(p.dtype) if p.is_floating_point() else p)
    return out


def total_nbytes(xs) -> int:
    """The bytes of the tensors ``xs`` together."""
    total = 0
    for x in xs:
        total += x.numel() * x.element_size()
    return total


def shaped_parts(pieces, shapes, ranks: int, equal_sizes: bool = True) -> list:
    """Every rank's payload from the 1-D ``pieces[i][r]`` (part i of rank r), each part in the
    layout of the local part's shape ``shapes[i]``: that exact shape when sizes are equal
    across ranks, else the same trailing dimensions with a free first one."""
    payloads = []
    for r in range(ranks):
        payload = []
        for part, shp in zip(pieces, shapes):
            piece = part[r]
            if equal_sizes or len(shp) == 0:
                piece = piece.reshape(shp)
            elif len(shp) > 1:
                piece = piece.reshape((-1, *shp[1:]))
            payload.append(piece)
        payloads.append(payload)
    return payloads


# ------------------------------------------------------------------ seeded randomness
# On the device path (a GPU, or ``kernels.emulate_device()``) every draw is made where ``like``
# lives by Philox keyed by (seed, name, step, stream) (``grace_dl.torch.kernels.philox``): no
# host draw, no copy. Elsewhere the reference stream of ``grace_dl.seeding``, shared with TF.
def _on_device(like) -> bool:
    return like is not None and _on_device_path(like)


def uniform(seed: int, name: str, step, n: int, like=None, stream: int = 0):
    if _on_device(like):
        return philox.uniform_twin_of(philox.words(philox.device_key(seed, name), int(step),
                                                   stream, n, like))
    return from_numpy(seeding.uniform(seed, name, int(step), n, stream), like)


def choice(seed: int, name: str, step, n: int, k: int, like=None):
    if _on_device(like):
        return philox.choice(philox.device_key(seed, name), int(step), n, k, like)
    return from_numpy(seeding.choice(seed, name, int(step), n, k), like)


def dither(seed: int, name: str, step, n: int, bits: int = 16, like=None, stream: int = 0):
    """``n`` uniform integers in ``[0, 2**bits)``, uint8 (8 bits) or uint16 (16 bits): the dither
    ``u = (k + 1/2) / 2**bits`` of a stochastic rounding, whose bias is at most
    ``2**-(bits + 1)`` of a step (``seeding.dither``; on the device path the top ``bits`` bits
    of Philox words)."""
    if _on_device(like):
        if bits not in seeding.DITHER_BITS:
            raise ValueError(f"bits must be one of {list(seeding.DITHER_BITS)}, got {bits}")
        w = philox.words(philox.device_key(seed, name), int(step), stream, n, like)
        return (w >> (32 - bits)).to(torch.uint8 if bits == 8 else torch.uint16)
    return from_numpy(seeding.dither(seed, name, int(step), n, bits, stream), like)


def normal(seed: int, name: str, step, shape, like=None):
    """Standard normal float32 draws of ``shape`` (PowerSGD's first Q)."""
    if _on_device(like):
        return philox.normal(philox.device_key(seed, name), int(step), tuple(shape), like)
    return from_numpy(seeding.normal(seed, name, int(step), shape), like)


# ------------------------------------------------------------------ blockwise evaluation
# Elements per block of ``blockwise`` (and of ``unpack_lookup``'s gather): with one intra-op
# thread, 512 KB of float32 (cache-sized, and few enough blocks that per-op dispatch stays
# small); with several, torch's intra-op grain (32768), so each block's ops run on the calling
# thread: hundreds of small parallel regions cost more in waking and joining threads (far more
# on a loaded machine) than they save.
BLOCK = 1 << 17
BLOCK_THREADED = 1 << 15


def _block() -> int:
    return BLOCK if torch.get_num_threads() == 1 else BLOCK_THREADED


def blockwise(fn, *xs, out=None):
    """``flatten(fn(*xs))`` for a row-wise ``fn``: all ``xs`` have the same number of rows (axis 0)
    and ``fn`` of a block of rows is the matching part of ``fn`` of all of them. ``out``: a 1-D
    tensor of the result's length to write the result into (and return) instead of a new one;
    ``fn`` may read ``out``'s block through one of ``xs`` (each block is computed before it is
    written).

    Here ``fn`` runs on blocks of about ``BLOCK`` elements of ``xs[0]`` (a whole number of rows,
    each block but the last a multiple of 8 elements, so ``fn`` may bit-pack) and the results
    are written into one output: the temporaries of an elementwise chain stay in cache and are
    reused, instead of each being a fresh tensor of the whole size (torch's CPU allocator maps
    every large tensor anew, so each costs page faults on top of a pass over memory). Every block
    but the last must give the same number of results. TF evaluates ``fn(*xs)`` once.
    """
    # (this module's ``max`` is the tensor one)
    if not _host(xs[0]):  # GPU memory is pooled; one launch per op is cheaper
        return _written(fn(*xs).reshape(-1), out)
    rows = xs[0].shape[0] if xs[0].dim() else 1
    per_row = (xs[0].numel() // rows if rows else 0) or 1
    align = 8 // math.gcd(per_row, 8)
    step = -(-(_block() // per_row or 1) // align) * align
    if rows <= step or xs[0].dim() == 0:
        return _written(fn(*xs).reshape(-1), out)
    if out is not None:
        pos = 0
        for start in range(0, rows, step):
            got = fn(*(x[start:start + step] for x in xs)).reshape(-1)
            out[pos:pos + got.numel()] = got
            pos += got.numel()
        if pos != out.numel():
            raise ValueError(f"blockwise: out has {out.numel()} elements, the result {pos}")
        return out
    starts = range(0, rows, step)
    first = fn(*(x[:step] for x in xs)).reshape(-1)
    last = fn(*(x[starts[-1]:] for x in xs)).reshape(-1)
    m = first.numel()
    out = first.new_empty(m * (len(starts) - 1) + last.numel())
    out[:m] = first
    out[m * (len(starts) - 1):] = last
    for i in range(1, len(starts) - 1):
        start = starts[i]
        out[i * m:(i + 1) * m] = fn(*(x[start:start + step] for x in xs)).reshape(-1)
    return out


def _written(result, out):
    """``result`` (1-D), or ``out`` holding it."""
    if out is None:
        return result
    if out.numel() != result.numel():
        raise ValueError(f"blockwise: out has {out.numel()} elements, the result "
                         f"{result.numel()}")
    return out.copy_(result)


# ------------------------------------------------------------------ bit packing
def pack_bits(codes, bits: int):
    """Pack unsigned codes (< 2**bits, any int dtype) into a uint8 tensor, ``bits`` each.

    Codes are laid out little-endian within each byte; the result has ceil(n*bits/8) bytes.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    codes = codes.reshape(-1).to(torch.uint8)
    n = codes.numel()
    if bits == 8:
        return codes.clone()
    if sys.byteorder == "little" and bits in (2, 4):
        return _pack_lanes(codes, bits)
    if sys.byteorder == "little":
        return _pack_words(codes, bits)
    if 8 % bits == 0:
        per = 8 // bits
        codes = pad(codes, (-n) % per).reshape(-1, per)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        return (codes << shifts).sum(dim=1, dtype=torch.uint8)
    # Widths that do not divide 8: expand to a bit stream, regroup by 8.
    shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    stream = ((codes.unsqueeze(1) >> shifts) & 1).reshape(-1)
    stream = pad(stream, (-stream.numel()) % 8).reshape(-1, 8)
    weights = torch.arange(8, dtype=torch.uint8, device=codes.device)
    return (stream << weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed, bits: int, n: int):
    """Inverse of ``pack_bits``: the first ``n`` codes, as uint8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    packed = packed.reshape(-1)
    if bits == 8:
        return packed[:n].clone()
    if bits == 1 and _host(packed):  # NumPy's unpackbits: ~10x the shifts below
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little"))
    if 8 % bits and sys.byteorder == "little":
        return _unpack_words(packed, bits, n)
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        return ((packed.unsqueeze(1) >> shifts) & mask).reshape(-1)[:n]
    weights = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.unsqueeze(1) >> weights) & 1).reshape(-1)[: n * bits].reshape(n, bits)
    shifts = torch.arange(bits, dtype=torch.uint8, device=packed.device)
    return (stream << shifts).sum(dim=1, dtype=torch.uint8)


def _replicate(value: int, period: int) -> int:
    """``value`` repeated every ``period`` bits across a 64-bit word."""
    word = 0
    for shift in range(0, 64, period):  # (this module's ``sum`` is the tensor one)
        word |= value << shift
    return word


# Eight b-bit codes <-> one 64-bit word: the codes' bytes are folded pairwise (8 -> 16 -> 32 ->
# 64-bit lanes), the word's low b bytes being the packed stream (little-endian hosts). A few
# whole-tensor shift/and/or passes over n/8 words, instead of a bit per element.
_WORD_STEPS = ((8, 1), (16, 2), (32, 4))


def _pack_lanes(codes, bits: int):
    """2- or 4-bit codes, little-endian host: the ``8 // bits`` codes of a byte read as one
    int32 (int16) lane and folded into its low byte by shift-ors: a few passes over n/4 (n/2)
    lanes."""
    per = 8 // bits
    n = codes.numel()
    if n == 0:
        return codes.new_zeros(0)
    if n % per or codes.storage_offset() % per or not codes.is_contiguous():
        codes = torch.cat([codes, codes.new_zeros((-n) % per)])
    if bits == 4:  # c0 | c1 << 8 -> c0 | c1 << 4
        v = codes.view(torch.int16)
        v = v | (v >> 4)
    else:  # c0 | c1 << 8 | c2 << 16 | c3 << 24 -> c0 | c1 << 2 | c2 << 4 | c3 << 6
        v = codes.view(torch.int32)
        v = v | (v >> 6)
        v |= v >> 12
    return v.to(torch.uint8)


def _pack_words(codes, bits: int):
    n = codes.numel()
    if n == 0:
        return codes.new_zeros(0)
    codes = codes.contiguous()
    if n % 8 or codes.storage_offset() % 8:
        codes = torch.cat([codes, codes.new_zeros((-n) % 8)])
    v = codes.view(torch.int64)
    for lane, mult in _WORD_STEPS:
        keep = _replicate((1 << bits * mult) - 1, 2 * lane)
        v = (v & keep) | ((v >> (lane - bits * mult)) & (keep << bits * mult))
    return v.view(torch.uint8).reshape(-1, 8)[:, :bits].reshape(-1)[: packed_size(n, bits)]


def _unpack_words(packed, bits: int, n: int):
    if n == 0:
        return packed.new_zeros(0)
    words = -(-n // 8)
    p = packed[: words * bits]
    if p.numel() < words * bits:
        p = torch.cat([p, p.new_zeros(words * bits - p.numel())])
    p = p.reshape(words, bits)
    v = torch.cat([p, p.new_zeros(words, 8 - bits)], 1).view(torch.int64).reshape(-1)
    for lane, mult in reversed(_WORD_STEPS):
        keep = _replicate((1 << bits * mult) - 1, 2 * lane)
        v = (v & keep) | ((v << (lane - bits * mult)) & (keep << lane))
    return v.view(torch.uint8)[:n]


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``pack_bits`` produces for ``n`` codes."""
    return math.ceil(n * bits / 8)


def pack_mask(mask):
    """Pack a boolean tensor (or nonzero-ness of any tensor) into bits: the same ``ceil(n/8)``
    uint8 as ``pack_bits(mask, 1)``, built from n/8 int64 words by three shift-ors instead of
    ``pack_bits``' general per-code path (the 1-bit sign methods pack every element)."""
    m = mask.reshape(-1)
    if m.dtype != torch.bool:
        m = m != 0
    if sys.byteorder != "little":
        return pack_bits(m, 1)
    n = m.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8, device=m.device)
    if _host(m):  # NumPy's packbits: ~10x faster than the shift-ors below
        return torch.from_numpy(np.packbits(m.numpy(), bitorder="little"))
    m = m.view(torch.uint8)
    if n % 8 or m.storage_offset() % 8 or not m.is_contiguous():
        m = torch.cat([m, m.new_zeros((-n) % 8)])
    # Byte i of a word holds bit i of the result: fold bytes 8 -> 4 -> 2 -> 1.
    v = m.view(torch.int64)
    v = v | (v >> 7)
    v |= v >> 14
    v |= v >> 28
    return (v & 0xFF).to(torch.uint8)


COMPARISONS = {"lt": (torch.lt, np.less), "eq": (torch.eq, np.equal)}


def pack_compare(x, cmp: str, value):
    """The packed bits (``pack_mask`` layout) of ``x <cmp> value`` elementwise, ``cmp`` one
    of ``COMPARISONS``: the sign codes' planes, without a separate boolean tensor
    (NumPy's comparison on the CPU: several times torch's into bool)."""
    if cmp not in COMPARISONS:
        raise ValueError(f"cmp must be one of {sorted(COMPARISONS)}, got {cmp!r}")
    flat = x.reshape(-1)
    if _host(flat) and sys.byteorder == "little" and flat.dtype in _NUMPY_CMP:
        mask = COMPARISONS[cmp][1](flat.detach().numpy(), value)
        return torch.from_numpy(np.packbits(mask, bitorder="little"))
    return pack_mask(COMPARISONS[cmp][0](flat, value))


_NUMPY_CMP = (torch.float32, torch.float64, torch.float16)


def unpack_lookup(packed, bits: int, n, table, out=None):
    """Decode through a table: ``table[code]`` for each of the first ``n`` ``bits``-wide codes of
    ``packed`` (``pack_bits`` layout). ``table`` is 1-D with ``2**bits`` entries and gives the
    result's dtype. One gather of a 256-row table (each byte value's codes, already decoded), so
    unpacking and decoding cost a single pass over the output. ``bits`` must divide 8.
    ``out``: a contiguous tensor of ``n`` elements of the table's dtype to write the result
    into (and return) instead of a new one."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be one of [1, 2, 4, 8], got {bits}")
    if table.numel() != 1 << bits:
        raise ValueError(f"table must have {1 << bits} entries for {bits}-bit codes, "
                         f"got {table.numel()}")
    per = 8 // bits
    expanded = table.reshape(-1)[_byte_codes(bits, table.device)]
    packed = packed.reshape(-1)
    result = expanded.new_empty(n) if out is None else out.view(-1)
    full = n // per   # whole bytes by the table's rows; the last partial one by itself
    if full:
        _lookup_into(expanded, packed[:full], result[:full * per].view(full, per), per)
    if n > full * per:
        result[full * per:] = expanded[packed[full].long()][:n - full * per]
    return result if out is None else out


@functools.lru_cache(maxsize=None)
def _byte_codes(bits: int, device):
    """The ``8 // bits`` codes of each byte value, a (256, 8 // bits) int64 tensor made once
    per device."""
    per = 8 // bits
    codes = (np.arange(256)[:, None] >> (bits * np.arange(per))) & ((1 << bits) - 1)
    return torch.from_numpy(codes).to(device)


def _lookup_into(expanded, packed, out, per: int):
    """``out[i] = expanded[packed[i]]`` (rows of ``per`` values); on the CPU block by block,
    so that the int32 indices stay in cache."""
    if per == 1:
        expanded, out = expanded.reshape(-1), out.reshape(-1)
    if not _host(packed):
        torch.index_select(expanded, 0, packed.to(torch.int32), out=out)
        return
    step = _block() // per or 1  # a block's worth of results (this module's max is a tensor one)
    for start in range(0, packed.numel(), step):
        stop = start + step
        torch.index_select(expanded, 0, packed[start:stop].to(torch.int32),
                           out=out[start:stop])


# ------------------------------------------------------------------ state (training state slots)
def variable(value, dt: str, like=None, name: str | None = None):
    """A mutable slot initialised from ``value`` (a NumPy array, or a tensor), of dtype ``dt``
    on ``like``'s device. Read with ``read``, write with ``assign``."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to(_DTYPES[dt], copy=True)
    else:
        t = torch.from_numpy(np.array(value, copy=True)).to(_DTYPES[dt])
    return t if like is None else t.to(like.device)


def read(var):
    return var


def assign(var, value):
    var.copy_(value)
    return var


def assign_lerp(var, value, weight: float):
    """In place: ``var <- var + weight * (value - var)`` (a momentum/EMA update); returns var.
    For ``weight >= 0.5`` computed as ``value - (1 - weight) * (value - var)``, as torch.lerp."""
    var.lerp_(value, float(weight))
    return var


def assign_div(var, value, divisor=None):
    """In place: ``var <- value / divisor`` (``value`` itself for None); returns var."""
    value = value.reshape(var.shape)
    if divisor is None:
        return var if value.data_ptr() == var.data_ptr() else var.copy_(value)
    return torch.div(value, divisor, out=var)


def aliases(a, b) -> bool:
    """Whether ``a`` and ``b`` are the same elements in memory (views of one buffer from the
    same first element, with as many elements): writing one writes the other."""
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype


def assign_scatter(var, idx, values):
    """In place: ``var`` = zeros, then ``values`` added at the flat positions ``idx`` (duplicates
    add up, in order); returns var."""
    if not var.is_contiguous():  # e.g. a channels_last gradient: positions are row-major
        return var.copy_(scatter_add(idx, values, var.numel()).view(var.shape))
    var.zero_()
    var.view(-1).index_add_(0, idx, values)
    return var


def assign_add(var, value):
    """In place: ``var += value``; returns var."""
    var.add_(value)
    return var


def assign_sub(var, value):
    """In place: ``var -= value``; returns var."""
    var.sub_(value.reshape(var.shape))
    return var


def known_finite(x) -> bool:
    """True where every entry of ``x`` is known finite without a device synchronisation: an
    integer tensor, or a CPU tensor whose sum is finite (a NaN or an infinity makes the sum
    non-finite; one read of ``x``). False says only "not known": a non-finite entry, a finite
    sum out of range, or a tensor on the device path (no host read there)."""
    if not x.is_floating_point():
        return True
    if x.device.type == "cuda" or _EMULATED[0]:
        return False
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    return bool(torch.isfinite(x.sum(dtype=wide)))


def assign_finite(var):
    """In place: every NaN and +-inf of ``var`` set to 0; returns var. The rewrite runs only
    where ``known_finite`` cannot rule it out: on the CPU a read of the slot instead of a read
    and a write; on the device path it always runs (no host read)."""
    if known_finite(var):
        return var
    return var.nan_to_num_(0.0, 0.0, 0.0)


def assign_zero_at(var, idx):
    """In place: ``var.flat[idx] = 0`` (+0.0); returns var."""
    idx = idx if idx.dtype == torch.int64 else idx.long()     # (index_fill_'s index type)
    if var.is_contiguous():
        var.view(-1).index_fill_(0, idx, 0.0)
        return var
    # e.g. a channels_last slot: positions are row-major
    return var.copy_(var.reshape(-1).index_fill(0, idx, 0.0).view(var.shape))


def flat_view(var):
    """A 1-D view of ``var``'s elements in row-major order, writing which writes ``var``; None
    when there is none (a non-contiguous tensor)."""
    return var.view(-1) if var.is_contiguous() else None


def assign_matmul(var, a, b):
    """In place: ``var <- a @ b`` (``var`` shaped like the product), with no result of its own;
    returns var."""
    return _product(a, b, out=var)


def assign_sub_matmul(var, a, b):
    """In place: ``var <- var - a @ b`` (``var`` shaped like the product), with no product of
    its own; returns var."""
    return _product(a, b, out=var, alpha=-1)


def assign_sub_at(var, idx, values):
    """In place: ``var.flat[idx] -= values`` (distinct flat positions); returns var."""
    var.view(-1).index_add_(0, idx, values, alpha=-1)
    return var


def counter(start: int, name: str | None = None):
    """A step counter slot starting at ``start``: a 0-d int64 NumPy array, kept on the host so
    that counting a step never touches a device."""
    return np.array(start, np.int64)


def increment(counter_var):
    """Add one to a counter slot; returns the new value (a Python int here)."""
    counter_var += 1
    return int(counter_var)


# ------------------------------------------------------------------ host-side bookkeeping
def host_callback(fn, *values) -> None:
    """Call ``fn`` with ``values`` (Python ints or integer scalar tensors) as Python ints, every
    time this line runs (byte counters and other Python-side bookkeeping)."""
    fn(*(int(v) for v in values))
