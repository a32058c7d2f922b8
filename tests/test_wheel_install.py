"""The package as a user installs it for the DDP path: the wheel built from this checkout,
installed with ``pip install --no-deps`` into a fresh virtual environment that sees the
existing torch (and its dependencies) but not Horovod nor this checkout, runs the README's DDP
quickstart on 2 ranks. Its metadata names framework ranges, not this machine's pins."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
HIDDEN = ("horovod", "grace_dl", "grace-dl", "__editable__", "_grace_dl")

LOOP = '''\
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(dist.get_rank())
for step in range(5):
    x = torch.randn(16, 32, generator=g)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
checksum = float(sum(p.double().sum() for p in model.parameters()))
# one file per rank: two ranks printing to one pipe can run their lines together
with open(f"result_rank{dist.get_rank()}.txt", "w") as out:
    out.write(f"RANK {dist.get_rank()} steps {state.grace.bytes.total['steps']} "
              f"sent {state.grace.bytes.total['sent']} checksum {checksum!r}\\n")
'''


def ddp_quickstart() -> str:
    """The README's DDP snippet as a script: a model defined before it, a short loop where
    it says "the usual DDP loop"."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    snippet = next(b for b in blocks if "register_comm_hook" in b and "DDP(net)" in b)
    head, marker, tail = snippet.partition("# ... the usual DDP loop")
    assert marker, "the DDP quickstart lost its loop marker"
    tail = tail.split("\n", 1)[1]
    return ("import torch\nnet = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),"
            " torch.nn.Linear(64, 8))\n" + head + LOOP + tail)


def _beside(site: Path, target: Path) -> None:
    """``target`` holds links to everything in ``site`` but Horovod and grace_dl."""
    target.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(HIDDEN) and entry.suffix != ".pth":
            (target / entry.name).symlink_to(entry)


def _requirements(text: str, key: str) -> list[str]:
    line = re.search(rf"^{key} = \[(.*?)\]", text, flags=re.M | re.S)
    assert line, key
    return re.findall(r'"([^"]+)"', line.group(1))


def test_metadata_names_ranges_not_pins():
    text = (ROOT / "pyproject.toml").read_text()
    frameworks = _requirements(text, "torch") + _requirements(text, "tensorflow")
    assert frameworks and all("==" not in r and ">=" in r for r in frameworks), frameworks
    runtime = _requirements(text, "dependencies") + frameworks
    assert not [r for r in runtime if re.match(r"(lightning|accelerate|horovod)\b", r)]
    assert "lightning==" in text and "torch==" not in text.split("[project.scripts]")[0]


def test_wheel_installs_beside_torch_and_runs_the_ddp_quickstart(tmp_path):
    python = Path(sys.executable)
    timeout = 600 * float(os.environ.get("GRACE_TEST_TIMEOUT_SCALE", "1"))
    subprocess.run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", tmp_path / "dist", ROOT], check=True, timeout=timeout,
                   capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("grace_dl-*.whl")
    # the fresh venv sees neither this checkout (PYTHONPATH) nor the test's own venv
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", venv], check=True, timeout=timeout)
    vpy = venv / "bin" / "python"
    site = Path(subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, env=env,
                               text=True).stdout.strip())
    existing = Path(subprocess.run([python, "-c", "import torch, pathlib; print(pathlib.Path("
                                    "torch.__file__).parent.parent)"], check=True,
                                   capture_output=True, text=True).stdout.strip())
    _beside(existing, tmp_path / "existing")
    (site / "existing_torch.pth").write_text(str(tmp_path / "existing") + "\n")
    subprocess.run([vpy, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel],
                   check=True, timeout=timeout, capture_output=True, env=env, cwd=tmp_path)
    where = subprocess.run([vpy, "-c", "import grace_dl, importlib.util as u; "
                            "print(grace_dl.__file__, u.find_spec('horovod'))"], env=env,
                           cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    assert where.startswith(str(site)) and where.split()[-1] == "None", where

    script = tmp_path / "train.py"
    script.write_text(ddp_quickstart())
    proc = subprocess.run([vpy, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", script], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = "".join(p.read_text() for p in sorted(tmp_path.glob("result_rank*.txt")))
    ranks = sorted(re.findall(r"RANK (\d) steps (\d+) sent (\d+) checksum (\S+)", results))
    assert [r[0] for r in ranks] == ["0", "1"], results + proc.stdout[-2000:]
    assert all(int(steps) == 5 and int(sent) > 0 for _, steps, sent, _ in ranks), ranks
    assert ranks[0][3] == ranks[1][3], ranks          # the replicas stayed identical
    assert {p.name for p in tmp_path.glob("grace_rank*.pt")} == {"grace_rank0.pt",
                                                                 "grace_rank1.pt"}
