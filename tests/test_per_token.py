"""Per-token quantize / dequantize: strict interface, bit-stable."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowbit.ops import dequantize_per_token, quantize_per_token

from .conftest import BACKENDS, FAST_BACKENDS, gen

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(1, 8), d=st.integers(1, 70), dtype=st.sampled_from(FLOATS),
       bits=st.sampled_from([4, 8]), symmetric=st.booleans(), seed=st.integers(0, 2**31),
       magnitude=st.sampled_from([1e-3, 1.0, 1e3]))
def test_dequantize_inverts_quantize_within_half_a_step(backend, n, d, dtype, bits, symmetric, seed, magnitude):
    x = (torch.randn(n, d, generator=gen(seed), dtype=torch.float64) * magnitude).to(dtype)
    q, scale, zp = quantize_per_token(x, bits, symmetric)
    assert q.dtype == (torch.int8 if symmetric else torch.uint8)
    assert scale.dtype == dtype and zp.dtype == torch.int32 and scale.shape == zp.shape == (n,)
    y = dequantize_per_token(q, scale, zp, backend=backend)
    assert y.dtype == dtype
    # scale/2 from rounding, plus float32 rounding of x/scale and (q - z)*scale (2 * 2^bits
    # codes * 2^-24), plus the final rounding to a 16-bit output type (half an ulp of |y|).
    half_ulp = (torch.finfo(dtype).eps / 2) * y.double().abs()
    bound = scale.double()[:, None] * (0.5 + 2 * 2.0**bits * 2.0**-24) + half_ulp
    assert bool(((y.double() - x.double()).abs() <= bound).all())


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@given(n=st.integers(0, 9), d=st.integers(0, 300), dtype=st.sampled_from(FLOATS),
       bits=st.sampled_from([2, 4, 7, 8]), symmetric=st.booleans(), seed=st.integers(0, 2**31),
       magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]), zero_row=st.booleans())
def test_quantize_per_token_is_bit_exact_across_backends(backend, n, d, dtype, bits, symmetric, seed,
                                                         magnitude, zero_row):
    x = torch.randn(n, d, generator=gen(seed), dtype=torch.float64) * magnitude
    if zero_row and n:
        x[0] = 0
    x = x.to(dtype)
    ref = quantize_per_token(x, bits, symmetric, backend="reference")
    fast = quantize_per_token(x, bits, symmetric, backend=backend)
    for a, b in zip(ref, fast):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_per_token_refuses_non_finite_input_on_every_backend(backend):
    x = torch.randn(4, 64)
    x[2, 17] = float("inf")
    with pytest.raises(ValueError, match=r"x contains NaN or Inf \(first at index \[2, 17\]"):
        quantize_per_token(x, backend=backend)


@pytest.mark.parametrize("dtype", FLOATS)
def test_dequantize_per_token_is_the_written_formula_bit_for_bit(dtype):
    q = torch.randint(0, 256, (16, 100), dtype=torch.uint8)
    zp = torch.randint(0, 256, (16,), dtype=torch.int32)
    scale = (torch.rand(16, dtype=torch.float64) * 0.1).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    expected = ((q.to(torch.int32) - zp[:, None]).to(acc) * scale.to(acc)[:, None]).to(dtype)
    for backend in BACKENDS:
        assert torch.equal(dequantize_per_token(q, scale, zp, backend=backend), expected)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("qdtype", [torch.int8, torch.uint8])
def test_dequantize_per_token_is_bit_exact_across_backends_and_runs(backend, dtype, qdtype):
    lo, hi = (-128, 128) if qdtype == torch.int8 else (0, 256)
    q = torch.randint(lo, hi, (64, 257), dtype=qdtype)
    zp = torch.randint(lo, hi, (64,), dtype=torch.int32)
    scale = torch.rand(64, dtype=dtype)
    ref = dequantize_per_token(q, scale, zp, backend="reference")
    for _ in range(3):
        assert torch.equal(dequantize_per_token(q, scale, zp, backend=backend), ref)


def test_gradient_with_respect_to_scale_passes_gradcheck():
    q = torch.randint(0, 256, (5, 7), dtype=torch.uint8)
    zp = torch.randint(0, 256, (5,), dtype=torch.int32)
    scale = torch.rand(5, dtype=torch.float64, requires_grad=True)
    for backend in BACKENDS:
        assert torch.autograd.gradcheck(lambda s: dequantize_per_token(q, s, zp, backend=backend), (scale,))


def test_zero_sized_input_is_a_no_op():
    q, scale, zp = quantize_per_token(torch.empty(0, 16))
    assert q.shape == (0, 16) and scale.shape == (0,)
    assert dequantize_per_token(q, scale, zp).shape == (0, 16)
    q, scale, zp = quantize_per_token(torch.empty(3, 0))
    assert dequantize_per_token(q, scale, zp).shape == (3, 0)


U8 = torch.zeros(4, 8, dtype=torch.uint8)
S = torch.ones(4)
Z = torch.zeros(4, dtype=torch.int32)


@pytest.mark.parametrize("args, kwargs, err, match", [
    ((U8[0], S, Z), {}, ValueError, "q must be 2-D"),
    ((U8.float(), S, Z), {}, TypeError, "q must have dtype"),
    ((U8.to(torch.int32), S, Z), {}, TypeError, "q must have dtype"),
    ((U8, S[:3], Z), {}, ValueError, "scale must have shape"),
    ((U8, S[:, None], Z), {}, ValueError, "scale must be 1-D"),
    ((U8, S.to(torch.int32), Z), {}, TypeError, "scale must have dtype"),
    ((U8, S, Z[:2]), {}, ValueError, "zero_point must have shape"),
    ((U8, S, Z.to(torch.int64)), {}, TypeError, "zero_point must have dtype"),
    ((U8, S, Z), {"out_dtype": torch.float16}, TypeError, "out_dtype"),
    ((U8, S, Z), {"backend": "gpu"}, ValueError, "backend"),
    ((U8, S, Z.to("meta")), {}, ValueError, "zero_point is on meta"),
])
def test_bad_arguments_are_refused_before_any_work(args, kwargs, err, match):
    with pytest.raises(err, match=match):
        dequantize_per_token(*args, **kwargs)


@pytest.mark.parametrize("x, kwargs, err, match", [
    (torch.randn(4), {}, ValueError, "x must be 2-D"),
    (torch.randint(0, 5, (4, 4)), {}, TypeError, "x must have dtype"),
    (torch.randn(4, 4), {"bits": 9}, ValueError, "bits"),
    (torch.randn(4, 4), {"bits": 1}, ValueError, "bits"),
    (torch.tensor([[1.0, float("nan")]]), {}, ValueError, "x contains NaN or Inf"),
    (torch.tensor([[1.0, float("inf")]]), {}, ValueError, "x contains NaN or Inf"),
])
def test_bad_quantize_per_token_arguments_are_refused(x, kwargs, err, match):
    with pytest.raises(err, match=match):
        quantize_per_token(x, **kwargs)
