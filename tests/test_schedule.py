"""``grace_dl.Schedule`` and the momentum-aware recipes: construction checks, switching,
residual hand-over and checkpoints in this process (a one-rank collectives stand-in carries the
payloads), and the real thing under 2-rank horovodrun (tests/workers/schedule_torch.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mp
from grace_dl import Schedule, grace_from_params
from grace_dl.state import config_of
from support import OneRank, topk_strategy

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))

DENSE = {"compressor": "none", "communicator": "allreduce"}
TOPK = {"compressor": "topk", "compress_ratio": 0.25, "memory": "residual",
        "communicator": "allgather"}
SHAPES = {"a": (8, 4), "b": (10,)}


def grads(step):
    rng = np.random.default_rng(step)
    return {n: torch.from_numpy(rng.standard_normal(s).astype(np.float32))
            for n, s in SHAPES.items()}


def run(grc, start, stop):
    """Steps ``start..stop-1`` as the optimizer drives them; the reduced gradients per step."""
    out = []
    for step in range(start, stop):
        handles = {n: grc.send(g, n, collectives=OneRank()) for n, g in grads(step).items()}
        out.append({n: grc.receive(h).numpy().copy() for n, h in handles.items()})
        grc.end_step()
    return out


# ---------------------------------------------------------------- construction
@pytest.mark.parametrize("stages, words", [
    ({}, ["non-empty dict"]),
    ([(0, DENSE)], ["non-empty dict"]),
    ({-1: DENSE, 0: TOPK}, ["non-negative integers", "-1"]),
    ({0: DENSE, 2.5: TOPK}, ["non-negative integers", "2.5"]),
    ({0: DENSE, True: TOPK}, ["non-negative integers", "True"]),
    ({0: DENSE, "10": TOPK}, ["non-negative integers", "'10'"]),
    ({5: DENSE, 10: TOPK}, ["first step must be 0", "5"]),
    ({0: DENSE, 10: {**TOPK, "communicator": "allreduce"}}, ["stage at step 10", "allreduce"]),
    ({0: DENSE, 10: {**TOPK, "compress_ratio": 2}}, ["stage at step 10", "compress_ratio"]),
    ({0: DENSE, 10: {"compressor": "topq"}}, ["stage at step 10", "topq"]),
    ({0: DENSE, 10: "topk"}, ["stage at step 10", "'topk'", "grace_from_params dict"]),
])
def test_bad_schedules_are_refused_naming_the_value(stages, words):
    with pytest.raises(ValueError) as err:
        Schedule(stages)
    for word in words:
        assert word in str(err.value)


def test_one_object_in_two_stages_is_refused():
    comm = grace_from_params(dict(TOPK))
    with pytest.raises(ValueError, match="steps 0 and 4 are the same object"):
        Schedule({0: comm, 4: comm})


def test_fingerprint_covers_stages_and_steps_not_progress():
    a, b = Schedule({0: DENSE, 4: TOPK}), Schedule({0: DENSE, 4: TOPK})
    assert a.fingerprint() == b.fingerprint()
    assert Schedule({0: DENSE, 5: TOPK}).fingerprint() != a.fingerprint()
    assert Schedule({0: DENSE, 4: {**TOPK, "compress_ratio": 0.5}}).fingerprint() \
        != a.fingerprint()
    run(a, 0, 5)
    assert a.fingerprint() == b.fingerprint()


# ---------------------------------------------------------------- switching
def test_switches_at_the_step_and_bytes_drop():
    grc = Schedule({0: DENSE, 3: TOPK})
    run(grc, 0, 6)
    assert [s["stage"] for s in grc.bytes.steps] == [0, 0, 0, 3, 3, 3]
    sent = [s["sent"] for s in grc.bytes.steps]
    dense = sum(int(np.prod(s)) for s in SHAPES.values()) * 4
    assert sent[:3] == [0, 0, 0] or sent[0] >= dense  # one-rank allreduce moves 2(N-1)/N = 0
    topk_sent = sum(int(np.ceil(0.25 * np.prod(s))) * 8 for s in SHAPES.values())
    assert sent[3:] == [topk_sent] * 3
    assert grc.active is grc.stages[1][1] and grc.compressor is grc.stages[1][1].compressor


def test_dense_stage_then_topk_is_exactly_the_two_pipelines():
    sched = run(Schedule({0: DENSE, 3: TOPK}), 0, 6)
    dense = run(grace_from_params(dict(DENSE)), 0, 3)
    topk = grace_from_params(dict(TOPK))
    for step, want in zip(range(3), dense):
        for n in SHAPES:
            np.testing.assert_array_equal(sched[step][n], want[n])
    for step, want in zip(range(3, 6), run(topk, 3, 6)):
        for n in SHAPES:
            np.testing.assert_array_equal(sched[step][n], want[n])


def _total(outs):
    return {n: sum(o[n].astype(np.float64) for o in outs) for n in SHAPES}


def _inputs(start, stop):
    return {n: sum(grads(s)[n].numpy().astype(np.float64) for s in range(start, stop))
            for n in SHAPES}


def test_residual_is_handed_over_so_nothing_is_lost():
    # residual memory -> residual memory with another ratio: sent + final residual == inputs
    grc = Schedule({0: TOPK, 4: {**TOPK, "compress_ratio": 0.1}})
    outs = run(grc, 0, 8)
    old, new = grc.stages[0][1].memory.state_dict(), grc.stages[1][1].memory.state_dict()
    for n in SHAPES:
        assert not old[n].any()                      # the old stage was emptied
        np.testing.assert_allclose(_total(outs)[n] + new[n], _inputs(0, 8)[n], atol=1e-4)
    # without the hand-over the residual left at step 4 would be missing from the sum
    lost = Schedule({0: TOPK, 4: {**TOPK, "compress_ratio": 0.1}})
    lost._switch = lambda index: setattr(lost, "_index", index)
    outs = run(lost, 0, 8)
    new = lost.stages[1][1].memory.state_dict()
    assert any(not np.allclose(_total(outs)[n] + new[n], _inputs(0, 8)[n], atol=1e-4)
               for n in SHAPES)


def test_reset_zeroes_every_stages_state_and_the_carry_and_keeps_the_step():
    """``Schedule.reset`` is the whole protocol's (the DDP hook's ``state.reset()`` calls it):
    a tensor's residual in every stage, or all of them, and what a switch carried."""
    grc = Schedule({0: TOPK, 4: {**TOPK, "compress_ratio": 0.1}})
    run(grc, 0, 2)
    first = grc.stages[0][1].memory
    assert all(first.state_dict()[n].any() for n in SHAPES)
    grc._carry = {"a": np.ones(SHAPES["a"], np.float32), "b": np.ones(SHAPES["b"], np.float32)}
    grc.reset("a")
    state = first.state_dict()
    assert not state["a"].any() and state["b"].any() and set(grc._carry) == {"b"}
    grc.reset()
    assert not any(v.any() for v in first.state_dict().values()) and grc._carry == {}
    assert grc.step == 2 and grc.active is grc.stages[0][1]
    # a reset run equals a fresh one fed from the same step on (nothing kept from before)
    fresh = Schedule({0: TOPK, 4: {**TOPK, "compress_ratio": 0.1}})
    fresh.load_state_dict({**fresh.state_dict(), "step": 2})
    for a, b in zip(run(grc, 2, 6), run(fresh, 2, 6)):
        for n in SHAPES:
            np.testing.assert_array_equal(a[n], b[n])


def test_residual_is_flushed_into_a_stage_without_memory():
    grc = Schedule({0: TOPK, 3: DENSE})
    left = None
    outs = []
    for step in range(6):
        outs += run(grc, step, step + 1)
        if step == 1:
            left = grc.stages[0][1].memory.state_dict()
    # after the flush step everything sent so far equals every gradient so far
    np.testing.assert_allclose(_total(outs)["a"], _inputs(0, 6)["a"], atol=1e-4)
    assert left is not None and np.abs(left["a"]).sum() > 0
    assert grc.state_dict()["carry"] == {}


def test_buckets_add_into_the_running_stages_residual():
    """``accumulator`` under a Schedule: the running stage's residual slot, so the torch
    optimizer's buckets add their gradients there (the same payloads and results as sending
    the whole tensor), across switches; None under a stage without one."""
    from grace_dl.communicators.base import accumulator

    plain, parts = Schedule({0: TOPK, 2: DENSE, 3: TOPK}), Schedule({0: TOPK, 2: DENSE, 3: TOPK})
    for step in range(5):
        g = grads(step)["a"]
        want = plain.receive(plain.send(g.clone(), "a", collectives=OneRank())).clone()
        slot = accumulator(parts, "a", g)
        assert (slot is None) == (step == 2 or parts.stage_start == 2), step
        if slot is None:
            sent = g.clone()
        else:
            slot.view(-1)[:5].add_(g.view(-1)[:5])
            slot.view(-1)[5:].add_(g.view(-1)[5:])
            sent = torch.full_like(g, float("nan"))     # its values are not read
        got = parts.receive(parts.send(sent, "a", collectives=OneRank()))
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        plain.end_step()
        parts.end_step()
    assert accumulator(Schedule({0: DENSE}), "a", grads(0)["a"]) is None   # memory none


def test_dgc_momentum_moves_with_the_velocity():
    mom = {"compressor": "none", "memory": "momentum", "error_feedback": False,
           "factor_masking": False, "communicator": "allreduce"}
    sparse = {**TOPK, "memory": "momentum"}
    grc = Schedule({0: mom, 2: sparse})
    run(grc, 0, 1)
    for n, g in grads(1).items():
        grc.receive(grc.send(g, n, collectives=OneRank()))
    before = grc.stages[0][1].memory.state_dict()["momentum/a"].copy()
    assert np.abs(before).sum() > 0
    grc.end_step()                                  # the switch to step 2's stage
    after = grc.stages[1][1].memory.state_dict()
    np.testing.assert_array_equal(after["momentum/a"], before)   # carried at the switch
    assert not grc.stages[0][1].memory.state_dict()["momentum/a"].any()


def _size_threshold(params, small):
    from grace_dl.strategy import SizeThreshold, from_strategy

    d = from_strategy(SizeThreshold(20, params, small=small).build(SHAPES))
    d._verified = True      # one process: no other rank to agree with
    return d


def test_dispatcher_stages_hand_over_per_tensor():
    # 'a' (32 elements) is compressed, 'b' (1-D) dense with momentum in the memory, in both
    # stages: a's residual reaches the new topk memory, b's momentum the new dense memory
    mom = {"compressor": "none", "memory": "momentum", "error_feedback": False,
           "factor_masking": False}
    grc = Schedule({0: _size_threshold(TOPK, mom),
                    4: _size_threshold({**TOPK, "compress_ratio": 0.1}, mom)})
    outs = run(grc, 0, 3)
    old = {c.memory.__class__.__name__: c.memory for c in grc.stages[0][1].parts()}
    momentum_b = old["MomentumMemory"].state_dict()["momentum/b"].copy()
    assert np.abs(momentum_b).sum() > 0
    outs += run(grc, 3, 8)
    new = {c.memory.__class__.__name__: c.memory for c in grc.stages[1][1].parts()}
    residual_a = new["ResidualMemory"].state_dict()["a"]
    np.testing.assert_allclose(_total(outs)["a"] + residual_a, _inputs(0, 8)["a"], atol=1e-4)
    assert not old["ResidualMemory"].state_dict()["a"].any()
    # b's momentum went on: after 8 steps it is the momentum of all 8 gradients
    want = np.zeros(SHAPES["b"])
    for step in range(8):
        want = 0.9 * want + grads(step)["b"].numpy()
    np.testing.assert_allclose(new["MomentumMemory"].state_dict()["momentum/b"], want,
                               rtol=1e-5)
    assert grc.state_dict()["carry"] == {}


def test_resume_mid_schedule_is_bit_for_bit():
    stages = {0: DENSE, 2: TOPK, 5: {**TOPK, "compress_ratio": 0.1}}
    whole = run(Schedule(dict(stages)), 0, 8)
    first = Schedule(dict(stages))
    run(first, 0, 4)
    state = first.state_dict()
    assert state["step"] == 4
    second = Schedule(dict(stages))
    second.load_state_dict(state)
    assert second.stage_start == 2
    for got, want in zip(run(second, 4, 8), whole[4:]):
        for n in SHAPES:
            np.testing.assert_array_equal(got[n], want[n])
    # a state with a pending flush (just after switching to a memory-less stage) too
    flush = {0: TOPK, 3: DENSE}
    whole = run(Schedule(dict(flush)), 0, 5)
    first = Schedule(dict(flush))
    run(first, 0, 3)
    assert set(first.state_dict()["carry"]) == set(SHAPES)
    second = Schedule(dict(flush))
    second.load_state_dict(first.state_dict())
    for got, want in zip(run(second, 3, 5), whole[3:]):
        for n in SHAPES:
            np.testing.assert_array_equal(got[n], want[n])


def test_checkpoint_of_another_schedule_is_refused():
    a = Schedule({0: DENSE, 4: TOPK})
    with pytest.raises(ValueError, match=r"stages starting at \['3'\]"):
        a.load_state_dict({"step": 0, "stages": {"0": {}, "3": {}}})


# ---------------------------------------------------------------- momentum memory, randomk
def test_momentum_memory_without_error_feedback_sends_the_momentum():
    grc = grace_from_params({"compressor": "none", "memory": "momentum", "momentum": 0.5,
                             "error_feedback": False, "factor_masking": False})
    outs = run(grc, 0, 3)
    u = 0
    for step in range(3):
        u = 0.5 * u + grads(step)["a"].numpy()
        np.testing.assert_allclose(outs[step]["a"], u, rtol=1e-6)


def test_momentum_memory_with_error_feedback_is_dgc():
    a = grace_from_params({**TOPK, "memory": "momentum"})
    b = grace_from_params({**TOPK, "memory": "dgc"})
    for x, y in zip(run(a, 0, 5), run(b, 0, 5)):
        for n in SHAPES:
            np.testing.assert_array_equal(x[n], y[n])


def test_momentum_memory_checks_its_flags():
    with pytest.raises(ValueError, match="factor_masking=True needs error_feedback=True"):
        grace_from_params({"memory": "momentum", "error_feedback": False})
    with pytest.raises(ValueError, match=r"error_feedback must be one of \[False, True\]"):
        grace_from_params({"memory": "momentum", "error_feedback": "no"})


def test_unbiased_randomk_is_unbiased_and_seeded():
    from grace_dl.compressors.randomk import RandomKCompressor

    x = torch.from_numpy(np.random.default_rng(0).standard_normal(50).astype(np.float32))
    comp = RandomKCompressor(0.1, unbiased=True)
    draws = [comp.decompress(*comp.compress(x, "w")).numpy() for _ in range(4000)]
    mean = np.mean(draws, axis=0)
    # each coordinate is x/p with probability p: std of the mean = |x| sqrt((1/p-1)/4000)
    assert np.all(np.abs(mean - x.numpy()) <= 5 * np.abs(x.numpy()) * np.sqrt(9 / 4000) + 1e-6)
    biased = RandomKCompressor(0.1)
    assert np.allclose(np.mean([biased.decompress(*biased.compress(x, "w")).numpy()
                                for _ in range(4000)], axis=0), 0.1 * x.numpy(), atol=0.05)
    assert config_of(RandomKCompressor(0.1, unbiased=True))["unbiased"] is True
    with pytest.raises(ValueError, match="unbiased must be one of"):
        RandomKCompressor(0.1, unbiased=1.5)


# ---------------------------------------------------------------- 2 ranks, horovodrun
@pytest.mark.multiproc
def test_schedule_under_horovodrun_switches_together_and_resumes_bitwise(tmp_path):
    saved = mp.run("schedule_torch.py", np=2, args=["save", tmp_path], timeout=240)
    resumed = mp.run("schedule_torch.py", np=2, args=["load", tmp_path], timeout=240)
    numel = saved[0]["numel"]
    for r in saved:
        assert [w for w in r["warnings"] if "known to diverge" in w and "RandomK" in w]
        assert r["stage"] == [0, 0, 0, 3, 3, 3, 6, 6, 6]
        dense, topk10, topk5 = r["sent"][0], r["sent"][3], r["sent"][6]
        assert r["sent"][:3] == [dense] * 3 and dense >= numel * 4 // 2   # ring: 2(N-1)/N
        assert topk10 < dense / 3 and r["sent"][3:6] == [topk10] * 3
        assert topk5 < topk10 and r["sent"][6:] == [topk5] * 3
        old, new = r["after_switch"]["old"], r["after_switch"]["new"]
        assert all(not v.any() for v in old.values())          # handed over ...
        assert all(np.abs(new[k]).sum() > 0 for k in new)      # ... into the new stage
    for k in saved[0]["uninterrupted"]:
        np.testing.assert_array_equal(saved[0]["uninterrupted"][k], saved[1]["uninterrupted"][k])
    for before, after in zip(saved, resumed):
        assert after["resumed_at"] == (5, 3)
        for k in before["uninterrupted"]:
            np.testing.assert_array_equal(after["resumed"][k], before["uninterrupted"][k])
        assert any(not np.array_equal(after["without_grace_state"][k], before["uninterrupted"][k])
                   for k in before["uninterrupted"])


@pytest.mark.multiproc
def test_schedule_under_the_tf_tape_eager_and_refused_in_tf_function():
    ranks = mp.run("schedule_tf.py", np=2, timeout=300)
    for r in ranks:
        assert r["stage"] == [0, 0, 2, 2, 2]
        assert r["sent"][0] == r["sent"][1] and r["sent"][2] < r["sent"][0] / 3
        assert r["resumed_at"] == (3, 2)
        for a, b in zip(r["resumed"], r["weights"]):
            np.testing.assert_array_equal(a, b)
        assert "cannot switch stages inside tf.function" in r["in_function"]
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fw", ["torch", "tf"])
def test_momentum_memory_same_in_torch_and_tf(fw):
    from grace_dl.compressors.randomk import RandomKCompressor
    from grace_dl.memory.momentum import MomentumMemory

    if fw == "tf":
        import tensorflow as tf

        make = tf.constant
    else:
        make = torch.from_numpy
    outs = {}
    for ef in (False, True):
        memory = MomentumMemory(0.5, error_feedback=ef, factor_masking=ef)
        comp = RandomKCompressor(0.25, unbiased=not ef)
        sent = []
        for step in range(4):
            g = make(grads(step)["a"].numpy())
            x = memory.compensate(g, "a")
            payload, ctx = comp.compress(x, "a")
            memory.update(x, "a", comp, payload, ctx)
            sent.append(np.asarray(comp.decompress(payload, ctx)))
        outs[ef] = (sent, memory.state_dict())
    u = 0
    for step in range(4):            # without error feedback: (n/k)-scaled random-k of u
        u = 0.5 * u + grads(step)["a"].numpy()
        kept = outs[False][0][step] != 0
        np.testing.assert_allclose(outs[False][0][step][kept], 4 * u[kept], rtol=1e-5)
    assert set(outs[False][1]) == {"momentum/a"}
    assert set(outs[True][1]) == {"momentum/a", "velocity/a"}


@pytest.mark.parametrize("case", ["twophase", "twophase-early", "pieces", "twophase-pieces",
                                  "buckets"])
def test_a_schedule_of_one_pipeline_trains_as_that_pipeline_on_two_ranks(case):
    """Nothing is lost at a switch to the same pipeline and no glue option is dropped under a
    Schedule: two-phase's server residuals are handed to the next stage (they were dropped:
    0.012 off a step after the switch), and ``piece_bytes`` cuts as it does for the plain
    communicator (it was ignored: the whole tensors sent), ``bucket_bytes`` packs (it was
    refused)."""
    ranks = mp.run("schedule_same.py", np=2, args=[case], timeout=240)
    for res in ranks:
        plain, scheduled = res["plain"], res["schedule"]
        assert scheduled["sent"] == plain["sent"]
        assert scheduled["pieces"] == plain["pieces"]
        assert scheduled["buckets"] == plain["buckets"]
        assert (plain["buckets"] != {}) == (case == "buckets")
        assert (plain["pieces"] != {}) == case.endswith("pieces")
        for step, (want, got) in enumerate(zip(plain["params"], scheduled["params"])):
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} {step}")


def test_a_switch_that_drops_two_phase_server_residuals_warns_at_construction():
    twophase = {"compressor": "onebit", "memory": "residual", "communicator": "twophase"}
    with pytest.warns(UserWarning, match=r"step 0: its two-phase server residuals .* at step 5 "
                                         r"the others are dropped"):
        Schedule({0: dict(twophase), 5: {"compressor": "topk", "memory": "residual",
                                         "communicator": "allgather"}})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Schedule({0: dict(twophase), 5: {**twophase, "compressor": "qsgd"}})   # handed over


def test_a_strategy_with_buckets_is_refused_as_a_stage():
    """The glue lays a step's buckets out once (the torch optimizer asks ``grace.buckets``),
    so a bucketed strategy inside a Schedule sent each parameter alone, silently."""
    with pytest.raises(ValueError, match=r"stage at step 3 is a strategy that packs variables "
                                         r"into buckets \(1: .*bucket_bytes=None"):
        Schedule({0: {"compressor": "none", "communicator": "allreduce"},
                  3: topk_strategy(bucketed=True)})
    Schedule({0: {"compressor": "none", "communicator": "allreduce"}, 3: topk_strategy()})
