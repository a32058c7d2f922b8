"""benchmarks/hook_calls.py counts the Python calls inside grace_dl of one DDP hook step: the
count is positive, the same from step to step and run to run, every counted file is a
grace_dl file, and the counts do not grow past what they were when the counter was written
(issue 42 wants them far lower: a refactor that thins the hook lowers the bounds below)."""

import math

import pytest

from benchmarks import hook_calls, records, tables

#: measured on the CPU path (small MLP, one bucket, default hook options; the committed
#: results file): (calls, files) per step; the bounds allow 10% more, so a regression fails
#: (qsgd two-phase: 330 with the reference's compress around the kernels, 193 on the CPU
#: path's own, ``grace_dl.native.paths.QSGDOnCpu``; 198 once the server rank decodes its own
#: chunk's divided payload, as the other ranks do, so that they agree at any group size)
MEASURED = {"none": (22, 6), "topk": (91, 17), "qsgd-2phase": (198, 20)}
MARGIN = 1.10
#: pipelines without a target, their calls per step as measured (PowerSGD on the hook's bucket
#: path, ``grace_dl.torch.ddp_powersgd``: 684 when every tensor took the send path, 323 with
#: the compressor's and memory's methods called per tensor, 109 with a bucket's foreach
#: operations and QR per matrix shape; fp16 cast by the hook itself, ``sums_in_half``: 57
#: through the send path)
UNTARGETED = {"powersgd": 109, "fp16": 24}
#: torch operations the hook issues per step (the *torch ops* column; on a GPU each is a
#: launch), as measured when the column was added; PowerSGD's after its QR orthonormalization
#: of P alone, with Q^T sent as computed and QR's column signs kept (292 with two-pass
#: Gram–Schmidt, 214 with Q orthonormalized too: 162), then on the bucket path's views of
#: DDP's buffer and foreach operations (128), so going back to any of them fails; fp16's
#: payload summed in place (9 with the fresh buffer allreduce_async takes; 7 through the send
#: path, 6 cast by the hook itself)
TORCH_OPS = {"none": 2, "fp16": 6, "powersgd": 128}


def test_only_calls_in_grace_dl_files_are_counted():
    def outside():
        return 1

    import torch

    from grace_dl import backend

    counter = hook_calls.CallCounter()
    with counter:
        for _ in range(3):
            outside()
        backend.ops_for(torch.zeros(1))
    got = counter.grace_calls()
    assert sum(counter.codes.values()) > sum(got.values())   # outside() was seen, not kept
    assert not any(name.endswith("outside") for _, _, name in got)
    assert ("backend.py", backend.ops_for.__code__.co_firstlineno, "ops_for") in got
    for rel, _, _ in got:
        assert (hook_calls.PACKAGE / rel).is_file() and not rel.startswith(".."), rel


def test_none_step_is_counted_the_same_every_time_inside_grace_dl():
    first = hook_calls.count("none", warmup=2, steps=2)
    again = hook_calls.count("none", warmup=2, steps=2)
    assert first["calls"] > 0 and first["files"] > 0
    assert first["calls_per_step"] == [first["calls"]] * 2       # step to step
    assert (again["calls"], again["files"]) == (first["calls"], first["files"])  # run to run
    assert again["top_functions"] == first["top_functions"]
    assert first["buckets"] == 1 and first["grace_tensors"] == 1
    assert sum(n for _, n in first["top_files"]) == first["calls"]
    assert len(first["top_files"]) == first["files"]
    for rel, _ in first["top_files"]:
        path = (hook_calls.PACKAGE / rel).resolve()
        assert path.is_file() and hook_calls.PACKAGE in path.parents, rel
    assert any(f.startswith("torch/ddp.py:") for f, _ in first["top_functions"]) or \
        any(f == "torch/ddp.py" for f, _ in first["top_files"])      # the hook itself ran


@pytest.mark.parametrize("pipeline", sorted(MEASURED))
def test_counts_do_not_grow(pipeline):
    calls, files = MEASURED[pipeline]
    got = hook_calls.count(pipeline, warmup=2, steps=1)
    assert got["buckets"] == 1
    assert got["calls"] <= int(calls * MARGIN), (got["calls"], got["top_functions"])
    assert got["files"] <= int(files * MARGIN), (got["files"], got["top_files"])
    assert got["target_calls"] == hook_calls.TARGETS[pipeline][0]
    assert got["calls"] <= got["target_calls"], got["top_functions"]   # issue 42's, on the CPU


@pytest.mark.parametrize("pipeline", sorted(UNTARGETED))
def test_untargeted_counts_do_not_grow(pipeline):
    got = hook_calls.count(pipeline, warmup=2, steps=1)
    assert got["calls"] <= int(UNTARGETED[pipeline] * MARGIN), got["top_functions"]
    assert got["target_calls"] is None


@pytest.mark.parametrize("pipeline", sorted(TORCH_OPS))
def test_torch_operations_per_step_do_not_grow(pipeline):
    got = hook_calls.count(pipeline, warmup=2, steps=2)
    assert got["torch_ops_per_step"] == [got["torch_ops"]] * 2      # step to step
    assert 0 < got["torch_ops"] <= int(TORCH_OPS[pipeline] * MARGIN), got["torch_ops"]


def test_shape_models_have_the_real_networks_parameters():
    """``--model resnet50`` / ``decoder``: torchvision's ResNet-50 (161 tensors, 25,557,032
    parameters) and benchmarks/gpu.py's decoder, as parameter shapes."""
    shapes = hook_calls.resnet50_shapes()
    assert len(shapes) == 161 and sum(math.prod(s) for s in shapes) == 25_557_032
    assert shapes[0] == (64, 3, 7, 7) and shapes[-2:] == [(1000, 2048), (1000,)]
    decoder = hook_calls.decoder_shapes()
    assert 100e6 < sum(math.prod(s) for s in decoder) < 130e6
    assert (3 * 768, 768) in decoder and (768, 4 * 768) in decoder


def test_pytorch_hooks_are_counted_as_baselines_with_no_grace_calls():
    """PyTorch's PowerSGD hook at grace powersgd's rank: its torch operations per step (the
    same every step) and no grace_dl calls; its ops are views and kernels both."""
    got = hook_calls.count("pytorch-powersgd", warmup=3, steps=2)
    assert got["calls"] == 0 and got["files"] == 0 and got["grace_tensors"] is None
    assert got["torch_ops_per_step"] == [got["torch_ops"]] * 2
    assert 0 < got["torch_views"] < got["torch_ops"]
    row, = tables.hook_calls_rows([got])
    assert row["non-view ops"] == got["torch_ops"] - got["torch_views"]
    with pytest.raises(ValueError, match="pytorch-fp16"):
        hook_calls.count("pytorch-sgd")


def test_table_puts_targets_beside_counts_and_the_main_prints_it(capsys, tmp_path):
    out = tmp_path / "hook_calls.json"
    assert hook_calls.main(["--pipelines", "none", "fp16", "--warmup", "2", "--steps", "1",
                            "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| pipeline | calls | target calls | files | target files | torch ops |" in text
    assert "| none | " in text and "| <= 40 | " in text and "| <= 8 | " in text
    assert "`fp16`: the 10 functions called most" in text
    doc = records.load(out)
    assert doc["benchmark"] == "hook_calls" and [r["pipeline"] for r in
                                                 doc["runs"][0]["records"]] == ["none", "fp16"]
    assert tables.hook_calls(doc).startswith(text.split("\n")[0])
    assert doc["runs"][0]["command"].startswith("python -m benchmarks.hook_calls --pipelines")


def test_a_hook_on_another_thread_is_counted_through_cover_this_thread():
    """On a GPU DDP calls the hook on an autograd device thread, started before the counter
    (``threading.setprofile`` does not reach it): the hook's wrapper covers that thread."""
    import threading

    import torch

    from grace_dl import backend

    go, done = threading.Event(), threading.Event()

    def worker():
        go.wait()
        backend.ops_for(torch.zeros(1))             # not covered: not counted
        with counter.cover_this_thread():
            backend.ops_for(torch.zeros(1))
        done.set()

    counter = hook_calls.CallCounter()
    thread = threading.Thread(target=worker)
    thread.start()
    with counter:
        go.set()
        assert done.wait(30)
    thread.join()
    calls = counter.grace_calls()
    assert calls[("backend.py", backend.ops_for.__code__.co_firstlineno, "ops_for")] == 1
    assert len(counter.threads) == 2


def test_the_device_path_counts_triton_launches_and_not_the_interpreters_work(tmp_path):
    """``--path device``: the GPU's code on CPU tensors (a process of its own: Triton's
    interpreter is chosen when Triton is imported); each Triton kernel is one launch (qsgd
    two-phase: the worker's and the server's encoders, the server's decoding of its chunk for
    its error feedback, and that chunk's divided payload decoded as every other rank decodes
    it), and what the interpreter runs for it (the kernel's Python, its copies) is not
    counted."""
    import os
    import subprocess
    import sys

    out = tmp_path / "device.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.hook_calls", "--path", "device",
                          "--pipelines", "qsgd-2phase", "none", "topk", "signsgd-2phase",
                          "--warmup", "2", "--steps", "2", "--where", "--json", str(out)],
                         capture_output=True, text=True,
                         cwd=hook_calls.PACKAGE.parent, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| Triton kernels |" in run.stdout
    device, none, topk, signs = records.load(out)["runs"][0]["records"]
    cpu = hook_calls.count("qsgd-2phase", warmup=2, steps=1)
    assert (cpu["path"], device["path"]) == ("cpu", "device")
    assert cpu["triton_kernels"] == 0 and device["triton_kernels"] == 4
    assert none["triton_kernels"] == 0
    assert device["torch_ops_per_step"] == [device["torch_ops"]] * 2
    assert not any(f.startswith("torch/kernels/jit_") for f, _ in device["top_files"]), \
        device["top_files"]
    assert any(f == "torch/device.py" for f, _ in device["top_files"])   # its speed paths ran
    # what a GPU's step runs: issue 42's call targets met there (not yet its files)
    for got in (device, none, topk):
        assert got["calls"] <= hook_calls.TARGETS[got["pipeline"]][0], got["top_functions"]
    # signSGD's vote and error by kernels (a launch a payload), not ~30 bitwise ops a payload
    # (93: its sizes exchanged from the device, 81 when each compression read its own)
    assert signs["triton_kernels"] == 6 and signs["torch_ops"] <= 93, signs["top_functions"]
    # --where lists every operation and launch of the last step with the line issuing it
    # (printed, not kept in the results file)
    listed = topk["torch_ops"] + topk["triton_kernels"]
    assert f"`topk`: its {listed} torch operations and Triton launches of one step" in \
        run.stdout
    section = run.stdout.split("`topk`: its ")[1].split("\n\n`")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) == listed
    assert sum(line.startswith("| Triton ") for line in rows) == topk["triton_kernels"]
    assert any("`torch/kernels/select.py:" in line for line in rows), rows
    assert not any("sites" in r for r in (device, none, topk, signs))
    with pytest.raises(ValueError, match="path must be one of"):
        hook_calls.count("none", path="gpu")
