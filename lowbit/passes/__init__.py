"""Quantization as passes over torch.export programs.

``export`` turns a causal LM into an ExportedProgram; each pass takes an
ExportedProgram and returns a new one (the input is never changed), is tested on its
own, composes with the others and is idempotent:

* ``quantize_weights(ep, recipe)``: the selected linears' float weights become codes,
  scales and zero points (buffers) and plain aten ops that dequantize them before an
  unchanged ``aten.linear`` (the "dequantize in the graph" form);
* ``fuse(ep)``: ``linear(x, dequantize(W))``, matched op for op, becomes
  ``lowbit.weight_only_matmul(x, W)``: no float copy of a weight;
* ``lower(ep, device)``: records in each lowbit matmul node's metadata which kernel runs
  it on the target and why (``node.meta["custom"]["lowbit_kernels"]``).

Example::

    >>> import torch, lowbit
    >>> from lowbit.passes import quantize_weights, fuse, op_counts
    >>> m = torch.nn.Sequential(torch.nn.Linear(64, 32)).requires_grad_(False)
    >>> ep = torch.export.export(m, (torch.randn(2, 64),))
    >>> fused = fuse(quantize_weights(ep, {"weight": "int8-sym", "modules": ["^0$"]}))
    >>> op_counts(fused)["lowbit.weight_only_matmul"]
    1
"""

from .activations import calibrate, observer_problem, quantize_activations
from .export import export
from .fuse import fuse
from .lower import lower
from .program import op_counts
from .weights import embedding_problem, quantize_weights, rounding_problem


def eager_reason(recipe) -> str | None:
    """Why the passes cannot quantize with ``recipe`` by themselves (so the eager model is
    quantized first, ``lowbit.quantize_model``, then exported), or None when they can.

    Example::

        >>> from lowbit.passes import eager_reason
        >>> eager_reason("w8a8") is None, eager_reason("w4a16-g128:gptq")[:36]
        (True, "recipe 'w4a16-g128:gptq' rounds weig")
    """
    from ..recipe import Recipe

    r = Recipe.get(recipe)
    return rounding_problem(r) or embedding_problem(r) or (observer_problem(r) if r.static_activations else None)


__all__ = ["export", "quantize_weights", "calibrate", "quantize_activations", "fuse", "lower", "op_counts",
           "eager_reason"]
