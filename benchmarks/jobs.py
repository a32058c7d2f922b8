"""How the benchmarks launch their worker jobs: one environment, one local horovodrun line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.bind import command as bind_command

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def worker_env(base: dict | None = None, **extra: str) -> dict:
    """``base`` (default: this process's environment) with the repository importable, one
    intra-op thread, TensorFlow's start-up logging off, unbuffered output and this Python's
    launchers on PATH; ``extra`` on top."""
    env = dict(os.environ if base is None else base)
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONUNBUFFERED="1")
    if str(BIN) not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def local_horovodrun(argv: list[str], ranks: int = 2, bind: bool = True) -> list[str]:
    """``horovodrun --gloo`` with ``ranks`` ranks on this machine's loopback; with ``bind``,
    each rank on cores of its own (``benchmarks/bind.py``)."""
    return [str(BIN / "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
            *(bind_command(argv) if bind else argv)]
