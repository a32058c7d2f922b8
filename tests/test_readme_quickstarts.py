"""What the README shows runs as printed: the Horovod quickstart in a real 2-rank horovodrun
job (the DDP one runs from an installed wheel in test_wheel_install.py), every command it
names exists with the options it uses, and its "where compression pays" table is the
committed results'."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import mp
from benchmarks import records, tables

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _python_block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    return next(b for b in blocks if marker in b)


@pytest.mark.multiproc
def test_horovod_quickstart_trains_compressed_on_two_ranks():
    snippet = _python_block("import grace_dl.torch.horovod as hvd")
    ranks = mp.run("readme_quickstart.py", args=[snippet])
    assert [r["steps"] for r in ranks] == [4, 4]
    # topk 1% of 2,632 parameters: a handful of values and indices a step, far below fp32
    assert all(0 < r["last"] < 0.05 * 4 * 2632 for r in ranks), ranks
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


def _commands() -> list[str]:
    """Every shell command the README shows: lines of bash blocks and inline code spans that
    start with python/torchrun/horovodrun/make/pip."""
    lines = [ln.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", README,
                                                               flags=re.S)
             for ln in block.splitlines()]
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", README, flags=re.S))
    starts = ("python ", "torchrun ", "horovodrun ", "make ", "pip ", "mpirun ")
    return [c for c in dict.fromkeys(lines + spans) if c.startswith(starts)]


def test_every_command_names_what_exists_with_options_it_takes():
    commands = _commands()
    assert any(c.startswith("torchrun") for c in commands) and "make test" in commands
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    checked = 0
    for command in commands:
        words = command.split()
        if words[0] == "make":
            assert words[1] in targets, command
            continue
        if "-m" in words and words[words.index("-m") + 1].startswith(("grace_dl", "bench")):
            at = words.index("-m")
            module, args = words[at + 1], words[at + 2:]
            sub = []
            for word in args:
                if word.startswith("-") or "." in word:
                    break
                sub.append(word.split("|")[0])
            proc = subprocess.run([sys.executable, "-m", module, *sub, "--help"],
                                  capture_output=True, text=True, cwd=ROOT, timeout=120)
            assert proc.returncode == 0, (command, proc.stderr[-2000:])
            for option in (w.split("=")[0] for w in args if w.startswith("-")):
                assert re.search(rf"(^|[\s,\[]){re.escape(option)}\b", proc.stdout), \
                    (command, option)
            checked += 1
        for path in (w for w in words if w.endswith(".py") and "/" in w):
            assert (ROOT / path).exists(), command
    assert checked >= 2


def test_where_compression_pays_is_the_committed_e2e_results():
    ratio = tables.speedups([r for r in tables.records_of(records.load(
        records.RESULTS / "e2e.json")) if "error" not in r])
    section = README.split("## Where compression pays")[1].split("\n## ")[0]
    header = next(ln for ln in section.splitlines() if ln.startswith("| model | link"))
    pipelines = [re.search(r"`([^`]+)`", c).group(1) for c in header.strip("|").split("|")[2:]]
    models = {"MLP": "mlp", "ResNet-18": "resnet18", "Transformer": "transformer"}
    links = {"100 Mbit/s": 100, "1 Gbit/s": 1000, "10 Gbit/s": 10000}
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and "x |" in ln]
    assert len(rows) == 9
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        model, link = models[cells[0].split(" (")[0]], links[cells[1]]
        for pipeline, cell in zip(pipelines, cells[2:]):
            want = ratio.get((model, link, pipeline))
            assert cell == (f"{want:.2f}x" if want else "n/a"), (model, link, pipeline)


def test_readme_stays_a_users_page():
    """At most 450 lines, and no lab-notebook provenance ("round N") in it or the library."""
    assert len(README.splitlines()) <= 450
    pattern = re.compile(r"round [0-9]+", re.I)
    found = [str(p.relative_to(ROOT)) for p in [ROOT / "README.md",
                                                *sorted((ROOT / "grace_dl").rglob("*"))]
             if p.is_file() and p.suffix in (".md", ".py", ".c", ".proto")
             and pattern.search(p.read_text(errors="replace"))]
    assert not found, found
