"""The triton backend against the reference, run on the CPU by Triton's interpreter
(TRITON_INTERPRET=1, set in conftest.py; CI has no GPU) at small shapes: bit-exact where
the reference is integer or elementwise, derived tolerances for the float matmuls."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("triton")

from lowbit.kernels.triton import backend as tb  # noqa: E402
from lowbit.kernels.triton import weight_only  # noqa: E402
import lowbit  # noqa: E402
from lowbit import kernels  # noqa: E402
from lowbit.kernels import reference  # noqa: E402
from lowbit.ops import (dequantize_accumulator, dequantize_per_token, linear, linear_qta8a_qga4w_qta8o,  # noqa: E402
                        quantize_per_token, quantized_matmul)

from .conftest import gen  # noqa: E402
from .test_matmul import (QTA8O_CASES, UNIT, _assert_ties_only, _qta8o_case,  # noqa: E402
                          abs_products, gamma)

pytestmark = pytest.mark.skipif(not tb.INTERPRET, reason="TRITON_INTERPRET is off: these tests run the kernels "
                                "on CPU tensors through Triton's interpreter")

T = "triton"
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


# -- weight-only matmuls (W4A16, W8A16) --------------------------------------------------------
def triton_weight_only_tolerance(x, qt, y_ref):
    """Both results are within gamma_{2K+16} * A of the exact float64 value (A =
    abs_products: every partial sum either side forms, (q - z) s x or s (q.x - z sum x),
    is bounded by it; codes and 16-bit x are exact tl.dot operands, so only float32 sums
    and scalings round).  float32 x goes to the tensor cores as tf32x3 on a GPU: its
    lost tail |x - hi - lo| <= 2^-21 |x| adds 2^-21 * A.  Each output is rounded once to
    x's dtype (u_out * |y| on each side)."""
    k = x.shape[-1]
    a = abs_products(x, qt)
    u_in = 2.0**-21 if x.dtype == torch.float32 else 0.0
    return 2 * gamma(2 * k + 16) * a + u_in * a + 2 * UNIT[x.dtype] * y_ref.double().abs().reshape(a.shape) + 1e-30


WEIGHT_SCHEMES = ["int8-sym", "int8-sym-g64", "int8-asym-g32", "int4-sym-g32", "int4-sym-g128", "int4-asym-g64",
                  "int4-asym-channel", "int4-asym-g32-zpfloat-f16", "int4-sym-g64-bf16", "int4-asym-g64-u8",
                  "int4-sym-tensor", "int2-asym-g64"]


@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_weight_only_linear_matches_the_reference(scheme, dtype, m):
    qt = lowbit.quantize(torch.randn(48, 256), scheme)
    x = torch.randn(m, 256).to(dtype)
    y_ref = linear(x, qt, backend="reference")
    y = linear(x, qt, backend=T)
    assert y.dtype == dtype and y.shape == (m, 48)
    err = (y.double() - y_ref.double()).abs()
    assert bool((err <= triton_weight_only_tolerance(x, qt, y_ref)).all()), float(err.max())


@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int4-sym-channel", "int8-asym-channel", "int4-sym-g32"])
@pytest.mark.parametrize("m", [1, 3])
def test_weight_only_k576_tail_tiles(scheme, m):
    # K = 576 = 4 * 128 + 64: a partial last K tile (GEMV) and a per-channel group that
    # no power-of-two tile divides.
    qt = lowbit.quantize(torch.randn(40, 576), scheme)
    x = torch.randn(m, 576).to(torch.bfloat16)
    y_ref = linear(x, qt, backend="reference")
    err = (linear(x, qt, backend=T).double() - y_ref.double()).abs()
    assert bool((err <= triton_weight_only_tolerance(x, qt, y_ref)).all()), float(err.max())


@pytest.mark.parametrize("scheme", ["int4-asym-g128", "int8-sym"])
def test_decode_gemv_splits_k_and_adds_the_splits_in_order(scheme):
    n, k = 16, 4096
    assert weight_only.split_k(n, k, torch.device("cpu")) > 1  # the split path is what runs
    qt = lowbit.quantize(torch.randn(n, k), scheme)
    x = torch.randn(1, k)
    y_ref = linear(x, qt, backend="reference")
    y = linear(x, qt, backend=T)
    assert bool(((y.double() - y_ref.double()).abs() <= triton_weight_only_tolerance(x, qt, y_ref)).all())
    assert torch.equal(linear(x, qt, backend=T), y)  # no atomics: the same bits every run


@pytest.mark.parametrize("scheme", ["int8-sym-g32", "int4-asym-g64", "int4-sym-channel", "int4-asym-g32-zpfloat"])
def test_quantized_matmul_raw_api_equals_linear_and_writes_out(scheme):
    qt = lowbit.quantize(torch.randn(24, 128), scheme)
    x = torch.randn(2, 3, 128)
    s = qt.scheme
    group = s.group_size or 128
    scales = qt.scale.reshape(24, -1)
    zps = None if qt.zero_point is None else qt.zero_point.reshape(24, -1)
    y = quantized_matmul(x, qt.codes, scales, zps, bits=s.bits, group_size=group, backend=T)
    assert y.shape == (2, 3, 24) and torch.equal(y, linear(x, qt, backend=T))
    out = torch.empty(2, 3, 24)
    assert quantized_matmul(x, qt.codes, scales, zps, bits=s.bits, group_size=group, out=out, backend=T) is out
    assert torch.equal(out, y)


def test_weight_only_zero_rows_and_float64_fall_back():
    qt = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
    assert linear(torch.empty(0, 64, dtype=torch.bfloat16), qt, backend=T).shape == (0, 16)
    x = torch.randn(3, 64, dtype=torch.float64)  # no float64 tensor-core path: the reference runs
    assert torch.equal(linear(x, qt, backend=T), linear(x, qt, backend="reference"))


# -- W8A8 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", ["int8-sym-token", "int8-asym-token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 17, 64])
def test_w8a8_linear_is_bit_exact_with_the_reference(act, dtype, m):
    qt = lowbit.quantize(torch.randn(96, 320), "int8-sym")
    x = torch.randn(m, 320).to(dtype)
    bias = torch.randn(96)
    assert torch.equal(linear(x, qt, bias, act_scheme=act, backend=T),
                       linear(x, qt, bias, act_scheme=act, backend="reference"))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 40])
def test_fused_w8a8_epilogue_is_bit_exact_with_the_unfused_ops(out_dtype, zero_point, bias, m):
    g = gen(m)
    n, k = 72, 200  # K = 3 * 64 + 8: a masked tail tile
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    row, col = torch.rand(m, generator=g) * 0.01, torch.rand(n, generator=g).to(torch.bfloat16)
    azp = torch.randint(-256, 128, (m,), generator=g, dtype=torch.int32) if zero_point else None
    bvec = torch.randn(n, generator=g) if bias else None
    acc = reference.int8_mm(a, b)
    if zero_point:
        acc = acc - azp[:, None] * b.sum(dim=1, dtype=torch.int32)[None, :]
    expected = reference.dequantize_accumulator_rowcol(acc, row, col, out_dtype)
    if bias:
        expected = expected + bvec.to(out_dtype)
    assert torch.equal(tb.int8_linear(a, azp, b, row, col, bvec, out_dtype), expected)


@pytest.mark.parametrize("values", ["random", "extreme"])
@pytest.mark.parametrize("m, n, k", [(1, 8, 64), (17, 40, 200), (16, 16, 4096)])
def test_int8_mm_is_the_exact_int32_product(values, m, n, k):
    g = gen(k)
    if values == "extreme":  # |sum| = 128 * 128 * K: int32 headroom at K = 4096 is 2^26 of 2^31
        a = torch.full((m, k), -128, dtype=torch.int8)
        b = torch.where(torch.rand(n, k, generator=g) < 0.5, -128, 127).to(torch.int8)
    else:
        a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    out = kernels.module(T).int8_mm(a, b)
    assert out.dtype == torch.int32 and torch.equal(out, reference.int8_mm(a, b))


# -- W4A8: requirement D -------------------------------------------------------------------------
# The cases of tests/test_matmul.py, fewer at large K (the interpreter runs a K loop in
# Python): K = 16384 keeps int32 headroom (extreme values) at g128, with and without zero points.
TRITON_QTA8O_CASES = [c for c in QTA8O_CASES if c[2] <= 512 or (c[2] == 4096 and c[3] != 64 and c[4] != "zero")
                      or (c[2] == 16384 and c[3] == 128 and c[4] != "zero" and c[5] == "extreme")]


@pytest.mark.parametrize("m, n, k, group, zp, values", TRITON_QTA8O_CASES)
def test_w4a8_qta8o_agrees_with_the_reference_up_to_ties(m, n, k, group, zp, values):
    args = _qta8o_case(m, n, k, group, zp, values, seed=m * 1000 + k + group)
    ref = linear_qta8a_qga4w_qta8o(*args, backend="reference")
    _assert_ties_only(args, ref, linear_qta8a_qga4w_qta8o(*args, backend=T))
    # The fused kernel (requantization in its epilogue) meets the same rule.
    x_q, x_scale, x_zp, w_packed, w_scales, w_zp, group, out_scale, out_zp, bias = args
    fused = tb.linear_qta8a_qga4w_qta8o(x_q, x_scale, x_zp, w_packed, w_scales, w_zp, group, out_scale, out_zp,
                                        bias)
    _assert_ties_only(args, ref, fused)


def test_w4a8_linear_float_output_matches_the_reference():
    qt = lowbit.quantize(torch.randn(40, 256), "int4-asym-g64")
    x = torch.randn(6, 256)
    y_ref = linear(x, qt, act_scheme="int8-asym-token", backend="reference")
    y = linear(x, qt, act_scheme="int8-asym-token", backend=T)
    q, s, z = quantize_per_token(x)
    x_hat = dequantize_per_token(q, s, z)
    # Both sides: gamma_{K+3} * sum|terms| from the float32 sums and scalings.
    tol = 2 * gamma(256 + 3) * abs_products(x_hat, qt) + 1e-30
    assert bool(((y.double() - y_ref.double()).abs() <= tol).all())


# -- dequantize, per token, accumulators: bit-exact -----------------------------------------------
@pytest.mark.parametrize("scheme", ["int8-sym", "int8-asym-g32", "int8-sym-tensor", "int8-asym-token-bf16",
                                    "int4-sym-g32", "int4-asym-g64-u8", "int4-asym-g32-zpfloat-f16",
                                    "int4-asym-channel", "int2-asym-g64", "int2-sym-g32-u8", "int3-asym-g64"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_dequantize_is_bit_exact_with_the_reference(scheme, dtype):
    qt = lowbit.quantize(torch.randn(3, 20, 128), scheme) if "channel" not in scheme else \
        lowbit.quantize(torch.randn(20, 128), scheme)
    assert torch.equal(lowbit.dequantize(qt, dtype, backend=T), lowbit.dequantize(qt, dtype, backend="reference"))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("qdtype", [torch.int8, torch.uint8])
def test_dequantize_per_token_is_bit_exact_with_the_reference(dtype, qdtype):
    lo, hi = (-128, 128) if qdtype == torch.int8 else (0, 256)
    q = torch.randint(lo, hi, (33, 257), dtype=qdtype)
    zp = torch.randint(lo, hi, (33,), dtype=torch.int32)
    scale = torch.rand(33, dtype=dtype)
    assert torch.equal(dequantize_per_token(q, scale, zp, backend=T),
                       dequantize_per_token(q, scale, zp, backend="reference"))


@given(n=st.integers(0, 6), d=st.integers(0, 300), dtype=st.sampled_from(FLOATS),
       bits=st.sampled_from([2, 4, 7, 8]), symmetric=st.booleans(), seed=st.integers(0, 2**31),
       magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]), zero_row=st.booleans())
def test_quantize_per_token_is_bit_exact_with_the_reference(n, d, dtype, bits, symmetric, seed, magnitude,
                                                            zero_row):
    x = torch.randn(n, d, generator=gen(seed), dtype=torch.float64) * magnitude
    if zero_row and n:
        x[0] = 0
    x = x.to(dtype)
    ref = quantize_per_token(x, bits, symmetric, backend="reference")
    fast = quantize_per_token(x, bits, symmetric, backend=T)
    for a, b in zip(ref, fast):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_quantize_per_token_refuses_non_finite_input():
    x = torch.randn(4, 64)
    x[2, 17] = float("nan")
    with pytest.raises(ValueError, match=r"x contains NaN or Inf \(first at index \[2, 17\]"):
        quantize_per_token(x, backend=T)


@given(m=st.integers(0, 5), groups=st.integers(1, 3), group_size=st.sampled_from([1, 3, 32, 128]),
       per_row=st.booleans(), out_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       scale_dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31))
def test_dequantize_accumulator_grouped_is_bit_exact(m, groups, group_size, per_row, out_dtype, scale_dtype, seed):
    g = gen(seed)
    n = groups * group_size
    acc = torch.randint(-2**31, 2**31 - 1, (m, n), generator=g, dtype=torch.int32)
    scale = (torch.rand((m, groups) if per_row else (groups,), generator=g) * 1e-6).to(scale_dtype)
    assert torch.equal(dequantize_accumulator(acc, scale, group_size, out_dtype=out_dtype, backend=T),
                       dequantize_accumulator(acc, scale, group_size, out_dtype=out_dtype, backend="reference"))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # float16 outputs saturate to inf
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_dequantize_accumulator_rowcol_is_bit_exact(out_dtype, lead):
    acc = torch.randint(-2**31, 2**31 - 1, (*lead, 300), dtype=torch.int32)
    row, col = torch.rand(lead) * 0.01, torch.rand(300).to(torch.bfloat16)
    kw = dict(row_scale=row, col_scale=col, out_dtype=out_dtype)
    assert torch.equal(dequantize_accumulator(acc, backend=T, **kw), dequantize_accumulator(acc, backend="reference", **kw))


# -- selection and errors --------------------------------------------------------------------------
def test_triton_is_chosen_for_cuda_and_only_by_name_on_the_cpu():
    assert "triton" in kernels.available_backends("cuda")
    assert "triton" not in kernels.available_backends("cpu")  # interpreter mode never becomes the default
    assert kernels.resolve(None, torch.device("cuda")) == "triton"
    assert kernels.resolve("triton", torch.device("cpu")) == "triton"  # interpreter mode: by name


def test_triton_on_cpu_tensors_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernels.triton_kernels, "interpreting", lambda: False)
    with pytest.raises(ValueError, match=r"backend='triton' is not available for tensors on cpu.*CUDA tensors"
                                         r".*TRITON_INTERPRET=1"):
        linear(torch.randn(2, 64), lowbit.quantize(torch.randn(16, 64), "int4-sym-g32"), backend="triton")


def test_import_lowbit_needs_no_triton_and_asking_for_it_names_the_cause():
    # A fresh interpreter: lowbit imports without importing triton; then `import triton`
    # is made to fail, as on a machine without it.
    code = (
        "import sys, torch, lowbit\n"
        "assert 'triton' not in sys.modules\n"
        "sys.modules['triton'] = None\n"
        "from lowbit import kernels\n"
        "assert kernels.available_backends('cuda') == ['reference'], kernels.available_backends('cuda')\n"
        "qt = lowbit.quantize(torch.randn(8, 32), 'int4-sym-g32')\n"
        "assert lowbit.linear(torch.randn(1, 32), qt).shape == (1, 8)\n"
        "try:\n"
        "    kernels.resolve('triton', torch.device('cuda'))\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "backend='triton' is not available for tensors on cuda" in out.stdout
    assert "pip install triton" in out.stdout
