"""int32 GEMM accumulators -> float (the W8A8 epilogue).

Grouped form: ``out = float32(acc) * float32(scale[group])`` rounded once, where
``scale = scale_activation * scale_weight`` is given per group of ``group_size``
consecutive elements of the last dim.  Row/column form:
``out = float32(acc) * row_scale[m] * col_scale[n]``, left to right in float32.
"""

from __future__ import annotations

import torch

from .. import _validate
from . import library

SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dequantize_accumulator(acc: torch.Tensor, scale: torch.Tensor | None = None,
                           group_size: int | None = None, *, row_scale: torch.Tensor | None = None,
                           col_scale: torch.Tensor | None = None,
                           out_dtype: torch.dtype = torch.bfloat16,
                           backend: str | None = None) -> torch.Tensor:
    """Convert int32 accumulators [..., N] to ``out_dtype``.

    Give either ``scale`` ([N // group_size] shared by all rows, or
    [..., N // group_size]) with ``group_size`` (inferred from scale when None), or
    ``row_scale`` [...] and ``col_scale`` [N].

    Example::

        >>> import torch
        >>> from lowbit.ops import dequantize_accumulator
        >>> acc = torch.tensor([[100, -200, 300, 400]], dtype=torch.int32)
        >>> dequantize_accumulator(acc, torch.tensor([0.5, 0.25]), 2, out_dtype=torch.float32)
        tensor([[  50., -100.,   75.,  100.]])
        >>> dequantize_accumulator(acc, row_scale=torch.tensor([2.0]),
        ...                        col_scale=torch.tensor([1.0, 1.0, 0.5, 0.5]), out_dtype=torch.float32)
        tensor([[ 200., -400.,  300.,  400.]])
    """
    _validate.tensor("acc", acc, dtypes=[torch.int32], min_ndim=1)
    _validate.float_dtype("out_dtype", out_dtype, OUT_DTYPES)
    n = acc.shape[-1]
    if scale is not None:
        if row_scale is not None or col_scale is not None:
            raise ValueError("give either scale (grouped form) or row_scale and col_scale, not both")
        _validate.tensor("scale", scale, dtypes=SCALE_DTYPES, min_ndim=1)
        if group_size is None:
            groups = scale.shape[-1]
            if groups == 0 or n % groups:
                raise ValueError(
                    f"cannot infer group_size: scale.shape[-1]={groups} does not divide acc.shape[-1]={n}"
                )
            group_size = n // groups
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if n % group_size:
            raise ValueError(f"group_size={group_size} does not divide acc.shape[-1]={n}")
        shared, per_row = (n // group_size,), (*acc.shape[:-1], n // group_size)
        if tuple(scale.shape) not in (shared, per_row):
            raise ValueError(
                f"scale must have shape {shared} or {per_row} for acc {tuple(acc.shape)} and "
                f"group_size={group_size}, got {tuple(scale.shape)}"
            )
        _validate.same_device("acc", acc, scale=scale)
        gs = group_size
    else:
        if row_scale is None or col_scale is None:
            raise ValueError("give scale (grouped form) or both row_scale and col_scale")
        if group_size is not None:
            raise ValueError("group_size only applies to the grouped form (scale=...)")
        _validate.tensor("row_scale", row_scale, dtypes=SCALE_DTYPES)
        _validate.tensor("col_scale", col_scale, dtypes=SCALE_DTYPES, ndim=1)
        _validate.shape("row_scale", row_scale, acc.shape[:-1], "one per row of acc")
        _validate.shape("col_scale", col_scale, (n,), "one per column of acc")
        _validate.same_device("acc", acc, row_scale=row_scale, col_scale=col_scale)
        gs = 0
    return library.call(library.dequantize_accumulator, backend, acc.device, acc, scale, gs, row_scale,
                        col_scale, out_dtype)
