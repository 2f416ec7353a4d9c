"""Whether streaming quantization keeps its memory flat as the model grows: wall time and
peak resident memory of ``lowbit.models.stream.quantize_streaming`` on synthetic Llama
checkpoints of 2, 8 and 32 decoder layers in Llama-2-7B shapes.

The checkpoints are Hugging Face Llama folders (``config.json``, one safetensors shard
per decoder layer plus one for ``embed_tokens`` and one for ``norm`` / ``lm_head``,
``model.safetensors.index.json``) with random bfloat16 weights (normal, std 0.02; norms
about 1).  They are written one shard at a time, each shard's tensors generated just
before it is written, so the writer holds about one layer; each is written under a
temporary name and renamed when complete, and cached in ``--workdir`` keyed by layer
count and shapes (the 32-layer one is about 13 GB; 2 + 8 + 32 layers need about 20 GB of
disk, plus the quantized output of one row at a time).

Each (method, layers) row runs in its own process (``--worker``), which generates the
calibration token ids (seeded, uniform over the vocabulary) when the recipe needs them,
calls ``quantize_streaming`` and reports the call's seconds and its process's peak RSS
(``ru_maxrss``, which counts the memory-mapped shard pages it touched).  The quantized
output is measured, then deleted.  Flat memory means the peak RSS ratio between the
largest and the smallest layer count is about 1.0 (the rows also show the RSS before the
call: torch, lowbit and the calibration ids).  The first row on a freshly written
checkpoint reads it from a warm page cache; later rows may not, when RAM is short.

Heavy (minutes per row, ~20 GB of disk at the default shapes): never run in CI.

Usage::

    python benchmarks/streaming.py                               # rtn and gptq at 2, 8, 32 layers
    python benchmarks/streaming.py --methods rtn --layers 2 8 --threads 8 --json out.json
    python benchmarks/streaming.py --methods gptq w4a16-g128:awq --calib-samples 8 --calib-len 256
    python benchmarks/streaming.py --hidden 64 --intermediate 128 --heads 4 --vocab 256 --layers 2 \\
        --workdir /tmp/bench-streaming                           # tiny shapes: a quick check
    python benchmarks/streaming.py --methods                     # only write (cache) the checkpoints
    python benchmarks/streaming.py --clean --methods             # only remove the cached checkpoints
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# method name -> lowbit recipe; any other --methods value is taken as a recipe name itself
METHODS = {"rtn": "w4a16-g128", "gptq": "w4a16-g128:gptq", "awq": "w4a16-g128:awq"}
MARKER = "lowbit_synthetic.json"  # in every checkpoint folder this script wrote (what --clean removes)
WEIGHT_SEED = 0
GB = 1e9


# ---------------------------------------------------------------------------------------------
# synthetic checkpoints


def shapes_key(s: dict) -> str:
    return f"h{s['hidden']}-i{s['intermediate']}-a{s['heads']}-kv{s['kv_heads']}-v{s['vocab']}"


def checkpoint_name(layers: int, s: dict) -> str:
    return f"llama-{layers}L-{shapes_key(s)}"


def llama_config(layers: int, s: dict) -> dict:
    """config.json of a Llama-2-7B-like model (shapes overridable)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": layers,
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["hidden"] // s["heads"],
        "vocab_size": s["vocab"],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def layer_shapes(i: int, s: dict) -> dict[str, tuple[int, ...]]:
    h, inter, hd = s["hidden"], s["intermediate"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * hd
    p = f"model.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": (h, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, h),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }


def shard_plan(layers: int, s: dict) -> list[dict[str, tuple[int, ...]]]:
    """Tensor name -> shape, one dict per shard: embed_tokens, each decoder layer, norm + lm_head."""
    h, v = s["hidden"], s["vocab"]
    return ([{"model.embed_tokens.weight": (v, h)}] + [layer_shapes(i, s) for i in range(layers)]
            + [{"model.norm.weight": (h,), "lm_head.weight": (v, h)}])


def checkpoint_bytes(layers: int, s: dict) -> int:
    n = 0
    for shard in shard_plan(layers, s):
        for shape in shard.values():
            size = 1
            for d in shape:
                size *= d
            n += 2 * size  # bfloat16
    return n


def _random_tensor(name: str, shape: tuple[int, ...], gen):
    import torch

    t = torch.randn(shape, generator=gen, dtype=torch.bfloat16)
    if len(shape) == 1:  # RMSNorm weights: about 1
        return t.mul_(0.05).add_(1.0)
    return t.mul_(0.02)


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer over ``vocab`` made-up words (``<unk>``, ``<s>``, ``</s>``, ``w3``, ...),
    so that transformers' and lowbit's loaders find one; the benchmark itself uses random ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "model_max_length": 4096}, f, indent=2)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_complete(folder: Path) -> bool:
    index = folder / "model.safetensors.index.json"
    if not ((folder / MARKER).is_file() and (folder / "config.json").is_file() and index.is_file()):
        return False
    with open(index) as f:
        shards = set(json.load(f)["weight_map"].values())
    return all((folder / name).is_file() for name in shards)


def write_checkpoint(workdir: Path, layers: int, s: dict) -> Path:
    """The cached synthetic checkpoint of ``layers`` layers, written (shard by shard,
    under a temporary name renamed at the end) when it is not there yet."""
    import torch
    from safetensors.torch import save_file

    name = checkpoint_name(layers, s)
    final = workdir / name
    if final.exists():
        if _is_complete(final):
            return final
        raise SystemExit(f"{final} exists but is not a complete checkpoint written by this script "
                         f"(no {MARKER} or missing shards); remove it yourself")
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in workdir.glob(f".{name}.tmp-*"):  # left by a crashed writer
        pid = stale.name.rpartition("-")[2]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale)
    need = checkpoint_bytes(layers, s)
    free = shutil.disk_usage(workdir).free
    if need > free:
        raise SystemExit(f"{name} needs {need / GB:.1f} GB, {workdir} has {free / GB:.1f} GB free")
    tmp = workdir / f".{name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        plan = shard_plan(layers, s)
        weight_map, total = {}, 0
        t0 = time.perf_counter()
        for k, shard in enumerate(plan):
            file = f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
            gen = torch.Generator().manual_seed(WEIGHT_SEED * 100003 + k)
            tensors = {n: _random_tensor(n, shape, gen) for n, shape in shard.items()}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            for n, t in tensors.items():
                weight_map[n] = file
                total += t.numel() * t.element_size()
            del tensors
            print(f"\r  writing {name}: shard {k + 1}/{len(plan)}, {time.perf_counter() - t0:.0f} s",
                  end="", file=sys.stderr, flush=True)
        print(file=sys.stderr, flush=True)
        with open(tmp / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(tmp / "config.json", "w") as f:
            json.dump(llama_config(layers, s), f, indent=2)
        with open(tmp / "generation_config.json", "w") as f:
            json.dump({"bos_token_id": 1, "eos_token_id": 2}, f, indent=2)
        write_tokenizer(tmp, s["vocab"])
        with open(tmp / MARKER, "w") as f:  # last: what marks the folder as complete and ours
            json.dump({"written_by": "benchmarks/streaming.py", "layers": layers, "shapes": s,
                       "weight_seed": WEIGHT_SEED, "bytes": total}, f, indent=2)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def clean(workdir: Path) -> list[Path]:
    """Remove the synthetic checkpoints this script wrote in ``workdir`` (and its dead
    temporaries); nothing else."""
    removed = []
    if not workdir.is_dir():
        return removed
    for p in sorted(workdir.iterdir()):
        ours = p.is_dir() and p.name.startswith("llama-") and (p / MARKER).is_file()
        if p.is_dir() and p.name.startswith(".llama-") and ".tmp-" in p.name:
            pid = p.name.rpartition("-")[2]
            ours = pid.isdigit() and not _pid_alive(int(pid))
        if ours:
            shutil.rmtree(p)
            removed.append(p)
    return removed


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


# ---------------------------------------------------------------------------------------------
# measurement


def worker(src: str, out: str, recipe: str, calib_samples: int, calib_len: int, threads: int | None,
           seed: int, dtype: str = "float32") -> dict:
    """Quantize ``src`` into ``out`` in this process; seconds and peak RSS."""
    import torch

    import lowbit
    from lowbit.models.stream import quantize_streaming

    if threads:
        torch.set_num_threads(threads)
    with open(Path(src) / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    calibration = None
    if lowbit.Recipe.get(recipe).needs_calibration:
        gen = torch.Generator().manual_seed(seed)
        calibration = torch.randint(0, vocab, (calib_samples, calib_len), generator=gen, dtype=torch.int64)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    quantize_streaming(src, out, recipe, calibration=calibration, overwrite=True, dtype=getattr(torch, dtype))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"seconds": seconds, "peak_rss_gb": peak * 1024 / GB, "base_rss_gb": base * 1024 / GB,
            "threads": torch.get_num_threads(),
            "calibration": None if calibration is None else list(calibration.shape)}


def run_row(method: str, recipe: str, src: Path, layers: int, workdir: Path, a) -> dict:
    out = workdir / f"out-{method.replace(':', '_').replace('/', '_')}-{src.name}"
    row = {"method": method, "recipe": recipe, "layers": layers, "checkpoint_gb": folder_bytes(src) / GB}

    def remove_out():  # only the benchmark's own output folder under workdir
        if out.exists() and out.resolve().parent == workdir.resolve() and out.name.startswith("out-"):
            shutil.rmtree(out)

    remove_out()
    cmd = [sys.executable, __file__, "--worker", str(src), str(out), recipe, "--calib-samples", str(a.calib_samples),
           "--calib-len", str(a.calib_len), "--seed", str(a.seed), "--dtype", a.dtype]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    row["process_seconds"] = time.perf_counter() - t0
    try:
        if done.returncode == 0:
            row.update(json.loads(done.stdout.strip().splitlines()[-1]))
            row["seconds_per_layer"] = row["seconds"] / layers
            row["output_gb"] = folder_bytes(out) / GB if out.exists() else None
        else:
            err = done.stderr.strip().splitlines()
            row["error"] = err[-1] if err else f"exit status {done.returncode}"
    finally:
        remove_out()
    return row


COLUMNS = [("method", "method", "{}"), ("layers", "layers", "{}"), ("ckpt GB", "checkpoint_gb", "{:.2f}"),
           ("out GB", "output_gb", "{:.2f}"), ("seconds", "seconds", "{:.1f}"),
           ("s/layer", "seconds_per_layer", "{:.2f}"), ("base RSS GB", "base_rss_gb", "{:.2f}"),
           ("peak RSS GB", "peak_rss_gb", "{:.2f}")]


def table(rows: list[dict]) -> str:
    cells = [["-" if r.get(k) is None else f.format(r[k]) for _, k, f in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(COLUMNS)]
    line = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                                  for i, (v, w) in enumerate(zip(vals, widths)))
    head = line([h for h, _, _ in COLUMNS])
    return "\n".join([head, "-" * len(head)] + [line(c) + (f"  error: {r['error'][:160]}" if "error" in r else "")
                                               for c, r in zip(cells, rows)])


def ratios(rows: list[dict]) -> list[dict]:
    """Per method: peak RSS and seconds per layer at the largest layer count over the smallest."""
    out = []
    for method in dict.fromkeys(r["method"] for r in rows):
        ok = sorted((r for r in rows if r["method"] == method and "error" not in r), key=lambda r: r["layers"])
        if len(ok) < 2 or ok[0]["layers"] == ok[-1]["layers"]:
            continue
        lo, hi = ok[0], ok[-1]
        out.append({"method": method, "layers": [lo["layers"], hi["layers"]],
                    "peak_rss_ratio": hi["peak_rss_gb"] / lo["peak_rss_gb"],
                    "peak_rss_above_base_ratio": ((hi["peak_rss_gb"] - hi["base_rss_gb"])
                                                  / max(lo["peak_rss_gb"] - lo["base_rss_gb"], 1e-9)),
                    "seconds_per_layer_ratio": hi["seconds_per_layer"] / lo["seconds_per_layer"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32], help="decoder layer counts (default 2 8 32)")
    p.add_argument("--methods", nargs="*", default=["rtn", "gptq"],
                   help=f"{', '.join(f'{k} ({v})' for k, v in METHODS.items())} or a recipe name "
                        "(default: rtn gptq); none: only write (or with --clean, only remove) the checkpoints")
    p.add_argument("--calib-samples", type=int, default=4, help="calibration sequences (recipes that need them)")
    p.add_argument("--calib-len", type=int, default=128, help="tokens per calibration sequence")
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration token ids")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="float dtype the layers are computed and the float parts saved in (default: float32; "
                        "bfloat16 matmuls are 7x slower than float32 on a CPU without AVX512-BF16)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads in each worker (default: torch's)")
    p.add_argument("--workdir", default="/work/bench-streaming",
                   help="cache of the synthetic checkpoints, and where outputs go (deleted after each row)")
    keep = p.add_mutually_exclusive_group()
    keep.add_argument("--keep", action="store_true", default=True,
                      help="keep the synthetic checkpoints as a cache (the default)")
    keep.add_argument("--clean", action="store_true",
                      help="at the end, remove the synthetic checkpoints this script wrote in --workdir")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, help="default: --heads (Llama-2-7B has no GQA)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--json", help="write the rows and ratios to this file")
    p.add_argument("--worker", nargs=3, metavar=("SRC", "OUT", "RECIPE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(*a.worker, a.calib_samples, a.calib_len, a.threads, a.seed, a.dtype)), flush=True)
        return

    kv_heads = a.kv_heads or a.heads
    if a.hidden % a.heads or a.heads % kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    shapes = {"hidden": a.hidden, "intermediate": a.intermediate, "heads": a.heads, "kv_heads": kv_heads,
              "vocab": a.vocab}
    workdir = Path(a.workdir).absolute()
    if a.clean and not a.methods:
        for path in clean(workdir):
            print(f"removed {path}", file=sys.stderr)
        return
    layers = sorted(dict.fromkeys(a.layers))
    sources = {}
    for n in layers:
        sources[n] = write_checkpoint(workdir, n, shapes)
        print(f"checkpoint: {sources[n]} ({folder_bytes(sources[n]) / GB:.2f} GB)", file=sys.stderr, flush=True)

    rows = []
    for method in a.methods:
        recipe = METHODS.get(method, method)
        for n in layers:
            rows.append(run_row(method, recipe, sources[n], n, workdir, a))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # each row as it comes
    summary = ratios(rows)
    if a.clean:
        for path in clean(workdir):
            print(f"removed {path}", file=sys.stderr)
    if not rows:
        return

    threads = next((r["threads"] for r in rows if "threads" in r), a.threads or "default")
    print(f"shapes: {shapes_key(shapes)}, bfloat16; calibration (recipes that need it): {a.calib_samples} x "
          f"{a.calib_len} random tokens; threads: {threads}; cpus: {os.cpu_count()}")
    print(table(rows))
    if summary:
        print()
        for s in summary:
            print(f"{s['method']}: {s['layers'][1]} vs {s['layers'][0]} layers: peak RSS x{s['peak_rss_ratio']:.2f} "
                  f"(above the pre-call RSS x{s['peak_rss_above_base_ratio']:.2f}; flat: ~1.0), "
                  f"seconds per layer x{s['seconds_per_layer_ratio']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shapes": shapes, "calib_samples": a.calib_samples, "calib_len": a.calib_len,
                       "threads": a.threads, "rows": rows, "ratios": summary}, f, indent=1)


if __name__ == "__main__":
    main()
