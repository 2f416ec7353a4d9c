import json

import pytest

from lowbit.recipe import DECODER_LINEARS, RECIPE_PRESETS, Recipe


def test_presets_are_valid_and_named_after_their_key():
    for name, r in RECIPE_PRESETS.items():
        assert r.name == name and Recipe.from_dict(r.to_dict()) == r


@pytest.mark.parametrize("name, expect", [
    ("model.layers.0.self_attn.q_proj", ("int4-asym-g64", None)),
    ("model.layers.29.mlp.down_proj", ("int4-asym-g64", None)),
    ("model.layers.3.self_attn.rotary_emb", None),
    ("model.embed_tokens", None),
    ("lm_head", None),
])
def test_default_modules_are_the_seven_decoder_linears(name, expect):
    assert Recipe(weight="int4-asym-g64").scheme_for(name) == expect


def test_overrides_apply_in_order_and_can_keep_a_module_float():
    r = Recipe(weight="int4-asym-g64", activation="int8-asym-token",
               overrides=(("down_proj", {"weight": "int8-sym"}), (r"layers\.0\.", {"weight": None}),
                          ("gate_proj", {"activation": None})))
    assert r.scheme_for("model.layers.1.mlp.down_proj") == ("int8-sym", "int8-asym-token")
    assert r.scheme_for("model.layers.0.mlp.down_proj") is None
    assert r.scheme_for("model.layers.2.mlp.gate_proj") == ("int4-asym-g64", None)


def test_lm_head_is_quantized_only_when_asked():
    assert Recipe(weight="int8-sym", lm_head="int8-sym").scheme_for("lm_head") == ("int8-sym", None)
    assert RECIPE_PRESETS["w4a16-g128-head8"].scheme_for("lm_head") == ("int8-sym", None)
    for name in ("w8a8-head8", "w4a8-g128-head8"):  # W8A8 for lm_head, the layers as without -head8
        assert RECIPE_PRESETS[name].scheme_for("lm_head") == ("int8-sym", "int8-sym-token")
        body = RECIPE_PRESETS[name.replace("-head8", "")]
        assert RECIPE_PRESETS[name].scheme_for("model.layers.3.mlp.up_proj") == body.scheme_for(
            "model.layers.3.mlp.up_proj")


def test_recipe_files_json_and_yaml(tmp_path):
    d = {"weight": "int4-sym-g32", "activation": None, "overrides": [["up_proj", {"weight": "int8-sym"}]]}
    (tmp_path / "r.json").write_text(json.dumps(d))
    (tmp_path / "r.yaml").write_text("weight: int4-sym-g32\noverrides:\n  - [up_proj, {weight: int8-sym}]\n")
    for f in ("r.json", "r.yaml"):
        r = Recipe.get(str(tmp_path / f))
        assert r.weight == "int4-sym-g32" and r.modules == (DECODER_LINEARS,)
        assert r.scheme_for("model.layers.0.mlp.up_proj") == ("int8-sym", None)


@pytest.mark.parametrize("d, match", [
    ({"weight": "int5-sym"}, "recipe weight"),
    ({"weight": "int4-sym-token"}, "per token"),
    ({"weight": "int8-sym", "activation": "int4-sym-token"}, "activations are 8-bit"),
    ({"weight": "int8-sym", "modules": ["("]}, "bad regex"),
    ({"weight": "int8-sym", "overrides": [["x", {"wieght": "int8-sym"}]]}, "unknown keys"),
    ({"wieght": "int8-sym"}, "unknown recipe keys"),
    ({"activation": "int8-sym-token"}, "needs a 'weight'"),
])
def test_bad_recipes_are_refused_with_the_field_named(d, match):
    with pytest.raises(ValueError, match=match):
        Recipe.from_dict(d)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="w4a16-g128"):
        Recipe.get("w3a16")


def _weight_schemes():
    for bits in (2, 3, 4, 8):
        for sym in (True, False):
            for block in ("tensor", "channel", "g32"):
                for zp in (("",) if sym else ("", "-zpfloat")):
                    yield f"int{bits}-{'sym' if sym else 'asym'}-{block}{zp}"


@pytest.mark.parametrize("act", [None, "int8-sym-token", "int8-asym-token", "int8-asym-tensor"])
def test_check_act_weight_agrees_with_what_linear_runs(act):
    """Recipes refuse exactly the weight/activation pairs lowbit.linear refuses (both call
    lowbit.scheme.check_act_weight): every weight scheme with ``act``."""
    import torch

    import lowbit
    from lowbit.scheme import check_act_weight

    for w in _weight_schemes():
        qt = lowbit.quantize(torch.randn(8, 64), w)
        try:
            lowbit.linear(torch.randn(2, 64), qt, act_scheme=act, backend="reference")
            runs = None
        except ValueError as e:
            runs = str(e)
        try:
            check_act_weight(w, act)
            accepted = None
        except ValueError as e:
            accepted = str(e)
        assert (runs is None) == (accepted is None), (w, act, runs, accepted)
        if accepted is None:
            Recipe(weight=w, activation=act)
        else:
            with pytest.raises(ValueError, match=f"weights '{w}' with activations '{act}'"):
                Recipe(weight=w, activation=act)
