"""compressed-tensors export: layouts and config checked against the compressed-tensors
package itself (it compresses the same model the same way, and decompresses our files),
and the export loaded by transformers."""

import json
import re

import pytest
import torch

import lowbit
from lowbit.formats import compressed_tensors as ct

ct_pkg = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
)
from safetensors.torch import load_file  # noqa: E402

VOCAB = 96


def tiny_llama(tie=True, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


# (weight scheme, activation scheme): weight-only packed, per channel, 8-bit packed, W8A8, W4A8
CASES = [
    ("int4-sym-g32", None),
    ("int4-asym-g32-f16", None),
    ("int4-asym-channel", None),
    ("int8-sym", None),
    ("int2-sym-g64-bf16", None),
    ("int3-asym-g32", None),
    ("int8-sym", "int8-sym-token"),
    ("int4-asym-g64-f16", "int8-asym-token"),
]


def quantized(weight, act=None, tie=True, **kw):
    return lowbit.quantize_model(tiny_llama(tie), lowbit.Recipe(weight=weight, activation=act, **kw))


def export(model, tmp_path, name="out"):
    return ct.export_compressed_tensors(model, None, tmp_path / name)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("shape", [(5, 37), (64, 96), (3, 1)])
def test_pack_is_the_packages(bits, dim, shape):
    lo = -(1 << (bits - 1))
    v = torch.randint(lo, -lo, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(bits))
    words = ct.pack(v, bits, dim)
    assert torch.equal(words, pack_to_int32(v, bits, packed_dim=dim))
    assert torch.equal(ct.unpack(words, bits, shape[dim], dim), v)
    assert torch.equal(unpack_from_int32(words, bits, torch.Size(shape), packed_dim=dim), v)


def test_pack_refuses_bad_input():
    with pytest.raises(ValueError, match="values must be a 2-D int8"):
        ct.pack(torch.zeros(4, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="hold 8 4-bit values, fewer than the 9"):
        ct.unpack(torch.zeros(2, 1, dtype=torch.int32), 4, 9)


def _package_export(model, config: dict, tmp_path):
    """The same model compressed and saved by the compressed-tensors package: lowbit's
    dequantized weights in float modules, the package's config applied, lowbit's scales
    and zero points (as signed values) copied in, then ModelCompressor.compress_model."""
    from lowbit.nn import QuantLinear

    ref = tiny_llama(model.config.tie_word_embeddings)
    qmods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    sd = {k: v for k, v in model.state_dict().items() if not any(k.startswith(n + ".") for n in qmods)}
    ref.load_state_dict(sd, strict=False)
    for n, m in qmods.items():
        ref.get_submodule(n).weight.data = lowbit.dequantize(m.qweight, torch.float32)
    qc = QuantizationConfig.model_validate(config)
    qc.quantization_status = QuantizationStatus.INITIALIZED
    apply_quantization_config(ref, qc)
    for n, m in qmods.items():
        mod, qt = ref.get_submodule(n), m.qweight
        mod.weight_scale.data = qt.scale.reshape(mod.weight_scale.shape).clone()
        if qt.zero_point is not None:
            zp = qt.zero_point.to(torch.int16) - (1 << (qt.scheme.bits - 1))
            mod.weight_zero_point.data = zp.to(torch.int8).reshape(mod.weight_scale.shape)
        mod.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(ref)
    compressor.compress_model(ref)
    out = tmp_path / "package"
    ref.save_pretrained(out)
    compressor.update_config(out)
    return out


@pytest.mark.parametrize("weight,act", CASES)
def test_export_is_what_the_package_writes(weight, act, tmp_path):
    model = quantized(weight, act)
    result = export(model, tmp_path)
    ours_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    ours = load_file(tmp_path / "out" / "model.safetensors")
    theirs_dir = _package_export(model, ours_cfg["quantization_config"], tmp_path)
    theirs_cfg = json.loads((theirs_dir / "config.json").read_text())
    theirs = load_file(theirs_dir / "model.safetensors")
    assert ours_cfg["quantization_config"] == theirs_cfg["quantization_config"]
    assert ours_cfg["architectures"] == theirs_cfg["architectures"] == ["LlamaForCausalLM"]
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]), k
    assert len(result.modules) == 14 and "lm_head.weight" not in ours  # tied: stored once


@pytest.mark.parametrize("weight,act", CASES)
def test_package_decompresses_to_lowbits_weights(weight, act, tmp_path):
    """The package's own decompressor, in float32, gives lowbit's dequantized weights bit
    for bit (every code times a float32 scale is exact, in both)."""
    from compressed_tensors.compressors.base import BaseCompressor

    model = quantized(weight, act)
    export(model, tmp_path)
    cfg = QuantizationConfig.model_validate(json.loads((tmp_path / "out" / "config.json").read_text())
                                            ["quantization_config"])
    scheme = cfg.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    for name, mod in model.named_modules():
        if not isinstance(mod, lowbit.nn.QuantLinear):
            continue
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        local["weight_scale"] = local["weight_scale"].float()
        got = compressor.decompress(local, scheme)["weight"]
        assert torch.equal(got.float(), lowbit.dequantize(mod.qweight, torch.float32)), name


def test_transformers_runs_the_same_weights(tmp_path):
    """transformers loads the export; its logits are those of the float model holding
    lowbit's dequantized weights, bit for bit (same library, same weights), and close to
    lowbit's own quantized model (whose matmuls are tested against the reference)."""
    from transformers import AutoModelForCausalLM

    model = quantized("int4-sym-g32")
    export(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    floats = tiny_llama()
    floats.load_state_dict(_dequantized_state(model))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want, ours = loaded(ids).logits, floats(ids).logits, model(ids).logits
    assert torch.equal(got, want)
    assert (got - ours).abs().max() <= 1e-4 * ours.abs().max()


def _dequantized_state(model, dtype=torch.float32):
    """The float state of ``model`` with every quantized weight dequantized to ``dtype``
    (then float32)."""
    sd = {}
    for name, mod in model.named_modules():
        if isinstance(mod, lowbit.nn.QuantLinear):
            sd[name + ".weight"] = lowbit.dequantize(mod.qweight, dtype).float()
    for k, v in model.state_dict().items():
        if not any(k.startswith(n + ".") for n in [k2[:-7] for k2 in sd]):
            sd.setdefault(k, v)
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def test_transformers_asymmetric_needs_dequantize(tmp_path):
    """The asymmetric zero points are packed along the rows, as the package's compressor
    writes them and vLLM reads them; transformers 5.23's compressed mode expects them
    unpacked (compressed-tensors' shape inference on meta tensors skips that packing), so
    it loads them only with CompressedTensorsConfig(dequantize=True).  That mode
    dequantizes in the scales' dtype (here float16), so its weights are lowbit's rounded
    to float16 once."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = quantized("int4-asym-g32-f16")
    export(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    floats = tiny_llama()
    floats.load_state_dict(_dequantized_state(model, torch.float16))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, floats(ids).logits)


def test_quantized_head_unties_and_groups_by_scheme(tmp_path):
    model = quantized("int4-sym-g32", lm_head="int8-sym")
    result = export(model, tmp_path)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    q = cfg["quantization_config"]
    assert cfg["tie_word_embeddings"] is False and q["ignore"] == []
    targets = {g["weights"]["num_bits"]: g["targets"] for g in q["config_groups"].values()}
    assert targets[8] == ["lm_head"] and len(targets[4]) == 14
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight_packed" in tensors
    assert len(result.modules) == 15
    QuantizationConfig.model_validate(q)  # the package accepts it


def test_refuses_what_has_no_form(tmp_path):
    for weight, why in [("int4-asym-g32-zpmin-f16", "'min' zero point"),
                        ("int4-asym-g32-zpfloat-f16", "'float' zero point")]:
        with pytest.raises(ct.CompressedTensorsError, match=why):
            export(quantized(weight), tmp_path, weight)
        assert not (tmp_path / weight).exists()
    with pytest.raises(ct.CompressedTensorsError, match="no quantized linears"):
        export(tiny_llama(), tmp_path, "float")
    with pytest.raises(ct.CompressedTensorsError, match="quantized embedding"):
        export(quantized("int8-sym", embedding="int8-sym"), tmp_path, "emb")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_overwrites_only_its_own_exports(tmp_path):
    model = quantized("int8-sym")
    export(model, tmp_path)
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        export(model, tmp_path)
    ct.export_compressed_tensors(model, None, tmp_path / "out", overwrite=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a compressed-tensors folder written by lowbit export"):
        ct.export_compressed_tensors(model, None, tmp_path / "mine", overwrite=True)
    lowbit.save_quantized(model, tmp_path / "ckpt")
    with pytest.raises(FileExistsError, match="not a compressed-tensors folder"):
        ct.export_compressed_tensors(model, None, tmp_path / "ckpt", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "mine", "out"]


# -- import: compressed-tensors folders into lowbit's modules --------------------------------
def _qlinears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, lowbit.nn.QuantLinear)}


@pytest.mark.parametrize("weight,act", CASES)
def test_round_trip_keeps_codes_and_logits(weight, act, tmp_path):
    model = quantized(weight, act)
    export(model, tmp_path)
    back, tok = lowbit.load_model(tmp_path / "out")
    assert tok is None and back.lowbit_modules.keys() == model.lowbit_modules.keys()
    for name, mod in _qlinears(model).items():
        a, b = mod.qweight, back.get_submodule(name).qweight
        assert a.scheme == b.scheme and torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale), name
        assert (a.zero_point is None) == (b.zero_point is None)
        assert a.zero_point is None or torch.equal(a.zero_point, b.zero_point)
        assert back.get_submodule(name).act_scheme == mod.act_scheme
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_static_activation_scale_round_trips(tmp_path):
    calibration = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    model = lowbit.quantize_model(tiny_llama(), lowbit.Recipe(weight="int8-sym", activation="int8-asym-tensor"),
                                  calibration=calibration)
    export(model, tmp_path)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg["config_groups"]["group_0"]["input_activations"]["dynamic"] is False
    back, _ = lowbit.load_model(tmp_path / "out")
    for name, mod in _qlinears(model).items():
        got = back.get_submodule(name)
        assert torch.equal(got.act_scale, mod.act_scale) and torch.equal(got.act_zero_point, mod.act_zero_point)


@pytest.mark.parametrize("weight,act", [("int4-asym-g32-f16", None), ("int8-sym", "int8-sym-token")])
def test_reads_what_the_package_writes(weight, act, tmp_path):
    model = quantized(weight, act)
    export(model, tmp_path)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    theirs = _package_export(model, cfg, tmp_path)
    back, _ = lowbit.load_model(theirs)
    for name, mod in _qlinears(model).items():
        assert torch.equal(lowbit.dequantize(back.get_submodule(name).qweight), lowbit.dequantize(mod.qweight))


def test_imported_q4_0_becomes_exact_gguf(tmp_path):
    """compressed-tensors in, GGUF out: symmetric 4-bit codes in groups of 32 with float16
    scales are Q4_0 exactly (the bundled model, its first layer quantized)."""
    from lowbit.formats.gguf_export import export_gguf

    model, tok = lowbit.load_model()
    lowbit.quantize_model(model, lowbit.Recipe(weight="int4-sym-g32-f16", modules=[r"layers\.0\."]))
    ct.export_compressed_tensors(model, tok, tmp_path / "ct")
    back, tok2 = lowbit.load_model(tmp_path / "ct")
    out = export_gguf(back, tok2, tmp_path / "m.gguf", strict=True)
    assert sorted(t.name for t in out.tensors if t.ggml_type == "Q4_0") == sorted(
        f"blk.0.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"))


def _corrupt(tmp_path, edit_tensors=None, edit_config=None):
    """An export of a small W4A16 asymmetric model with one thing changed."""
    from safetensors.torch import save_file

    model = quantized("int4-asym-g32-f16")
    export(model, tmp_path)
    folder = tmp_path / "out"
    if edit_tensors:
        t = load_file(folder / "model.safetensors")
        edit_tensors(t)
        save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        c = json.loads((folder / "config.json").read_text())
        edit_config(c["quantization_config"])
        (folder / "config.json").write_text(json.dumps(c))
    return folder


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit_tensors,edit_config,error", [
    (lambda t: t.__setitem__(f"{Q}.weight_scale", t[f"{Q}.weight_scale"] * float("nan")), None,
     f"{Q}.weight_scale holds NaN or Inf"),
    (lambda t: t.__setitem__(f"{Q}.weight_scale", t[f"{Q}.weight_scale"][:, :1]), None,
     f"{Q}.weight_scale has shape"),
    (lambda t: t.pop(f"{Q}.weight_zero_point"), None, f"tensor '{Q}.weight_zero_point' is missing"),
    (lambda t: t.__setitem__(f"{Q}.weight_packed", t[f"{Q}.weight_packed"].float()), None,
     f"'{Q}.weight_packed' has dtype torch.float32"),
    (lambda t: t.__setitem__(f"{Q}.weight_shape", torch.tensor([64, 65])), None, "weight_shape is [64, 65]"),
    (lambda t: t.__setitem__("extra", torch.zeros(1)), None, "tensors the model does not use: ['extra']"),
    (None, lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=5), "num_bits=5 is not read"),
    (None, lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block"), "strategy='block'"),
    (None, lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder='group'"),
    (None, lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme is set"),
    (None, lambda q: q.update(quantization_status="frozen"), "quantization_status is 'frozen'"),
    (None, lambda q: q["config_groups"]["group_0"].update(targets=["Conv2d"]), "no module of the model matches"),
    (None, lambda q: q["config_groups"]["group_0"].update(format="marlin-24"), "format 'marlin-24' is not read"),
    (None, lambda q: q["config_groups"]["group_0"].update(targets=[7]), "targets must be a list of non-empty strings"),
    (None, lambda q: q.update(ignore=["re:("]), "'re:(' is not a valid regular expression"),
])
def test_bad_folders_are_refused_by_name(tmp_path, edit_tensors, edit_config, error):
    folder = _corrupt(tmp_path, edit_tensors, edit_config)
    with pytest.raises(ValueError, match=re.escape(error)):
        lowbit.load_model(folder)


def test_layer_count_is_checked_before_the_model_is_built(tmp_path):
    folder = _corrupt(tmp_path)
    c = json.loads((folder / "config.json").read_text())
    c["num_hidden_layers"] = 2**31  # building that many layers would never end
    (folder / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=re.escape("num_hidden_layers is 2147483648 but")):
        lowbit.load_model(folder)


def test_out_of_range_int_codes_are_refused(tmp_path):
    model = quantized("int4-asym-g64-f16", "int8-asym-token")
    export(model, tmp_path)
    from safetensors.torch import save_file

    t = load_file(tmp_path / "out" / "model.safetensors")
    t[f"{Q}.weight"][0, 0] = 9
    save_file(t, str(tmp_path / "out" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(f"{Q}.weight holds values outside the 4-bit range [-8, 7]")):
        lowbit.load_model(tmp_path / "out")
