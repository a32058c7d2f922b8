"""``from_spec``: a ``grace=`` object from a JSON-able description, so that a recipe with a
schedule and per-size pipelines (``grace_dl.recipes``) is one value a user can store and pass:

* a ``grace_from_params`` dict;
* ``{"size_threshold": {"min_elements": n, "params": dict, "small": dict}}``: a
  ``SizeThreshold`` strategy over the model's parameters (``from_strategy`` of it);
* ``{"schedule": {"<step>": spec, ...}}``: a ``grace_dl.Schedule`` of such specs; a key
  ``"<n>e"`` starts its stage after ``n`` epochs of ``steps_per_epoch`` optimizer steps.

    spec, momentum = grace_dl.recipes.recipe("topk")
    grc = from_spec(spec, model.named_parameters(), steps_per_epoch=len(loader))
"""

from __future__ import annotations

from grace_dl.communicators.schedule import Schedule
from grace_dl.params import grace_from_params
from grace_dl.strategy.builders import SizeThreshold
from grace_dl.strategy.dispatcher import from_strategy


def from_spec(spec: dict, named_parameters=None, steps_per_epoch: int | None = None):
    """The ``grace=`` object ``spec`` describes (module docstring). ``named_parameters`` (torch
    ``named_parameters()``, Keras variables or ``{name: shape}``) is needed by a
    ``size_threshold``; ``steps_per_epoch`` by a schedule key ``"<n>e"``."""
    if not isinstance(spec, dict):
        raise ValueError(f"spec must be a dict (grace_from_params keys, 'size_threshold' or "
                         f"'schedule'), got {spec!r}")
    if "schedule" in spec:
        stages = spec["schedule"]
        if not isinstance(stages, dict):
            raise ValueError(f"'schedule' must be a dict {{step: spec}}, got {stages!r}")
        named = named_parameters     # a generator (named_parameters()) serves every stage
        if named is not None and not isinstance(named, dict):
            named = list(named)
        return Schedule({_step(k, steps_per_epoch): from_spec(v, named, steps_per_epoch)
                         for k, v in stages.items()})
    if "size_threshold" in spec:
        if named_parameters is None:
            raise ValueError("a 'size_threshold' spec needs the model's named_parameters")
        args = spec["size_threshold"]
        if not isinstance(args, dict):
            raise ValueError(f"'size_threshold' takes a dict of SizeThreshold arguments "
                             f"(min_elements, params, small), got {args!r}")
        return from_strategy(SizeThreshold(**args).build(named_parameters))
    return grace_from_params(dict(spec))


def _step(key, steps_per_epoch):
    text = str(key)
    if text.endswith("e"):
        if steps_per_epoch is None:
            raise ValueError(f"schedule key {key!r} counts epochs: give steps_per_epoch")
        if not text[:-1].isdigit():
            raise ValueError(f"schedule key {key!r}: epochs must be a non-negative integer "
                             f"followed by 'e' (e.g. '1e')")
        return int(text[:-1]) * steps_per_epoch
    if isinstance(key, str):
        if not key.isdigit():
            raise ValueError(f"schedule key {key!r}: a step (non-negative integer) or '<n>e'")
        return int(key)
    return key
