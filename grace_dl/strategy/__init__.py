"""Strategies: per-variable compression plans as AutoDist-style protobuf messages.

    from grace_dl.strategy import SizeThreshold, broadcast_strategy, from_strategy

    strategy = broadcast_strategy(lambda: SizeThreshold(4096, {
        "compressor": "topk", "compress_ratio": 0.01, "memory": "residual",
        "communicator": "allgather"}).build(model.named_parameters()), framework="torch")
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   grace=from_strategy(strategy))

* ``strategy.proto`` / ``strategy_pb2``: the messages (``Strategy``, ``Node``, synchronizers);
* ``builders``: ``AllReduce``, ``Uniform``, ``SizeThreshold``, ``PS``, ``Auto`` (cost model in
  ``cost_model``), fed by ``resource_spec`` (AutoDist's YAML);
* ``dispatcher``: ``from_strategy``, the ``grace=`` object that routes each gradient to its
  node's pipeline (the send path, fusion and the PS communicator are the core's);
* ``consensus``: ``broadcast_strategy`` and the cross-rank agreement check;
* ``spec``: ``from_spec``, a ``grace=`` object (schedule, size threshold, params) from JSON;
* ``serialize``: text and binary files; ``python -m grace_dl strategy build|show|validate``.
"""

from grace_dl.strategy import strategy_pb2
from grace_dl.strategy.builders import PS, AllReduce, Auto, SizeThreshold, StrategyBuilder, Uniform
from grace_dl.strategy.consensus import broadcast_strategy
from grace_dl.strategy.dispatcher import StrategyDispatcher, from_strategy
from grace_dl.strategy.pipeline import Pipeline
from grace_dl.strategy.resource_spec import ResourceSpec
from grace_dl.strategy.serialize import from_bytes, from_text, load, save, to_bytes, to_text
from grace_dl.strategy.spec import from_spec

Strategy = strategy_pb2.Strategy

__all__ = [
    "PS", "AllReduce", "Auto", "Pipeline", "ResourceSpec", "SizeThreshold", "Strategy",
    "StrategyBuilder", "StrategyDispatcher", "Uniform", "broadcast_strategy", "from_bytes",
    "from_spec", "from_strategy", "from_text", "load", "save", "strategy_pb2", "to_bytes",
    "to_text",
]
