"""``powersgd``: error feedback for PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank
Gradient Compression for Distributed Optimization", Algorithm 1 / Algorithm 2).

    compensate: M_w = g_w + e_w
    update:     e_w = M_w - P_hat Q_w^T       (P_hat Q_w^T = this rank's share of the result)

where Q_w = M_w^T P_hat is what this rank sent in the second round. The communicator's result is
sum_w P_hat Q_w^T (divided by the number of ranks W for ``op=average``), so
sum_w e_w = sum_w M_w - W * average: over all ranks, nothing sent is lost, and the residual is
local (it does not depend on the other ranks' gradients beyond the shared P_hat). This follows
the paper; PyTorch's DDP hook keeps M_w - average instead, which has the same sum over ranks
(memory ``residual`` gives that one: the allreduce communicator hands it the ranks' average as
the approximation). A tensor that went uncompressed leaves a zero residual.

With a single-round compressor this is plain error feedback (e = x - decompress(payload)).
A NaN/Inf entry leaves ``e`` at 0 there after the update (``grace_dl.memory.base``).
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.compressors import paths
from grace_dl.compressors.powersgd import PowerSGDCompressor
from grace_dl.memory import base
from grace_dl.registry import register_memory


@register_memory("powersgd")
class PowerSGDMemory(base.Memory):
    def compensate(self, tensor, name):
        ops = ops_for(tensor)
        return ops.read(self.state.zeros(name, ops, tensor)) + tensor

    def refusal(self, compressor) -> str | None:
        if compressor.caps.rounds > 1 and not isinstance(compressor, PowerSGDCompressor):
            return (f"memory 'powersgd' needs compressor powersgd (its local_share) or a "
                    f"single-round one, got {type(compressor).__name__} with "
                    f"rounds={compressor.caps.rounds}")
        return None

    def update(self, tensor, name, compressor, payload, ctx, approximation=None):
        self._assign_error(tensor, name, compressor, payload, ctx, approximation, False)

    def _assign_error(self, tensor, name, compressor, payload, ctx, approximation, in_slot):
        """The slot set to ``tensor`` (which it holds already when ``in_slot``) minus this
        rank's share of the result (multi-round) or what was sent (single-round)."""
        if compressor.caps.rounds > 1 and not ctx.low_rank:
            self.state.zero([name])     # sent uncompressed: nothing lost (no slot: nothing)
            return
        ops = ops_for(tensor)
        slot = self.state.zeros(name, ops, tensor)
        if compressor.caps.rounds > 1:
            if not in_slot:
                ops.assign(slot, tensor)
            compressor.subtract_local_share(ctx, slot)
        else:
            sent = base.sent(compressor, payload, ctx, approximation)
            if in_slot:
                ops.assign_sub(slot, sent)
            else:
                ops.assign(slot, tensor - sent)
        self.state.clean(name)      # a NaN/Inf is sent once, never kept (memory.base)


@paths.register(PowerSGDMemory)
class PowerSGDFeedback(base.Feedback):
    """Compensation in the error's own slot (no new tensor); the update then subtracts this
    rank's share there. A tensor PowerSGD never compresses (1-D, integer, too small to
    gain) has no slot at all: its residual would always be zero. Not for compressors whose
    payload is the compensated tensor itself; multi-round: ``update`` takes this rank's
    share from the compressor, not the approximation."""

    def __init__(self, memory):
        super().__init__(memory)
        self._in_slot: set[str] = set()    # names compensated in their slot, not yet updated

    def compensate(self, tensor, name, compressor):
        if compressor.caps.sends_tensor:
            return self.memory.compensate(tensor, name)
        ops = ops_for(tensor)
        if isinstance(compressor, PowerSGDCompressor) and compressor.never_compresses(ops, tensor):
            return tensor   # its residual is always zero: no slot, nothing to add or zero
        self._in_slot.add(name)
        return ops.read(ops.assign_add(self.memory.state.zeros(name, ops, tensor), tensor))

    def update(self, tensor, name, compressor, payload, ctx, approximation=None):
        in_slot = name in self._in_slot
        self._in_slot.discard(name)
        self.memory._assign_error(tensor, name, compressor, payload, ctx, approximation, in_slot)

    def wants_approximation(self, compressor) -> bool:
        return compressor.caps.rounds == 1
