"""lowbit: low-bit quantized LLM inference.

The names below are imported on first use (``import lowbit`` alone loads neither torch's
kernels nor lowbit's C++ extension, so ``lowbit --help`` starts fast).

Example::

    >>> import torch, lowbit
    >>> qt = lowbit.quantize(torch.randn(64, 128), "int4-asym-g64")
    >>> lowbit.dequantize(qt).shape
    torch.Size([64, 128])
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it (a name equal to its module is the module)
_EXPORTS = {
    "QuantScheme": "scheme", "SCHEME_PRESETS": "scheme",
    "QTensor": "qtensor", "SplitQTensor": "qtensor",
    "quantize": "ops", "dequantize": "ops", "quantized_matmul": "ops", "linear": "ops", "split_quantize": "ops",
    "available_backends": "kernels",
    "Recipe": "recipe", "RECIPE_PRESETS": "recipe",
    "load_model": "models", "quantize_model": "models", "save_quantized": "models", "load_quantized": "models",
    "Runner": "runtime",
    "evaluate": "evaluation",
    "export": "passes",
}
_MODULES = ("ops", "nn", "models", "kernels", "scheme", "recipe", "runtime", "passes", "sparse")

__all__ = sorted(_EXPORTS) + list(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
