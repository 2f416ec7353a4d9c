"""Bad input to the recipe loader and the ``lowbit`` command is refused before any work,
with one message that names the argument, field or file at fault, and nothing written.

The model-level tests run a 1-layer random Llama (SmolLM2's tokenizer, 48 positions) in
process, so the whole file takes seconds."""

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
from lowbit.cli import demo, main
from lowbit.recipe import Recipe

from .conftest import TINY_POSITIONS


def _last_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error message"
    assert err[-1].startswith(f"lowbit {command}: error: "), err[-1]
    return err[-1]


def _usage_error(capsys, argv: list[str], option: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = _last_error(capsys, argv[0])
    assert f"argument {option}: expected " in err
    return err


# -- item 3: a string is one pattern, never its characters --------------------------------

def test_a_modules_string_is_one_pattern_not_its_letters(tmp_path):
    r = Recipe(weight="int8-sym", modules="down_proj")
    assert r.modules == ("down_proj",)
    assert r.scheme_for("model.layers.0.mlp.down_proj") == ("int8-sym", None)
    assert r.scheme_for("model.layers.0.mlp.up_proj") is None  # 'p' would match it
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"weight": "int8-sym", "modules": "down_proj"}))
    assert Recipe.get(str(f)) == r and Recipe.from_dict(r.to_dict()) == r


def test_a_modules_string_quantizes_only_what_it_names(capsys, tmp_path, tiny):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"weight": "int8-sym", "modules": "down_proj"}))
    assert main(["quantize", str(tiny), "--recipe", str(f), "-o", str(tmp_path / "out")]) == 0
    assert "recipe custom: 1 modules quantized" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "out")]) == 0
    assert "1 linears: weight int8-sym" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, field", [
    ("down_proj", "recipe overrides"),                          # a string is no list of pairs
    (["down_proj", {"weight": None}], "recipe overrides[0]"),  # one pair, not a list of pairs
    ([["down_proj"]], "recipe overrides[0]"),
    ([["down_proj", "int8-sym"]], "recipe overrides[0]"),
    ([[None, {"weight": None}]], "recipe overrides[0]"),
    ({"down_proj": {"weight": None}}, "recipe overrides"),
])
def test_overrides_must_be_a_list_of_pairs(overrides, field):
    with pytest.raises(ValueError) as e:
        Recipe(weight="int8-sym", overrides=overrides)
    assert str(e.value).startswith(field + ":"), str(e.value)


@pytest.mark.parametrize("kw, field", [
    ({"modules": 3}, "recipe modules:"),
    ({"modules": [r"layers\.0\.", None]}, "recipe modules[1]:"),
    ({"weight": 4}, "recipe weight:"),
    ({"weight": None}, "recipe weight:"),
    ({"lm_head": ["int8-sym"]}, "recipe lm_head:"),
    ({"activation": 8}, "recipe activation:"),
    ({"name": 1}, "recipe name:"),
    ({"overrides": [["x", {"weight": 4}]]}, "recipe overrides['x'].weight:"),
])
def test_fields_of_the_wrong_type_are_named(kw, field):
    with pytest.raises(ValueError) as e:
        Recipe(**({"weight": "int8-sym"} | kw))
    assert str(e.value).startswith(field), str(e.value)


# -- item 17: malformed recipe files name the file and the field --------------------------

@pytest.mark.parametrize("name, content, field", [
    ("pair.json", b'{"weight": "int8-sym", "overrides": [["down_proj"]]}', "overrides[0]"),
    ("single.json", b'{"weight": "int8-sym", "overrides": ["down_proj", {"weight": null}]}', "overrides[0]"),
    ("null.json", b'{"weight": "int8-sym", "modules": [null]}', "modules[0]"),
    ("truncated.json", b'{"weight": "int8-sym", "modules": ["down', "not valid JSON"),
    ("latin1.json", b'{"weight": "int8-sym", "name": "caf\xe9"}', "not UTF-8"),
    ("empty.json", b"", "not valid JSON"),
    ("list.json", b'["int8-sym"]', "JSON object"),
    ("keys.json", b'{"weight": "int8-sym", "modules": [], "wieght": 1}', "wieght"),
    ("bad.yaml", b"weight: [int8-sym\n", "not valid YAML"),
    ("keys.yaml", b"weight: int8-sym\n1: 2\n", "unknown recipe keys"),
    ("null.yaml", b"weight: int8-sym\nmodules: [~]\n", "modules[0]"),
])
def test_malformed_recipe_files_name_the_file_and_field(tmp_path, name, content, field):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(ValueError) as e:
        Recipe.get(str(f))
    msg = str(e.value)
    assert msg.startswith(f"recipe file {str(f)!r}: ") and field in msg, msg
    assert "\n" not in msg


def test_a_recipe_folder_is_named_as_a_folder(tmp_path):
    with pytest.raises(ValueError, match="is a folder"):
        Recipe.get(str(tmp_path))


@pytest.mark.parametrize("content, field", [
    (b'{"weight": "int8-sym", "modules": [null]}', "modules[0]"),
    (b'{"weight": "int8-sym", "overrides": [["down_proj"]]}', "overrides[0]"),
    (b'{"weight": "int2-asym-g64", "activation": "int8-sym-token"}', "int2-asym-g64"),
    (b'\xff\xfe{}', "not UTF-8"),
])
def test_quantize_refuses_a_bad_recipe_file_and_writes_nothing(capsys, tmp_path, content, field):
    f = tmp_path / "recipe.json"
    f.write_bytes(content)
    out = tmp_path / "out"
    assert main(["quantize", "--recipe", str(f), "-o", str(out)]) == 2
    err = _last_error(capsys, "quantize")
    assert str(f) in err and field in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["recipe.json"]


VALID = json.dumps({"weight": "int4-asym-g64", "activation": "int8-asym-token", "modules": [r"layers\.\d+\."],
                    "overrides": [["down_proj", {"weight": "int8-sym"}], [r"layers\.0\.", {"weight": None}]],
                    "lm_head": "int8-sym", "name": "fuzz"}).encode()


@st.composite
def mutated(draw, base: bytes) -> bytes:
    """``base`` with a few bytes replaced, deleted or inserted, or cut short."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data)))
        byte = draw(st.integers(0, 255))
        how = draw(st.sampled_from(["replace", "delete", "insert", "truncate"]))
        if how == "insert" or i == len(data):
            data.insert(i, byte)
        elif how == "replace":
            data[i] = byte
        elif how == "delete":
            del data[i]
        else:
            del data[i:]
    return bytes(data)


FUZZ_EXAMPLES = 50


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(content=mutated(VALID))
def test_mutated_recipe_files_load_or_raise_a_value_error_naming_the_file(content):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "recipe.json"
        f.write_bytes(content)
        try:
            r = Recipe.get(str(f))
        except ValueError as e:
            assert str(e).startswith(f"recipe file {str(f)!r}: "), str(e)
        else:
            assert isinstance(r, Recipe) and Recipe.from_dict(r.to_dict()) == r


# -- item 18: weight/activation combinations lowbit.linear has no kernel for ---------------

@pytest.mark.parametrize("kw, named", [
    ({"weight": "int2-asym-g64", "activation": "int8-sym-token"}, "weight/activation"),
    ({"weight": "int8-asym", "activation": "int8-sym-token"}, "weight/activation"),
    ({"weight": "int4-asym-g32-zpfloat-f16", "activation": "int8-asym-token"}, "weight/activation"),
    ({"weight": "int4-asym-g64", "activation": "int8-asym-token",
      "overrides": [["down_proj", {"weight": "int3-asym-g64"}]]}, "overrides['down_proj']"),
    ({"weight": "int3-asym-g64", "overrides": [["down_proj", {"activation": "int8-sym-token"}]]},
     "overrides['down_proj']"),
    # a module kept float by one override and given weights by a later one keeps the activations
    ({"weight": "int8-sym", "activation": "int8-sym-token",
      "overrides": [["proj", {"weight": None}], ["down", {"weight": "int2-asym-g64"}]]}, "overrides['down']"),
])
def test_a_combination_linear_cannot_run_is_refused_when_the_recipe_is_made(kw, named):
    with pytest.raises(ValueError) as e:
        Recipe(**kw)
    msg = str(e.value)
    assert msg.startswith(f"recipe {named}: weights '") and "with activations 'int8-" in msg, msg


def test_weight_only_overrides_of_an_activation_recipe_are_fine():
    r = Recipe(weight="int4-asym-g64", activation="int8-asym-token",
               overrides=[["down_proj", {"weight": "int2-asym-g64", "activation": None}]])
    assert r.scheme_for("model.layers.0.mlp.down_proj") == ("int2-asym-g64", None)


# -- item 8: more positions than the model has ---------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tiny):
    return lowbit.load_model(tiny)


def test_generate_refuses_a_prompt_past_max_position_embeddings_before_running(tiny_model, monkeypatch):
    model, _ = tiny_model
    runner = lowbit.Runner(model)
    monkeypatch.setattr(runner, "forward", lambda *a, **k: pytest.fail("ran the model"))
    with pytest.raises(ValueError) as e:
        runner.generate(torch.zeros(60, dtype=torch.long), 4)
    assert "60 tokens" in str(e.value) and f"max_position_embeddings={TINY_POSITIONS}" in str(e.value)
    with pytest.raises(ValueError) as e:  # the prompt fits, the new tokens do not
        runner.generate(torch.zeros(40, dtype=torch.long), 10)
    assert "40 tokens" in str(e.value) and "10 new tokens" in str(e.value) and "at most 8 new tokens" in str(e.value)
    with pytest.raises(ValueError, match=f"max_position_embeddings={TINY_POSITIONS}"):
        runner.new_cache(TINY_POSITIONS + 1)


def test_evaluate_refuses_a_ctx_past_max_position_embeddings(tiny_model):
    from lowbit.evaluation import evaluate

    model, tok = tiny_model
    with pytest.raises(ValueError) as e:
        evaluate(model, tok, ctx=64, speed=False, corpus="/nonexistent")  # refused before reading the corpus
    assert "ctx" in str(e.value) and "64 tokens" in str(e.value) and f"={TINY_POSITIONS}" in str(e.value)


def test_cli_eval_refuses_a_ctx_past_max_position_embeddings(capsys, tiny):
    assert main(["eval", str(tiny), "--ctx", "64", "--windows", "1", "--no-speed"]) == 2
    err = _last_error(capsys, "eval")
    assert "--ctx (64 tokens)" in err and f"max_position_embeddings={TINY_POSITIONS}" in err
    assert capsys.readouterr().out == ""


def test_cli_generate_refuses_a_prompt_past_max_position_embeddings(capsys, tiny):
    assert main(["generate", str(tiny), "word " * 60, "--raw", "-n", "2"]) == 2
    err = _last_error(capsys, "generate")
    assert "the prompt (" in err and f"max_position_embeddings={TINY_POSITIONS}" in err
    assert capsys.readouterr().out == ""


# -- item 16: info on a GGUF file, or on any other file ------------------------------------

def test_info_describes_a_gguf_file(capsys, tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "small.gguf"  # the bundled file takes seconds to parse (49k tokenizer entries)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("small")
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((8, 32), dtype=np.float16))
    w.add_tensor("blk.1.attn_q.weight", np.zeros((8, 32), dtype=np.float16))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"GGUF file {path}") and "not a lowbit checkpoint" in out
    assert "small (llama), 2 layers, context 64 tokens" in out and "3 tensors: 2 x F16, 1 x F32" in out


@pytest.mark.parametrize("make, expect", [
    (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 16) and d / "model.safetensors", "is a file"),
    (lambda d: d / "missing", "does not exist"),
    (lambda d: d, "not a lowbit checkpoint"),
])
def test_info_on_something_else_says_what_it_expects(capsys, tmp_path, make, expect):
    path = make(tmp_path)
    assert main(["info", str(path)]) == 2
    err = _last_error(capsys, "info")
    assert str(path) in err and expect in err


# -- item 23: corpus, windows, demo's schemes and limit, a gone source model ---------------

def test_eval_says_a_corpus_folder_is_a_folder_before_loading(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(lowbit, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["eval", "--corpus", str(tmp_path)]) == 2
    err = _last_error(capsys, "eval")
    assert str(tmp_path) in err and "is a folder; expected a UTF-8 text file" in err
    assert main(["eval", "--corpus", str(tmp_path / "nope.txt")]) == 2
    assert "does not exist" in _last_error(capsys, "eval")


@pytest.mark.parametrize("argv, option", [
    (["eval", "--windows", "abc"], "--windows"),
    (["eval", "--ctx", "abc"], "--ctx"),
    (["demo", "--schemes", ""], "--schemes"),
    (["demo", "--schemes", ","], "--schemes"),
    (["demo", "--schemes", "int8-sym,,int4-asym-g64"], "--schemes"),
    (["demo", "--limit", "0"], "--limit"),
])
def test_bad_values_are_usage_errors_naming_the_option(capsys, argv, option):
    err = _usage_error(capsys, argv, option)
    assert repr(argv[-1]) in err and "invalid literal" not in err


@pytest.mark.parametrize("kw, field", [
    ({"schemes": []}, "schemes"),
    ({"schemes": "int8-sym"}, "schemes"),     # a string is no list: never split into letters
    ({"limit": 0}, "limit"),
    ({"limit": -3}, "limit"),
    ({"schemes": ["int5-sym"]}, "int5-sym"),
])
def test_demo_refuses_bad_arguments_before_reading_weights(monkeypatch, kw, field):
    import lowbit.models

    monkeypatch.setattr(lowbit.models, "read_gguf_linear_weights", lambda *a, **k: pytest.fail("read weights"))
    with pytest.raises(ValueError, match=field):
        demo(quiet=True, **kw)


@pytest.mark.parametrize("how", ["deleted", "emptied"])
def test_eval_of_a_checkpoint_whose_source_is_gone_skips_the_comparison(capsys, tmp_path, tiny, how):
    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    ckpt = tmp_path / "ckpt"
    assert main(["quantize", str(src), "--recipe", "w8a16", "-o", str(ckpt)]) == 0
    if how == "deleted":
        shutil.rmtree(src)
    else:
        (src / "config.json").unlink()
    capsys.readouterr()
    assert main(["eval", str(ckpt), "--ctx", "16", "--windows", "1", "--no-speed", "--json"]) == 0
    captured = capsys.readouterr()
    warning = [line for line in captured.err.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and str(src) in warning[0] and "evaluating the checkpoint alone" in warning[0]
    rows = json.loads(captured.out)
    assert [r["model"] for r in rows] == ["ckpt"] and "kl_divergence" not in rows[0]
    assert main(["eval", str(ckpt), "--compare", "w8a16", "--ctx", "16", "--no-speed"]) == 2
    assert "--compare needs the float model" in _last_error(capsys, "eval")


# -- quantize: the output is checked before the model is loaded ----------------------------

@pytest.mark.parametrize("force", [False, True])
def test_quantize_refuses_an_output_that_is_no_checkpoint_before_loading(capsys, tmp_path, monkeypatch, force):
    monkeypatch.setattr(lowbit, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["quantize", "--recipe", "w8a16", "-o", str(tmp_path)] + ["--force"] * force) == 2
    assert str(tmp_path) in _last_error(capsys, "quantize")
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"] and (tmp_path / "keep.txt").read_text() == "mine"


def test_quantize_refuses_an_output_under_a_file_before_loading(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(lowbit, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    (tmp_path / "file").write_text("mine")
    assert main(["quantize", "--recipe", "w8a16", "-o", str(tmp_path / "file" / "out")]) == 2
    assert "is not a folder" in _last_error(capsys, "quantize")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_export_graph_writes_a_program_and_refuses_what_it_must(tiny, tmp_path, capsys):
    out = tmp_path / "w8a8.pt2"
    assert main(["export", str(tiny), "--recipe", "w8a8", "--graph", "-o", str(out)]) == 0
    lines = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:-1]}
    assert list(lines) == ["export", "quantize_weights", "quantize_activations", "fuse", "lower"]
    assert lines["fuse"][1:3] == ["1", "7"]  # aten.linear (the output projection), lowbit.int8_linear
    program = torch.export.load(out)
    model, _ = lowbit.load_model(tiny)
    eager = lowbit.quantize_model(model, "w8a8", inplace=False)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        assert torch.equal(program.module()(ids), eager(ids).logits)
    before = out.stat().st_mtime_ns
    assert main(["export", str(tiny), "--graph", "-o", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    unfused = tmp_path / "w4.pt2"
    assert main(["export", str(tiny), "--recipe", "w4a16-g32", "--graph", "--unfused", "-o", str(unfused)]) == 0
    assert "aten.bitwise_and" in capsys.readouterr().out
    (tmp_path / "notes.txt").write_text("mine")
    for argv, message in [
            (["--graph", "--force", "-o", str(tmp_path / "notes.txt")], "is not a torch.export program"),
            (["--graph", "--format", "gguf", "-o", str(tmp_path / "x.pt2")], "--graph writes a torch.export program"),
            (["--unfused", "-o", str(tmp_path / "x.gguf")], "--unfused applies to --graph"),
            (["--graph", "-o", str(tmp_path)], "is a folder")]:
        assert main(["export", str(tiny), *argv]) == 2
        assert message in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine" and out.stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "w4.pt2", "w8a8.pt2"]


@pytest.mark.parametrize("argv", [["generate", "--prompt", "The capital of France is"],
                                  ["quantize", "--rec", "w8a8", "-o", "out"]])
def test_an_abbreviated_option_is_refused_not_taken_for_another(capsys, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `generate --prompt TEXT` read TEXT as the --prompts file
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"unrecognized arguments: {argv[1]}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
