"""A ``Collectives`` that records the name of every collective it hands to the real one, for
tests that count collectives per step (fusion). Installed through a communicator's one routing
hook: ``grc.collectives = counting_hook(grc, calls)``."""

from grace_dl.collectives import Wrapping


class Counting(Wrapping):
    """``events``, when given, also gets ``("issue", name)`` and ``("wait", name)`` in the
    order the pipeline starts collectives and waits for them."""

    def __init__(self, inner, calls: list, events: list | None = None):
        super().__init__(inner)
        self.calls = calls
        self.events = events
        self._names: dict = {}

    def _issued(self, name, handle):
        if self.events is not None:
            self.events.append(("issue", name))
            self._names[id(handle)] = (name, handle)
        return handle

    def allreduce_async(self, tensor, name):
        self.calls.append(name)
        return self._issued(name, self.inner.allreduce_async(tensor, name))

    def allreduce_async_(self, tensor, name, scale=1.0):
        handle = self.inner.allreduce_async_(tensor, name, scale)
        if handle is not None:
            self.calls.append(f"{name} (in place)")
        return handle

    def allgather_async(self, tensor, name):
        self.calls.append(name)
        return self._issued(name, self.inner.allgather_async(tensor, name))

    def broadcast_async(self, tensor, root, name):
        self.calls.append(name)
        return self._issued(name, self.inner.broadcast_async(tensor, root, name))

    def alltoall_async(self, tensor, splits, name):
        self.calls.append(name)
        return self._issued(name, self.inner.alltoall_async(tensor, splits, name))

    def synchronize(self, handle):
        if self.events is not None and id(handle) in self._names:
            self.events.append(("wait", self._names.pop(id(handle))[0]))
        return self.inner.synchronize(handle)


def counting_hook(grc, calls: list, events: list | None = None):
    """A replacement for ``grc.collectives`` that counts into ``calls`` (and logs issues and
    waits into ``events``)."""
    real = grc.collectives
    return lambda tensor: Counting(real(tensor), calls, events)
