"""The lowbit::* custom ops: torch.library.opcheck, torch.compile(fullgraph=True)
and torch.export."""

import warnings

import pytest
import torch

import lowbit
import lowbit.passes  # noqa: F401  (defines lowbit::observe_range, the calibration observer)
from lowbit.kernels import use_backend
from lowbit.ops import library
from lowbit.ops import dequantize_accumulator, dequantize_per_token, quantize_per_token

from .conftest import BACKENDS

ops = torch.ops.lowbit


def _samples():
    x = torch.randn(4, 64)
    for s in ["int4-asym-g32", "int8-sym", "int3-sym-g32", "int4-asym-g32-zpfloat-f16"]:
        scale, zp = ops.choose_qparams(x, s)
        zp = None if "-sym" in s else zp
        yield "choose_qparams", (x, s)
        codes = ops.quantize(x, scale, zp, s)
        yield "quantize", (x, scale, zp, s)
        yield "dequantize", (codes, scale, zp, s, [4, 64], torch.bfloat16)
    q = torch.randint(-8, 8, (3, 16), dtype=torch.int8)
    yield "pack", (q, 4, "u32")
    yield "unpack", (ops.pack(q, 4, "u8"), 4, "u8", True)
    yield "dequantize_accumulator", (torch.randint(-99, 99, (3, 64), dtype=torch.int32),
                                     torch.rand(2), 32, None, None, torch.bfloat16)
    yield "dequantize_accumulator", (torch.randint(-99, 99, (3, 64), dtype=torch.int32), None, 0,
                                     torch.rand(3), torch.rand(64), torch.float16)
    qt, st, zt = quantize_per_token(torch.randn(3, 16, dtype=torch.float64))
    yield "dequantize_per_token", (qt, st.requires_grad_(), zt)
    yield "quantize_per_token", (torch.randn(3, 16), 8, False)
    yield "quantize_per_token", (torch.randn(3, 16, dtype=torch.bfloat16), 4, True)
    w4 = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
    w8 = lowbit.quantize(torch.randn(16, 64), "int8-sym")
    xq = torch.randint(-128, 128, (3, 64), dtype=torch.int8)
    for dt in (torch.float32, torch.bfloat16):
        yield "weight_only_matmul", (torch.randn(3, 64, dtype=dt), w4.codes, w4.scale, w4.zero_point, 4, 32)
        yield "weight_only_matmul", (torch.randn(1, 64, dtype=dt), w8.codes, w8.scale[:, None], None, 8, 64)
    yield "int8_mm", (xq, w8.codes)
    for dt in (torch.float32, torch.bfloat16):
        yield "linear_a8_blocks", (torch.randn(3, 64, dtype=dt), w4.codes, w4.scale, w4.zero_point, 4, 32, 32)
        yield "linear_a8_blocks", (torch.randn(2, 64, dtype=dt), w8.codes, w8.scale[:, None], None, 8, 64, 32)
    for zp, bias, dt in [(None, None, torch.bfloat16), (torch.randint(-9, 9, (3,), dtype=torch.int32),
                                                        torch.randn(16), torch.float32)]:
        yield "int8_linear", (xq, zp, w8.codes, torch.rand(3), w8.scale, bias, dt)
    x_args = (xq, torch.rand(3), torch.randint(-5, 5, (3,), dtype=torch.int32), w4.codes, w4.scale,
              w4.zero_point, 32)
    yield "linear_qta8a_qga4w", (*x_args, torch.randn(16))
    yield "linear_qta8a_qga4w_qta8o", (*x_args, torch.rand(3) + 0.5, torch.zeros(3, dtype=torch.int32), None)
    xs = torch.randn(4, 64, requires_grad=True)
    yield "fake_quantize", (xs, *ops.choose_qparams(xs.detach(), "int4-asym-g32"), "int4-asym-g32")
    yield "fake_quantize", (xs, torch.rand(4) + 0.1, None, "int8-sym")
    yield "observe_range", (torch.randn(3, 16), "opcheck")
    from lowbit.ops.matmul import weight_parts

    st = lowbit.split_quantize(torch.randn(16, 64), "int4-asym-g32", 8, high="int8-asym")
    parts = (*weight_parts(st.low), st.outliers, *weight_parts(st.high))
    yield "split_matmul", (torch.randn(3, 64, requires_grad=True), *parts)
    yield "split_matmul", (torch.randn(1, 64, dtype=torch.bfloat16), *parts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, args", list(_samples()), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, args, backend):
    with use_backend(backend):
        torch.library.opcheck(getattr(ops, name).default, args)


def test_every_registered_op_has_an_opcheck_sample():
    registered = {n for n in dir(ops) if not n.startswith("_") and isinstance(getattr(ops, n), torch._ops.OpOverloadPacket)}
    assert registered == {name for name, _ in _samples()}


def _pipeline(x, w_qt, acc):
    """A W8A8-style chain plus weight dequant: every public op in one function."""
    q, s, z = quantize_per_token(x)
    xd = dequantize_per_token(q, s, z)
    w = lowbit.dequantize(w_qt, torch.float32)
    y = dequantize_accumulator(acc, row_scale=s, col_scale=torch.ones(acc.shape[-1]), out_dtype=torch.float32)
    return xd @ w.t() + y[:, : w.shape[0]], lowbit.quantize(xd, "int4-asym-g32")


def _inputs():
    x = torch.randn(8, 64)
    w_qt = lowbit.quantize(torch.randn(16, 64), "int4-sym-g32")
    acc = torch.randint(-1000, 1000, (8, 32), dtype=torch.int32)
    return x, w_qt, acc


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    args = _inputs()
    eager_y, eager_qt = _pipeline(*args)
    y, qt = torch.compile(_pipeline, fullgraph=True)(*args)
    assert torch.equal(y, eager_y)
    assert torch.equal(qt.codes, eager_qt.codes) and torch.equal(qt.scale, eager_qt.scale)


class Pipeline(torch.nn.Module):
    def forward(self, x, w_qt, acc):
        return _pipeline(x, w_qt, acc)[0]


class QuantizedMLP(torch.nn.Module):
    """W8A8 then W4A16 then W4A8, as a model would chain them."""

    def __init__(self):
        super().__init__()
        self.w1 = lowbit.quantize(torch.randn(64, 32), "int8-sym")
        self.w2 = lowbit.quantize(torch.randn(32, 64), "int4-asym-g32")
        self.w3 = lowbit.quantize(torch.randn(16, 32), "int4-sym-g32")

    def forward(self, x):
        h = torch.relu(lowbit.linear(x, self.w1, act_scheme="int8-sym-token"))
        h = lowbit.linear(h, self.w2)
        return lowbit.linear(h, self.w3, act_scheme="int8-asym-token")


def test_quantized_linears_compile_fullgraph_and_export_by_name():
    torch._dynamo.reset()
    model, x = QuantizedMLP(), torch.randn(5, 32)
    eager = model(x)
    assert torch.equal(torch.compile(model, fullgraph=True)(x), eager)
    code = torch.export.export(model, (x,)).graph_module.code
    for op in ["lowbit.int8_linear", "lowbit.weight_only_matmul", "lowbit.linear_qta8a_qga4w"]:
        assert op in code, op
    calls = [line for line in code.splitlines() if "torch.ops.lowbit." in line]
    assert calls and not any("'cpu'" in c or "'reference'" in c for c in calls)  # what, not where


def test_export_shows_lowbit_ops_by_name():
    args = _inputs()
    ep = torch.export.export(Pipeline(), args)
    code = ep.graph_module.code
    for op in ["lowbit.quantize_per_token", "lowbit.dequantize_per_token", "lowbit.dequantize.",
               "lowbit.dequantize_accumulator"]:
        assert op in code, op
    assert torch.equal(ep.module()(*args), Pipeline()(*args))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_eager_path_gives_the_dispatcher_bits(backend):
    # Where autograd records nothing (torch.inference_mode, torch.no_grad, or no argument
    # that requires grad) the public functions run the ops' implementations without the
    # dispatcher (library._eager); where an argument requires grad the registered ops run.
    w4 = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
    w8 = lowbit.quantize(torch.randn(16, 64), "int8-sym")
    x = torch.randn(3, 64)
    xg = x.clone().requires_grad_()

    def run(x):  # (int8 activations refuse an x that requires grad: that call takes x detached)
        return [lowbit.linear(x, w4, backend=backend), lowbit.linear(x[:1], w4, backend=backend),
                lowbit.linear(x.detach(), w8, act_scheme="int8-asym-token", backend=backend),
                lowbit.dequantize(w4, torch.bfloat16, backend=backend), *quantize_per_token(x, backend=backend)]

    assert library._eager([x]) and not library._eager([xg]) and not library._eager([w4.codes, xg])
    with torch.inference_mode():
        assert library._eager([xg])
        fast = run(x)
    with torch.no_grad():
        assert library._eager([xg])
        fast_no_grad = run(x)
    plain = run(x)
    dispatched = run(xg)
    assert dispatched[0].requires_grad and dispatched[1].requires_grad  # recorded: the dispatcher ran
    assert not any(t.requires_grad for t in plain)
    for a, b, c, d in zip(fast, fast_no_grad, plain, dispatched):
        assert torch.equal(a, d.detach()) and torch.equal(b, d.detach()) and torch.equal(c, d.detach())


def test_one_row_outside_no_grad_records_what_requires_grad():
    # a one-row linear takes the prepared row kernel where nothing requires grad; a bias or
    # x that does gets its gradient through the registered op, the same forward bits
    w = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
    x = torch.randn(1, 64)
    bias = torch.nn.Parameter(torch.randn(16))
    y = lowbit.linear(x, w, bias)
    assert y.requires_grad
    y.sum().backward()
    assert torch.equal(bias.grad, torch.ones(16))
    xg = x.clone().requires_grad_()
    yx = lowbit.linear(xg, w)
    yx.sum().backward()
    assert xg.grad is not None and xg.grad.shape == x.shape
    with torch.no_grad():
        ref = lowbit.linear(x, w, bias)
        ref_x = lowbit.linear(x, w)
    plain = lowbit.linear(x, w)
    assert not plain.requires_grad
    assert torch.equal(y.detach(), ref) and torch.equal(yx.detach(), ref_x) and torch.equal(plain, ref_x)


def test_the_eager_path_stays_off_where_the_op_must_be_seen():
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(3, 64)
    with torch.no_grad():
        with FlopCounterMode(display=False):  # a dispatch mode: it must see lowbit::* by name
            assert not library._eager([x])
    with torch.enable_grad():
        assert not library._eager([x.requires_grad_()])
    # vmap's batched tensors have no storage for a kernel: the registered op runs (its
    # batching fallback, one row at a time), also where autograd records nothing
    w = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
    xs = torch.randn(3, 64)
    for mode in (torch.no_grad, torch.enable_grad):
        with mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no batching rule for lowbit::weight_only_matmul"
            y = torch.func.vmap(lambda r: lowbit.linear(r[None], w))(xs)
        assert torch.equal(y[:, 0], torch.cat([lowbit.linear(r[None], w) for r in xs]))


def test_a_forward_mode_dual_tensor_is_refused_by_name():
    # lowbit's ops have no forward-mode derivative: a dual tensor's tangent would be lost
    # silently, so every public path through the ops refuses it (the one-row fast path too)
    import torch.autograd.forward_ad as fwad

    w = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
    x = torch.randn(3, 64)
    for mode in (torch.enable_grad, torch.no_grad):  # (inference_mode makes no dual tensors)
        with mode(), fwad.dual_level():
            dual = fwad.make_dual(x, torch.randn_like(x))
            for call in (lambda: lowbit.linear(dual, w), lambda: lowbit.linear(dual[:1], w),
                         lambda: lowbit.quantize(dual, "int8-sym"), lambda: quantize_per_token(dual)):
                with pytest.raises(NotImplementedError, match="argument 0 is a forward-mode AD dual tensor"):
                    call()
            plain = lowbit.linear(x, w)  # tensors without a tangent run as before
    assert torch.equal(plain, lowbit.linear(x, w))
