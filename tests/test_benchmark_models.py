"""The benchmark models, the e2e report's two baselines and the demo's emulated-link step, fast:
the models build with their documented parameter and tensor counts and train one step; the e2e
table shows each pipeline against fp32 Horovod and Horovod's fp16; the demo's network part
skips with one line without root. (The part that launches jobs is in
test_benchmarks_smoke.py.)"""

import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from benchmarks import demo_link, network, records, tables
from benchmarks.e2e_worker import MODELS, build_model

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"

# name: (parameters, gradient tensors), as the e2e worker's docstring states them
COUNTS = {"tiny": (19_210, 4), "mlp": (5_824_522, 6), "cnn": (2_512_138, 10),
          "resnet18": (11_173_962, 62), "transformer": (6_374_666, 103)}


def test_every_model_is_counted():
    assert set(MODELS) == set(COUNTS)


@pytest.mark.parametrize("kind", ["resnet18", "transformer"])
def test_realistic_models_have_their_tensor_counts_and_train(kind):
    torch.manual_seed(0)
    model, shape = build_model(kind)
    params = list(model.parameters())
    assert (sum(p.numel() for p in params), len(params)) == COUNTS[kind]
    assert shape == (3, 32, 32)
    x, y = torch.randn(4, *shape), torch.randint(0, 10, (4,))
    loss = nn.CrossEntropyLoss()(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    names = [n for n, _ in model.named_parameters()]
    assert len(set(names)) == len(names)
    if kind == "resnet18":  # batch norm after every convolution: 20 of them, weight and bias
        bn = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
        conv = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
        assert len(bn) == len(conv) == 20


def test_small_models_keep_their_counts():
    for kind in ("tiny", "mlp", "cnn"):
        model, _ = build_model(kind)
        params = list(model.parameters())
        assert (sum(p.numel() for p in params), len(params)) == COUNTS[kind], kind


def test_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match="tiny, mlp, cnn, resnet18, transformer, got 'vgg'"):
        build_model("vgg")


def _rec(pipeline, step_s, model="m", mbit=100):
    return {"model": model, "mbit": mbit, "pipeline": pipeline, "step_s": step_s,
            "compute_s": 0.01, "compress_s": 0.0, "communicate_s": step_s - 0.01,
            "sent_bytes": 1e6, "received_bytes": 1e6}


def test_e2e_rows_show_speedup_against_fp32_and_fp16():
    rows_in = [_rec("none", 2.0), _rec("hvd-fp16", 1.0), _rec("topk", 0.25),
               _rec("none", 0.3, mbit=1000), _rec("topk", 0.2, mbit=1000),
               {"model": "m", "mbit": 100, "pipeline": "randomk", "error": "boom"}]
    rows = {(r["pipeline"], r["Mbit/s"]): r for r in tables.e2e_rows(rows_in)}
    assert rows["topk", "100"]["speedup vs none"] == "8.00x"
    assert rows["topk", "100"]["speedup vs hvd-fp16"] == "4.00x"
    assert rows["hvd-fp16", "100"]["speedup vs hvd-fp16"] == "1.00x"
    assert rows["none", "100"]["speedup vs hvd-fp16"] == "0.50x"
    # no fp16 baseline at 1 Gbit/s in this run: said, not guessed
    assert rows["topk", "1000"]["speedup vs none"] == "1.50x"
    assert rows["topk", "1000"]["speedup vs hvd-fp16"] == "n/a"
    assert rows["randomk", "100"]["step ms"] == "failed"


def test_committed_e2e_results_render_with_both_ratios():
    doc = records.load(RESULTS / "e2e.json")
    rows = tables.e2e_rows(tables.records_of(doc))
    assert len(rows) == sum(len(run["records"]) for run in doc["runs"])
    assert all(r["speedup vs none"].endswith("x") and r["speedup vs hvd-fp16"].endswith("x")
               for r in rows)
    # every row's baseline is its own run's uncompressed step at that model and link
    top = next(r for r in rows if (r["model"], r["Mbit/s"], r["pipeline"]) == ("mlp", "100",
                                                                              "topk"))
    assert top["speedup vs none"] == "32.75x" and top["run"].startswith("7a090af-gpm")


def test_demo_link_skips_with_one_line_without_root(monkeypatch, capsys):
    monkeypatch.setattr(network.os, "geteuid", lambda: 1000)
    assert demo_link.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["skipped the emulated 100 Mbit/s link: emulated hosts need root (ip netns, tc)"]


def test_demo_link_skips_when_namespaces_fail(monkeypatch, capsys):
    import subprocess

    def refuse(*args, **kwargs):
        raise subprocess.CalledProcessError(1, ["ip", "netns", "add", "x"],
                                            stderr="mount --make-shared /run/netns failed: "
                                                   "Operation not permitted\n")

    monkeypatch.setattr(network, "_ip", refuse)
    monkeypatch.setattr(network, "cleanup_stale", lambda prefix: [])
    monkeypatch.setattr(network.os, "geteuid", lambda: 0)
    assert demo_link.main(["--prefix", "gracenever"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["skipped the emulated 100 Mbit/s link: 'ip netns add x ...' failed: "
                   "mount --make-shared /run/netns failed: Operation not permitted"]


def test_demo_table_shows_both_ratios():
    records = [{**_rec("none", 2.0), "params": 5_824_522, "steps": 5},
               {**_rec("hvd-fp16", 1.0), "params": 5_824_522, "steps": 5},
               {**_rec("topk", 0.2), "params": 5_824_522, "steps": 5}]
    text = demo_link.table(records, 100)
    topk = next(line for line in text.splitlines() if line.startswith("topk"))
    assert topk.split()[-2:] == ["10.00x", "5.00x"]
    assert "5.8M parameters" in text and "100 Mbit/s" in text


@pytest.mark.multiproc
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_demo_link_runs_over_the_emulated_link(capsys):
    assert demo_link.main(["--model", "tiny", "--steps", "2", "--warmup", "1",
                           "--pipelines", "none", "topk", "--prefix", "gracedtest"]) == 0
    out = capsys.readouterr().out
    assert "over an emulated 100 Mbit/s link" in out
    none = next(line for line in out.splitlines() if line.startswith("none"))
    topk = next(line for line in out.splitlines() if line.startswith("topk"))
    assert none.split()[-2:] == ["1.00x", "n/a"]
    assert topk.split()[-2].endswith("x")
    assert "gracedtest" not in network._ip("netns", "list").stdout


@pytest.mark.multiproc
def test_demo_training_prints_no_progress_bar_spam_under_horovodrun():
    import subprocess

    from mp import _env, command

    root = Path(__file__).resolve().parent.parent
    env = _env("", {"TF_ENABLE_ONEDNN_OPTS": "0"})
    proc = subprocess.run(
        command(root / "examples" / "pytorch_digits.py", args=[
            "--epochs", "2", "--compressor", "topk", "--memory", "residual", "--communicator",
            "allgather", "--compress-ratio", "0.01"]),
        env=env, capture_output=True, text=True, timeout=300, cwd=str(root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    assert "\r" not in output and "it/s" not in output, output
    assert "oneDNN" not in output and "absl" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and "accuracy" in lines[0], lines
