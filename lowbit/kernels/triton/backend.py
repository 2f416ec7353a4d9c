"""The ``"triton"`` backend: the functions the operators in ``lowbit.ops.library`` call,
with the signatures of ``lowbit.kernels.reference``.  Triton kernels where they apply;
the rest (3-bit codes, float64 matmuls, group sizes the tiles cannot follow) goes to
the reference, which runs on CUDA tensors as plain PyTorch."""

from __future__ import annotations

import torch

from .. import reference
from ..cpu import pack, quantize_packed, unpack  # word-wide torch ops: any device
from . import elementwise, int8, weight_only
from ._common import INTERPRET

__all__ = ["INTERPRET", "choose_qparams", "quantize_packed", "pack", "unpack", "dequantize_packed",
           "quantize_per_token", "dequantize_accumulator_grouped", "dequantize_accumulator_rowcol",
           "weight_only_matmul", "int8_mm", "int8_linear", "linear_qta8a_qga4w", "requantize_per_token",
           "linear_qta8a_qga4w_qta8o"]

choose_qparams = reference.choose_qparams
requantize_per_token = reference.requantize_per_token
quantize_per_token = elementwise.quantize_per_token
dequantize_accumulator_grouped = elementwise.dequantize_accumulator_grouped
dequantize_accumulator_rowcol = elementwise.dequantize_accumulator_rowcol


def dequantize_packed(codes, scale, zero_point, bits, symmetric, granularity, group_size, packing, shape,
                      out_dtype):
    if bits == 3:  # 3-bit codes straddle words
        return reference.dequantize_packed(codes, scale, zero_point, bits, symmetric, granularity, group_size,
                                           packing, shape, out_dtype)
    return elementwise.dequantize_packed(codes, scale, zero_point, bits, symmetric, granularity, group_size,
                                         packing, shape, out_dtype)


def weight_only_matmul(x, codes, scale, zero_point, bits, group_size):
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.dtype == torch.float64 or not weight_only.supported(bits, group_size, x.shape[-1], m):
        return reference.weight_only_matmul(x, codes, scale, zero_point, bits, group_size)
    return weight_only.weight_only_matmul(x, codes, scale, zero_point, bits, group_size)


def int8_mm(a, b):
    """int8 a [M, K] @ int8 b [N, K].T, exact int32."""
    return int8.int8_mm_rowcol(a, b, None, None, torch.int32)


def int8_linear(a, a_zero_point, b, row_scale, col_scale, bias, out_dtype):
    """W8A8 in one kernel: the int8 GEMM with the dequantize_accumulator epilogue fused,
    ``((float32(a . b - a_zp[m] sum b[n]) * row_scale[m]) * col_scale[n] + bias[n])``
    rounded once to out_dtype; a_zero_point may be None (symmetric activations)."""
    return int8.int8_mm_rowcol(a, b, row_scale, col_scale, out_dtype, a_zero_point, bias)


def linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points, group_size, bias):
    if not int8.w4a8_block_k_ok(group_size):
        return reference.linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points,
                                            group_size, bias)
    return int8.linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points, group_size,
                                   bias)


def linear_qta8a_qga4w_qta8o(x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points, group_size,
                             out_scale, out_zero_point, bias):
    """Requirement D in one kernel: the W4A8 linear with the per-token int8
    requantization of its output fused (the float output never reaches memory)."""
    if not int8.w4a8_block_k_ok(group_size):
        y = linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points, group_size, bias)
        return requantize_per_token(y, out_scale, out_zero_point)
    return int8.linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points, group_size,
                                   bias, out_scale, out_zero_point)
