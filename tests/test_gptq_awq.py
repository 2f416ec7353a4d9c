"""GPTQ and AWQ checkpoints into lowbit: folders written here from the formats'
descriptions (lowbit -> format -> lowbit keeps every code and scale), plus the small
fixtures the real tools made (tests/fixtures/formats), checked against the tools' own
dequantized weights."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import lowbit
from lowbit.formats import gptq

VOCAB = 96


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _pack(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """int [R, C] -> int32 words packed along ``dim``: value j of a word at bits b*j
    (AWQ: the value at bits 4*i is the one at position order[i] of its 8)."""
    v = values.long() if dim == 1 else values.long().t()
    per = 32 // bits
    v = v.reshape(v.shape[0], -1, per)
    if order is not None:
        v = v[..., list(order)]
    words = (v << torch.arange(0, 32, bits)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words if dim == 1 else words.t().contiguous()


def _unsigned(qt):
    """Codes [N, K] as the unsigned values both formats store, and zeros [N, G]."""
    s = qt.scheme
    q = lowbit.ops.unpack_bits(qt.codes, s.bits, signed=s.symmetric).long()
    groups = qt.scale.reshape(qt.shape[0], -1).shape[1]
    if s.symmetric:
        return q + (1 << (s.bits - 1)), torch.full((qt.shape[0], groups), 1 << (s.bits - 1))
    return q, qt.zero_point.long().reshape(qt.shape[0], -1)


def write_folder(model, folder, method, zero_minus_one=True, **config):
    """``model`` (quantized by lowbit) written as a GPTQ or AWQ folder."""
    folder.mkdir()
    tensors = {}
    group = None
    for name, mod in model.named_modules():
        if isinstance(mod, lowbit.nn.QuantLinear):
            qt = mod.qweight
            q, z = _unsigned(qt)
            scales = qt.scale.reshape(qt.shape[0], -1).t().contiguous()
            group = qt.scheme.group_size or -1
            if method == "gptq":
                stored = (z - 1) & 0xF if zero_minus_one else z
                tensors[f"{name}.qweight"] = _pack(q.t(), 4, dim=0)
                tensors[f"{name}.qzeros"] = _pack(stored.t(), 4, dim=1)
                tensors[f"{name}.g_idx"] = (torch.arange(qt.shape[1]) // (qt.scheme.group_size or qt.shape[1])
                                            ).to(torch.int32)
            else:
                tensors[f"{name}.qweight"] = _pack(q.t(), 4, dim=1, order=gptq.AWQ_ORDER)
                tensors[f"{name}.qzeros"] = _pack(z.t(), 4, dim=1, order=gptq.AWQ_ORDER)
            tensors[f"{name}.scales"] = scales
        elif isinstance(getattr(mod, "weight", None), torch.nn.Parameter):  # embedding, norms, lm_head
            tensors[f"{name}.weight"] = mod.weight.detach()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    cfg = model.config.to_dict()
    q = {"quant_method": method, "bits": 4, "group_size": group}
    if method == "gptq":
        q.update(sym=model.lowbit_recipe.weight.startswith("int4-sym"), desc_act=False,
                 checkpoint_format="gptq" if zero_minus_one else "gptq_v2")
    else:
        q.update(zero_point=True, version="gemm")
    q.update(config)
    cfg["quantization_config"] = q
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("method,weight,v1", [
    ("gptq", "int4-sym-g32-f16", True), ("gptq", "int4-asym-g32-f16", True), ("gptq", "int4-asym-g64-f16", False),
    ("gptq", "int4-asym-channel-f16", True), ("awq", "int4-asym-g32-f16", True), ("awq", "int4-asym-g64-f16", True)])
def test_round_trip(method, weight, v1, tmp_path):
    model = lowbit.quantize_model(tiny_llama(), lowbit.Recipe(weight=weight))
    if v1:  # AutoGPTQ's format cannot store a zero point of 0 (see test_wrapped_zero_is_refused)
        for mod in model.modules():
            if isinstance(mod, lowbit.nn.QuantLinear) and mod.qweight.zero_point is not None:
                assert int(mod.qweight.zero_point.min()) > 0
    folder = write_folder(model, tmp_path / "ckpt", method, zero_minus_one=v1)
    back, _ = lowbit.load_model(folder)
    assert back.lowbit_modules.keys() == model.lowbit_modules.keys()
    for name in model.lowbit_modules:
        a, b = model.get_submodule(name).qweight, back.get_submodule(name).qweight
        assert a.scheme == b.scheme, name
        assert torch.equal(lowbit.dequantize(a), lowbit.dequantize(b)), name
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_wrapped_zero_is_refused(tmp_path):
    model = lowbit.quantize_model(tiny_llama(), lowbit.Recipe(weight="int4-asym-g32-f16"))
    mlp = model.model.layers[0].mlp
    qt = lowbit.quantize(torch.rand(mlp.up_proj.out_features, mlp.up_proj.in_features), "int4-asym-g32-f16")
    assert int(qt.zero_point.min()) == 0  # every group >= 0: zero point 0, stored as 0 - 1 = 15
    mlp.up_proj = lowbit.nn.QuantLinear(qt)
    folder = write_folder(model, tmp_path / "ckpt", "gptq")
    with pytest.raises(ValueError, match=re.escape("zero point 16 is outside the 4-bit code range [0, 15]")):
        lowbit.load_model(folder)


def test_act_order_is_refused_by_name(tmp_path):
    model = lowbit.quantize_model(tiny_llama(), lowbit.Recipe(weight="int4-sym-g32-f16"))
    folder = write_folder(model, tmp_path / "ckpt", "gptq", desc_act=True)
    from safetensors.torch import load_file

    t = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.g_idx"
    t[name] = t[name].flip(0).contiguous()
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj': g_idx is not k // group_size"):
        lowbit.load_model(folder)


@pytest.mark.parametrize("config,error", [
    ({"bits": 3}, "bits 3 is not read"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not read"),
    ({"group_size": 48}, "group_size 48 must be -1 or a positive divisor"),
])
def test_bad_configs(config, error, tmp_path):
    model = lowbit.quantize_model(tiny_llama(), lowbit.Recipe(weight="int4-sym-g32-f16"))
    folder = write_folder(model, tmp_path / "ckpt", "gptq", **config)
    with pytest.raises(ValueError, match=re.escape(error)):
        lowbit.load_model(folder)
