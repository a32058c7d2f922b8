"""benchmarks/gpu_step_profile.py on a CPU (gloo, the step table's small decoder): what the
next lent GPU runs to see where a step's time goes. The hook's calls are timed and profiled
for grace's hook and PyTorch's, none for plain DDP; the rows and files are written."""

import json

import torch.distributed as dist

from benchmarks import gpu_step_profile


def test_step_profile_times_and_profiles_the_hooks_on_a_cpu(tmp_path):
    labels = ["DDP", "grace fp16", "PyTorch fp16_compress_hook"]
    assert gpu_step_profile.main(["--device", "cpu", "--small", "--models", "gpt",
                                  "--labels", *labels, "--steps", "2",
                                  "--out", str(tmp_path)]) == 0
    rows = {r["pipeline"]: r for r in json.loads((tmp_path / "step_profile.json").read_text())}
    assert set(rows) == set(labels)
    for r in rows.values():
        assert 0 < r["issue_ms"] <= r["step_ms"] * 1.05 and r["ops"] > 0
        assert r["launches"] is None and r["device_ms"] is None      # (no CUDA here)
    assert rows["DDP"]["hook_ms"] == 0 and rows["DDP"]["top_python"] == []
    grace, torch_hook = rows["grace fp16"], rows["PyTorch fp16_compress_hook"]
    assert 0 < grace["grace_ms"] <= grace["hook_ms"] and grace["top_python"]
    assert torch_hook["hook_ms"] > 0 and torch_hook["grace_ms"] == 0
    assert not dist.is_initialized()        # the group it started is gone
    text = (tmp_path / "step_profile.txt").read_text()
    assert text.count("=== ") == 3 and '"pipeline": "grace fp16"' in text
