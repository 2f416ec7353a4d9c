import argparse
import subprocess
import sys

import pytest

from lowbit.cli import KERNEL_PLAN_ROWS, build_parser, demo, kernels_cmd, main


def test_demo_prints_a_row_per_scheme_on_the_bundled_model(capsys):
    assert main(["demo", "--limit", "3", "--schemes", "int4-asym-g32-zpfloat-f16,int4-asym-g32"]) == 0
    out = capsys.readouterr().out
    assert "3 linear weights" in out and "stored as Q4_1" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("int4-")]
    assert [r[0] for r in rows] == ["int4-asym-g32-zpfloat-f16", "int4-asym-g32"]
    # The Q4_1 weights sit on a float-zero-point grid: re-quantizing them in that form
    # is near-lossless, an integer zero point is not.
    zpfloat, zpint = (float(r[2]) for r in rows)
    assert zpfloat < 1e-2 * zpint


def test_demo_figures_respect_the_half_step_bound():
    rows = demo(schemes=["int8-sym", "int3-asym-g64"], limit=2, quiet=True)
    assert all(r["worst_err_over_half_step"] <= 1.0001 for r in rows)
    assert rows[1]["bits_per_weight"] == pytest.approx(3 + (32 + 8) / 64)


def test_demo_reports_a_missing_model_clearly(capsys, tmp_path):
    assert main(["demo", str(tmp_path / "nope.gguf")]) == 2
    assert "nope.gguf does not exist" in capsys.readouterr().err


def test_demo_reports_a_bad_scheme_clearly(capsys):
    assert main(["demo", "--limit", "2", "--schemes", "int4-asym-g128"]) == 2
    assert "group_size=128" in capsys.readouterr().err


def test_quantize_info_eval_generate_on_the_bundled_model(capsys, tmp_path):
    import json

    out = tmp_path / "smol-w8"
    assert main(["quantize", "--recipe", "w8a16", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "210 modules quantized" in text and "210 x weight int8-sym" in text
    assert main(["quantize", "--recipe", "w8a16", "-o", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["info", str(out)]) == 0
    assert "210 linears: weight int8-sym" in capsys.readouterr().out
    assert main(["info", str(out), "--kernels"]) == 0  # its two shapes (K = 576, 1536), M = 1 .. 512
    table = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("int8-sym ")]
    assert [row[2] for row in table] == ["1536", "576"] and all(len(row) == 3 + len(KERNEL_PLAN_ROWS) for row in table)
    assert main(["info"]) == 2 and "--kernels" in capsys.readouterr().err
    assert main(["eval", str(out), "--windows", "1", "--ctx", "64", "--no-speed", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in rows] == ["float", "smol-w8"]  # compared with its float source
    assert rows[1]["kl_divergence"] > 0 and rows[1]["scored_tokens"] == 63
    assert main(["generate", str(out), "What is the capital of France?", "-n", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "decode" in captured.err and "tok/s" in captured.err


def test_quantize_with_outliers_writes_a_split_checkpoint(capsys, tmp_path, tiny):
    out = tmp_path / "tiny-split"
    argv = ["quantize", str(tiny), "--recipe", "w4a16-g32", "--outliers", "8", "--calib-samples", "2",
            "--calib-len", "16", "-o", str(out)]
    assert main(argv) == 0
    assert "7 x weight int4-asym-g32-f16 + 8 outlier channels int8-sym" in capsys.readouterr().out
    assert main(["info", str(out)]) == 0
    assert "7 splits: weight int4-asym-g32-f16" in capsys.readouterr().out
    assert main(["quantize", str(tiny), "--recipe", "w8a8", "--outliers", "8", "-o", str(tmp_path / "x")]) == 2
    assert "does not combine with activations int8-sym-token" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_generate_without_a_model_uses_the_bundled_one(capsys):
    assert main(["generate", "Say hi.", "-n", "3", "--recipe", "w4a16-g64"]) == 0
    assert "prefill" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "Hi there", "-n", "3"], ["generate", "-n", "3", "Hi there"],
                                  ["generate", "--recipe", "q4_0-a8", "Hi there", "-n", "3"],
                                  ["generate", "--dtype", "float32", "-n", "3", "Hi there", "--raw"]])
def test_generate_without_a_model_takes_the_prompt_wherever_it_stands(argv):
    # the bundled model's placeholder goes right before the prompt: argparse fills both
    # optional positionals from the first positional it meets
    from lowbit.cli import _default_model, build_parser

    parser = build_parser()
    args = parser.parse_args(_default_model(parser, argv))
    assert (args.model, args.prompt, args.max_new_tokens) == ("", "Hi there", 3)


def test_generate_act_compute_int8_runs_weight_only_models_and_refuses_others(capsys):
    assert main(["generate", "What is the capital of France?", "-n", "6", "--dtype", "float32",
                 "--recipe", "w4a16-g128-head8", "--act-compute", "int8"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out and "decode" in err
    # the bundled GGUF's own Q4_1 tensors (the "min" domain): llama.cpp's Q4_1 x Q8_1 arithmetic (its
    # first token is a near tie, "The" / "L", which the activations' rounding may flip: no answer checked)
    assert main(["generate", "What is the capital of France?", "-n", "6", "--act-compute", "int8"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "decode" in err
    assert main(["generate", "Hi", "-n", "2", "--recipe", "w8a8", "--act-compute", "int8"]) == 2  # int8 already
    assert "applies to weight-only quantized linears; this model has none" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "Hi", "--act-compute", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_generate_runs_a_file_of_prompts_as_one_batch(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\n\nName a primary colour.\n", encoding="utf-8")
    assert main(["generate", "--prompts", str(prompts), "-n", "6", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == "[0] What is the capital of France?" and "Paris" in lines[1]
    assert "[1] Name a primary colour." in lines and "[2]" not in out  # the empty line is no prompt
    assert "2 prompts" in err and "tok/s with the prefill" in err


@pytest.mark.parametrize("argv, message", [
    (["generate", "-n", "2"], "give a PROMPT or --prompts FILE"),
    (["generate", "", "hi", "--prompts", "FILE"], "either PROMPT or --prompts, not both"),
    (["generate", "--prompts", "EMPTY"], "has no non-empty line"),
    (["generate", "--prompts", "MISSING"], "No such file"),
])
def test_generate_prompts_errors(capsys, tmp_path, argv, message):
    (tmp_path / "FILE").write_text("hi\n")
    (tmp_path / "EMPTY").write_text("\n  \n")
    argv = [str(tmp_path / a) if a in ("FILE", "EMPTY", "MISSING") else a for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_errors_are_one_line(capsys, tmp_path):
    assert main(["info", str(tmp_path)]) == 2
    assert "not a lowbit checkpoint" in capsys.readouterr().err
    assert main(["quantize", "--recipe", "nope", "-o", str(tmp_path / "x")]) == 2
    assert "neither a preset" in capsys.readouterr().err


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("name", list(_commands()))
def test_every_command_help_has_a_description_and_examples(name):
    p = _commands()[name]
    text = p.format_help()
    assert p.description and p.description.splitlines()[0] in text
    examples = [line for line in p.epilog.splitlines()[1:] if line.strip()]
    assert p.epilog.startswith("examples:") and 2 <= len(examples) <= 3
    assert all(line.startswith(f"  lowbit {name}") for line in examples)
    assert all(line in text.splitlines() for line in examples)  # kept whole, one per line


@pytest.mark.parametrize("name", list(_commands()))
def test_every_option_states_its_default(name):
    for action in _commands()[name]._actions:
        if action.option_strings and action.help != argparse.SUPPRESS and "-h" not in action.option_strings:
            assert "(default: " in action.help or "(required)" in action.help, action.option_strings


def test_sampling_options_say_they_need_sample():
    helps = {a.dest: a.help for a in _commands()["generate"]._actions}
    assert all(helps[k].startswith("with --sample:") for k in ("temperature", "top_k", "top_p", "seed"))


def test_choices_come_from_the_library():
    from lowbit.evaluation import PROTOCOLS
    from lowbit.kernels import BACKENDS
    from lowbit.models.load import FLOAT_DTYPES_BY_NAME

    opts = {(a.dest): a for a in _commands()["eval"]._actions}
    assert tuple(opts["backend"].choices) == BACKENDS
    assert tuple(opts["dtype"].choices) == tuple(FLOAT_DTYPES_BY_NAME)
    assert tuple(opts["protocol"].choices) == PROTOCOLS


def test_version(capsys):
    import lowbit

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"lowbit {lowbit.__version__}\n"


@pytest.mark.parametrize("argv, option", [
    (["eval", "--windows", "two"], "--windows"),
    (["eval", "--windows", "0"], "--windows"),
    (["eval", "--ctx", "-5"], "--ctx"),
    (["eval", "--greedy-tokens", "1.5"], "--greedy-tokens"),
    (["generate", "hi", "--max-new-tokens", "x"], "--max-new-tokens"),
    (["generate", "hi", "--temperature", "0"], "--temperature"),
    (["generate", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "hi", "--top-k", "0"], "--top-k"),
    (["generate", "hi", "--top-p", "1.5"], "--top-p"),
    (["generate", "hi", "--seed", "-1"], "--seed"),
    (["demo", "--limit", "none"], "--limit"),
])
def test_a_bad_number_is_a_one_line_usage_error_naming_the_option(capsys, argv, option):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"lowbit {argv[0]}: error: argument ") and f"{option}: expected " in err
    assert repr(argv[-1]) in err


def test_help_imports_no_kernels():
    code = ("import sys\n"
            "from lowbit.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('lowbit._C' in sys.modules, 'lowbit.kernels' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "False False"


def test_export_writes_an_exact_gguf_and_refuses_what_it_must(capsys, tmp_path):
    out = tmp_path / "m.gguf"
    assert main(["export", "--recipe", "q4_0", "-o", str(out), "--strict"]) == 0
    text = capsys.readouterr().out
    assert "int4-sym-g32-f16  Q4_0       210      codes kept  0 (exact)" in text
    assert "int8-sym-g32-f16  Q8_0       1        codes kept  0 (exact)" in text  # the output projection
    assert "273 tensors, 0 not exact" in text
    assert out.read_bytes()[:4] == b"GGUF"
    assert out.stat().st_mode & 0o644 == 0o644  # not the temporary file's private mode
    before = out.stat().st_mtime_ns
    assert main(["export", "-o", str(out)]) == 2  # exists, no --force
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["export", "--recipe", "w4a16-g32", "-o", str(tmp_path / "n.gguf"), "--strict"]) == 2
    assert "is not stored exactly as Q4_1" in capsys.readouterr().err
    assert out.stat().st_mtime_ns == before and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    assert main(["export", "-o", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_export_compressed_tensors_and_load_it_back(capsys, tmp_path):
    import json

    recipe = tmp_path / "layer0-w8a8.json"
    recipe.write_text(json.dumps({"weight": "int8-sym", "activation": "int8-sym-token", "modules": [r"layers\.0\."]}))
    out = tmp_path / "ct"
    assert main(["export", "--recipe", str(recipe), "--format", "compressed-tensors", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "int8-sym       int8-sym-token  int-quantized  7        exact" in text
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == "int-quantized"
    assert (out / "tokenizer.json").is_file()
    assert main(["info", str(out)]) == 0
    assert "7 linears: weight int8-sym, activations int8-sym-token" in capsys.readouterr().out
    # refused before the model is loaded: options of the other format, a scheme it cannot hold
    assert main(["export", "--format", "compressed-tensors", "--type", "q4_0", "-o", str(tmp_path / "x")]) == 2
    assert "--type applies to --format gguf" in capsys.readouterr().err
    assert main(["export", "--recipe", "q4_1", "--format", "compressed-tensors", "-o", str(tmp_path / "x")]) == 2
    assert "'min' zero point" in capsys.readouterr().err
    assert main(["export", "--recipe", str(recipe), "--format", "compressed-tensors", "-o", str(out)]) == 2
    assert "exists; pass overwrite=True" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct", "layer0-w8a8.json"]


def test_info_kernels_shows_the_cpu_plan_of_the_presets(capsys):
    from lowbit.kernels import cpu

    if not cpu.available():
        pytest.skip(cpu.load_error())
    rows = kernels_cmd()
    out = capsys.readouterr().out
    assert out.startswith("cpu: ") and "why:" in out
    if cpu.prefill_attention_available():  # which attention a prefill runs, tiles named where they run
        assert "prefill attention: prefill_attention" in out
        assert ("heads of 32, 64, 96, 128 values on AMX bf16 tiles" in out) == cpu.prefill_attention_tiles(64)
    assert {(r["weight"], r["activation"]) for r in rows} >= {("int4-sym-g32-f16", "int8-sym-g32"),
                                                               ("int8-sym", None)}
    for r in rows:  # every kernel named is explained, and the decode rows run no weight tiles
        assert all(f"  {k}" in out for k in r["kernels"])
        if cpu._has_gemv_f32() and r["activation"] is None:
            assert r["kernels"][0].startswith("gemv"), r
