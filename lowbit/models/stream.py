"""Quantizing a model larger than memory: a Hugging Face safetensors folder is read one
decoder layer at a time (memory-mapped) and the checkpoint written one layer at a time.

The model is built with empty weights.  For each decoder layer in order, its tensors are
read from the source files, its linears quantized (round to nearest and HQQ alone; GPTQ,
AWQ and SmoothQuant through the calibration loop, which carries the calibration
activations from layer to layer), its tensors written to a shard of the output
(``model-00001-of-000NN.safetensors``, one per layer) and the layer dropped.  The
embedding, then the final norm with ``lm_head``, are read and written last, each in its
own shard.  Peak memory is then about the largest of one decoder layer, the embedding
and ``lm_head``, plus the calibration activations, whatever the number of layers.  The output folder is staged beside its
destination and renamed into place at the end (``checkpoint.staging``): a crash leaves
no half-written checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ..recipe import Recipe
from .calibrate import SUPPORTED, calibrate_and_quantize
from .checkpoint import _unique_state, finish, staging
from .common import FLOAT_DTYPES_BY_NAME, quiet_transformers, sha256
from .quantize import (act_observer, algorithms_for, calibrates, calibration_record, plan, quantize_modules,
                       _tied_embedding)

INDEX = "model.safetensors.index.json"


class _Source:
    """The tensors of a Hugging Face folder's safetensors files.  Their headers are read
    once; a file is mapped only while tensors are copied out of it, so the pages read
    do not stay resident for the rest of the run."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        index = folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
                files = {name: folder / f for name, f in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{index}: not a safetensors index (a JSON object with a 'weight_map' "
                                 f"of tensor name: file): {type(e).__name__}: {e}") from None
        elif (folder / "model.safetensors").is_file():
            files = None
        else:
            raise FileNotFoundError(f"{folder}: no model.safetensors or {INDEX}; streaming reads safetensors "
                                    "weights only (convert .bin weights with transformers first)")
        self.where: dict[str, Path] = {}
        self.info: dict[str, tuple[tuple[int, ...], str]] = {}  # name -> (shape, safetensors dtype)
        for file in sorted(set(files.values())) if files else [folder / "model.safetensors"]:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: missing ({INDEX} names it)")
            try:
                with safe_open(str(file), framework="pt") as h:
                    for name in h.keys():
                        if files is None or files.get(name) == file:
                            sl = h.get_slice(name)
                            self.where[name] = file
                            self.info[name] = (tuple(sl.get_shape()), sl.get_dtype())
            except Exception as e:  # safetensors raises its own error types
                raise ValueError(f"{file}: unreadable or truncated safetensors file ({e})") from None

    def check(self, model: nn.Module, tied: bool) -> None:
        """Every parameter of ``model`` (built empty) is in the files, with its shape."""
        for name, p in model.named_parameters():
            if tied and name == "lm_head.weight":
                continue
            if name not in self.where:
                raise ValueError(f"the model's tensor {name!r} is in none of the safetensors files")
            shape = self.info[name][0]
            if shape != tuple(p.shape):
                raise ValueError(f"{self.where[name]}: tensor {name!r} has shape {shape}, the config says "
                                 f"{tuple(p.shape)}")

    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point tensor of the files."""
        for _, kind in self.info.values():
            dt = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(kind)
            if dt is not None:
                return dt
        return torch.float32

    def load(self, module: nn.Module, prefix: str, dtype: torch.dtype, names: dict[str, str] | None = None) -> None:
        """Give ``module`` (named ``prefix`` in the model) its parameters from the files, in
        ``dtype``; ``names`` maps a parameter to another tensor of the files (tied ones)."""
        from safetensors import safe_open

        wanted = {n: (names or {}).get(n, f"{prefix}.{n}") for n, _ in module.named_parameters()}
        for file in sorted({self.where[full] for full in wanted.values()}):
            with safe_open(str(file), framework="pt") as h:
                for name, full in wanted.items():
                    if self.where[full] != file:
                        continue
                    t = h.get_tensor(full).to(dtype=dtype, copy=True)  # a copy: the mapping goes away
                    owner, _, attr = name.rpartition(".")
                    setattr(module.get_submodule(owner) if owner else module, attr,
                            nn.Parameter(t, requires_grad=False))


def _meta(p: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)


def quantize_streaming(src: str | os.PathLike, out: str | os.PathLike, recipe: Recipe | str, *,
                       calibration: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                       backend: str | None = None, progress: bool = False, overwrite: bool = False) -> Path:
    r"""Quantize the Hugging Face model folder ``src`` (safetensors, one file or sharded)
    with ``recipe`` and write a lowbit checkpoint folder ``out``, one decoder layer at a
    time, so a model larger than memory can be quantized.  ``calibration``: token ids
    [samples, length] for the methods that calibrate.  ``dtype``: of the float parts
    (None: the files').  The checkpoint loads with ``lowbit.load_quantized`` and holds
    the same tensors ``quantize_model`` + ``save_quantized`` would write, in one
    shard per decoder layer.

    Example (the first two layers of the bundled model, as a Hugging Face folder)::

        >>> import tempfile, lowbit
        >>> from lowbit.models.stream import quantize_streaming
        >>> model, tok = lowbit.load_model()
        >>> model.model.layers = model.model.layers[:2]; model.config.num_hidden_layers = 2
        >>> with tempfile.TemporaryDirectory() as d:
        ...     model.save_pretrained(d + "/hf"); _ = tok.save_pretrained(d + "/hf")
        ...     path = quantize_streaming(d + "/hf", d + "/q", "w4a16-g32")
        ...     q, _ = lowbit.load_quantized(path)
        >>> type(q.model.layers[1].mlp.down_proj).__name__, len(q.lowbit_modules)
        ('QuantLinear', 14)
    """
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    src = Path(src)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json; streaming quantizes a Hugging Face model folder")
    recipe = Recipe.get(recipe)
    quantizer, transforms = algorithms_for(recipe, calibration)
    if dtype is not None and dtype not in FLOAT_DTYPES_BY_NAME.values():
        raise TypeError(f"dtype must be one of {list(FLOAT_DTYPES_BY_NAME.values())}, got {dtype}")
    transformers = quiet_transformers()
    config = transformers.AutoConfig.from_pretrained(src)
    if getattr(config, "model_type", None) not in SUPPORTED:
        raise ValueError(f"{src / 'config.json'}: streaming supports model_type in {SUPPORTED}, "
                         f"got {getattr(config, 'model_type', None)!r}")
    source = _Source(src)
    dtype = dtype or source.dtype()
    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # from_config leaves them apart
    tied = _tied_embedding(model)
    source.check(model, tied)
    todo = plan(model, recipe)
    if not todo:
        raise ValueError(f"recipe '{recipe.name}' selects no module of {src}")
    tokenizer = None
    if (src / "tokenizer.json").is_file() or (src / "tokenizer_config.json").is_file():
        tokenizer = transformers.AutoTokenizer.from_pretrained(src)
    body, layers = model.model, model.model.layers
    prefix = "model.layers"
    shards: dict[str, list[str]] = {}
    digests: dict[str, str] = {}
    count = len(layers) + 2
    record = {"method": recipe.method, "params": quantizer.params(),
              "transforms": {t.name: t.params() for t in transforms}}

    with staging(out, overwrite) as tmp:
        def write(k: int, tensors: dict[str, torch.Tensor]) -> None:
            name = f"model-{k + 1:05d}-of-{count:05d}.safetensors"
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            shards[name] = sorted(tensors)
            digests.update({n: sha256(t) for n, t in tensors.items()})

        def enter(i: int) -> None:
            if i == 0:  # the calibration tokens are embedded: the embedding comes back at the end
                body.embed_tokens.weight = _meta(body.embed_tokens.weight)
                if tied:
                    model.lm_head.weight = body.embed_tokens.weight
            source.load(layers[i], f"{prefix}.{i}", dtype)

        def leave(i: int) -> None:
            write(i, {f"{prefix}.{i}.{n}": t for n, t in _unique_state(layers[i]).items()})
            layers[i] = nn.Module()  # the layer is written: free it

        in_layers = {n: s for n, s in todo.items() if n.startswith(f"{prefix}.")}
        if calibrates(recipe, quantizer, transforms, calibration):
            source.load(body.embed_tokens, "model.embed_tokens", dtype)
            run = calibrate_and_quantize(model, in_layers, quantizer, transforms, calibration, backend=backend,
                                         progress=progress, act_observer=act_observer(recipe),
                                         enter=enter, leave=leave)
            record["calibration"] = calibration_record(calibration, run)
        else:
            it = range(len(layers))
            if progress:
                from tqdm.auto import tqdm

                it = tqdm(it, desc=f"quantizing ({recipe.name}, streaming)", unit="layer")
            for i in it:
                enter(i)
                quantize_modules(model, {n: s for n, s in in_layers.items() if n.startswith(f"{prefix}.{i}.")},
                                 quantizer, backend)
                leave(i)
        # the rest, one shard each: the embedding; the final norm and lm_head
        rest = {n: s for n, s in todo.items() if n not in in_layers}
        source.load(body.embed_tokens, "model.embed_tokens", dtype)
        quantize_modules(model, {n: s for n, s in rest.items() if n != "lm_head"}, quantizer, backend)
        write(count - 2, {f"model.embed_tokens.{n}": t for n, t in _unique_state(body.embed_tokens).items()})
        if tied and "lm_head" not in rest:  # saved once, as the embedding
            source.load(body.norm, "model.norm", dtype)
            write(count - 1, {f"model.norm.{n}": t for n, t in _unique_state(body.norm).items()})
        else:
            body.embed_tokens = nn.Module()  # written: free it before lm_head comes in
            source.load(body.norm, "model.norm", dtype)
            source.load(model.lm_head, "lm_head", dtype, {"weight": "model.embed_tokens.weight"} if tied else None)
            quantize_modules(model, {n: s for n, s in rest.items() if n == "lm_head"}, quantizer, backend)
            if tied:
                model.config.tie_word_embeddings = False
            write(count - 1, {n: t for n, t in _unique_state(model).items() if not n.startswith("model.layers.")})
        model.lowbit_recipe = recipe
        model.lowbit_modules = todo
        model.lowbit_quantization = record
        model.lowbit_source = str(src)
        finish(tmp, model, digests, tokenizer, shards)
    return Path(out)


__all__ = ["quantize_streaming"]
