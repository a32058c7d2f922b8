"""``none``: no error feedback; what compression loses is lost."""

from __future__ import annotations

from grace_dl.memory.base import Memory
from grace_dl.registry import register_memory


@register_memory("none")
class NoneMemory(Memory):
    needs_approximation = False

    def compensate(self, tensor, name):
        return tensor

    def update(self, tensor, name, compressor, payload, ctx, approximation=None):
        pass
