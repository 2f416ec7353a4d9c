"""Fast CPU kernels: a C++ extension (``lowbit._C``, built at install time with
torch's cpp_extension, OpenMP + AVX-512 through the compiler).  Configurations the
extension does not cover go to the reference implementation."""

from __future__ import annotations

import torch

from .. import reference

try:  # built by setup.py; absent when installed without a compiler
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
quantize_packed = reference.quantize_packed
pack = reference.pack
unpack = reference.unpack
dequantize_packed = reference.dequantize_packed
dequantize_accumulator_grouped = reference.dequantize_accumulator_grouped
dequantize_accumulator_rowcol = reference.dequantize_accumulator_rowcol
