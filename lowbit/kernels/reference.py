"""Reference implementations: plain PyTorch, short, obviously right.

These are the ground truth every fast kernel is tested against.  They take plain
arguments (no validation: the public operators in ``lowbit.ops`` validate first)
and follow the conventions of ``lowbit.scheme`` to the letter; every scheme fact
(code range, block shape, packing word) comes from the ``QuantScheme`` itself.
"""

from __future__ import annotations

import math

import torch

from .._validate import has_values
from ..scheme import QuantScheme, code_range, pack_unit, word_bits


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_blocks(x: torch.Tensor, s: QuantScheme) -> torch.Tensor:
    """View ``x`` as [num_blocks, block_len]; row i uses scale.reshape(-1)[i]."""
    return x.reshape(math.prod(s.scale_shape(x.shape)), s.block_len(x.shape))


def divide(a: torch.Tensor, d: float) -> torch.Tensor:
    """``a / d`` correctly rounded on every device.  (CUDA computes ``tensor / python_number``
    as ``tensor * (1 / d)``, one rounding more, which moves some scales by an ulp.)"""
    return a / a.new_full((), d)


# -- choose_qparams ---------------------------------------------------------------
def block_qparams(xb: torch.Tensor, bits: int, symmetric: bool, zero_point_domain: str,
                  scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale [B] and zero point [B] (int32, or scale_dtype for the "float" domain; None
    when symmetric) of the non-empty blocks ``xb`` [B, block_len]."""
    qmin, qmax = code_range(bits, symmetric)
    xb = xb.to(compute_dtype(xb.dtype))
    lo, hi = xb.amin(dim=1), xb.amax(dim=1)
    if symmetric:
        scale = divide(torch.maximum(-lo, hi), (qmax - qmin) / 2)
    elif zero_point_domain == "int":
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = divide(hi - lo, qmax - qmin)
    elif zero_point_domain == "min":
        lo = round_down_to(lo, scale_dtype).to(lo.dtype)  # the stored min never cuts the range
        scale = divide(hi - lo, qmax - qmin)
    else:
        # Floor the scale so |zero_point| = |lo| / scale stays below 2^15 (fits float16).
        scale = torch.maximum(divide(hi - lo, qmax - qmin), torch.maximum(-lo, hi) * 2.0**-15)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero block
    scale = round_up_to(scale, scale_dtype)
    if symmetric:
        return scale, None
    s = scale.to(lo.dtype)
    if zero_point_domain == "int":
        return scale, (qmin - torch.round(lo / s)).clamp(qmin, qmax).to(torch.int32)
    if zero_point_domain == "min":
        return scale, lo.to(scale_dtype)  # exact: lo was rounded to scale_dtype
    return scale, (qmin - lo / s).to(scale_dtype)


def choose_qparams(x: torch.Tensor, s: QuantScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point of ``x`` under ``s``, shaped ``s.scale_shape(x.shape)``."""
    shape = s.scale_shape(x.shape)
    if x.numel() == 0:  # empty blocks: scale 1, zero point 0, as for an all-zero block
        ones = torch.ones(shape, dtype=s.scale_dtype, device=x.device)
        if s.symmetric:
            return ones, None
        zp_dtype = torch.int32 if s.zero_point_domain == "int" else s.scale_dtype
        return ones, torch.zeros(shape, dtype=zp_dtype, device=x.device)
    scale, zp = block_qparams(to_blocks(x, s), s.bits, s.symmetric, s.zero_point_domain, s.scale_dtype)
    return scale.reshape(shape), None if zp is None else zp.reshape(shape)


def round_down_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to ``dtype`` rounding down (toward -inf)."""
    return -round_up_to(-x, dtype)


def round_up_to(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to ``dtype`` rounding up, so a stored scale never clips the range."""
    s = scale.to(dtype)
    below = s.to(scale.dtype) < scale
    return torch.where(below, torch.nextafter(s, torch.full_like(s, math.inf)), s)


# -- quantize / dequantize on unpacked codes ---------------------------------------
def quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
             s: QuantScheme) -> torch.Tensor:
    """Unpacked codes of x: int8 for symmetric, uint8 for asymmetric, shape of x."""
    q = rounded_codes(x, scale, zero_point, s)
    return q.clamp(s.qmin, s.qmax).to(torch.int8 if s.symmetric else torch.uint8).reshape(x.shape)


def rounded_codes(x, scale, zero_point, s: QuantScheme) -> torch.Tensor:
    """The codes before clamping, as floats in blocks [num_blocks, block_len]."""
    cdt = compute_dtype(x.dtype)
    xb = to_blocks(x, s).to(cdt)
    sc = scale.reshape(-1, 1).to(cdt)
    if zero_point is None:
        return torch.round(xb / sc)
    if s.zero_point_domain == "int":
        return torch.round(xb / sc) + zero_point.reshape(-1, 1).to(cdt)
    if s.zero_point_domain == "min":
        return torch.round((xb - zero_point.reshape(-1, 1).to(cdt)) / sc)
    return torch.round(xb / sc + zero_point.reshape(-1, 1).to(cdt))


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, s: QuantScheme,
               out_dtype: torch.dtype) -> torch.Tensor:
    """(q - zero_point) * scale (q * scale + zero_point in the "min" domain) in float32
    (float64 for float64 output), rounded once to ``out_dtype``."""
    cdt = compute_dtype(out_dtype)
    qb = to_blocks(q, s).to(cdt)
    if zero_point is not None and s.zero_point_domain == "min":
        out = qb * scale.reshape(-1, 1).to(cdt) + zero_point.reshape(-1, 1).to(cdt)
        return out.to(out_dtype).reshape(q.shape)
    if zero_point is not None:
        qb = qb - zero_point.reshape(-1, 1).to(cdt)
    return (qb * scale.reshape(-1, 1).to(cdt)).to(out_dtype).reshape(q.shape)


# -- bit packing ------------------------------------------------------------------
def pack(q: torch.Tensor, bits: int, packing: str) -> torch.Tensor:
    """Pack the low ``bits`` of each code along the last dim as a little-endian bit
    stream into int32 words ("u32") or uint8 bytes ("u8")."""
    word, unit = word_bits(packing), pack_unit(bits, packing)  # unit: values that fill whole words
    lead, k = q.shape[:-1], q.shape[-1]
    v = (q.to(torch.int64) & ((1 << bits) - 1)).reshape(*lead, k // unit, unit)
    stream = (v[..., None] >> torch.arange(bits, device=q.device)) & 1  # [..., k/unit, unit, bits]
    stream = stream.reshape(*lead, k // unit, unit * bits // word, word)  # bit i of word w
    words = (stream << torch.arange(word, device=q.device)).sum(-1)
    if packing == "u32":
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    else:
        words = words.to(torch.uint8)
    return words.reshape(*lead, k * bits // word)


def unpack(packed: torch.Tensor, bits: int, packing: str, signed: bool) -> torch.Tensor:
    """Inverse of ``pack``: int8 codes (sign-extended) if signed, else uint8."""
    word, unit = word_bits(packing), pack_unit(bits, packing)
    lead = packed.shape[:-1]
    w = packed.to(torch.int64) & ((1 << word) - 1)
    k = packed.shape[-1] * word // bits
    stream = (w[..., None] >> torch.arange(word, device=packed.device)) & 1  # [..., words, word]
    stream = stream.reshape(*lead, k // unit, unit, bits)
    v = (stream << torch.arange(bits, device=packed.device)).sum(-1).reshape(*lead, k)
    if signed:
        v = torch.where(v >= 1 << (bits - 1), v - (1 << bits), v)
        return v.to(torch.int8)
    return v.to(torch.uint8)


# -- what the operators call: unpack-and-dequantize ---------------------------------
def dequantize_packed(codes, scale, zero_point, s: QuantScheme, shape, out_dtype) -> torch.Tensor:
    q = unpack(codes, s.bits, s.packing, s.symmetric) if s.is_packed else codes
    return dequantize(q.reshape(shape), scale, zero_point, s, out_dtype)


# -- per-token quantization with a strict interface ----------------------------------
def quantize_per_token(x, bits, symmetric):
    """(codes, scale in x's dtype, int32 zero point (0 when symmetric)) of each row of
    x [N, D], and whether every scale is finite (the caller checked that x is).  The rows are the blocks
    of ``choose_qparams`` with an "int" zero point; the scale keeps x's dtype."""
    qmin, qmax = code_range(bits, symmetric)
    n = x.shape[0]
    if x.numel() == 0:
        scale = torch.ones(n, dtype=x.dtype, device=x.device)
        zp = torch.zeros(n, dtype=torch.int32, device=x.device)
    else:
        scale, zp = block_qparams(x, bits, symmetric, "int", x.dtype)
        zp = torch.zeros(n, dtype=torch.int32, device=x.device) if zp is None else zp
    cdt = compute_dtype(x.dtype)
    q = torch.round(x.to(cdt) / scale.to(cdt)[:, None]) + zp.to(cdt)[:, None]
    ok = not has_values(scale) or bool(torch.isfinite(scale).all())
    return q.clamp(qmin, qmax).to(torch.int8 if symmetric else torch.uint8), scale, zp, ok


def dequantize_per_token(q, scale, zero_point):
    """(q[n, d] - zero_point[n]) * scale[n] in float32 (float64 for a float64 scale),
    rounded once to scale's dtype."""
    cdt = compute_dtype(scale.dtype)
    return ((q.to(cdt) - zero_point.to(cdt)[:, None]) * scale.to(cdt)[:, None]).to(scale.dtype)


# -- int32 accumulator dequantization (the W8A8 epilogue) -----------------------------
def dequantize_accumulator_grouped(
    acc: torch.Tensor, scale: torch.Tensor, group_size: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """float32(acc) * float32(scale of the group), rounded once to out_dtype."""
    s = scale.to(torch.float32).repeat_interleave(group_size, dim=-1)
    return (acc.to(torch.float32) * s).to(out_dtype)


def dequantize_accumulator_rowcol(
    acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """float32(acc) * row_scale[m] * col_scale[n], left to right in float32."""
    y = acc.to(torch.float32) * row_scale.to(torch.float32)[..., None]
    return (y * col_scale.to(torch.float32)).to(out_dtype)


# -- matmuls -------------------------------------------------------------------------
def dequantize_weight(codes, scale, zero_point, bits, group_size, k, out_dtype=torch.float32,
                      zero_point_min=False):
    """Float [N, K] weight from codes [N, K] (8 bit) or packed int32 [N, K*bits/32],
    scale/zero_point [N, K // group_size]; signed codes iff zero_point is None.  W = (q - z) * s,
    or q * s + z with ``zero_point_min`` (the "min" zero-point domain)."""
    q = codes if bits == 8 else unpack(codes, bits, "u32", zero_point is None)
    q = q.reshape(-1, k).to(compute_dtype(out_dtype))
    by_group = lambda t: t.to(q.dtype).repeat_interleave(group_size, dim=1)  # noqa: E731
    if zero_point_min:
        return (q * by_group(scale) + by_group(zero_point)).to(out_dtype)
    if zero_point is not None:
        q = q - by_group(zero_point)
    return (q * by_group(scale)).to(out_dtype)


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with float32 products and sums, whatever ``torch.set_float32_matmul_precision``
    says: at "high" or "medium" torch's CPU matmul runs in bf16 where the CPU has bf16 dot
    products (oneDNN on AVX512-BF16 / AMX: errors of 2^-9 relative), and a reference that
    moved with that setting would no longer be the float32 result its tests derive bounds
    from.  (The setting is process-wide; the reference runs it for one matmul.)"""
    before = torch.get_float32_matmul_precision()
    if before == "highest":
        return a @ b
    torch.set_float32_matmul_precision("highest")
    try:
        return a @ b
    finally:
        torch.set_float32_matmul_precision(before)


def weight_only_matmul(x, codes, scale, zero_point, bits, group_size, zero_point_min=False):
    """x [..., K] @ dequantize(W).T in float32, rounded once to x's dtype."""
    w = dequantize_weight(codes, scale, zero_point, bits, group_size, x.shape[-1], zero_point_min=zero_point_min)
    return matmul_f32(x.to(torch.float32), w.T).to(x.dtype)


def split_weight(codes, scale, zero_point, bits, group_size, k, outliers, high_codes, high_scale,
                 high_zero_point, high_bits, high_group_size):
    """The float32 [N, K] split weight (``lowbit.SplitQTensor``): the low part dequantized,
    the high part's columns added at ``outliers``."""
    w = dequantize_weight(codes, scale, zero_point, bits, group_size, k)
    w[:, outliers] += dequantize_weight(high_codes, high_scale, high_zero_point, high_bits, high_group_size,
                                        outliers.numel())
    return w


def split_matmul(x, codes, scale, zero_point, bits, group_size, outliers, *high):
    """x [..., K] @ W.T for the split weight ``W = low + high placed at the outlier
    columns``: ``split_weight``, one float32 matmul, rounded once to x's dtype."""
    w = split_weight(codes, scale, zero_point, bits, group_size, x.shape[-1], outliers, *high)
    return matmul_f32(x.to(torch.float32), w.T).to(x.dtype)


def int8_blocks(x, act_block):
    """x quantized and dequantized in symmetric int8 blocks of ``act_block`` values along K
    (the scheme ``int8-sym-g<act_block>``: float32 scale max|x| / 127.5 per block, codes in
    [-128, 127]), float32."""
    s = QuantScheme.parse(f"int8-sym-g{act_block}")
    x32 = x.to(torch.float32)
    xs, _ = choose_qparams(x32, s)
    return dequantize(quantize(x32, xs, None, s), xs, None, s, torch.float32)


def linear_a8_blocks(x, codes, scale, zero_point, bits, group_size, act_block, zero_point_min=False):
    """``int8_blocks`` of x, then the weight-only matmul in float32, rounded once to x's dtype."""
    return weight_only_matmul(int8_blocks(x, act_block), codes, scale, zero_point, bits, group_size,
                              zero_point_min).to(x.dtype)


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 a [M, K] @ int8 b [N, K].T with exact int32 accumulation (int64 inside)."""
    return (a.to(torch.int64) @ b.to(torch.int64).T).to(torch.int32)


def linear_qta8a_qga4w(x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size, bias):
    """The W4A8 linear before output quantization: dequantize the int8 per-token input
    and the int4 per-group weight, float32 linear (+ bias)."""
    k = x_q.shape[-1]
    x = (x_q.to(torch.float32) - x_zero_point.to(torch.float32)[:, None]) * x_scale.to(torch.float32)[:, None]
    w = dequantize_weight(w_codes, w_scale, w_zero_point, 4, group_size, k)
    y = matmul_f32(x, w.T)
    return y if bias is None else y + bias.to(torch.float32)


def requantize_per_token(y, out_scale, out_zero_point):
    """int8 clamp(round(y / out_scale) + out_zero_point, -128, 127), one row per token."""
    q = torch.round(y / out_scale.to(torch.float32)[:, None]) + out_zero_point.to(torch.float32)[:, None]
    return q.clamp(-128, 127).to(torch.int8)
