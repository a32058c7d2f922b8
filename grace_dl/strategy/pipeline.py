"""A node's compression pipeline: compressor, memory and communicator, each a registry name with
constructor parameters.

``Pipeline`` is the hashable, comparable form the builders and the dispatcher share. It comes
from a strategy node (``from_node``, which also reads AutoDist's old compressor enum) or from a
dictionary of GRACE keys as ``grace_from_params`` takes them (``from_params``), and ``build``
turns it into a ready communicator.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from grace_dl.registry import lookup
from grace_dl.strategy import strategy_pb2 as pb

KINDS = ("compressor", "memory", "communicator")
DEFAULTS = {"compressor": "none", "memory": "none", "communicator": "allreduce"}
#: the communicator a PSSynchronizer node gets (grace_dl.strategy.ps)
PS = "ps"

# AutoDist's AllReduceSynchronizer.Compressor enum, for strategies that only set it.
LEGACY = {
    pb.AllReduceSynchronizer.NoneCompressor: ("none", "none"),
    pb.AllReduceSynchronizer.HorovodCompressor: ("fp16", "none"),
    pb.AllReduceSynchronizer.HorovodCompressorEF: ("fp16", "residual"),
}
LEGACY_NAMES = {pb.AllReduceSynchronizer.Compressor.Name(k): v for k, v in LEGACY.items()}


def _freeze(params: dict) -> tuple:
    return tuple(sorted(params.items()))


@dataclass(frozen=True)
class Pipeline:
    compressor: str = "none"
    compressor_params: tuple = ()
    memory: str = "none"
    memory_params: tuple = ()
    communicator: str = "allreduce"
    communicator_params: tuple = ()

    # ------------------------------------------------------------------ views
    def params(self, kind: str) -> dict:
        return dict(getattr(self, f"{kind}_params"))

    def label(self) -> str:
        """``topk(compress_ratio=0.01)+residual+allgather``: the name counters and state use."""
        parts = []
        for kind in KINDS:
            args = ",".join(f"{k}={v!r}" for k, v in getattr(self, f"{kind}_params"))
            parts.append(f"{getattr(self, kind)}({args})" if args else getattr(self, kind))
        return "+".join(parts)

    def as_params(self) -> dict:
        """The flat GRACE dictionary (``grace_from_params``'s form) when no two classes share a
        parameter name; otherwise ``ValueError`` (the flat form could not say whose it is)."""
        flat = {kind: getattr(self, kind) for kind in KINDS}
        for kind in KINDS:
            for key, value in getattr(self, f"{kind}_params"):
                if key in flat and flat[key] != value:
                    raise ValueError(f"parameter {key!r} differs between the pipeline's classes")
                flat[key] = value
        return flat

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_params(cls, params: dict, ps: bool = False) -> Pipeline:
        """From GRACE keys: ``{"compressor": "topk", "memory": "residual", "communicator":
        "allgather", "compress_ratio": 0.01}``. Every other key goes to each of the three
        classes whose constructor takes it; a key none takes raises ``ValueError``."""
        if not isinstance(params, dict):
            raise ValueError(f"pipeline params must be a dict of GRACE keys, got {params!r}")
        params = dict(params)
        default_comm = PS if ps else DEFAULTS["communicator"]
        chosen = {kind: params.pop(kind, DEFAULTS[kind] if kind != "communicator"
                                   else default_comm) for kind in KINDS}
        if chosen["compressor"] in LEGACY_NAMES:
            legacy_compressor, legacy_memory = LEGACY_NAMES[chosen["compressor"]]
            chosen["compressor"] = legacy_compressor
            if chosen["memory"] == "none":
                chosen["memory"] = legacy_memory
        params.pop("world_size", None)  # GRACE's key; Horovod knows the world size
        accepted = {kind: _accepted(_class(kind, chosen[kind])) for kind in KINDS}
        unknown = sorted(k for k in params if not any(k in a for a in accepted.values()))
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {unknown} for compressor={chosen['compressor']!r}, "
                f"memory={chosen['memory']!r}, communicator={chosen['communicator']!r}; "
                f"accepted: {sorted(set().union(*accepted.values()))}")
        split = {kind: {k: v for k, v in params.items() if k in accepted[kind]}
                 for kind in KINDS}
        return cls(chosen["compressor"], _freeze(split["compressor"]),
                   chosen["memory"], _freeze(split["memory"]),
                   chosen["communicator"], _freeze(split["communicator"]))

    @classmethod
    def from_node(cls, node) -> Pipeline:
        """The pipeline a ``Strategy.Node`` names (``ValueError`` for contradictions)."""
        which = node.WhichOneof("synchronizer")
        ps = which == "PSSynchronizer"
        chosen = {"compressor": node.compressor.name if node.HasField("compressor") else "",
                  "memory": node.memory.name if node.HasField("memory") else "",
                  "communicator": node.communicator.name if node.HasField("communicator")
                  else ""}
        for kind in KINDS:
            if getattr(node, kind).params and not chosen[kind]:
                raise ValueError(f"node {node.var_name!r}: {kind} has params but no name")
        legacy = node.AllReduceSynchronizer.compressor if which == "AllReduceSynchronizer" else 0
        if legacy:
            enum_name = pb.AllReduceSynchronizer.Compressor.Name(legacy)
            if chosen["compressor"]:
                raise ValueError(f"node {node.var_name!r} sets both compressor "
                                 f"{chosen['compressor']!r} and AutoDist's AllReduceSynchronizer"
                                 f".compressor {enum_name}; set only one")
            chosen["compressor"], legacy_memory = LEGACY[legacy]
            chosen["memory"] = chosen["memory"] or legacy_memory
        if ps and chosen["communicator"] not in ("", PS):
            raise ValueError(f"node {node.var_name!r} has a PSSynchronizer, whose communicator is "
                             f"{PS!r} (reduce to one rank, then broadcast), but names "
                             f"communicator {chosen['communicator']!r}; leave it unset")
        chosen = {kind: chosen[kind] or (PS if ps and kind == "communicator" else DEFAULTS[kind])
                  for kind in KINDS}
        params = {kind: params_from_proto(getattr(node, kind).params) for kind in KINDS}
        return cls(chosen["compressor"], _freeze(params["compressor"]),
                   chosen["memory"], _freeze(params["memory"]),
                   chosen["communicator"], _freeze(params["communicator"]))

    def write(self, node) -> None:
        """Put this pipeline into ``node``'s compressor/memory/communicator fields."""
        for kind in KINDS:
            method = getattr(node, kind)
            method.Clear()
            method.name = getattr(self, kind)
            params_to_proto(self.params(kind), method.params)

    def build(self, process_set=None, root: int = 0):
        """A ready communicator. Bad names or values raise ``ValueError`` naming them."""
        classes = {kind: _class(kind, getattr(self, kind)) for kind in KINDS}
        compressor = _construct(classes["compressor"], "compressor", self.compressor,
                                self.params("compressor"))
        memory = _construct(classes["memory"], "memory", self.memory, self.params("memory"))
        kwargs = self.params("communicator")
        if self.communicator == PS:
            kwargs["root"] = root
        try:
            return classes["communicator"](compressor, memory, process_set=process_set, **kwargs)
        except TypeError as err:
            raise ValueError(f"communicator {self.communicator!r}: {err}; accepted parameters: "
                             f"{sorted(_accepted(classes['communicator']))}") from err


# ------------------------------------------------------------------ classes and their arguments
def _class(kind: str, name: str):
    if kind == "communicator" and name == PS:
        from grace_dl.strategy.ps import PSCommunicator

        return PSCommunicator
    return lookup(kind, name)


def _accepted(cls) -> set[str]:
    sig = inspect.signature(cls.__init__)
    skip = {"self", "compressor", "memory", "process_set", "root"}
    return {p for p, v in sig.parameters.items()
            if p not in skip and v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)}


def _construct(cls, kind: str, name: str, kwargs: dict):
    unknown = sorted(set(kwargs) - _accepted(cls))
    if unknown:
        raise ValueError(f"{kind} {name!r} takes no parameter(s) {unknown}; accepted: "
                         f"{sorted(_accepted(cls))}")
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"{kind} {name!r}: {err}; accepted parameters: "
                         f"{sorted(_accepted(cls))}") from err


# ------------------------------------------------------------------ Param <-> Python
def params_from_proto(params) -> dict:
    out = {}
    for key, param in params.items():
        which = param.WhichOneof("value")
        if which is None:
            raise ValueError(f"parameter {key!r} has no value")
        out[key] = getattr(param, which)
    return out


def params_to_proto(params: dict, target) -> None:
    for key, value in params.items():
        param = target[key]
        if isinstance(value, bool):
            param.bool_value = value
        elif isinstance(value, int):
            param.int_value = value
        elif isinstance(value, float):
            param.double_value = value
        elif isinstance(value, str):
            param.string_value = value
        else:
            raise ValueError(f"parameter {key!r} = {value!r}: a strategy holds bool, int, float "
                             f"or str parameters, not {type(value).__name__}")
