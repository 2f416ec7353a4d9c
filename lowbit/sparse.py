"""2:4 semi-structured sparsity combined with quantized weights.

A weight W [N, K] is 2:4 sparse when every group of 4 consecutive input channels
(``W[n, 4t:4t+4]``) holds at most 2 non-zeros.  ``Sparse24QTensor`` stores such a
weight as the 2 kept values of each group of 4 and their positions:

    values   a ``QTensor`` [N, K/2]: the kept values of row n in increasing column order
             (kept value 2t and 2t+1 are the first and second of group t), quantized with
             any lowbit scheme.  The scheme's groups run along this compressed axis: a
             group of G kept values covers 2G consecutive input channels (so
             ``int4-asym-g32`` stores one scale per 32 kept values, as dense g32 does per
             32 values).  K/2 must be a multiple of the group size and of the scheme's
             ``pack_unit`` (8 for u32-packed 4-bit codes): K a multiple of 16 for int4.
    indices  uint8 [N, K/8]: the position (0..3) of kept value j inside its group of 4,
             2 bits each, packed 4 per byte as ``lowbit.ops.pack_bits(pos, 2, "u8")`` lays
             them out (value j in bits 2j..2j+1 of byte j // 4, so byte b holds groups
             2b and 2b+1, the first group in the low nibble).  The two positions of a group
             are strictly increasing.  K must be a multiple of 8 (whole bytes).

Dequantized, the weight is ``densify(sqt)``: zeros everywhere but the kept positions,
which hold ``dequantize(values)``.  Bytes: ``values.nbytes + N * K / 8`` (int4 g32 with
float16 scale and uint8 zero point: 3.375 bits per dense weight; dense: 4.75).

The reference ``sparse_linear`` is ``x @ densify(sqt).T`` in float32.  There is no fast
path: an AVX2 sparse int4 GEMV (``benchmarks/sparse_gemv.cpp``) ran at 0.88-1.12x the
speed of lowbit's dense W4A16 kernel at M=1 on one Zen 2 thread (SmolLM2's shapes and
4096x4096; ``benchmarks/sparse.py``): the 31% fewer bytes do not pay for picking x by the
positions.  torch's semi-structured sparse tensors
(``torch.sparse.to_sparse_semi_structured``) run on CUDA only; nothing here uses or tests them.

Example::

    >>> import torch
    >>> from lowbit.sparse import sparsify, densify, sparse_linear
    >>> w = torch.randn(8, 64)
    >>> sqt = sparsify(w, "int8-sym")
    >>> d = densify(sqt)
    >>> bool((d.view(8, 16, 4) != 0).sum(-1).le(2).all()), sqt.bits_per_weight
    (True, 5.5)
    >>> x = torch.randn(3, 64)
    >>> torch.allclose(sparse_linear(x, sqt), x @ d.T, atol=1e-5)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn

from . import _validate
from .ops import dequantize, pack_bits, quantize, unpack_bits
from .ops.quant import as_scheme
from .qtensor import QTensor
from .scheme import QuantScheme


def _check_weight(name: str, w, multiple: int = 4) -> torch.Tensor:
    _validate.tensor(name, w, dtypes=_validate.FLOAT_DTYPES, ndim=2)
    if w.shape[1] % multiple:
        raise ValueError(f"{name}.shape[1]={w.shape[1]} (in_features) must be a multiple of {multiple} "
                         f"for 2:4 sparsity{' with 2-bit indices packed 4 per byte' if multiple == 8 else ''}")
    _validate.finite(name, w)
    return w


def check_mask(mask, shape) -> None:
    """Raise unless ``mask`` is a bool tensor of ``shape`` [N, K] keeping exactly 2 of
    every 4 consecutive entries of a row.

    Example::

        >>> check_mask(torch.tensor([[True, False, True, False]]), (1, 4))
        >>> check_mask(torch.tensor([[True, True, True, False]]), (1, 4))
        Traceback (most recent call last):
        ...
        ValueError: mask must keep exactly 2 of every 4 consecutive entries of a row; row 0, columns 0..3 keep 3
    """
    _validate.tensor("mask", mask, dtypes=[torch.bool], ndim=2)
    _validate.shape("mask", mask, shape, "the weight's [N, K]")
    kept = mask.view(shape[0], -1, 4).sum(-1)
    bad = (kept != 2).nonzero()
    if len(bad):
        n, t = bad[0].tolist()
        raise ValueError(f"mask must keep exactly 2 of every 4 consecutive entries of a row; row {n}, "
                         f"columns {4 * t}..{4 * t + 3} keep {int(kept[n, t])}")


def prune_2_4(w: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
    """The 2:4 mask (bool [N, K]) that keeps, in each group of 4 consecutive input
    channels of every row of ``w`` [N, K], the 2 entries with the largest ``scores``
    (default ``|w|``); ties go to the lower column.

    Example::

        >>> prune_2_4(torch.tensor([[0.1, -3.0, 2.0, 0.5]]))
        tensor([[False,  True,  True, False]])
    """
    _check_weight("w", w)
    if scores is None:
        scores = w.abs()
    else:
        _validate.tensor("scores", scores, dtypes=_validate.FLOAT_DTYPES)
        _validate.shape("scores", scores, w.shape, "same as w")
        _validate.finite("scores", scores)
    n, k = w.shape
    top = torch.argsort(scores.reshape(n, k // 4, 4), dim=-1, descending=True, stable=True)[..., :2]
    return torch.zeros(n, k // 4, 4, dtype=torch.bool, device=w.device).scatter_(-1, top, True).view(n, k)


@dataclass(frozen=True)
class Sparse24QTensor:
    """A 2:4 sparse quantized weight: ``values`` (QTensor [N, K/2]), ``indices`` (uint8
    [N, K/8]) and the dense ``shape`` [N, K]; see the module docstring for the layout.
    Build it with ``sparsify`` or ``lowbit.algorithms.sparsegpt.sparsegpt_quantize``.

    Example::

        >>> sqt = sparsify(torch.randn(16, 64), "int4-asym-g32-f16")
        >>> sqt.values.shape, sqt.indices.shape, sqt.nbytes, sqt.bits_per_weight
        (torch.Size([16, 32]), torch.Size([16, 8]), 432, 3.375)
    """

    values: QTensor
    indices: torch.Tensor
    shape: torch.Size

    def __post_init__(self) -> None:
        # Shapes and dtypes as QTensor's (a mismatch would make a kernel read past a buffer),
        # then, when the indices hold values (not under a trace), that each group's two
        # positions increase: a repeated position would silently drop a kept value.
        shape = torch.Size(self.shape)
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.values, QTensor):
            raise TypeError(f"values must be a lowbit.QTensor, got {type(self.values).__name__}")
        if len(shape) != 2 or shape[1] % 8:
            raise ValueError(f"shape must be [N, K] with K a multiple of 8 (2:4 groups, indices in whole bytes), "
                             f"got {tuple(shape)}")
        n, k = shape
        if tuple(self.values.shape) != (n, k // 2):
            raise ValueError(f"values must have shape {(n, k // 2)} (the 2 kept of every 4 of {tuple(shape)}), "
                             f"got {tuple(self.values.shape)}")
        _validate.tensor("indices", self.indices, dtypes=[torch.uint8])
        _validate.shape("indices", self.indices, (n, k // 8), "2-bit positions, 4 per byte")
        _validate.same_device("values", self.values.codes, indices=self.indices)
        if _validate.has_values(self.indices):
            pos = self.positions().view(n, k // 4, 2)
            bad = (pos[..., 0] >= pos[..., 1]).nonzero()
            if len(bad):
                r, t = bad[0].tolist()
                raise ValueError(f"indices must hold two increasing positions per group of 4; row {r}, group {t} "
                                 f"(columns {4 * t}..{4 * t + 3}) has {pos[r, t].tolist()}")

    @property
    def scheme(self) -> QuantScheme:
        return self.values.scheme

    @property
    def nbytes(self) -> int:
        """Bytes of the kept values' codes, scales and zero points, and of the indices."""
        return self.values.nbytes + self.indices.numel()

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per dense weight (N * K of them)."""
        return 8 * self.nbytes / self.shape.numel()

    def positions(self) -> torch.Tensor:
        """The position (0..3) of each kept value inside its group of 4, uint8 [N, K/2]."""
        return unpack_bits(self.indices, 2, "u8", signed=False)

    def __repr__(self) -> str:
        return f"Sparse24QTensor(shape={tuple(self.shape)}, scheme='{self.scheme}', nbytes={self.nbytes})"


def compress(w: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept values [N, K/2] of ``w`` [N, K] under the 2:4 ``mask`` and their packed
    indices (uint8 [N, K/8]); ``w`` and ``mask`` are checked by the caller.

    Example::

        >>> kept, idx = compress(torch.arange(8.0).view(1, 8), prune_2_4(torch.arange(8.0).view(1, 8)))
        >>> kept, idx   # positions 2, 3 and 2, 3: 0b11_10 = 14 per group
        (tensor([[2., 3., 6., 7.]]), tensor([[238]], dtype=torch.uint8))
    """
    n, k = w.shape
    kept = w[mask].view(n, k // 2)  # row-major: each row's kept values in increasing column order
    pos = (mask.nonzero()[:, 1] % 4).view(n, k // 2).to(torch.uint8)
    return kept, pack_bits(pos, 2, "u8")


def sparsify(w: torch.Tensor, scheme: QuantScheme | str, mask: torch.Tensor | None = None) -> Sparse24QTensor:
    """Prune ``w`` [N, K] to 2:4 (``mask``, default ``prune_2_4(w)``: magnitude) and
    round the kept values to nearest under ``scheme`` (groups along the kept values).

    Example::

        >>> w = torch.tensor([[0.1, -3.0, 2.0, 0.5, 1.0, 0.0, 0.0, -1.0]])
        >>> densify(sparsify(w, "int8-sym")).mul(100).round().int()   # scale 3 / 127.5
        tensor([[   0, -301,  200,    0,   99,    0,    0,  -99]], dtype=torch.int32)
    """
    s = as_scheme(scheme)
    _check_weight("w", w, 8)
    n, k = w.shape
    if s.granularity == "group" and (k // 2) % s.group_size:
        raise ValueError(f"scheme '{s}': group_size={s.group_size} must divide the {k // 2} kept values of a row "
                         f"(groups run along the compressed axis, K/2 = {k}/2)")
    if s.is_packed and (k // 2) % s.pack_unit:
        raise ValueError(f"scheme '{s}': the {k // 2} kept values of a row must be a multiple of {s.pack_unit} to "
                         f"pack {s.bits}-bit codes (w.shape[1] a multiple of {2 * s.pack_unit})")
    if s.granularity == "token":
        raise ValueError(f"scheme '{s}' is per token; a weight is quantized per tensor, channel or group")
    if mask is None:
        mask = prune_2_4(w)
    else:
        check_mask(mask, w.shape)
    kept, idx = compress(w, mask)
    return Sparse24QTensor(quantize(kept.contiguous(), s), idx, w.shape)


def densify(sqt: Sparse24QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight [N, K] as ``dtype``: ``dequantize(values)`` at the kept positions
    (one rounding, as ``lowbit.dequantize``), exact zeros elsewhere.

    Example::

        >>> densify(sparsify(torch.ones(2, 16), "int8-asym"), torch.bfloat16)[0, :4]
        tensor([1., 1., 0., 0.], dtype=torch.bfloat16)
    """
    if not isinstance(sqt, Sparse24QTensor):
        raise TypeError(f"sqt must be a lowbit.sparse.Sparse24QTensor, got {type(sqt).__name__}")
    _validate.float_dtype("dtype", dtype)
    n, k = sqt.shape
    cols = torch.arange(k // 2, device=sqt.indices.device) // 2 * 4 + sqt.positions().long()
    return torch.zeros(n, k, dtype=dtype, device=cols.device).scatter_(1, cols, dequantize(sqt.values, dtype))


def sparse_linear(x: torch.Tensor, sqt: Sparse24QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ densify(sqt).T + bias`` computed in float32 and rounded once to x's dtype
    (the reference: there is no fast path).  ``x`` [..., K] float; ``bias`` [N].

    Example::

        >>> sqt = sparsify(torch.randn(4, 16), "int4-sym-g8")
        >>> sparse_linear(torch.randn(2, 3, 16, dtype=torch.bfloat16), sqt, torch.zeros(4)).shape
        torch.Size([2, 3, 4])
    """
    _validate.tensor("x", x, dtypes=_validate.FLOAT_DTYPES, min_ndim=1)
    if not isinstance(sqt, Sparse24QTensor):
        raise TypeError(f"sqt must be a lowbit.sparse.Sparse24QTensor, got {type(sqt).__name__}")
    n, k = sqt.shape
    if x.shape[-1] != k:
        raise ValueError(f"x.shape[-1]={x.shape[-1]} does not match the weight's in_features={k}")
    if bias is not None:
        _validate.tensor("bias", bias, dtypes=_validate.FLOAT_DTYPES, ndim=1)
        _validate.shape("bias", bias, (n,), "[out_features]")
    _validate.same_device("x", x, indices=sqt.indices, bias=bias)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(cdt) @ densify(sqt, cdt).T
    return (y if bias is None else y + bias.to(cdt)).to(x.dtype)


class SparseQuantLinear(nn.Module):
    """``y = sparse_linear(x, sqt, bias)``: an ``nn.Linear`` with a 2:4 sparse quantized weight.

    Example::

        >>> lin = SparseQuantLinear.from_linear(torch.nn.Linear(64, 32), "int4-asym-g32")
        >>> lin(torch.randn(2, 64)).shape, lin
        (torch.Size([2, 32]), SparseQuantLinear(in_features=64, out_features=32, weight='int4-asym-g32', bits/w=3.625))
    """

    def __init__(self, sqt: Sparse24QTensor, bias: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(sqt, Sparse24QTensor):
            raise TypeError(f"sqt must be a lowbit.sparse.Sparse24QTensor, got {type(sqt).__name__}")
        self.out_features, self.in_features = sqt.shape
        self.scheme = sqt.scheme
        # buffers (state dict, .to()); sqt rebuilds the validated tensor when they change
        self.register_buffer("codes", sqt.values.codes)
        self.register_buffer("scale", sqt.values.scale)
        self.register_buffer("zero_point", sqt.values.zero_point)
        self.register_buffer("indices", sqt.indices)
        self._cached = sqt
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def sqt(self) -> Sparse24QTensor:
        c = self._cached
        if (c.values.codes is not self.codes or c.values.scale is not self.scale
                or c.values.zero_point is not self.zero_point or c.indices is not self.indices):
            n, k = self.out_features, self.in_features
            values = QTensor(self.codes, self.scale, self.zero_point, self.scheme, (n, k // 2))
            c = self._cached = Sparse24QTensor(values, self.indices, (n, k))
        return c

    @classmethod
    def from_linear(cls, lin: nn.Linear, scheme: QuantScheme | str, mask: torch.Tensor | None = None):
        """Magnitude-prune (or apply ``mask``) and round ``lin.weight`` in float32; keep its bias."""
        return cls(sparsify(lin.weight.detach().float(), scheme, mask), lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparse_linear(x, self.sqt, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, weight='{self.sqt.scheme}', "
                f"bits/w={self.sqt.bits_per_weight:.3f}")


def _flatten(sqt: Sparse24QTensor):
    return [sqt.values, sqt.indices], tuple(sqt.shape)


def _flatten_with_keys(sqt: Sparse24QTensor):
    return [(pytree.GetAttrKey("values"), sqt.values), (pytree.GetAttrKey("indices"), sqt.indices)], tuple(sqt.shape)


def _unflatten(children, context) -> Sparse24QTensor:
    return Sparse24QTensor(children[0], children[1], torch.Size(context))


pytree.register_pytree_node(
    Sparse24QTensor, _flatten, _unflatten,
    serialized_type_name="lowbit.Sparse24QTensor", flatten_with_keys_fn=_flatten_with_keys,
)

__all__ = ["Sparse24QTensor", "SparseQuantLinear", "check_mask", "compress", "densify", "prune_2_4",
           "sparse_linear", "sparsify"]
