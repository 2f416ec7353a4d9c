"""What every pass does to an ExportedProgram besides its own rewrite: find the tensor
behind a placeholder, add weight buffers, give new nodes their fake values, drop what
no node uses any more, and build the new program.

A pass never edits the program it was given: ``Edit(ep)`` works on a deep copy of the
graph module, and ``Edit.program()`` returns a new ExportedProgram whose signature and
state dict match the edited graph.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections import Counter

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, TensorArgument

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def op_name(target) -> str:
    """``aten.linear``, ``lowbit.weight_only_matmul``: an op's namespace and name, no overload."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def op_counts(ep: ExportedProgram) -> Counter:
    """How many times each op runs in ``ep``'s graph (``op_name`` keys).

    Example::

        >>> import torch
        >>> from lowbit.passes import op_counts
        >>> ep = torch.export.export(torch.nn.Linear(4, 2), (torch.randn(1, 4),))
        >>> op_counts(ep)["aten.linear"]
        1
    """
    return Counter(op_name(n.target) for n in ep.graph.nodes if n.op == "call_function")


class Edit:
    """A copy of ``ep``'s graph to rewrite, and what it takes to make a program of it."""

    def __init__(self, ep: ExportedProgram):
        self.ep = ep
        self.gm = copy.deepcopy(ep.graph_module)
        self.graph: fx.Graph = self.gm.graph
        # the copy may rename nodes (a placeholder named like a builtin): the specs follow by position
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.specs = {n.name: _renamed(s, n.name) for n, s in zip(placeholders, ep.graph_signature.input_specs)}
        self.state_dict = dict(ep.state_dict)
        self.constants = dict(ep.constants)
        self.created: list[fx.Node] = []  # nodes ``call`` inserted (a pass may clear it)
        self.fake_mode = torch._guards.detect_fake_mode(
            [n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"])

    # -- reading ------------------------------------------------------------------------------
    def spec(self, node) -> InputSpec | None:
        """The input spec of a placeholder node (None for any other value)."""
        return self.specs.get(node.name) if isinstance(node, fx.Node) and node.op == "placeholder" else None

    def state(self, node) -> torch.Tensor | None:
        """The tensor behind a parameter, buffer or constant placeholder; None for anything
        else (a user input, a computed value, a literal)."""
        spec = self.spec(node)
        if spec is None or spec.kind not in _STATE_KINDS:
            return None
        if spec.kind == InputKind.CONSTANT_TENSOR or (spec.kind == InputKind.BUFFER and spec.persistent is False):
            return self.constants.get(spec.target, self.state_dict.get(spec.target))
        return self.state_dict[spec.target]

    @property
    def device(self) -> torch.device:
        """The device of the program's tensors (its first placeholder's)."""
        return next((n.meta["val"].device for n in self.graph.nodes if n.op == "placeholder"
                     and isinstance(n.meta.get("val"), torch.Tensor)), torch.device("cpu"))

    def call_functions(self, target) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "call_function" and n.target == target]

    # -- writing ------------------------------------------------------------------------------
    def add_buffer(self, target: str, tensor: torch.Tensor) -> fx.Node:
        """A new persistent buffer ``target`` (a state-dict key) holding ``tensor``: its
        placeholder goes after the last parameter or buffer placeholder."""
        if target in self.state_dict or target in self.constants:
            raise ValueError(f"the program already holds a tensor named {target!r}")
        state = [n for n in self.graph.nodes if n.op == "placeholder"
                 and self.specs[n.name].kind in (InputKind.PARAMETER, InputKind.BUFFER)]
        first = next(n for n in self.graph.nodes if n.op == "placeholder")
        name = "b_" + target.replace(".", "_")
        with self.graph.inserting_after(state[-1]) if state else self.graph.inserting_before(first):
            node = self.graph.placeholder(name)
        # fx renames a placeholder whose name is taken; the spec follows the node's real name
        node.meta["val"] = self.fake_mode.from_tensor(tensor, static_shapes=True)
        self.specs[node.name] = InputSpec(InputKind.BUFFER, TensorArgument(node.name), target, persistent=True)
        self.state_dict[target] = tensor
        return node

    def drop_alias(self, target: str) -> None:
        """Forget state-dict key ``target`` when no placeholder reads it: torch.export keeps
        the second name of a tied tensor (``lm_head.weight`` of a tied embedding) beside
        the one its placeholder reads, and ``ep.module()`` would tie them again."""
        if target in self.state_dict and all(s.target != target for s in self.specs.values()):
            del self.state_dict[target]

    def call(self, target, args: tuple, kwargs: dict | None = None, *, like: fx.Node | None = None) -> fx.Node:
        """Insert ``target(*args, **kwargs)`` at the graph's insertion point, with its fake
        value (and the module path and stack trace of ``like``, the node it stands for)."""
        kwargs = kwargs or {}
        node = self.graph.call_function(target, args, kwargs)
        self.created.append(node)
        vals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*vals[0], **vals[1])
        if like is not None:
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if key in like.meta:
                    node.meta[key] = like.meta[key]
        return node

    def inline(self, gm: fx.GraphModule, inputs: list, *, like: fx.Node | None = None):
        """Insert the nodes of a traced function (``trace``) at the insertion point, its
        inputs bound to ``inputs`` (nodes, or None for an argument it was traced without);
        returns the node(s) of its output."""
        env = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for ph, value in zip(placeholders, inputs, strict=True):
            env[ph] = value
        for n in gm.graph.nodes:
            if n.op == "call_function":
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = self.call(n.target, args, kwargs, like=like)
            elif n.op == "output":
                return fx.node.map_arg(n.args[0], env.__getitem__)
            elif n.op != "placeholder":
                raise ValueError(f"cannot inline a traced {n.op} node ({n.name}): trace functions of their inputs only")

    def erase_unused(self, nodes) -> None:
        """Erase the nodes of ``nodes`` that nothing uses any more, then their inputs that
        became unused in turn (a placeholder with its spec and tensor); side-effecting
        nodes stay."""
        todo, erased = list(nodes), set()
        while todo:
            node = todo.pop()
            if node in erased or node.graph is not self.graph or node.users or node.op == "output" or (
                    node.op == "call_function" and node.is_impure()):
                continue
            if node.op == "placeholder":
                spec = self.specs.get(node.name)
                if spec is None or spec.kind not in _STATE_KINDS:
                    continue  # a user input stays, used or not
                del self.specs[node.name]
                if self.state_dict.pop(spec.target, None) is None:
                    self.constants.pop(spec.target, None)
            todo += node.all_input_nodes
            self.graph.erase_node(node)
            erased.add(node)

    def program(self) -> ExportedProgram:
        """The edited graph as a new ExportedProgram (the input specs in placeholder order)."""
        self.graph.lint()
        self.gm.recompile()
        inputs = [self.specs[n.name] for n in self.graph.nodes if n.op == "placeholder"]
        # an output replaced by a rewrite (a fused output projection) keeps its spec, renamed
        returned = next(n for n in self.graph.nodes if n.op == "output").args[0]
        outputs = [_renamed(spec, getattr(value, "name", None))
                   for spec, value in zip(self.ep.graph_signature.output_specs, returned)]
        signature = ExportGraphSignature(input_specs=inputs, output_specs=outputs)
        ep = self.ep
        with warnings.catch_warnings():  # torch's own pytree specs warn about themselves when copied
            warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
            calls = copy.deepcopy(ep.module_call_graph)
        return ExportedProgram(
            root=self.gm, graph=self.graph, graph_signature=signature, state_dict=self.state_dict,
            range_constraints=copy.deepcopy(ep.range_constraints), module_call_graph=calls,
            example_inputs=ep.example_inputs, constants=self.constants, verifiers=ep.verifiers)


def _renamed(spec, name: str | None):
    """An input or output spec whose tensor argument is now the node ``name``."""
    if not isinstance(spec.arg, TensorArgument) or name is None:
        return spec
    return dataclasses.replace(spec, arg=TensorArgument(name))


class Example:
    """A stand-in input for ``trace``: a shape (None for a dynamic dim), a dtype, a device."""

    def __init__(self, shape, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


def value_key(v) -> tuple:
    """(shape with None for dynamic dims, dtype, device) of a node's value: a cache key of
    traces (a trace can hold the device: a zero point made with ``torch.zeros``)."""
    return tuple(d if isinstance(d, int) else None for d in v.shape), v.dtype, str(v.device)


def trace(fn, examples: list) -> fx.GraphModule:
    """``fn`` traced to aten and lowbit ops for inputs like ``examples`` (``Example``\\ s,
    fake values of program nodes), every size symbolic: the graph ``Edit.inline``
    writes into a program, and the template a matcher compares a subgraph with."""
    from torch.fx.experimental.proxy_tensor import make_fx

    # a fresh size for each dynamic dim: not 0 or 1 (those specialize) and equal to no static
    # size of a weight (tracing ties equal sizes to one symbol)
    sizes = iter((1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049))

    def real(v):
        if not isinstance(v, (torch.Tensor, Example)):
            return v
        shape = [d if isinstance(d, int) else next(sizes) for d in v.shape]
        return torch.zeros(shape, dtype=v.dtype, device=v.device) if not v.is_floating_point() else \
            torch.ones(shape, dtype=v.dtype, device=v.device)

    gm = make_fx(fn, tracing_mode="symbolic")(*[real(v) for v in examples])
    gm.graph.eliminate_dead_code()  # the trace keeps unused outputs of multi-output ops
    return gm
