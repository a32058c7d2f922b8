"""``efsignsgd``: the error-feedback memory of EF-SIGNSGD (Karimireddy, Rebjock, Stich, Jaggi
2019, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", Algorithm 1).

    compensate: p = lr * g + e[name]          (from the first step on)
    update:     e[name] = p - decompress(compress(p))

``e`` is stored in parameter units (lr already applied), in the gradient's shape and dtype, under
the tensor's name in ``self.state`` (so it survives ``state_dict``/``load_state_dict``). The
compressor ``efsignsgd`` sends the scaled sign of ``p`` and divides the aggregate by the same
``lr``; see ``grace_dl.compressors.efsignsgd`` for the whole step. Nothing is lost: the sum over
steps of what was sent equals ``lr`` times the sum of the gradients minus the final ``e``.
(GRACE's torch version skipped ``lr`` on the first step; its TF version applied it elsewhere.)
With equal ``lr`` on both sides its value only sets the units of ``e`` (default 1.0: gradient
units); the communicated result does not depend on it.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.memory import base
from grace_dl.registry import register_memory
from grace_dl.state import config_of
from grace_dl.validate import in_range


@register_memory("efsignsgd")
class EFSignSGDMemory(base.Memory):
    def __init__(self, lr: float = 1.0):
        super().__init__()
        self.lr = in_range("lr", lr, 0.0, None, lo_open=True)

    def compensate(self, tensor, name):
        ops = ops_for(tensor)
        return ops.read(self.state.zeros(name, ops, tensor)) + tensor * self.lr

    def refusal(self, compressor) -> str | None:
        other = config_of(compressor).get("lr", self.lr)
        if other != self.lr:
            return (f"memory efsignsgd has lr={self.lr!r} but its compressor "
                    f"{type(compressor).__name__} has lr={other!r}; they must match")
        return None

    def update(self, tensor, name, compressor, payload, ctx, approximation=None):
        ops = ops_for(tensor)
        sent = base.sent(compressor, payload, ctx, approximation)
        ops.assign(self.state.zeros(name, ops, tensor), tensor - sent)
        self.state.clean(name)      # a NaN/Inf is sent once, never kept (memory.base)
