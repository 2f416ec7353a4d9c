"""Observers: the ranges that calibration turns into static scales and zero points.

Two kinds:

* Activation observers watch a layer's inputs batch by batch and give the range of a
  per-tensor scheme (static activation scales, e.g. W8A8 with ``'int8-sym-tensor'``):
  ``MinMax``, ``MovingAverageMinMax`` and ``Percentile``, made by name with
  ``activation_observer("minmax" | "ema" | "percentile")``.
* Weight observers choose the scale of each block of a weight from the weight itself,
  through ``weight_qparams``: ``"minmax"`` (``lowbit.ops.choose_qparams``: the full range of
  each block, round to nearest) or ``"mse"`` (``mse_clip_qparams``: each block's range shrunk
  to the ratio with the smallest quantization error).

Neither restates lowbit's rules for a scale and a zero point (``lowbit.scheme``): an
activation observer hands its range to ``choose_qparams``; the clip search computes the
qparams of a shrunk range with ``kernels.reference.block_qparams``, the function that
``choose_qparams`` runs on each block, and scores a candidate with the reference quantize
and dequantize, i.e. with the stored (dtype-rounded) scale and zero point.

Example::

    >>> import torch
    >>> from lowbit.algorithms.observers import activation_observer
    >>> obs = activation_observer("minmax")
    >>> obs.update(torch.tensor([[-1.0, 0.5], [2.0, 0.0]]))
    >>> obs.update(torch.tensor([3.0, -0.5]))
    >>> obs.range()
    (-1.0, 3.0)
    >>> scale, zp = obs.qparams("int8-asym-tensor")   # scale 4 / 255, zero point round(255 / 4)
    >>> round(scale.item(), 6), zp.item()
    (0.015686, 64)
"""

from __future__ import annotations

import math

import torch

from .. import _validate
from ..kernels import reference
from ..nn import act_qparams_from_range
from ..ops import choose_qparams
from ..ops.quant import _check_input, as_scheme
from ..recipe import ACT_OBSERVERS, WEIGHT_OBSERVERS  # the names a recipe accepts: one list
from ..scheme import QuantScheme


# -- activation observers -----------------------------------------------------------------------
class Observer:
    """What every activation observer provides.

    ``update(x)`` takes one batch of activations (a float tensor of any shape; an empty one
    changes nothing; NaN or Inf raise ValueError), ``range(symmetric=False)`` the observed
    ``(lo, hi)`` as Python floats, and ``qparams(scheme)`` the scale and zero point (None
    for a symmetric scheme) of a per-tensor ``scheme`` for that range.  ``range`` and
    ``qparams`` raise RuntimeError before the first non-empty batch.
    """

    def __init__(self) -> None:
        self.batches = 0  # non-empty batches seen

    def update(self, x: torch.Tensor) -> None:
        _validate.tensor("x", x, dtypes=_validate.FLOAT_DTYPES)
        if x.numel() == 0:
            return
        x = x.detach()
        lo, hi = (v.item() for v in torch.aminmax(x))  # amin/amax propagate NaN: one sync checks both
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(
                f"activations hold NaN or Inf (batch {self.batches} seen by {self!r}, "
                f"min {lo}, max {hi}); a non-finite value would poison the static scale"
            )
        self._observe(x, lo, hi)
        self.batches += 1

    def range(self, symmetric: bool = False) -> tuple[float, float]:
        """``(lo, hi)`` of the activations seen; ``symmetric=True`` gives ``(-a, a)`` with
        ``a`` the observer's estimate of ``max|x|``."""
        if not self.batches:
            raise RuntimeError(
                f"{self!r} has observed no activations: call update(x) with calibration "
                "batches before range() or qparams()"
            )
        return self._range(symmetric)

    def qparams(self, scheme: QuantScheme | str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale [1] and zero point [1] (None when symmetric) of the per-tensor ``scheme``
        for activations in ``range()``: ``lowbit.nn.act_qparams_from_range``."""
        s = as_scheme(scheme)
        if s.granularity != "tensor":
            raise ValueError(
                f"an activation observer gives one range, the qparams of a per-tensor scheme "
                f"(granularity 'tensor', e.g. 'int8-sym-tensor'); got '{s}' with granularity "
                f"{s.granularity!r}"
            )
        return act_qparams_from_range(s, *self.range(symmetric=s.symmetric))

    def _observe(self, x: torch.Tensor, lo: float, hi: float) -> None:
        raise NotImplementedError

    def _range(self, symmetric: bool) -> tuple[float, float]:
        lo, hi = self._lo, self._hi
        if symmetric:
            a = max(-lo, hi)
            return -a, a
        return lo, hi


class MinMax(Observer):
    """The smallest and largest activation seen over all batches.

    Example::

        >>> import torch
        >>> obs = MinMax()
        >>> obs.update(torch.tensor([-2.0, 1.0])); obs.update(torch.tensor([0.5, 3.0]))
        >>> obs.range(), obs.range(symmetric=True)
        ((-2.0, 3.0), (-3.0, 3.0))
    """

    def _observe(self, x, lo, hi):
        first = not self.batches
        self._lo = lo if first else min(self._lo, lo)
        self._hi = hi if first else max(self._hi, hi)

    def __repr__(self) -> str:
        return "MinMax()"


class MovingAverageMinMax(Observer):
    """Exponential moving average of each batch's min and max: the first batch sets the
    range, every later one moves it ``lo = momentum * lo + (1 - momentum) * batch_min``
    (and ``hi`` alike), so one outlier batch moves the range by ``1 - momentum`` of its
    excess only.  ``momentum`` lies in [0, 1] (0: the last batch alone).

    Example::

        >>> import torch
        >>> obs = MovingAverageMinMax(momentum=0.75)
        >>> obs.update(torch.tensor([-1.0, 1.0])); obs.update(torch.tensor([-3.0, 5.0]))
        >>> obs.range()   # (0.75 * -1 + 0.25 * -3, 0.75 * 1 + 0.25 * 5)
        (-1.5, 2.0)
    """

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum <= 1:
            raise ValueError(f"MovingAverageMinMax(momentum) must be a number in [0, 1], got {momentum!r}")
        self.momentum = float(momentum)

    def _observe(self, x, lo, hi):
        if not self.batches:
            self._lo, self._hi = lo, hi
            return
        m = self.momentum
        self._lo = m * self._lo + (1 - m) * lo
        self._hi = m * self._hi + (1 - m) * hi

    def __repr__(self) -> str:
        return f"MovingAverageMinMax(momentum={self.momentum})"


class Percentile(Observer):
    """The ``q``-th percentile of ``|x|`` (symmetric range ``(-p, p)``) or the
    ``100 - q``-th and ``q``-th percentiles of ``x`` (asymmetric range), so that the rare
    outliers above it are clipped instead of stretching the scale of every other value.

    Streaming: each batch's percentiles are computed exactly (``torch.quantile``'s linear
    interpolation between order statistics, found with ``kthvalue``, which has no limit on
    the input size, unlike torch.quantile's 16M elements) and averaged over the batches,
    each weighted by its number of elements.  Chosen over a reservoir sample because the
    tail is what matters: a reservoir of R values keeps only R * (1 - q/100) of them above
    the percentile (100 of a million at q = 99.99), so its estimate is noisy, whereas one
    calibration batch (512 tokens x 4096 features) holds 2M values, 200 above; averaging
    also needs no random state and O(1) memory and is exact for a single batch.  The
    limit: a batch of fewer than ``100 / (100 - q)`` values (10,000 at q = 99.99) has
    its percentile close to its max, so with many tiny batches the average lies above
    the percentile of the pooled data.  ``q`` lies in (50, 100].

    Example::

        >>> import torch
        >>> obs = Percentile(q=90.0)
        >>> obs.update(torch.arange(-10.0, 11.0))      # 21 values: -10 .. 10
        >>> obs.range(), obs.range(symmetric=True)     # 90th percentile of |x|: 9
        ((-8.0, 8.0), (-9.0, 9.0))
    """

    def __init__(self, q: float = 99.99) -> None:
        super().__init__()
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 50 < q <= 100:
            raise ValueError(f"Percentile(q) must be a number in (50, 100], got {q!r}")
        self.q = float(q)
        self._count = 0
        self._sums = [0.0, 0.0, 0.0]  # element-weighted sums of the batch's low, high and |x| percentiles

    def _observe(self, x, lo, hi):
        v = x.reshape(-1).to(reference.compute_dtype(x.dtype))
        f, n = self.q / 100, v.numel()
        for i, p in enumerate((_quantile(v, (100 - self.q) / 100), _quantile(v, f), _quantile(v.abs(), f))):
            self._sums[i] += n * p
        self._count += n

    def _range(self, symmetric):
        low, high, absolute = (t / self._count for t in self._sums)
        return (-absolute, absolute) if symmetric else (low, high)

    def __repr__(self) -> str:
        return f"Percentile(q={self.q})"


def _quantile(v: torch.Tensor, f: float) -> float:
    """``torch.quantile(v, f)`` (linear interpolation) of a 1-D tensor of any size."""
    pos = f * (v.numel() - 1)
    i = math.floor(pos)
    below = v.kthvalue(i + 1).values.item()
    if pos == i:
        return below
    above = v.kthvalue(i + 2).values.item()
    return below + (pos - i) * (above - below)


ACTIVATION_OBSERVERS: dict[str, type[Observer]] = {
    "minmax": MinMax, "ema": MovingAverageMinMax, "percentile": Percentile,
}
assert tuple(ACTIVATION_OBSERVERS) == ACT_OBSERVERS


def activation_observer(name: str, **kw) -> Observer:
    """A new activation observer by name: "minmax" (``MinMax``), "ema"
    (``MovingAverageMinMax``, keyword ``momentum``) or "percentile" (``Percentile``,
    keyword ``q``).

    Example::

        >>> activation_observer("percentile", q=99.9)
        Percentile(q=99.9)
        >>> activation_observer("histogram")
        Traceback (most recent call last):
        ...
        ValueError: unknown activation observer 'histogram'; expected one of ['ema', 'minmax', 'percentile']
    """
    if not isinstance(name, str):
        raise TypeError(f"activation_observer(name) needs a str, got {type(name).__name__}")
    if name not in ACTIVATION_OBSERVERS:
        raise ValueError(f"unknown activation observer {name!r}; expected one of {sorted(ACTIVATION_OBSERVERS)}")
    return ACTIVATION_OBSERVERS[name](**kw)


# -- weight observers ---------------------------------------------------------------------------


def weight_qparams(w: torch.Tensor, scheme: QuantScheme | str, observer: str = "minmax",
                   x_sq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point of the weight ``w`` [N, K] under ``scheme``, by the weight
    observer ``observer``: "minmax" (``lowbit.ops.choose_qparams``; ignores ``x_sq``) or
    "mse" (``mse_clip_qparams`` with its defaults and ``x_sq``).  The result goes to
    ``lowbit.quantize(w, scheme, scale, zero_point)``.

    Example::

        >>> import torch, lowbit
        >>> w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
        >>> scale, zp = weight_qparams(w, "int4-asym-g32", "mse")
        >>> lowbit.quantize(w, "int4-asym-g32", scale, zp).shape
        torch.Size([8, 64])
    """
    if observer == "minmax":
        return choose_qparams(w, scheme)
    if observer == "mse":
        return mse_clip_qparams(w, scheme, x_sq=x_sq)
    raise ValueError(f"unknown weight observer {observer!r}; expected one of {list(WEIGHT_OBSERVERS)}")


def clipped_qparams(w: torch.Tensor, scheme: QuantScheme | str,
                    ratio: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point of ``w`` [N, K] with the range of every block shrunk by
    ``ratio`` in (0, 1]: symmetric ``max|x| * ratio``, asymmetric ``[min * ratio,
    max * ratio]``.  Bit for bit ``choose_qparams(w * ratio, scheme)`` (the min and max of
    ``w * ratio`` are ``min * ratio`` and ``max * ratio``, rounding being monotone), without
    scaling the weight.

    Example::

        >>> import torch
        >>> w = torch.tensor([[-1.0, 0.5, 2.0, 3.0] * 8])
        >>> clipped_qparams(w, "int4-sym", 0.5)[0]    # 3 * 0.5 / 7.5
        tensor([0.2000])
    """
    s = as_scheme(scheme)
    _check_weight(w, s)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
    blocks = reference.to_blocks(w, s).to(reference.compute_dtype(w.dtype))
    scale, zp = _shrunk_qparams(blocks.amin(1), blocks.amax(1), ratio, s)
    shape = s.scale_shape(w.shape)
    return scale.reshape(shape), None if zp is None else zp.reshape(shape)


def mse_clip_qparams(w: torch.Tensor, scheme: QuantScheme | str, *, grid: int = 20, min_ratio: float = 0.5,
                     x_sq: torch.Tensor | None = None, h_blocks: torch.Tensor | None = None,
                     norm: float = 2.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point of ``w`` [N, K] whose clip ratio minimizes, block by block,
    the quantization error ``sum(|w - dequantize(quantize(w))|^norm * x_sq)``.

    Each block of ``scheme`` (a channel, a group, ...) tries the ratios
    ``linspace(min_ratio, 1, grid)`` (``clipped_qparams``) and keeps the one of lowest
    error, computed with the stored (dtype-rounded) scale and zero point; ratio 1 (the
    ``choose_qparams`` result, round to nearest over the full range) is tried first and
    only a strictly lower error replaces it, so the result is never worse than it.
    ``x_sq`` [K] (>= 0), the mean square of the layer's input per input channel, weights
    the error of each column: for a layer ``y = w @ x`` the output error of row n is
    ``E[(dw_n . x)^2] = dw_n^T E[x x^T] dw_n``, which the diagonal of ``E[x x^T]`` turns
    into a sum over columns, separable by block (exact for ``norm=2`` with uncorrelated
    inputs).  ``h_blocks`` [K / g, g, g] instead, the diagonal blocks of ``E[x x^T]``
    along K for the scheme's groups of ``g`` input channels, makes it exact for
    correlated inputs too: block ``b`` of row n costs ``dw^T H_b dw`` (``norm`` 2 only).
    Without either the weight error alone is measured.  GPTQ's ``mse`` option searches
    the same way (its grid 100, ratios down to 0.2, norm 2.4).

    Vectorized over the blocks; one pass over w per ratio.  Returns tensors of the
    scheme's dtypes and of shape ``scheme.scale_shape(w.shape)``.

    Example::

        >>> import torch, lowbit
        >>> _ = torch.manual_seed(0)
        >>> w = torch.distributions.StudentT(3.0).sample((64, 128))
        >>> rtn, mse = choose_qparams(w, "int4-sym-g64"), mse_clip_qparams(w, "int4-sym-g64")
        >>> def err(qp): return (lowbit.dequantize(lowbit.quantize(w, "int4-sym-g64", *qp)) - w).square().sum()
        >>> bool(err(mse) <= err(rtn)), bool((mse[0] <= rtn[0]).all())
        (True, True)
    """
    s = as_scheme(scheme)
    _check_weight(w, s)
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
        raise ValueError(f"grid must be an int >= 1, got {grid!r}")
    if isinstance(min_ratio, bool) or not isinstance(min_ratio, (int, float)) or not 0 < min_ratio <= 1:
        raise ValueError(f"min_ratio must be a number in (0, 1], got {min_ratio!r}")
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not (0 < norm < math.inf):
        raise ValueError(f"norm must be a finite number > 0, got {norm!r}")
    cdt = reference.compute_dtype(w.dtype)
    blocks = reference.to_blocks(w, s).to(cdt)
    weight = None
    if x_sq is not None:
        _validate.tensor("x_sq", x_sq, dtypes=_validate.FLOAT_DTYPES)
        _validate.shape("x_sq", x_sq, [w.shape[-1]], "one mean square per input channel of w")
        _validate.same_device("w", w, x_sq=x_sq)
        if _validate.has_values(x_sq) and not bool((torch.isfinite(x_sq) & (x_sq >= 0)).all()):
            raise ValueError("x_sq must be finite and >= 0 (mean squares of the input activations)")
        weight = reference.to_blocks(x_sq.to(cdt).expand(w.shape), s)
    hb = None
    if h_blocks is not None:
        if x_sq is not None or norm != 2 or s.granularity not in ("group", "channel") or w.dim() != 2:
            raise ValueError("h_blocks weighs the error of a 2-D weight per group or channel along K, with norm 2 "
                             "and without x_sq")
        g = s.block_len(w.shape)
        _validate.tensor("h_blocks", h_blocks, dtypes=_validate.FLOAT_DTYPES)
        _validate.shape("h_blocks", h_blocks, [w.shape[1] // g, g, g], "the diagonal blocks of E[x x^T], one per group")
        _validate.same_device("w", w, h_blocks=h_blocks)
        if not _validate.all_finite(h_blocks):
            raise ValueError("h_blocks must be finite (blocks of the inputs' E[x x^T])")
        hb = h_blocks.to(cdt)

    def error(scale, zp):  # [B]: the error of each block with these stored qparams
        deq = reference.dequantize(reference.quantize(w, scale, zp, s), scale, zp, s, cdt)
        d = reference.to_blocks(deq, s) - blocks
        if hb is not None:  # [N * G, g] -> [G, N, g]; dw^T H_b dw per row and block
            dg = d.reshape(w.shape[0], hb.shape[0], -1).transpose(0, 1)
            return (torch.bmm(dg, hb) * dg).sum(-1).transpose(0, 1).reshape(-1)
        e = d.abs().pow(norm)
        return (e if weight is None else e * weight).sum(dim=1)

    shape = s.scale_shape(w.shape)
    scale, zp = choose_qparams(w, s)
    scale, zp = scale.reshape(-1), None if zp is None else zp.reshape(-1)
    best = error(scale, zp)
    lo, hi = blocks.amin(1), blocks.amax(1)
    # linspace(min_ratio, 1, grid) from the top; ratio 1 was the start.
    for i in reversed(range(grid - 1)):
        ratio = min_ratio + (1 - min_ratio) * i / (grid - 1)
        sc, z = _shrunk_qparams(lo, hi, ratio, s)
        e = error(sc, z)
        better = e < best
        best = torch.where(better, e, best)
        scale = torch.where(better, sc, scale)
        zp = None if zp is None else torch.where(better, z, zp)
    return scale.reshape(shape), None if zp is None else zp.reshape(shape)


def _check_weight(w, s: QuantScheme) -> None:
    _validate.tensor("w", w, dtypes=_validate.FLOAT_DTYPES, ndim=2)
    _check_input(w, s, "w")
    _validate.finite("w", w)


def _shrunk_qparams(lo: torch.Tensor, hi: torch.Tensor, ratio: float,
                    s: QuantScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Flat scale [B] and zero point [B] (the scheme's dtypes) of blocks whose min is
    ``lo * ratio`` and max ``hi * ratio``: ``block_qparams`` of the blocks [B, 2] holding
    just those two values, which have the same min and max."""
    scale, zp = reference.block_qparams(torch.stack([lo * ratio, hi * ratio], dim=1), s.bits, s.symmetric,
                                        s.zero_point_domain, s.scale_dtype)
    return scale, None if zp is None else zp.to(s.zero_point_dtype)
