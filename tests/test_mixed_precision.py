"""Automated mixed precision: bits per weight counted exactly, sensitivities measured
(and measured right: the resumed forward is the whole forward), the allocation meets
its budget with the least predicted loss, the recipe it writes quantizes as chosen,
and the CLI writes the checkpoint with its sensitivity table and plot."""

import itertools
import json

import pytest
import torch

import lowbit
from lowbit.cli import main
from lowbit.models.mixed_precision import (Sensitivity, _ladder, allocate, measure_sensitivity, mixed_recipe,
                                           save_sensitivity, scheme_bits)
from lowbit.recipe import fit_group

CANDIDATES = ["int8-sym", "int4-asym-g32-f16", "int3-asym-g32-f16", "int2-asym-g32-f16"]


@pytest.mark.parametrize("scheme", ["int8-sym", "int4-asym-g32-f16", "int4-sym-g64", "int3-asym-g32-f16",
                                    "int2-asym-g32", "int8-asym-g128-bf16", "int4-asym-zpfloat"])
@pytest.mark.parametrize("shape", [(64, 576), (24, 1536)])
def test_scheme_bits_counts_what_a_qtensor_stores(scheme, shape):
    qt = lowbit.quantize(torch.randn(shape), fit_group(scheme, shape[1]))
    assert scheme_bits(fit_group(scheme, shape[1]), *shape) == qt.nbytes * 8 / qt.numel()


@pytest.fixture(scope="module")
def small():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # weights large enough that every module moves the output (the default initializer's
    # logits are near zero: a near-uniform distribution that no quantization disturbs)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    calibration = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    return model, calibration, measure_sensitivity(model, calibration, candidates=CANDIDATES)


def _whole_forward_kl(model, calibration, name, scheme):
    lin = model.get_submodule(name)
    w = lin.weight.data
    with torch.inference_mode():
        ref = [torch.log_softmax(model(r[None]).logits, -1) for r in calibration]
        lin.weight.data = lowbit.dequantize(lowbit.quantize(w, fit_group(scheme, w.shape[1])))
        try:
            out = [torch.log_softmax(model(r[None]).logits, -1) for r in calibration]
        finally:
            lin.weight.data = w
    return sum(float((p.exp() * (p - q)).sum(-1).mean()) for p, q in zip(ref, out)) / len(ref)


def test_sensitivity_is_the_kl_of_the_module_quantized_alone(small):
    model, calibration, sens = small
    assert len(sens.kl) == 14 and all(list(v) == CANDIDATES for v in sens.kl.values())
    for name in ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"]:
        for scheme in ["int8-sym", "int2-asym-g32-f16"]:
            want = max(_whole_forward_kl(model, calibration, name, scheme), 0.0)  # measured KL is clamped at 0
            # the same logits (the resumed forward is bit for bit the whole one), two float32
            # log-softmaxes of values near log(96): a few ulp of 4.6 each, summed with weights p
            assert sens.kl[name][scheme] == pytest.approx(want, rel=1e-5, abs=1e-6)
    # fewer bits cost more for every module, and the proxy ranks the pairs like the KL does
    assert all(per["int8-sym"] < per["int4-asym-g32-f16"] < per["int2-asym-g32-f16"] for per in sens.kl.values())
    assert sens.spearman()["all"] > 0.6
    assert sens.tokens == calibration.numel()


def test_sensitivity_refuses_bad_input(small):
    model, calibration, _ = small
    with pytest.raises(ValueError, match="calibration must be token ids"):
        measure_sensitivity(model, calibration.float())
    with pytest.raises(ValueError, match="selects no linear"):
        measure_sensitivity(model, calibration, lowbit.Recipe(weight="int8-sym", modules=["nothing"]))
    with pytest.raises(ValueError):
        measure_sensitivity(model, calibration, candidates=["int9-sym"])


def test_the_ladder_is_the_lower_convex_hull():
    bits = {"8": 8.0, "6": 6.0, "4": 4.0, "3": 3.0, "2": 2.0}
    kl = {"8": 0.0, "6": 0.5, "4": 0.2, "3": 0.6, "2": 2.0}  # "6" dominated by "4"; "3" sits on the hull
    assert _ladder(kl, bits) == ["8", "4", "3", "2"]
    # from 8 bits: to 6 costs 0.25 KL per bit, to 4 0.15, to 3 0.14: 6 and 4 lie above the line to 3
    kl = {"8": 0.0, "6": 0.5, "4": 0.6, "3": 0.7, "2": 2.0}
    assert _ladder(kl, bits) == ["8", "3", "2"]


def _random_sensitivity(seed, modules=5):
    g = torch.Generator().manual_seed(seed)
    sens = Sensitivity()
    for m in range(modules):
        name = f"m{m}"
        sens.numel[name] = int(torch.randint(1, 5, (1,), generator=g)) * 100
        base = float(torch.rand(1, generator=g))
        # "4b" has 4's bits (another scale dtype), "6" may be dominated or above the hull
        sens.kl[name] = {s: base * f * float(1 + torch.rand(1, generator=g)) for s, f in
                         [("8", 0.01), ("6", 0.8), ("4", 1.0), ("4b", 1.0), ("3", 3.0), ("2", 12.0)]}
        sens.bits[name] = {"8": 8.25, "6": 6.25, "4": 4.75, "4b": 4.75, "3": 3.75, "2": 2.75}
        sens.proxy[name] = dict(sens.kl[name])
    return sens


def _bits(sens, choice):
    return sum(sens.bits[n][s] * sens.numel[n] for n, s in choice.items()) / sum(sens.numel.values())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("target", [3.0, 4.0, 4.75, 5.0, 6.5])
def test_allocation_meets_the_budget_and_is_near_the_exhaustive_optimum(seed, target):
    sens = _random_sensitivity(seed)
    choice = allocate(sens, target)
    assert _bits(sens, choice) <= target + 1e-9
    loss = sum(sens.kl[n][s] for n, s in choice.items())
    names = list(sens.kl)
    feasible = [sum(sens.kl[n][s] for n, s in zip(names, combo)) for combo in
                itertools.product(*[list(sens.kl[n]) for n in names])
                if _bits(sens, dict(zip(names, combo))) <= target + 1e-9]
    best = min(feasible)
    # greedy on the convex hulls: optimal up to the one step that crosses the budget, which
    # costs at most the largest single step along a ladder
    worst_step = max(sens.kl[n][b] - sens.kl[n][a] for n in names
                     for a, b in zip(_ladder(sens.kl[n], sens.bits[n]), _ladder(sens.kl[n], sens.bits[n])[1:]))
    assert best <= loss <= best + worst_step
    uniform = [sum(sens.kl[n][s] for n in names) for s in ["8", "6", "4", "4b", "3", "2"]
               if _bits(sens, dict.fromkeys(names, s)) <= target + 1e-9]
    assert loss <= min(uniform)  # never worse than one scheme for all that fits


def test_the_mix_overrides_the_base_recipe_and_leaves_the_output_projection(small):
    model, calibration, _ = small
    base = lowbit.Recipe(weight="int4-asym-g32-f16", lm_head="int8-sym",
                         overrides=(("q_proj", {"weight": "int8-sym"}),))
    sens = measure_sensitivity(model, calibration, base, ["int8-sym", "int2-asym-g32-f16"])
    assert "lm_head" not in sens.kl  # keeps the recipe's own scheme
    choice = dict.fromkeys(sens.kl, "int2-asym-g32-f16")
    r = mixed_recipe(base, choice, 3.0)
    assert all(r.scheme_for(n)[0] == "int2-asym-g32-f16" for n in choice)  # the base's q_proj override loses
    assert r.scheme_for("lm_head")[0] == "int8-sym"
    with pytest.raises(ValueError, match="candidate 'int2-asym-g32-f16' cannot run module"):
        measure_sensitivity(model, calibration, "w8a8", ["int8-sym", "int2-asym-g32-f16"])


def test_allocation_refuses_an_unreachable_budget(small):
    _, _, sens = small
    with pytest.raises(ValueError, match="below 2.750, the smallest the candidates reach"):
        allocate(sens, 2.5)
    with pytest.raises(ValueError, match="positive number"):
        allocate(sens, float("nan"))
    with pytest.raises(ValueError, match="no module"):
        allocate(Sensitivity(), 4.0)
    assert set(allocate(sens, 99).values()) == {"int8-sym"}  # a budget above the largest: all at the largest


def test_the_mixed_recipe_quantizes_each_module_as_chosen(small, tmp_path):
    model, _, sens = small
    choice = allocate(sens, 4.5)
    assert len(set(choice.values())) > 1
    r = mixed_recipe("w4a16-g128", choice, 4.5)
    q = lowbit.quantize_model(model, r, inplace=False)
    assert {n: v["weight"] for n, v in q.lowbit_modules.items()} == {n: fit_group(s, model.get_submodule(n).in_features)
                                                                     for n, s in choice.items()}
    assert lowbit.Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r  # it round-trips as JSON
    paths = save_sensitivity(sens, choice, tmp_path, 4.5)
    assert [p.name for p in paths] == ["sensitivity.csv", "sensitivity.json", "sensitivity.png"]
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths[1].read_text())
    assert data["choice"] == choice and data["bits_per_weight"] <= 4.5 and "all" in data["spearman_proxy_vs_kl"]
    assert len(paths[0].read_text().splitlines()) == 1 + 14 * len(CANDIDATES)


def test_quantize_target_bits_writes_the_mix_and_its_sensitivities(tiny, tmp_path, capsys):
    out = tmp_path / "auto"
    argv = ["quantize", str(tiny), "--target-bits", "6", "--candidates", "int8-sym,int4-asym-g32-f16", "-o", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "sensitivity: 7 modules x 2 schemes" in text and "Spearman" in text
    assert {p.name for p in out.iterdir()} >= {"sensitivity.csv", "sensitivity.json", "sensitivity.png", "lowbit.json"}
    data = json.loads((out / "sensitivity.json").read_text())
    assert data["bits_per_weight"] <= 6 and set(data["choice"].values()) == {"int8-sym", "int4-asym-g32-f16"}
    model, _ = lowbit.load_model(out)
    assert {n: v["weight"] for n, v in model.lowbit_modules.items()} == data["choice"]
    for bad, message in [(["quantize", str(tiny), "-o", str(tmp_path / "x")], "give --recipe, or --target-bits"),
                         (["quantize", str(tiny), "--recipe", "w8a16", "--candidates", "int8-sym", "-o",
                           str(tmp_path / "x")], "--candidates applies to --target-bits"),
                         (["quantize", str(tiny), "--target-bits", "1", "-o", str(tmp_path / "x")], "below")]:
        assert main(bad) == 2
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto"]
