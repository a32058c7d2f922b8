"""Gradient buckets, the framework-neutral part: several gradients packed into one flat tensor
and compressed once, as DDP does with its buckets.

**Layout** (``pack``): gradients in the order they are expected to become ready (for a
backward pass: reverse registration order, the order DDP's first buckets assume) are packed
greedily per dtype and device: a bucket is closed when the next gradient would take it past
``bucket_bytes``; a gradient larger than that has a bucket of its own. The layout follows from
the gradients' sizes alone, so it is the same on every rank. A bucket is named
``bucket<n>:<digest of its members' names>`` (``bucket_name``), so grace state (residuals,
step counters) follows the bucket's content, not its position.

**What goes on the wire** is the compressor's payload for the bucket's flat tensor. For
quantizers, signs and fp16 that is the per-tensor bits give or take one chunk header per
bucket; a sparsifier selects over the whole bucket (topk: a global top-k, so layers with large
gradients take more of the k; ``compress_ratio`` is a fraction of the bucket). Compressors that
need each layer's shape (PowerSGD's matrices: ``caps.needs_shape``) and strategy
dispatchers (which route by gradient name) cannot be bucketed (``check_bucket_bytes``).

The torch optimizer (``grace_dl.torch.buckets``), the DDP hook (``grace_dl.torch.ddp``, on DDP's
own buckets) and the TF tape and Keras optimizer (``grace_dl.tensorflow.gradients``) build on it.
"""

from __future__ import annotations

import hashlib
import json

from grace_dl.communicators.base import Communicator

#: DDP's default bucket size (``bucket_cap_mb=25``)
DEFAULT_BUCKET_BYTES = 25 << 20


def bucket_name(names) -> str:
    """``bucket<n>:<digest>`` of the member names, in their order."""
    text = json.dumps(list(names), sort_keys=True, default=repr)
    return f"bucket{len(names)}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def needs_shapes(grace) -> bool:
    """Whether ``grace`` must see each gradient with its own shape: a strategy dispatcher
    (routes per name), a compressor with ``needs_shape``, or a ``Schedule`` with a stage of
    either (a bucket's layout is one for every stage)."""
    from grace_dl.communicators.schedule import Schedule

    if isinstance(grace, Schedule):
        return any(map(needs_shapes, grace.parts()))
    return not isinstance(grace, Communicator) or grace.compressor.caps.needs_shape


def check_bucket_bytes(bucket_bytes, grace, groups=None):
    """``bucket_bytes`` if it is None or a positive int that ``grace`` can use (without fusion
    ``groups``: a bucket already sends its gradients together), else a ``ValueError`` naming
    the bad value and what is accepted. ``grace`` None: Horovod's own path, which has no
    buckets of ours."""
    if bucket_bytes is None:
        return None
    if grace is None:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} needs grace=: without it the reduction "
                         f"is Horovod's own, which fuses by HOROVOD_FUSION_THRESHOLD; pass "
                         f"bucket_bytes=None or a grace communicator")
    if groups is not None:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} and groups={groups!r} cannot be "
                         f"combined: a bucket already sends its gradients together; pass one "
                         f"of them")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int or None, got {bucket_bytes!r}")
    if needs_shapes(grace):
        from grace_dl.communicators.schedule import Schedule

        what = (f"compressor {type(grace.compressor).__name__} needs each parameter's shape"
                if isinstance(grace, Communicator) else
                "a Schedule stage's pipeline needs each parameter's shape, or routes it by "
                "its name (a strategy)" if isinstance(grace, Schedule) else
                f"{type(grace).__name__} routes each parameter by its name (a strategy "
                f"names its buckets per node: AllReduceSynchronizer.bucket)")
        raise ValueError(f"bucket_bytes={bucket_bytes!r} cannot be used with this grace: {what}; "
                         f"pass bucket_bytes=None (one grace tensor per parameter), or a "
                         f"communicator whose compressor takes a flat bucket (any without "
                         f"needs_shape, e.g. topk, randomk, qsgd, signsgd, fp16, none)")
    return bucket_bytes


def pack(items, bucket_bytes: int) -> list[list[int]]:
    """Positions of ``items``, ``[(key, nbytes)]`` in ready order (key: dtype and device),
    packed greedily per key up to ``bucket_bytes``; buckets in the order they were closed,
    then the open ones in the order their keys were first met."""
    closed, open_ = [], {}
    for i, (key, size) in enumerate(items):
        members, used = open_.get(key, ([], 0))
        if members and used + size > bucket_bytes:
            closed.append(members)
            members, used = [], 0
        open_[key] = (members + [i], used + size)
    return closed + [members for members, _ in open_.values()]
