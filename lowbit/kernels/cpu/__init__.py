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
