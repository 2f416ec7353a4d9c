"""SmoothQuant (Xiao et al., 2022): move activation outliers into the weights before
8-bit activation quantization.

Per input channel ``j`` of a group of linears that read one input:
``s_j = max|x_j|^alpha / max|W_j|^(1 - alpha)`` (``max|W_j|`` over every row of the
group); ``1 / s`` is folded into the op that produces the input (an RMSNorm weight or
the previous linear's rows) and ``s`` into the weights' columns, so the float model's
function is unchanged before quantization.  ``alpha="auto"`` tries a grid per group
(refined around its best point; and no smoothing at all) and keeps the one whose
W8A8 output (int8 per-token activations, int8 per-channel weights, fake-quantized:
SmoothQuant's own target, whatever the recipe's schemes) is closest to the float
output on a sample of the calibration tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import dequantize, fake_quantize, quantize
from .base import Algorithm, LinearGroup, token_sample

# alpha="auto": a grid over (0, 1), then the two alphas half a step either side of the best.
AUTO_ALPHAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
AUTO_REFINE = 0.05


@dataclass
class SmoothQuant(Algorithm):
    """SmoothQuant as a calibration-loop transform.

    Example::

        >>> SmoothQuant(alpha=0.5).params()
        {'alpha': 0.5}
    """

    alpha: float | str = 0.5
    max_tokens: int = 2048

    name = "smoothquant"
    transforms = True

    def __post_init__(self):
        a = self.alpha
        if a != "auto" and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1):
            raise ValueError(f"smoothquant alpha must be in [0, 1] or 'auto', got {a!r}")
        self.tokens = None
        self._max: dict[int, torch.Tensor] = {}
        self._sample: dict[int, list[torch.Tensor]] = {}
        self._n: dict[int, int] = {}
        self.chosen: list[dict] = []

    def start(self, tokens: int) -> None:
        self.tokens = tokens

    def observe(self, index: int, group: LinearGroup, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        m = x.abs().amax(0)
        self._max[index] = torch.maximum(self._max[index], m) if index in self._max else m
        self._n[index] = self._n.get(index, 0) + 1
        if self.alpha == "auto":
            self._sample.setdefault(index, []).append(token_sample(x, self.tokens, self.max_tokens,
                                                                   self._n[index]))

    @staticmethod
    def scales(x_max: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
        """``max|x_j|^alpha / max|W_j|^(1 - alpha)`` per input channel of the weights ``w``."""
        s = x_max.clamp(min=1e-5).pow(alpha) / w.abs().amax(0).clamp(min=1e-5).pow(1 - alpha)
        return s.clamp(min=1e-5)

    def transform(self, groups: list[LinearGroup]) -> None:
        for gi, g in enumerate(groups):
            if g.prev is None or not g.quantized or gi not in self._max:
                continue
            x_max, w = self._max[gi], g.weight()
            if self.alpha != "auto":
                g.fold(g.tie(self.scales(x_max, w, float(self.alpha))))
                continue
            x = torch.cat(self._sample[gi])
            ref = x @ w.T
            err = lambda a: self._w8a8_error(x, w, ref, g.tie(self.scales(x_max, w, a)))  # noqa: E731
            tried = {a: err(a) for a in AUTO_ALPHAS}
            a0 = min(tried, key=tried.get)
            for a in (round(a0 - AUTO_REFINE, 3), round(a0 + AUTO_REFINE, 3)):
                if 0 <= a <= 1 and a not in tried:
                    tried[a] = err(a)
            best_alpha = min(tried, key=tried.get)
            if tried[best_alpha] >= self._w8a8_error(x, w, ref, torch.ones(w.shape[1])):
                best_alpha = None  # smoothing does not help this group
            self.chosen.append({"group": g.names[0], "alpha": best_alpha})
            if best_alpha is not None:
                g.fold(g.tie(self.scales(x_max, w, best_alpha)))

    @staticmethod
    def _w8a8_error(x, w, ref, s) -> float:
        xq = fake_quantize(x / s, "int8-sym-token")
        wq = dequantize(quantize(w * s, "int8-sym"))
        return float(((xq @ wq.T - ref) ** 2).sum())

    def end_layer(self) -> None:
        self._max.clear()
        self._sample.clear()
        self._n.clear()

    def params(self) -> dict:
        return {"alpha": self.alpha}


__all__ = ["SmoothQuant", "AUTO_ALPHAS", "AUTO_REFINE"]
