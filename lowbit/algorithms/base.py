"""What every algorithm shares: the view of a decoder layer the calibration loop hands
over (``LinearGroup``), the events an algorithm reacts to (``Algorithm``), and the
fake quantization of a block of weights with given scales (``fake_quantize_columns``).

The loop (``lowbit.models.calibrate``) runs, for each decoder layer: a pass for the
transforms (``observe`` then ``transform``: AWQ and SmoothQuant fold scales into the
float layer), a pass for the weight quantizer when it ``observes`` (GPTQ's Hessian),
``quantize`` for every selected linear, then the quantized layer over the calibration
activations to make the next layer's inputs.  Algorithms never call the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..kernels import reference
from ..ops import quantize as _quantize
from ..qtensor import QTensor
from ..scheme import QuantScheme


@dataclass
class LinearGroup:
    """Linears of one decoder layer that read the same input, and the op whose output
    channels are that input (``prev``: an RMSNorm or a linear, None when a scale cannot
    be folded into it).  ``names`` and ``linears`` hold every consumer of the input (a
    folded scale must be compensated in all of them); ``schemes`` maps the names the
    recipe quantizes to their weight scheme.  ``prev_channels`` [in_features]: which
    output channel of ``prev`` each input channel is (None: the same one); with
    grouped-query attention every v channel feeds the o channels of several heads, so a
    scale must be the same on all of them (``tie``).

    Example::

        >>> import torch
        >>> g = LinearGroup(["mlp.down_proj"], [torch.nn.Linear(8, 4)], None, {"mlp.down_proj": "int8-sym"})
        >>> g.in_features, g.quantized
        (8, ['mlp.down_proj'])
    """

    names: list[str]
    linears: list[nn.Linear]
    prev: nn.Module | None
    schemes: dict[str, str] = field(default_factory=dict)
    prev_channels: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.linears[0].in_features

    @property
    def quantized(self) -> list[str]:
        return [n for n in self.names if n in self.schemes]

    def weight(self) -> torch.Tensor:
        """The group's weights stacked [sum of out_features, in_features], float32."""
        return torch.cat([m.weight.detach().float() for m in self.linears])

    def tie(self, s: torch.Tensor) -> torch.Tensor:
        """``s`` [in_features] made equal on the input channels that come from one channel
        of ``prev`` (their geometric mean), so that it can be folded; unchanged when
        every input channel has its own."""
        if self.prev_channels is None:
            return s
        idx = self.prev_channels
        n = int(idx.max()) + 1
        log_sum = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, s.double().log())
        count = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, torch.ones_like(idx, dtype=torch.float64))
        return (log_sum / count).exp()[idx].to(s.dtype)

    def fold(self, s: torch.Tensor) -> None:
        """Divide the input of the group by ``s`` [in_features] (in ``prev``'s output
        channels) and multiply every consumer's weight columns by ``s``: the float
        function is unchanged up to rounding.  New parameters replace the old ones
        (computed in float64, rounded once), so a model copy that shares its tensors
        with the original (``quantize_model(..., inplace=False)``) leaves it untouched.
        With ``prev_channels``, ``s`` must be tied (``tie``)."""
        s = s.double()
        p = self.prev
        if self.prev_channels is not None:
            if not torch.allclose(self.tie(s), s, rtol=1e-9, atol=0):
                raise ValueError(f"the scales of {self.names} differ on input channels that share one channel "
                                 "of the op before them; tie them first (LinearGroup.tie)")
            s_prev = torch.ones(p.out_features, dtype=torch.float64).index_copy_(0, self.prev_channels, s)
        else:
            s_prev = s
        results = [(p, p.weight.double() / (s_prev[:, None] if isinstance(p, nn.Linear) else s_prev))]
        results += [(c, c.weight.double() * s) for c in self.linears]
        for mod, scaled in results:
            if not bool((scaled.abs() <= torch.finfo(mod.weight.dtype).max).all()):
                raise ValueError(f"folding scales into the input of {self.names} would overflow "
                                 f"{mod.weight.dtype} (scales {float(s.min()):.3g}..{float(s.max()):.3g}); "
                                 "use a smaller alpha or a float32 model")
        if isinstance(p, nn.Linear):
            _replace(p, "weight", p.weight.double() / s_prev[:, None])
            if p.bias is not None:
                _replace(p, "bias", p.bias.double() / s_prev)
        else:
            _replace(p, "weight", p.weight.double() / s_prev)
        for m in self.linears:
            _replace(m, "weight", m.weight.double() * s)


def _replace(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.detach().to(old.dtype), requires_grad=False))


# Rows of X^T X computed at a time by add_gram: only the blocks on and right of the
# diagonal are multiplied (the rest is their mirror), which halves the work; blocks of 128
# rows keep each product a few MB whatever K, and the GEMMs efficient.
GRAM_BLOCK_ROWS = 128


def add_gram(acc: torch.Tensor | None, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``acc + x^T x`` for ``x`` [rows, K] (float32 products of the batch, summed into the
    symmetric ``acc`` [K, K] in place; None starts a sum in ``dtype``).  Only the upper block
    triangle is multiplied, a block of ``GRAM_BLOCK_ROWS`` rows at a time; the lower one
    is copied from it, so the sum is exactly symmetric.

    Example::

        >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> add_gram(None, x)
        tensor([[10., 14.],
                [14., 20.]], dtype=torch.float64)
    """
    k = x.shape[1]
    if acc is None:
        acc = torch.zeros(k, k, dtype=dtype, device=x.device)
    for r0 in range(0, k, GRAM_BLOCK_ROWS):
        r1 = min(k, r0 + GRAM_BLOCK_ROWS)
        acc[r0:r1, r0:] += x[:, r0:r1].T @ x[:, r0:]
        d = acc[r0:r1, r0:r1]
        d.copy_(d.triu() + d.triu(1).T)  # exactly symmetric, as the GEMM's (i, j) and (j, i) need not be
        acc[r1:, r0:r1] = acc[r0:r1, r1:].T
    return acc


def token_sample(x: torch.Tensor, tokens: int | None, max_tokens: int, batch: int) -> torch.Tensor:
    """About ``max_tokens`` of the ``tokens`` calibration rows, taken from the rows ``x``
    [rows, K] of one batch at a stride, with an offset that moves from batch to batch (so
    the sample is not always position 0 of each sequence, the attention sink).  A copy:
    a view would keep the whole batch alive."""
    stride = max(1, (tokens or x.shape[0]) // max_tokens)
    return x[(batch * 7919) % stride::stride].clone()


class Algorithm:
    """Round to nearest with min-max scales: the base every method refines.

    Subclasses set ``observes`` (the loop runs a calibration pass and calls ``observe``
    with each group's input before ``quantize``) or ``transforms`` (a pass with
    ``observe``, then ``transform`` folds scales into the float layer), and override the
    events they need.  ``params()`` is what a checkpoint records.

    Example::

        >>> import torch
        >>> qt = Algorithm().quantize("fc", torch.nn.Linear(64, 8), "int4-asym-g32", None)
        >>> qt.scheme, tuple(qt.shape)
        (QuantScheme('int4-asym-g32'), (8, 64))
    """

    name = "rtn"
    observes = False
    transforms = False

    def start(self, tokens: int) -> None:
        """Calibration begins: ``tokens`` calibration tokens will pass each layer."""

    def observe(self, index: int, group: LinearGroup, x: torch.Tensor) -> None:
        """``x``: a batch of the input of group ``index`` of the current layer."""

    def transform(self, groups: list[LinearGroup]) -> None:
        """Fold scales into the float layer (its function unchanged)."""

    def quantize(self, name: str, linear: nn.Linear, scheme: str | QuantScheme, index: int | None) -> QTensor:
        """The quantized weight of ``linear`` (module ``name``, in group ``index`` of the
        current layer, or None outside the decoder layers)."""
        return _quantize(linear.weight.detach().float(), scheme)

    def end_layer(self) -> None:
        """Drop the statistics of the layer just quantized."""

    def params(self) -> dict:
        return {}


def fake_quantize_columns(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                          s: QuantScheme) -> torch.Tensor:
    """``dequantize(quantize(w))`` of the columns ``w`` [N, C] that share the scale and
    zero point [N] (one block per row), with exactly the arithmetic of lowbit's quantize
    and dequantize (``lowbit.scheme``), in float32.

    Example::

        >>> import torch
        >>> s = QuantScheme.parse("int4-asym-g32")
        >>> fake_quantize_columns(torch.tensor([[0.0, 0.3, 1.5]]), torch.tensor([0.1]), torch.tensor([0]), s)
        tensor([[0.0000, 0.3000, 1.5000]])
    """
    per_row = replace(s, granularity="channel", group_size=None)  # one block per row of w
    q = reference.rounded_codes(w.float(), scale, zero_point, per_row).clamp(s.qmin, s.qmax)
    return reference.dequantize(q, scale, zero_point, per_row, torch.float32)


__all__ = ["Algorithm", "LinearGroup", "fake_quantize_columns", "add_gram"]
