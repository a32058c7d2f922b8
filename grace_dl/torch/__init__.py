"""PyTorch side: tensor ops backend, Horovod torch collectives, DistributedOptimizer.

``grace_dl.torch.DistributedOptimizer`` is loaded on first use, so importing the ops backend
never imports Horovod; it serves scripts that keep ``import horovod.torch as hvd``.
"""


def __getattr__(name):
    if name == "DistributedOptimizer":
        from grace_dl.torch.optimizer import DistributedOptimizer

        return DistributedOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
