"""Models: finding and loading them (GGUF, Hugging Face folders, lowbit checkpoints),
quantizing them with a recipe, saving them."""

from ..formats.gguf_file import BUNDLED_GGUF, bundled_model_path, read_gguf_linear_weights
from .load import cache_dir, load_model
from .checkpoint import CheckpointError, load_quantized, save_quantized
from .quantize import dequantized_copy, plan, quantize_model
from .split import split_model

__all__ = ["BUNDLED_GGUF", "bundled_model_path", "read_gguf_linear_weights", "load_model", "cache_dir",
           "quantize_model", "plan", "dequantized_copy", "save_quantized", "load_quantized", "CheckpointError",
           "split_model"]
