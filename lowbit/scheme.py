"""QuantScheme: the one source of truth for how a tensor is quantized.

Conventions (every operator and kernel in lowbit follows these; none restates them)
-----------------------------------------------------------------------------------
Codes and values::

    int zero point   : q = clamp(round_half_to_even(x / scale) + zero_point, qmin, qmax)
                       x ~= (q - zero_point) * scale
    float zero point : q = clamp(round_half_to_even(x / scale + zero_point), qmin, qmax)
                       x ~= (q - zero_point) * scale          (zero_point is a float)
    min zero point   : q = clamp(round_half_to_even((x - zero_point) / scale), qmin, qmax)
                       x ~= q * scale + zero_point            (zero_point is the block's min)

* Symmetric schemes use signed codes ``[-2^(b-1), 2^(b-1) - 1]`` and no zero point.
  ``scale = max|x| / ((qmax - qmin) / 2)`` (4 bit: ``max|x| / 7.5``), so the whole
  grid is used and every value inside the range is within ``scale / 2`` of a code.
* Asymmetric schemes use unsigned codes ``[0, 2^b - 1]``.  With an "int" zero point
  the range is ``[min(x_min, 0), max(x_max, 0)]`` (zero is then exactly
  representable) and ``zero_point = qmin - round(range_min / scale)`` is an integer
  in the code range, stored as uint8.  With a "float" zero point (the scale-and-min form of GGUF
  Q4_1/Q4_K and HQQ) the range is ``[x_min, x_max]`` and
  ``zero_point = qmin - x_min / scale`` is stored in ``scale_dtype``.  With a "min" zero
  point (GGUF's Q4_1/Q5_1 and the K-quants' ``d * q + m``, computed in that order: a
  product, then a sum) the zero point is ``x_min`` rounded *down* to ``scale_dtype`` and
  the range ``[zero_point, x_max]``; GGUF blocks load into it without rounding.
* Arithmetic is float32 (float64 for float64 inputs).  The scale is computed in that
  type and rounded *up* to ``scale_dtype``, so storing it in bfloat16 never clips the
  range; quantization then divides by the stored scale, so quantize and dequantize
  agree on the grid.  An all-zero block gets scale 1 (finite, non-zero).
* Dequantization computes ``(q - zero_point) * scale`` (``q * scale + zero_point`` in the
  "min" domain) in float32 (float64 for float64 output) and rounds once to the output
  dtype; every backend gives the same bits.

Shapes::

    granularity  blocks that share one scale       scale / zero_point shape
    "tensor"     the whole tensor                   [1]
    "channel"    x[n, ...] (weights: out_features)  [N]
    "token"      x[..., :] (one row of activations) x.shape[:-1]
    "group"      group_size consecutive elements    x.shape[:-1] + (K // group_size,)
                 of the last dim (weights [N, K]:
                 groups along in_features)

Packing: 8-bit codes are stored one per byte (int8 signed, uint8 unsigned).  Sub-byte
codes are packed along the last dim as a little-endian bit stream into int32 words
("u32") or bytes ("u8"): value j of a word occupies bits ``b*j .. b*j + b - 1``.
For 4 bits that is the "u32x8" layout (8 values per int32, element j in bits
4j..4j+3) and the "u8x2" layout (2 per byte, even element in the low nibble).
3-bit codes straddle words: 32 values fill 3 int32 words (8 values fill 3 bytes).

String form: ``int{bits}-{sym|asym}[-g{G}|-channel|-token|-tensor][-zpfloat|-zpmin]
[-{f32|f16|bf16}][-{u32|u8}]``; defaults (group for a ``-gG``, otherwise channel,
int zero point, float32 scales, u32 packing) are left out of ``str(scheme)``.

Example::

    >>> from lowbit import QuantScheme
    >>> s = QuantScheme.parse("int4-asym-g64")
    >>> s.bits, s.symmetric, s.granularity, s.group_size, s.qmin, s.qmax
    (4, False, 'group', 64, 0, 15)
    >>> str(s)
    'int4-asym-g64'
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

BITS = (2, 3, 4, 8)
GRANULARITIES = ("tensor", "channel", "token", "group")
ZERO_POINT_DOMAINS = ("int", "float", "min")
PACKINGS = ("u32", "u8")
SCALE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in SCALE_DTYPES.items()}


@dataclass(frozen=True)
class QuantScheme:
    """How one tensor is quantized; see the module docstring for the conventions.

    Args:
        bits: code width, one of 2, 3, 4, 8.
        symmetric: signed codes and no zero point (True) or unsigned codes with a
            zero point (False).
        granularity: "tensor", "channel", "token" or "group".
        group_size: elements per group along the last dim (granularity "group" only).
        scale_dtype: float32, float16 or bfloat16.
        zero_point_domain: "int" (integer zero point in the code range), "float"
            (float offset) or "min" (the block's minimum, added after the scale); the
            last two asymmetric only.
        packing: container of sub-byte codes, "u32" (int32 words) or "u8" (bytes);
            ignored for 8 bits.

    Example::

        >>> QuantScheme(bits=4, symmetric=True, granularity="group", group_size=128)
        QuantScheme('int4-sym-g128')
    """

    bits: int = 8
    symmetric: bool = True
    granularity: str = "channel"
    group_size: int | None = None
    scale_dtype: torch.dtype = torch.float32
    zero_point_domain: str = "int"
    packing: str = "u32"

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in BITS:
            raise ValueError(f"QuantScheme.bits must be one of {BITS}, got {self.bits!r}")
        if not isinstance(self.symmetric, bool):
            raise TypeError(f"QuantScheme.symmetric must be a bool, got {self.symmetric!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"QuantScheme.granularity must be one of {GRANULARITIES}, got {self.granularity!r}"
            )
        if self.granularity == "group":
            g = self.group_size
            if isinstance(g, bool) or not isinstance(g, int) or g <= 0:
                raise ValueError(
                    f"QuantScheme.group_size must be a positive int for granularity 'group', got {g!r}"
                )
            if g % self.pack_unit:
                raise ValueError(
                    f"QuantScheme.group_size={g} must be a multiple of {self.pack_unit} so that "
                    f"groups of {self.bits}-bit codes fill whole {self.packing} words"
                )
        elif self.group_size is not None:
            raise ValueError(
                f"QuantScheme.group_size must be None for granularity {self.granularity!r}, "
                f"got {self.group_size!r}"
            )
        if self.scale_dtype not in _DTYPE_NAMES:
            raise TypeError(
                f"QuantScheme.scale_dtype must be torch.float32, torch.float16 or torch.bfloat16, "
                f"got {self.scale_dtype!r}"
            )
        if self.zero_point_domain not in ZERO_POINT_DOMAINS:
            raise ValueError(
                f"QuantScheme.zero_point_domain must be one of {ZERO_POINT_DOMAINS}, "
                f"got {self.zero_point_domain!r}"
            )
        if self.symmetric and self.zero_point_domain != "int":
            raise ValueError(
                f"QuantScheme.zero_point_domain={self.zero_point_domain!r} needs symmetric=False: "
                "symmetric schemes have no zero point"
            )
        if self.packing not in PACKINGS:
            raise ValueError(f"QuantScheme.packing must be one of {PACKINGS}, got {self.packing!r}")
        if not self.is_packed and self.packing != "u32":
            # 8-bit codes are stored one per byte whatever the packing says: one canonical
            # form, so that equal schemes compare equal and str() round-trips.
            object.__setattr__(self, "packing", "u32")

    # -- derived facts, used by every operator -------------------------------------
    @property
    def qmin(self) -> int:
        return code_range(self.bits, self.symmetric)[0]

    @property
    def qmax(self) -> int:
        return code_range(self.bits, self.symmetric)[1]

    @property
    def is_packed(self) -> bool:
        return self.bits < 8

    @property
    def word_bits(self) -> int:
        """Bits of one storage word of the codes: 8 for 8-bit codes, else the packing's."""
        return word_bits(self.packing) if self.is_packed else 8

    @property
    def code_dtype(self) -> torch.dtype:
        """dtype of the stored codes: int8/uint8 for 8 bits, the packing word below."""
        if not self.is_packed:
            return torch.int8 if self.symmetric else torch.uint8
        return word_dtype(self.packing)

    @property
    def pack_unit(self) -> int:
        """Values per whole number of packing words (the last dim must be a multiple)."""
        return pack_unit(self.bits, self.packing) if self.is_packed else 1

    def packed_shape(self, shape) -> list[int]:
        """Shape of the stored codes of a tensor of logical ``shape`` (last dim packed).

        Example::

            >>> QuantScheme.parse("int4-asym-g64").packed_shape([32, 256])
            [32, 32]
        """
        shape = list(shape)
        return shape[:-1] + [packed_length(shape[-1], self.bits, self.packing) if self.is_packed else shape[-1]]

    def scale_shape(self, shape) -> list[int]:
        """Shape of the scale (and zero point) of a tensor of logical ``shape``.

        Example::

            >>> QuantScheme.parse("int4-asym-g64").scale_shape([32, 256])
            [32, 4]
        """
        shape = list(shape)
        if self.granularity == "tensor":
            return [1]
        if self.granularity == "channel":
            return shape[:1]
        if self.granularity == "token":
            return shape[:-1]
        return shape[:-1] + [shape[-1] // self.group_size]

    def scale_map(self, shape) -> tuple[int, int]:
        """``(rows_per_scale, group)`` of a tensor of logical ``shape`` viewed as [rows, K]:
        element (r, k) uses ``scale.flat[(r // rows_per_scale) * (K // group) + k // group]``
        (the form the fast dequantize kernels take).

        Example::

            >>> QuantScheme.parse("int8-sym").scale_map([2, 3, 64])
            (3, 64)
        """
        shape = list(shape)
        k = shape[-1] if shape else 1
        rows = math.prod(shape) // k if k else 0
        if self.granularity == "tensor":
            return max(rows, 1), k
        if self.granularity == "channel":
            return (max(rows // shape[0], 1) if shape[0] else 1), k
        return 1, self.group_size if self.granularity == "group" else k

    def block_len(self, shape) -> int:
        """Elements that share one scale in a tensor of logical ``shape``.

        Example::

            >>> QuantScheme.parse("int8-sym-tensor").block_len([4, 8]), QuantScheme.parse("w4-g32").block_len([4, 64])
            (32, 32)
        """
        shape = list(shape)
        if self.granularity == "tensor":
            return math.prod(shape)
        if self.granularity == "channel":
            return math.prod(shape[1:])
        if self.granularity == "token":
            return shape[-1] if shape else 1
        return self.group_size

    @property
    def zero_point_dtype(self) -> torch.dtype | None:
        if self.symmetric:
            return None
        # An int zero point lies in the code range [0, 2^bits): one byte holds it.
        return torch.uint8 if self.zero_point_domain == "int" else self.scale_dtype

    # -- string form ----------------------------------------------------------------
    def __str__(self) -> str:
        parts = [f"int{self.bits}", "sym" if self.symmetric else "asym"]
        if self.granularity == "group":
            parts.append(f"g{self.group_size}")
        elif self.granularity != "channel":
            parts.append(self.granularity)
        if self.zero_point_domain != "int":
            parts.append("zp" + self.zero_point_domain)
        if self.scale_dtype != torch.float32:
            parts.append(_DTYPE_NAMES[self.scale_dtype])
        if self.is_packed and self.packing != "u32":
            parts.append(self.packing)
        return "-".join(parts)

    def __repr__(self) -> str:
        return f"QuantScheme({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> "QuantScheme":
        """Parse the string form, or a preset name (see ``SCHEME_PRESETS``).

        Example::

            >>> QuantScheme.parse("int8-sym-token") == QuantScheme(8, True, "token")
            True
            >>> QuantScheme.parse("w4-g128")
            QuantScheme('int4-sym-g128')
        """
        if not isinstance(text, str):
            raise TypeError(f"QuantScheme.parse(text) needs a str, got {type(text).__name__}")
        if text in SCHEME_PRESETS:
            return SCHEME_PRESETS[text]
        parts = text.strip().lower().split("-")
        m = re.fullmatch(r"int(\d+)", parts[0])
        if not m or len(parts) < 2 or parts[1] not in ("sym", "asym"):
            raise ValueError(
                f"cannot parse scheme {text!r}: expected 'int<bits>-<sym|asym>[-g<N>|-channel|"
                f"-token|-tensor][-zpfloat|-zpmin][-f32|-f16|-bf16][-u32|-u8]' or a preset {sorted(SCHEME_PRESETS)}"
            )
        kw: dict = {"bits": int(m.group(1)), "symmetric": parts[1] == "sym"}
        seen: dict[str, str] = {}  # what each part set: one part per kind, no silent "last one wins"
        for p in parts[2:]:
            if re.fullmatch(r"g\d+", p):
                kind, value = "granularity", {"granularity": "group", "group_size": int(p[1:])}
            elif p in GRANULARITIES:
                kind, value = "granularity", {"granularity": p}
            elif p in ("zpfloat", "zpmin"):
                kind, value = "zero point domain", {"zero_point_domain": p[2:]}
            elif p in SCALE_DTYPES:
                kind, value = "scale dtype", {"scale_dtype": SCALE_DTYPES[p]}
            elif p in PACKINGS:
                kind, value = "packing", {"packing": p}
                if kw["bits"] >= 8:
                    raise ValueError(f"cannot parse scheme {text!r}: {kw['bits']}-bit codes are stored one "
                                     f"per byte, not packed; drop '-{p}'")
            else:
                raise ValueError(f"cannot parse scheme {text!r}: unknown part {p!r}")
            if kind in seen:
                raise ValueError(f"cannot parse scheme {text!r}: '{seen[kind]}' and '{p}' both set the {kind}")
            seen[kind] = p
            kw.update(value)
        return cls(**kw)


# -- which weights run with 8-bit activations --------------------------------------------------
W4A8_MAX_GROUP = (2**31 - 1) // (255 * 15)  # W4A8 sums |x_q - x_zp| (q - z) <= 255 * 15 per term in int32


def act_scheme_problem(s: QuantScheme) -> str | None:
    """Why ``s`` cannot quantize the activations of ``lowbit.linear`` (None when it can):
    they are 8-bit and either per token (dynamic), per tensor (static: a calibrated scale)
    or symmetric blocks of a group size along K with float32 scales, chosen on the fly
    (``"int8-sym-g32"``: llama.cpp's Q8_0 activations, the one form its Q4_0/Q8_0
    matmuls run).  The one statement of this rule: ``linear`` and recipes ask it.

    Example::

        >>> act_scheme_problem(QuantScheme.parse("int8-sym-g32")) is None
        True
        >>> act_scheme_problem(QuantScheme.parse("int8-asym-g32"))
        'activations in blocks are symmetric with float32 scales (e.g. int8-sym-g32), got int8-asym-g32'
    """
    if s.bits != 8 or s.granularity not in ("token", "tensor", "group"):
        return f"activations are 8-bit per token, per tensor or in blocks (e.g. int8-sym-g32), got {s}"
    if s.granularity == "group" and (not s.symmetric or s.scale_dtype != torch.float32):
        return f"activations in blocks are symmetric with float32 scales (e.g. int8-sym-g32), got {s}"
    return None


def check_act_weight(weight: "QuantScheme | str", act, in_features: int | None = None) -> None:
    """Raise ValueError unless ``lowbit.linear`` runs a weight of scheme ``weight`` (and
    ``in_features``, when given) with activations of scheme ``act``.  None (weight-only)
    runs with every weight; 8-bit activations per token or tensor need, for W8A8, an int8
    symmetric per-channel weight, and for W4A8 a 4-bit weight with integer zero points,
    groups of at most ``W4A8_MAX_GROUP`` and in_features a positive multiple of 8 (whole
    u32 words); 8-bit activations in blocks (``"int8-sym-g32"``) need a 4- or 8-bit weight
    whose groups are whole blocks ("min" domain included).  The one statement of these
    rules: ``linear``, recipes and the runtime call it.

    Example::

        >>> from lowbit.scheme import check_act_weight
        >>> check_act_weight("int4-asym-g128", "int8-asym-token")   # W4A8: fine
        >>> check_act_weight("int2-asym-g64", "int8-sym-token")
        Traceback (most recent call last):
        ...
        ValueError: 8-bit activations need an 8-bit or a 4-bit weight, got 'int2-asym-g64'
    """
    if act is None:
        return
    w = weight if isinstance(weight, QuantScheme) else QuantScheme.parse(weight)
    a = act if isinstance(act, QuantScheme) else QuantScheme.parse(act)
    if a.granularity == "group":
        _check_block_act_weight(w, a, in_features)
        return
    if w.bits == 8:
        if not w.symmetric or w.granularity != "channel":
            raise ValueError(f"W8A8 needs an int8 symmetric per-channel weight ('int8-sym'), got '{w}'")
    elif w.bits == 4:
        if w.zero_point_domain != "int":
            raise ValueError(f"W4A8 needs integer weight zero points, got the float domain of '{w}'")
        group = w.group_size if w.granularity == "group" else in_features
        if group is not None and group > W4A8_MAX_GROUP:
            raise ValueError(f"W4A8 sums each weight group in int32, exact up to {W4A8_MAX_GROUP} values; "
                             f"'{w}' has groups of {group}")
        if in_features is not None and (in_features <= 0 or in_features % 8):
            raise ValueError(f"W4A8 needs in_features a positive multiple of 8 (whole u32 words of 4-bit "
                             f"codes), got {in_features} for '{w}'")
    else:
        raise ValueError(f"8-bit activations need an 8-bit or a 4-bit weight, got '{w}'")


def _check_block_act_weight(w: QuantScheme, a: QuantScheme, in_features: int | None) -> None:
    """Activations in blocks run with any 4- or 8-bit weight whose groups are whole blocks
    (the float scales multiply integer dot products of one block), "min" domain included
    (q * s + m: llama.cpp's Q4_1 x Q8_1)."""
    if w.bits not in (4, 8):
        raise ValueError(f"activations in blocks ('{a}') need an 8-bit or a 4-bit weight, got '{w}'")
    group = w.group_size if w.granularity == "group" else in_features
    if group is not None and group % a.group_size:
        raise ValueError(f"weight groups of {group} ('{w}') are not whole activation blocks of {a.group_size} "
                         f"('{a}')")
    if in_features is not None and (in_features <= 0 or in_features % a.group_size or
                                    (w.bits == 4 and in_features % 8)):
        raise ValueError(f"activations in blocks of {a.group_size} need in_features a positive multiple of "
                         f"{a.group_size}{' and of 8' if w.bits == 4 else ''}, got {in_features}")



# -- the rules behind the properties, for callers that hold bits and a packing only --------
def code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """(qmin, qmax): signed ``[-2^(b-1), 2^(b-1) - 1]`` or unsigned ``[0, 2^b - 1]``.

    Example::

        >>> code_range(4, True), code_range(4, False)
        ((-8, 7), (0, 15))
    """
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if symmetric else (0, (1 << bits) - 1)


def word_bits(packing: str) -> int:
    """Bits of one packing word: 32 for "u32", 8 for "u8".

    Example::

        >>> word_bits("u32"), word_dtype("u8")
        (32, torch.uint8)
    """
    return 32 if packing == "u32" else 8


def word_dtype(packing: str) -> torch.dtype:
    """dtype of one packing word: int32 for "u32", uint8 for "u8"."""
    return torch.int32 if packing == "u32" else torch.uint8


def pack_unit(bits: int, packing: str) -> int:
    """Number of values that exactly fill a whole number of words (8 for int4 in u32).

    Example::

        >>> pack_unit(4, "u32"), pack_unit(3, "u32"), packed_length(64, 3, "u32")
        (8, 32, 6)
    """
    return math.lcm(bits, word_bits(packing)) // bits


def packed_length(k: int, bits: int, packing: str) -> int:
    """Words that hold ``k`` packed ``bits``-bit codes (k a multiple of ``pack_unit``)."""
    return k * bits // word_bits(packing)


SCHEME_PRESETS: dict[str, QuantScheme] = {
    # weights
    "w8": QuantScheme(8, True, "channel"),
    "w4-g32": QuantScheme(4, True, "group", 32),
    "w4-g64": QuantScheme(4, True, "group", 64),
    "w4-g128": QuantScheme(4, True, "group", 128),
    "w4a-g64": QuantScheme(4, False, "group", 64),
    "w4a-g128": QuantScheme(4, False, "group", 128),
    "q4_1": QuantScheme(4, False, "group", 32, torch.float16, "min"),  # GGUF Q4_1: d * q + m
    "w2-g64": QuantScheme(2, False, "group", 64),
    "w3-g64": QuantScheme(3, False, "group", 64),
    # activations
    "a8-token": QuantScheme(8, False, "token"),
    "a8-token-sym": QuantScheme(8, True, "token"),
}
