"""Activation quantization as passes: ``calibrate`` observes the input range of the
linears a recipe gives static (per-tensor) activations, ``quantize_activations`` puts
a quantize -> dequantize pair before each linear whose recipe quantizes its
activations (per token, per tensor from calibration, or in int8 blocks), in the form
``lowbit.linear`` quantizes them; ``fuse`` turns the pair, the dequantized weight and
the linear into lowbit's integer matmul."""

from __future__ import annotations

import functools
import math

import torch
from torch import fx
from torch.export import ExportedProgram

from ..nn import act_qparams_from_range
from ..ops import dequantize, dequantize_per_token, quantize, quantize_per_token
from ..recipe import Recipe
from ..scheme import QuantScheme, check_act_weight
from . import dequant
from .program import Edit, Example, trace, value_key
from .weights import module_of

aten = torch.ops.aten

# -- the observer op ------------------------------------------------------------------------------
_LIB = torch.library.Library("lowbit", "FRAGMENT")  # noqa: TOR901 (lives as long as lowbit)
_LIB.define("observe_range(Tensor x, str key) -> ()")
_RANGES: dict[str, tuple[float, float]] = {}


def _observe_range(x, key):
    if x.numel():
        lo, hi = torch.aminmax(x.detach().float())
        old = _RANGES.get(key, (math.inf, -math.inf))
        _RANGES[key] = (min(old[0], lo.item()), max(old[1], hi.item()))


_LIB.impl("observe_range", _observe_range, "CompositeExplicitAutograd")
torch.library.register_fake("lowbit::observe_range", lambda x, key: None, lib=_LIB)
OBSERVE = torch.ops.lowbit.observe_range.default
fx.node.has_side_effect(OBSERVE)  # returns nothing: dead code elimination must keep it


# -- the quantize -> dequantize pair ----------------------------------------------------------------
def qdq(x: torch.Tensor, scheme: str, act_scale=None, act_zero_point=None) -> torch.Tensor:
    """``x`` quantized and dequantized the way ``lowbit.linear`` quantizes the activations
    of ``scheme`` (rows of x per token, all of x with a static scale, blocks along K), in
    x's shape and dtype.

    Example::

        >>> import torch
        >>> from lowbit.passes.activations import qdq
        >>> x = torch.randn(2, 3, 64)
        >>> bool(((qdq(x, "int8-sym-token") - x).abs() <= x.abs().amax(-1, keepdim=True) / 254 + 1e-6).all())
        True
    """
    s = QuantScheme.parse(scheme)
    x2 = x.reshape(-1, x.shape[-1])
    if s.granularity == "token":
        d = dequantize_per_token(*quantize_per_token(x2, 8, s.symmetric))
    elif s.granularity == "tensor":
        d = dequantize(quantize(x2, s, act_scale, act_zero_point), x.dtype)
    else:  # blocks: quantized in float32, as linear_a8_blocks does
        d = dequantize(quantize(x2.float(), s), torch.float32)
    return d.to(x.dtype).reshape(x.shape)


@functools.lru_cache(maxsize=256)
def _qdq_graph(scheme: str, x_key: tuple, static: tuple | None) -> fx.GraphModule:
    x = Example(*x_key)
    if static is None:
        return trace(lambda x_: qdq(x_, scheme), [x])
    scale = Example((1,), static[0], x.device)
    zp = None if static[1] is None else Example((1,), static[1], x.device)
    if zp is None:
        return trace(lambda x_, s_: qdq(x_, scheme, s_), [x, scale])
    return trace(lambda x_, s_, z_: qdq(x_, scheme, s_, z_), [x, scale, zp])


def qdq_graph(scheme: str, x_val, static: tuple | None = None) -> fx.GraphModule:
    """The traced quantize -> dequantize pair of ``scheme`` for a value like ``x_val``
    (``static``: the dtypes of a static scale and zero point)."""
    return _qdq_graph(scheme, value_key(x_val), static)


def match_qdq(value: fx.Node, scheme: str, is_state) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(x, [act_scale, act_zero_point])`` when ``value`` is exactly ``qdq(x, scheme, ...)``
    as ``quantize_activations`` writes it (static qparams: tensors of the program), else None."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    s = QuantScheme.parse(scheme)
    static = None
    if s.granularity == "tensor":
        static = (s.scale_dtype, None if s.symmetric else torch.uint8)
    template = qdq_graph(scheme, val, static)
    placeholders = [n for n in template.graph.nodes if n.op == "placeholder"]
    out = next(n for n in template.graph.nodes if n.op == "output").args[0]

    def leaf_ok(t, node):
        if t is placeholders[0]:
            v = node.meta.get("val")
            return isinstance(v, torch.Tensor) and v.dtype == val.dtype and v.dim() == val.dim()
        v = node.meta.get("val")
        return is_state(node) and tuple(v.shape) == (1,) and v.dtype == t.meta["val"].dtype

    mapping: dict = {}
    if not dequant.same(out, value, mapping, leaf_ok):
        return None
    return mapping[placeholders[0]], [mapping[p] for p in placeholders[1:]]


# -- calibrate ------------------------------------------------------------------------------------
def _act_linears(edit: Edit, recipe: Recipe):
    """(linear node, module name, activation scheme) of each linear with a quantized weight
    whose recipe scheme quantizes its activations."""
    for node in edit.call_functions(aten.linear.default):
        name = module_of(node)
        chosen = None if name is None else recipe.scheme_for(name)
        if chosen is None or chosen[1] is None:
            continue
        if dequant.quantized_parts(node.args[1], lambda n: edit.state(n) is not None) is None:
            continue  # a float weight: lowbit quantizes the activations of quantized linears only
        yield node, name, QuantScheme.parse(chosen[1])


def observer_problem(recipe: Recipe) -> str | None:
    """Why ``calibrate`` cannot observe ``recipe``'s static activation ranges (it observes
    min and max), or None."""
    if recipe.act_observer != "minmax":
        return (f"calibrate observes min and max; the recipe's act_observer '{recipe.act_observer}' runs in "
                "lowbit.quantize_model")
    return None


def calibrate(ep: ExportedProgram, recipe: Recipe | str | dict, calibration: torch.Tensor) -> ExportedProgram:
    """Observe the input range of every quantized linear whose recipe gives it static
    (per-tensor) activations: insert ``lowbit.observe_range`` nodes before them, run each
    row of ``calibration`` (token ids [samples, length]) through that program, and record
    ``[min, max]`` in the linear's ``node.meta["custom"]["lowbit_act_range"]``.  The
    returned program holds no observer.  Idempotent for the same data (the same ranges).

    Example::

        >>> import torch
        >>> from lowbit.passes import calibrate, quantize_weights
        >>> m = torch.nn.Sequential(torch.nn.Embedding(16, 64), torch.nn.Linear(64, 8)).requires_grad_(False)
        >>> recipe = {"weight": "int8-sym", "activation": "int8-sym-tensor", "modules": ["^1$"]}
        >>> ep = quantize_weights(torch.export.export(m, (torch.zeros(1, 4, dtype=torch.long),)), recipe)
        >>> c = calibrate(ep, recipe, torch.tensor([[1, 2, 3, 4]]))
        >>> lo, hi = next(n.meta["custom"]["lowbit_act_range"] for n in c.graph.nodes if n.target == torch.ops.aten.linear.default)
        >>> (lo, hi) == (m[0].weight[1:5].min().item(), m[0].weight[1:5].max().item())
        True
    """
    recipe = Recipe.get(recipe)
    if observer_problem(recipe):
        raise ValueError(observer_problem(recipe))
    if not isinstance(calibration, torch.Tensor) or calibration.dtype != torch.int64 or calibration.dim() != 2 \
            or calibration.numel() == 0:
        raise ValueError("calibration must be token ids: a non-empty int64 tensor [samples, length]")
    observed = Edit(ep)
    keys = {}
    for node, name, s in _act_linears(observed, recipe):
        if s.granularity == "tensor":
            with observed.graph.inserting_before(node):
                observed.call(OBSERVE, (node.args[0], node.name), like=node)
            keys[node.name] = name
    if not keys:
        raise ValueError(f"recipe '{recipe.name}' gives no quantized linear of this program static (per-tensor) "
                         "activations: nothing to calibrate")
    program = observed.program().module()
    device = observed.device
    _RANGES.clear()
    try:
        with torch.inference_mode():
            for row in calibration.to(device):
                program(row[None])
        ranges = dict(_RANGES)
    finally:
        _RANGES.clear()
    edit = Edit(ep)
    for node in edit.graph.nodes:
        if node.name in keys:
            if node.name not in ranges:
                raise ValueError(f"module '{keys[node.name]}' saw no activation during calibration")
            node.meta.setdefault("custom", {})["lowbit_act_range"] = list(ranges[node.name])
    return edit.program()


# -- quantize_activations ---------------------------------------------------------------------------
def quantize_activations(ep: ExportedProgram, recipe: Recipe | str | dict) -> ExportedProgram:
    """Quantize the input of every quantized linear (its weight as ``quantize_weights``
    wrote it) whose recipe scheme has activations: a quantize -> dequantize pair (``qdq``:
    lowbit's per-token / per-tensor / block ops) before the linear.  A per-tensor scheme
    takes its static scale (and zero point) from the range ``calibrate`` recorded, stored
    as the buffers ``<module>.act_scale`` / ``.act_zero_point`` (``QuantLinear``'s names);
    without a range it is refused.  Idempotent: a linear whose input already is the pair
    is left alone.

    Example::

        >>> import torch
        >>> from lowbit.passes import quantize_weights, quantize_activations, op_counts
        >>> m = torch.nn.Sequential(torch.nn.Linear(64, 8)).requires_grad_(False)
        >>> recipe = {"weight": "int8-sym", "activation": "int8-asym-token", "modules": ["^0$"]}
        >>> ep = quantize_activations(quantize_weights(torch.export.export(m, (torch.randn(2, 64),)), recipe),
        ...                           recipe)
        >>> op_counts(ep)["lowbit.quantize_per_token"], op_counts(ep)["lowbit.dequantize_per_token"]
        (1, 1)
    """
    recipe = Recipe.get(recipe)
    edit = Edit(ep)
    is_state = lambda n: edit.state(n) is not None  # noqa: E731
    for node, name, s in list(_act_linears(edit, recipe)):
        x = node.args[0]
        if match_qdq(x, str(s), is_state) is not None:
            continue
        w, _ = dequant.quantized_parts(node.args[1], is_state)
        k = x.meta["val"].shape[-1]
        try:
            check_act_weight(w, s, k)
        except ValueError as e:
            raise ValueError(f"cannot quantize the activations of module '{name}': {e}") from None
        inputs = [x]
        if s.granularity == "tensor":
            found = node.meta.get("custom", {}).get("lowbit_act_range")
            if found is None:
                raise ValueError(f"module '{name}' has static activations '{s}' but no calibrated range: "
                                 "run lowbit.passes.calibrate(ep, recipe, calibration) first")
            scale, zp = act_qparams_from_range(s, *found)
            inputs.append(edit.add_buffer(f"{name}.act_scale", scale))
            if zp is not None:
                inputs.append(edit.add_buffer(f"{name}.act_zero_point", zp))
        static = None if s.granularity != "tensor" else (s.scale_dtype, None if s.symmetric else torch.uint8)
        graph = qdq_graph(str(s), x.meta["val"], static)
        with edit.graph.inserting_before(node):
            out = edit.inline(graph, inputs, like=node)
        node.replace_input_with(x, out)
        node.meta.setdefault("custom", {})["lowbit_activation"] = str(s)
    return edit.program()
