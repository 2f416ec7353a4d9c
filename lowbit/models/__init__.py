"""Finding and reading models: the bundled SmolLM2-135M GGUF and user files."""

from .gguf_file import BUNDLED_GGUF, bundled_model_path, read_gguf_linear_weights

__all__ = ["BUNDLED_GGUF", "bundled_model_path", "read_gguf_linear_weights"]
