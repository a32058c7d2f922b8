"""A node's compression pipeline: compressor, memory and communicator, each a registry name with
constructor parameters.

``Pipeline`` is the hashable, comparable form the builders and the dispatcher share. It comes
from a strategy node (``from_node``, which also reads AutoDist's old compressor enum) or from a
dictionary of GRACE keys as ``grace_from_params`` takes them (``from_params``), and ``build``
turns it into a ready communicator.
"""

from __future__ import annotations

from dataclasses import dataclass

from grace_dl import params as grace_params
from grace_dl.params import DEFAULTS, KINDS
from grace_dl.strategy import strategy_pb2 as pb

#: the communicator a PSSynchronizer node gets (grace_dl.communicators.ps)
PS = "ps"
#: constructor arguments a strategy supplies itself, never parameters in a node
SUPPLIED = ("process_set", "root")

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
        """From GRACE keys, routed exactly as ``grace_from_params`` routes them
        (``grace_dl.params.route``): ``{"compressor": "topk", "memory": "residual",
        "communicator": "allgather", "compress_ratio": 0.01}``. AutoDist's legacy compressor
        names are accepted too."""
        if not isinstance(params, dict):
            raise ValueError(f"pipeline params must be a dict of GRACE keys, got {params!r}")
        params = dict(params)
        legacy = LEGACY_NAMES.get(params.get("compressor"))
        if legacy is not None:
            params["compressor"] = legacy[0]
            if params.get("memory", "none") == "none":
                params["memory"] = legacy[1]
        names, kwargs = grace_params.route(params, {"communicator": PS} if ps else None,
                                           exclude=SUPPLIED)
        return cls(names["compressor"], _freeze(kwargs["compressor"]),
                   names["memory"], _freeze(kwargs["memory"]),
                   names["communicator"], _freeze(kwargs["communicator"]))

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
        supplied = {"process_set": process_set}
        if self.communicator == PS:
            supplied["root"] = root
        return grace_params.build({kind: getattr(self, kind) for kind in KINDS},
                                  {kind: self.params(kind) for kind in KINDS}, **supplied)

    def build_compressor(self):
        """The compressor alone (the cost model reads its byte formulas)."""
        return grace_params.construct("compressor", self.compressor, self.params("compressor"))


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
