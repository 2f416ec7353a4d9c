"""GGUF side by side: lowbit's ggml dequantization against the gguf package's, and
lowbit's GGUF exports run by llama.cpp against the same models run by lowbit.

    HF_HUB_OFFLINE=1 python benchmarks/gguf_bench.py [--windows 16] [--rounds 3] [--no-llama]

Part 1 (always): every tensor type of the bundled model plus random Q4_0/Q5_1/Q4_K/Q6_K
tensors at its ffn shape, dequantized by ``gguf.quants.dequantize`` (numpy) and by
``lowbit.formats.ggml.dequantize`` (torch), alternating, best of ``--rounds``; prints
each one's time and the ratio.

Part 2 (needs ``pip install llama-cpp-python``, the optional extra ``lowbit[llama]``):
the bundled model quantized by lowbit with schemes that map onto ggml types exactly
(int4-sym-g32-f16 -> Q4_0, int8-sym-g32-f16 -> Q8_0) and the ``q4_1`` recipe (Q4_1
with float16-rounded mins), and the float model exported as ``--type q4_k`` / ``q6_k``
(K-quants where rows are whole super-blocks, llama.cpp's fallback types elsewhere), each
written by ``export_gguf`` and loaded by ``llama_cpp.Llama``; lowbit runs the quantized
model, or for the K-quant rows the exported file loaded with ``gguf="native"``:

- perplexity with llama.cpp's protocol on lowbit's default corpus: the *same token
  windows* (lowbit's tokenizer; llama.cpp's own tokenization of the first window is
  checked equal) scored by llama.cpp (``logits_all``) and by ``lowbit.evaluate(...,
  protocol="llama")``, and their relative difference (target: within 0.5%);
- a greedy chat answer from each through the GGUF's chat template;
- prefill (512 tokens) and decode (64 tokens) tokens/s: llama.cpp on the export, lowbit's
  runtime on the quantized model, both at ``--threads``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

# (lowbit recipe, or None for the float model, and the --type of the export, None: per scheme)
EXPORTS = [("int4-sym-g32-f16", None), ("int8-sym-g32-f16", None), ("q4_1", None), (None, "Q4_K"), (None, "Q6_K")]
QUESTION = "What is the capital of France?"


def dequant_speed(rounds: int) -> None:
    import gguf

    from lowbit.formats import ggml
    from lowbit.formats.gguf_file import read_gguf

    cases = {}
    for t in read_gguf().tensors:
        if t.tensor_type.name not in cases or t.n_elements > cases[t.tensor_type.name][2]:
            shape = [int(n) for n in reversed(t.shape)]
            cases[t.tensor_type.name] = (np.asarray(t.data).view(np.uint8).reshape(-1), shape, int(t.n_elements))
    rng = np.random.default_rng(0)
    for name in ("Q4_0", "Q5_1", "Q4_K", "Q6_K"):
        shape = [1536, 576 if name.endswith("_0") or name.endswith("_1") else 768]
        raw = ggml.quantize(torch.randn(shape), name).numpy().reshape(-1) if name in ggml.QUANTIZABLE else \
            rng.integers(0, 256, ggml.nbytes(name, shape), dtype=np.uint8)
        if name in ("Q4_K", "Q6_K"):  # finite scales: random bytes make NaN d's
            blocks = raw.reshape(-1, ggml.block_type(name).type_size)
            at = 208 if name == "Q6_K" else 0
            blocks[:, at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        cases.setdefault(name, (raw, shape, int(np.prod(shape))))
    print(f"{'type':6} {'shape':>14} {'gguf (numpy) ms':>16} {'lowbit ms':>10} {'speed-up':>9}")
    for name, (raw, shape, _) in cases.items():
        qtype = gguf.GGMLQuantizationType[name]
        traw = torch.from_numpy(raw.copy())
        best = {"gguf": math.inf, "lowbit": math.inf}
        for _ in range(rounds):
            for who in ("gguf", "lowbit"):
                t0 = time.perf_counter()
                if who == "gguf":
                    gguf.quants.dequantize(raw, qtype)
                else:
                    ggml.dequantize(traw, name, shape)
                best[who] = min(best[who], time.perf_counter() - t0)
        print(f"{name:6} {str(shape):>14} {best['gguf'] * 1e3:16.2f} {best['lowbit'] * 1e3:10.2f} "
              f"{best['gguf'] / best['lowbit']:8.2f}x")


def llama_cpp_perplexity(llm, windows: list[torch.Tensor], first: int) -> float:
    """Perplexity of llama.cpp's logits over token windows, scoring the logits from
    index ``first`` on (lowbit's ``windows(..., protocol="llama")``)."""
    nll, count = 0.0, 0
    for w in windows:
        ids = w.tolist()
        llm.reset()
        llm.eval(ids)
        logits = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
        logp = torch.log_softmax(logits[first:-1].double(), dim=-1)
        target = w[first + 1:]
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += target.numel()
    return math.exp(nll / count)


def llama_cpp_speed(llm, prompt: list[int], decode: int) -> tuple[float, float]:
    """(prefill tokens/s over ``prompt``, greedy decode tokens/s over ``decode`` steps)."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    for _ in range(decode):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([tok])
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), decode / (t2 - t1)


def chat(llm) -> str:
    out = llm.create_chat_completion(messages=[{"role": "user", "content": QUESTION}], max_tokens=32,
                                     temperature=0.0)
    return out["choices"][0]["message"]["content"]


def llama_rows(n_windows: int, threads: int) -> None:
    import llama_cpp

    import lowbit
    from lowbit.evaluation import default_corpus, evaluate, measure_speed, windows
    from lowbit.formats.gguf_export import export_gguf
    from lowbit.runtime import Runner

    model, tok = lowbit.load_model(progress=False)
    text, _ = default_corpus()
    wins, first = windows(tok, text, 512, n_windows, "llama")
    prompt = torch.cat(wins)[:512]
    tmp = Path(tempfile.mkdtemp(prefix="lowbit-gguf-bench-"))
    rows = []
    for recipe, type in EXPORTS:
        scheme = recipe or f"float -> {type}"
        q = model
        if recipe is not None:
            q = lowbit.quantize_model(model, recipe if recipe in lowbit.RECIPE_PRESETS else lowbit.Recipe(weight=recipe),
                                      inplace=False)
        path = tmp / f"{recipe or type}.gguf"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = export_gguf(q, tok, path, type=type)
        if type is not None:  # lowbit runs the file's own K-quant (and fallback) weights
            os.environ["LOWBIT_CACHE"] = str(tmp / "cache")  # the file's tokenizer entry goes there
            q, _ = lowbit.load_model(path, gguf="native")
        exact = sum(t.exact for t in out.tensors)
        ours = evaluate({scheme: q}, tok, max_windows=n_windows, protocol="llama", speed=False)[0]["perplexity"]
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_threads=threads, logits_all=True,
                              verbose=False)
        same_tokens = llm.tokenize(tok.decode(wins[0]).encode(), add_bos=False, special=False) == wins[0].tolist()
        theirs = llama_cpp_perplexity(llm, wins, first)
        lp, ld = llama_cpp_speed(llm, prompt.tolist(), 64)
        answer = chat(llm)
        speed = measure_speed(q, prompt, 64, repeats=2)
        ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                      return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        tokens = Runner(q).generate(ids.reshape(-1), 32).tokens
        end = tok.convert_tokens_to_ids("<|im_end|>")
        lowbit_answer = tok.decode(tokens[:tokens.index(end)] if end in tokens else tokens)
        rows.append((scheme, out, exact, ours, theirs, same_tokens, lp, ld, speed, answer, lowbit_answer))
        del llm
    shutil.rmtree(tmp)  # the folder this run made: its exports and their tokenizer cache
    print(f"\nllama.cpp {llama_cpp.__version__} on lowbit's exports, {n_windows} windows of 512 tokens, "
          f"llama protocol, {threads} threads")
    print(f"{'lowbit scheme':18} {'gguf':11} {'exact':>8} {'bpw':>6} {'ppl lowbit':>11} {'ppl llama.cpp':>14} "
          f"{'diff':>7} {'tok ok':>6} {'prefill l.cpp/lowbit':>21} {'decode l.cpp/lowbit':>20}")
    for scheme, out, exact, ours, theirs, same, lp, ld, speed, _, _ in rows:
        typ = "+".join(sorted({t.ggml_type for t in out.tensors if t.name.startswith("blk.") and
                               not t.name.endswith("norm.weight")}))
        print(f"{scheme:18} {typ:11} {exact:4}/{len(out.tensors):<3} {out.bits_per_weight:6.2f} {ours:11.3f} "
              f"{theirs:14.3f} {100 * (theirs / ours - 1):+6.2f}% {str(same):>6} "
              f"{lp:7.0f}/{speed['prefill_tokens_per_s']:<7.0f}={lp / speed['prefill_tokens_per_s']:4.2f}x "
              f"{ld:6.1f}/{speed['decode_tokens_per_s']:<6.1f}={ld / speed['decode_tokens_per_s']:4.2f}x")
    for scheme, *_, answer, lowbit_answer in rows:
        print(f"\n{scheme}: {QUESTION}\n  llama.cpp: {answer!r}\n  lowbit:    {lowbit_answer!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-llama", action="store_true", help="only the dequantization speed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dequant_speed(args.rounds)
    if args.no_llama:
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("\nllama-cpp-python is not installed (pip install 'lowbit[llama]'): skipping the llama.cpp rows")
        return
    llama_rows(args.windows, args.threads)


if __name__ == "__main__":
    main()
