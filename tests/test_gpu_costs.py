"""Auto on a GPU prices compression with the GPU's measured costs: the shipped throughput file
is the conversion of the committed GPU compressor table, a job on "cuda" gets it instead of the
CPU's (the pessimistic default, or a file measured on host tensors), and it is far cheaper."""

import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks import gpu_costs
from grace_dl.strategy import Auto, Pipeline, ResourceSpec
from grace_dl.strategy.cost_model import (
    DEFAULT,
    FORMAT,
    GPU_THROUGHPUT,
    Throughput,
    device_kind,
    for_device,
)
from grace_dl.strategy.step_model import Calibration, calibration_for

BIG = {**{f"l{i}.weight": (4096, 4096) for i in range(4)},
       **{f"l{i}.bias": (4096,) for i in range(4)}}


def test_the_shipped_file_is_the_conversion_of_the_committed_gpu_table():
    assert GPU_THROUGHPUT.read_text() == gpu_costs.render(), \
        "run: python -m benchmarks.gpu_costs --write"
    assert gpu_costs.main(["--check"]) == 0
    doc = json.loads(GPU_THROUGHPUT.read_text())
    assert doc["format"] == FORMAT and doc["device"].startswith("cuda (NVIDIA")
    names = {e["compressor"] for e in doc["entries"]}
    assert {"fp16", "topk", "randomk", "qsgd", "signsgd", "powersgd"} <= names
    assert "none" not in names      # free, as the cost model has it


@pytest.mark.parametrize("device, kind", [
    ("cuda", "cuda"), ("cuda:1", "cuda"), (torch.device("cuda", 0), "cuda"), ("gpu", "cuda"),
    ("/job:localhost/replica:0/task:0/device:GPU:0", "cuda"), ("cpu", "cpu"),
    (torch.device("cpu"), "cpu"), ("meta", "cpu"), (None, "cpu")])
def test_device_kind(device, kind):
    assert device_kind(device) == kind


def test_cuda_gets_the_gpu_costs_and_cpu_keeps_the_default():
    gpu, cpu = calibration_for("cuda"), calibration_for("cpu")
    assert gpu.throughput.on_gpu and gpu.throughput.source == str(GPU_THROUGHPUT)
    assert not cpu.throughput.on_gpu and cpu.throughput.entries == []
    assert for_device("cuda").entries and for_device("cpu").entries == []
    # the expected direction: a GPU compresses a large tensor far faster than the CPU default
    for name, *_ in gpu.throughput.entries:
        for n in (1 << 20, 1 << 24):
            on_gpu = sum(f(n) for f in gpu.throughput.costs(name, {}))
            on_cpu = sum(f(n) for f in cpu.throughput.costs(name, {}))
            assert on_cpu == 2 * DEFAULT(n)
            assert on_gpu < on_cpu / 2, (name, n, on_gpu, on_cpu)
    topk_gpu, _ = gpu.throughput.costs("topk", {"compress_ratio": 0.1})   # any parameters
    assert topk_gpu(1 << 24) < 1e-3 < DEFAULT(1 << 24)


def test_a_file_measured_on_host_tensors_gives_way_to_the_gpus_on_cuda():
    host = {"format": FORMAT, "device": "cpu (x86_64)",
            "entries": [{"compressor": "topk", "params": {},
                         "compress": {"overhead_s": 1e-4, "per_element_s": 5e-9},
                         "decompress": {"overhead_s": 1e-5, "per_element_s": 1e-9}}],
            "job": {"workers": 2, "overlap": 0.5},
            "collectives": [{"collective": "allreduce", "dtype": "float32",
                             "latency_s": 1e-3, "per_byte_s": 1e-9}],
            "pipelines": [{"pipeline": "topk+residual+allgather",
                           "encode": {"latency_s": 0.0, "per_unit_s": 1e-9},
                           "exchange": {"latency_s": 0.0, "per_unit_s": 1e-9}}]}
    measured = Calibration.from_document(host)
    assert calibration_for("cpu", measured) is measured
    on_gpu = calibration_for("cuda", measured)
    assert on_gpu.throughput.on_gpu and on_gpu.pipelines == {}
    assert on_gpu.collectives == measured.collectives and on_gpu.overlap == 0.5
    gpu_file = Calibration(Throughput.from_document({**host, "device": "cuda (A100)"}))
    assert calibration_for("cuda", gpu_file) is gpu_file


def test_auto_on_a_gpu_compresses_where_the_cpu_costs_said_not_to():
    spec = ResourceSpec.local(8, bandwidth_gbps=25)
    on_cpu, on_gpu = Auto(compute_s=0.05), Auto(compute_s=0.05, device="cuda")
    cpu_strategy, gpu_strategy = on_cpu.build(BIG, spec), on_gpu.build(BIG, spec)
    assert (on_cpu.device, on_gpu.device) == ("cpu", "cuda")
    assert {Pipeline.from_node(n).compressor for n in cpu_strategy.node_config} == {"none"}
    assert "powersgd" in {Pipeline.from_node(n).compressor for n in gpu_strategy.node_config}
    assert on_gpu.prediction.step_s < on_gpu.baseline.step_s == on_cpu.baseline.step_s
    # each big variable's topk encode: the GPU's cost, far under the CPU default's
    (_, cpu_row), (_, gpu_row) = on_cpu.report[0], on_gpu.report[0]
    topk = [i for i, (p, _) in enumerate(cpu_row) if p.compressor == "topk"][0]
    assert gpu_row[topk][1].encode_s < cpu_row[topk][1].encode_s / 10


def test_auto_reads_the_device_from_the_parameters():
    def params(device):    # stand-ins for torch parameters on a device (no GPU needed)
        return ((name, SimpleNamespace(shape=shape, dtype=torch.float32, device=device))
                for name, shape in BIG.items())

    spec = ResourceSpec.local(8, bandwidth_gbps=25)
    auto = Auto(compute_s=0.05)
    strategy = auto.build(params(torch.device("cuda", 0)), spec)   # a generator, read twice
    assert auto.device == "cuda" and len(strategy.node_config) == len(BIG)
    auto.build(params(torch.device("cpu")), spec)
    assert auto.device == "cpu"
    auto.build(torch.nn.Linear(4, 4).named_parameters(), spec)
    assert auto.device == "cpu"
    pinned = Auto(compute_s=0.05, device="cpu")
    pinned.build(params(torch.device("cuda", 0)), spec)
    assert pinned.device == "cpu"


def test_the_cli_builds_for_a_gpu_with_device_cuda(tmp_path, capsys):
    from grace_dl.strategy.cli import main

    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({k: list(v) for k, v in BIG.items()}))
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes:\n  - {address: a, slots: 8, network_bandwidth: 25}\n")
    picked = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.pbtxt"
        assert main(["build", "--variables", str(shapes), "--builder", "auto", "--device",
                     device, "--resource-spec", str(spec), "-o", str(out)]) == 0
        picked[device] = out.read_text().count('name: "powersgd"')
    capsys.readouterr()
    assert picked["cpu"] == 0 < picked["cuda"]
