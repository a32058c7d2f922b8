"""The typed contracts of grace_dl: what ``grace=`` takes, and what a tensor-ops backend offers.

``Grace`` is the protocol the torch ``DistributedOptimizer``, the TF tape and Keras optimizer
and the DDP hook drive: every ``Communicator`` and the strategy dispatcher satisfy it.
``OpsBackend`` is what ``grace_dl.torch.ops`` and ``grace_dl.tensorflow.ops`` both implement,
name for name and parameter for parameter (``tests/test_contracts.py`` checks it): algorithms
are written once against it, through ``grace_dl.backend.ops_for(tensor)``.

Backend tensors are values: write ``x = x + y``, or use ``+=`` only on a tensor the function
itself just made (torch's ``+=`` mutates in place, TF's rebinds the name).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, runtime_checkable

GRACE_MEMBERS = ("send", "receive", "synchronize", "end_step", "check_op", "fuse", "state_dict",
                 "load_state_dict", "config", "fingerprint", "bytes", "process_set")


@runtime_checkable
class Grace(Protocol):
    """A ``grace=`` object. ``send`` starts a named tensor's exchange and returns at once;
    ``receive`` returns its aggregate (averaged for ``op="average"``), written into ``into``
    when given to either (the torch optimizer passes the gradient to ``send``, which lets an
    uncompressed allreduce sum in it in place); ``end_step`` closes an
    optimizer step in ``bytes``; ``fuse`` sets fusion groups (lists of tensor names);
    ``fingerprint`` digests ``config()``, which ranks compare before the first step."""

    bytes: Any
    process_set: Any

    def send(self, tensor, name: str, op: str = "average", collectives=None,
             into=None) -> Any: ...

    def receive(self, handle, into=None) -> Any: ...

    def synchronize(self, tensor, name: str, op: str = "average", collectives=None,
                    into=None) -> Any: ...

    def end_step(self) -> dict: ...

    def check_op(self, op: str) -> str: ...

    def fuse(self, groups) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def config(self) -> dict: ...

    def fingerprint(self) -> str: ...


def check_grace(obj) -> None:
    """``ValueError`` naming what ``obj`` lacks, unless it is a ``Grace`` object."""
    if isinstance(obj, Grace):
        return
    missing = [m for m in GRACE_MEMBERS if not hasattr(obj, m)]
    raise ValueError(f"grace must be a grace_dl communicator (grace_from_params) or a strategy "
                     f"dispatcher (from_strategy); {type(obj).__name__} lacks {missing}")


#: id(grace object) -> (a reference to it, a weak reference to the glue object carrying it)
_CARRIERS: dict = {}


def check_uncarried(grace, what: str) -> None:
    """``ValueError`` where another live glue object (an optimizer, a DDP hook's state) carries
    ``grace`` already: its state (residuals, momenta, step counters) is keyed by tensor names,
    which two carriers share (Horovod's and the DDP hook's default names always do), so one
    would feed the other's state into its tensors and save it in its checkpoint. ``what``:
    the new carrier, for the message. Raised at construction, on every rank."""
    for key, (held, carrier) in list(_CARRIERS.items()):
        if held() is None or carrier() is None:
            del _CARRIERS[key]
    entry = _CARRIERS.get(id(grace))
    if entry is not None and entry[0]() is grace:
        raise ValueError(f"this grace object ({type(grace).__name__}) is already carried by a "
                         f"{type(entry[1]()).__name__} still in use: its error-feedback state "
                         f"is keyed by tensor names and would mix with the new {what}'s; build "
                         f"one grace object per {what} (grace_from_params(params) for each)")


def carried_by(grace, carrier) -> None:
    """Record that ``carrier`` (held weakly) carries ``grace`` (``check_uncarried``)."""
    try:
        held = weakref.ref(grace)
    except TypeError:           # (no weak references: held as long as its carrier lives)
        held = (lambda g: lambda: g)(grace)
    _CARRIERS[id(grace)] = (held, weakref.ref(carrier))


class OpsBackend(Protocol):
    """The tensor operations algorithms are written against (one module per framework)."""

    def is_tensor(self, x) -> bool: ...

    def dtype(self, x) -> str: ...

    def cast(self, x, dt: str): ...

    def is_floating(self, x) -> bool: ...

    def shape(self, x) -> tuple: ...

    def numel(self, x) -> int: ...

    def nbytes(self, x) -> int: ...

    def reshape(self, x, shp): ...

    def flatten(self, x): ...

    def transpose(self, x): ...

    def permute(self, x, perm): ...

    def zeros(self, shp, dt: str = "float32", like=None): ...

    def zeros_like(self, x): ...

    def ones_like(self, x): ...

    def full(self, shp, value, dt: str = "float32", like=None): ...

    def from_numpy(self, arr, like=None): ...

    def to_numpy(self, x) -> Any: ...

    def device_type(self, x) -> str: ...

    def to_host(self, x):
        """``x`` in host (CPU) memory; ``x`` itself when it is there already."""

    def to_device(self, x, like):
        """``x`` on ``like``'s device; ``x`` itself when it is there already."""

    def abs(self, x): ...

    def sign(self, x): ...

    def sqrt(self, x): ...

    def ceil(self, x): ...

    def maximum(self, a, b): ...

    def minimum(self, a, b): ...

    def isfinite(self, x): ...

    def clamp(self, x, lo=None, hi=None): ...

    def where(self, cond, a, b): ...

    def cond(self, pred, true_fn, false_fn): ...

    def logical_and(self, a, b): ...

    def bit_and(self, a, b): ...

    def bit_or(self, a, b): ...

    def bit_xor(self, a, b): ...

    def bit_not(self, x):
        """Bitwise operations on integer tensors (the packed sign planes' bytes)."""

    def bitcast(self, x, dt: str):
        """Reinterpret the bits of ``x`` as dtype ``dt`` (float32 <-> int32; a wider integer
        as its bytes, int16 -> uint8 in memory order)."""

    def to_bytes(self, x):
        """The bytes of ``x`` (row-major) as a 1-D uint8 tensor (``grace_dl.communicators.
        wire.pack``: a payload's parts in one buffer)."""

    def from_bytes(self, b, dt: str):
        """1-D uint8 ``b`` read as a 1-D tensor of dtype ``dt`` (its length a multiple of the
        width)."""

    def shift_left(self, x, n: int):
        """``x << n`` for integer tensors."""

    def shift_right(self, x, n: int):
        """``x >> n`` for integer tensors (arithmetic for signed dtypes, as TF's)."""

    def sum(self, x, axis=None): ...

    def mean(self, x, axis=None): ...

    def max(self, x, axis=None): ...

    def min(self, x, axis=None): ...

    def norm(self, x, axis=None):
        """L2 norm (of everything, or along ``axis``)."""

    def abs_sum(self, x): ...

    def abs_max(self, x):
        """``max |x|`` over all (at least one) elements; NaN when x holds a NaN or an inf."""

    def nonfinite_mark(self, x):
        """0-d, x's dtype: -0.0 when every (at least one) element is finite, else NaN."""

    def count_nonzero(self, x):
        """Number of nonzero (True) elements, an int64 scalar tensor."""

    def matmul(self, a, b): ...

    def qr(self, x):
        """The reduced QR factors ``(q, r)`` of a k x r matrix (k >= r), by Householder
        reflections (LAPACK's, cuSOLVER's, Eigen's): one call, whatever r."""

    def cat(self, xs, axis=0): ...

    def stack(self, xs, axis=0): ...

    def split(self, x, sizes): ...

    def numels(self, xs):
        """A 1-D int32 tensor holding the element count of each tensor in ``xs``."""

    def split_by(self, x, lengths): ...

    # a payload's parts on the wire (``grace_dl.communicators.wire``), each in one call
    def flat_parts(self, payload):
        """(each part of ``payload`` as 1-D, the parts' shapes)."""

    def part_layout(self, flats):
        """``(dtype, bytes)`` of each 1-D part, or None where one is ``bool``."""

    def pack_parts(self, flats):
        """The 1-D parts' bytes one after another, as one 1-D uint8 tensor."""

    def unpack_parts(self, buffer, layouts: list) -> list:
        """``buffer``'s segments laid out as ``layouts`` cut into ``pieces[i][s]``: part i of
        non-empty segment s."""

    def pack_ragged(self, flats):
        """One rank's block of a gather of ragged parts: their int32 element counts, then
        their bytes, as one 1-D uint8 tensor."""

    def unpack_ragged(self, buffer, dtypes: list, size: int) -> list:
        """``size`` ``pack_ragged`` blocks one after another cut into ``pieces[i][r]``: rank
        r's part i, read as ``dtypes[i]``."""

    def shaped_parts(self, pieces, shapes, ranks: int, equal_sizes: bool = True) -> list:
        """Every rank's payload from the 1-D ``pieces[i][r]``, each part in its local shape's
        layout."""

    def total_nbytes(self, xs):
        """The bytes of the tensors ``xs`` together."""

    def add_to_floating(self, parts, scalar) -> list:
        """``parts`` with the 0-d ``scalar`` added to the floating-point ones."""

    def slice(self, x, start: int, stop: int): ...

    def pad(self, x, n: int):
        """Append ``n`` zeros to a 1-D tensor."""

    def topk(self, x, k: int):
        """The ``k`` largest entries of a 1-D tensor: (values, int64 indices)."""

    def kth_largest(self, x, k):
        """The ``k``-th largest entry of a 1-D tensor with no NaN (``0 < k <= numel``; ``k``
        may be an int tensor): ``min(topk(x, k)[0])``, found without sorting."""

    def gather(self, x, idx): ...

    def scatter(self, idx, values, n: int):
        """A dense 1-D tensor of length ``n``: zeros, with ``values`` at ``idx`` (idx distinct)."""

    def scatter_add(self, idx, values, n: int):
        """Like ``scatter`` but duplicate indices add up."""

    def bincount(self, idx, n: int): ...

    def positions_at_least(self, flat, thr, sign=None): ...

    def nonzero(self, mask):
        """int64 indices where a 1-D bool tensor is true."""

    def sort(self, x):
        """The elements of a 1-D tensor in ascending order."""

    def bucketize(self, x, boundaries): ...

    def uniform(self, seed: int, name: str, step, n: int, like=None, stream: int = 0): ...

    def choice(self, seed: int, name: str, step, n: int, k: int, like=None): ...

    def normal(self, seed: int, name: str, step, shape, like=None): ...

    def dither(self, seed: int, name: str, step, n: int, bits: int = 16, like=None,
               stream: int = 0):
        """``n`` uniform integers in ``[0, 2**bits)`` (bits 8 or 16; uint8 or uint16), the dither
        ``(k + 1/2) / 2**bits`` of a stochastic rounding, with bias <= ``2**-(bits+1)`` step."""

    def blockwise(self, fn, *xs, out=None):
        """``flatten(fn(*xs))`` for a row-wise ``fn``, possibly evaluated block by block;
        written into the 1-D ``out`` when given (torch; TF has no writable tensors)."""

    def pack_bits(self, codes, bits: int):
        """Pack unsigned codes (< 2**bits, any int dtype) into a uint8 tensor, ``bits`` each."""

    def unpack_bits(self, packed, bits: int, n: int):
        """Inverse of ``pack_bits``: the first ``n`` codes, as uint8."""

    def packed_size(self, n: int, bits: int) -> int:
        """Bytes that ``pack_bits`` produces for ``n`` codes."""

    def pack_mask(self, mask): ...

    def pack_compare(self, x, cmp: str, value): ...

    def unpack_lookup(self, packed, bits: int, n, table, out=None):
        """``table[code]`` of each of the first ``n`` codes; into ``out`` where views exist."""

    def variable(self, value, dt: str, like=None, name: str | None = None): ...

    def read(self, var): ...

    def assign(self, var, value): ...

    def assign_lerp(self, var, value, weight: float): ...

    def assign_div(self, var, value, divisor=None): ...

    def aliases(self, a, b) -> bool: ...

    def assign_scatter(self, var, idx, values): ...

    def assign_add(self, var, value): ...

    def assign_sub(self, var, value): ...

    def assign_finite(self, var):
        """In place: every NaN and +-inf of ``var`` set to 0 (error feedback never keeps a
        non-finite value: ``grace_dl.memory.base``); returns var."""

    def known_finite(self, x) -> bool:
        """True where every entry of ``x`` is known finite without a device synchronisation
        (an integer tensor; a CPU tensor with a finite sum); False: not known."""

    def assign_zero_at(self, var, idx):
        """In place: ``var.flat[idx] = 0`` (distinct flat positions); returns var."""

    def assign_matmul(self, var, a, b): ...

    def assign_sub_matmul(self, var, a, b): ...

    def flat_view(self, var): ...

    def assign_sub_at(self, var, idx, values): ...

    def counter(self, start: int, name: str | None = None):
        """A step counter slot starting at ``start`` (``increment`` counts it)."""

    def increment(self, counter_var):
        """Add one to a counter slot; returns the new value (a Python int here)."""

    def host_callback(self, fn, *values) -> None: ...
