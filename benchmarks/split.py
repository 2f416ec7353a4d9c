"""Mixed int8/int4 weights (outlier input channels at 8 bits) against plain int4.

Accuracy: on the bundled SmolLM2-135M, every decoder linear quantized with plain int4 at
group 64 and 32 and with int4 g64 plus N outlier channels at int8 (chosen by the
output-error saving from calibration, by activation energy alone, or by weight magnitude
without calibration), evaluated in one ``lowbit.evaluate`` run on the same windows
(perplexity, KL and top-1 against the float model), each row with its bits per weight
(codes, scales, zero points and outlier indices counted).

Speed: ``lowbit.linear`` at M=1 (and M=16) on the cpu backend at the model's shapes,
plain int4 g64 against the same weight split with 16 outliers, alternating, ratios.

    python benchmarks/split.py            # about 6 minutes on 2 cores
    python benchmarks/split.py --quick    # a smoke test

The bundled model's linears are an exact dequantization of Q4_1 (group 32, float16
scale and min): int4 at group 32 re-rounds onto nearly the same grid, so it is far
better here than on a model trained in float; group 64 is the fair plain-int4 baseline.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import lowbit
from lowbit.evaluation import calibration_set, evaluate
from lowbit.models.split import split_model
from lowbit.recipe import DECODER_LINEARS, Recipe

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]


def accuracy(args) -> None:
    model, tok = lowbit.load_model()
    modules = r"layers\.[01]\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$" if args.quick \
        else DECODER_LINEARS
    ids = calibration_set(tok, samples=args.samples, length=args.length)
    models = {}
    for plain in ("int4-asym-g64-f16", "int4-asym-g32-f16"):
        models[plain] = lowbit.quantize_model(model, Recipe(weight=plain, modules=(modules,)), inplace=False)
    for count in args.outliers:
        for by, calib in (("error", ids), ("activation", ids), ("weight", None)):
            if by != "error" and count != 16:
                continue
            name = f"g64 + {count} int8 ({by})"
            models[name] = split_model(lowbit.models.quantize._shallow_copy(model), "int4-asym-g64-f16", count,
                                       calibration=calib, by=by, modules=modules)
    t0 = time.perf_counter()
    rows = evaluate(models, tok, reference=model, ctx=args.ctx, max_windows=args.windows, speed=False,
                    greedy_tokens=16)
    print(f"evaluated {len(models)} models on {args.windows} windows of {args.ctx} tokens in "
          f"{time.perf_counter() - t0:.0f}s")
    print(f"\n{'model':<34}{'bits/w':>8}{'KL':>9}{'top-1':>8}{'ppl':>9}")
    for r in rows:
        bits = r.get("bits_per_linear_weight") or 32.0
        print(f"{r['model']:<34}{bits:>8.3f}{r.get('kl_divergence', 0):>9.4f}{r.get('top1_agreement', 1):>8.3f}"
              f"{r['perplexity']:>9.3f}")


def _time(fn, x, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - t0) / reps


@torch.inference_mode()
def speed(args) -> None:
    print(f"\nlowbit.linear on the cpu backend, {torch.get_num_threads()} threads; split: 16 outliers at int8-sym")
    print(f"{'N x K':<12}{'M':>4}{'plain us':>10}{'split us':>10}{'split/plain':>13}")
    for n, k in SHAPES:
        w = torch.randn(n, k)
        plain = lowbit.quantize(w, "int4-asym-g64-f16")
        split = lowbit.split_quantize(w, "int4-asym-g64-f16", 16)
        for m in (1, 16):
            x = torch.randn(m, k)
            fns = {"plain": lambda x: lowbit.linear(x, plain), "split": lambda x: lowbit.linear(x, split)}
            for f in fns.values():
                _time(f, x, 20)
            best = {name: float("inf") for name in fns}
            for _ in range(args.rounds):  # alternate: the machine is noisy
                for name, f in fns.items():
                    best[name] = min(best[name], _time(f, x, args.reps))
            print(f"{n}x{k:<7}{m:>4}{best['plain'] * 1e6:>10.1f}{best['split'] * 1e6:>10.1f}"
                  f"{best['split'] / best['plain']:>13.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outliers", nargs="+", type=int, default=[8, 16, 32], help="outlier channels per linear")
    p.add_argument("--samples", type=int, default=8, help="calibration rows")
    p.add_argument("--length", type=int, default=256, help="tokens per calibration row")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="2 decoder layers, 2 windows of 128 tokens, short timings")
    p.add_argument("--only", choices=["accuracy", "speed"], help="run one half")
    args = p.parse_args()
    if args.quick:
        args.windows, args.ctx, args.samples, args.length, args.rounds, args.reps = 2, 128, 2, 64, 2, 20
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    if args.only != "speed":
        accuracy(args)
    if args.only != "accuracy":
        speed(args)


if __name__ == "__main__":
    main()
