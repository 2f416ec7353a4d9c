"""The dequantized weight as plain aten ops in a graph, and the matcher that finds it.

The weight quantization pass writes a quantized linear as ``linear(x, W)`` with W
computed in the graph from the weight's matmul parts (``lowbit.ops.matmul.weight_parts``:
8-bit codes [N, K], or 4-bit codes as int32 words [N, K/8]; scale [N, G]; zero point
[N, G] or none), with the arithmetic of the reference (``kernels.reference.
dequantize_weight``): codes -> float32, minus the zero point, times the scale, rounded
once to the weight's dtype.  For 4-bit words::

    q = (codes.unsqueeze(-1) >> [0, 4, ..., 28]) & 15      # nibble j of a word is value j
    q = (q ^ 8) - 8                                          # signed codes (no zero point)
    w = ((q.view(N, G, K/G).float() - zp[..., None]) * scale[..., None]).view(N, K).to(dtype)

``emit`` writes these nodes; ``match`` proves that a linear's weight is exactly such a
subgraph by writing the template for the parts it finds and comparing the two graphs
node by node (ops, literal arguments and which tensor goes where): a weight computed in
any other way, even one that differs only in a constant, does not match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..ops.matmul import min_form
from ..scheme import QuantScheme

aten = torch.ops.aten


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# what the matmul ops take (lowbit.ops.matmul._check_weight): (part, bits, zero point?) -> dtypes
_LEAF_DTYPES = {
    **{("codes", 4, zp): (torch.int32,) for zp in (False, True)},
    ("codes", 8, False): (torch.int8,), ("codes", 8, True): (torch.uint8,),
    **{("scale", b, zp): _FLOATS for b in (4, 8) for zp in (False, True)},
    **{("zero_point", b, True): (torch.uint8, torch.int8, torch.int32, *_FLOATS) for b in (4, 8)},
}


def parts_scheme(bits: int, group_size: int, k: int, scale_dtype: torch.dtype,
                 zero_point_dtype: torch.dtype | None, zero_point_min: bool = False) -> QuantScheme:
    """The weight scheme of matmul parts (``weight_parts``' form): per channel when one
    group spans K, a float zero point in the "float" domain (the "min" one with
    ``zero_point_min``, the matmul ops' flag), none: symmetric.

    Example::

        >>> import torch
        >>> from lowbit.passes.dequant import parts_scheme
        >>> parts_scheme(4, 64, 576, torch.float16, torch.uint8), parts_scheme(8, 576, 576, torch.float32, None)
        (QuantScheme('int4-asym-g64-f16'), QuantScheme('int8-sym'))
    """
    return QuantScheme(bits=bits, symmetric=zero_point_dtype is None,
                       granularity="channel" if group_size == k else "group",
                       group_size=None if group_size == k else group_size, scale_dtype=scale_dtype,
                       zero_point_domain="min" if zero_point_min else "float"
                       if zero_point_dtype is not None and zero_point_dtype.is_floating_point else "int")


@dataclass(frozen=True)
class DequantForm:
    """What one dequantized weight of the graph is made of (the matmul ops' arguments)."""

    codes: fx.Node
    scale: fx.Node
    zero_point: fx.Node | None
    bits: int
    group_size: int

    def scheme(self) -> QuantScheme:
        """The weight scheme whose matmul parts these are."""
        k = self.codes.meta["val"].shape[1] * (8 if self.bits == 4 else 1)
        zp = None if self.zero_point is None else self.zero_point.meta["val"].dtype
        return parts_scheme(self.bits, self.group_size, k, self.scale.meta["val"].dtype, zp)


def emit(call, codes, scale, zero_point, *, bits: int, group_size: int, n: int, k: int, dtype: torch.dtype,
         device: torch.device):
    """Write the aten ops computing the float [n, k] weight of ``dtype`` from its parts;
    ``call(target, args, kwargs)`` inserts one node.  Returns the weight's node."""
    q = codes
    if bits == 4:
        shifts = call(aten.arange.start_step, (0, 32, 4), {"dtype": torch.int32, "device": device})
        q = call(aten.bitwise_right_shift.Tensor, (call(aten.unsqueeze.default, (q, -1)), shifts))
        q = call(aten.bitwise_and.Scalar, (q, 15))
        if zero_point is None:  # sign-extend the nibble: 8..15 -> -8..-1
            q = call(aten.sub.Tensor, (call(aten.bitwise_xor.Scalar, (q, 8)), 8))
    groups = k // group_size
    q = call(aten.view.default, (call(aten._to_copy.default, (q,), {"dtype": torch.float32}),
                                 [n, groups, group_size]))
    if zero_point is not None:
        zp = call(aten._to_copy.default, (zero_point,), {"dtype": torch.float32})
        q = call(aten.sub.Tensor, (q, call(aten.unsqueeze.default, (zp, -1))))
    s = call(aten._to_copy.default, (scale,), {"dtype": torch.float32})
    w = call(aten.view.default, (call(aten.mul.Tensor, (q, call(aten.unsqueeze.default, (s, -1)))), [n, k]))
    return w if dtype == torch.float32 else call(aten._to_copy.default, (w,), {"dtype": dtype})


def _template(leaves: dict[str, torch.Tensor], bits: int, group_size: int, n: int, k: int, dtype, device):
    """The graph ``emit`` writes for parts of these shapes, its placeholders named after
    the parts (``codes``, ``scale``, ``zero_point``)."""
    g = fx.Graph()
    ph = {name: g.placeholder(name) for name in leaves}
    w = emit(lambda target, args, kwargs=None: g.call_function(target, args, kwargs or {}),
             ph["codes"], ph["scale"], ph.get("zero_point"), bits=bits, group_size=group_size, n=n, k=k,
             dtype=dtype, device=device)
    return w


def same(t, a, mapping: dict, leaf_ok) -> bool:
    """Whether graph value ``a`` is computed as template value ``t``: the same ops with the
    same literal arguments, each template placeholder standing for one graph node that
    ``leaf_ok(placeholder, node)`` accepts (``mapping``: template placeholder -> graph
    node, filled as the walk meets them)."""
    if isinstance(t, fx.Node):
        if not isinstance(a, fx.Node):
            return False
        if t.op == "placeholder":
            if t in mapping:
                return mapping[t] is a
            if a in mapping.values() or not leaf_ok(t, a):
                return False
            mapping[t] = a
            return True
        if (a.op != "call_function" or a.target != t.target or len(a.args) != len(t.args)
                or a.kwargs.keys() != t.kwargs.keys()):
            return False
        return (all(same(x, y, mapping, leaf_ok) for x, y in zip(t.args, a.args))
                and all(same(t.kwargs[key], a.kwargs[key], mapping, leaf_ok) for key in t.kwargs))
    if isinstance(t, (list, tuple)):
        return isinstance(a, (list, tuple)) and len(t) == len(a) and all(
            same(x, y, mapping, leaf_ok) for x, y in zip(t, a))
    return type(t) is type(a) and t == a


def _hypotheses(leaves: list[fx.Node], n: int, k: int):
    """(bits, group_size, has zero point) that the leaf tensors' shapes and dtypes allow."""
    vals = [leaf.meta["val"] for leaf in leaves]
    floats = [v for v in vals if v.is_floating_point()]
    if not floats or floats[0].dim() != 2 or floats[0].shape[0] != n or not 0 < floats[0].shape[1] <= k:
        return []
    group = k // floats[0].shape[1]
    out = []
    for v in vals:
        if v.dim() == 2 and v.shape[0] == n:
            if v.dtype == torch.int32 and v.shape[1] * 8 == k:
                out += [(4, group, len(leaves) == 3)]
            if v.dtype in (torch.int8, torch.uint8) and v.shape[1] == k:
                out += [(8, group, len(leaves) == 3)]
    return out if len(leaves) in (2, 3) else []


def match(weight: fx.Node, is_state) -> DequantForm | None:
    """The parts of ``weight`` when it is exactly ``emit``'s dequantization of tensors of
    the program (``is_state(node)``: a parameter, buffer or constant placeholder), else
    None."""
    val = weight.meta.get("val")
    if weight.op != "call_function" or not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    n, k = val.shape
    if not isinstance(n, int) or not isinstance(k, int):
        return None
    leaves, seen, todo = [], set(), [weight]
    while todo:  # the placeholders the weight is computed from
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            if not is_state(node):
                return None  # computed from a user input: not a weight
            leaves.append(node)
        todo += node.all_input_nodes
    for bits, group, has_zp in _hypotheses(leaves, n, k):
        if k % group or (bits == 4 and group % 8):
            continue
        shapes = {"codes": (n, k // 8 if bits == 4 else k), "scale": (n, k // group)}
        if has_zp:
            shapes["zero_point"] = (n, k // group)
        template = _template(shapes, bits, group, n, k, val.dtype, val.device)
        mapping: dict = {}

        def leaf_ok(t, node, shapes=shapes, bits=bits, has_zp=has_zp):
            v = node.meta["val"]
            return is_state(node) and tuple(v.shape) == shapes[t.name] and v.dtype in _LEAF_DTYPES[t.name, bits, has_zp]
        if same(template, weight, mapping, leaf_ok):
            parts = {t.name: a for t, a in mapping.items()}
            return DequantForm(parts["codes"], parts["scale"], parts.get("zero_point"), bits, group)
    return None


def quantized_parts(weight: fx.Node, is_state) -> tuple[QuantScheme, list[fx.Node]] | None:
    """(scheme, [codes, scale(, zero_point)]) of a weight that is the dequantization of the
    program's tensors, as ``quantize_weights`` writes it: ``match``'s aten form (matmul
    parts), or a ``lowbit.dequantize`` of a "min"-domain scheme whose codes the matmul ops
    take (``lowbit.ops.matmul.min_form``: the QTensor's own parts); else None (a float
    weight, or 2/3-bit codes)."""
    form = match(weight, is_state)
    if form is not None:
        return form.scheme(), [form.codes, form.scale] + ([form.zero_point] if form.zero_point is not None else [])
    if weight.op != "call_function" or weight.target != torch.ops.lowbit.dequantize.default:
        return None
    codes, scale, zero_point, scheme, shape = weight.args[:5]
    w = QuantScheme.parse(scheme)
    if len(shape) != 2 or not min_form(w, shape[1]) or not all(is_state(p) for p in (codes, scale, zero_point)):
        return None
    return w, [codes, scale, zero_point]
