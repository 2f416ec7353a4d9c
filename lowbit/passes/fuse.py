"""The fusion pass: ``linear(x, dequantize(W))`` -> ``lowbit.weight_only_matmul(x, W)``,
found by pattern matching (``lowbit.passes.dequant.match``)."""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from .dequant import match
from .program import Edit

aten = torch.ops.aten


def fuse(ep: ExportedProgram) -> ExportedProgram:
    """Rewrite every ``aten.linear`` whose weight is the dequantization of the program's
    quantized parts (as ``quantize_weights`` writes it, matched op for op) into one
    ``lowbit.weight_only_matmul`` on those parts (plus the bias), so no float copy of
    the weight is made.  The dequantizing ops go when nothing else reads them.  Anything
    else is left as it is: a weight computed any other way, a dequantized weight that
    feeds another op, a ``lowbit.dequantize`` of a scheme the matmul ops do not take.
    Idempotent.

    Example::

        >>> import torch
        >>> from lowbit.passes import quantize_weights, fuse, op_counts
        >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64)).requires_grad_(False)
        >>> ep = quantize_weights(torch.export.export(m, (torch.randn(2, 64),)), {"weight": "int4-sym-g32",
        ...                                                                      "modules": ["^0$"]})
        >>> f = fuse(ep)
        >>> op_counts(f)["lowbit.weight_only_matmul"], op_counts(f)["aten.linear"], op_counts(f)["aten.bitwise_and"]
        (1, 0, 0)
        >>> x = torch.randn(2, 64)
        >>> torch.allclose(f.module()(x), ep.module()(x), atol=1e-5)
        True
    """
    edit = Edit(ep)
    old = []
    for node in edit.call_functions(aten.linear.default):
        x, weight, bias = (list(node.args) + [None])[:3]
        form = match(weight, lambda n: edit.state(n) is not None)
        if form is None:
            continue
        with edit.graph.inserting_before(node):
            y = mm = edit.call(torch.ops.lowbit.weight_only_matmul.default,
                               (x, form.codes, form.scale, form.zero_point, form.bits, form.group_size), like=node)
            if bias is not None:
                b = bias
                if bias.meta["val"].dtype != mm.meta["val"].dtype:
                    b = edit.call(aten._to_copy.default, (bias,), {"dtype": mm.meta["val"].dtype}, like=node)
                y = edit.call(aten.add.Tensor, (mm, b), like=node)
        mm.meta.setdefault("custom", {}).update(node.meta.get("custom", {}))
        node.replace_all_uses_with(y)
        edit.graph.erase_node(node)
        old.append(weight)
    edit.erase_unused(old)
    return edit.program()
