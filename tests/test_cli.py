import pytest

from lowbit.cli import demo, main


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
    assert main(["demo", "--model", str(tmp_path / "nope.gguf")]) == 2
    assert "nope.gguf does not exist" in capsys.readouterr().err


def test_demo_reports_a_bad_scheme_clearly(capsys):
    assert main(["demo", "--limit", "2", "--schemes", "int4-asym-g128"]) == 2
    assert "group_size=128" in capsys.readouterr().err
