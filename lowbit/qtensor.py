"""QTensor: packed codes + scale + zero point + scheme + logical shape.

A plain container, not a ``torch.Tensor`` subclass: every use of the codes goes
through a named ``lowbit`` op (so torch.export graphs show ``lowbit.dequantize``
rather than an implicit dequantization hidden in ``__torch_dispatch__``), nothing
silently falls back to a float copy, and it is registered as a pytree node so it
can be passed into and out of ``torch.compile``d and exported functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from . import _validate
from .scheme import QuantScheme


@dataclass(frozen=True)
class QTensor:
    """A quantized tensor; build it with ``lowbit.quantize``.

    Attributes:
        codes: packed codes (``scheme.code_dtype``), last dim packed for sub-byte widths.
        scale: ``scheme.scale_dtype``, shape per granularity (see ``lowbit.scheme``).
        zero_point: None for symmetric schemes; uint8 ("int" domain) or
            ``scale_dtype`` ("float" domain), same shape as ``scale``.
        scheme: the ``QuantScheme``.
        shape: logical (unpacked) shape.

    Example::

        >>> import torch, lowbit
        >>> qt = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
        >>> qt.codes.shape, qt.scale.shape, qt.nbytes
        (torch.Size([16, 8]), torch.Size([16, 2]), 672)
        >>> lowbit.dequantize(qt, torch.bfloat16).shape
        torch.Size([16, 64])
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    scheme: QuantScheme
    shape: torch.Size

    def __post_init__(self) -> None:
        # Metadata only (works on fake tensors too): a mismatch here would make a kernel
        # read past the end of a buffer, so it is refused when the QTensor is built.
        s, shape = self.scheme, torch.Size(self.shape)
        object.__setattr__(self, "shape", shape)
        if not isinstance(s, QuantScheme):
            raise TypeError(f"scheme must be a QuantScheme, got {type(s).__name__}")
        if len(shape) == 0:
            raise ValueError("shape must have at least 1 dim")
        _validate.tensor("codes", self.codes, dtypes=[s.code_dtype])
        _validate.shape("codes", self.codes, s.packed_shape(shape), f"{tuple(shape)} packed as '{s}'")
        expected = s.scale_shape(shape)
        _validate.tensor("scale", self.scale, dtypes=[s.scale_dtype])
        _validate.shape("scale", self.scale, expected, f"granularity of '{s}'")
        if s.symmetric and self.zero_point is not None:
            raise ValueError(f"zero_point must be None for the symmetric scheme '{s}'")
        if not s.symmetric:
            if self.zero_point is None:
                raise ValueError(f"zero_point is required for the asymmetric scheme '{s}'")
            _validate.tensor("zero_point", self.zero_point, dtypes=[s.zero_point_dtype])
            _validate.shape("zero_point", self.zero_point, expected, "same as scale")
        _validate.same_device("codes", self.codes, scale=self.scale, zero_point=self.zero_point)

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and zero points together."""
        parts = [self.codes, self.scale] + ([self.zero_point] if self.zero_point is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def numel(self) -> int:
        return self.shape.numel()

    def to(self, device: torch.device | str) -> "QTensor":
        """The same quantized tensor on another device."""
        zp = None if self.zero_point is None else self.zero_point.to(device)
        return QTensor(self.codes.to(device), self.scale.to(device), zp, self.scheme, self.shape)

    def __repr__(self) -> str:
        return (f"QTensor(shape={tuple(self.shape)}, scheme='{self.scheme}', "
                f"codes={self.codes.dtype}{tuple(self.codes.shape)}, nbytes={self.nbytes})")


def _flatten(qt: QTensor):
    return [qt.codes, qt.scale, qt.zero_point], (qt.scheme, tuple(qt.shape))


def _flatten_with_keys(qt: QTensor):
    children, context = _flatten(qt)
    keys = [pytree.GetAttrKey(k) for k in ("codes", "scale", "zero_point")]
    return list(zip(keys, children)), context


def _unflatten(children, context) -> QTensor:
    scheme, shape = context
    return QTensor(children[0], children[1], children[2], scheme, torch.Size(shape))


pytree.register_pytree_node(
    QTensor, _flatten, _unflatten,
    serialized_type_name="lowbit.QTensor", flatten_with_keys_fn=_flatten_with_keys,
)


@dataclass(frozen=True)
class SplitQTensor:
    """A weight [N, K] whose input channels are split: a few outlier channels kept at
    high precision (int8), the rest at low precision (int4); build it with
    ``lowbit.split_quantize``.

    ``W = dequantize(low) + dequantize(high)`` placed at the columns ``outliers``:
    ``low`` is a QTensor [N, K] whose outlier columns hold zeros (their codes are the zero
    point), ``high`` a QTensor [N, len(outliers)].  ``low`` keeps all K columns so that its
    groups stay whole (K minus a few channels rarely divides by a group size); the zeros
    cost ``scheme.bits`` per outlier weight and are counted in ``bits_per_weight``.

    Attributes:
        low: the int4 (any 4- or 8-bit matmul scheme) part, shape [N, K].
        high: the outlier columns, shape [N, len(outliers)].
        outliers: int64 [len(outliers)], strictly increasing input channel indices.

    Example::

        >>> import torch, lowbit
        >>> w = torch.randn(16, 64)
        >>> st = lowbit.split_quantize(w, "int4-asym-g32", outliers=torch.tensor([3, 40]))
        >>> st.shape, st.high.shape, round(st.bits_per_weight, 3)
        (torch.Size([16, 64]), torch.Size([16, 2]), 6.031)
    """

    low: QTensor
    high: QTensor
    outliers: torch.Tensor

    def __post_init__(self) -> None:
        for name, qt in (("low", self.low), ("high", self.high)):
            if not isinstance(qt, QTensor) or len(qt.shape) != 2:
                raise TypeError(f"{name} must be a 2-D lowbit.QTensor, got {qt!r}")
        n, k = self.low.shape
        _validate.tensor("outliers", self.outliers, dtypes=[torch.int64], ndim=1)
        if self.outliers.numel() == 0:
            raise ValueError("outliers must hold at least one input channel")
        if tuple(self.high.shape) != (n, self.outliers.numel()):
            raise ValueError(f"high has shape {tuple(self.high.shape)}; expected [N, len(outliers)] = "
                             f"{[n, self.outliers.numel()]}")
        _validate.same_device("low", self.low.codes, high=self.high.codes, outliers=self.outliers)
        _validate.increasing_indices("outliers", self.outliers, k)

    @property
    def shape(self) -> torch.Size:
        return self.low.shape

    @property
    def nbytes(self) -> int:
        """Bytes of both parts (codes, scales, zero points) and of the outlier indices
        (stored as int16 where K allows it, as a file would)."""
        index_bytes = 2 if self.shape[1] <= 2**15 else 4
        return self.low.nbytes + self.high.nbytes + self.outliers.numel() * index_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.shape.numel()

    @property
    def device(self) -> torch.device:
        return self.low.device

    def numel(self) -> int:
        return self.shape.numel()

    def to(self, device: torch.device | str) -> "SplitQTensor":
        """The same split tensor on another device."""
        return SplitQTensor(self.low.to(device), self.high.to(device), self.outliers.to(device))

    def __repr__(self) -> str:
        return (f"SplitQTensor(shape={tuple(self.shape)}, low='{self.low.scheme}', high='{self.high.scheme}', "
                f"outliers={self.outliers.numel()}, nbytes={self.nbytes})")


pytree.register_pytree_node(
    SplitQTensor, lambda st: ([st.low, st.high, st.outliers], None),
    lambda children, _: SplitQTensor(*children),
    serialized_type_name="lowbit.SplitQTensor",
    flatten_with_keys_fn=lambda st: ([(pytree.GetAttrKey(k), getattr(st, k)) for k in ("low", "high", "outliers")],
                                     None),
)
