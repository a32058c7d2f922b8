"""Every communicator with every compressor it accepts, under real horovodrun / mpirun:
the result is identical on every rank, equals a single-process replay of the same math over all
ranks' inputs (``comm_common``), and the byte counters record what the collectives moved.

One launch per (framework, ranks, launcher) runs every pair, to keep the multi-process time low.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import mp

sys.path.insert(0, str(mp.WORKERS))
import comm_common as cc  # noqa: E402

from grace_dl.backend import ops_for  # noqa: E402

COMMS = "allreduce,allgather"


def _framework_tensor(mode):
    if mode == "torch":
        import torch

        return torch.from_numpy
    import tensorflow as tf

    return tf.constant


def _nbytes(tensors):
    return sum(int(ops_for(t).nbytes(t)) for t in tensors)


def _tolerance(comm, comp):
    if comm == "allreduce" and comp in ("fp16", "bf16"):
        return {"rtol": 1e-2, "atol": 1e-2}  # half-precision sums, in Horovod's order
    return {"rtol": 1e-5, "atol": 1e-6}


def replay(comm, comp, mode, size):
    """Reference outputs and per-rank expected (sent, received) bytes for every step/tensor."""
    tensor = _framework_tensor(mode)
    ranks = [cc.SimRank(comp) for _ in range(size)]
    servers = [{} for _ in range(size)]
    outs, expect = [], []
    for s in range(cc.STEPS):
        step_out, step_bytes = [], {}
        for name in cc.TENSORS:
            xs = [tensor(cc.make_input(r, s, name)) for r in range(size)]
            if comm == "allreduce":
                out, rounds = cc.reference_allreduce(ranks, xs, name, "average")
                ring = sum(2 * (size - 1) * _nbytes(p) // size for p in rounds)
                step_bytes[name] = [(ring, ring)] * size
            elif comm in ("allgather", "broadcast"):
                out, sent = cc.reference_gather(ranks, xs, name, "average")
                own = [_nbytes(p) for p, _ in sent]
                lengths = 0 if ranks[0].compressor.equal_sizes else 4 * len(sent[0][0])
                step_bytes[name] = [(own[r] + lengths,
                                     sum(own) - own[r] + lengths * (size - 1))
                                    for r in range(size)]
            else:
                out, chunks = cc.reference_twophase(ranks, xs, name, "average", servers)
                m = len(chunks[0])
                own = [[_nbytes(p) for p, _ in chunks[r]] for r in range(size)]
                step_bytes[name] = [
                    (sum(own[r][j] for j in range(m) if j != r)
                     + (own[r][r] if r < m else 0),
                     sum(own[q][r] for q in range(size) if q != r) if r < m else 0)
                    for r in range(size)]
                for r in range(size):  # phase 2: the gather of every other owner's chunk
                    sent2 = own[r][r] if r < m else 0
                    recv2 = sum(own[j][j] for j in range(m) if j != r)
                    a, b = step_bytes[name][r]
                    step_bytes[name][r] = (a - (own[r][r] if r < m else 0) + sent2, b + recv2)
            step_out.append(ops_for(out).to_numpy(out))
        outs.append(step_out)
        expect.append(step_bytes)
    return outs, expect


def whole_payload_bytes(comp, mode, name, step, rank=0):
    """Bytes of one rank's payload when the whole tensor is compressed at once."""
    x = _framework_tensor(mode)(cc.make_input(rank, step, name))
    payload, _ = cc.SimRank(comp).compressor.compress(x, name)
    return _nbytes(payload)


def check(results, mode, size):
    problems = []
    assert [r["rank"] for r in results] == list(range(size))
    pairs = results[0]["results"]
    assert pairs, "no (communicator, compressor) pair ran"
    for (comm, comp), res in pairs.items():
        tag = f"{comm}/{comp}"
        for other in results[1:]:
            for s in range(cc.STEPS):
                for a, b, name in zip(res["outs"][s], other["results"][(comm, comp)]["outs"][s],
                                      cc.TENSORS):
                    if not np.array_equal(a, b):
                        problems.append(f"{tag} step {s} {name}: rank {other['rank']} differs "
                                        f"from rank 0")
        ref_outs, ref_bytes = replay(comm, comp, mode, size)
        for s in range(cc.STEPS):
            for got, want, name in zip(res["outs"][s], ref_outs[s], cc.TENSORS):
                if not np.allclose(got, want, **_tolerance(comm, comp)):
                    err = np.max(np.abs(got.astype(np.float64) - want))
                    problems.append(f"{tag} step {s} {name}: max |error| {err:g} vs reference")
        for r, rank_res in enumerate(results):
            counted = rank_res["results"][(comm, comp)]["bytes"]
            for s in range(cc.STEPS):
                for name in cc.TENSORS:
                    got = tuple(counted[s]["per_tensor"][name])
                    want = ref_bytes[s][name][r]
                    if got != tuple(want):
                        problems.append(f"{tag} step {s} {name} rank {r}: counted "
                                        f"(sent, received) {got}, expected {want}")
    assert not problems, "\n".join(problems)
    return pairs


def _run(mode, size, launcher="gloo"):
    results = mp.run("comm_check.py", np=size, launcher=launcher, args=[mode, COMMS],
                     timeout=240)
    return check(results, mode, size), results


@pytest.mark.multiproc
@pytest.mark.parametrize("size", [2, 4])
def test_torch_gloo(size):
    pairs, results = _run("torch", size)
    comms = {c for c, _ in pairs}
    assert {"allreduce", "allgather"} <= comms


@pytest.mark.multiproc
def test_torch_mpi():
    _run("torch", 2, launcher="mpi")


@pytest.mark.multiproc
@pytest.mark.parametrize("mode,launcher", [("tf-graph", "gloo"), ("tf-eager", "mpi")])
def test_tensorflow(mode, launcher):
    _run(mode, 2, launcher)
