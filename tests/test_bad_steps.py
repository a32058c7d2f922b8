"""Training survives a bad step (issue #44): non-finite gradients, reloads and pickles of the
state, sparse and empty tensors, a hook on some ranks only.

In this process: every pipeline the registry allows, on one rank, through a NaN and an Inf;
``reset``; state restores. Real 2-rank jobs: ``horovodrun --gloo`` of
``tests/workers/torch_bad_steps.py`` (the torch ``DistributedOptimizer``) and ``torchrun`` of
``tests/workers/ddp_bad_steps.py`` (the DDP hook)."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import mp
from grace_dl import grace_from_params
from support import (
    OneRank,
    allowed,
    parse_pipeline,
    registry_pairs,
    registry_round_trip,
    registry_triples,
)

NAN_INF = {1: float("nan"), 3: float("inf")}
#: finite per step when step 1 holds a NaN and step 3 an Inf (5 or 6 steps)
EXPECTED = [True, False, True, False, True, True]
SPARSIFIERS = ["adaq", "dgc", "randomk", "threshold", "topk"]


class OneRankSplits(OneRank):
    """``OneRank`` whose all-to-all gives its splits back as a tensor, as Horovod does (the PS
    communicator reads them)."""

    def alltoall_async(self, tensor, splits, name):
        return tensor.clone(), torch.tensor(splits)


# ---------------------------------------------------------------- in this process
@pytest.mark.parametrize("path", ["reference", "device"])
@pytest.mark.parametrize("pipeline", registry_triples())
def test_one_nonfinite_step_shows_once_and_leaves_no_state(pipeline, path):
    """One rank: the step with a NaN (then one with an Inf) gives a non-finite result, and
    every later step is finite again: nothing keeps it. ``device``: the GPU speed paths, run
    on CPU tensors (``emulate_device``)."""
    grc = grace_from_params(parse_pipeline(pipeline))
    finite = [bool(torch.isfinite(out).all()) for out in _bad_steps(grc, path, 5)]
    assert finite == EXPECTED[:5]
    for key, value in _leaves(grc.state_dict()):
        assert np.isfinite(value).all(), key


def _bad_steps(grc, path: str, steps: int):
    """``grc``'s results of ``steps`` one-rank steps of seeded gradients, a NaN in step 1 and
    an Inf in step 3, on ``path`` ("device": ``emulate_device``), each yielded before the
    next step runs."""
    from grace_dl.torch.kernels import emulate_device

    torch.manual_seed(0)
    with emulate_device() if path == "device" else contextlib.nullcontext():
        for step in range(steps):
            g = torch.randn(16, 12)
            if step in NAN_INF:
                g[3, 4] = NAN_INF[step]
            yield grc.synchronize(g, "w", collectives=OneRankSplits())
            grc.end_step()


@pytest.mark.parametrize("pipeline", ["signsgd+residual+allgather", "signsgd+residual+twophase",
                                      "signsgd+none+twophase"])
def test_a_signs_error_after_a_nonfinite_step_is_the_cleaned_one_on_every_path(pipeline):
    """The device path writes a non-finite step's sign error as 0 itself (the memory skips its
    clean-up there): results and every slot equal the reference path's, step for step, and
    the slot after the NaN step is all zeros."""
    runs = []
    for path in ("reference", "device"):
        grc = grace_from_params(parse_pipeline(pipeline))
        runs.append([(out.clone(), dict(_leaves(grc.state_dict())))
                     for out in _bad_steps(grc, path, 4)])
    for step, ((a, sa), (b, sb)) in enumerate(zip(*runs)):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"step {step}")
        assert sa.keys() == sb.keys()
        for key in sa:
            np.testing.assert_array_equal(np.asarray(sa[key]), np.asarray(sb[key]),
                                          err_msg=f"step {step} {key}")
    residual = [v for k, v in runs[1][1][1].items() if "w" in k and np.size(v) == 16 * 12]
    assert all(not np.any(v) for v in residual)


@pytest.mark.parametrize("pipeline", ["topk+residual+allgather", "qsgd+residual+twophase",
                                      "signum+dgc+allgather", "powersgd+powersgd+allreduce",
                                      "randomk+residual+allreduce"])
def test_one_nonfinite_step_tensorflow(pipeline):
    """The same rule through the TF backend (written once: ``ops.assign_finite``)."""
    import tensorflow as tf

    grc = grace_from_params(parse_pipeline(pipeline))
    rng = np.random.default_rng(0)
    finite = []
    for step in range(5):
        g = rng.standard_normal((16, 12)).astype(np.float32)
        if step in NAN_INF:
            g[3, 4] = NAN_INF[step]
        out = grc.synchronize(tf.constant(g), "w", collectives=_TFOneRank())
        finite.append(bool(np.isfinite(out.numpy()).all()))
    assert finite == EXPECTED[:5]


class _TFOneRank(OneRank):
    """One rank for TF tensors (``OneRank`` clones with torch's ``clone``)."""

    def allreduce_async(self, tensor, name):
        return tensor

    def allgather_async(self, tensor, name):
        return tensor

    def broadcast_async(self, tensor, root, name):
        return tensor

    def alltoall_async(self, tensor, splits, name):
        import tensorflow as tf

        return tensor, tf.constant(splits)


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}/{k}")
    else:
        yield prefix, tree


def test_reset_zeroes_accumulated_state_and_keeps_counters():
    grc = grace_from_params({"compressor": "qsgd", "memory": "dgc", "communicator": "twophase"})
    coll = OneRankSplits()
    for _ in range(2):
        for name in ("a", "b"):
            grc.synchronize(torch.randn(40), name, collectives=coll)
    before = grc.state_dict()
    grc.reset("a")
    after = grc.state_dict()
    for part in ("memory", "server"):
        for key, value in after[part].items():
            if "a" in key.split("/"):
                assert not value.any(), key
            else:
                np.testing.assert_array_equal(value, before[part][key], err_msg=key)
    assert any("b" in k.split("/") and v.any() for k, v in after["memory"].items())
    for key, value in after["compressor"].items():      # step counters are kept
        np.testing.assert_array_equal(value, before["compressor"][key], err_msg=key)
    grc.reset()
    state = grc.state_dict()
    assert not any(v.any() for part in ("memory", "server") for v in state[part].values())
    # signum's momentum is accumulated state of the compressor
    sig = grace_from_params({"compressor": "signum", "communicator": "allgather"})
    sig.synchronize(torch.randn(10), "w", collectives=coll)
    assert sig.state_dict()["compressor"]["momentum/w"].any()
    sig.reset()
    assert not sig.state_dict()["compressor"]["momentum/w"].any()


def test_strategy_dispatcher_resets_its_pipelines():
    from grace_dl.strategy import Uniform, from_strategy

    disp = from_strategy(Uniform({"compressor": "topk", "memory": "residual",
                                  "communicator": "allgather", "compress_ratio": 0.2})
                         .build({"w": (10,), "v": (10,)}))
    coll = OneRankSplits()
    disp._verified = True      # one process: nothing to agree with
    for name in ("w", "v"):
        disp.synchronize(torch.randn(10), name, collectives=coll)
    disp.reset("w")
    (state,) = disp.state_dict().values()
    assert not state["memory"]["w"].any() and state["memory"]["v"].any()


def test_live_load_restores_counters_and_replaces_the_state():
    """A 0-d step counter loads into a live object (it crashed: ``output with shape [] doesn't
    match the broadcast shape [1]``), and a slot the checkpoint lacks starts over."""
    grc = grace_from_params({"compressor": "qsgd", "memory": "residual",
                             "communicator": "allgather"})
    coll = OneRankSplits()
    grc.synchronize(torch.randn(20), "w", collectives=coll)
    saved = copy.deepcopy(grc.state_dict())
    grc.synchronize(torch.randn(20), "w", collectives=coll)
    grc.synchronize(torch.randn(20), "later", collectives=coll)
    grc.load_state_dict(saved)
    assert {k: v.tolist() for k, v in grc.state_dict()["compressor"].items()} == \
        {k: v.tolist() for k, v in saved["compressor"].items()}
    assert set(grc.state_dict()["memory"]) == {"w"}
    np.testing.assert_array_equal(grc.state_dict()["memory"]["w"], saved["memory"]["w"])


def test_live_load_resets_tf_variables_in_place():
    """TF variables a traced function may hold are set back, not replaced."""
    import tensorflow as tf

    grc = grace_from_params({"compressor": "powersgd", "memory": "powersgd",
                             "communicator": "allreduce", "compress_rank": 1})
    x = tf.random.normal((6, 5), seed=1)
    grc.synchronize(x, "w", collectives=_TFOneRank())
    fresh = {k: v.numpy().copy() for k, v in grc.compressor.state.variables().items()}
    saved = grc.state_dict()
    grc.synchronize(x * 2, "w", collectives=_TFOneRank())
    grc.synchronize(x, "v", collectives=_TFOneRank())
    held = grc.memory.state.variables()["v"]
    grc.load_state_dict(saved)
    assert grc.memory.state.variables()["v"] is held and not held.numpy().any()
    for key, value in grc.compressor.state.variables().items():
        if key in fresh:
            np.testing.assert_array_equal(value.numpy(), fresh[key], err_msg=key)


@pytest.mark.parametrize("compressor", SPARSIFIERS)
def test_sparsifier_on_a_zero_element_tensor_packs(compressor):
    from grace_dl.communicators import wire
    from grace_dl.compressors.base import Call

    grc = grace_from_params({"compressor": compressor, "memory": "residual",
                             "communicator": "allgather"})
    for shape in ((0,), (5, 0)):
        encoded = grc.encode(torch.zeros(shape), f"w{len(shape)}", Call(0, 2))
        flats, _ = wire.flatten(encoded.payload)
        parts = wire.unpack(wire.pack(flats), wire.layout(flats))
        assert [tuple(p.shape) for p in parts] == [tuple(f.shape) for f in flats]


def test_grace_none_runs_horovods_checks_first():
    """Without ``hvd.init()``, Horovod's own argument check (its ``test_duplicate_names``)
    raises Horovod's error, not grace's agreement check's "not initialized"."""
    code = ("import torch, grace_dl.torch.horovod as hvd\n"
            "w = torch.nn.Parameter(torch.ones(2))\n"
            "opt = torch.optim.SGD([w], lr=0.1)\n"
            "try:\n"
            "    hvd.DistributedOptimizer(opt, named_parameters=[('a', w), ('a', w)])\n"
            "except Exception as err:\n"
            "    print(type(err).__name__, err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(mp.ROOT)}, timeout=120)
    assert "Parameter names in named_parameters must be unique" in out.stdout, \
        out.stdout + out.stderr


def test_grace_state_checks_agreement_timeout_and_pickles_unbound():
    from grace_dl.torch import ddp as grace_ddp

    grc = grace_from_params({"compressor": "topk", "communicator": "allgather"})
    for bad in (0, -1, "30", True):
        with pytest.raises(ValueError, match=rf"agreement_timeout must be a positive number "
                                             rf"of seconds, got {re.escape(repr(bad))}"):
            grace_ddp.GraceState(grc, agreement_timeout=bad)
    state = grace_ddp.GraceState(grc)
    copied = copy.deepcopy(state)
    assert copied.process_group is None and copied.collectives is None
    assert copied.grace is not state.grace


# ---------------------------------------------------------------- horovodrun (torch)
#: (compressor, communicator) pairs for the zero-element parameters: every sparsifier on every
#: communicator that carries it
ZERO = [f"{c}+residual+{k}" for c in SPARSIFIERS
        for k in ("allgather", "allreduce", "broadcast", "ps", "twophase")
        if allowed(c, "residual", k)]
#: pipelines whose error feedback GradScaler must not poison (residual, dgc, PowerSGD)
AMP = ["topk+residual+allgather", "dgc+dgc+allgather", "powersgd+powersgd+allreduce"]
#: beyond the registry's pairs: every communicator
MORE = ["qsgd+residual+broadcast", "topk+residual+ps", "qsgd+none+twophase",
        "signsgd+none+twophase", "threshold+dgc+broadcast", "randomk+none+allreduce"]


@pytest.fixture(scope="module")
def horovod_ranks():
    args = ["nonfinite", *registry_pairs(), *MORE, "--", "amp", *AMP, "--", "zero", *ZERO,
            "--", "reload", *registry_round_trip()]
    return mp.run("torch_bad_steps.py", np=2, args=args, timeout=900)


@pytest.mark.multiproc
@pytest.mark.parametrize("pipeline", registry_pairs() + MORE)
def test_horovod_nan_shows_in_its_step_and_later_steps_are_finite(horovod_ranks, pipeline):
    """Rank 1's NaN (step 1) and Inf (step 3) show in that step's averaged gradient on both
    ranks, and every other step is finite (issue items 1 and 2)."""
    for res in horovod_ranks:
        got = res["nonfinite"][pipeline]
        assert "error" not in got, got
        assert got["finite"] == EXPECTED and got["params_finite"], got


@pytest.mark.multiproc
@pytest.mark.parametrize("pipeline", AMP)
def test_horovod_grad_scaler_skips_the_overflow_and_goes_on(horovod_ranks, pipeline):
    for res in horovod_ranks:
        got = res["amp"][pipeline]
        assert got["scales"] == [1024.0] * 2 + [512.0] * 4, got
        assert got["moved"] == [True, True, False, True, True, True], got
        assert got["params_finite"] and got["state_finite"], got


@pytest.mark.multiproc
@pytest.mark.parametrize("pipeline", ZERO)
def test_horovod_sparsifiers_carry_zero_element_parameters(horovod_ranks, pipeline):
    outs = [res["zero"][pipeline] for res in horovod_ranks]
    for got in outs:
        assert got["error"] is None, got["error"]
        assert got["empty_grads"] == [(0,), (5, 0)]
    for k, v in outs[0]["params"].items():
        np.testing.assert_array_equal(v, outs[1]["params"][k], err_msg=k)


@pytest.mark.multiproc
@pytest.mark.parametrize("pipeline", registry_round_trip())
def test_horovod_state_reloads_live_and_fresh_bit_for_bit(horovod_ranks, pipeline):
    """``opt.load_state_dict(checkpoint)`` into the live optimizer (it crashed for qsgd,
    terngrad, natural, dgc) and into a fresh one: the same 3 steps give the same bits."""
    for res in horovod_ranks:
        got = res["reload"][pipeline]
        assert got["error"] is None, got["error"]
        for how in ("live", "fresh"):
            for k, v in got["straight"].items():
                np.testing.assert_array_equal(got[how][k], v, err_msg=f"{how} {k}")


# ---------------------------------------------------------------- torchrun (DDP hook)
DDP_NONFINITE = ["topk", "topk-dgc", "dgc", "randomk", "qsgd-2phase", "signsgd-2phase",
                 "terngrad", "powersgd", "signsgd", "signum", "fp16"]
DDP_AMP = ["topk", "topk-dgc", "powersgd"]
DDP_PICKLE = ["topk", "qsgd-2phase", "powersgd"]


def torchrun(*args, timeout: float = 600):
    return mp.run("ddp_bad_steps.py", np=2, launcher="torchrun", args=args, timeout=timeout,
                  env={"GLOO_SOCKET_IFNAME": "lo"})


@pytest.fixture(scope="module")
def ddp_ranks():
    return torchrun("nonfinite", *DDP_NONFINITE, "--", "amp", *DDP_AMP, "--",
                    "reload", "3", *registry_round_trip(), "--", "pickle", "3", *DDP_PICKLE,
                    "--", "sparse")


@pytest.mark.multiproc
@pytest.mark.parametrize("pipeline", DDP_NONFINITE)
def test_ddp_nan_shows_in_its_step_and_later_steps_are_finite(ddp_ranks, pipeline):
    for res in ddp_ranks:
        got = res["nonfinite"][pipeline]
        assert got["finite"] == EXPECTED and got["params_finite"], got


@pytest.mark.multiproc
@pytest.mark.parametrize("pipeline", DDP_AMP)
def test_ddp_grad_scaler_skips_the_overflow_and_goes_on(ddp_ranks, pipeline):
    for res in ddp_ranks:
        got = res["amp"][pipeline]
        assert got["scales"] == [1024.0] * 2 + [512.0] * 4, got
        assert got["moved"] == [True, True, False, True, True, True], got
        assert got["params_finite"] and got["state_finite"], got


@pytest.mark.multiproc
@pytest.mark.parametrize("pipeline", registry_round_trip())
def test_ddp_state_reloads_live_and_fresh_bit_for_bit(ddp_ranks, pipeline):
    for res in ddp_ranks:
        got = res["reload"][pipeline]
        assert got["error"] is None, got["error"]
        for how in ("live", "fresh"):
            for k, v in got["straight"].items():
                np.testing.assert_array_equal(got[how][k], v, err_msg=f"{how} {k}")


@pytest.mark.multiproc
def test_ddp_state_dict_loads_with_weights_only(ddp_ranks):
    for res in ddp_ranks:
        assert res["reload"]["weights_only"] is None, res["reload"]["weights_only"]


@pytest.mark.multiproc
@pytest.mark.parametrize("group", ["default", "new_group"])
@pytest.mark.parametrize("pipeline", DDP_PICKLE)
def test_ddp_pickled_state_resumes_bit_for_bit_on_a_rebuilt_model(ddp_ranks, pipeline, group):
    """``torch.save(state)`` / ``copy.deepcopy(state)`` resume the original's training on a
    reloaded model and a new DDP (they silently started fresh residuals), bound to the default
    group or to the one the user sets."""
    for res in ddp_ranks:
        got = res["pickle"][f"{pipeline}/{group}"]
        assert got["error"] is None, got["error"]
        for how in ("pickled", "deepcopy", "rebound"):
            for k, v in got["straight"].items():
                np.testing.assert_array_equal(got[how][k], v, err_msg=f"{how} {k}")


@pytest.mark.multiproc
def test_ddp_pickled_state_of_a_subgroup_must_be_bound(ddp_ranks):
    error = ddp_ranks[0]["pickle"]["unbound"]
    assert error is not None and "set state.process_group" in error and "[0]" in error, error


@pytest.mark.multiproc
def test_ddp_sparse_gradient_is_refused_clearly(ddp_ranks):
    for res in ddp_ranks:
        error = res["sparse"]["error"]
        assert error is not None and "has a sparse gradient" in error and "dense" in error, error


@pytest.mark.multiproc
def test_ddp_hook_on_some_ranks_only_fails_within_a_minute():
    """Rank 0 with the grace hook, rank 1 plain DDP (it hung): rank 0 names rank 1 after its
    ``agreement_timeout`` (5 s here), and the job ends."""
    start = time.monotonic()
    cmd = mp.command("ddp_bad_steps.py", 2, "torchrun", ["some_ranks"])
    proc = subprocess.run(cmd, env=mp._env("", {"GLOO_SOCKET_IFNAME": "lo"}),
                          capture_output=True, text=True, timeout=120, cwd=str(mp.ROOT))
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert elapsed < 60, (elapsed, out)
    assert re.search(r"rank 0 after [\d.]+ s: ValueError: ranks \[1\] of the process group did "
                     r"not reach the grace DDP hook", out), out


def test_grace_state_pickled_before_its_first_step_with_names_refuses_to_guess():
    from grace_dl.torch import ddp as grace_ddp

    w = torch.nn.Parameter(torch.ones(3))
    state = grace_ddp.GraceState(grace_from_params({"compressor": "topk",
                                                    "communicator": "allgather"}),
                                 named_parameters=[("w", w)])
    copied = copy.deepcopy(state)
    with pytest.raises(ValueError, match="pickled before its first step with named_parameters"):
        copied._name_of(w)


def test_grace_state_reset_zeroes_the_grace_state():
    from grace_dl.torch import ddp as grace_ddp

    grc = grace_from_params({"compressor": "topk", "memory": "residual",
                             "communicator": "allgather", "compress_ratio": 0.2})
    grc.synchronize(torch.randn(10), "bucket0", collectives=OneRankSplits())
    state = grace_ddp.GraceState(grc)
    assert state.state_dict()["grace"]["memory"]["bucket0"].any()
    state.reset()
    assert not state.state_dict()["grace"]["memory"]["bucket0"].any()


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_finite_tensor_is_sent_bit_for_bit(framework):
    """The mark of a finite tensor is -0.0: the result has the bits of the unmarked payload's
    decompression (-0.0 included)."""
    x = np.array([[1.5, -0.0], [0.0, -2.0]], np.float32)
    grc = grace_from_params({"compressor": "topk", "compress_ratio": 1.0,
                             "communicator": "allgather"})
    if framework == "torch":
        tensor, coll = torch.from_numpy(x), OneRankSplits()
    else:
        import tensorflow as tf

        tf.constant(0.0) * 1    # TF's constant cache then holds a +0.0
        tensor, coll = tf.constant(x), _TFOneRank()
    want = grc.compressor.decompress(*grc.compressor.compress(tensor, "v")).numpy()
    out = grc.synchronize(tensor, "w", collectives=coll).numpy()
    np.testing.assert_array_equal(np.signbit(out), np.signbit(want))
    np.testing.assert_array_equal(out, want)
