"""The ``"triton"`` backend: Triton kernels where they apply; the rest (3-bit codes,
float64 matmuls, group sizes the tiles cannot follow) goes to the reference, which runs
on CUDA tensors as plain PyTorch.  Which kernel runs is decided in ``plan``."""

from __future__ import annotations

import torch

from .. import packing as word_packing
from ..interface import Backend, Plan
from . import elementwise, int8, weight_only


def _weight_only_plan(bits, group, m, k, dtype, zero_point_min=False) -> Plan:
    if zero_point_min:
        return Plan("reference", "no Triton kernel for q * s + m weights (the \"min\" zero-point domain)")
    if dtype == torch.float64 or not weight_only.supported(bits, group, k, m):
        return Plan("reference", "no Triton tile covers these bits, group size and K (or float64)")
    if m == 1:
        return Plan("weight_only_gemv", "one row: split-K GEMV on the packed weight")
    return Plan("weight_only_gemm", "tensor-core GEMM, the weight dequantized per tile")


class TritonBackend(Backend):
    name = "triton"
    kernels = ("reference", "weight_only_gemv", "weight_only_gemm", "int8_gemm", "w4a8_gemm")

    def plan(self, weight, act, m, k, dtype):
        group = weight.group_size or k
        if act is None:
            return _weight_only_plan(weight.bits, group, m, k, dtype, weight.zero_point_domain == "min")
        if act.granularity == "group":
            return Plan("reference", "no triton kernel for activations in int8 blocks")
        if weight.bits == 8:
            return Plan("int8_gemm", "int8 tensor-core GEMM with the accumulator epilogue fused")
        if int8.w4a8_block_k_ok(group):
            return Plan("w4a8_gemm", "int8 x u4 GEMM with integer sums per weight group")
        return Plan("reference", f"group size {group} is not a multiple of 32")

    def pack(self, q, bits, packing):
        return word_packing.pack(q, bits, packing)

    def unpack(self, packed, bits, packing, signed):
        return word_packing.unpack(packed, bits, packing, signed)

    def dequantize(self, codes, scale, zero_point, scheme, shape, out_dtype):
        if scheme.bits == 3 or scheme.zero_point_domain == "min":  # straddling words; q * s + m: not yet
            return super().dequantize(codes, scale, zero_point, scheme, shape, out_dtype)
        return elementwise.dequantize_packed(codes, scale, zero_point, scheme, shape, out_dtype)

    def quantize_per_token(self, x, bits, symmetric):
        return elementwise.quantize_per_token(x, bits, symmetric)

    def dequantize_per_token(self, q, scale, zero_point):
        d = q.shape[1]
        return elementwise.dequantize(q, scale, zero_point, 8, q.dtype == torch.int8, q.shape[0], d, d, 1,
                                      scale.dtype).reshape(q.shape)

    def dequantize_accumulator_grouped(self, acc, scale, group_size, out_dtype):
        return elementwise.dequantize_accumulator_grouped(acc, scale, group_size, out_dtype)

    def dequantize_accumulator_rowcol(self, acc, row_scale, col_scale, out_dtype):
        return elementwise.dequantize_accumulator_rowcol(acc, row_scale, col_scale, out_dtype)

    def weight_only_matmul(self, x, codes, scale, zero_point, bits, group_size, zero_point_min=False):
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        if _weight_only_plan(bits, group_size, m, k, x.dtype, zero_point_min).kernel == "reference":
            return super().weight_only_matmul(x, codes, scale, zero_point, bits, group_size, zero_point_min)
        return weight_only.weight_only_matmul(x, codes, scale, zero_point, bits, group_size)

    def int8_mm(self, a, b):
        """int8 a [M, K] @ int8 b [N, K].T, exact int32."""
        return int8.int8_mm_rowcol(a, b, None, None, torch.int32)

    def int8_linear(self, a, a_zero_point, b, row_scale, col_scale, bias, out_dtype):
        """W8A8 in one kernel: the int8 GEMM with the dequantize_accumulator epilogue fused,
        ``((float32(a . b - a_zp[m] sum b[n]) * row_scale[m]) * col_scale[n] + bias[n])``
        rounded once to out_dtype; a_zero_point may be None (symmetric activations)."""
        return int8.int8_mm_rowcol(a, b, row_scale, col_scale, out_dtype, a_zero_point, bias)

    def linear_qta8a_qga4w(self, x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size, bias):
        if not int8.w4a8_block_k_ok(group_size):
            return super().linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point,
                                              group_size, bias)
        return int8.linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size,
                                       bias)

    def linear_qta8a_qga4w_qta8o(self, x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size,
                                 out_scale, out_zero_point, bias):
        """The W4A8 linear with the per-token int8 requantization of its output fused (the
        float output never reaches memory)."""
        if not int8.w4a8_block_k_ok(group_size):
            return super().linear_qta8a_qga4w_qta8o(x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point,
                                                    group_size, out_scale, out_zero_point, bias)
        return int8.linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size,
                                       bias, out_scale, out_zero_point)


BACKEND = TritonBackend()
