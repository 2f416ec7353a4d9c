"""Quantized matmuls: weight-only (W8A16, W4A16), W8A8 and W4A8.

Weights are [N, K] (out_features, in_features) with groups along K, following
``lowbit.scheme``: 8-bit codes one per byte, 4-bit codes packed "u32x8"; signed
codes without zero point (symmetric) or unsigned codes with a zero point.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd import forward_ad

from .. import _validate
from ..qtensor import QTensor, SplitQTensor
from ..scheme import W4A8_MAX_GROUP, QuantScheme, act_scheme_problem, check_act_weight
from . import library
from .pack import pack_bits, unpack_bits
from .per_token import quantize_per_token
from .quant import _check_qparams, dequantize, quantize

SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ZP_INT_DTYPES = (torch.uint8, torch.int8, torch.int32)


def _check_weight(k: int, codes, scale, zero_point, bits, group_size,
                  names=("codes", "scale", "zero_point")):
    """Validate a weight's codes, scale and zero point against the activations' K; return N."""
    wname, sname, zname = names
    if isinstance(bits, bool) or bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if k % group_size:
        raise ValueError(f"group_size={group_size} does not divide K={k} (in_features)")
    if bits == 4 and group_size % 8:
        raise ValueError(f"group_size={group_size} must be a multiple of 8 for u32x8-packed 4-bit weights")
    if bits == 8:
        dtypes = [torch.int8] if zero_point is None else [torch.uint8]
        _validate.tensor(wname, codes, dtypes=dtypes, ndim=2)
        _validate.shape(wname, codes, (codes.shape[0], k), "[N, K] with K = in_features of the input")
    else:
        _validate.tensor(wname, codes, dtypes=[torch.int32], ndim=2)
        _validate.shape(wname, codes, (codes.shape[0], k // 8), "[N, K/8] u32x8-packed 4-bit codes")
    n = codes.shape[0]
    _validate.tensor(sname, scale, dtypes=SCALE_DTYPES, ndim=2)
    _validate.shape(sname, scale, (n, k // group_size), "[N, K / group_size]")
    if zero_point is not None:
        _validate.tensor(zname, zero_point, dtypes=ZP_INT_DTYPES + SCALE_DTYPES, ndim=2)
        _validate.shape(zname, zero_point, (n, k // group_size), f"same as {sname}")
    _validate.same_device(wname, codes, **{sname: scale, zname: zero_point})
    return n


def quantized_matmul(input: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                     zero_point: torch.Tensor | None = None, *, bits: int, group_size: int,
                     zero_point_min: bool = False, out: torch.Tensor | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """``input @ dequantize(W).T`` in input's dtype, without a float copy of the weight W.

    Args:
        input: float [..., K] (float32, float64, float16 or bfloat16).
        codes: the weight's codes; bits=8: int8 [N, K] (symmetric) or uint8 [N, K] (with
            zero_point); bits=4: int32 [N, K/8], "u32x8"-packed.
        scale: [N, K / group_size] (group_size = K: per channel), float32/float16/bfloat16.
        zero_point: None (symmetric, signed codes), integer (unsigned codes) or float
            (the scheme's "float" zero-point domain), same shape as scale.
        zero_point_min: W = q * scale + zero_point (the "min" domain: GGUF Q4_1's
            d * q + m, unsigned codes, a float zero_point), not (q - zero_point) * scale.
        out: optional [..., N] tensor of input's dtype to write the result into.

    Example::

        >>> import torch, lowbit
        >>> _ = torch.manual_seed(0)
        >>> w = torch.randn(32, 64)
        >>> qt = lowbit.quantize(w, "int4-sym-g32")
        >>> x = torch.randn(2, 64)
        >>> y = lowbit.quantized_matmul(x, qt.codes, qt.scale, bits=4, group_size=32)
        >>> torch.allclose(y, x @ lowbit.dequantize(qt).T, rtol=1e-4, atol=1e-4)
        True
        >>> q41 = lowbit.quantize(w, "int4-asym-g32-zpmin-f16")  # GGUF Q4_1's d * q + m
        >>> y = lowbit.quantized_matmul(x, q41.codes, q41.scale, q41.zero_point, bits=4, group_size=32,
        ...                             zero_point_min=True)
        >>> torch.allclose(y, x @ lowbit.dequantize(q41).T, rtol=1e-4, atol=1e-4)
        True
    """
    _validate.tensor("input", input, dtypes=_validate.FLOAT_DTYPES, min_ndim=1)
    n = _check_weight(input.shape[-1], codes, scale, zero_point, bits, group_size)
    if not isinstance(zero_point_min, bool):
        raise TypeError(f"zero_point_min must be a bool, got {type(zero_point_min).__name__}")
    library._check_min(zero_point, zero_point_min)
    _validate.same_device("input", input, codes=codes, out=out)
    if out is not None:
        _validate.tensor("out", out, dtypes=[input.dtype])
        _validate.shape("out", out, (*input.shape[:-1], n), "[..., N]")
    y = library.call(library.weight_only_matmul, backend, input.device, input, codes, scale, zero_point, bits,
                     group_size, *((True,) if zero_point_min else ()))
    return y if out is None else out.copy_(y)


# weight_parts of the QTensors in use, by id: a decode step calls linear on the same
# weights again and again, and rebuilding the views costs about 1.5 us a call.  An entry
# is kept while its QTensor lives and is valid while no in-place write hit the tensors
# (their version counters; the parts may be copies).  It also holds the weight's prepared
# one-row linears (``_one_row``), by activation dtype and scheme.
_PARTS: dict[int, tuple] = {}


def _versions(qweight: QTensor):
    zp = qweight.zero_point
    return qweight.codes._version, qweight.scale._version, None if zp is None else zp._version


def _cacheable(qweight: QTensor) -> bool:
    """Eager tensors with version counters: traced ones show their views in the graph, and
    those made under inference_mode have no counter to tell an in-place write."""
    if torch.compiler.is_compiling() or type(qweight.codes) is not torch.Tensor:
        return False
    return not (qweight.codes.is_inference() or qweight.scale.is_inference())


def _entry(qweight: QTensor) -> tuple:
    """qweight's ``_PARTS`` entry (weakref, versions, parts, prepared one-row linears)."""
    key = id(qweight)
    hit = _PARTS.get(key)
    if hit is not None and hit[0]() is qweight and hit[1] == _versions(qweight):
        return hit
    hit = (weakref.ref(qweight, lambda _, key=key: _PARTS.pop(key, None)), _versions(qweight),
           _build_weight_parts(qweight), {})
    _PARTS[key] = hit
    return hit


def weight_parts(qweight: QTensor):
    """The matmul form of a 2-D weight QTensor: ``(codes, scale [N, G], zero_point or None,
    bits, group_size)``, 4-bit codes as u32x8 words (what the matmul ops take).

    Example::

        >>> import torch, lowbit
        >>> from lowbit.ops.matmul import weight_parts
        >>> codes, scale, zp, bits, group = weight_parts(lowbit.quantize(torch.randn(8, 64), "int4-sym-g32"))
        >>> codes.shape, scale.shape, zp, bits, group
        (torch.Size([8, 8]), torch.Size([8, 2]), None, 4, 32)
    """
    if not isinstance(qweight, QTensor):
        raise TypeError(f"qweight must be a lowbit.QTensor, got {type(qweight).__name__}")
    return _entry(qweight)[2] if _cacheable(qweight) else _build_weight_parts(qweight)


_FLOAT_ROWS = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a module's bias is a Parameter


def _one_row(x, qweight, bias, act_scheme):
    """``linear`` of one row of x on the automatic backend through the weight's prepared
    one-row callable (``Backend.one_row``, kept in its ``_PARTS`` entry), in eager mode on
    plain tensors; None where that does not apply, or where the call refuses x (the
    general path then runs, and says why).  The same kernel and bits as the general path,
    without its per-call checks and conversions: at the bundled model's shapes those
    cost as much as the kernel."""
    if type(x) is not torch.Tensor or type(qweight) is not QTensor or x.dtype not in _FLOAT_ROWS:
        return None
    shape, wshape, codes = x.shape, qweight.shape, qweight.codes
    if (not shape or x.numel() != shape[-1] or len(wshape) != 2 or wshape[1] != shape[-1] or not shape[-1]
            or x.get_device() != codes.get_device()):
        return None
    if bias is not None and (type(bias) not in _PLAIN or bias.shape != wshape[:1] or not bias.is_floating_point()
                             or bias.get_device() != codes.get_device()):
        return None
    if forward_ad._current_level >= 0:  # a dual level is open: the general path checks x for a tangent
        return None
    # autograd records a call only where an argument requires grad (a float scale may)
    grad = x.requires_grad or qweight.scale.requires_grad or (bias is not None and bias.requires_grad)
    if not (library.eager_mode(grad) and type(codes) is torch.Tensor and not codes.is_inference()
            and not qweight.scale.is_inference()):
        return None  # as _cacheable: eager_mode says it does not compile
    backend = library.backend_for(x.device)
    rows = _entry(qweight)[3]
    key = (x.dtype, act_scheme, backend.name, backend.plan_epoch)
    run = rows.get(key, False)
    if run is False:
        run = rows[key] = _prepare_row(qweight, act_scheme, x.dtype, backend)
    if run is None:
        return None
    try:
        y = run(x)
    except RuntimeError:  # NaN or Inf in x with int8 activations: the general path's error
        return None
    return y if bias is None else y + bias.to(y.dtype)


def _prepare_row(qweight: QTensor, act_scheme, dtype: torch.dtype, backend):
    w, k = qweight.scheme, qweight.shape[1]
    if w.granularity == "token":
        return None
    if act_scheme is None:
        if not (matmul_form(w, k) or min_form(w, k)):
            return None
        act = None
    else:
        try:
            act = as_act_scheme(act_scheme)
            check_act_weight(w, act, k)
        except (ValueError, TypeError):
            return None
    codes, scale, zp, _, _ = _entry(qweight)[2]
    return backend.one_row(w, act, codes, scale, zp, k, dtype)


def _build_weight_parts(qweight: QTensor):
    if len(qweight.shape) != 2:
        raise ValueError(f"qweight must be 2-D [out_features, in_features], got shape {tuple(qweight.shape)}")
    s, (n, k) = qweight.scheme, qweight.shape
    if s.granularity == "token":
        raise ValueError(f"qweight scheme '{s}' is per-token; weights are per tensor, channel or group")
    group = s.group_size if s.granularity == "group" else k
    groups = k // group
    scale = qweight.scale.reshape(-1, 1).expand(n, groups) if s.granularity == "tensor" else qweight.scale.reshape(n, groups)
    zp = qweight.zero_point
    if zp is not None:
        zp = zp.reshape(-1, 1).expand(n, groups) if s.granularity == "tensor" else zp.reshape(n, groups)
    codes = qweight.codes
    if s.bits == 4 and s.packing == "u8":
        # u8x2 bytes are u32x8 words read little-endian: same bits, no repacking.
        codes = codes.contiguous().view(torch.int32) if k % 8 == 0 else pack_bits(
            unpack_bits(codes, 4, "u8", signed=s.symmetric), 4, "u32")
    return codes, scale.contiguous(), None if zp is None else zp.contiguous(), s.bits, group


def _codes_fit(scheme: QuantScheme, k: int) -> bool:
    """8-bit codes, or 4-bit codes filling whole u32 words: the codes the matmul ops take."""
    return scheme.bits == 8 or (scheme.bits == 4 and k % 8 == 0)


def matmul_form(scheme: QuantScheme, k: int) -> bool:
    """Whether the matmul ops take a weight of ``scheme`` with K = ``k`` as it is: 8-bit
    codes, or 4-bit codes filling whole u32 words, with (q - z) * s arithmetic.  The others
    are dequantized first: 2/3-bit codes, 4-bit codes of a K that fills no whole u32 word
    (u8 packing).  A "min" zero point (q * s + m) is not this form but ``min_form``.

    Example::

        >>> from lowbit.ops.matmul import matmul_form
        >>> from lowbit.scheme import QuantScheme
        >>> matmul_form(QuantScheme.parse("int4-asym-g32"), 64), matmul_form(QuantScheme.parse("int3-asym-g32"), 64)
        (True, False)
    """
    return _codes_fit(scheme, k) and scheme.zero_point_domain != "min"


def min_form(scheme: QuantScheme, k: int) -> bool:
    """Whether ``lowbit.linear`` runs a "min" zero-point weight (q * s + m) of ``scheme``
    with K = ``k`` on its packed codes (``weight_only_matmul(..., zero_point_min=True)``):
    the codes of ``matmul_form``, in the "min" domain.

    Example::

        >>> from lowbit.ops.matmul import min_form
        >>> from lowbit.scheme import QuantScheme
        >>> min_form(QuantScheme.parse("int4-asym-g32-zpmin-f16"), 64), min_form(QuantScheme.parse("int4-asym-g32"), 64)
        (True, False)
    """
    return _codes_fit(scheme, k) and scheme.zero_point_domain == "min"


def as_act_scheme(act_scheme) -> QuantScheme:
    """The 8-bit activation scheme ``linear`` accepts (per token, per tensor or in blocks), parsed.

    Example::

        >>> from lowbit.ops.matmul import as_act_scheme
        >>> as_act_scheme("int8-asym-token")
        QuantScheme('int8-asym-token')
    """
    if isinstance(act_scheme, QuantScheme):
        s = act_scheme
    else:  # parsed once per string: a decode step asks for the same scheme 210 times a token
        s = library.scheme_of(act_scheme) if isinstance(act_scheme, str) else QuantScheme.parse(act_scheme)
    problem = act_scheme_problem(s)
    if problem:
        raise ValueError(f"act_scheme: {problem}")
    return s


def linear(x: torch.Tensor, qweight: QTensor, bias: torch.Tensor | None = None, *,
           act_scheme: QuantScheme | str | None = None, act_scale: torch.Tensor | None = None,
           act_zero_point: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with a quantized weight, dispatching on the schemes:

    * ``act_scheme=None``: weight-only (W8A16, W4A16; 2/3-bit weights run the reference);
      a ``SplitQTensor`` (int8 outlier channels + int4, ``lowbit.split_quantize``) too.
    * 8-bit activations with an int8 symmetric per-channel weight: W8A8, an int8 x int8 ->
      int32 GEMM and the ``dequantize_accumulator`` epilogue (``lowbit::int8_linear``; fused
      into the GEMM on the triton backend).
    * 8-bit activations with a 4-bit grouped weight: W4A8, integer accumulation per
      weight group (``linear_qta8a_qga4w``).
    * 8-bit activations in blocks along K (``'int8-sym-g32'``) with any 4- or 8-bit weight
      whose groups are whole blocks: x quantized per block on the fly, integer dot products
      per block, float scales once per block (``linear_a8_blocks``; llama.cpp's Q8_0
      activations).

    ``x`` is float32, float16 or bfloat16 (float64 too, weight-only) of shape [..., K] with
    K = ``qweight.shape[1]``; ``qweight`` is a 2-D QTensor (or SplitQTensor) [N, K]; ``bias`` a 1-D float
    tensor [N]; the result has shape [..., N] and x's dtype.

    Activations are quantized per token or per block on the fly (``'int8-sym-token'``,
    ``'int8-asym-token'``, ``'int8-sym-g32'``), or with a calibrated per-tensor
    ``act_scale`` (and ``act_zero_point`` for an asymmetric scheme) when ``act_scheme`` is
    per tensor.

    Example::

        >>> import torch, lowbit
        >>> w = lowbit.quantize(torch.randn(64, 128), "int8-sym")
        >>> x = torch.randn(4, 128, dtype=torch.bfloat16)
        >>> lowbit.linear(x, w, act_scheme="int8-sym-token").dtype
        torch.bfloat16
    """
    if backend is None and act_scale is None and act_zero_point is None:
        y = _one_row(x, qweight, bias, act_scheme)
        if y is not None:
            return y
    _validate.tensor("x", x, dtypes=_validate.FLOAT_DTYPES, min_ndim=1)
    if not isinstance(qweight, (QTensor, SplitQTensor)):
        raise TypeError(f"qweight must be a lowbit.QTensor or SplitQTensor, got {type(qweight).__name__}")
    if len(qweight.shape) != 2:
        raise ValueError(f"qweight must be 2-D [out_features, in_features], got shape {tuple(qweight.shape)}")
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x.shape[-1]={x.shape[-1]} does not match qweight in_features={k}")
    _validate.same_device("x", x, qweight=qweight.low.codes if isinstance(qweight, SplitQTensor) else qweight.codes,
                          bias=bias)
    if bias is not None:
        _validate.tensor("bias", bias, dtypes=_validate.FLOAT_DTYPES, ndim=1)
        _validate.shape("bias", bias, (n,), "[out_features]")
    if isinstance(qweight, SplitQTensor):
        if act_scheme is not None or act_scale is not None or act_zero_point is not None:
            raise ValueError("a SplitQTensor weight (int8 outlier channels + int4) runs weight-only: act_scheme, "
                             "act_scale and act_zero_point must be None")
        return _split_linear(x, qweight, bias, backend=backend)
    w = qweight.scheme
    if act_scheme is None:
        if act_scale is not None or act_zero_point is not None:
            raise ValueError("act_scale / act_zero_point need an act_scheme")
        if k == 0:
            y = x.new_zeros((*x.shape[:-1], n))
        elif matmul_form(w, k) or min_form(w, k):
            codes, scales, zps, bits, group = weight_parts(qweight)
            # q * s + m (the "min" domain) says so; the other weights' nodes keep the six arguments
            flag = (True,) if w.zero_point_domain == "min" else ()
            y = library.call(library.weight_only_matmul, backend, x.device, x, codes, scales, zps, bits, group,
                             *flag)
        else:
            y = torch.nn.functional.linear(x, dequantize(qweight, x.dtype, backend=backend))
        return y if bias is None else y + bias.to(y.dtype)

    s = as_act_scheme(act_scheme)
    if x.dtype == torch.float64:
        raise TypeError("x must be float32, float16 or bfloat16 for 8-bit activations, got torch.float64")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"act_scheme='{s}' quantizes x on the fly, which has no gradient; for "
                         "quantization-aware training use lowbit.fake_quantize on x, or run under torch.no_grad()")
    check_act_weight(w, s, k)
    codes, scales, zps, bits, group = weight_parts(qweight)
    if s.granularity == "group":
        if act_scale is not None or act_zero_point is not None:
            raise ValueError(f"act_scheme='{s}' chooses a scale per block of x on the fly; act_scale / "
                             "act_zero_point are for per-tensor schemes")
        flag = (True,) if w.zero_point_domain == "min" else ()  # as weight-only, above
        y = library.call(library.linear_a8_blocks, backend, x.device, x, codes, scales, zps, bits, group,
                         s.group_size, *flag)
        return y if bias is None else y + bias.to(y.dtype)
    x2 = x.reshape(-1, k)
    xq, xs, xz = _quantize_activations(x2, s, act_scale, act_zero_point, backend)
    if bits == 8:
        zp = xz if not s.symmetric or act_scale is not None else None
        y = library.call(library.int8_linear, backend, x.device, xq, zp, codes, xs, scales.reshape(n), bias,
                         x.dtype)
        return y.reshape(*x.shape[:-1], n)  # bias added in the epilogue
    else:  # 4 bits (check_act_weight)
        y = library.call(library.linear_qta8a_qga4w, backend, x.device, xq, xs.to(torch.float32), xz, codes,
                         scales, zps, group, None).to(x.dtype)
    y = y.reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


def _quantize_activations(x2, s: QuantScheme, act_scale, act_zero_point, backend):
    """int8 codes [M, K], scale [M], int32 zero point [M] (0 for symmetric)."""
    m = x2.shape[0]
    if act_scale is None and act_zero_point is not None:
        raise ValueError("act_zero_point was given without act_scale")
    if act_scale is not None and s.granularity != "tensor":
        raise ValueError(f"a calibrated act_scale needs a per-tensor act_scheme, got '{s}'")
    if s.granularity == "token":
        q, scale, zp = quantize_per_token(x2, 8, s.symmetric, backend=backend)
    else:  # per tensor: calibrated (act_scale given) or chosen from x2
        if act_scale is not None:
            _check_qparams(x2, s, act_scale, act_zero_point, names=("act_scale", "act_zero_point"))
        qt = quantize(x2, s, act_scale, act_zero_point, backend=backend)
        q, scale = qt.codes, qt.scale.expand(m)
        zp = (torch.zeros(m, dtype=torch.int32, device=x2.device) if s.symmetric
              else qt.zero_point.to(torch.int32).expand(m))
    if q.dtype == torch.uint8:  # unsigned codes shifted by 128 to int8, exactly: u - 128 is u ^ 0x80 as int8
        q = (q ^ 0x80).view(torch.int8)
        zp = zp - 128
    return q, scale.contiguous(), zp.contiguous()


def linear_qta8a_qga4w_qta8o(x_q: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor,
                             w_codes: torch.Tensor, w_scale: torch.Tensor,
                             w_zero_point: torch.Tensor | None, group_size: int,
                             out_scale: torch.Tensor, out_zero_point: torch.Tensor,
                             bias: torch.Tensor | None = None, *, backend: str | None = None) -> torch.Tensor:
    """Integer W4A8 linear with int8 output: per-token affine 8-bit activations (qta8a),
    per-group affine 4-bit weights (qga4w), per-token affine 8-bit output (qta8o).

    ``x = (x_q - x_zero_point[m]) * x_scale[m]`` (int8 [M, K], per token);
    ``W = (w_q - w_zero_point[n, g]) * w_scale[n, g]`` (4-bit u32x8 codes [N, K/8], per group;
    ``w_zero_point`` None for signed codes);
    ``out = clamp(round((x @ W.T + bias) / out_scale[m]) + out_zero_point[m], -128, 127)``.
    The fast paths accumulate in int32 inside each weight group and scale once per group.

    Example::

        >>> import torch, lowbit
        >>> from lowbit.ops import linear_qta8a_qga4w_qta8o
        >>> w = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
        >>> x_q = torch.randint(-128, 128, (2, 64), dtype=torch.int8)
        >>> one, zero = torch.full((2,), 0.05), torch.zeros(2, dtype=torch.int32)
        >>> out = linear_qta8a_qga4w_qta8o(x_q, one, zero, w.codes, w.scale, w.zero_point, 32,
        ...                                torch.full((2,), 0.5), zero)
        >>> out.dtype, out.shape
        (torch.int8, torch.Size([2, 16]))
    """
    _validate.tensor("x_q", x_q, dtypes=[torch.int8], ndim=2)
    m, k = x_q.shape
    for name, t, dtypes in [("x_scale", x_scale, SCALE_DTYPES), ("x_zero_point", x_zero_point, [torch.int32]),
                            ("out_scale", out_scale, SCALE_DTYPES), ("out_zero_point", out_zero_point, [torch.int32])]:
        _validate.tensor(name, t, dtypes=dtypes, ndim=1)
        _validate.shape(name, t, (m,), "one per token (row of x_q)")
    if w_zero_point is not None and w_zero_point.is_floating_point():
        raise TypeError(f"w_zero_point must be integer (int domain), got {w_zero_point.dtype}")
    n = _check_weight(k, w_codes, w_scale, w_zero_point, 4, group_size,
                      names=("w_codes", "w_scale", "w_zero_point"))
    if bias is not None:
        _validate.tensor("bias", bias, dtypes=_validate.FLOAT_DTYPES, ndim=1)
        _validate.shape("bias", bias, (n,), "[N]")
    _validate.same_device("x_q", x_q, x_scale=x_scale, x_zero_point=x_zero_point, w_codes=w_codes,
                          out_scale=out_scale, out_zero_point=out_zero_point, bias=bias)
    # Values: the integer kernels sum (x_q - x_zero_point)(q - w_zero_point) in int32 per group,
    # exact when the zero points lie in their code ranges and the group is at most W4A8_MAX_GROUP.
    for name, t in [("x_scale", x_scale), ("out_scale", out_scale)]:
        _validate.positive_finite(name, t)
    _validate.finite("w_scale", w_scale)
    for name, t in [("x_zero_point", x_zero_point), ("out_zero_point", out_zero_point)]:
        _validate.in_range(name, t, -128, 127, "the int8 code range")
    _validate.in_range("w_zero_point", w_zero_point, 0, 15, "the unsigned 4-bit code range")
    if group_size > W4A8_MAX_GROUP:
        raise ValueError(f"group_size={group_size} is past {W4A8_MAX_GROUP}, the largest group whose int32 "
                         "sum of (x_q - x_zero_point)(q - w_zero_point), at most 255 * 15 per term, is exact")
    return library.call(library.linear_qta8a_qga4w_qta8o, backend, x_q.device, x_q, x_scale, x_zero_point,
                        w_codes, w_scale, w_zero_point, group_size, out_scale, out_zero_point, bias)


from .split import split_linear as _split_linear  # noqa: E402 (split.py builds on this module)
