"""Integer matmuls on int8 tensor cores: W8A8 and W4A8.

* ``_int8_gemm_kernel``: int8 a [M, K] @ int8 b [N, K].T with exact int32 accumulation
  (tl.dot on int8 operands), and, when ``EPILOGUE`` is set, the W8A8 epilogue fused:
  ``(float32(acc - a_zp[m] * b_sum[n]) * row_scale[m]) * col_scale[n]`` rounded to the
  output dtype, then ``+ bias[n]`` rounded again: the same bits as ``dequantize_accumulator``
  followed by ``lowbit.linear``'s bias add, while the int32 accumulator never reaches memory.
* ``_w4a8_kernel`` (W4A8, linear_qta8a_qga4w[_qta8o]): int8 per-token activations times 4-bit per-group
  weights.  Inside a weight group everything is an integer: the codes are centered
  by their zero point (``q - z`` fits int8), multiplied on the int8 tensor cores and
  summed in int32; the activation zero point comes off as ``x_zp[m] * sum(q - z)``.
  Each group's int32 sum is converted and scaled once:

      y[m, n] = x_scale[m] * sum_g w_scale[n, g] * float32(sum_{k in g} (x_q - x_zp)(q - z)) + bias[n]

  and with ``REQUANT`` the output is requantized per token in the same kernel:
  ``clamp(round_half_even(y / out_scale[m]) + out_zp[m], -128, 127)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, cast_rn, div_exact, interleave8, round_half_even, tile_rows_cols


@triton.jit
def _int8_gemm_kernel(a_ptr, b_ptr, y_ptr, row_ptr, col_ptr, azp_ptr, bsum_ptr, bias_ptr, M, N, K, M_BUCKET,
                      stride_am, stride_bn, stride_ym, EPILOGUE: tl.constexpr, HAS_AZP: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    rm, rn = tile_rows_cols(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + rk[None, :], mask=m_mask[:, None] & (rk[None, :] < K), other=0)
        b = tl.load(b_ptr + rn[None, :] * stride_bn + rk[:, None], mask=n_mask[None, :] & (rk[:, None] < K), other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    out_mask = m_mask[:, None] & n_mask[None, :]
    y_off = rm[:, None] * stride_ym + rn[None, :]
    if EPILOGUE:
        if HAS_AZP:  # (a - a_zp) . b = a . b - a_zp * sum(b), exact in int32
            azp = tl.load(azp_ptr + rm, mask=m_mask, other=0)
            bsum = tl.load(bsum_ptr + rn, mask=n_mask, other=0)
            acc -= azp[:, None] * bsum[None, :]
        row = tl.load(row_ptr + rm, mask=m_mask, other=0).to(tl.float32)
        col = tl.load(col_ptr + rn, mask=n_mask, other=0).to(tl.float32)
        y = cast_rn((acc.to(tl.float32) * row[:, None]) * col[None, :], y_ptr.dtype.element_ty)
        if HAS_BIAS:  # added to the rounded output, as lowbit.linear adds it (no FMA: see _launch)
            bias = cast_rn(tl.load(bias_ptr + rn, mask=n_mask, other=0), y_ptr.dtype.element_ty)
            y = cast_rn(y.to(tl.float32) + bias.to(tl.float32)[None, :], y_ptr.dtype.element_ty)
        tl.store(y_ptr + y_off, y, mask=out_mask)
    else:
        tl.store(y_ptr + y_off, acc, mask=out_mask)


@triton.jit
def _centered(words, J: tl.constexpr, SIGNED: tl.constexpr, HAS_ZP: tl.constexpr, z):
    """Field J of each u32x8 word as int8: the signed code, or the code minus its zero
    point z ([BLOCK_N] int32; the difference lies in [-15, 15])."""
    u = (words >> (4 * J)) & 15
    if SIGNED:
        u = u - ((u >> 3) << 4)
    if HAS_ZP:
        u -= z[:, None]
    return u.to(tl.int8)


@triton.jit
def _w4a8_kernel(x_ptr, xs_ptr, xz_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, os_ptr, oz_ptr, y_ptr, M, N, K, M_BUCKET,
                 stride_xm, stride_wn, stride_sn, stride_ym, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                 SIGNED: tl.constexpr,
                 HAS_BIAS: tl.constexpr, REQUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """BLOCK_K divides GROUP: a group is GROUP // BLOCK_K int8 dots into one int32 sum."""
    rm, rn = tile_rows_cols(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask = rm < M
    n_mask = rn < N
    xz = tl.load(xz_ptr + rm, mask=m_mask, other=0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, K // GROUP):
        iacc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        wsum = tl.zeros([BLOCK_N], dtype=tl.int32)
        z = tl.zeros([BLOCK_N], dtype=tl.int32)
        if HAS_ZP:
            z = tl.load(z_ptr + rn * stride_sn + g, mask=n_mask, other=0).to(tl.int32)
        for kk in range(0, GROUP, BLOCK_K):
            k0 = g * GROUP + kk
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None], other=0)
            rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            words = tl.load(w_ptr + rn[:, None] * stride_wn + rw[None, :], mask=n_mask[:, None], other=0)
            q = interleave8(_centered(words, 0, SIGNED, HAS_ZP, z), _centered(words, 1, SIGNED, HAS_ZP, z),
                            _centered(words, 2, SIGNED, HAS_ZP, z), _centered(words, 3, SIGNED, HAS_ZP, z),
                            _centered(words, 4, SIGNED, HAS_ZP, z), _centered(words, 5, SIGNED, HAS_ZP, z),
                            _centered(words, 6, SIGNED, HAS_ZP, z), _centered(words, 7, SIGNED, HAS_ZP, z))
            wsum += tl.sum(q.to(tl.int32), axis=1)
            iacc = tl.dot(x, tl.trans(q), iacc, out_dtype=tl.int32)
        iacc -= xz[:, None] * wsum[None, :]
        s = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
        acc += iacc.to(tl.float32) * s[None, :]
    y = acc * tl.load(xs_ptr + rm, mask=m_mask, other=0).to(tl.float32)[:, None]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_mask, other=0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    y_off = rm[:, None] * stride_ym + rn[None, :]
    if REQUANT:
        osc = tl.load(os_ptr + rm, mask=m_mask, other=1).to(tl.float32)
        ozp = tl.load(oz_ptr + rm, mask=m_mask, other=0).to(tl.float32)
        q_out = round_half_even(div_exact(y, osc[:, None])) + ozp[:, None]
        q_out = tl.minimum(tl.maximum(q_out, -128.0), 127.0)
        tl.store(y_ptr + y_off, q_out.to(tl.int8), mask=out_mask)
    else:
        tl.store(y_ptr + y_off, y, mask=out_mask)


def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages)


# int8 operands: BLOCK_K >= 32 (one int8 MMA step).  Decode/small M (<= 64 rows) and
# prefill are tuned separately.
SMALL_M = 64
INT8_SMALL_M = [_cfg(16, 64, 128, 4, 4), _cfg(16, 128, 128, 4, 4), _cfg(32, 64, 256, 4, 3),
                _cfg(64, 128, 128, 4, 4)]
INT8_PREFILL = [_cfg(128, 128, 128, 8, 3), _cfg(128, 256, 128, 8, 3), _cfg(128, 128, 64, 4, 4),
                _cfg(64, 128, 128, 4, 4), _cfg(256, 128, 128, 8, 3)]
W4A8_SMALL_M = [_cfg(16, 64, 128, 4, 4), _cfg(16, 128, 64, 4, 4), _cfg(32, 64, 64, 4, 4),
                _cfg(16, 64, 32, 4, 5), _cfg(64, 128, 32, 4, 4)]
W4A8_PREFILL = [_cfg(128, 128, 64, 8, 3), _cfg(128, 128, 128, 8, 3), _cfg(64, 128, 64, 4, 4),
                _cfg(128, 64, 32, 4, 4), _cfg(128, 256, 64, 8, 3)]
INTERPRET_CONFIG = _cfg(32, 64, 64, 4, 1, group_m=4)


def _prune_by_group(configs, named_args, **kwargs):
    group = {**named_args, **kwargs}["GROUP"]
    return [c for c in configs if group % c.kwargs["BLOCK_K"] == 0]


_int8_small_m = triton.autotune(INT8_SMALL_M, key=["M_BUCKET", "N", "K", "EPILOGUE"])(_int8_gemm_kernel)
_int8_prefill = triton.autotune(INT8_PREFILL, key=["M_BUCKET", "N", "K", "EPILOGUE"])(_int8_gemm_kernel)
_w4a8_small_m = triton.autotune(W4A8_SMALL_M, key=["M_BUCKET", "N", "K", "GROUP"],
                                prune_configs_by={"early_config_prune": _prune_by_group})(_w4a8_kernel)
_w4a8_prefill = triton.autotune(W4A8_PREFILL, key=["M_BUCKET", "N", "K", "GROUP"],
                                prune_configs_by={"early_config_prune": _prune_by_group})(_w4a8_kernel)


def _launch(jit_kernel, small, prefill, m, n, args, block_k=None, **constexprs):
    if INTERPRET:
        cfg = dict(INTERPRET_CONFIG.kwargs)
        if block_k is not None:
            cfg["BLOCK_K"] = block_k
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        jit_kernel[grid](*args, **constexprs, **cfg)
    else:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        # No FMA contraction: the epilogues round exactly where the reference does.
        (small if m <= SMALL_M else prefill)[grid](*args, **constexprs, enable_fp_fusion=False)


def int8_mm_rowcol(a: torch.Tensor, b: torch.Tensor, row_scale: torch.Tensor | None,
                   col_scale: torch.Tensor | None, out_dtype: torch.dtype, a_zero_point: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """int8 a [M, K] @ int8 b [N, K].T.  Without scales: the exact int32 product.  With
    row_scale [M] and col_scale [N]: the W8A8 epilogue fused, bit-identical to
    ``dequantize_accumulator(acc - a_zp[:, None] * b.sum(1), row_scale=, col_scale=) + bias``
    in out_dtype."""
    m, k = a.shape
    n = b.shape[0]
    epilogue = row_scale is not None
    y = torch.empty(m, n, dtype=out_dtype if epilogue else torch.int32, device=a.device)
    if m == 0 or n == 0:
        return y
    a, b = a.contiguous(), b.contiguous()
    dummy = y
    row = row_scale.reshape(m).contiguous() if epilogue else dummy
    col = col_scale.contiguous() if epilogue else dummy
    azp = a_zero_point.to(torch.int32).contiguous() if a_zero_point is not None else dummy
    bsum = b.sum(dim=1, dtype=torch.int32) if a_zero_point is not None else dummy
    bias_t = bias.contiguous() if bias is not None else dummy
    args = (a, b, y, row, col, azp, bsum, bias_t, m, n, k, triton.next_power_of_2(m), a.stride(0), b.stride(0),
            y.stride(0))
    _launch(_int8_gemm_kernel, _int8_small_m, _int8_prefill, m, n, args, EPILOGUE=epilogue,
            HAS_AZP=a_zero_point is not None, HAS_BIAS=bias is not None)
    return y


def w4a8_block_k_ok(group_size: int) -> bool:
    return group_size % 32 == 0


def linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size, bias,
                       out_scale=None, out_zero_point=None) -> torch.Tensor:
    """The W4A8 linear (linear_qta8a_qga4w): float32 [M, N] (see the module docstring), or with
    out_scale/out_zero_point the int8 [M, N] requantized output.  group_size % 32 == 0."""
    m, k = x_q.shape
    n = w_codes.shape[0]
    requant = out_scale is not None
    y = torch.empty(m, n, dtype=torch.int8 if requant else torch.float32, device=x_q.device)
    if m == 0 or n == 0:
        return y
    x_q, w_codes, w_scale = x_q.contiguous(), w_codes.contiguous(), w_scale.contiguous()
    dummy = w_scale
    args = (x_q, x_scale.contiguous(), x_zero_point.to(torch.int32).contiguous(), w_codes, w_scale,
            dummy if w_zero_point is None else w_zero_point.contiguous(),
            dummy if bias is None else bias.contiguous(),
            out_scale.contiguous() if requant else dummy,
            out_zero_point.contiguous() if requant else dummy,
            y, m, n, k, triton.next_power_of_2(m), x_q.stride(0), w_codes.stride(0), w_scale.stride(0), y.stride(0))
    _launch(_w4a8_kernel, _w4a8_small_m, _w4a8_prefill, m, n, args,
            block_k=min(group_size, INTERPRET_CONFIG.kwargs["BLOCK_K"]), GROUP=group_size,
            HAS_ZP=w_zero_point is not None, SIGNED=w_zero_point is None, HAS_BIAS=bias is not None,
            REQUANT=requant)
    return y
