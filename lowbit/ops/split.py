"""Mixed int8/int4 weights: a few outlier input channels at 8 bits, the rest at 4.

One input channel with large activations (LLM.int8()'s outlier features) or large
weights widens every 4-bit group it falls in.  ``split_quantize`` takes such channels
out of the 4-bit part (their columns become exact zeros there, so the groups' scales
shrink) and keeps them in an 8-bit part; ``lowbit.linear`` multiplies both without a
float weight (``lowbit::split_matmul``).  ``choose_outliers`` picks the channels from
calibration statistics or from the weight alone.
"""

from __future__ import annotations

import torch

from .. import _validate
from ..qtensor import SplitQTensor
from ..scheme import QuantScheme
from ..kernels.reference import compute_dtype
from . import library
from .matmul import matmul_form, weight_parts
from .quant import as_scheme, dequantize, quantize

BY = ("error", "activation", "weight")


def _low_scheme(scheme, k: int) -> QuantScheme:
    s = as_scheme(scheme)
    if s.granularity == "group" and k % s.group_size:
        raise ValueError(f"scheme '{s}': group_size={s.group_size} does not divide K={k} (in_features)")
    if not matmul_form(s, k) or s.granularity == "token":
        raise ValueError(f"scheme '{s}' is not one the weight-only matmul takes for K={k} (4- or 8-bit codes, "
                         "4-bit ones filling whole u32 words, no 'min' zero point)")
    return s


def _high_ok(s: QuantScheme) -> bool:
    return s.bits == 8 and s.granularity in ("channel", "group") and s.zero_point_domain != "min"


def _high_scheme(high) -> QuantScheme:
    s = as_scheme(high, "high")
    if not _high_ok(s):
        raise ValueError(f"high must be an 8-bit per-channel or group scheme the matmul takes, got '{s}'")
    return s


def _check_count(count, k: int, high: QuantScheme) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= k:
        raise ValueError(f"outliers must be a count in [1, {k}] (in_features) or an int64 tensor of channels, "
                         f"got {count!r}")
    if high.granularity == "group" and count % high.group_size:
        raise ValueError(f"high='{high}' needs a number of outliers divisible by {high.group_size}, got {count}")


def check_split(scheme, high, k: int, count=None) -> tuple[QuantScheme, QuantScheme]:
    """The parsed (low, high) schemes of a split weight with K = ``k``, and the outlier
    ``count`` (when given) checked, before any work.

    Example::

        >>> from lowbit.ops.split import check_split
        >>> check_split("int4-asym-g64", "int8-sym", 576, 16)
        (QuantScheme('int4-asym-g64'), QuantScheme('int8-sym'))
    """
    low_s, high_s = _low_scheme(scheme, k), _high_scheme(high)
    if count is not None:
        _check_count(count, k, high_s)
    return low_s, high_s


def choose_outliers(w: torch.Tensor, count: int, scheme: QuantScheme | str, *, x_sq: torch.Tensor | None = None,
                    by: str = "error") -> torch.Tensor:
    """The ``count`` input channels (columns of ``w`` [N, K]) to keep at 8 bits, sorted.

    ``by``:
        * ``"error"`` (default): the columns whose move to 8 bits saves the most output
          error at ``scheme`` (their own and that of the groups whose range they widen),
          with ``x_sq`` the inputs' mean squares ``E[x_k^2]`` from calibration (all ones
          without); see ``_greedy_by_error``.
        * ``"activation"``: the largest ``x_sq`` (LLM.int8()'s outlier features; needs x_sq).
        * ``"weight"``: the largest ``max_n |w[n, k]|`` (calibration-free).

    Example::

        >>> import torch
        >>> from lowbit.ops.split import choose_outliers
        >>> w = torch.randn(8, 64)
        >>> w[:, 5] *= 30
        >>> choose_outliers(w, 1, "int4-asym-g32").tolist()
        [5]
    """
    _validate.tensor("w", w, dtypes=_validate.FLOAT_DTYPES, ndim=2)
    k = w.shape[1]
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= k:
        raise ValueError(f"count must be an int in [0, {k}] (in_features), got {count!r}")
    if by not in BY:
        raise ValueError(f"by must be one of {BY}, got {by!r}")
    s = _low_scheme(scheme, k)
    if x_sq is not None:
        _validate.tensor("x_sq", x_sq, dtypes=_validate.FLOAT_DTYPES, ndim=1)
        _validate.shape("x_sq", x_sq, (k,), "[in_features], the inputs' mean squares per channel")
        _validate.finite("x_sq", x_sq)
        if _validate.has_values(x_sq) and bool((x_sq < 0).any()):
            raise ValueError("x_sq holds negative values; it is the inputs' mean squares E[x_k^2] per channel")
    if by == "activation" and x_sq is None:
        raise ValueError("by='activation' ranks channels by the inputs' mean squares: pass x_sq")
    _validate.finite("w", w)
    w = w.detach().float()
    if by == "weight":
        score = w.abs().amax(dim=0)
    elif by == "activation":
        score = x_sq.float()
    else:
        return _greedy_by_error(w, count, s, x_sq)
    return torch.sort(torch.topk(score, count).indices).values


def _greedy_by_error(w, count: int, s: QuantScheme, x_sq) -> torch.Tensor:
    """Channels by how much output error moving each to 8 bits saves, in rounds.

    Round to nearest leaves an error of about ``scale^2 / 12`` per weight, weighted by its
    input's ``E[x^2]``; a group of row n costs ``width^2 * sum_k x_sq[k]`` (up to a
    constant), ``width`` its min-max range (the max |w| when symmetric).  Moving column j
    out of the group saves ``width^2 * S - width_without_j^2 * (S - x_sq[j])``, summed over
    rows: a column whose weights set the ranges saves the most, which a channel's own
    rounding error misses (the extreme of a range rounds well).  The range without j comes
    from each block's two largest and two smallest values.  After each of 4 rounds (a
    quarter of ``count``) the chosen columns are zeroed and the rest re-scored."""
    n, k = w.shape
    g = s.group_size if s.granularity == "group" else k
    x2 = torch.ones(k, device=w.device) if x_sq is None else x_sq.detach().float().to(w.device).clone()
    w = w.clone()
    chosen = torch.zeros(k, dtype=torch.bool, device=w.device)
    step = max(1, -(-count // 4))
    while int(chosen.sum()) < count:
        save = _savings(w.reshape(n, k // g, g), x2.reshape(k // g, g), s).reshape(k)
        save[chosen] = -torch.inf
        take = torch.topk(save, min(step, count - int(chosen.sum()))).indices
        chosen[take] = True
        w[:, take] = 0.0
        x2[take] = 0.0
    return torch.nonzero(chosen).reshape(-1)


def _savings(wb: torch.Tensor, xb: torch.Tensor, s: QuantScheme) -> torch.Tensor:
    """[G, g]: the error saved by taking each column out of its group (``_greedy_by_error``),
    for blocks ``wb`` [N, G, g] and their inputs' mean squares ``xb`` [G, g]."""
    if wb.shape[-1] == 1:  # a group of one: its own (range-sized) error is all there is to save
        return (wb.square() * xb).sum(0)

    def drop_top(v):  # max over the block, and max over the block without each element
        top = v.topk(2, dim=-1).values
        return top[..., :1], torch.where(v == top[..., :1], top[..., 1:], top[..., :1])

    if s.symmetric:
        width, without = drop_top(wb.abs())
    else:
        (hi, hi_wo), (nlo, nlo_wo) = drop_top(wb), drop_top(-wb)
        if s.zero_point_domain == "int":  # the range always holds 0
            hi, hi_wo, nlo, nlo_wo = (t.clamp(min=0) for t in (hi, hi_wo, nlo, nlo_wo))
        width, without = hi + nlo, hi_wo + nlo_wo
    total = xb.sum(-1, keepdim=True)
    return (width.square() * total - without.square() * (total - xb)).sum(0)


def split_quantize(w: torch.Tensor, scheme: QuantScheme | str, outliers: int | torch.Tensor, *,
                   high: QuantScheme | str = "int8-sym", x_sq: torch.Tensor | None = None,
                   by: str = "error") -> SplitQTensor:
    """Quantize ``w`` [N, K] as a ``SplitQTensor``: the ``outliers`` columns at ``high``
    (8-bit), the others at ``scheme`` (round to nearest, lowbit's min-max rule).

    ``outliers`` is a count (chosen by ``choose_outliers(w, count, scheme, x_sq=x_sq,
    by=by)``) or an int64 tensor of column indices.  The low part quantizes ``w`` with the
    outlier columns set to 0 (which leaves them out of its groups' ranges); the high part
    quantizes what the low part leaves of those columns (``w`` itself there, except for a
    "float" zero point, whose zero is not exact), so ``W = low + high`` holds by
    construction.

    Example::

        >>> import torch, lowbit
        >>> w = torch.randn(32, 128)
        >>> w[:, 7] *= 50
        >>> st = lowbit.split_quantize(w, "int4-asym-g64", 16)
        >>> plain = lowbit.dequantize(lowbit.quantize(w, "int4-asym-g64"))
        >>> bool((lowbit.dequantize(st) - w).norm() < (plain - w).norm())
        True
    """
    _validate.tensor("w", w, dtypes=_validate.FLOAT_DTYPES, ndim=2)
    n, k = w.shape
    low_s, high_s = check_split(scheme, high, k, None if isinstance(outliers, torch.Tensor) else outliers)
    _validate.finite("w", w)
    if isinstance(outliers, torch.Tensor):
        _validate.tensor("outliers", outliers, dtypes=[torch.int64], ndim=1)
        idx = outliers.to(w.device)
        _check_count(idx.numel(), k, high_s)
        _validate.increasing_indices("outliers", idx, k)
    else:
        idx = choose_outliers(w, outliers, low_s, x_sq=x_sq, by=by)
    w = w.detach().float()
    w_low = w.clone()
    w_low[:, idx] = 0.0
    low = quantize(w_low, low_s)
    hi = quantize(w[:, idx] - dequantize(low)[:, idx], high_s)
    return SplitQTensor(low, hi, idx)


def split_dequantize(st: SplitQTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] of a split tensor: ``dequantize(low)`` with
    ``dequantize(high)`` added at the outlier columns, in float32, rounded once to dtype.

    Example::

        >>> import torch, lowbit
        >>> from lowbit.ops.split import split_dequantize
        >>> st = lowbit.split_quantize(torch.randn(4, 32), "int4-sym-g32", torch.tensor([0, 9]))
        >>> split_dequantize(st, torch.bfloat16).shape
        torch.Size([4, 32])
    """
    if not isinstance(st, SplitQTensor):
        raise TypeError(f"st must be a lowbit.SplitQTensor, got {type(st).__name__}")
    _validate.float_dtype("dtype", dtype)
    cdt = compute_dtype(dtype)
    w = dequantize(st.low, cdt)
    w[:, st.outliers] += dequantize(st.high, cdt)
    return w.to(dtype)


def split_linear(x: torch.Tensor, st: SplitQTensor, bias: torch.Tensor | None = None, *,
                 backend: str | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a split weight (``lowbit.linear`` runs it for a SplitQTensor):
    ``lowbit::split_matmul``, the 4-bit part over all of x and the 8-bit part over
    ``x[..., outliers]``, each a weight-only kernel on its packed codes.

    Example::

        >>> import torch, lowbit
        >>> st = lowbit.split_quantize(torch.randn(32, 64), "int4-asym-g32", 16)
        >>> lowbit.linear(torch.randn(3, 64), st).shape
        torch.Size([3, 32])
    """
    if not matmul_form(st.low.scheme, st.shape[1]):
        _low_scheme(st.low.scheme, st.shape[1])  # raises, naming the scheme
    if not _high_ok(st.high.scheme):
        _high_scheme(st.high.scheme)  # raises, naming the scheme
    codes, scale, zp, bits, group = weight_parts(st.low)
    h_codes, h_scale, h_zp, h_bits, h_group = weight_parts(st.high)
    y = library.call(library.split_matmul, backend, x.device, x, codes, scale, zp, bits, group, st.outliers,
                     h_codes, h_scale, h_zp, h_bits, h_group)
    return y if bias is None else y + bias.to(y.dtype)


__all__ = ["choose_outliers", "check_split", "split_quantize", "split_dequantize", "split_linear"]
