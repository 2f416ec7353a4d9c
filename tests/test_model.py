"""The model pipeline on the bundled SmolLM2-135M: load, quantize, run, evaluate, save."""

import json
import os

import pytest
import torch

import lowbit
from lowbit.kernels import cpu
from lowbit.models import dequantized_copy
from lowbit.models.checkpoint import CheckpointError
from lowbit.nn import QuantLinear
from lowbit.runtime import Runner

from .conftest import FAST_BACKENDS as _FAST
from .conftest import biased_llama

# a whole model through Triton's interpreter takes minutes: the model tests run the compiled backends
FAST_BACKENDS = [b for b in _FAST if b != "triton"]

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def smol():
    model, tok = lowbit.load_model()
    return model, tok


@pytest.fixture(scope="session")
def prompt_ids(smol):
    return torch.tensor(smol[1](PROMPT).input_ids)


def test_bundled_model_loads_as_the_llama_the_issue_describes(smol):
    model, tok = smol
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == ("llama", 30, 576, 9, 3, 1536, 49152)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight is model.model.embed_tokens.weight


@torch.inference_mode()
def test_runner_matches_transformers_forward(smol, prompt_ids, monkeypatch):
    model, _ = smol
    ref = model(prompt_ids[None]).logits[0]
    monkeypatch.setenv("LOWBIT_NATIVE_DECODE", "0")  # the Python path, torch's attention
    r = Runner(model)
    # same ops in the same order as transformers' eager Llama: bit-identical
    assert torch.equal(r.forward(prompt_ids, r.new_cache(32), all_logits=True), ref)
    monkeypatch.undo()
    r = Runner(model)
    full = r.forward(prompt_ids, r.new_cache(32), all_logits=True)
    # with lowbit's prefill attention kernel (AVX-512 builds) the attention sums in another
    # order, as over a cache below
    torch.testing.assert_close(full, ref, rtol=0, atol=1e-3)
    cache = r.new_cache(32)
    r.forward(prompt_ids[:2], cache)
    chunk = r.forward(prompt_ids[2:], cache, all_logits=True)
    # attention over a cache (masked SDPA) sums in another order: float32 rounding of
    # logits of magnitude ~20 over 30 layers stays far below 1e-3
    torch.testing.assert_close(chunk, ref[2:], rtol=0, atol=1e-3)


def test_runner_greedy_matches_transformers_generate(smol, prompt_ids):
    model, _ = smol
    hf = model.generate(prompt_ids[None], max_new_tokens=16, do_sample=False)[0, prompt_ids.numel():].tolist()
    assert Runner(model).generate(prompt_ids, 16).tokens == hf


def test_recipe_selects_the_seven_decoder_linears(smol):
    model, _ = smol
    q = lowbit.quantize_model(model, "int4-g64", inplace=False)
    quant = [n for n, m in q.named_modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 210 and all(n.startswith("model.layers.") for n in quant)
    assert type(q.lm_head).__name__ == "Linear" and q.lm_head.weight is model.lm_head.weight
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear"  # original untouched
    w = q.model.layers[0].mlp.up_proj.qweight
    assert str(w.scheme) == "int4-asym-g64" and w.codes.dtype == torch.int32 and w.codes.shape == (1536, 72)


def test_group_size_falls_back_when_it_does_not_divide_in_features(smol):
    model, _ = smol
    q = lowbit.quantize_model(model, "w4a16-g128", inplace=False)
    assert q.lowbit_modules["model.layers.0.mlp.down_proj"]["weight"] == "int4-asym-g128-f16"  # K = 1536
    assert q.lowbit_modules["model.layers.0.mlp.up_proj"]["weight"] == "int4-asym-g64-f16"     # K = 576


@torch.inference_mode()
@pytest.mark.parametrize("backend", ["reference"] + FAST_BACKENDS)
def test_in_graph_int4_dequant_matches_the_host_dequantized_baseline(smol, prompt_ids, backend):
    """int4 affine g64 packed 8 per uint32 on the 7 linears: the quantized model's logits
    equal a float model holding the host-dequantized weights.  Both compute float32
    dot products of the same float32 weights (exact: (q - z) * s is computed once in
    float32 by both); only the summation order differs, float32 rounding ~1e-7
    relative over K <= 1536 per layer, far inside the 1e-4 asked."""
    model, _ = smol
    q = lowbit.quantize_model(model, "int4-g64", backend=backend, inplace=False)
    host = dequantized_copy(q)
    for ids in (prompt_ids, prompt_ids[:1]):  # a prompt (M = 5) and one token (M = 1: the decode kernels)
        got, want = q(ids[None]).logits, host(ids[None]).logits
        assert (got - want).abs().max() <= 1e-4


@torch.inference_mode()
def test_int4_g64_greedy_48_tokens_agree_between_backends(smol, prompt_ids):
    """The fast backend decodes 48 greedy tokens one at a time (M = 1 kernels, KV cache);
    the reference backend then reads prompt + those tokens in one forward.  If its argmax
    at every position is the token the fast backend chose, its own greedy decoding
    would, by induction over the positions, produce the same 48 tokens: token-identical
    decoding, at one reference forward instead of 48."""
    if not FAST_BACKENDS:
        pytest.skip("no fast backend built")
    model, _ = smol
    ref = lowbit.quantize_model(model, "int4-g64", backend="reference", inplace=False)
    for backend in FAST_BACKENDS:
        fast = lowbit.quantize_model(model, "int4-g64", backend=backend, inplace=False)
        tokens = Runner(fast).generate(prompt_ids, 48).tokens
        assert len(tokens) == 48
        seq = torch.cat([prompt_ids, torch.tensor(tokens)])
        r = Runner(ref)
        logits = r.forward(seq[:-1], r.new_cache(seq.numel()), all_logits=True)
        assert logits[prompt_ids.numel() - 1:].argmax(-1).tolist() == tokens


def test_presets_run_and_their_error_follows_their_precision(smol, prompt_ids):
    model, _ = smol

    def kl(recipe):
        q = lowbit.quantize_model(model, recipe, inplace=False)
        with torch.inference_mode():
            ref = torch.log_softmax(model(prompt_ids[None]).logits[0].float(), -1)
            got = torch.log_softmax(q(prompt_ids[None]).logits[0].float(), -1)
        return float((ref.exp() * (ref - got)).sum(-1).mean())

    two_bit = lowbit.Recipe(weight="int2-asym-g64")
    k = {r: kl(r) for r in ["w8a16", "w4a16-g64", "w8a8", "w4a8-g128", "q4_1"]} | {"int2": kl(two_bit)}
    # The bundled weights are Q4_1: q4_1 lands on their own grid, exactly (the same weights);
    # its logits differ only by float32 summation order (|d logit| < 1e-4, as the int4 twin
    # above), so the KL is rounding noise, far below 4-bit error (w4a16-g64: ~0.5).
    assert abs(k.pop("q4_1")) < 1e-5
    q = lowbit.quantize_model(model, "q4_1", inplace=False)
    assert torch.equal(lowbit.dequantize(q.model.layers[0].mlp.down_proj.qweight),
                       model.model.layers[0].mlp.down_proj.weight)
    assert all(v > 0 for v in k.values()), k
    # fewer bits, more error: 8 < 4 < 2 bits of weight; 8-bit activations add to it
    assert k["w8a16"] < k["w4a16-g64"] < k["int2"], k
    assert k["w8a16"] < k["w8a8"] < k["w4a8-g128"], k


def test_sampling_is_seeded_and_top_k_1_is_greedy(smol, prompt_ids):
    model, _ = smol
    r = Runner(model)
    a = r.generate(prompt_ids, 12, do_sample=True, temperature=1.0, seed=7).tokens
    b = r.generate(prompt_ids, 12, do_sample=True, temperature=1.0, seed=7).tokens
    c = r.generate(prompt_ids, 12, do_sample=True, temperature=1.0, seed=8).tokens
    assert a == b and a != c
    assert r.generate(prompt_ids, 12, do_sample=True, top_k=1, seed=3).tokens == r.generate(prompt_ids, 12).tokens


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(do_sample=True, temperature=0.0), "temperature"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k")])
def test_generate_refuses_bad_arguments(smol, prompt_ids, kwargs, match):
    kw = dict(max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        Runner(smol[0]).generate(prompt_ids, **kw)


def test_kv_cache_overflow_is_an_error(smol, prompt_ids):
    r = Runner(smol[0])
    with pytest.raises(ValueError, match="KV cache holds 3 tokens"):
        r.forward(prompt_ids, r.new_cache(3))


# -- checkpoints ------------------------------------------------------------------------

@pytest.fixture(scope="session")
def saved(smol, tmp_path_factory):
    model, tok = smol
    q = lowbit.quantize_model(model, "w4a16-g128-head8", inplace=False)
    path = tmp_path_factory.mktemp("ckpt") / "smol-w4"
    lowbit.save_quantized(q, path, tok)
    return q, path


@torch.inference_mode()
def test_checkpoint_round_trip_is_exact(saved, prompt_ids):
    q, path = saved
    assert sorted(os.listdir(path.parent)) == ["smol-w4"]  # no temp folder left behind
    meta = json.loads((path / "lowbit.json").read_text())
    assert meta["recipe"]["name"] == "w4a16-g128-head8" and meta["dtype"] == "float32"
    assert meta["modules"]["lm_head"]["weight"] == "int8-sym"
    q2, tok2 = lowbit.load_model(path)
    assert tok2 is not None and isinstance(q2.lm_head, QuantLinear)
    assert torch.equal(q2(prompt_ids[None]).logits, q(prompt_ids[None]).logits)
    assert Runner(q2).generate(prompt_ids, 8).tokens == Runner(q).generate(prompt_ids, 8).tokens


def test_checkpoint_refuses_to_overwrite_without_force(saved):
    q, path = saved
    with pytest.raises(FileExistsError, match="overwrite=True"):
        lowbit.save_quantized(q, path)


def _copy(path, dst):
    import shutil

    shutil.copytree(path, dst)
    return dst


def test_corrupted_tensor_is_refused_by_name(saved, tmp_path):
    _, path = saved
    bad = _copy(path, tmp_path / "bad")
    f = bad / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF  # a byte of the last tensor's data
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.*' is corrupted"):
        lowbit.load_model(bad)


def test_truncated_file_is_refused(saved, tmp_path):
    _, path = saved
    bad = _copy(path, tmp_path / "short")
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable or truncated"):
        lowbit.load_model(bad)


def test_wrong_shape_in_the_description_is_refused(saved, tmp_path):
    _, path = saved
    bad = _copy(path, tmp_path / "shape")
    meta = json.loads((bad / "lowbit.json").read_text())
    meta["modules"]["model.layers.0.mlp.up_proj"]["weight"] = "int4-asym-g32-f16"
    (bad / "lowbit.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="up_proj.* does not match 'int4-asym-g32-f16'"):
        lowbit.load_model(bad)


def test_save_needs_a_quantized_model(smol, tmp_path):
    with pytest.raises(ValueError, match="quantize_model first"):
        lowbit.save_quantized(smol[0], tmp_path / "x")


# -- evaluation -------------------------------------------------------------------------

def test_evaluate_reports_what_quantization_costs(smol):
    from lowbit.evaluation import evaluate, format_table

    model, tok = smol
    models = {r: lowbit.quantize_model(model, r, inplace=False) for r in ["q4_1", "w4a16-g64"]}
    rows = evaluate(models, tok, reference=model, ctx=64, max_windows=2, greedy_tokens=8, decode_tokens=4,
                    prefill_tokens=32)
    f, q41, g64 = rows
    assert f["model"] == "float" and f["kl_divergence"] == 0 and f["greedy_match"] == 8
    assert f["scored_tokens"] == 2 * 63 and f["weight_bytes"] > 5e8
    # the bundled weights are Q4_1: requantizing them in that form is lossless (the same
    # weights; the quantized prefill sums in another order than torch's float GEMM, a
    # float32 rounding of ~1e-6 in the logits, so KL ~1e-10), an integer zero point at g64
    # is a second rounding (KL ~0.3)
    assert 0 <= q41["kl_divergence"] < 1e-8 < g64["kl_divergence"]
    assert q41["top1_agreement"] == 1 > g64["top1_agreement"]
    assert g64["weight_bytes"] < 0.4 * f["weight_bytes"]
    assert g64["bits_per_linear_weight"] == pytest.approx(4 + (16 + 8) / 64)
    assert all(r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in rows)
    table = format_table(rows)
    assert table.splitlines()[0].split()[:3] == ["model", "bits/w", "weights"] and "w4a16-g64" in table


def test_evaluate_adds_an_int8_activation_row_after_each_weight_only_model(smol):
    from lowbit.evaluation import evaluate

    model, tok = smol
    models = {r: lowbit.quantize_model(model, r, inplace=False) for r in ["q4_1", "w4a16-g64", "w8a8"]}
    models["int3"] = lowbit.quantize_model(model, lowbit.Recipe(weight="int3-asym-g64"), inplace=False)
    with pytest.warns(UserWarning, match="no 'int3 act int8' row: .*need an 8-bit or a 4-bit weight"):
        rows = evaluate(models, tok, reference=model, ctx=64, max_windows=1, greedy_tokens=4, speed=False,
                        act_compute="int8")
    by = {r["model"]: r for r in rows}
    # w8a8: int8 already; int3: no integer kernel for 3-bit codes
    assert list(by) == ["float", "q4_1", "q4_1 act int8", "w4a16-g64", "w4a16-g64 act int8", "w8a8", "int3"]
    # q4_1 is the bundled weights' own grid (KL 0); its int8 twin (llama.cpp's Q4_1 x Q8_1) adds
    # only the activations' rounding, small next to a second 4-bit rounding of the weights (g64)
    assert by["q4_1"]["kl_divergence"] < 1e-8 < by["q4_1 act int8"]["kl_divergence"]
    assert by["q4_1 act int8"]["kl_divergence"] < 0.2 * by["w4a16-g64"]["kl_divergence"]
    assert by["w4a16-g64 act int8"]["act_compute"] == "int8" and by["w4a16-g64"]["act_compute"] is None
    # another arithmetic, close to the weight-only one: the activations' rounding is small next
    # to the weights' (int4 g64, the bundled model's weights rounded a second time)
    act, wo = by["w4a16-g64 act int8"], by["w4a16-g64"]
    assert act["perplexity"] != wo["perplexity"]
    assert 0 < act["kl_divergence"] < 1.5 * wo["kl_divergence"]
    with pytest.raises(ValueError, match="act_compute must be None or one of"):
        evaluate(model, tok, act_compute="int4")


def test_llama_protocol_scores_the_second_half(smol):
    from lowbit.evaluation import evaluate

    model, tok = smol
    rows = evaluate({}, tok, reference=model, ctx=64, max_windows=2, protocol="llama", speed=False, greedy_tokens=2)
    assert rows[0]["scored_tokens"] == 2 * 31


def test_evaluate_refuses_bad_arguments(smol, tmp_path):
    from lowbit.evaluation import evaluate

    model, tok = smol
    with pytest.raises(ValueError, match="protocol"):
        evaluate(model, tok, protocol="nope")
    with pytest.raises(FileNotFoundError, match="corpus file"):
        evaluate(model, tok, corpus=tmp_path / "none.txt")
    (tmp_path / "tiny.txt").write_text("too short")
    with pytest.raises(ValueError, match="fewer than one window"):
        evaluate(model, tok, corpus=tmp_path / "tiny.txt")


# -- the C++ decode step ---------------------------------------------------------------------

@pytest.fixture(scope="session")
def smol_bf16():
    return lowbit.load_model(dtype=torch.bfloat16)[0]


def _decode_step_covers(model, dtype) -> bool:
    """Whether the cpu backend's one-row plan of every quantized projection is a kernel the
    C++ decode step runs (the rule lowbit.runtime follows)."""
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            act = None if mod.act_scheme is None else lowbit.QuantScheme.parse(mod.act_scheme)
            plan = cpu.BACKEND.plan(mod.qweight.scheme, act, 1, mod.in_features, dtype)
            if plan.kernel not in cpu.DECODE_KERNELS:
                return False
    return True


@pytest.mark.skipif(not FAST_BACKENDS, reason="needs lowbit._C")
@pytest.mark.parametrize("recipe", [None, "w4a16-g128-head8", "w8a16", "w8a8", "w4a8-g128", "w8a8-asym", "q4_0-a8",
                                    "q8_0-a8", "w4a8-g128-head8", "q4_1", "q4_1-a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_step_is_bit_identical_to_the_python_path(smol, smol_bf16, prompt_ids, recipe, dtype,
                                                                 monkeypatch):
    m = smol[0] if dtype == torch.float32 else smol_bf16
    if recipe == "w8a8-asym":  # asymmetric activations: the zero-point correction of W8A8
        recipe = lowbit.Recipe(weight="int8-sym", activation="int8-asym-token")
    if recipe == "q4_1-a8":  # q * s + m weights with activations in int8 blocks (llama.cpp's Q4_1 x Q8_1)
        recipe = lowbit.Recipe(weight="int4-asym-g32-zpmin-f16", activation="int8-sym-g32")
    if recipe is not None:
        m = lowbit.quantize_model(m, recipe, inplace=False)
    native, python = _native_and_python(m, monkeypatch)
    assert (native._decoder is not None) == _decode_step_covers(m, dtype)
    _same_steps(native, python, prompt_ids, (7, 1234, 42))


def _native_and_python(m, monkeypatch):
    """Runners of m with the C++ decode step and without it (skips where the plan gives none)."""
    native = Runner(m)
    monkeypatch.setenv("LOWBIT_NATIVE_DECODE", "0")
    python = Runner(m)
    assert python._decoder is None
    # the same prompt attention and norms on both sides: the steps are compared
    python._prefill, python._rms_many = native._prefill, native._rms_many
    if native._decoder is None:
        pytest.skip("the cpu plan for one row picks no kernel the C++ decode step runs on this machine")
    return native, python


def _same_steps(native, python, prompt, tokens):
    """The prompt, then a decode step per token: the same logits and KV caches, bit for bit
    (the caches the C++ step wrote are read back by the next steps)."""
    caches = [r.new_cache(prompt.numel() + len(tokens)) for r in (native, python)]
    for r, c in zip((native, python), caches):
        r.forward(prompt, c)
    for tok in tokens:
        a, b = (r.forward(torch.tensor([tok]), c) for r, c in zip((native, python), caches))
        assert torch.equal(a, b)
    (nk, nv), (pk, pv) = ((c.keys, c.values) for c in caches)
    assert all(torch.equal(x, y) for x, y in zip(nk + nv, pk + pv))


@pytest.mark.skipif(not FAST_BACKENDS, reason="needs lowbit._C")
@pytest.mark.parametrize("recipe", [None, "w4a16-g128", "w8a8", "w4a8-g128", "w4a8-sym", "q4_0-a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_decode_step_adds_each_projections_bias_as_the_python_path(recipe, dtype, monkeypatch):
    m = biased_llama(dtype)
    if recipe == "w4a8-sym":  # symmetric per-token activations with 4-bit codes
        recipe = lowbit.Recipe(weight="int4-asym-g128-f16", activation="int8-sym-token")
    if recipe is not None:
        m = lowbit.quantize_model(m, recipe, inplace=False)
    _same_steps(*_native_and_python(m, monkeypatch), torch.tensor([3, 14, 15, 92, 65]), (35, 89, 79))
    assert any(mod.bias is not None for mod in m.modules() if isinstance(mod, (QuantLinear, torch.nn.Linear)))


@pytest.mark.skipif(not FAST_BACKENDS, reason="needs lowbit._C")
def test_native_decoder_refuses_sizes_that_do_not_fit_before_any_step():
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        cpu.new_decoder(3, 2, 8, 24, 1e-5, 0.35)
    d = cpu.new_decoder(2, 1, 8, 16, 1e-5, 0.35)  # q 16 outputs, k and v 8, hidden 16

    def lin(n, k, bias=None):
        return cpu.float_projection(torch.randn(n, k), bias)

    ln = torch.ones(16)
    with pytest.raises(RuntimeError, match="the model's sizes"):  # down reads 24 features, gate gives 32
        d.add_layer(ln, ln, lin(16, 16), lin(8, 16), lin(8, 16), lin(16, 16), lin(32, 16), lin(32, 16), lin(16, 24))
    with pytest.raises(RuntimeError, match="differ in size"):  # k reads 12 features, q 16
        d.add_layer(ln, ln, lin(16, 16), lin(8, 12), lin(8, 16), lin(16, 16), lin(32, 16), lin(32, 16), lin(16, 32))
    with pytest.raises(RuntimeError, match="one value per output feature"):
        d.add_layer(ln, ln, lin(16, 16, torch.zeros(8)), lin(8, 16), lin(8, 16), lin(16, 16), lin(32, 16),
                    lin(32, 16), lin(16, 32))
    with pytest.raises(RuntimeError, match="lm_head must take hidden"):
        d.set_head(ln, lin(40, 12))
    d.add_layer(ln, ln, lin(16, 16), lin(8, 16), lin(8, 16), lin(16, 16), lin(32, 16), lin(32, 16), lin(16, 32))
    d.set_head(ln, lin(40, 16))
    kv = [torch.zeros(1, 4, 8)]
    with pytest.raises(RuntimeError, match="pos must be >= 0"):
        d.step(torch.randn(1, 16), torch.ones(1, 1, 8), torch.zeros(1, 1, 8), kv, kv, -1)
    assert d.step(torch.randn(1, 16), torch.ones(1, 1, 8), torch.zeros(1, 1, 8), kv, [torch.zeros(1, 4, 8)],
                  0).shape == (1, 40)


@pytest.mark.skipif(not FAST_BACKENDS, reason="needs lowbit._C")
@pytest.mark.parametrize("recipe", [None, "w4a16-g128-head8", "q4_0-a8", "w8a8-head8"])
def test_greedy_generation_on_the_cpp_step_gives_the_tokens_of_forward_and_argmax(smol_bf16, prompt_ids, recipe):
    m = smol_bf16 if recipe is None else lowbit.quantize_model(smol_bf16, recipe, inplace=False)
    r = Runner(m)
    if r._greedy_decoder() is None:
        pytest.skip("the cpu plan for one row picks no kernel the C++ decode step runs on this machine")
    fast = r.generate(prompt_ids, 12)
    r._embeds_natively = False  # each step through forward() and _pick
    slow = r.generate(prompt_ids, 12)
    assert r._greedy_decoder() is None and fast.tokens == slow.tokens
    assert len(set(fast.tokens)) > 3  # a sequence, not one token repeated


@pytest.mark.skipif(not FAST_BACKENDS, reason="needs lowbit._C")
def test_greedy_step_writes_the_cache_as_step_and_takes_numpys_argmax():
    torch.manual_seed(0)
    d = cpu.new_decoder(2, 1, 8, 16, 1e-5, 0.35)  # q 16 outputs, k and v 8, hidden 16

    def lin(n, k):
        return cpu.float_projection(torch.randn(n, k), None)

    d.add_layer(torch.rand(16) + 0.5, torch.rand(16) + 0.5, lin(16, 16), lin(8, 16), lin(8, 16), lin(16, 16),
                lin(32, 16), lin(32, 16), lin(16, 32))
    head = torch.randn(40, 16)
    d.set_head(torch.ones(16), cpu.float_projection(head, None))
    emb, cos, sin = torch.randn(50, 16), torch.rand(6, 8), torch.rand(6, 8)
    with pytest.raises(RuntimeError, match="set_embedding first"):
        d.greedy(1, 0, cos, sin, [torch.zeros(1, 6, 8)], [torch.zeros(1, 6, 8)])
    d.set_embedding(emb)
    caches = [[torch.zeros(1, 6, 8)], [torch.zeros(1, 6, 8)]], [[torch.zeros(1, 6, 8)], [torch.zeros(1, 6, 8)]]
    for pos, tok in enumerate([4, 49, 0, 3]):
        got = d.greedy(tok, pos, cos, sin, *caches[0])
        logits = d.step(emb[tok:tok + 1], cos[pos:pos + 1, None], sin[pos:pos + 1, None], *caches[1], pos)
        assert got == int(logits[0].numpy().argmax())
        assert all(torch.equal(a, b) for a, b in zip(caches[0][0] + caches[0][1], caches[1][0] + caches[1][1]))
    for bad, what in ((dict(token=50), "not an id"), (dict(token=-1), "not an id"), (dict(pos=6), "position 6")):
        args = dict(token=1, pos=4) | bad
        with pytest.raises(RuntimeError, match=what):
            d.greedy(args["token"], args["pos"], cos, sin, *caches[0])
    # the logits' ties and NaNs as numpy's argmax: the first of the largest, else the first NaN
    d.set_head(torch.ones(16), cpu.float_projection(torch.zeros(40, 16), None))
    assert d.greedy(2, 4, cos, sin, *caches[0]) == 0
    nan_head = torch.randn(40, 16)
    nan_head[[9, 30]] = float("nan")
    d.set_head(torch.ones(16), cpu.float_projection(nan_head, None))
    assert d.greedy(2, 5, cos, sin, *caches[0]) == 9


@pytest.mark.skipif(not FAST_BACKENDS, reason="needs lowbit._C")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_takes_numpys_argmax_of_each_row(dtype):
    torch.manual_seed(0)
    x = torch.randn(37, 1000).to(dtype)
    x[3, [17, 900]] = 50  # a tie: the first
    x[5, [400, 12]] = float("nan")  # NaNs: the first NaN, whatever the values
    x[6, -1] = 60  # the last element, past the 16-lane loop's remainder
    x[7] = float("-inf")  # all -inf: index 0
    x[8, :999] = float("-inf")
    x[8, 999] = float("nan")
    want = [int(row.numpy().argmax()) for row in x.float()]
    got = cpu.argmax_rows(x)
    assert got.dtype == torch.int64 and got.tolist() == want
    assert want[3] == 17 and want[5] == 12 and want[6] == 999 and want[7] == 0 and want[8] == 999
    assert cpu.argmax_rows(x[:, :13]).tolist() == [int(r.numpy().argmax()) for r in x[:, :13].float()]
    assert cpu.argmax_rows(x.t()[:9]).tolist() == [int(r.numpy().argmax()) for r in x.t()[:9].float()]
    for bad in (torch.zeros(4), torch.zeros(3, 0)):
        with pytest.raises(RuntimeError, match=r"argmax_rows: x must be \[rows, n\] with n > 0"):
            cpu.argmax_rows(bad)


@pytest.mark.skipif(not FAST_BACKENDS or not cpu._C.has_dense_rows(), reason="needs lowbit._C with AVX2")
def test_float32_projections_run_the_dense_kernel_in_decode_steps_only(smol, prompt_ids, monkeypatch):
    calls = []
    real = cpu.dense_linear
    monkeypatch.setattr(cpu, "dense_linear", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b))
    monkeypatch.setenv("LOWBIT_NATIVE_DECODE", "0")
    r = Runner(smol[0])
    cache = r.new_cache(16)
    want = smol[0](prompt_ids[None]).logits[0]
    assert torch.equal(r.forward(prompt_ids, r.new_cache(16), all_logits=True), want)  # transformers' bits
    r.forward(prompt_ids, cache)
    assert calls == []  # a prefill runs torch's linear
    logits = r.forward(torch.tensor([7]), cache)
    assert calls == [1] * (7 * len(r.layers) + 1)  # every projection and the lm_head
    h = r._rms(torch.randn(1, r.hidden), r.norm)
    assert torch.equal(r._proj(r.lm_head, h, step=True), real(h, r.lm_head.weight, None))
    assert logits.shape == (1, r.lm_head.out_features)
    monkeypatch.setattr(cpu, "DENSE_ROWS_MAX_M", 0)  # the plan says no: torch's linear
    calls.clear()
    r.forward(torch.tensor([8]), cache)
    assert calls == []


@pytest.mark.skipif(not FAST_BACKENDS, reason="needs lowbit._C")
@pytest.mark.parametrize("native", ["1", "0"])
def test_act_compute_int8_runs_the_weight_only_model_as_its_int8_block_twin(smol, prompt_ids, native, monkeypatch):
    monkeypatch.setenv("LOWBIT_NATIVE_DECODE", native)
    q = lowbit.quantize_model(smol[0], "w4a16-g128-head8", inplace=False)
    blocks = "int8-sym-g32"
    twin = lowbit.quantize_model(smol[0], lowbit.Recipe(weight="int4-asym-g128-f16", activation=blocks,
                                                        lm_head="int8-sym", lm_head_activation=blocks), inplace=False)
    a, b, plain = Runner(q, act_compute="int8"), Runner(twin), Runner(q)
    assert (a._decoder is not None) == (native == "1") == (b._decoder is not None)
    caches = [r.new_cache(16) for r in (a, b, plain)]
    outs = [r.forward(prompt_ids, c) for r, c in zip((a, b, plain), caches)]
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    for tok in (7, 1234):
        outs = [r.forward(torch.tensor([tok]), c) for r, c in zip((a, b, plain), caches)]
        assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    batch = a.generate([prompt_ids, prompt_ids[:3]], 4)
    assert [s.tokens for s in batch.sequences] == [b.generate(p, 4).tokens for p in (prompt_ids, prompt_ids[:3])]
    assert all(m.act_scheme is None for m in q.modules() if isinstance(m, QuantLinear))  # the model is unchanged


def test_act_compute_refuses_what_it_cannot_run(smol):
    with pytest.raises(ValueError, match="act_compute must be None or one of \\['int8'\\], got 'fp8'"):
        Runner(smol[0], act_compute="fp8")
    with pytest.raises(ValueError, match="applies to weight-only quantized linears; this model has none"):
        Runner(smol[0], act_compute="int8")  # a float model
    q = lowbit.quantize_model(smol[0], lowbit.Recipe(weight="int4-asym-g64-f16",
                                                     overrides=[(r"layers\.3\.mlp\.up_proj", {"weight": "int3-asym-g64"})]),
                              inplace=False)
    with pytest.raises(ValueError, match=r"layers\.3\.up \(int3-asym-g64\) cannot run with int8-sym-g32"):
        Runner(q, act_compute="int8")
    w8a8 = lowbit.quantize_model(smol[0], "w8a8", inplace=False)  # quantized activations already
    with pytest.raises(ValueError, match="this model has none"):
        Runner(w8a8, act_compute="int8")


def test_native_decode_is_skipped_for_activations_it_does_not_cover(smol):
    from lowbit.evaluation import calibration_set

    ids = calibration_set(smol[1], samples=2, length=32)  # static per-tensor scales come from calibration
    q = lowbit.quantize_model(smol[0], lowbit.Recipe(weight="int8-sym", activation="int8-sym-tensor"), inplace=False,
                              calibration=ids)
    assert all(m.act_calibrated for m in q.modules() if isinstance(m, lowbit.nn.QuantLinear))
    assert Runner(q)._decoder is None
