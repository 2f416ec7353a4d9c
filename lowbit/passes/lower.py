"""The lowering pass: which kernel runs each lowbit matmul node on the target, and why,
written into the node's metadata (the backend's own kernel plan, one source of truth)."""

from __future__ import annotations

import torch
from torch import fx
from torch.export import ExportedProgram

from .. import kernels
from ..scheme import QuantScheme
from .dequant import parts_scheme
from .program import Edit

lowbit = torch.ops.lowbit
_MATMULS = (lowbit.weight_only_matmul.default, lowbit.linear_a8_blocks.default, lowbit.int8_linear.default,
            lowbit.linear_qta8a_qga4w.default)
# activation rows the plan is recorded for: a decode step, short and long prefills
ROWS = (1, 16, 512)


def _schemes(node: fx.Node) -> tuple[QuantScheme, QuantScheme | None, int] | None:
    """(weight scheme, activation scheme, K) of a lowbit matmul node (None for other nodes)."""
    if node.target not in _MATMULS:
        return None
    a = node.args
    k = a[0].meta["val"].shape[-1]

    def weight(bits, group, scale, zero_point, zero_point_min=False):
        return parts_scheme(bits, group, k, scale.meta["val"].dtype,
                            None if zero_point is None else zero_point.meta["val"].dtype, zero_point_min)

    if node.target == lowbit.weight_only_matmul.default:  # x, codes, scale, zp, bits, group[, zero_point_min]
        return weight(a[4], a[5], a[2], a[3], len(a) > 6 and a[6]), None, k
    if node.target == lowbit.linear_a8_blocks.default:  # ... act_block[, zero_point_min]
        return weight(a[4], a[5], a[2], a[3], len(a) > 7 and a[7]), QuantScheme.parse(f"int8-sym-g{a[6]}"), k
    if node.target == lowbit.int8_linear.default:  # a, a_zp, b, row_scale, col_scale, bias, dtype
        return weight(8, k, a[4], None), QuantScheme.parse(f"int8-{'sym' if a[1] is None else 'asym'}-token"), k
    # linear_qta8a_qga4w: x_q, x_scale, x_zp, codes, scale, zp, group
    return weight(4, a[6], a[4], a[5]), QuantScheme.parse("int8-asym-token"), k


def lower(ep: ExportedProgram, backend: str | None = None) -> ExportedProgram:
    """Record in every lowbit matmul node which kernel of ``backend`` (default: the
    fastest for the program's device, ``lowbit.kernels.resolve``) runs it for 1, 16 and
    512 activation rows, and why: ``node.meta["custom"]["lowbit_kernels"]``, a dict
    ``{"backend": ..., "features": ..., "M=1": "kernel: why", ...}`` that
    ``torch.export.save`` keeps.  The ops stay the same ops (the dispatcher picks the
    kernel at run time by the same plan); the record says what that will be on this
    machine.  Idempotent.

    Example::

        >>> import torch
        >>> from lowbit.passes import quantize_weights, fuse, lower
        >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64)).requires_grad_(False)
        >>> ep = fuse(quantize_weights(torch.export.export(m, (torch.randn(2, 64),)),
        ...                            {"weight": "int8-sym", "modules": ["^0$"]}))
        >>> node = next(n for n in lower(ep, "reference").graph.nodes if n.name.startswith("weight_only"))
        >>> node.meta["custom"]["lowbit_kernels"]["M=1"]
        'reference: plain PyTorch: the float32 matmul of the dequantized weight'
    """
    edit = Edit(ep)
    name = kernels.resolve(backend, edit.device) if backend != "triton" else "triton"
    target = kernels.get_backend(name)
    features = ""
    if name == "cpu":
        from ..kernels import cpu

        features = " ".join(cpu.features()["machine"])
    for node in edit.graph.nodes:
        found = _schemes(node) if node.op == "call_function" else None
        if found is None:
            continue
        w, act, k = found
        dtype = (node.args[6] if node.target == lowbit.int8_linear.default else torch.float32
                 if node.target == lowbit.linear_qta8a_qga4w.default else node.args[0].meta["val"].dtype)
        record = {"backend": name, "features": features}
        for m in ROWS:
            plan = target.plan(w, act, m, k, dtype)
            record[f"M={m}"] = f"{plan.kernel}: {plan.why}"
        node.meta.setdefault("custom", {})["lowbit_kernels"] = record
    return edit.program()
