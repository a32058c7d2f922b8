"""The training clients users already run: PyTorch Lightning and Hugging Face Accelerate,
each with grace's DDP hook, in real 2-rank torchrun jobs on gloo (examples/lightning_digits.py,
examples/accelerate_digits.py). The byte counters show the hook carried the gradients, the ranks
end with the same parameters, and the model learns."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# the 2-layer digits model of both examples: 64*128 + 128 + 128*10 + 10 parameters
PARAMS = 64 * 128 + 128 + 128 * 10 + 10


def _torchrun(example: str, out: Path, *args: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    timeout = 600 * float(os.environ.get("GRACE_TEST_TIMEOUT_SCALE", "1"))
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2",
           str(ROOT / "examples" / example), "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(out.parent))
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


def _compressed_and_in_step(ranks: list[dict], ceiling: float) -> None:
    r0, r1 = ranks
    assert r0["steps"] == r1["steps"] > 0, ranks          # the hook ran on every step
    assert 0 < r0["sent_bytes"] / r0["steps"] < ceiling * 4 * PARAMS, ranks
    assert r0["checksum"] == r1["checksum"], ranks       # DDP's replicas stayed identical
    assert min(r0["accuracy"], r1["accuracy"]) > 0.85, ranks


@pytest.mark.parametrize("compressor, ceiling", [("topk", 0.2), ("qsgd", 0.4)])
def test_lightning_ddp_strategy_trains_with_graces_hook(compressor, ceiling, tmp_path):
    ranks = _torchrun("lightning_digits.py", tmp_path / "r", "--compressor", compressor)
    _compressed_and_in_step(ranks, ceiling)


def test_lightning_alone_does_not_register_the_hook_on_cpu(tmp_path):
    """What the callback is for: DDPStrategy(ddp_comm_hook=...) registers only on CUDA, so on
    CPU the gradients go through DDP's own allreduce and grace counts nothing."""
    ranks = _torchrun("lightning_digits.py", tmp_path / "r", "--no-callback", "--epochs", "1")
    assert [r["steps"] for r in ranks] == [0, 0] and ranks[0]["checksum"] == ranks[1]["checksum"]


def test_accelerate_trains_with_graces_hook_on_the_prepared_model(tmp_path):
    ranks = _torchrun("accelerate_digits.py", tmp_path / "r", "--compressor", "topk")
    _compressed_and_in_step(ranks, 0.2)
