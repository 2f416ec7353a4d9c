"""quantize / dequantize / choose_qparams / fake_quantize for every scheme.

The arithmetic is defined once, in ``lowbit.scheme``; this module validates
arguments and calls the ``lowbit::*`` custom ops.
"""

from __future__ import annotations

import torch

from .. import _validate
from ..qtensor import QTensor, SplitQTensor
from ..scheme import QuantScheme
from . import library


def as_scheme(scheme: QuantScheme | str, name: str = "scheme") -> QuantScheme:
    if isinstance(scheme, QuantScheme):
        return scheme
    if isinstance(scheme, str):
        return QuantScheme.parse(scheme)
    raise TypeError(f"{name} must be a QuantScheme or its string form, got {type(scheme).__name__}")


def _check_input(x, s: QuantScheme, name: str = "x", packed: bool = True) -> None:
    _validate.tensor(name, x, dtypes=_validate.FLOAT_DTYPES, min_ndim=1)
    k = x.shape[-1]
    if s.granularity == "group" and k % s.group_size:
        raise ValueError(
            f"group_size={s.group_size} of scheme '{s}' does not divide {name}.shape[-1]={k}"
        )
    if packed and s.is_packed and k % s.pack_unit:
        raise ValueError(
            f"{name}.shape[-1]={k} must be a multiple of {s.pack_unit} to pack {s.bits}-bit codes "
            f"into {s.packing} words (scheme '{s}')"
        )


def _check_qparams(x, s: QuantScheme, scale, zero_point, names=("scale", "zero_point")) -> None:
    """Static quantization parameters: shapes, dtypes and device, then values (a scale
    finite and > 0, an integer zero point inside the code range, a float one finite)."""
    sname, zname = names
    expected = s.scale_shape(x.shape)
    _validate.tensor(sname, scale, dtypes=[s.scale_dtype])
    _validate.shape(sname, scale, expected, f"granularity {s.granularity!r} of {tuple(x.shape)}")
    if s.symmetric:
        if zero_point is not None:
            raise ValueError(f"{zname} must be None for the symmetric scheme '{s}'")
    else:
        if zero_point is None:
            raise ValueError(f"{zname} is required for the asymmetric scheme '{s}'")
        _validate.tensor(zname, zero_point, dtypes=[s.zero_point_dtype])
        _validate.shape(zname, zero_point, expected, f"same as {sname}")
    _validate.same_device("x", x, **{sname: scale, zname: zero_point})
    _validate.positive_finite(sname, scale)
    if zero_point is not None and s.zero_point_domain == "int":
        _validate.in_range(zname, zero_point, s.qmin, s.qmax, f"the code range of '{s}'")
    elif zero_point is not None:
        _validate.finite(zname, zero_point)


def choose_qparams(x: torch.Tensor, scheme: QuantScheme | str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point (None for symmetric schemes) of ``x`` under ``scheme``.

    Example::

        >>> import torch
        >>> from lowbit.ops import choose_qparams
        >>> scale, zp = choose_qparams(torch.tensor([[-1.0, 0.0, 2.0, 3.0]]), "int8-asym-token")
        >>> round(scale.item(), 6), zp.item()
        (0.015686, 64)
    """
    s = as_scheme(scheme)
    _check_input(x, s)
    scale, zp = library.choose_qparams(x, str(s))
    return scale, (None if s.symmetric else zp)


def quantize(x: torch.Tensor, scheme: QuantScheme | str, scale: torch.Tensor | None = None,
             zero_point: torch.Tensor | None = None, *, backend: str | None = None) -> QTensor:
    """Quantize ``x`` to a ``QTensor``; scale and zero point are chosen from ``x``
    unless given (static quantization).

    ``x`` is a float32, float64, float16 or bfloat16 tensor of shape [..., K] (at least
    1-D); blocks run along the last dim, so K must be a multiple of the group size of a
    grouped scheme and of ``scheme.pack_unit`` for packed codes (8 for 4-bit codes in
    int32 words).  ``scale`` and ``zero_point``, when given, have shape
    ``scheme.scale_shape(x.shape)``, the scheme's scale and zero-point dtypes and x's
    device.  Returns a QTensor of x's shape.

    Example::

        >>> import torch, lowbit
        >>> w = torch.randn(128, 256)
        >>> qt = lowbit.quantize(w, "int4-sym-g64")
        >>> err = (lowbit.dequantize(qt) - w).abs().max()
        >>> bool(err <= qt.scale.max() / 2 + 1e-6)
        True
    """
    s = as_scheme(scheme)
    _check_input(x, s)
    if scale is None:
        if zero_point is not None:
            raise ValueError("zero_point was given without scale; give both or neither")
        scale, zero_point = choose_qparams(x, s)
    else:
        _check_qparams(x, s, scale, zero_point)
    codes = library.call(library.quantize, backend, x.device, x, scale, zero_point, str(s))
    return QTensor(codes, scale, zero_point, s, x.shape)


def dequantize(qt: QTensor, dtype: torch.dtype = torch.float32, *, backend: str | None = None) -> torch.Tensor:
    """``(q - zero_point) * scale`` as ``dtype`` (computed in float32, float64 for a
    float64 output, rounded once); a SplitQTensor's both parts summed (``split_dequantize``).

    Example::

        >>> import torch, lowbit
        >>> qt = lowbit.quantize(torch.tensor([[0.5, -1.0, 0.25, 1.0]]), "int8-sym-tensor")
        >>> lowbit.dequantize(qt, torch.bfloat16).dtype
        torch.bfloat16
    """
    if isinstance(qt, SplitQTensor):
        from .split import split_dequantize

        return split_dequantize(qt, dtype)
    if not isinstance(qt, QTensor):
        raise TypeError(f"qt must be a lowbit.QTensor or SplitQTensor, got {type(qt).__name__}")
    _validate.float_dtype("dtype", dtype)
    return library.call(library.dequantize, backend, qt.codes.device, qt.codes, qt.scale, qt.zero_point,
                        str(qt.scheme), list(qt.shape), dtype)


def fake_quantize(x: torch.Tensor, scheme: QuantScheme | str, scale: torch.Tensor | None = None,
                  zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(quantize(x))`` in x's dtype, with a straight-through gradient
    (identity where the rounded code lies in [qmin, qmax], zero where quantize clamps
    it), for quantization-aware training.  Scale and zero point are chosen from x
    unless given.

    Example::

        >>> import torch
        >>> from lowbit.ops import fake_quantize
        >>> x = torch.tensor([[-2.0, -0.5, 0.5, 2.0]], requires_grad=True)
        >>> y = fake_quantize(x, "int4-sym-tensor", scale=torch.tensor([0.25]))
        >>> y.sum().backward()
        >>> y.tolist(), x.grad.tolist()  # 2.0 / 0.25 = 8 > qmax = 7: clamped
        ([[-2.0, -0.5, 0.5, 1.75]], [[1.0, 1.0, 1.0, 0.0]])
    """
    s = as_scheme(scheme)
    _check_input(x, s, packed=False)
    if scale is None:
        if zero_point is not None:
            raise ValueError("zero_point was given without scale; give both or neither")
        scale, zero_point = library.choose_qparams(x.detach(), str(s))
        zero_point = None if s.symmetric else zero_point
    else:
        _check_qparams(x, s, scale, zero_point)
    return library.fake_quantize(x, scale, zero_point, str(s))
