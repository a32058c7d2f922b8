"""Foundation smoke test: Horovod torch allreduce/allgather/broadcast on every rank.

With ``--mpi4py-comm``, Horovod is started from an mpi4py communicator (``hvd.init(comm=...)``)."""

import sys

import horovod.torch as hvd
import torch

import mp

if "--mpi4py-comm" in sys.argv:
    from mpi4py import MPI

    hvd.init(comm=MPI.COMM_WORLD)
else:
    hvd.init()

r, n = hvd.rank(), hvd.size()
x = torch.arange(6, dtype=torch.float32) + 10 * r
summed = hvd.allreduce(x, op=hvd.Sum, name="smoke.sum")
gathered = hvd.allgather(torch.full((r + 1, 2), float(r)), name="smoke.gather")
root_value = hvd.broadcast(torch.tensor([float(r), 7.0]), root_rank=n - 1, name="smoke.bcast")
mp.report({"rank": r, "size": n, "sum": summed.numpy(), "gather": gathered.numpy(),
           "bcast": root_value.numpy(),
           "gloo": hvd.gloo_enabled(), "mpi": hvd.mpi_enabled()})
