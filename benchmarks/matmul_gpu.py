"""Quantized matmul speed on an NVIDIA GPU: lowbit's triton backend next to bfloat16
torch.matmul and, where they install, torchao and gemlite.

    python benchmarks/matmul_gpu.py                      # (also run by benchmarks/matmul.py on a GPU)
    python benchmarks/matmul_gpu.py --shapes 14336x4096 --m 1 16 --rows W4A16 gemlite

For each (M, N, K), bfloat16 activations, two times per row:

* "call": the median time of one Python call (triton.testing.do_bench, which flushes
  the L2 cache before every run, so weights stream from HBM).  At small M this is the
  host's launch cost (Python, the Triton launcher), not the kernel's.
* "graph": the kernel work alone: the calls captured in a CUDA graph and replayed, the
  graph cycling through enough copies of the weight (more than twice the L2 cache) that
  every call streams its weight from HBM.  This is what a server that replays graphs
  (vLLM, torch.compile's "reduce-overhead") sees.

each with its ratio to bfloat16 torch.matmul measured the same way (>1: faster), and
for the graph time the weight bytes streamed per second next to the GPU's copy
bandwidth measured in the same run (a 1 GiB device-to-device copy, bytes read +
written per second), as a percentage.
Issue 6's targets: W4A16 at M=1 on 14336x4096 >= 80% of the copy bandwidth; W4A16 at
M=16 >= 3x bf16 torch.matmul; W8A8 at M >= 1024 >= 1.5x bf16 torch.matmul.
"""

from __future__ import annotations

import argparse

import torch

import lowbit

SHAPES = [(4096, 4096), (14336, 4096)]  # (N, K)
MS = [1, 16, 128, 1024]
GROUP = 128


def bench(fn) -> float:
    """Median seconds per call."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def bench_graph(make, reps: int = 20) -> float:
    """Median seconds per call of a CUDA graph that replays ``reps`` rounds over
    enough copies of the weight (each ``make()`` builds one) to exceed 2x the L2 cache."""
    fn, wbytes = make()
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    fns = [fn] + [make()[0] for _ in range(min(64, 2 * l2 // max(wbytes, 1)))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (autotuning, compilation) outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for f in fns:
                f()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / (reps * len(fns)))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e9


def _nbytes(t) -> int:
    """Bytes a (possibly subclassed: torchao, gemlite) tensor holds in plain tensors."""
    if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
        return t.numel() * t.element_size()
    names = getattr(t, "__tensor_flatten__", lambda: ([], None))()[0]
    return sum(_nbytes(getattr(t, n)) for n in names) if names else t.numel() * t.element_size()


def _module_bytes(mod) -> int:
    return sum(_nbytes(t) for t in mod.state_dict().values() if isinstance(t, torch.Tensor))


def rows(w: torch.Tensor, x: torch.Tensor):
    """(name, make): make() returns (fn, weight bytes); w is the float32 [N, K] weight."""
    from lowbit.kernels import get_backend
    tb = get_backend("triton")

    n, k = w.shape

    def bf16():
        wb = w.to(torch.bfloat16)
        return (lambda: x @ wb.T), wb.numel() * 2

    def lowbit_linear(scheme, act=None):
        def make():
            qt = lowbit.quantize(w, scheme)
            return (lambda: lowbit.linear(x, qt, act_scheme=act)), qt.nbytes
        return make

    def w8a8_fused():  # activations already int8: the GEMM with its epilogue alone
        qt = lowbit.quantize(w, "int8-sym")
        xq, xs, _ = lowbit.ops.quantize_per_token(x.float(), 8, True)
        return (lambda: tb.int8_linear(xq, None, qt.codes, xs, qt.scale, None, torch.bfloat16)), qt.nbytes

    def w4a8_qta8o():  # integer W4A8: int8 in, int8 out, requantization fused
        qt = lowbit.quantize(w, f"int4-asym-g{GROUP}")
        xq, xs, xz = lowbit.ops.quantize_per_token(x.float(), 8, True)
        s, z = qt.scale.reshape(n, -1), qt.zero_point.reshape(n, -1)
        os_, oz = torch.full_like(xs, 0.05), torch.zeros_like(xz)
        return (lambda: tb.linear_qta8a_qga4w_qta8o(xq, xs, xz, qt.codes, s, z, GROUP, os_, oz, None)), qt.nbytes

    def torchao(config_name, **kw):
        def make():
            import torchao.quantization as tq

            lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            lin.weight.data.copy_(w)
            tq.quantize_(lin, getattr(tq, config_name)(**kw))
            return (lambda: lin(x)), _module_bytes(lin)
        return make

    def gemlite(helper_name, int4=False):
        def make():
            import gemlite.helper as gh

            helper = getattr(gh, helper_name)(device="cuda:0", dtype=torch.bfloat16)
            if int4:  # weights (q - z) * s, q unsigned 4-bit, g128: lowbit's int4-asym-g128 codes
                qt = lowbit.quantize(w, f"int4-asym-g{GROUP}")
                q = lowbit.ops.unpack_bits(qt.codes, 4, signed=False).to(torch.uint8)
                lin = helper.from_weights(W_q=q, scales=qt.scale.reshape(n, -1).to(torch.bfloat16),
                                          zeros=qt.zero_point.reshape(n, -1).to(torch.bfloat16))
            else:
                ref = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
                ref.weight.data.copy_(w)
                lin = helper.from_linear(ref)
            return (lambda: lin(x)), _module_bytes(lin)
        return make

    yield "torch.matmul bf16 weight", bf16
    yield f"lowbit W4A16 int4-asym-g{GROUP}", lowbit_linear(f"int4-asym-g{GROUP}")
    yield f"lowbit W4A16 int4-sym-g{GROUP}", lowbit_linear(f"int4-sym-g{GROUP}")
    yield "lowbit W8A16 int8-sym", lowbit_linear("int8-sym")
    yield "lowbit W8A8 dyn. per-token (linear)", lowbit_linear("int8-sym", "int8-sym-token")
    yield "lowbit W8A8 int8 GEMM+epilogue only", w8a8_fused
    yield f"lowbit W4A8 qta8o g{GROUP} (int8 in/out)", w4a8_qta8o
    yield f"peer torchao Int4WeightOnly g{GROUP}", torchao("Int4WeightOnlyConfig", group_size=GROUP)
    yield "peer torchao Int8DynAct-Int8W", torchao("Int8DynamicActivationInt8WeightConfig")
    yield f"peer gemlite A16W4 g{GROUP}", gemlite("A16W4_HQQ_INT", int4=True)
    yield "peer gemlite A8W8 int8 dynamic", gemlite("A8W8_int8_dynamic")


def peak_extra_bytes(fn) -> int:
    """Memory a call allocates beyond what is live before it (the float weight would
    be N * K * 2 bytes if a kernel materialized it)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="*", help="NxK, e.g. 4096x4096")
    p.add_argument("--m", nargs="*", type=int, default=MS)
    p.add_argument("--rows", nargs="*", help="only the rows whose name contains one of these words "
                   "(the bf16 baseline always runs), e.g. W4A16 gemlite")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("matmul_gpu: no CUDA device; nothing to measure")
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"\n#### GPU: {torch.cuda.get_device_name()}; copy bandwidth (1 GiB device copy): {bw:.0f} GB/s; "
          f"lowbit backends for cuda: {lowbit.available_backends('cuda')}")
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda") * 0.02
        for m in args.m:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            print(f"\n== M={m} N={n} K={k} activations bfloat16 (GPU)")
            print(f"{'':<40}{'call ms':>9}{'vs bf16':>9}{'graph ms':>10}{'vs bf16':>9}{'GB/s':>8}"
                  f"{'% copy bw':>10}")
            t_bf16 = g_bf16 = None
            for name, make in rows(w, x):
                if args.rows and not name.startswith("torch.matmul") and not any(r in name for r in args.rows):
                    continue
                try:
                    fn, wbytes = make()
                    t = bench(fn)
                except Exception as e:  # a peer missing, or refusing this shape
                    msg = str(e).splitlines()[0][:70] if str(e) else ""
                    print(f"{name:<40}  n/a ({type(e).__name__}: {msg})")
                    continue
                t_bf16 = t if t_bf16 is None else t_bf16
                try:
                    g = bench_graph(make)
                except Exception as e:  # a host sync inside the call cannot be captured
                    msg = str(e).splitlines()[0][:60] if str(e) else ""
                    print(f"{name:<40}{t * 1e3:>9.4f}{t_bf16 / t:>9.2f}  graph n/a ({type(e).__name__}: {msg})")
                    continue
                g_bf16 = g if g_bf16 is None else g_bf16
                gbs = wbytes / g / 1e9
                print(f"{name:<40}{t * 1e3:>9.4f}{t_bf16 / t:>9.2f}{g * 1e3:>10.4f}{g_bf16 / g:>9.2f}{gbs:>8.0f}"
                      f"{100 * gbs / bw:>9.0f}%")
                if name.startswith("lowbit W4A16") and "asym" in name:
                    extra = peak_extra_bytes(fn)
                    print(f"{'  (peak extra memory of one call)':<40}{extra / 2**20:>9.2f} MiB; "
                          f"a bf16 copy of W would be {n * k * 2 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
