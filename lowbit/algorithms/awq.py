"""AWQ (Lin et al., 2023): activation-aware per-input-channel weight scales.

For each group of linears that read one input (q/k/v, gate/up, down; o too where its
input channels are v's output channels), AWQ searches scales ``s`` [in_features] such
that quantizing ``W * s`` and dividing the result by ``s`` loses the least of the
layer output ``x @ W.T`` on calibration activations, then folds ``1 / s`` into the op
that produces the input (an RMSNorm weight, or the rows of the previous linear) and
``s`` into the weights, so the float model computes the same function (up to
rounding) before it is quantized.  Candidates: ``s = mean|x|^r / mean|w|^(1 - r)``
("duo scaling", as AutoAWQ) or ``mean|x|^r``, for ``r`` on a grid, plus ``s = 1`` so
the result is never worse than round to nearest on the calibration sample.

The output error of a candidate is ``sum((Wq - W) H (Wq - W)^T)`` with
``H = X^T X`` over a strided sample of the calibration tokens (``max_tokens``), which
equals ``||X Wq^T - X W^T||^2`` on that sample at a fraction of the cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import dequantize, quantize
from ..scheme import QuantScheme
from .base import Algorithm, LinearGroup, add_gram, token_sample


def output_error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> float:
    """``sum((wq - w) @ h * (wq - w))``: the squared output error on inputs with
    ``h = X^T X`` (in h's dtype)."""
    d = (wq - w).to(h.dtype)
    return float(((d @ h) * d).sum())


def _fake_quantize(w: torch.Tensor, scheme: str) -> torch.Tensor:
    return dequantize(quantize(w, scheme))


def _row_group_mean(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """Per input channel: the mean over rows of |w| relative to the largest |w| of its
    quantization block."""
    s = QuantScheme.parse(scheme)
    g = s.group_size if s.granularity == "group" else w.shape[1]
    a = w.abs().reshape(w.shape[0], -1, g)
    a = a / a.amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return a.reshape(w.shape).mean(0)


@dataclass
class AWQ(Algorithm):
    """AWQ as a calibration-loop transform; weights are then rounded to nearest.  With
    ``clip`` (AutoAWQ's clip search) each group's clipping range is searched after the
    scales are folded, minimizing the error weighted by the inputs (the ``"mse"``
    observer), else the recipe's observer sets the ranges.

    Example::

        >>> AWQ().params()
        {'grid': 20, 'duo_scaling': True, 'max_tokens': 8192, 'clip': True}
    """

    grid: int = 20
    duo_scaling: bool = True
    max_tokens: int = 8192
    clip: bool = True

    name = "awq"
    transforms = True

    def __post_init__(self):
        for label, v, low in [("grid", self.grid, 1), ("max_tokens", self.max_tokens, 16)]:
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"awq {label} must be an integer >= {low}, got {v!r}")
        for label, v in [("duo_scaling", self.duo_scaling), ("clip", self.clip)]:
            if not isinstance(v, bool):
                raise ValueError(f"awq {label} must be true or false, got {v!r}")
        self.tokens = None
        self._abs: dict[int, torch.Tensor] = {}
        self._h: dict[int, torch.Tensor] = {}
        self._n: dict[int, int] = {}
        self.chosen: list[dict] = []

    def start(self, tokens: int) -> None:
        self.tokens = tokens

    def observe(self, index: int, group: LinearGroup, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self._abs[index] = self._abs.get(index, 0) + x.abs().sum(0)
        self._n[index] = self._n.get(index, 0) + x.shape[0]
        xs = token_sample(x, self.tokens, self.max_tokens, self._n[index] // x.shape[0])
        self._h[index] = add_gram(self._h.get(index), xs)

    def transform(self, groups: list[LinearGroup]) -> None:
        for gi, g in enumerate(groups):
            if g.prev is None or not g.quantized or gi not in self._h:
                continue
            x_mean = self._abs[gi] / self._n[gi]
            members = [(m, g.schemes[n]) for n, m in zip(g.names, g.linears) if n in g.schemes]
            weights = [m.weight.detach().float() for m, _ in members]
            w_mean = torch.stack([_row_group_mean(w, s) for w, (_, s) in zip(weights, members)]).mean(0)
            h = self._h[gi].float()  # accumulated in float64; float32 ranks the candidates as well

            def loss(s: torch.Tensor) -> float:
                return sum(output_error(w, _fake_quantize(w * s, sc) / s, h) for w, (_, sc) in zip(weights, members))

            best_s, best_r = torch.ones_like(x_mean), None
            best = loss(best_s)
            for i in range(self.grid):
                r = i / self.grid
                s = x_mean.clamp(min=1e-4).pow(r)
                if self.duo_scaling:
                    s = s / w_mean.clamp(min=1e-4).pow(1 - r)
                s = s.clamp(min=1e-4)
                s = g.tie(s / (s.max() * s.min()).sqrt())
                if not torch.isfinite(s).all():
                    continue
                e = loss(s)
                if e < best:
                    best, best_s, best_r = e, s, r
            self.chosen.append({"group": g.names[0], "ratio": best_r})
            if best_r is not None:
                g.fold(best_s)

    def end_layer(self) -> None:
        self._abs.clear()
        self._h.clear()
        self._n.clear()

    def params(self) -> dict:
        return {"grid": self.grid, "duo_scaling": self.duo_scaling, "max_tokens": self.max_tokens, "clip": self.clip}


__all__ = ["AWQ", "output_error"]
