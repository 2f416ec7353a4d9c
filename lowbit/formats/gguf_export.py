"""Writing a Llama-family model as a GGUF file that llama.cpp loads.

Every weight's ggml type follows from its lowbit scheme, and the export says for each
tensor whether it is stored exactly:

- a quantized weight whose groups are whole 32-value blocks keeps its codes: symmetric
  codes of up to 4 bits go to Q4_0 (``d * (q - 8)`` is lowbit's ``q * scale``), of up
  to 5 bits to Q5_0, 8-bit ones to Q8_0; asymmetric codes go to Q4_1 / Q5_1 with
  ``d = scale`` and ``m = -zero_point * scale``.  That is exact when the scale and the
  min are float16 values (an ``-f16`` scheme with symmetric codes always is), otherwise
  it differs only by rounding them to float16;
- a K-quant loaded natively (``ggml.as_qtensor``: groups of 16 or 32, float32 sub-block
  scales that are a float16 ``d`` times integers) goes back to its K-quant when that type
  is asked for (``kquants.from_parts`` recovers ``d`` and the integers exactly);
- anything else (8-bit asymmetric codes, a requested type the codes do not fit, groups
  that are not whole blocks, other schemes asked to be K-quants) is re-quantized from lowbit's dequantized
  weights with ggml's own quantizer (bit-identical with the ``gguf`` package's) or, for
  the K-quants, ``lowbit.formats.kquants``; a K-quant asked for a weight whose rows are
  not whole 256-value super-blocks becomes ``K_FALLBACK``'s type, as in llama.cpp;
- float tensors keep their dtype (F32 / F16 / BF16) unless a type is asked for; norms
  are always F32, as llama.cpp needs.

``export_gguf`` measures each stored tensor against lowbit's own dequantized weight
(bit-exact or the relative RMS error), refuses with ``strict=True`` anything that is
not exact, and writes the file atomically (a temporary file, then a rename).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import ggml

TARGET_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32")
# A K-quant needs rows of whole 256-value super-blocks; a weight with other rows (576 in
# SmolLM2) is stored as the simple type llama.cpp's llama-quantize picks there (no
# smaller than the K-quant), and the export table and a warning say so.
K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
FLOAT_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
# HF module name -> GGUF tensor name (llama.cpp's names for the llama architecture)
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5  # llama.cpp's token types


class GGUFExportError(ValueError):
    """A model that cannot be written as the GGUF asked for; the message names the tensor."""


@dataclass
class TensorExport:
    """How one tensor was stored: its source (a lowbit scheme or a float dtype), ggml
    type, whether its stored values equal lowbit's bit for bit, and if not the relative
    RMS error ``||stored - lowbit|| / ||lowbit||`` and how it was converted."""

    name: str
    source: str
    ggml_type: str
    exact: bool
    error: float
    how: str
    numel: int
    nbytes: int
    fallback: str | None = None  # "Q5_0, not Q4_K: why" when ggml_type is not the type asked for


@dataclass
class GGUFExport:
    """What ``export_gguf`` wrote: the file and one ``TensorExport`` per tensor."""

    path: Path
    tensors: list[TensorExport] = field(default_factory=list)

    @property
    def bits_per_weight(self) -> float:
        """Bits of tensor data per value over every tensor of the file."""
        return 8 * sum(t.nbytes for t in self.tensors) / max(1, sum(t.numel for t in self.tensors))

    def table(self) -> str:
        """One line per distinct (source, type, how) with its tensor count, worst error and
        bits per weight, then the file's totals."""
        rows: dict[tuple, list[TensorExport]] = {}
        for t in self.tensors:
            rows.setdefault((t.source, t.ggml_type, t.how), []).append(t)
        head = ("source", "ggml type", "tensors", "stored", "max rel error", "bits/weight")
        lines = [head]
        for (src, typ, how), ts in rows.items():
            err = max(t.error for t in ts)
            lines.append((src, typ, str(len(ts)), how, "0 (exact)" if err == 0 else f"{err:.2e}",
                          f"{8 * sum(t.nbytes for t in ts) / sum(t.numel for t in ts):.3f}"))
        widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
        out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
        inexact = sum(not t.exact for t in self.tensors)
        out.append(f"{len(self.tensors)} tensors, {inexact} not exact; "
                   f"{self.bits_per_weight:.3f} bits per weight over the whole file")
        return "\n".join(out)


# -- names and layout -------------------------------------------------------------------
def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's tensor name for a Llama module (None for a module with no weight there).

    Example::

        >>> gguf_name("model.layers.3.mlp.down_proj"), gguf_name("model.embed_tokens")
        ('blk.3.ffn_down', 'token_embd')
    """
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def rope_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order llama.cpp stores q/k projections in: per head, HF's two rotary halves
    interleaved (llama.cpp's converter permutes them the same way).

    Example::

        >>> rope_rows(8, 2).tolist()
        [0, 2, 1, 3, 4, 6, 5, 7]
    """
    return torch.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).transpose(1, 2).reshape(-1)


# -- one tensor -------------------------------------------------------------------------
def _rows(qt, idx: torch.Tensor):
    """The QTensor ``qt`` with its rows (out features) reordered by ``idx``."""
    from ..qtensor import QTensor

    s = qt.scheme
    if s.granularity == "tensor":
        return QTensor(qt.codes[idx], qt.scale, qt.zero_point, s, qt.shape)
    zp = None if qt.zero_point is None else qt.zero_point[idx]
    return QTensor(qt.codes[idx], qt.scale[idx], zp, s, qt.shape)


def _block_params(qt, t: torch.Tensor) -> torch.Tensor:
    """A per-block parameter ``t`` (shaped like qt.scale) repeated to one value per 32 values."""
    s, (n, k) = qt.scheme, qt.shape
    if s.granularity == "tensor":
        return t.reshape(1, 1).expand(n, k // 32).reshape(-1)
    g = s.group_size if s.granularity == "group" else k
    return t.reshape(n, k // g).repeat_interleave(g // 32, dim=1).reshape(-1)


def _codes_fit(qt, target: str) -> str | None:
    """Why the codes of ``qt`` cannot be stored as ``target`` as they are (None: they can)."""
    s, k = qt.scheme, qt.shape[-1]
    if target in K_FALLBACK:
        from .kquants import TYPES

        t = TYPES[target]
        if k % ggml.QK_K or s.granularity != "group" or s.group_size != t.sub:
            return f"{target}'s sub-blocks are groups of {t.sub} in rows of whole 256-value super-blocks"
        if s.symmetric == t.has_min or (t.has_min and s.zero_point_domain != "min"):
            return f"{target} {'has a min (a zpmin scheme)' if t.has_min else 'is symmetric'}"
        return None  # the values decide (``_keep_codes``)
    if target not in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return f"{target} stores floats"
    if s.granularity == "token" or k % 32:
        return "its rows are not whole 32-value blocks"
    if s.granularity == "group" and s.group_size % 32:
        return f"groups of {s.group_size} are not whole 32-value blocks"
    width = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}[target]
    if _code_bits(qt) > width:
        return f"{s.bits}-bit codes do not fit {target}"
    if not s.symmetric and target in ("Q4_0", "Q5_0", "Q8_0"):
        return f"{target} has no zero point"
    return None


def _keep_codes(qt, target: str) -> torch.Tensor | None:
    """Blocks of ``target`` holding ``qt``'s codes; its scale (and -zero_point * scale as
    the min) rounded to float16.  None when one of them overflows float16 (every stored
    value is then finite: |d * q| <= 65504 * 255)."""
    from ..ops import unpack_bits

    s = qt.scheme
    q = qt.codes if not s.is_packed else unpack_bits(qt.codes, s.bits, s.packing, signed=s.symmetric)
    if target in K_FALLBACK:  # sub-block scales that are float16 d times integers (a K-quant loaded natively)
        from .kquants import TYPES, from_parts

        t = TYPES[target]
        blocks = q.numel() // ggml.QK_K
        low = None if s.symmetric else -qt.zero_point.to(torch.float32).reshape(blocks, t.n_sub)
        return from_parts(target, qt.scale.to(torch.float32).reshape(blocks, t.n_sub), low,
                          q.reshape(blocks, t.n_sub, t.sub))
    q = q.to(torch.int32).reshape(-1, 32)
    scale = qt.scale.to(torch.float32)
    d = _block_params(qt, scale).to(torch.float16)
    if target in ("Q4_0", "Q5_0", "Q8_0"):  # symmetric codes: x = d * (q - offset)
        return ggml.pack_simple(target, q + ggml.CODE_OFFSET[target], d) if bool(d.isfinite().all()) else None
    if s.symmetric:  # signed codes into an unsigned min type: q + 2^(b-1), m = -2^(b-1) * scale
        half = 1 << (_code_bits(qt) - 1)
        q, m = q + half, -half * scale
    elif s.zero_point_domain == "min":  # lowbit's q * scale + min is ggml's d * q + m
        m = qt.zero_point.to(torch.float32)
    else:
        m = -(qt.zero_point.to(torch.float32) * scale)
    m = _block_params(qt, m).to(torch.float16)
    return ggml.pack_simple(target, q, d, m) if bool(d.isfinite().all() and m.isfinite().all()) else None


def encode(weight, target: str) -> tuple[torch.Tensor, str]:
    """``weight`` (a 2-D QTensor or float tensor) as ``target`` blocks [rows, bytes] and
    how: "codes kept", "re-quantized (...why...)" or "float".

    Example::

        >>> import torch, lowbit
        >>> qt = lowbit.quantize(torch.randn(4, 64), "int4-sym-g32-f16")
        >>> raw, how = encode(qt, "Q4_0")
        >>> how, torch.equal(ggml.dequantize(raw, "Q4_0", [4, 64]), lowbit.dequantize(qt))
        ('codes kept', True)
    """
    from ..qtensor import QTensor

    if isinstance(weight, QTensor):
        why = _codes_fit(weight, target)
        if why is None:
            raw = _keep_codes(weight, target)
            if raw is not None:
                return raw.reshape(weight.shape[0], -1), "codes kept"
            why = (f"its codes or sub-block scales are not a {target}'s (codes in its range, scales a float16 "
                   "times integers)" if target in K_FALLBACK else "its scales overflow float16")
        from ..ops import dequantize

        values, how = dequantize(weight, torch.float32), f"re-quantized ({why})"
    else:
        values, how = weight.detach(), "float" if target in ("F32", "F16", "BF16") else "quantized from float"
    block = ggml.block_type(target).block_size
    if values.shape[-1] % block:
        raise GGUFExportError(f"{target} needs rows of whole {block}-value blocks, got {values.shape[-1]} values")
    if target in K_FALLBACK:
        from . import kquants

        return kquants.quantize(values, target), how
    return ggml.quantize(values, target), how


def target_type(shape, requested: str) -> tuple[str, str | None]:
    """The type a weight of ``shape`` is stored as when ``requested`` is asked for, and
    why it differs (None when it does not): a K-quant needs rows of whole 256-value
    super-blocks, otherwise ``K_FALLBACK`` holds llama.cpp's replacement.

    Example::

        >>> target_type((1536, 576), "Q4_K")
        ('Q5_0', 'rows of 576 values are not whole 256-value super-blocks')
        >>> target_type((576, 1536), "Q4_K")
        ('Q4_K', None)
    """
    if requested in K_FALLBACK and shape[-1] % ggml.QK_K:
        return K_FALLBACK[requested], f"rows of {shape[-1]} values are not whole {ggml.QK_K}-value super-blocks"
    return requested, None


def _measure(raw: torch.Tensor, target: str, reference: torch.Tensor) -> tuple[bool, float]:
    got = ggml.dequantize(raw.reshape(-1), target, reference.shape)
    ref = reference.to(torch.float32)
    if torch.equal(got.view(torch.int32), ref.view(torch.int32)) or torch.equal(got, ref):
        return True, 0.0
    den = float(ref.double().norm())
    return False, float((got.double() - ref.double()).norm()) / (den if den > 0 else 1.0)


def default_type(weight) -> str:
    """The ggml type a weight goes to when none is asked for: the K-quant it was loaded
    from (``ggml.as_qtensor``'s schemes, when its scales decompose as that type's), else
    the smallest simple type that holds its codes (Q4_0/Q4_1 up to 4 bits, Q5_0/Q5_1 for
    codes of 5 bits, which 8-bit codes loaded from Q5_x are, Q8_0), else its float dtype.

    Example::

        >>> import torch, lowbit
        >>> default_type(lowbit.quantize(torch.randn(4, 64), "int4-asym-g64"))
        'Q4_1'
    """
    from ..qtensor import QTensor

    if not isinstance(weight, QTensor):
        return FLOAT_TYPES.get(weight.dtype, "F32")
    s = weight.scheme
    k_type = _K_OF_SCHEME.get(str(s))
    if k_type and _codes_fit(weight, k_type) is None and _keep_codes(weight, k_type) is not None:
        return k_type
    bits = _code_bits(weight)
    if bits <= 4:
        return "Q4_0" if s.symmetric else "Q4_1"
    if bits == 5:
        return "Q5_0" if s.symmetric else "Q5_1"
    return "Q8_0"


def _code_bits(qt) -> int:
    """The bits ``qt``'s codes need: its scheme's, or 5 for 8-bit codes that all fit 5
    bits (what a Q5_0 / Q5_1 tensor loads into), so those go back to Q5_x."""
    s = qt.scheme
    if s.bits != 8 or not qt.codes.numel():
        return s.bits
    lo, hi = int(qt.codes.min()), int(qt.codes.max())
    return 5 if (-16 <= lo and hi <= 15 if s.symmetric else hi <= 31) else 8


# the scheme each K-quant loads into, back to its type
_K_OF_SCHEME = {scheme: name for name, scheme in ggml.LOSSLESS_SCHEMES.items() if name in K_FALLBACK}


# -- the model --------------------------------------------------------------------------
_UNSTORED = {"SplitQuantLinear": "int8 outlier channels + int4", "SparseQuantLinear": "2:4 sparse"}


def _weights(model: nn.Module):
    """(gguf name, HF module name, weight to write: QTensor or float tensor, its source
    label or None, the weight as the module holds it) of every tensor to write, in
    llama.cpp's order; refuses what llama.cpp's llama architecture cannot run.  An
    act-order weight is written as its float weight in the input's order (GGUF has no
    column order), labelled "<scheme> act-order"."""
    from ..nn import QuantEmbedding, QuantLinear, SplitQuantLinear
    from ..sparse import SparseQuantLinear

    out, seen = [], {}
    for name, mod in model.named_modules():
        if isinstance(mod, (SplitQuantLinear, SparseQuantLinear)):
            raise GGUFExportError(f"module {name!r} is a {type(mod).__name__} ({_UNSTORED[type(mod).__name__]}); "
                                  "GGUF has no such tensor type: quantize it with a single dense scheme to export")
        base = gguf_name(name)
        if base is None:
            if isinstance(mod, (nn.Linear, nn.Embedding, QuantLinear, QuantEmbedding)):
                raise GGUFExportError(f"module {name!r} has no place in llama.cpp's llama architecture")
            continue
        if getattr(mod, "bias", None) is not None:
            raise GGUFExportError(f"module {name!r} has a bias; llama.cpp's llama architecture has none")
        if isinstance(mod, QuantLinear) and mod.act_scheme is not None:
            warnings.warn(f"{name}: activation quantization ({mod.act_scheme}) is not stored in GGUF; "
                          "llama.cpp picks its own activation format", stacklevel=3)
        w = mod.weight.qtensor() if isinstance(mod, (QuantLinear, QuantEmbedding)) else mod.weight
        if w is None:
            continue
        storage = w.codes if isinstance(mod, (QuantLinear, QuantEmbedding)) else w
        if id(storage) in seen:  # tied to a tensor already written (lm_head and the embedding)
            continue
        seen[id(storage)] = base
        held, source = w, None
        if isinstance(mod, QuantLinear) and mod.input_order is not None:
            source, w = f"{w.scheme} act-order", mod.dequantized_weight(torch.float32)
        out.append((base + ".weight", name, w, source, held))
    return out


def _metadata(model, tokenizer, source: str | None) -> list[tuple[str, tuple]]:
    """The GGUF key-value pairs of ``model`` as ``(GGUFWriter method, args)`` calls,
    computed (and checked) before anything is written."""
    import gguf

    c = model.config
    if getattr(c, "model_type", None) != "llama":
        raise GGUFExportError(f"only Llama-family models are written as GGUF, got model_type "
                              f"{getattr(c, 'model_type', None)!r}")
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    if rope.get("rope_type", "default") != "default" or theta is None:
        raise GGUFExportError(f"RoPE {rope} is not written yet; only the default RoPE with a rope_theta is")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    calls = [
        ("add_name", (str(getattr(c, "name_or_path", "") or "lowbit export"),)),
        ("add_context_length", (int(c.max_position_embeddings),)),
        ("add_embedding_length", (int(c.hidden_size),)),
        ("add_block_count", (int(c.num_hidden_layers),)),
        ("add_feed_forward_length", (int(c.intermediate_size),)),
        ("add_head_count", (int(c.num_attention_heads),)),
        ("add_head_count_kv", (int(c.num_key_value_heads),)),
        ("add_rope_freq_base", (float(theta),)),
        ("add_layer_norm_rms_eps", (float(c.rms_norm_eps),)),
        ("add_rope_dimension_count", (int(head_dim),)),
        ("add_vocab_size", (int(c.vocab_size),)),
        ("add_quantization_version", (gguf.GGML_QUANT_VERSION,)),
    ]
    return calls + _tokenizer(tokenizer, int(c.vocab_size), source)


def tokenizer_pre(source: str | None) -> str:
    """llama.cpp's pre-tokenizer name: read from the GGUF file the model came from when
    there is one, otherwise "default" (with a warning).

    Example::

        >>> from lowbit.models import bundled_model_path
        >>> tokenizer_pre(str(bundled_model_path()))
        'smollm'
    """
    if source and str(source).endswith(".gguf") and Path(source).is_file():
        from .gguf_file import read_gguf

        f = read_gguf(source, model_checks=False).fields.get("tokenizer.ggml.pre")
        if f is not None:
            return str(f.contents())
    warnings.warn("the model did not come from a GGUF file, so llama.cpp's pre-tokenizer name is unknown: "
                  "writing 'default'", stacklevel=4)
    return "default"


def _tokenizer(tok, vocab_size: int, source: str | None) -> list[tuple[str, tuple]]:
    """A byte-level BPE tokenizer (GPT-2 style, llama.cpp's "gpt2" model) as llama.cpp's
    converter writes it: tokens padded to the vocabulary size, their types, merges,
    special token ids and the chat template."""
    import json

    backend = getattr(tok, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    if spec.get("model", {}).get("type") != "BPE":
        raise GGUFExportError("only byte-level BPE tokenizers (tokenizer.json with a BPE model) are written "
                              f"as GGUF, got {spec.get('model', {}).get('type')!r}")
    vocab = spec["model"]["vocab"]
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    tokens, types = [], []
    by_id = {i: t for t, i in vocab.items()} | {i: a["content"] for i, a in added.items()}
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(TOKEN_NORMAL if i not in added else
                         TOKEN_CONTROL if added[i].get("special") else TOKEN_USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    calls = [("add_tokenizer_model", ("gpt2",)), ("add_tokenizer_pre", (tokenizer_pre(source),)),
             ("add_token_list", (tokens,)), ("add_token_types", (types,)), ("add_token_merges", (merges,))]
    for key, value in [("bos", tok.bos_token_id), ("eos", tok.eos_token_id), ("unk", tok.unk_token_id),
                       ("pad", tok.pad_token_id)]:
        if value is not None:
            calls.append((f"add_{key}_token_id", (int(value),)))
    calls += [("add_add_bos_token", (bool(getattr(tok, "add_bos_token", False)),)),
              ("add_add_space_prefix", (False,))]
    if isinstance(getattr(tok, "chat_template", None), str):
        calls.append(("add_chat_template", (tok.chat_template,)))
    return calls


def _file_type(types: list[str]) -> int:
    import gguf

    linear = max(set(types), key=types.count) if types else "F32"
    names = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}
    return int(gguf.LlamaFileType[names.get(linear, f"MOSTLY_{linear}")])


def check_arguments(path: str | os.PathLike, type: str | None, float_type: str | None, overwrite: bool,
                    overwrite_flag: str = "overwrite=True (--force)",
                    names: tuple[str, str] = ("type", "float_type")) -> tuple[Path, str | None, str | None]:
    """``(path, type, float_type)`` of an export, checked before any work: types among
    ``TARGET_TYPES`` (any case; returned upper case), an output file that does not exist
    (unless ``overwrite``, which the error names as ``overwrite_flag``) in a folder that does;
    ``names`` are what the errors call the two types (the CLI's flags).

    Example::

        >>> check_arguments("m.gguf", "q4_0", None, False)
        (PosixPath('m.gguf'), 'Q4_0', None)
    """
    checked = []
    for label, value in zip(names, (type, float_type)):
        if value is not None and str(value).upper() not in TARGET_TYPES:
            raise ValueError(f"{label} must be one of {[t.lower() for t in TARGET_TYPES]}, got {value!r}")
        checked.append(None if value is None else str(value).upper())
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"output {str(path)!r} is a folder; expected a .gguf file path")
    if path.exists() and not overwrite:
        raise FileExistsError(f"output {str(path)!r} exists; pass {overwrite_flag} to replace it")
    if not path.absolute().parent.is_dir():
        raise FileNotFoundError(f"output folder {str(path.absolute().parent)!r} does not exist")
    return path, *checked


def export_gguf(model: nn.Module, tokenizer, path: str | os.PathLike, *, type: str | None = None,
                float_type: str | None = None, strict: bool = False, overwrite: bool = False) -> GGUFExport:
    """Write ``model`` (a Llama-family transformers model, float or quantized by lowbit)
    and its tokenizer as a GGUF file llama.cpp loads.

    Args:
        type: ggml type of every linear weight (one of ``TARGET_TYPES``, any case; a
            K-quant falls back per ``target_type`` where rows are not whole super-blocks);
            None picks per weight (``default_type``: exact for lowbit's 2- to 8-bit
            symmetric and 2- to 4-bit asymmetric group schemes of 32, 64, 128, ...).
        float_type: type of float embedding / output weights (None: their own dtype).
        strict: refuse (``GGUFExportError``, nothing written) if any tensor would not be
            stored exactly.
        overwrite: replace an existing file.

    Returns a ``GGUFExport`` (``.table()`` prints the per-scheme summary).  Tensors
    stored inexactly are also reported with ``warnings.warn``.

    Example::

        >>> import tempfile, pathlib, lowbit
        >>> from lowbit.formats.gguf_export import export_gguf
        >>> model, tok = lowbit.load_model()
        >>> q = lowbit.quantize_model(model, lowbit.Recipe(weight="int4-sym-g32-f16"))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = export_gguf(q, tok, pathlib.Path(d) / "m.gguf")
        >>> sorted({(t.ggml_type, t.exact) for t in out.tensors})
        [('F32', True), ('Q4_0', True)]
    """
    import gguf

    path, type, float_type = check_arguments(path, type, float_type, overwrite)

    metadata = _metadata(model, tokenizer, getattr(model, "lowbit_source", None))
    c = model.config
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    result = GGUFExport(path)
    encoded = []
    for name, module_name, w, reordered, held in _weights(model):
        is_linear = name.startswith("blk.") and len(w.shape) == 2
        fallback = None
        if len(w.shape) == 1:
            target = "F32"
        elif is_linear and type:
            target, fallback = target_type(w.shape, type)
        elif not is_linear and float_type and not hasattr(held, "scheme"):
            target, fallback = target_type(w.shape, float_type)
        else:  # from the weight as the module holds it (an act-order one: its codes' type)
            target = default_type(held)
        kind = name.split(".")[-2]
        if kind in heads:  # llama.cpp's rotary row order
            idx = rope_rows(w.shape[0], int(heads[kind]))
            w = _rows(w, idx) if hasattr(w, "scheme") else w[idx]
        try:
            raw, how = encode(w, target)
        except (ValueError, TypeError) as e:
            raise GGUFExportError(f"tensor {name} ({module_name}): {e}") from e
        if reordered:
            how = "re-quantized (input channels in act-order; GGUF has no column order)"
        if fallback:
            fallback = f"{target}, not {type if is_linear else float_type}: {fallback}"
            how = f"{how}; {fallback}"  # its own row of the table
        if hasattr(w, "scheme"):
            from ..ops import dequantize

            reference, source = dequantize(w, torch.float32), str(w.scheme)
        else:
            reference, source = w.detach().to(torch.float32), reordered or str(w.dtype).replace("torch.", "")
        exact, err = _measure(raw, target, reference)
        if strict and not exact:
            raise GGUFExportError(f"tensor {name} ({source}) is not stored exactly as {target} ({how}, "
                                  f"relative error {err:.2e}); strict export refused, nothing written")
        result.tensors.append(TensorExport(name, source, target, exact, err, how, w.numel(), raw.numel(), fallback))
        encoded.append((name, raw, list(w.shape), target))
    replaced = [t for t in result.tensors if t.fallback]
    if replaced:
        warnings.warn(f"{len(replaced)} of {len(result.tensors)} tensors are stored as another type than asked "
                      f"for ({'; '.join(sorted({t.fallback for t in replaced}))}), as llama.cpp's llama-quantize "
                      "does", stacklevel=2)
    inexact = [t for t in result.tensors if not t.exact]
    if inexact:
        worst = max(inexact, key=lambda t: t.error)
        warnings.warn(f"{len(inexact)} of {len(result.tensors)} tensors are not stored exactly "
                      f"(worst: {worst.name}, {worst.how}, relative error {worst.error:.2e})", stacklevel=2)

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, "llama")
        for method, args in metadata:
            getattr(writer, method)(*args)
        writer.add_file_type(_file_type([t.ggml_type for t in result.tensors
                                         if t.name.startswith("blk.") and not t.name.endswith("_norm.weight")]))
        for name, raw, shape, target in encoded:
            # raw rows as bytes: gguf derives the shape in values from the type
            writer.add_tensor(name, raw.reshape(*shape[:-1], -1).numpy(), raw_dtype=gguf.GGMLQuantizationType[target])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private; a new file gets the usual mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return result


__all__ = ["export_gguf", "check_arguments", "encode", "default_type", "target_type", "K_FALLBACK", "gguf_name", "rope_rows", "GGUFExport", "TensorExport",
           "GGUFExportError", "TARGET_TYPES"]
