"""Quantized matmul speed on CPU: lowbit next to torch float matmuls and torch's own
quantized weight kernels (the CPU paths torchao's int4/int8 weight-only configs use).

    python benchmarks/matmul.py                 # all shapes, M in {1, 16, 128}
    python benchmarks/matmul.py --quick         # fewer repetitions
    python benchmarks/matmul.py --shapes 4096x4096 --m 1

For each (M, N, K) and activation dtype it prints the median time, the ratio to float32
and to bfloat16 torch.matmul on the same shape (>1: faster), the ratio to the best peer
row, and the weight bytes streamed per second next to the machine's read bandwidth (a
large tensor sum) measured in the same run.  Every row cycles through copies of its
weight totalling >= 96 MiB, so weights stream from DRAM, not from the last-level cache
(``--cache-resident``: one copy, which stays in cache).
Peers (torchao, optimum-quanto) are rows where they are installed; they are not
dependencies of lowbit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import lowbit

SHAPES = [(1536, 576), (576, 1536), (4096, 4096), (14336, 4096)]  # (N, K)


def timeit(fn, reps: int, min_time: float = 0.05) -> float:
    fn()
    t0, times = time.perf_counter(), []
    while len(times) < reps or time.perf_counter() - t0 < min_time:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if len(times) > 50 * reps:
            break
    return statistics.median(times)


def read_bandwidth(reps: int) -> float:
    big = torch.ones(256 * 2**20 // 4)
    return big.numel() * 4 / timeit(lambda: big.sum(), reps) / 1e9


def group_for(k: int) -> int:
    return 128 if k % 128 == 0 else 64


def torchao_linear(w: torch.Tensor, dtype: torch.dtype, config_name: str, **kw):
    """An nn.Linear quantized in place by torchao (its CPU paths call torch's kernels)."""
    import torchao.quantization as tq

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(dtype)
    lin.weight.data.copy_(w.to(dtype))
    tq.quantize_(lin, getattr(tq, config_name)(**kw))
    return lin


def quanto_linear(w: torch.Tensor, dtype: torch.dtype, weights: str):
    import optimum.quanto as oq

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(dtype)
    lin.weight.data.copy_(w.to(dtype))
    model = torch.nn.Sequential(lin)  # quanto swaps children, not the root module
    oq.quantize(model, weights=getattr(oq, weights))
    oq.freeze(model)
    return model


def rows(n: int, k: int, m: int, dtype: torch.dtype):
    """(name, make, is_peer): make(w) builds the operands from a float weight and returns
    (fn, weight bytes); each call of make gives a separate copy in memory."""
    g = group_for(k)
    x = torch.randn(m, k).to(dtype)

    def f32(w):
        wf = w.contiguous()
        return (lambda: x.float() @ wf.T), wf.numel() * 4

    def bf16(w):
        wb, xb = w.to(torch.bfloat16), x.to(torch.bfloat16)
        return (lambda: xb @ wb.T), wb.numel() * 2

    def lowbit_linear(scheme, act=None):
        def make(w):
            qt = lowbit.quantize(w, scheme)
            return (lambda: lowbit.linear(x, qt, act_scheme=act)), qt.nbytes
        return make

    def int8pack(w):
        q8 = lowbit.quantize(w, "int8-sym")
        s = q8.scale.to(dtype)
        return (lambda: torch._weight_int8pack_mm(x, q8.codes, s)), q8.codes.numel() + s.numel() * s.element_size()

    def int4pack(w):
        q4 = lowbit.quantize(w, f"int4-asym-g{g}")
        q = lowbit.ops.unpack_bits(q4.codes, 4, signed=False)
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        sz = torch.stack([q4.scale.T, (8 - q4.zero_point.float().T) * q4.scale.T], dim=-1).to(dtype).contiguous()
        return (lambda: torch._weight_int4pack_mm_for_cpu(x, packed, g, sz)), packed.numel() + sz.numel() * sz.element_size()

    def module(build):
        def make(w):
            lin = build(w)
            nbytes = sum(_nbytes(t) for t in lin.state_dict().values())
            return (lambda: lin(x)), nbytes
        return make

    yield "torch.matmul f32 weight", f32, False
    yield "torch.matmul bf16 weight", bf16, False
    yield "lowbit W8A16 int8-sym", lowbit_linear("int8-sym"), False
    yield f"lowbit W4A16 int4-asym-g{g}", lowbit_linear(f"int4-asym-g{g}"), False
    yield f"lowbit W4A16 int4-sym-g{g}", lowbit_linear(f"int4-sym-g{g}"), False
    yield "lowbit W8A8 dyn. per-token", lowbit_linear("int8-sym", "int8-sym-token"), False
    yield f"lowbit W4A8 int4-asym-g{g}", lowbit_linear(f"int4-asym-g{g}", "int8-asym-token"), False
    # llama.cpp's arithmetic: Q4_0 / Q8_0 weights, activations in int8 blocks of 32
    yield "lowbit q4_0 x int8 blocks", lowbit_linear("int4-sym-g32-f16", "int8-sym-g32"), False
    yield "lowbit q8_0 x int8 blocks", lowbit_linear("int8-sym-g32-f16", "int8-sym-g32"), False
    yield "peer torch._weight_int8pack_mm", int8pack, True
    yield f"peer torch._weight_int4pack_mm g{g}", int4pack, True
    yield "peer torchao Int8WeightOnly", module(lambda w: torchao_linear(w, dtype, "Int8WeightOnlyConfig")), True
    yield f"peer torchao Int4WeightOnly g{g}", module(lambda w: torchao_linear(
        w, dtype, "Int4WeightOnlyConfig", group_size=g)), True
    yield "peer torchao Int8DynAct-Int8W", module(lambda w: torchao_linear(
        w, dtype, "Int8DynamicActivationInt8WeightConfig")), True
    yield "peer quanto qint8 weights", module(lambda w: quanto_linear(w, dtype, "qint8")), True
    yield "peer quanto qint4 weights", module(lambda w: quanto_linear(w, dtype, "qint4")), True


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a (possibly subclassed, e.g. torchao/quanto) tensor holds in plain tensors."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(_nbytes(getattr(t, name)) for name in names)


# Quantized weights of these shapes fit the 32 MiB L3 of the machine this was tuned on;
# each row cycles through copies totalling at least this much so weights come from DRAM.
COLD_BYTES = 96 * 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--m", type=int, nargs="*", default=[1, 16, 128])
    ap.add_argument("--shapes", nargs="*", help="NxK, e.g. 4096x4096")
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--cache-resident", action="store_true",
                    help="one copy of each weight, called again and again (it stays in cache), instead of "
                         "copies cycled through >= 96 MiB")
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    # Weights are made as a user makes them (outside inference mode: tensors with version
    # counters), the calls timed as lowbit.Runner runs them, under inference mode: there
    # lowbit's public functions call the op's implementation directly (no dispatcher round
    # trip of ~20 us), and one row runs the weight's prepared kernel.  (This once entered
    # inference mode as torch.inference_mode().__enter__(), whose guard object is freed at
    # once: every figure before was taken outside it.)
    bw = read_bandwidth(reps)
    print(f"read bandwidth (sum of 256 MiB): {bw:.1f} GB/s; threads: {torch.get_num_threads()}; "
          f"lowbit backends: {lowbit.available_backends()}")
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        for n, k in shapes:
            for m in args.m:
                print(f"\n== M={m} N={n} K={k} activations {dname}")
                print(f"{'':<36}{'ms':>9}{'vs f32':>8}{'vs bf16':>8}{'vs peer':>8}{'GB/s':>7}{'% read bw':>10}")
                results = []
                w = torch.randn(n, k) * 0.02
                for name, make, peer in rows(n, k, m, dtype):
                    try:
                        fn, wbytes = make(w)
                        cold = 0 if args.cache_resident else COLD_BYTES
                        copies = [fn] + [make(w)[0] for _ in range(-(-cold // wbytes) - 1)]
                        turn = iter(range(10**9))
                        with torch.inference_mode():
                            t = timeit(lambda: copies[next(turn) % len(copies)](), reps)
                    except Exception as e:  # a peer missing, or refusing this shape or dtype
                        print(f"{name:<36}  n/a ({type(e).__name__}: {str(e).splitlines()[0][:70] if str(e) else ''})")
                        continue
                    results.append((name, t, wbytes, peer))
                t32 = results[0][1]
                tbf = results[1][1]
                peers = [t for _, t, _, p in results if p]
                best_peer = min(peers) if peers else float("nan")
                for name, t, wbytes, peer in results:
                    gbs = wbytes / t / 1e9
                    print(f"{name:<36}{t * 1e3:>9.3f}{t32 / t:>8.2f}{tbf / t:>8.2f}{best_peer / t:>8.2f}"
                          f"{gbs:>7.1f}{100 * gbs / bw:>9.0f}%")
    if torch.cuda.is_available():  # GPU rows: lowbit's triton backend (benchmarks/matmul_gpu.py)
        from matmul_gpu import main as gpu_main
        gpu_main([])


if __name__ == "__main__":
    main()
