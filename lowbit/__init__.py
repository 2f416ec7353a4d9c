"""lowbit: low-bit quantized LLM inference.

Example::

    >>> import torch, lowbit
    >>> qt = lowbit.quantize(torch.randn(64, 128), "int4-asym-g64")
    >>> lowbit.dequantize(qt).shape
    torch.Size([64, 128])
"""

from . import models, nn, ops
from .kernels import available_backends
from .models import load_model, load_quantized, quantize_model, save_quantized
from .ops import dequantize, linear, quantize, quantized_matmul
from .qtensor import QTensor
from .recipe import Recipe
from .runtime import Runner
from .evaluate import evaluate  # noqa: E402  (the function; the module stays importable)
from .scheme import PRESETS, QuantScheme

__version__ = "0.1.0"
__all__ = ["QuantScheme", "PRESETS", "QTensor", "quantize", "dequantize", "quantized_matmul", "linear", "ops",
           "available_backends", "nn", "models", "Recipe", "load_model", "quantize_model", "save_quantized", "load_quantized", "Runner", "evaluate"]
