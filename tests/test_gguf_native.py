"""GGUF files loaded into lowbit modules without a float copy (``load_model(gguf="native")``)."""

import warnings

import pytest
import torch

import lowbit
from lowbit.evaluation import evaluate
from lowbit.formats.gguf_export import export_gguf
from lowbit.nn import QuantEmbedding, QuantLinear

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def both():
    native, tok = lowbit.load_model(gguf="native", progress=False)
    floating, _ = lowbit.load_model(progress=False)
    return native, floating, tok


def test_the_bundled_model_keeps_its_own_4_bit_weights(both):
    native, floating, _ = both
    linears = {n: m for n, m in native.named_modules() if isinstance(m, QuantLinear) and n != "lm_head"}
    assert len(linears) == 210 and {str(m.qweight.scheme) for m in linears.values()} == {"int4-asym-g32-zpmin-f16"}
    for name, m in linears.items():  # the file's Q4_1 values, bit for bit (q/k rows back in HF order)
        assert torch.equal(lowbit.dequantize(m.qweight), floating.get_submodule(name).weight), name
    emb = native.model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and str(emb.weight.scheme) == "int8-sym-g32-f16"
    assert torch.equal(lowbit.dequantize(emb.weight.qtensor()), floating.model.embed_tokens.weight)
    assert native.lm_head.weight.codes is emb.weight.codes  # tied: one copy
    assert native.lowbit_gguf == {"native": {"Q8_0": 1, "Q4_1": 210}, "dequantized": {}}
    size = lowbit.evaluation.weight_bytes(native)["weight_bytes"]
    assert size < 100e6 < lowbit.evaluation.weight_bytes(floating)["weight_bytes"] / 5


def test_its_decode_step_runs_in_cpp_on_the_packed_q4_1_weights(both):
    """Q4_1's q * s + m runs on the packed codes (the float32 row kernel), so the whole
    decode step is C++ (lowbit.runtime's native decoder) and agrees with the Python path."""
    from lowbit.kernels import cpu
    from lowbit.runtime import Runner

    if not cpu.available() or not cpu._has_gemv_f32():
        pytest.skip("no AVX2 row kernel in lowbit._C")
    native, _, tok = both
    r = Runner(native)
    assert r._decoder is not None
    ids = tok("The capital of France is", return_tensors="pt").input_ids[0]
    cache = r.new_cache(16)
    r.forward(ids, cache)
    step = r.forward(torch.tensor([7]), cache)
    with torch.no_grad():  # the module's own forward over prompt + token: the same weights
        whole = native(torch.cat([ids, torch.tensor([7])])[None]).logits[0, -1]
    # float32 sums in other orders over 30 layers (the row kernels, C++ attention against
    # torch's): ~5e-5 on logits of magnitude ~20, with a 20x margin
    assert (step[-1].float() - whole.float()).abs().max() <= 1e-3


def test_its_perplexity_is_that_of_its_float_dequantization(both):
    """Same weights; only the output projection's matmul (int8 codes against float32)
    sums in another order."""
    native, floating, tok = both
    a = evaluate({"native": native}, tok, ctx=128, max_windows=2, speed=False)[0]["perplexity"]
    b = evaluate({"float": floating}, tok, ctx=128, max_windows=2, speed=False)[0]["perplexity"]
    assert abs(a / b - 1) < 1e-5


@pytest.mark.parametrize("recipe, heads", [("q4_0", 1), ("q4_1", 0)])
def test_round_trip_lowbit_gguf_lowbit_keeps_codes_and_scales(both, tmp_path, monkeypatch, recipe, heads):
    # q4_0's output projection is Q8_0, a tensor of its own; q4_1's stays float, tied to the
    # embedding and written once
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))  # the file's tokenizer entry goes there
    _, floating, tok = both
    q = lowbit.quantize_model(floating, recipe, inplace=False)
    export_gguf(q, tok, tmp_path / "m.gguf", strict=True)
    back, _ = lowbit.load_model(tmp_path / "m.gguf", gguf="native")
    again = export_gguf(back, tok, tmp_path / "again.gguf", strict=True)
    assert [t.name for t in again.tensors].count("output.weight") == heads
    for name, m in q.named_modules():
        if isinstance(m, QuantLinear):
            a, b = m.qweight, back.get_submodule(name).qweight
            assert a.scheme == b.scheme and torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale), name


@pytest.mark.parametrize("type, fallback", [("q4_k", "Q5_0"), ("q6_k", "Q8_0")])
def test_k_quants_and_their_fallbacks_load_natively(both, tmp_path, monkeypatch, type, fallback):
    """An export with K-quants (ffn_down, 1536 wide) and llama.cpp's fallback types (the
    576-wide rest) loads into QuantLinears whose weights are the file's, bit for bit; only
    the float embedding is a float module."""
    import numpy as np

    from lowbit.formats import ggml
    from lowbit.formats.gguf_file import read_gguf

    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    _, floating, tok = both
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_gguf(floating, tok, tmp_path / "m.gguf", type=type, float_type="f16")
    back, _ = lowbit.load_model(tmp_path / "m.gguf", gguf="native")
    k = type.upper()
    assert back.lowbit_gguf == {"native": {k: 30, fallback: 180}, "dequantized": {"F16": 1}}
    file = {t.name: t for t in read_gguf(tmp_path / "m.gguf").tensors}
    for i in (0, 29):
        for module, name, typ in [("mlp.down_proj", "ffn_down", k), ("mlp.up_proj", "ffn_up", fallback)]:
            m = back.get_submodule(f"model.layers.{i}.{module}")
            t = file[f"blk.{i}.{name}.weight"]
            raw = torch.from_numpy(np.asarray(t.data).reshape(-1).view(np.uint8).copy())
            assert isinstance(m, QuantLinear) and str(m.qweight.scheme) == ggml.LOSSLESS_SCHEMES[typ]
            assert torch.equal(lowbit.dequantize(m.qweight), ggml.dequantize(raw, typ, m.qweight.shape))
    size = lowbit.evaluation.weight_bytes(back)["weight_bytes"]
    assert size < lowbit.evaluation.weight_bytes(floating)["weight_bytes"] / 2
    # and written back (each weight's default type: the one it came from; the float
    # embedding was float16), every tensor byte for byte
    out = export_gguf(back, tok, tmp_path / "again.gguf", float_type="f16", strict=True)
    assert {t.ggml_type for t in out.tensors} == {k, fallback, "F16", "F32"}
    again = {t.name: t for t in read_gguf(tmp_path / "again.gguf").tensors}
    for name, t in file.items():
        assert again[name].tensor_type == t.tensor_type, name
        assert np.array_equal(np.asarray(again[name].data).view(np.uint8), np.asarray(t.data).view(np.uint8)), name


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="gguf must be one of \\('float', 'native'\\), got 'fast'"):
        lowbit.load_model(gguf="fast")


def test_native_model_exports_to_the_same_bytes(both, tmp_path):
    """GGUF -> lowbit modules -> GGUF: every tensor's bytes are the original file's (the
    tied Q8_0 embedding written once, the Q4_1 linears with their own codes)."""
    import numpy as np

    from lowbit.formats.gguf_file import read_gguf

    native, _, tok = both
    out = export_gguf(native, tok, tmp_path / "m.gguf", strict=True)
    assert {t.ggml_type for t in out.tensors} == {"F32", "Q4_1", "Q8_0"}
    old = {t.name: t for t in read_gguf(None).tensors}
    new = {t.name: t for t in read_gguf(tmp_path / "m.gguf").tensors}
    assert set(new) == set(old)
    for name, t in old.items():
        assert new[name].tensor_type == t.tensor_type
        assert np.array_equal(np.asarray(new[name].data).view(np.uint8), np.asarray(t.data).view(np.uint8)), name


def test_the_tokenizer_is_converted_once_and_cached(tmp_path, monkeypatch):
    """Without a float conversion in the cache, the first native load converts the
    tokenizer through transformers and caches it alone (no float weights written)."""
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path))
    _, tok = lowbit.load_model(gguf="native", progress=False)
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert len(entries) == 1 and entries[0].endswith("-tokenizer")
    assert not list(tmp_path.glob("*/model.safetensors"))
    _, again = lowbit.load_model(gguf="native", progress=False)
    assert again("Hello, world").input_ids == tok("Hello, world").input_ids
    assert sorted(p.name for p in tmp_path.iterdir()) == entries
