"""GGUF export: codes kept where the scheme maps onto a ggml type, the file read back by
the gguf package and by transformers' GGUF loader, tokenizer metadata as llama.cpp's
converter wrote it for the bundled model, strict refusals and atomic writes."""

import warnings

import numpy as np
import pytest
import torch

import lowbit
from lowbit.formats import ggml
from lowbit.formats.gguf_export import (GGUFExportError, default_type, encode, export_gguf, gguf_name, target_type,
                                        rope_rows)

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def bundled():
    model, tok = lowbit.load_model(progress=False)
    return model, tok


def quantized(model, scheme: str, **kw):
    return lowbit.quantize_model(model, lowbit.Recipe(weight=scheme, **kw), inplace=False)


def read(path):
    from lowbit.formats.gguf_file import read_gguf

    return read_gguf(path)


@pytest.mark.parametrize("scheme, target", [
    ("int4-sym-g32-f16", "Q4_0"), ("int4-sym-g128-f16", "Q4_0"), ("int3-sym-g64-f16", "Q4_0"),
    ("int2-sym-g32-f16", "Q4_0"), ("int8-sym-g32-f16", "Q8_0"), ("int4-sym-g32-f16", "Q8_0"),
    ("int4-sym-g32-f16", "Q4_1"), ("int4-sym-g64-f16", "Q5_0"), ("int8-sym-channel-f16", "Q8_0"),
    ("int4-sym-tensor-f16", "Q4_0"),
])
def test_codes_are_kept_exactly(scheme, target):
    """Symmetric codes with float16 scales in whole 32-value blocks store exactly: the
    ggml dequantization equals lowbit's bit for bit."""
    qt = lowbit.quantize(torch.randn(16, 256) * 3, scheme)
    raw, how = encode(qt, target)
    assert how == "codes kept"
    assert torch.equal(ggml.dequantize(raw, target, [16, 256]), lowbit.dequantize(qt))


def test_asymmetric_codes_keep_codes_and_round_the_min():
    """Q4_1's min is float16: -zero_point * scale is rounded once, so the error is that
    rounding (at most 2^-11 of |min| per value), orders below the 4-bit grid's."""
    w = torch.randn(16, 256)
    qt = lowbit.quantize(w, "int4-asym-g32-f16")
    raw, how = encode(qt, "Q4_1")
    ref = lowbit.dequantize(qt)
    got = ggml.dequantize(raw, "Q4_1", [16, 256])
    assert how == "codes kept"
    d, m, q = ggml._simple_parts(raw.reshape(-1, 20), "Q4_1")
    assert torch.equal(q.reshape(16, 256), lowbit.ops.unpack_bits(qt.codes, 4, signed=False).to(torch.int32))
    bound = (m.abs() * 2.0**-11).reshape(16, 8).repeat_interleave(32, dim=1)
    assert bool(((got - ref).abs() <= bound).all())
    assert (got - ref).norm() / ref.norm() < 1e-3 < (w - ref).norm() / w.norm()


def test_what_cannot_keep_its_codes_is_requantized_and_says_why():
    qt = lowbit.quantize(torch.randn(8, 64), "int8-asym-g32")
    raw, how = encode(qt, "Q8_0")
    assert how == "re-quantized (Q8_0 has no zero point)"
    assert torch.equal(raw, ggml.quantize(lowbit.dequantize(qt), "Q8_0"))
    assert encode(lowbit.quantize(torch.randn(8, 64), "int8-sym-g32"), "Q4_0")[1] == \
        "re-quantized (8-bit codes do not fit Q4_0)"
    big = lowbit.quantize(torch.randn(8, 64) * 1e7, "int4-sym-g32")  # scales beyond float16
    assert encode(big, "Q4_0")[1] == "re-quantized (its scales overflow float16)"
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        encode(torch.randn(4, 48), "Q8_0")


def test_default_types():
    q = lambda s: lowbit.quantize(torch.randn(4, 64), s)  # noqa: E731
    assert [default_type(q(s)) for s in ("int4-sym-g32", "int2-asym-g64", "int8-sym", "int8-asym-g32")] == \
        ["Q4_0", "Q4_1", "Q8_0", "Q8_0"]
    assert default_type(torch.zeros(2, dtype=torch.bfloat16)) == "BF16"


def test_names_and_rope_order():
    assert gguf_name("model.layers.12.self_attn.o_proj") == "blk.12.attn_output"
    assert gguf_name("lm_head") == "output" and gguf_name("model.layers.0.mlp") is None
    idx = rope_rows(12, 2)  # 2 heads of 6 rows: halves [0 1 2 | 3 4 5] interleaved
    assert idx.tolist() == [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]


def test_bundled_export_reads_back_exactly_with_the_original_metadata(bundled, tmp_path):
    model, tok = bundled
    q = quantized(model, "int4-sym-g32-f16")
    out = export_gguf(q, tok, tmp_path / "m.gguf", strict=True)
    assert {(t.ggml_type, t.how) for t in out.tensors} == {("F32", "float"), ("Q4_0", "codes kept")}
    new, old = read(tmp_path / "m.gguf"), read(None)
    assert out.bits_per_weight == 8 * sum(int(t.n_bytes) for t in new.tensors) / sum(int(t.n_elements) for t in new.tensors)
    heads = {"attn_q": 9, "attn_k": 3}
    tensors = {t.name: t for t in new.tensors}
    assert set(tensors) == {t.name for t in old.tensors}
    for name, mod in q.named_modules():
        base = gguf_name(name)
        if base is None or not hasattr(mod, "qweight"):
            continue
        t = tensors[base + ".weight"]
        assert t.tensor_type.name == "Q4_0"
        w = lowbit.dequantize(mod.qweight)
        kind = base.split(".")[-1]
        if kind in heads:
            w = w[rope_rows(w.shape[0], heads[kind])]
        stored = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        assert np.array_equal(stored, w.numpy()), base
    for key, field in old.fields.items():  # everything llama.cpp reads, as its converter wrote it
        if key.startswith(("tokenizer.", "llama.")):
            assert new.fields[key].contents() == field.contents(), key
    assert new.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_0)


def test_transformers_loads_the_export_with_the_same_logits(bundled, tmp_path):
    """A second client: transformers' GGUF loader (it undoes llama.cpp's q/k row order)
    gets exactly lowbit's dequantized weights, so its logits equal lowbit's model run on
    those float weights."""
    transformers = pytest.importorskip("transformers")
    model, tok = bundled
    q = quantized(model, "int4-sym-g128-f16")
    export_gguf(q, tok, tmp_path / "m.gguf", strict=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    ours = lowbit.models.dequantized_copy(q)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = theirs(ids).logits, ours(ids).logits
    assert torch.equal(a, b)


def test_strict_refuses_and_writes_nothing(bundled, tmp_path):
    model, tok = bundled
    q = quantized(model, "int4-asym-g32-f16")
    with pytest.raises(GGUFExportError, match=r"tensor blk\.0\.\w+\.weight \(int4-asym-g32-f16\) is not stored "
                                              r"exactly as Q4_1 \(codes kept"):
        export_gguf(q, tok, tmp_path / "m.gguf", strict=True)
    assert list(tmp_path.iterdir()) == []
    with pytest.warns(UserWarning, match="210 of 272 tensors are not stored exactly"):
        out = export_gguf(q, tok, tmp_path / "m.gguf")
    assert sum(not t.exact for t in out.tensors) == 210 and "210 not exact" in out.table()


def test_output_is_checked_before_any_work(bundled, tmp_path):
    model, tok = bundled
    (tmp_path / "m.gguf").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        export_gguf(model, tok, tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_bytes() == b"mine"
    with pytest.raises(ValueError, match="type must be one of"):
        export_gguf(model, tok, tmp_path / "n.gguf", type="q4_k_m")
    with pytest.raises(FileNotFoundError, match="output folder"):
        export_gguf(model, tok, tmp_path / "no" / "m.gguf")
    with pytest.raises(IsADirectoryError):
        export_gguf(model, tok, tmp_path)


def test_failed_write_leaves_no_file(bundled, tmp_path, monkeypatch):
    model, tok = bundled
    q = quantized(model, "int8-sym-g32-f16")

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError, match="disk full"):
        export_gguf(q, tok, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_float_model_with_a_type(bundled, tmp_path):
    """A float model: linears quantized to the asked type by ggml's quantizer (bit-identical
    with gguf's), the embedding kept float32 or stored as float_type."""
    model, tok = bundled
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = export_gguf(model, tok, tmp_path / "m.gguf", type="q8_0", float_type="f16")
    kinds = {t.name: (t.ggml_type, t.how) for t in out.tensors}
    assert kinds["blk.0.ffn_up.weight"] == ("Q8_0", "quantized from float")
    assert kinds["token_embd.weight"] == ("F16", "float")
    assert kinds["output_norm.weight"] == ("F32", "float")
    t = {t.name: t for t in read(tmp_path / "m.gguf").tensors}["blk.0.ffn_up.weight"]
    w = model.model.layers[0].mlp.up_proj.weight.detach()
    expected = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), expected.view(np.uint8).reshape(-1))


def test_k_quants_where_rows_are_super_blocks_and_llama_cpp_fallbacks_elsewhere(bundled, tmp_path):
    """--type q4_k on the bundled model: ffn_down (1536 wide) is Q4_K, written by
    lowbit.formats.kquants; the 576-wide linears are Q5_0, llama.cpp's fallback, with a
    warning and their own row of the table; the file reads back as written."""
    from lowbit.formats import kquants

    model, tok = bundled
    with pytest.warns(UserWarning, match=r"180 of 272 tensors are stored as another type than asked for \(Q5_0, "
                                         r"not Q4_K: rows of 576 values are not whole 256-value super-blocks\)"):
        out = export_gguf(model, tok, tmp_path / "m.gguf", type="q4_k")
    kinds = {t.name: t for t in out.tensors}
    down, up = kinds["blk.3.ffn_down.weight"], kinds["blk.3.ffn_up.weight"]
    assert (down.ggml_type, down.fallback) == ("Q4_K", None) and down.nbytes * 8 / down.numel == 4.5
    assert up.ggml_type == "Q5_0" and up.fallback.startswith("Q5_0, not Q4_K")
    assert sum(t.ggml_type == "Q4_K" for t in out.tensors) == 30
    assert any("Q5_0, not Q4_K" in line for line in out.table().splitlines())
    t = {t.name: t for t in read(tmp_path / "m.gguf").tensors}["blk.3.ffn_down.weight"]
    w = model.model.layers[3].mlp.down_proj.weight.detach()
    assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), kquants.quantize(w, "Q4_K").reshape(-1).numpy())
    assert target_type((8, 512), "Q6_K") == ("Q6_K", None) and target_type((8, 96), "Q2_K")[0] == "Q4_0"


def test_the_bundled_model_round_trips_byte_for_byte(bundled, tmp_path):
    """GGUF Q4_1 -> float -> lowbit's q4_1 preset (the 'min' zero point) -> GGUF Q4_1:
    every linear tensor's bytes equal the original file's."""
    model, tok = bundled
    export_gguf(lowbit.quantize_model(model, "q4_1", inplace=False), tok, tmp_path / "m.gguf", strict=True)
    old = {t.name: t for t in read(None).tensors}
    new = {t.name: t for t in read(tmp_path / "m.gguf").tensors}
    linears = [n for n, t in old.items() if t.tensor_type.name == "Q4_1"]
    assert len(linears) == 210
    for n in linears:
        assert np.array_equal(np.asarray(new[n].data).view(np.uint8), np.asarray(old[n].data).view(np.uint8)), n


def test_8_bit_codes_that_fit_5_bits_go_to_q5_exactly():
    """What a Q5_0 / Q5_1 tensor loads into (8-bit codes of 5-bit range, any float16 d,
    not only ggml's max / -16) goes back to Q5_x with its codes; wider codes to Q8_0."""
    codes = torch.randint(-10, 11, (4, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    sym = lowbit.QTensor(codes, torch.full((4, 2), 0.1, dtype=torch.float16), None,
                         lowbit.QuantScheme.parse("int8-sym-g32-f16"), torch.Size((4, 64)))
    assert default_type(sym) == "Q5_0"
    raw, how = encode(sym, "Q5_0")
    assert how == "codes kept" and torch.equal(ggml.dequantize(raw, "Q5_0", [4, 64]), lowbit.dequantize(sym))
    raw, how = encode(sym, "Q5_1")  # signed codes into the min type: + 16, m = -16 d
    assert how == "codes kept" and torch.equal(ggml.dequantize(raw, "Q5_1", [4, 64]), lowbit.dequantize(sym))
    wide = lowbit.QTensor(codes * 3, sym.scale, None, sym.scheme, sym.shape)
    assert default_type(wide) == "Q8_0" and encode(wide, "Q5_0")[1] == "re-quantized (8-bit codes do not fit Q5_0)"


def test_act_order_weights_keep_their_codes_type(monkeypatch):
    """An act-order weight is written re-quantized, as the type its codes would have had
    (Q4_0 here), not as the float32 it is re-quantized from."""
    from lowbit.formats.gguf_export import _weights

    lin = torch.nn.Linear(64, 32, bias=False)
    q = lowbit.nn.QuantLinear(lowbit.quantize(lin.weight.detach(), "int4-sym-g32-f16"),
                              input_order=torch.randperm(64, generator=torch.Generator().manual_seed(0)))
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].mlp = torch.nn.Module()
    model.model.layers[0].mlp.up_proj = q
    [(name, _, w, source, held)] = _weights(model)
    assert (name, source, default_type(held)) == ("blk.0.ffn_up.weight", "int4-sym-g32-f16 act-order", "Q4_0")
    assert torch.equal(w, q.dequantized_weight())
