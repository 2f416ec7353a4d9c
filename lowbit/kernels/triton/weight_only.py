"""W4A16 / W8A16: ``x @ dequantize(W).T`` with the dequantization fused into the
matmul; the float weight is never written to memory.

One kernel family for every weight format, parametrized by constexpr: ``BITS`` (4:
"u32x8" words, 8: one code per byte), ``SIGNED`` (symmetric codes), ``HAS_ZP`` (a
zero point, integer or float) and ``GROUP`` (group size; K for per channel).  Weight
codes (q, or q - z for integer zero points: at most 9 bits) are multiplied as they are
(exact in bf16/fp16/tf32) and the group's scale (and a float zero point) is applied
once per group to the partial sums:

    sum_k x[k] (q[k] - z) s  =  s (sum_k x[k] q[k] - z sum_k x[k])

Codes become floats without the int -> float instruction (``_common.code_plane``), and
4-bit words are unpacked into planes of one field each, never moved between threads in
the GEMV and interleaved in registers for the GEMM (``_common.interleave8``).

* M = 1 (decode): ``_gemv_kernel``, a split-K GEMV.  Each program reads BLOCK_N rows
  of packed words contiguously along K; when N alone gives too few programs to keep
  every SM streaming, K is split and ``_add_splits`` adds the splits' partial sums in a
  fixed order (deterministic, no atomics).
* M > 1: ``_gemm_kernel``, a tensor-core tile GEMM (tl.dot) with its own config
  lists for small M (up to 64 rows, weight-bandwidth bound) and prefill.

Measured on an H200 (``benchmarks/matmul_gpu.py``, CUDA-graph replay, bf16 activations,
ratio to bf16 ``torch.matmul``; 2026-11-27): the planes took the 4-bit GEMV from 0.39-0.50x
to 0.86-1.01x and the 8-bit one from 1.01-1.08x to 1.24-1.28x; see README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (DOT_PRECISION_F32, INTERPRET, cast_rn, code_plane, dot_dtype, interleave8, num_sms,
                      tile_rows_cols, unpack_words)


@triton.jit
def _plane(words, J: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, CENTER: tl.constexpr, z,
           DTYPE: tl.constexpr):
    """Field J of each word in DTYPE, less the row's integer zero point z ([BLOCK_N] float32)
    when CENTER: q - z is an integer of at most 9 bits, exact in every dot dtype."""
    q = code_plane(words, J, BITS, SIGNED)
    if CENTER:
        q -= z[:, None]
    return q.to(DTYPE)


@triton.jit
def _load_codes(w_ptr, rn, k0, n_mask, K, stride_wn, z, BITS: tl.constexpr, SIGNED: tl.constexpr,
                CENTER: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """Codes q[n, k0:k0+BLOCK_K] (q - z[n] when CENTER) as DTYPE [BLOCK_N, BLOCK_K], 0 beyond K
    or N (-z there when CENTER: those columns meet x = 0)."""
    if BITS == 8:
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = n_mask[:, None] & (rk[None, :] < K)
        words = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=mask, other=0).to(tl.int32)
        q = _plane(words, 0, BITS, SIGNED, CENTER, z, DTYPE)
    else:
        PER_WORD: tl.constexpr = 32 // BITS
        rw = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
        mask = n_mask[:, None] & (rw[None, :] < K // PER_WORD)
        words = tl.load(w_ptr + rn[:, None] * stride_wn + rw[None, :], mask=mask, other=0)
        if BLOCK_K // PER_WORD < 8:  # Triton 3.6 fails to compile the interleaves into a
            # 16-bit wgmma operand for rows of 4 words: unpack through a reshape there
            q = unpack_words(words, BITS, PER_WORD, SIGNED).to(tl.float32)
            if CENTER:
                q -= z[:, None]
            q = q.to(DTYPE)
        else:
            q = interleave8(_plane(words, 0, BITS, SIGNED, CENTER, z, DTYPE),
                            _plane(words, 1, BITS, SIGNED, CENTER, z, DTYPE),
                            _plane(words, 2, BITS, SIGNED, CENTER, z, DTYPE),
                            _plane(words, 3, BITS, SIGNED, CENTER, z, DTYPE),
                            _plane(words, 4, BITS, SIGNED, CENTER, z, DTYPE),
                            _plane(words, 5, BITS, SIGNED, CENTER, z, DTYPE),
                            _plane(words, 6, BITS, SIGNED, CENTER, z, DTYPE),
                            _plane(words, 7, BITS, SIGNED, CENTER, z, DTYPE))
    return q


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, K, stride_wn, stride_sn,
                 BITS: tl.constexpr, GROUP: tl.constexpr, SIGNED: tl.constexpr, HAS_ZP: tl.constexpr,
                 SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[pid_k, n] = sum over this program's K tiles of s (x . q - z sum x); one row x.

    The packed words are used as loaded ([BLOCK_N, BLOCK_K / PER_WORD], contiguous along
    K): field j of every word is one plane, multiplied by the x values at positions
    PER_WORD * w + j, so no code is ever moved between threads.  Each word's products
    are summed, scaled by the word's group, and kept per word position until the end."""
    PER_WORD: tl.constexpr = 32 // BITS if BITS < 8 else 1
    BW: tl.constexpr = BLOCK_K // PER_WORD
    ONE_GROUP: tl.constexpr = GROUP % BLOCK_K == 0  # each tile inside one group
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    acc = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
    for t in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, k_tiles)):
        k0 = t * BLOCK_K
        rw = k0 // PER_WORD + tl.arange(0, BW)
        w_mask = n_mask[:, None] & (rw[None, :] * PER_WORD < K)
        words = tl.load(w_ptr + rn[:, None] * stride_wn + rw[None, :], mask=w_mask, other=0).to(tl.int32)
        part = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
        xw = tl.zeros([BW], dtype=tl.float32)
        for j in tl.static_range(PER_WORD):
            rk = rw * PER_WORD + j
            xj = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            part += code_plane(words, j, BITS, SIGNED) * xj[None, :]
            if HAS_ZP:
                xw += xj
        if ONE_GROUP:
            sz_off = rn * stride_sn + k0 // GROUP
            if HAS_ZP:
                part -= tl.load(z_ptr + sz_off, mask=n_mask, other=0).to(tl.float32)[:, None] * xw[None, :]
            acc += part * tl.load(s_ptr + sz_off, mask=n_mask, other=0).to(tl.float32)[:, None]
        else:  # each word position in its own group (loads of one group's scale hit L1)
            sz_off = rn[:, None] * stride_sn + (rw * PER_WORD // GROUP)[None, :]
            if HAS_ZP:
                part -= tl.load(z_ptr + sz_off, mask=w_mask, other=0).to(tl.float32) * xw[None, :]
            acc += part * tl.load(s_ptr + sz_off, mask=w_mask, other=0).to(tl.float32)
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rn, cast_rn(y, y_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(y_ptr + pid_k * N + rn, y, mask=n_mask)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, M_BUCKET, stride_xm, stride_wn, stride_sn,
                 stride_ym, BITS: tl.constexpr, GROUP: tl.constexpr, SIGNED: tl.constexpr,
                 HAS_ZP: tl.constexpr, ZP_INT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """y = x @ dequantize(W).T for a BLOCK_M x BLOCK_N tile.  The K tiles of one group (GROUP
    a multiple of BLOCK_K, or per channel: GROUP = K) accumulate in one dot accumulator,
    scaled once per group; integer zero points are taken off the codes before the dot
    (q - z is exact in the dot dtype), float ones off the group's sums as z * sum x.
    M_BUCKET only keys the autotuner."""
    rm, rn = tile_rows_cols(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, K, GROUP):
        z = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_ZP:
            z = tl.load(z_ptr + rn * stride_sn + g0 // GROUP, mask=n_mask, other=0).to(tl.float32)
        gacc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kk in range(0, GROUP, BLOCK_K):
            rk = g0 + kk + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None] & (rk[None, :] < K),
                        other=0.0).to(DOT_DTYPE)
            q = _load_codes(w_ptr, rn, g0 + kk, n_mask, K, stride_wn, z, BITS, SIGNED, HAS_ZP and ZP_INT,
                            BLOCK_K, DOT_DTYPE)
            gacc = tl.dot(x, tl.trans(q), gacc, input_precision=PRECISION)
            if HAS_ZP and not ZP_INT:
                xsum += tl.sum(x.to(tl.float32), axis=1)
        if HAS_ZP and not ZP_INT:  # a float zero point: off the group's sums
            gacc -= xsum[:, None] * z[None, :]
        acc += gacc * tl.load(s_ptr + rn * stride_sn + g0 // GROUP, mask=n_mask, other=0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], cast_rn(acc, y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _add_splits(part_ptr, y_ptr, N, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y[n] = part[0, n] + part[1, n] + ... in split order (float32), rounded once to y's
    dtype: the same bits every run, and one launch."""
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    total = tl.load(part_ptr + rn, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLIT_K):
        total += tl.load(part_ptr + i * N + rn, mask=mask, other=0.0)
    tl.store(y_ptr + rn, cast_rn(total, y_ptr.dtype.element_ty), mask=mask)


# -- configs: M = 1 decode, small M (<= SMALL_M rows) and prefill, tuned separately -------------
def _cfg(bm, bn, bk, warps, stages, group_m=8):
    kw = {"BLOCK_N": bn, "BLOCK_K": bk}
    if bm:
        kw.update(BLOCK_M=bm, GROUP_M=group_m)
    return triton.Config(kw, num_warps=warps, num_stages=stages)


GEMV_CONFIGS = [_cfg(0, 16, 512, 4, 3), _cfg(0, 32, 256, 4, 3), _cfg(0, 32, 512, 8, 3),
                _cfg(0, 64, 256, 8, 3), _cfg(0, 64, 128, 4, 4), _cfg(0, 128, 128, 8, 3),
                _cfg(0, 16, 128, 4, 4), _cfg(0, 32, 128, 4, 4)]
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
    if bits not in (4, 8) or (bits == 4 and (group_size % 8 or k % 8)):  # whole u32x8 words per group
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
            _add_splits[(triton.cdiv(n, 1024),)](out, y, n, SPLIT_K=split, BLOCK=1024)
        return y.reshape(*x.shape[:-1], n)
    ddt = dot_dtype(x.dtype)
    zp_int = zero_point is not None and not zero_point.dtype.is_floating_point
    prec = DOT_PRECISION_F32 if ddt == tl.float32 else "tf32"  # (ignored for 16-bit operands)
    args = (x2, codes, scale, zp, y, m, n, k, triton.next_power_of_2(m), x2.stride(0), codes.stride(0),
            scale.stride(0), y.stride(0))
    if INTERPRET:
        cfg = INTERPRET_GEMM.kwargs
        bk = _interpret_block_k(INTERPRET_GEMM, gemm_block_k_ok, group_size, k)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _gemm_kernel[grid](*args, ZP_INT=zp_int, DOT_DTYPE=ddt, PRECISION=prec, BLOCK_M=cfg["BLOCK_M"],
                           BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], **common)
    else:
        kernel = _gemm_small_m if m <= SMALL_M else _gemm_prefill
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        kernel[grid](*args, ZP_INT=zp_int, DOT_DTYPE=ddt, PRECISION=prec, **common)
    return y.reshape(*x.shape[:-1], n)
