"""Swapping a model's ``nn.Linear`` (and optionally ``nn.Embedding``) modules for
quantized ones according to a ``Recipe`` (round to nearest)."""

from __future__ import annotations

import copy
import hashlib
import re

import torch
from torch import nn

from ..algorithms import build
from ..nn import QuantEmbedding, QuantLinear, SplitQuantLinear
from ..ops import dequantize
from ..recipe import Recipe, fit_group
from ..scheme import check_act_weight
from ..sparse import SparseQuantLinear, densify
from .calibrate import calibrate_and_quantize, set_module as _set_module


def _shallow_copy(model: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters and buffers are the original tensors
    (quantizing the copy replaces its modules, never the original's)."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def plan(model: nn.Module, recipe: Recipe) -> dict[str, dict]:
    """Which modules ``quantize_model`` would replace, with their final schemes.

    Example::

        >>> import torch
        >>> from lowbit.models import plan
        >>> m = torch.nn.Sequential()
        >>> m.add_module("layers", torch.nn.ModuleList([torch.nn.Sequential()]))
        >>> m.layers[0].add_module("mlp", torch.nn.Module())
        >>> m.layers[0].mlp.down_proj = torch.nn.Linear(576, 8)
        >>> plan(m, "w4a16-g128")
        {'layers.0.mlp.down_proj': {'kind': 'linear', 'weight': 'int4-asym-g64-f16', 'activation': None, 'asked': 'int4-asym-g128-f16'}}
    """
    recipe = Recipe.get(recipe)
    out: dict[str, dict] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            chosen = recipe.scheme_for(name)
            if chosen is not None:
                w, a = chosen
                fitted = fit_group(w, mod.in_features)
                try:  # what depends on the module (in_features): refused before any weight is quantized
                    check_act_weight(fitted, a, mod.in_features)
                except ValueError as e:
                    raise ValueError(f"cannot quantize module '{name}': {e}") from None
                out[name] = dict(kind="linear", weight=fitted, activation=a, asked=w)
        elif isinstance(mod, nn.Embedding) and recipe.embedding and re.search(r"(^|\.)embed_tokens$", name):
            out[name] = dict(kind="embedding", weight=fit_group(recipe.embedding, mod.embedding_dim),
                             activation=None, asked=recipe.embedding)
    return out


def quantize_model(model: nn.Module, recipe: Recipe | str, *, backend: str | None = None,
                   inplace: bool = True, progress: bool = False, calibration: torch.Tensor | None = None,
                   ) -> nn.Module:
    """Replace the linears (and embedding) a recipe selects by ``QuantLinear`` /
    ``QuantEmbedding``, with weights rounded by the recipe's method (round to nearest,
    HQQ, GPTQ, AWQ; SmoothQuant first when asked).

    Group sizes that do not divide a module's in_features (SmolLM2's 576 with g128)
    fall back to the largest power of two >= 32 that does; ``model.lowbit_modules`` records
    every module's final schemes and ``model.lowbit_recipe`` the recipe.

    Args:
        recipe: a ``Recipe``, a preset name (``lowbit.recipe.RECIPE_PRESETS``) or a JSON/YAML file.
        backend: kernel backend of the new modules (None: the fastest for their device).
        inplace: False quantizes a copy that shares the untouched tensors with ``model``.
        calibration: token ids [samples, length] for the methods that calibrate (GPTQ,
            AWQ, SmoothQuant, static activation scales, MSE clipping weighted by the
            inputs), e.g. ``lowbit.evaluation.calibration_set(tokenizer)``; they run
            decoder layer by decoder layer (``lowbit.models.calibrate``).
            ``model.lowbit_quantization`` records the method, its parameters and the run.

    Example::

        >>> import torch, lowbit
        >>> m = torch.nn.Module()
        >>> m.layers = torch.nn.ModuleList([torch.nn.Module()])
        >>> m.layers[0].self_attn = torch.nn.Module()
        >>> m.layers[0].self_attn.q_proj = torch.nn.Linear(64, 64)
        >>> q = lowbit.quantize_model(m, "w4a16-g64", inplace=False)
        >>> type(q.layers[0].self_attn.q_proj).__name__, type(m.layers[0].self_attn.q_proj).__name__
        ('QuantLinear', 'Linear')
    """
    recipe = Recipe.get(recipe)
    quantizer, transforms = algorithms_for(recipe, calibration)
    if not inplace:
        model = _shallow_copy(model)
    todo = plan(model, recipe)
    if not todo:
        raise ValueError(f"recipe '{recipe.name}' selects no module of this {type(model).__name__} "
                         f"(modules={list(recipe.modules)})")
    tied = _tied_embedding(model)
    record = {"method": recipe.method, "params": quantizer.params(),
              "transforms": {t.name: t.params() for t in transforms}}
    if calibrates(recipe, quantizer, transforms, calibration):
        linears = {n: s for n, s in todo.items() if s["kind"] == "linear"}
        run = calibrate_and_quantize(model, linears, quantizer, transforms, calibration, backend=backend,
                                     progress=progress, act_observer=act_observer(recipe))
        record["calibration"] = calibration_record(calibration, run)
        todo_rest = {n: s for n, s in todo.items() if s["kind"] != "linear"}
    else:
        todo_rest = todo
    quantize_modules(model, todo_rest, quantizer, backend, progress=progress, desc=f"quantizing ({recipe.name})")
    if tied and hasattr(model, "config") and any(n == "lm_head" or v["kind"] == "embedding" for n, v in todo.items()):
        # The tied pair now has separate storage (one or both quantized on their own).
        model.config.tie_word_embeddings = False
    model.lowbit_recipe = recipe
    model.lowbit_modules = {**getattr(model, "lowbit_modules", {}), **todo}
    model.lowbit_quantization = record
    return model


def algorithms_for(recipe: Recipe, calibration):
    """The recipe's weight quantizer and transforms; refuses a recipe that calibrates
    without ``calibration`` before any work."""
    quantizer, transforms = build(recipe, calibrated=calibration is not None)
    if recipe.needs_calibration and calibration is None:
        raise ValueError(f"recipe '{recipe.name}' (method {recipe.method}"
                         f"{', smoothquant' if recipe.smoothquant is not None else ''}) needs calibration data: "
                         "pass calibration=lowbit.evaluation.calibration_set(tokenizer)")
    return quantizer, transforms


def calibrates(recipe: Recipe, quantizer, transforms, calibration) -> bool:
    """Whether the decoder linears go through the calibration loop."""
    return calibration is not None and bool(transforms or quantizer.observes or recipe.needs_calibration)


def calibration_record(calibration: torch.Tensor, run: dict) -> dict:
    """What ``lowbit.json`` records of a calibration run."""
    return {"samples": int(calibration.shape[0]), "length": int(calibration.shape[1]),
            "sha256": hashlib.sha256(calibration.cpu().numpy().tobytes()).hexdigest()[:16],
            "seconds": round(run["seconds"], 1), "peak_rss_mb": round(run["peak_rss_mb"])}


def quantize_modules(model: nn.Module, todo: dict[str, dict], quantizer, backend, *, progress=False,
                     desc="quantizing") -> None:
    """Replace each module of ``todo`` (``plan``'s output) by its quantized module,
    rounded by ``quantizer`` without statistics."""
    items = list(todo.items())
    if progress and items:
        from tqdm.auto import tqdm

        items = tqdm(items, desc=desc, unit="module", leave=False)
    for name, spec in items:
        mod = model.get_submodule(name)
        try:
            if spec["kind"] == "linear":  # a NaN or Inf weight is refused by the quantizer
                new = QuantLinear(quantizer.quantize(name, mod, spec["weight"], None), mod.bias,
                                  spec["activation"], backend)
            else:
                new = QuantEmbedding.from_embedding(mod, spec["weight"])
        except ValueError as e:  # name the module: "the weight holds NaN" alone says not which
            raise ValueError(f"cannot quantize module '{name}': {e}") from e
        _set_module(model, name, new)


def act_observer(recipe: Recipe):
    """A factory of the recipe's activation observer (static per-tensor activation scales)."""
    if not recipe.static_activations:
        return None
    from ..algorithms.observers import activation_observer

    return lambda: activation_observer(recipe.act_observer)


def _tied_embedding(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    return (isinstance(head, nn.Linear) and isinstance(emb, nn.Embedding) and head.weight is emb.weight)


def dequantized_copy(model: nn.Module) -> nn.Module:
    """The host-side baseline: a float model whose linears hold the dequantized weights
    (``nn.Linear`` again), for checking a quantized model against it.

    Example::

        >>> import torch, lowbit
        >>> m = torch.nn.Module(); m.layers = torch.nn.ModuleList([torch.nn.Module()])
        >>> m.layers[0].mlp = torch.nn.Module(); m.layers[0].mlp.up_proj = torch.nn.Linear(64, 8)
        >>> q = lowbit.quantize_model(m, "w8a16", inplace=False)
        >>> type(lowbit.models.dequantized_copy(q).layers[0].mlp.up_proj).__name__
        'Linear'
    """
    out = _shallow_copy(model)
    for name, mod in list(out.named_modules()):
        if isinstance(mod, (QuantLinear, SplitQuantLinear, SparseQuantLinear)):
            w = densify(mod.sqt) if isinstance(mod, SparseQuantLinear) else mod.dequantized_weight(torch.float32)
            dtype = mod.bias.dtype if mod.bias is not None else _float_dtype(model)
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, dtype=dtype)
            lin.weight = nn.Parameter(w.to(dtype), requires_grad=False)
            if mod.bias is not None:
                lin.bias = mod.bias
            _set_module(out, name, lin)
        elif isinstance(mod, QuantEmbedding):
            emb = nn.Embedding(mod.num_embeddings, mod.embedding_dim, mod.padding_idx, dtype=mod.dtype)
            emb.weight = nn.Parameter(dequantize(mod.weight.qtensor(), mod.dtype), requires_grad=False)
            _set_module(out, name, emb)
    for attr in ("lowbit_recipe", "lowbit_modules", "lowbit_quantization"):
        if hasattr(out, attr):
            delattr(out, attr)
    return out


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


__all__ = ["quantize_model", "plan", "dequantized_copy"]
