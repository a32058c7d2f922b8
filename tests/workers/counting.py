"""A ``Collectives`` that records the name of every collective it hands to the real one, for
tests that count collectives per step (fusion). Installed through a communicator's one routing
hook: ``grc.collectives = counting_hook(grc, calls)``."""

from grace_dl.collectives import Wrapping


class Counting(Wrapping):
    def __init__(self, inner, calls: list):
        super().__init__(inner)
        self.calls = calls

    def allreduce_async(self, tensor, name):
        self.calls.append(name)
        return self.inner.allreduce_async(tensor, name)

    def allreduce_async_(self, tensor, name, scale=1.0):
        handle = self.inner.allreduce_async_(tensor, name, scale)
        if handle is not None:
            self.calls.append(f"{name} (in place)")
        return handle

    def allgather_async(self, tensor, name):
        self.calls.append(name)
        return self.inner.allgather_async(tensor, name)

    def broadcast_async(self, tensor, root, name):
        self.calls.append(name)
        return self.inner.broadcast_async(tensor, root, name)

    def alltoall_async(self, tensor, splits, name):
        self.calls.append(name)
        return self.inner.alltoall_async(tensor, splits, name)

    def synchronize(self, handle):
        return self.inner.synchronize(handle)


def counting_hook(grc, calls: list):
    """A replacement for ``grc.collectives`` that counts into ``calls``."""
    real = grc.collectives
    return lambda tensor: Counting(real(tensor), calls)
