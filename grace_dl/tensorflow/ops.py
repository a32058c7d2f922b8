"""Tensor-ops backend for TensorFlow tensors (eager and inside ``tf.function``).

Same functions, same meaning as ``grace_dl.torch.ops`` (see its docstring for conventions).
Shapes are static Python ints where TF knows them; a dimension only known at run time (the
variable-length payloads of threshold/DGC) comes back as a scalar tensor.
Seeded draws go through ``tf.numpy_function`` when the step is a graph tensor, so they give the
same numbers as the torch backend for the same (seed, name, step).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops.resource_variable_ops import ResourceVariable as _ResourceVariable

from grace_dl import seeding

NAME = "tensorflow"

_DTYPES = {
    "float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16,
    "float64": tf.float64, "uint8": tf.uint8, "int8": tf.int8, "int16": tf.int16,
    "uint16": tf.uint16, "int32": tf.int32, "int64": tf.int64, "bool": tf.bool,
}


def is_tensor(x) -> bool:
    return tf.is_tensor(x) or isinstance(x, tf.Variable)


# ------------------------------------------------------------------ dtype, shape
def dtype(x) -> str:
    return x.dtype.name


def cast(x, dt: str):
    return tf.cast(x, _DTYPES[dt])


def is_floating(x) -> bool:
    return x.dtype.is_floating


def shape(x) -> tuple:
    static = x.shape.as_list() if x.shape.rank is not None else None
    if static is not None and all(d is not None for d in static):
        return tuple(static)
    dyn = tf.shape(x)
    return tuple(d if d is not None else dyn[i] for i, d in enumerate(static or []))


def numel(x):
    n = x.shape.num_elements()
    return n if n is not None else tf.size(x)


def nbytes(x):
    return numel(x) * x.dtype.size


def reshape(x, shp):
    return tf.reshape(x, shp)


def flatten(x):
    return tf.reshape(x, [-1])


def transpose(x):
    return tf.transpose(x)


def permute(x, perm):
    """Reorder the axes of ``x``: axis ``i`` of the result is axis ``perm[i]`` of ``x``
    (``numpy.transpose(x, perm)``)."""
    return tf.transpose(x, perm=list(perm))


# ------------------------------------------------------------------ creation
def zeros(shp, dt: str = "float32", like=None):
    return tf.zeros(shp, dtype=_DTYPES[dt])


def zeros_like(x):
    return tf.zeros_like(x)


def ones_like(x):
    return tf.ones_like(x)


def full(shp, value, dt: str = "float32", like=None):
    return tf.fill(shp if not isinstance(shp, int) else [shp], tf.constant(value, _DTYPES[dt]))


def from_numpy(arr, like=None):
    return tf.convert_to_tensor(arr)


def to_numpy(x) -> np.ndarray:
    if x.dtype == tf.bfloat16:
        x = tf.cast(x, tf.float32)
    return x.numpy()


# ------------------------------------------------------------------ devices
def device_type(x) -> str:
    """Where ``x`` lives: ``"cpu"``, ``"gpu"``, or ``""`` when not known yet (TF graph tensors
    before placement)."""
    device = (getattr(x, "device", "") or "").upper()
    if "GPU" in device:
        return "gpu"
    if "CPU" in device:
        return "cpu"
    return ""


def to_host(x):
    """``x`` in host (CPU) memory; ``x`` itself when it is there already."""
    if device_type(x) == "cpu":
        return x
    with tf.device("/CPU:0"):
        return tf.identity(x)


def to_device(x, like):
    """``x`` on ``like``'s device; ``x`` itself when it is there already, or when ``like``'s
    device is not known yet (graph tensors: TF places the op)."""
    device = getattr(like, "device", "") or ""
    if not device or device == (getattr(x, "device", "") or ""):
        return x
    with tf.device(device):
        return tf.identity(x)


# ------------------------------------------------------------------ math
abs = tf.math.abs  # noqa: A001
sign = tf.math.sign
sqrt = tf.math.sqrt
ceil = tf.math.ceil
maximum = tf.math.maximum
minimum = tf.math.minimum
isfinite = tf.math.is_finite


def clamp(x, lo=None, hi=None):
    if lo is not None:
        x = tf.math.maximum(x, tf.cast(lo, x.dtype))
    if hi is not None:
        x = tf.math.minimum(x, tf.cast(hi, x.dtype))
    return x


def where(cond, a, b):
    return tf.where(cond, a, b)


def cond(pred, true_fn, false_fn):
    """``true_fn()`` if the scalar ``pred`` holds, else ``false_fn()``; a ``tf.cond``, so it works
    inside ``tf.function`` (both branches must return the same structure)."""
    return tf.cond(pred, true_fn, false_fn)


def logical_and(a, b):
    return tf.math.logical_and(a, b)


def bit_and(a, b):
    return tf.bitwise.bitwise_and(a, b)


def bit_or(a, b):
    return tf.bitwise.bitwise_or(a, b)


def bit_xor(a, b):
    return tf.bitwise.bitwise_xor(a, b)


def bit_not(x):
    return tf.bitwise.invert(x)


def bitcast(x, dt: str):
    """Reinterpret the bits of ``x`` as dtype ``dt`` of the same width (float32 <-> int32)."""
    return tf.bitcast(x, _DTYPES[dt])


def to_bytes(x):
    """The bytes of ``x`` (any shape, row-major) as a 1-D uint8 tensor."""
    x = tf.reshape(x, [-1])
    return x if x.dtype == tf.uint8 else tf.reshape(tf.bitcast(x, tf.uint8), [-1])


def from_bytes(b, dt: str):
    """1-D uint8 ``b`` read as a 1-D tensor of dtype ``dt``."""
    want = _DTYPES[dt]
    if want == tf.uint8:
        return b
    if want.size == 1:
        return tf.bitcast(b, want)
    return tf.bitcast(tf.reshape(b, [-1, want.size]), want)


def shift_left(x, n: int):
    """``x << n`` for integer tensors."""
    return tf.bitwise.left_shift(x, tf.cast(n, x.dtype))


def shift_right(x, n: int):
    """``x >> n`` for integer tensors (arithmetic for signed dtypes, as torch's)."""
    return tf.bitwise.right_shift(x, tf.cast(n, x.dtype))


def sum(x, axis=None):  # noqa: A001
    return tf.reduce_sum(x, axis=axis)


def mean(x, axis=None):
    return tf.reduce_mean(x, axis=axis)


def max(x, axis=None):  # noqa: A001
    return tf.reduce_max(x, axis=axis)


def min(x, axis=None):  # noqa: A001
    return tf.reduce_min(x, axis=axis)


def norm(x, axis=None):
    """L2 norm (of everything, or along ``axis``)."""
    return tf.norm(x, axis=axis) if axis is not None else tf.norm(tf.reshape(x, [-1]))


def abs_sum(x):
    """Sum of ``|x|`` over all elements (the L1 norm), in ``x``'s dtype."""
    return tf.reduce_sum(tf.math.abs(x))


def abs_max(x):
    """``max |x|`` over all (at least one) elements, 0-d; NaN when ``x`` holds a NaN or an
    infinity (reductions of max may skip NaN: the sum of ``0 * x`` brings it back)."""
    return tf.maximum(tf.reduce_max(x), -tf.reduce_min(x)) + tf.reduce_sum(0.0 * x)


def nonfinite_mark(x):
    """A 0-d tensor of ``x``'s dtype: -0.0 when every entry of ``x`` (at least one) is
    finite, else NaN. One pass (``abs_max``)."""
    # (|.|: an all-zero x's max may be -0.0; a constant -0.0 would be cached as 0.0)
    return -tf.abs(abs_max(x) * 0)


def count_nonzero(x):
    """Number of nonzero (True) elements, an int64 scalar tensor."""
    return tf.math.count_nonzero(x, dtype=tf.int64)


def matmul(a, b):
    return tf.linalg.matmul(a, b)


def qr(x):
    """The reduced QR factors ``(q, r)`` of a k x r matrix (k >= r), by Householder
    reflections."""
    return tf.linalg.qr(x, full_matrices=False)


# ------------------------------------------------------------------ joining, slicing, indexing
def cat(xs, axis=0):
    return tf.concat(list(xs), axis=axis)


def stack(xs, axis=0):
    return tf.stack(list(xs), axis=axis)


def split(x, sizes):
    return tf.split(x, list(sizes))


def numels(xs):
    """A 1-D int32 tensor holding the element count of each tensor in ``xs``."""
    return tf.stack([tf.size(x, out_type=tf.int32) for x in xs])


def split_by(x, lengths):
    """Split 1-D ``x`` into pieces whose lengths are the entries of the 1-D int tensor
    ``lengths`` (known only at run time, e.g. received from other ranks; its length must be
    static)."""
    return tf.split(x, tf.cast(lengths, tf.int64), num=lengths.shape[0])


def slice(x, start, stop):  # noqa: A001
    return x[start:stop]


def pad(x, n):
    """Append ``n`` zeros to a 1-D tensor."""
    if isinstance(n, int) and n == 0:
        return x
    return tf.pad(x, [[0, n]])


def topk(x, k: int):
    """The ``k`` largest entries of a 1-D tensor: (values, int64 indices)."""
    values, idx = tf.math.top_k(x, k=k, sorted=False)
    return values, tf.cast(idx, tf.int64)


def kth_largest(x, k):
    """The ``k``-th largest entry of a 1-D tensor with no NaN (``0 < k <= numel``; ``k`` may be
    an int tensor)."""
    return tf.reduce_min(tf.math.top_k(x, k=k, sorted=False).values)


def gather(x, idx):
    return tf.gather(x, idx)


def scatter(idx, values, n):
    """A dense 1-D tensor of length ``n``: zeros, with ``values`` at ``idx`` (idx distinct)."""
    return tf.scatter_nd(tf.reshape(tf.cast(idx, tf.int64), [-1, 1]), values,
                         tf.cast(tf.reshape(n, [1]), tf.int64))


def scatter_add(idx, values, n):
    """Like ``scatter`` but duplicate indices add up (``tf.scatter_nd`` sums duplicates)."""
    return scatter(idx, values, n)


def bincount(idx, n):
    """How often each of 0..n-1 occurs in the 1-D int tensor ``idx`` (all in range), as
    float32 (the counts of ``scatter_add(idx, ones, n)``, without building the ones)."""
    counts = tf.math.bincount(tf.cast(idx, tf.int32), minlength=n, maxlength=n, dtype=tf.int64)
    return tf.cast(counts, tf.float32)


def nonzero(mask):
    """int64 indices where a 1-D bool tensor is true."""
    return tf.reshape(tf.where(mask), [-1])


def positions_at_least(flat, thr, sign=None):
    """int64 positions of the 1-D ``flat``'s entries whose magnitude reaches the scalar
    ``thr``: ``|x| >= thr`` (``sign`` None), ``x >= thr`` (1) or ``x <= -thr`` (-1); NaN never."""
    if sign is None:
        return nonzero(tf.abs(flat) >= thr)
    return nonzero(flat >= thr if sign > 0 else flat <= -thr)



def sort(x):
    """The elements of a 1-D tensor in ascending order."""
    return tf.sort(x)


def bucketize(x, boundaries):
    """int32 bucket of each element of 1-D ``x`` against the sorted 1-D ``boundaries``: the number
    of boundaries <= the element (so bucket i holds boundaries[i-1] <= x < boundaries[i])."""
    return tf.searchsorted(tf.cast(boundaries, x.dtype), x, side="right", out_type=tf.int32)


# ------------------------------------------------------------------ the wire (payload parts)
# ``grace_dl.communicators.wire``'s layout work on a payload's parts (the torch backend's
# functions of the same names).
def flat_parts(payload):
    """(each part of ``payload`` as 1-D, the parts' shapes)."""
    return [flatten(p) for p in payload], [shape(p) for p in payload]


def part_layout(flats):
    """``(dtype, bytes)`` of each 1-D part, or None where one is ``bool`` (TF cannot
    reinterpret a bool's bytes)."""
    if any(f.dtype == tf.bool for f in flats):
        return None
    return [(dtype(f), nbytes(f)) for f in flats]


def pack_parts(flats):
    """The 1-D parts' bytes one after another, as one 1-D uint8 tensor."""
    chunks = []
    for f in flats:
        n = numel(f)
        chunks.append(tf.zeros([0], tf.uint8) if isinstance(n, int) and n == 0
                      else to_bytes(f))
    return tf.concat(chunks, axis=0)


def pack_ragged(flats):
    """One rank's block for a gather of parts whose lengths differ across ranks: the parts'
    element counts (int32), then their bytes (a ``bool`` part's as uint8), as one 1-D uint8
    tensor (``unpack_ragged``)."""
    raw = [to_bytes(tf.cast(f, tf.uint8) if f.dtype == tf.bool else f) for f in flats]
    return tf.concat([to_bytes(numels(flats)), *raw], axis=0)


def unpack_ragged(buffer, dtypes: list, size: int) -> list:
    """``size`` ``pack_ragged`` blocks one after another in ``buffer`` (a gather, in rank
    order) cut into ``pieces[i][r]``: rank r's part i, read as ``dtypes[i]``. Each block's
    counts are read where it starts, as tensors (graph mode knows no sizes)."""
    n = len(dtypes)
    widths = tf.constant([_DTYPES[d].size for d in dtypes], tf.int32)
    pieces = [[] for _ in dtypes]
    at = tf.constant(0, tf.int32)
    for _ in range(size):
        sizes = tf.bitcast(tf.reshape(buffer[at:at + 4 * n], [n, 4]), tf.int32) * widths
        at = at + 4 * n
        for i, d in enumerate(dtypes):
            b = buffer[at:at + sizes[i]]
            pieces[i].append(tf.cast(b, tf.bool) if d == "bool" else from_bytes(b, d))
            at = at + sizes[i]
    return pieces


def unpack_parts(buffer, layouts: list) -> list:
    """``buffer``'s segments (one per entry of ``layouts``, each ``part_layout``'s list of its
    packed parts; ``[]``: an empty segment) cut into ``pieces[i][s]``: part i of non-empty
    segment s, read as its dtype."""
    sizes = []
    for parts in layouts:       # (this module's ``sum`` is the tensor one)
        total = 0
        for _, n in parts:
            total += n
        sizes.append(total)
    segments = tf.split(buffer, sizes)
    cut = [[from_bytes(p, dt) for p, (dt, _) in zip(tf.split(b, [n for _, n in parts]), parts)]
           for b, parts in zip(segments, layouts) if parts]
    return [list(p) for p in zip(*cut)]


def add_to_floating(parts, scalar) -> list:
    """``parts`` with the 0-d ``scalar`` (cast to each one's dtype) added to the floating-point
    ones (``communicators.base.marked``)."""
    return [p + tf.cast(scalar, p.dtype) if p.dtype.is_floating else p for p in parts]


def total_nbytes(xs):
    """The bytes of the tensors ``xs`` together (a scalar tensor inside ``tf.function`` where
    a size is only known at run time)."""
    total = 0
    for x in xs:
        total = total + nbytes(x)
    return total


def shaped_parts(pieces, shapes, ranks: int, equal_sizes: bool = True) -> list:
    """Every rank's payload from the 1-D ``pieces[i][r]`` (part i of rank r), each part in the
    layout of the local part's shape ``shapes[i]``: that exact shape when sizes are equal
    across ranks, else the same trailing dimensions with a free first one."""
    def shaped(piece, shp):
        if equal_sizes or len(shp) == 0:
            return tf.reshape(piece, shp)
        return piece if len(shp) == 1 else tf.reshape(piece, (-1, *shp[1:]))
    return [[shaped(part[r], shp) for part, shp in zip(pieces, shapes)] for r in range(ranks)]


# ------------------------------------------------------------------ seeded randomness
def _draw(fn, out_dtype, out_shape, seed, name, step):
    if isinstance(step, (int, np.integer)) or (tf.executing_eagerly() and tf.is_tensor(step)):
        return tf.convert_to_tensor(fn(int(step)))
    result = tf.numpy_function(lambda s: fn(int(s)), [step], out_dtype, stateful=False)
    return tf.ensure_shape(result, out_shape)


def uniform(seed: int, name: str, step, n: int, like=None, stream: int = 0):
    return _draw(lambda s: seeding.uniform(seed, name, s, n, stream), tf.float32, [n],
                 seed, name, step)


def choice(seed: int, name: str, step, n: int, k: int, like=None):
    return _draw(lambda s: seeding.choice(seed, name, s, n, k).astype(np.int64), tf.int64, [k],
                 seed, name, step)


def dither(seed: int, name: str, step, n: int, bits: int = 16, like=None, stream: int = 0):
    """``n`` uniform integers in ``[0, 2**bits)``, uint8 (8 bits) or uint16 (16 bits): the same
    values as torch's (``seeding.dither``, which states the bias bound)."""
    dt = tf.uint8 if bits == 8 else tf.uint16
    return _draw(lambda s: seeding.dither(seed, name, s, n, bits, stream), dt, [n],
                 seed, name, step)


def normal(seed: int, name: str, step, shape, like=None):
    """Standard normal float32 draws of ``shape`` (``seeding.normal``, as torch's on a CPU)."""
    shape = [int(d) for d in shape]
    if isinstance(step, (int, np.integer)):    # eager even while tracing: it may seed a slot
        with tf.init_scope():
            return tf.constant(seeding.normal(seed, name, int(step), shape))
    return _draw(lambda s: seeding.normal(seed, name, s, shape), tf.float32, shape,
                 seed, name, step)


# ------------------------------------------------------------------ blockwise evaluation
def blockwise(fn, *xs, out=None):
    """``flatten(fn(*xs))`` for a row-wise ``fn`` (torch evaluates it block by block to keep its
    temporaries in cache; TF reuses its buffers, and evaluates it once). ``out`` (torch writes
    the result there) must be None: TF tensors have no writable views (``flat_view``)."""
    if out is not None:
        raise ValueError("blockwise(out=...) needs a writable tensor; TF has none (flat_view "
                         "is None), pass out=None")
    return tf.reshape(fn(*xs), [-1])


# ------------------------------------------------------------------ bit packing
def pack_bits(codes, bits: int):
    """Pack unsigned codes (< 2**bits) into uint8, ``bits`` each (same layout as torch's)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if bits < 8 and sys.byteorder == "little":
        return _pack_words(tf.cast(tf.reshape(codes, [-1]), tf.uint8), bits)
    codes = tf.cast(tf.reshape(codes, [-1]), tf.int32)
    n = tf.size(codes)
    if bits == 8:
        return tf.cast(codes, tf.uint8)
    if 8 % bits == 0:
        per = 8 // bits
        codes = tf.reshape(tf.pad(codes, [[0, (-n) % per]]), [-1, per])
        shifts = tf.range(0, 8, bits, dtype=tf.int32)
        return tf.cast(tf.reduce_sum(tf.bitwise.left_shift(codes, shifts), axis=1), tf.uint8)
    shifts = tf.range(bits, dtype=tf.int32)
    stream = tf.reshape(tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(codes[:, None], shifts), 1), [-1])
    stream = tf.reshape(tf.pad(stream, [[0, (-tf.size(stream)) % 8]]), [-1, 8])
    weights = tf.range(8, dtype=tf.int32)
    return tf.cast(tf.reduce_sum(tf.bitwise.left_shift(stream, weights), axis=1), tf.uint8)


def unpack_bits(packed, bits: int, n):
    """Inverse of ``pack_bits``: the first ``n`` codes, as uint8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if 8 % bits and sys.byteorder == "little":
        return _unpack_words(tf.cast(tf.reshape(packed, [-1]), tf.uint8), bits, n)
    packed = tf.cast(tf.reshape(packed, [-1]), tf.int32)
    if bits == 8:
        return tf.cast(packed[:n], tf.uint8)
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = tf.range(0, 8, bits, dtype=tf.int32)
        codes = tf.bitwise.bitwise_and(tf.bitwise.right_shift(packed[:, None], shifts), mask)
        return tf.cast(tf.reshape(codes, [-1])[:n], tf.uint8)
    weights = tf.range(8, dtype=tf.int32)
    stream = tf.bitwise.bitwise_and(tf.bitwise.right_shift(packed[:, None], weights), 1)
    stream = tf.reshape(tf.reshape(stream, [-1])[: n * bits], [-1, bits])
    shifts = tf.range(bits, dtype=tf.int32)
    return tf.cast(tf.reduce_sum(tf.bitwise.left_shift(stream, shifts), axis=1), tf.uint8)


def _replicate(value: int, period: int) -> int:
    """``value`` repeated every ``period`` bits across a 64-bit word."""
    word = 0
    for shift in range(0, 64, period):  # (this module's ``sum`` is the tensor one)
        word |= value << shift
    return word


# Same word folding as the torch backend's (eight b-bit codes <-> one 64-bit word).
_WORD_STEPS = ((8, 1), (16, 2), (32, 4))


def _pack_words(codes, bits: int):
    n = tf.size(codes)
    words = tf.bitcast(tf.reshape(tf.pad(codes, [[0, (-n) % 8]]), [-1, 8]), tf.int64)
    v = words
    for lane, mult in _WORD_STEPS:
        keep = tf.constant(_replicate((1 << bits * mult) - 1, 2 * lane), tf.int64)
        high = tf.bitwise.bitwise_and(tf.bitwise.right_shift(v, lane - bits * mult),
                                      tf.bitwise.left_shift(keep, bits * mult))
        v = tf.bitwise.bitwise_or(tf.bitwise.bitwise_and(v, keep), high)
    out = tf.reshape(tf.bitcast(v, tf.uint8)[:, :bits], [-1])
    return out[: (n * bits + 7) // 8]


def _unpack_words(packed, bits: int, n):
    words = (n + 7) // 8
    p = packed[: words * bits]
    p = tf.reshape(tf.pad(p, [[0, words * bits - tf.size(p)]]), [-1, bits])
    v = tf.bitcast(tf.pad(p, [[0, 0], [0, 8 - bits]]), tf.int64)
    for lane, mult in reversed(_WORD_STEPS):
        keep = tf.constant(_replicate((1 << bits * mult) - 1, 2 * lane), tf.int64)
        high = tf.bitwise.bitwise_and(tf.bitwise.left_shift(v, lane - bits * mult),
                                      tf.bitwise.left_shift(keep, lane))
        v = tf.bitwise.bitwise_or(tf.bitwise.bitwise_and(v, keep), high)
    return tf.reshape(tf.bitcast(v, tf.uint8), [-1])[:n]


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``pack_bits`` produces for ``n`` codes."""
    return math.ceil(n * bits / 8)


COMPARISONS = {"lt": tf.less, "eq": tf.equal}


def pack_compare(x, cmp: str, value):
    """The packed bits (``pack_mask`` layout) of ``x <cmp> value`` elementwise, ``cmp`` one
    of ``COMPARISONS``: the sign codes' planes, without a separate boolean tensor."""
    if cmp not in COMPARISONS:
        raise ValueError(f"cmp must be one of {sorted(COMPARISONS)}, got {cmp!r}")
    return pack_mask(COMPARISONS[cmp](tf.reshape(x, [-1]), tf.cast(value, x.dtype)))


def pack_mask(mask):
    """Pack a boolean tensor (or nonzero-ness of any tensor) into bits: the same ``ceil(n/8)``
    uint8 as ``pack_bits(mask, 1)``, from n/8 int64 words by three shift-ors (see torch's)."""
    m = tf.reshape(mask, [-1])
    if m.dtype != tf.bool:
        m = tf.not_equal(m, tf.zeros([], m.dtype))
    if sys.byteorder != "little":
        return pack_bits(m, 1)
    m = tf.cast(m, tf.uint8)
    m = tf.pad(m, [[0, (-tf.size(m)) % 8]])
    # Byte i of a word holds bit i of the result: fold bytes 8 -> 4 -> 2 -> 1.
    v = tf.bitcast(tf.reshape(m, [-1, 8]), tf.int64)
    for shift in (7, 14, 28):
        v = tf.bitwise.bitwise_or(v, tf.bitwise.right_shift(v, tf.constant(shift, tf.int64)))
    return tf.cast(tf.bitwise.bitwise_and(v, tf.constant(0xFF, tf.int64)), tf.uint8)


def unpack_lookup(packed, bits: int, n, table, out=None):
    """Decode through a table: ``table[code]`` for each of the first ``n`` ``bits``-wide codes of
    ``packed`` (``pack_bits`` layout); ``table`` is 1-D with ``2**bits`` entries and gives the
    result's dtype. One gather of a 256-row table of decoded bytes. ``bits`` must divide 8.
    ``out`` is ignored: TF tensors have no views to write into (the result is new)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be one of [1, 2, 4, 8], got {bits}")
    size = table.shape.num_elements()
    if size is not None and size != 1 << bits:
        raise ValueError(f"table must have {1 << bits} entries for {bits}-bit codes, got {size}")
    per = 8 // bits
    codes = (np.arange(256)[:, None] >> (bits * np.arange(per))) & ((1 << bits) - 1)
    expanded = tf.gather(tf.reshape(table, [-1]), tf.constant(codes, tf.int32))
    out = tf.gather(expanded, tf.cast(tf.reshape(packed, [-1]), tf.int32))
    return tf.reshape(out, [-1])[:n]


# ------------------------------------------------------------------ state (training state slots)
def variable(value, dt: str, like=None, name: str | None = None):
    """A ``tf.Variable`` slot initialised from ``value`` (a NumPy array or a tensor). It is
    created outside any ``tf.function`` graph, so it may be created lazily during the first
    trace.

    It is built as a ``ResourceVariable`` directly, which skips variable-creator scopes:
    ``tf.function`` then does not see a variable created on its first call and does not trace
    the function a second time (the variable is already initialised eagerly)."""
    with tf.init_scope():
        init = tf.cast(tf.constant(np.asarray(value)), _DTYPES[dt])
        return _ResourceVariable(init, trainable=False, name=_var_name(name))


def read(var):
    return var.read_value() if isinstance(var, tf.Variable) else var


def assign(var, value):
    var.assign(value)
    return var


def assign_lerp(var, value, weight: float):
    """In place: ``var <- var + weight * (value - var)`` (a momentum/EMA update); returns var.
    For ``weight >= 0.5`` computed as ``value - (1 - weight) * (value - var)``, as torch.lerp,
    so both backends round alike."""
    old = var.read_value()
    w = float(weight)
    if w < 0.5:
        var.assign(old + tf.cast(w, old.dtype) * (value - old))
    else:
        var.assign(value - (value - old) * tf.cast(1.0 - w, old.dtype))
    return var


def assign_div(var, value, divisor=None):
    """In place: ``var <- value / divisor`` (``value`` itself for None); returns var."""
    value = tf.reshape(value, tf.shape(var))
    var.assign(value if divisor is None else value / tf.cast(divisor, value.dtype))
    return var


def aliases(a, b) -> bool:
    """Always False: TF tensors are values, never views of a variable's memory."""
    return False


def assign_scatter(var, idx, values):
    """In place: ``var`` = zeros, then ``values`` added at the flat positions ``idx`` (duplicates
    add up, in order); returns var."""
    var.assign(tf.reshape(scatter(idx, values, tf.size(var)), tf.shape(var)))
    return var


def assign_add(var, value):
    """In place: ``var += value``; returns var."""
    var.assign_add(value)
    return var


def assign_sub(var, value):
    """In place: ``var -= value``; returns var."""
    var.assign_sub(tf.reshape(value, tf.shape(var)))
    return var


def assign_finite(var):
    """In place: every NaN and +-inf of ``var`` set to 0; returns var."""
    value = var.read_value()
    var.assign(tf.where(tf.math.is_finite(value), value, tf.zeros_like(value)))
    return var


def known_finite(x) -> bool:
    """True for an integer tensor; for a float one False ("not known": a graph has no host
    read of a tensor's values)."""
    return not x.dtype.is_floating


def assign_zero_at(var, idx):
    """In place: ``var.flat[idx] = 0``; returns var."""
    at = _indices_of(var, idx)
    var.scatter_nd_update(at, tf.zeros(tf.shape(at)[:1], var.dtype))
    return var


def flat_view(var):
    """Always None: TF tensors and variables have no writable views."""
    return None


def assign_matmul(var, a, b):
    """In place: ``var <- a @ b`` (``var`` shaped like the product); returns var."""
    var.assign(tf.matmul(a, b))
    return var


def assign_sub_matmul(var, a, b):
    """In place: ``var <- var - a @ b`` (``var`` shaped like the product); returns var."""
    var.assign_sub(tf.matmul(a, b))
    return var


def assign_sub_at(var, idx, values):
    """In place: ``var.flat[idx] -= values`` (distinct flat positions); returns var."""
    var.scatter_nd_sub(_indices_of(var, idx), values)
    return var


def _indices_of(var, idx):
    """The ``scatter_nd`` indices of ``var``'s flat positions ``idx`` (k x rank, int64)."""
    flat_idx = tf.reshape(tf.cast(idx, tf.int64), [-1, 1])
    if var.shape.rank == 1:
        return flat_idx
    shape = tf.shape(var, out_type=tf.int64)
    return tf.transpose(tf.unravel_index(tf.reshape(flat_idx, [-1]), shape))



def counter(start: int, name: str | None = None):
    """A step counter slot starting at ``start``: an int64 ``tf.Variable`` (graph mode counts
    inside the graph)."""
    return variable(np.asarray(start, np.int64), "int64", name=name)


def increment(counter_var):
    """Add one to a counter slot; returns the new value (a tensor; an int in eager mode)."""
    new = counter_var.assign_add(1)
    return int(new.numpy()) if tf.executing_eagerly() else new


# ------------------------------------------------------------------ host-side bookkeeping
def host_callback(fn, *values) -> None:
    """Call ``fn`` with ``values`` (Python ints or integer scalar tensors) as Python ints, every
    time this line runs: at once in eager mode; inside ``tf.function`` through a stateful
    ``tf.numpy_function``, so it runs on each call of the traced function, not once at trace."""
    if tf.executing_eagerly():
        fn(*(int(v) for v in values))
        return

    def call(*args):
        fn(*(int(a) for a in args))
        return np.int64(0)

    tf.numpy_function(call, [tf.cast(v, tf.int64) for v in values], tf.int64, stateful=True)


def _var_name(name):
    if name is None:
        return None
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name) or None
