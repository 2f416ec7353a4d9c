"""HQQ: Half-Quadratic Quantization (Badri & Shaji, 2023), calibration-free qparams.

HQQ looks for the qparams of each block that make the quantization error
``e = W - dequantize(quantize(W))`` small in the ``lp`` sense (``p < 1``: a few large
errors, at outliers, cost less than many small ones).  It splits the problem with an
auxiliary error ``W_e`` and alternates closed-form steps; in lowbit's convention
``q = round(W / scale + z)``, ``W ~= (q - z) * scale``::

    W_q = clamp(round(W / scale + z), qmin, qmax)             codes of the current qparams
    W_e = shrink_p(W - (W_q - z) * scale, beta)                generalized lp soft-threshold
    z   = mean over the block of (W_q - (W - W_e) / scale)     HQQ's zero-point step
    beta *= kappa

with ``shrink_p(x, beta) = sign(x) * relu(|x| - |x|^(p-1) / beta)``.  As in HQQ, beta
acts in the weight's own units (its defaults suit LLM weights, whose errors lie far
below the threshold ``beta^(-1/(2-p))``, so there the steps are least squares).

Two departures from the paper, both measured (``tests/test_hqq.py``):

* After the zero-point step each iteration also takes the closed-form scale step of
  the same split, ``scale = sum((W - W_e)(W_q - z)) / sum((W_q - z)^2)``.  HQQ keeps
  the min-max scale; with an "int" zero point that leaves nothing to gain (the mean
  step rounds back to RTN's integer: squared error 1.000 of RTN's), and with a "float"
  one the scale step lowers it further (Gaussian weights, int4 g64: 0.88 of RTN's
  instead of 0.93 with the zero point alone; int2 g32: 0.62 instead of 0.90).
* Every iterate is stored as lowbit stores it (the scale rounded up to
  ``scale_dtype``; the zero point rounded to an integer code, uint8, in the "int"
  domain, to ``scale_dtype`` in the "float" one) and scored exactly as
  ``lowbit.quantize`` + ``lowbit.dequantize`` will reproduce it.  Per block the result
  is the iterate with the lowest squared error; a block whose lp error would then
  exceed min-max round-to-nearest's (RTN, ``choose_qparams``, the first iterate) keeps
  RTN's qparams, so no block is worse than RTN in either error.

Symmetric schemes have no zero point, so HQQ does not apply: the scale of each block
is searched over ``SHRINK_GRID`` (fractions of the min-max scale, rounded up to
``scale_dtype``) with the same rule.
"""

from __future__ import annotations

import math
import numbers

import torch

from .. import _validate
from ..kernels import reference
from ..ops.quant import as_scheme, choose_qparams
from ..scheme import QuantScheme

# Fractions of the min-max scale tried for symmetric schemes: clipping the largest |w|
# of a block buys a finer grid for the rest.  The last, 1.0, is RTN's scale.
SHRINK_GRID = tuple(round(0.70 + 0.02 * i, 2) for i in range(16))  # 0.70, 0.72, ..., 1.00


def hqq_qparams(w: torch.Tensor, scheme: QuantScheme | str, *, iters: int = 20, lp_norm: float = 0.7,
                beta: float = 10.0, kappa: float = 1.01,
                early_stop: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point for weight ``w`` [N, K] (float) under ``scheme``, optimized by
    HQQ so that ``lowbit.quantize(w, scheme, scale, zero_point)`` then
    ``lowbit.dequantize(...)`` has a lower error than round-to-nearest min-max qparams
    (``lowbit.ops.choose_qparams``).  See the module docstring for the algorithm.

    Args:
        w: float weight [N, K] (float32, float64, float16 or bfloat16), finite; K a
            multiple of the scheme's group size and of ``scheme.pack_unit``.
        scheme: a ``QuantScheme`` or its string form; every granularity works (the
            blocks are the scheme's: groups, channels, or the whole tensor).
        iters: at most this many half-quadratic iterations (>= 1).
        lp_norm: p of the lp error HQQ minimizes, in (0, 1].
        beta: initial half-quadratic penalty (> 0), in the weight's units.
        kappa: growth of beta per iteration (>= 1).
        early_stop: stop once the total squared error of an iterate stops falling (HQQ's
            rule, on the error kept here); the best iterate of each block is kept
            either way.

    Returns ``(scale, zero_point)`` shaped ``scheme.scale_shape(w.shape)``: the scale in
    ``scheme.scale_dtype``, finite and > 0; the zero point in ``scheme.zero_point_dtype``
    (an integer in [qmin, qmax] as uint8 for the "int" domain, a finite ``scale_dtype``
    value for the "float" one), None for symmetric schemes, which get a per-block
    search over ``SHRINK_GRID`` of the scale instead of HQQ.  In every block, the mean
    squared and the mean lp error of the result are at most RTN's.  Arithmetic is
    float32 (float64 for a float64 ``w``), vectorized over blocks, deterministic.

    Example::

        >>> import torch, lowbit
        >>> from lowbit.algorithms.hqq import hqq_qparams
        >>> w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
        >>> scale, zp = hqq_qparams(w, "int4-asym-g64")
        >>> scale.shape, scale.dtype, zp.dtype
        (torch.Size([64, 4]), torch.float32, torch.uint8)
        >>> def mse(qt): return float((lowbit.dequantize(qt) - w).square().mean())
        >>> mse(lowbit.quantize(w, "int4-asym-g64", scale, zp)) < mse(lowbit.quantize(w, "int4-asym-g64"))
        True
    """
    s = as_scheme(scheme)
    if s.zero_point_domain == "min":
        raise ValueError(f"hqq_qparams: scheme '{s}' has a 'min' zero point, which HQQ does not optimize yet; "
                         "use an 'int' or 'float' zero point")
    _check_args(w, s, iters, lp_norm, beta, kappa, early_stop)
    scale, zero_point = choose_qparams(w, s)  # RTN: the first iterate, and the floor of every block
    if w.numel() == 0:
        return scale, zero_point
    shape = scale.shape
    wb = reference.to_blocks(w, s)
    rtn = (scale.reshape(-1), None if zero_point is None else zero_point.reshape(-1))
    if s.symmetric:
        best = (_search_scale(wb, rtn[0], s), None)
    else:
        best = _half_quadratic(wb, *rtn, s, iters, lp_norm, beta, kappa, early_stop)
    # The squared error of `best` is at most RTN's by construction; keep RTN in the
    # blocks where the lp error, which the iterations do not track, came out worse.
    worse = _lp_error(wb, *best, s, lp_norm) > _lp_error(wb, *rtn, s, lp_norm)
    scale = torch.where(worse, rtn[0], best[0]).reshape(shape)
    if zero_point is not None:
        zero_point = torch.where(worse, rtn[1], best[1]).reshape(shape)
    return scale, zero_point


def _lp_error(wb, scale, zero_point, s: QuantScheme, p: float) -> torch.Tensor:
    """Mean |error|^p of each block of ``wb`` [B, L] under stored qparams [B], by the
    reference quantize and dequantize (the codes ``lowbit.quantize`` produces)."""
    cdt = reference.compute_dtype(wb.dtype)
    q = reference.quantize(wb, scale, zero_point, s)
    e = reference.dequantize(q, scale, zero_point, s, cdt) - wb.to(cdt)
    return e.abs().pow(p).mean(1)


def _codes_minus_zero(w, scale, zero, s: QuantScheme) -> torch.Tensor:
    """``clamp(q) - zero`` of blocks ``w`` [B, L] under ``scale`` and ``zero`` [B, 1], in
    the float ops of ``reference.rounded_codes`` (the float domain rounds
    ``w / scale + zero``, the int domain adds the zero point after rounding), so the
    errors computed from it are lowbit's, bit for bit."""
    q = torch.div(w, scale)
    if s.zero_point_domain == "int":
        q.round_().add_(zero)
    else:
        q.add_(zero).round_()
    return q.clamp_(s.qmin, s.qmax).sub_(zero)


def _half_quadratic(wb, scale, zero_point, s: QuantScheme, iters, p, beta, kappa, early_stop):
    """The iterations of the module docstring on blocks ``wb`` [B, L] from RTN's scale
    and zero point [B]; returns the stored (scale, zero point) [B] of least squared error."""
    cdt = reference.compute_dtype(wb.dtype)
    w = wb.to(cdt)
    n = w.shape[1]
    w_sum = w.sum(1, keepdim=True)
    sc, z = scale.to(cdt)[:, None], zero_point.to(cdt)[:, None]
    best_sc, best_z, best_err = sc, z, torch.full_like(sc, math.inf)
    prev = math.inf
    for i in range(iters + 1):
        d = _codes_minus_zero(w, sc, z, s)  # W_q - z
        diff = torch.sub(w, d * sc)  # W - W_r: what dequantize(quantize(W)) misses
        err = torch.linalg.vecdot(diff, diff)[:, None]
        take = err < best_err  # NaN (an overflowed iterate) is never taken
        best_sc, best_z = torch.where(take, sc, best_sc), torch.where(take, z, best_z)
        best_err = torch.where(take, err, best_err)
        total = float(err.sum())
        if i == iters or (early_stop and total >= prev):
            break
        prev = total
        # W_e is non-zero only where |x|^(2-p) > 1/beta.  At LLM weight sizes no error gets
        # there, so the common case skips it (and HQQ's +1e-8 against 0^(p-1)).
        thresh = beta ** (-1.0 / (2.0 - p))
        w_e = None
        if float(torch.linalg.vector_norm(diff, math.inf)) > thresh:
            a = diff.abs()
            w_e = torch.copysign(torch.relu(a - a.clamp(min=thresh).pow(p - 1) / beta), diff)
        beta *= kappa
        # z step (HQQ): mean(W_q - (W - W_e) / scale) = z + mean(d) - mean(W - W_e) / scale
        d_sum = d.sum(1, keepdim=True)
        t_sum = w_sum if w_e is None else w_sum - w_e.sum(1, keepdim=True)
        z_new = z + (d_sum - t_sum / sc) / n
        if s.zero_point_domain == "int":
            z_new = torch.round(z_new).clamp_(s.qmin, s.qmax)
        else:
            z_new = z_new.to(s.zero_point_dtype).to(cdt)
        z_new = torch.where(torch.isfinite(z_new), z_new, z)
        # scale step: least squares of W - W_e on the codes less the new zero point,
        # d + dz with dz = z - z_new (expanded, to save a pass over the block)
        dz = z - z_new
        num = torch.linalg.vecdot(w, d)[:, None] + dz * w_sum
        if w_e is not None:
            num -= torch.linalg.vecdot(w_e, d)[:, None] + dz * w_e.sum(1, keepdim=True)
        den = torch.linalg.vecdot(d, d)[:, None] + dz * (2 * d_sum + n * dz)
        sc_new = reference.round_up_to(num / den, s.scale_dtype).to(cdt)
        sc = torch.where(torch.isfinite(sc_new) & (sc_new > 0), sc_new, sc)
        z = z_new
    return best_sc[:, 0].to(s.scale_dtype), best_z[:, 0].to(s.zero_point_dtype)


def _search_scale(wb, scale, s: QuantScheme) -> torch.Tensor:
    """Per block [B], the scale in ``SHRINK_GRID`` times the min-max ``scale`` (rounded up
    to ``scale_dtype``) of least squared error (symmetric schemes)."""
    cdt = reference.compute_dtype(wb.dtype)
    w = wb.to(cdt)
    s0 = scale.to(cdt)[:, None]
    best_sc, best_err = s0, torch.full_like(s0, math.inf)
    for f in reversed(SHRINK_GRID):  # RTN (1.0) first: ties keep the larger scale
        sc = reference.round_up_to(s0 * f, s.scale_dtype).to(cdt)  # rounded up: > 0
        diff = w - torch.div(w, sc).round_().clamp_(s.qmin, s.qmax) * sc
        err = torch.linalg.vecdot(diff, diff)[:, None]
        take = err < best_err
        best_sc, best_err = torch.where(take, sc, best_sc), torch.where(take, err, best_err)
    return best_sc[:, 0].to(s.scale_dtype)


def _check_args(w, s: QuantScheme, iters, lp_norm, beta, kappa, early_stop) -> None:
    _validate.tensor("w", w, dtypes=_validate.FLOAT_DTYPES, ndim=2)
    _validate.finite("w", w)
    k = w.shape[1]
    if s.granularity == "group" and k % s.group_size:
        raise ValueError(f"group_size={s.group_size} of scheme '{s}' does not divide w.shape[1]={k}")
    if s.is_packed and k % s.pack_unit:
        raise ValueError(f"w.shape[1]={k} must be a multiple of {s.pack_unit} to pack {s.bits}-bit codes "
                         f"into {s.packing} words (scheme '{s}')")
    if isinstance(iters, bool) or not isinstance(iters, numbers.Integral):
        raise TypeError(f"iters must be an int >= 1, got {iters!r}")
    if iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    for name, value, ok, expected in (
        ("lp_norm", lp_norm, lambda v: 0 < v <= 1, "in (0, 1]"),
        ("beta", beta, lambda v: v > 0, "> 0"),
        ("kappa", kappa, lambda v: v >= 1, ">= 1"),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number {expected}, got {value!r}")
        if not (math.isfinite(value) and ok(value)):
            raise ValueError(f"{name} must be finite and {expected}, got {value!r}")
    if not isinstance(early_stop, bool):
        raise TypeError(f"early_stop must be a bool, got {early_stop!r}")
