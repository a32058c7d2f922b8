"""The quantizers under real horovodrun / mpirun (2 ranks): what ``allgather`` (and, for the
allreduce-safe fp16, ``allreduce``) returns equals a single-process replay of every rank's
compress/decompress, on every rank, and the byte counters hold exactly the payloads: uint8 codes,
int8/int16 values and 1-element scalars all cross Horovod as they are."""

import numpy as np
import pytest
import tensorflow as tf
import torch
from workers.quantizers_allgather import COMMUNICATORS, CONFIGS, SHAPE, STEPS, grad

import mp
from grace_dl import grace_from_params
from grace_dl.backend import ops_for
from grace_dl.compressors.base import Call


def replay(params, mode, size):
    """Per step: the average over ranks of decompress(compress(grad)), and each rank's bytes."""
    to_tensor = torch.from_numpy if mode == "torch" else tf.constant
    comps = [grace_from_params({**params, "communicator": "allgather"}).compressor
             for _ in range(size)]
    outs, nbytes = [], []
    for step in range(STEPS):
        total, sent = 0.0, []
        for rank, comp in enumerate(comps):
            payload, ctx = comp.compress(to_tensor(grad(rank, step)), "w", Call(rank, size))
            out = comp.decompress(payload, ctx)
            total = total + ops_for(out).to_numpy(out).astype(np.float64)
            sent.append(sum(int(ops_for(p).nbytes(p)) for p in payload))
            lengths = 0 if comp.caps.equal_sizes else 4 * len(payload)
        outs.append(total / size)
        nbytes.append([s + lengths for s in sent])
    return outs, nbytes


@pytest.mark.multiproc
@pytest.mark.parametrize("mode,launcher", [("torch", "gloo"), ("tf-graph", "mpi")])
def test_quantizers_through_horovod_on_two_ranks(mode, launcher):
    size = 2
    results = mp.run("quantizers_allgather.py", np=size, launcher=launcher, args=[mode],
                     timeout=400)
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == size for r in results)
    for key, params in CONFIGS.items():
        expect, nbytes = replay(params, "torch" if mode == "torch" else "tf", size)
        for comm in COMMUNICATORS[key]:
            half_sum = comm == "allreduce"  # 16-bit sums on the wire: rounding of the sum
            tol = {"rtol": 1e-2, "atol": 1e-3} if half_sum else {"rtol": 1e-5, "atol": 1e-7}
            for res in results:
                for step in range(STEPS):
                    got = res[(key, comm)]["out"][step]
                    assert got.shape == SHAPE
                    np.testing.assert_allclose(got, expect[step], err_msg=f"{key}/{comm}",
                                               **tol)
                    if comm == "allgather":
                        counted = res[(key, comm)]["bytes"][step]
                        mine = nbytes[step][res["rank"]]
                        others = sum(nbytes[step]) - mine
                        assert (counted["sent"], counted["received"]) == (mine, others), key
