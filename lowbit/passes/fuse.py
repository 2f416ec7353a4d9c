"""The fusion pass: ``linear(x, dequantize(W))`` -> lowbit's weight-only matmul, and
``linear(dequantize(quantize(x)), dequantize(W))`` -> lowbit's integer matmul, found by
pattern matching (``dequant.match``, ``activations.match_qdq``) and replaced by
``lowbit.linear`` itself, traced: the fused program runs the ops an eager ``QuantLinear``
runs, with the same arguments."""

from __future__ import annotations

import functools

import torch
from torch import fx
from torch.export import ExportedProgram

from ..ops import linear
from ..qtensor import QTensor
from ..scheme import QuantScheme, check_act_weight
from . import dequant
from .activations import match_qdq
from .program import Edit, Example, trace, value_key

aten = torch.ops.aten
# the activation forms tried on a linear that does not say which it has (``quantize_activations``
# records it in the linear's metadata)
ACT_FORMS = ("int8-sym-token", "int8-asym-token", "int8-sym-tensor", "int8-asym-tensor", "int8-sym-g32")
MATMUL_OPS = ("weight_only_matmul", "int8_linear", "linear_qta8a_qga4w", "linear_a8_blocks")


@functools.lru_cache(maxsize=256)
def _linear_graph(weight: str, n: int, k: int, x_key: tuple, act: str | None, bias: torch.dtype | None,
                  static: tuple | None) -> fx.GraphModule:
    """``lowbit.linear`` traced for a weight of scheme ``weight`` [n, k] given as its
    parts, inputs ``(x, codes, scale[, zero_point][, bias][, act_scale[, act_zero_point]])``."""
    w = QuantScheme.parse(weight)
    shape = torch.Size((n, k))
    device = x_key[2]
    examples = [Example(*x_key), Example(w.packed_shape(shape), w.code_dtype, device),
                Example(w.scale_shape(shape), w.scale_dtype, device)]
    if not w.symmetric:
        examples.append(Example(w.scale_shape(shape), w.zero_point_dtype, device))
    if bias is not None:
        examples.append(Example((n,), bias, device))
    if static is not None:
        examples += [Example((1,), dtype, device) for dtype in static if dtype is not None]

    def f(x, codes, scale, *rest):
        rest = list(rest)
        zp = None if w.symmetric else rest.pop(0)
        b = rest.pop(0) if bias is not None else None
        return linear(x, QTensor(codes, scale, zp, w, shape), b, act_scheme=act, act_scale=rest[0] if rest else None,
                      act_zero_point=rest[1] if len(rest) > 1 else None)

    return trace(f, examples)


def fuse(ep: ExportedProgram) -> ExportedProgram:
    """Rewrite every ``aten.linear`` whose weight is the dequantization of the program's
    quantized parts (as ``quantize_weights`` writes it, matched op for op) into the ops
    ``lowbit.linear`` runs on those parts: ``lowbit.weight_only_matmul``, or, when its
    input is a quantize -> dequantize pair as ``quantize_activations`` writes it and the
    weight takes those activations, the integer matmul (``lowbit.int8_linear``,
    ``linear_qta8a_qga4w``, ``linear_a8_blocks``) on the pair's input.  A weight that
    ``quantize_weights`` dequantizes with ``lowbit.dequantize`` because it is in the "min"
    domain (q * s + m, ``lowbit.ops.matmul.min_form``) goes the same way, its parts as the
    QTensor holds them.  No float copy of the weight is made.  The replaced ops go when
    nothing else reads them.  Anything else stays as it is: a weight computed any other
    way, a dequantized weight that feeds another op, a ``lowbit.dequantize`` of a scheme
    the matmul ops do not take (2/3-bit codes).  Idempotent.

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
    is_state = lambda n: edit.state(n) is not None  # noqa: E731
    old = []
    for node in edit.call_functions(aten.linear.default):
        x, weight, bias = (list(node.args) + [None])[:3]
        found = dequant.quantized_parts(weight, is_state)
        if found is None:
            continue
        w, parts = found
        n, k = weight.meta["val"].shape
        act, act_inputs, static = None, [], None
        hint = node.meta.get("custom", {}).get("lowbit_activation")
        for s in [hint] if hint else ACT_FORMS:
            found = match_qdq(x, s, is_state)
            if found is None:
                continue
            try:
                check_act_weight(w, s, k)
            except ValueError:
                break  # these weights do not take these activations: the pair stays, fused weight-only
            x, act_inputs = found
            act = s
            static = tuple(a.meta["val"].dtype for a in act_inputs) or None
            break
        if len(parts) == 3 and parts[2].meta["val"].dtype != w.zero_point_dtype:
            continue  # an int8/int32 zero point: the matmul ops take it, a QTensor does not
        graph = _linear_graph(str(w), n, k, value_key(x.meta["val"]), act,
                              None if bias is None else bias.meta["val"].dtype, static)
        with edit.graph.inserting_before(node):
            y = edit.inline(graph, [x, *parts, *([bias] if bias is not None else []), *act_inputs], like=node)
        for new in edit.created:
            if new.op == "call_function" and getattr(new.target, "namespace", None) == "lowbit" \
                    and new.target._opname in MATMUL_OPS:
                new.meta.setdefault("custom", {}).update(node.meta.get("custom", {}))
        edit.created.clear()
        old += [node.args[0], weight]
        node.replace_all_uses_with(y)
        edit.graph.erase_node(node)
    edit.erase_unused(old)
    return edit.program()
