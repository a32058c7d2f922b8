"""``grace_from_params``: GRACE's dictionary interface.

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

DEFAULTS = {"compressor": "none", "memory": "none", "communicator": "allreduce"}
# Keys every pipeline accepts. GRACE passed the world size explicitly; Horovod knows it, so the
# key is checked against nothing else. ``seed`` reaches the compressors that draw random numbers
# and means nothing to deterministic ones, so one params dict can sweep over methods.
IGNORED = {"world_size", "seed"}


def _accepted(cls) -> set[str]:
    sig = inspect.signature(cls.__init__)
    return {p for p, v in sig.parameters.items()
            if p != "self" and v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)}


def _kwargs_for(cls, params: dict, skip=()) -> dict:
    return {k: v for k, v in params.items() if k in _accepted(cls) and k not in skip}


def grace_from_params(params: dict):
    """Build a ready communicator (compressor + memory + collective) from a dict of GRACE keys."""
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict, got {type(params).__name__}")
    params = dict(params)
    chosen = {kind: params.pop(kind, DEFAULTS[kind]) for kind in DEFAULTS}
    classes = {kind: lookup(kind, name) for kind, name in chosen.items()}

    accepted = set(IGNORED)
    for cls in classes.values():
        accepted |= _accepted(cls) - {"compressor", "memory"}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} for compressor={chosen['compressor']!r}, "
            f"memory={chosen['memory']!r}, communicator={chosen['communicator']!r}; "
            f"accepted: {sorted(accepted - IGNORED)} (and {sorted(IGNORED)})")

    compressor = _construct(classes["compressor"], "compressor", chosen, params)
    memory = _construct(classes["memory"], "memory", chosen, params)
    comm_kwargs = _kwargs_for(classes["communicator"], params, skip=("compressor", "memory"))
    return classes["communicator"](compressor, memory, **comm_kwargs)


def _construct(cls, kind: str, chosen: dict, params: dict):
    kwargs = _kwargs_for(cls, params)
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required parameter is missing
        raise ValueError(f"{kind} {chosen[kind]!r}: {err}; accepted parameters: "
                         f"{sorted(_accepted(cls))}") from err
