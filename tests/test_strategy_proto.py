"""The strategy protobuf: generated code is current, AutoDist's field numbers are kept, and
strategies survive text and binary round trips."""

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format

from grace_dl.strategy import from_bytes, from_text, load, save, strategy_pb2, to_bytes, to_text
from grace_dl.strategy.pipeline import Pipeline

ROOT = Path(__file__).resolve().parent.parent
PROTO = "grace_dl/strategy/strategy.proto"


def test_generated_module_is_current(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}",
                    PROTO], cwd=ROOT, check=True, capture_output=True)
    fresh = (tmp_path / "grace_dl/strategy/strategy_pb2.py").read_text()
    committed = (ROOT / "grace_dl/strategy/strategy_pb2.py").read_text()
    assert fresh == committed, (
        "grace_dl/strategy/strategy_pb2.py is stale; regenerate it with "
        "`python -m grpc_tools.protoc -I. --python_out=. grace_dl/strategy/strategy.proto`")


def test_runtime_accepts_generated_code():
    # Importing validates the gencode version against the installed protobuf runtime; make it
    # fail loudly in a fresh interpreter with warnings as errors.
    subprocess.run([sys.executable, "-W", "error", "-c",
                    "import grace_dl.strategy.strategy_pb2"], cwd=ROOT, check=True)


def _numbers(message):
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_autodist_field_numbers_kept():
    assert _numbers(strategy_pb2.Strategy) == {
        "id": 1, "path": 2, "node_config": 3, "graph_config": 4, "version": 5,
        "predicted_step_s": 6}
    node = _numbers(strategy_pb2.Strategy.Node)
    assert {k: node[k] for k in ("var_name", "PSSynchronizer", "AllReduceSynchronizer",
                                 "partitioner", "part_config")} == {
        "var_name": 1, "PSSynchronizer": 2, "AllReduceSynchronizer": 3, "partitioner": 5,
        "part_config": 6}
    assert {node[k] for k in ("compressor", "memory", "communicator", "shape")} == {8, 9, 10, 11}
    assert _numbers(strategy_pb2.Strategy.GraphConfig) == {"replicas": 1}
    assert _numbers(strategy_pb2.AllReduceSynchronizer) == {"spec": 1, "compressor": 2,
                                                            "group": 3, "bucket": 4}
    assert _numbers(strategy_pb2.PSSynchronizer) == {
        "reduction_destination": 1, "local_replication": 2, "sync": 3, "staleness": 4}
    spec = strategy_pb2.AllReduceSynchronizer.Spec
    assert (spec.Value("AUTO"), spec.Value("NCCL"), spec.Value("RING")) == (0, 1, 2)


def _sample():
    s = strategy_pb2.Strategy(id="t1", version=1)
    s.graph_config.replicas.extend(["a:GPU:0", "b:GPU:0"])
    node = s.node_config.add(var_name="fc.weight")
    node.AllReduceSynchronizer.spec = strategy_pb2.AllReduceSynchronizer.RING
    node.AllReduceSynchronizer.group = 4
    Pipeline.from_params({"compressor": "topk", "compress_ratio": 0.25, "memory": "residual",
                          "communicator": "allgather", "beta": 0.5}).write(node)
    node.shape.extend([10, 20])
    ps = s.node_config.add(var_name="emb.weight")
    ps.PSSynchronizer.reduction_destination = "1"
    ps.PSSynchronizer.sync = True
    return s


def test_text_and_binary_round_trip(tmp_path):
    s = _sample()
    assert from_text(to_text(s)) == s
    assert from_bytes(to_bytes(s)) == s
    assert to_bytes(from_bytes(to_bytes(s))) == to_bytes(s)  # deterministic
    for name in ("s.pbtxt", "s.pb", "s.other"):
        path = save(s, tmp_path / name)
        loaded = load(path)
        assert loaded.path == str(path)
        loaded.path = ""
        s.path = ""
        assert loaded == s
    assert (tmp_path / "s.pb").read_bytes() != (tmp_path / "s.pbtxt").read_bytes()
    node = load(tmp_path / "s.pbtxt").node_config[0]
    assert Pipeline.from_node(node).params("compressor") == {"compress_ratio": 0.25}
    assert Pipeline.from_node(node).params("memory") == {"beta": 0.5}


def test_autodist_message_parses_as_version_0():
    """A strategy written with AutoDist's fields only (its binary form has the same numbers)."""
    text = """
      id: "autodist"
      node_config { var_name: "w" AllReduceSynchronizer { spec: NCCL compressor: HorovodCompressorEF
                                                          group: 2 } }
      graph_config { replicas: "10.0.0.1:GPU:0" }
    """
    s = from_bytes(to_bytes(from_text(text)))
    assert s.version == 0
    p = Pipeline.from_node(s.node_config[0])
    assert (p.compressor, p.memory, p.communicator) == ("fp16", "residual", "allreduce")


def test_bad_inputs_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="text format"):
        from_text("node_config { no_such_field: 1 }")
    with pytest.raises(ValueError, match="serialized strategy"):
        from_bytes(b"\xff\xff\xff")
    with pytest.raises(ValueError, match="does not exist"):
        load(tmp_path / "missing.pbtxt")
    with pytest.raises(ValueError, match="bool, int, float or str"):
        Pipeline(compressor="topk", compressor_params=(("compress_ratio", [0.1]),)).write(
            strategy_pb2.Strategy.Node())
    assert text_format.MessageToString(strategy_pb2.Strategy()) == ""
