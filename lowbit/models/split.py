"""Mixed int8/int4 linears for a whole model: each selected ``nn.Linear`` becomes a
``SplitQuantLinear`` whose outlier input channels stay at 8 bits."""

from __future__ import annotations

import re

import torch
from torch import nn

from ..nn import SplitQuantLinear
from ..ops.split import check_split
from ..recipe import DECODER_LINEARS, Recipe, fit_group
from .calibrate import set_module


@torch.no_grad()
def input_mean_squares(model: nn.Module, names: list[str], calibration: torch.Tensor,
                       batch: int = 4) -> dict[str, torch.Tensor]:
    """``E[x_k^2]`` of the inputs of the linears ``names``, float32 [in_features] each, over
    the tokens of ``calibration`` (token ids [samples, length]) run through the model as it
    is (one pass, every layer fed by the float layers before it).

    Example::

        >>> import torch, lowbit
        >>> from lowbit.models.split import input_mean_squares
        >>> model, tok = lowbit.load_model()
        >>> ids = torch.randint(0, 1000, (1, 8))
        >>> input_mean_squares(model, ["model.layers.0.mlp.down_proj"], ids)["model.layers.0.mlp.down_proj"].shape
        torch.Size([1536])
    """
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.dtype != torch.int64:
        raise ValueError(f"calibration must be int64 token ids [samples, length], got "
                         f"{getattr(calibration, 'dtype', type(calibration).__name__)} "
                         f"{tuple(getattr(calibration, 'shape', ()))}")
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name):
        def record(_mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.square().sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return record

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        for i in range(0, calibration.shape[0], batch):
            model(calibration[i:i + batch].to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: sums[n] / counts[n] for n in names}


def split_model(model: nn.Module, scheme: str, outliers: int, *, calibration: torch.Tensor | None = None,
                by: str = "error", high: str = "int8-sym", modules: str = DECODER_LINEARS,
                backend: str | None = None) -> nn.Module:
    """Replace each ``nn.Linear`` whose name matches ``modules`` (default: the 7 decoder
    linears of every layer) by a ``SplitQuantLinear``: ``outliers`` input channels at
    ``high``, the rest at ``scheme`` (its group fitted to in_features like a recipe's),
    in place; returns the model.

    The channels are chosen by ``lowbit.ops.choose_outliers(..., by=by)`` with each
    linear's input mean squares from ``calibration`` (token ids) when given, from the
    weights alone otherwise.  ``model.lowbit_modules`` and ``lowbit_quantization`` record
    what was done, so ``lowbit.save_quantized`` writes it and ``load_quantized`` reads it
    back; GGUF and compressed-tensors have no layout for it (they refuse it).

    Example::

        >>> import lowbit
        >>> from lowbit.models.split import split_model
        >>> model, tok = lowbit.load_model()
        >>> m = split_model(model, "int4-asym-g64", 16, modules=r"layers\\.0\\.mlp\\.down_proj$")
        >>> type(m.model.layers[0].mlp.down_proj).__name__
        'SplitQuantLinear'
    """
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and re.search(modules, n)]
    if not names:
        raise ValueError(f"modules={modules!r} selects no nn.Linear of this {type(model).__name__}")
    for name in names:  # every module's schemes and count, before the calibration pass
        check_split(fit_group(scheme, model.get_submodule(name).in_features), high,
                    model.get_submodule(name).in_features, outliers)
    x_sq = input_mean_squares(model, names, calibration) if calibration is not None else {}
    specs = {}
    for name in names:
        lin = model.get_submodule(name)
        fitted = fit_group(scheme, lin.in_features)
        set_module(model, name, SplitQuantLinear.from_linear(lin, fitted, outliers, high=high, x_sq=x_sq.get(name),
                                                             by=by, backend=backend))
        specs[name] = {"kind": "split", "weight": fitted, "activation": None, "high": high, "asked": scheme}
    # what save_quantized records (a model quantize_model touched first keeps its recipe)
    if getattr(model, "lowbit_recipe", None) is None:
        model.lowbit_recipe = Recipe(weight=scheme, modules=(modules,), name="split")
    model.lowbit_modules = {**getattr(model, "lowbit_modules", {}), **specs}
    split = {"outliers": outliers, "high": high, "by": by, "calibrated": calibration is not None}
    model.lowbit_quantization = {**(getattr(model, "lowbit_quantization", None)
                                    or {"method": "rtn", "params": {}, "transforms": {}}), "split": split}
    return model


__all__ = ["split_model", "input_mean_squares"]
