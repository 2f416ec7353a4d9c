"""A Llama GGUF file loaded straight into lowbit's modules, without a float copy.

Every quantized ggml tensor becomes a ``QuantLinear`` / ``QuantEmbedding`` holding the
file's own codes and scales in the lowbit scheme that stores its type without loss
(Q4_0 -> int4-sym-g32-f16, Q4_1 -> int4-asym-g32-zpmin-f16, Q4_K -> int4-asym-g32-zpmin
with float32 sub-block scales, ...: ``lowbit.formats.ggml.LOSSLESS_SCHEMES`` and
``as_qtensor``); float tensors become float modules (exactly, with ``ggml.dequantize``),
and the model counts both in ``lowbit_gguf``.
The q/k projections are put back in Hugging Face's row order (llama.cpp's converter
interleaves the rotary halves).  The tokenizer is converted by transformers once and
cached next to the float conversions (``load.cache_dir()``).
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..formats import ggml
from ..formats.gguf_export import _rows, gguf_name, rope_rows
from ..formats.gguf_file import GGUFError, read_gguf
from .common import cache_entry, quiet_transformers


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _config(reader, path: Path, transformers):
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"{path}: native loading reads llama GGUF files, got architecture {arch!r}")
    if any(k.startswith("llama.rope.scaling") for k in reader.fields):
        raise GGUFError(f"{path}: RoPE scaling is not loaded natively yet; load it with gguf='float'")
    names = {t.name for t in reader.tensors}
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    vocab = _field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return transformers.LlamaConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0))},
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def gguf_tokenizer(path: Path, entry: Path, transformers):
    """The tokenizer of a GGUF file: from its float conversion's cache entry ``entry`` if
    there is one, else converted by transformers once and cached in ``entry`` +
    "-tokenizer" (written to a temporary folder, then renamed)."""
    for folder in (entry, Path(f"{entry}-tokenizer")):
        if (folder / "tokenizer.json").is_file():
            return transformers.AutoTokenizer.from_pretrained(folder)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # what read_gguf's checks missed still names the file
        raise GGUFError(f"{path}: passed lowbit's GGUF checks but transformers could not convert its tokenizer: "
                        f"{type(e).__name__}: {e}") from e
    with cache_entry(Path(f"{entry}-tokenizer")) as tmp:
        tok.save_pretrained(tmp)
    return tok


def load_gguf_native(path: Path, dtype: torch.dtype, entry: Path):
    """(model, tokenizer) of a llama GGUF file with its quantized tensors kept as they are
    stored; see the module docstring.  ``model.lowbit_gguf`` counts the tensors loaded
    natively and those dequantized, by ggml type.  A file ``read_gguf`` accepts but that
    still cannot be built raises ``GGUFError`` naming it."""
    transformers = quiet_transformers()
    reader = read_gguf(path)
    try:
        model = _build(reader, path, dtype, transformers)
    except GGUFError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        raise GGUFError(f"{path}: passed lowbit's GGUF checks but cannot be built natively: "
                        f"{type(e).__name__}: {e}") from e
    return model, gguf_tokenizer(path, entry, transformers)


def _build(reader, path: Path, dtype: torch.dtype, transformers):
    from ..nn import QuantEmbedding, QuantLinear

    config = _config(reader, path, transformers)
    tensors = {t.name: t for t in reader.tensors}
    from transformers.initialization import no_init_weights

    with torch.device("meta"), no_init_weights():  # every weight comes from the file
        model = transformers.LlamaForCausalLM(config)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    native, dequantized = Counter(), Counter()
    modules = dict(model.named_modules())
    embedding = None
    for name, mod in modules.items():
        base = gguf_name(name)
        if base is None or name == "lm_head" and config.tie_word_embeddings:
            continue
        t = tensors.get(base + ".weight")
        if t is None:
            raise GGUFError(f"{path}: tensor {base + '.weight'!r} (for {name}) is missing")
        kind, shape = t.tensor_type.name, [int(n) for n in reversed(t.shape)]
        with warnings.catch_warnings():  # the file's memory map is read-only; nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.asarray(t.data).reshape(-1).view(np.uint8))
        is_matrix = isinstance(mod, (nn.Linear, nn.Embedding))
        qt = ggml.as_qtensor(raw, kind, shape) if is_matrix else None
        idx = None
        if base.split(".")[-1] in heads:
            idx = torch.argsort(rope_rows(shape[0], int(heads[base.split(".")[-1]])))
        if qt is not None:
            qt = _rows(qt, idx) if idx is not None else qt
            new = (QuantEmbedding(qt, dtype, mod.padding_idx) if isinstance(mod, nn.Embedding) else QuantLinear(qt))
            native[kind] += 1
        else:
            w = ggml.dequantize(raw, kind, shape)
            w = (w[idx] if idx is not None else w).to(dtype)
            if isinstance(mod, nn.Embedding):
                new = nn.Embedding(shape[0], shape[1], padding_idx=mod.padding_idx, _weight=w)
            elif isinstance(mod, nn.Linear):
                new = nn.Linear(shape[1], shape[0], bias=False)
                new.weight = nn.Parameter(w, requires_grad=False)
            else:  # RMSNorm
                mod.weight = nn.Parameter(w, requires_grad=False)
                new = mod
            if is_matrix:
                dequantized[kind] += 1
        if new is not mod:
            parent, _, child = name.rpartition(".")
            setattr(modules[parent] if parent else model, child, new)
        if name == "model.embed_tokens":
            embedding = new
    if config.tie_word_embeddings:
        if isinstance(embedding, QuantEmbedding):
            model.lm_head = QuantLinear(embedding.weight.qtensor())
        else:
            model.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            model.lm_head.weight = embedding.weight
    rotary = model.model.rotary_emb
    with torch.device("cpu"):
        model.model.rotary_emb = type(rotary)(config=config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise GGUFError(f"{path}: no tensor in the file for {left[:3]}")
    model.eval()
    model.requires_grad_(False)
    model.lowbit_gguf = {"native": dict(native), "dequantized": dict(dequantized)}
    return model
