"""Run a command bound to this rank's own CPU cores: ``python -m benchmarks.bind CMD ARGS...``.

The benchmarks emulate one host per rank on one machine (``benchmarks/network.py``), but the
ranks share its cores. Unbound, the scheduler moves both ranks' training threads and their
Horovod and gloo threads across the shared cores, one rank's backward pass falls behind the
other's and every collective waits for it (``docs/DECISIONS.md``, "Each rank bound to a core
of its own"). Real
hosts have cores of their own, and ``mpirun`` binds a rank to a core by default for 2 ranks.

Each rank (``HOROVOD_RANK``, ``OMPI_COMM_WORLD_RANK`` or torchrun's ``RANK``, out of the
matching size) gets an equal contiguous share of the cores this process may use, or, with more
ranks than cores, core ``rank % cores``; all of its threads (Horovod's and gloo's included)
inherit the binding. Outside a job, or where affinity cannot be set, the command runs unbound.
"""

from __future__ import annotations

import os
import sys

_RANK_SIZE = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
              ("RANK", "WORLD_SIZE"))


def cores_for(rank: int, size: int, cores: list[int]) -> list[int]:
    """The cores rank ``rank`` of ``size`` gets out of ``cores``."""
    if size <= 0 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a job of size {size}")
    if size > len(cores):
        return [cores[rank % len(cores)]]
    share = len(cores) // size
    return cores[rank * share:(rank + 1) * share]


def rank_and_size(env=os.environ) -> tuple[int, int] | None:
    """This process's rank and job size from the launcher's variables, or None outside a job."""
    for rank, size in _RANK_SIZE:
        if rank in env and size in env:
            return int(env[rank]), int(env[size])
    return None


def bind(env=os.environ) -> list[int] | None:
    """Bind this process to its rank's cores; the cores, or None where it stayed unbound."""
    job = rank_and_size(env)
    if job is None or not hasattr(os, "sched_setaffinity"):
        return None
    chosen = cores_for(*job, sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, chosen)
    return chosen


def command(argv: list[str]) -> list[str]:
    """``argv`` run through this module, so that it starts bound."""
    return [sys.executable, "-m", "benchmarks.bind", *argv]


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m benchmarks.bind CMD [ARGS...]")
    bind()
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
