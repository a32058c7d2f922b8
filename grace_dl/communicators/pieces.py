"""One large tensor sent as several pieces, so that its compression and communication overlap.

A tensor of more than ``piece_bytes`` bytes is cut into ``ceil(bytes / piece_bytes)`` even 1-D
pieces, and each is sent as its own grace tensor ``<name>/piece<i>`` from (and received into)
its slice of the tensor. ``send`` of piece i starts its collectives and returns, so piece i is
on the wire while piece i+1 is compressed; ``Router.receive_all`` then reduces piece i while
the later pieces' exchanges are still in flight. The whole tensor's compression and exchange
no longer run one after the other.

Only for what a piece does not change, and where there is work to overlap: a ``Communicator``
(not a strategy dispatcher, which routes by the tensor's own name) whose compressor compresses
any 1-D chunk on its own (``two_phase_safe``: quantizers, signs, fp16) and does compress (not
``sends_tensor``: ``none`` sends the tensor itself, and its pieces would only add collectives),
or a ``Schedule`` whose every stage is one (a tensor's pieces, and the residuals handed over at
a switch by their names, are then the same in every stage). Sparsifiers keep their tensors
whole, since their k is a fraction of the whole tensor. The bits on the wire are the whole
tensor's, give or take one chunk header per piece (a quantizer's last partial bucket norm).
Each piece has its own state (residual, server residual, step counter), keyed by its name, so
the piece size is part of a checkpoint: the framework glue records it and refuses a checkpoint
written with another.

Pieces exist to overlap the host's work with the wire. A GPU compresses a whole bucket in less
time than one piece's round of Python and collectives, so the glue's default, ``"auto"``
(``AUTO``), cuts only tensors that live on the CPU (in pieces of ``DEFAULT_PIECE_BYTES``) and
sends a GPU's (or, under ``grace_dl.torch.kernels.emulate_device``, any device-path) tensor
whole, as PyTorch's own hooks send a bucket; an int cuts on every device, ``None`` cuts nowhere
(``device_piece_bytes``).

The DDP hook (``grace_dl.torch.ddp``) and the Horovod torch optimizer
(``grace_dl.torch.optimizer``) send through this module.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.communicators.base import Communicator
from grace_dl.torch.kernels import on_device  # (stdlib only: it imports no torch)

#: the piece size ``AUTO`` gives tensors on the CPU: 4 MiB (a quarter of the MLP's largest
#: gradient; DDP's first bucket is 1 MiB and its others 25 MiB)
DEFAULT_PIECE_BYTES = 4 << 20
#: the glue's default ``piece_bytes``: pieces of ``DEFAULT_PIECE_BYTES`` on the CPU, whole on a GPU
AUTO = "auto"


def check_piece_bytes(piece_bytes):
    """``piece_bytes`` if it is a positive int, None or ``"auto"``, else a ``ValueError``
    naming it."""
    if piece_bytes is not None and piece_bytes != AUTO and (
            isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int)
            or piece_bytes <= 0):
        raise ValueError(f"piece_bytes must be a positive int, None or {AUTO!r}, got "
                         f"{piece_bytes!r}")
    return piece_bytes


def device_piece_bytes(piece_bytes, tensor):
    """``piece_bytes`` for ``tensor``: ``"auto"`` gives None (whole) where the tensor takes the
    device path (a GPU's) and ``DEFAULT_PIECE_BYTES`` elsewhere; an int or None as it is."""
    if piece_bytes != AUTO:
        return piece_bytes
    return None if on_device(tensor) else DEFAULT_PIECE_BYTES


def effective_piece_bytes(grace, piece_bytes):
    """``piece_bytes`` where ``grace`` sends tensors in pieces (a communicator of a
    chunk-independent compressor), else None: what a checkpoint records (``"auto"``, until a
    tensor's device resolves it: ``device_piece_bytes``)."""
    check_piece_bytes(piece_bytes)
    return piece_bytes if piece_bytes is not None and _cuts(grace) else None


def _cuts(grace) -> bool:
    """Whether ``grace`` sends tensors in pieces (the module docstring)."""
    from grace_dl.communicators.schedule import Schedule

    if isinstance(grace, Schedule):
        return all(map(_cuts, grace.parts()))
    return isinstance(grace, Communicator) and grace.compressor.caps.two_phase_safe and \
        not grace.compressor.caps.sends_tensor


def piece_sizes(numel: int, element_size: int, piece_bytes):
    """Lengths of the even pieces a tensor of ``numel`` elements is sent in, or None when it
    goes whole (``piece_bytes`` None, or the tensor no larger than one piece)."""
    if piece_bytes is None:
        return None
    per = max(1, piece_bytes // element_size)
    if numel <= per:
        return None
    count = -(-numel // per)
    return [numel // count + (i < numel % count) for i in range(count)]


def piece_name(name: str, i: int) -> str:
    return f"{name}/piece{i}"


def send_pieces(grace, flat, name: str, op: str, collectives, sizes) -> list:
    """Send the 1-D contiguous ``flat`` as pieces of ``sizes``, each from and into its own
    slice of ``flat`` (torch: views, written in place): after ``receive`` of every handle,
    ``flat`` holds the result."""
    return [grace.send(piece, piece_name(name, i), op, collectives, into=piece)
            for i, piece in enumerate(ops_for(flat).split(flat, sizes))]
