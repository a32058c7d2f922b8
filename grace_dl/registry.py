"""Registration of compressors, memories and communicators by name.

Built-in methods live one per module (``grace_dl/compressors/<module>.py`` etc.) and register
themselves with the decorators below when imported; the table ``BUILTIN`` says which module holds
which name, so only what is used gets imported. A user's own subclass registers the same way::

    from grace_dl import Compressor, register_compressor

    @register_compressor("mine")
    class Mine(Compressor): ...

    grace_from_params({"compressor": "mine", "memory": "residual", "communicator": "allgather"})
"""

from __future__ import annotations

import importlib

KINDS = ("compressor", "memory", "communicator")

# name -> module, for everything grace_dl ships.
BUILTIN: dict[str, dict[str, str]] = {
    "compressor": {
        "none": "grace_dl.compressors.none",
        "fp16": "grace_dl.compressors.fp16",
        "bf16": "grace_dl.compressors.fp16",
        "qsgd": "grace_dl.compressors.qsgd",
        "terngrad": "grace_dl.compressors.terngrad",
        "natural": "grace_dl.compressors.natural",
        "onebit": "grace_dl.compressors.onebit",
        "signsgd": "grace_dl.compressors.signsgd",
        "signum": "grace_dl.compressors.signum",
        "efsignsgd": "grace_dl.compressors.efsignsgd",
        "u8bit": "grace_dl.compressors.u8bit",
        "inceptionn": "grace_dl.compressors.inceptionn",
        "sketch": "grace_dl.compressors.sketch",
        "topk": "grace_dl.compressors.topk",
        "randomk": "grace_dl.compressors.randomk",
        "threshold": "grace_dl.compressors.threshold",
        "dgc": "grace_dl.compressors.dgc",
        "adaq": "grace_dl.compressors.adaq",
        "powersgd": "grace_dl.compressors.powersgd",
    },
    "memory": {
        "none": "grace_dl.memory.none",
        "residual": "grace_dl.memory.residual",
        "dgc": "grace_dl.memory.dgc",
        "efsignsgd": "grace_dl.memory.efsignsgd",
        "powersgd": "grace_dl.memory.powersgd",
        "momentum": "grace_dl.memory.momentum",
    },
    "communicator": {
        "allreduce": "grace_dl.communicators.allreduce",
        "allgather": "grace_dl.communicators.allgather",
        "broadcast": "grace_dl.communicators.broadcast",
        "twophase": "grace_dl.communicators.twophase",
        "ps": "grace_dl.communicators.ps",
    },
}

_REGISTERED: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}


def _register(kind: str, name: str):
    def decorator(cls):
        existing = _REGISTERED[kind].get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"{kind} {name!r} is already registered to {existing.__qualname__}")
        _REGISTERED[kind][name] = cls
        if kind == "communicator":
            cls.name = name
        else:
            cls.registry_name = name
        return cls

    return decorator


def register_compressor(name: str):
    return _register("compressor", name)


def register_memory(name: str):
    return _register("memory", name)


def register_communicator(name: str):
    return _register("communicator", name)


def names(kind: str) -> list[str]:
    """Every name of ``kind`` that can be asked for (built in or registered)."""
    return sorted(set(BUILTIN[kind]) | set(_REGISTERED[kind]))


def lookup(kind: str, name: str) -> type:
    """The class registered as ``name``; ``ValueError`` naming the accepted ones otherwise."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(name, str):
        raise ValueError(f"{kind} name must be a string, got {name!r}; "
                         f"accepted: {', '.join(names(kind))}")
    if name not in _REGISTERED[kind] and name in BUILTIN[kind]:
        importlib.import_module(BUILTIN[kind][name])
    if name not in _REGISTERED[kind]:
        raise ValueError(f"unknown {kind} {name!r}; accepted: {', '.join(names(kind))}")
    return _REGISTERED[kind][name]
