"""2:4 sparse + quantized weights: what they cost in accuracy, and whether they are faster.

(a) Accuracy on the bundled SmolLM2-135M: every decoder linear (q/k/v/o/gate/up/down of
every layer) dense int8 / int4 next to 2:4 sparse at the same scheme, magnitude pruning +
round to nearest next to SparseGPT (prune and quantize in one pass with error feedback;
dense int4 GPTQ, lowbit's layer-by-layer variant, beside it),
one ``lowbit.evaluate`` run on the same windows (perplexity, KL and top-1 against the
float model).  SparseGPT's Hessians are "all layers from float inputs": one pass of the
float model over the calibration text collects every linear's ``X^T X`` (not the
sequential variant that feeds each layer the already-quantized layers' outputs).
(b) CPU speed at M = 1: an experimental AVX2 sparse int4 GEMV (``sparse_gemv.cpp``,
built here) next to lowbit's dense W4A16 kernel (``lowbit.quantized_matmul``, cpu
backend) and float32 ``F.linear``, repeats alternating, medians and ratios printed;
"cache" rows reuse one weight, "DRAM" rows cycle through copies of >= 64 MiB.

    OMP_NUM_THREADS=1 python benchmarks/sparse.py   # about 13 minutes
    python benchmarks/sparse.py --quick    # a smoke test: 2 windows of 128 tokens, fewer repeats
    python benchmarks/sparse.py --no-accuracy   # speed only

The bundled model's linears are an exact dequantization of Q4_1 (group 32): every 4-bit
row here is a second rounding, the same for dense and sparse.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import re
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lowbit  # noqa: E402
from lowbit.algorithms.sparsegpt import sparsegpt_quantize  # noqa: E402
from lowbit.evaluation import calibration_set, evaluate  # noqa: E402
from lowbit.recipe import DECODER_LINEARS, Recipe  # noqa: E402
from lowbit.sparse import SparseQuantLinear, prune_2_4, sparse_linear, sparsify  # noqa: E402

SCHEMES = {"int8": "int8-sym", "int4": "int4-asym-g32-f16"}  # int4: g32 divides K/2 = 288 of SmolLM2's 576
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 4096)]  # (N, K)
DRAM_BYTES = 64 << 20  # twice the 32 MiB L3


# -- (a) accuracy --------------------------------------------------------------------------
def hessians(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``E[x x^T]`` of the input of every decoder linear, from the float model (q/k/v and
    gate/up read the same input: one Hessian each, shared)."""
    sums, count, hooks = {}, {}, []
    for name, m in model.named_modules():
        if re.search(DECODER_LINEARS, name) and not re.search(r"(k|v)_proj$|up_proj$", name):
            def hook(mod, inp, out, name=name):
                x = inp[0].reshape(-1, inp[0].shape[-1]).float()
                sums[name] = sums.get(name, 0) + x.T @ x
                count[name] = count.get(name, 0) + x.shape[0]
            hooks.append(m.register_forward_hook(hook))
    with torch.no_grad():
        for row in ids:
            model(row[None])
    for h in hooks:
        h.remove()
    return {n: s / count[n] for n, s in sums.items()}


def _shared(name: str) -> str:
    return re.sub(r"(k|v)_proj$", "q_proj", re.sub(r"up_proj$", "gate_proj", name))


def sparse_model(model, make) -> tuple[torch.nn.Module, float]:
    """A copy of ``model`` with every decoder linear replaced by ``make(name, linear)`` (a
    module), and the replaced weights' bits per weight."""
    out = copy.deepcopy(model)
    bits = numel = 0
    for name, m in list(out.named_modules()):
        if re.search(DECODER_LINEARS, name):
            new = make(name, m)
            parent, _, attr = name.rpartition(".")
            setattr(out.get_submodule(parent), attr, new)
            numel += m.weight.numel()
            bits += 8 * new.sqt.nbytes if isinstance(new, SparseQuantLinear) else 32 * m.weight.numel()
    return out, bits / numel


def dense_bits(q) -> float:
    mods = [m for n, m in q.named_modules() if re.search(DECODER_LINEARS, n)]
    return sum(8 * m.qweight.nbytes for m in mods) / sum(m.in_features * m.out_features for m in mods)


def accuracy(args) -> None:
    model, tok = lowbit.load_model()
    t0 = time.perf_counter()
    ids = calibration_set(tok, samples=args.samples, length=args.length)
    hs = hessians(model, ids)
    print(f"Hessians of {len(hs)} linear inputs from {ids.numel()} float-model tokens in "
          f"{time.perf_counter() - t0:.0f}s")
    models, bits = {}, {}
    magnitude_float = lambda name, m: _masked(m)  # noqa: E731
    models["2:4 float (magnitude)"], bits["2:4 float (magnitude)"] = sparse_model(model, magnitude_float)
    bits["2:4 float (magnitude)"] = 32.0  # float weights, zeros stored
    for label, scheme in SCHEMES.items():
        q = lowbit.quantize_model(model, Recipe(weight=scheme, name=scheme), inplace=False)
        models[f"dense {label} {scheme}"], bits[f"dense {label} {scheme}"] = q, dense_bits(q)
        if label == "int4":  # error feedback without pruning: lowbit's GPTQ (sequential, act-order)
            t0 = time.perf_counter()
            q = lowbit.quantize_model(model, Recipe(weight=scheme, method="gptq", name="gptq"), inplace=False,
                                      calibration=ids)
            models[f"dense {label} GPTQ"], bits[f"dense {label} GPTQ"] = q, dense_bits(q)
            print(f"GPTQ {scheme}: {time.perf_counter() - t0:.0f}s")
        name = f"2:4 {label} magnitude+RTN"
        models[name], bits[name] = sparse_model(
            model, lambda n, m, s=scheme: SparseQuantLinear.from_linear(m, s))
        t0 = time.perf_counter()
        name = f"2:4 {label} SparseGPT"
        models[name], bits[name] = sparse_model(model, lambda n, m, s=scheme: SparseQuantLinear(
            sparsegpt_quantize(m.weight.detach().float(), hs[_shared(n)], s), m.bias))
        print(f"SparseGPT {scheme}: 210 linears in {time.perf_counter() - t0:.0f}s")
    t0 = time.perf_counter()
    rows = evaluate(models, tok, reference=model, ctx=args.ctx, max_windows=args.windows, speed=False,
                    greedy_tokens=16)
    by = {r["model"]: r for r in rows}
    print(f"evaluated {len(models) + 1} models on {args.windows} windows of {args.ctx} tokens in "
          f"{time.perf_counter() - t0:.0f}s; corpus sha256 {rows[0].get('corpus_sha256', '?')[:12]}")
    print(f"\n{'model':<34}{'bits/w':>8}{'ppl':>9}{'KL':>9}{'top-1':>8}")
    print(f"{'float':<34}{32:>8.3f}{by['float']['perplexity']:>9.3f}{0:>9.4f}{1:>8.3f}")
    for name in models:
        r = by[name]
        print(f"{name:<34}{bits[name]:>8.3f}{r['perplexity']:>9.3f}{r['kl_divergence']:>9.4f}"
              f"{r['top1_agreement']:>8.3f}")


def _masked(m: torch.nn.Linear) -> torch.nn.Linear:
    out = copy.deepcopy(m)
    out.weight.data.mul_(prune_2_4(m.weight.detach()))
    return out


# -- (b) speed -----------------------------------------------------------------------------
def load_kernel():
    from torch.utils.cpp_extension import load

    # -fopenmp compiles at::parallel_for's OpenMP region; not linking libgomp makes it bind
    # to torch's own copy (two OpenMP runtimes would spin against each other on 2 cores)
    build = "/tmp/lowbit_sparse_gemv"
    os.makedirs(build, exist_ok=True)
    return load("lowbit_sparse_gemv", [os.path.join(os.path.dirname(__file__), "sparse_gemv.cpp")],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                build_directory=build, verbose=False)


def sparse_args(sqt):
    """The kernel's arguments, float32 scales and zero points made once (as for the dense row)."""
    v = sqt.values
    zp = None if v.zero_point is None else v.zero_point.float().contiguous()
    return v.codes, v.scale.float().contiguous(), zp, sqt.indices, v.scheme.group_size


def check_kernel(ext, sqt, x) -> None:
    """The kernel against the reference: both sum K/2 float32 products (the reference
    also K/2 zeros), so |difference| <= 2 * (K/2) * 2^-24 * sum |x| |w| (two orders of
    float32 sums, gamma_n <= n u each)."""
    w = lowbit.sparse.densify(sqt)
    ref = sparse_linear(x[None], sqt)[0]
    y = ext.sparse24_gemv_w4(x, *sparse_args(sqt))
    bound = sqt.shape[1] * 2.0**-24 * (x.abs() @ w.abs().T) + 1e-30
    bad = ((y - ref).abs() > bound).nonzero()
    if len(bad):
        raise AssertionError(f"sparse kernel differs from the reference at {bad[0].tolist()}: "
                             f"{y[bad[0]].item()} vs {ref[bad[0]].item()}")


def median_time(fn, copies: int, calls: int) -> float:
    t = time.perf_counter()
    for i in range(calls):
        fn(i % copies)
    return (time.perf_counter() - t) / calls


def speed(args) -> None:
    torch.set_num_threads(args.speed_threads)
    ext = load_kernel()
    print(f"\nM=1 float32 x, {torch.get_num_threads()} thread(s); lowbit dense W4A16: "
          f"lowbit.quantized_matmul(backend='cpu'), int4-asym-g32 (float32 scales and zero points);"
          f"\nsparse: 2:4 + int4-asym-g32 (32 kept values per scale), benchmarks/sparse_gemv.cpp; "
          f"us per call: the median over {args.repeats} alternating repeats of the mean of a batch of calls")
    from lowbit.kernels import cpu

    kernel = cpu._weight_only_plan(4, 32, 1, 4096, torch.float32).kernel
    index = cpu.weight_only_kernel_index(kernel)
    print(f"dense kernel: lowbit._C.weight_only_matmul, the cpu plan's '{kernel}' called directly (no Python "
          f"checks), as the sparse kernel is; 'quantized_matmul': the public op, checks and dispatch included")
    print(f"{'N x K':<12}{'where':<7}{'copies':>7}{'f32 F.linear':>13}{'quantized_matmul':>17}{'dense kernel':>13}"
          f"{'2:4 kernel':>11}{'dense/2:4':>11}{'f32/2:4':>9}{'bytes 2:4/dense':>17}")
    scheme = "int4-asym-g32"
    for n, k in args.shapes:
        w = torch.randn(n, k)
        x = torch.randn(k)
        sqt = sparsify(w, scheme)
        check_kernel(ext, sqt, x)
        qt = lowbit.quantize(w, scheme)
        dense = (qt.codes, qt.scale.float(), qt.zero_point.float())
        dense_bytes = qt.nbytes
        for where in ("cache", "DRAM"):
            copies = 1 if where == "cache" else math.ceil(DRAM_BYTES / sqt.nbytes)
            ws = [w] if copies == 1 else [w.clone() for _ in range(max(2, math.ceil(DRAM_BYTES / (n * k * 4))))]
            ds = [dense] if copies == 1 else [tuple(t.clone() for t in dense)
                                              for _ in range(math.ceil(DRAM_BYTES / dense_bytes))]
            ss = [sparse_args(sqt)] if copies == 1 else [
                tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in sparse_args(sqt))
                for _ in range(copies)]
            x2 = x[None]
            fns = {
                "f32": (lambda i: F.linear(x2, ws[i % len(ws)]), len(ws)),
                "dense": (lambda i: lowbit.quantized_matmul(x2, *ds[i % len(ds)][:2], ds[i % len(ds)][2], bits=4,
                                                            group_size=32, backend="cpu"), len(ds)),
                "kernel": (lambda i: cpu._C.weight_only_matmul(x2, *ds[i % len(ds)], 4, 32, index, False), len(ds)),
                "sparse": (lambda i: ext.sparse24_gemv_w4(x, *ss[i % len(ss)]), len(ss)),
            }
            calls = max(20, min(2000, int(2e8 / (n * k))))
            times = {key: [] for key in fns}
            for _ in range(args.repeats):
                for key, (fn, c) in fns.items():
                    fn(0)
                    times[key].append(median_time(fn, c, calls))
            t = {key: statistics.median(v) * 1e6 for key, v in times.items()}
            print(f"{f'{n}x{k}':<12}{where:<7}{len(ss):>7}{t['f32']:>13.1f}{t['dense']:>17.1f}{t['kernel']:>13.1f}"
                  f"{t['sparse']:>11.1f}{t['kernel'] / t['sparse']:>11.2f}{t['f32'] / t['sparse']:>9.2f}"
                  f"{sqt.nbytes / dense_bytes:>17.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 windows of 128 tokens, 4 calibration rows, 3 repeats")
    p.add_argument("--no-accuracy", action="store_true")
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--samples", type=int, default=32, help="calibration rows for the Hessians")
    p.add_argument("--length", type=int, default=512, help="tokens per calibration row")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--speed-threads", type=int, default=1, help="threads for the speed rows (default: %(default)s)")
    args = p.parse_args()
    args.shapes = SHAPES
    if args.quick:
        args.windows, args.ctx, args.samples, args.length, args.repeats = 2, 128, 4, 128, 3
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    if not args.no_accuracy:
        accuracy(args)
    if not args.no_speed:
        speed(args)


if __name__ == "__main__":
    main()
