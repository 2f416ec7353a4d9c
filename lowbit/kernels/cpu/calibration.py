"""This CPU's crossovers between the cpu backend's row kernels and its GEMM paths, kept per
CPU.

The plan (``lowbit.kernels.cpu``) runs a decode ("rows") kernel up to some number of
activation rows and a GEMM path beyond it.  The built-in thresholds were measured by hand
on two machines; on another CPU the crossover moves.  ``lowbit.ops.calibrate.calibrate()``
times both sides of each threshold in ``THRESHOLDS`` that applies to this machine, takes
the largest row count at which the rows kernel still wins (``crossover``), and saves the
result as a JSON file named after the CPU, the extension's build and torch's thread count
(``cache_path()``).  The cpu backend reads that file when it is imported (``load``,
``apply``) and uses its thresholds instead of the built-in ones; ``lowbit info --kernels``
says which are in force and why.  ``LOWBIT_KERNEL_CALIBRATION=0`` ignores the file.

Example::

    >>> from lowbit.kernels.cpu import calibration
    >>> calibration.cache_path().name.startswith("kernels-")
    True
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# 2: the a8 blocks threshold per weight bits, and GEMM sides that changed (gemm_a8.cpp,
# gemm_i16.cpp); 3: the weight-only and float32 GEMM sides on AVX2 run gemm_f32.cpp, not
# MKL's sgemm.  A file of an older format measured other kernels and is not used.
# 4: on AMX machines the GEMM sides run AMX tiles (int8: gemm_amx.cpp; bf16 weight-only:
# gemm_bf16.cpp's weight_only_gemm_bf16_amx), and the a8 blocks have thresholds of their own there.
# 5: gemv_bf16 lost a 64-bit division per 128 weights (1.06-1.24x a call) and the AMX
# weight-only kernels one per 32 values: the bf16 gemv's crossover may have moved.
# 6: on AVX-512 machines without AMX the a8 blocks' GEMM side runs gemm_a8_vnni.cpp (not
# float32 tiles), with a threshold per weight bits.
# 7: gemm_amx.cpp's int8-block tiles take the weight rows as A (1.2-1.7x a call at 4-32
# rows): the a8 blocks' AMX crossover moved down.
# 8: where AMX runs, gemv_bf16's other side is gemv_amx.cpp's tiles, with a threshold of its own.
# 9: where AMX runs, one row of int8 blocks times 4-bit codes runs a8_amx (gemv_a8_vnni.cpp)
# whatever the threshold, which is timed from two rows.
FORMAT = 9
LARGE = 1 << 20                              # a threshold that forces the rows kernel
BUILT_IN: dict[str, int] = {}                # each threshold's value in the code, before a calibration


@dataclass(frozen=True)
class Threshold:
    """One threshold of the plan: the module constant (``key``: an item of a dict
    constant), the matmul it decides (weight and activation schemes; no weight scheme: a
    float nn.Linear of ``dtype`` in a decode step) and the dtype of its activations, and on which
    machines the plan reads it (``avx512``: True, False, or None for both)."""

    name: str
    constant: str
    key: int | None
    weight: str | None
    act: str | None
    avx512: bool | None
    dtype: str = "float32"
    first_m: int = 1  # the fewest rows timed (AMX a8 blocks, 4-bit: one row runs a8_amx whatever the threshold)

    def get(self, mod) -> int:
        value = getattr(mod, self.constant)
        return value[self.key] if self.key is not None else value

    def set(self, mod, value: int) -> None:
        if self.key is None:
            setattr(mod, self.constant, value)
        else:
            setattr(mod, self.constant, {**getattr(mod, self.constant), self.key: value})
        mod.clear_plans()  # the plans are cached per shape


THRESHOLDS = (
    Threshold("gemv 4-bit (AVX2)", "AVX2_GEMV_MAX_M", 4, "int4-asym-g64-f16", None, False),
    Threshold("gemv 8-bit (AVX2)", "AVX2_GEMV_MAX_M", 8, "int8-sym", None, False),
    Threshold("a8 blocks 4-bit (AVX2)", "AVX2_A8_ROWS_MAX_M", 4, "int4-sym-g32-f16", "int8-sym-g32", False),
    Threshold("a8 blocks 8-bit (AVX2)", "AVX2_A8_ROWS_MAX_M", 8, "int8-sym-g32-f16", "int8-sym-g32", False),
    Threshold("a8 blocks 4-bit (AVX-512)", "A8_ROWS_MAX_M", 4, "int4-sym-g32-f16", "int8-sym-g32", True),
    Threshold("a8 blocks 8-bit (AVX-512)", "A8_ROWS_MAX_M", 8, "int8-sym-g32-f16", "int8-sym-g32", True),
    Threshold("a8 blocks 4-bit (AMX)", "AMX_A8_ROWS_MAX_M", 4, "int4-sym-g32-f16", "int8-sym-g32", True, first_m=2),
    Threshold("a8 blocks 8-bit (AMX)", "AMX_A8_ROWS_MAX_M", 8, "int8-sym-g32-f16", "int8-sym-g32", True),
    Threshold("int8 rows (AVX2)", "INT8_ROWS_MAX_M", None, "int8-sym", "int8-sym-token", False),
    Threshold("w4a8 rows (AVX2)", "W4A8_AVX2_ROWS_MAX_M", None, "int4-asym-g64-f16", "int8-asym-token", False),
    Threshold("w4a8 rows (AVX-512)", "W4A8_ROWS_MAX_M", None, "int4-asym-g64-f16", "int8-asym-token", True),
    Threshold("dense float32 rows", "DENSE_ROWS_MAX_M", None, None, None, None),
    Threshold("dense bfloat16 rows", "DENSE_BF16_ROWS_MAX_M", None, None, None, None, "bfloat16"),
    Threshold("gemv bf16 (AVX-512)", "GEMV_BF16_MAX_M", None, "int4-asym-g64-f16", None, True, "bfloat16"),
    Threshold("gemv bf16 (AMX)", "AMX_GEMV_BF16_MAX_M", None, "int4-asym-g64-f16", None, True, "bfloat16"),
)


def machine_key() -> dict:
    """What the measured thresholds depend on: the CPU model and its flags, the kernels'
    build, torch's version and thread count."""
    from . import features

    f = features()
    cpu = f["cpu"] if f["cpu"] != "unknown" else platform.processor() or platform.machine()
    return {"cpu": cpu, "flags": sorted(f["machine"]), "built": sorted(f["compiled"]), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def cache_path(key: dict | None = None) -> Path:
    """The calibration file of this machine: ``$LOWBIT_CACHE`` (default ``~/.cache/lowbit``)
    / ``kernels-<hash of machine_key()>.json`` (``key``: that key, when the caller has it)."""
    from ..._folders import cache_dir

    key = machine_key() if key is None else key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir()) / f"kernels-{digest}.json"


def applies(t: Threshold) -> bool:
    from . import _C, _has_avx512

    if _C is None or (t.avx512 is not None and t.avx512 != _has_avx512()):
        return False
    if t.weight is None:
        return _C.has_dense_rows()
    if t.constant.endswith("GEMV_BF16_MAX_M"):  # the AMX threshold where AMX runs, the other elsewhere
        return _C.gemv_bf16_supported(576, 64) and t.constant.startswith("AMX_") == _C.gemv_bf16_amx_supported(576, 64)
    if t.constant == "INT8_ROWS_MAX_M":
        return _C.has_int8_rows()
    if t.constant.startswith("W4A8"):
        return _C.has_w4a8_rows()
    if t.act == "int8-sym-g32":  # the AMX thresholds where AMX runs, A8_ROWS_MAX_M elsewhere
        return _C.has_a8_blocks() and t.constant.startswith("AMX_") == _C.has_amx_int8()
    return _C.has_gemv_f32()


def load(path: Path | None = None) -> dict | None:
    """The calibration of this machine, checked, or None when there is none, it is turned
    off (``LOWBIT_KERNEL_CALIBRATION=0``) or it was written for another machine or by a
    lowbit whose calibration ``FORMAT`` differs (other kernels: calibrate again).
    A file that cannot be read as one raises ValueError naming it."""
    if os.environ.get("LOWBIT_KERNEL_CALIBRATION", "1") == "0":
        return None
    key = machine_key()  # reads /proc/cpuinfo: once, at import
    path = cache_path(key) if path is None else path
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("format"), int) and data["format"] != FORMAT:
            return None  # written by another version of lowbit, for other kernels
        ok = (isinstance(data["thresholds"], dict)
              and all(isinstance(v["value"], int) and not isinstance(v["value"], bool) and 0 <= v["value"] <= LARGE
                      for v in data["thresholds"].values()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"kernel calibration {str(path)!r} is not a readable calibration ({e}); delete it or "
                         "run `lowbit info --kernels --calibrate` again") from None
    if not ok:
        raise ValueError(f"kernel calibration {str(path)!r} has a threshold that is not an integer in [0, {LARGE}]; "
                         "delete it or run `lowbit info --kernels --calibrate` again")
    if data.get("machine") != key:
        return None
    return data


def apply(data: dict) -> None:
    """Set the cpu backend's thresholds from a ``load()``-ed calibration."""
    from .. import cpu

    by_name = {t.name: t for t in THRESHOLDS}
    for name, v in data["thresholds"].items():
        if name in by_name:
            by_name[name].set(cpu, v["value"])


def crossover(rows: list[dict]) -> int:
    """The largest row count up to which the rows kernel wins at every timed count (0:
    the GEMM path wins from one row on); rows as ``lowbit.ops.calibrate.measure`` gives them."""
    best = 0
    for r in rows:
        if r["rows"] > r["gemm"]:
            break
        best = r["m"]
    return best


def save(data: dict) -> Path:
    """Write a calibration where ``load`` finds it (a temporary file renamed into place)."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


__all__ = ["THRESHOLDS", "Threshold", "load", "apply", "save", "cache_path", "machine_key", "crossover", "applies"]
