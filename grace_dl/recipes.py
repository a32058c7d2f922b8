"""Which memory, and whether the optimizer keeps its momentum, per method family; and the
warning for combinations known to diverge under momentum SGD.

Measured in ``benchmarks/results/recipes.md`` (digits and a 100-class mixture, 2 ranks, SGD
lr 0.05, momentum 0.9 for the baseline); the README's recipes table is this one with those
numbers. ``RECIPES[family]`` is ``(grace_from_params dict, optimizer momentum)``.

Why the families differ (see ``grace_dl.memory.momentum``):

* **magnitude sparsifiers** (``topk``, ``threshold``, ``dgc``): error feedback works because a
  coordinate waits only until it is large; put the momentum in front of the sparsifier
  (memory ``dgc``, i.e. ``momentum`` with error feedback and factor masking: Lin et al. 2018,
  §3.2-3.3) and run the optimizer without momentum;
* **random-k**: error feedback makes every coordinate wait a geometric number of steps (mean
  n/k) whatever its size and then arrive as one burst, which the optimizer's momentum keeps
  re-applying; send an unbiased (n/k-scaled) random-k of the momentum instead (memory
  ``momentum`` with ``error_feedback=False``, ``randomk`` with ``unbiased=True``; Wangni et
  al. 2018), optimizer without momentum. This wins on digits; on the longer 100-class mixture
  its variance adds up and memory ``dgc`` (optimizer momentum 0) is better (recipes.md);
* **quantizers and low rank** (``qsgd``, ``fp16``, ``powersgd``): every coordinate travels
  every step, so nothing is stale: keep the optimizer's momentum, with the method's usual
  memory (``residual``, ``powersgd``; Vogels et al. 2019).
"""

from __future__ import annotations

import warnings

from grace_dl.communicators.base import Communicator, FanOut

RECIPES: dict[str, tuple[dict, float]] = {
    "topk": ({"compressor": "topk", "compress_ratio": 0.01, "memory": "dgc",
              "communicator": "allgather"}, 0.0),
    "randomk": ({"compressor": "randomk", "compress_ratio": 0.1, "unbiased": True,
                 "memory": "momentum", "error_feedback": False, "factor_masking": False,
                 "communicator": "allreduce"}, 0.0),
    "qsgd": ({"compressor": "qsgd", "quantum_num": 64, "memory": "residual",
              "communicator": "twophase"}, 0.9),
    "powersgd": ({"compressor": "powersgd", "compress_rank": 2, "memory": "powersgd",
                  "communicator": "allreduce"}, 0.9),
}

_MOMENTUM_MEMORIES = ("DgcMemory", "MomentumMemory")


def recipe(family: str) -> tuple[dict, float]:
    """``(grace_from_params dict, optimizer momentum)`` for ``family``; the momentum given
    to the memory (``momentum`` key, where it has one) is the one the optimizer would have had."""
    if family not in RECIPES:
        raise ValueError(f"family must be one of {sorted(RECIPES)}, got {family!r}")
    params, momentum = RECIPES[family]
    return dict(params), momentum


def communicators(grace) -> list:
    """The communicators behind a ``grace=`` object: itself, a Schedule's stages, a strategy
    dispatcher's pipelines."""
    if isinstance(grace, Communicator):
        return [grace]
    if isinstance(grace, FanOut):
        return [c for part in grace.parts() for c in communicators(part)]
    return []


def problems(grace, optimizer_momentum: float) -> list[str]:
    """What is known to go wrong with ``grace`` under an optimizer with this momentum."""
    out = []
    for comm in communicators(grace):
        compressor, memory = comm.compressor, comm.memory
        ckind, mkind = type(compressor).__name__, type(memory).__name__
        error_feedback = mkind in ("ResidualMemory", "DgcMemory", "EFSignSGDMemory",
                                   "PowerSGDMemory") or (
            mkind == "MomentumMemory" and memory.error_feedback)
        label = f"{ckind} + {mkind}"
        if mkind in _MOMENTUM_MEMORIES and optimizer_momentum > 0:
            out.append(f"{label}: the memory already applies momentum "
                       f"{memory.momentum}; with optimizer momentum {optimizer_momentum} it "
                       f"is applied twice (set the optimizer's momentum to 0)")
        if ckind != "RandomKCompressor":
            continue
        if getattr(compressor, "unbiased", False) and error_feedback:
            out.append(f"{label}: randomk with unbiased=True scales the sent values by n/k, "
                       f"so an error-feedback residual x - (n/k) x grows without bound; use "
                       f"memory 'momentum' with error_feedback=False (or 'none')")
        elif error_feedback and optimizer_momentum > 0:
            out.append(f"{label} with optimizer momentum {optimizer_momentum}: known to "
                       f"diverge (each coordinate's residual waits ~n/k steps, then arrives as "
                       f"one burst the optimizer's momentum keeps re-applying; digits: 51% vs "
                       f"97% uncompressed). Recipe: randomk unbiased=True, memory 'momentum' "
                       f"with error_feedback=False, optimizer momentum 0")
        elif getattr(compressor, "unbiased", False) and optimizer_momentum > 0:
            out.append(f"{label} with optimizer momentum {optimizer_momentum}: known to "
                       f"diverge (the optimizer keeps re-applying each n/k-times amplified "
                       f"coordinate; digits: NaN by epoch 7). Recipe: memory 'momentum' with "
                       f"error_feedback=False, optimizer momentum 0")
    return out


def optimizer_momentum(param_groups) -> float:
    """The largest ``momentum`` of an optimizer's parameter groups (SGD, RMSprop); 0 if none."""
    values = [float(g.get("momentum", 0.0) or 0.0) for g in param_groups]
    return max(values, default=0.0)


def warn_known_problems(grace, momentum: float, stacklevel: int = 3) -> list[str]:
    """``UserWarning`` for each of ``problems(grace, momentum)``; returns them."""
    found = problems(grace, momentum)
    for text in found:
        warnings.warn(f"grace_dl: {text} (see grace_dl.recipes and the README's recipes)",
                      UserWarning, stacklevel=stacklevel)
    return found
