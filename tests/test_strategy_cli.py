"""``python -m grace_dl strategy build|show|validate``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grace_dl.strategy import load
from grace_dl.strategy.cli import main
from grace_dl.strategy.pipeline import Pipeline

ROOT = Path(__file__).resolve().parent.parent
TOPK = json.dumps({"compressor": "topk", "compress_ratio": 0.01, "memory": "residual",
                   "communicator": "allgather"})


def _shapes(tmp_path):
    path = tmp_path / "shapes.yaml"
    path.write_text("emb.weight: [5000, 64]\nconv.weight: [16, 3, 3, 3]\nconv.bias: [16]\n"
                    "fc.weight: [10, 64]\nfc.bias: [10]\n")
    return str(path)


def test_build_show_validate_as_a_module(tmp_path):
    out = tmp_path / "s.pb"
    cmd = [sys.executable, "-m", "grace_dl", "strategy"]
    build = subprocess.run(cmd + ["build", "--variables", _shapes(tmp_path), "--builder",
                                  "size-threshold", "--min-elements", "500", "--params", TOPK,
                                  "-o", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    strategy = load(out)
    chosen = {n.var_name: Pipeline.from_node(n).compressor for n in strategy.node_config}
    assert chosen == {"emb.weight": "topk", "conv.weight": "none", "conv.bias": "none",
                      "fc.weight": "topk", "fc.bias": "none"}
    show = subprocess.run(cmd + ["show", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    lines = show.stdout.splitlines()
    assert lines[0].split() == ["variable", "shape", "numel", "synchronizer", "spec", "pipeline"]
    assert lines[1].split() == ["emb.weight", "5000x64", "320000", "AllReduce", "g0", "AUTO",
                                "topk(compress_ratio=0.01)+residual+allgather"]
    assert "5 variables, 2 pipelines" in lines[-1]
    ok = subprocess.run(cmd + ["validate", str(out), "--variables", _shapes(tmp_path),
                               "--workers", "4"], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("ok: 5 variables"), ok.stderr


def test_validate_reports_problems(tmp_path, capsys):
    shapes = _shapes(tmp_path)
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes:\n  - {address: a, gpus: [0, 1]}\n  - {address: b, gpus: [0, 1]}\n")
    out = str(tmp_path / "s.pbtxt")
    assert main(["build", "--variables", shapes, "--builder", "allreduce", "--params",
                 '{"compressor": "fp16"}', "--resource-spec", str(spec), "-o", out]) == 0
    assert main(["validate", out, "--workers", "4"]) == 0
    assert main(["validate", out, "--workers", "2"]) == 1
    assert "4 replicas, not 2 workers" in capsys.readouterr().err
    other = tmp_path / "other.yaml"
    other.write_text("emb.weight: [5000, 64]\nhead.weight: [3, 3]\n")
    assert main(["validate", out, "--variables", str(other)]) == 1
    err = capsys.readouterr().err
    assert "no node in the strategy: ['head.weight']" in err
    assert "naming no variable of the model: ['conv.weight', 'conv.bias'" in err
    assert main(["build", "--variables", shapes, "--params", '{"compressor": "zip"}']) == 1
    assert "unknown compressor 'zip'" in capsys.readouterr().err
    assert main(["build", "--variables", shapes, "--params", "{bad"]) == 1
    assert "--params is not valid JSON" in capsys.readouterr().err


def test_auto_from_the_command_line(tmp_path, capsys):
    spec = tmp_path / "slow.yaml"
    spec.write_text("nodes:\n  - {address: a, slots: 4, network_bandwidth: 1}\n")
    candidates = json.dumps([{"compressor": "none"}, {"compressor": "topk",
                             "compress_ratio": 0.01, "memory": "residual",
                             "communicator": "allgather"}])
    assert main(["build", "--variables", _shapes(tmp_path), "--builder", "auto",
                 "--candidates", candidates, "--resource-spec", str(spec)]) == 0
    text = capsys.readouterr().out
    assert 'name: "topk"' in text and 'replicas: "a:CPU:3"' in text
    assert "predicted_step_s: " in text
    assert main(["show", "--text", str(tmp_path / "missing.pbtxt")]) == 1
    capsys.readouterr()
    # After a run, show puts the measured step time next to Auto's prediction.
    out = tmp_path / "auto.pbtxt"
    assert main(["build", "--variables", _shapes(tmp_path), "--builder", "auto",
                 "--candidates", candidates, "--resource-spec", str(spec), "-o", str(out)]) == 0
    predicted = load(out).predicted_step_s
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"step_s": 2 * predicted}))
    capsys.readouterr()
    assert main(["show", str(out), "--measured", str(run)]) == 0
    assert f"measured {2e3 * predicted:.1f} ms (predicted / measured 0.50)" in \
        capsys.readouterr().out
    for bad, words in (("-1", "positive step time"), (str(tmp_path / "nope"), "neither"),
                       (str(_write_json(tmp_path, {"step": 1})), "no numeric \"step_s\"")):
        assert main(["show", str(out), "--measured", bad]) == 1
        assert words in capsys.readouterr().err


def test_buckets_from_the_command_line(tmp_path, capsys):
    """show marks a strategy's bucket groups; build passes --bucket-bytes to Auto (0: never
    bucket) and refuses a negative one, naming it."""
    from grace_dl.strategy.builders import assemble
    from grace_dl.strategy.serialize import save
    from grace_dl.strategy.variables import variables_of

    variables = variables_of({"a": (4, 4), "b": (4,), "c": (8,)})
    topk = Pipeline.from_params(json.loads(TOPK))
    path = tmp_path / "buckets.pbtxt"
    save(assemble(variables, [topk] * 3, buckets=[[2, 1], [0]]), str(path))
    assert main(["show", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[3:5] for line in lines[1:4]] == [["AllReduce", "g1"],
                                                          ["AllReduce", "g0"],
                                                          ["AllReduce", "g0"]]
    assert [line.split()[5] for line in lines[2:4]] == ["bucket", "bucket"]
    spec = tmp_path / "slow.yaml"
    spec.write_text("nodes:\n  - {address: a, slots: 4, network_bandwidth: 1}\n")
    build = ["build", "--variables", _shapes(tmp_path), "--builder", "auto",
             "--resource-spec", str(spec)]
    assert main(build + ["--bucket-bytes", "0"]) == 0
    capsys.readouterr()
    assert main(build + ["--bucket-bytes", "-1"]) == 1
    assert "bucket_bytes" in capsys.readouterr().err


def _write_json(tmp_path, obj):
    path = tmp_path / "record.json"
    path.write_text(json.dumps(obj))
    return path


def test_measure_writes_a_throughput_file_auto_reads(tmp_path, capsys):
    from grace_dl.strategy import Auto, ResourceSpec
    from grace_dl.strategy.cost_model import Throughput

    out = tmp_path / "tp.json"
    assert main(["measure", "--sizes", "256,8192", "--repeats", "2", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [e["compressor"] for e in doc["entries"]] == [
        "none", "fp16", "topk", "randomk", "qsgd", "signsgd", "powersgd"]
    assert "collectives" not in doc  # not started by horovodrun: compression only
    for entry in doc["entries"]:
        for what in ("compress", "decompress"):
            assert entry[what]["overhead_s"] >= 0 and entry[what]["per_element_s"] >= 0
        # the fitted line reproduces a positive time at the large size
        c = entry["compress"]
        assert c["overhead_s"] + c["per_element_s"] * 8192 > 0
    tp = Throughput.load(out)
    assert tp.costs("topk", {"compress_ratio": 0.01, "approximate": True}) != tp.costs("qsgd", {})
    Auto(throughput=tp).build({"w": (512, 512)}, ResourceSpec.local(4, bandwidth_gbps=1))
    assert main(["measure", "--sizes", "8192,256"]) == 1
    assert "increasing" in capsys.readouterr().err


def test_bad_command_lines_give_one_line_errors_not_tracebacks(tmp_path, capsys):
    shapes = _shapes(tmp_path)
    for argv, words in (
            (["build", "--model", "nosuchmod:f"], "cannot import 'nosuchmod'"),
            (["build", "--model", "os:nosuchfunction"], "module 'os' has no 'nosuchfunction'"),
            (["build", "--model", "os:sep"], "is a str, not a function returning a model"),
            (["build", "--model", "os:getcwd"], "returned a str, not a torch module"),
            (["build", "--variables", shapes, "-o", "/nonexistent/dir/x.pbtxt"],
             "directory '/nonexistent/dir' does not exist"),
            (["build", "--variables", shapes, "--builder", "auto"],
             "--builder auto needs --resource-spec FILE")):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv", [["validate", "s.pbtxt", "--workers", "0"],
                                  ["build", "--chunk-size", "0"],
                                  ["measure", "--repeats", "-1"]])
def test_counts_must_be_positive(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["[1.5, 2]", "[true, 3]", "[2, \"x\"]", "[-1, 3]"])
def test_variables_file_shapes_must_be_non_negative_integers(tmp_path, capsys, shape):
    path = tmp_path / "shapes.yaml"
    path.write_text(f"w: {shape}\n")
    assert main(["build", "--variables", str(path)]) == 1
    err = capsys.readouterr().err
    assert "variable 'w'" in err and ("sequence of ints" in err or "negative" in err), err


def test_negative_fusion_group_is_refused(tmp_path, capsys):
    out = tmp_path / "s.pbtxt"
    assert main(["build", "--variables", _shapes(tmp_path), "-o", str(out)]) == 0
    text = out.read_text()
    assert "group: 0" in text or "AllReduceSynchronizer {" in text
    out.write_text(text.replace("AllReduceSynchronizer {", "AllReduceSynchronizer {\n    group: -1",
                                1))
    capsys.readouterr()
    assert main(["validate", str(out)]) == 1
    assert "fusion group must be >= 0, got -1" in capsys.readouterr().err


def test_the_package_command_lists_its_commands(capsys):
    from grace_dl.__main__ import main as grace_dl_main

    assert grace_dl_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: grace-dl {strategy}") and "strategy   build, show" in out
    assert grace_dl_main(["nosuch"]) == 2
    assert "unknown command 'nosuch'; accepted: ['strategy']" in capsys.readouterr().err
    assert grace_dl_main([]) == 2
