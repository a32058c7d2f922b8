"""The step model behind ``Auto``: overlap with the backward pass, encode on the critical path,
fusion, measured overlap; Auto's choice from a measurement file; the in-job measurement under a
real 2-rank horovodrun."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grace_dl.strategy import Auto, Pipeline, ResourceSpec
from grace_dl.strategy.builders import horovod_path
from grace_dl.strategy.calibrate import overlap_bytes
from grace_dl.strategy.cost_model import FORMAT, Network
from grace_dl.strategy.step_model import (
    HOROVOD,
    HOROVOD_FP16,
    Calibration,
    Cost,
    Fit,
    link_share_s,
    predict_step,
    simulate,
    variable_cost,
)
from grace_dl.strategy.variables import variables_of

ROOT = Path(__file__).resolve().parent.parent
TOPK = {"compressor": "topk", "compress_ratio": 0.01, "memory": "residual",
        "communicator": "allgather"}
RANDOMK = {"compressor": "randomk", "compress_ratio": 0.01, "memory": "residual",
           "communicator": "allreduce"}
MLP = {"1.weight": (2048, 784), "1.bias": (2048,), "3.weight": (2048, 2048), "3.bias": (2048,),
       "5.weight": (10, 2048), "5.bias": (10,)}


def test_exchanges_overlap_the_backward_pass_as_far_as_the_job_measured():
    # forward 10 ms, backward 20 ms shared by two equal variables; the last one is ready first
    costs = [Cost(0.0, 0.0, 0.005, "a"), Cost(0.0, 0.0, 0.005, "b")]
    full = simulate(costs, [1, 1], compute_s=0.03, overlap=1.0)
    assert full.ideal_s == pytest.approx(0.035)  # var 1 sent at 20 ms hides; var 0 at 30 ms
    assert full.serial_s == pytest.approx(0.04)
    assert full.step_s == pytest.approx(0.035)
    assert simulate(costs, [1, 1], 0.03, overlap=0.0).step_s == pytest.approx(0.04)
    assert simulate(costs, [1, 1], 0.03, overlap=0.5).step_s == pytest.approx(0.0375)


def test_bytes_on_the_link_overlap_as_measured_the_rest_as_the_cores_allow():
    """Over a slow link a compute loop hides an allreduce that is waiting on the link
    (``overlap``), but where the ranks' threads share too few cores (``cpu_overlap`` 0) it
    hides none of an exchange's CPU: latency, copies, reductions."""
    on_link = [Cost(0.0, 0.0, 0.005, "a", wire_s=0.005), Cost(0.0, 0.0, 0.005, "b", wire_s=0.005)]
    on_cpu = [Cost(0.0, 0.0, 0.005, "a"), Cost(0.0, 0.0, 0.005, "b")]
    half = [Cost(0.0, 0.0, 0.005, "a", wire_s=0.0025), Cost(0.0, 0.0, 0.005, "b", wire_s=0.0025)]
    # ideal 35 ms, serial 40 ms (test above)
    assert simulate(on_link, [1, 1], 0.03, 1.0, 0.0).step_s == pytest.approx(0.035)
    assert simulate(on_cpu, [1, 1], 0.03, 1.0, 0.0).step_s == pytest.approx(0.04)
    assert simulate(half, [1, 1], 0.03, 1.0, 0.0).step_s == pytest.approx(0.0375)
    assert simulate(on_cpu, [1, 1], 0.03, 0.0, 1.0).step_s == pytest.approx(0.035)
    # no cpu_overlap (files measured before it): ``overlap`` for all of it, as before
    for costs in (on_link, on_cpu, half):
        assert simulate(costs, [1, 1], 0.03, 0.5).step_s == pytest.approx(0.0375)


def test_the_wire_share_of_a_cost_is_its_payload_over_the_link():
    calib = Calibration.coerce(None)
    slow = Network(2, 12.5e6, 1e-4)                       # 100 Mbit/s
    dense = variable_cost(HOROVOD, (1000, 1000), "float32", calib, slow)
    assert dense.wire_s == pytest.approx(4e6 / 12.5e6)    # 2 ranks: 2 (N-1)/N x 4 MB
    assert dense.wire_s <= dense.latency_s + dense.transfer_s
    sparse = variable_cost(Pipeline.from_params(TOPK), (1000, 1000), "float32", calib, slow)
    assert sparse.wire_s == pytest.approx(80e3 / 12.5e6)  # 1% of the values and indices


def test_a_float16_sum_hides_as_much_as_the_job_measured_not_its_bytes_time():
    """Over 1 Gbit/s Horovod's fp16 allreduce takes its bytes' time, but its CPU sum takes the
    core from the backward pass: with ``fp16_overlap`` measured, compute hides that share of
    it (ResNet-18: predicted 273 ms from the bytes, measured 365-375 ms)."""
    link = Network(2, 1.25e8, 1e-4)
    fits = {("allreduce", "float16"): Fit(0.0, 8e-9), ("allreduce", "float32"): Fit(0.0, 8e-9)}
    bytes_only = Calibration(collectives=fits, overlap=0.9, cpu_overlap=0.0)
    measured = Calibration(collectives=fits, overlap=0.9, cpu_overlap=0.0, fp16_overlap=0.45)
    shape = (1000, 1000)
    before = variable_cost(HOROVOD_FP16, shape, "float32", bytes_only, link)
    after = variable_cost(HOROVOD_FP16, shape, "float32", measured, link)
    busy = 8e-9 * 2e6                                        # the fit at 2 MB, before the cast back
    assert before.wire_s == pytest.approx(2e6 / 1.25e8)     # the payload's bytes
    assert after.wire_s == pytest.approx(busy * 0.45 / 0.9)  # hides 0.45 of it, as measured
    # float32 sums are not touched, nor is a job that measured no fp16_overlap
    assert variable_cost(HOROVOD, shape, "float32", measured, link).wire_s == pytest.approx(
        variable_cost(HOROVOD, shape, "float32", bytes_only, link).wire_s)
    assert link_share_s(measured, "float32", 0.01, 0.02) == 0.01
    assert link_share_s(bytes_only, "float16", 0.01, 0.02) == 0.01
    assert link_share_s(measured, None, 0.01, 0.02) == 0.01
    # the grace fp16 pipeline's allreduce sums float16 the same way
    grace = variable_cost(Pipeline.from_params({"compressor": "fp16"}), shape, "float32",
                          measured, link)
    assert grace.wire_s == pytest.approx(busy * 0.5)
    # clipped to the exchange: a share above the fp32 overlap is all of it, below cpu_overlap none
    assert link_share_s(Calibration(overlap=0.5, cpu_overlap=0.1, fp16_overlap=0.9),
                        "float16", 0.01, 0.02) == pytest.approx(0.02)
    assert link_share_s(Calibration(overlap=0.5, cpu_overlap=0.2, fp16_overlap=0.1),
                        "float16", 0.01, 0.02) == 0.0
    # where overlap does not exceed cpu_overlap, the share cannot be told apart: bytes
    assert link_share_s(Calibration(overlap=0.3, cpu_overlap=0.3, fp16_overlap=0.1),
                        "float16", 0.01, 0.02) == 0.01
    # the step: a 4 MB fp16 gradient sent mid-backward hides less behind it, so it is slower
    variables = variables_of({"a": shape, "b": shape})
    slow = predict_step(variables, [HOROVOD_FP16] * 2, measured, link, compute_s=0.1)
    fast = predict_step(variables, [HOROVOD_FP16] * 2, bytes_only, link, compute_s=0.1)
    assert slow.step_s > fast.step_s


def test_the_overlap_size_is_the_largest_allreduce_of_its_dtype_measured_under_the_limit():
    fp16 = {"collective": "allreduce", "dtype": "float16",
            "points": {"4096": 0.001, "1048576": 0.009, "8388608": 0.07, "33554432": 0.2}}
    fp32 = {"collective": "allreduce", "dtype": "float32",
            "points": {"4096": 0.001, "33554432": 0.05}}
    gather = {"collective": "allgather", "dtype": "float32", "points": {"67108864": 0.05}}
    assert overlap_bytes([fp32, fp16, gather], "float16") == 8 << 20
    assert overlap_bytes([fp32, fp16, gather], "float16", most_s=0.5) == 32 << 20
    assert overlap_bytes([fp32, fp16, gather], "float32") == 32 << 20
    slow = {**fp16, "points": {"4096": 0.002, "1048576": 0.09}}
    assert overlap_bytes([slow], "float16") == 1 << 20
    assert overlap_bytes([{**fp16, "points": {"4096": 0.001}}], "float16") == 1 << 20  # >= 1 MB
    assert overlap_bytes([fp32], "float16") == 1 << 20


def test_encode_is_on_the_critical_path():
    costs = [Cost(0.0, 0.0, 0.005, "a"), Cost(0.004, 0.0, 0.005, "b")]
    step = simulate(costs, [1, 1], compute_s=0.03)
    # var 1's encode delays the rest of the backward pass: var 0 is ready at 34 ms
    assert step.main_s == pytest.approx(0.034) and step.step_s == pytest.approx(0.039)


def test_queued_exchanges_of_one_kind_fuse_into_one_latency():
    same = [Cost(0.0, 0.01, 0.001, "a")] * 3
    mixed = [Cost(0.0, 0.01, 0.001, k) for k in "abc"]
    assert simulate(same, [1, 1, 1]).step_s == pytest.approx(0.013)
    assert simulate(mixed, [1, 1, 1]).step_s == pytest.approx(0.033)


def test_later_rounds_run_after_the_backward_pass_half_fused_by_kind():
    """Two-phase's gather and PowerSGD's second round start in ``receive``, which the optimizer
    calls for all tensors in lockstep after the backward pass: no overlap with it; the later
    rounds fuse (half the latency once per kind), the first went per tensor (the other half
    each)."""
    deferred = [Cost(0.0, 0.01, 0.001, "a", deferred=True)] * 3
    step = simulate(deferred, [1, 1, 1], compute_s=0.03, overlap=1.0)
    assert step.step_s == pytest.approx(0.03 + 0.005 + 3 * (0.005 + 0.001))
    two_kinds = [*deferred[:2], Cost(0.0, 0.02, 0.001, "b", deferred=True)]
    assert simulate(two_kinds, [1, 1, 1], compute_s=0.03).step_s == \
        pytest.approx(0.03 + (0.005 + 0.01) + (0.005 + 0.005 + 0.01) + 3 * 0.001)
    # on the channel, the first starts during the backward pass (ready at 16.7 ms), the last
    # two queue behind it: 16.7 + 3 * 11 ms
    assert simulate([Cost(0.0, 0.01, 0.001, "a")] * 3, [1, 1, 1], 0.03).step_s == \
        pytest.approx(0.02 / 3 + 0.01 + 3 * 0.011)
    calib, network = Calibration(), Network(2, 1.25e8, 25e-6)
    twophase = Pipeline.from_params({"compressor": "signsgd", "memory": "residual",
                                     "communicator": "twophase"})
    powersgd = Pipeline.from_params({"compressor": "powersgd", "memory": "powersgd",
                                     "communicator": "allreduce"})
    assert variable_cost(twophase, (64,), "float32", calib, network).deferred
    assert variable_cost(powersgd, (512, 512), "float32", calib, network).deferred
    # a vector goes uncompressed in one round
    assert not variable_cost(powersgd, (512,), "float32", calib, network).deferred
    assert not variable_cost(Pipeline.from_params(TOPK), (512, 512), "float32", calib,
                             network).deferred


def test_tensors_powersgd_leaves_uncompressed_cost_the_plain_allreduce(tmp_path):
    """PowerSGD sends a vector (and a matrix too small to gain) as it is, one allreduce: it
    costs the measured ``none`` pipeline, not PowerSGD's two-round matrix exchange."""
    powersgd = {"compressor": "powersgd", "memory": "powersgd", "communicator": "allreduce",
                "compress_rank": 2}
    plain = {"compressor": "none", "memory": "none", "communicator": "allreduce"}
    calib = Calibration.load(_document(tmp_path, pipelines=[(powersgd, 1e-9, 1e-6),
                                                            (plain, 0.0, 1e-8)]))
    network = Network(2, 1.25e8, 25e-6)
    matrix = variable_cost(Pipeline.from_params(powersgd), (512, 512), "float32", calib,
                           network)
    assert matrix.kind == Pipeline.from_params(powersgd).label() and matrix.deferred
    assert matrix.transfer_s == pytest.approx(512 * 512 * 1e-6)
    for shape in ((2048,), (4, 3)):   # a vector; a matrix whose rank-2 factors are no smaller
        cost = variable_cost(Pipeline.from_params(powersgd), shape, "float32", calib, network)
        numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
        assert cost.kind == Pipeline.from_params(plain).label()
        assert not cost.deferred
        assert cost.latency_s + cost.transfer_s == pytest.approx(1e-4 + numel * 1e-8)


def test_two_phase_all_to_all_starts_at_send_and_only_the_gather_waits():
    """Half of a two-phase exchange (its all-to-all) goes on the channel when the tensor is
    encoded, alone, during the backward pass; only the gathers' half runs after it, fused."""
    calib, network = Calibration(), Network(2, 1.25e8, 25e-6)
    twophase = Pipeline.from_params({"compressor": "signsgd", "memory": "residual",
                                     "communicator": "twophase"})
    powersgd = Pipeline.from_params({"compressor": "powersgd", "memory": "powersgd",
                                     "communicator": "allreduce"})
    assert variable_cost(twophase, (64,), "float32", calib, network).early == 0.5
    assert variable_cost(powersgd, (512, 512), "float32", calib, network).early == 0.0
    early = [Cost(0.0, 0.01, 0.004, "a", deferred=True, early=0.5)] * 3
    # the all-to-alls: ready at 16.7, 23.3 and 30 ms (forward 10 ms, then the backward pass),
    # 7 ms each, one after another: the channel is free at 37.7 ms; then the gathers, fused:
    # their latency (the other half) once, and their transfers
    step = simulate(early, [1, 1, 1], compute_s=0.03, overlap=1.0)
    first = 0.01 + 0.02 / 3 + 3 * 0.007
    assert step.step_s == pytest.approx(first + 0.005 + 3 * 0.002)
    whole = [Cost(0.0, 0.01, 0.004, "a", deferred=True)] * 3
    assert simulate(whole, [1, 1, 1], compute_s=0.03, overlap=1.0).step_s == \
        pytest.approx(0.03 + 0.005 + 3 * (0.005 + 0.004))
    assert step.step_s < simulate(whole, [1, 1, 1], compute_s=0.03, overlap=1.0).step_s


def test_fit_latency_is_not_inflated_by_one_slow_small_call():
    fit = Fit.through({4096: 8e-3, 1 << 20: 3e-3, 8 << 20: 10e-3})
    assert fit.per_unit_s == pytest.approx(7e-3 / (7 << 20))
    assert fit.latency_s == pytest.approx(3e-3 - fit.per_unit_s * (1 << 20))
    with pytest.raises(ValueError, match="two or more sizes"):
        Fit.through({1: 1.0})


def test_no_call_costs_less_than_the_cheapest_measured():
    """A shaped link's sustained slope puts a 64-element batch-norm tensor at microseconds and
    the line's intercept clips to 0; every call measured took a millisecond or more."""
    fit = Fit.through({4096: 1.0e-3, 1 << 20: 6.4e-3, 8 << 20: 71e-3, 32 << 20: 291e-3})
    assert fit.latency_s == 0.0 and fit.floor_s == pytest.approx(1.0e-3)
    assert fit(256) == pytest.approx(1.0e-3)  # not 256 * 9 ns
    assert fit(32 << 20) == pytest.approx(fit.per_unit_s * (32 << 20))  # the line above it
    latency, transfer = fit.split(256)
    assert (latency, transfer) == (pytest.approx(1.0e-3), pytest.approx(0.0))
    latency, transfer = fit.split(32 << 20)
    assert latency + transfer == pytest.approx(fit(32 << 20)) and latency == fit.floor_s


def test_files_without_a_stored_floor_take_it_from_their_points(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({
        "format": FORMAT, "entries": [],
        "collectives": [{"collective": "allreduce", "dtype": "float32", "latency_s": 0.0,
                         "per_byte_s": 1e-8, "points": {"4096": 2e-3, "1048576": 9e-3}}],
        "pipelines": [{"pipeline": Pipeline.from_params(TOPK).label(),
                       "encode": {"latency_s": 0.0, "per_unit_s": 1e-9},
                       "exchange": {"latency_s": 0.0, "per_unit_s": 1e-9},
                       "points": {"1024": [4e-4, 5e-3], "262144": [1e-3, 6e-3]}}]}))
    calib = Calibration.load(path)
    assert calib.collective("allreduce", "float32").floor_s == pytest.approx(2e-3)
    encode, exchange = calib.pipelines[Pipeline.from_params(TOPK).label()]
    assert (encode.floor_s, exchange.floor_s) == (pytest.approx(4e-4), pytest.approx(5e-3))



def test_fit_follows_the_measured_points_between_sizes():
    """topk's exchange in the 10 Gbit/s job: cheap at 262K elements, 7.5 ms at 2.1M, 9.9 ms at
    8.4M. The line of the two largest points, under every point, put the MLP's 5.8M-element
    bucket at 3.8 ms; the points say 8.9 ms."""
    points = {1024: 2.34e-3, 262144: 1.63e-3, 2096704: 7.5e-3, 8386816: 9.89e-3}
    fit = Fit.through(points)
    line = fit.latency_s + fit.per_unit_s * 5824522
    assert line < 4e-3
    assert fit(5824522) == pytest.approx(7.5e-3 + 2.39e-3 * (5824522 - 2096704) / 6290112)
    assert fit(1024) == pytest.approx(1.63e-3)  # no dearer than a larger call measured
    assert fit(8386816) == pytest.approx(9.89e-3)
    assert fit(2 * 8386816) == pytest.approx(9.89e-3 + fit.per_unit_s * 8386816)  # last slope
    latency, transfer = fit.split(5824522)
    assert latency == pytest.approx(1.63e-3) and latency + transfer == pytest.approx(
        fit(5824522))


def test_fit_keeps_the_sustained_rate_where_a_burst_was_measured():
    """A 100 Mbit/s token bucket lets a lone small call through at burst speed; a step's many
    calls drain the bucket, so between points the cost is at least the sustained line."""
    fit = Fit.through({1024: 2.78e-3, 262144: 4.34e-3, 2096704: 47.55e-3, 8386816: 369e-3})
    assert fit(262144) == pytest.approx(fit.per_unit_s * 262144) and fit(262144) > 10e-3
    assert fit(8386816) >= 369e-3  # the line: its intercept clips at 0


def test_measurement_files_are_read_through_their_points(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({
        "format": FORMAT, "entries": [],
        "collectives": [{"collective": "allreduce", "dtype": "float32", "latency_s": 0.0,
                         "per_byte_s": 1e-9, "floor_s": 1e-3,
                         "points": {"4096": 1e-3, "1048576": 9e-3, "8388608": 12e-3}}],
        "pipelines": [{"pipeline": Pipeline.from_params(TOPK).label(),
                       "encode": {"latency_s": 0.0, "per_unit_s": 1e-9, "floor_s": 1e-4},
                       "exchange": {"latency_s": 0.0, "per_unit_s": 1e-9, "floor_s": 1e-3},
                       "points": {"1024": [1e-4, 1e-3], "262144": [2e-3, 6e-3],
                                  "2096704": [4e-3, 7e-3]}}]}))
    calib = Calibration.load(path)
    assert calib.collective("allreduce", "float32")(1 << 21) == pytest.approx(
        9e-3 + 3e-3 * (1 << 20) / (7 << 20))
    encode, exchange = calib.pipelines[Pipeline.from_params(TOPK).label()]
    assert encode(131584) == pytest.approx(1e-4 + 1.9e-3 / 2)  # halfway between two points
    assert exchange(131584) == pytest.approx(1e-3 + 5e-3 / 2)


def test_large_gradients_are_priced_in_the_pieces_the_optimizer_sends():
    """``DistributedOptimizer`` sends a gradient over ``piece_bytes`` as even pieces when its
    compressor takes any chunk alone (two-phase signsgd here), each with its own encode and
    exchange; sparsifiers keep their tensors whole, and a strategy's dispatcher sends whole."""
    twophase = Pipeline.from_params({"compressor": "signsgd", "memory": "residual",
                                     "communicator": "twophase"})
    topk = Pipeline.from_params(TOPK)
    calib = Calibration(pipelines={p.label(): (Fit(1e-4, 2e-9), Fit(3e-3, 5e-9))
                                   for p in (twophase, topk)}, workers=2)
    network = Network(2, 1.25e9, 25e-6)
    whole = variable_cost(twophase, (2048, 2048), "float32", calib, network)
    cut = variable_cost(twophase, (2048, 2048), "float32", calib, network, piece_bytes=4 << 20)
    assert (whole.pieces, cut.pieces) == (1, 4)
    assert cut.encode_s == pytest.approx(1e-4 + 2e-9 * (1 << 20))
    assert cut.total_s == pytest.approx(4 * (1e-4 + 2e-9 * (1 << 20) + 3e-3 + 5e-9 * (1 << 20)))
    assert variable_cost(topk, (2048, 2048), "float32", calib, network,
                         piece_bytes=4 << 20).pieces == 1
    assert variable_cost(twophase, (1024, 1024), "float32", calib, network,
                         piece_bytes=4 << 20).pieces == 1  # no larger than one piece
    big = variables_of({"w": (2048, 2048)})
    quarters = variables_of({f"w{i}": (1 << 20,) for i in range(4)})
    pieced = predict_step(big, [twophase], calib, network, compute_s=0.03, piece_bytes=4 << 20)
    assert pieced.step_s == pytest.approx(
        predict_step(quarters, [twophase] * 4, calib, network, compute_s=0.03).step_s)
    # pieces overlap one another's encode and exchange where the job overlaps (a GPU, spare
    # cores); where it does not (2 ranks on 2 cores: overlap 0) they only add latencies
    assert pieced.step_s < predict_step(big, [twophase], calib, network, compute_s=0.03).step_s
    calib.overlap = 0.0
    assert predict_step(big, [twophase], calib, network, compute_s=0.03,
                        piece_bytes=4 << 20).step_s > \
        predict_step(big, [twophase], calib, network, compute_s=0.03).step_s
    # where the job timed the pipeline in pieces of that size, that is its cost, whole
    calib.pieced[twophase.label()] = (4 << 20, (Fit(2e-4, 3e-9), Fit(1e-3, 2e-9)))
    timed = variable_cost(twophase, (2048, 2048), "float32", calib, network,
                          piece_bytes=4 << 20)
    assert timed.pieces == 1 and timed.encode_s == pytest.approx(2e-4 + 3e-9 * (4 << 20))
    assert timed.latency_s + timed.transfer_s == pytest.approx(1e-3 + 2e-9 * (4 << 20))
    assert variable_cost(twophase, (2048, 2048), "float32", calib, network,
                         piece_bytes=2 << 20).pieces == 8  # other pieces: not what was timed

BATCH_NORM = {**{f"bn{i}.{p}": (64,) for i in range(40) for p in ("weight", "bias")},
              "conv.weight": (512, 512, 3, 3)}


def test_many_small_tensors_pay_per_call_unless_fused(tmp_path):
    """ResNet-18's 40 batch-norm tensors: Horovod's allreduces of them fuse (one floor), a
    pipeline whose every call costs 5 ms (two-phase: two collectives, two cycles) is not taken
    for them although its line says it moves their bytes for free."""
    twophase = {"compressor": "signsgd", "memory": "residual", "communicator": "twophase"}
    path = tmp_path / "m.json"
    path.write_text(json.dumps({
        "format": FORMAT, "entries": [], "job": {"workers": 2, "overlap": 1.0},
        "collectives": [{"collective": "allreduce", "dtype": "float32", "latency_s": 0.0,
                         "per_byte_s": 8e-9, "floor_s": 1e-3}],
        "pipelines": [{"pipeline": Pipeline.from_params(p).label(),
                       "encode": {"latency_s": 0.0, "per_unit_s": e, "floor_s": ef},
                       "exchange": {"latency_s": 0.0, "per_unit_s": x, "floor_s": xf}}
                      for p, e, ef, x, xf in [({"compressor": "none"}, 0.0, 1e-4, 3.4e-8, 1e-3),
                                              (twophase, 5e-9, 5e-4, 9e-9, 5e-3)]]}))
    small = variables_of({k: v for k, v in BATCH_NORM.items() if k.startswith("bn")})
    network = Network(2, 1.25e8, 25e-6)
    fused = predict_step(small, [HOROVOD] * len(small), path, network)
    assert fused.step_s == pytest.approx(1e-3, rel=0.2)  # one floor for the batch, not 80
    two = predict_step(small, [Pipeline.from_params(twophase)] * len(small), path, network,
                       compute_s=0.2)
    assert two.serial_s > 0.2 + 80 * 5e-4  # every encode's floor is on the training thread
    builder = Auto([{"compressor": "none"}, twophase], throughput=path, compute_s=0.2,
                   bucket_bytes=None)
    strategy = builder.build(BATCH_NORM, ResourceSpec.local(2, bandwidth_gbps=0.1))
    chosen = {n.var_name: Pipeline.from_node(n).communicator for n in strategy.node_config}
    assert chosen["conv.weight"] == "twophase"
    assert {c for k, c in chosen.items() if k.startswith("bn")} == {"allreduce"}
    assert not any(n.AllReduceSynchronizer.bucket for n in strategy.node_config)
    # in a bucket the 80 vectors pay one encode and one exchange: two-phase for all, faster
    in_buckets = Auto([{"compressor": "none"}, twophase], throughput=path, compute_s=0.2)
    strategy = in_buckets.build(BATCH_NORM, ResourceSpec.local(2, bandwidth_gbps=0.1))
    assert {Pipeline.from_node(n).communicator for n in strategy.node_config} == {"twophase"}
    assert all(n.AllReduceSynchronizer.bucket for n in strategy.node_config)
    assert in_buckets.prediction.step_s < builder.prediction.step_s


def _document(tmp_path, collectives=(), pipelines=(), overlap=1.0, name="m.json"):
    path = tmp_path / name
    path.write_text(json.dumps({
        "format": FORMAT, "entries": [], "job": {"workers": 2, "overlap": overlap},
        "collectives": [{"collective": c, "dtype": d, "latency_s": a, "per_byte_s": b}
                        for c, d, a, b in collectives],
        "pipelines": [{"pipeline": Pipeline.from_params(p).label(),
                       "encode": {"latency_s": 0.0, "per_unit_s": e},
                       "exchange": {"latency_s": 1e-4, "per_unit_s": x}}
                      for p, e, x in pipelines]}))
    return path


def test_auto_does_not_pick_fp16_when_the_job_measured_its_sum_slow(tmp_path):
    """The 10 Gbit/s failure: fp16 halves the bytes, but this job's CPU sums fp16 5x slower
    per byte than fp32; measured, Horovod's own fp32 allreduce wins."""
    slow_fp16 = [("allreduce", "float32", 1e-3, 1e-9), ("allreduce", "float16", 1e-3, 5e-9)]
    spec = ResourceSpec.local(2, bandwidth_gbps=10)
    builder = Auto([{"compressor": "none"}, {"compressor": "fp16"}],
                   throughput=_document(tmp_path, slow_fp16))
    strategy = builder.build(MLP, spec)
    assert horovod_path(strategy)
    assert strategy.predicted_step_s == builder.baseline.step_s
    # with a fast fp16 sum the same builder compresses
    fast = [("allreduce", "float32", 1e-3, 1e-9), ("allreduce", "float16", 1e-3, 0.25e-9)]
    strategy = Auto([{"compressor": "none"}, {"compressor": "fp16"}],
                    throughput=_document(tmp_path, fast, name="fast.json")).build(MLP, spec)
    assert {Pipeline.from_node(n).compressor for n in strategy.node_config} == {"fp16"}


def test_auto_takes_measured_pipelines_and_never_one_predicted_to_lose(tmp_path):
    base = [("allreduce", "float32", 1e-3, 1e-9)]  # 23 MB: ~24 ms
    spec = ResourceSpec.local(2, bandwidth_gbps=10)
    cheap = _document(tmp_path, base, [(TOPK, 1e-9, 1e-9), (RANDOMK, 1e-10, 1e-10)])
    builder = Auto([{"compressor": "none"}, TOPK, RANDOMK], throughput=cheap)
    chosen = {Pipeline.from_node(n).compressor for n in builder.build(MLP, spec).node_config}
    assert "randomk" in chosen and "topk" not in chosen
    # topk measured only ~5% faster than Horovod's allreduce: within the margin, not taken
    close = _document(tmp_path, base, [(TOPK, 0.0, 3.9e-9)], name="close.json")
    builder = Auto([{"compressor": "none"}, TOPK], throughput=close, margin=0.1)
    assert horovod_path(builder.build(MLP, spec))
    assert builder.prediction is builder.baseline
    assert not horovod_path(Auto([{"compressor": "none"}, TOPK], throughput=close,
                                 margin=0.0).build(MLP, spec))


def test_predict_step_covers_horovods_own_paths(tmp_path):
    calib = Calibration.load(_document(tmp_path, [("allreduce", "float32", 1e-3, 1e-9),
                                                  ("allreduce", "float16", 1e-3, 4e-9)]))
    variables = variables_of(MLP)
    numel = sum(v.numel for v in variables)
    network = Network(2, 1.25e9, 25e-6)
    none = predict_step(variables, [HOROVOD] * 6, calib, network)
    half = predict_step(variables, [HOROVOD_FP16] * 6, calib, network)
    assert none.step_s == pytest.approx(1e-3 + 4e-9 * numel)  # all ready at once: one fusion
    assert half.step_s > none.step_s  # 2 bytes at 4 ns each, plus the casts


@pytest.mark.parametrize("job, match", [({"overlap": 2}, "overlap must be a number in"),
                                        ({"overlap": "x"}, "overlap must be a number in"),
                                        ({"cpu_overlap": -1}, "cpu_overlap must be a number"),
                                        ({"fp16_overlap": 1.5}, "fp16_overlap must be a num")])
def test_bad_measurement_files_name_the_problem(tmp_path, job, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": FORMAT, "entries": [], "job": job}))
    with pytest.raises(ValueError, match=match):
        Calibration.load(path)
    path.write_text(json.dumps({"format": FORMAT, "entries": [], "collectives": [{"x": 1}]}))
    with pytest.raises(ValueError, match="bad.json.*malformed"):
        Calibration.load(path)
    with pytest.raises(ValueError, match="does not exist"):
        Calibration.load(tmp_path / "missing.json")


def test_bad_auto_arguments_are_rejected_at_construction():
    with pytest.raises(ValueError, match="margin"):
        Auto(margin=-0.1)
    with pytest.raises(ValueError, match="compute_s"):
        Auto(compute_s=-1)


def test_auto_chooses_for_a_160_tensor_model():
    """Choosing is a handful of simulated steps, not a search; the time is printed, not
    asserted."""
    named = [(f"layer{i}.{'weight' if i % 2 == 0 else 'bias'}",
              torch.nn.Parameter(torch.zeros((256, 256 + i) if i % 2 == 0 else (256,))))
             for i in range(160)]
    builder = Auto(compute_s=0.2)
    start = time.perf_counter()
    strategy = builder.build(named, ResourceSpec.local(2, bandwidth_gbps=1))
    elapsed = time.perf_counter() - start
    print(f"Auto chose pipelines for 160 tensors in {elapsed * 1e3:.1f} ms")
    assert [n.var_name for n in strategy.node_config] == [n for n, _ in named]
    assert len(builder.report) == 160 and strategy.predicted_step_s > 0


def test_measure_under_horovodrun_times_the_job(tmp_path):
    """``grace-dl strategy measure`` on 2 real ranks adds the job's collectives, overlap and
    pipelines to the compression file, and Auto builds from it; a pipeline the optimizer sends
    in pieces is also timed that way above one piece."""
    out = tmp_path / "job.json"
    twophase = {"compressor": "signsgd", "memory": "residual", "communicator": "twophase"}
    candidates = json.dumps([{"compressor": "none"}, TOPK, twophase])
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
           sys.executable, "-m", "grace_dl", "strategy", "measure", "--candidates", candidates,
           "--sizes", "256,8192", "--repeats", "1", "--mbit", "1000", "-o", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["job"]["workers"] == 2 and doc["job"]["mbit"] == 1000
    assert 0.0 <= doc["job"]["overlap"] <= 1.0 and 0.0 <= doc["job"]["cpu_overlap"] <= 1.0
    assert Calibration.load(out).cpu_overlap == doc["job"]["cpu_overlap"]
    assert 0.0 <= doc["job"]["fp16_overlap"] <= 1.0
    assert Calibration.load(out).fp16_overlap == doc["job"]["fp16_overlap"]
    parts = doc["job"]["seconds_by_part"]
    assert set(parts) == {"collectives", "overlap", "fp16_overlap", "cpu_overlap", "pipelines"}
    assert sum(parts.values()) == pytest.approx(doc["job"]["seconds"], abs=0.05)
    assert {(c["collective"], c["dtype"]) for c in doc["collectives"]} == {
        ("allreduce", "float32"), ("allreduce", "float16"), ("allgather", "float32"),
        ("alltoall", "float32"), ("broadcast", "float32")}
    for c in doc["collectives"]:
        assert c["latency_s"] >= 0 and c["per_byte_s"] >= 0 and len(c["points"]) >= 2
    labels = [p["pipeline"] for p in doc["pipelines"]]
    assert labels == [Pipeline().label(), Pipeline.from_params(TOPK).label(),
                      Pipeline.from_params(twophase).label()]
    assert [bool(p.get("pieces")) for p in doc["pipelines"]] == [False, False, True]
    pieces = doc["pipelines"][2]["pieces"]
    whole = doc["pipelines"][2]["points"]
    assert pieces["piece_bytes"] == 4 << 20
    large = [n for n in pieces["points"] if int(n) * 4 > 4 << 20]
    assert large and all(n in whole for n in pieces["points"])
    assert {n: v for n, v in pieces["points"].items() if n not in large} == \
        {n: v for n, v in whole.items() if int(n) * 4 <= 4 << 20}
    calib = Calibration.load(out)
    assert calib.pieced[Pipeline.from_params(twophase).label()][0] == 4 << 20
    assert calib.workers == 2 and calib.collective("allreduce", "float16") is not None
    strategy = Auto([{"compressor": "none"}, TOPK], throughput=out).build(
        MLP, ResourceSpec.local(2, bandwidth_gbps=1))
    assert strategy.predicted_step_s > 0
