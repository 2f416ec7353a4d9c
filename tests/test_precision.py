"""float32 activations follow torch.set_float32_matmul_precision: float32-accurate at
"highest" (torch's default), bfloat16 dot products allowed at "high"/"medium"."""

import pytest
import torch

import lowbit
from lowbit.kernels import cpu
from lowbit.ops import linear

from .conftest import FAST_BACKENDS
from .test_matmul import U32, abs_products, gamma, weight_only_tolerance


@pytest.fixture
def precision():
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int4-sym-g32", "int8-sym"])
@pytest.mark.parametrize("m", [1, 2, 5, 16, 40])
def test_highest_precision_gives_float32_accurate_products(precision, backend, scheme, m):
    precision("highest")
    n, k = 64, 512
    qt = lowbit.quantize(torch.randn(n, k), scheme)
    x = torch.randn(m, k)
    y = linear(x, qt, backend=backend)
    exact = x.double() @ lowbit.dequantize(qt, torch.float64).T
    # float32 everywhere: no more than 2K + 16 roundings of unit 2^-24 per output (the
    # bound of tests/test_matmul.py without its bf16 input-rounding term), then one
    # rounding of the result
    tol = 2 * gamma(2 * k + 16) * abs_products(x, qt) + 2 * U32 * exact.abs()
    assert bool(((y.double() - exact).abs() <= tol).all())


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("m", [1, 16])
def test_medium_precision_may_use_bfloat16_and_stays_within_its_bound(precision, backend, m):
    n, k = 64, 512
    qt = lowbit.quantize(torch.randn(n, k), "int4-asym-g64")
    x = torch.randn(m, k)
    precision("highest")
    y_ref = linear(x, qt, backend="reference")
    precision("medium")
    assert not cpu.float32_exact(torch.float32)
    y = linear(x, qt, backend=backend)
    assert bool(((y.double() - y_ref.double()).abs() <= weight_only_tolerance(x, qt, y_ref, backend)).all())
