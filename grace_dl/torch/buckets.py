"""Gradient buckets for the Horovod torch optimizer (``DistributedOptimizer(bucket_bytes=n)``):
the parameters that need gradients, in reverse registration order, packed as
``grace_dl.communicators.buckets`` packs them (layout, names, what goes on the wire).

**A step.** When a parameter's gradient is ready (its post-accumulate hook, after
``backward_passes_per_step`` passes) it is copied into its slice of the bucket's buffer (the
buffer is allocated once and kept); when the bucket's last member is in, the whole buffer is
sent through the communicator (in pieces where ``piece_bytes`` applies, as any large
gradient), so early buckets travel while the backward pass goes on. Where the memory
compensates in a slot of its own (``Feedback.accumulator``: residual error feedback), each
gradient is added into its range of the bucket's slot (or of its pieces' slots) instead, and
the compensation at send adds nothing: the copy into the buffer is saved, and the buffer only
receives the result. A parameter alone in its bucket is sent as its own gradient (no copy).
``synchronize()`` fills what never became ready (zeros for a parameter without a gradient, as
Horovod sends), receives every bucket in layout order into its buffer, and the buffer's slices
become the members' ``p.grad`` (copied in only where a slice cannot stand for the gradient: a
sparse or non-contiguous one, or a predivided one that must be rescaled): one copy per
gradient and step (none where the gradients are added into the residual), in exchange for one
compression and one set of collectives per bucket instead of per parameter.
"""

from __future__ import annotations

import torch

from grace_dl.communicators.buckets import bucket_name, pack


class Bucket:
    """Some parameters' gradients in one flat buffer, sent as one grace tensor."""

    __slots__ = ("params", "names", "numels", "starts", "name", "flat", "ready", "unit",
                 "sums")

    def __init__(self, params, names, name=None):
        self.params, self.names = list(params), list(names)
        self.numels = [p.numel() for p in self.params]
        self.starts = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.name = bucket_name(self.names) if name is None else name
        self.flat = None     # the buffer, made at the first fill
        self.ready = 0       # members filled this step
        self.unit = None     # this step's ``exchange.Unit`` once sent
        self.sums = None     # this step: [(start, slot)] the gradients are added into, or None

    def buffer(self):
        """The bucket's flat buffer, made at the first call and kept."""
        if self.flat is None:
            p = self.params[0]
            self.flat = torch.empty(sum(self.numels), dtype=p.dtype, device=p.device)
        return self.flat

    def view(self, i: int):
        """Member ``i``'s slice of the buffer, shaped like its parameter."""
        start = self.starts[i]
        return self.buffer()[start:start + self.numels[i]].view(self.params[i].shape)

    def add(self, i: int, grad) -> None:
        """Add member ``i``'s gradient into this step's ``sums`` (``(start, slot)``: the
        memory's slots of the bucket's pieces, in order, or one for the whole bucket), each
        part into the slot that holds its range."""
        start, end = self.starts[i], self.starts[i] + self.numels[i]
        grad = grad.reshape(-1)
        for at, slot in self.sums:
            lo, hi = max(start, at), min(end, at + slot.numel())
            if lo < hi:
                slot.view(-1)[lo - at:hi - at].add_(grad[lo - start:hi - start])


def plan(params, names: dict, bucket_bytes: int) -> list[Bucket]:
    """The buckets of ``params`` (in the order gradients are expected: reverse registration);
    ``names``: parameter → name."""
    params = list(params)
    layout = pack([((p.dtype, p.device), p.numel() * p.element_size()) for p in params],
                  bucket_bytes)
    return [Bucket([params[i] for i in members], [names[params[i]] for i in members])
            for members in layout]


def given(params, names: dict, layout) -> list[Bucket]:
    """The buckets a strategy names (``layout``: each bucket's member names in ready order,
    ``StrategyDispatcher.buckets``) and every other parameter of ``params`` alone under its own
    name (so the strategy routes it by that name); ``[]`` for no layout."""
    if not layout:
        return []
    params = list(params)
    by_name = {names[p]: p for p in params}
    unknown = [n for members in layout for n in members if n not in by_name]
    if unknown:
        raise ValueError(f"the strategy's buckets name {unknown[:5]}, which are not parameters "
                         f"of this optimizer that need gradients ({sorted(by_name)[:5]}...)")
    inside = {n for members in layout for n in members}
    return [Bucket([by_name[n] for n in members], members) for members in layout] + \
        [Bucket([p], [names[p]], name=names[p]) for p in reversed(params)
         if names[p] not in inside]
