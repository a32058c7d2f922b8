"""The one seam for speed paths: a faster way to run a compressor's methods, chosen once and
tested against the compressor's own methods.

A compressor's methods (``compress``, ``decompress``, ``aggregate``) are the **reference**:
written once against the ops backend, the same in torch and TensorFlow; ``Reference`` composes
from them what communicators need besides (every rank's payload combined, a decompression
built in a given buffer, ...). A *speed path* is a class registered here for one exact
compressor class and one device kind, or for every kind (``ANY``: a method's own faster
composition, such as sparse payloads summed by one scatter); it does some of those things
faster with the same payloads and the same results where the method is deterministic, and
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
import inspect
import logging
import weakref

LOG = logging.getLogger("grace_dl.paths")

#: device kind -> the module whose import registers that kind's speed paths
PROVIDERS = {"cuda": "grace_dl.torch.device", "cpu": "grace_dl.native.paths"}

_REGISTRY: dict = {}
_LOADED: set = set()
_TOLD: set = set()
_FEEDBACK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: the kind of a path that serves every device (a compressor's own faster composition, in its
#: module: sparse payloads summed by one scatter, an average folded into k values); a path
#: registered for a device kind derives from it
ANY = "any"


def register(compressor_cls: type, kind: str = ANY):
    """Class decorator: the decorated class is ``compressor_cls``'s speed path on ``kind``
    (every kind without one of its own: ``ANY``)."""
    def decorate(path_cls):
        _REGISTRY[(compressor_cls, kind)] = path_cls
        return path_cls
    return decorate


def kind_of(tensor) -> str:
    """The device kind of ``tensor`` (see the module docstring)."""
    device = getattr(tensor, "device", None)
    if hasattr(device, "type"):          # a torch tensor (``on_device``)
        emulated = _TORCH_EMULATED or _torch_emulated()
        return "cuda" if device.type == "cuda" or emulated[0] else "cpu"
    return "tensorflow"


#: ``grace_dl.torch.kernels``' emulation flag (a one-element list), once a torch tensor was met
_TORCH_EMULATED: list | None = None


def _torch_emulated() -> list:
    global _TORCH_EMULATED
    from grace_dl.torch.kernels import _EMULATED

    _TORCH_EMULATED = _EMULATED
    return _EMULATED


class Reference:
    """The compressor's own methods composed plainly: the path every speed path is held to.
    Besides ``compress``/``decompress`` it offers what communicators need beyond them, each
    built from the compressor's methods alone:

    ``combine(payloads, ctx, out)``
        every rank's payload decompressed and ``aggregate``d (what a gathering communicator
        hands back); a speed path builds it in ``out`` (a torch tensor of the result's shape
        and dtype, or None) and returns it, the reference ignores ``out``;
    ``decompress_into(payload, ctx, out)``
        ``decompress``, built in ``out`` where a path can (an allreduce's one reduced payload);
    ``compress_with_error(tensor, name, call, error, decoded=None)``
        ``compress``, also writing ``tensor - decompress(payload, ctx)`` into ``error`` (and
        the decompression into ``decoded``) while compressing; None where the path cannot
        (the caller then decompresses). For a compressor that ``drops_nonfinite``, an
        ``error`` finite wherever ``tensor`` is (the communicator skips its clean-up when it
        knows ``tensor`` finite);
    ``combine_with_feedback(payloads, ctx, slot, out)``
        two-phase's server step in one go: ``combine`` added to the residual ``slot``, that
        compressed, its error left in ``slot``, its decompression in ``out``; returns the
        payload, or None (the communicator runs the steps one by one, same result);
    ``error_finite(payload)``
        True where the path knows, without a device synchronisation, that the error (or
        server slot) its ``compress_with_error`` / ``combine_with_feedback`` just wrote
        with ``payload`` holds no NaN/Inf: the communicator then skips that slot's clean-up
        (the reference: False, not known);
    ``divided(payload, divisor)``
        a payload that decompresses to this one's result divided by ``divisor``, made
        without a dense tensor (a sparse method's k values), or None: an average then divides
        the dense result (used only while ``aggregate`` is a sum: a path for an exact class);
    ``sent_lengths(payload, ctx)``
        for a payload compressed with ``call.exchanges_sizes``: an int32 tensor on its
        device, one entry a part, of how much of each (flattened) part is sent, its prefix of
        that length being the same payload; None where every part is sent whole (the
        reference's are: its ``compress`` returns what it sends).

    Speed paths derive from it (or from a compressor's generic path) and override what they
    do faster."""

    def __init__(self, compressor):
        self.compressor = compressor

    def compress(self, tensor, name, call):
        return self.compressor.compress(tensor, name, call)

    def compress_with_error(self, tensor, name, call, error, decoded=None):
        return None

    def decompress(self, payload, ctx):
        return self.compressor.decompress(payload, ctx)

    def decompress_into(self, payload, ctx, out=None):
        return self.decompress(payload, ctx)

    def combine(self, payloads, ctx, out=None):
        return self.compressor.aggregate([self.decompress(p, ctx) for p in payloads])

    def combine_with_feedback(self, payloads, ctx, slot, out):
        return None

    def divided(self, payload, divisor):
        return None

    def error_finite(self, payload) -> bool:
        return False

    def sent_lengths(self, payload, ctx):
        return None

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
        device = getattr(tensor, "device", None)
        if hasattr(device, "type"):     # (``kind_of``, inline: it runs for every tensor)
            emulated = _TORCH_EMULATED or _torch_emulated()
            kind = "cuda" if device.type == "cuda" or emulated[0] else "cpu"
        else:
            kind = "tensorflow"
        path = self._by_kind.get(kind)
        if path is None:
            path = self._by_kind[kind] = self._choose(kind)
        return path

    def _choose(self, kind: str):
        if kind in PROVIDERS and kind not in _LOADED:
            importlib.import_module(PROVIDERS[kind])
            _LOADED.add(kind)
        cls = type(self.compressor)
        path_cls = _REGISTRY.get((cls, kind)) or _REGISTRY.get((cls, ANY))
        if path_cls is not None:
            return path_cls(self.compressor)
        base = next((b for b in cls.__mro__[1:]
                     if (b, kind) in _REGISTRY or (b, ANY) in _REGISTRY), None)
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
    else its path for every kind (``ANY``), or None."""
    if kind in PROVIDERS and kind not in _LOADED:
        importlib.import_module(PROVIDERS[kind])
        _LOADED.add(kind)
    return _REGISTRY.get((compressor_cls, kind)) or _REGISTRY.get((compressor_cls, ANY))


def feedback_of(memory):
    """The path that runs ``memory`` for a communicator: the one registered for its exact
    class (``register(MemoryClass)``: compensation in the memory's own slot, the error
    written while compressing), else ``grace_dl.memory.base.Feedback`` (its own
    ``compensate``/``update``). One per memory object: the path keeps which names it
    compensated in place until their update."""
    try:
        path = _FEEDBACK.get(memory)
    except TypeError:       # a memory that cannot be a weak key (unhashable): not shared
        return _feedback_path(memory)
    if path is None:
        path = _FEEDBACK[memory] = _feedback_path(memory)
    return path


def _feedback_path(memory):
    """A new path for ``memory``: its exact class's registered one, else ``Feedback``."""
    from grace_dl.memory.base import Feedback
    cls = type(memory)
    path_cls = _REGISTRY.get((cls, ANY))
    if path_cls is not None:
        return path_cls(memory)
    base = next((b for b in cls.__mro__[1:] if (b, ANY) in _REGISTRY), None)
    if base is not None and cls not in _TOLD:
        _TOLD.add(cls)
        LOG.info("%s derives from %s, which has a speed path; %s runs its own compensate and "
                 "update (the reference path)", cls.__name__, base.__name__, cls.__name__)
    return Feedback(memory)


def overrides(cls: type, base: type, name: str) -> bool:
    """Whether ``cls`` (a subclass of ``base``) defines its own ``name`` instead of
    ``base``'s (a wrapper that says what it wraps, ``functools.wraps``, counts as the function
    it wraps). Asked once, when a communicator is built, to keep a speed path that relies on
    ``base``'s method away from a subclass that changed it."""
    own = getattr(cls, name, None)
    return own is not None and inspect.unwrap(own) is not getattr(base, name)


def own(compressor):
    """The path ``compressor`` runs where no device kind has one of its own (TensorFlow
    tensors, a torch device without speed paths): its class's ``ANY`` path, else the
    reference."""
    path_cls = _REGISTRY.get((type(compressor), ANY))
    return Reference(compressor) if path_cls is None else path_cls(compressor)
