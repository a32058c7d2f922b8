"""``signum``: signSGD with momentum, majority vote (Bernstein, Wang, Azizzadenesheli,
Anandkumar 2018, "signSGD: Compressed Optimisation for Non-Convex Problems", Algorithm 2
"Signum"; majority vote as in Bernstein et al. 2019).

Each rank keeps a momentum per tensor name, ``m <- momentum * m + (1 - momentum) * g``, and sends
the sign of ``m``; the aggregate is the majority vote over ranks, not averaged. The momentum
lives in ``self.state`` under ``"momentum/<name>"`` (the input's shape flattened, its dtype), so
it survives ``state_dict``/``load_state_dict``. ``momentum = 0`` is plain ``signsgd``.

Wire: exactly ``signsgd``'s, ``ceil(n/8) + 1`` uint8 (the packed signs of ``m``, then a status
byte set when ``m`` holds a NaN or an Inf), with ``ceil(n/8)`` more (the packed zero bits of ``m``)
where ``m`` has exact zeros: a parameter that has never had a gradient has ``m = 0`` and does not
move. Biased, not allreduce-safe, sizes depend on the data (whether ``m`` has zeros).
Not two-phase safe: compression updates the momentum, so the second phase's re-compression of
the voted signs would fold them into a momentum of its own.
"""

from __future__ import annotations

from grace_dl.backend import ops_for
from grace_dl.compressors import paths
from grace_dl.compressors.base import LOCAL, Capabilities
from grace_dl.compressors.signsgd import SignSGDCompressor, SignSGDPath
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range


@register_compressor("signum")
class SignumCompressor(SignSGDCompressor):
    caps = Capabilities(equal_sizes=False, average=False)
    def __init__(self, momentum: float = 0.9):
        super().__init__()
        self.state.accumulates = ("momentum/",)    # kept finite after each step, reset() zeroes
        self.momentum = in_range("momentum", momentum, 0.0, 1.0, hi_open=True)

    def momentum_step(self, ops, tensor, name):
        """The tensor's momentum slot (flat) after this step's update ``m <- beta m + (1 -
        beta) g``: what Signum sends the signs of. Every path of this class calls it."""
        flat = ops.flatten(tensor)
        slot = self.state.zeros(f"momentum/{name}", ops, flat)
        ops.assign_lerp(slot, flat, 1.0 - self.momentum)
        return slot

    def compress(self, tensor, name, call=LOCAL):
        ops = ops_for(tensor)
        slot = self.momentum_step(ops, tensor, name)
        return self._encode(ops, ops.read(slot)), (ops.shape(tensor), ops.dtype(tensor))


@paths.register(SignumCompressor)
class SignumPath(SignSGDPath):
    """signsgd's composition, except the error written while encoding: signum sends its
    momentum's signs, so its error is decoded after."""

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        return None
