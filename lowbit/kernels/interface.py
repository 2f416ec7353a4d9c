"""The backend interface: what a backend provides, and the plan of which kernel runs.

``Backend`` itself is the reference backend: every method runs the plain-PyTorch
implementation in ``reference.py``.  A fast backend subclasses it, overrides the
methods it accelerates and calls ``super()`` for the cases its kernels do not cover,
so nothing is optional and nothing is looked up with ``getattr``.  Two methods are
compositions of the others (``int8_linear``, ``linear_qta8a_qga4w_qta8o``, ``split_matmul``); a backend
with a fused kernel overrides them and must give the same bits (``split_matmul``: the
same bound, see its docstring).

``plan`` is the one place a backend decides which of its kernels runs for a matmul;
its kernels, ``lowbit.runtime`` (the native decode step) and the tests (to pick a
tolerance) all ask it, so a threshold lives in one place.

Example::

    >>> import torch
    >>> from lowbit.kernels import get_backend
    >>> from lowbit.scheme import QuantScheme
    >>> get_backend("reference").plan(QuantScheme.parse("int4-asym-g64"), None, 1, 4096, torch.bfloat16)
    Plan(kernel='reference', why='plain PyTorch: the float32 matmul of the dequantized weight')
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scheme import QuantScheme
from . import reference as ref


@dataclass(frozen=True)
class Plan:
    """Which kernel of a backend runs a matmul, and why (for logs, tests and graphs)."""

    kernel: str
    why: str


class Backend:
    """The reference backend, and the interface every backend implements.

    Arguments arrive validated by ``lowbit.ops`` (shapes, dtypes, devices); methods
    never check.  Weight matmuls take the parts of a 2-D weight: ``codes`` [N, K] (8
    bit) or u32x8-packed int32 [N, K/8] (4 bit), ``scale`` [N, K / group_size],
    ``zero_point`` None (signed codes) or of scale's shape.
    """

    name = "reference"
    # Every kernel name ``plan`` may return: the tests check each is covered.
    kernels: tuple[str, ...] = ("reference",)

    # -- which kernel runs ---------------------------------------------------------------
    def plan(self, weight: QuantScheme, act: QuantScheme | None, m: int, k: int, dtype: torch.dtype) -> Plan:
        """The kernel that runs ``linear`` of ``m`` rows of ``dtype`` activations with K
        = ``k`` on a ``weight``-scheme weight, with 8-bit activations ``act`` or none."""
        return Plan("reference", "plain PyTorch: the float32 matmul of the dequantized weight" if act is None
                    else "plain PyTorch: dequantized activations and weight, float32 matmul")

    # Bumped when the plans change (a new calibration): what was prepared by an older plan
    # (``one_row``) is prepared again.
    plan_epoch = 0

    def one_row(self, weight: QuantScheme, act: QuantScheme | None, codes, scale, zero_point, k: int,
                dtype: torch.dtype):
        """A callable that runs ``linear`` for one row of ``dtype`` activations on this
        weight (its matmul parts) with the same bits as the ops, its weight laid out once,
        or None (the ops run).  For ``lowbit.linear``'s eager calls at decode size, where
        the checks and conversions around the kernel cost as much as the kernel."""
        return None

    # -- quantize / dequantize -------------------------------------------------------------
    def choose_qparams(self, x, scheme: QuantScheme):
        return ref.choose_qparams(x, scheme)

    def quantize(self, x, scale, zero_point, scheme: QuantScheme):
        """Packed codes of x (``scheme.code_dtype``, ``scheme.packed_shape(x.shape)``): the
        reference's rounding, packed with this backend's ``pack``."""
        q = ref.quantize(x, scale, zero_point, scheme)
        return self.pack(q, scheme.bits, scheme.packing) if scheme.is_packed else q

    def dequantize(self, codes, scale, zero_point, scheme: QuantScheme, shape, out_dtype):
        return ref.dequantize_packed(codes, scale, zero_point, scheme, shape, out_dtype)

    def pack(self, q, bits: int, packing: str):
        return ref.pack(q, bits, packing)

    def unpack(self, packed, bits: int, packing: str, signed: bool):
        return ref.unpack(packed, bits, packing, signed)

    def quantize_per_token(self, x, bits: int, symmetric: bool):
        """(codes, scale, int32 zero point, ok): ok is False when x holds NaN/Inf or a row's
        scale overflowed (the op then says which)."""
        return ref.quantize_per_token(x, bits, symmetric)

    def dequantize_per_token(self, q, scale, zero_point):
        return ref.dequantize_per_token(q, scale, zero_point)

    # -- int32 accumulators -> float ----------------------------------------------------------
    def dequantize_accumulator_grouped(self, acc, scale, group_size: int, out_dtype):
        return ref.dequantize_accumulator_grouped(acc, scale, group_size, out_dtype)

    def dequantize_accumulator_rowcol(self, acc, row_scale, col_scale, out_dtype):
        return ref.dequantize_accumulator_rowcol(acc, row_scale, col_scale, out_dtype)

    def requantize_per_token(self, y, out_scale, out_zero_point):
        return ref.requantize_per_token(y, out_scale, out_zero_point)

    # -- matmuls ----------------------------------------------------------------------------------
    def weight_only_matmul(self, x, codes, scale, zero_point, bits: int, group_size: int,
                           zero_point_min: bool = False):
        """x @ W.T, W = (q - zero_point) * scale, or q * scale + zero_point with ``zero_point_min``."""
        return ref.weight_only_matmul(x, codes, scale, zero_point, bits, group_size, zero_point_min)

    def split_matmul(self, x, codes, scale, zero_point, bits: int, group_size: int, outliers, high_codes,
                     high_scale, high_zero_point, high_bits: int, high_group_size: int):
        """x @ W.T for a split weight (``lowbit.SplitQTensor``): ``x @ low.T + x[..., outliers]
        @ high.T``, two weight-only matmuls of this backend's kernels (each reads its packed
        weight once; no float weight exists), their results in x's dtype summed in float32 (float64
        for float64 x) and rounded once to x's dtype.  Against ``reference.split_matmul`` (one float32
        matmul of the summed weight) the difference is each part's weight-only rounding
        plus one rounding of each part to x's dtype."""
        y = self.weight_only_matmul(x, codes, scale, zero_point, bits, group_size)
        xh = x.index_select(-1, outliers)
        yh = self.weight_only_matmul(xh, high_codes, high_scale, high_zero_point, high_bits, high_group_size)
        if x.dtype in (torch.float32, torch.float64):
            return y.add_(yh)  # one rounding in x's dtype: the sum below, without the casts
        return (y.to(torch.float32) + yh.to(torch.float32)).to(x.dtype)

    def int8_mm(self, a, b):
        return ref.int8_mm(a, b)

    def linear_a8_blocks(self, x, codes, scale, zero_point, bits: int, group_size: int, act_block: int,
                         zero_point_min: bool = False):
        """(y, ok): x [..., K] quantized to int8 in symmetric blocks of ``act_block`` along K,
        times the weight; ok is False (and y unwritten) when x held NaN/Inf: the op then
        says where."""
        if not bool(torch.isfinite(x).all()):
            return x.new_empty((*x.shape[:-1], codes.shape[0])), False
        return ref.linear_a8_blocks(x, codes, scale, zero_point, bits, group_size, act_block, zero_point_min), True

    def linear_qta8a_qga4w(self, x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size: int, bias):
        return ref.linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size, bias)

    def int8_linear(self, a, a_zero_point, b, row_scale, col_scale, bias, out_dtype):
        """W8A8: ``dequantize_accumulator(a . b.T - a_zp[m] sum b[n], row_scale, col_scale)``
        rounded to out_dtype, then ``+ bias`` in out_dtype; a fused kernel gives the same bits."""
        acc = self.int8_mm(a, b)
        if a_zero_point is not None:
            # (q_x - z_x) . q_w = q_x . q_w - z_x * sum(q_w): exact in int32 for K < 2^16.
            acc = acc - a_zero_point[:, None] * b.sum(dim=1, dtype=torch.int32)[None, :]
        y = self.dequantize_accumulator_rowcol(acc, row_scale, col_scale, out_dtype)
        return y if bias is None else y + bias.to(out_dtype)

    def linear_qta8a_qga4w_qta8o(self, x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point,
                                 group_size: int, out_scale, out_zero_point, bias):
        """The W4A8 linear, then its output requantized per token to int8; a kernel with the
        requantization fused gives the same bits."""
        y = self.linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size, bias)
        return self.requantize_per_token(y, out_scale, out_zero_point)
