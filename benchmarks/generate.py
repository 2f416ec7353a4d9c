"""Prefill and decode speed of the bundled SmolLM2-135M: lowbit's runtime at several
recipes next to transformers' generate and, when a build is present, llama.cpp's
llama-bench on the same model.

    python benchmarks/generate.py                    # 512-token prefill, 128-token decode
    python benchmarks/generate.py --rounds 3 --decode 64
    LLAMA_BENCH=/path/to/llama-bench python benchmarks/generate.py

Rows run in alternation (round 1: every row, round 2: every row, ...) and each row
reports its best round: this machine drifts by ~20% over minutes, and alternation
spreads the drift over all rows instead of favouring whichever ran first.  llama-bench
runs in every round too, before lowbit's rows, and reports its best repetition.

Quantized recipes are made from the model loaded in bfloat16 where the CPU has bf16 dot
products (AVX512-BF16 or AMX), as llama.cpp's quantized matmuls do not keep float32
activations either (they quantize them to 8 bits), and in float32 elsewhere, where bf16
arithmetic is emulated and slower (``--quantized-dtype`` chooses); the float32 rows are
the float model in float32.  llama.cpp decodes after as many tokens of context as
lowbit's rows (``llama-bench -d``).  Ratios are to the
faster of the two float models (lowbit runtime, float32 and bfloat16, each of prefill and
decode) and to llama.cpp's matching quantization.

Batched generation (``--batch 8 32``): each row generates ``--batch-tokens`` tokens for
each of B copies of one chat prompt (``Runner.generate`` with a list: one prefill of all
prompts, then one matmul per projection per step), timed as generated tokens over
prefill plus decode seconds.  With ``--vllm-python`` (a vLLM CPU venv's python, see
``benchmarks/vllm_serve.py``) vLLM serves the same model the same way in the same run,
from folders this script writes into ``--vllm-dir``: the float model, and the w8a8 and
w4a16-g64 recipes as compressed-tensors (``lowbit export``).  Each lowbit row's ratio is
to vLLM's row of the same class (float, W8A8, W4A16).

    python benchmarks/generate.py --batch 8 32 --vllm-python /work/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time

import numpy as np
import torch

import lowbit
from lowbit.evaluation import _prompt_ids, default_corpus
from lowbit.formats.compressed_tensors import export_compressed_tensors
from lowbit.runtime import Runner

# name, model dtype, recipe (None: float; "native": the bundled GGUF loaded natively), llama.cpp type it is
# compared with, Runner's act_compute
ROWS = [
    ("float32", torch.float32, None, "F32", None),
    ("bfloat16", torch.bfloat16, None, None, None),
    ("w8a16", torch.bfloat16, "w8a16", "Q8_0", None),
    ("w8a16-head8", torch.bfloat16, "w8a16-head8", "Q8_0", None),
    ("w4a16-g128", torch.bfloat16, "w4a16-g128", "Q4_0", None),
    ("w4a16-g64", torch.bfloat16, "w4a16-g64", "Q4_0", None),
    ("w4a16-g128-head8", torch.bfloat16, "w4a16-g128-head8", "Q4_0", None),
    ("w8a8", torch.bfloat16, "w8a8", "Q8_0", None),
    ("w4a8-g128", torch.bfloat16, "w4a8-g128", "Q4_0", None),
    ("w8a8-head8", torch.bfloat16, "w8a8-head8", "Q8_0", None),
    ("w4a8-g128-head8", torch.bfloat16, "w4a8-g128-head8", "Q4_0", None),
    # the bundled weights' own grid, GGUF Q4_1's form (q * s + m): the bundled file itself on llama.cpp
    ("q4_1", torch.bfloat16, "q4_1", "Q4_1", None),
    # GGUF Q8_0 / Q4_0's weights exactly (output projection Q8_0, as in llama.cpp's files), float activations
    ("q8_0", torch.bfloat16, "q8_0", "Q8_0", None),
    ("q4_0", torch.bfloat16, "q4_0", "Q4_0", None),
    # llama.cpp's own arithmetic: Q8_0 / Q4_0 weights (output projection Q8_0), int8 blocks of x
    ("q8_0-a8", torch.bfloat16, "q8_0-a8", "Q8_0", None),
    ("q4_0-a8", torch.bfloat16, "q4_0-a8", "Q4_0", None),
    # the same arithmetic on weight-only checkpoints: Runner(act_compute="int8")
    ("w8a16-head8 act int8", torch.bfloat16, "w8a16-head8", "Q8_0", "int8"),
    ("w4a16-g128-head8 act int8", torch.bfloat16, "w4a16-g128-head8", "Q4_0", "int8"),
    ("q4_1 act int8", torch.bfloat16, "q4_1", "Q4_1", "int8"),  # llama.cpp's Q4_1 x Q8_1 (the head stays float)
    # the bundled GGUF file itself, as llama.cpp runs it: its own Q4_1 linears and Q8_0 tied embedding / head
    ("gguf native", torch.bfloat16, "native", "Q4_1", None),
    ("gguf native act int8", torch.bfloat16, "native", "Q4_1", "int8"),
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


BATCH_PROMPT = "Explain in two sentences why the sky is blue."  # vllm_serve.py's default prompt
# the vLLM folder (recipe class) each lowbit row is compared with; vllm_rows writes the folders
VLLM_CLASS = {"float32": "float", "bfloat16": "float", "w8a8": "w8a8", "w4a16-g64": "w4a16-g64",
              "w4a16-g128-head8": "w4a16-g64", "w4a16-g128-head8 act int8": "w4a16-g64"}


def lowbit_batch_round(runner: Runner, prompt: torch.Tensor, batch: int, tokens: int) -> float:
    g = runner.generate([prompt] * batch, tokens)  # no end token: every sequence runs to the end
    return g.tokens_per_s


def vllm_rows(python: str, folder: str, model, tok, batches: list[int], tokens: int, dtype: str) -> dict:
    """{class: {batch: tok/s}} from benchmarks/vllm_serve.py run by the vLLM venv's
    python on the float model and its w8a8 / w4a16-g64 compressed-tensors exports
    (written into ``folder`` once), or an error string per class."""
    os.makedirs(folder, exist_ok=True)
    dirs = {name: os.path.join(folder, name) for name in ("float", "w8a8", "w4a16-g64")}
    if not os.path.isdir(dirs["float"]):
        model.save_pretrained(dirs["float"] + ".tmp")
        tok.save_pretrained(dirs["float"] + ".tmp")
        os.replace(dirs["float"] + ".tmp", dirs["float"])
    for recipe in ("w8a8", "w4a16-g64"):
        if not os.path.isdir(dirs[recipe]):
            q = lowbit.quantize_model(model, recipe, inplace=False)
            export_compressed_tensors(q, tok, dirs[recipe])
    out_json = os.path.join(folder, "vllm.json")
    cmd = [python, os.path.join(os.path.dirname(__file__), "vllm_serve.py"), "--threads",
           str(torch.get_num_threads()), "--dtype", dtype, "--tokens", str(tokens), "--prompt", BATCH_PROMPT,
           "--batch", *map(str, batches), "--json", out_json, *dirs.values()]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if res.returncode or not os.path.exists(out_json):
        print(f"vllm_serve.py failed: {res.stderr.strip()[-500:]}")
        return {}
    with open(out_json) as f:
        table = json.load(f)
    names = {path: name for name, path in dirs.items()}
    return {names[r["model"]]: ({int(b): v for b, v in r["tok_s"].items()}, r["error"]) for r in table}


def llama_bench(binary: str, gguf_dir: str, prefill: int, decode: int) -> dict[str, tuple[float, float]]:
    """tokens/s (prefill, decode) per llama.cpp type from llama-bench, for the GGUF files
    named SmolLM2-135M-Instruct.<TYPE>.gguf in gguf_dir (plus the bundled Q4_1): prefill of
    ``prefill`` tokens from an empty context, and decode of ``decode`` tokens after
    ``prefill`` tokens of context (``-d``), as lowbit's rows decode after their prompt.
    The best of llama-bench's 2 repetitions (lowbit's rows report their best round too);
    main() calls it once per round, between lowbit's rows, so that both sides see the same
    drift of the machine."""
    files = {m.group(1): os.path.join(gguf_dir, f) for f in sorted(os.listdir(gguf_dir))
             if (m := re.match(r"SmolLM2-135M-Instruct\.(\w+)\.gguf$", f))}
    files.setdefault("Q4_1", str(lowbit.models.bundled_model_path()))
    out = {}
    for kind, path in files.items():
        tps = {}
        for what, extra in (("prefill", ["-p", str(prefill), "-n", "0"]),
                            ("decode", ["-p", "0", "-n", str(decode), "-d", str(prefill)])):
            res = subprocess.run([binary, "-m", path, *extra, "-t", str(torch.get_num_threads()), "-r", "2",
                                  "-o", "json"], capture_output=True, text=True)
            if res.returncode:
                why = f"killed by signal {-res.returncode}" if res.returncode < 0 else f"exit status {res.returncode}"
                print(f"llama-bench failed on {path} ({why}): {res.stderr.strip()[-300:]}")
                continue
            tps[what] = max(json.loads(res.stdout)[-1]["samples_ts"])
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
    ap.add_argument("--batch", type=int, nargs="*", default=[],
                    help="batched generation rows at these numbers of prompts (default: none)")
    ap.add_argument("--batch-tokens", type=int, default=64, help="tokens generated per prompt in a batch")
    ap.add_argument("--vllm-python", help="python of a vLLM CPU venv: vLLM rows next to the batched ones")
    ap.add_argument("--vllm-dir", default="benchmarks/.vllm", help="where the vLLM model folders are written")
    args = ap.parse_args()
    if any(b < 1 for b in args.batch) or args.batch_tokens < 1:
        ap.error("--batch sizes and --batch-tokens must be >= 1")
    names = [name for name, *_ in ROWS]
    unknown = [r for r in args.rows or [] if r not in names]
    if unknown:
        ap.error(f"--rows: no row named {', '.join(map(repr, unknown))}; the rows are {', '.join(names)}")

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; bundled SmolLM2-135M-Instruct")
    models = {dt: lowbit.load_model(dtype=dt) for dt in (torch.float32, torch.bfloat16)}
    tok = models[torch.float32][1]
    text, _ = default_corpus()
    prompt = torch.tensor(tok(text).input_ids[: args.prefill])
    runners = {}
    if args.quantized_dtype == "auto":
        args.quantized_dtype = "bfloat16" if lowbit.kernels.cpu.has_bf16_dot() else "float32"
    qdt = getattr(torch, args.quantized_dtype)
    for name, dt, recipe, _, act in ROWS:
        if args.rows and name not in args.rows:
            continue
        m = models[dt if recipe is None else qdt][0]
        if recipe == "native":  # load_model(gguf="native"): the file's own tensors, no float copy
            q = lowbit.load_model(gguf="native", dtype=qdt, progress=False)[0]
        else:
            q = m if recipe is None else lowbit.quantize_model(m, recipe, inplace=False)
        runners[name] = Runner(q, act_compute=act)
        runners[name].generate(prompt[:16], 4)  # warm-up
    hf = {} if args.no_transformers else {"transformers float32": models[torch.float32][0],
                                          "transformers bfloat16": models[torch.bfloat16][0]}
    run_llama = bool(args.llama_bench) and os.path.isdir(args.gguf_dir)
    if args.llama_bench and not run_llama:
        print(f"(no {args.gguf_dir}: llama-bench rows skipped)")
    best: dict[str, list[float]] = {}
    llama: dict[str, tuple[float, float]] = {}
    for rnd in range(args.rounds):
        if run_llama:
            for kind, (p, d) in llama_bench(args.llama_bench, args.gguf_dir, args.prefill, args.decode).items():
                lp, ld = llama.get(kind, (float("nan"), float("nan")))
                llama[kind] = (float(np.fmax(lp, p)), float(np.fmax(ld, d)))  # fmax skips a failed run's nan
        for name, r in runners.items():
            p, d = lowbit_round(r, prompt, args.decode)
            b = best.setdefault(name, [0.0, 0.0])
            b[0], b[1] = max(b[0], p), max(b[1], d)
        for name, m in hf.items():
            p, d = transformers_round(m, prompt, min(args.decode, 32))
            b = best.setdefault(name, [0.0, 0.0])
            b[0], b[1] = max(b[0], p), max(b[1], d)
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    batched: dict[str, dict[int, float]] = {}
    if args.batch:
        chat = _prompt_ids(tok, BATCH_PROMPT)
        for rnd in range(args.rounds):
            for b in args.batch:
                for name, r in runners.items():
                    row = batched.setdefault(name, {})
                    row[b] = max(row.get(b, 0.0), lowbit_batch_round(r, chat, b, args.batch_tokens))
            print(f"batch round {rnd + 1}/{args.rounds} done", flush=True)
    vllm = {}
    if args.batch and args.vllm_python:
        vllm = vllm_rows(args.vllm_python, args.vllm_dir, models[torch.float32][0], tok, args.batch,
                         args.batch_tokens, args.quantized_dtype)


    floats = [best[n] for n in ("float32", "bfloat16") if n in best] or [(float("nan"), float("nan"))]
    base_p, base_d = max(f[0] for f in floats), max(f[1] for f in floats)
    print()
    print(f"prefill {args.prefill} tokens, decode {args.decode} tokens; best of {args.rounds} alternating rounds; "
          f"quantized rows from the {args.quantized_dtype} model")
    head = (f"{'row':<27}{'prefill tok/s':>14}{'decode tok/s':>13}{'prefill/float':>14}{'decode/float':>13}"
            f"{'llama.cpp':>11}{'prefill/llama':>14}{'decode/llama':>13}")
    print(head)
    print("-" * len(head))
    kinds = {name: kind for name, _, _, kind, _ in ROWS}
    for name, (p, d) in best.items():
        kind = kinds.get(name)
        lp, ld = llama.get(kind, (float("nan"), float("nan"))) if kind else (float("nan"), float("nan"))
        print(f"{name:<27}{p:>14.0f}{d:>13.1f}{p / base_p:>14.2f}{d / base_d:>13.2f}"
              f"{kind or '':>11}{p / lp:>14.2f}{d / ld:>13.2f}")
    for kind, (p, d) in llama.items():
        print(f"{'llama.cpp ' + kind:<27}{p:>14.0f}{d:>13.1f}{p / base_p:>14.2f}{d / base_d:>13.2f}")

    if batched:
        print_batched(batched, vllm, args)


def print_batched(batched: dict, vllm: dict, args) -> None:
    print()
    print(f"batched generation: {args.batch_tokens} tokens per prompt, aggregate generated tok/s (prefill "
          f"included); best of {args.rounds} rounds; vLLM {args.quantized_dtype}: one timed run after a "
          "warm-up")
    head = f"{'row':<27}" + "".join(f"{f'B={b} tok/s':>13}{'/float':>8}{'/vLLM':>8}" for b in args.batch)
    print(head)
    print("-" * len(head))
    nan = float("nan")
    # the faster of lowbit's float32 and bfloat16 models at each batch size, as the table above
    floats = [batched[n] for n in ("float32", "bfloat16") if n in batched]
    base = {b: max(f[b] for f in floats) for b in args.batch} if floats else {}
    for name, row in batched.items():
        cls = vllm.get(VLLM_CLASS.get(name), ({}, None))[0]
        print(f"{name:<27}" + "".join(f"{row[b]:>13.1f}{row[b] / base.get(b, nan):>8.2f}{row[b] / cls.get(b, nan):>8.2f}"
                                      for b in args.batch))
    for name, (row, error) in vllm.items():
        print(f"{'vLLM ' + name:<27}" + "".join(f"{row.get(b, nan):>13.1f}{row.get(b, nan) / base.get(b, nan):>8.2f}"
                                                f"{'':>8}" for b in args.batch))
        if error:
            print(f"  vLLM {name}: {error[:200]}")


if __name__ == "__main__":
    main()
