"""The ``torch.library`` custom ops of namespace ``lowbit``.

Each op receives arguments the public functions already validated (metadata: shapes,
dtypes, devices), checks what only the values can tell (NaN/Inf, scale overflow),
then runs the chosen backend.  Schemes travel as their string form, so the ops show
up readably in ``torch.export`` graphs: ``lowbit.quantize(x, s, z, 'int4-asym-g64', 'cpu')``.
Each op has a fake (meta) implementation for torch.compile and torch.export.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from .. import _validate, kernels
from ..kernels import reference as ref
from ..scheme import QuantScheme


@lru_cache(maxsize=None)
def scheme_of(text: str) -> QuantScheme:
    return QuantScheme.parse(text)


def packed_last_dim(k, s: QuantScheme):
    return k * s.bits // (32 if s.packing == "u32" else 8) if s.is_packed else k


def _no_zero_point(x: Tensor) -> Tensor:
    return x.new_empty(0, dtype=torch.int32)


def _check_scale(scale: Tensor, dtype: torch.dtype) -> None:
    if scale.numel() and not bool(torch.isfinite(scale).all()):
        raise ValueError(
            f"scale overflows {dtype}: the range of a block is too large for it; "
            "use scale_dtype=torch.float32"
        )


# -- choose_qparams -----------------------------------------------------------------
@torch.library.custom_op("lowbit::choose_qparams", mutates_args=())
def choose_qparams(x: Tensor, scheme: str) -> tuple[Tensor, Tensor]:
    s = scheme_of(scheme)
    _validate.finite("x", x)
    scale, zp = ref.choose_qparams(
        x, s.bits, s.symmetric, s.granularity, s.group_size, s.scale_dtype, s.zero_point_domain
    )
    _check_scale(scale, s.scale_dtype)
    return scale, (_no_zero_point(x) if zp is None else zp.to(s.zero_point_dtype))


@choose_qparams.register_fake
def _(x, scheme):
    s = scheme_of(scheme)
    shape = ref.scale_shape(x.shape, s.granularity, s.group_size)
    scale = x.new_empty(shape, dtype=s.scale_dtype)
    if s.symmetric:
        return scale, _no_zero_point(x)
    return scale, x.new_empty(shape, dtype=s.zero_point_dtype)


# -- quantize / dequantize ------------------------------------------------------------
@torch.library.custom_op("lowbit::quantize", mutates_args=())
def quantize(x: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: str, backend: str) -> Tensor:
    s = scheme_of(scheme)
    _validate.finite("x", x)
    return kernels.module(backend).quantize_packed(
        x, scale, zero_point, s.bits, s.symmetric, s.granularity, s.group_size,
        s.zero_point_domain, s.packing,
    )


@quantize.register_fake
def _(x, scale, zero_point, scheme, backend):
    s = scheme_of(scheme)
    return x.new_empty([*x.shape[:-1], packed_last_dim(x.shape[-1], s)], dtype=s.code_dtype)


@torch.library.custom_op("lowbit::dequantize", mutates_args=())
def dequantize(codes: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: str,
               shape: list[int], out_dtype: torch.dtype, backend: str) -> Tensor:
    s = scheme_of(scheme)
    return kernels.module(backend).dequantize_packed(
        codes, scale, zero_point, s.bits, s.symmetric, s.granularity, s.group_size,
        s.packing, shape, out_dtype,
    )


@dequantize.register_fake
def _(codes, scale, zero_point, scheme, shape, out_dtype, backend):
    return codes.new_empty(shape, dtype=out_dtype)


# -- bit packing ------------------------------------------------------------------------
@torch.library.custom_op("lowbit::pack", mutates_args=())
def pack(q: Tensor, bits: int, packing: str, backend: str) -> Tensor:
    if q.numel():
        lo, hi = int(q.min()), int(q.max())
        if lo < -(1 << (bits - 1)) or hi >= 1 << bits or (lo < 0 and hi >= 1 << (bits - 1)):
            raise ValueError(
                f"q holds values in [{lo}, {hi}]; {bits}-bit codes must be signed "
                f"[{-(1 << (bits - 1))}, {(1 << (bits - 1)) - 1}] or unsigned [0, {(1 << bits) - 1}]"
            )
    return kernels.module(backend).pack(q, bits, packing)


@pack.register_fake
def _(q, bits, packing, backend):
    word = 32 if packing == "u32" else 8
    return q.new_empty([*q.shape[:-1], q.shape[-1] * bits // word],
                       dtype=torch.int32 if packing == "u32" else torch.uint8)


@torch.library.custom_op("lowbit::unpack", mutates_args=())
def unpack(packed: Tensor, bits: int, packing: str, signed: bool, backend: str) -> Tensor:
    return kernels.module(backend).unpack(packed, bits, packing, signed)


@unpack.register_fake
def _(packed, bits, packing, signed, backend):
    word = 32 if packing == "u32" else 8
    return packed.new_empty([*packed.shape[:-1], packed.shape[-1] * word // bits],
                            dtype=torch.int8 if signed else torch.uint8)


# -- requirement B: per-token quantize / dequantize ----------------------------------------
@torch.library.custom_op("lowbit::quantize_per_token", mutates_args=())
def quantize_per_token(x: Tensor, bits: int, symmetric: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    if backend == "reference":
        _validate.finite("x", x)
    q, scale, zp, finite = kernels.module(backend).quantize_per_token(x, bits, symmetric)
    if not finite:  # the fast kernel checks while it reads; name the first bad value
        _validate.finite("x", x)
    return q, scale, zp


@quantize_per_token.register_fake
def _(x, bits, symmetric, backend):
    n = x.shape[0]
    return (x.new_empty(x.shape, dtype=torch.int8 if symmetric else torch.uint8),
            x.new_empty([n]), x.new_empty([n], dtype=torch.int32))


@torch.library.custom_op("lowbit::dequantize_per_token", mutates_args=())
def dequantize_per_token(q: Tensor, scale: Tensor, zero_point: Tensor, backend: str) -> Tensor:
    return kernels.module(backend).dequantize_packed(
        q, scale, zero_point, 8, q.dtype == torch.int8, "token", None, "u32", list(q.shape),
        scale.dtype,
    )


@dequantize_per_token.register_fake
def _(q, scale, zero_point, backend):
    return q.new_empty(q.shape, dtype=scale.dtype)


def _dequantize_per_token_setup(ctx, inputs, output):
    q, scale, zero_point, _ = inputs
    ctx.save_for_backward(q, zero_point)
    ctx.scale_dtype = scale.dtype


def _dequantize_per_token_backward(ctx, grad):
    # y[n, d] = (q[n, d] - z[n]) * scale[n]  =>  dL/dscale[n] = sum_d dL/dy[n, d] * (q[n, d] - z[n])
    q, zero_point = ctx.saved_tensors
    cdt = ref.compute_dtype(ctx.scale_dtype)
    centered = q.to(cdt) - zero_point.to(cdt)[:, None]
    grad_scale = (grad.to(cdt) * centered).sum(dim=1).to(ctx.scale_dtype)
    return None, grad_scale, None, None


dequantize_per_token.register_autograd(
    _dequantize_per_token_backward, setup_context=_dequantize_per_token_setup
)


# -- straight-through fake quantization for quantization-aware training --------------------
@torch.library.custom_op("lowbit::fake_quantize", mutates_args=())
def fake_quantize(x: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: str) -> Tensor:
    s = scheme_of(scheme)
    _validate.finite("x", x)
    q = ref.quantize(x, scale, zero_point, s.bits, s.symmetric, s.granularity, s.group_size,
                     s.zero_point_domain)
    return ref.dequantize(q, scale, zero_point, s.granularity, s.group_size, x.dtype)


@fake_quantize.register_fake
def _(x, scale, zero_point, scheme):
    return torch.empty_like(x)


def _fake_quantize_setup(ctx, inputs, output):
    x, scale, zero_point, scheme = inputs
    ctx.save_for_backward(x, scale, zero_point)
    ctx.scheme = scheme


def _fake_quantize_backward(ctx, grad):
    # Straight-through estimator (as torch.fake_quantize_*): d out / d x = 1 where the
    # rounded code lies in [qmin, qmax], 0 where quantize clamps it.
    x, scale, zero_point = ctx.saved_tensors
    s = scheme_of(ctx.scheme)
    q = ref.rounded_codes(x, scale, zero_point, s.granularity, s.group_size, s.zero_point_domain)
    inside = ((q >= s.qmin) & (q <= s.qmax)).reshape(x.shape)
    return grad * inside, None, None, None


fake_quantize.register_autograd(_fake_quantize_backward, setup_context=_fake_quantize_setup)


# -- requirement A: int32 accumulators -> float --------------------------------------------
@torch.library.custom_op("lowbit::dequantize_accumulator", mutates_args=())
def dequantize_accumulator(acc: Tensor, scale: Tensor | None, group_size: int,
                           row_scale: Tensor | None, col_scale: Tensor | None,
                           out_dtype: torch.dtype, backend: str) -> Tensor:
    k = kernels.module(backend)
    if scale is not None:
        return k.dequantize_accumulator_grouped(acc, scale, group_size, out_dtype)
    return k.dequantize_accumulator_rowcol(acc, row_scale, col_scale, out_dtype)


@dequantize_accumulator.register_fake
def _(acc, scale, group_size, row_scale, col_scale, out_dtype, backend):
    return acc.new_empty(acc.shape, dtype=out_dtype)


# -- matmuls -------------------------------------------------------------------------------
@torch.library.custom_op("lowbit::weight_only_matmul", mutates_args=())
def weight_only_matmul(x: Tensor, codes: Tensor, scale: Tensor, zero_point: Tensor | None, bits: int,
                       group_size: int, backend: str) -> Tensor:
    return kernels.module(backend).weight_only_matmul(x, codes, scale, zero_point, bits, group_size)


@weight_only_matmul.register_fake
def _(x, codes, scale, zero_point, bits, group_size, backend):
    return x.new_empty([*x.shape[:-1], codes.shape[0]])


@torch.library.custom_op("lowbit::int8_mm", mutates_args=())
def int8_mm(a: Tensor, b: Tensor, backend: str) -> Tensor:
    return kernels.module(backend).int8_mm(a, b)


@int8_mm.register_fake
def _(a, b, backend):
    return a.new_empty([a.shape[0], b.shape[0]], dtype=torch.int32)


@torch.library.custom_op("lowbit::int8_linear", mutates_args=())
def int8_linear(a: Tensor, a_zero_point: Tensor | None, b: Tensor, row_scale: Tensor, col_scale: Tensor,
                bias: Tensor | None, out_dtype: torch.dtype, backend: str) -> Tensor:
    """W8A8: ``dequantize_accumulator(a . b.T - a_zp[m] sum b[n], row_scale, col_scale)``
    rounded to out_dtype, then ``+ bias`` in out_dtype.  Backends with a fused kernel
    (triton, cpu: the epilogue inside the int8 GEMM) give the same bits; theirs may
    return None for shapes it does not cover."""
    k = kernels.module(backend)
    fused = getattr(k, "int8_linear", None)
    y = None if fused is None else fused(a, a_zero_point, b, row_scale, col_scale, bias, out_dtype)
    if y is not None:
        return y
    acc = k.int8_mm(a, b)
    if a_zero_point is not None:
        # (q_x - z_x) . q_w = q_x . q_w - z_x * sum(q_w): exact in int32 for K < 2^16.
        acc = acc - a_zero_point[:, None] * b.sum(dim=1, dtype=torch.int32)[None, :]
    y = k.dequantize_accumulator_rowcol(acc, row_scale, col_scale, out_dtype)
    return y if bias is None else y + bias.to(out_dtype)


@int8_linear.register_fake
def _(a, a_zero_point, b, row_scale, col_scale, bias, out_dtype, backend):
    return a.new_empty([a.shape[0], b.shape[0]], dtype=out_dtype)


@torch.library.custom_op("lowbit::linear_qta8a_qga4w", mutates_args=())
def linear_qta8a_qga4w(x_q: Tensor, x_scale: Tensor, x_zero_point: Tensor, w_packed: Tensor,
                       w_scales: Tensor, w_zero_points: Tensor | None, group_size: int,
                       bias: Tensor | None, backend: str) -> Tensor:
    return kernels.module(backend).linear_qta8a_qga4w(
        x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points, group_size, bias)


@linear_qta8a_qga4w.register_fake
def _(x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points, group_size, bias, backend):
    return x_q.new_empty([x_q.shape[0], w_packed.shape[0]], dtype=torch.float32)


@torch.library.custom_op("lowbit::linear_qta8a_qga4w_qta8o", mutates_args=())
def linear_qta8a_qga4w_qta8o(x_q: Tensor, x_scale: Tensor, x_zero_point: Tensor, w_packed: Tensor,
                             w_scales: Tensor, w_zero_points: Tensor | None, group_size: int,
                             out_scale: Tensor, out_zero_point: Tensor, bias: Tensor | None,
                             backend: str) -> Tensor:
    k = kernels.module(backend)
    fused = getattr(k, "linear_qta8a_qga4w_qta8o", None)  # the output requantization fused in
    if fused is not None:
        return fused(x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points, group_size,
                     out_scale, out_zero_point, bias)
    y = k.linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points, group_size, bias)
    return k.requantize_per_token(y, out_scale, out_zero_point)


@linear_qta8a_qga4w_qta8o.register_fake
def _(x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points, group_size, out_scale,
      out_zero_point, bias, backend):
    return x_q.new_empty([x_q.shape[0], w_packed.shape[0]], dtype=torch.int8)


# -- eager fast path -------------------------------------------------------------------------
# Calling a custom op from Python costs ~30 us of dispatch machinery (autograd wrapper,
# redispatch, dynamo-disable), more than a decode-sized kernel.  In plain eager calls the
# public functions therefore run the op's own implementation directly; whenever anything
# traces (torch.compile, torch.export, fake tensors, dispatch modes) or autograd needs the
# op's backward, the registered op runs, so graphs still show lowbit ops by name.
def _plain(args) -> bool:
    if torch._C._len_torch_dispatch_stack():
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, Tensor) and (type(a) is not Tensor or (grad and a.requires_grad)):
            return False
    return True


def _with_eager_fast_path(op):
    impl = op._init_fn

    def call(*args):
        if torch.compiler.is_compiling() or not _plain(args):
            return op(*args)
        return impl(*args)

    call.__name__ = call.__qualname__ = op._name.split("::")[-1]
    call.op = op
    return call


for _name in ["choose_qparams", "quantize", "dequantize", "pack", "unpack", "quantize_per_token",
              "dequantize_per_token", "fake_quantize", "dequantize_accumulator", "weight_only_matmul",
              "int8_mm", "int8_linear", "linear_qta8a_qga4w", "linear_qta8a_qga4w_qta8o"]:
    globals()[_name] = _with_eager_fast_path(globals()[_name])
