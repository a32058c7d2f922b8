"""grace_dl.torch.horovod.DistributedOptimizer: argument checks in this process, and real 2-rank
horovodrun jobs (tests/workers/torch_optimizer.py, torch_resume.py) compared with
horovod.torch's optimizer and with single-process references that apply the same
compress/aggregate math to both ranks' gradients."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mp
from grace_dl import grace_from_params
from support import assert_dicts_differ, assert_equal_dicts

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
import torch_common as C  # noqa: E402

N = 2
NONE = {"compressor": "none", "memory": "none", "communicator": "allreduce"}
TOPK = {"compressor": "topk", "memory": "residual", "communicator": "allgather",
        "compress_ratio": 0.1}
NUMEL = sum(p.numel() for p in C.make_model().parameters())


# ---------------------------------------------------------------- single-process references
def _aggregate(grcs, grads_by_rank, name, factor=1.0):
    """What the allgather pipeline should produce for ``name``: each rank's compensated,
    compressed, decompressed gradient, aggregated in rank order, divided by the rank count."""
    decompressed = []
    for grc, grads in zip(grcs, grads_by_rank):
        g = torch.as_tensor(grads[name])
        if factor != 1.0:
            g = g * (1.0 / factor)
        comp = grc.memory.compensate(g, name)
        payload, ctx = grc.compressor.compress(comp, name)
        grc.memory.update(comp, name, grc.compressor, payload, ctx)
        decompressed.append(grc.compressor.decompress(payload, ctx))
    out = grcs[0].compressor.aggregate(decompressed) / len(grcs)
    return out * factor if factor != 1.0 else out


def _reference_training(params, steps=3, factor=1.0, extra=False):
    torch.set_num_threads(1)
    model = C.make_model(extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grcs = [grace_from_params(dict(params)) for _ in range(N)]
    named = dict(model.named_parameters())
    for step in range(steps):
        grads = []
        for r in range(N):
            model.zero_grad(set_to_none=True)
            C.loss_of(model, r, step).backward()
            grads.append({k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                          for k, p in named.items() if p.requires_grad})
        for name in sorted(grads[0]):
            named[name].grad = _aggregate(grcs, grads, name, factor)
        opt.step()
    return C.params(model)


def _close(a: dict, b: dict, **tol):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], err_msg=k, **tol)


# ---------------------------------------------------------------- in-process checks
def _sgd():
    return torch.optim.SGD(C.make_model().parameters(), lr=0.1)


@pytest.mark.parametrize("kwargs, words", [
    ({"op": "adasum"}, ["op", "'adasum'", "Average", "Sum"]),
    ({"op": 2}, ["Adasum", "Average", "Sum"]),
    ({"op": 3}, ["Min", "Average", "Sum"]),
    ({"backward_passes_per_step": 0}, ["backward_passes_per_step", "0"]),
    ({"gradient_predivide_factor": 2.0, "op": 1}, ["gradient_predivide_factor", "Average"]),
    ({"gradient_predivide_factor": -1.0}, ["gradient_predivide_factor", "-1.0"]),
    ({"groups": -2}, ["groups", "-2"]),
    ({"groups": [[1.0]]}, ["groups", "torch.Tensor"]),
    ({"piece_bytes": 0}, ["piece_bytes", "positive int, None or 'auto'", "got 0"]),
    ({"piece_bytes": "4MB"}, ["piece_bytes", "'4MB'"]),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, words):
    import grace_dl.torch.horovod as hvd

    with pytest.raises(ValueError) as err:
        hvd.DistributedOptimizer(_sgd(), grace=grace_from_params(dict(NONE)), **kwargs)
    for word in words:
        assert word in str(err.value)


def test_grace_on_a_process_set_needs_the_optimizer_on_it_too():
    import grace_dl.torch.horovod as hvd

    grc = grace_from_params(dict(NONE))
    grc.process_set = hvd.ProcessSet([0])
    with pytest.raises(ValueError, match="process_set"):
        hvd.DistributedOptimizer(_sgd(), grace=grc)


def test_grace_needs_a_communicator_and_no_horovod_compression():
    import grace_dl.torch.horovod as hvd

    with pytest.raises(ValueError, match="send"):
        hvd.DistributedOptimizer(_sgd(), grace={"compressor": "topk"})
    with pytest.raises(ValueError, match="Compression.none"):
        hvd.DistributedOptimizer(_sgd(), grace=grace_from_params(dict(NONE)),
                                 compression=hvd.Compression.fp16)


def test_a_grace_object_carries_one_optimizer_at_a_time():
    """Its state is keyed by parameter names: a second live optimizer would feed the first's
    residuals into its own tensors (Horovod's default names always meet) and save them in its
    checkpoint; one that is gone frees the object."""
    import gc

    import grace_dl.torch.horovod as hvd

    hvd.init()      # a one-process job
    grc = grace_from_params(dict(TOPK))
    first = hvd.DistributedOptimizer(_sgd(), grace=grc)
    with pytest.raises(ValueError) as err:
        hvd.DistributedOptimizer(_sgd(), grace=grc)
    for word in ("already carried by a SGD still in use", "DistributedOptimizer",
                 "one grace object per DistributedOptimizer", "grace_from_params"):
        assert word in str(err.value)
    hvd.DistributedOptimizer(_sgd(), grace=grace_from_params(dict(TOPK)))     # one each
    del first
    gc.collect()
    assert hvd.DistributedOptimizer(_sgd(), grace=grc).grace is grc


def test_groups_keep_only_the_tensors_the_optimizer_trains_as_horovod_does():
    """Fine-tuning: ``groups`` may name every model parameter for an optimizer of a few, or a
    frozen one; those are left out of the fusion groups (Horovod's ``_register_hooks``)."""
    import grace_dl.torch.horovod as hvd

    hvd.init()
    model = C.make_model()
    named = dict(model.named_parameters())
    head, frozen = list(named)[-2:], list(named)[0]
    named[frozen].requires_grad_(False)
    trained = [named[frozen]] + [named[k] for k in head]
    grc = grace_from_params(dict(NONE))
    hvd.DistributedOptimizer(torch.optim.SGD(trained, lr=0.1), grace=grc,
                             named_parameters=model.named_parameters(),
                             groups=[[named[frozen]], [named[k] for k in list(named)[1:]]])
    assert sorted(map(sorted, grc.fusion.groups.values())) == [sorted(head)]


def test_topk_over_allreduce_is_refused_at_construction():
    with pytest.raises(ValueError) as err:
        grace_from_params({**TOPK, "communicator": "allreduce"})
    assert "allreduce" in str(err.value) and "topk" in str(err.value).lower()


def test_dropin_module_has_every_horovod_name_and_lazy_import():
    code = ("import sys, grace_dl.torch, grace_dl.torch.ops\n"
            "assert 'horovod' not in sys.modules, 'ops imported horovod'\n"
            "from grace_dl.torch import DistributedOptimizer\n"
            "import horovod.torch as h, grace_dl.torch.horovod as g\n"
            "from grace_dl.torch.optimizer import DistributedOptimizer as D\n"
            "missing = [k for k in vars(h) if not k.startswith('_') and not hasattr(g, k)]\n"
            "assert not missing, missing\n"
            "assert g.DistributedOptimizer is D is DistributedOptimizer\n"
            "assert g.allreduce is h.allreduce and g.Average == h.Average\n"
            "assert g.broadcast_optimizer_state is not h.broadcast_optimizer_state\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=str(mp.ROOT))


# ---------------------------------------------------------------- 2-rank jobs
@pytest.fixture(scope="module")
def ranks():
    return mp.run("torch_optimizer.py", np=N, args=[json.dumps(TOPK)], timeout=300)


@pytest.mark.multiproc
def test_grace_none_is_horovods_optimizer_bit_for_bit(ranks):
    for res in ranks:
        assert res["grace_none_class_module"] == "horovod.torch.optimizer"
        assert_equal_dicts(res["grace_None"], res["hvd"])


@pytest.mark.multiproc
def test_none_pipeline_equals_horovod_averaging(ranks):
    for res in ranks:
        # the same in-place allreduce of p.grad with the same postscale as Horovod's optimizer
        assert_equal_dicts(res["none_pipeline"], res["hvd"])
        assert res["none_bytes"] == [NUMEL * 4] * 3   # fp32, ring allreduce over 2 ranks
    assert_equal_dicts(ranks[0]["none_pipeline"], ranks[1]["none_pipeline"])


@pytest.mark.multiproc
def test_topk_residual_allgather_matches_single_process_reference(ranks):
    # Step by step: the applied gradient is the reference math on both ranks' local gradients.
    grcs = [grace_from_params(dict(TOPK)) for _ in range(N)]
    for step in range(3):
        local = [res["topk_records"][step]["local"] for res in ranks]
        for name in sorted(local[0]):
            expected = _aggregate(grcs, local, name).numpy()
            for res in ranks:
                np.testing.assert_allclose(res["topk_records"][step]["synced"][name], expected,
                                           rtol=1e-6, atol=1e-8, err_msg=f"{name} step {step}")
    # Whole trajectory, recomputed in this process.
    reference = _reference_training(TOPK)
    for res in ranks:
        _close(res["topk"], reference, rtol=1e-5, atol=1e-6)
        assert_equal_dicts(res["topk_again"], res["topk"])  # step() path == synchronize() path
        assert_dicts_differ(res["topk"], res["none_pipeline"])  # compression did something
    assert_equal_dicts(ranks[0]["topk"], ranks[1]["topk"])
    payload = grcs[0].compressor.payload_nbytes
    expected_bytes = sum(payload(p.numel()) for p in C.make_model().parameters())
    assert ranks[0]["topk_bytes"] == [expected_bytes] * 3
    assert expected_bytes < NUMEL * 4 / 3


@pytest.mark.multiproc
def test_gradient_predivide_factor(ranks):
    reference = _reference_training(TOPK, factor=4.0)
    for res in ranks:
        _close(res["pre_grace"], res["pre_hvd"], rtol=1e-6, atol=1e-7)
        _close(res["pre_topk"], reference, rtol=1e-5, atol=1e-6)
    assert_equal_dicts(ranks[0]["pre_topk"], ranks[1]["pre_topk"])


@pytest.mark.multiproc
def test_op_sum(ranks):
    for res in ranks:
        _close(res["sum_grace"], res["sum_hvd"], rtol=1e-6, atol=1e-7)
        assert_dicts_differ(res["sum_hvd"], res["hvd"])


@pytest.mark.multiproc
def test_backward_passes_per_step_accumulates_then_sends_once(ranks):
    for res in ranks:
        _close(res["bpps_grace"], res["bpps_hvd"], rtol=1e-6, atol=1e-7)
        assert_dicts_differ(res["bpps_hvd"], res["hvd"])
        assert res["bpps_sent_after_pass1"] == 0
        assert res["bpps_sent_after_pass2"] == NUMEL * 4
        assert "backward_passes_per_step" in res["bpps_third_pass"]


@pytest.mark.multiproc
def test_synchronize_clip_skip_synchronize(ranks):
    for res in ranks:
        _close(res["skip_grace"], res["skip_hvd"], rtol=1e-6, atol=1e-7)
        assert res["skip_synced_norm"] <= 0.05 + 1e-6     # clipping saw the averaged gradient
        assert res["skip_steps_counted"] == 3              # step() inside skip: no second send
        assert len(res["skip_warning"]) == 1 and "skip_synchronize" in res["skip_warning"][0]


@pytest.mark.multiproc
def test_parameter_without_gradient_and_non_float_parameter(ranks):
    init = C.params(C.make_model(extra_branch=True))
    for res in ranks:
        _close(res["nograd_grace"], res["nograd_hvd"], rtol=1e-6, atol=1e-7)
        for key in ("nograd_grace", "nograd_topk"):
            np.testing.assert_array_equal(res[key]["counter"], np.arange(3))
            assert not np.array_equal(res[key]["extra.weight"], init["extra.weight"])
    for key in ("nograd_grace", "nograd_topk"):
        assert_equal_dicts(ranks[0][key], ranks[1][key])


@pytest.mark.multiproc
def test_process_set_is_passed_to_the_communicator(ranks):
    for res in ranks:
        assert res["ps_attached"]
        _close(res["ps_grace"], res["ps_hvd"], rtol=1e-6, atol=1e-7)
    assert [res["ps_grace_steps"] for res in ranks] == [3, 0]   # rank 1 is outside the set


@pytest.mark.multiproc
@pytest.mark.parametrize("pipeline", ["none", "topk"])
def test_groups_fuse_payloads_into_fewer_collectives(ranks, pipeline):
    """groups=2 with grace: fewer collectives per step (fused per group, kind and dtype), the
    same bytes, the same parameters bit for bit, identical on both ranks, and no warning."""
    for res in ranks:
        alone, fused = res["groups"][pipeline]["None"], res["groups"][pipeline]["2"]
        assert fused["calls_per_step"] < alone["calls_per_step"]
        assert all(n.startswith("grace.fused.g") for n in fused["names"])
        assert fused["sent"] == alone["sent"]
        assert fused["warnings"] == [] and alone["warnings"] == []
        assert_equal_dicts(fused["params"], alone["params"])
    assert_equal_dicts(*(res["groups"][pipeline]["2"]["params"] for res in ranks))


@pytest.mark.multiproc
def test_step_starts_every_two_phase_gather_before_waiting_for_one(ranks):
    """step() receives a step's handles in lockstep (``receive_all``): every tensor's phase-2
    allgather is in flight before the first is waited for, so Horovod can fuse them, where
    receiving one by one waits for each before the next starts; the parameters are the same
    bit for bit and identical on both ranks."""
    for res in ranks:
        lock, seq = res["two_phase"]["lockstep"], res["two_phase"]["one_by_one"]
        assert lock["tensors"] == seq["tensors"] > 1
        assert lock["all_issued_before_a_wait"]
        assert not seq["all_issued_before_a_wait"]
        assert_equal_dicts(lock["params"], seq["params"])
    assert_equal_dicts(*(res["two_phase"]["lockstep"]["params"] for res in ranks))


@pytest.mark.multiproc
def test_gradients_over_piece_bytes_go_in_pieces(ranks):
    """piece_bytes=64: every weight of the tiny MLP is sent as pieces, each its own grace
    tensor with its own state, results written back into p.grad. fp16 in pieces sums to the
    same as fp16 whole, bit for bit; ``none`` is never cut; qsgd two-phase keeps ranks
    identical; the pieces are part of the checkpoint, which an optimizer with other pieces
    refuses."""
    for res in ranks:
        assert_equal_dicts(res["pieces_fp16"], res["whole_fp16"])
        assert res["pieces_fp16_layout"] == res["pieces_qsgd"]["pieces"] != {}
        assert res["pieces_none_layout"] == {}
        qsgd = res["pieces_qsgd"]
        assert qsgd["pieces"] and all(n > 1 for n in qsgd["pieces"].values()), qsgd["pieces"]
        for name in qsgd["pieces"]:
            assert any(f"/{name}/piece1" in k for k in qsgd["keys"]), (name, qsgd["keys"])
        assert "other pieces" in res["pieces_refused"] and "piece_bytes=None" in \
            res["pieces_refused"], res["pieces_refused"]
        assert res["pieces_reloaded"]
    assert_equal_dicts(*(res["pieces_qsgd"]["params"] for res in ranks))


@pytest.mark.multiproc
def test_uncompressed_pipeline_sums_in_place_in_p_grad(ranks):
    """``none``/allreduce hands p.grad itself to Horovod's in-place allreduce (no result
    allocation, no copy, the average taken by its postscale); compressed payloads do not."""
    for res in ranks:
        names = res["groups"]["none"]["None"]["names"]
        assert names and all(n.endswith(" (in place)") for n in names)
        assert not any(n.endswith(" (in place)") for n in res["groups"]["topk"]["None"]["names"])


@pytest.mark.multiproc
def test_zero_grad_race_and_rank_mismatch_raise_on_every_rank(ranks):
    for res in ranks:
        assert "zero_grad" in res["zero_grad_race"]
        assert "ranks disagree on the grace configuration" in res["mismatch_config"]
        assert "compress_ratio" in res["mismatch_config"]
        assert "ranks disagree on the parameters" in res["mismatch_model"]


@pytest.mark.multiproc
def test_broadcast_optimizer_state_sends_nothing_through_grace(ranks):
    for res in ranks:
        assert res["bcast_state_entries"] == len(C.params(C.make_model()))  # momentum buffers
        assert res["bcast_grace_steps"] == 0


@pytest.mark.multiproc
def test_sparse_gradients(ranks):
    for res in ranks:
        np.testing.assert_allclose(res["sparse_grace"], res["sparse_hvd"], rtol=1e-6, atol=1e-7)
        assert "sparse_as_dense=True" in res["sparse_refused"]
    np.testing.assert_array_equal(ranks[0]["sparse_grace"], ranks[1]["sparse_grace"])


@pytest.mark.multiproc
def test_checkpoint_resume_in_fresh_job_is_bitwise_identical(tmp_path):
    saved = mp.run("torch_resume.py", np=N, args=["save", tmp_path, json.dumps(TOPK)],
                   timeout=240)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gathered.pt", "rank0.pt", "rank1.pt"]
    # The fresh job even uses the other launcher (Open MPI instead of Gloo).
    resumed = mp.run("torch_resume.py", np=N, launcher="mpi",
                     args=["load", tmp_path, json.dumps(TOPK)], timeout=240)
    for before, after in zip(saved, resumed):
        assert before["grace_keys"] == sorted(C.params(C.make_model()))  # one residual each
        assert_equal_dicts(after["from_own_file"], before["uninterrupted"])
        assert_equal_dicts(after["from_gathered"], before["uninterrupted"])
        assert_dicts_differ(after["without_grace_state"], before["uninterrupted"])
    assert resumed[0]["other_rank_file"] == "no error"
    assert "not this rank 1" in resumed[1]["other_rank_file"]


def test_auto_pieces_follow_each_gradients_device_and_a_refusal_says_what_auto_means():
    """``piece_bytes="auto"`` (the default): a gradient over 4 MiB goes in pieces on the CPU,
    whole on the device path (a GPU's; CPU tensors under ``emulate_device``); a checkpoint with
    another piece layout is refused with what "auto" gave and what to pass instead."""
    import grace_dl.torch.horovod as hvd
    from grace_dl.torch.kernels import emulate_device

    hvd.init()
    qsgd = {"compressor": "qsgd", "memory": "residual", "communicator": "twophase"}

    def optimizer(**options):
        model = torch.nn.Linear(1100, 1000)        # a 4.4 MB weight: 2 pieces of <= 4 MiB
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        grace=grace_from_params(dict(qsgd)), **options)

    cpu = optimizer()
    assert cpu._piece_layout() == {"weight": 2}
    with emulate_device():
        assert optimizer()._piece_layout() == {}
        assert optimizer(piece_bytes=4 << 20)._piece_layout() == {"weight": 2}
    with pytest.raises(ValueError, match=r"other pieces.*'auto' is pieces of 4194304 bytes on "
                                         r"the CPU and whole on a GPU"):
        cpu.load_state_dict(optimizer(piece_bytes=None).state_dict())
