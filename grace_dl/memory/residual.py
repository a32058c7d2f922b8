"""``residual``: classic error feedback (Seide et al. 2014, "1-bit SGD"; Stich et al. 2018,
"Sparsified SGD with memory"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD").

    compensate: x' = beta * residual[name] + gamma * x
    update:     residual[name] = x' - decompress(compress(x'))

With beta = gamma = 1 a communicator's compensation is done in the residual's slot
(``ResidualFeedback``, its speed path) and the update subtracts what was sent there: no
per-step tensors. For sparse compressors (``caps.sparse``) that is the k sent values at their
positions, never the dense approximation, so a step costs one pass over the tensor plus O(k).

With the defaults (beta = gamma = 1) nothing is ever lost: the sum over steps of what was sent
equals the sum of the gradients minus the final residual.

A NaN/Inf entry of ``x'`` leaves the residual at 0 there (``grace_dl.memory.base``): it is sent
in its own step (a sparse compressor's payload is marked), never kept for later ones.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.compressors import paths
from grace_dl.memory import base
from grace_dl.registry import register_memory
from grace_dl.validate import in_range


@register_memory("residual")
class ResidualMemory(base.Memory):
    def __init__(self, beta: float = 1.0, gamma: float = 1.0):
        super().__init__()
        self.beta = in_range("beta", beta, 0.0, None)
        self.gamma = in_range("gamma", gamma, 0.0, None, lo_open=True)

    def compensate(self, tensor, name):
        ops = ops_for(tensor)
        residual = ops.read(self.state.zeros(name, ops, tensor))
        if self.beta == 1.0 and self.gamma == 1.0:
            return residual + tensor
        return residual * self.beta + tensor * self.gamma

    def update(self, tensor, name, compressor, payload, ctx, approximation=None):
        self._assign_error(tensor, name, compressor, payload, ctx, approximation, False)

    def _assign_error(self, tensor, name, compressor, payload, ctx, approximation, in_slot):
        """The residual set to ``tensor`` (which it holds already when ``in_slot``) minus what
        was sent: the k sent values at their positions for a sparse compressor given no
        approximation, never the dense approximation."""
        ops = ops_for(tensor)
        residual = self.state.zeros(name, ops, tensor)
        entries = compressor.sent_entries(payload, ctx) if approximation is None else None
        if entries is None:
            sent = base.sent(compressor, payload, ctx, approximation)
            if in_slot:     # the slot holds ``tensor`` already
                ops.assign_sub(residual, sent)
            else:
                ops.assign(residual, tensor - sent)
        else:
            # sparse: the same values, without building the dense approximation
            if not in_slot:
                ops.assign(residual, tensor)
            ops.assign_sub_at(residual, *entries)
        self.state.clean(name)


@paths.register(ResidualMemory)
class ResidualFeedback(base.Feedback):
    """With beta = gamma = 1, compensation in the residual's own slot (no new tensor): the
    update then subtracts what was sent there, only the k sent values for sparse
    compressors; the slot is also what the framework glue adds a tensor's parts into
    (``accumulator``) and where a compressor's path writes its error while compressing
    (``error_slot``). Not for compressors whose payload is the compensated tensor itself
    (``sends_tensor``), which that subtraction would zero before it is sent."""

    def __init__(self, memory):
        super().__init__(memory)
        self._in_slot: dict = {}    # names compensated in their slot, not yet updated: the slot
        self._accumulated: set = set()  # names whose tensor was added into the slot already

    def _in_place(self, compressor) -> bool:
        return self.memory.beta == 1.0 and self.memory.gamma == 1.0 and \
            not compressor.caps.sends_tensor

    def wants_approximation(self, compressor) -> bool:
        return not compressor.caps.sparse

    def compensate(self, tensor, name, compressor):
        if not self._in_place(compressor):
            return self.memory.compensate(tensor, name)
        ops = ops_for(tensor)
        slot = self._in_slot[name] = self.memory.state.zeros(name, ops, tensor)
        if name in self._accumulated:
            self._accumulated.discard(name)
            return ops.read(slot)
        return ops.read(ops.assign_add(slot, tensor))

    def accumulator(self, name, like, compressor):
        if not self._in_place(compressor):
            return None
        self._accumulated.add(name)
        return self.memory.state.zeros(name, ops_for(like), like)

    def error_slot(self, name, compressor):
        return self._in_slot.get(name)

    def error_written(self, name, finite=False):
        self._in_slot.pop(name, None)
        if not finite:
            self.memory.state.clean(name)

    def update(self, tensor, name, compressor, payload, ctx, approximation=None):
        in_slot = self._in_slot.pop(name, None) is not None
        self.memory._assign_error(tensor, name, compressor, payload, ctx, approximation, in_slot)
