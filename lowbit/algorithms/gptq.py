"""GPTQ (Frantar et al., 2022): quantize a weight column by column, spreading each
column's rounding error over the columns not yet quantized through the inverse
Hessian of the layer's input, ``H = E[x x^T]`` from calibration activations.

Numerics: ``H`` accumulates in float32 (each batch's X^T X is a float32 GEMM over
thousands of rows; summing a few dozen of them in float64 would add nothing but twice
the memory); dampening adds ``damp * mean(diag H)`` to its
diagonal and is raised tenfold (with a logged warning) whenever the Cholesky
factorization fails, so a rank-deficient Hessian never stops it; input columns that
calibration never excites (``H[i, i] == 0``) get weight 0, as their input is always
zero.  The inverse's Cholesky factor is computed in float32; the column loop runs in
float32 with lazy block updates.  A group's scale and zero point are chosen when the
loop reaches the group (from the already-updated weights); with ``act_order`` the
columns go in decreasing ``H[i, i]`` and the groups' scales are chosen up front
("static groups"), so the packed layout stays the plain group layout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from .._validate import all_finite
from ..kernels import reference
from ..ops import quantize
from ..ops.quant import as_scheme
from ..qtensor import QTensor
from ..scheme import QuantScheme
from .base import Algorithm, LinearGroup, add_gram

log = logging.getLogger("lowbit.gptq")


def _qparams(w: torch.Tensor, s: QuantScheme, observer, x_sq: torch.Tensor | None):
    """Scale and zero point of ``w`` [N, C] taken as one block per row (a group or, per
    channel, the whole row): lowbit's rule (the reference's ``choose_qparams``, which
    every backend matches bit for bit), or the observer's."""
    one = QuantScheme(bits=s.bits, symmetric=s.symmetric, granularity="channel", scale_dtype=s.scale_dtype,
                      zero_point_domain=s.zero_point_domain)
    if observer is None:
        return reference.choose_qparams(w, one)
    return observer(w.contiguous(), one, x_sq)


def inverse_factor(h: torch.Tensor, damp: float, what: str = "gptq", consume: bool = False) -> tuple[torch.Tensor, float]:
    """Upper triangular ``U`` with ``U^T U = (H + damp * mean(diag H) * I)^-1`` (float32,
    as GPTQ's own implementation: the dampening bounds the condition number, and
    float64 would cost 2-3x the time), raising the dampening tenfold (with a warning)
    until H factors.

    With ``J`` the reversal permutation, ``J H J = L L^T`` gives ``H = R R^T`` with
    ``R = J L J`` upper triangular, so ``H^-1 = (R^-1)^T R^-1`` and
    ``U = R^-1 = J L^-1 J``: one Cholesky factorization and one triangular inverse.
    Besides ``h``, three K x K float32 matrices live at most (1.45 GB at K = 11008: the
    damped copy is kept until the factor is known to be finite, for the retry); with
    ``consume`` (``h`` is scratch the caller gives up) ``h``'s storage is released once
    its flipped copy exists.

    Example::

        >>> h = torch.tensor([[4.0, 2.0], [2.0, 3.0]])
        >>> u, used = inverse_factor(h, 1e-6)
        >>> torch.allclose(u.T @ u, torch.linalg.inv(h), atol=1e-5), used
        (True, 1e-06)
    """
    mean = float(h.diagonal().double().mean())
    m = h.to(torch.float32).flip(0, 1)  # J H J (a copy); J I J = I, so the dampening goes on its diagonal
    if consume:
        h.untyped_storage().resize_(0)
    m.diagonal().add_(damp * mean)
    while True:
        l, info = torch.linalg.cholesky_ex(m)
        if int(info) == 0:
            # L^-1 solved into the identity in place (column-major, as LAPACK works: no copy)
            l_inv = torch.eye(l.shape[0], dtype=l.dtype, device=l.device).mT
            torch.linalg.solve_triangular(l, l_inv, upper=False, out=l_inv)
            del l
            u = l_inv.flip(0, 1)
            del l_inv
            if all_finite(u):
                return u, damp
            del u
        else:
            del l
        if damp >= 1e6:
            raise ValueError(f"{what}: the Hessian does not factor even with dampening {damp:g} x mean(diag)")
        log.warning("%s: Hessian not positive definite with dampening %g; retrying with %g", what, damp, damp * 10)
        m.diagonal().add_(9 * damp * mean)  # damp -> 10 damp
        damp *= 10


def _order(diag: torch.Tensor, act_order: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The dead columns (a zero Hessian diagonal: the input is always 0), the diagonal
    with 1 there, and the act-order permutation (decreasing diagonal) or None."""
    dead = diag == 0
    d = diag.masked_fill(dead, 1.0)
    return dead, d, torch.argsort(d, descending=True, stable=True) if act_order else None


def hessian_factor(h: torch.Tensor, damp: float, act_order: bool, what: str = "gptq") -> tuple[torch.Tensor, float]:
    """``inverse_factor`` of ``h`` with a dead column's diagonal set to 1, its rows and
    columns in act-order when asked: the ``factor`` ``gptq_quantize`` takes (one per
    Hessian, shared by the weights that read the same input)."""
    dead, _, perm = _order(h.diagonal().double(), act_order)
    return inverse_factor(_prepared(h.to(torch.float32, copy=True), dead, perm), damp, what, consume=True)


def _prepared(h: torch.Tensor, dead: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """``h`` (changed in place) with the dead columns' diagonal set to 1, reordered by
    ``perm``: both from ``_order`` of the float64 diagonal, the order ``gptq_quantize``
    permutes the weight in (a float32 diagonal could order near-ties differently)."""
    h.diagonal()[dead] = 1.0
    return h if perm is None else h[perm[:, None], perm]


def _columns(W1, Q1, E1, U1, a: int, b: int, scale, zero_point, qmin: float, qmax: float, int_zp: bool) -> None:
    """GPTQ's loop over columns ``a..b-1`` of one block, in place: ``W1``, ``Q1``, ``E1``
    [B, N] are the block's rows of the transposed weight, its quantized values and its
    scaled errors, ``U1`` [B, B] the block of the inverse-Hessian factor, ``scale`` (and
    ``zero_point``) [b - a, N] the quantization grid of each column.  Each column is
    quantized with lowbit's arithmetic (``lowbit.scheme``, as ``fake_quantize_columns``)
    and its error spread over the block's later columns.  The plain version of
    ``lowbit._C.gptq_columns`` (csrc/cpu/gptq.cpp), which does the same float32
    operations in the same order: the two agree bit for bit."""
    for i in range(a, b):
        w, q, sc = W1[i], Q1[i], scale[i - a]
        z = None if zero_point is None else zero_point[i - a]
        torch.div(w, sc, out=q)
        if z is None:
            q.round_().clamp_(qmin, qmax)
        elif int_zp:
            q.round_().add_(z).clamp_(qmin, qmax).sub_(z)
        else:
            q.add_(z).round_().clamp_(qmin, qmax).sub_(z)
        q.mul_(sc)
        err = torch.sub(w, q, out=E1[i]).div_(U1[i, i])
        W1[i + 1:].sub_(U1[i, i + 1:, None] * err)  # not addr_: its tail elements are fused multiply-adds


def _columns_kernel(w: torch.Tensor):
    """``lowbit._C.gptq_columns`` for CPU tensors when the extension is built (the Python
    loop costs ~90 us of call overhead per column), else ``_columns``."""
    from ..kernels import cpu

    return cpu._C.gptq_columns if w.device.type == "cpu" and cpu.available() else _columns


def _check_params(block_size, damp) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"gptq block_size must be a positive integer, got {block_size!r}")
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 < damp < 1:
        raise ValueError(f"gptq damp must be a fraction in (0, 1) of the mean Hessian diagonal, got {damp!r}")


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, scheme: QuantScheme | str, *, block_size: int = 128,
                  damp: float = 0.01, act_order: bool = False, observer=None,
                  what: str = "weight", factor: tuple | None = None) -> tuple[QTensor, dict]:
    """Quantize ``w`` [N, K] with GPTQ against the Hessian ``h`` [K, K] (``E[x x^T]`` of
    the layer's inputs).  Returns the QTensor (exactly the codes GPTQ chose: dequantizing
    it gives GPTQ's weights bit for bit) and facts about the run (the dampening used,
    the dead columns).

    ``observer(w_block [N, C], per_channel_scheme, x_sq [C]) -> (scale, zero_point)``
    replaces min-max scales (e.g. MSE-optimal clipping).  ``factor``: the
    ``(U, damp)`` of ``hessian_factor`` for this ``h`` and ``act_order``, when several
    weights share one Hessian; ``h`` may then be its diagonal [K] alone.

    Example::

        >>> import torch
        >>> x = torch.randn(256, 64) @ torch.randn(64, 64)     # correlated inputs
        >>> w = torch.randn(32, 64)
        >>> qt, info = gptq_quantize(w, x.T @ x / 256, "int4-asym-g32")
        >>> import lowbit
        >>> rtn = lowbit.dequantize(lowbit.quantize(w, "int4-asym-g32"))
        >>> err = lambda v: float(((x @ (v - w).T) ** 2).mean())
        >>> err(lowbit.dequantize(qt)) < err(rtn)
        True
    """
    s = as_scheme(scheme)
    if s.zero_point_domain == "min":
        raise ValueError(f"gptq_quantize: scheme '{s}' has a 'min' zero point, which GPTQ's column loop does not "
                         "round yet; use an 'int' or 'float' zero point")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{what}: w must be a 2-D float tensor [N, K]")
    n, k = w.shape
    shapes = [(k, k)] + ([(k,)] if factor is not None else [])
    if not isinstance(h, torch.Tensor) or tuple(h.shape) not in shapes:
        raise ValueError(f"{what}: the Hessian must be [{k}, {k}]{' (or its diagonal)' if factor else ''}, got "
                         f"{tuple(getattr(h, 'shape', ()))}")
    if not (all_finite(h) and all_finite(w)):
        raise ValueError(f"{what}: the weight or the Hessian holds NaN or Inf")
    if s.granularity not in ("group", "channel"):
        raise ValueError(f"{what}: GPTQ quantizes per channel or per group, not '{s.granularity}' ('{s}')")
    if s.granularity == "group" and k % s.group_size:
        raise ValueError(f"{what}: group_size={s.group_size} of '{s}' does not divide in_features={k}")
    _check_params(block_size, damp)
    W = w.detach().to(torch.float32).clone()
    dead, diag, perm = _order((h if h.dim() == 1 else h.diagonal()).double(), act_order)
    W[:, dead] = 0.0
    group = s.group_size if s.granularity == "group" else k
    if s.granularity == "group" and block_size % group:
        block_size = group * max(1, block_size // group)
    x_sq = diag.float()

    scales = torch.empty(n, k // group, dtype=s.scale_dtype, device=w.device)
    zps = None if s.symmetric else torch.empty(n, k // group, dtype=s.zero_point_dtype if s.zero_point_domain == "float"
                                               else torch.int32, device=w.device)
    if act_order or group == k:  # static groups: every group's scale from the weights before any update
        for g in range(k // group):
            sc, zp = _qparams(W[:, g * group:(g + 1) * group], s, observer, x_sq[g * group:(g + 1) * group])
            scales[:, g] = sc
            if zps is not None:
                zps[:, g] = zp
    U, used = factor if factor is not None else hessian_factor(h, float(damp), act_order, what)
    U = U.to(torch.float32)
    if perm is not None:
        W = W[:, perm]
    col_group = (perm if perm is not None else torch.arange(k)) // group

    # The loop works on W transposed ([K, N]: column j of W is the contiguous row j).
    Wt = W.T.contiguous()
    Qt = torch.empty_like(Wt)
    columns = _columns_kernel(Wt)
    limits = (float(s.qmin), float(s.qmax), s.zero_point_domain == "int")
    static = act_order or group == k
    rows_sc = scales.float().T.contiguous() if static else None  # [groups, N]: one group's scales a row
    rows_zp = zps.float().T.contiguous() if static and zps is not None else None
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1, Q1, U1 = Wt[i1:i2], Qt[i1:i2], U[i1:i2, i1:i2]
        E1 = torch.empty_like(W1)
        if static:
            g = col_group[i1:i2]
            columns(W1, Q1, E1, U1, 0, i2 - i1, rows_sc.index_select(0, g),
                    None if rows_zp is None else rows_zp.index_select(0, g), *limits)
        else:  # a group's scale when the loop reaches it, from the updated weights (blocks hold whole groups)
            for a in range(0, i2 - i1, group):
                g = (i1 + a) // group
                sc, zp = _qparams(W1[a:a + group].T, s, observer, x_sq[i1 + a:i1 + a + group])
                scales[:, g] = sc
                if zps is not None:
                    zps[:, g] = zp
                rows = lambda t: t[:, g].float().contiguous().expand(group, n)  # noqa: E731  (stride 0: one row)
                columns(W1, Q1, E1, U1, a, a + group, rows(scales), None if zps is None else rows(zps), *limits)
        Wt[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1)
    Q = Qt.T
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    if s.granularity == "channel":
        scales, zps = scales[:, 0], None if zps is None else zps[:, 0]
    if zps is not None and s.zero_point_domain == "int":
        zps = zps.to(s.zero_point_dtype)
    qt = quantize(Q, s, scales.contiguous(), None if zps is None else zps.contiguous())
    return qt, {"damp": used, "dead_columns": int(dead.sum())}


@dataclass
class GPTQ(Algorithm):
    """GPTQ as a calibration-loop algorithm: accumulates ``E[x x^T]`` of each group's
    input (one Hessian for q/k/v, one for gate/up), then quantizes each linear with
    ``gptq_quantize``.

    Example::

        >>> GPTQ(act_order=False).params()
        {'block_size': 128, 'damp': 0.01, 'act_order': False}
    """

    block_size: int = 128
    damp: float = 0.01
    act_order: bool = True
    observer: object = None

    name = "gptq"
    observes = True

    def __post_init__(self):
        _check_params(self.block_size, self.damp)
        if not isinstance(self.act_order, bool):
            raise ValueError(f"gptq act_order must be true or false, got {self.act_order!r}")
        self._h: dict[int, torch.Tensor] = {}
        self._n: dict[int, int] = {}
        self._factor: dict[int, tuple] = {}
        self.log: list[dict] = []

    def observe(self, index: int, group: LinearGroup, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self._h[index] = add_gram(self._h.get(index), x, torch.float32)
        self._n[index] = self._n.get(index, 0) + x.shape[0]

    def quantize(self, name: str, linear: nn.Linear, scheme, index: int | None) -> QTensor:
        if index is None or (index not in self._h and index not in self._factor):
            return super().quantize(name, linear, scheme, index)
        if index not in self._factor:  # one factorization per Hessian (q, k and v share theirs)
            self._factor.clear()  # the loop quantizes group after group: the earlier ones are done
            # memory: H is scratch, released inside inverse_factor (a Llama-2-7B down_proj's
            # is 485 MB); all that is kept of it is its diagonal
            h = self._h.pop(index).div_(self._n[index])
            diag = h.diagonal().double()
            dead, _, perm = _order(diag, self.act_order)
            h = _prepared(h, dead, perm)
            self._factor[index] = (*inverse_factor(h, float(self.damp), "gptq", consume=True), diag)
            del h
        u, used, diag = self._factor[index]
        qt, info = gptq_quantize(linear.weight.detach(), diag, scheme, block_size=self.block_size, damp=self.damp,
                                 act_order=self.act_order, observer=self.observer, what="gptq", factor=(u, used))
        self.log.append({"module": name, **info})
        return qt

    def end_layer(self) -> None:
        self._h.clear()
        self._n.clear()
        self._factor.clear()

    def params(self) -> dict:
        return {"block_size": self.block_size, "damp": self.damp, "act_order": self.act_order}


__all__ = ["GPTQ", "gptq_quantize"]
