"""Every communicator with every compressor it accepts, under real horovodrun / mpirun:
the result is identical on every rank, equals a single-process replay of the same math over all
ranks' inputs (``comm_common``), and the byte counters record what the collectives moved.

One launch per (framework, ranks, launcher) runs every pair, to keep the multi-process time low.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import pytest

import mp

sys.path.insert(0, str(mp.WORKERS))
import comm_common as cc  # noqa: E402

from grace_dl.backend import ops_for  # noqa: E402

COMMS = "allreduce,allgather,broadcast,twophase"


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
    ranks = [cc.SimRank(comp, r) for r in range(size)]
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
                lengths = 0 if ranks[0].compressor.caps.equal_sizes else 4 * len(sent[0][0])
                step_bytes[name] = [(own[r] + lengths,
                                     sum(own) - own[r] + lengths * (size - 1))
                                    for r in range(size)]
            else:
                out, chunks, again = cc.reference_twophase(ranks, xs, name, "average", servers)
                m = len(chunks[0])
                own = [[_nbytes(p) for p, _ in chunks[r]] for r in range(size)]
                # alltoall: my payloads for the others' chunks out, theirs for mine in;
                # allgather: my re-compressed chunk out, the other owners' in. Where sizes
                # vary, the re-compressed chunk's own size, and the gather carries each rank's
                # parts' lengths (int32) too.
                gathered = [_nbytes(p) for p in again]
                lengths = 0 if ranks[0].compressor.caps.equal_sizes else 4 * len(chunks[0][0][0])
                step_bytes[name] = [
                    (sum(own[r][j] for j in range(m) if j != r)
                     + (gathered[r] if r < m else 0) + lengths,
                     (sum(own[q][r] for q in range(size) if q != r) if r < m else 0)
                     + sum(gathered[j] for j in range(m) if j != r) + lengths * (size - 1))
                    for r in range(size)]
            step_out.append(ops_for(out).to_numpy(out))
        outs.append(step_out)
        expect.append(step_bytes)
    return outs, expect


def whole_payload_bytes(comp, mode, name, step, rank=0):
    """Bytes of one rank's payload when the whole tensor is compressed at once."""
    x = _framework_tensor(mode)(cc.make_input(rank, step, name))
    payload, _ = cc.SimRank(comp).compressor.compress(x, name)
    return _nbytes(payload)


def check(results, size):
    """Every rank's output identical, equal to the replay, and bytes counted as expected."""
    problems = []
    assert [r["rank"] for r in results] == list(range(size))
    pairs = results[0]["results"]
    assert pairs, "no (communicator, compressor) pair ran"
    for key, res in pairs.items():
        mode, comm, comp = key
        tag = "/".join(key)
        for other in results[1:]:
            for s in range(cc.STEPS):
                for a, b, name in zip(res["outs"][s], other["results"][key]["outs"][s],
                                      cc.TENSORS):
                    if not np.array_equal(a, b, equal_nan=True):
                        problems.append(f"{tag} step {s} {name}: rank {other['rank']} differs "
                                        f"from rank 0")
        ref_outs, ref_bytes = replay(comm, comp, "torch" if mode == "torch" else "tf", size)
        for s in range(cc.STEPS):
            for got, want, name in zip(res["outs"][s], ref_outs[s], cc.TENSORS):
                if not np.allclose(got, want, equal_nan=True, **_tolerance(comm, comp)):
                    err = np.max(np.abs(got.astype(np.float64) - want))
                    problems.append(f"{tag} step {s} {name}: max |error| {err:g} vs reference")
        for r, rank_res in enumerate(results):
            counted = rank_res["results"][key]["bytes"]
            for s in range(cc.STEPS):
                for name in cc.TENSORS:
                    got = tuple(counted[s]["per_tensor"][name])
                    want = ref_bytes[s][name][r]
                    if got != tuple(want):
                        problems.append(f"{tag} step {s} {name} rank {r}: counted "
                                        f"(sent, received) {got}, expected {want}")
    assert not problems, "\n".join(problems)


# (launcher, ranks) -> the launches of that job: (modes run in one launch, compressors the TF
# modes are limited to, or None). TF traces every pair, slowly on two shared cores: at 4 ranks
# it runs a representative set (exact, allreduce-safe, sparsifier, variable-size, quantizer).
# A launch that starts both frameworks' Horovod runs two background loops per rank: at 4 ranks
# on two cores torch's pairs took ~166 s beside TF's, ~10 s alone. So each gloo job gives each
# framework its own launch (mpi's, 54 s for torch and eager TF together, shares one).
TF_AT_4 = "allreduce/fp16,allgather/topk,broadcast/threshold,twophase/none,twophase/qsgd"
LAUNCHES = {("gloo", 2): [("torch", None), ("tf-graph", None)],
            ("gloo", 4): [("torch", None), ("tf-graph", TF_AT_4)],
            ("mpi", 2): [("torch,tf-eager", None)]}


@functools.lru_cache(maxsize=None)
def _launch(launcher, size):
    """Every rank's results of the job's launches, merged (one dict per rank)."""
    merged = None
    for modes, tf_only in LAUNCHES[(launcher, size)]:
        try:
            results = mp.run("comm_check.py", np=size, launcher=launcher,
                             args=[modes, COMMS] + ([tf_only] if tf_only else []),
                             timeout=420)
        except AssertionError as err:  # remembered: the tests sharing a launch fail at once
            return err
        if merged is None:
            merged = results
            continue
        for into, res in zip(merged, results):
            into["results"].update(res["results"])
            into["seconds"].update(res["seconds"])
            into["total_seconds"] += res["total_seconds"]
    return merged


def launch(launcher, size):
    results = _launch(launcher, size)
    if isinstance(results, AssertionError):
        raise results
    return results


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher,size", list(LAUNCHES))
def test_every_pair_matches_single_process_reference(launcher, size):
    results = launch(launcher, size)
    check(results, size)
    ran = {(m, c) for m, c, _ in results[0]["results"]}
    expected, modes = set(), set()
    for launched, tf_only in LAUNCHES[(launcher, size)]:
        modes |= set(launched.split(","))
        expected |= {(m, *pair) for m in launched.split(",")
                     for pair in cc.pairs(COMMS.split(","))
                     if m == "torch" or tf_only is None
                     or {pair[1], "/".join(pair)} & set(tf_only.split(","))}
    assert ran == {(m, c) for m in modes for c in COMMS.split(",")}
    assert set(results[0]["results"]) == expected
    assert not results[0]["missing"], results[0]["missing"]


@pytest.mark.multiproc
@pytest.mark.parametrize("size", [2, 4])
def test_twophase_receives_under_two_payloads_allgather_n_minus_1(size):
    """Received bytes per step for the 4096-element tensor, from the byte counters: two-phase
    stays <= 2 x one rank's whole-tensor payload, allgather receives (N-1) x."""
    results = launch("gloo", size)
    checked = set()
    for key in results[0]["results"]:
        mode, comm, comp = key
        if mode != "torch" or comm not in ("twophase", "allgather"):
            continue
        compressor = cc.SimRank(comp).compressor
        if not compressor.caps.equal_sizes:
            continue
        for res in results:
            for s in range(cc.STEPS):
                payload = whole_payload_bytes(comp, "torch", "big", s, res["rank"])
                received = res["results"][key]["bytes"][s]["per_tensor"]["big"][1]
                if comm == "twophase":
                    assert received <= 2 * payload, (key, res["rank"], received, payload)
                else:
                    assert received == (size - 1) * payload, (key, res["rank"], received)
        checked.add(comm)
    assert checked == {"twophase", "allgather"}


@pytest.mark.multiproc
def test_variable_size_payload_with_a_rank_sending_nothing():
    """threshold sends nothing for "quiet" on ranks > 0; allgather and broadcast still match the
    reference (checked above) and those ranks put only the int32 lengths on the wire."""
    results = launch("gloo", 2)
    x = cc.make_input(1, 0, "quiet")
    import torch

    payload, _ = cc.SimRank("threshold").compressor.compress(torch.from_numpy(x), "quiet")
    assert sum(p.numel() for p in payload) == 0
    for comm in ("allgather", "broadcast"):
        for mode in ("torch", "tf-graph"):
            counted = results[1]["results"][(mode, comm, "threshold")]["bytes"]
            for s in range(cc.STEPS):
                assert counted[s]["per_tensor"]["quiet"][0] == 4 * len(payload)


@pytest.mark.multiproc
def test_twophase_keeps_server_side_error_feedback():
    results = launch("gloo", 2)
    for comp in ("qsgd", "signsgd"):
        for res in results:
            state = res["results"][("torch", "twophase", comp)]["state"]
            server = state["server"]
            r = res["rank"]
            assert f"big/chunk{r}" in server and server[f"big/chunk{r}"].shape == (2048,)
            assert not any(k.endswith(f"chunk{1 - r}") for k in server)
            if comp == "qsgd":  # lossy re-compression leaves a residual
                assert np.abs(server[f"big/chunk{r}"]).sum() > 0
            assert np.abs(state["memory"]["big"]).sum() > 0


def _parts(comp, name, step=0):
    """The flat parts of one rank's payload of tensor ``name``, and whether they travel packed
    (``wire.packable``): more than one part, equal sizes on every rank."""
    import torch

    from grace_dl.communicators import wire

    compressor = cc.SimRank(comp).compressor
    payload, _ = compressor.compress(torch.from_numpy(cc.make_input(0, step, name)), name)
    flats = wire.flatten(payload)[0]
    return len(flats), compressor.caps.equal_sizes and wire.packable(flats)


def _collectives_per_tensor(results):
    """(comm, comp) -> tensor -> the names of the collectives rank 0 issued for it in step 0
    (torch; allgather, broadcast and two-phase pairs)."""
    out = {}
    for (mode, comm, comp), res in results[0]["results"].items():
        if mode == "torch" and comm in ("allgather", "broadcast", "twophase"):
            out[(comm, comp)] = {name: [c[len(f"grace.{name}."):] for c in res["calls"][0]
                                        if c.startswith(f"grace.{name}.")]
                                 for name in cc.TENSORS}
    return out


@pytest.mark.multiproc
def test_payload_parts_travel_packed_one_collective_per_round():
    """A payload of several parts (topk's values and indices, a quantizer's norms and levels)
    goes in one collective per round, its parts' bytes in one buffer: one allgather, one
    broadcast per root, or one all-to-all and one allgather for two-phase. The results and
    byte counts are the ones the reference checks above (the same bytes, fewer collectives)."""
    per = _collectives_per_tensor(launch("gloo", 2))
    packed_pairs = set()
    for (comm, comp), tensors in per.items():
        for name, calls in tensors.items():
            n_parts, packed = _parts(comp, name)
            if not packed:
                continue
            packed_pairs.add((comm, comp))
            want = {"allgather": ["p"], "broadcast": ["b0p", "b1p"],
                    "twophase": ["a2a.p", "ag.p"]}[comm]
            assert calls == want, (comm, comp, name, calls, n_parts)
    # the multi-part compressors the issue names travel packed on every communicator that packs
    assert {("allgather", "topk"), ("allgather", "qsgd"), ("broadcast", "topk"),
            ("broadcast", "qsgd"), ("twophase", "qsgd"),
            ("twophase", "terngrad")} <= packed_pairs, sorted(packed_pairs)


@pytest.mark.multiproc
def test_ragged_payload_gathers_its_lengths_and_parts_in_one_collective():
    """A payload whose size depends on the data (threshold, signSGD's zero plane) is gathered
    on Horovod in one allgather, each rank's lengths at the front of its block
    (``Collectives.allgather_parts_async``): allgather sends ``len`` alone, two-phase's
    gather ``ag.len`` and no per-part ``ag.p<i>``. The results and byte counts (the lengths
    counted as before) are the reference's, checked above."""
    per = _collectives_per_tensor(launch("gloo", 2))
    ragged_pairs = set()
    for (comm, comp), tensors in per.items():
        if comm == "broadcast" or cc.SimRank(comp).compressor.caps.equal_sizes:
            continue
        ragged_pairs.add((comm, comp))
        for name, calls in tensors.items():
            gathers = [c for c in calls if not c.startswith("a2a")]
            assert gathers == (["len"] if comm == "allgather" else ["ag.len"]), \
                (comm, comp, name, calls)
    assert {("allgather", "threshold"), ("allgather", "signsgd"),
            ("twophase", "signsgd")} <= ragged_pairs, sorted(ragged_pairs)


@pytest.mark.multiproc
def test_pack_parts_false_sends_one_collective_per_part_with_the_same_results():
    """``pack_parts=False`` on allgather, broadcast and two-phase: one collective per payload
    part (``.p<i>``), results and byte counts as the single-process reference says."""
    results = mp.run("comm_check.py", np=2, args=["torch", COMMS], timeout=420,
                     env={"GRACE_TEST_PACK_PARTS": "0"})
    check(results, 2)
    for (comm, comp), tensors in _collectives_per_tensor(results).items():
        for name, calls in tensors.items():
            n_parts, packed = _parts(comp, name)
            if not packed:
                continue
            if comm == "allgather":
                assert calls == [f"p{i}" for i in range(n_parts)], (comp, name, calls)
            elif comm == "broadcast":
                assert calls == [f"b{r}p{i}" for r in range(2) for i in range(n_parts)], \
                    (comp, name, calls)
            else:
                assert calls == [f"a2a.p{i}" for i in range(n_parts)] + \
                    [f"ag.p{i}" for i in range(n_parts)], (comp, name, calls)
