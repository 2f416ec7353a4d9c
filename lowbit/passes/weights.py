"""The weight quantization pass: the float weight of each linear a recipe selects becomes
its quantized parts (buffers) and the ops that dequantize them in the graph, before an
unchanged ``aten.linear``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx
from torch.export import ExportedProgram

from ..ops import quantize
from ..ops.matmul import matmul_form, weight_parts
from ..qtensor import QTensor
from ..recipe import Recipe, fit_group
from ..scheme import check_act_weight
from . import dequant
from .program import Edit

aten = torch.ops.aten


def module_of(node: fx.Node) -> str | None:
    """The path of the module whose forward made ``node`` (``model.layers.0.mlp.up_proj``),
    from the module stack torch.export records; None when it recorded none."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else None


def rounding_problem(recipe: Recipe) -> str | None:
    """Why ``quantize_weights`` cannot round ``recipe``'s weights itself (it rounds to
    nearest with min-max scales), or None."""
    if recipe.method != "rtn" or recipe.observer != "minmax" or recipe.smoothquant is not None:
        return (f"recipe '{recipe.name}' rounds weights by method {recipe.method!r} (observer {recipe.observer!r}, "
                f"smoothquant {recipe.smoothquant!r}); the pass rounds to nearest with min-max scales")
    return None


def embedding_problem(recipe: Recipe) -> str | None:
    """Why the graph passes cannot quantize ``recipe``'s embedding (they quantize linears), or None."""
    if recipe.embedding is not None:
        return f"recipe '{recipe.name}' quantizes the embedding; the graph pass quantizes linears"
    return None


def quantize_weights(ep: ExportedProgram, recipe: Recipe | str,
                     quantizer: Callable[[str, torch.Tensor, str], QTensor] | None = None) -> ExportedProgram:
    """Quantize the weight of every ``aten.linear`` of ``ep`` whose module the recipe
    selects (``Recipe.scheme_for``, the group size fitted as ``quantize_model`` fits it).

    The float weight leaves the program (unless another op, a tied embedding, still reads
    it); the buffers ``<module>.weight.codes``, ``.scale`` and ``.zero_point`` (the
    matmul form, ``lowbit.ops.matmul.weight_parts``) take its place, and plain aten ops
    dequantize them before the linear (``lowbit.passes.dequant``).  A weight the matmul
    ops cannot take as matmul parts (2/3-bit, "min" zero points) is dequantized by
    ``lowbit.dequantize`` from the QTensor's own parts (``fuse`` turns the "min" ones into
    the packed matmul ops).
    The recipe's activation scheme is checked against each weight here and applied by
    ``quantize_activations``.  Idempotent: a second run finds every selected linear
    quantized and returns the program as it is.

    ``quantizer(module, float_weight, scheme) -> QTensor`` rounds each weight (default:
    round to nearest, ``lowbit.quantize``).  Methods that calibrate (GPTQ, AWQ) run on the
    eager model: ``quantize_model`` then ``lowbit.passes.export``.

    Example::

        >>> import torch
        >>> from lowbit.passes import quantize_weights, op_counts
        >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64)).requires_grad_(False)
        >>> ep = torch.export.export(m, (torch.randn(2, 64),))
        >>> q = quantize_weights(ep, {"weight": "int4-sym-g32", "modules": ["^0$"]})
        >>> sorted(q.state_dict)
        ['0.bias', '0.weight.codes', '0.weight.scale']
        >>> op_counts(q)["aten.bitwise_and"], op_counts(q)["aten.linear"]
        (1, 1)
    """
    recipe = Recipe.get(recipe)
    if quantizer is None and rounding_problem(recipe):
        raise ValueError(f"{rounding_problem(recipe)}: pass a quantizer, or quantize with lowbit.quantize_model, "
                         "then export")
    if embedding_problem(recipe):
        raise ValueError(f"{embedding_problem(recipe)}: quantize the model with lowbit.quantize_model, then export it")
    edit = Edit(ep)
    done, already, old = 0, 0, []
    for node in edit.call_functions(aten.linear.default):
        weight, name = node.args[1], module_of(node)
        w = edit.state(weight)
        chosen = None if name is None else recipe.scheme_for(name)
        if chosen is not None and "lowbit_weight" in node.meta.get("custom", {}):
            already += 1  # quantized by an earlier run
        if chosen is None or w is None or not w.is_floating_point() or w.dim() != 2:
            continue
        scheme = fit_group(chosen[0], w.shape[1])
        try:
            check_act_weight(scheme, chosen[1], w.shape[1])
            qt = quantizer(name, w, scheme) if quantizer is not None else quantize(w.detach().float(), scheme)
        except ValueError as e:
            raise ValueError(f"cannot quantize module '{name}': {e}") from None
        with edit.graph.inserting_before(node):
            w_node = _dequantized(edit, node, name, qt, w.dtype)
        node.replace_input_with(weight, w_node)
        _untie(edit, weight, f"{name}.weight")
        node.meta.setdefault("custom", {})["lowbit_weight"] = str(qt.scheme)
        old.append(weight)
        done += 1
    if not done and already:
        return ep  # every linear the recipe selects is quantized already
    if not done:
        raise ValueError(f"recipe '{recipe.name}' selects no aten.linear of this program with a float weight "
                         f"(modules={list(recipe.modules)}, lm_head={recipe.lm_head!r}); a program quantized "
                         "eagerly holds lowbit matmuls, a decomposed one (run_decompositions) no aten.linear")
    edit.erase_unused(old)
    return edit.program()


def _untie(edit: Edit, weight: fx.Node, target: str) -> None:
    """A float weight still read by another op (the embedding tied to the output
    projection) must not keep the quantized module's name, which its buffers'
    ``<target>.codes`` now extend: its readers move to another name of the same tensor
    (torch.export keeps a placeholder for each), or the state-dict alias is dropped."""
    edit.drop_alias(target)
    if not weight.users or edit.spec(weight).target != target:
        return
    tensor = edit.state(weight)
    alias = next((n for n in edit.graph.nodes if n is not weight and edit.state(n) is tensor), None)
    if alias is None:
        raise ValueError(f"the float weight {target!r} is read by another op too "
                         f"({', '.join(u.name for u in weight.users)}) and has no other name to keep it under")
    weight.replace_all_uses_with(alias)


def _dequantized(edit: Edit, linear: fx.Node, name: str, qt: QTensor, dtype: torch.dtype) -> fx.Node:
    """Buffers of ``qt`` and the nodes that dequantize them to ``dtype``."""
    n, k = qt.shape
    call = lambda target, args, kwargs=None: edit.call(target, args, kwargs, like=linear)  # noqa: E731
    if not matmul_form(qt.scheme, k):
        parts = [edit.add_buffer(f"{name}.weight.{part}", t) for part, t in
                 (("codes", qt.codes), ("scale", qt.scale), ("zero_point", qt.zero_point)) if t is not None]
        zp = parts[2] if len(parts) == 3 else None
        return call(torch.ops.lowbit.dequantize.default, (parts[0], parts[1], zp, str(qt.scheme), [n, k], dtype))
    codes, scale, zp, bits, group = weight_parts(qt)
    codes_n = edit.add_buffer(f"{name}.weight.codes", codes.contiguous())
    scale_n = edit.add_buffer(f"{name}.weight.scale", scale.contiguous())
    zp_n = None if zp is None else edit.add_buffer(f"{name}.weight.zero_point", zp.contiguous())
    return dequant.emit(call, codes_n, scale_n, zp_n, bits=bits, group_size=group, n=n, k=k, dtype=dtype,
                        device=codes.device)
