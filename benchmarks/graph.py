"""Does the compiler fuse the dequantize into the matmul on its own?  PyTorch Inductor
on CPU, asked with the bundled SmolLM2-135M (float32) as torch.export programs.

    python benchmarks/graph.py                          # w4a16-g128, 512-token prefill, 3 rounds
    python benchmarks/graph.py --recipes w4a16-g128 w8a16
    python benchmarks/graph.py --quick                  # 64-token prefill, 1 round, w4a16-g128
    python benchmarks/graph.py --modes eager            # no torch.compile (it takes minutes)

From one exported float program (``lowbit.passes.export``) it builds, per recipe:

* float:   the export of the float model;
* unfused: ``quantize_weights(ep, recipe)``: codes, scales and zero points as buffers and
  plain aten ops that dequantize them before each decoder ``aten.linear`` (a float
  copy of each weight is made at every call, unless a compiler fuses it away);
* fused:   ``fuse(unfused)``: ``lowbit.weight_only_matmul`` (lowbit's C++ kernels),
  no float copy of a weight;

and runs each as ``ep.module()`` (eager) and ``torch.compile(ep.module())`` (Inductor,
default options: no freezing, no max-autotune, so the weights stay graph inputs and
Inductor cannot constant-fold the dequantize away).  The programs have no KV cache:
"one-token forward" is a forward of a 1-token input, which streams every weight once
as a decode step does, not a decode step of a real generation.

Speed: the prefill (one forward of ``--prefill`` real tokens of English text) in
tokens/s and the one-token forward in forwards/s; variants alternate round-robin
(each round starts one variant further on) for ``--rounds`` rounds and each row is
the median of its rounds, as this machine drifts and is shared.  Compile time (the
first call of each input shape, in a fresh, empty Inductor cache) is excluded from the
speeds and printed on its own.  Memory: the state dict's bytes (distinct storages);
the peak of tensor bytes alive at once over one forward (torch.profiler's allocation
events: exact, and blind to the C library's heap); and the peak RSS increase over one
forward, each variant built again in a fresh subprocess and warmed up, read from
/proc/self/status (VmHWM, reset through /proc/self/clear_refs after malloc_trim, with
glibc's mmap threshold fixed so that freed tensors leave RSS; ``--memory profiler``
skips these subprocesses).  RSS peaks depend on the allocator's state: for the unfused
programs they moved by 10-20 MiB between runs, and came out up to 2x higher when
measured in a process that had run other variants; the tensor peak does not move.
Accuracy: max |logit difference| against the eager reference,
``lowbit.quantize_model(m, recipe)`` for the quantized rows and the float model for
the float rows.

Whether Inductor fused the dequantize into the matmul is read from the code Inductor
generates for each compiled graph: every ``extern_kernels.mm/addmm`` call is sorted by
where its weight operand comes from, a graph input (a stored weight) or a buffer
computed inside the graph (a dequantized float weight, written to memory in full
before the matmul reads it), and the bytes of those buffers are summed.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from unittest import mock

import torch

import lowbit
from lowbit.evaluation import default_corpus
from lowbit.passes import export, fuse, lower, op_counts, quantize_weights

MODES = ("eager", "compiled")
OPS = ("lowbit.weight_only_matmul", "aten.linear", "aten.bitwise_and")
MiB = 2**20


# -- building ---------------------------------------------------------------------------------
def prompt_ids(tok, n: int) -> torch.Tensor:
    text, _ = default_corpus()
    ids = tok(text[: 40 * n + 1000]).input_ids
    while len(ids) < n:
        ids = ids + ids
    return torch.tensor(ids[:n], dtype=torch.int64)[None]


def programs(ep, recipes: list[str]) -> dict:
    """name -> ExportedProgram: "float", "<recipe> unfused", "<recipe> fused"."""
    out = {"float": ep}
    for r in recipes:
        q = quantize_weights(ep, r)
        out[f"{r} unfused"] = q
        out[f"{r} fused"] = fuse(q)
    return out


def recipe_of(program: str) -> str | None:
    return None if program == "float" else program.rsplit(" ", 1)[0]


def state_bytes(ep) -> tuple[int, int]:
    """(bytes of the state dict's distinct storages, of which float 2-D decoder weights
    (``model.layers.*.weight``: not the quantized weights' float scales))."""
    seen, total, decoder = set(), 0, 0
    for key, t in list(ep.state_dict.items()) + list(ep.constants.items()):
        if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
        if key.startswith("model.layers.") and key.endswith(".weight") and t.is_floating_point() and t.dim() == 2:
            decoder += t.untyped_storage().nbytes()
    return total, decoder


def graph_float_weights(ep) -> int:
    """Bytes of float weights the eager program computes per forward: every aten.linear
    whose weight operand is computed in the graph rather than read from the state."""
    total = 0
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
            w = node.args[1]
            if w.op != "placeholder":
                v = w.meta["val"]
                total += v.numel() * v.element_size()
    return total


# -- Inductor's generated code -------------------------------------------------------------------
def _call_args(line: str, start: int) -> list[str]:
    """The top-level arguments of the call whose '(' is at ``start``."""
    depth, cur, out = 0, [], []
    for ch in line[start + 1:]:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur).strip())
    return out


def inductor_evidence(code: str, elsize: int) -> dict:
    """What one compiled graph does with weights: extern mm/addmm calls by where the weight
    operand comes from, bytes of the float weights computed in the graph, lowbit and
    packed weight-only calls, generated C++ kernels."""
    ev = {"mm_stored": 0, "mm_computed": 0, "computed_bytes": 0, "lowbit_calls": 0, "woq_packed_calls": 0,
          "cpp_kernels": 0, "example": None}
    lines = code.splitlines()
    allocs = {}
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("#"):
            continue
        if (a := re.match(r"(\w+) = empty_strided_cpu\(\(([^)]*)\)", s)):
            allocs[a.group(1)] = (i, a.group(2))
        if re.match(r"cpp_fused\w*\(", s):
            ev["cpp_kernels"] += 1
        if re.search(r"= torch\.ops\.lowbit\.weight_only_matmul\.default\(", s):
            ev["lowbit_calls"] += 1
        if re.search(r"(_weight_int[48]pack_mm\w*|mkldnn\._linear_pointwise\w*|mkl\._mkl_linear\w*|"
                     r"_dyn_quant_matmul\w*)(\.default)?\(", s):
            ev["woq_packed_calls"] += 1
        m = re.search(r"extern_kernels\.(mm|addmm)\(", s)
        if not m:
            continue
        args = _call_args(s, m.end() - 1)
        w = args[1] if m.group(1) == "mm" else args[2]
        r = re.match(r"reinterpret_tensor\((\w+), \(([^)]*)\)", w)
        root, shape = (r.group(1), r.group(2)) if r else (w, None)
        if root.startswith("arg"):
            ev["mm_stored"] += 1
            continue
        ev["mm_computed"] += 1
        dims = [int(d) for d in (shape or "").split(",") if d.strip().isdigit()]
        ev["computed_bytes"] += elsize * (eval_prod(dims) if dims else 0)
        if ev["example"] is None:
            src = allocs.get(root)
            ev["example"] = ([lines[src[0]].strip()] if src else []) + [s]
    return ev


def eval_prod(dims: list[int]) -> int:
    p = 1
    for d in dims:
        p *= d
    return p


# -- memory ---------------------------------------------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return -1


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _trim() -> None:
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def fixed_mmap_threshold() -> bool:
    """glibc: serve every allocation of 128 KiB or more by its own mmap, released on free
    (``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc raising the threshold as large
    blocks are freed).  RSS then follows the tensors alive, not what the heap kept from
    earlier allocations, and a peak does not depend on what the process ran before."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(-3, 128 * 1024))


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_increase(fn, reps: int = 3) -> tuple[int, str]:
    """Peak RSS increase over ``fn()`` (bytes; the median of ``reps`` calls) and how it was
    measured."""
    peaks = []
    for _ in range(reps):
        _trim()
        if not _reset_peak():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            fn()
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, "ru_maxrss (lower bound)"
        base = _status("VmRSS")
        fn()
        peaks.append(_status("VmHWM") - base)
    return int(statistics.median(peaks)), f"VmHWM (median of {reps} forwards)"


def tensor_peak(fn) -> int:
    """The most bytes of tensors allocated during ``fn()`` and alive at once (beyond those
    alive before it): torch.profiler's allocation events, summed in time order.  Exact
    and free of the C library's heap: it counts tensors, not pages."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def child(args) -> None:
    """Build one variant in this fresh process, warm it up, measure one forward of each shape."""
    program, mode = args.child, args.child_mode
    m, tok = lowbit.load_model()
    m.requires_grad_(False)
    ids = prompt_ids(tok, args.prefill)
    one = ids[:, :1]
    ep = export(m)
    recipe = recipe_of(program)
    if recipe is not None:
        q = quantize_weights(ep, recipe)
        prog = fuse(q) if program.endswith("fused") and not program.endswith("unfused") else q
        del q
    else:
        prog = ep
    mod = prog.module()
    del ep, m
    fn = torch.compile(mod) if mode == "compiled" else mod
    out = {}
    with torch.inference_mode():
        for x in (ids, one, ids, one):  # compiles (the Inductor cache is warm) and warms up
            fn(x)
        out["proc_peak"] = _status("VmHWM")  # ru_maxrss would include the parent's, from before the exec
        out["fixed"] = fixed_mmap_threshold()
        _trim()
        out["rss_built"] = _status("VmRSS")
        out["one"], out["how"] = peak_increase(lambda: fn(one))
        out["prefill"], _ = peak_increase(lambda: fn(ids))
    print("CHILD_RESULT " + json.dumps(out), flush=True)


def run_child(program: str, mode: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", program, "--child-mode", mode,
           "--prefill", str(args.prefill)] + (["--threads", str(args.threads)] if args.threads else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    for line in res.stdout.splitlines():
        if line.startswith("CHILD_RESULT "):
            return json.loads(line[len("CHILD_RESULT "):])
    tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    return {"error": f"child rc={res.returncode}: {tail[0][:100]}"}


# -- timing -----------------------------------------------------------------------------------------
def time_once(fn, x) -> float:
    t = time.perf_counter()
    fn(x)
    return time.perf_counter() - t


def time_median(fn, x, min_time: float = 0.3, min_n: int = 3, max_n: int = 20, budget: float = 3.0) -> float:
    """Median of calls: at least ``min_n`` and ``min_time`` s, at most ``max_n`` calls; calls
    stop after ``budget`` s (slow variants get fewer samples per round)."""
    times, t0 = [], time.perf_counter()
    while True:
        times.append(time_once(fn, x))
        el = time.perf_counter() - t0
        if len(times) >= max_n or (len(times) >= min_n and el >= min_time) or el >= budget:
            return statistics.median(times)


def short_error(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:90]}"


class Variant:
    def __init__(self, program: str, mode: str, ep):
        self.program, self.mode, self.ep = program, mode, ep
        self.name = f"{program} {mode}"
        self.fn = None
        self.error = None
        self.trace = None
        self.compile_s: dict[str, float] = {}
        self.codes: dict[str, list[str]] = {}
        self.diff = float("nan")
        self.prefill: list[float] = []
        self.one: list[float] = []
        self.mem: dict = {}


def warm_up(v: Variant, inputs: dict, refs: dict) -> None:
    """Build the callable, compile (timing each shape's first call and keeping the code
    Inductor writes for it), check the logits against the reference, warm up."""
    from torch._inductor.graph import GraphLowering

    mod = v.ep.module()
    fn = torch.compile(mod) if v.mode == "compiled" else mod
    diffs = []
    try:
        for label, x in inputs.items():
            codes: list[str] = []
            with mock.patch.object(GraphLowering, "save_output_code", lambda code: codes.append(code)):
                t = time.perf_counter()
                y = fn(x)
                first = time.perf_counter() - t
            if v.mode == "compiled":
                v.compile_s[label], v.codes[label] = first, codes
            diffs.append((y.float() - refs[label]).abs().max().item())
        for x in inputs.values():
            fn(x)
    except Exception as e:  # noqa: BLE001 (a compile failure is a row of the table, not a crash)
        v.error, v.trace = short_error(e), traceback.format_exc()
        return
    v.fn, v.diff = fn, max(diffs)


# -- printing -----------------------------------------------------------------------------------
def machine() -> None:
    from lowbit.kernels import cpu as cpu_kernels

    f = cpu_kernels.features()
    mem = _meminfo("MemTotal")
    print(f"cpu: {f['cpu']}; {os.cpu_count()} logical cpus; memory {mem / 2**30:.1f} GiB")
    print(f"cpu features lowbit uses: {' '.join(f['machine']) or '-'}; lowbit._C compiled for: "
          f"{' '.join(f['compiled']) or '-'}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {_loadavg()}")


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}" if b and a == a and b == b else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="prefill 64, 1 round, w4a16-g128 only, no memory subprocesses (a smoke test; compiling "
                         "still takes ~5 min)")
    ap.add_argument("--recipes", nargs="+", default=["w4a16-g128"])
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill forward")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                    help="eager and/or compiled; compiling the model takes ~30-60 s per program and input shape")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--memory", choices=["subprocess", "profiler", "none"],
                    help="subprocess (default): the peak of tensor memory over one forward (torch.profiler, in "
                         "this process) and the peak RSS increase over one forward in a fresh subprocess per "
                         "variant (~25 s per eager and ~60 s per compiled variant on 2 idle cores); profiler "
                         "(the --quick default): tensor memory only; none")
    ap.add_argument("--dump-code", metavar="DIR", help="write the code Inductor generates for each graph here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-mode", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.prefill, args.rounds, args.recipes = 64, 1, ["w4a16-g128"]
    args.memory = args.memory or ("profiler" if args.quick else "subprocess")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return

    own_cache = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    if own_cache:  # compile times from an empty cache; the memory subprocesses then reuse it
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="lowbit-graph-inductor-")
    try:
        run(args)
    finally:
        if own_cache:
            shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def run(args) -> None:
    t_start = time.perf_counter()
    machine()
    m, tok = lowbit.load_model()
    m.requires_grad_(False)
    dtype = next(m.parameters()).dtype
    elsize = torch.empty(0, dtype=dtype).element_size()
    ids = prompt_ids(tok, args.prefill)
    inputs = {"prefill": ids, "one": ids[:, :1]}
    print(f"model: bundled SmolLM2-135M, {dtype}; prefill {args.prefill} tokens of English text "
          f"(pydoc topics); one-token forward: seq 1 of the same program (no KV cache in these programs: "
          f"it reads every weight once, as a decode step does, but attends to nothing)")

    t = time.perf_counter()
    ep = export(m)
    progs = programs(ep, args.recipes)
    print(f"exported and rewrote {len(progs)} programs in {time.perf_counter() - t:.0f} s")

    # eager references: the float model, lowbit.quantize_model per recipe
    refs = {}
    with torch.inference_mode():
        refs[None] = {k: m(input_ids=x, use_cache=False).logits.float() for k, x in inputs.items()}
        for r in args.recipes:
            qm = lowbit.quantize_model(m, r, inplace=False)
            refs[r] = {k: qm(input_ids=x, use_cache=False).logits.float() for k, x in inputs.items()}
            del qm

    variants = [Variant(p, mode, prog) for p, prog in progs.items() for mode in args.modes]
    with torch.inference_mode():
        for v in variants:
            t = time.perf_counter()
            warm_up(v, inputs, refs[recipe_of(v.program)])
            status = f"error: {v.error}" if v.error else f"max|dlogit| {v.diff:.3g}"
            print(f"  built {v.name:<28} {time.perf_counter() - t:6.1f} s  {status}", flush=True)
            if args.dump_code:
                os.makedirs(args.dump_code, exist_ok=True)
                for label, codes in v.codes.items():
                    for i, code in enumerate(codes):
                        name = re.sub(r"\W+", "_", f"{v.name}_{label}_{i}") + ".py"
                        with open(os.path.join(args.dump_code, name), "w") as f:
                            f.write(code)

        live = [v for v in variants if v.fn is not None]
        for rnd in range(args.rounds):
            order = live[rnd % len(live):] + live[:rnd % len(live)] if live else []
            for v in order:
                v.prefill.append(args.prefill / time_once(v.fn, inputs["prefill"]))
                v.one.append(1 / time_median(v.fn, inputs["one"]))
            print(f"round {rnd + 1}/{args.rounds} done ({time.perf_counter() - t_start:.0f} s so far)", flush=True)

    for v in variants:
        if v.error is not None:
            continue
        if args.memory != "none":
            with torch.inference_mode():
                v.mem["tensors"] = {k: tensor_peak(lambda x=x: v.fn(x)) for k, x in inputs.items()}
        if args.memory == "subprocess":
            v.mem["subprocess"] = run_child(v.program, v.mode, args)
            print(f"  memory of {v.name:<28} measured in a subprocess ({time.perf_counter() - t_start:.0f} s "
                  f"so far)", flush=True)

    report(args, variants, progs, elsize)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; load average {_loadavg()}")


def report(args, variants: list[Variant], progs: dict, elsize: int) -> None:
    by = {(v.program, v.mode): v for v in variants}

    def med(v, what):
        vals = getattr(v, what)
        return statistics.median(vals) if vals else float("nan")

    print(f"\n== speed: median of {args.rounds} alternating round(s); compile time excluded (first call of each "
          f"shape, empty Inductor cache, printed on its own); ratios > 1: faster")
    for what, unit, title in (("prefill", "tok/s", f"prefill ({args.prefill} tokens)"),
                              ("one", "fwd/s", "one-token forward (seq 1, no KV cache)")):
        base = by.get(("float", "eager"))
        base = med(base, what) if base else None
        print(f"\n{title}")
        head = (f"{'program':<24}{'mode':<10}{unit:>9}{'/float eager':>13}{'/unfused eager':>15}"
                f"{'/unfused compiled':>18}{'compile s':>11}")
        print(head)
        print("-" * len(head))
        for v in variants:
            r = recipe_of(v.program)
            ue = by.get((f"{r} unfused", "eager")) if r else None
            uc = by.get((f"{r} unfused", "compiled")) if r else None
            comp = f"{v.compile_s[what]:.0f}" if what in v.compile_s else "-"
            if v.error:
                print(f"{v.program:<24}{v.mode:<10}  failed: {v.error}")
                continue
            x = med(v, what)
            print(f"{v.program:<24}{v.mode:<10}{x:>9.1f}{ratio(x, base):>13}"
                  f"{ratio(x, med(ue, what) if ue and ue.fn is not None else None):>15}"
                  f"{ratio(x, med(uc, what) if uc and uc.fn is not None else None):>18}{comp:>11}")

    sub = args.memory == "subprocess"
    print("\n== memory and accuracy (tensors: the peak of tensor bytes allocated over one forward and alive at "
          "once, from torch.profiler" + ("; RSS: the peak RSS increase over one forward after warm-up, in a fresh "
                                          "process per variant" if sub else "")
          + "; float weights written: per forward, from the FX graph (eager) or Inductor's code (compiled))")
    memcols = f"{'tensors 1-tok':>14}{'tensors prefill':>16}" if args.memory != "none" else ""
    if sub:
        memcols += f"{'RSS 1-tok':>10}{'RSS prefill':>12}{'proc max':>9}"
    head = (f"{'program':<24}{'mode':<10}{'state':>7}{'f32 dec.':>9}{'wts written':>12}"
            f"{memcols}{'max|dlogit|':>13}")
    print("all in MiB")
    print(head)
    print("-" * len(head))
    how = set()
    for v in variants:
        total, dec = state_bytes(v.ep)
        if v.mode == "compiled":
            evs = [inductor_evidence(c, elsize) for c in v.codes.get("one", [])]
            written = f"{sum(e['computed_bytes'] for e in evs) / MiB:.1f}" if evs else "-"
        else:
            written = f"{graph_float_weights(v.ep) / MiB:.1f}"
        if v.error:
            print(f"{v.program:<24}{v.mode:<10}{total / MiB:>7.1f}{dec / MiB:>9.1f}  failed: {v.error}")
            continue
        cols = ""
        if "tensors" in v.mem:
            cols += f"{v.mem['tensors']['one'] / MiB:>14.1f}{v.mem['tensors']['prefill'] / MiB:>16.1f}"
        if sub:
            mem = v.mem.get("subprocess", {})
            if "error" in mem:
                cols += f"  ({mem['error']})  "
            else:
                how.add(mem["how"] + ("" if mem.get("fixed") else " (glibc mmap threshold not fixed)"))
                cols += f"{mem['one'] / MiB:>10.1f}{mem['prefill'] / MiB:>12.1f}{mem['proc_peak'] / MiB:>9.0f}"
        print(f"{v.program:<24}{v.mode:<10}{total / MiB:>7.1f}{dec / MiB:>9.1f}{written:>12}{cols}"
              f"{v.diff:>13.3g}")
    print("state: distinct storages of the program's state dict (the tied embedding / lm_head counted once); "
          "f32 dec.: of which float 2-D decoder weights (none in the quantized programs: the float copy, where "
          "there is one, is made at run time, see 'wts written')")
    if sub:
        print("RSS: read from " + (", ".join(sorted(how)) or "-") + " after gc and malloc_trim, with glibc's "
              "mmap threshold fixed at 128 KiB (every block of 128 KiB or more has its own pages, returned on "
              "free); proc max: the subprocess's VmHWM before those forwards (model load, export, compile and "
              "warm-up included)")
    print("max|dlogit|: vs lowbit.quantize_model(m, recipe) run eagerly (quantized rows), vs the float model "
          "(float rows); the larger of the prefill and the one-token forward")

    print("\n== op counts per program")
    head = f"{'program':<24}" + "".join(f"{o:>28}" for o in OPS)
    print(head)
    print("-" * len(head))
    for p, prog in progs.items():
        c = op_counts(prog)
        print(f"{p:<24}" + "".join(f"{c[o]:>28}" for o in OPS))
    for p, prog in progs.items():
        if p.endswith(" fused"):
            plans = {}
            for node in lower(prog).graph.nodes:
                rec = node.meta.get("custom", {}).get("lowbit_kernels")
                if rec:
                    for key in ("M=1", "M=512"):
                        plans.setdefault(key, set()).add(rec[key])
            for key, found in plans.items():
                print(f"{p}: lowbit kernel at {key} (lowbit.passes.lower, this machine): {'; '.join(sorted(found))}")

    compiled = [v for v in variants if v.mode == "compiled"]
    if not compiled:
        return
    print("\n== what Inductor generated (per compiled graph; mm = extern_kernels.mm/addmm, by where the weight "
          "operand comes from)")
    head = (f"{'program':<24}{'graph':<9}{'graphs':>7}{'mm: stored w':>14}{'mm: w computed':>16}"
            f"{'float w MiB':>13}{'lowbit calls':>14}{'packed woq':>12}{'C++ calls':>11}")
    print(head)
    print("-" * len(head))
    example = None
    for v in compiled:
        if v.error and not v.codes:
            print(f"{v.program:<24}{'-':<9}  failed: {v.error}")
            continue
        for label in ("prefill", "one"):
            codes = v.codes.get(label, [])
            if not codes:
                print(f"{v.program:<24}{label:<9}{0:>7}  (no code captured: an Inductor cache hit, or no compile)")
                continue
            evs = [inductor_evidence(c, elsize) for c in codes]
            s = {k: sum(e[k] for e in evs) for k in ("mm_stored", "mm_computed", "computed_bytes",
                                                     "lowbit_calls", "woq_packed_calls", "cpp_kernels")}
            print(f"{v.program:<24}{label:<9}{len(codes):>7}{s['mm_stored']:>14}{s['mm_computed']:>16}"
                  f"{s['computed_bytes'] / MiB:>13.1f}{s['lowbit_calls']:>14}{s['woq_packed_calls']:>12}"
                  f"{s['cpp_kernels']:>11}")
            if example is None and v.program.endswith("unfused"):
                example = next((e["example"] for e in evs if e["example"]), None)
    print("packed woq: calls of Inductor's own weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm, "
          "mkldnn/mkl linear): nonzero if its pattern matcher had turned a dequantize + mm into one of them")
    if example:
        print("\nexample from an unfused graph (the dequantized weight is allocated in full, written by a C++ kernel, "
              "then read by the matmul):")
        for line in example:
            print("    " + (line if len(line) <= 200 else line[:200] + " ..."))

    print("\n== answer (from the counts above)")
    for r in args.recipes:
        uc = by.get((f"{r} unfused", "compiled"))
        fc = by.get((f"{r} fused", "compiled"))
        fe = by.get((f"{r} fused", "eager"))
        if uc is None or uc.error:
            print(f"{r}: the unfused program did not compile ({uc.error if uc else 'not run'})")
            continue
        evs = [inductor_evidence(c, elsize) for cs in uc.codes.values() for c in cs]
        computed = sum(e["mm_computed"] for e in evs)
        packed = sum(e["woq_packed_calls"] for e in evs)
        n_q = op_counts(progs[f"{r} unfused"])["aten.linear"] - op_counts(progs[f"{r} fused"])["aten.linear"]
        verdict = ("no" if computed and not packed else "yes" if packed and not computed else "partly")
        print(f"{r}: fused by Inductor? {verdict}: of the {n_q} quantized linears per graph, "
              f"{computed // max(len(evs), 1)} are an extern mm reading a float weight Inductor computed into "
              f"memory first; {packed} packed weight-only calls")
        for what, label in (("prefill", "prefill"), ("one", "one-token")):
            parts = []
            if fc and fc.fn is not None:
                parts.append(f"compiled unfused / compiled fused = {med(uc, what) / med(fc, what):.2f}")
            if fe and fe.fn is not None:
                parts.append(f"compiled unfused / eager fused = {med(uc, what) / med(fe, what):.2f}")
            print(f"    {label} speed: " + "; ".join(parts))


if __name__ == "__main__":
    main()
