"""grace_dl: gradient compression (GRACE-style) for Horovod, in PyTorch and TensorFlow 2.

    from grace_dl import grace_from_params
    grc = grace_from_params({"compressor": "topk", "memory": "residual",
                             "communicator": "allgather", "compress_ratio": 0.01})

``grc`` is what ``grace=`` takes in ``grace_dl.torch.horovod.DistributedOptimizer`` and
``grace_dl.tensorflow.horovod.DistributedGradientTape``.
"""

from grace_dl.communicators.base import Communicator
from grace_dl.communicators.schedule import Schedule
from grace_dl.compressors.base import Capabilities, Compressor
from grace_dl.memory.base import Memory
from grace_dl.params import grace_from_params
from grace_dl.registry import (
    lookup,
    names,
    register_communicator,
    register_compressor,
    register_memory,
)

__version__ = "0.1.0"

__all__ = [
    "Capabilities", "Communicator", "Compressor", "Memory", "grace_from_params", "lookup", "names",
    "register_communicator", "register_compressor", "register_memory", "Schedule",
    "__version__",
]
