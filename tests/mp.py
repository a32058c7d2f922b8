"""Run real multi-process Horovod jobs from tests, and collect what each rank reports.

A worker script (``tests/workers/*.py``) does its work under Horovod and calls
``report(obj)`` once per rank; ``run(...)`` launches it with ``horovodrun --gloo`` or
``mpirun`` and returns the list of reported objects, indexed by rank. Failures raise with the
job's output, and every job has a timeout, so a hung collective fails the test instead of CI.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
WORKERS = TESTS / "workers"
BIN = Path(sys.executable).parent


def _env(out_dir: str, extra: dict | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env["GRACE_TEST_OUT"] = out_dir
    # Two cores are shared by every rank: keep each rank's thread pools small.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TF_NUM_INTRAOP_THREADS", "1")
    env.setdefault("TF_NUM_INTEROP_THREADS", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Gloo gives up on a peer after 30 s by default; four ranks tracing TF graphs on two
    # loaded cores have missed that (a rank starved, not hung): the run's own timeout bounds it
    env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "120")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def command(script, np: int = 2, launcher: str = "gloo", args=()) -> list[str]:
    script = str(script if os.path.isabs(str(script)) else WORKERS / script)
    if launcher == "gloo":
        return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo",
                sys.executable, script, *map(str, args)]
    if launcher == "mpi":
        return [shutil.which("mpirun") or "mpirun", "--allow-run-as-root", "--oversubscribe",
                "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
                "-np", str(np), "-x", "PYTHONPATH", "-x", "GRACE_TEST_OUT",
                "-x", "PATH", "-x", "OMP_NUM_THREADS", "-x", "TF_CPP_MIN_LOG_LEVEL",
                sys.executable, script, *map(str, args)]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={np}", script,
                *map(str, args)]
    raise ValueError(f"launcher must be 'gloo', 'mpi' or 'torchrun', got {launcher!r}")


def run(script, np: int = 2, launcher: str = "gloo", args=(), timeout: float = 300,
        env: dict | None = None) -> list:
    """Launch ``script`` on ``np`` ranks; return each rank's ``report``ed object. The timeout is
    multiplied by ``GRACE_TEST_TIMEOUT_SCALE`` (default 1) on a machine shared with other work."""
    timeout = timeout * float(os.environ.get("GRACE_TEST_TIMEOUT_SCALE", "1"))
    with tempfile.TemporaryDirectory(prefix="grace_mp_") as out_dir:
        cmd = command(script, np, launcher, args)
        try:
            proc = subprocess.run(cmd, env=_env(out_dir, env), capture_output=True, text=True,
                                  timeout=timeout, cwd=str(ROOT))
        except subprocess.TimeoutExpired as err:
            out = err.stdout or ""
            out = (out.decode(errors="replace") if isinstance(out, bytes) else out)[-6000:]
            raise AssertionError(f"{' '.join(cmd)} timed out after {timeout}s\n{out}") from None
        if proc.returncode != 0:
            # which ranks got as far as reporting tells a crash in the run from one at exit
            reported = [r for r in range(np) if (Path(out_dir) / f"rank{r}.pkl").exists()]
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode} (ranks that had "
                                 f"reported: {reported} of {np})\n"
                                 f"--- stdout ---\n{proc.stdout[-8000:]}\n"
                                 f"--- stderr ---\n{proc.stderr[-8000:]}")
        results = []
        for r in range(np):
            path = Path(out_dir) / f"rank{r}.pkl"
            if not path.exists():
                raise AssertionError(f"rank {r} reported nothing\n{proc.stdout[-4000:]}\n"
                                     f"{proc.stderr[-4000:]}")
            results.append(pickle.loads(path.read_bytes()))
        return results


def report(obj, rank: int | None = None) -> None:
    """Called by a worker on each rank: hand ``obj`` (picklable; NumPy arrays are fine) to the
    test. ``rank`` defaults to Horovod's (torch or TF, whichever is initialised)."""
    if rank is None:
        rank = _hvd_rank()
    out = Path(os.environ["GRACE_TEST_OUT"]) / f"rank{rank}.pkl"
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(obj))
    tmp.rename(out)
    _shut_down_both_horovods()


def _shut_down_both_horovods() -> None:
    """Where a worker runs torch's and TensorFlow's Horovod in one process, torch's imported
    and initialised first (so it initialised MPI and finalizes it), shut them down in order on
    every rank once it has reported: TF's first (its background thread frees its MPI
    communicators), then a barrier on torch's, so that no rank exits (and finalizes MPI)
    while another still frees a communicator. Left to ``atexit``, a rank once segfaulted in
    TF's ``MPIContext::FinalizeWithoutEnv -> PMPI_Comm_free`` after its peer had exited."""
    tf_hvd, torch_hvd = (sys.modules.get(m) for m in ("horovod.tensorflow", "horovod.torch"))
    if tf_hvd is None or torch_hvd is None:
        return
    imported = list(sys.modules)
    if imported.index("horovod.torch") > imported.index("horovod.tensorflow"):
        # TF's Horovod came first (and so, in these workers, initialised MPI: its shutdown
        # would finalize MPI before the barrier): left to atexit
        return
    try:
        torch_hvd.size()
        tf_hvd.size()
    except ValueError:      # one of them was never initialised: nothing shared
        return
    tf_hvd.shutdown()
    torch_hvd.allreduce(sys.modules["torch"].zeros(1), name="grace_test.exit_barrier")
    torch_hvd.shutdown()


def _hvd_rank() -> int:
    for mod in ("horovod.torch", "horovod.tensorflow"):
        if mod in sys.modules:
            try:
                return sys.modules[mod].rank()
            except Exception:  # noqa: BLE001 - not initialised in this framework
                continue
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    raise RuntimeError("cannot tell this process's rank")
