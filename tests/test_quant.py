"""quantize / dequantize / choose_qparams / fake_quantize: properties of the
conventions in lowbit.scheme, on every backend."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowbit
from lowbit import QuantScheme
from lowbit.kernels import reference
from lowbit.ops import choose_qparams, fake_quantize

from .conftest import BACKENDS, FAST_BACKENDS, gen
from .test_scheme import schemes

X_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@st.composite
def cases(draw):
    """A scheme and an input it accepts: random values over a random magnitude, with
    some all-zero and constant rows mixed in."""
    s = draw(schemes())
    k = (s.group_size or s.pack_unit) * draw(st.integers(1, 3))
    k = math.lcm(k, s.pack_unit)
    shape = (draw(st.integers(1, 6)), k) if draw(st.booleans()) else (draw(st.integers(1, 3)), 2, k)
    dtype = draw(st.sampled_from(X_DTYPES))
    magnitude = 10.0 ** draw(st.integers(-4, 4))
    x = torch.randn(shape, generator=gen(draw(st.integers(0, 2**31))), dtype=torch.float64) * magnitude
    if draw(st.booleans()):
        x[0] = 0.0
    if draw(st.booleans()):
        x[-1] = 3.0 * magnitude
    if draw(st.booleans()):
        x = x.abs() + magnitude  # all positive: the asymmetric range no longer centred
    return s, x.to(dtype)


def error_bound(s: QuantScheme, scale: torch.Tensor, zero_point) -> torch.Tensor:
    """Largest |x - dequantize(quantize(x))| for x inside the range, per block.

    Exact arithmetic gives scale/2 (round to nearest).  float32 adds: x/scale and
    (q - z)*scale are each rounded once, relative error 2^-24 on values of at most
    2^bits codes, so 2 * 2^bits * 2^-24 codes; a float zero point is stored in
    scale_dtype, which shifts the grid by up to half its ulp (codes).
    """
    slack = 2 * 2.0**s.bits * 2.0**-24
    if zero_point is not None and zero_point.is_floating_point():
        ulp = torch.finfo(zero_point.dtype).eps * zero_point.double().abs().clamp(min=1)
        slack = slack + ulp / 2
    return scale.double() * (0.5 + slack)


def blocks_of(t, s):
    return reference.to_blocks(t, s)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=cases())
def test_round_trip_error_is_at_most_half_a_step(backend, case):
    s, x = case
    qt = lowbit.quantize(x, s, backend=backend)
    y = lowbit.dequantize(qt, torch.float64 if x.dtype == torch.float64 else torch.float32,
                          backend=backend)
    err = blocks_of((y.double() - x.double()).abs(), s).amax(dim=1)
    bound = error_bound(s, qt.scale, qt.zero_point).reshape(-1)
    assert bool((err <= bound).all()), f"{s}: worst error/scale {(err / qt.scale.double().reshape(-1)).max()}"


@pytest.mark.parametrize("backend", BACKENDS)
@given(s=schemes(), seed=st.integers(0, 2**31))
def test_values_on_the_grid_round_trip_exactly(backend, s, seed):
    g = gen(seed)
    shape = (3, math.lcm(s.group_size or 1, s.pack_unit) * 2)
    sshape = s.scale_shape(shape)
    scale = (torch.rand(sshape, generator=g) * 2 + 0.01).to(s.scale_dtype)
    q = torch.randint(s.qmin, s.qmax + 1, shape, generator=g)
    zp = None
    if not s.symmetric:
        if s.zero_point_domain == "int":
            zp = torch.randint(s.qmin, s.qmax + 1, sshape, generator=g).to(s.zero_point_dtype)
        else:
            zp = (torch.rand(sshape, generator=g) * s.qmax).to(s.scale_dtype)
    x = reference.dequantize(q, scale, zp, s, torch.float32)
    qt = lowbit.quantize(x, s, scale, zp, backend=backend)
    assert torch.equal(lowbit.ops.unpack_bits(qt.codes, s.bits, s.packing, signed=s.symmetric).long()
                       if s.is_packed else qt.codes.long(), q)
    assert torch.equal(lowbit.dequantize(qt, backend=backend), x)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("out_dtype", X_DTYPES)
@given(case=cases())
def test_fast_backends_are_bit_exact_with_the_reference(backend, out_dtype, case):
    s, x = case
    ref = lowbit.quantize(x, s, backend="reference")
    fast = lowbit.quantize(x, s, backend=backend)
    assert torch.equal(ref.codes, fast.codes)
    assert torch.equal(lowbit.dequantize(ref, out_dtype, backend="reference"),
                       lowbit.dequantize(ref, out_dtype, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_the_written_formula_bit_for_bit(backend, out_dtype):
    s = QuantScheme.parse("int4-asym-g32-zpfloat-bf16")
    x = torch.randn(8, 128)
    qt = lowbit.quantize(x, s)
    q = lowbit.ops.unpack_bits(qt.codes, 4, signed=False).float().reshape(8, 4, 32)
    expected = ((q - qt.zero_point.float()[..., None]) * qt.scale.float()[..., None]).to(out_dtype)
    assert torch.equal(lowbit.dequantize(qt, out_dtype, backend=backend), expected.reshape(8, 128))


def test_scale_rounded_to_bfloat16_never_clips_the_range():
    # max|x| / 7.5 rounded to nearest bf16 may land below the true scale; lowbit rounds up.
    x = torch.tensor([[1.0, -0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9999]]) * 1.00390625
    scale, _ = choose_qparams(x, "int4-sym-g8-bf16")
    assert scale.float().item() >= x.abs().max().item() / 7.5


def test_all_zero_groups_get_a_finite_nonzero_scale():
    x = torch.zeros(4, 64)
    x[1, :32] = torch.randn(32)
    for s in ["int4-sym-g32", "int4-asym-g32", "int4-asym-g32-zpfloat", "int8-sym-tensor"]:
        scale, _ = choose_qparams(x, s)
        assert bool(torch.isfinite(scale).all() and (scale > 0).all()), s
        assert torch.equal(lowbit.dequantize(lowbit.quantize(x, s))[0], x[0])


def test_asymmetric_int_zero_point_represents_zero_exactly():
    x = torch.rand(4, 64) * 5 + 1  # all positive: zero is still on the grid
    qt = lowbit.quantize(x, "int8-asym-g32")
    assert bool(((qt.zero_point >= 0) & (qt.zero_point <= 255)).all())
    z = lowbit.quantize(torch.zeros(4, 64), "int8-asym-g32", qt.scale, qt.zero_point)
    assert bool((lowbit.dequantize(z) == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("s", ["int4-asym-g32", "int8-sym", "int8-asym-token", "int3-sym-tensor"])
@pytest.mark.parametrize("shape", [(0, 64), (4, 0), (0,)])
def test_zero_sized_inputs_are_a_no_op(backend, s, shape):
    scheme = QuantScheme.parse(s)
    if scheme.granularity == "group" and shape[-1]:
        return
    x = torch.empty(shape)
    qt = lowbit.quantize(x, scheme, backend=backend)
    y = lowbit.dequantize(qt, backend=backend)
    assert y.shape == x.shape and y.numel() == 0


def test_non_contiguous_inputs_give_the_contiguous_result():
    x = torch.randn(64, 128)
    for s in ["int4-sym-g32", "int8-asym-token", "int8-sym"]:
        a = lowbit.quantize(x.t().contiguous(), s)
        b = lowbit.quantize(x.t(), s)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


def test_qtensor_nbytes_and_to():
    qt = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
    assert qt.nbytes == 16 * 64 // 2 + 16 * 2 * 4 + 16 * 2  # codes, float32 scales, uint8 zero points
    assert torch.equal(lowbit.dequantize(qt.to("cpu")), lowbit.dequantize(qt))


def test_fake_quantize_is_dequantize_of_quantize_with_straight_through_gradient():
    x = torch.randn(4, 64, requires_grad=True)
    y = fake_quantize(x, "int4-asym-g32")
    assert torch.equal(y, lowbit.dequantize(lowbit.quantize(x.detach(), "int4-asym-g32")))
    y.backward(torch.arange(256.0).reshape(4, 64))
    # Dynamic scales cover every value; only an extreme whose code rounds half a step
    # past qmax can be clamped (round(7.5) = 8 for symmetric int4).
    passed = x.grad == torch.arange(256.0).reshape(4, 64)
    assert bool((passed | (x.grad == 0)).all()) and int(passed.sum()) >= 256 - 8


def test_fake_quantize_gradient_is_zero_where_values_are_clamped():
    x = torch.tensor([[-3.0, -0.5, 0.0, 0.5, 1.0, 3.0, 0.25, 0.75]], requires_grad=True)
    scale = torch.tensor([[0.125]])  # codes [-8, 7] cover [-1, 0.875]: -3, 1 and 3 are clamped
    fake_quantize(x, "int4-sym-g8", scale).sum().backward()
    assert x.grad.tolist() == [[0, 1, 1, 1, 0, 0, 1, 1]]
