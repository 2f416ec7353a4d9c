"""The kernel plan's per-machine calibration (lowbit.kernels.cpu.calibration)."""

import json

import pytest
import torch

from lowbit.cli import main
from lowbit.kernels import cpu
from lowbit.kernels.cpu import calibration
from lowbit.ops.calibrate import calibrate
from lowbit.scheme import QuantScheme

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs lowbit._C")


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A private cache folder, calibration files read, and every threshold restored after."""
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path))
    monkeypatch.setenv("LOWBIT_KERNEL_CALIBRATION", "1")
    for t in calibration.THRESHOLDS:
        monkeypatch.setattr(cpu, t.constant, getattr(cpu, t.constant))
    return tmp_path


def test_crossover_is_the_last_row_count_of_an_unbroken_win():
    rows = [{"m": 1, "rows": 1, "gemm": 5}, {"m": 4, "rows": 2, "gemm": 3}, {"m": 16, "rows": 4, "gemm": 3},
            {"m": 64, "rows": 1, "gemm": 9}]
    assert calibration.crossover(rows) == 4       # a win after a loss does not count
    assert calibration.crossover([{"m": 1, "rows": 2, "gemm": 1}]) == 0


def test_calibrate_measures_every_threshold_that_applies_and_the_plan_follows(own_cache):
    data = calibrate(reps=1, log=lambda line: None, ladder=(1, 4))
    names = {t.name for t in calibration.THRESHOLDS if calibration.applies(t)}
    assert names and set(data["thresholds"]) == names
    by_name = {t.name: t for t in calibration.THRESHOLDS}
    for name, v in data["thresholds"].items():
        # a quantized matmul's one row stays with its rows kernel (the C++ decode step's);
        # the AMX a8 blocks are timed from two rows (one row runs a8_amx whatever they say)
        t = by_name[name]
        assert v["value"] in ((1, 4) if t.weight is not None else (0, 1, 4))
        assert [m for m, _, _ in v["ms"]] == [m for m in (1, 4) if m >= t.first_m]
        assert all(a > 0 and b > 0 for _, a, b in v["ms"])
    path = calibration.cache_path()
    assert path.parent == own_cache and json.loads(path.read_text()) == data
    assert calibration.load() == data
    # applied: a threshold set from a file decides the plan
    t = next(t for t in calibration.THRESHOLDS if calibration.applies(t))
    data["thresholds"][t.name]["value"] = 2
    calibration.apply(data)
    w, a = QuantScheme.parse(t.weight), None if t.act is None else QuantScheme.parse(t.act)
    k = 576
    plans = [cpu.BACKEND.plan(w, a, m, k, torch.float32).kernel for m in (2, 3)]
    assert plans[0] != plans[1]


def test_a_calibration_of_another_machine_or_turned_off_is_not_used(own_cache, monkeypatch):
    path = calibration.cache_path()
    data = {"format": calibration.FORMAT, "machine": {**calibration.machine_key(), "cpu": "another"},
            "written": "x", "shapes": [], "thresholds": {}}
    path.write_text(json.dumps(data))
    assert calibration.load() is None
    data["machine"] = calibration.machine_key()
    path.write_text(json.dumps(data))
    assert calibration.load() == data
    # written by a lowbit whose kernels (and so crossovers) were others: not used
    path.write_text(json.dumps({**data, "format": calibration.FORMAT - 1}))
    assert calibration.load() is None
    path.write_text(json.dumps(data))
    monkeypatch.setenv("LOWBIT_KERNEL_CALIBRATION", "0")
    assert calibration.load() is None


@pytest.mark.parametrize("text", ["{not json", json.dumps([1]), json.dumps({"format": calibration.FORMAT}),
                                  json.dumps({"format": calibration.FORMAT, "thresholds": {"x": {"value": -1}}}),
                                  json.dumps({"format": calibration.FORMAT, "thresholds": {"x": {"value": "16"}}})])
def test_a_broken_calibration_file_is_named(own_cache, text):
    calibration.cache_path().write_text(text)
    with pytest.raises(ValueError, match="kernel calibration .*kernels-"):
        calibration.load()


def test_info_kernels_says_where_the_thresholds_come_from(own_cache, capsys):
    assert main(["info", "--kernels"]) == 0
    assert "row-kernel thresholds: built in" in capsys.readouterr().out
    assert main(["info", "--calibrate"]) == 2
    assert "--calibrate applies to --kernels only" in capsys.readouterr().err
