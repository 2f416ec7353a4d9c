"""The ``lowbit`` command.  Without a MODEL argument every command uses the bundled
SmolLM2-135M-Instruct (GGUF Q4_1).

Example::

    $ lowbit quantize --recipe w4a16-g128 -o smollm2-w4a16     # quantize and save
    $ lowbit eval smollm2-w4a16                                  # perplexity, KL, speed vs float
    $ lowbit eval --compare w8a16 w4a16-g64 w8a8 --json          # several recipes in one table
    $ lowbit generate smollm2-w4a16 "Tell me about Paris."       # chat, fast decode
    $ lowbit info smollm2-w4a16                                  # what a checkpoint holds
    $ lowbit demo                        # weight error of every linear at several schemes
"""

from __future__ import annotations

import argparse
import json
import os
import math
import sys
import time
from collections import Counter

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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def quantize_cmd(model: str | None, recipe: str, output: str, dtype: str = "float32", force: bool = False,
                 backend: str | None = None) -> dict:
    """Load MODEL, quantize it with RECIPE and save a checkpoint folder; returns a summary.

    Example::

        >>> from lowbit.cli import quantize_cmd
        >>> quantize_cmd(None, "w4a16-g128", "smollm2-w4a16")            # doctest: +SKIP
    """
    import lowbit
    from lowbit.evaluate import weight_bytes

    r = lowbit.Recipe.get(recipe)
    if os.path.exists(output) and not force:
        raise FileExistsError(f"{output!r} exists; pass --force to replace it")
    t0 = time.perf_counter()
    m, tok = lowbit.load_model(model, dtype=DTYPES[dtype])
    _err(f"loaded {getattr(m, 'lowbit_source', model)} in {time.perf_counter() - t0:.1f}s")
    before = weight_bytes(m)["weight_bytes"]
    t0 = time.perf_counter()
    lowbit.quantize_model(m, r, backend=backend, progress=True)
    seconds = time.perf_counter() - t0
    out = lowbit.save_quantized(m, output, tok, overwrite=force)
    after = weight_bytes(m)["weight_bytes"]
    counts = Counter((v["weight"], v["activation"]) for v in m.lowbit_modules.values())
    fallbacks = sum(v["weight"] != v["asked"] for v in m.lowbit_modules.values())
    print(f"recipe {r.name}: {len(m.lowbit_modules)} modules quantized in {seconds:.1f}s")
    for (w, a), n in sorted(counts.items()):
        print(f"  {n:4d} x weight {w}" + (f", activations {a}" if a else ""))
    if fallbacks:
        print(f"  ({fallbacks} modules use a smaller group: their in_features is not a multiple of the asked one)")
    print(f"weights {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB; saved to {out}")
    return {"recipe": r.name, "modules": len(m.lowbit_modules), "weight_bytes": after, "path": str(out)}


def _model_and_reference(model: str | None, dtype, backend):
    """(model, tokenizer, float reference or None) for eval/generate."""
    import lowbit
    from lowbit.models.load import CHECKPOINT_CONFIG, resolve_model_path

    p = resolve_model_path(model)
    m, tok = lowbit.load_model(p, dtype=dtype, backend=backend)
    if p.is_dir() and (p / CHECKPOINT_CONFIG).is_file():
        src = getattr(m, "lowbit_source", None)
        if src and os.path.exists(src):
            ref, _ = lowbit.load_model(src, dtype=dtype)
            return m, tok, ref
        _err(f"the float model this checkpoint came from ({src}) is not here: no comparison with it")
        return m, tok, None
    return None, tok, m


def eval_cmd(model: str | None, compare: list[str], *, as_json: bool = False, corpus: str | None = None,
             ctx: int = 512, windows: int | None = 16, protocol: str = "lowbit", speed: bool = True,
             dtype: str = "float32", backend: str | None = None) -> list[dict]:
    """Evaluate a checkpoint (against its float source) or a float model, plus the
    ``compare`` recipes applied to the float model, in one table.

    Example::

        >>> from lowbit.cli import eval_cmd
        >>> rows = eval_cmd(None, ["w8a16", "w4a16-g64"], windows=4)       # doctest: +SKIP
    """
    import lowbit
    from lowbit.evaluate import evaluate, format_table

    quant, tok, ref = _model_and_reference(model, DTYPES[dtype], backend)
    models = {}
    if quant is not None:
        models[os.path.basename(os.path.normpath(model))] = quant
    if compare and ref is None:
        raise ValueError("--compare needs the float model; it is not available for this checkpoint")
    for r in compare:
        models[r] = lowbit.quantize_model(ref, r, backend=backend, inplace=False)
    rows = evaluate(models, tok, reference=ref, corpus=corpus, ctx=ctx, max_windows=windows, protocol=protocol,
                    speed=speed, progress=not as_json)
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        r0 = rows[0]
        print(f"corpus: {r0['corpus']} (sha256 {r0['corpus_sha256']}), {r0['windows']} windows of {ctx} tokens, "
              f"{r0['scored_tokens']} scored ({protocol} protocol)"
              + ("; speed: 512-token prefill, 64-token decode" if speed else ""))
        if "greedy_match" in r0:
            print(f"greedy: leading tokens identical to the float model's {r0['greedy_tokens']} greedy tokens "
                  "(one near-tie flips the rest, so top-1 and KL are the steadier measures)")
        print(format_table(rows))
    return rows


def generate_cmd(model: str | None, prompt: str, *, max_new_tokens: int = 128, sample: bool = False,
                 temperature: float = 0.7, top_k: int | None = None, top_p: float | None = 0.9,
                 seed: int | None = None, raw: bool = False, recipe: str | None = None,
                 dtype: str = "bfloat16", backend: str | None = None):
    """Generate text from a checkpoint or a float model (optionally quantized on the fly
    with ``recipe``), streaming tokens; prints prefill and decode tokens/s to stderr.

    Example::

        >>> from lowbit.cli import generate_cmd
        >>> generate_cmd(None, "What is the capital of France?", recipe="w4a16-g64")   # doctest: +SKIP
    """
    import lowbit
    from lowbit.evaluate import _prompt_ids

    m, tok = lowbit.load_model(model, dtype=DTYPES[dtype], backend=backend)
    if recipe:
        lowbit.quantize_model(m, recipe, backend=backend)
    ids = torch.tensor(tok(prompt).input_ids) if raw else _prompt_ids(tok, prompt)
    eos = _eos_ids(m, tok)
    printed = ""
    new: list[int] = []

    def show(t: int) -> None:  # decode the whole continuation: multi-token characters print whole
        nonlocal printed
        new.append(t)
        text = tok.decode(new, skip_special_tokens=True)
        print(text[len(printed):], end="", flush=True)
        printed = text

    g = lowbit.Runner(m).generate(ids, max_new_tokens, do_sample=sample, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed, eos_token_id=eos, on_token=show)
    print()
    _err(f"prompt {g.prompt_tokens} tokens: prefill {g.prefill_tokens_per_s:.0f} tok/s; "
         f"{len(g.tokens)} new tokens: decode {g.decode_tokens_per_s:.1f} tok/s")
    return g


def _eos_ids(model, tok) -> list[int]:
    """Token ids that end a generation: the generation config's, the tokenizer's, and
    the chat end-of-turn marker when the vocabulary has one."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    ids.append(tok.eos_token_id)
    vocab = tok.get_vocab()
    ids += [vocab[t] for t in ("<|im_end|>", "<|eot_id|>", "<|end|>") if t in vocab]
    return sorted({i for i in ids if isinstance(i, int)})


def info_cmd(path: str) -> dict:
    """Print what a checkpoint folder holds: recipe, schemes per module, sizes, versions.

    Example::

        >>> from lowbit.cli import info_cmd
        >>> info_cmd("smollm2-w4a16")                                    # doctest: +SKIP
    """
    from lowbit.models.checkpoint import WEIGHTS, read_metadata

    meta = read_metadata(path)
    size = os.path.getsize(os.path.join(path, WEIGHTS))
    counts = Counter((v["kind"], v["weight"], v["activation"]) for v in meta["modules"].values())
    print(f"lowbit checkpoint {path} (format {meta['format_version']}, written by lowbit {meta['lowbit_version']})")
    print(f"source model: {meta.get('source')}")
    print(f"recipe: {meta['recipe'].get('name')}  {json.dumps(meta['recipe'])}")
    print(f"float dtype: {meta['dtype']}; {WEIGHTS}: {size / 1e6:.1f} MB, {len(meta['sha256'])} tensors")
    for (kind, w, a), n in sorted(counts.items(), key=lambda kv: str(kv[0])):
        print(f"  {n:4d} {kind}s: weight {w}" + (f", activations {a}" if a else ""))
    return meta


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lowbit`` command."""
    from lowbit.recipe import PRESETS

    parser = argparse.ArgumentParser(prog="lowbit", description="low-bit quantized LLM inference "
                                     "(MODEL: a GGUF file, a Hugging Face folder or a lowbit checkpoint; "
                                     "default: the bundled SmolLM2-135M-Instruct)")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, model_help="GGUF file, Hugging Face folder or lowbit checkpoint (default: bundled model)"):
        p.add_argument("model", nargs="?", help=model_help)
        p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="float dtype (default float32)")
        p.add_argument("--backend", choices=["reference", "cpu", "triton"], help="kernel backend (default: fastest)")

    p = sub.add_parser("quantize", help="quantize a model with a recipe and save a checkpoint folder")
    common(p)
    p.add_argument("--recipe", required=True, help=f"preset ({', '.join(PRESETS)}) or a JSON/YAML recipe file")
    p.add_argument("-o", "--output", required=True, help="checkpoint folder to write")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")

    p = sub.add_parser("eval", help="perplexity, KL / top-1 / logit error vs the float model, greedy "
                                    "agreement, weight memory, prefill and decode speed")
    common(p)
    p.add_argument("--compare", nargs="*", default=[], metavar="RECIPE", help="recipes to apply to the float model")
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    p.add_argument("--corpus", help="UTF-8 text file (default: the Python language reference, offline)")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--windows", default="16", help="number of windows, or 'all' (default 16)")
    p.add_argument("--protocol", choices=["lowbit", "llama"], default="lowbit",
                   help="'llama': llama-perplexity's protocol (score the second half of each window)")
    p.add_argument("--no-speed", action="store_true", help="skip the prefill/decode timing")

    p = sub.add_parser("generate", help="generate text (greedy by default) with the fast runtime")
    p.add_argument("model", nargs="?", help="GGUF file, Hugging Face folder or lowbit checkpoint")
    p.add_argument("prompt", help="the prompt (wrapped in the chat template unless --raw)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                   help="activation dtype (default bfloat16: the fast kernels; float32 is float32-accurate)")
    p.add_argument("--backend", choices=["reference", "cpu", "triton"])
    p.add_argument("--recipe", help="quantize on the fly with this recipe (float models)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=128)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")

    p = sub.add_parser("info", help="what a lowbit checkpoint folder holds")
    p.add_argument("path", help="checkpoint folder")

    p = sub.add_parser("demo", help="quantize the linear weights of a model at several schemes "
                                    "and print the error table")
    p.add_argument("--model", help="GGUF file (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--schemes", help=f"comma-separated schemes (default: {','.join(DEMO_SCHEMES)})")
    p.add_argument("--limit", type=int, help="only the first N linear weights")
    # `lowbit generate "prompt"` (no model): argparse would take the prompt as the model
    if argv is None:
        argv = sys.argv[1:]
    if len(argv) >= 2 and argv[0] == "generate":
        pos = [a for a in argv[1:] if not a.startswith("-")]
        if len(pos) == 1 and not os.path.exists(pos[0]):
            argv = ["generate", "", *argv[1:]]
    args = parser.parse_args(argv)
    try:
        with torch.no_grad():
            if args.command == "demo":
                demo(args.model, args.schemes.split(",") if args.schemes else None, args.limit)
            elif args.command == "quantize":
                quantize_cmd(args.model, args.recipe, args.output, args.dtype, args.force, args.backend)
            elif args.command == "eval":
                windows = None if args.windows == "all" else int(args.windows)
                eval_cmd(args.model, args.compare, as_json=args.json, corpus=args.corpus, ctx=args.ctx,
                         windows=windows, protocol=args.protocol, speed=not args.no_speed, dtype=args.dtype,
                         backend=args.backend)
            elif args.command == "generate":
                generate_cmd(args.model or None, args.prompt, max_new_tokens=args.max_new_tokens, sample=args.sample,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                             raw=args.raw, recipe=args.recipe, dtype=args.dtype, backend=args.backend)
            elif args.command == "info":
                info_cmd(args.path)
    except (FileNotFoundError, FileExistsError, ValueError, TypeError) as e:
        print(f"lowbit {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
