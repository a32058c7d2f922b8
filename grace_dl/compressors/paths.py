"""The one seam for speed paths: a faster way to run a compressor's methods on one kind of
device, chosen once and tested against the compressor's own methods.

A compressor's methods (``compress``, ``decompress``, ``aggregate``, and the optional
``combine`` / ``decompress_into`` / ``compress_with_error`` / ``combine_with_feedback``) are the
**reference**: written once against the ops backend, the same in torch and TensorFlow. A
*speed path* is a class registered here for one exact compressor class and one device kind
(``register``); it implements some of those methods faster on that kind (fused Triton kernels
on a GPU) with the same payloads and the same results where the method is deterministic, and
inherits the reference for the rest. Communicators never call a compressor's methods
directly: they ask ``paths.on(tensor)`` (``Paths``, built with the communicator) for the path
of the tensor's device and call that.

Device kinds: ``"cuda"`` for torch tensors on a GPU (and for CPU tensors inside
``grace_dl.torch.kernels.emulate_device()``, how tests run the device path on a CPU),
``"cpu"`` for other torch tensors, ``"tensorflow"`` for TF tensors. A kind's paths are imported
the first time a tensor of that kind is seen (``PROVIDERS``), and each ``Paths`` keeps its
choice per kind from then on.

A compressor of a class with no path of its own runs the reference, also when it derives
from a class that has one (its overrides change what the methods do): ``Paths.describe()``
says which path serves each kind, and a one-time log line on ``grace_dl.paths`` names such a
subclass.
"""

from __future__ import annotations

import importlib
import logging

LOG = logging.getLogger("grace_dl.paths")

#: device kind -> the module whose import registers that kind's speed paths
PROVIDERS = {"cuda": "grace_dl.torch.device", "cpu": "grace_dl.native.paths"}

_REGISTRY: dict = {}
_LOADED: set = set()
_TOLD: set = set()


def register(compressor_cls: type, kind: str):
    """Class decorator: the decorated class is ``compressor_cls``'s speed path on ``kind``."""
    def decorate(path_cls):
        _REGISTRY[(compressor_cls, kind)] = path_cls
        return path_cls
    return decorate


def kind_of(tensor) -> str:
    """The device kind of ``tensor`` (see the module docstring)."""
    device = getattr(tensor, "device", None)
    if hasattr(device, "type"):          # a torch tensor
        from grace_dl.torch.kernels import on_device
        return "cuda" if on_device(tensor) else "cpu"
    return "tensorflow"


class Reference:
    """The compressor's own methods: the plain composition every speed path is held to.
    Speed paths derive from it and override what they do faster."""

    def __init__(self, compressor):
        self.compressor = compressor

    def compress(self, tensor, name, call):
        return self.compressor.compress(tensor, name, call)

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        return self.compressor.compress_with_error(tensor, name, call, error, decoded)

    def decompress(self, payload, ctx):
        return self.compressor.decompress(payload, ctx)

    def decompress_into(self, payload, ctx, out=None):
        return self.compressor.decompress_into(payload, ctx, out)

    def combine(self, payloads, ctx, out=None):
        return self.compressor.combine(payloads, ctx, out)

    def combine_with_feedback(self, payloads, ctx, slot, out):
        return self.compressor.combine_with_feedback(payloads, ctx, slot, out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.compressor).__name__})"


class Paths:
    """The path serving each device kind for one compressor, chosen on a kind's first tensor
    and kept: the registered speed path of the compressor's exact class, else the reference."""

    def __init__(self, compressor):
        self.compressor = compressor
        self._reference = Reference(compressor)
        self._by_kind: dict = {}

    def on(self, tensor):
        """The path for ``tensor``'s device kind (``tensor`` may be a payload: a list whose
        first tensor decides; the reference where there is none)."""
        while isinstance(tensor, (list, tuple)):
            if not tensor:
                return self._reference
            tensor = tensor[0]
        kind = kind_of(tensor)
        path = self._by_kind.get(kind)
        if path is None:
            path = self._by_kind[kind] = self._choose(kind)
        return path

    def _choose(self, kind: str):
        if kind in PROVIDERS and kind not in _LOADED:
            importlib.import_module(PROVIDERS[kind])
            _LOADED.add(kind)
        cls = type(self.compressor)
        path_cls = _REGISTRY.get((cls, kind))
        if path_cls is not None:
            return path_cls(self.compressor)
        base = next((b for b in cls.__mro__[1:] if (b, kind) in _REGISTRY), None)
        if base is not None and (cls, kind) not in _TOLD:
            _TOLD.add((cls, kind))
            LOG.info("%s derives from %s, which has a speed path on %s; %s runs its own "
                     "methods (the reference path) there", cls.__name__, base.__name__, kind,
                     cls.__name__)
        return self._reference

    def describe(self) -> dict:
        """``{kind: path class name}`` for the kinds seen so far."""
        return {kind: type(path).__name__ for kind, path in self._by_kind.items()}


def path_class(compressor_cls: type, kind: str):
    """The speed path registered for ``compressor_cls`` on ``kind`` (its provider imported),
    or None."""
    if kind in PROVIDERS and kind not in _LOADED:
        importlib.import_module(PROVIDERS[kind])
        _LOADED.add(kind)
    return _REGISTRY.get((compressor_cls, kind))
