"""Memory-bound kernels, bit-exact with the reference: dequantize (codes, per-token
codes and int32 accumulators alike), the row/column accumulator epilogue, and
per-token quantize.

Every value is computed with the reference's operations in the reference's order and
types (float32, float64 for float64 output; IEEE division; round half to even), so
the results are the same bits."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...scheme import code_range
from ._common import cast_rn, div_exact, round_half_even

BLOCK_R, BLOCK_K = 8, 256


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, z_ptr, y_ptr, R, K, GROUP, RPS, BITS: tl.constexpr, PER_WORD: tl.constexpr,
                    SIGNED: tl.constexpr, HAS_ZP: tl.constexpr, CDT: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """y[r, k] = (q[r, k] - z[i]) * s[i], i = (r // RPS) * (K // GROUP) + k // GROUP, in CDT;
    q is a code (PER_WORD = 1: int8, uint8 or int32) or a field of a packed word."""
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rr[:, None] < R) & (rk[None, :] < K)
    row = rr.to(tl.int64)[:, None]
    if PER_WORD == 1:
        v = tl.load(q_ptr + row * K + rk[None, :], mask=mask, other=0)
    else:
        word = tl.load(q_ptr + row * (K // PER_WORD) + (rk // PER_WORD)[None, :], mask=mask, other=0)
        v = (word.to(tl.int32) >> ((rk % PER_WORD) * BITS)[None, :]) & ((1 << BITS) - 1)
        if SIGNED:
            v = v - ((v >> (BITS - 1)) << BITS)
    si = (rr.to(tl.int64) // RPS)[:, None] * (K // GROUP) + (rk // GROUP)[None, :]
    v = v.to(CDT)
    if HAS_ZP:
        v = v - tl.load(z_ptr + si, mask=mask, other=0).to(CDT)
    y = v * tl.load(s_ptr + si, mask=mask, other=0).to(CDT)
    tl.store(y_ptr + row * K + rk[None, :], cast_rn(y, y_ptr.dtype.element_ty), mask=mask)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bits: int,
               signed: bool, rows: int, k: int, group: int, rows_per_scale: int,
               out_dtype: torch.dtype) -> torch.Tensor:
    """[rows, k] values of ``codes`` (one per element, or ``bits``-bit fields of int32 or
    uint8 words), block (r, k) scaled by scale.flat[(r // rows_per_scale) * (k // group) + k // group]."""
    y = torch.empty(rows, k, dtype=out_dtype, device=codes.device)
    if rows == 0 or k == 0:
        return y
    word_bits = codes.element_size() * 8
    per_word = 1 if bits >= 8 else word_bits // bits
    cdt = tl.float64 if out_dtype == torch.float64 else tl.float32
    grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(k, BLOCK_K))
    _dequant_kernel[grid](codes.contiguous(), scale.contiguous(),
                          scale if zero_point is None else zero_point.contiguous(), y, rows, k, group,
                          rows_per_scale, BITS=bits, PER_WORD=per_word, SIGNED=signed,
                          HAS_ZP=zero_point is not None, CDT=cdt, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    return y


def dequantize_packed(codes, scale, zero_point, scheme, shape, out_dtype) -> torch.Tensor:
    """The backend interface of ``lowbit.kernels.reference.dequantize_packed`` for 2-, 4-
    and 8-bit codes (3-bit codes straddle words: the caller sends them to the reference)."""
    k = shape[-1] if shape else 1
    rows = math.prod(shape) // k if k else 0
    rps, group = scheme.scale_map(shape)
    return dequantize(codes, scale, zero_point, scheme.bits, scheme.symmetric, rows, k, group, rps,
                      out_dtype).reshape(shape)


@triton.jit
def _rowcol_kernel(acc_ptr, row_ptr, col_ptr, y_ptr, R, N, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rn = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rr[:, None] < R) & (rn[None, :] < N)
    off = rr.to(tl.int64)[:, None] * N + rn[None, :]
    acc = tl.load(acc_ptr + off, mask=mask, other=0).to(tl.float32)
    row = tl.load(row_ptr + rr, mask=rr < R, other=0).to(tl.float32)
    col = tl.load(col_ptr + rn, mask=rn < N, other=0).to(tl.float32)
    tl.store(y_ptr + off, cast_rn((acc * row[:, None]) * col[None, :], y_ptr.dtype.element_ty), mask=mask)


def dequantize_accumulator_grouped(acc, scale, group_size, out_dtype):
    n = acc.shape[-1]
    rows = acc.numel() // n if n else 0
    shared = scale.dim() == 1 and acc.dim() > 1
    y = dequantize(acc, scale, None, 32, True, rows, n, group_size, max(rows, 1) if shared else 1, out_dtype)
    return y.reshape(acc.shape)


def dequantize_accumulator_rowcol(acc, row_scale, col_scale, out_dtype):
    n = acc.shape[-1]
    rows = acc.numel() // n if n else 0
    y = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    if rows and n:
        grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(n, BLOCK_K))
        _rowcol_kernel[grid](acc.contiguous(), row_scale.contiguous(), col_scale.contiguous(), y, rows, n,
                             BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    return y


@triton.jit
def _quantize_per_token_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bad_ptr, D, stride_x, QMIN: tl.constexpr,
                               QMAX: tl.constexpr, SYMMETRIC: tl.constexpr, CDT: tl.constexpr,
                               ROUND_UP: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row: range, scale (rounded up to x's dtype), zero point, codes, and whether
    the row held NaN/Inf; the formulas of ``reference.choose_qparams`` / ``quantize``."""
    r = tl.program_id(0)
    x_row = x_ptr + r.to(tl.int64) * stride_x
    lo_v = tl.full([BLOCK_D], float("inf"), CDT)
    hi_v = tl.full([BLOCK_D], float("-inf"), CDT)
    bad_v = tl.zeros([BLOCK_D], dtype=tl.int32)
    for d0 in range(0, D, BLOCK_D):
        rd = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_row + rd, mask=rd < D, other=0).to(CDT)
        lo_v = tl.minimum(lo_v, tl.where(rd < D, x, float("inf")))
        hi_v = tl.maximum(hi_v, tl.where(rd < D, x, float("-inf")))
        bad_v |= ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
    lo = tl.min(lo_v, axis=0)
    hi = tl.max(hi_v, axis=0)
    if SYMMETRIC:
        scale = div_exact(tl.maximum(-lo, hi), (QMAX - QMIN) / 2)
    else:
        lo = tl.minimum(lo, 0.0)
        hi = tl.maximum(hi, 0.0)
        scale = div_exact(hi - lo, (QMAX - QMIN) * 1.0)
    scale = tl.where(scale > 0, scale, 1.0)
    stored = cast_rn(scale, s_ptr.dtype.element_ty)
    if ROUND_UP:  # a 16-bit scale is rounded up (lowbit.scheme): it never clips the range
        up = (stored.to(tl.int16, bitcast=True) + 1).to(s_ptr.dtype.element_ty, bitcast=True)
        stored = tl.where(stored.to(CDT) < scale, up, stored)
    tl.store(s_ptr + r, stored)
    s = stored.to(CDT)
    zp = 0.0
    if not SYMMETRIC:
        zp = tl.minimum(tl.maximum(QMIN - round_half_even(div_exact(lo, s)), QMIN), QMAX)
    tl.store(z_ptr + r, zp.to(tl.int32))
    tl.store(bad_ptr + r, tl.max(bad_v, axis=0))
    q_row = q_ptr + r.to(tl.int64) * D
    for d0 in range(0, D, BLOCK_D):
        rd = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_row + rd, mask=rd < D, other=0).to(CDT)
        q = tl.minimum(tl.maximum(round_half_even(div_exact(x, s)) + zp, QMIN), QMAX)
        tl.store(q_row + rd, q.to(q_ptr.dtype.element_ty), mask=rd < D)


def quantize_per_token(x: torch.Tensor, bits: int, symmetric: bool):
    """(codes, scale in x's dtype, int32 zero point, whether x was all finite) of each
    row of x [N, D], bit-identical to ``reference.quantize_per_token``."""
    n, d = x.shape
    qmin, qmax = code_range(bits, symmetric)
    q = torch.empty(n, d, dtype=torch.int8 if symmetric else torch.uint8, device=x.device)
    scale = torch.empty(n, dtype=x.dtype, device=x.device)
    zp = torch.empty(n, dtype=torch.int32, device=x.device)
    bad = torch.empty(n, dtype=torch.int32, device=x.device)
    if n == 0:
        return q, scale, zp, True
    cdt = tl.float64 if x.dtype == torch.float64 else tl.float32
    block = min(max(triton.next_power_of_2(d), 16), 1024)
    x = x if x.stride(-1) == 1 else x.contiguous()
    _quantize_per_token_kernel[(n,)](x, q, scale, zp, bad, d, x.stride(0), QMIN=qmin, QMAX=qmax,
                                     SYMMETRIC=symmetric, CDT=cdt,
                                     ROUND_UP=x.dtype in (torch.float16, torch.bfloat16), BLOCK_D=block)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        # Inside a CUDA graph capture the host cannot look (a sync ends the capture): the
        # graph asserts on the device instead, so a replay on NaN/Inf stops with this error.
        torch._assert_async((bad.amax() == 0) & torch.isfinite(scale).all(),
                            "quantize_per_token: x contains NaN or Inf, or a row's scale overflows")
        return q, scale, zp, True
    return q, scale, zp, not bool(bad.any() | ~torch.isfinite(scale).all())  # one host sync

