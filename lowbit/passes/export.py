"""A causal LM as a torch.export program: token ids [batch, seq] -> logits [batch, seq,
vocab], the sequence length dynamic."""

from __future__ import annotations

import torch
from torch import nn
from torch.export import Dim, ExportedProgram


class _Logits(nn.Module):
    """``model(input_ids, use_cache=False).logits`` with the model's own parameter names
    (its children are this module's children, so the program's state dict keys and
    module paths are the model's: ``model.layers.0.mlp.up_proj.weight``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "causal_lm", model)  # not a child: its parameters are named above

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.causal_lm(input_ids=input_ids, use_cache=False).logits


def export(model: nn.Module, example_inputs: tuple[torch.Tensor] | None = None, *,
           dynamic_shapes=None, max_seq_len: int | None = None) -> ExportedProgram:
    """Export a Llama-family causal LM (float, or quantized by ``lowbit.quantize_model``)
    to an ExportedProgram that maps token ids [batch, seq] (int64) to logits [batch, seq,
    vocab] without a KV cache.

    ``example_inputs``: ``(input_ids,)``, default 8 tokens of one sequence.
    ``dynamic_shapes``: torch.export's, for the argument ``input_ids``; default: the
    sequence length is dynamic from 1 to ``max_seq_len`` (default the model's
    ``max_position_embeddings``), the batch is the example's.  Quantized linears appear
    by name (``lowbit.weight_only_matmul`` ...); the program's state dict keys are the
    model's.  Runs under ``torch.no_grad`` on the model's parameters as they are (call
    ``requires_grad_(False)``: the program is for inference).

    Example::

        >>> import torch, lowbit
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                   num_attention_heads=4, num_key_value_heads=2)
        >>> model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
        >>> ep = lowbit.passes.export(model)
        >>> ep.module()(torch.randint(0, 128, (1, 5))).shape
        torch.Size([1, 5, 128])
    """
    if not isinstance(model, nn.Module) or not callable(getattr(model, "get_input_embeddings", None)):
        raise TypeError(f"model must be a transformers causal LM (an nn.Module with get_input_embeddings), "
                        f"got {type(model).__name__}")
    config = getattr(model, "config", None)
    if max_seq_len is not None:
        limit, source = max_seq_len, "max_seq_len"
    else:
        limit, source = getattr(config, "max_position_embeddings", None) or 2048, "the config's max_position_embeddings"
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 2:
        raise ValueError(f"{source} must be an int >= 2, got {limit!r}")
    device = next(model.parameters()).device
    if example_inputs is None:
        example_inputs = (torch.zeros(1, min(8, limit), dtype=torch.int64, device=device),)
    if (not isinstance(example_inputs, tuple) or len(example_inputs) != 1
            or not isinstance(example_inputs[0], torch.Tensor) or example_inputs[0].dtype != torch.int64
            or example_inputs[0].dim() != 2):
        raise ValueError("example_inputs must be a tuple (input_ids,) of one int64 tensor [batch, seq]")
    if dynamic_shapes is None:
        dynamic_shapes = {"input_ids": {1: Dim("seq", min=1, max=limit)}}
    with torch.no_grad():
        return torch.export.export(_Logits(model).eval(), example_inputs, dynamic_shapes=dynamic_shapes)
