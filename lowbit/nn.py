"""Modules that hold quantized weights: drop-in replacements for ``nn.Linear`` and
``nn.Embedding``.

Their state dict holds the packed codes, scales and zero points (``weight.codes``,
``weight.scale``, ``weight.zero_point``), never a float copy of the weight; the
schemes are module attributes (saved in a checkpoint's ``lowbit.json``).
"""

from __future__ import annotations

import torch
from torch import nn

from ._validate import has_values as _has_values
from .ops import linear, quantize
from .qtensor import QTensor
from .scheme import QuantScheme


class _QuantWeight(nn.Module):
    """Buffers ``codes``, ``scale`` and (asymmetric schemes) ``zero_point`` of one
    quantized weight; ``qtensor()`` views them as a validated ``QTensor``."""

    def __init__(self, qt: QTensor):
        super().__init__()
        self.scheme = qt.scheme
        self.shape = torch.Size(qt.shape)
        self.register_buffer("codes", qt.codes)
        self.register_buffer("scale", qt.scale)
        self.register_buffer("zero_point", qt.zero_point)
        self._cached: QTensor | None = None

    def qtensor(self) -> QTensor:
        c = self._cached
        if c is None or c.codes is not self.codes or c.scale is not self.scale or c.zero_point is not self.zero_point:
            c = self._cached = QTensor(self.codes, self.scale, self.zero_point, self.scheme, self.shape)
        return c

    @property
    def nbytes(self) -> int:
        return self.qtensor().nbytes

    def extra_repr(self) -> str:
        return f"'{self.scheme}', shape={tuple(self.shape)}"


class QuantLinear(nn.Module):
    """``y = x @ W.T + bias`` with W quantized (``lowbit.linear``): weight-only
    (W8A16/W4A16) or, with ``act_scheme``, 8-bit activations (W8A8/W4A8).

    Example::

        >>> import torch, lowbit
        >>> from lowbit.nn import QuantLinear
        >>> lin = torch.nn.Linear(64, 32)
        >>> q = QuantLinear.from_linear(lin, "int4-asym-g32")
        >>> q(torch.randn(2, 64)).shape
        torch.Size([2, 32])
        >>> q.extra_repr()
        "in_features=64, out_features=32, bias=True, weight='int4-asym-g32', act=None"
    """

    def __init__(self, qweight: QTensor, bias: torch.Tensor | None = None,
                 act_scheme: str | QuantScheme | None = None, backend: str | None = None):
        super().__init__()
        if not isinstance(qweight, QTensor) or len(qweight.shape) != 2:
            raise TypeError("qweight must be a 2-D lowbit.QTensor [out_features, in_features]")
        self.out_features, self.in_features = qweight.shape
        self.weight = _QuantWeight(qweight)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.act_scheme = None if act_scheme is None else str(QuantScheme.parse(str(act_scheme)))
        self.backend = backend

    @classmethod
    def from_linear(cls, lin: nn.Linear, scheme: str | QuantScheme, act_scheme: str | QuantScheme | None = None,
                    backend: str | None = None) -> "QuantLinear":
        """Quantize ``lin.weight`` (round to nearest, in float32) and keep its bias."""
        w = lin.weight.detach()
        if not torch.isfinite(w).all():
            raise ValueError("the weight of the linear to quantize holds NaN or Inf")
        qt = quantize(w.float(), scheme)
        return cls(qt, lin.bias, act_scheme, backend)

    @property
    def qweight(self) -> QTensor:
        return self.weight.qtensor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight.qtensor(), self.bias, act_scheme=self.act_scheme, backend=self.backend)

    def extra_repr(self) -> str:
        act = None if self.act_scheme is None else f"'{self.act_scheme}'"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight='{self.weight.scheme}', act={act}")


class QuantEmbedding(nn.Module):
    """Token embedding with quantized rows: looks up the codes of the requested rows and
    dequantizes only those.

    Example::

        >>> import torch
        >>> from lowbit.nn import QuantEmbedding
        >>> e = QuantEmbedding.from_embedding(torch.nn.Embedding(100, 64), "int8-sym", torch.float32)
        >>> e(torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 64])
    """

    def __init__(self, qweight: QTensor, dtype: torch.dtype, padding_idx: int | None = None):
        super().__init__()
        if qweight.scheme.granularity == "tensor":
            raise ValueError("embedding rows are looked up one by one: use a per-channel or group scheme")
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.weight = _QuantWeight(qweight)
        self.dtype = dtype
        self.padding_idx = padding_idx

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, scheme: str | QuantScheme, dtype: torch.dtype | None = None):
        w = emb.weight.detach()
        if not torch.isfinite(w).all():
            raise ValueError("the embedding to quantize holds NaN or Inf")
        return cls(quantize(w.float(), scheme), dtype or w.dtype, emb.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from .ops import dequantize

        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"ids must be an int64 or int32 tensor, got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        qt = self.weight.qtensor()
        flat = ids.reshape(-1)
        if flat.device.type == "cuda":  # no host sync: a bad id stops the next kernel
            torch._assert_async(((flat >= 0) & (flat < self.num_embeddings)).all(),
                                f"QuantEmbedding: ids must lie in [0, {self.num_embeddings})")
        elif _has_values(flat) and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            bad = flat[(flat < 0) | (flat >= self.num_embeddings)][0].item()
            raise IndexError(f"ids must lie in [0, {self.num_embeddings}) (the vocabulary of this embedding), "
                             f"got {bad}")
        zp = None if qt.zero_point is None else qt.zero_point[flat]
        rows = QTensor(qt.codes[flat], qt.scale[flat], zp, qt.scheme, torch.Size((flat.numel(), self.embedding_dim)))
        return dequantize(rows, self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, weight='{self.weight.scheme}', dtype={self.dtype}"


__all__ = ["QuantLinear", "QuantEmbedding"]
