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
