"""``none``: no error feedback; what compression loses is lost."""

from __future__ import annotations

from grace_dl.compressors import paths
from grace_dl.memory.base import Feedback, Memory
from grace_dl.registry import register_memory


@register_memory("none")
class NoneMemory(Memory):
    def compensate(self, tensor, name):
        return tensor

    def update(self, tensor, name, compressor, payload, ctx, approximation=None):
        pass


@paths.register(NoneMemory)
class NoneFeedback(Feedback):
    """Nothing is compensated or kept: the communicator skips the memory altogether."""

    keeps_nothing = True

    def wants_approximation(self, compressor) -> bool:
        return False
