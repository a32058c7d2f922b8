"""``grace_dl.torch.ops.matmul`` / ``assign_matmul``: the thin products PowerSGD makes, some as
outer products on the CPU (``_product``), equal ``a @ b`` in every layout they take."""

import pytest
import torch

from grace_dl.torch import ops


def _layouts(n, k, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, k, generator=g)
    b = torch.randn(k, m, generator=g)
    return {
        "row-major": (a, b),
        "a transposed": (a.t().contiguous().t(), b),
        "b column-major": (a, b.t().contiguous().t()),
        "both transposed": (a.t().contiguous().t(), b.t().contiguous().t()),
    }


SHAPES = [
    (2048, 2048, 2),   # M @ Q: plain GEMM
    (2048, 2048, 8),
    (2048, 2048, 9),
    (2048, 2, 2048),   # P @ Q^T: outer products
    (512, 4, 300),
    (300, 5, 512),     # inner dimension above OUTER_MAX_INNER: plain GEMM
    (3, 2, 4),         # small output: plain GEMM
    (1, 1, 1),
]


@pytest.mark.parametrize("n,k,m", SHAPES)
def test_matmul_equals_the_product_in_every_layout(n, k, m):
    for layout, (a, b) in _layouts(n, k, m).items():
        want = (a.double() @ b.double()).float()
        got = ops.matmul(a, b)
        assert got.shape == (n, m), layout
        assert got.is_contiguous(), layout
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * k ** 0.5, msg=layout)


@pytest.mark.parametrize("n,k,m", SHAPES)
def test_assign_matmul_writes_into_the_variable(n, k, m):
    for layout, (a, b) in _layouts(n, k, m, seed=1).items():
        out = torch.full((n, m), float("nan"))
        returned = ops.assign_matmul(out, a, b)
        assert returned is out, layout
        torch.testing.assert_close(out, (a.double() @ b.double()).float(), rtol=1e-5,
                                   atol=1e-4 * k ** 0.5, msg=layout)


def test_other_ranks_fall_through_to_torch():
    a, b = torch.randn(3, 4, 5), torch.randn(5, 2)
    torch.testing.assert_close(ops.matmul(a, b), a @ b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes(dtype):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(256, 2, generator=g).to(dtype), torch.randn(2, 128, generator=g).to(dtype)
    got = ops.matmul(a, b)
    assert got.dtype == dtype
    # one rounding of the result to the dtype's 8 (bfloat16) or 11 (float16) significant bits
    torch.testing.assert_close(got.double(), a.double() @ b.double(), rtol=1e-2, atol=5e-2)
