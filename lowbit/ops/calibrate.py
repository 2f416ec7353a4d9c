"""Time the cpu backend's row kernels against their GEMM paths through ``lowbit.linear``
and keep the crossovers for this CPU (``lowbit.kernels.cpu.calibration`` holds them and
the cpu backend applies them).  ``lowbit info --kernels --calibrate`` runs ``calibrate``.

Example::

    >>> from lowbit.ops.calibrate import measure
    >>> from lowbit.kernels.cpu.calibration import THRESHOLDS
    >>> rows = measure(THRESHOLDS[0], ladder=(1, 2), reps=1)
    >>> [r["m"] for r in rows], all(r["rows"] > 0 and r["gemm"] > 0 for r in rows)
    ([1, 2], True)
"""

from __future__ import annotations

import statistics
import time

import torch

from ..kernels import cpu
from ..kernels.cpu.calibration import (BUILT_IN, FORMAT, LARGE, THRESHOLDS, Threshold, applies, crossover,
                                       machine_key, save)
from .matmul import linear
from .quant import quantize

LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # activation rows timed (512: a prefill)
SHAPES = ((1536, 576), (576, 1536))                # [N, K] of the bundled model's MLP projections


def _seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(t: Threshold, ladder=LADDER, reps: int = 5) -> list[dict]:
    """Seconds of the rows kernel and of the GEMM path at each row count of ``ladder``,
    summed over ``SHAPES`` (the threshold forced each way in turn, per row count); the
    threshold is restored after."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for n, k in SHAPES]
    if t.weight is None:  # a float nn.Linear in a decode step, weight and x of t.dtype
        weights = [w.to(getattr(torch, t.dtype)) for w in weights]
        run = lambda x, w: cpu.step_linear(x, w, None)  # noqa: E731
    else:
        weights = [quantize(w, t.weight) for w in weights]
        run = lambda x, w: linear(x, w, act_scheme=t.act, backend="cpu")  # noqa: E731
    before = t.get(cpu)
    rows = []
    try:
        for m in ladder:
            xs = [torch.randn(m, k, generator=gen).to(getattr(torch, t.dtype)) for _, k in SHAPES]
            sides = {}
            for side, value in (("rows", LARGE), ("gemm", 0)):
                t.set(cpu, value)
                sides[side] = sum(_seconds(lambda: run(x, w), reps) for x, w in zip(xs, weights))
            rows.append({"m": m, **sides})
    finally:
        t.set(cpu, before)
    return rows


def calibrate(reps: int = 15, write: bool = True, log=print, ladder=LADDER) -> dict:
    """Time every threshold that applies here, set the crossovers in this process and
    (``write``) save them where the cpu backend reads them when lowbit is imported
    (``calibration.cache_path()``); returns the calibration.  About 8 s on 2 cores (Zen 2).
    """
    result = {"format": FORMAT, "machine": machine_key(), "written": time.strftime("%Y-%m-%d %H:%M:%S"),
              "shapes": [list(s) for s in SHAPES], "thresholds": {}}
    for t in THRESHOLDS:
        if not applies(t):
            continue
        rows = measure(t, tuple(m for m in ladder if m >= t.first_m), reps)
        # A quantized matmul keeps its rows kernel for one row whatever the timing says: it is
        # what the C++ decode step runs (a plan without it leaves decoding to Python, several
        # times slower), and a GEMM path "winning" at one row is noise of its fixed costs.
        value = crossover(rows) if t.weight is None else max(1, crossover(rows))
        built_in = BUILT_IN.get(t.name, t.get(cpu))
        result["thresholds"][t.name] = {"constant": t.constant, "key": t.key, "value": value, "built_in": built_in,
                                        "ms": [[r["m"], round(r["rows"] * 1e3, 4), round(r["gemm"] * 1e3, 4)]
                                               for r in rows]}
        t.set(cpu, value)
        log(f"{t.name}: rows kernel up to {value} rows (built in: {built_in})")
    if write:
        log(f"wrote {save(result)}")
    return result


__all__ = ["calibrate", "measure", "LADDER", "SHAPES"]
