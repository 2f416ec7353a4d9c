"""SparseGPT (Frantar & Alistarh, 2023) in its 2:4 form, pruning and quantizing in one pass.

GPTQ's column loop (``lowbit.algorithms.gptq``) with one step more: on reaching the first
column of each group of 4, the loop keeps the 2 columns of largest OBS saliency
``w^2 / [H^-1]_jj^2`` of every row (``[H^-1]_jj`` the diagonal of the inverse-Hessian
Cholesky factor ``U``, the inverse of H restricted to the columns not yet processed,
read as GPTQ reads it), sets the pruned weights to 0, rounds the kept ones with the
scheme's arithmetic, and spreads both errors over the later columns through ``U``, with
GPTQ's lazy block updates.  The Hessian, its dampening and its dead columns are GPTQ's
(``hessian_factor``).

Scales: a quantization group covers G kept values, that is 2G columns (``lowbit.sparse``);
its scale and zero point are chosen when the loop reaches the group, from the weights as
updated so far, over the 2 entries of each 4 that the saliency would keep at that moment
(the final masks, chosen column group by column group, may differ; a kept value that
falls outside the grid is clamped, as in GPTQ).  Per channel, the scales come from the
weights before any update.
"""

from __future__ import annotations

import torch

from .._validate import all_finite
from ..ops import quantize
from ..ops.quant import as_scheme
from ..scheme import QuantScheme
from ..sparse import Sparse24QTensor, compress, prune_2_4
from .base import fake_quantize_columns
from .gptq import _check_params, _qparams, hessian_factor


def _check(w, h, s: QuantScheme, factor) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"sparsegpt: w must be a 2-D float tensor [N, K], got {getattr(w, 'shape', type(w))}")
    n, k = w.shape
    if k % 8:
        raise ValueError(f"sparsegpt: w.shape[1]={k} must be a multiple of 8 (2:4 groups, 2-bit indices per byte)")
    shapes = [(k, k)] + ([(k,)] if factor is not None else [])
    if not isinstance(h, torch.Tensor) or tuple(h.shape) not in shapes:
        raise ValueError(f"sparsegpt: h (the Hessian) must be [{k}, {k}], got {tuple(getattr(h, 'shape', ()))}")
    if not (all_finite(h) and all_finite(w)):
        raise ValueError("sparsegpt: w or h holds NaN or Inf")
    if s.granularity not in ("group", "channel"):
        raise ValueError(f"sparsegpt: scheme '{s}' must be per channel or per group")
    if s.granularity == "group" and s.group_size % 2:
        raise ValueError(f"sparsegpt: group_size={s.group_size} of '{s}' must be even: a group of kept values "
                         "spans 2 * group_size input channels, which must be whole 2:4 groups")
    if s.granularity == "group" and (k // 2) % s.group_size:
        raise ValueError(f"sparsegpt: group_size={s.group_size} of '{s}' must divide the {k // 2} kept values "
                         "of a row (groups run along the kept values)")
    if s.is_packed and (k // 2) % s.pack_unit:
        raise ValueError(f"sparsegpt: '{s}' packs {s.pack_unit} codes per word; w.shape[1] must be a multiple "
                         f"of {2 * s.pack_unit}")


def _scale(Wt: torch.Tensor, d: torch.Tensor, s: QuantScheme):
    """Scale and zero point [N] of the columns ``Wt`` [C, N] (transposed), over the entries
    that the saliency with inverse-Hessian diagonal ``d`` [C] keeps."""
    w = Wt.T
    keep = prune_2_4(w, w.square() / d.square())
    return _qparams(w[keep].view(w.shape[0], -1), s, None, None)


def sparsegpt_quantize(w: torch.Tensor, h: torch.Tensor, scheme: QuantScheme | str, *, block_size: int = 128,
                       damp: float = 0.01, factor: tuple | None = None) -> Sparse24QTensor:
    """Prune ``w`` [N, K] to 2:4 and quantize the kept values with ``scheme``, against
    the Hessian ``h`` [K, K] (``E[x x^T]`` of the layer's inputs).  ``factor``: the
    ``(U, damp)`` of ``gptq.hessian_factor(h, damp, False)`` when weights share ``h``
    (``h`` may then be its diagonal).

    Example::

        >>> import torch
        >>> from lowbit.sparse import densify, sparsify
        >>> x = torch.randn(512, 64) @ torch.randn(64, 64)     # correlated inputs
        >>> w = torch.randn(32, 64)
        >>> sqt = sparsegpt_quantize(w, x.T @ x / 512, "int4-asym-g16")
        >>> err = lambda v: float(((x @ (v - w).T) ** 2).mean())
        >>> err(densify(sqt)) < err(densify(sparsify(w, "int4-asym-g16")))
        True
    """
    s = as_scheme(scheme)
    _check(w, h, s, factor)
    _check_params(block_size, damp)
    n, k = w.shape
    grouped = s.granularity == "group"
    span = 2 * s.group_size if grouped else k  # columns that share one scale
    block_size = max(1, block_size // span) * span if grouped else max(4, block_size // 4 * 4)
    U, _ = factor if factor is not None else hessian_factor(h.float(), float(damp), False, "sparsegpt")
    U = U.to(torch.float32)
    d = U.diagonal()
    dead = (h if h.dim() == 1 else h.diagonal()) == 0

    Wt = w.detach().to(torch.float32).T.contiguous()  # [K, N]: column j of w is row j, as in gptq
    Wt[dead] = 0.0
    Qt, keep = torch.zeros_like(Wt), torch.zeros_like(Wt, dtype=torch.bool)
    sc_zp = [] if grouped else [_scale(Wt, d, s)]
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1, U1 = Wt[i1:i2], U[i1:i2, i1:i2]
        E1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            j = i1 + i
            if grouped and j % span == 0:
                sc_zp.append(_scale(W1[i:i + span], d[j:j + span], s))
            if j % 4 == 0:
                keep[j:j + 4] = prune_2_4(W1[i:i + 4].T, (W1[i:i + 4] / d[j:j + 4, None]).square().T).T
            q = fake_quantize_columns(W1[i, :, None], *sc_zp[-1], s)[:, 0].masked_fill_(~keep[j], 0.0)
            Qt[j] = q
            E1[i] = (W1[i] - q) / U1[i, i]
            W1[i + 1:].sub_(U1[i, i + 1:, None] * E1[i])
        Wt[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1)

    kept, indices = compress(Qt.T, keep.T)
    scale = torch.stack([sc for sc, _ in sc_zp], 1) if grouped else sc_zp[0][0]
    zp = None
    if not s.symmetric:
        zp = torch.stack([z for _, z in sc_zp], 1) if grouped else sc_zp[0][1]
        zp = zp.to(s.zero_point_dtype)
    # kept values lie on the grid: quantizing them again with the same scales gives their codes
    return Sparse24QTensor(quantize(kept.contiguous(), s, scale.contiguous(), zp), indices, w.shape)


__all__ = ["sparsegpt_quantize"]
