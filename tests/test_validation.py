"""Bad input to quantize / dequantize / choose_qparams: a clear error that names the
argument, raised before any work."""

import pytest
import torch

import lowbit
from lowbit.ops import choose_qparams, fake_quantize

X = torch.randn(4, 64)


@pytest.mark.parametrize("call, err, match", [
    (lambda: lowbit.quantize(X.to(torch.int32), "int8-sym"), TypeError, "x must have dtype"),
    (lambda: lowbit.quantize([1.0, 2.0], "int8-sym"), TypeError, "x must be a torch.Tensor"),
    (lambda: lowbit.quantize(torch.tensor(1.0), "int8-sym-tensor"), ValueError, "x must have at least 1"),
    (lambda: lowbit.quantize(X, "int4-sym-g48"), ValueError, "group_size=48 .* does not divide x.shape"),
    (lambda: lowbit.quantize(X[:, :60], "int4-sym-channel"), ValueError, "multiple of 8"),
    (lambda: lowbit.quantize(X, "int5-sym"), ValueError, "QuantScheme.bits"),
    (lambda: lowbit.quantize(X, 4), TypeError, "scheme must be a QuantScheme"),
    (lambda: lowbit.quantize(X, "int8-sym", backend="tpu"), ValueError, "backend"),
    (lambda: lowbit.quantize(torch.tensor([[1.0, float("nan")]] * 4), "int8-sym"), ValueError, "x contains NaN"),
    (lambda: lowbit.quantize(torch.tensor([[1.0, float("-inf")]] * 4), "int8-sym"), ValueError, "x contains NaN"),
    (lambda: lowbit.quantize(X * 1e8, "int8-sym-f16"), ValueError, "scale of a block overflows torch.float16"),
    # static quantization: given scale / zero point
    (lambda: lowbit.quantize(X, "int8-sym", torch.ones(3)), ValueError, "scale must have shape"),
    (lambda: lowbit.quantize(X, "int8-sym", torch.ones(4, dtype=torch.float16)), TypeError, "scale must have dtype"),
    (lambda: lowbit.quantize(X, "int8-sym", torch.ones(4), torch.zeros(4, dtype=torch.uint8)), ValueError,
     "zero_point must be None"),
    (lambda: lowbit.quantize(X, "int8-asym", torch.ones(4)), ValueError, "zero_point is required"),
    (lambda: lowbit.quantize(X, "int8-asym", torch.ones(4), torch.zeros(4)), TypeError, "zero_point must have dtype"),
    (lambda: lowbit.quantize(X, "int8-asym", torch.ones(4), torch.zeros(2, dtype=torch.uint8)), ValueError,
     "zero_point must have shape"),
    (lambda: lowbit.quantize(X, "int8-sym", zero_point=torch.zeros(4)), ValueError, "without scale"),
    (lambda: lowbit.quantize(X, "int8-sym", torch.ones(4, device="meta")), ValueError, "scale is on meta"),
    (lambda: lowbit.dequantize(X), TypeError, "qt must be a lowbit.QTensor"),
    (lambda: lowbit.dequantize(lowbit.quantize(X, "int8-sym"), torch.int8), TypeError, "dtype must be one of"),
    (lambda: choose_qparams(X, "int4-sym-g48"), ValueError, "group_size=48"),
    (lambda: fake_quantize(X.long(), "int8-sym"), TypeError, "x must have dtype"),
])
def test_bad_arguments_name_the_argument(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_inconsistent_qtensor_is_refused_when_built():
    qt = lowbit.quantize(X, "int4-asym-g32")
    good = dict(codes=qt.codes, scale=qt.scale, zero_point=qt.zero_point, scheme=qt.scheme, shape=qt.shape)
    for change, match in [
        (dict(codes=qt.codes[:, :4]), "codes must have shape"),
        (dict(codes=qt.codes.to(torch.uint8)), "codes must have dtype"),
        (dict(scale=qt.scale[:, :1]), "scale must have shape"),
        (dict(zero_point=None), "zero_point is required"),
        (dict(zero_point=qt.zero_point.to(torch.int32)), "zero_point must have dtype"),
        (dict(shape=torch.Size([4, 128])), "codes must have shape"),
        (dict(scheme="int4-asym-g32"), "scheme must be a QuantScheme"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            lowbit.QTensor(**{**good, **change})
