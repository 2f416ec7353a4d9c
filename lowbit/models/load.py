"""Loading causal LMs offline into transformers: a Hugging Face folder, a GGUF file
(converted once, then cached as a float safetensors folder) or a lowbit checkpoint.

The cache lives in ``$LOWBIT_CACHE`` (default ``~/.cache/lowbit``); an entry is keyed
by the GGUF file's name, size and modification time and written atomically (temp
folder, then rename), so an interrupted conversion never leaves a half-written entry.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .._folders import cache_dir
from .common import CHECKPOINT_CONFIG, FLOAT_DTYPES_BY_NAME, cache_entry, quiet_transformers
from ..formats.gguf_file import GGUFError, bundled_model_path, read_gguf

def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """The model a user means: None is the bundled SmolLM2-135M-Instruct GGUF."""
    if path is None:
        return bundled_model_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model {str(path)!r} does not exist (expected a GGUF file, a Hugging Face "
                                "model folder or a lowbit checkpoint folder)")
    if p.is_dir() and not (p / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(p)!r} has no config.json: not a Hugging Face model folder "
                                "or lowbit checkpoint")
    if p.is_file() and p.suffix != ".gguf":
        raise ValueError(f"model file {str(p)!r} is not a .gguf file; pass a GGUF file or a model folder")
    return p


def _gguf_cache_entry(gguf: Path) -> Path:
    st = gguf.stat()
    return cache_dir() / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"


def convert_gguf(gguf: Path, progress: bool = True) -> Path:
    """Dequantize a GGUF file into a float32 Hugging Face folder in the cache (once);
    return the folder.  A damaged or inconsistent file raises ``GGUFError`` (a
    ValueError naming the file) before transformers is imported."""
    entry = _gguf_cache_entry(gguf)
    if (entry / "model.safetensors").is_file():
        return entry
    note = _gguf_note(read_gguf(gguf))
    transformers = quiet_transformers(progress)
    from safetensors.torch import save_model

    try:
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32)
    except Exception as e:  # what read_gguf's checks missed still names the file
        raise GGUFError(f"{gguf}: passed lowbit's GGUF checks but transformers could not load it: "
                        f"{type(e).__name__}: {e}") from e
    with cache_entry(entry) as tmp:
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the float copy is no longer GGUF-quantized
        config["lowbit_source"] = {"gguf": str(gguf.absolute()), "note": note}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_model(model, str(tmp / "model.safetensors"))  # drops the tied lm_head copy
        tok.save_pretrained(tmp)
    _prune_stale(entry, gguf)
    return entry


def _prune_stale(entry: Path, gguf: Path) -> None:
    """Delete the float conversions lowbit wrote earlier that nothing reads again, each the
    whole model in float32: those of the same GGUF path (written when the file had another
    size or modification time, e.g. before a reinstall) and those whose GGUF file is gone
    (the bundled model of a deleted virtual environment).  Folders lowbit did not write (no
    ``lowbit_source`` in their config.json) and conversions of files that exist stay."""
    import shutil

    mine = {str(gguf), str(gguf.absolute())}
    for other in entry.parent.iterdir():
        if other == entry or not other.is_dir() or other.is_symlink():
            continue
        try:
            source = json.loads((other / "config.json").read_text())["lowbit_source"]["gguf"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a conversion lowbit wrote
        if not isinstance(source, str):
            continue
        gone = os.path.isabs(source) and not os.path.exists(source)  # a relative path: unknown, kept
        if source in mine or gone:
            shutil.rmtree(other, ignore_errors=True)


def _gguf_note(reader) -> str:
    """What the float weights of a GGUF file (its ``read_gguf`` reader) really are: their
    storage types."""
    kinds: dict[str, int] = {}
    for t in reader.tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    return "dequantized from GGUF tensors " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))


GGUF_MODES = ("float", "native")


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
               backend: str | None = None, progress: bool = True, *, gguf: str = "float"):
    """Load a causal LM and its tokenizer, offline.

    Args:
        path: None (the bundled SmolLM2-135M-Instruct Q4_1 GGUF), a ``.gguf`` file, a
            Hugging Face model folder (float, or quantized by another tool in a format
            ``lowbit.models.foreign`` reads: compressed-tensors, GPTQ, AWQ), or a folder written by
            ``lowbit.save_quantized``.
        dtype: dtype of the float parts (activations, norms, unquantized weights).
        backend: kernel backend of a quantized checkpoint's modules (None: automatic).
        gguf: how a GGUF file loads: "float" (dequantized once into a float32 folder in
            ``cache_dir()``, then loaded: what quantizing with a recipe starts from) or
            "native" (its quantized tensors, every ggml type, kept as lowbit
            ``QuantLinear`` / ``QuantEmbedding`` modules with the file's own codes and
            scales, float tensors as float modules; see ``lowbit.models.gguf_native``).
            Both give the same weights bit for bit.

    Returns ``(model, tokenizer)``; the model is in eval mode.  GGUF files are converted
    once to a float32 folder in ``cache_dir()`` (the bundled model: about 15 s), later
    loads take about a second.

    Example::

        >>> import lowbit
        >>> model, tok = lowbit.load_model()
        >>> model.config.num_hidden_layers, model.dtype, tok.decode(tok("Hello").input_ids)
        (30, torch.float32, 'Hello')
    """
    if dtype not in FLOAT_DTYPES_BY_NAME.values():
        raise TypeError(f"dtype must be one of {list(FLOAT_DTYPES_BY_NAME.values())}, got {dtype}")
    if gguf not in GGUF_MODES:
        raise ValueError(f"gguf must be one of {GGUF_MODES}, got {gguf!r}")
    p = resolve_model_path(path)
    if p.is_file() and gguf == "native":
        from .gguf_native import load_gguf_native

        model, tok = load_gguf_native(p, dtype, _gguf_cache_entry(p))
        model.lowbit_source = str(p)
        return model, tok
    if p.is_dir() and (p / CHECKPOINT_CONFIG).is_file():
        from .checkpoint import load_quantized

        return load_quantized(p, dtype=dtype, backend=backend)
    if p.is_dir():
        from .foreign import load_foreign, quant_method

        if quant_method(p) is not None:  # quantized by another tool: its codes into lowbit's modules
            return load_foreign(p, dtype, backend)
    folder = convert_gguf(p, progress) if p.is_file() else p
    transformers = quiet_transformers()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(folder)
    except (ValueError, OSError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{folder}: cannot load the tokenizer (tokenizer.json, tokenizer_config.json, ...): "
                         f"{type(e).__name__}: {e}") from e
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except (ValueError, OSError, TypeError, KeyError) as e:
        raise ValueError(f"{folder}: cannot load the model (config.json, weights): {type(e).__name__}: {e}") from e
    model.eval()
    model.requires_grad_(False)
    model.lowbit_source = str(p)
    return model, tok


__all__ = ["load_model", "cache_dir", "convert_gguf", "resolve_model_path"]
