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
            position = torch.arange(qt.shape[1])  # of each input channel among the columns
            if mod.input_order is not None:  # act-order: the file keeps the input's order
                position = torch.argsort(mod.input_order)
                q = q[:, position]
            if method == "gptq":
                stored = (z - 1) & 0xF if zero_minus_one else z
                tensors[f"{name}.qweight"] = _pack(q.t(), 4, dim=0)
                tensors[f"{name}.qzeros"] = _pack(stored.t(), 4, dim=1)
                tensors[f"{name}.g_idx"] = (position // (qt.scheme.group_size or qt.shape[1])).to(torch.int32)
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


def _act_order(model, seed=0):
    """Give every QuantLinear of ``model`` random act-order groups: each input channel a
    random group (group_size channels each), columns sorted by group as the loader sorts
    them, so a GPTQ folder written from it loads back to the same modules."""
    gen = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, lowbit.nn.QuantLinear):
            k, g = mod.in_features, mod.qweight.scheme.group_size
            groups = torch.randperm(k, generator=gen) // g
            mod.input_order = torch.sort(groups, stable=True).indices
    return model


def test_act_order_loads_with_its_input_order(tmp_path):
    """A desc_act checkpoint (g_idx a random balanced assignment of channels to groups)
    loads with the file's codes, its columns sorted by group: the same weights and
    logits, bit for bit, as the modules it was written from; the C++ decode step steps
    aside (it has no permutation) and the Python path runs it."""
    from lowbit.runtime import Runner

    model = _act_order(lowbit.quantize_model(tiny_llama(), lowbit.Recipe(weight="int4-asym-g32-f16")))
    folder = write_folder(model, tmp_path / "ckpt", "gptq", desc_act=True)
    from safetensors.torch import load_file

    g_idx = load_file(folder / "model.safetensors")["model.layers.0.mlp.down_proj.g_idx"]
    assert not torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // 32)  # a real act-order file
    back, _ = lowbit.load_model(folder)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    for name in model.lowbit_modules:
        a, b = model.get_submodule(name), back.get_submodule(name)
        assert torch.equal(a.input_order, b.input_order) and torch.equal(a.qweight.codes, b.qweight.codes), name
        assert not torch.equal(b.input_order, torch.arange(b.in_features)), name
        assert torch.equal(a.dequantized_weight(), b.dequantized_weight()), name
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
        plain = lowbit.models.dequantized_copy(back)(ids).logits  # float weights in the input's order
        assert torch.allclose(plain, back(ids).logits, rtol=0, atol=1e-4)
    assert Runner(back)._decoder is None


def test_act_order_survives_a_checkpoint_and_is_re_quantized_for_gguf(tmp_path):
    from lowbit.formats.compressed_tensors import CompressedTensorsError, export_compressed_tensors
    from lowbit.formats.gguf_export import _weights

    model = _act_order(lowbit.quantize_model(tiny_llama(), lowbit.Recipe(weight="int4-sym-g32-f16")))
    back, _ = lowbit.load_model(lowbit.save_quantized(model, tmp_path / "ckpt"))
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    up = back.model.layers[0].mlp.up_proj
    assert torch.equal(up.input_order, model.model.layers[0].mlp.up_proj.input_order)
    with pytest.raises(CompressedTensorsError, match="act-order groups .input_order"):
        export_compressed_tensors(back, None, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()
    written = {module: (w, source) for _, module, w, source, _ in _weights(back)}  # what export_gguf stores
    w, source = written["model.layers.0.mlp.up_proj"]
    assert source == "int4-sym-g32-f16 act-order" and torch.equal(w, up.dequantized_weight())


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


@pytest.mark.parametrize("g_idx, error", [
    (torch.tensor([0, 0, 0, 1]), r"exactly 2 input channels in each of the 2 groups .* group sizes \[1, 3\]"),
    (torch.tensor([0, 1, 2, 1]), r"values 0..2"),
    (torch.tensor([0, 1, 1]), r"g_idx has shape \(3,\), expected \(4,\)"),
])
def test_unbalanced_or_bad_g_idx_is_refused(g_idx, error):
    with pytest.raises(gptq.GPTQFormatError, match=error):
        gptq.input_order(g_idx, 4, 2)


def test_input_order_must_be_a_permutation():
    qt = lowbit.quantize(torch.randn(8, 32), "int4-sym-g32")
    with pytest.raises(ValueError, match=r"input_order must be a permutation of 0..31"):
        lowbit.nn.QuantLinear(qt, input_order=torch.zeros(32, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"input_order must be an int64 tensor of shape \(32,\)"):
        lowbit.nn.QuantLinear(qt, input_order=torch.arange(16))
