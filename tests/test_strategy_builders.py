"""Strategy builders on a model with conv, linear, bias and embedding parameters, the resource
spec, and the ``Auto`` cost model."""

import json

import pytest
import torch

from grace_dl.strategy import (
    PS,
    AllReduce,
    Auto,
    ResourceSpec,
    SizeThreshold,
    Uniform,
    from_strategy,
)
from grace_dl.strategy.builders import horovod_path
from grace_dl.strategy.cost_model import Network, Throughput, communication_time, predict
from grace_dl.strategy.pipeline import Pipeline
from grace_dl.strategy.variables import variables_of

TOPK = {"compressor": "topk", "compress_ratio": 0.01, "memory": "residual",
        "communicator": "allgather"}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5000, 64)          # 320000, 2-D
        self.conv = torch.nn.Conv2d(3, 16, 3)            # 432 weight (4-D), 16 bias
        self.fc = torch.nn.Linear(64, 10)                # 640 weight, 10 bias
        self.head = torch.nn.Linear(2048, 1024)          # 2097152 weight, 1024 bias


def _table(strategy):
    """{var: (compressor, memory, communicator, group, shape)}"""
    out = {}
    for node in strategy.node_config:
        p = Pipeline.from_node(node)
        group = node.AllReduceSynchronizer.group \
            if node.WhichOneof("synchronizer") == "AllReduceSynchronizer" else None
        out[node.var_name] = (p.compressor, p.memory, p.communicator, group, tuple(node.shape))
    return out


def test_builders_table():
    params = list(Net().named_parameters())
    shapes = {n: tuple(p.shape) for n, p in params}

    # (var) -> expected (compressor, memory, communicator, group) per builder
    expected = {
        "AllReduce(chunk=2, fp16)": {
            "emb.weight": ("fp16", "none", "allreduce", 0),
            "conv.weight": ("fp16", "none", "allreduce", 0),
            "conv.bias": ("fp16", "none", "allreduce", 1),
            "fc.weight": ("fp16", "none", "allreduce", 1),
            "fc.bias": ("fp16", "none", "allreduce", 2),
            "head.weight": ("fp16", "none", "allreduce", 2),
            "head.bias": ("fp16", "none", "allreduce", 3)},
        "Uniform(topk)": {n: ("topk", "residual", "allgather", i)
                          for i, n in enumerate(shapes)},
        "SizeThreshold(500, topk, chunk=2)": {
            "emb.weight": ("topk", "residual", "allgather", 0),
            "conv.weight": ("none", "none", "allreduce", 1),      # 432 < 500
            "conv.bias": ("none", "none", "allreduce", 1),        # 1-D
            "fc.weight": ("topk", "residual", "allgather", 0),
            "fc.bias": ("none", "none", "allreduce", 2),
            "head.weight": ("topk", "residual", "allgather", 3),
            "head.bias": ("none", "none", "allreduce", 2)},
    }
    built = {
        "AllReduce(chunk=2, fp16)": AllReduce(chunk_size=2, compressor="fp16").build(params),
        "Uniform(topk)": Uniform(TOPK).build(params),
        "SizeThreshold(500, topk, chunk=2)": SizeThreshold(500, TOPK, chunk_size=2).build(params),
    }
    for key, strategy in built.items():
        table = _table(strategy)
        assert list(table) == list(shapes), key  # one node per parameter, in order
        assert {n: v[:4] for n, v in table.items()} == expected[key], key
        assert all(table[n][4] == shapes[n] for n in shapes), key
        assert strategy.version == 1 and strategy.id


def test_allreduce_is_autodist_grouping_and_legacy_names():
    shapes = {f"v{i}": (4, 4) for i in range(300)}
    s = AllReduce().build(shapes)  # chunk_size=128
    assert [n.AllReduceSynchronizer.group for n in s.node_config] == [i // 128 for i in range(300)]
    p = Pipeline.from_node(AllReduce(compressor="HorovodCompressorEF").build(shapes).node_config[0])
    assert (p.compressor, p.memory) == ("fp16", "residual")
    s = AllReduce(spec="RING").build(shapes)
    assert {n.AllReduceSynchronizer.spec for n in s.node_config} == {2}


def test_ps_builder_and_resource_replicas():
    spec = ResourceSpec.from_dict({"nodes": [{"address": "a", "gpus": [0, 1], "chief": True},
                                             {"address": "b", "slots": 2}]})
    s = PS(reduction_destination=1).build({"w": (3, 3), "b": (3,)}, spec)
    assert list(s.graph_config.replicas) == ["a:GPU:0", "a:GPU:1", "b:CPU:0", "b:CPU:1"]
    for node in s.node_config:
        assert node.WhichOneof("synchronizer") == "PSSynchronizer"
        assert node.PSSynchronizer.reduction_destination == "1" and node.PSSynchronizer.sync
        assert Pipeline.from_node(node).communicator == "ps"
    with pytest.raises(ValueError, match="reduction_destination 7"):
        PS(reduction_destination=7).build({"w": (3,)}, spec)


def test_tf_variable_names_follow_the_tape():
    tf = pytest.importorskip("tensorflow")
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d1"),
                              keras.layers.Dense(2, name="d2")])
    names = [v.name for v in variables_of(model.trainable_variables)]
    assert names == [v.path for v in model.trainable_variables]
    plain = [tf.Variable(tf.zeros([2]), name="w"), tf.Variable(tf.zeros([3]), name="w")]
    got = variables_of(plain)
    assert [(v.name, v.shape) for v in got] == [("w", (2,)), ("w_1", (3,))]


def test_bad_builder_inputs_name_the_value():
    with pytest.raises(ValueError, match="unknown compressor 'nope'.*accepted"):
        Uniform({"compressor": "nope"})
    with pytest.raises(ValueError, match="cannot carry compressor 'topk'"):
        Uniform({"compressor": "topk"}).build({"w": (10,)})  # topk over allreduce
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['ratio'\]"):
        Uniform({"compressor": "topk", "ratio": 0.1})
    with pytest.raises(ValueError, match="compress_ratio"):
        Uniform({**TOPK, "compress_ratio": 2.0}).build({"w": (10,)})
    with pytest.raises(ValueError, match="chunk_size"):
        AllReduce(chunk_size=0)
    with pytest.raises(ValueError, match="spec must be one of"):
        AllReduce(spec="FAST")
    with pytest.raises(ValueError, match="appears twice"):
        Uniform({}).build([("a", (1,)), ("a", (2,))])
    with pytest.raises(ValueError, match="no variables"):
        Uniform({}).build({})


# ------------------------------------------------------------------ resource spec
def test_resource_spec_yaml(tmp_path):
    (tmp_path / "tp.json").write_text(json.dumps({"format": "grace_dl.compression_throughput/1",
                                                  "entries": []}))
    path = tmp_path / "cluster.yaml"
    path.write_text("""
nodes:
  - address: 10.0.0.1
    gpus: [0, 1, 2, 3]
    chief: true
    network_bandwidth: 100
  - address: 10.0.0.2
    gpus: [0, 1]
    network_bandwidth: 25
    cpus: [0]
network_latency_us: 40
compression_throughput: tp.json
""")
    spec = ResourceSpec.from_yaml(path)
    assert spec.workers == 6
    assert spec.bandwidth_bytes_per_s == 25e9 / 8
    assert spec.latency_s == pytest.approx(40e-6)
    assert spec.chief.address == "10.0.0.1"
    assert spec.throughput_path == str(tmp_path / "tp.json")
    assert len(spec.replicas()) == 6
    s = Uniform({}).build({"w": (2,)}, str(path))
    assert len(s.graph_config.replicas) == 6


@pytest.mark.parametrize("data, match", [
    ({"nodes": []}, "non-empty list"),
    ({"nodes": [{"gpus": [0]}]}, "needs an 'address'"),
    ({"nodes": [{"address": "a", "gpu": [0]}]}, r"unknown key\(s\) \['gpu'\]"),
    ({"nodes": [{"address": "a", "chief": True}, {"address": "b", "chief": True}]}, "2 chiefs"),
    ({"nodes": [{"address": "a"}, {"address": "a"}]}, "more than once"),
    ({"nodes": [{"address": "a", "network_bandwidth": 0}]}, "network_bandwidth"),
    ({"nodes": [{"address": "a"}], "latency": 3}, r"unknown resource spec key\(s\)"),
])
def test_resource_spec_rejects(data, match):
    with pytest.raises(ValueError, match=match):
        ResourceSpec.from_dict(data)


# ------------------------------------------------------------------ Auto and its cost model
SHAPES = {"big.weight": (4096, 1024), "mid.weight": (256, 256), "small.weight": (8, 8),
          "big.bias": (1024,)}


CANDIDATES = ({"compressor": "none"}, {"compressor": "fp16"}, TOPK)


def _chosen(strategy):
    return {n.var_name: Pipeline.from_node(n).compressor for n in strategy.node_config}


def test_auto_picks_none_everywhere_at_very_high_bandwidth():
    spec = ResourceSpec.local(8, bandwidth_gbps=1e6, latency_us=25)
    strategy = Auto().build(SHAPES, spec)
    assert set(_chosen(strategy).values()) == {"none"}
    assert horovod_path(strategy)  # run as grace=None, as predicted


def test_auto_compresses_large_tensors_at_low_bandwidth():
    spec = ResourceSpec.local(8, bandwidth_gbps=1.0)
    builder = Auto(candidates=CANDIDATES)
    strategy = builder.build(SHAPES, spec)
    chosen = _chosen(strategy)
    assert chosen["big.weight"] == "topk" and chosen["mid.weight"] != "none"
    assert chosen["small.weight"] == "none"  # 64 elements: the per-call cost dominates
    assert chosen["big.bias"] == "none"
    assert not horovod_path(strategy)
    # The pick is predicted faster than no compression (run as Horovod's own allreduce) by
    # the margin, and the strategy carries its prediction.
    assert builder.prediction.step_s * (1 + builder.margin) < builder.baseline.step_s
    assert strategy.predicted_step_s == builder.prediction.step_s
    for node, (var, costs) in zip(strategy.node_config, builder.report):
        assert var.name == node.var_name and [p for p, _ in costs] == builder.candidates


def test_auto_uses_measured_throughput(tmp_path):
    """A measured, very slow topk makes Auto fall back to fp16 for the large tensor."""
    spec = ResourceSpec.local(8, bandwidth_gbps=1.0)
    assert _chosen(Auto(CANDIDATES).build(SHAPES, spec))["big.weight"] == "topk"
    path = tmp_path / "tp.json"
    path.write_text(json.dumps({"format": "grace_dl.compression_throughput/1", "entries": [
        {"compressor": "topk", "params": {"compress_ratio": 0.01},
         "compress": {"overhead_s": 1.0, "per_element_s": 0.0},
         "decompress": {"overhead_s": 0.0, "per_element_s": 0.0}}]}))
    assert _chosen(Auto(CANDIDATES, throughput=str(path)).build(SHAPES, spec))["big.weight"] \
        == "fp16"
    with pytest.raises(ValueError, match="must have \"format\""):
        Throughput.load(_write(tmp_path, "{}"))


def _write(tmp_path, text):
    p = tmp_path / "bad.json"
    p.write_text(text)
    return p


def test_cost_model_formulas():
    net = Network(workers=4, bandwidth=1e9, latency=1e-5)
    assert communication_time("allreduce", 4e6, 4e6, net) == pytest.approx(
        2 * 3 / 4 * 4e6 / 1e9 + 6e-5)
    assert communication_time("allgather", 4e6, 4e6, net) == pytest.approx(3 * 4e6 / 1e9 + 3e-5)
    assert communication_time("allreduce", 4e6, 4e6, Network(1, 1e9, 1e-5)) == 0.0
    none = predict(Pipeline(), (1000, 1000), "float32", net, Throughput())
    assert none.payload_bytes == 4_000_000 and none.compute_s == 0.0
    topk = predict(Pipeline.from_params(TOPK), (1000, 1000), "float32", net, Throughput())
    assert topk.payload_bytes == 10_000 * 8
    # compress + 4 decompressions (one per rank) + 1 for the memory, 50 us + 1 ns/element each
    assert topk.compute_s == pytest.approx(6 * (50e-6 + 1e-9 * 1e6))
    with pytest.raises(ValueError, match="no cost model"):
        communication_time("carrier-pigeon", 1, 1, net)


def test_auto_rejects_unpredictable_candidates():
    spec = ResourceSpec.local(2)
    with pytest.raises(ValueError, match="depends on the data"):
        Auto(candidates=[{"compressor": "threshold", "communicator": "allgather"}]).build(
            {"w": (10, 10)}, spec)
    with pytest.raises(ValueError, match="needs a resource spec"):
        Auto().build({"w": (10, 10)})


def test_dispatcher_accepts_every_builder_output():
    shapes = {n: tuple(p.shape) for n, p in Net().named_parameters()}
    spec = ResourceSpec.local(2, bandwidth_gbps=1.0)
    for builder in (AllReduce(chunk_size=3), Uniform(TOPK, chunk_size=2),
                    SizeThreshold(500, TOPK), Auto(), PS(1)):
        d = from_strategy(builder.build(shapes, spec), variables=shapes)
        assert {d.node(n).name for n in shapes} == set(shapes)
