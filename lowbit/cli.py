"""The ``lowbit`` command.

Example::

    $ lowbit demo                       # quantize every linear of the bundled model
    $ lowbit demo --schemes int4-asym-g64,int8-sym --model path/to/model.gguf
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

DEMO_SCHEMES = [
    # SmolLM2's in_features are 576 and 1536: group sizes must divide 576 = 9 * 64.
    "int8-sym", "int8-asym", "int4-asym-channel", "int4-sym-g64", "int4-asym-g64", "int4-asym-g32",
    "int4-asym-g32-zpfloat-f16", "int3-asym-g64", "int2-asym-g64", "int2-asym-g64-zpfloat",
]


def demo(model: str | None = None, schemes: list[str] | None = None, limit: int | None = None,
         quiet: bool = False) -> list[dict]:
    """Quantize every decoder linear weight of a GGUF model (default: the bundled
    SmolLM2-135M) at several schemes and print what each costs in error and bytes.

    Returns one dict per scheme with the figures printed.

    Example::

        >>> from lowbit.cli import demo
        >>> rows = demo(schemes=["int8-sym"], limit=2, quiet=True)
        >>> rows[0]["scheme"], rows[0]["bits_per_weight"] > 8, rows[0]["worst_err_over_half_step"] <= 1.0001
        ('int8-sym', True, True)
    """
    import lowbit
    from lowbit.kernels.reference import to_blocks
    from lowbit.models import read_gguf_linear_weights

    def say(line=""):
        if not quiet:
            print(line, flush=True)

    t0 = time.perf_counter()
    weights = read_gguf_linear_weights(model, limit=limit)
    numel = sum(w.numel() for w, _ in weights.values())
    kinds = sorted({k for _, k in weights.values()})
    say(f"{len(weights)} linear weights, {numel / 1e6:.1f}M values (stored as {', '.join(kinds)}), "
        f"read in {time.perf_counter() - t0:.1f}s")
    say("error: relative RMS error ||W - deq(q(W))|| / ||W||; SQNR = -20 log10 of it;")
    say("worst/half-step: max |error| over (scale/2) of its block, <= 1 by construction")
    say()
    header = f"{'scheme':<28}{'bits/weight':>12}{'rel. error':>12}{'SQNR dB':>9}{'worst/half-step':>17}{'quantize s':>12}"
    say(header)
    say("-" * len(header))
    rows = []
    for name in schemes or DEMO_SCHEMES:
        s = lowbit.QuantScheme.parse(name)
        err2 = ref2 = 0.0
        nbytes, worst, seconds = 0, 0.0, 0.0
        for w, _ in weights.values():
            t = time.perf_counter()
            qt = lowbit.quantize(w, s)
            seconds += time.perf_counter() - t
            e = (lowbit.dequantize(qt) - w).double()
            err2 += float((e * e).sum())
            ref2 += float((w.double() ** 2).sum())
            nbytes += qt.nbytes
            per_block = to_blocks(e.abs(), s.granularity, s.group_size).amax(dim=1)
            worst = max(worst, float((per_block / (qt.scale.double().reshape(-1) / 2)).max()))
        rel = math.sqrt(err2 / ref2)
        row = dict(scheme=str(s), bits_per_weight=nbytes * 8 / numel, rel_error=rel,
                   sqnr_db=-20 * math.log10(max(rel, 1e-300)), worst_err_over_half_step=worst,
                   quantize_seconds=seconds)
        rows.append(row)
        say(f"{row['scheme']:<28}{row['bits_per_weight']:>12.3f}{rel:>12.2e}{row['sqnr_db']:>9.1f}"
            f"{worst:>17.4f}{seconds:>12.2f}")
    if "Q4_1" in kinds:
        say()
        say("The weights were stored as GGUF Q4_1 (4-bit, group 32, fp16 scale and min), so the")
        say("float zero point scheme int4-asym-g32-zpfloat-f16 lands back on their grid almost")
        say("exactly, while an integer zero point (int4-asym-g32) adds a second rounding.")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lowbit`` command."""
    parser = argparse.ArgumentParser(prog="lowbit", description="low-bit quantized LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="quantize the linear weights of a model at several schemes "
                                    "and print the error table")
    p.add_argument("--model", help="GGUF file (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--schemes", help=f"comma-separated schemes (default: {','.join(DEMO_SCHEMES)})")
    p.add_argument("--limit", type=int, help="only the first N linear weights")
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            with torch.no_grad():
                demo(args.model, args.schemes.split(",") if args.schemes else None, args.limit)
        except (FileNotFoundError, ValueError, TypeError) as e:
            print(f"lowbit demo: error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
