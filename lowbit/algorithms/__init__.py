"""Quantization algorithms: how a float weight becomes a QTensor.

Each method is a config (a dataclass of its parameters, ``params()`` recorded in a
checkpoint) and the events it reacts to in the one layer-by-layer calibration loop
(``lowbit.models.calibrate``); none drives the loop.

* ``rtn``: round to nearest with min-max (or MSE-clipped) scales.
* ``hqq``: half-quadratic optimization of each group's scale and zero point; no calibration.
* ``gptq``: column-by-column rounding with error feedback through the inputs' Hessian.
* ``awq``: activation-aware per-input-channel scales folded into the preceding op, then rtn
  with the clipping range of each group searched on the inputs (``clip``, on by default).
* ``smoothquant`` (recipe field, composes with any method): outliers moved from the
  activations into the weights before 8-bit activation quantization.

Example::

    >>> from lowbit.recipe import Recipe
    >>> quantizer, transforms = build(Recipe.get("w4a16-g32:awq"))
    >>> quantizer.name, [t.name for t in transforms]
    ('rtn', ['awq'])
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..qtensor import QTensor
from ..recipe import METHODS, Recipe
from ..scheme import QuantScheme
from .awq import AWQ
from .base import Algorithm, LinearGroup
from .gptq import GPTQ, gptq_quantize
from .smoothquant import SmoothQuant


def _mse_observer(w: torch.Tensor, scheme, x_sq: torch.Tensor | None):
    from .observers import weight_qparams

    return weight_qparams(w, scheme, "mse", x_sq=x_sq)


def _block_len(group: LinearGroup) -> int:
    """The group size shared by the weight schemes of ``group``'s quantized linears, else 1."""
    sizes = {s.group_size if s.granularity == "group" else 1
             for s in (QuantScheme.parse(v) if isinstance(v, str) else v for v in group.schemes.values())}
    return sizes.pop() if len(sizes) == 1 else 1


# RTN's calibrated MSE clipping (``observer="mse"``, AWQ's clip search): the clip ratios
# tried per group, linspace(CLIP_MIN_RATIO, 1, CLIP_GRID).  Finer and wider than
# mse_clip_qparams' defaults: on the bundled model's q_proj at g64 the output error left
# after clipping drops by a further 10%.
CLIP_GRID = 50
CLIP_MIN_RATIO = 0.3


@dataclasses.dataclass
class RTN(Algorithm):
    """Round to nearest; with ``observer="mse"`` the scales are MSE-clipped, and when
    calibrating the error is the layer output's: each group's weight error weighted by
    its block of the inputs' ``E[x x^T]`` (``mse_clip_qparams``'s ``h_blocks``; the
    diagonal alone per channel).

    Example::

        >>> RTN().params()
        {'observer': 'minmax'}
    """

    observer: str = "minmax"
    calibrated: bool = False

    name = "rtn"

    def __post_init__(self):
        self.observes = self.observer == "mse" and self.calibrated
        self._h: dict[int, torch.Tensor] = {}
        self._n: dict[int, int] = {}

    def observe(self, index: int, group: LinearGroup, x: torch.Tensor) -> None:
        # only the diagonal [g, g] blocks of X^T X that the clip search reads: g is the
        # group's weight group size (1, the mean squares alone, unless every quantized
        # linear of the group has the same group size)
        x = x.reshape(-1, x.shape[-1]).float()
        g = _block_len(group)
        if g == 1:
            h = (x * x).sum(0).reshape(-1, 1, 1)
        else:
            xb = x.reshape(x.shape[0], -1, g).transpose(0, 1)  # [K / g, rows, g]
            h = xb.transpose(1, 2) @ xb
        self._h[index] = self._h[index].add_(h) if index in self._h else h
        self._n[index] = self._n.get(index, 0) + x.shape[0]

    def quantize(self, name: str, linear: nn.Linear, scheme, index: int | None) -> QTensor:
        if self.observer == "minmax":
            return super().quantize(name, linear, scheme, index)
        from ..ops import quantize
        from ..ops.quant import as_scheme
        from .observers import mse_clip_qparams

        w = linear.weight.detach().float()
        if index not in self._h:
            return quantize(w, scheme, *_mse_observer(w, scheme, None))
        s, blocks = as_scheme(scheme), self._h[index] / self._n[index]  # diagonal blocks of E[x x^T]
        clip = {"grid": CLIP_GRID, "min_ratio": CLIP_MIN_RATIO}
        if s.granularity == "group" and blocks.shape[-1] == s.group_size:
            return quantize(w, s, *mse_clip_qparams(w, s, h_blocks=blocks, **clip))
        return quantize(w, s, *mse_clip_qparams(w, s, x_sq=blocks.diagonal(dim1=1, dim2=2).reshape(-1), **clip))

    def end_layer(self) -> None:
        self._h.clear()
        self._n.clear()

    def params(self) -> dict:
        return {"observer": self.observer}


@dataclasses.dataclass
class HQQ(Algorithm):
    """Half-quadratic quantization (``lowbit.algorithms.hqq``): calibration-free.

    Example::

        >>> HQQ().params()
        {'iters': 20}
    """

    iters: int = 20

    name = "hqq"

    def __post_init__(self):
        if isinstance(self.iters, bool) or not isinstance(self.iters, int) or self.iters < 1:
            raise ValueError(f"hqq iters must be a positive integer, got {self.iters!r}")

    def quantize(self, name: str, linear: nn.Linear, scheme, index: int | None) -> QTensor:
        from ..ops import quantize
        from .hqq import hqq_qparams

        w = linear.weight.detach().float()
        return quantize(w, scheme, *hqq_qparams(w, scheme, iters=self.iters))

    def params(self) -> dict:
        return {"iters": self.iters}


_QUANTIZERS = {"rtn": RTN, "hqq": HQQ, "gptq": GPTQ, "awq": RTN}


def build(recipe: Recipe, calibrated: bool = True) -> tuple[Algorithm, list[Algorithm]]:
    """The weight quantizer and the transforms (run before it, in order) a recipe asks
    for; ``recipe.method_args`` are checked here, before any work."""
    assert set(_QUANTIZERS) == set(METHODS)
    args = dict(recipe.method_args)
    transforms: list[Algorithm] = []
    if recipe.smoothquant is not None:
        transforms.append(SmoothQuant(alpha=recipe.smoothquant))
    observer = None if recipe.observer == "minmax" else _mse_observer
    try:
        if recipe.method == "awq":
            transforms.append(AWQ(**args))
            quantizer = RTN(observer="mse" if transforms[-1].clip else recipe.observer, calibrated=calibrated)
        elif recipe.method == "rtn":
            quantizer = RTN(observer=recipe.observer, calibrated=calibrated, **args)
        elif recipe.method == "gptq":
            quantizer = GPTQ(observer=observer, **args)
        else:
            quantizer = HQQ(**args)
    except TypeError:
        cls = AWQ if recipe.method == "awq" else _QUANTIZERS[recipe.method]
        known = [f.name for f in dataclasses.fields(cls) if f.name not in ("observer", "calibrated")]
        raise ValueError(f"recipe method_args {sorted(args)} are not all parameters of '{recipe.method}'; "
                         f"expected some of {known}") from None
    except ValueError as e:
        raise ValueError(f"recipe method_args: {e}") from None
    return quantizer, transforms


__all__ = ["Algorithm", "LinearGroup", "RTN", "HQQ", "GPTQ", "AWQ", "SmoothQuant", "build", "gptq_quantize"]
