"""The layer-by-layer calibration loop (llm-compressor's "sequential pipeline" idea).

The calibration token ids are embedded once; then for each decoder layer: the
transforms' pass (``observe``, then ``transform`` folds scales into the float layer),
the quantizer's pass when it observes (GPTQ's Hessian) together with the activation
observers of static activation scales, ``quantize`` of every selected linear, and one
pass of the quantized layer that turns the layer's inputs into the next layer's.  Only
one buffer of calibration activations [samples, length, hidden] lives at a time (each
batch is overwritten by the layer's output), so peak memory is the model, that buffer
and one layer's statistics, whatever the number of layers.

Algorithms (``lowbit.algorithms``) react to these events and never drive the loop.
"""

from __future__ import annotations

import resource
import time

import torch
from torch import nn

from ..algorithms.base import Algorithm, LinearGroup
from ..nn import QuantLinear
from ..scheme import QuantScheme

SUPPORTED = ("llama", "mistral", "qwen2")


def layer_groups(layer: nn.Module, prefix: str, schemes: dict[str, str]) -> list[LinearGroup]:
    """The linears of a Llama-family decoder layer grouped by the input they share, each
    with the op its input comes out of: q/k/v after the input RMSNorm, o after v (with
    grouped-query attention each v channel feeds the o channels of several heads:
    ``LinearGroup.prev_channels``), gate/up after the post-attention RMSNorm, down after
    up, in the order the layer runs them (an observing pass stops at the last).  ``schemes``:
    the recipe's weight scheme of each selected module (full names).

    Example::

        >>> import lowbit
        >>> model, _ = lowbit.load_model()
        >>> [g.names[-1].split(".")[-1] for g in layer_groups(model.model.layers[0], "model.layers.0", {})]
        ['v_proj', 'o_proj', 'up_proj', 'down_proj']
    """
    a, m = layer.self_attn, layer.mlp
    full = lambda n: f"{prefix}.{n}"  # noqa: E731
    spec = [
        (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], layer.input_layernorm, None),
        (["self_attn.o_proj"], a.v_proj, _v_channels_of_o(a)),
        (["mlp.gate_proj", "mlp.up_proj"], layer.post_attention_layernorm, None),
        (["mlp.down_proj"], m.up_proj, None),
    ]
    groups = []
    for names, prev, channels in spec:
        mods = [layer.get_submodule(n) for n in names]
        groups.append(LinearGroup([full(n) for n in names], mods, prev,
                                  {full(n): schemes[full(n)] for n in names if full(n) in schemes}, channels))
    return groups


def _v_channels_of_o(attn: nn.Module) -> torch.Tensor | None:
    """The v output channel of each o input channel: head h's dimension d reads v head
    h // (heads per kv head), dimension d.  None when they are the same channels."""
    d = attn.head_dim
    heads, kv_heads = attn.o_proj.in_features // d, attn.v_proj.out_features // d
    if heads == kv_heads:
        return None
    j = torch.arange(heads * d)
    return (j // d) // (heads // kv_heads) * d + j % d


class _Inputs:
    """The embedded calibration samples, the rotary tables and the causal mask."""

    def __init__(self, model: nn.Module, ids: torch.Tensor):
        body = model.model
        dtype = body.norm.weight.dtype
        with torch.no_grad():
            self.h = body.embed_tokens(ids).to(dtype)
        if not torch.isfinite(self.h).all():
            raise ValueError("calibration: the embedding of the calibration tokens holds NaN or Inf")
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)[None]
        self.rope = body.rotary_emb(self.h[:1], pos)
        self.pos = pos
        mask = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype, device=ids.device).triu(1)
        self.mask = mask[None, None]


class _Seen(Exception):
    """Raised by an observing pass once the layer's last group has seen its input: the
    rest of the layer (down_proj's GEMM, the residual) would be computed for nothing."""


def _run(layer: nn.Module, inp: _Inputs, batch: int, write: bool, index: int) -> None:
    """Every calibration sample through ``layer``, ``batch`` samples at a time; with
    ``write`` the outputs replace the inputs (the next layer's inputs)."""
    h = inp.h
    for b0 in range(0, h.shape[0], batch):
        x = h[b0:b0 + batch]
        try:
            y = layer(x, attention_mask=inp.mask, position_ids=inp.pos, position_embeddings=inp.rope)
        except _Seen:
            continue
        y = y[0] if isinstance(y, tuple) else y
        if write:
            if not torch.isfinite(y).all():
                raise ValueError(f"calibration: the output of decoder layer {index} holds NaN or Inf "
                                 f"(calibration samples {b0}..{b0 + x.shape[0] - 1})")
            h[b0:b0 + batch] = y


def _observe(layer, groups, inp, batch, index, listeners) -> None:
    """One pass of ``layer`` that hands each group's input to every listener; it stops
    at the last group (``layer_groups`` lists them in the order the layer runs them)."""
    hooks = []
    for gi, g in enumerate(groups):
        def hook(_mod, args, gi=gi, g=g):
            x = args[0]
            if not torch.isfinite(x).all():
                raise ValueError(f"calibration: the input of '{g.names[0]}' holds NaN or Inf")
            for fn in listeners:
                fn(gi, g, x)
            if gi == len(groups) - 1:
                raise _Seen
        hooks.append(g.linears[0].register_forward_pre_hook(hook))
    try:
        _run(layer, inp, batch, False, index)
    finally:
        for h in hooks:
            h.remove()


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@torch.no_grad()
def calibrate_and_quantize(model: nn.Module, todo: dict[str, dict], quantizer: Algorithm,
                           transforms: list[Algorithm], ids: torch.Tensor, *, backend: str | None = None,
                           batch_tokens: int = 4096, progress: bool = False,
                           act_observer=None, enter=None, leave=None) -> dict:
    """Quantize the linears of ``todo`` (``lowbit.models.plan``'s output) decoder layer by
    decoder layer with ``quantizer`` after ``transforms``, on the calibration token ids
    ``ids`` [samples, length].  Linears outside the decoder layers (``lm_head``) are
    quantized by ``quantizer`` without statistics (round to nearest for GPTQ).
    ``act_observer()`` makes one activation observer per group whose linears take
    static per-tensor activation scales.  ``enter(i)`` runs before decoder layer ``i`` is
    touched and ``leave(i)`` once it has made the next layer's inputs (streaming
    quantization loads and writes one layer at a time there).  Returns facts about the
    run (time, peak RSS).
    """
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in SUPPORTED:
        raise ValueError(f"calibration supports model_type in {SUPPORTED}, got {getattr(cfg, 'model_type', None)!r}")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        raise ValueError(f"calibration ids must be an int64 tensor [samples, length], got "
                         f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if ids.numel() == 0:
        raise ValueError("the calibration set is empty (0 samples or 0 tokens)")
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if window is not None and ids.shape[1] > window:
        raise ValueError(f"calibration length {ids.shape[1]} is longer than the model's sliding window ({window})")
    vocab = model.model.embed_tokens.num_embeddings
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"calibration ids must lie in [0, {vocab}) (the model's vocabulary)")
    start = time.perf_counter()
    layers = model.model.layers
    prefix = next(n for n, m in model.named_modules() if m is layers)
    inp = _Inputs(model, ids.to(model.model.embed_tokens.weight.device))
    batch = max(1, batch_tokens // ids.shape[1])
    for a in [*transforms, quantizer]:
        a.start(ids.numel())
    it = range(len(layers))
    if progress:
        from tqdm.auto import tqdm

        steps = "+".join([t.name for t in transforms] + [quantizer.name])
        it = tqdm(it, desc=f"calibrating ({steps}, {ids.shape[0]} x {ids.shape[1]} tokens)", unit="layer")
    for i in it:
        if enter is not None:
            enter(i)
        layer = layers[i]
        schemes = {n: s["weight"] for n, s in todo.items() if n.startswith(f"{prefix}.{i}.")}
        groups = layer_groups(layer, f"{prefix}.{i}", schemes)
        for t in transforms:
            _observe(layer, groups, inp, batch, i, [t.observe])
            t.transform(groups)
            t.end_layer()
        static = {gi: act_observer() for gi, g in enumerate(groups)
                  if act_observer is not None and any(_per_tensor(todo[n]) for n in g.quantized)}
        listeners = ([quantizer.observe] if quantizer.observes else []) + \
                    ([lambda gi, g, x: static[gi].update(x) if gi in static else None] if static else [])
        if listeners:
            _observe(layer, groups, inp, batch, i, listeners)
        for gi, g in enumerate(groups):
            for name in g.quantized:
                spec = todo[name]
                lin = model.get_submodule(name)
                try:
                    qt = quantizer.quantize(name, lin, spec["weight"], gi)
                except ValueError as e:
                    raise ValueError(f"cannot quantize module '{name}': {e}") from e
                new = QuantLinear(qt, lin.bias, spec["activation"], backend)
                if gi in static and _per_tensor(spec):
                    new.set_act_qparams(*static[gi].qparams(spec["activation"]))
                set_module(model, name, new)
        quantizer.end_layer()
        _run(layer, inp, batch, True, i)
        if leave is not None:
            leave(i)
    for name, spec in todo.items():
        if spec["kind"] == "linear" and not name.startswith(f"{prefix}."):
            lin = model.get_submodule(name)
            set_module(model, name, QuantLinear(quantizer.quantize(name, lin, spec["weight"], None), lin.bias,
                                                spec["activation"], backend))
    return {"seconds": time.perf_counter() - start,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "activation_mb": inp.h.numel() * inp.h.element_size() / 2**20}


def _per_tensor(spec: dict) -> bool:
    return spec.get("activation") is not None and QuantScheme.parse(spec["activation"]).granularity == "tensor"


__all__ = ["calibrate_and_quantize", "layer_groups"]
