"""Quantized checkpoints written by other tools, loaded into lowbit's own modules.

A Hugging Face folder whose ``config.json`` has a ``quantization_config`` with
``quant_method`` "compressed-tensors" (llm-compressor, ``lowbit export --format
compressed-tensors``), "gptq" (AutoGPTQ, GPTQModel) or "awq" (AutoAWQ, GEMM) loads with every quantized linear as a ``QuantLinear`` holding the
file's own codes, scales and zero points (no float copy, no second rounding), so
lowbit's kernels run it, ``lowbit.save_quantized`` keeps it and ``lowbit export`` turns
it into GGUF.  The formats' layouts live in ``lowbit.formats``; this module only builds
the model around them.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from ..formats import compressed_tensors as ct
from ..formats import gptq
from ..nn import QuantLinear
from ..recipe import Recipe
from .common import TensorFiles, quiet_transformers
from .quantize import _set_module

FOREIGN_METHODS = ("compressed-tensors", "gptq", "awq")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class ForeignCheckpointError(ValueError):
    """A quantized folder lowbit cannot load exactly, with the file and the reason."""


def quant_method(folder: str | Path) -> str | None:
    """The ``quant_method`` of a model folder's ``config.json`` (None: not quantized).

    Example::

        >>> import tempfile, pathlib, json
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = (pathlib.Path(d) / "config.json").write_text(
        ...         json.dumps({"quantization_config": {"quant_method": "gptq"}}))
        ...     quant_method(d)
        'gptq'
    """
    f = Path(folder) / "config.json"
    try:
        config = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ForeignCheckpointError(f"{f}: cannot be read as JSON ({e})") from None
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if q is None:
        return None
    if not isinstance(q, dict) or not isinstance(q.get("quant_method"), str):
        raise ForeignCheckpointError(f"{f}: quantization_config must be an object with a quant_method string")
    return q["quant_method"]


def _tensors(folder: Path) -> TensorFiles:
    """The safetensors files of a folder (``model.safetensors`` or the shards a
    ``model.safetensors.index.json`` lists), read by name with dtype and shape checks."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ForeignCheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    else:
        files = ["model.safetensors"]
    paths = {}
    for name in files:
        file = (folder / name).resolve()
        if file.parent != folder.resolve():
            raise ForeignCheckpointError(f"{index}: shard {name!r} is outside the folder")
        paths[file] = None
    return TensorFiles(paths, folder / files[0] if len(files) == 1 else index, ForeignCheckpointError)


def _ct_modules(model: nn.Module, q: dict, tensors: TensorFiles, where: str) -> dict:
    """{module name: (QTensor, activation scheme, static act scale, act zero point, input
    order: None)} of a compressed-tensors folder."""
    ct.check_config(q, where)
    for key, empty in (("kv_cache_scheme", None), ("sparsity_config", {}), ("transform_config", {})):
        if q.get(key) not in (None, {}, empty):
            raise ForeignCheckpointError(f"{where}: quantization_config.{key} is set; lowbit reads weight and "
                                         "activation quantization only")
    if q.get("quantization_status", "compressed") != "compressed":
        raise ForeignCheckpointError(f"{where}: quantization_status is {q.get('quantization_status')!r}; only "
                                     "compressed checkpoints hold codes (save with save_compressed=True)")
    groups = q["config_groups"]
    ignore = q.get("ignore") or []
    out = {}
    for name, mod in model.named_modules():
        classes = [c.__name__ for c in type(mod).__mro__]
        hits = [g for g in groups.values() if any(ct.matches(name, classes, t) for t in g["targets"])]
        if not hits or any(ct.matches(name, classes, t) for t in ignore):
            continue
        if not isinstance(mod, nn.Linear):
            raise ForeignCheckpointError(f"{where}: module {name!r} ({type(mod).__name__}) is quantized; lowbit "
                                         "reads quantized linears only")
        if len(hits) > 1 and any(h != hits[0] for h in hits[1:]):
            raise ForeignCheckpointError(f"{where}: module {name!r} matches {len(hits)} different config groups")
        g = hits[0]
        if g.get("output_activations") is not None:
            raise ForeignCheckpointError(f"{where}: module {name!r} quantizes its outputs; lowbit does not")
        fmt = g.get("format") or q.get("format")
        if fmt == "dense":
            continue
        here = f"{where}: module {name!r}"
        qt = ct.decode_weight(tensors.get, name, g.get("weights"), fmt, (mod.out_features, mod.in_features), where)
        act = ct.act_scheme_from_args(g.get("input_activations"), here)
        scale = zp = None
        if act is not None and act.endswith("-tensor"):
            scale = tensors.get(f"{name}.input_scale", FLOATS).float().reshape(-1)
            if scale.numel() != 1:
                raise ForeignCheckpointError(f"{tensors.file}: tensor {name}.input_scale must hold one value")
            if "asym" in act:
                zp = tensors.get(f"{name}.input_zero_point", (torch.int8,)).reshape(-1)
                zp = (zp.to(torch.int16) + 128).to(torch.uint8)
        out[name] = (qt, act, scale, zp, None)
    if not out:
        raise ForeignCheckpointError(f"{where}: no module of the model matches the config groups' targets")
    return out


def _packed_modules(model: nn.Module, q: dict, tensors: TensorFiles, where: str, method: str) -> dict:
    """The GPTQ / AWQ linears of a folder: every linear with a ``qweight`` in the file."""
    try:
        gptq.check_config(method, q, where)
    except gptq.GPTQFormatError as e:
        raise ForeignCheckpointError(str(e)) from None
    out = {}
    for name, mod in model.named_modules():
        if f"{name}.qweight" not in tensors:
            continue
        if not isinstance(mod, nn.Linear):
            raise ForeignCheckpointError(f"{tensors.file}: {name}.qweight belongs to a {type(mod).__name__}, "
                                         "not a linear")
        shape = (mod.out_features, mod.in_features)
        if method == "gptq":
            key = f"{name}.g_idx"
            g_idx = tensors.get(key, (torch.int32, torch.int64)) if key in tensors else None
            qt, order = gptq.decode_gptq(tensors.get, name, q, shape, str(tensors.where[f"{name}.qweight"]), g_idx)
        else:
            qt, order = gptq.decode_awq(tensors.get, name, q, shape, str(tensors.where[f"{name}.qweight"])), None
        out[name] = (qt, None, None, None, order)
    if not out:
        raise ForeignCheckpointError(f"{tensors.file}: no linear has a qweight tensor; not a {method} checkpoint")
    return out


def load_foreign(folder: str | Path, dtype: torch.dtype = torch.float32, backend: str | None = None):
    r"""Load a quantized folder another tool wrote (see ``FOREIGN_METHODS``) with its
    quantized linears as lowbit ``QuantLinear`` modules; returns ``(model, tokenizer)``.

    Example (a compressed-tensors folder written by ``lowbit export``)::

        >>> import tempfile, torch, lowbit
        >>> from lowbit.formats.compressed_tensors import export_compressed_tensors
        >>> model, tok = lowbit.load_model()
        >>> q = lowbit.quantize_model(model, lowbit.Recipe(weight="int4-sym-g32-f16", modules=[r"layers\.0\."]))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = export_compressed_tensors(q, tok, d + "/ct")
        ...     back, _ = load_foreign(d + "/ct")
        >>> a, b = q.model.layers[0].mlp.up_proj.qweight, back.model.layers[0].mlp.up_proj.qweight
        >>> torch.equal(a.codes, b.codes), torch.equal(a.scale, b.scale), len(back.lowbit_modules)
        (True, True, 7)
    """
    from accelerate import init_empty_weights

    folder = Path(folder)
    method = quant_method(folder)
    where = str(folder / "config.json")
    if method not in FOREIGN_METHODS:
        raise ForeignCheckpointError(f"{where}: quant_method {method!r} is not read (lowbit reads "
                                     f"{', '.join(FOREIGN_METHODS)})")
    raw = json.loads((folder / "config.json").read_text())
    q = raw["quantization_config"]
    tensors = _tensors(folder)
    layers = {int(m.group(1)) for k in tensors.where if (m := re.search(r"\.layers\.(\d+)\.", k))}
    n = raw.get("num_hidden_layers")
    if layers and n != max(layers) + 1:  # checked before building n layers (a huge n would never finish)
        raise ForeignCheckpointError(f"{where}: num_hidden_layers is {n!r} but {tensors.file} holds layers "
                                     f"0..{max(layers)}")
    transformers = quiet_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # lowbit builds the quantized modules itself
        with init_empty_weights(include_buffers=False):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as e:  # transformers raises anything from a bad config
        raise ForeignCheckpointError(f"{where}: cannot be read as a model config ({type(e).__name__}: {e})") from None
    if method == "compressed-tensors":
        modules = _ct_modules(model, q, tensors, where)
    else:
        modules = _packed_modules(model, q, tensors, where, method)
    for name, (qt, act, scale, zp, order) in modules.items():
        shell = model.get_submodule(name)
        bias = None
        if shell.bias is not None:
            bias = tensors.get(f"{name}.bias", FLOATS, (shell.out_features,)).to(dtype)
        try:
            mod = QuantLinear(qt, bias, act, backend, input_order=order)
            if scale is not None:
                mod.set_act_qparams(scale, zp)
        except (TypeError, ValueError) as e:
            raise ForeignCheckpointError(f"{where}: module {name!r}: {e}") from None
        _set_module(model, name, mod)
    tensors.fill(model, dtype)
    model.eval()
    model.requires_grad_(False)
    kinds = Counter((str(qt.scheme), act) for qt, act, *_ in modules.values())
    (weight, act), _ = kinds.most_common(1)[0]
    model.lowbit_recipe = Recipe(weight=weight, activation=act, name=f"{method} import")
    model.lowbit_modules = {n: {"kind": "linear", "weight": str(qt.scheme), "activation": act,
                                "asked": str(qt.scheme)} for n, (qt, act, *_) in modules.items()}
    model.lowbit_quantization = {"method": "import", "format": method, "config": q}
    model.lowbit_source = str(folder)
    tok = None
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        try:
            tok = transformers.AutoTokenizer.from_pretrained(folder)
        except Exception as e:  # tokenizers and transformers raise their own types
            raise ForeignCheckpointError(f"{folder}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    return model, tok


__all__ = ["load_foreign", "quant_method", "FOREIGN_METHODS", "ForeignCheckpointError"]
