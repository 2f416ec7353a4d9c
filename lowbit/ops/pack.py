"""Bit packing of sub-byte codes; the layout is defined in ``lowbit.scheme``."""

from __future__ import annotations

import math

import torch

from .. import _validate
from . import library

INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
INT4_LAYOUTS = {"u32x8": "u32", "u8x2": "u8"}


def _check_bits(bits) -> None:
    if isinstance(bits, bool) or bits not in (2, 3, 4):
        raise ValueError(f"bits must be 2, 3 or 4 for packing, got {bits!r}")


def _check_packing(packing) -> int:
    if packing not in ("u32", "u8"):
        raise ValueError(f"packing must be 'u32' or 'u8', got {packing!r}")
    return 32 if packing == "u32" else 8


def pack_bits(q: torch.Tensor, bits: int, packing: str = "u32", *, backend: str | None = None) -> torch.Tensor:
    """Pack integer codes along the last dim: ``bits`` bits each, little-endian bit
    stream in int32 words ("u32") or uint8 bytes ("u8").  Signed codes
    ``[-2^(b-1), 2^(b-1))`` and unsigned codes ``[0, 2^b)`` are both accepted (the low
    ``bits`` are stored).

    Example::

        >>> import torch
        >>> from lowbit.ops import pack_bits, unpack_bits
        >>> q = torch.tensor([[0, 1, 2, 3, 3, 2, 1, 0]], dtype=torch.uint8)
        >>> pack_bits(q, 2, "u8")
        tensor([[228,  27]], dtype=torch.uint8)
        >>> torch.equal(unpack_bits(pack_bits(q, 2, "u8"), 2, "u8", signed=False), q)
        True
    """
    _check_bits(bits)
    word = _check_packing(packing)
    _validate.tensor("q", q, dtypes=INT_DTYPES, min_ndim=1)
    unit = math.lcm(bits, word) // bits
    if q.shape[-1] % unit:
        raise ValueError(
            f"q.shape[-1]={q.shape[-1]} must be a multiple of {unit} to pack {bits}-bit codes "
            f"into {packing} words"
        )
    return library.call(library.pack, backend, q.device, q, bits, packing)


def unpack_bits(packed: torch.Tensor, bits: int, packing: str = "u32", *, signed: bool,
                backend: str | None = None) -> torch.Tensor:
    """Inverse of ``pack_bits``: int8 codes (sign-extended) if ``signed``, else uint8.

    Example::

        >>> import torch
        >>> from lowbit.ops import unpack_bits
        >>> unpack_bits(torch.tensor([[0x7654321F]], dtype=torch.int32), 4, signed=True)
        tensor([[-1,  1,  2,  3,  4,  5,  6,  7]], dtype=torch.int8)
    """
    _check_bits(bits)
    word = _check_packing(packing)
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be a bool, got {signed!r}")
    _validate.tensor("packed", packed, dtypes=[torch.int32 if word == 32 else torch.uint8], min_ndim=1)
    words = math.lcm(bits, word) // word
    if packed.shape[-1] % words:
        raise ValueError(
            f"packed.shape[-1]={packed.shape[-1]} must be a multiple of {words}: {bits}-bit codes "
            f"fill whole groups of {words} {packing} words"
        )
    return library.call(library.unpack, backend, packed.device, packed, bits, packing, signed)


def _int4_packing(layout) -> str:
    if layout not in INT4_LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(INT4_LAYOUTS)}, got {layout!r}")
    return INT4_LAYOUTS[layout]


def pack_int4(q: torch.Tensor, layout: str = "u32x8", *, backend: str | None = None) -> torch.Tensor:
    """Pack 4-bit codes: "u32x8" puts 8 consecutive values of the last dim in one int32
    (element j in bits 4j..4j+3), "u8x2" puts 2 in one uint8 (even element low nibble).

    Example::

        >>> import torch
        >>> from lowbit.ops import pack_int4
        >>> hex(pack_int4(torch.arange(8, dtype=torch.int8)[None]).item())
        '0x76543210'
        >>> pack_int4(torch.tensor([[1, 2]], dtype=torch.uint8), "u8x2")
        tensor([[33]], dtype=torch.uint8)
    """
    return pack_bits(q, 4, _int4_packing(layout), backend=backend)


def unpack_int4(packed: torch.Tensor, layout: str = "u32x8", *, signed: bool,
                backend: str | None = None) -> torch.Tensor:
    """Inverse of ``pack_int4``; ``signed`` sign-extends each nibble to int8 [-8, 7],
    otherwise codes are uint8 [0, 15].

    Example::

        >>> import torch
        >>> from lowbit.ops import unpack_int4
        >>> unpack_int4(torch.tensor([[0xF1]], dtype=torch.uint8), "u8x2", signed=True)
        tensor([[ 1, -1]], dtype=torch.int8)
    """
    return unpack_bits(packed, 4, _int4_packing(layout), signed=signed, backend=backend)
