"""lowbit.passes: export a Llama model, quantize its weights in the graph, fuse the
dequantize -> matmul pattern, lower to the target's kernels; each pass on its own,
composed, idempotent, and the fused program against the eager quantized model."""

import copy
import subprocess
import sys

import pytest
import torch
from torch import fx

import lowbit
from lowbit.kernels import get_backend
from lowbit.kernels import reference as ref
from lowbit.models.quantize import dequantized_copy
from lowbit.ops.matmul import weight_parts
from lowbit.passes import (calibrate, dequant, export, fuse, lower, op_counts, quantize_activations,
                           quantize_weights)
from lowbit.passes.lower import ROWS
from lowbit.passes.weights import module_of
from lowbit.scheme import QuantScheme

VOCAB = 128
aten = torch.ops.aten


def tiny_llama(tie=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def program(model):
    return export(model)


def ids(n, seed=1):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def logits(m, x):
    with torch.inference_mode():
        return m(x).logits if hasattr(m, "config") else m(x)


def decoder_weights(state_dict) -> list[str]:
    return [k for k in state_dict if k.startswith("model.layers.") and k.endswith("_proj.weight")]


# -- export ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 5, 17])
def test_the_exported_program_is_the_model_at_any_sequence_length(model, program, n):
    assert torch.equal(logits(program.module(), ids(n)), logits(model, ids(n)))


def test_export_keeps_the_models_parameter_names(model, program):
    assert set(program.state_dict) <= {k for k, _ in model.named_parameters()} | set(model.state_dict())
    assert "model.layers.1.mlp.down_proj.weight" in program.state_dict


def test_export_refuses_what_it_cannot_export(model):
    with pytest.raises(TypeError, match="model must be a transformers causal LM"):
        export(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="example_inputs must be a tuple"):
        export(model, (torch.zeros(1, 4),))
    with pytest.raises(ValueError, match="max_seq_len must be an int >= 2"):
        export(model, max_seq_len=1)


# -- the dequantization in the graph ---------------------------------------------------------
FORMS = ["int4-asym-g32", "int4-sym-g64-f16", "int4-asym-g32-f16", "int4-asym-g32-zpfloat", "int8-sym",
         "int8-asym-g32-bf16", "int4-sym"]


@pytest.mark.parametrize("scheme", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emitted_ops_are_the_reference_dequantization_bit_for_bit(scheme, dtype):
    qt = lowbit.quantize(torch.randn(24, 128) * 3, scheme)
    codes, scale, zp, bits, group = weight_parts(qt)
    g = fx.Graph()
    ph = [g.placeholder(p) for p in ("codes", "scale", "zero_point")]
    w = dequant.emit(lambda t, a, kw=None: g.call_function(t, a, kw or {}), ph[0], ph[1],
                     None if zp is None else ph[2], bits=bits, group_size=group, n=24, k=128, dtype=dtype,
                     device=torch.device("cpu"))
    g.output(w)
    got = fx.GraphModule(torch.nn.Module(), g)(codes, scale, zp)
    want = ref.dequantize_weight(codes, scale, zp, bits, group, 128, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(want, lowbit.dequantize(qt, dtype))  # and the reference is lowbit's dequantize


# -- quantize_weights --------------------------------------------------------------------------
RECIPES = ["w4a16-g32", "w8a16", "q4_0", "int4-g64", "q8_0", "q4_1"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_program_is_the_dequantized_eager_model(model, program, recipe):
    # The same RTN codes, dequantized by ops the reference's arithmetic: the same float
    # weights, so the same logits as the eager model holding the dequantized weights.
    q = quantize_weights(program, recipe)
    eager = dequantized_copy(lowbit.quantize_model(model, recipe, inplace=False))
    assert torch.equal(logits(q.module(), ids(9)), logits(eager, ids(9)))
    assert not decoder_weights(q.state_dict)  # no float copy of a quantized weight is held
    head = lowbit.Recipe.get(recipe).lm_head is not None  # q4_0, q8_0: Q8_0 as in llama.cpp's files
    assert sum(k.endswith(".weight.codes") for k in q.state_dict) == 14 + head
    # the input program is untouched
    assert program.graph_module.code == export(model).graph_module.code
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in program.state_dict.items())


def test_quantize_weights_takes_overrides_and_the_output_projection(model, program):
    recipe = {"weight": "int4-asym-g32", "lm_head": "int8-sym",
              "overrides": [["down_proj", {"weight": None}], ["q_proj", {"weight": "int8-sym"}]]}
    q = quantize_weights(program, recipe)
    lin = {n.meta["custom"]["lowbit_weight"] for n in q.graph.nodes if n.target == aten.linear.default
           and "lowbit_weight" in n.meta.get("custom", {})}
    assert lin == {"int4-asym-g32", "int8-sym"}
    assert "model.layers.0.mlp.down_proj.weight" in q.state_dict  # left float by the override
    assert "lm_head.weight.codes" in q.state_dict
    assert "model.embed_tokens.weight" in q.state_dict  # the tied embedding still reads its float weight
    eager = dequantized_copy(lowbit.quantize_model(model, lowbit.Recipe.from_dict(recipe), inplace=False))
    assert torch.equal(logits(q.module(), ids(6)), logits(eager, ids(6)))


def test_quantize_weights_refuses_what_it_cannot_do(program):
    with pytest.raises(ValueError, match="selects no aten.linear"):
        quantize_weights(program, {"weight": "int8-sym", "modules": ["no_such_module"]})
    with pytest.raises(ValueError, match="rounds weights by method 'gptq'.*pass a quantizer"):
        quantize_weights(program, "w4a16-g128:gptq")
    with pytest.raises(ValueError, match="quantizes the embedding"):
        quantize_weights(program, {"weight": "int8-sym", "embedding": "int8-sym"})
    bad = torch.nn.Sequential(torch.nn.Linear(64, 8)).requires_grad_(False)
    bad[0].weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match="cannot quantize module '0': .*NaN"):
        quantize_weights(torch.export.export(bad, (torch.randn(1, 64),)), {"weight": "int8-sym", "modules": ["^0$"]})


# -- fuse -------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["w4a16-g32", "w8a16", "q4_0", "int4-g64", "q8_0"])
def test_fused_program_is_the_eager_quantized_model(model, program, recipe):
    # Both run lowbit.weight_only_matmul on the same parts: the same kernels, the same bits.
    f = fuse(quantize_weights(program, recipe))
    counts = op_counts(f)
    head = lowbit.Recipe.get(recipe).lm_head is not None  # q4_0, q8_0: Q8_0; the others' stays float
    assert counts["lowbit.weight_only_matmul"] == 14 + head and counts["aten.linear"] == 1 - head
    assert counts["aten.bitwise_and"] == 0 and counts["aten.mul"] == op_counts(program)["aten.mul"]
    eager = lowbit.quantize_model(model, recipe, inplace=False)
    for n in (1, 7):
        assert torch.equal(logits(f.module(), ids(n)), logits(eager, ids(n)))


def test_fuse_leaves_schemes_the_matmul_ops_do_not_take(program):
    q = quantize_weights(program, lowbit.Recipe(weight="int3-asym-g64"))  # 3-bit codes: lowbit.dequantize, linear
    f = fuse(q)
    assert op_counts(f)["lowbit.dequantize"] == 14 and op_counts(f)["lowbit.weight_only_matmul"] == 0
    assert f.graph_module.code == q.graph_module.code


@pytest.mark.parametrize("recipe", ["q4_1", "q4_1-a8"])
def test_fuse_runs_min_weights_on_their_packed_codes(model, program, recipe):
    # quantize_weights dequantizes q * s + m with lowbit.dequantize; fuse gives the linear the
    # op an eager QuantLinear runs (zero_point_min=True): the same arguments, the same bits
    r = "q4_1" if recipe == "q4_1" else lowbit.Recipe(weight="int4-asym-g32-zpmin-f16", activation="int8-sym-g32")
    q = quantize_weights(program, r)
    if recipe != "q4_1":
        q = quantize_activations(q, r)
    f = fuse(q)
    op = "lowbit.weight_only_matmul" if recipe == "q4_1" else "lowbit.linear_a8_blocks"
    counts = op_counts(f)
    assert counts[op] == 14 and counts["lowbit.dequantize"] == 0 and counts["aten.linear"] == 1  # lm_head float
    node = next(n for n in f.graph.nodes if n.op == "call_function" and str(n.target).startswith(op))
    assert node.args[-1] is True  # zero_point_min
    eager = lowbit.quantize_model(model, r, inplace=False)
    for n in (1, 7):
        assert torch.equal(logits(f.module(), ids(n)), logits(eager, ids(n)))
    assert fuse(f).graph_module.code == f.graph_module.code  # idempotent


def _unfused_layer0(program):
    q = quantize_weights(program, "w4a16-g32")
    q = copy.deepcopy(q)
    lin = next(n for n in q.graph.nodes if n.target == aten.linear.default
               and n.meta["custom"].get("lowbit_weight") and "layers.0.self_attn.q_proj" in str(n.meta["nn_module_stack"]))
    return q, lin


def _fused(ep) -> int:
    return op_counts(fuse(ep))["lowbit.weight_only_matmul"]


def _ancestors(node):
    seen, todo = [], [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.append(n)
            todo += n.all_input_nodes
    return seen


def test_fuse_does_not_match_a_dequantization_with_another_constant(program):
    q, lin = _unfused_layer0(program)
    mask = next(n for n in _ancestors(lin.args[1]) if n.target == aten.bitwise_and.Scalar)
    mask.args = (mask.args[0], 7)  # three bits of each nibble: not the 4-bit dequantization
    q.graph_module.recompile()
    assert _fused(q) == 13


def test_fuse_does_not_match_a_weight_changed_after_dequantizing(program):
    q, lin = _unfused_layer0(program)
    with q.graph.inserting_before(lin):
        doubled = q.graph.call_function(aten.mul.Tensor, (lin.args[1], 2.0))
        doubled.meta["val"] = lin.args[1].meta["val"]
    lin.replace_input_with(lin.args[1], doubled)
    q.graph_module.recompile()
    assert _fused(q) == 13


def test_fuse_does_not_match_another_group_size(program):
    q, lin = _unfused_layer0(program)
    view = next(n for n in _ancestors(lin.args[1]) if n.target == aten.view.default and len(n.args[1]) == 3)
    n_, g, size = view.args[1]
    view.args = (view.args[0], [n_, g * 2, size // 2])  # the scales' groups no longer line up
    q.graph_module.recompile()
    assert _fused(q) == 13


def test_fuse_keeps_a_dequantized_weight_another_op_reads(program):
    q, lin = _unfused_layer0(program)
    out = next(n for n in q.graph.nodes if n.op == "output")
    w = lin.args[1]
    with q.graph.inserting_before(out):
        total = q.graph.call_function(aten.sum.default, (w,))
        total.meta["val"] = torch.empty((), dtype=w.meta["val"].dtype)
        plus = q.graph.call_function(aten.add.Tensor, (out.args[0][0], total))
        plus.meta["val"] = out.args[0][0].meta["val"]
    out.args = ((plus,),)
    q.graph_module.recompile()
    f = fuse(q)
    assert op_counts(f)["lowbit.weight_only_matmul"] == 14  # the linear is fused
    assert op_counts(f)["aten.bitwise_and"] == 1  # the other reader keeps its dequantization
    assert torch.allclose(logits(f.module(), ids(5)), logits(q.module(), ids(5)), atol=1e-4)


def test_fuse_does_not_match_a_weight_computed_from_an_input():
    class DequantOfInput(torch.nn.Module):
        def forward(self, x, codes, scale):
            return torch.nn.functional.linear(x, ref.dequantize_weight(codes, scale, None, 8, 32, 64))

    qt = lowbit.quantize(torch.randn(16, 64), "int8-sym-g32")
    codes, scale, _, _, _ = weight_parts(qt)
    ep = torch.export.export(DequantOfInput(), (torch.randn(2, 64), codes, scale))
    assert op_counts(fuse(ep)) == op_counts(ep)


# -- every pass is idempotent, and they compose ---------------------------------------------------
def test_passes_are_idempotent(program):
    q = quantize_weights(program, "w4a16-g32")
    f = fuse(q)
    low = lower(f)
    assert fuse(f).graph_module.code == f.graph_module.code and fuse(f).state_dict.keys() == f.state_dict.keys()
    again = lower(low)
    assert again.graph_module.code == low.graph_module.code
    assert [n.meta.get("custom") for n in again.graph.nodes] == [n.meta.get("custom") for n in low.graph.nodes]
    again = quantize_weights(q, "w4a16-g32")  # every selected linear is quantized already
    assert again.graph_module.code == q.graph_module.code and again.state_dict.keys() == q.state_dict.keys()


# -- lower ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_lower_records_the_backends_own_plan(program, backend):
    if backend not in lowbit.kernels.available_backends("cpu"):
        pytest.skip("no CPU kernels")
    low = lower(fuse(quantize_weights(program, "w4a16-g32")), backend)
    nodes = [n for n in low.graph.nodes if n.target == torch.ops.lowbit.weight_only_matmul.default]
    assert len(nodes) == 14
    for n in nodes:
        rec = n.meta["custom"]["lowbit_kernels"]
        for m in ROWS:
            plan = get_backend(backend).plan(QuantScheme.parse("int4-asym-g32"), None, m, n.args[0].meta["val"].shape[-1],
                                             torch.float32)
            assert rec[f"M={m}"] == f"{plan.kernel}: {plan.why}"
        assert rec["backend"] == backend


def test_an_eager_quantized_model_exports_fused_and_lowers(model):
    q = lowbit.quantize_model(model, "w8a8", inplace=False)
    ep = export(q)
    assert op_counts(ep)["lowbit.int8_linear"] == 14
    assert op_counts(fuse(ep)) == op_counts(ep)
    low = lower(ep, "reference")
    recs = [n.meta["custom"]["lowbit_kernels"] for n in low.graph.nodes
            if n.target == torch.ops.lowbit.int8_linear.default]
    assert len(recs) == 14 and all(r["M=1"].startswith("reference") for r in recs)
    assert torch.equal(logits(low.module(), ids(6)), logits(q, ids(6)))


# -- the saved program runs without lowbit's model code ------------------------------------------
def test_saved_program_loads_with_only_the_lowbit_ops(program, tmp_path):
    low = lower(fuse(quantize_weights(program, "w4a16-g32")))
    path = tmp_path / "prog.pt2"
    torch.export.save(low, path)
    want = logits(low.module(), ids(6))
    torch.save(ids(6), tmp_path / "ids.pt")
    code = f"""
import sys, torch
import lowbit.ops  # the lowbit ops: all the program needs
ep = torch.export.load({str(path)!r})
with torch.inference_mode():
    y = ep.module()(torch.load({str(tmp_path / 'ids.pt')!r}))
torch.save(y, {str(tmp_path / 'y.pt')!r})
kernels = [n.meta["custom"]["lowbit_kernels"] for n in ep.graph.nodes if "lowbit_kernels" in n.meta.get("custom", {{}})]
assert len(kernels) == 14, len(kernels)
assert "transformers" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    assert torch.equal(torch.load(tmp_path / "y.pt"), want)


def test_the_bundled_model_fused_program_is_the_eager_quantized_model():
    m, tok = lowbit.load_model()
    fused = lower(fuse(quantize_weights(export(m), "w4a16-g128")))
    eager = lowbit.quantize_model(m, "w4a16-g128", inplace=False)
    x = tok("The capital of France is", return_tensors="pt").input_ids
    # the same lowbit.weight_only_matmul calls on the same parts as the eager model: bit for bit
    assert torch.equal(logits(fused.module(), x), logits(eager, x))
    assert op_counts(fused)["lowbit.weight_only_matmul"] == 210


# -- activations: quantize -> dequantize pairs, calibration, and their fusion ----------------------
ACT_RECIPES = {"w8a8": "lowbit.int8_linear", "w4a8-g128": "lowbit.linear_qta8a_qga4w",
               "q4_0-a8": "lowbit.linear_a8_blocks", "q8_0-a8": "lowbit.linear_a8_blocks"}


@pytest.mark.parametrize("recipe", sorted(ACT_RECIPES))
def test_fused_activation_program_is_the_eager_quantized_model(model, program, recipe):
    r = lowbit.Recipe.get(recipe)
    pairs = quantize_activations(quantize_weights(program, r), r)
    heads = 1 if r.lm_head_activation else 0  # q*_0-a8 run the output projection on blocks too
    assert op_counts(pairs)["aten.linear"] == 15 and op_counts(pairs)["lowbit.dequantize_per_token"] + \
        op_counts(pairs)["lowbit.dequantize"] == 14 + heads
    f = fuse(pairs)
    assert op_counts(f)[ACT_RECIPES[recipe]] == 14 + heads and op_counts(f)["aten.linear"] == 1 - heads
    assert op_counts(f)["lowbit.dequantize_per_token"] == op_counts(f)["lowbit.dequantize"] == 0
    eager = lowbit.quantize_model(model, r, inplace=False)
    assert torch.equal(logits(f.module(), ids(8)), logits(eager, ids(8)))
    assert quantize_activations(pairs, r).graph_module.code == pairs.graph_module.code  # idempotent
    assert fuse(f).graph_module.code == f.graph_module.code


@pytest.mark.parametrize("act", ["int8-sym-token", "int8-asym-token", "int8-sym-g32"])
@pytest.mark.parametrize("weight", ["int8-sym", "int4-asym-g32", "int4-sym-g32-f16"])
def test_a_quantize_dequantize_pair_is_what_the_fused_matmul_computes(act, weight):
    from lowbit.scheme import check_act_weight

    try:
        check_act_weight(weight, act, 128)
    except ValueError:
        pytest.skip(f"{weight} does not take {act}")
    lin = torch.nn.Sequential(torch.nn.Linear(128, 24, bias=False)).requires_grad_(False)
    recipe = {"weight": weight, "activation": act, "modules": ["^0$"]}
    x = torch.randn(5, 128) * 2
    pairs = quantize_activations(quantize_weights(torch.export.export(lin, (x,)), recipe), recipe)
    fused = fuse(pairs)
    w = lowbit.quantize(lin[0].weight, weight)
    from lowbit.passes.activations import qdq

    x_hat, w_hat = qdq(x, act), lowbit.dequantize(w)
    with torch.inference_mode():
        unfused, y = pairs.module()(x), fused.module()(x)
    assert torch.equal(y, lowbit.linear(x, w, act_scheme=act))
    assert torch.equal(unfused, torch.nn.functional.linear(x_hat, w_hat))
    # The pair's float32 matmul and the integer matmul sum the same products of x_hat and
    # w_hat; float32 accumulation over K terms plus the epilogue's two roundings (scale
    # products, output) differ by at most gamma_{K+2} * sum_k |x_hat_k| |w_hat_k| each.
    u = 2.0 ** -24
    gamma = (128 + 2) * u / (1 - (128 + 2) * u)
    assert ((unfused - y).abs() <= 2 * gamma * (x_hat.abs() @ w_hat.abs().T)).all()


STATIC = {"weight": "int8-sym", "activation": "int8-asym-tensor"}
STATIC_SYM = {"weight": "int8-sym", "activation": "int8-sym-tensor"}


def _linear_inputs(model, calibration):
    """min and max of each decoder linear's input over the calibration rows, by hooks."""
    seen = {}

    def hook(name):
        def record(_mod, args):
            lo, hi = args[0].min().item(), args[0].max().item()
            old = seen.get(name, (lo, hi))
            seen[name] = (min(old[0], lo), max(old[1], hi))
        return record

    handles = [mod.register_forward_pre_hook(hook(name)) for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and name.startswith("model.layers.")]
    for row in calibration:
        logits(model, row[None])
    for h in handles:
        h.remove()
    return seen


def test_calibrate_records_each_linears_input_range(model, program):
    cal = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(2))
    q = quantize_weights(program, STATIC)
    c = calibrate(q, STATIC, cal)
    want = _linear_inputs(dequantized_copy(lowbit.quantize_model(model, "w8a16", inplace=False)), cal)
    got = {module_of(n): tuple(n.meta["custom"]["lowbit_act_range"]) for n in c.graph.nodes
           if "lowbit_act_range" in n.meta.get("custom", {})}
    assert got == want and len(got) == 14
    assert op_counts(c) == op_counts(q)  # no observer left in the program
    again = calibrate(c, STATIC, cal)
    assert [n.meta.get("custom") for n in again.graph.nodes] == [n.meta.get("custom") for n in c.graph.nodes]


@pytest.mark.parametrize("recipe", [STATIC, STATIC_SYM], ids=["asym", "sym"])
def test_static_activation_program_is_the_eager_model_with_its_scales(model, program, recipe):
    cal = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(2))
    pairs = quantize_activations(calibrate(quantize_weights(program, recipe), recipe, cal), recipe)
    assert quantize_activations(pairs, recipe).graph_module.code == pairs.graph_module.code  # idempotent
    f = fuse(pairs)
    assert op_counts(f)["lowbit.int8_linear"] == 14 and op_counts(f)["lowbit.dequantize"] == 0
    # lowbit.quantize_model calibrates layer by layer on the quantized layers before, the
    # pass on the program as given: the eager model gets the program's scales to compare
    eager = lowbit.quantize_model(model, lowbit.Recipe.from_dict(recipe), inplace=False, calibration=cal)
    for name, mod in eager.named_modules():
        if isinstance(mod, lowbit.nn.QuantLinear):
            mod.set_act_qparams(f.state_dict[f"{name}.act_scale"], f.state_dict.get(f"{name}.act_zero_point"))
    assert torch.equal(logits(f.module(), ids(7)), logits(eager, ids(7)))


def test_activation_passes_refuse_what_they_cannot_do(program):
    q = quantize_weights(program, STATIC)
    with pytest.raises(ValueError, match="no calibrated range: run lowbit.passes.calibrate"):
        quantize_activations(q, STATIC)
    with pytest.raises(ValueError, match="act_observer 'percentile'"):
        calibrate(q, {**STATIC, "act_observer": "percentile"}, torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="calibration must be token ids"):
        calibrate(q, STATIC, torch.zeros(4))
    with pytest.raises(ValueError, match="nothing to calibrate"):
        calibrate(quantize_weights(program, "w8a8"), "w8a8", torch.zeros(1, 4, dtype=torch.long))


def test_a_model_with_a_quantized_embedding_exports():
    model = tiny_llama(tie=False)
    q = lowbit.quantize_model(model, lowbit.Recipe(weight="int4-asym-g32", embedding="int8-sym", lm_head="int8-sym"),
                              inplace=False)
    ep = export(q)
    assert op_counts(ep)["lowbit.dequantize"] == 1 and op_counts(ep)["lowbit.weight_only_matmul"] == 15
    assert torch.equal(logits(ep.module(), ids(6)), logits(q, ids(6)))


def test_a_bfloat16_model_runs_every_pass_like_its_eager_quantized_model():
    model = tiny_llama().to(torch.bfloat16)
    program = export(model)
    for recipe in ["w4a16-g32", "w8a8", "q4_0-a8"]:
        r = lowbit.Recipe.get(recipe)
        f = lower(fuse(quantize_activations(quantize_weights(program, r), r)))
        out = logits(f.module(), ids(6))
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, logits(lowbit.quantize_model(model, r, inplace=False), ids(6)))
