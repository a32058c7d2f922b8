"""Checkpoint trees (nested dicts/lists of state) between NumPy and torch: grace state is NumPy
inside grace_dl and CPU tensors in a torch checkpoint, so ``torch.load(weights_only=True)`` reads
it."""

from __future__ import annotations

import numpy as np
import torch


def _map(tree, leaf):
    if isinstance(tree, dict):
        return {k: _map(v, leaf) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, leaf) for v in tree)
    return leaf(tree)


def _tensor(x):
    return torch.from_numpy(np.array(x, copy=True)) if isinstance(x, np.ndarray) else x


def _array(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x) if isinstance(x, np.generic) else x


def to_torch(tree):
    """NumPy arrays -> CPU tensors (copies)."""
    return _map(tree, _tensor)


def to_numpy(tree):
    """Tensors (any device) and NumPy scalars -> NumPy arrays."""
    return _map(tree, _array)
