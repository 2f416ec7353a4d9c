"""Does automatic mixed precision beat uniform quantization at the same size?

On the bundled SmolLM2-135M: measure every decoder linear's sensitivity once (the KL
divergence of the next-token distribution on calibration text when that module alone
is quantized, at each candidate scheme), then for each uniform scheme quantize the model
with it and with the automatic allocation for exactly its bits per weight (scales and
zero points counted), and for each --targets budget; evaluate all of them in one
``lowbit.evaluate`` run on the same held-out windows (perplexity, KL and top-1 against
the float model).  Prints the proxy's rank correlation with the measured KL, the table,
and per uniform scheme the ratio of the automatic mix's KL to the uniform one's.

    python benchmarks/mixed_precision.py            # about 15 minutes on 2 cores
    python benchmarks/mixed_precision.py --quick    # a smoke test: 2 layers, 2 windows
    python benchmarks/mixed_precision.py --gguf benchmarks/.llama.cpp/gguf/*.Q{3,4}_K_M.gguf

The bundled model's linears are an exact dequantization of Q4_1 (group 32, float16
scale and min): every 4-bit scheme here is a second rounding, the same for both sides.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import lowbit  # noqa: E402
from lowbit.evaluation import calibration_set, evaluate  # noqa: E402
from lowbit.models.mixed_precision import allocate, measure_sensitivity, mixed_recipe, scheme_bits  # noqa: E402
from lowbit.recipe import DECODER_LINEARS, Recipe, fit_group  # noqa: E402

UNIFORM = ["int3-asym-g64-f16", "int4-asym-f16", "int4-sym-g32-f16", "int4-asym-g32-f16"]
CANDIDATES = ["int8-sym", "int4-asym-g32-f16", "int4-sym-g32-f16", "int4-asym-f16", "int3-asym-g64-f16",
              "int2-asym-g32-f16"]


def uniform_bits(model, recipe: Recipe) -> float:
    """Bits per weight of ``recipe``'s single scheme over the linears it selects (group sizes fitted)."""
    bits = numel = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and recipe.scheme_for(name) is not None:
            n, k = mod.weight.shape
            bits += scheme_bits(fit_group(recipe.weight, k), n, k) * n * k
            numel += n * k
    return bits / numel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--uniform", nargs="+", default=UNIFORM, help="uniform schemes to match (default: %(default)s)")
    p.add_argument("--candidates", nargs="+", default=CANDIDATES, help="schemes the mix chooses from")
    p.add_argument("--targets", nargs="*", type=float, default=[3.5, 4.0, 4.5], help="more budgets (bits/weight)")
    p.add_argument("--samples", type=int, default=1, help="calibration rows for the sensitivities")
    p.add_argument("--length", type=int, default=256, help="tokens per calibration row")
    p.add_argument("--windows", type=int, default=8, help="evaluation windows of --ctx tokens")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--gguf", nargs="*", default=[],
                   help="GGUF files of the same model to compare (llama.cpp's fixed mixes: llama-quantize the F32 "
                        "export to Q3_K_M, Q4_K_M), run on their own tensors, with the automatic mix at their "
                        "decoder linears' bits per weight")
    p.add_argument("--quick", action="store_true", help="2 decoder layers, 2 windows of 128 tokens")
    args = p.parse_args()
    modules = (r"layers\.[01]\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$",) if args.quick \
        else (DECODER_LINEARS,)
    if args.quick:
        args.windows, args.ctx, args.length = 2, 128, 64
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    model, tok = lowbit.load_model()
    base = Recipe(weight="int4-asym-g32-f16", modules=modules, name="base")
    ids = calibration_set(tok, samples=args.samples, length=args.length)
    t0 = time.perf_counter()
    sens = measure_sensitivity(model, ids, base, args.candidates, progress=True)
    print(f"sensitivity: {len(sens.kl)} modules x {len(args.candidates)} schemes on {ids.numel()} tokens "
          f"in {time.perf_counter() - t0:.0f}s")
    print("Spearman rank correlation, proxy (input-weighted weight error) vs measured KL:")
    for key, rho in sens.spearman().items():
        print(f"  {key:<20} {rho:6.3f}")
    recipes: dict[str, tuple[Recipe, float, float]] = {}  # name -> (recipe, bits, predicted KL)
    for u in args.uniform:
        r = Recipe(weight=u, modules=modules, name=u)
        bits = uniform_bits(model, r)
        predicted = sum(sens.kl[n].get(u, float("nan")) for n in sens.kl)
        recipes[u] = (r, bits, predicted)
        choice = allocate(sens, bits)
        recipes[f"auto@{u}"] = (mixed_recipe(r, choice, bits), sens.bits_per_weight(choice),
                                sens.predicted_kl(choice))
    for t in args.targets:
        choice = allocate(sens, t)
        recipes[f"auto-{t:g}"] = (mixed_recipe(base, choice, t), sens.bits_per_weight(choice),
                                  sens.predicted_kl(choice))
    ggufs = {}
    for path in args.gguf:
        g, _ = lowbit.load_model(path, gguf="native")
        name = "llama.cpp " + os.path.basename(path).rsplit(".", 2)[-2]
        bits = gguf_decoder_bits(path)
        ggufs[name] = (g, bits, dict(sorted(g.lowbit_gguf["native"].items())))
        choice = allocate(sens, bits)
        recipes[f"auto@{name.split()[-1]}"] = (mixed_recipe(base, choice, bits), sens.bits_per_weight(choice),
                                               sens.predicted_kl(choice))
    models = {name: lowbit.quantize_model(model, r, inplace=False) for name, (r, _, _) in recipes.items()}
    models.update({name: g for name, (g, _, _) in ggufs.items()})
    t0 = time.perf_counter()
    rows = evaluate(models, tok, reference=model, ctx=args.ctx, max_windows=args.windows, speed=False,
                    greedy_tokens=16)
    print(f"evaluated {len(models)} models on {args.windows} windows of {args.ctx} tokens in "
          f"{time.perf_counter() - t0:.0f}s")
    by = {r["model"]: r for r in rows}
    print(f"\n{'model':<26}{'bits/w':>8}{'pred. KL':>10}{'KL':>9}{'top-1':>8}{'ppl':>9}")
    print(f"{'float':<26}{32:>8.3f}{'':>10}{0:>9.4f}{1:>8.3f}{by['float']['perplexity']:>9.3f}")
    for name, (_, bits, predicted) in recipes.items():
        row = by[name]
        print(f"{name:<26}{bits:>8.3f}{predicted:>10.4f}{row['kl_divergence']:>9.4f}"
              f"{row['top1_agreement']:>8.3f}{row['perplexity']:>9.3f}")
    for name, (_, bits, types) in ggufs.items():
        row = by[name]
        print(f"{name:<26}{bits:>8.3f}{'':>10}{row['kl_divergence']:>9.4f}"
              f"{row['top1_agreement']:>8.3f}{row['perplexity']:>9.3f}   tensors: {types}")
    print("\nautomatic / uniform at the same bits per weight (below 1: the mix is better)")
    for u in args.uniform:
        a, b = by[f"auto@{u}"], by[u]
        print(f"  {u:<22} KL {a['kl_divergence'] / b['kl_divergence']:.3f}   "
              f"perplexity {a['perplexity'] / b['perplexity']:.3f}")


def gguf_decoder_bits(path: str) -> float:
    """Bits per weight of a GGUF file's decoder linears (blk.N.attn_q/k/v/output, ffn_gate/up/down) as stored."""
    import re

    from lowbit.formats.gguf_file import read_gguf

    bits = numel = 0
    for t in read_gguf(path).tensors:
        if re.fullmatch(r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight", t.name):
            bits += int(t.n_bytes) * 8
            numel += int(t.n_elements)
    return bits / numel


if __name__ == "__main__":
    main()
