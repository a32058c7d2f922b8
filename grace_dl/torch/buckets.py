"""Gradient buckets for the Horovod torch optimizer (``DistributedOptimizer(bucket_bytes=n)``):
several parameters' gradients packed into one flat buffer and compressed once, as the DDP hook
compresses DDP's buckets (``grace_dl.torch.ddp``).

**Layout.** The parameters that need gradients, in reverse registration order (the order in
which a backward pass makes most models' gradients ready, the order DDP's first buckets
assume), are packed greedily per dtype and device: a bucket is closed when the next gradient
would take it past ``bucket_bytes``; a gradient larger than that has a bucket of its own. The
layout follows from the parameters alone, so it is the same on every rank (the optimizer's
agreement check compares it). A bucket is named ``bucket<n>:<digest of its members' names>``,
as the DDP hook names its buckets, so grace state (residuals, step counters) follows the
bucket's content.

**A step.** When a parameter's gradient is ready (its post-accumulate hook, after
``backward_passes_per_step`` passes) it is copied into its slice of the bucket's buffer (the
buffer is allocated once and kept); when the bucket's last member is in, the whole buffer is
sent through the communicator (in pieces where ``piece_bytes`` applies, as any large
gradient), so early buckets travel while the backward pass goes on. ``synchronize()`` fills
what never became ready (zeros for a parameter without a gradient, as Horovod sends), receives
every bucket in layout order into its buffer and copies each member's slice back into
``p.grad``: two memory passes per step over the gradients, in exchange for one compression and
one set of collectives per bucket instead of per parameter.

**What goes on the wire** is the compressor's payload for the bucket's flat tensor. For
quantizers, signs and fp16 that is the per-tensor bits give or take one chunk header per
bucket; a sparsifier selects over the whole bucket (topk: a global top-k, so layers with large
gradients take more of the k; ``compress_ratio`` is a fraction of the bucket). Compressors that
need each layer's shape (PowerSGD's matrices: ``Compressor.needs_shape``) and strategy
dispatchers (which route by parameter name) cannot be bucketed; the optimizer refuses them.
"""

from __future__ import annotations

import hashlib
import json

import torch

from grace_dl.communicators.base import Communicator

#: DDP's default bucket size (``bucket_cap_mb=25``)
DEFAULT_BUCKET_BYTES = 25 << 20


def bucket_name(names) -> str:
    """``bucket<n>:<digest>`` of the member names, in their order (the DDP hook's names too)."""
    text = json.dumps(list(names), sort_keys=True, default=repr)
    return f"bucket{len(names)}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def needs_shapes(grace) -> bool:
    """Whether ``grace`` must see each parameter with its own shape: a strategy dispatcher
    (routes per name) or a compressor with ``needs_shape``."""
    return not isinstance(grace, Communicator) or grace.compressor.needs_shape


def check_bucket_bytes(bucket_bytes, grace=None):
    """``bucket_bytes`` if it is None or a positive int that ``grace`` can use, else a
    ``ValueError`` naming the bad value and what is accepted."""
    if bucket_bytes is None:
        return None
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int or None, got {bucket_bytes!r}")
    if grace is not None and needs_shapes(grace):
        what = (f"compressor {type(grace.compressor).__name__} needs each parameter's shape"
                if isinstance(grace, Communicator) else
                f"{type(grace).__name__} routes each parameter by its name")
        raise ValueError(f"bucket_bytes={bucket_bytes!r} cannot be used with this grace: {what}; "
                         f"pass bucket_bytes=None (one grace tensor per parameter), or a "
                         f"communicator whose compressor takes a flat bucket (any without "
                         f"needs_shape, e.g. topk, randomk, qsgd, signsgd, fp16, none)")
    return bucket_bytes


class Bucket:
    """Some parameters' gradients in one flat buffer, sent as one grace tensor."""

    __slots__ = ("params", "names", "numels", "starts", "name", "flat", "ready", "handles")

    def __init__(self, params, names):
        self.params, self.names = list(params), list(names)
        self.numels = [p.numel() for p in self.params]
        self.starts = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.name = bucket_name(self.names)
        self.flat = None     # the buffer, made at the first fill
        self.ready = 0       # members filled this step
        self.handles = None  # this step's handles once sent (a list when sent in pieces)

    def view(self, i: int):
        """Member ``i``'s slice of the buffer, shaped like its parameter."""
        if self.flat is None:
            p = self.params[0]
            self.flat = torch.empty(sum(self.numels), dtype=p.dtype, device=p.device)
        start = self.starts[i]
        return self.flat[start:start + self.numels[i]].view(self.params[i].shape)


def plan(params, names: dict, bucket_bytes: int) -> list[Bucket]:
    """The buckets of ``params`` (in the order gradients are expected: reverse registration),
    packed greedily per (dtype, device) up to ``bucket_bytes``; ``names``: parameter → name."""
    closed, open_ = [], {}
    for p in params:
        key = (p.dtype, p.device)
        size = p.numel() * p.element_size()
        members, used = open_.get(key, ([], 0))
        if members and used + size > bucket_bytes:
            closed.append(members)
            members, used = [], 0
        open_[key] = (members + [p], used + size)
    closed.extend(members for members, _ in open_.values())
    return [Bucket(members, [names[p] for p in members]) for members in closed]
