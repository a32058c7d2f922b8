"""The README's "writing your own method" example runs as printed, in torch and TF, and its methods
table says what the classes declare."""

import re
from pathlib import Path

import numpy as np
import tensorflow as tf
import torch

from grace_dl import grace_from_params, lookup, names
from grace_dl.registry import BUILTIN

README = Path(__file__).resolve().parent.parent / "README.md"


def _example_source() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return next(b for b in blocks if "@register_compressor(\"halfsign\")" in b)


def test_readme_compressor_registers_and_round_trips():
    namespace = {}
    exec(compile(_example_source(), str(README), "exec"), namespace)  # noqa: S102
    cls = lookup("compressor", "halfsign")
    x = np.array([[0.5, -1.5, 2.0], [-0.25, 0.0, 1.0]], np.float32)
    expected = np.where(x >= 0, 1.0, -1.0) * np.abs(x).mean()
    for tensor in (torch.from_numpy(x), tf.constant(x)):
        comp = cls()
        payload, ctx = comp.compress(tensor, "w")
        assert int(payload[0].shape[0]) == 1          # 6 signs packed into one byte
        np.testing.assert_allclose(np.asarray(comp.decompress(payload, ctx)), expected,
                                   rtol=1e-6)
    grc = grace_from_params({"compressor": "halfsign", "memory": "residual",
                             "communicator": "allgather"})
    assert isinstance(grc.compressor, cls)


def _method_rows():
    """(compressor names, allreduce-safe, two-phase, unbiased) for each row of the README's
    methods table; a cell counts as yes when it starts with 'yes'."""
    section = README.read_text().split("## Methods and what they put on the wire")[1]
    known = set(names("compressor"))
    rows = []
    for line in section.split("\n## ")[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) != 5:
            continue
        methods = [m for m in re.findall(r"`([a-z0-9_]+)`", cells[0]) if m in known]
        rows.append((methods, *(c.startswith("yes") for c in cells[2:])))
    return rows


def test_readme_methods_table_matches_the_classes():
    rows = _method_rows()
    listed = [m for methods, *_ in rows for m in methods]
    assert sorted(listed) == sorted(BUILTIN["compressor"])
    for methods, allreduce_safe, two_phase, unbiased in rows:
        for name in methods:
            cls = lookup("compressor", name)
            assert (cls.caps.allreduce_safe, cls.caps.two_phase_safe, cls.caps.unbiased) == (
                allreduce_safe, two_phase, unbiased), name
