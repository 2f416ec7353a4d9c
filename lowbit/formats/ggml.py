"""ggml's quantized block types (GGUF's tensor data), in plain PyTorch.

Every type stores a row as consecutive blocks of ``block_size`` values in
``type_size`` bytes.  The layouts and formulas below are those of ggml (llama.cpp's
``ggml-quants.c``) as the ``gguf`` package reads and writes them; ``dequantize`` is
bit-identical with ``gguf.quants.dequantize`` and ``quantize`` with
``gguf.quants.quantize`` (tested on random blocks and on every tensor of the bundled
model).  All arithmetic is float32, one operation at a time in ggml's order, so no
fused multiply-add can change a bit.

Simple types (32 values per block; ``d`` and ``m`` are float16; a byte of ``qs``
holds value i in its low nibble and value i + 16 in its high nibble; ``qh`` is a
little-endian 32-bit word whose bit i is bit 4 of value i)::

    Q4_0  d qs          x = d * (q - 8)     q in [0, 15]
    Q4_1  d m qs        x = d * q + m       q in [0, 15]
    Q5_0  d qh qs       x = d * (q - 16)    q in [0, 31]
    Q5_1  d m qh qs     x = d * q + m       q in [0, 31]
    Q8_0  d qs          x = d * q           q int8

K-quants (256 values per super-block, 16 or 8 sub-blocks with their own 4- or 6-bit
scales (and mins) under a float16 ``d`` (and ``dmin``)): Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K; this module dequantizes them (``gguf`` has no quantizer for them).

Example::

    >>> import torch
    >>> from lowbit.formats import ggml
    >>> x = torch.linspace(-1, 1, 64).reshape(2, 32)
    >>> raw = ggml.quantize(x, "Q8_0")
    >>> raw.shape, (ggml.dequantize(raw, "Q8_0", x.shape) - x).abs().max() < 1 / 127
    (torch.Size([2, 34]), tensor(True))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

QK_K = 256  # values per K-quant super-block


@dataclass(frozen=True)
class BlockType:
    """One ggml tensor type: ``block_size`` values stored in ``type_size`` bytes."""

    name: str
    block_size: int
    type_size: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size


TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("F32", 1, 4), BlockType("F16", 1, 2), BlockType("BF16", 1, 2),
    BlockType("Q4_0", 32, 18), BlockType("Q4_1", 32, 20), BlockType("Q5_0", 32, 22),
    BlockType("Q5_1", 32, 24), BlockType("Q8_0", 32, 34),
    BlockType("Q2_K", QK_K, 84), BlockType("Q3_K", QK_K, 110), BlockType("Q4_K", QK_K, 144),
    BlockType("Q5_K", QK_K, 176), BlockType("Q6_K", QK_K, 210),
)}
QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def block_type(name: str) -> BlockType:
    """The ``BlockType`` called ``name`` (case-insensitive); a ValueError lists the known ones.

    Example::

        >>> block_type("q4_k"), block_type("Q4_K").bits_per_weight
        (BlockType(name='Q4_K', block_size=256, type_size=144), 4.5)
    """
    t = TYPES.get(str(name).upper())
    if t is None:
        raise ValueError(f"unknown ggml type {name!r}: expected one of {list(TYPES)}")
    return t


def nbytes(name: str, shape) -> int:
    """Bytes of a tensor of logical ``shape`` stored as type ``name``; its rows (last dim)
    must be whole blocks.

    Example::

        >>> nbytes("Q4_0", (576, 1536))
        497664
    """
    t = block_type(name)
    shape = [int(n) for n in shape]
    if not shape or shape[-1] % t.block_size:
        raise ValueError(f"a {t.name} tensor needs rows of whole {t.block_size}-value blocks, got shape {shape}")
    return math.prod(shape) // t.block_size * t.type_size


# -- helpers: byte fields of a block -----------------------------------------------------
def _blocks(raw: torch.Tensor, t: BlockType, shape) -> torch.Tensor:
    """``raw`` (uint8, any shape) as [n_blocks, type_size], checked against ``shape``."""
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise TypeError(f"raw must be a uint8 torch.Tensor of {t.name} blocks, got "
                        f"{raw.dtype if isinstance(raw, torch.Tensor) else type(raw).__name__}")
    expected = nbytes(t.name, shape)
    if raw.numel() != expected:
        raise ValueError(f"{t.name} data of shape {list(shape)} is {expected} bytes, got {raw.numel()}")
    return raw.reshape(-1, t.type_size)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 fields [n, 2] (uint8) as float32 [n]."""
    return b.contiguous().view(torch.float16).reshape(-1).to(torch.float32)


def _u8(x: torch.Tensor) -> torch.Tensor:
    """float16 [n] as its little-endian bytes [n, 2]."""
    return x.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values: low nibbles are values 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32] bits, bit i first."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[..., None] >> shifts) & 1).reshape(qh.shape[0], 32)


def _simple_parts(blocks: torch.Tensor, name: str):
    """(d float32 [n], m float32 [n] or None, q int32 [n, 32]: the stored unsigned code)."""
    if name == "Q8_0":
        return _f16(blocks[:, :2]), None, blocks[:, 2:].contiguous().view(torch.int8).to(torch.int32)
    has_m = name in ("Q4_1", "Q5_1")
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4]) if has_m else None
    rest = blocks[:, 4:] if has_m else blocks[:, 2:]
    if name in ("Q5_0", "Q5_1"):
        q = _nibbles(rest[:, 4:]) | (_bits(rest[:, :4]) << 4)
    else:
        q = _nibbles(rest)
    return d, m, q.to(torch.int32)


CODE_OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 0}  # x = d * (q - offset) for the types without a min


# -- dequantize --------------------------------------------------------------------------
def dequantize(raw: torch.Tensor, name: str, shape, *, backend: str | None = None) -> torch.Tensor:
    """float32 tensor of logical ``shape`` from the raw bytes ``raw`` (uint8) of a ggml
    tensor of type ``name``; bit-identical with ``gguf.quants.dequantize``.

    ``backend``: "reference" (the plain PyTorch below) or "cpu" (lowbit's C++ kernel,
    ``csrc/cpu/ggml.cpp``: the same bits, except that a NaN from non-finite scales may
    carry another payload); None picks "cpu" for CPU data when the extension is built.

    Example::

        >>> import torch
        >>> raw = torch.tensor([0, 60] + [0x98] * 16, dtype=torch.uint8)   # d = 1.0, q = 8, 9
        >>> dequantize(raw, "Q4_0", [32])[[0, 16]]
        tensor([0., 1.])
    """
    t = block_type(name)
    blocks = _blocks(raw, t, shape)
    if backend not in (None, "reference", "cpu"):
        raise ValueError(f"backend must be None, 'reference' or 'cpu', got {backend!r}")
    if t.block_size > 1 and backend != "reference" and raw.device.type == "cpu":
        from ..kernels.cpu import _C

        if _C is not None:
            return _C.ggml_dequantize(blocks.reshape(-1).contiguous(), t.name).reshape(list(shape))
        if backend == "cpu":
            raise RuntimeError("backend='cpu' needs lowbit's C++ extension, which did not load")
    if t.name == "F32":
        out = blocks.contiguous().view(torch.float32)
    elif t.name == "F16":
        out = blocks.contiguous().view(torch.float16).to(torch.float32)
    elif t.name == "BF16":
        out = blocks.contiguous().view(torch.bfloat16).to(torch.float32)
    elif t.name in CODE_OFFSET:
        d, _, q = _simple_parts(blocks, t.name)
        out = d[:, None] * (q - CODE_OFFSET[t.name]).to(torch.float32)
    elif t.name in ("Q4_1", "Q5_1"):
        d, m, q = _simple_parts(blocks, t.name)
        out = d[:, None] * q.to(torch.float32) + m[:, None]
    else:
        out = _k_dequantize(blocks, t.name)
    return out.reshape(list(shape))


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins packed in 12 bytes -> two [n, 8]."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _shifted(b: torch.Tensor, shifts, width: int, mask: int) -> torch.Tensor:
    """[n, j*width] bytes -> [n, j, len(shifts), width]: each byte shifted by each shift, masked."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=b.device).reshape(1, 1, -1, 1)
    return (b.reshape(b.shape[0], -1, 1, width) >> s) & mask


def _q2_k(blocks: torch.Tensor):
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = d[:, None] * (scales & 0x0F).to(torch.float32)
    ml = dmin[:, None] * (scales >> 4).to(torch.float32)
    return dl, ml, _shifted(qs, (0, 2, 4, 6), 32, 3).reshape(n, 16, 16).to(torch.int32)


def _q3_k(blocks: torch.Tensor):
    n = blocks.shape[0]
    hmask, qs, scales, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _f16(blocks[:, 108:110])
    lo = _shifted(scales[:, :8], (0, 4), 8, 0x0F).reshape(n, 16)
    hi = _shifted(scales[:, 8:12], (0, 2, 4, 6), 4, 0x03).reshape(n, 16)
    sc = ((lo | (hi << 4)).to(torch.int32) - 32).to(torch.float32)
    ql = _shifted(qs, (0, 2, 4, 6), 32, 3).reshape(n, 16, 16).to(torch.int32)
    qh = _shifted(hmask, range(8), 32, 1).reshape(n, 16, 16).to(torch.int32)
    return d[:, None] * sc, None, ql - ((qh ^ 1) << 2)  # the high bit *clear* means "minus 4"


def _q45_k(blocks: torch.Tensor, five: bool):
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = d[:, None] * sc.to(torch.float32)
    ml = dmin[:, None] * mn.to(torch.float32)
    qs = blocks[:, 48:] if five else blocks[:, 16:]
    q = _shifted(qs, (0, 4), 32, 0x0F).reshape(n, 8, 32)
    if five:
        q = q | (_shifted(blocks[:, 16:48], range(8), 32, 1).reshape(n, 8, 32) << 4)
    return dl, ml, q.to(torch.int32)


def _q6_k(blocks: torch.Tensor):
    n = blocks.shape[0]
    ql, qh, scales, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], _f16(blocks[:, 208:210])
    dl = d[:, None] * scales.contiguous().view(torch.int8).to(torch.float32)
    lo = _shifted(ql, (0, 4), 64, 0x0F).reshape(n, 8, 32)
    hi = _shifted(qh, (0, 2, 4, 6), 32, 0x03).reshape(n, 8, 32)
    return dl, None, ((lo | (hi << 4)).to(torch.int32) - 32).reshape(n, 16, 16)


# (scale [n, sub-blocks], min to subtract [n, sub-blocks] or None, code [n, sub-blocks, values])
# of each K-quant super-block: x = scale * q - min, both products exact in float32
_K_PARTS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": lambda b: _q45_k(b, False),
            "Q5_K": lambda b: _q45_k(b, True), "Q6_K": _q6_k}


def _k_dequantize(blocks: torch.Tensor, name: str) -> torch.Tensor:
    dl, ml, q = _K_PARTS[name](blocks)
    out = dl[..., None] * q.to(torch.float32)
    return out if ml is None else out - ml[..., None]


# -- quantize ----------------------------------------------------------------------------
def quantize(x: torch.Tensor, name: str) -> torch.Tensor:
    """The raw bytes (uint8 [rows, bytes per row]) of float ``x`` stored as ggml type
    ``name`` (one of ``QUANTIZABLE``); bit-identical with ``gguf.quants.quantize`` of
    ``x`` as float32.  ``x``'s last dim must be whole blocks, its values finite.

    Example::

        >>> import torch
        >>> quantize(torch.full((1, 32), 0.5), "Q4_0")[0, :4].tolist()   # d = -0.0625, q = 0
        [0, 172, 0, 0]
    """
    t = block_type(name)
    if t.name not in QUANTIZABLE:
        raise ValueError(f"no quantizer for ggml type {t.name}: expected one of {list(QUANTIZABLE)}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a float torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0 or x.shape[-1] % t.block_size:
        raise ValueError(f"{t.name} needs rows of whole {t.block_size}-value blocks, got shape {list(x.shape)}")
    x = x.detach().to(torch.float32)
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"cannot store non-finite values as {t.name}")
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    if t.name == "F32":
        return rows.contiguous().view(torch.uint8)
    if t.name == "F16":
        return rows.to(torch.float16).view(torch.uint8)
    if t.name == "BF16":  # round to nearest even (torch and ggml agree on finite values)
        return rows.to(torch.bfloat16).view(torch.uint8)
    b = rows.reshape(-1, t.block_size)
    out = _QUANTIZERS[t.name](b)
    return out.reshape(rows.shape[0], -1)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: nearest, halves away from zero (ggml's Q8_0)."""
    a = v.abs()
    f = torch.floor(a)
    return torch.sign(v) * (f + torch.floor(2 * (a - f)))


def _signed_max(b: torch.Tensor) -> torch.Tensor:
    """Per block, the value of largest magnitude with its sign (the first one on ties)."""
    return torch.gather(b, 1, b.abs().argmax(dim=1, keepdim=True))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.uint8)
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def _pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of 32 values as a little-endian uint32, [n, 4] bytes."""
    bits = ((q.to(torch.int64) >> 4) & 1).reshape(-1, 4, 8)
    return (bits << torch.arange(8, device=q.device)).sum(-1).to(torch.uint8)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(dim=1, keepdim=True) / 127
    q = _roundf(b * _inverse(d)).to(torch.int8)
    return torch.cat([_u8(d), q.view(torch.uint8)], dim=1)


def _q_sym(b: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 (half = 8) and Q5_0 (16): d = signed max / -half, q = trunc(x / d + half + 0.5)."""
    d = _signed_max(b) / -half
    q = torch.trunc(b * _inverse(d) + (half + 0.5)).clamp(0, 2 * half - 1)
    return d, q


def _q_min(b: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 (levels = 15) and Q5_1 (31): d = (max - min) / levels, q = trunc((x - min) / d + 0.5)."""
    lo, hi = b.amin(dim=1, keepdim=True), b.amax(dim=1, keepdim=True)
    d = (hi - lo) / levels
    q = torch.trunc((b - lo) * _inverse(d) + 0.5).clamp(0, levels)
    return d, lo, q


def _q4_0(b):
    d, q = _q_sym(b, 8)
    return torch.cat([_u8(d), _pack_nibbles(q)], dim=1)


def _q5_0(b):
    d, q = _q_sym(b, 16)
    return torch.cat([_u8(d), _pack_high_bits(q), _pack_nibbles(q)], dim=1)


def _q4_1(b):
    d, m, q = _q_min(b, 15)
    return torch.cat([_u8(d), _u8(m), _pack_nibbles(q)], dim=1)


def _q5_1(b):
    d, m, q = _q_min(b, 31)
    return torch.cat([_u8(d), _u8(m), _pack_high_bits(q), _pack_nibbles(q)], dim=1)


_QUANTIZERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1}


# -- lossless block <-> code views --------------------------------------------------------
def pack_simple(name: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks [n, type_size] of a simple type from its parts: ``q`` [n, 32] the stored
    codes (unsigned, or int8 for Q8_0), ``d`` [n] and, for Q4_1/Q5_1, ``m`` [n], both
    float16.  The inverse of the parts ``dequantize`` reads: no rounding.

    Example::

        >>> import torch
        >>> q, d = torch.arange(32) % 16, torch.full((1,), 0.5, dtype=torch.float16)
        >>> dequantize(pack_simple("Q4_0", q[None], d), "Q4_0", [32])[:4]
        tensor([-4.0000, -3.5000, -3.0000, -2.5000])
    """
    t = block_type(name)
    if t.name == "Q8_0":
        body = q.to(torch.int8).view(torch.uint8)
    elif t.name in ("Q5_0", "Q5_1"):
        body = torch.cat([_pack_high_bits(q), _pack_nibbles(q)], dim=1)
    elif t.name in ("Q4_0", "Q4_1"):
        body = _pack_nibbles(q)
    else:
        raise ValueError(f"pack_simple takes Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0, got {t.name}")
    head = [_u8(d)] + ([_u8(m)] if t.name in ("Q4_1", "Q5_1") else [])
    return torch.cat(head + [body], dim=1)


# -- ggml blocks as lowbit QTensors --------------------------------------------------------
# the lowbit scheme each ggml type loads into without loss.  Scales and mins are the
# file's own values (float16) or, for the K-quants, the products d * sc and dmin * m
# (exact in float32).  Codes that lowbit has no width for go into the next wider one:
# 5- and 6-bit codes into int8, and Q3_K's 3-bit codes into int4, which the CPU kernels
# run (a scale may be negative, as ggml's own Q4_0 quantizer writes them).
LOSSLESS_SCHEMES = {
    "Q4_0": "int4-sym-g32-f16", "Q4_1": "int4-asym-g32-zpmin-f16", "Q8_0": "int8-sym-g32-f16",
    "Q5_0": "int8-sym-g32-f16", "Q5_1": "int8-asym-g32-zpmin-f16",
    "Q2_K": "int2-asym-g16-zpmin", "Q3_K": "int4-sym-g16", "Q4_K": "int4-asym-g32-zpmin",
    "Q5_K": "int8-asym-g32-zpmin", "Q6_K": "int8-sym-g16",
}


def as_qtensor(raw: torch.Tensor, name: str, shape):
    """The ggml tensor ``raw`` (uint8) of type ``name`` and logical ``shape`` [N, K] as a
    lowbit QTensor holding the same codes, scales and mins (``LOSSLESS_SCHEMES``), or
    None for the float types.  ``lowbit.dequantize`` of the result equals
    ``dequantize(raw, name, shape)`` bit for bit (tested on every type): ggml computes
    ``d * (q - offset)``, ``d * q + m`` or ``(d * sc) * q - dmin * m``, and the scheme's
    ``q * scale`` / ``q * scale + zero_point`` ("min" domain) is the same float32 sum of
    the same products.

    Example::

        >>> import torch, lowbit
        >>> raw = quantize(torch.randn(4, 64), "Q4_1")
        >>> qt = as_qtensor(raw, "Q4_1", [4, 64])
        >>> qt.scheme, torch.equal(lowbit.dequantize(qt), dequantize(raw, "Q4_1", [4, 64]))
        (QuantScheme('int4-asym-g32-zpmin-f16'), True)
    """
    from ..ops import pack_bits
    from ..qtensor import QTensor
    from ..scheme import QuantScheme

    t = block_type(name)
    if t.name not in LOSSLESS_SCHEMES:
        return None
    shape = [int(n) for n in shape]
    if len(shape) != 2:
        raise ValueError(f"as_qtensor takes a 2-D [N, K] tensor, got shape {shape}")
    blocks = _blocks(raw, t, shape)
    n, k = shape
    s = QuantScheme.parse(LOSSLESS_SCHEMES[t.name])
    if t.name in _K_PARTS:
        scale, low, q = _K_PARTS[t.name](blocks)
        zero_point = None if low is None else -low  # q * scale + (-min) == scale * q - min
    else:
        scale, zero_point, q = _simple_parts(blocks, t.name)
        if s.symmetric:
            q = q - CODE_OFFSET[t.name]
    g = s.group_size
    scale = scale.to(s.scale_dtype).reshape(n, k // g)  # exact: float16 read, or an exact float32 product
    zero_point = None if zero_point is None else zero_point.to(s.scale_dtype).reshape(n, k // g)
    q = q.reshape(n, k).to(torch.int8 if s.symmetric else torch.uint8)
    codes = pack_bits(q, s.bits, s.packing) if s.is_packed else q
    return QTensor(codes, scale, zero_point, s, torch.Size(shape))
