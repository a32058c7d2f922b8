"""grace_dl.torch.ddp (the DDP communication hook) and grace_dl.torch.distributed (the
torch.distributed collectives): argument checks in this process, and real
``torchrun --nproc-per-node 2`` jobs on gloo (tests/workers/ddp_check.py), no Horovod."""

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mp
from grace_dl import grace_from_params
from support import assert_dicts_differ, assert_equal_dicts, topk_strategy

N = 2
#: ``ddp_check.DDP_OPTIONS``'s labels
DDP_LABELS = ("default", "bucket_view", "static", "both")
#: the half-precision models it trains
HALVES = ("bfloat16", "float16")
TORCHRUN = Path(sys.executable).parent / "torchrun"


def torchrun(*args, timeout: float = 300, ranks: int = N) -> list:
    """``torchrun --standalone --nproc-per-node <ranks> tests/workers/ddp_check.py ARGS``;
    each rank's reported object, by rank. A hung collective fails the test after
    ``timeout``."""
    return mp.run("ddp_check.py", np=ranks, launcher="torchrun", args=args, timeout=timeout,
                  env={"GLOO_SOCKET_IFNAME": "lo"})


# ---------------------------------------------------------------- in-process checks
def test_importing_the_ddp_path_never_imports_horovod():
    code = ("import sys, grace_dl, grace_dl.torch.ddp, grace_dl.torch.distributed\n"
            "from grace_dl import grace_from_params\n"
            "for c in ['topk', 'powersgd', 'qsgd', 'signsgd', 'fp16']:\n"
            "    for m in ['allgather', 'twophase', 'allreduce', 'broadcast']:\n"
            "        try:\n"
            "            grace_from_params({'compressor': c, 'communicator': m})\n"
            "        except ValueError:\n"
            "            pass\n"
            "assert 'horovod' not in sys.modules, [m for m in sys.modules if 'horovod' in m]\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(mp.ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_state_rejects_bad_arguments_naming_them():
    from grace_dl.torch import ddp as grace_ddp

    grc = grace_from_params({"compressor": "topk", "communicator": "allgather"})
    with pytest.raises(ValueError, match=r"granularity must be one of .*'bucket'.*got 'layer'"):
        grace_ddp.GraceState(grc, granularity="layer")
    with pytest.raises(ValueError, match=r"op must be one of .*got 'max'"):
        grace_ddp.GraceState(grc, op="max")
    with pytest.raises(ValueError, match=r"grace must be a grace_dl communicator.*send"):
        grace_ddp.GraceState(object())
    with pytest.raises(ValueError, match="named_parameters must be a sequence"):
        grace_ddp.GraceState(grc, named_parameters=[1, 2])
    for bad in (0, -1, 2.5, "4MB", True):
        with pytest.raises(ValueError, match=rf"piece_bytes must be a positive int, None or "
                                             rf"'auto', got {re.escape(repr(bad))}"):
            grace_ddp.GraceState(grc, piece_bytes=bad)
    with pytest.raises(ValueError, match="GraceState"):
        grace_ddp.comm_hook(object(), None)


def test_a_grace_object_carries_one_state_at_a_time():
    """Two DDP models' hooks on one grace object would key both models' residuals by the same
    default names (``param<i>``): the second state is refused, naming the fix; one that is
    gone frees the object."""
    import gc

    from grace_dl.torch import ddp as grace_ddp

    grc = grace_from_params({"compressor": "topk", "memory": "residual",
                             "communicator": "allgather"})
    first = grace_ddp.GraceState(grc)
    with pytest.raises(ValueError, match=r"already carried by a GraceState still in use.*"
                                         r"one grace object per GraceState"):
        grace_ddp.GraceState(grc)
    grace_ddp.GraceState(grace_from_params({"compressor": "topk", "memory": "residual",
                                            "communicator": "allgather"}))     # one each
    del first
    gc.collect()
    assert grace_ddp.GraceState(grc).grace is grc


def test_a_strategy_the_hook_cannot_carry_is_refused_at_construction():
    """A strategy's nodes are parameters: DDP's buckets as grace tensors match none of them
    (that failed at the first step, naming no option), and a strategy's own buckets were
    dropped silently (each parameter sent alone)."""
    from grace_dl import Schedule
    from grace_dl.torch import ddp as grace_ddp

    for grc in (topk_strategy(), Schedule({0: topk_strategy()})):
        with pytest.raises(ValueError, match=r"granularity='bucket' .* pass granularity="
                                             r"'parameter' or 'auto'"):
            grace_ddp.GraceState(grc, granularity="bucket", named_parameters=[])
    with pytest.raises(ValueError, match=r"packs variables into buckets \(1: .*"
                                         r"Auto\(\.\.\., bucket_bytes=None\)"):
        grace_ddp.GraceState(topk_strategy(bucketed=True), named_parameters=[])
    assert grace_ddp.GraceState(topk_strategy(), named_parameters=[]).per_parameter


def test_auto_granularity_follows_the_compressor():
    from grace_dl.torch import ddp as grace_ddp

    per_param = grace_ddp.GraceState(grace_from_params({"compressor": "powersgd",
                                                        "memory": "powersgd"}))
    bucket = grace_ddp.GraceState(grace_from_params({"compressor": "topk",
                                                     "communicator": "allgather"}))
    forced = grace_ddp.GraceState(grace_from_params({"compressor": "topk",
                                                     "communicator": "allgather"}),
                                  granularity="parameter")
    assert per_param.per_parameter and not bucket.per_parameter and forced.per_parameter


def test_an_uncompressed_bucket_summed_in_place_is_the_send_path():
    """``sums_in_place``: grace ``none`` (allreduce, memory none) is summed by the hook
    itself, in place; the same parameters, bytes counted, grace tensors and checkpoint
    layout as through the send path, here at world size 1 on gloo (2 ranks: the torchrun
    test against DDP's own averaging). Other pipelines, and subclasses, keep the send path."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from grace_dl.compressors.none import NoneCompressor
    from grace_dl.torch import ddp as grace_ddp

    none = {"compressor": "none", "memory": "none", "communicator": "allreduce"}
    assert grace_ddp.sums_in_place(grace_from_params(dict(none)))
    assert not grace_ddp.sums_in_place(grace_from_params({**none, "memory": "residual"}))
    assert not grace_ddp.sums_in_place(grace_from_params({**none, "compressor": "fp16"}))

    class Mine(NoneCompressor):
        pass

    mine = grace_from_params(dict(none))
    assert not grace_ddp.sums_in_place(type(mine)(Mine(), mine.memory))

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        runs = {}
        for in_place in (True, False):
            torch.manual_seed(0)
            net = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                          torch.nn.Linear(16, 2)), bucket_cap_mb_list=[100])
            state = grace_ddp.GraceState(grace_from_params(dict(none)))
            state._sums_in_place = in_place
            net.register_comm_hook(state, grace_ddp.comm_hook)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(1)
            for _ in range(3):
                opt.zero_grad()
                net(torch.randn(4, 8, generator=g)).square().mean().backward()
                opt.step()
            runs[in_place] = ({k: v.detach().clone() for k, v in net.state_dict().items()},
                              state.grace.bytes.steps, state.last_step_names,
                              state.state_dict()["layout"])
        (fast, fast_bytes, fast_names, fast_layout), slow = runs[True], runs[False]
        for k in fast:
            assert torch.equal(fast[k], slow[0][k]), k
        assert (fast_bytes, fast_names, fast_layout) == slow[1:]
        assert fast_names and fast_layout
    finally:
        if created:
            dist.destroy_process_group()


def test_auto_pieces_cut_buckets_on_the_cpu_and_send_a_gpus_whole():
    """``piece_bytes="auto"`` (the default): a bucket over 4 MiB goes in pieces on the CPU and
    whole on the device path (a GPU's tensors; here CPU tensors under ``emulate_device``), as
    the first bucket resolves it; the state records the resolved value. An explicit size cuts
    on the device path too."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from grace_dl.torch import ddp as grace_ddp
    from grace_dl.torch.kernels import emulate_device

    def names(device_path, **options):
        torch.manual_seed(0)
        net = DDP(torch.nn.Linear(1100, 1000), bucket_cap_mb_list=[100])   # 4.4 MB: 2 pieces
        state = grace_ddp.GraceState(grace_from_params({"compressor": "fp16"}), **options)
        net.register_comm_hook(state, grace_ddp.comm_hook)
        with emulate_device() if device_path else contextlib.nullcontext():
            for _ in range(2):
                net(torch.randn(2, 1100)).sum().backward()
        return sorted(state.grace.bytes.steps[-1]["per_tensor"]), \
            state.state_dict()["piece_bytes"]

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        cpu, cpu_pieces = names(False)
        gpu, gpu_pieces = names(True)
        cut, cut_pieces = names(True, piece_bytes=4 << 20)
    finally:
        if created:
            dist.destroy_process_group()
    assert len(cpu) == 2 and cpu[1].endswith("/piece1") and cpu_pieces == 4 << 20, cpu
    assert len(gpu) == 1 and "/piece" not in gpu[0] and gpu_pieces is None, gpu
    assert cut == cpu and cut_pieces == 4 << 20


def test_load_state_dict_refuses_another_configuration():
    from grace_dl.torch import ddp as grace_ddp

    a = grace_ddp.GraceState(grace_from_params({"compressor": "topk", "compress_ratio": 0.1,
                                                "communicator": "allgather"}))
    b = grace_ddp.GraceState(grace_from_params({"compressor": "topk", "compress_ratio": 0.2,
                                                "communicator": "allgather"}))
    with pytest.raises(ValueError, match="grace state is for configuration"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="not a GraceState state_dict"):
        b.load_state_dict({"x": 1})
    c = grace_ddp.GraceState(grace_from_params({"compressor": "topk", "compress_ratio": 0.1,
                                                "communicator": "allgather"}),
                             granularity="parameter")
    with pytest.raises(ValueError, match="per_parameter"):
        c.load_state_dict(a.state_dict())
    # pieces name a quantizer's state, so a checkpoint with other pieces is refused; topk
    # keeps its buckets whole whatever piece_bytes says, so it loads either way
    qsgd = {"compressor": "qsgd", "memory": "residual", "communicator": "twophase"}
    whole = grace_ddp.GraceState(grace_from_params(qsgd), piece_bytes=None)
    pieces = grace_ddp.GraceState(grace_from_params(qsgd), piece_bytes=4 << 20)
    with pytest.raises(ValueError, match=r"piece_bytes=None, this state has "
                                         r"piece_bytes=4194304"):
        pieces.load_state_dict(whole.state_dict())
    with pytest.raises(ValueError, match=r"piece_bytes=4194304, this state has "
                                         r"piece_bytes=None"):
        whole.load_state_dict(pieces.state_dict())
    # "auto" (the default) before any bucket takes the checkpoint's pieces, and a checkpoint
    # saved before any bucket loads into either
    for saved in (whole, pieces):
        auto = grace_ddp.GraceState(grace_from_params(qsgd))
        auto.load_state_dict(saved.state_dict())
        assert auto.state_dict()["piece_bytes"] == saved.piece_bytes
        saved.load_state_dict(grace_ddp.GraceState(grace_from_params(qsgd)).state_dict())
    grace_ddp.GraceState(grace_from_params({"compressor": "topk", "compress_ratio": 0.1,
                                            "communicator": "allgather"}),
                         piece_bytes=None).load_state_dict(a.state_dict())


# ---------------------------------------------------------------- torchrun jobs
@pytest.mark.multiproc
def test_distributed_collectives_on_gloo():
    res = torchrun("collectives")
    for r, out in enumerate(res):
        assert out["size"] == N and out["rank"] == r
        for dt, (got_dt, values, untouched) in out["sums"].items():
            assert got_dt == dt and untouched, dt
            assert values == [2 * i + 1 for i in range(5)], dt
        assert "bool" in out["bool_sum_error"] and "summable" in out["bool_sum_error"]
        gathers = dict(out["gathers"])
        assert gathers.pop("empty") == [0.0] * 4           # rank 0 sent 0 rows, rank 1 four
        for dt, (got_dt, shape, values) in gathers.items():
            assert got_dt == dt and shape == [3, 3, 2], dt   # 1 row from rank 0, 2 from rank 1
            expect = [float(v % 3) for v in range(6)] + [float(v % 3) for v in range(12)]
            if dt == "torch.bool":
                expect = [float(bool(v)) for v in expect]
            assert values == expect, dt
        for root, (values, untouched) in out["broadcast"].items():
            assert values == [float(root * 10 + 1)] * 3 and untouched
        assert "root" in out["bad_root_error"] and "[0, 2)" in out["bad_root_error"]
        recv, splits = out["alltoall"]
        assert splits == [r + j + 1 for j in range(N)]      # rank j sent r + j + 1 rows
        expect = [[100.0 * j + r, float(j)] for j in range(N) for _ in range(r + j + 1)]
        assert recv == expect
        assert "splits" in out["bad_splits_error"]
        assert list(out["alltoall_big"]) == [True, [(r + j + 1) * 80000 for j in range(N)]]
        # sizes given by the caller: the same data without the size exchange; wrong sizes
        # are refused before anything is sent, naming what was given
        assert list(out["alltoall_known"]) == list(out["alltoall_big"])
        assert out["gather_known"]
        # a ragged payload's three parts: one all_gather of their lengths, then one per part
        # sized from them (the default: one gather of lengths and parts together, sized by an
        # exchange of sizes: 2 calls); the same pieces, rank by rank
        one_exchange, plain_calls, same, got = out["gather_parts"]
        assert (one_exchange, plain_calls, same) == (4, 2, True)
        assert got == [[[0.0], [10.0, 11.0, 12.0]], [[0, 0, 0], [1, 1, 1, 1]], [[], []]]
        counts_error, matrix_error = out["known_errors"]
        assert "counts must be 2 non-negative row counts" in counts_error and "[5, 5]" in \
            counts_error, counts_error
        assert "matrix must be 2 rows" in matrix_error and "[[1, 1], [1, 1]]" in matrix_error
        same, values, int8_refused = out["in_place"]
        assert same and values == [(2 * i + 1) * 0.5 for i in range(5)] and int8_refused


@pytest.mark.multiproc
def test_powersgd_units_of_a_bucket_go_in_one_collective_per_round():
    """And PowerSGD's bucket path (``grace_dl.torch.ddp_powersgd``, the default for grace's
    own PowerSGD pipeline) gives the reference composition's bits, bytes and state."""
    res = torchrun("fused", 3)
    for out in res:
        # 3 weight matrices (P, then Q) and 3 biases: alone, 6 + 3 all_reduce calls a step;
        # fused, one for the Ps and biases and one for the Qs (powerSGD_hook's batching)
        assert out["alone"]["calls"] == [9, 9, 9]
        assert out["fused"]["calls"] == out["reference"]["calls"] == [2, 2, 2]
        assert out["fused"]["bucket_path"]
        for other in ("reference", "alone"):
            assert_equal_dicts(out["fused"]["params"], out[other]["params"])
            assert_equal_dicts(out["fused"]["state"], out[other]["state"])
            assert out["fused"]["bytes"] == out[other]["bytes"], other
            assert out["fused"]["names"] == out[other]["names"]
        assert all(sum(sent for sent, _ in step.values()) > 0 for step in out["fused"]["bytes"])
    assert_equal_dicts(res[0]["fused"]["params"], res[1]["fused"]["params"])


@pytest.mark.multiproc
def test_none_allreduce_hook_equals_ddp_default_averaging():
    res = torchrun("equal")
    for out in res:
        for case in ("plain", "no_sync", "unused", "pieces"):
            assert_equal_dicts(out[f"{case}/default"], out[f"{case}/hook"])
        # pieces: fp16 whole against fp16 in pieces of 4 KiB (each piece its own tensor)
        whole, cut = out["pieces/default/tensors"], out["pieces/hook/tensors"]
        assert not any("/piece" in t for t in whole) and len(cut) > len(whole), (whole, cut)
        assert all(t.startswith("bucket") for t in cut) and any("/piece1" in t for t in cut)
        # 12 micro-batches, 6 synchronised: the hook ran (and closed a step) 6 times
        assert out["no_sync/hook_steps"] == 6 and out["no_sync/iteration"] == 6
    for case in ("plain", "no_sync", "unused"):
        assert_equal_dicts(res[0][f"{case}/hook"], res[1][f"{case}/hook"])


@pytest.mark.multiproc
def test_compressed_hooks_train_digits_like_ddp():
    pipelines = ["ddp", "topk", "powersgd", "qsgd-2phase", "signsgd", "fp16"]
    res = torchrun("train", 8, *pipelines, timeout=600)
    for out in res:
        assert not out["horovod_before"] and not out["horovod_after"]
    base = res[0]["ddp"]["accuracy"][-1]
    assert base > 0.9, res[0]["ddp"]["accuracy"]
    finals = {p: res[0][p]["accuracy"][-1] for p in pipelines}
    assert all(finals[p] >= base - 0.05 for p in pipelines), finals
    for p in pipelines[1:]:
        # every rank holds identical parameters
        assert_equal_dicts(res[0][p]["params"], res[1][p]["params"])
        for out in res:
            assert out[p]["roundtrip"], p
    # the compressed pipelines did move fewer bytes than fp32 allreduce would
    numel = sum(v.size for v in res[0]["ddp"]["params"].values())
    ring = 2 * (N - 1) / N * numel * 4
    for p, most in (("topk", 0.21), ("powersgd", 0.3), ("qsgd-2phase", 0.35),
                    ("signsgd", 0.1), ("fp16", 0.51)):
        sent = res[0][p]["sent_per_step"][-1]
        assert 0 < sent <= most * ring, (p, sent, ring)
    assert res[0]["powersgd"]["granularity"] == "parameter"
    assert res[0]["topk"]["granularity"] == "bucket"
    # state is there to round-trip: residuals, PowerSGD's Q, twophase's server residuals
    assert any(k.startswith("/memory/") for k in res[0]["topk"]["state_keys"])
    assert any("/q/" in k for k in res[0]["powersgd"]["state_keys"])
    assert any(k.startswith("/server/") for k in res[0]["qsgd-2phase"]["state_keys"])


@pytest.mark.multiproc
def test_resume_from_a_checkpoint_continues_bit_for_bit():
    """Also each bucket completed in its own hook call (``@bucketwise``: what the hook does
    on NCCL, data-dependent sizes read once a round of the step) against the step's buckets
    completed together (gloo's): the same bits."""
    bucketwise = ["topk@bucketwise", "powersgd@bucketwise", "qsgd-2phase@pieces@bucketwise",
                  "none@bucketwise", "signsgd-2phase@bucketwise", "dgc@bucketwise"]
    # ``@static``: DDP keeps its first layout (a bucket a dtype) two iterations, the first its
    # delayed allreduce, each bucket finished in its own hook call: both are regrouped as
    # the saved run grouped its gradients, every bucket of them
    static = ["topk@static", "qsgd-2phase@static"]
    pipelines = ["topk", "powersgd", "qsgd-2phase", "randomk", "threshold-bcast",
                 "qsgd-2phase@pieces", "none", "signsgd-2phase", "dgc", *bucketwise, *static]
    res = torchrun("resume", 6, *pipelines, timeout=600)
    for out in res:
        for p in pipelines:
            assert_equal_dicts(out[p]["straight"], out[p]["resumed"])
            if not p.startswith("none"):        # (none keeps no state)
                assert_dicts_differ(out[p]["straight"], out[p]["no_state"])
            assert out[p]["names"] == out[p]["names_resumed"], p
        for p in bucketwise:
            together = p.removesuffix("@bucketwise")
            assert_equal_dicts(out[p]["straight"], out[together]["straight"])
            assert out[p]["names"] == out[together]["names"], p
        # in pieces, every piece of a bucket has its own residual and server residual;
        # bucket-sized pieces (the default, 4 MiB) leave these small buckets whole
        pieces = [k for k in out["qsgd-2phase@pieces"]["keys"] if "/piece" in k]
        assert any(k.startswith("/server/") for k in pieces), out["qsgd-2phase@pieces"]["keys"]
        assert any(k.startswith("/memory/") for k in pieces)
        assert not any("/piece" in k for k in out["qsgd-2phase"]["keys"])
    for p in pipelines:
        assert_equal_dicts(res[0][p]["resumed"], res[1][p]["resumed"])


@pytest.mark.multiproc
def test_the_device_path_trains_two_ranks_as_the_cpu_path_does():
    """2 ranks (torchrun, gloo), the GPU's code on CPU tensors (``emulate_device``, its Triton
    kernels in Triton's interpreter) against the path CPU tensors take, one ~100K-element
    bucket: the ranks agree on either path; signSGD's vote (allgather, and two-phase's server
    with its error; also with the sizes on the device held for the step's one read, as on
    NCCL: ``@bucketwise``) and top-k give the CPU path's parameters bit for bit and its bytes
    each step; dgc, whose device path draws its threshold's sample otherwise, sends about as much
    and trains to finite parameters."""
    res = mp.run("ddp_check.py", np=N, launcher="torchrun",
                 args=("device", 3, "signsgd", "signsgd-2phase", "signsgd-2phase@bucketwise",
                       "topk", "dgc"), timeout=900,
                 env={"GLOO_SOCKET_IFNAME": "lo", "TRITON_INTERPRET": "1"})
    assert res[0].pop("kernels") and res[1].pop("kernels")      # (the interpreter ran them)
    for key, got in res[0].items():
        assert got["units"] == 1, key
        for name, value in got["params"].items():
            np.testing.assert_array_equal(value, res[1][key]["params"][name], err_msg=key)
    for pipeline in ("signsgd", "signsgd-2phase", "signsgd-2phase@bucketwise", "topk"):
        cpu, device = res[0][f"{pipeline}/cpu"], res[0][f"{pipeline}/device"]
        assert cpu["sent"] == device["sent"], pipeline
        for name, value in cpu["params"].items():
            np.testing.assert_array_equal(value, device["params"][name],
                                          err_msg=f"{pipeline} {name}")
    cpu, device = res[0]["dgc/cpu"], res[0]["dgc/device"]
    assert all(np.isfinite(v).all() for v in device["params"].values())
    assert 0.5 < sum(device["sent"]) / sum(cpu["sent"]) < 2.0, (cpu["sent"], device["sent"])


def test_ddps_speed_and_memory_options():
    """``gradient_as_bucket_view`` (gradients are views of DDP's buckets, which the hook writes
    into) gives every pipeline the parameters, bytes, state and names of DDP's defaults, bit
    for bit. ``static_graph`` rebuilds DDP's buckets after the second iteration, not the
    first: the hook follows (the first layout's names twice, its state dropped at the
    rebuild), the same bits where state does not depend on the layout (none, fp16, PowerSGD
    per parameter), the same names, bytes and state keys from the rebuild on for the others.
    A bfloat16 or float16 model trains on every pipeline with its ranks in step; ``none``
    equals DDP's own averaging in bfloat16, and in float16 up to DDP's division before the
    sum."""
    pipelines = ["ddp", "none", "fp16", "topk", "randomk", "qsgd-2phase", "powersgd", "signsgd",
                 "topk@bucketwise"]     # (each bucket completed in its hook call: NCCL's way)
    layout_free = ("ddp", "none", "fp16", "powersgd")
    res = torchrun("options", 6, *pipelines, timeout=600)
    for out in res:
        for p in pipelines:
            default = out[f"{p}/default"]
            for label in DDP_LABELS[1:]:
                run = out[f"{p}/{label}"]
                static = label != "bucket_view"
                if p in layout_free or not static:
                    assert_equal_dicts(default["params"], run["params"])
                if p == "ddp":
                    continue
                names, want = run["names"], default["names"]
                assert len(names) == 6 and run["keys"] == default["keys"], (p, label)
                if static:  # DDP's first layout twice; then its rebuilt one, as by default
                    assert names[1] == want[0] and names[2:] == want[2:], (p, label, names)
                    assert run["sent"][2:] == default["sent"][2:], (p, label)
                else:
                    assert names == want and run["sent"] == default["sent"], (p, label)
            for dtype in HALVES:
                half = out[f"{p}/{dtype}"]["params"]
                assert all(np.isfinite(v).all() for v in half.values()), (p, dtype)
                assert_dicts_differ(half, out["ddp/default"]["params"])     # (it trained)
                if p not in ("ddp", "none"):    # (none: equal to DDP's, below)
                    assert len(out[f"{p}/{dtype}"]["sent"]) == 6, (p, dtype)
                    assert_dicts_differ(half, out[f"ddp/{dtype}"]["params"])
        for label in (*DDP_LABELS, "bfloat16"):
            assert_equal_dicts(out[f"none/{label}"]["params"], out[f"ddp/{label}"]["params"])
        # float16: DDP halves each rank's gradient before the sum, grace the sum: a gradient
        # small enough to be subnormal when halved rounds otherwise (a last bit, here and there)
        for k, want in out["ddp/float16"]["params"].items():
            np.testing.assert_allclose(out["none/float16"]["params"][k], want, rtol=2e-3,
                                       atol=1e-5, err_msg=k)
        # the layout changes at DDP's rebuild (else the static case above proves nothing)
        assert out["topk/default"]["names"][0] != out["topk/default"]["names"][1]
    for key in res[0]:
        assert_equal_dicts(res[0][key]["params"], res[1][key]["params"])


@pytest.mark.multiproc
def test_ranks_agree_at_a_world_size_that_is_not_a_power_of_two():
    """Three ranks: an average's division by 3 rounds (by 2 or 4 it is exact), so every rank
    must divide the same numbers the same way. Two-phase qsgd folds the average into the
    payloads' norms (``divided_payloads``): its server rank once wrote its own chunk as its
    decoding divided by 3, the others that chunk's divided payload decoded, and the ranks
    drifted apart in the last bits. Every pipeline, under each DDP option and on half-precision
    models: the same parameters on every rank."""
    pipelines = ["none", "fp16", "topk", "randomk", "qsgd-2phase", "powersgd", "signsgd",
                 "signsgd-2phase", "dgc", "threshold-bcast", "qsgd-2phase@bucketwise"]
    res = torchrun("options", 3, *pipelines, timeout=600, ranks=3)
    assert len(res) == 3 and set(res[0]) == {f"{p}/{label}" for p in pipelines
                                             for label in (*DDP_LABELS, *HALVES)}
    for key in res[0]:
        assert len(res[0][key]["sent"]) == 3, key
        for other in res[1:]:
            assert_equal_dicts(res[0][key]["params"], other[key]["params"])


@pytest.mark.multiproc
def test_a_state_goes_on_after_a_backward_pass_failed_in_the_delayed_allreduce():
    """A backward pass that fails in DDP's delayed allreduce (after two of three buckets)
    never runs the end-of-pass callback that ends the hook's step; DDP refuses to go on, and
    the same ``GraceState`` registered on a new DDP of the module must take the new pass's
    buckets as a new step (they came in another autograd graph task), not as more of the
    failed one (it raised "a DDP step started before the previous one handed over its last
    bucket"). Every step after it completes; ``none`` gives the clean run's bits (the failed
    pass's compressed buckets are in a stateful pipeline's error feedback, as they would be
    had the pass failed after them)."""
    pipelines = ["none", "topk", "qsgd-2phase"]
    res = torchrun("aborted", 4, *pipelines, timeout=300)
    for out in res:
        for p in pipelines:
            failed, clean = out[f"{p}/failed"], out[f"{p}/clean"]
            assert failed["error"] == "injected after the second bucket", failed["error"]
            assert failed["iteration"] == clean["iteration"] == 4, p
            assert failed["units"] == clean["units"], p
            assert all(np.isfinite(v).all() for v in failed["params"].values()), p
        assert_equal_dicts(out["none/failed"]["params"], out["none/clean"]["params"])
    for p in pipelines:
        assert_equal_dicts(res[0][f"{p}/failed"]["params"], res[1][f"{p}/failed"]["params"])


@pytest.mark.multiproc
def test_static_graphs_delayed_allreduce_of_several_dtypes():
    """Under ``static_graph`` DDP ends its first iteration by a delayed allreduce: every bucket
    (one a dtype: float32, float64, a complex parameter's real view) handed over at the end of
    the backward pass as bucket 0, none as the last, all awaited before the pass ends. The
    hook finishes each in its own call and ends the step with the pass: every pipeline trains
    with its ranks in step, one hook step a backward pass, every dtype's bucket a unit of
    the first step; where state does not depend on the layout, the same bits as without
    ``static_graph``, and ``none`` equal to DDP's own averaging."""
    pipelines = ["ddp", "none", "none@parameter", "fp16", "powersgd", "topk", "qsgd-2phase",
                 "signsgd", "topk@bucketwise"]
    res = torchrun("delayed", 4, *pipelines, timeout=400)
    for out in res:
        for label in ("default", "static"):
            for none in ("none", "none@parameter"):    # (a complex gradient's real view whole)
                assert_equal_dicts(out[f"{none}/{label}"]["params"],
                                   out[f"ddp/{label}"]["params"])
        for p in pipelines[1:]:
            static, default = out[f"{p}/static"], out[f"{p}/default"]
            assert static["iteration"] == static["steps"] == 4, (p, static)
            assert static["units"][0] >= 3, (p, static["units"])     # a bucket a dtype
            assert all(np.isfinite(v).all() for v in static["params"].values()), p
            assert_dicts_differ(static["params"], out["ddp/static"]["params"]) \
                if p not in ("none", "none@parameter", "fp16") else None
            if p in ("none", "none@parameter", "fp16", "powersgd"):
                assert_equal_dicts(static["params"], default["params"])
    for key in res[0]:
        assert_equal_dicts(res[0][key]["params"], res[1][key]["params"])


@pytest.mark.multiproc
def test_uneven_inputs_under_ddps_join():
    """Rank 1 runs out of batches two steps before rank 0; under ``model.join()`` its DDP runs
    the hook on zero buckets for rank 0's last steps, so every pipeline's collectives stay
    matched (no hang), its ranks end with the same parameters, and ``none`` equals DDP's
    own join."""
    pipelines = ["ddp", "none", "fp16", "topk", "qsgd-2phase", "powersgd", "signsgd",
                 "topk@bucketwise"]
    res = torchrun("join", *pipelines, timeout=300)
    for p in pipelines:
        assert_equal_dicts(res[0][p]["params"], res[1][p]["params"])
        if p != "ddp":
            for out in res:     # the joined rank's hook ran for the steps it shadowed
                assert out[p]["steps"] == 6 and out[p]["iteration"] == 6, (p, out[p])
    assert_equal_dicts(res[0]["none"]["params"], res[0]["ddp"]["params"])
    assert_dicts_differ(res[0]["topk"]["params"], res[0]["ddp"]["params"])


@pytest.mark.multiproc
def test_ranks_with_different_configurations_fail_instead_of_hanging():
    res = torchrun("disagree", timeout=120)
    for out in res:
        assert out["error"] is not None
        assert "ranks disagree on the grace configuration" in out["error"], out["error"]


@pytest.mark.multiproc
def test_per_variable_strategies_run_under_the_hook_without_horovod():
    """A strategy dispatcher (a size threshold; the top-k recipe, a ``Schedule`` whose second
    stage is one) under the hook: its first send's check that every rank runs the same
    strategy goes over the hook's torch.distributed collectives (it reached for Horovod's),
    topk's weights send fewer bytes than the dense stage, both ranks end equal. Without
    ``named_parameters`` the state refuses it at construction, naming the fix."""
    res = torchrun("strategy", "6")
    steps = 6
    for case in ("size_threshold", "recipe"):
        assert_equal_dicts(res[0][case]["params"], res[1][case]["params"])
        sent = res[0][case]["sent_per_step"]
        assert len(sent) == steps, sent
    dense = res[0]["recipe"]["sent_per_step"]
    assert dense[0] == dense[2] and dense[3] < dense[2] / 2, dense      # the switch at step 3
    thresholded = res[0]["size_threshold"]["sent_per_step"]
    assert thresholded[0] < dense[0] / 2, (thresholded, dense)
    assert_dicts_differ(res[0]["size_threshold"]["params"], res[0]["recipe"]["params"])
    for out in res:
        assert not out["horovod"]
        assert "named_parameters=model.named_parameters()" in out["unnamed"], out["unnamed"]
