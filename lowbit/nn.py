"""Modules that hold quantized weights: drop-in replacements for ``nn.Linear`` and
``nn.Embedding``.

Their state dict holds the packed codes, scales and zero points (``weight.codes``,
``weight.scale``, ``weight.zero_point``), never a float copy of the weight, and, for a
calibrated per-tensor activation scheme, the static ``act_scale`` (and ``act_zero_point``);
the schemes are module attributes (saved in a checkpoint's ``lowbit.json``).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ._validate import has_values as _has_values
from .ops import choose_qparams, linear, quantize
from .ops.matmul import _one_row
from .ops.quant import _check_qparams
from .qtensor import QTensor, SplitQTensor
from .scheme import QuantScheme


def act_qparams_from_range(act_scheme: str | QuantScheme, min_val, max_val) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Static scale [1] and zero point ([1], None for a symmetric scheme) of a per-tensor
    activation scheme for activations observed in ``[min_val, max_val]``.

    The rule is ``lowbit.ops.choose_qparams``'s, applied to the two-element float32 tensor
    ``[min_val, max_val]``: a per-tensor scheme depends only on a tensor's min and max (the
    symmetric scale on ``max(|min|, |max|)``, the asymmetric one on ``[min(min, 0),
    max(max, 0)]``), so these are the qparams ``choose_qparams`` gives any tensor with that
    range.

    Example::

        >>> from lowbit.nn import act_qparams_from_range
        >>> scale, zp = act_qparams_from_range("int8-asym-tensor", -1.0, 3.0)
        >>> round(scale.item(), 6), zp.item()
        (0.015686, 64)
    """
    s = act_scheme if isinstance(act_scheme, QuantScheme) else QuantScheme.parse(str(act_scheme))
    if s.granularity != "tensor":
        raise ValueError(f"act_scheme must be per tensor to have a static range, got '{s}'")
    bounds = []
    for name, v in (("min_val", min_val), ("max_val", max_val)):
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ValueError(f"{name} must hold one value, got shape {tuple(v.shape)}")
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
        bounds.append(float(v))
    if bounds[0] > bounds[1]:
        raise ValueError(f"min_val={bounds[0]} is greater than max_val={bounds[1]}")
    # A packed scheme's last dim must fill whole words; repeating min_val keeps min and max.
    bounds += [bounds[0]] * max(s.pack_unit - 2, 0)
    return choose_qparams(torch.tensor(bounds, dtype=torch.float32), s)


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
        c, b = self._cached, self._buffers  # the buffers read directly: nn.Module's __getattr__ costs ~1 us each
        if c is None or c.codes is not b["codes"] or c.scale is not b["scale"] or c.zero_point is not b["zero_point"]:
            c = self._cached = QTensor(self.codes, self.scale, self.zero_point, self.scheme, self.shape)
        return c

    @property
    def nbytes(self) -> int:
        return self.qtensor().nbytes

    def extra_repr(self) -> str:
        return f"'{self.scheme}', shape={tuple(self.shape)}"


@functools.lru_cache(maxsize=64)
def _per_tensor_scheme(act_scheme: str | None) -> QuantScheme | None:
    # cached: forward asks on every call, and parsing a scheme string costs ~10 us
    s = None if act_scheme is None else QuantScheme.parse(act_scheme)
    return s if s is not None and s.granularity == "tensor" else None


class QuantLinear(nn.Module):
    """``y = x @ W.T + bias`` with W quantized (``lowbit.linear``): weight-only
    (W8A16/W4A16) or, with ``act_scheme``, 8-bit activations (W8A8/W4A8).

    ``input_order`` (int64 [in_features], a permutation; None: the identity) says that
    column j of ``qweight`` multiplies input feature ``input_order[j]``: forward computes
    ``linear(x[..., input_order], qweight)``.  It is how act-order GPTQ checkpoints
    (``desc_act``), whose quantization groups gather scattered input channels, load with
    their groups as consecutive columns; ``dequantized_weight()`` gives W in the input's
    order.

    A per-token ``act_scheme`` quantizes each row of x on the fly.  A per-tensor one
    (``'int8-sym-tensor'``, ``'int8-asym-tensor'``) uses a static, calibrated scale: the
    buffers ``act_scale`` ([1], the scheme's scale dtype) and ``act_zero_point`` ([1] uint8,
    asymmetric schemes), None until ``set_act_qparams`` or ``set_act_range`` stores them;
    ``forward`` refuses to run before.

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
                 act_scheme: str | QuantScheme | None = None, backend: str | None = None,
                 input_order: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(qweight, QTensor) or len(qweight.shape) != 2:
            raise TypeError("qweight must be a 2-D lowbit.QTensor [out_features, in_features]")
        self.out_features, self.in_features = qweight.shape
        if input_order is not None:
            _check_order(input_order, self.in_features, qweight.codes.device)
        self.register_buffer("input_order", input_order)  # None: not in the state dict
        self.weight = _QuantWeight(qweight)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.act_scheme = None if act_scheme is None else str(QuantScheme.parse(str(act_scheme)))
        self.backend = backend
        act = self._static_act()
        if act is not None and act.zero_point_domain == "float":
            # lowbit.linear feeds the integer kernels an int32 activation zero point
            raise ValueError(f"act_scheme '{act}' has a float zero point; a static per-tensor activation "
                             "scheme needs an integer one (e.g. 'int8-asym-tensor')")
        # static per-tensor activation qparams: None until calibrated (None buffers are not
        # in the state dict, so an uncalibrated module saves none)
        self.register_buffer("act_scale", None)
        self.register_buffer("act_zero_point", None)

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

    def _static_act(self) -> QuantScheme | None:
        """The activation scheme when it is per tensor (static qparams), else None."""
        return _per_tensor_scheme(self.act_scheme)

    @property
    def act_calibrated(self) -> bool:
        """False only for a per-tensor act_scheme whose static scale is not set yet."""
        return self.act_scale is not None or self._static_act() is None

    def set_act_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> None:
        """Store the static activation scale (and zero point) of a per-tensor ``act_scheme``.

        ``scale``: shape [1], the scheme's scale dtype (float32 unless the scheme says
        ``-f16``/``-bf16``), finite and > 0.  ``zero_point``: None for a symmetric scheme,
        else uint8 [1] in the code range.  They are copied to the weight's device.

        Example::

            >>> import torch
            >>> from lowbit.nn import QuantLinear
            >>> q = QuantLinear.from_linear(torch.nn.Linear(64, 32), "int8-sym", act_scheme="int8-sym-tensor")
            >>> q.set_act_qparams(torch.tensor([0.02]))
            >>> q(torch.randn(2, 64)).shape
            torch.Size([2, 32])
        """
        s = self._static_act()
        if s is None:
            raise ValueError(f"set_act_qparams needs a per-tensor act_scheme (static activation scale), "
                             f"this QuantLinear has act_scheme={self.act_scheme!r}")
        device = self.weight.codes.device
        if isinstance(scale, torch.Tensor):
            scale = scale.detach().to(device)
        if isinstance(zero_point, torch.Tensor):
            zero_point = zero_point.detach().to(device)
        # lowbit.linear's own checks of a static act_scale / act_zero_point (dtype, shape [1],
        # finite and > 0, zero point in the code range), run here once, before storing
        _check_qparams(torch.empty(0, device=device), s, scale, zero_point, names=("act_scale", "act_zero_point"))
        # copies: two modules given the same tensor (q/k/v share an input) keep their own
        # storage, which save_quantized needs (it writes a shared tensor once)
        self.act_scale = scale.clone()
        self.act_zero_point = None if zero_point is None else zero_point.clone()

    def set_act_range(self, min_val, max_val) -> None:
        """``set_act_qparams`` with the qparams of activations observed in ``[min_val, max_val]``
        (``act_qparams_from_range``)."""
        s = self._static_act()
        if s is None:
            raise ValueError(f"set_act_range needs a per-tensor act_scheme (static activation scale), "
                             f"this QuantLinear has act_scheme={self.act_scheme!r}")
        self.set_act_qparams(*act_qparams_from_range(s, min_val, max_val))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        if b["act_scale"] is None and b["input_order"] is None and self.backend is None:
            # dynamic or no activation quantization: one row in eager mode runs the weight's
            # prepared kernel (lowbit.linear's own shortcut), without the general path's checks
            y = _one_row(x, self._modules["weight"].qtensor(), self.bias, self.act_scheme)
            if y is not None:
                return y
        if self.act_scale is None and self._static_act() is not None:
            raise ValueError(f"activation scale not calibrated: act_scheme '{self.act_scheme}' quantizes the "
                             f"input of this QuantLinear ({self.in_features} -> {self.out_features}) with a "
                             "static per-tensor scale; set it with set_act_qparams(scale, zero_point) or "
                             "set_act_range(min, max) from calibration data")
        return self._linear(x, self.act_scheme, self.act_scale, self.act_zero_point)

    def forward_with_activations(self, x: torch.Tensor, act_scheme: str) -> torch.Tensor:
        """This linear with its input quantized dynamically by ``act_scheme`` (for example
        ``"int8-sym-g32"``) in place of its own activations; the module is not changed
        (``lowbit.Runner``'s ``act_compute``).

        Example::

            >>> import torch
            >>> from lowbit.nn import QuantLinear
            >>> q = QuantLinear.from_linear(torch.nn.Linear(64, 32, bias=False), "int4-sym-g32-f16")
            >>> x = torch.randn(2, 64)
            >>> y = q.forward_with_activations(x, "int8-sym-g32")
            >>> y.shape, q.act_scheme, torch.allclose(y, q(x), atol=0.1)
            (torch.Size([2, 32]), None, True)
        """
        return self._linear(x, act_scheme, None, None)

    def _linear(self, x, act_scheme, act_scale, act_zero_point):
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        return linear(x, self.weight.qtensor(), self.bias, act_scheme=act_scheme, act_scale=act_scale,
                      act_zero_point=act_zero_point, backend=self.backend)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out_features, in_features] this module multiplies x by, its
        columns in the input's order (``input_order`` undone).

        Example::

            >>> import torch
            >>> from lowbit.nn import QuantLinear
            >>> q = QuantLinear.from_linear(torch.nn.Linear(64, 32, bias=False), "int8-sym")
            >>> x = torch.randn(2, 64)
            >>> torch.allclose(q(x), x @ q.dequantized_weight().T, atol=1e-5)
            True
        """
        from .ops import dequantize

        w = dequantize(self.weight.qtensor(), dtype)
        if self.input_order is None:
            return w
        return w.index_select(1, torch.argsort(self.input_order))

    def extra_repr(self) -> str:
        act = None if self.act_scheme is None else f"'{self.act_scheme}'"
        order = "" if self.input_order is None else ", input_order=permuted"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight='{self.weight.scheme}', act={act}{order}")


class _SplitWeight(nn.Module):
    """The parts of a ``SplitQTensor``: submodules ``low`` and ``high`` (each a weight's
    codes / scale / zero point) and the buffer ``outliers``."""

    def __init__(self, st: SplitQTensor):
        super().__init__()
        self.low, self.high = _QuantWeight(st.low), _QuantWeight(st.high)
        self.register_buffer("outliers", st.outliers)
        self._cached: SplitQTensor | None = st

    def qtensor(self) -> SplitQTensor:
        c, low, high = self._cached, self.low.qtensor(), self.high.qtensor()
        if c is None or c.low is not low or c.high is not high or c.outliers is not self.outliers:
            c = self._cached = SplitQTensor(low, high, self.outliers)
        return c

    @property
    def nbytes(self) -> int:
        return self.qtensor().nbytes

    def extra_repr(self) -> str:
        return (f"low='{self.low.scheme}', high='{self.high.scheme}', outliers={self.outliers.numel()}, "
                f"shape={tuple(self.low.shape)}")


class SplitQuantLinear(nn.Module):
    """``y = x @ W.T + bias`` with a mixed int8/int4 weight (``lowbit.SplitQTensor``): the
    outlier input channels at 8 bits, the others at 4 (``lowbit.split_quantize``), one
    ``lowbit::split_matmul`` without a float copy of W.  Weight-only.

    It is a module of its own, not a ``QuantLinear``: lowbit checkpoints hold it (module
    kind "split"), GGUF and compressed-tensors have no split layout and refuse it by name
    rather than write half of it, and the native decode step leaves a model with one to
    the Python path.

    Example::

        >>> import torch
        >>> from lowbit.nn import SplitQuantLinear
        >>> q = SplitQuantLinear.from_linear(torch.nn.Linear(64, 32), "int4-asym-g32", outliers=16)
        >>> q(torch.randn(2, 64)).shape
        torch.Size([2, 32])
        >>> q.extra_repr()
        "in_features=64, out_features=32, bias=True, weight='int4-asym-g32' + 16 outlier channels 'int8-sym'"
    """

    def __init__(self, qweight: SplitQTensor, bias: torch.Tensor | None = None, backend: str | None = None):
        super().__init__()
        if not isinstance(qweight, SplitQTensor):
            raise TypeError(f"qweight must be a lowbit.SplitQTensor, got {type(qweight).__name__}")
        self.out_features, self.in_features = qweight.shape
        self.weight = _SplitWeight(qweight)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.backend = backend

    @classmethod
    def from_linear(cls, lin: nn.Linear, scheme: str | QuantScheme, outliers, *, high: str = "int8-sym",
                    x_sq: torch.Tensor | None = None, by: str = "error", backend: str | None = None):
        """``lowbit.split_quantize`` of ``lin.weight`` (in float32), keeping its bias."""
        from .ops import split_quantize

        st = split_quantize(lin.weight.detach().float(), scheme, outliers, high=high, x_sq=x_sq, by=by)
        return cls(st, lin.bias, backend)

    @property
    def qweight(self) -> SplitQTensor:
        return self.weight.qtensor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight.qtensor(), self.bias, backend=self.backend)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from .ops import dequantize

        return dequantize(self.weight.qtensor(), dtype)

    def extra_repr(self) -> str:
        w = self.weight
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight='{w.low.scheme}' + {w.outliers.numel()} outlier channels '{w.high.scheme}'")


def _check_order(order, k: int, device) -> None:
    """``order`` must be an int64 permutation of range(k) on the weight's device."""
    if not isinstance(order, torch.Tensor) or order.dtype != torch.int64 or tuple(order.shape) != (k,):
        raise ValueError(f"input_order must be an int64 tensor of shape ({k},) (in_features), got "
                         f"{getattr(order, 'dtype', type(order).__name__)} {tuple(getattr(order, 'shape', ()))}")
    if order.device != device:
        raise ValueError(f"input_order is on {order.device}, the weight on {device}")
    if _has_values(order) and not torch.equal(torch.sort(order).values, torch.arange(k, device=device)):
        raise ValueError(f"input_order must be a permutation of 0..{k - 1} (each input feature once)")


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


__all__ = ["QuantLinear", "QuantEmbedding", "SplitQuantLinear", "act_qparams_from_range"]
