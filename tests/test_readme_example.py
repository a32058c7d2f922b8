"""The README's "writing your own method" example runs as printed, in torch and TF."""

import re
from pathlib import Path

import numpy as np
import tensorflow as tf
import torch

from grace_dl import grace_from_params, lookup

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
