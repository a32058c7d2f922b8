"""``residual``: classic error feedback (Seide et al. 2014, "1-bit SGD"; Stich et al. 2018,
"Sparsified SGD with memory"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD").

    compensate: x' = beta * residual[name] + gamma * x
    update:     residual[name] = x' - decompress(compress(x'))

With the defaults (beta = gamma = 1) nothing is ever lost: the sum over steps of what was sent
equals the sum of the gradients minus the final residual.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.memory.base import Memory
from grace_dl.registry import register_memory
from grace_dl.validate import in_range


@register_memory("residual")
class ResidualMemory(Memory):
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
        ops = ops_for(tensor)
        sent = self.sent(compressor, payload, ctx, approximation)
        ops.assign(self.state.zeros(name, ops, tensor), tensor - sent)
