"""Weight-only recipes with and without int8 activation blocks (llama.cpp's arithmetic).

A weight-only recipe multiplies float activations with the dequantized weight.  The same
weights can instead run against activations rounded to int8 in blocks of 32 (scheme
``int8-sym-g32``: one float32 scale per block, as llama.cpp's Q8_0 activations), where
the dot products of each block are exact integer ones (gemv_a8.cpp).  That is a change
of numerics, so lowbit never makes it silently: a recipe asks for it with
``activation="int8-sym-g32"`` (and ``lm_head_activation``), as the presets ``q4_0-a8`` /
``q8_0-a8`` do.  This script measures what it costs in accuracy and what it gains in
decode speed, each recipe next to its int8-block twin, in one run:

    python benchmarks/act_blocks.py                 # accuracy and speed, about 8 minutes
    python benchmarks/act_blocks.py --only speed
    python benchmarks/act_blocks.py --quick         # a smoke test
    python benchmarks/act_blocks.py --recipes q4_1  # one recipe and its twin

Accuracy: perplexity, KL and top-1 against the float model on the same windows
(``lowbit.evaluate``).  Speed: ``Runner.generate`` decode tokens/s after a 512-token
prompt, alternating the models over rounds (the machine is noisy: read the ratios).
Models are the bundled SmolLM2-135M in float32.
"""

from __future__ import annotations

import argparse
import platform
from dataclasses import replace

import torch

import lowbit
from lowbit.evaluation import default_corpus, evaluate
from lowbit.recipe import Recipe
from lowbit.runtime import Runner

BLOCKS = "int8-sym-g32"
RECIPES = ["w8a16-head8", "w4a16-g64", "w4a16-g128-head8", "q8_0", "q4_0", "q4_1"]


def with_blocks(name: str) -> Recipe:
    """The recipe ``name`` with its activations (and its lm_head's, when quantized) in int8
    blocks of 32."""
    r = Recipe.get(name)
    return replace(r, activation=BLOCKS, lm_head_activation=BLOCKS if r.lm_head else None, name=f"{name} +a8")


def models(model, names):
    out = {}
    for name in names:
        out[name] = lowbit.quantize_model(model, name, inplace=False)
        out[f"{name} +a8"] = lowbit.quantize_model(model, with_blocks(name), inplace=False)
    return out


def accuracy(args, model, tok, quantized) -> None:
    rows = evaluate(quantized, tok, reference=model, ctx=args.ctx, max_windows=args.windows, speed=False,
                    greedy_tokens=16)
    print(f"\naccuracy: {args.windows} windows of {args.ctx} tokens, against the float32 model")
    print(f"{'model':<26}{'ppl':>9}{'KL':>9}{'top-1':>8}{'greedy':>8}")
    for r in rows:
        print(f"{r['model']:<26}{r['perplexity']:>9.3f}{r.get('kl_divergence', 0):>9.4f}"
              f"{r.get('top1_agreement', 1):>8.3f}{r.get('greedy_match', 16):>8}")


def speed(args, tok, quantized) -> None:
    text, _ = default_corpus()
    prompt = torch.tensor(tok(text).input_ids[: args.prefill])
    runners = {name: Runner(m) for name, m in quantized.items()}
    best = {name: 0.0 for name in runners}
    for r in runners.values():
        r.generate(prompt[:8], 4)  # warm-up
    for _ in range(args.rounds):
        for name, r in runners.items():
            best[name] = max(best[name], r.generate(prompt, args.decode + 1).decode_tokens_per_s)
    print(f"\ndecode tok/s after a {args.prefill}-token prompt, {args.decode} tokens, best of {args.rounds} "
          f"alternating rounds, {torch.get_num_threads()} threads")
    print(f"{'model':<26}{'decode tok/s':>14}{'+a8 / plain':>13}")
    for name, tps in best.items():
        ratio = f"{tps / best[name[:-4]]:>13.2f}" if name.endswith(" +a8") else ""
        print(f"{name:<26}{tps:>14.1f}{ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["accuracy", "speed"])
    ap.add_argument("--quick", action="store_true", help="two recipes, two windows, one round")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--recipes", nargs="+", choices=RECIPES, help="only these recipes (default: all)")
    args = ap.parse_args()
    names = args.recipes or (RECIPES[-2:] if args.quick else RECIPES)
    if args.quick:
        args.windows, args.rounds, args.decode = 2, 1, 16
    print(f"lowbit {lowbit.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"cpu kernels: {lowbit.kernels.cpu.features()['cpu']}")
    model, tok = lowbit.load_model(dtype=torch.float32)
    quantized = models(model, names)
    if args.only != "speed":
        accuracy(args, model, tok, quantized)
    if args.only != "accuracy":
        speed(args, tok, quantized)


if __name__ == "__main__":
    main()
