"""Quantized checkpoints: a folder with

* ``model.safetensors``: packed codes, scales and zero points of every quantized
  module (``<module>.weight.codes`` / ``.scale`` / ``.zero_point``) and the float
  tensors of the rest (embeddings, norms, biases);
* ``lowbit.json``: format version, lowbit version, the recipe, every quantized
  module's schemes, the float dtype, and a SHA-256 of every tensor;
* ``config.json`` and the tokenizer files, so transformers tools can read them.

Writing goes to a temporary sibling folder that is renamed into place at the end,
so a crash never leaves a half-written checkpoint.  Loading checks every tensor's
name, dtype, shape and checksum and names the file and tensor it refuses.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from ..nn import QuantEmbedding, QuantLinear
from ..qtensor import QTensor
from ..recipe import Recipe
from ..scheme import QuantScheme
from .common import CHECKPOINT_CONFIG, FLOAT_DTYPES_BY_NAME, quiet_transformers
from .quantize import _float_dtype, _set_module

FORMAT = "lowbit"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded (missing, corrupted or inconsistent)."""


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()).hexdigest()


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without the second name of tied tensors (the tied lm_head)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key in seen or t.device.type == "meta":
            continue
        seen.add(key)
        out[name] = t.detach().contiguous()
    return out


def save_quantized(model: nn.Module, path: str | os.PathLike, tokenizer=None, *, overwrite: bool = False) -> Path:
    r"""Write a quantized model (from ``lowbit.quantize_model``) to the folder ``path``;
    returns its path.  The folder must not exist unless ``overwrite``.

    Example (a preset such as ``"w4a16-g128"`` quantizes all 30 layers; this recipe only
    the first layer's 7 linears, to keep the example fast)::

        >>> import tempfile, lowbit
        >>> model, tok = lowbit.load_model()
        >>> model = lowbit.quantize_model(model, lowbit.Recipe(weight="int4-asym-g64", modules=[r"layers\.0\."]))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = lowbit.save_quantized(model, d + "/smollm2-int4", tok)
        ...     names = sorted(f.name for f in path.iterdir())
        >>> [n for n in names if not n.startswith(("tokenizer", "chat_template"))]  # and the tokenizer's files
        ['config.json', 'lowbit.json', 'model.safetensors']
    """
    from safetensors.torch import save_file

    from .. import __version__

    modules = getattr(model, "lowbit_modules", None)
    if not modules:
        raise ValueError("model has no quantized modules: quantize it with lowbit.quantize_model first")
    out = Path(path)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{str(out)!r} exists; pass overwrite=True (CLI: --force) to replace it")
    tensors = _unique_state(model)
    float_dtype = _float_dtype(model)
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "lowbit_version": __version__,
        "recipe": model.lowbit_recipe.to_dict(),
        "modules": {n: {k: v[k] for k in ("kind", "weight", "activation")} for n, v in modules.items()},
        "dtype": str(float_dtype).removeprefix("torch."),
        "source": getattr(model, "lowbit_source", None),
        "sha256": {n: _digest(t) for n, t in tensors.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        if hasattr(model, "config"):
            model.config.to_json_file(str(tmp / "config.json"))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / CHECKPOINT_CONFIG).write_text(json.dumps(meta, indent=1))
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "x")
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_metadata(path: str | os.PathLike) -> dict:
    """The ``lowbit.json`` of a checkpoint folder, checked for format and version."""
    f = Path(path) / CHECKPOINT_CONFIG
    try:
        meta = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing; {str(path)!r} is not a lowbit checkpoint") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    if meta.get("format") != FORMAT or not isinstance(meta.get("format_version"), int):
        raise CheckpointError(f"{f}: not a lowbit checkpoint description (format={meta.get('format')!r})")
    if meta["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{f}: format_version {meta['format_version']} is newer than this lowbit "
                              f"reads ({FORMAT_VERSION}); upgrade lowbit")
    for key in ("recipe", "modules", "dtype", "sha256"):
        if key not in meta:
            raise CheckpointError(f"{f}: missing key {key!r}")
    return meta


class _Reader:
    """Tensors of one safetensors file, each checked against its recorded checksum."""

    def __init__(self, file: Path, digests: dict[str, str]):
        from safetensors import safe_open

        self.file, self.digests, self.used = file, digests, set()
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        try:
            self.handle = safe_open(str(file), framework="pt")
            self.keys = set(self.handle.keys())
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{file}: unreadable or truncated safetensors file ({e})") from None
        if self.keys != set(digests):
            missing, extra = sorted(set(digests) - self.keys), sorted(self.keys - set(digests))
            raise CheckpointError(f"{file}: tensors do not match lowbit.json (missing {missing[:5]}, "
                                  f"unexpected {extra[:5]})")

    def get(self, name: str, dtypes, shape=None) -> torch.Tensor:
        if name not in self.keys:
            raise CheckpointError(f"{self.file}: tensor {name!r} is missing")
        try:
            t = self.handle.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self.file}: tensor {name!r} could not be read ({e})") from None
        if dtypes is not None and t.dtype not in dtypes:
            raise CheckpointError(f"{self.file}: tensor {name!r} has dtype {t.dtype}, expected one of {dtypes}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.file}: tensor {name!r} has shape {tuple(t.shape)}, "
                                  f"expected {tuple(shape)}")
        if _digest(t) != self.digests[name]:
            raise CheckpointError(f"{self.file}: tensor {name!r} is corrupted (SHA-256 mismatch)")
        self.used.add(name)
        return t


def _quant_module(reader: _Reader, name: str, spec: dict, shell: nn.Module, dtype, backend):
    scheme = QuantScheme.parse(spec["weight"])
    if spec["kind"] == "linear":
        if not isinstance(shell, nn.Linear):
            raise CheckpointError(f"lowbit.json: module {name!r} is a {type(shell).__name__}, not a Linear")
        shape = (shell.out_features, shell.in_features)
    else:
        if not isinstance(shell, nn.Embedding):
            raise CheckpointError(f"lowbit.json: module {name!r} is a {type(shell).__name__}, not an Embedding")
        shape = (shell.num_embeddings, shell.embedding_dim)
    parts = {}
    for part in ("codes", "scale", "zero_point"):
        key = f"{name}.weight.{part}"
        parts[part] = reader.get(key, None) if key in reader.keys else None
    try:
        qt = QTensor(parts["codes"], parts["scale"], parts["zero_point"], scheme, torch.Size(shape))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{reader.file}: quantized weight of {name!r} does not match '{scheme}' "
                              f"and shape {shape}: {e}") from None
    if spec["kind"] == "embedding":
        return QuantEmbedding(qt, dtype, shell.padding_idx)
    bias = None
    if shell.bias is not None:
        bias = reader.get(f"{name}.bias", (torch.float32, torch.bfloat16, torch.float16),
                          (shell.out_features,)).to(dtype)
    return QuantLinear(qt, bias, spec["activation"], backend)


def load_quantized(path: str | os.PathLike, dtype: torch.dtype | None = None, backend: str | None = None):
    r"""Load a folder written by ``save_quantized``; returns ``(model, tokenizer)``
    (tokenizer None when the folder has none).  ``dtype`` None: the dtype it was saved in.

    Example::

        >>> import tempfile, lowbit
        >>> model, tok = lowbit.load_model()
        >>> model = lowbit.quantize_model(model, lowbit.Recipe(weight="int8-sym", modules=[r"layers\.0\."]))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = lowbit.save_quantized(model, d + "/smollm2-int8", tok)
        ...     loaded, tok2 = lowbit.load_quantized(d + "/smollm2-int8")
        >>> loaded.lowbit_modules == model.lowbit_modules, type(loaded.model.layers[0].mlp.up_proj).__name__
        (True, 'QuantLinear')
    """
    from accelerate import init_empty_weights

    folder = Path(path)
    meta = read_metadata(folder)
    saved_dtype = FLOAT_DTYPES_BY_NAME.get(meta["dtype"])
    if saved_dtype is None:
        raise CheckpointError(f"{folder / CHECKPOINT_CONFIG}: unknown dtype {meta['dtype']!r}")
    dtype = dtype or saved_dtype
    transformers = quiet_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except Exception as e:
        raise CheckpointError(f"{folder / 'config.json'}: cannot be read as a model config ({e})") from None
    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    reader = _Reader(folder / WEIGHTS, meta["sha256"])
    for name, spec in meta["modules"].items():
        try:
            shell = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"lowbit.json: the model has no module {name!r}") from None
        _set_module(model, name, _quant_module(reader, name, spec, shell, dtype, backend))
    floats = (torch.float32, torch.bfloat16, torch.float16)
    tied = getattr(config, "tie_word_embeddings", False) and isinstance(model.lm_head, nn.Linear)
    for name, p in list(model.named_parameters()):
        if p.device.type != "meta" or (tied and name == "lm_head.weight"):
            continue
        mod_name, _, attr = name.rpartition(".")
        t = reader.get(name, floats, p.shape).to(dtype)
        setattr(model.get_submodule(mod_name), attr, nn.Parameter(t, requires_grad=False))
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise CheckpointError(f"{reader.file}: no tensors for {left[:5]}")
    unused = sorted(reader.keys - reader.used)
    if unused:
        raise CheckpointError(f"{reader.file}: tensors the model does not use: {unused[:5]}")
    model.eval()
    model.lowbit_recipe = Recipe.from_dict(meta["recipe"])
    model.lowbit_modules = {n: {**s, "asked": s["weight"]} for n, s in meta["modules"].items()}
    model.lowbit_source = meta.get("source")
    tok = None
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        tok = transformers.AutoTokenizer.from_pretrained(folder)
    return model, tok


__all__ = ["save_quantized", "load_quantized", "read_metadata", "CheckpointError"]
