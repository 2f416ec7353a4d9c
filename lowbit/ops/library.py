"""The ``torch.library`` operators of namespace ``lowbit``.

Each op receives arguments the public functions already validated (metadata: shapes,
dtypes, devices), checks what only the values can tell (NaN/Inf, scale overflow), then
runs a ``Backend`` method.  Registration is torch.library's own, per device: the
reference is the default kernel (any device), the "CPU" and "CUDA" kernels run
``kernels.for_device`` (the fastest backend there, or the one a ``use_backend`` block
chose), and a fake kernel serves torch.compile and torch.export.  No op takes a backend
argument, so an exported graph says what is computed, not where:
``lowbit.dequantize(codes, scale, zp, 'int4-asym-g64', [4096, 4096], torch.bfloat16)``.
Schemes travel as their string form.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode

from .. import _validate, kernels
from ..kernels import reference as ref
from ..scheme import QuantScheme, code_range, packed_length, word_bits, word_dtype

_LIB = torch.library.Library("lowbit", "DEF")  # noqa: TOR901 (a library that lives as long as lowbit)
_EAGER: dict = {}  # op -> its implementation, for the eager path of ``call``


@lru_cache(maxsize=None)
def scheme_of(text: str) -> QuantScheme:
    return QuantScheme.parse(text)


def _define(schema: str, fake, *, devices: bool = True):
    """Define ``lowbit::<schema>``; the decorated ``impl(backend, *args)`` runs with the
    reference backend by default and, when ``devices``, with the device's backend on CPU
    and CUDA tensors.  Returns the op (``torch.ops.lowbit.<name>.default``)."""
    name = schema.split("(")[0]
    _LIB.define(schema)
    torch.library.register_fake(f"lowbit::{name}", fake, lib=_LIB)

    def register(impl):
        _LIB.impl(name, lambda *args: impl(kernels.REFERENCE, *args), "CompositeExplicitAutograd")
        if devices:
            _LIB.impl(name, lambda *args: impl(kernels.for_device("cpu"), *args), "CPU")
            _LIB.impl(name, lambda *args: impl(kernels.for_device("cuda"), *args), "CUDA")
        op = getattr(torch.ops.lowbit, name).default
        _EAGER[op] = impl if devices else lambda backend, *args: impl(kernels.REFERENCE, *args)
        return op

    return register


def _no_zero_point(x: Tensor) -> Tensor:
    return x.new_empty(0, dtype=torch.int32)


def _check_scale(scale: Tensor, dtype: torch.dtype, what: str = "a block") -> None:
    """Refuse a chosen scale that overflowed: finite values whose range (max - min) is
    past the largest float32, or past the largest float16 for a float16 scale."""
    if _validate.has_values(scale) and not bool(torch.isfinite(scale).all()):
        hint = ("; a float32 scale (the scheme without '-f16') holds it" if dtype == torch.float16
                else "; scale the data down first")
        raise ValueError(f"the scale of {what} overflows {dtype}: its range max - min is too large{hint}")


# -- choose_qparams -----------------------------------------------------------------
def _choose_qparams_fake(x, scheme):
    s = scheme_of(scheme)
    shape = s.scale_shape(x.shape)
    scale = x.new_empty(shape, dtype=s.scale_dtype)
    return scale, (_no_zero_point(x) if s.symmetric else x.new_empty(shape, dtype=s.zero_point_dtype))


@_define("choose_qparams(Tensor x, str scheme) -> (Tensor, Tensor)", _choose_qparams_fake)
def choose_qparams(backend, x, scheme):
    s = scheme_of(scheme)
    _validate.finite("x", x)
    scale, zp = backend.choose_qparams(x, s)
    _check_scale(scale, s.scale_dtype)
    return scale, (_no_zero_point(x) if zp is None else zp.to(s.zero_point_dtype))


# -- quantize / dequantize ------------------------------------------------------------
def _quantize_fake(x, scale, zero_point, scheme):
    s = scheme_of(scheme)
    return x.new_empty(s.packed_shape(x.shape), dtype=s.code_dtype)


@_define("quantize(Tensor x, Tensor scale, Tensor? zero_point, str scheme) -> Tensor", _quantize_fake)
def quantize(backend, x, scale, zero_point, scheme):
    _validate.finite("x", x)
    return backend.quantize(x, scale, zero_point, scheme_of(scheme))


@_define("dequantize(Tensor codes, Tensor scale, Tensor? zero_point, str scheme, SymInt[] shape, "
         "ScalarType out_dtype) -> Tensor",
         lambda codes, scale, zero_point, scheme, shape, out_dtype: codes.new_empty(shape, dtype=out_dtype))
def dequantize(backend, codes, scale, zero_point, scheme, shape, out_dtype):
    return backend.dequantize(codes, scale, zero_point, scheme_of(scheme), shape, out_dtype)


# -- bit packing ------------------------------------------------------------------------
@_define("pack(Tensor q, int bits, str packing) -> Tensor",
         lambda q, bits, packing: q.new_empty([*q.shape[:-1], packed_length(q.shape[-1], bits, packing)],
                                              dtype=word_dtype(packing)))
def pack(backend, q, bits, packing):
    if _validate.has_values(q):
        lo, hi = int(q.min()), int(q.max())
        smin, smax = code_range(bits, True)
        if lo < smin or hi > code_range(bits, False)[1] or (lo < 0 and hi > smax):
            raise ValueError(
                f"q holds values in [{lo}, {hi}]; {bits}-bit codes must be signed "
                f"[{smin}, {smax}] or unsigned [0, {code_range(bits, False)[1]}]"
            )
    return backend.pack(q, bits, packing)


@_define("unpack(Tensor packed, int bits, str packing, bool signed) -> Tensor",
         lambda packed, bits, packing, signed: packed.new_empty(
             [*packed.shape[:-1], packed.shape[-1] * word_bits(packing) // bits],
             dtype=torch.int8 if signed else torch.uint8))
def unpack(backend, packed, bits, packing, signed):
    return backend.unpack(packed, bits, packing, signed)


# -- per-token quantize / dequantize --------------------------------------------------------
def _quantize_per_token_fake(x, bits, symmetric):
    n = x.shape[0]
    return (x.new_empty(x.shape, dtype=torch.int8 if symmetric else torch.uint8),
            x.new_empty([n]), x.new_empty([n], dtype=torch.int32))


@_define("quantize_per_token(Tensor x, int bits, bool symmetric) -> (Tensor, Tensor, Tensor)",
         _quantize_per_token_fake)
def quantize_per_token(backend, x, bits, symmetric):
    if backend.name == "reference":
        _validate.finite("x", x)
    q, scale, zp, ok = backend.quantize_per_token(x, bits, symmetric)
    if not ok:  # the backend checked while it ran (no extra host sync); name what was wrong
        _validate.finite("x", x)
        _check_scale(scale, scale.dtype, "a row of x")
    return q, scale, zp


@_define("dequantize_per_token(Tensor q, Tensor scale, Tensor zero_point) -> Tensor",
         lambda q, scale, zero_point: q.new_empty(q.shape, dtype=scale.dtype))
def dequantize_per_token(backend, q, scale, zero_point):
    return backend.dequantize_per_token(q, scale, zero_point)


def _dequantize_per_token_setup(ctx, inputs, output):
    q, scale, zero_point = inputs
    ctx.save_for_backward(q, zero_point)
    ctx.scale_dtype = scale.dtype


def _dequantize_per_token_backward(ctx, grad):
    # y[n, d] = (q[n, d] - z[n]) * scale[n]  =>  dL/dscale[n] = sum_d dL/dy[n, d] * (q[n, d] - z[n])
    q, zero_point = ctx.saved_tensors
    cdt = ref.compute_dtype(ctx.scale_dtype)
    centered = q.to(cdt) - zero_point.to(cdt)[:, None]
    grad_scale = (grad.to(cdt) * centered).sum(dim=1).to(ctx.scale_dtype)
    return None, grad_scale, None


torch.library.register_autograd("lowbit::dequantize_per_token", _dequantize_per_token_backward,
                                setup_context=_dequantize_per_token_setup, lib=_LIB)


# -- straight-through fake quantization for quantization-aware training --------------------
@_define("fake_quantize(Tensor x, Tensor scale, Tensor? zero_point, str scheme) -> Tensor",
         lambda x, scale, zero_point, scheme: torch.empty_like(x), devices=False)
def fake_quantize(backend, x, scale, zero_point, scheme):
    s = scheme_of(scheme)
    _validate.finite("x", x)
    return ref.dequantize(ref.quantize(x, scale, zero_point, s), scale, zero_point, s, x.dtype)


def _fake_quantize_setup(ctx, inputs, output):
    x, scale, zero_point, scheme = inputs
    ctx.save_for_backward(x, scale, zero_point)
    ctx.scheme = scheme


def _fake_quantize_backward(ctx, grad):
    # Straight-through estimator (as torch.fake_quantize_*): d out / d x = 1 where the
    # rounded code lies in [qmin, qmax], 0 where quantize clamps it.
    x, scale, zero_point = ctx.saved_tensors
    s = scheme_of(ctx.scheme)
    q = ref.rounded_codes(x, scale, zero_point, s)
    inside = ((q >= s.qmin) & (q <= s.qmax)).reshape(x.shape)
    return grad * inside, None, None, None


torch.library.register_autograd("lowbit::fake_quantize", _fake_quantize_backward,
                                setup_context=_fake_quantize_setup, lib=_LIB)


# -- int32 accumulators -> float (the W8A8 epilogue) -----------------------------------------
@_define("dequantize_accumulator(Tensor acc, Tensor? scale, int group_size, Tensor? row_scale, "
         "Tensor? col_scale, ScalarType out_dtype) -> Tensor",
         lambda acc, scale, group_size, row_scale, col_scale, out_dtype: acc.new_empty(acc.shape, dtype=out_dtype))
def dequantize_accumulator(backend, acc, scale, group_size, row_scale, col_scale, out_dtype):
    if scale is not None:
        return backend.dequantize_accumulator_grouped(acc, scale, group_size, out_dtype)
    return backend.dequantize_accumulator_rowcol(acc, row_scale, col_scale, out_dtype)


# -- matmuls -------------------------------------------------------------------------------
def _check_min(zero_point: Tensor | None, zero_point_min: bool) -> None:
    """A "min"-domain weight (q * scale + m) needs its float mins in zero_point."""
    if zero_point_min and (zero_point is None or not zero_point.is_floating_point()):
        raise ValueError("zero_point_min=True needs zero_point: the float mins m of W = q * scale + m, "
                         f"got {'None' if zero_point is None else zero_point.dtype}")


@_define("weight_only_matmul(Tensor x, Tensor codes, Tensor scale, Tensor? zero_point, int bits, "
         "int group_size, bool zero_point_min=False) -> Tensor",
         lambda x, codes, scale, zero_point, bits, group_size, zero_point_min=False:
         x.new_empty([*x.shape[:-1], codes.shape[0]]))
def weight_only_matmul(backend, x, codes, scale, zero_point, bits, group_size, zero_point_min=False):
    # zero_point_min: W = q * scale + zero_point (the scheme's "min" domain, unsigned codes),
    # not (q - zero_point) * scale
    _check_min(zero_point, zero_point_min)
    if x.shape[-1] == 0:  # an empty sum: zeros, as torch.matmul gives (no backend's kernel takes K = 0)
        return x.new_zeros((*x.shape[:-1], codes.shape[0]))
    return backend.weight_only_matmul(x, codes, scale, zero_point, bits, group_size, zero_point_min)


def _weight_only_matmul_setup(ctx, inputs, output):
    x, codes, scale, zero_point, bits, group_size, *min_form = inputs
    ctx.save_for_backward(codes, scale, zero_point)
    ctx.bits, ctx.group_size, ctx.k, ctx.x_dtype = bits, group_size, x.shape[-1], x.dtype
    ctx.zero_point_min = bool(min_form and min_form[0])


def _weight_only_matmul_backward(ctx, grad):
    # y = x @ W.T  =>  dL/dx = dL/dy @ W, W the dequantized weight (float32, rounded once to
    # x's dtype); the codes, scale and zero point get no gradient (a frozen quantized weight:
    # LoRA adapters and quantization-aware training on top of it).
    codes, scale, zero_point = ctx.saved_tensors
    w = ref.dequantize_weight(codes, scale, zero_point, ctx.bits, ctx.group_size, ctx.k,
                              zero_point_min=ctx.zero_point_min)
    return (grad.to(torch.float32) @ w).to(ctx.x_dtype), None, None, None, None, None, None


torch.library.register_autograd("lowbit::weight_only_matmul", _weight_only_matmul_backward,
                                setup_context=_weight_only_matmul_setup, lib=_LIB)


@_define("split_matmul(Tensor x, Tensor codes, Tensor scale, Tensor? zero_point, int bits, int group_size, "
         "Tensor outliers, Tensor high_codes, Tensor high_scale, Tensor? high_zero_point, int high_bits, "
         "int high_group_size) -> Tensor",
         lambda x, codes, *rest: x.new_empty([*x.shape[:-1], codes.shape[0]]))
def split_matmul(backend, x, codes, scale, zero_point, bits, group_size, outliers, high_codes, high_scale,
                 high_zero_point, high_bits, high_group_size):
    """x @ W.T for a split weight: low (all K columns) plus high (the outlier columns)."""
    if x.shape[-1] == 0:
        return x.new_zeros((*x.shape[:-1], codes.shape[0]))
    return backend.split_matmul(x, codes, scale, zero_point, bits, group_size, outliers, high_codes, high_scale,
                                high_zero_point, high_bits, high_group_size)


def _split_matmul_setup(ctx, inputs, output):
    x, codes, scale, zero_point, bits, group_size, outliers, h_codes, h_scale, h_zero_point, h_bits, h_group = inputs
    ctx.save_for_backward(codes, scale, zero_point, outliers, h_codes, h_scale, h_zero_point)
    ctx.parts = bits, group_size, h_bits, h_group, x.shape[-1], x.dtype


def _split_matmul_backward(ctx, grad):
    # dL/dx = dL/dy @ W with W the summed split weight (float32, rounded once to x's dtype);
    # the codes, scales and outliers get no gradient (a frozen weight, as weight_only_matmul's)
    codes, scale, zero_point, outliers, h_codes, h_scale, h_zero_point = ctx.saved_tensors
    bits, group_size, h_bits, h_group, k, x_dtype = ctx.parts
    w = ref.split_weight(codes, scale, zero_point, bits, group_size, k, outliers, h_codes, h_scale, h_zero_point,
                         h_bits, h_group)
    return ((grad.to(torch.float32) @ w).to(x_dtype),) + (None,) * 11


torch.library.register_autograd("lowbit::split_matmul", _split_matmul_backward,
                                setup_context=_split_matmul_setup, lib=_LIB)


@_define("int8_mm(Tensor a, Tensor b) -> Tensor",
         lambda a, b: a.new_empty([a.shape[0], b.shape[0]], dtype=torch.int32))
def int8_mm(backend, a, b):
    if a.shape[1] > INT8_MM_MAX_K:
        raise ValueError(f"int8_mm: K={a.shape[1]} is past {INT8_MM_MAX_K}, the largest K whose int8 x int8 "
                         "dot products (at most 128 * 128 * K) are exact in its int32 result")
    return backend.int8_mm(a, b)


# Exact int32 accumulation: |a . b| <= 128 * 128 * K for int8 a and b; with a zero point
# (|a - a_zp| <= 256, |a_zp| <= 128 for codes shifted from uint8) every partial result of
# a . b - a_zp * sum(b) is at most 256 * 128 * K.  Past these K the ops sum int32 chunks in int64.
INT8_MM_MAX_K = (2**31 - 1) // (128 * 128)
INT8_LINEAR_CHUNK_K = (2**31 - 1) // (256 * 128)


def _int8_linear_long_k(backend, a, a_zero_point, b, row_scale, col_scale, bias, out_dtype):
    """``int8_linear`` past INT8_LINEAR_CHUNK_K: exact int32 products of K chunks (the
    backend's int8_mm) summed in int64, then the reference epilogue: the same bits on
    every backend, as the exact integer is the same."""
    k = a.shape[1]
    acc = sum(backend.int8_mm(a[:, i:i + INT8_LINEAR_CHUNK_K].contiguous(),
                              b[:, i:i + INT8_LINEAR_CHUNK_K].contiguous()).to(torch.int64)
              for i in range(0, k, INT8_LINEAR_CHUNK_K))
    if a_zero_point is not None:
        acc = acc - a_zero_point.to(torch.int64)[:, None] * b.sum(dim=1, dtype=torch.int64)[None, :]
    y = ref.dequantize_accumulator_rowcol(acc, row_scale, col_scale, out_dtype)
    return y if bias is None else y + bias.to(out_dtype)


@_define("int8_linear(Tensor a, Tensor? a_zero_point, Tensor b, Tensor row_scale, Tensor col_scale, "
         "Tensor? bias, ScalarType out_dtype) -> Tensor",
         lambda a, a_zero_point, b, row_scale, col_scale, bias, out_dtype:
             a.new_empty([a.shape[0], b.shape[0]], dtype=out_dtype))
def int8_linear(backend, a, a_zero_point, b, row_scale, col_scale, bias, out_dtype):
    """W8A8: ``dequantize_accumulator(a . b.T - a_zp[m] sum b[n], row_scale, col_scale)``
    rounded to out_dtype, then ``+ bias`` in out_dtype (``Backend.int8_linear``), for any K."""
    if a.shape[1] > INT8_LINEAR_CHUNK_K:
        return _int8_linear_long_k(backend, a, a_zero_point, b, row_scale, col_scale, bias, out_dtype)
    return backend.int8_linear(a, a_zero_point, b, row_scale, col_scale, bias, out_dtype)


@_define("linear_a8_blocks(Tensor x, Tensor codes, Tensor scale, Tensor? zero_point, int bits, int group_size, "
         "int act_block, bool zero_point_min=False) -> Tensor",
         lambda x, codes, scale, zero_point, bits, group_size, act_block, zero_point_min=False:
         x.new_empty([*x.shape[:-1], codes.shape[0]]))
def linear_a8_blocks(backend, x, codes, scale, zero_point, bits, group_size, act_block, zero_point_min=False):
    """x quantized to int8 in symmetric blocks of ``act_block`` values along K (float32
    scales, chosen on the fly), times the weight-only weight (q * s + zero_point with
    ``zero_point_min``): ``Backend.linear_a8_blocks``."""
    _check_min(zero_point, zero_point_min)
    y, ok = backend.linear_a8_blocks(x, codes, scale, zero_point, bits, group_size, act_block, zero_point_min)
    if not ok:  # the backend checked (the CPU kernel while it quantized, no extra pass); name what was wrong
        _validate.finite("x", x)
        raise ValueError("x holds values past the largest float32 (the blocks are quantized in float32)")
    return y


@_define("linear_qta8a_qga4w(Tensor x_q, Tensor x_scale, Tensor x_zero_point, Tensor w_codes, "
         "Tensor w_scale, Tensor? w_zero_point, int group_size, Tensor? bias) -> Tensor",
         lambda x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size, bias:
             x_q.new_empty([x_q.shape[0], w_codes.shape[0]], dtype=torch.float32))
def linear_qta8a_qga4w(backend, x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size, bias):
    return backend.linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size,
                                      bias)


@_define("linear_qta8a_qga4w_qta8o(Tensor x_q, Tensor x_scale, Tensor x_zero_point, Tensor w_codes, "
         "Tensor w_scale, Tensor? w_zero_point, int group_size, Tensor out_scale, Tensor out_zero_point, "
         "Tensor? bias) -> Tensor",
         lambda x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size, out_scale,
         out_zero_point, bias: x_q.new_empty([x_q.shape[0], w_codes.shape[0]], dtype=torch.int8))
def linear_qta8a_qga4w_qta8o(backend, x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size,
                             out_scale, out_zero_point, bias):
    return backend.linear_qta8a_qga4w_qta8o(x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point,
                                            group_size, out_scale, out_zero_point, bias)


def _eager(args) -> bool:
    """Whether ``call`` may run an op's implementation without the dispatcher: when
    autograd records nothing (torch.inference_mode, torch.no_grad, which ``transformers``'
    ``generate`` runs under, or no argument that requires grad), outside torch.compile and
    torch.export, with no dispatch mode active (make_fx, FlopCounterMode: they must see
    the op), on plain tensors (fake, functional and other traced tensors are subclasses).
    The dispatcher's Python kernel costs ~20 us a call (~35 us with its autograd layer):
    6-8% of a weight-only decode step of the bundled model where the steps run in Python
    (measured on a Zen 2 without AVX-512), a quarter of a transformers forward under
    no_grad, and more than the kernel of a one-row matmul at the bundled model's shapes."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    return (eager_mode(any(a.requires_grad for a in tensors))
            and all(type(a) is Tensor for a in tensors))


def eager_mode(requires_grad: bool = True) -> bool:
    """``_eager``'s conditions but the arguments' types: no autograd recording (grad mode
    off, inference mode, or ``requires_grad`` False: no argument of the call requires
    grad, so autograd would record nothing), no tracing, no dispatch mode, no functorch
    transform."""
    if torch.compiler.is_compiling():  # dynamo cannot trace what follows
        return False
    if requires_grad and torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
        return False
    # functorch transforms (vmap, grad) wrap tensors that have no storage for a kernel to read
    return (not torch.compiler.is_exporting() and _dispatch_mode() is None
            and not torch._C._are_functorch_transforms_active())


def backend_for(device: torch.device):
    """The backend ``call`` runs an op on with ``backend=None`` for tensors on ``device``."""
    return kernels.for_device(device.type)


def refuse_tangents(op, args) -> None:
    """Raise for an argument that is a forward-mode AD dual tensor (inside a
    ``torch.autograd.forward_ad.dual_level``): no lowbit op has a forward-mode derivative,
    so the result would silently carry no tangent."""
    if torch.compiler.is_compiling() or forward_ad._current_level < 0:  # no dual level open: none
        return
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and forward_ad.unpack_dual(a).tangent is not None:
            raise NotImplementedError(f"{op}: argument {i} is a forward-mode AD dual tensor "
                                      "(torch.autograd.forward_ad); lowbit's ops have no forward-mode "
                                      "derivative, so its tangent would be lost")


def call(op, backend: str | None, device: torch.device, *args):
    """Run ``op(*args)``: on the automatic backend when ``backend`` is None, else inside a
    ``kernels.use_backend(backend)`` block (which checks it can run on ``device``).  Where
    autograd records nothing, on plain tensors, the op's implementation runs directly
    (``_eager``); whatever traces (torch.compile, torch.export, fake tensors) sees the op by
    name.  A forward-mode AD dual tensor is refused (``refuse_tangents``)."""
    refuse_tangents(op, args)
    if backend is None:
        if _eager(args):
            return _EAGER[op](kernels.for_device(device.type), *args)
        return op(*args)
    with kernels.use_backend(backend, device):
        if _eager(args):
            return _EAGER[op](kernels.for_device(device.type), *args)
        return op(*args)
