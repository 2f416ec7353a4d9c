"""W4A16 / W8A16: ``x @ dequantize(W).T`` with the dequantization fused into the
matmul; the float weight is never written to memory.

One kernel family for every weight format, parametrized by constexpr: ``BITS`` (4:
"u32x8" words, 8: one code per byte), ``SIGNED`` (symmetric codes), ``HAS_ZP`` (a
zero point, integer or float) and ``GROUP`` (group size; K for per channel).  Weight
codes are multiplied as they are (exact in bf16/fp16/tf32) and the group's scale and
zero point are applied once per K tile to the partial sums:

    sum_k x[k] (q[k] - z) s  =  s (sum_k x[k] q[k] - z sum_k x[k])

* M = 1 (decode): ``_gemv_kernel``, a split-K GEMV.  Each program reads BLOCK_N rows
  of packed words contiguously along K; when N alone gives too few programs to keep
  every SM streaming, K is split and the partial sums of the splits are added by
  torch in a fixed order (deterministic, no atomics).
* M > 1: ``_gemm_kernel``, a tensor-core tile GEMM (tl.dot) with its own config
  lists for small M (up to 64 rows, weight-bandwidth bound) and prefill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (DOT_PRECISION_F32, INTERPRET, cast_rn, dot_dtype, num_sms, tile_rows_cols,
                      unpack_words)


@triton.jit
def _load_codes(w_ptr, rn, k0, n_mask, K, stride_wn, BITS: tl.constexpr, SIGNED: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Codes q[n, k0:k0+BLOCK_K] as int32 [BLOCK_N, BLOCK_K], 0 beyond K or N."""
    if BITS == 8:
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = n_mask[:, None] & (rk[None, :] < K)
        q = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=mask, other=0).to(tl.int32)
    else:
        PER_WORD: tl.constexpr = 32 // BITS
        rw = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
        mask = n_mask[:, None] & (rw[None, :] < K // PER_WORD)
        words = tl.load(w_ptr + rn[:, None] * stride_wn + rw[None, :], mask=mask, other=0)
        q = unpack_words(words, BITS, PER_WORD, SIGNED)
    return q


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, K, stride_wn, stride_sn,
                 BITS: tl.constexpr, GROUP: tl.constexpr, SIGNED: tl.constexpr, HAS_ZP: tl.constexpr,
                 SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[pid_k, n] = sum over this program's K tiles of s (x . q - z sum x); one row x."""
    # A tile holds GPT whole groups (BLOCK_K a multiple of GROUP) or lies inside one
    # group (GROUP a multiple of BLOCK_K, or one group per row: per channel).
    GPT: tl.constexpr = BLOCK_K // GROUP if BLOCK_K % GROUP == 0 else 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for t in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, k_tiles)):
        k0 = t * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        q = _load_codes(w_ptr, rn, k0, n_mask, K, stride_wn, BITS, SIGNED, BLOCK_K).to(tl.float32)
        part = tl.sum(tl.reshape(q * x[None, :], (BLOCK_N, GPT, BLOCK_K // GPT)), axis=2)
        g = k0 // GROUP + tl.arange(0, GPT)
        sz_mask = n_mask[:, None] & (g[None, :] < K // GROUP)
        sz_off = rn[:, None] * stride_sn + g[None, :]
        if HAS_ZP:
            z = tl.load(z_ptr + sz_off, mask=sz_mask, other=0).to(tl.float32)
            part -= z * tl.sum(tl.reshape(x, (GPT, BLOCK_K // GPT)), axis=1)[None, :]
        s = tl.load(s_ptr + sz_off, mask=sz_mask, other=0).to(tl.float32)
        acc += tl.sum(part * s, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rn, cast_rn(acc, y_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(y_ptr + pid_k * N + rn, acc, mask=n_mask)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, M_BUCKET, stride_xm, stride_wn, stride_sn,
                 stride_ym, BITS: tl.constexpr, GROUP: tl.constexpr, SIGNED: tl.constexpr,
                 HAS_ZP: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """y = x @ dequantize(W).T for a BLOCK_M x BLOCK_N tile; each K tile lies inside one
    group (GROUP a multiple of BLOCK_K, or per channel), M_BUCKET only keys the autotuner."""
    rm, rn = tile_rows_cols(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None] & (rk[None, :] < K),
                    other=0.0).to(DOT_DTYPE)
        q = _load_codes(w_ptr, rn, k0, n_mask, K, stride_wn, BITS, SIGNED, BLOCK_K).to(DOT_DTYPE)
        part = tl.dot(x, tl.trans(q), input_precision=PRECISION)
        g = k0 // GROUP
        if HAS_ZP:
            z = tl.load(z_ptr + rn * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
            part -= tl.sum(x.to(tl.float32), axis=1)[:, None] * z[None, :]
        s = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
        acc += part * s[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], cast_rn(acc, y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# -- configs: M = 1 decode, small M (<= SMALL_M rows) and prefill, tuned separately -------------
def _cfg(bm, bn, bk, warps, stages, group_m=8):
    kw = {"BLOCK_N": bn, "BLOCK_K": bk}
    if bm:
        kw.update(BLOCK_M=bm, GROUP_M=group_m)
    return triton.Config(kw, num_warps=warps, num_stages=stages)


GEMV_CONFIGS = [_cfg(0, 16, 512, 4, 3), _cfg(0, 32, 256, 4, 3), _cfg(0, 32, 512, 8, 3),
                _cfg(0, 64, 256, 8, 3), _cfg(0, 64, 128, 4, 4), _cfg(0, 128, 128, 8, 3)]
SMALL_M = 64
SMALL_M_CONFIGS = [_cfg(16, 64, 128, 4, 4), _cfg(16, 128, 64, 4, 4), _cfg(32, 64, 128, 4, 4),
                   _cfg(32, 128, 64, 4, 4), _cfg(64, 128, 64, 4, 3), _cfg(16, 64, 32, 4, 5),
                   _cfg(32, 128, 32, 4, 5)]
PREFILL_CONFIGS = [_cfg(128, 128, 64, 8, 3), _cfg(128, 256, 64, 8, 3), _cfg(64, 128, 64, 4, 4),
                   _cfg(128, 64, 64, 4, 4), _cfg(128, 128, 32, 8, 4), _cfg(64, 256, 32, 8, 4)]
# Under the interpreter (no GPU, tests only) nothing is timed: one config each, large
# tiles so few programs run.
INTERPRET_GEMV = _cfg(0, 32, 128, 4, 1)
INTERPRET_GEMM = _cfg(32, 64, 64, 4, 1, group_m=4)


def gemv_block_k_ok(block_k: int, group: int, k: int) -> bool:
    return block_k % group == 0 or group % block_k == 0 or group == k


def gemm_block_k_ok(block_k: int, group: int, k: int) -> bool:
    return group % block_k == 0 or group == k


def _pruner(ok):
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        group, k = args["GROUP"], args["K"]
        return [c for c in configs if ok(c.kwargs["BLOCK_K"], group, k)]
    return {"early_config_prune": prune}


_gemv_tuned = triton.autotune(GEMV_CONFIGS, key=["N", "K", "BITS", "GROUP", "SPLIT_K"],
                              prune_configs_by=_pruner(gemv_block_k_ok))(_gemv_kernel)
_gemm_small_m = triton.autotune(SMALL_M_CONFIGS, key=["M_BUCKET", "N", "K", "BITS", "GROUP", "DOT_DTYPE"],
                                prune_configs_by=_pruner(gemm_block_k_ok))(_gemm_kernel)
_gemm_prefill = triton.autotune(PREFILL_CONFIGS, key=["M_BUCKET", "N", "K", "BITS", "GROUP", "DOT_DTYPE"],
                                prune_configs_by=_pruner(gemm_block_k_ok))(_gemm_kernel)


def supported(bits: int, group_size: int, k: int, m: int) -> bool:
    """Whether these kernels cover the call (the backend sends the rest to the reference)."""
    if bits not in (4, 8):
        return False
    configs = [INTERPRET_GEMV] if INTERPRET else GEMV_CONFIGS
    ok = gemv_block_k_ok
    if m > 1:
        configs = [INTERPRET_GEMM] if INTERPRET else SMALL_M_CONFIGS + PREFILL_CONFIGS
        ok = gemm_block_k_ok
    return any(ok(c.kwargs["BLOCK_K"], group_size, k) for c in configs) or (
        INTERPRET and any(ok(bk, group_size, k) for bk in (16, 32)))


def _interpret_block_k(cfg, ok, group, k):
    bk = cfg.kwargs["BLOCK_K"]
    while not ok(bk, group, k) and bk > 16:
        bk //= 2
    return bk


def split_k(n: int, k: int, device: torch.device) -> int:
    """K splits for the GEMV: enough programs (counted with 32-row blocks) for about
    4 per SM, each split still streaming at least 1024 values of K per row."""
    programs, sms, split = triton.cdiv(n, 32), num_sms(device), 1
    while split < 8 and programs * split * 2 <= 4 * sms and k // (2 * split) >= 1024:
        split *= 2
    return split


def weight_only_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                       zero_point: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """x [..., K] @ dequantize(W).T in x's dtype; W as codes [N, K] (8 bit) or u32x8
    words [N, K/8] (4 bit), scale/zero_point [N, K/group_size].  The caller checked the
    arguments and ``supported``."""
    k, n = x.shape[-1], codes.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*x.shape[:-1], n)
    codes, scale = codes.contiguous(), scale.contiguous()
    zp = scale if zero_point is None else zero_point.contiguous()  # placeholder pointer when unused
    common = dict(BITS=bits, GROUP=group_size, SIGNED=zero_point is None, HAS_ZP=zero_point is not None)
    if m == 1:
        split = split_k(n, k, x.device)
        out = y if split == 1 else torch.empty(split, n, dtype=torch.float32, device=x.device)
        if INTERPRET:
            cfg = INTERPRET_GEMV
            bk = _interpret_block_k(cfg, gemv_block_k_ok, group_size, k)
            _gemv_kernel[(triton.cdiv(n, cfg.kwargs["BLOCK_N"]), split)](
                x2, codes, scale, zp, out, n, k, codes.stride(0), scale.stride(0), SPLIT_K=split,
                BLOCK_N=cfg.kwargs["BLOCK_N"], BLOCK_K=bk, **common)
        else:
            grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
            _gemv_tuned[grid](x2, codes, scale, zp, out, n, k, codes.stride(0), scale.stride(0),
                              SPLIT_K=split, **common)
        if split > 1:
            y = out.sum(0, keepdim=True).to(x.dtype)
        return y.reshape(*x.shape[:-1], n)
    ddt = dot_dtype(x.dtype)
    prec = DOT_PRECISION_F32 if ddt == tl.float32 else "tf32"  # (ignored for 16-bit operands)
    args = (x2, codes, scale, zp, y, m, n, k, triton.next_power_of_2(m), x2.stride(0), codes.stride(0),
            scale.stride(0), y.stride(0))
    if INTERPRET:
        cfg = INTERPRET_GEMM.kwargs
        bk = _interpret_block_k(INTERPRET_GEMM, gemm_block_k_ok, group_size, k)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _gemm_kernel[grid](*args, DOT_DTYPE=ddt, PRECISION=prec, BLOCK_M=cfg["BLOCK_M"],
                           BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], **common)
    else:
        kernel = _gemm_small_m if m <= SMALL_M else _gemm_prefill
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        kernel[grid](*args, DOT_DTYPE=ddt, PRECISION=prec, **common)
    return y.reshape(*x.shape[:-1], n)
