"""What several test modules share in-process: a one-rank ``Collectives`` (so pipelines run
without Horovod or torch.distributed) and comparisons of parameter dicts."""

from __future__ import annotations

import numpy as np

from grace_dl.collectives import Collectives


class OneRank(Collectives):
    """The collectives of a one-process job: every collective returns (a copy of) its input."""

    def size(self):
        return 1

    def rank(self):
        return 0

    def allreduce_async(self, tensor, name):
        return tensor.clone()

    def allgather_async(self, tensor, name):
        return tensor.clone()

    def broadcast_async(self, tensor, root, name):
        return tensor.clone()

    def alltoall_async(self, tensor, splits, name):
        return tensor.clone(), splits

    def synchronize(self, handle):
        return handle


def assert_equal_dicts(a: dict, b: dict):
    """Same keys, bit-identical arrays."""
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def assert_dicts_differ(a: dict, b: dict):
    assert any(not np.array_equal(a[k], b[k]) for k in a)


#: the communicators tried, in order, for a compressor x memory pair (the first that carries it)
PREFERRED_COMMUNICATORS = ("allgather", "allreduce", "twophase")


def allowed(compressor: str, memory: str, communicator: str) -> bool:
    """Whether the registry builds this pipeline (``grace_from_params`` refuses it otherwise)."""
    import warnings

    from grace_dl import grace_from_params

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            grace_from_params({"compressor": compressor, "memory": memory,
                               "communicator": communicator})
        except ValueError:
            return False
    return True


def registry_pairs() -> list[str]:
    """``"compressor+memory+communicator"`` for every compressor x memory pair the registry
    allows, each with the first of ``PREFERRED_COMMUNICATORS`` that carries it."""
    from grace_dl.registry import names

    out = []
    for c in names("compressor"):
        for m in names("memory"):
            k = next((k for k in PREFERRED_COMMUNICATORS if allowed(c, m, k)), None)
            if k is not None:
                out.append(f"{c}+{m}+{k}")
    return out


def registry_triples() -> list[str]:
    """``"compressor+memory+communicator"`` for every triple the registry allows."""
    from grace_dl.registry import names

    return [f"{c}+{m}+{k}" for c in names("compressor") for m in names("memory")
            for k in names("communicator") if allowed(c, m, k)]


def registry_round_trip() -> list[str]:
    """Pipelines that cover every compressor (with residual memory where it can take it), every
    memory and every communicator at least once: for state round trips."""
    from grace_dl.registry import names

    out = []
    for c in names("compressor"):
        m = next(m for m in ("residual", "efsignsgd", "powersgd", "none")
                 if any(allowed(c, m, k) for k in PREFERRED_COMMUNICATORS))
        out.append(f"{c}+{m}+" + next(k for k in PREFERRED_COMMUNICATORS if allowed(c, m, k)))
    return out + ["topk+dgc+allgather", "topk+momentum+allgather", "signum+dgc+allgather",
                  "efsignsgd+efsignsgd+allgather", "powersgd+powersgd+allreduce",
                  "randomk+residual+allreduce", "qsgd+residual+twophase",
                  "signsgd+residual+twophase", "threshold+residual+broadcast",
                  "topk+residual+ps", "fp16+none+allreduce"]


def parse_pipeline(name: str) -> dict:
    """GRACE keys of ``"compressor+memory+communicator"``."""
    c, m, k = name.split("+")
    return {"compressor": c, "memory": m, "communicator": k}


def state_finite(grace) -> bool:
    """Whether every entry of ``grace``'s training state is finite."""
    def leaves(tree):
        if isinstance(tree, dict):
            for v in tree.values():
                yield from leaves(v)
        else:
            yield np.asarray(tree)
    return all(np.isfinite(v).all() for v in leaves(grace.state_dict()))


def topk_strategy(bucketed: bool = False):
    """A topk strategy dispatcher over three variables (``a`` 4x4, ``b`` 4, ``c`` 8), ``b``
    and ``c`` in one bucket when ``bucketed``."""
    from grace_dl.strategy import Pipeline, from_strategy
    from grace_dl.strategy.builders import assemble
    from grace_dl.strategy.variables import variables_of

    variables = variables_of({"a": (4, 4), "b": (4,), "c": (8,)})
    topk = Pipeline.from_params({"compressor": "topk", "memory": "residual",
                                 "communicator": "allgather", "compress_ratio": 0.25})
    return from_strategy(assemble(variables, [topk] * 3,
                                  buckets=[[2, 1], [0]] if bucketed else None))
