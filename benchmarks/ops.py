"""Dequantize throughput on 4096x4096: lowbit's backends next to plain torch,
torch.compile (Inductor) of the same expression, and the machine's copy bandwidth.

    python benchmarks/ops.py            # both allocator modes, one table each
    python benchmarks/ops.py --quick    # fewer repetitions

Throughput is GB/s of output written.  "copy" is torch.clone of a 256 MiB tensor.

Two allocator modes: by default glibc hands every large tensor fresh pages from mmap,
so each call pays page faults (clone included) and all fast paths look alike; with
GLIBC_TUNABLES raising the mmap threshold, freed blocks are reused and the kernels'
own speed shows.  The script runs itself once per mode, in one invocation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

REUSE = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=17179869184"


def timeit(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cases(n: int, k: int):
    import lowbit
    from lowbit.ops import dequantize_accumulator, dequantize_per_token

    w = torch.randn(n, k)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)

    q8 = lowbit.quantize(w, "int8-sym")
    def plain_int8(out):
        return (q8.codes.to(torch.float32) * q8.scale[:, None]).to(out)

    q4 = lowbit.quantize(w, "int4-asym-g64")
    def plain_int4(out):
        q = ((q4.codes[..., None] >> shifts) & 0xF).reshape(n, k // 64, 64)
        return ((q.to(torch.float32) - q4.zero_point[..., None].to(torch.float32))
                * q4.scale[..., None]).reshape(n, k).to(out)

    qt, st, zt = lowbit.ops.quantize_per_token(w)
    def plain_token(out):
        return ((qt.to(torch.int32) - zt[:, None]).to(torch.float32) * st[:, None]).to(out)

    acc = torch.randint(-2**20, 2**20, (n, k), dtype=torch.int32)
    sg = torch.rand(n, k // 128)
    def plain_acc(out):
        return (acc.to(torch.float32) * sg.repeat_interleave(128, dim=-1)).to(out)

    for out in (torch.float32, torch.bfloat16):
        yield (f"int8 per-channel -> {_short(out)}",
               lambda b, out=out: lowbit.dequantize(q8, out, backend=b), lambda out=out: plain_int8(out), out)
        yield (f"int4 g64 asym u32x8 -> {_short(out)}",
               lambda b, out=out: lowbit.dequantize(q4, out, backend=b), lambda out=out: plain_int4(out), out)
    yield ("per-token uint8 -> f32",
           lambda b: dequantize_per_token(qt, st, zt, backend=b), lambda: plain_token(torch.float32), torch.float32)
    yield ("accumulator int32 g128 -> bf16",
           lambda b: dequantize_accumulator(acc, sg, 128, backend=b), lambda: plain_acc(torch.bfloat16), torch.bfloat16)


def _short(dtype):
    return {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]


def run(reps: int) -> None:
    import lowbit

    n = k = 4096
    big = torch.randn(64 * 2**20)
    copy = big.numel() * 4 / timeit(lambda: big.clone(), reps) / 1e9
    del big
    backends = lowbit.available_backends("cpu")
    print(f"copy (torch.clone, 256 MiB): {copy:.1f} GB/s; threads: {torch.get_num_threads()}; "
          f"backends: {backends}")
    cols = ["lowbit " + b for b in backends] + ["plain torch", "torch.compile"]
    print(f"{'op (4096x4096)':<32}" + "".join(f"{c:>16}" for c in cols) + f"{'best/copy':>11}{'vs plain':>10}")
    for name, lowbit_fn, plain, out in cases(n, k):
        nbytes = n * k * torch.empty(0, dtype=out).element_size()
        gbs = [nbytes / timeit(lambda b=b: lowbit_fn(b), reps if b != "reference" else 3) / 1e9 for b in backends]
        p = nbytes / timeit(plain, reps) / 1e9
        compiled = torch.compile(plain)
        c = nbytes / timeit(compiled, reps) / 1e9
        best = gbs[-1]
        print(f"{name:<32}" + "".join(f"{v:>16.1f}" for v in gbs + [p, c])
              + f"{best / copy:>11.2f}{best / p:>9.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mode", choices=["default", "reuse"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    reps = 5 if args.quick else 20
    if args.mode:
        run(reps)
        return
    for mode, label in [("default", "default glibc allocator (fresh pages on every large allocation)"),
                        ("reuse", f"GLIBC_TUNABLES={REUSE} (freed blocks reused)")]:
        print(f"\n== {label}", flush=True)
        env = dict(os.environ)
        if mode == "reuse":
            env["GLIBC_TUNABLES"] = REUSE
        subprocess.run([sys.executable, __file__, "--mode", mode] + (["--quick"] if args.quick else []),
                       env=env, check=True)


if __name__ == "__main__":
    main()
