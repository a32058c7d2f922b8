"""``grace_from_params``: GRACE's dictionary interface, and the one parameter routing that it
and the strategy's ``Pipeline`` share.

    grc = grace_from_params({"compressor": "topk", "memory": "residual",
                             "communicator": "allgather", "compress_ratio": 0.01})

Every other key is handed to whichever of the three constructors takes a parameter of that name
(``momentum`` reaches both a ``signum`` compressor and a ``dgc`` memory, for instance). A key
that none of them takes, or a value a constructor rejects, raises ``ValueError`` naming the key
and listing what is accepted. The returned communicator exposes ``.compressor`` and ``.memory``
and serves torch and TensorFlow tensors alike.
"""

from __future__ import annotations

import inspect

from grace_dl.registry import lookup

KINDS = ("compressor", "memory", "communicator")
DEFAULTS = {"compressor": "none", "memory": "none", "communicator": "allreduce"}
# Keys every pipeline accepts. GRACE passed the world size explicitly; Horovod knows it, so the
# key is checked against nothing else. ``seed`` reaches the compressors that draw random numbers
# and means nothing to deterministic ones, so one params dict can sweep over methods.
IGNORED = {"world_size", "seed"}
# Constructor arguments that are not parameters: the pieces a communicator is built from.
_WIRING = {"self", "compressor", "memory"}


def accepted(cls, exclude=()) -> set[str]:
    """Names of the parameters ``cls``'s constructor takes."""
    sig = inspect.signature(cls.__init__)
    return {p for p, v in sig.parameters.items()
            if p not in _WIRING and p not in exclude
            and v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)}


def route(params: dict, defaults: dict | None = None, exclude=()) -> tuple[dict, dict]:
    """Split a dict of GRACE keys into ``(names, kwargs)``: the registry name of each kind and
    the constructor arguments each class gets. ``exclude``: constructor arguments the caller
    supplies itself (they are refused as keys). ``ValueError`` names unknown keys and kinds."""
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict of GRACE keys, got {type(params).__name__}")
    defaults = {**DEFAULTS, **(defaults or {})}
    params = dict(params)
    names = {kind: params.pop(kind, defaults[kind]) for kind in KINDS}
    classes = {kind: lookup(kind, name) for kind, name in names.items()}
    takes = {kind: accepted(cls, exclude) for kind, cls in classes.items()}
    known = set().union(*takes.values())
    unknown = sorted(k for k in params if k not in known and k not in IGNORED)
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} for compressor={names['compressor']!r}, "
            f"memory={names['memory']!r}, communicator={names['communicator']!r}; "
            f"accepted: {sorted(known)} (and {sorted(IGNORED)})")
    kwargs = {kind: {k: v for k, v in params.items() if k in takes[kind]} for kind in KINDS}
    return names, kwargs


def construct(kind: str, name: str, kwargs: dict, **wiring):
    """An instance of the ``kind`` registered as ``name``; a ``ValueError`` naming it and its
    accepted parameters for an unknown or missing argument."""
    cls = lookup(kind, name)
    unknown = sorted(set(kwargs) - accepted(cls))
    if unknown:
        raise ValueError(f"{kind} {name!r} takes no parameter(s) {unknown}; accepted: "
                         f"{sorted(accepted(cls))}")
    try:
        return cls(**wiring, **kwargs)
    except TypeError as err:  # a required parameter is missing
        raise ValueError(f"{kind} {name!r}: {err}; accepted parameters: "
                         f"{sorted(accepted(cls))}") from err


def build(names: dict, kwargs: dict, **communicator_args):
    """A ready communicator from ``route``'s output (``communicator_args``: process set, PS
    root, supplied by the caller)."""
    compressor = construct("compressor", names["compressor"], kwargs["compressor"])
    memory = construct("memory", names["memory"], kwargs["memory"])
    return construct("communicator", names["communicator"],
                     {**kwargs["communicator"], **communicator_args},
                     compressor=compressor, memory=memory)


def grace_from_params(params: dict):
    """Build a ready communicator (compressor + memory + collective) from a dict of GRACE keys."""
    return build(*route(params))
