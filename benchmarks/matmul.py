"""Quantized matmul speed on CPU: lowbit next to torch float matmuls and torch's own
quantized weight kernels (the CPU paths torchao's int4/int8 weight-only configs use).

    python benchmarks/matmul.py                 # all shapes, M in {1, 16, 128}
    python benchmarks/matmul.py --quick         # fewer repetitions
    python benchmarks/matmul.py --shapes 4096x4096 --m 1

For each (M, N, K) and activation dtype it prints the median time, the ratio to float32
and to bfloat16 torch.matmul on the same shape (>1: lowbit faster), the ratio to the
best peer row, and the weight bytes streamed per second next to the machine's read
bandwidth (a large tensor sum) measured in the same run.
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


def rows(n: int, k: int, m: int, dtype: torch.dtype):
    """(name, fn, weight bytes, is_peer) for one shape and activation dtype."""
    g = group_for(k)
    w = torch.randn(n, k) * 0.02
    x = torch.randn(m, k).to(dtype)
    wf, wb = w.to(dtype), w.to(torch.bfloat16)
    yield "torch.matmul f32 weight", (lambda: x.float() @ w.T) if dtype != torch.float32 else (lambda: x @ w.T), n * k * 4, False
    yield "torch.matmul bf16 weight", lambda: x.to(torch.bfloat16) @ wb.T, n * k * 2, False
    q8 = lowbit.quantize(w, "int8-sym")
    q4 = lowbit.quantize(w, f"int4-asym-g{g}")
    q4s = lowbit.quantize(w, f"int4-sym-g{g}")
    yield "lowbit W8A16 int8-sym", lambda: lowbit.linear(x, q8), q8.nbytes, False
    yield f"lowbit W4A16 int4-asym-g{g}", lambda: lowbit.linear(x, q4), q4.nbytes, False
    yield f"lowbit W4A16 int4-sym-g{g}", lambda: lowbit.linear(x, q4s), q4s.nbytes, False
    yield "lowbit W8A8 dyn. per-token", lambda: lowbit.linear(x, q8, act_scheme="int8-sym-token"), q8.nbytes, False
    yield f"lowbit W4A8 int4-asym-g{g}", lambda: lowbit.linear(x, q4, act_scheme="int8-asym-token"), q4.nbytes, False
    # Peers: torch's native CPU weight-only kernels (bf16 activations are their fast case).
    xb = x.to(torch.bfloat16)
    w8 = q8.codes
    s8 = q8.scale.to(torch.bfloat16)
    yield "peer torch._weight_int8pack_mm", lambda: torch._weight_int8pack_mm(xb if dtype == torch.bfloat16 else x, w8, s8 if dtype == torch.bfloat16 else q8.scale), n * k + n * 2, True
    try:
        # int4 packed for torch's CPU kernel: uint8 [N, K/2], scales_and_zeros [K/g, N, 2]
        q = lowbit.ops.unpack_bits(q4.codes, 4, signed=False)
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        sz = torch.stack([q4.scale.T, (8 - q4.zero_point.float().T) * q4.scale.T], dim=-1).to(dtype).contiguous()
        yield f"peer torch._weight_int4pack_mm g{g}", lambda: torch._weight_int4pack_mm_for_cpu(x, packed, g, sz), n * k // 2 + sz.numel() * sz.element_size(), True
    except (RuntimeError, AttributeError) as e:  # pragma: no cover - depends on the torch build
        print(f"  (torch int4 kernel unavailable: {e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--m", type=int, nargs="*", default=[1, 16, 128])
    ap.add_argument("--shapes", nargs="*", help="NxK, e.g. 4096x4096")
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    torch.set_grad_enabled(False)
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
                for name, fn, wbytes, peer in rows(n, k, m, dtype):
                    try:
                        t = timeit(fn, reps)
                    except RuntimeError as e:  # a peer kernel refusing this shape or dtype
                        print(f"{name:<36}  n/a ({str(e).splitlines()[0][:60]})")
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


if __name__ == "__main__":
    main()
