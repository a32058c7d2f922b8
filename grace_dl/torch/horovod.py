"""Drop-in for ``horovod.torch``: ``import grace_dl.torch.horovod as hvd``.

Every public name of ``horovod.torch`` (``init``, ``rank``, ``size``, ``allreduce``,
``broadcast_parameters``, ``Compression``, ``Average``, ``Sum``, ``ProcessSet``, ...) is
re-exported unchanged, except

* ``DistributedOptimizer``: Horovod's arguments plus ``grace=`` (see
  ``grace_dl.torch.optimizer``); ``grace=None`` returns Horovod's own optimizer;
* ``broadcast_optimizer_state``: Horovod's function, but for a grace optimizer the step it takes
  to initialise optimizer state runs without communicating (Horovod's own check for that only
  recognises its own optimizer class), so grace step counters and byte counts are not touched.
"""

from __future__ import annotations

import horovod.torch as _hvd

from grace_dl.torch import optimizer as _optimizer

globals().update({k: v for k, v in vars(_hvd).items() if not k.startswith("_")})
DistributedOptimizer = _optimizer.DistributedOptimizer


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """``horovod.torch.broadcast_optimizer_state`` that also accepts a grace optimizer."""
    if isinstance(optimizer, _optimizer._GraceDistributedOptimizer):
        with optimizer.skip_synchronize():
            return _hvd.broadcast_optimizer_state(optimizer, root_rank, model=model)
    return _hvd.broadcast_optimizer_state(optimizer, root_rank, model=model)

