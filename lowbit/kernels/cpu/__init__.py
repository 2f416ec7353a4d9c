"""Fast CPU kernels: the C++ extension ``lowbit._C`` (built at install time with
torch's cpp_extension; OpenMP threads, AVX-512 through the compiler) plus packing in
word-wide integer torch ops.  Configurations they do not cover (3-bit codes) go to
the reference implementation, which is also what runs when the extension is absent."""

from __future__ import annotations

import math

import torch

from .. import reference

try:  # built by setup.py; absent when installed with LOWBIT_NO_EXT=1 or without a compiler
    from lowbit import _C  # type: ignore[attr-defined]

    _LOAD_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the install
    _C = None
    _LOAD_ERROR = f"the C++ extension lowbit._C did not load: {e}"


def available() -> bool:
    return _C is not None


def load_error() -> str | None:
    return _LOAD_ERROR


choose_qparams = reference.choose_qparams


def _rows_per_scale(shape, granularity: str, rows: int) -> int:
    if granularity == "tensor":
        return max(rows, 1)
    if granularity == "channel":
        return max(rows // shape[0], 1) if shape[0] else 1
    return 1


def dequantize_packed(codes, scale, zero_point, bits, symmetric, granularity, group_size,
                      packing, shape, out_dtype):
    if bits == 3:
        return reference.dequantize_packed(codes, scale, zero_point, bits, symmetric, granularity,
                                           group_size, packing, shape, out_dtype)
    k = shape[-1] if shape else 1
    rows = math.prod(shape) // k if k else 0
    cdt = reference.compute_dtype(out_dtype)
    zp = None if zero_point is None else zero_point.to(cdt).contiguous()
    group = group_size if granularity == "group" else k
    out = _C.dequantize(codes.contiguous(), scale.to(cdt).contiguous(), zp, bits, symmetric, k,
                        group, _rows_per_scale(shape, granularity, rows), out_dtype)
    return out.reshape(shape)


def quantize_packed(x, scale, zero_point, bits, symmetric, granularity, group_size,
                    zero_point_domain, packing):
    q = reference.quantize(x, scale, zero_point, bits, symmetric, granularity, group_size,
                           zero_point_domain)
    return pack(q, bits, packing) if bits < 8 else q


def pack(q, bits, packing):
    """Word-aligned widths (2, 4 bits): shift each value into place and OR (sum) a
    word's worth; 3-bit codes straddle words and use the reference bit stream."""
    word = 32 if packing == "u32" else 8
    if word % bits:
        return reference.pack(q, bits, packing)
    per = word // bits
    v = (q.to(torch.int32) & ((1 << bits) - 1)).reshape(*q.shape[:-1], q.shape[-1] // per, per)
    shifts = torch.arange(0, word, bits, dtype=torch.int32, device=q.device)
    words = (v << shifts).sum(-1, dtype=torch.int64 if packing == "u32" else torch.int32)
    return words.to(torch.int32 if packing == "u32" else torch.uint8)


def unpack(packed, bits, packing, signed):
    word = 32 if packing == "u32" else 8
    if word % bits:
        return reference.unpack(packed, bits, packing, signed)
    per = word // bits
    shifts = torch.arange(0, word, bits, dtype=torch.int32, device=packed.device)
    v = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    if signed:
        v = v - ((v >> (bits - 1)) << bits)
    return v.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.int8 if signed else torch.uint8)


def quantize_per_token(x, bits, symmetric):
    """One pass per row (range, scale, codes); also reports whether x was all finite."""
    return _C.quantize_per_token(x.contiguous(), bits, symmetric)


def dequantize_accumulator_grouped(acc, scale, group_size, out_dtype):
    n = acc.shape[-1]
    rows = acc.numel() // n if n else 0
    shared = scale.dim() == 1 and acc.dim() > 1
    out = _C.dequantize(acc.contiguous(), scale.to(torch.float32).contiguous(), None, 32, True, n,
                        group_size, max(rows, 1) if shared else 1, out_dtype)
    return out.reshape(acc.shape)


def dequantize_accumulator_rowcol(acc, row_scale, col_scale, out_dtype):
    return _C.dequantize_rowcol(acc.contiguous(), row_scale.to(torch.float32).contiguous(),
                                col_scale.to(torch.float32).contiguous(), out_dtype)


# -- matmuls -------------------------------------------------------------------------
# Rows of W dequantized per tile: about 1 MiB of float weight, which stays in L2 between
# the dequantize and the matmul, so no full float copy of W is ever made.
TILE_BYTES = 1 << 20
# The decode kernels (gemv_bf16.cpp, matmul.cpp: the packed weight unpacked in registers
# for every 4 rows) against the GEMM (gemm_bf16.cpp: unpacked once per call into bf16
# panels), 4096x4096, 2 threads, weights cold, Zen 5 (ms):
#   4-bit, bf16 x:     M=3 0.59 vs 0.82, M=4 0.75 vs 0.79, M=5 0.90 vs 0.83, M=6 1.02 vs 0.84
#   4-bit, float32 x:  M=2 0.53 vs 1.03, M=3 1.07 vs 1.05 (x split into two bf16 parts up
#                      to SPLIT_MAX_M rows, float32 FMAs beyond)
#   8-bit, any x:      M=1 0.57 vs 0.88, M=2 1.10-1.20 vs 0.63-0.84
# float32 x at the matmul precision "highest" has no bf16 GEMM: float32 FMAs up to
# GEMV_MAX_M rows (M=4 0.62 vs 1.18 ms for float32 tiles through torch.mm, M=8 1.85 vs 1.49).
GEMV_MAX_M = 6
SPLIT_MAX_M = 2


def gemv_max_m(bits: int, dtype: torch.dtype) -> int:
    """Up to how many activation rows a weight-only matmul runs the decode kernels."""
    if float32_exact(dtype):
        return GEMV_MAX_M
    if bits == 8:
        return 1
    return 4 if dtype == torch.bfloat16 else SPLIT_MAX_M


def float32_exact(dtype: torch.dtype) -> bool:
    """Whether float32 activations must get float32-accurate products: lowbit follows
    ``torch.set_float32_matmul_precision``.  At torch's default "highest" they do (float32
    FMAs, float32 tiles); at "high" or "medium" their dot products may run in bfloat16
    (x split in two bf16 parts at small M, rounded to bf16 at large M), 2-4x faster,
    as torch's own float32 matmuls may then use bf16/TF32."""
    return dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"


def _fused_ok(bits: int, group_size: int) -> bool:
    return _C.has_avx512() and group_size % (32 if bits == 4 else 16) == 0


def gemm_bf16_ok(k: int, group_size: int) -> bool:
    """Whether rows beyond ``gemv_max_m`` go through gemm_bf16.cpp (else: bf16 tiles + torch.mm)."""
    return _C.gemm_bf16_supported(k, group_size)


def weight_only_matmul(x, codes, scale, zero_point, bits, group_size):
    """x @ dequantize(W).T, in one call into lowbit._C (it picks the kernel by M).
    Up to ``gemv_max_m`` rows: a fused kernel reads the packed weight and accumulates in
    float32 (4-bit: bf16 dot products, gemv_bf16.cpp; 8-bit, and wider M with float32
    activations: float32 FMAs, matmul.cpp).  More rows: gemm_bf16.cpp dequantizes panels
    of W to bf16 (rounded once, as W.to(bfloat16)) and multiplies them with x rounded to
    bf16 by AVX512-BF16 dot products with float32 accumulation: bf16 torch.matmul's
    arithmetic; a float32 matmul is 4-5x slower here, and rounding x and W to bf16
    (2^-9 relative each) is far below the 4/8-bit weight error.  Float32 activations at
    the float32 matmul precision "highest" (``float32_exact``) stay float32: FMAs, then
    float32 tiles.  Without the AVX-512 kernels: tiles of W dequantized to bf16 (L2-sized)
    through torch.mm.  No full float copy of W is ever made."""
    if bits not in (4, 8) or x.dtype == torch.float64:
        return reference.weight_only_matmul(x, codes, scale, zero_point, bits, group_size)
    k = x.shape[-1]
    exact = float32_exact(x.dtype)
    if not exact or x.numel() <= GEMV_MAX_M * k:
        # exact: small M only (split_max_m=0 keeps float32 activations on float32 FMAs)
        y = _C.weight_only_matmul(x, codes, scale, zero_point, bits, group_size, gemv_max_m(bits, x.dtype),
                                  0 if exact else SPLIT_MAX_M)
        if y is not None:
            return y
    return _tiles(x, codes, scale, zero_point, bits, group_size, torch.float32 if exact else torch.bfloat16)


def _tiles(x, codes, scale, zero_point, bits, group_size, cdt):
    k, n = x.shape[-1], codes.shape[0]
    x2 = x.reshape(-1, k)
    zp = None if zero_point is None else zero_point.to(torch.float32).contiguous()
    s = scale.to(torch.float32).contiguous()
    xc = x2.to(cdt).contiguous()
    out_t = torch.empty(n, x2.shape[0], dtype=cdt)
    tile = max(16, TILE_BYTES // max(k * out_t.element_size(), 1))
    for n0 in range(0, n, tile):
        n1 = min(n, n0 + tile)
        w = _C.dequantize(codes[n0:n1].contiguous(), s[n0:n1], None if zp is None else zp[n0:n1],
                          bits, zero_point is None, k, group_size, 1, cdt)
        torch.mm(w, xc.T, out=out_t[n0:n1])
    return out_t.T.to(x.dtype).contiguous().reshape(*x.shape[:-1], n)


def int8_mm(a, b):
    """torch._int_mm: oneDNN's int8 GEMM (AMX/VNNI), exact int32 accumulation."""
    return torch._int_mm(a.contiguous(), b.T)


def int8_linear(a, a_zero_point, b, row_scale, col_scale, bias, out_dtype):
    """W8A8 in one call (gemm_int8.cpp): vpdpbusd int8 GEMM with exact int32 sums and the
    dequantize_accumulator epilogue (and bias) fused into its store; the bits of
    lowbit::int8_linear's composed path (int8_mm, zero-point correction, rowcol epilogue,
    bias add in out_dtype).  None where it does not apply (K not a multiple of 4, no
    VNNI) or is not the faster route: for one row, torch._int_mm's GEMV beats it (4096x4096
    on Zen 5: 0.17 vs 0.46 ms; from two rows on it is 4x slower, 1.32 vs 0.34 ms), so the
    caller composes it."""
    if a.shape[0] < 2 or not _C.int8_gemm_supported(a.shape[1]):
        return None
    return _C.int8_linear(a, a_zero_point, b, row_scale, col_scale, bias, out_dtype)


def linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_packed, w_scales, w_zero_points, group_size, bias):
    """Integer arithmetic inside each weight group, float scaling once per group:

    y[m, n] = x_scale[m] * sum_g w_scale[n, g] * sum_{k in g} (x_q[m, k] - x_zp[m]) (w_q[n, k] - w_zp[n, g])

    The inner sum expands to  sum x_q w_q - w_zp sum x_q - x_zp sum w_q + |g| x_zp w_zp,
    all exact in int32 (|g| * 255 * 15 << 2^31); sum x_q w_q is an int8 GEMM per group.
    """
    if _fused_ok(4, group_size):
        zp = None if w_zero_points is None else w_zero_points.to(torch.int32).contiguous()
        y = _C.w4a8_gemm(x_q.contiguous(), x_zero_point.to(torch.int32).contiguous(), w_packed.contiguous(),
                         w_scales.to(torch.float32).contiguous(), zp, group_size)
        y = y * x_scale.to(torch.float32)[:, None]
        return y if bias is None else y + bias.to(torch.float32)
    m, k = x_q.shape
    n, groups = w_scales.shape
    g = group_size
    w_q = unpack(w_packed, 4, "u32", w_zero_points is None).to(torch.int8).reshape(n, groups, g)
    xg = x_q.reshape(m, groups, g)
    w_zp = (torch.zeros(n, groups, dtype=torch.int32) if w_zero_points is None
            else w_zero_points.to(torch.int32))
    x_zp = x_zero_point.to(torch.int32)
    x_sum = xg.to(torch.int32).sum(-1)                       # [m, groups]
    w_sum = w_q.to(torch.int32).sum(-1)                      # [n, groups]
    y = torch.zeros(m, n, dtype=torch.float32)
    ws = w_scales.to(torch.float32)
    for j in range(groups):
        acc = int8_mm(xg[:, j].contiguous(), w_q[:, j].contiguous())  # [m, n] int32
        acc = (acc - x_sum[:, j, None] * w_zp[None, :, j] - x_zp[:, None] * w_sum[None, :, j]
               + g * x_zp[:, None] * w_zp[None, :, j])
        y += acc.to(torch.float32) * ws[None, :, j]
    y = y * x_scale.to(torch.float32)[:, None]
    return y if bias is None else y + bias.to(torch.float32)


requantize_per_token = reference.requantize_per_token
