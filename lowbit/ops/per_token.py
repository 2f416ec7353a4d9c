"""Per-token (per-row) quantize / dequantize with a strict, validated interface.

``y[n, d] = (q[n, d] - zero_point[n]) * scale[n]``, computed in float32 (float64 for
float64 output) and rounded once to the output dtype, so every backend gives the
same bits.  Differentiable with respect to ``scale``.
"""

from __future__ import annotations

import torch

from .. import _validate
from . import library


def quantize_per_token(x: torch.Tensor, bits: int = 8, symmetric: bool = False, *,
                       backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` [N, D] with its own scale.

    Returns ``(q, scale, zero_point)``: q [N, D] uint8 codes in [0, 2^bits) with an
    integer zero point (asymmetric) or int8 codes with zero_point 0 (symmetric);
    scale [N] in x's dtype; zero_point [N] int32.  NaN/Inf in x is an error.

    Example::

        >>> import torch
        >>> from lowbit.ops import quantize_per_token, dequantize_per_token
        >>> x = torch.randn(4, 32)
        >>> q, scale, zp = quantize_per_token(x)
        >>> q.dtype, scale.shape, zp.dtype
        (torch.uint8, torch.Size([4]), torch.int32)
        >>> bool(((dequantize_per_token(q, scale, zp) - x).abs() <= scale[:, None] / 2 + 1e-6).all())
        True
    """
    _validate.tensor("x", x, dtypes=_validate.FLOAT_DTYPES, ndim=2)
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an int in [2, 8], got {bits!r}")
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
    return library.call(library.quantize_per_token, backend, x.device, x, bits, symmetric)


def dequantize_per_token(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                         out_dtype: torch.dtype | None = None, *, backend: str | None = None
                         ) -> torch.Tensor:
    """``(q[n, d] - zero_point[n]) * scale[n]`` in the dtype of ``scale``.

    Args:
        q: int8 or uint8 [N, D].
        scale: [N], float32, float64, float16 or bfloat16: the output type.
        zero_point: [N] int32.
        out_dtype: defaults to scale.dtype; any other dtype is an error.

    Example::

        >>> import torch
        >>> from lowbit.ops import dequantize_per_token
        >>> q = torch.tensor([[0, 128, 255]], dtype=torch.uint8)
        >>> dequantize_per_token(q, torch.tensor([0.5]), torch.tensor([128], dtype=torch.int32))
        tensor([[-64.0000,   0.0000,  63.5000]])
    """
    _validate.tensor("q", q, dtypes=[torch.int8, torch.uint8], ndim=2)
    _validate.tensor("scale", scale, dtypes=_validate.FLOAT_DTYPES, ndim=1)
    _validate.tensor("zero_point", zero_point, dtypes=[torch.int32], ndim=1)
    _validate.shape("scale", scale, q.shape[:1], "one per row of q")
    _validate.shape("zero_point", zero_point, q.shape[:1], "one per row of q")
    _validate.same_device("q", q, scale=scale, zero_point=zero_point)
    if out_dtype is not None and out_dtype != scale.dtype:
        raise TypeError(
            f"out_dtype={out_dtype} differs from scale.dtype={scale.dtype}; the scale must be "
            "given in the output type (pass scale.to(out_dtype))"
        )
    return library.call(library.dequantize_per_token, backend, q.device, q, scale, zero_point)
