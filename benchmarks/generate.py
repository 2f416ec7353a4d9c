"""Prefill and decode speed of the bundled SmolLM2-135M: lowbit's runtime at several
recipes next to transformers' generate and, when a build is present, llama.cpp's
llama-bench on the same model.

    python benchmarks/generate.py                    # 512-token prefill, 128-token decode
    python benchmarks/generate.py --rounds 3 --decode 64
    LLAMA_BENCH=/path/to/llama-bench python benchmarks/generate.py

Rows run in alternation (round 1: every row, round 2: every row, ...) and each row
reports its best round: this machine drifts by ~20% over minutes, and alternation
spreads the drift over all rows instead of favouring whichever ran first.

Quantized recipes are made from the model loaded in bfloat16 where the CPU has bf16 dot
products (AVX512-BF16 or AMX), as llama.cpp's quantized matmuls do not keep float32
activations either (they quantize them to 8 bits), and in float32 elsewhere, where bf16
arithmetic is emulated and slower (``--quantized-dtype`` chooses); the float32 rows are
the float model in float32.  llama.cpp decodes after as many tokens of context as
lowbit's rows (``llama-bench -d``).  Ratios are to the
faster of the two float models (lowbit runtime, float32 and bfloat16, each of prefill and
decode) and to llama.cpp's matching quantization.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import time

import torch

import lowbit
from lowbit.evaluation import default_corpus
from lowbit.runtime import Runner

# name, model dtype, recipe (None: float), llama.cpp type it is compared with
ROWS = [
    ("float32", torch.float32, None, "F32"),
    ("bfloat16", torch.bfloat16, None, None),
    ("w8a16", torch.bfloat16, "w8a16", "Q8_0"),
    ("w8a16-head8", torch.bfloat16, "w8a16-head8", "Q8_0"),
    ("w4a16-g64", torch.bfloat16, "w4a16-g64", "Q4_0"),
    ("w4a16-g128-head8", torch.bfloat16, "w4a16-g128-head8", "Q4_0"),
    ("w8a8", torch.bfloat16, "w8a8", "Q8_0"),
    ("w4a8-g128", torch.bfloat16, "w4a8-g128", "Q4_0"),
    # llama.cpp's own arithmetic: Q8_0 / Q4_0 weights (output projection Q8_0), int8 blocks of x
    ("q8_0-a8", torch.bfloat16, "q8_0-a8", "Q8_0"),
    ("q4_0-a8", torch.bfloat16, "q4_0-a8", "Q4_0"),
]


def lowbit_round(runner: Runner, prompt: torch.Tensor, decode: int) -> tuple[float, float]:
    g = runner.generate(prompt, decode + 1)  # the first new token comes from the prefill
    return g.prefill_tokens_per_s, g.decode_tokens_per_s


@torch.inference_mode()
def transformers_round(model, prompt: torch.Tensor, decode: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    model(prompt[None])
    prefill = prompt.numel() / (time.perf_counter() - t0)
    short = prompt[:8][None]
    t0 = time.perf_counter()
    out = model.generate(short, max_new_tokens=decode, min_new_tokens=decode, do_sample=False)
    steps = out.shape[1] - short.shape[1]
    return prefill, steps / (time.perf_counter() - t0)


def llama_bench(binary: str, gguf_dir: str, prefill: int, decode: int) -> dict[str, tuple[float, float]]:
    """tokens/s (prefill, decode) per llama.cpp type from llama-bench, for the GGUF files
    named SmolLM2-135M-Instruct.<TYPE>.gguf in gguf_dir (plus the bundled Q4_1): prefill of
    ``prefill`` tokens from an empty context, and decode of ``decode`` tokens after
    ``prefill`` tokens of context (``-d``), as lowbit's rows decode after their prompt."""
    files = {m.group(1): os.path.join(gguf_dir, f) for f in sorted(os.listdir(gguf_dir))
             if (m := re.match(r"SmolLM2-135M-Instruct\.(\w+)\.gguf$", f))}
    files.setdefault("Q4_1", str(lowbit.models.bundled_model_path()))
    out = {}
    for kind, path in files.items():
        tps = {}
        for what, extra in (("prefill", ["-p", str(prefill), "-n", "0"]),
                            ("decode", ["-p", "0", "-n", str(decode), "-d", str(prefill)])):
            res = subprocess.run([binary, "-m", path, *extra, "-t", str(torch.get_num_threads()), "-o", "csv"],
                                 capture_output=True, text=True)
            if res.returncode:
                print(f"llama-bench failed on {path}: {res.stderr.strip()[-300:]}")
                continue
            rows = [line.split(",") for line in res.stdout.strip().splitlines()]
            head = [h.strip('"') for h in rows[0]]
            tps[what] = float(dict(zip(head, (c.strip('"') for c in rows[-1])))["avg_ts"])
        out[kind] = (tps.get("prefill", float("nan")), tps.get("decode", float("nan")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--quantized-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="dtype of the model the quantized rows are made from (activations, attention, norms)")
    ap.add_argument("--rows", nargs="*", help="run only these rows (names of the first column)")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench"),
                    help="llama-bench binary (default: $LLAMA_BENCH or on PATH)")
    ap.add_argument("--gguf-dir", default=os.environ.get("LLAMA_GGUF_DIR", "benchmarks/.llama.cpp/gguf"),
                    help="folder with SmolLM2-135M-Instruct.<TYPE>.gguf files for llama-bench")
    args = ap.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; bundled SmolLM2-135M-Instruct")
    models = {dt: lowbit.load_model(dtype=dt) for dt in (torch.float32, torch.bfloat16)}
    tok = models[torch.float32][1]
    text, _ = default_corpus()
    prompt = torch.tensor(tok(text).input_ids[: args.prefill])
    runners = {}
    if args.quantized_dtype == "auto":
        flags = lowbit.kernels.cpu.features()["machine"]
        args.quantized_dtype = "bfloat16" if {"avx512_bf16", "amx_tile"} & set(flags) else "float32"
    qdt = getattr(torch, args.quantized_dtype)
    for name, dt, recipe, _ in ROWS:
        if args.rows and name not in args.rows:
            continue
        m = models[dt if recipe is None else qdt][0]
        runners[name] = Runner(m if recipe is None else lowbit.quantize_model(m, recipe, inplace=False))
        runners[name].generate(prompt[:16], 4)  # warm-up
    hf = {} if args.no_transformers else {"transformers float32": models[torch.float32][0],
                                          "transformers bfloat16": models[torch.bfloat16][0]}
    best: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for name, r in runners.items():
            p, d = lowbit_round(r, prompt, args.decode)
            b = best.setdefault(name, [0.0, 0.0])
            b[0], b[1] = max(b[0], p), max(b[1], d)
        for name, m in hf.items():
            p, d = transformers_round(m, prompt, min(args.decode, 32))
            b = best.setdefault(name, [0.0, 0.0])
            b[0], b[1] = max(b[0], p), max(b[1], d)
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)

    llama = {}
    if args.llama_bench and os.path.isdir(args.gguf_dir):
        llama = llama_bench(args.llama_bench, args.gguf_dir, args.prefill, args.decode)
    elif args.llama_bench:
        print(f"(no {args.gguf_dir}: llama-bench rows skipped)")

    floats = [best[n] for n in ("float32", "bfloat16") if n in best] or [(float("nan"), float("nan"))]
    base_p, base_d = max(f[0] for f in floats), max(f[1] for f in floats)
    print()
    print(f"prefill {args.prefill} tokens, decode {args.decode} tokens; best of {args.rounds} alternating rounds; "
          f"quantized rows from the {args.quantized_dtype} model")
    head = (f"{'row':<24}{'prefill tok/s':>14}{'decode tok/s':>13}{'prefill/float':>14}{'decode/float':>13}"
            f"{'llama.cpp':>11}{'prefill/llama':>14}{'decode/llama':>13}")
    print(head)
    print("-" * len(head))
    kinds = {name: kind for name, _, _, kind in ROWS}
    for name, (p, d) in best.items():
        kind = kinds.get(name)
        lp, ld = llama.get(kind, (float("nan"), float("nan"))) if kind else (float("nan"), float("nan"))
        print(f"{name:<24}{p:>14.0f}{d:>13.1f}{p / base_p:>14.2f}{d / base_d:>13.2f}"
              f"{kind or '':>11}{p / lp:>14.2f}{d / ld:>13.2f}")
    for kind, (p, d) in llama.items():
        print(f"{'llama.cpp ' + kind:<24}{p:>14.0f}{d:>13.1f}{p / base_p:>14.2f}{d / base_d:>13.2f}")


if __name__ == "__main__":
    main()
