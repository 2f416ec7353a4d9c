"""lowbit.linear's eager shortcut for one row (``ops.matmul._one_row``): the weight's
prepared one-row kernel (``Backend.one_row``; on CPU the decode step's projection) gives
the bits of the general path, which ``backend="cpu"`` forces, and steps aside wherever
that path must run (autograd, tracing, a weight changed in place, bad input)."""

import pytest
import torch

import lowbit
from lowbit.kernels import cpu
from lowbit.nn import QuantLinear
from lowbit.ops import matmul

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no lowbit._C here")

CASES = [  # (weight scheme, activation scheme)
    ("int8-sym", None), ("int8-asym-g64", None), ("int4-sym-g32", None), ("int4-asym-g64", None),
    ("int4-sym-g32-f16", None), ("int4-asym-g32-zpmin-f16", None), ("int4-asym-g32-zpfloat-f16", None),
    ("int8-sym", "int8-sym-token"), ("int8-sym", "int8-asym-token"), ("int4-asym-g64", "int8-asym-token"),
    ("int4-sym-g32", "int8-sym-token"), ("int4-sym-g32-f16", "int8-sym-g32"), ("int8-sym-g32-f16", "int8-sym-g32"),
]


def _prepared(qt) -> dict:
    return matmul._PARTS[id(qt)][3]


@pytest.mark.parametrize("scheme, act", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(192,), (1, 192), (1, 1, 192)])
def test_one_row_gives_the_bits_of_the_general_path(scheme, act, dtype, shape):
    g = torch.Generator().manual_seed(len(scheme) * 7 + len(shape))
    qt = lowbit.quantize(torch.randn(48, 192, generator=g), scheme)
    bias = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(shape, generator=g).to(dtype)
    with torch.inference_mode():
        for b in (None, bias):
            y = lowbit.linear(x, qt, b, act_scheme=act)
            general = lowbit.linear(x, qt, b, act_scheme=act, backend="cpu")  # no shortcut with a backend named
            assert y.dtype == dtype and y.shape == (*shape[:-1], 48)
            assert torch.equal(y, general)
    # the shortcut ran: the weight holds its prepared kernel for this dtype and scheme
    assert any(run is not None for (dt, a, *_), run in _prepared(qt).items() if dt == dtype and a == act)


def test_one_row_follows_a_weight_changed_in_place():
    qt = lowbit.quantize(torch.randn(32, 64), "int8-sym")
    x = torch.randn(1, 64)
    with torch.no_grad():
        before = lowbit.linear(x, qt)
        qt.scale.mul_(2)  # a version counter moves: the prepared kernel is made again
        after = lowbit.linear(x, qt)
    assert torch.equal(after, 2 * before)  # a power of two: exactly
    assert torch.equal(after, lowbit.linear(x, qt, backend="cpu"))


def test_one_row_steps_aside_for_autograd_and_two_rows():
    lin = QuantLinear.from_linear(torch.nn.Linear(64, 16), "int4-asym-g32")
    x = torch.randn(1, 64, requires_grad=True)
    y = lin(x)  # grad mode: the general path, whose op has a backward
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert id(lin.qweight) not in matmul._PARTS or not _prepared(lin.qweight)
    with torch.inference_mode():
        two = lin(torch.randn(2, 64))  # two rows: the general path's plan for two rows
    assert two.shape == (2, 16) and not _prepared(lin.qweight)


def test_one_row_leaves_bad_input_to_the_general_path():
    qt = lowbit.quantize(torch.randn(16, 64), "int4-sym-g32-f16")
    with torch.inference_mode():
        x = torch.randn(1, 64)
        x[0, 3] = float("nan")
        with pytest.raises(ValueError, match="NaN or Inf"):  # int8 activations of a NaN: named, as before
            lowbit.linear(x, qt, act_scheme="int8-sym-g32")
        with pytest.raises(ValueError, match="does not match qweight in_features"):
            lowbit.linear(torch.randn(1, 63), qt)
        with pytest.raises(ValueError, match="bias"):
            lowbit.linear(torch.randn(1, 64), qt, torch.randn(15))


def test_one_row_is_prepared_again_after_a_new_calibration():
    qt = lowbit.quantize(torch.randn(16, 64), "int8-sym")
    x = torch.randn(1, 64)
    with torch.inference_mode():
        lowbit.linear(x, qt)
        epoch = cpu.CpuBackend.plan_epoch
        cpu.clear_plans()  # what calibration.apply does after changing a threshold
        assert cpu.CpuBackend.plan_epoch == epoch + 1
        y = lowbit.linear(x, qt)
    assert {key[3] for key in _prepared(qt)} == {epoch, epoch + 1}
    assert torch.equal(y, lowbit.linear(x, qt, backend="cpu"))


def test_quant_linear_module_takes_the_shortcut_with_its_bias():
    lin = torch.nn.Linear(64, 16)
    q = QuantLinear.from_linear(lin, "int8-sym", act_scheme="int8-asym-token")
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = q(x)
        general = lowbit.linear(x, q.qweight, q.bias, act_scheme="int8-asym-token", backend="cpu")
    assert torch.equal(y, general) and _prepared(q.qweight)
