"""GPTQ and AWQ checkpoints (AutoGPTQ / GPTQModel, AutoAWQ): their packed linears as
lowbit QTensors, exactly.

GPTQ (``quant_method`` "gptq"), a linear [N, K] with groups of G (``group_size`` -1:
one group)::

    qweight  int32 [K * b / 32, N]   codes packed along K: word i of column n holds
                                     k = (32/b) i .. (32/b) i + 32/b - 1, value j at bits b*j
    qzeros   int32 [K / G, N * b / 32]   zero points packed along N the same way
    scales   float16 [K / G, N]
    g_idx    int32 [K]               the group of each input channel
    x = scales[g, n] * (q - zero)    with zero = stored + 1 in the original format
                                     (checkpoint_format "gptq": AutoGPTQ wrote zero - 1)
                                     and zero = stored in "gptq_v2"

AWQ (``quant_method`` "awq", ``version`` "gemm")::

    qweight  int32 [K, N * b / 32]   codes packed along N in the interleaved order
                                     0, 2, 4, 6, 1, 3, 5, 7: value at bits 4*i of word w is
                                     column 8w + AWQ_ORDER[i]
    qzeros   int32 [K / G, N * b / 32]   zero points, same packing
    scales   float16 [K / G, N]
    x = scales[g, n] * (q - zero)

Both become lowbit's ``int{b}-{sym|asym}-g{G}-f16`` (per channel for one group): a
symmetric GPTQ checkpoint (every zero 2^(b-1)) has signed codes ``q - 2^(b-1)``, an
asymmetric one unsigned codes with integer zero points, so every weight dequantizes to
the same number.  Input-channel orders that are not contiguous groups (``desc_act``
with a ``g_idx`` that is not ``k // G``) and zero points outside the code range (the
wrapped zero 0 of AutoGPTQ's ``zero - 1``: stored 15, read back as 16) have no lowbit
form and are refused by name.
"""

from __future__ import annotations

import torch

from ..qtensor import QTensor
from ..scheme import QuantScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of the value at bits 4*i of an AWQ word


class GPTQFormatError(ValueError):
    """A GPTQ or AWQ linear that lowbit cannot hold exactly, with the file and reason."""


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> int16 [..., W, 32 / bits]: value j of each word (bits b*j..)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.int16).reshape(*words.shape, per)


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's ``qweight`` [K * b / 32, N] -> codes [K, N] (packed along dim 0).

    Example::

        >>> unpack_rows(torch.tensor([[0x76543210]], dtype=torch.int32), 4).flatten().tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    f = _fields(words, bits)  # [W, N, per]
    return f.permute(0, 2, 1).reshape(-1, words.shape[1])


def unpack_columns(words: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """GPTQ's ``qzeros`` (``order`` None) or AWQ's ``qweight``/``qzeros``
    (``order=AWQ_ORDER``) [R, N * b / 32] -> values [R, N] (packed along dim 1).

    Example::

        >>> unpack_columns(torch.tensor([[0x76543210]], dtype=torch.int32), 4, AWQ_ORDER).tolist()
        [[0, 4, 1, 5, 2, 6, 3, 7]]
    """
    f = _fields(words, bits)  # [R, W, per]: f[..., i] is column order[i] of its word
    if order is not None:
        inverse = [list(order).index(j) for j in range(len(order))]
        f = f[..., inverse]
    return f.reshape(words.shape[0], -1)


def _to_qtensor(q: torch.Tensor, zero: torch.Tensor, scales: torch.Tensor, bits: int, group: int, symmetric: bool,
                what: str) -> QTensor:
    """lowbit QTensor of codes ``q`` [K, N] (unsigned), per-group ``zero`` and ``scales``
    [K / group, N] (transposed layouts of both formats); ``group`` None: per channel."""
    from ..ops import pack_bits

    k, n = q.shape
    if not bool(torch.isfinite(scales).all()):
        raise GPTQFormatError(f"{what}: scales hold NaN or Inf")
    hi = (1 << bits) - 1
    if symmetric:
        if not bool((zero == 1 << (bits - 1)).all()):
            raise GPTQFormatError(f"{what}: sym is true but the zero points are not all {1 << (bits - 1)}")
        codes = (q.t() - (1 << (bits - 1))).to(torch.int8)
        zp = None
    else:
        if int(zero.min()) < 0 or int(zero.max()) > hi:
            raise GPTQFormatError(f"{what}: zero point {int(zero.max())} is outside the {bits}-bit code range "
                                  f"[0, {hi}] (AutoGPTQ's format stores zero - 1, so a zero of 0 wraps to {hi} and "
                                  f"reads back as {hi + 1}); lowbit cannot hold this group exactly")
        codes = q.t().to(torch.uint8)
        zp = zero.t().to(torch.uint8).contiguous()
    granularity, g = ("channel", None) if group is None else ("group", group)
    scheme = QuantScheme(bits, symmetric, granularity, g, scales.dtype, "int", "u32")
    if bits < 8:
        codes = pack_bits(codes, bits, "u32")
    scale = scales.t().contiguous()
    if granularity == "channel":
        scale, zp = scale.reshape(n), None if zp is None else zp.reshape(n)
    return QTensor(codes.contiguous(), scale, zp, scheme, torch.Size((n, k)))


def _group(config: dict, k: int, what: str) -> int | None:
    """The group size (None: ``group_size`` -1, one scale per output channel)."""
    g = config.get("group_size", -1)
    if isinstance(g, bool) or not isinstance(g, int) or (g != -1 and (g <= 0 or k % g)):
        raise GPTQFormatError(f"{what}: group_size {g!r} must be -1 or a positive divisor of in_features {k}")
    return None if g == -1 else g


def _bits(config: dict, allowed: tuple, what: str) -> int:
    b = config.get("bits")
    if b not in allowed:
        raise GPTQFormatError(f"{what}: bits {b!r} is not read (lowbit reads {', '.join(map(str, allowed))})")
    return b


def check_config(method: str, config: dict, where: str) -> None:
    """Refuse, before any tensor is read, a GPTQ / AWQ ``quantization_config`` lowbit
    does not read.

    Example::

        >>> check_config("awq", {"bits": 4, "group_size": 128, "version": "gemv"}, "config.json")
        Traceback (most recent call last):
        lowbit.formats.gptq.GPTQFormatError: config.json: AWQ version 'gemv' is not read (only 'gemm')
    """
    if method == "gptq":
        _bits(config, (2, 4, 8), where)
        fmt = config.get("checkpoint_format", config.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise GPTQFormatError(f"{where}: GPTQ checkpoint_format {fmt!r} is not read ('gptq', 'gptq_v2')")
    elif method == "awq":
        _bits(config, (4,), where)
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise GPTQFormatError(f"{where}: AWQ version {version!r} is not read (only 'gemm')")
    else:
        raise GPTQFormatError(f"{where}: quant_method {method!r} is not GPTQ or AWQ")


def decode_gptq(get, name: str, config: dict, shape, where: str,
                g_idx: torch.Tensor | None = None) -> tuple[QTensor, torch.Tensor | None]:
    """``(qt, input_order)`` of GPTQ linear ``name`` [N, K]: its QTensor and, for an
    act-order checkpoint, the order of its columns (``QuantLinear``'s ``input_order``),
    else None.  ``get(key, dtypes, shape)`` reads a tensor (shape None: any) and raises
    naming the file; ``g_idx`` (None: absent from the file) is the group of each input
    channel: ``k // group_size``, or (act-order, ``desc_act``) any assignment that puts
    exactly ``group_size`` channels in each group.  Then the channels are sorted by group
    (stably), so each group's codes become consecutive columns, as lowbit's group schemes
    need, and ``input_order`` records where each column came from.

    Example::

        >>> import torch, lowbit
        >>> qw = torch.full((4, 8), 0x76543210, dtype=torch.int32)  # K = 32, N = 8
        >>> t = {"m.qweight": qw, "m.qzeros": torch.full((1, 1), 0x77777777, dtype=torch.int32),
        ...      "m.scales": torch.ones(1, 8, dtype=torch.float16)}
        >>> qt, order = decode_gptq(lambda k, d, s: t[k], "m", {"bits": 4, "group_size": -1, "sym": True}, (8, 32), "x")
        >>> qt.scheme, lowbit.dequantize(qt)[0, :4].tolist(), order
        (QuantScheme('int4-sym-f16'), [-8.0, -7.0, -6.0, -5.0], None)
    """
    what = f"{where}: module {name!r}"
    n, k = shape
    bits = _bits(config, (2, 4, 8), what)
    group = _group(config, k, what)
    groups = 1 if group is None else k // group
    per = 32 // bits
    if k % per or n % per:
        raise GPTQFormatError(f"{what}: shape {tuple(shape)} must be a multiple of {per} on both dims")
    q = unpack_rows(get(f"{name}.qweight", (torch.int32,), (k // per, n)), bits)
    zeros = unpack_columns(get(f"{name}.qzeros", (torch.int32,), (groups, n // per)), bits)
    scales = get(f"{name}.scales", (torch.float16, torch.bfloat16, torch.float32), (groups, n))
    order = None if g_idx is None else input_order(g_idx, k, group, what)
    if order is not None:
        q = q.index_select(0, order)  # q is [K, N]: channel rows, sorted by group
    if config.get("checkpoint_format", config.get("format", "gptq")) == "gptq":
        zeros = zeros + 1  # AutoGPTQ stored zero - 1
    symmetric = bool(config.get("sym", True))
    return _to_qtensor(q, zeros, scales, bits, group, symmetric, what), order


def input_order(g_idx: torch.Tensor, k: int, group: int | None, what: str = "g_idx") -> torch.Tensor | None:
    """None when ``g_idx`` is the plain ``k // group_size``; otherwise (act-order) the
    stable sort of the channels by group, checked to hold exactly ``group_size``
    channels per group.

    Example::

        >>> import torch
        >>> input_order(torch.tensor([1, 0, 0, 1]), 4, 2).tolist()
        [1, 2, 0, 3]
    """
    if tuple(g_idx.shape) != (k,):
        raise GPTQFormatError(f"{what}: g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
    g_idx = g_idx.long()
    size = group or k
    if torch.equal(g_idx, torch.arange(k) // size):
        return None
    counts = torch.bincount(g_idx.clamp(0, k // size), minlength=k // size + 1)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= k // size or bool((counts[:k // size] != size).any()):
        raise GPTQFormatError(f"{what}: g_idx must put exactly {size} input channels in each of the {k // size} "
                              f"groups (group_size {size}); got values {int(g_idx.min())}..{int(g_idx.max())} "
                              f"and group sizes {sorted(set(counts[:k // size].tolist()))}")
    return torch.sort(g_idx, stable=True).indices


def decode_awq(get, name: str, config: dict, shape, where: str) -> QTensor:
    """The QTensor of AWQ (GEMM) linear ``name`` [N, K].

    Example::

        >>> import torch, lowbit
        >>> t = {"m.qweight": torch.full((32, 1), 0x76543210, dtype=torch.int32),
        ...      "m.qzeros": torch.zeros(1, 1, dtype=torch.int32), "m.scales": torch.ones(1, 8, dtype=torch.float16)}
        >>> qt = decode_awq(lambda k, d, s: t[k], "m", {"bits": 4, "group_size": 32}, (8, 32), "x")
        >>> lowbit.dequantize(qt)[:, 0].tolist()
        [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]
    """
    what = f"{where}: module {name!r}"
    n, k = shape
    bits = _bits(config, (4,), what)
    group = _group(config, k, what)
    groups = 1 if group is None else k // group
    if n % 8:
        raise GPTQFormatError(f"{what}: out_features {n} must be a multiple of 8")
    q = unpack_columns(get(f"{name}.qweight", (torch.int32,), (k, n // 8)), bits, AWQ_ORDER)
    zeros = unpack_columns(get(f"{name}.qzeros", (torch.int32,), (groups, n // 8)), bits, AWQ_ORDER)
    scales = get(f"{name}.scales", (torch.float16, torch.bfloat16, torch.float32), (groups, n))
    if config.get("zero_point", True) is False:
        raise GPTQFormatError(f"{what}: AWQ without zero points is not read")
    return _to_qtensor(q, zeros, scales, bits, group, False, what)

__all__ = ["decode_gptq", "decode_awq", "check_config", "unpack_rows", "unpack_columns", "AWQ_ORDER",
           "GPTQFormatError"]
