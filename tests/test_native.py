"""The compiled kernels (grace_dl/native): built by the project's install, and equal to their
NumPy twins on every SIMD path this CPU has, edge values and buffer overflow included."""

import numpy as np
import pytest
import torch

from grace_dl import native


@pytest.fixture
def every_path():
    """The SIMD widths this CPU runs (512 / 256 / scalar, as far as it has them); the default
    is restored afterwards."""
    paths = sorted({native.vector_bits(), 256 if native.vector_bits() >= 256 else 0, 0},
                   reverse=True)
    yield paths
    native.limit_vector_bits(512)


def test_the_install_built_the_library():
    """`pip install -e .` (scripts/setup.sh) compiles kernels.c here: a silent fallback to the
    NumPy twins would cost the sparsifiers their fast scan."""
    assert native.available()
    assert native.vector_bits() in (0, 256, 512)


def _mixed(n, seed):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * 2).astype(np.float32)
    if n > 40:
        a[[0, 17, 33]] = [np.nan, np.inf, -np.inf]
        a[5] = -0.0
        a[21] = 1.5                # exactly at the threshold below
        a[22] = -1.5
    return a


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100, 3 * (1 << 16) + 123])
@pytest.mark.parametrize("sign", [None, 1, -1])
@pytest.mark.parametrize("thr", [1.5, 0.0, -1.0, float("inf"), float("nan"), 3.9])
def test_positions_equal_the_numpy_twin_on_every_path(every_path, n, sign, thr):
    a = _mixed(n, n)
    mag = np.abs(a) if sign is None else (a if sign > 0 else -a)
    expected = np.flatnonzero(mag >= np.float32(thr))
    for bits in every_path:
        native.limit_vector_bits(bits)
        assert native.vector_bits() == bits
        got = native.positions_at_least(a, thr, sign)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, expected, err_msg=f"path {bits}")
    np.testing.assert_array_equal(native._positions_numpy(a, thr, sign), expected)


def test_more_positions_than_the_first_buffer_holds(every_path):
    """The first call's buffer holds n/64 positions: a low threshold overflows it and the
    kernel runs again with room for all (the count is exact either way)."""
    a = _mixed(200_000, 3)
    for bits in every_path:
        native.limit_vector_bits(bits)
        got = native.positions_at_least(a, 0.5)
        np.testing.assert_array_equal(got, np.flatnonzero(np.abs(a) >= 0.5))
        assert got.size > 200_000 // 64


def test_other_dtypes_and_strided_arrays_take_the_twin():
    a = _mixed(5000, 4)
    for x in (a.astype(np.float64), a[::2], a.astype(np.float16)):
        np.testing.assert_array_equal(native.positions_at_least(x, 1.5),
                                      np.flatnonzero(np.abs(x) >= x.dtype.type(1.5)))


def test_torch_positions_use_the_kernel_on_a_tensor_view():
    """grace_dl.torch.ops passes the tensor's own buffer (a slice of a larger one here)."""
    from grace_dl.torch import ops

    base = torch.from_numpy(_mixed(10_000, 5))
    view = base[1000:9000]
    got = ops.positions_at_least(view, torch.tensor(1.5), -1)
    np.testing.assert_array_equal(got.numpy(), np.flatnonzero((view <= -1.5).numpy()))
