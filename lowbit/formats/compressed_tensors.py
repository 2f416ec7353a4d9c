"""compressed-tensors: the quantized checkpoint format that vLLM and transformers load.

A model folder (``config.json`` with a ``quantization_config`` whose ``quant_method`` is
"compressed-tensors", ``model.safetensors``, the tokenizer's files).  The tensors of a
quantized linear ``NAME`` [N, K] with groups of G (``strategy`` "group"; "channel" has one
scale per row, "tensor" one in all)::

    pack-quantized (weight-only schemes)
        NAME.weight_packed      int32 [N, ceil(K * b / 32)]   codes, packed along K
        NAME.weight_scale       [N, K / G]  ("channel": [N, 1], "tensor": [1])
        NAME.weight_shape       int64 [2] = (N, K)
        NAME.weight_zero_point  int32 [ceil(N * b / 32), K / G]   asymmetric only: packed
                                along N (dim 0), not along K
    int-quantized (schemes that also quantize activations)
        NAME.weight             int8 [N, K]   codes, one per byte
        NAME.weight_scale, NAME.weight_zero_point (int8, same shape as the scale)
        NAME.input_scale        [1]  (and NAME.input_zero_point, int8 [1]): static
                                per-tensor activations only; per-token ones are dynamic

Codes and zero points are *signed*: a b-bit value v lies in ``[-2^(b-1), 2^(b-1))`` and
dequantizes to ``(v - zero_point) * scale``.  Packing stores ``v + 2^(b-1)`` as a dense
little-endian bit stream: 32 values fill exactly b int32 words, value i of a row at bits
``b*i .. b*i + b - 1`` of the row's stream (a row is padded with zeros to a multiple of 32
values, then cut to the words it needs).  This is not lowbit's two's-complement ``u32``
layout, but it holds the same values: lowbit's symmetric codes are those signed values,
and its asymmetric codes u in ``[0, 2^b)`` with integer zero point z become
``v = u - 2^(b-1)`` and ``zero_point = z - 2^(b-1)``, so ``v - zero_point = u - z`` and every
weight dequantizes to the same number.  Schemes with a float or "min" zero point (HQQ,
GGUF's Q4_1) have no compressed-tensors form and are refused, never converted silently.

The layouts and ``config.json`` fields are those the ``compressed-tensors`` package
(version ``FORMAT_VERSION``) writes; the tests check both against the package itself.

Example::

    >>> import torch, lowbit
    >>> from lowbit.formats import compressed_tensors as ct
    >>> qt = lowbit.quantize(torch.randn(8, 64), "int4-sym-g32")
    >>> sorted((k, tuple(v.shape)) for k, v in ct.encode_weight(qt, "weight_only").items())
    [('weight_packed', (8, 8)), ('weight_scale', (8, 2)), ('weight_shape', (2,))]
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..qtensor import QTensor
from ..scheme import QuantScheme

FORMAT_VERSION = "0.19.0"  # the compressed-tensors release whose layout this module writes
QUANT_METHOD = "compressed-tensors"
EXPORT_MARK = {"format": "pt", "lowbit_export": "compressed-tensors"}  # safetensors metadata of our files
WEIGHTS = "model.safetensors"
_STRATEGY = {"group": "group", "channel": "channel", "tensor": "tensor"}


class CompressedTensorsError(ValueError):
    """A model or file that compressed-tensors cannot express, named with the reason."""


# -- the arguments of one quantized tensor (config.json) -----------------------------------
def _args(bits: int, symmetric: bool, strategy: str, group_size: int | None, dynamic: bool) -> dict:
    """One ``QuantizationArgs`` as compressed-tensors serialises it (every field, its order)."""
    return {
        "actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": group_size,
        "num_bits": bits, "observer": None, "observer_kwargs": {}, "scale_dtype": None,
        "strategy": strategy, "symmetric": symmetric, "type": "int",
        "zp_dtype": None if symmetric else "torch.int8",
    }


def weight_args(scheme: QuantScheme | str) -> dict:
    """compressed-tensors' ``weights`` arguments for a lowbit weight scheme; raises
    ``CompressedTensorsError`` for a scheme it cannot hold exactly.

    Example::

        >>> a = weight_args("int4-asym-g64-f16")
        >>> a["num_bits"], a["strategy"], a["group_size"], a["symmetric"], a["zp_dtype"]
        (4, 'group', 64, False, 'torch.int8')
    """
    s = scheme if isinstance(scheme, QuantScheme) else QuantScheme.parse(str(scheme))
    if s.zero_point_domain != "int":
        raise CompressedTensorsError(
            f"weight scheme '{s}' has a {s.zero_point_domain!r} zero point; compressed-tensors stores "
            "integer zero points only (quantize with an int zero point, e.g. 'int4-asym-g32-f16')")
    if s.granularity not in _STRATEGY:
        raise CompressedTensorsError(f"weight scheme '{s}' is per {s.granularity}; weights are per group, "
                                     "channel or tensor")
    return _args(s.bits, s.symmetric, _STRATEGY[s.granularity], s.group_size, dynamic=False)


def activation_args(act_scheme: QuantScheme | str | None) -> dict | None:
    """compressed-tensors' ``input_activations`` for a lowbit activation scheme: per token
    is dynamic, per tensor is static (``input_scale`` in the file).

    Example::

        >>> a = activation_args("int8-sym-token")
        >>> a["strategy"], a["dynamic"], a["symmetric"]
        ('token', True, True)
    """
    if act_scheme is None:
        return None
    s = act_scheme if isinstance(act_scheme, QuantScheme) else QuantScheme.parse(str(act_scheme))
    if s.bits != 8 or s.zero_point_domain != "int" or s.granularity not in ("token", "tensor"):
        raise CompressedTensorsError(f"activation scheme '{s}' has no compressed-tensors form; "
                                     "activations are int8 per token (dynamic) or per tensor (static)")
    return _args(8, s.symmetric, s.granularity, None, dynamic=s.granularity == "token")


def compression_format(act_scheme) -> str:
    """The format compressed-tensors picks: "int-quantized" (one int8 per code) when
    activations are quantized too, else "pack-quantized".

    Example::

        >>> compression_format(None), compression_format("int8-sym-token")
        ('pack-quantized', 'int-quantized')
    """
    return "pack-quantized" if act_scheme is None else "int-quantized"


def check_recipe(recipe) -> None:
    """Refuse, before any quantizing, a ``lowbit.Recipe`` whose schemes compressed-tensors
    cannot hold (float or "min" zero points, a quantized embedding, activation schemes
    other than int8 per token or per tensor).

    Example::

        >>> import lowbit
        >>> check_recipe(lowbit.Recipe.get("q4_1"))
        Traceback (most recent call last):
        lowbit.formats.compressed_tensors.CompressedTensorsError: weight scheme 'int4-asym-g32-zpmin-f16' has a 'min' zero point; compressed-tensors stores integer zero points only (quantize with an int zero point, e.g. 'int4-asym-g32-f16')
    """
    if recipe.embedding is not None:
        raise CompressedTensorsError("the recipe quantizes the embedding; vLLM and transformers load "
                                     "compressed-tensors quantization of linear layers only")
    for w in [recipe.weight, recipe.lm_head] + [o.get("weight") for _, o in recipe.overrides]:
        if w is not None:
            weight_args(w)
    for a in [recipe.activation, recipe.lm_head_activation] + [o.get("activation") for _, o in recipe.overrides]:
        activation_args(a)


# -- codes --------------------------------------------------------------------------------
def _signed_codes(qt: QTensor) -> torch.Tensor:
    """int8 [N, K]: the QTensor's codes as compressed-tensors' signed values."""
    from ..ops import unpack_bits

    s = qt.scheme
    codes = qt.codes if not s.is_packed else unpack_bits(qt.codes, s.bits, s.packing, signed=s.symmetric)
    if s.symmetric:
        return codes.to(torch.int8)
    return (codes.to(torch.int16) - (1 << (s.bits - 1))).to(torch.int8)


def pack(values: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Pack signed ``bits``-bit values (int8 [R, C]) along ``dim`` into int32 words as
    compressed-tensors does: ``v + 2^(b-1)`` in a dense little-endian bit stream.

    Example::

        >>> pack(torch.tensor([[-8, -7, 0, 7, 1, 2, 3, 4]], dtype=torch.int8), 4)
        tensor([[-878053360]], dtype=torch.int32)
    """
    from ..ops import pack_bits

    if values.dtype != torch.int8 or values.dim() != 2:
        raise ValueError(f"values must be a 2-D int8 tensor, got {values.dtype} of shape {tuple(values.shape)}")
    v = values.t() if dim == 0 else values
    rows, cols = v.shape
    words = -(-cols * bits // 32)
    if bits == 8 and cols % 4 == 0 and sys.byteorder == "little":  # 4 bytes are one little-endian word
        out = (v.contiguous().view(torch.uint8) ^ 0x80).view(torch.int32)
        return (out.t() if dim == 0 else out).contiguous()
    u = v.to(torch.int32) + (1 << (bits - 1))
    per = 32 if bits < 8 else 4
    u = torch.nn.functional.pad(u, (0, -cols % per))
    if bits < 8:
        out = pack_bits(u.to(torch.uint8), bits, "u32")
    else:
        shifts = torch.arange(0, 32, 8, dtype=torch.int64)
        out = (u.to(torch.int64).reshape(rows, -1, 4) << shifts).sum(-1).to(torch.int32)
    out = out[:, :words]
    return (out.t() if dim == 0 else out).contiguous()


def unpack(words: torch.Tensor, bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """Inverse of ``pack``: the first ``length`` signed values along ``dim`` (int8).

    Example::

        >>> unpack(pack(torch.tensor([[-4, 3, 0, 1]], dtype=torch.int8), 3), 3, 4)
        tensor([[-4,  3,  0,  1]], dtype=torch.int8)
    """
    from ..ops import unpack_bits

    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"packed words must be a 2-D int32 tensor, got {words.dtype} of shape {tuple(words.shape)}")
    w = words.t() if dim == 0 else words
    if w.shape[1] * 32 < length * bits:
        raise ValueError(f"{w.shape[1]} int32 words hold {w.shape[1] * 32 // bits} {bits}-bit values, "
                         f"fewer than the {length} expected")
    if bits < 8:
        w = torch.nn.functional.pad(w, (0, -w.shape[1] % bits))
        u = unpack_bits(w.contiguous(), bits, "u32", signed=False).to(torch.int16)
    else:
        shifts = torch.arange(0, 32, 8, dtype=torch.int32)
        u = ((w.to(torch.int32)[..., None] >> shifts) & 0xFF).reshape(w.shape[0], -1).to(torch.int16)
    v = (u[:, :length] - (1 << (bits - 1))).to(torch.int8)
    return (v.t() if dim == 0 else v).contiguous()


def _same_stream(s: QuantScheme) -> bool:
    """Whether lowbit's stored words are compressed-tensors' bit stream already (up to
    the sign bits): sub-byte codes in int32 words, whose rows fill whole words."""
    return s.is_packed and s.packing == "u32"


def _sign_bits(bits: int) -> torch.Tensor:
    """int32 [bits]: the top bit of every ``bits``-bit field of 32 values' bit stream."""
    stream = sum(1 << (bits * i + bits - 1) for i in range(32))
    words = [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(bits)]
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def _flip_signs(words: torch.Tensor, bits: int) -> torch.Tensor:
    """``words`` [..., W] with the top bit of every ``bits``-bit field flipped (the
    pattern repeats every lcm(bits, 32) / 32 words: 1 for 2 and 4 bits, 3 for 3 bits)."""
    period = math.lcm(bits, 32) // 32
    mask = _sign_bits(bits)[:period].to(words.device)
    return (words.reshape(*words.shape[:-1], -1, period) ^ mask).reshape(words.shape)


def _packed_codes(qt: QTensor, values: torch.Tensor | None) -> torch.Tensor:
    """``weight_packed`` of ``qt``.  lowbit's ``u32`` words already hold the bit stream:
    unsigned (asymmetric) codes are the stored ``v + 2^(b-1)`` as they are, and adding
    ``2^(b-1)`` to a b-bit two's-complement code flips its top bit, so symmetric words
    need one XOR; other layouts are unpacked and packed again."""
    s = qt.scheme
    if values is not None:
        return pack(values, s.bits)
    return (_flip_signs(qt.codes, s.bits) if s.symmetric else qt.codes).contiguous()


def encode_weight(qt: QTensor, kind: str) -> dict[str, torch.Tensor]:
    """The tensors (names relative to the module) of one quantized weight [N, K] in
    ``kind`` "weight_only" (pack-quantized) or "int" (int-quantized) form.

    Example::

        >>> import torch, lowbit
        >>> qt = lowbit.quantize(torch.randn(64, 64), "int4-asym-g32-f16")
        >>> {k: tuple(v.shape) for k, v in encode_weight(qt, "weight_only").items()}
        {'weight_packed': (64, 8), 'weight_scale': (64, 2), 'weight_shape': (2,), 'weight_zero_point': (8, 2)}
    """
    s = qt.scheme
    weight_args(s)  # refuses what has no form
    if len(qt.shape) != 2:
        raise CompressedTensorsError(f"a quantized weight must be 2-D, got shape {tuple(qt.shape)}")
    n, k = qt.shape
    values = _signed_codes(qt) if kind == "int" or not _same_stream(s) else None
    scale = qt.scale.reshape(n, 1) if s.granularity == "channel" else qt.scale
    zp = None
    if not s.symmetric:
        zp = (qt.zero_point.to(torch.int16) - (1 << (s.bits - 1))).to(torch.int8)
        zp = zp.reshape(scale.shape)
    if kind == "int":
        out = {"weight": values, "weight_scale": scale}
        if zp is not None:
            out["weight_zero_point"] = zp
        return out
    if kind != "weight_only":
        raise ValueError(f"kind must be 'weight_only' or 'int', got {kind!r}")
    out = {"weight_packed": _packed_codes(qt, values), "weight_scale": scale,
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if zp is not None:
        # per group or channel the zero points are packed too, along the rows
        out["weight_zero_point"] = pack(zp, s.bits, dim=0) if s.granularity != "tensor" else zp
    return out


# -- reading ------------------------------------------------------------------------------
def matches(name: str, classes: list[str], target: str) -> bool:
    """compressed-tensors' rule for a target (or ignore) entry: ``re:PATTERN`` matches
    the module name from its start (``re.match``), anything else is the exact name or one
    of the module's class names (``classes``, its MRO).

    Example::

        >>> matches("model.layers.0.mlp.up_proj", ["Linear", "Module"], "re:.*mlp")
        True
    """
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target in classes


def check_config(q, where: str) -> None:
    """Refuse, before the model is built, a ``quantization_config`` whose structure is not
    compressed-tensors': ``config_groups`` an object of groups, each with a non-empty list
    of ``targets`` (strings; ``re:`` ones valid regexes), ``weights`` an object,
    ``input_activations`` an object or null; ``ignore`` a list of strings; ``format`` a
    string.

    Example::

        >>> check_config({"config_groups": {"g": {"targets": ["re:("], "weights": {}}}}, "config.json")
        Traceback (most recent call last):
        lowbit.formats.compressed_tensors.CompressedTensorsError: config.json: config_groups['g'].targets: 're:(' is not a valid regular expression (missing ), unterminated subpattern at position 0)
    """
    def bad(field, expected, value):
        raise CompressedTensorsError(f"{where}: {field} must be {expected}, got {value!r}")

    def names(field, value, non_empty):
        if not isinstance(value, list) or (non_empty and not value):
            bad(field, "a non-empty list of module names" if non_empty else "a list of module names", value)
        for t in value:
            if not isinstance(t, str) or not t:
                bad(field, "a list of non-empty strings", value)
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    raise CompressedTensorsError(f"{where}: {field}: {t!r} is not a valid regular expression "
                                                 f"({e})") from None

    if not isinstance(q, dict):
        bad("quantization_config", "an object", q)
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        bad("quantization_config.config_groups", "a non-empty object", groups)
    for key, g in groups.items():
        field = f"config_groups[{key!r}]"
        if not isinstance(g, dict):
            bad(field, "an object", g)
        names(f"{field}.targets", g.get("targets"), non_empty=True)
        if not isinstance(g.get("weights"), dict):
            bad(f"{field}.weights", "an object", g.get("weights"))
        for part in ("input_activations", "output_activations"):
            if g.get(part) is not None and not isinstance(g.get(part), dict):
                bad(f"{field}.{part}", "an object or null", g.get(part))
        if g.get("format") is not None and not isinstance(g.get("format"), str):
            bad(f"{field}.format", "a string or null", g.get("format"))
    names("quantization_config.ignore", q.get("ignore") or [], non_empty=False)
    if q.get("format") is not None and not isinstance(q.get("format"), str):
        bad("quantization_config.format", "a string or null", q.get("format"))


def scheme_from_args(args: dict, scale_dtype: torch.dtype, where: str) -> QuantScheme:
    """The lowbit scheme of compressed-tensors' ``weights`` arguments with scales of
    ``scale_dtype``; ``where`` (a file and module) is named in errors.

    Example::

        >>> scheme_from_args(weight_args("int4-asym-g32"), torch.float16, "x")
        QuantScheme('int4-asym-g32-f16')
    """
    if not isinstance(args, dict):
        raise CompressedTensorsError(f"{where}: weights arguments must be an object, got {args!r}")
    get = args.get
    bits, strategy = get("num_bits"), get("strategy")
    unsupported = [(k, get(k)) for k, ok in [("type", get("type") == "int"), ("dynamic", not get("dynamic")),
                                              ("block_structure", get("block_structure") is None),
                                              ("actorder", get("actorder") in (None, "static")),
                                              ("num_bits", bits in (2, 3, 4, 8)),
                                              ("strategy", strategy in _STRATEGY)] if not ok]
    if unsupported:
        raise CompressedTensorsError(f"{where}: weights {unsupported[0][0]}={unsupported[0][1]!r} is not read "
                                     "(int weights of 2, 3, 4 or 8 bits per group, channel or tensor, no "
                                     "activation ordering)")
    symmetric = get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise CompressedTensorsError(f"{where}: weights symmetric must be true or false, got {symmetric!r}")
    group = get("group_size") if strategy == "group" else None
    try:
        return QuantScheme(bits, symmetric, strategy, group, scale_dtype, "int", "u32")
    except (TypeError, ValueError) as e:
        raise CompressedTensorsError(f"{where}: weights {args} have no lowbit scheme: {e}") from None


def act_scheme_from_args(args: dict | None, where: str) -> str | None:
    """The lowbit activation scheme of compressed-tensors' ``input_activations``.

    Example::

        >>> act_scheme_from_args(activation_args("int8-asym-token"), "x")
        'int8-asym-token'
    """
    if args is None:
        return None
    if not isinstance(args, dict):
        raise CompressedTensorsError(f"{where}: input_activations must be an object or null, got {args!r}")
    strategy, dynamic = args.get("strategy"), bool(args.get("dynamic"))
    if (args.get("type") != "int" or args.get("num_bits") != 8
            or (strategy, dynamic) not in (("token", True), ("tensor", False))):
        raise CompressedTensorsError(f"{where}: input activations {args} are not read (int8 per token, dynamic, "
                                     "or per tensor, static)")
    return f"int8-{'sym' if args.get('symmetric', True) else 'asym'}-{strategy}"


def decode_weight(get, name: str, args: dict, fmt: str, shape, where: str) -> QTensor:
    """The QTensor of the quantized weight of module ``name`` [N, K] stored in ``fmt``
    ("pack-quantized" or "int-quantized") with ``weights`` arguments ``args``; ``get(key,
    dtypes, shape)`` reads a tensor of the file (shape None: any) and raises naming it.

    Example::

        >>> import lowbit
        >>> qt = lowbit.quantize(torch.randn(8, 64), "int4-sym-g32-f16")
        >>> t = {"m." + k: v for k, v in encode_weight(qt, "weight_only").items()}
        >>> back = decode_weight(lambda k, d, s: t[k], "m", weight_args(qt.scheme), "pack-quantized", (8, 64), "x")
        >>> torch.equal(back.codes, qt.codes) and torch.equal(back.scale, qt.scale)
        True
    """
    if fmt not in ("pack-quantized", "int-quantized"):
        raise CompressedTensorsError(f"{where}: module {name!r}: format {fmt!r} is not read (pack-quantized, "
                                     "int-quantized)")
    n, k = shape
    floats = (torch.float32, torch.float16, torch.bfloat16)
    scale = get(f"{name}.weight_scale", floats, None)
    s = scheme_from_args(args, scale.dtype, f"{where}: module {name!r}")
    scale_shape = {"group": None, "channel": (n, 1), "tensor": (1,)}[s.granularity]
    if s.granularity == "group":
        if k % s.group_size:
            raise CompressedTensorsError(f"{where}: module {name!r}: group_size {s.group_size} does not divide "
                                         f"in_features {k}")
        scale_shape = (n, k // s.group_size)
    if s.is_packed and k % s.pack_unit:
        raise CompressedTensorsError(f"{where}: module {name!r}: in_features {k} is not a multiple of "
                                     f"{s.pack_unit}, which lowbit's {s.bits}-bit packing needs")
    if tuple(scale.shape) != scale_shape:
        raise CompressedTensorsError(f"{where}: tensor {name}.weight_scale has shape {tuple(scale.shape)}, "
                                     f"expected {scale_shape}")
    if not bool(torch.isfinite(scale).all()):
        raise CompressedTensorsError(f"{where}: tensor {name}.weight_scale holds NaN or Inf")
    offset = 1 << (s.bits - 1)
    zp = None
    if not s.symmetric:
        if fmt == "pack-quantized" and s.granularity != "tensor":
            words = get(f"{name}.weight_zero_point", (torch.int32,), (-(-scale_shape[0] * s.bits // 32), scale_shape[1]))
            zp_values = unpack(words, s.bits, scale_shape[0], dim=0)
        else:
            zp_values = get(f"{name}.weight_zero_point", (torch.int8,), scale_shape)
        zp = _in_range(zp_values, s.bits, f"{where}: tensor {name}.weight_zero_point")
        zp = (zp.to(torch.int16) + offset).to(torch.uint8).reshape(s.scale_shape(shape))
    if fmt == "pack-quantized":
        stored = get(f"{name}.weight_shape", (torch.int64, torch.int32), (2,))
        if stored.tolist() != [n, k]:
            raise CompressedTensorsError(f"{where}: tensor {name}.weight_shape is {stored.tolist()}, the model's "
                                         f"module is [{n}, {k}]")
        words = get(f"{name}.weight_packed", (torch.int32,), (n, -(-k * s.bits // 32)))
        if s.is_packed:  # the same bit stream as lowbit's u32 words, up to the sign bits
            codes = _flip_signs(words, s.bits) if s.symmetric else words
        else:
            values = unpack(words, 8, k)
            codes = values if s.symmetric else (values.to(torch.int16) + offset).to(torch.uint8)
    else:
        values = _in_range(get(f"{name}.weight", (torch.int8,), (n, k)), s.bits, f"{where}: tensor {name}.weight")
        codes = values if s.symmetric else (values.to(torch.int16) + offset).to(torch.uint8)
        if s.is_packed:
            from ..ops import pack_bits

            codes = pack_bits(codes, s.bits, "u32")
    scale = scale.reshape(s.scale_shape(shape)).contiguous()
    return QTensor(codes.contiguous(), scale, zp, s, torch.Size(shape))


def _in_range(values: torch.Tensor, bits: int, what: str) -> torch.Tensor:
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if values.numel() and (int(values.min()) < lo or int(values.max()) > hi):
        raise CompressedTensorsError(f"{what} holds values outside the {bits}-bit range [{lo}, {hi}]")
    return values


# -- the model ------------------------------------------------------------------------------
@dataclass
class ModuleExport:
    """One quantized linear as written: its lowbit schemes and compressed-tensors format."""

    name: str
    weight: str
    activation: str | None
    format: str
    numel: int
    nbytes: int


@dataclass
class CompressedTensorsExport:
    """What ``export_compressed_tensors`` wrote."""

    path: Path
    modules: list[ModuleExport] = field(default_factory=list)
    float_tensors: int = 0
    float_numel: int = 0
    float_nbytes: int = 0
    config: dict = field(default_factory=dict)

    @property
    def bits_per_weight(self) -> float:
        """Bits per value over every tensor of the file (codes, scales, zero points, floats)."""
        n = sum(m.numel for m in self.modules) + self.float_numel
        return 8 * (sum(m.nbytes for m in self.modules) + self.float_nbytes) / max(n, 1)

    def table(self) -> str:
        """One line per (weight scheme, activation scheme): format, modules, bits/weight."""
        rows: dict[tuple, list[ModuleExport]] = {}
        for m in self.modules:
            rows.setdefault((m.weight, m.activation or "-", m.format), []).append(m)
        head = ("weight scheme", "activations", "format", "modules", "stored", "bits/weight")
        lines = [head] + [(w, a, f, str(len(ms)), "exact", f"{8 * sum(m.nbytes for m in ms) / sum(m.numel for m in ms):.3f}")
                          for (w, a, f), ms in rows.items()]
        if self.float_tensors:
            lines.append(("float", "-", "dense", str(self.float_tensors), "exact",
                          f"{8 * self.float_nbytes / max(self.float_numel, 1):.3f}"))
        widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
        out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
        out.append(f"{len(self.modules)} quantized linears, every tensor stored exactly; "
                   f"{self.bits_per_weight:.3f} bits per weight over the whole file")
        return "\n".join(out)


def _quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    from ..nn import QuantEmbedding, QuantLinear, SplitQuantLinear
    from ..sparse import SparseQuantLinear

    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (SplitQuantLinear, SparseQuantLinear)):
            raise CompressedTensorsError(f"module {name!r} is a {type(mod).__name__}, which lowbit does not write "
                                         "as compressed-tensors (int8 outlier channels + int4, or 2:4 sparse)")
        if isinstance(mod, QuantEmbedding):
            raise CompressedTensorsError(
                f"module {name!r} is a quantized embedding; vLLM and transformers load compressed-tensors "
                "quantization of linear layers only (quantize without the embedding)")
        if isinstance(mod, QuantLinear):
            if mod.weight.qtensor().scheme.granularity == "channel" and len(mod.weight.shape) != 2:
                raise CompressedTensorsError(f"module {name!r}: weight must be 2-D")
            if not mod.act_calibrated:
                raise CompressedTensorsError(f"module {name!r}: per-tensor activation scale not calibrated")
            if mod.input_order is not None:
                raise CompressedTensorsError(
                    f"module {name!r} has act-order groups (input_order, from a desc_act GPTQ checkpoint), "
                    "which compressed-tensors cannot hold: its g_idx (actorder 'group') is gone from the "
                    f"format version written here ({FORMAT_VERSION}); save with lowbit.save_quantized, or "
                    "export as GGUF (re-quantized)")
            out[name] = mod
    if not out:
        raise CompressedTensorsError("model has no quantized linears: quantize it with lowbit.quantize_model "
                                     "(or give lowbit export a --recipe)")
    return out


def _config_groups(linears: dict[str, nn.Module], float_linears: list[str]) -> tuple[dict, list[str]]:
    """``config_groups`` and ``ignore``: one group per distinct (weights, activations);
    a single group targets "Linear" and ignores the float linears, several name their
    modules (disjoint targets, so no module matches two groups)."""
    groups: dict[str, dict] = {}
    members: dict[str, list[str]] = {}
    for name, mod in linears.items():
        act = mod.act_scheme
        scheme = {"format": compression_format(act), "input_activations": activation_args(act),
                  "output_activations": None, "weights": weight_args(mod.weight.qtensor().scheme)}
        key = json.dumps(scheme, sort_keys=True)
        groups.setdefault(key, scheme)
        members.setdefault(key, []).append(name)
    out = {}
    for i, (key, scheme) in enumerate(groups.items()):
        targets = ["Linear"] if len(groups) == 1 else members[key]
        out[f"group_{i}"] = {**scheme, "targets": targets}
    return out, (sorted(float_linears) if len(groups) == 1 else [])


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def quantization_config(config_groups: dict, ignore: list[str], formats: set[str]) -> dict:
    """The ``quantization_config`` of ``config.json``, with every key compressed-tensors
    writes."""
    return {
        "config_groups": config_groups,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": QUANT_METHOD,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": FORMAT_VERSION,
    }


def check_output(path: str | os.PathLike, overwrite: bool) -> Path:
    """Check, before any work, that a compressed-tensors folder can be written at ``path``:
    it must not exist, unless ``overwrite`` and it is a folder an earlier export wrote
    (its model.safetensors says so); nothing else is ever replaced.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     check_output(d, overwrite=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        FileExistsError: '...' exists and is not a compressed-tensors folder written by lowbit export; refusing to replace it
    """
    from .._folders import check_output_dir

    return check_output_dir(path, overwrite, replaceable=_not_an_export, what="compressed-tensors folder")


def _not_an_export(p: Path) -> str | None:
    """Why the existing ``p`` is not a folder an earlier export wrote (None: it is)."""
    if p.is_symlink() or not p.is_dir():
        return "is not a folder"
    try:
        from safetensors import safe_open

        with safe_open(str(p / WEIGHTS), "pt") as f:
            meta = f.metadata() or {}
        if any(e.is_dir(follow_symlinks=False) for e in os.scandir(p)):
            return "holds folders, which an export never does"
    except Exception:  # noqa: BLE001 - any unreadable file means "not ours"
        meta = {}
    if meta.get("lowbit_export") != EXPORT_MARK["lowbit_export"]:
        return "is not a compressed-tensors folder written by lowbit export"
    return None


def export_compressed_tensors(model: nn.Module, tokenizer, path: str | os.PathLike, *,
                              overwrite: bool = False) -> CompressedTensorsExport:
    r"""Write ``model`` (a transformers causal LM quantized by lowbit) as a
    compressed-tensors folder that vLLM and transformers load.

    Every quantized linear is stored exactly (its codes, scales and zero points as they
    are); a scheme compressed-tensors cannot hold (float or "min" zero points, quantized
    embeddings) is refused with ``CompressedTensorsError`` before anything is written.
    Tied embeddings are stored once, as ``model.embed_tokens.weight``; ``config.json``
    names the architecture.  The folder is written beside ``path`` and renamed into
    place, so an interrupted export leaves nothing half-written.

    Example::

        >>> import tempfile, lowbit
        >>> from lowbit.formats.compressed_tensors import export_compressed_tensors
        >>> model, tok = lowbit.load_model()
        >>> recipe = lowbit.Recipe(weight="int8-sym", activation="int8-sym-token", modules=[r"layers\.0\."])
        >>> q = lowbit.quantize_model(model, recipe)  # W8A8 on layer 0 only, to keep the example fast
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = export_compressed_tensors(q, tok, d + "/smollm2-w8a8")
        >>> print(out.table())  # doctest: +NORMALIZE_WHITESPACE
        weight scheme  activations     format         modules  stored  bits/weight
        int8-sym       int8-sym-token  int-quantized  7        exact   8.047
        float          -               dense          265      exact   32.000
        7 quantized linears, every tensor stored exactly; 31.370 bits per weight over the whole file
    """
    from safetensors.torch import save_file

    from .._folders import staging

    check_output(path, overwrite)
    linears = _quantized_linears(model)
    config = getattr(model, "config", None)
    if config is None:
        raise CompressedTensorsError("model has no transformers config; export a transformers causal LM")
    tensors: dict[str, torch.Tensor] = {}
    result = CompressedTensorsExport(Path(path))
    formats = set()
    for name, mod in linears.items():
        qt = mod.weight.qtensor()
        fmt = compression_format(mod.act_scheme)
        formats.add(fmt)
        parts = encode_weight(qt, "int" if fmt == "int-quantized" else "weight_only")
        if mod.act_scale is not None:
            parts["input_scale"] = mod.act_scale.reshape(1)
            if mod.act_zero_point is not None:
                parts["input_zero_point"] = (mod.act_zero_point.to(torch.int16) - 128).to(torch.int8).reshape(1)
        if mod.bias is not None:
            parts["bias"] = mod.bias.detach()
        for k, v in parts.items():
            tensors[f"{name}.{k}"] = v.contiguous()
        result.modules.append(ModuleExport(name, str(qt.scheme), mod.act_scheme, fmt, qt.numel(),
                                           sum(v.numel() * v.element_size() for k, v in parts.items()
                                               if k not in ("weight_shape", "bias"))))
    # the float tensors; a tied output weight is written once, as the embedding
    tied = bool(getattr(config, "tie_word_embeddings", False))
    seen: dict[int, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        module = name.rsplit(".", 1)[0]
        if any(module == q or module.startswith(q + ".") for q in linears):
            continue
        if not t.is_floating_point():
            raise CompressedTensorsError(f"tensor {name!r} ({t.dtype}) is neither a float weight nor part of "
                                         "a quantized linear")
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if key in seen:  # the output weight tied to the embedding
            continue
        seen[key] = name
        tensors[name] = t.detach().contiguous()
        result.float_tensors += 1
        result.float_numel += t.numel()
        result.float_nbytes += t.numel() * t.element_size()
    float_linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    groups, ignore = _config_groups(linears, float_linears)
    data = config.to_dict()
    data["architectures"] = [type(model).__name__]
    data["dtype"] = str(_float_dtype(model)).removeprefix("torch.")
    if tied and ("lm_head" in linears or "lm_head.weight" in tensors):
        data["tie_word_embeddings"] = False  # the head is stored on its own (quantized, or untied in memory)
    data["quantization_config"] = quantization_config(groups, ignore, formats)
    result.config = data["quantization_config"]
    with staging(path, overwrite, replaceable=_not_an_export, what="compressed-tensors folder") as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata=dict(EXPORT_MARK))
        (tmp / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gen.to_json_file(str(tmp / "generation_config.json"))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return result


__all__ = ["export_compressed_tensors", "check_output", "check_recipe", "encode_weight", "weight_args", "activation_args",
           "compression_format", "quantization_config", "pack", "unpack", "matches", "scheme_from_args",
           "act_scheme_from_args", "decode_weight", "check_config", "CompressedTensorsExport",
           "CompressedTensorsError", "FORMAT_VERSION"]
