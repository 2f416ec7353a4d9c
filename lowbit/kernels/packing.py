"""Bit packing with word-wide integer torch ops (any device): each value shifted into
place and a word's worth OR-ed (summed) together; on little-endian hosts the values are
OR-ed into bytes and a u32 word is four of them viewed as one.  Word-aligned widths (2, 4 bits)
only; 3-bit codes straddle words and use the reference's bit stream.  Bit-identical
to ``reference.pack`` / ``reference.unpack`` (tested)."""

from __future__ import annotations

import sys

import torch

from ..scheme import word_bits, word_dtype
from . import reference


def pack(q: torch.Tensor, bits: int, packing: str) -> torch.Tensor:
    word = word_bits(packing)
    if word % bits:
        return reference.pack(q, bits, packing)
    if sys.byteorder == "little" and q.numel():  # bytes first (uint8 ops, 4x less memory traffic), then words are their view
        per = 8 // bits
        v = (q.to(torch.uint8) & ((1 << bits) - 1)).reshape(*q.shape[:-1], q.shape[-1] // per, per)  # q untouched
        b = v[..., 0].clone(memory_format=torch.contiguous_format)
        for j in range(1, per):
            b |= v[..., j] << (bits * j)
        return b if word == 8 else b.view(word_dtype(packing))
    per = word // bits
    v = (q.to(torch.int32) & ((1 << bits) - 1)).reshape(*q.shape[:-1], q.shape[-1] // per, per)
    shifts = torch.arange(0, word, bits, dtype=torch.int32, device=q.device)
    words = (v << shifts).sum(-1, dtype=torch.int64 if word == 32 else torch.int32)
    return words.to(word_dtype(packing))


def unpack(packed: torch.Tensor, bits: int, packing: str, signed: bool) -> torch.Tensor:
    word = word_bits(packing)
    if word % bits:
        return reference.unpack(packed, bits, packing, signed)
    per = word // bits
    shifts = torch.arange(0, word, bits, dtype=torch.int32, device=packed.device)
    v = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    if signed:
        v = v - ((v >> (bits - 1)) << bits)
    return v.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.int8 if signed else torch.uint8)
