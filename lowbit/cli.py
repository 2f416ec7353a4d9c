"""The ``lowbit`` command.  Without a MODEL argument every command uses the bundled
SmolLM2-135M-Instruct (GGUF Q4_1); ``lowbit COMMAND --help`` describes a command and
shows examples.

Example::

    $ lowbit quantize --recipe w4a16-g128 -o smollm2-w4a16     # quantize and save
    $ lowbit eval smollm2-w4a16                                  # perplexity, KL, speed vs float
    $ lowbit eval --compare w8a16 w4a16-g64 w8a8 --json          # several recipes in one table
    $ lowbit generate smollm2-w4a16 "Tell me about Paris."       # chat, fast decode
    $ lowbit info smollm2-w4a16                                  # what a checkpoint holds
    $ lowbit export smollm2-w4a16 --format gguf -o smollm2.gguf  # for llama.cpp
    $ lowbit export smollm2-w4a16 --format compressed-tensors -o smollm2-ct   # for vLLM, transformers
    $ lowbit demo                                                # weight error of every linear at several schemes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING
from pathlib import Path

if TYPE_CHECKING:
    from lowbit.recipe import Recipe

EXPORT_FORMATS = ("gguf", "compressed-tensors")
DEMO_SCHEMES = [
    # SmolLM2's in_features are 576 and 1536: group sizes must divide 576 = 9 * 64.
    "int8-sym", "int8-asym", "int4-asym-channel", "int4-sym-g64", "int4-asym-g64", "int4-asym-g32",
    "int4-asym-g32-zpfloat-f16", "int4-asym-g32-zpmin-f16", "int3-asym-g64", "int2-asym-g64", "int2-asym-g64-zpfloat",
]


def demo(model: str | None = None, schemes: list[str] | None = None, limit: int | None = None,
         quiet: bool = False) -> list[dict]:
    """Quantize every decoder linear weight of a GGUF model (default: the bundled
    SmolLM2-135M) at several schemes and print what each costs in error and bytes.

    ``schemes`` (None: ``DEMO_SCHEMES``) must name at least one scheme and ``limit`` (None:
    all) be at least 1; both are checked before any weight is read.  Returns one dict per
    scheme with the figures printed.

    Example::

        >>> from lowbit.cli import demo
        >>> rows = demo(schemes=["int8-sym"], limit=2, quiet=True)
        >>> rows[0]["scheme"], rows[0]["bits_per_weight"] > 8, rows[0]["worst_err_over_half_step"] <= 1.0001
        ('int8-sym', True, True)
    """
    import lowbit
    from lowbit.kernels.reference import to_blocks
    from lowbit.models import read_gguf_linear_weights

    def say(line=""):
        if not quiet:
            print(line, flush=True)

    if schemes is None:
        schemes = DEMO_SCHEMES
    if isinstance(schemes, str) or not schemes:
        raise ValueError(f"schemes: expected a non-empty list of scheme names, got {schemes!r}")
    parsed = []
    for name in schemes:
        try:
            parsed.append(lowbit.QuantScheme.parse(name))
        except (ValueError, TypeError) as e:
            raise ValueError(f"schemes: {name!r}: {e}") from None
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit: expected an integer >= 1 (or None: every weight), got {limit!r}")
    t0 = time.perf_counter()
    weights = read_gguf_linear_weights(model, limit=limit)
    numel = sum(w.numel() for w, _ in weights.values())
    kinds = sorted({k for _, k in weights.values()})
    say(f"{len(weights)} linear weights, {numel / 1e6:.1f}M values (stored as {', '.join(kinds)}), "
        f"read in {time.perf_counter() - t0:.1f}s")
    say("error: relative RMS error ||W - deq(q(W))|| / ||W||; SQNR = -20 log10 of it;")
    say("worst/half-step: max |error| over (scale/2) of its block, <= 1 by construction")
    say()
    header = f"{'scheme':<28}{'bits/weight':>12}{'rel. error':>12}{'SQNR dB':>9}{'worst/half-step':>17}{'quantize s':>12}"
    say(header)
    say("-" * len(header))
    rows = []
    for s in parsed:
        err2 = ref2 = 0.0
        nbytes, worst, seconds = 0, 0.0, 0.0
        for w, _ in weights.values():
            t = time.perf_counter()
            qt = lowbit.quantize(w, s)
            seconds += time.perf_counter() - t
            e = (lowbit.dequantize(qt) - w).double()
            err2 += float((e * e).sum())
            ref2 += float((w.double() ** 2).sum())
            nbytes += qt.nbytes
            per_block = to_blocks(e.abs(), s).amax(dim=1)
            worst = max(worst, float((per_block / (qt.scale.double().reshape(-1) / 2)).max()))
        rel = math.sqrt(err2 / ref2)
        row = dict(scheme=str(s), bits_per_weight=nbytes * 8 / numel, rel_error=rel,
                   sqnr_db=-20 * math.log10(rel) if rel > 0 else math.inf, worst_err_over_half_step=worst,
                   quantize_seconds=seconds)
        rows.append(row)
        say(f"{row['scheme']:<28}{row['bits_per_weight']:>12.3f}{rel:>12.2e}{row['sqnr_db']:>9.1f}"
            f"{worst:>17.4f}{seconds:>12.2f}")
    if "Q4_1" in kinds:
        say()
        say("The weights were stored as GGUF Q4_1 (4-bit, group 32, fp16 scale and min: d * q + m), so")
        say("the min zero point scheme int4-asym-g32-zpmin-f16 (the same form) lands back on their grid")
        say("exactly, the float zero point one ((q - z) * s) almost, and an integer zero point")
        say("(int4-asym-g32) adds a second rounding.")
    return rows


def _float_dtype(name: str):
    return _dtype_names()[name]


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _with_method(recipe: str | Recipe, method: str | None, smoothquant) -> Recipe:
    """The recipe with ``--method`` / ``--smoothquant`` applied."""
    from dataclasses import replace

    from lowbit.recipe import Recipe

    r = Recipe.get(recipe)
    if method is not None and method != r.method:
        r = replace(r, method=method, method_args={}, name=f"{r.name.partition(':')[0]}:{method}")
    if smoothquant is not None:
        r = replace(r, smoothquant=smoothquant, name=f"{r.name}+sq{smoothquant}")
    return r


def _calibration(recipes, tok, calib: str | None, samples: int, length: int, seed: int = 0):
    """Calibration token ids when some recipe needs them (else None), with a line saying
    where they come from; the corpus problems surface before any quantization."""
    from lowbit.recipe import Recipe

    # observer "mse" does not need data, but weights its clipping by the inputs when it has them
    if not any(Recipe.get(r).needs_calibration or Recipe.get(r).observer == "mse" for r in recipes):
        return None
    from lowbit.evaluation import calibration_set, load_corpus

    ids = calibration_set(tok, calib, samples=samples, length=length, seed=seed)
    _err(f"calibration: {samples} x {length} tokens (seed {seed}) from the second half of "
         f"{load_corpus(calib)[1]}")
    return ids


def quantize_cmd(model: str | None, recipe: str | Recipe, output: str, dtype: str = "float32",
                 force: bool = False, backend: str | None = None, *, method: str | None = None,
                 smoothquant=None, calib: str | None = None, calib_samples: int = 128,
                 calib_len: int = 512, stream: bool = False, target_bits: float | None = None,
                 candidates: list[str] | None = None, outliers: int | None = None) -> dict:
    r"""Load MODEL, quantize it with RECIPE (a preset name, a recipe file or a ``Recipe``)
    and save a checkpoint folder; prints what it did and returns a summary.

    With ``target_bits``, RECIPE is the base of an automatic mix (which modules, method,
    activations; default ``w4a16-g128``): ``mixed_precision_recipe`` chooses each
    module's weight scheme among ``candidates`` for that average bits per weight, and
    the checkpoint folder gets ``sensitivity.csv``, ``.json`` and ``.png``.

    With ``outliers``, the recipe's decoder linears become mixed int8/int4
    (``lowbit.models.split_model``): that many input channels per linear at ``int8-sym``,
    chosen with the calibration set's input statistics, the rest at the recipe's weight
    scheme (weight-only, round to nearest); its lm_head / embedding schemes still apply.

    Example (a preset such as ``"w4a16-g128"`` quantizes all 30 layers; this recipe only
    the first layer's 7 linears, to keep the example fast)::

        >>> import tempfile, lowbit
        >>> from lowbit.cli import quantize_cmd
        >>> first_layer = lowbit.Recipe(weight="int8-sym", modules=[r"layers\.0\."])
        >>> with tempfile.TemporaryDirectory() as d:
        ...     summary = quantize_cmd(None, first_layer, d + "/smollm2-int8")  # doctest: +ELLIPSIS
        recipe custom: 7 modules quantized in ...s (method rtn)
             7 x weight int8-sym
        weights 538.1 MB -> 527.5 MB; saved to .../smollm2-int8
        >>> summary["modules"]
        7
    """
    import lowbit
    from lowbit.evaluation import weight_bytes

    if recipe is None and target_bits is None:
        raise ValueError("give --recipe, or --target-bits for an automatic mix")
    if target_bits is None and candidates is not None:
        raise ValueError("--candidates applies to --target-bits")
    if target_bits is not None and stream:
        raise ValueError("--target-bits measures every module on the loaded model; it does not --stream")
    r = _with_method(recipe or "w4a16-g128", method, smoothquant)
    if outliers is not None:
        _check_outliers(r, outliers, stream, target_bits)
    _check_output(output, force)
    if calib is not None and r.needs_calibration:
        lowbit.evaluation.load_corpus(calib)  # a missing or unreadable file: say so before loading the model
    if stream:
        return _quantize_streaming(model, r, output, dtype, force, backend, calib, calib_samples, calib_len)
    t0 = time.perf_counter()
    m, tok = lowbit.load_model(model, dtype=_float_dtype(dtype))
    _err(f"loaded {getattr(m, 'lowbit_source', model)} in {time.perf_counter() - t0:.1f}s")
    before = weight_bytes(m)["weight_bytes"]
    mix = None
    if target_bits is not None:
        r, mix = mixed_precision_recipe(m, tok, r, target_bits, candidates, calib)
    t0 = time.perf_counter()
    if outliers is None:
        ids = _calibration([r], tok, calib, calib_samples, calib_len)
        t0 = time.perf_counter()
        lowbit.quantize_model(m, r, backend=backend, progress=True, calibration=ids)
    else:
        _quantize_split(m, tok, r, outliers, backend, calib, calib_samples, calib_len)
    seconds = time.perf_counter() - t0
    staging = None
    if mix is not None:  # written (the plot too) before the checkpoint, moved in once it is saved
        import tempfile

        from lowbit.models.mixed_precision import save_sensitivity

        parent = os.path.dirname(os.path.abspath(output)) or "."
        staging = tempfile.mkdtemp(prefix=".lowbit-sensitivity-", dir=parent)
    try:
        staged = save_sensitivity(*mix, staging, target_bits) if mix is not None else []
        out = lowbit.save_quantized(m, output, tok, overwrite=force)
        for f in staged:
            os.replace(f, os.path.join(out, f.name))
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    after = weight_bytes(m)["weight_bytes"]
    counts = Counter((v["weight"] + (f" + {outliers} outlier channels {v['high']}" if v["kind"] == "split" else ""),
                      v["activation"]) for v in m.lowbit_modules.values())
    fallbacks = sum(v["weight"] != v["asked"] for v in m.lowbit_modules.values())
    run = (m.lowbit_quantization or {}).get("calibration")
    print(f"recipe {r.name}: {len(m.lowbit_modules)} modules quantized in {seconds:.1f}s (method {r.method}"
          + (f", peak memory {run['peak_rss_mb']} MB" if run else "") + ")")
    for (w, a), n in sorted(counts.items()):
        print(f"  {n:4d} x weight {w}" + (f", activations {a}" if a else ""))
    if fallbacks:
        print(f"  ({fallbacks} modules use a smaller group: their in_features is not a multiple of the asked one)")
    print(f"weights {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB; saved to {out}")
    if staged:
        print(f"sensitivity table and plot: {', '.join(f.name for f in staged)} in {out}")
    return {"recipe": r.name, "modules": len(m.lowbit_modules), "weight_bytes": after, "path": str(out)}


def _check_outliers(r, outliers: int, stream: bool, target_bits) -> None:
    """What ``--outliers`` cannot be combined with, refused before the model loads."""
    why = ("--stream" if stream else "--target-bits" if target_bits is not None
           else f"activations {r.activation}" if r.activation is not None
           else f"method {r.method}" if r.method != "rtn"
           else "smoothquant" if r.smoothquant is not None
           else "the recipe's overrides" if r.overrides else None)
    if why:
        raise ValueError(f"--outliers (int8 outlier channels + int4, weight-only, round to nearest) does not "
                         f"combine with {why}")
    if isinstance(outliers, bool) or not isinstance(outliers, int) or outliers < 1:
        raise ValueError(f"--outliers must be a positive number of input channels, got {outliers!r}")


def _quantize_split(m, tok, r, outliers: int, backend, calib, samples: int, length: int) -> None:
    """``quantize_cmd --outliers``: the recipe's lm_head / embedding as it says, then its
    decoder linears split (``split_model``) with input statistics from calibration text."""
    import dataclasses

    import lowbit
    from lowbit.evaluation import calibration_set, load_corpus
    from lowbit.models import split_model

    ids = calibration_set(tok, calib, samples=samples, length=length)
    _err(f"calibration: {samples} x {length} tokens from the second half of {load_corpus(calib)[1]}")
    if r.lm_head is not None or r.embedding is not None:
        lowbit.quantize_model(m, dataclasses.replace(r, modules=(r"(?!)",)), backend=backend)
    split_model(m, r.weight, outliers, calibration=ids, modules="|".join(f"(?:{p})" for p in r.modules),
                backend=backend)
    m.lowbit_recipe = r


def mixed_precision_recipe(model, tok, base, target_bits: float, candidates=None, calib: str | None = None,
                           samples: int = 2, length: int = 256):
    r"""The recipe ``--target-bits`` quantizes with: every module's sensitivity measured
    on ``samples`` x ``length`` calibration tokens (``measure_sensitivity``), the schemes
    allocated for ``target_bits`` (``allocate``), written as ``base``'s overrides.
    Prints the proxy's rank correlation with the measured KL and the mix; returns
    ``(recipe, (sensitivity, choice))``.

    Example::

        >>> import lowbit
        >>> from lowbit.cli import mixed_precision_recipe
        >>> model, tok = lowbit.load_model()
        >>> base = lowbit.Recipe(weight="int4-asym-g32-f16", modules=[r"layers\.0\.mlp"])  # 3 modules: fast
        >>> r, (sens, choice) = mixed_precision_recipe(model, tok, base, 6.0, ["int8-sym", "int4-asym-g32-f16"],
        ...                                            samples=1, length=32)  # doctest: +ELLIPSIS
        sensitivity: 3 modules x 2 schemes on 1 x 32 calibration tokens in ...s
        ...
        >>> sorted(set(choice.values())), r.name
        (['int4-asym-g32-f16', 'int8-sym'], 'auto-6b')
    """
    from lowbit.evaluation import calibration_set
    from lowbit.models.mixed_precision import DEFAULT_CANDIDATES, allocate, measure_sensitivity, mixed_recipe

    candidates = list(candidates or DEFAULT_CANDIDATES)
    ids = calibration_set(tok, calib, samples=samples, length=length)
    t0 = time.perf_counter()
    sens = measure_sensitivity(model, ids, base, candidates, progress=True)
    print(f"sensitivity: {len(sens.kl)} modules x {len(candidates)} schemes on {samples} x {length} calibration "
          f"tokens in {time.perf_counter() - t0:.0f}s")
    rho = sens.spearman()
    print("proxy (input-weighted weight error) vs measured KL, Spearman rank correlation: "
          + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in rho.items()))
    choice = allocate(sens, target_bits)
    counts = Counter(choice.values())
    print(f"allocation for {target_bits:g} bits/weight: {sens.bits_per_weight(choice):.3f} achieved, predicted KL "
          f"{sens.predicted_kl(choice):.4f}; "
          + ", ".join(f"{n} x {s}" for s, n in counts.most_common()))
    return mixed_recipe(base, choice, target_bits), (sens, choice)


def _quantize_streaming(model, r, output, dtype, force, backend, calib, calib_samples, calib_len) -> dict:
    """``quantize --stream``: a Hugging Face folder read and written one decoder layer at a time."""
    import resource

    from lowbit.models.checkpoint import read_metadata
    from lowbit.models.common import quiet_transformers
    from lowbit.models.load import resolve_model_path
    from lowbit.models.stream import quantize_streaming

    src = resolve_model_path(model) if model is not None else None
    if src is None or not src.is_dir() or (src / "lowbit.json").exists():
        raise ValueError(f"--stream reads a Hugging Face model folder (config.json + safetensors), got "
                         f"{str(model) if model is not None else 'the bundled GGUF model'!r}")
    tok = None
    if r.needs_calibration:
        tok = quiet_transformers().AutoTokenizer.from_pretrained(src)
    ids = _calibration([r], tok, calib, calib_samples, calib_len) if tok is not None else None
    t0 = time.perf_counter()
    out = quantize_streaming(src, output, r, calibration=ids, dtype=_float_dtype(dtype), backend=backend,
                             progress=True, overwrite=force)
    seconds = time.perf_counter() - t0
    meta = read_metadata(out)
    counts = Counter((v["weight"], v["activation"]) for v in meta["modules"].values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"recipe {r.name}: {len(meta['modules'])} modules quantized in {seconds:.1f}s, streaming "
          f"(method {r.method}, {len(meta['shards'])} shards, peak memory {peak:.0f} MB)")
    for (w, a), n in sorted(counts.items()):
        print(f"  {n:4d} x weight {w}" + (f", activations {a}" if a else ""))
    print(f"saved to {out}")
    return {"recipe": r.name, "modules": len(meta["modules"]), "path": str(out)}


def export_cmd(model: str | None, output: str, *, format: str | None = None, type: str | None = None,
               float_type: str | None = None, strict: bool = False, force: bool = False,
               recipe: str | None = None, graph: bool = False, unfused: bool = False) -> dict:
    r"""Write MODEL (a lowbit checkpoint, or a float model, quantized on the fly with
    ``recipe`` when given) as another tool's format: a GGUF file for llama.cpp
    (``format="gguf"``; prints, per source scheme, the ggml type, whether the tensors are
    stored exactly, the worst error and the file's bits per weight) or a
    compressed-tensors folder for vLLM and transformers (``format="compressed-tensors"``;
    always exact, or refused; prints the schemes and formats written).

    Example::

        >>> import tempfile, lowbit
        >>> from lowbit.cli import export_cmd
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = export_cmd(None, d + "/m.gguf", type="q8_0", float_type="q8_0")  # doctest: +ELLIPSIS
        source   ggml type  tensors  stored                max rel error  bits/weight
        float32  Q8_0       211      quantized from float  ...e-03       8.500
        float32  F32        61       float                 0 (exact)      32.000
        272 tensors, 210 not exact; 8.506 bits per weight over the whole file
        wrote .../m.gguf (144.8 MB) in ...s

    (The embedding, stored as Q8_0 in the bundled GGUF, comes back exactly: ggml's Q8_0
    quantizer finds the same codes and scales again; the Q4_1 linears do not.)

    ``graph=True`` writes a torch.export program instead (``graph_export``).
    """
    import warnings

    import lowbit

    if graph:
        if format is not None or type is not None or float_type is not None or strict:
            raise ValueError("--graph writes a torch.export program; --format, --type, --float-type and --strict "
                             "are for gguf and compressed-tensors")
        return graph_export(model, output, recipe=recipe, force=force, unfused=unfused)
    if unfused:
        raise ValueError("--unfused applies to --graph")
    format = format or "gguf"
    if format not in EXPORT_FORMATS:
        raise ValueError(f"--format must be one of {list(EXPORT_FORMATS)}, got {format!r}")
    if format == "gguf":
        from lowbit.formats.gguf_export import check_arguments

        out = os.path.abspath(check_arguments(output, type, float_type, force, "--force",
                                              ("--type", "--float-type"))[0])  # before loading
    else:
        from lowbit.formats.compressed_tensors import check_output

        for flag, value in (("--type", type), ("--float-type", float_type)):
            if value is not None:
                raise ValueError(f"{flag} applies to --format gguf; a compressed-tensors export keeps every "
                                 "scheme as it is")
        out = os.path.abspath(check_output(output, force))
    r = lowbit.Recipe.get(recipe) if recipe is not None else None
    if r is not None and format == "compressed-tensors":
        from lowbit.formats.compressed_tensors import check_recipe

        check_recipe(r)
    t0 = time.perf_counter()
    m, tok = lowbit.load_model(model)
    _err(f"loaded {model or 'the bundled model'} in {time.perf_counter() - t0:.1f}s")
    if r is not None:
        lowbit.quantize_model(m, r, progress=True)
    t0 = time.perf_counter()
    if format == "compressed-tensors":
        from lowbit.formats.compressed_tensors import export_compressed_tensors

        ct = export_compressed_tensors(m, tok, out, overwrite=force)
        print(ct.table())
        size = sum(f.stat().st_size for f in Path(out).iterdir())
        print(f"wrote {out} ({size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f}s")
        return {"path": out, "tensors": len(ct.modules) + ct.float_tensors, "inexact": 0,
                "bits_per_weight": ct.bits_per_weight}
    from lowbit.formats.gguf_export import export_gguf

    with warnings.catch_warnings(record=True) as seen:  # the table below says the same, per scheme
        warnings.simplefilter("always")
        result = export_gguf(m, tok, out, type=type, float_type=float_type, strict=strict, overwrite=force)
    for w in seen:
        if "not stored exactly" not in str(w.message):
            _err(f"warning: {w.message}")
    print(result.table())
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f}s")
    inexact = sum(not t.exact for t in result.tensors)
    return {"path": out, "tensors": len(result.tensors), "inexact": inexact,
            "bits_per_weight": result.bits_per_weight}


GRAPH_COLUMNS = ("aten.linear", "aten.bitwise_and", "lowbit.dequantize", "lowbit.weight_only_matmul",
                 "lowbit.int8_linear", "lowbit.linear_qta8a_qga4w", "lowbit.linear_a8_blocks")


def graph_export(model: str | None, output: str, *, recipe: str | None = None, force: bool = False,
                 unfused: bool = False) -> dict:
    """Write MODEL as a torch.export program (``torch.export.save``, a .pt2 file) that
    maps token ids [1, seq] to logits and runs with only the lowbit ops imported:
    ``lowbit.passes.export``, then with ``recipe`` the passes ``quantize_weights``
    (``calibrate`` and ``quantize_activations`` when it quantizes activations), then
    ``fuse`` (unless ``unfused``: the dequantization stays as aten ops, the form a
    compiler sees) and ``lower``.  Prints the graph's op counts after each pass.  A
    recipe whose method calibrates the weights (GPTQ, AWQ, SmoothQuant, MSE clipping)
    quantizes the eager model first; its program shows the fused ops from the start.
    The file is written beside its name and renamed; ``force`` replaces only an earlier
    program.

    Example::

        >>> import tempfile
        >>> from lowbit.cli import graph_export
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = graph_export(None, d + "/m.pt2", recipe="w8a16")  # doctest: +ELLIPSIS
        pass                   nodes  aten.linear  lowbit.weight_only_matmul  seconds
        export                  ...
        quantize_weights        ...
        fuse                    ...         1                        210  ...
        lower                   ...
        wrote .../m.pt2 (...)...
        >>> out["ops"]["lowbit.weight_only_matmul"]
        210
    """
    import torch

    import lowbit
    from lowbit import passes
    from lowbit.recipe import Recipe

    out = os.path.abspath(output)
    _check_program_output(out, force)
    r = Recipe.get(recipe) if recipe is not None else None
    eager = None if r is None else passes.eager_reason(r)
    t0 = time.perf_counter()
    m, tok = lowbit.load_model(model)
    _err(f"loaded {model or 'the bundled model'} in {time.perf_counter() - t0:.1f}s")
    if eager:
        calibration = _calibration([r], tok, None, 128, 512)
        _err(f"{eager}: quantizing the eager model, then exporting it")
        m = lowbit.quantize_model(m, r, progress=True, calibration=calibration)
    rows = []

    def step(name, ep, t):
        rows.append((name, len(ep.graph.nodes), passes.op_counts(ep), time.perf_counter() - t))
        _err(f"{name}: {rows[-1][3]:.1f}s")
        return ep

    t = time.perf_counter()
    ep = step("export", passes.export(m), t)
    if r is not None and not eager:
        t = time.perf_counter()
        ep = step("quantize_weights", passes.quantize_weights(ep, r), t)
        if r.static_activations:
            t = time.perf_counter()
            ep = step("calibrate", passes.calibrate(ep, r, _calibration([r], tok, None, 32, 512)), t)
        if r.activation is not None or r.lm_head_activation is not None:
            t = time.perf_counter()
            ep = step("quantize_activations", passes.quantize_activations(ep, r), t)
    if not unfused:
        t = time.perf_counter()
        ep = step("fuse", passes.fuse(ep), t)
    t = time.perf_counter()
    ep = step("lower", passes.lower(ep), t)
    columns = [c for c in GRAPH_COLUMNS if any(counts[c] for _, _, counts, _ in rows)]
    print(f"{'pass':<22}{'nodes':>6}  " + "  ".join(columns) + "  seconds")
    for name, nodes, counts, seconds in rows:
        print(f"{name:<22}{nodes:>6}  " + "  ".join(f"{counts[c]:>{len(c)}}" for c in columns) + f"  {seconds:7.1f}")
    tmp = f"{out}.tmp-{os.getpid()}.pt2"  # torch.export.save wants the suffix
    try:
        torch.export.save(ep, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB): load with `import lowbit.ops; "
          f"torch.export.load(path).module()(input_ids)`")
    return {"path": out, "ops": dict(passes.op_counts(ep)), "nodes": len(ep.graph.nodes)}


def _check_program_output(out: str, force: bool) -> None:
    """Refuse, before any work, an output that exists (without ``force``) or is not a
    torch.export program (even with ``force``), or a folder that cannot be written."""
    import zipfile

    if os.path.isdir(out):
        raise ValueError(f"output {out!r} is a folder; --graph writes one .pt2 file")
    if os.path.exists(out):
        if not force:
            raise ValueError(f"output {out!r} exists; pass --force to replace it")
        try:
            with zipfile.ZipFile(out) as z:
                program = any(n.endswith("/archive_format") for n in z.namelist())
        except (OSError, zipfile.BadZipFile):
            program = False
        if not program:
            raise ValueError(f"output {out!r} exists and is not a torch.export program; --force replaces only "
                             "a program an earlier `lowbit export --graph` wrote")
    folder = os.path.dirname(out) or "."
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"cannot write {out!r}: {folder!r} is not a writable folder")


def _check_output(output: str, force: bool) -> None:
    """Refuse, before any work, an output that ``save_quantized`` would refuse at the end:
    one that exists (without ``force``), anything but a lowbit checkpoint (even with
    ``force``), a place that cannot be written."""
    from lowbit.models.checkpoint import check_output_dir

    check_output_dir(output, overwrite=force)


def _model_and_reference(model: str | None, dtype, backend):
    """(model, tokenizer, float reference or None) for eval/generate.  A checkpoint whose
    float source cannot be loaded any more is evaluated alone, with a warning."""
    import lowbit
    from lowbit.models.load import CHECKPOINT_CONFIG, resolve_model_path

    p = resolve_model_path(model)
    m, tok = lowbit.load_model(p, dtype=dtype, backend=backend)
    if p.is_dir() and (p / CHECKPOINT_CONFIG).is_file():
        src = getattr(m, "lowbit_source", None)
        if not src or not os.path.exists(src):
            why = "is not recorded" if not src else f"({src}) is not here any more"
        else:
            try:
                ref, _ = lowbit.load_model(src, dtype=dtype)
                return m, tok, ref
            except (OSError, ValueError, TypeError) as e:
                why = f"({src}) cannot be loaded: {' '.join(str(e).split())}"
        _err(f"warning: the float model this checkpoint came from {why}; evaluating the checkpoint alone "
             "(no KL, top-1, logit error or greedy agreement)")
        return m, tok, None
    return None, tok, m


def _gguf_own_weights(model: str | None, dtype, backend):
    """(row name, model) of a GGUF file loaded on its own quantized tensors
    (``gguf="native"``), or None for any other model or a file with none."""
    import lowbit
    from lowbit.models.load import resolve_model_path

    p = resolve_model_path(model)
    if not (p.is_file() and p.suffix == ".gguf"):
        return None
    m, _ = lowbit.load_model(p, dtype=dtype, backend=backend, gguf="native")
    types = m.lowbit_gguf["native"]
    if not types:
        return None
    return "gguf " + "+".join(sorted(types, key=types.get, reverse=True)), m


def _check_act_compute(act_compute: str | None) -> None:
    """--act-compute's value, checked before any work (argparse checks the CLI's; this, a
    Python caller's)."""
    from lowbit.runtime import ACT_COMPUTE

    if act_compute is not None and act_compute not in ACT_COMPUTE:
        raise ValueError(f"--act-compute must be one of {sorted(ACT_COMPUTE)}, got {act_compute!r}")


def eval_cmd(model: str | None, compare: list[str], *, as_json: bool = False, corpus: str | None = None,
             ctx: int = 512, windows: int | None = 16, protocol: str = "lowbit", speed: bool = True,
             greedy_tokens: int = 48, dtype: str = "float32", backend: str | None = None,
             calib: str | None = None, calib_samples: int = 128, calib_len: int = 512,
             act_compute: str | None = None) -> list[dict]:
    """Evaluate a checkpoint (against its float source) or a float model, plus the
    ``compare`` recipes applied to the float model, in one table; with ``act_compute``
    (``"int8"``) each weight-only quantized model also as ``lowbit.Runner(model,
    act_compute=...)`` runs it, in a row of its own.

    Example::

        >>> from lowbit.cli import eval_cmd
        >>> rows = eval_cmd(None, [], ctx=64, windows=1, speed=False, greedy_tokens=4)  # doctest: +ELLIPSIS
        corpus: pydoc_data.topics (...), 1 windows of 64 tokens, 63 scored (lowbit protocol)
        greedy: leading tokens identical to the float model's 4 greedy tokens ...
        model           bits/w  weights MB     ppl      KL   top-1  max|dlogit|  mean|dlogit|  greedy
        ---------------------------------------------------------------------------------------------
        float            32.00       538.1  ...
        gguf Q4_1+Q8_0    5.00        96.6  ...
        >>> rows[0]["model"], rows[0]["scored_tokens"], rows[1]["model"]
        ('float', 63, 'gguf Q4_1+Q8_0')

    ``eval_cmd(None, ["w8a16", "w4a16-g64"])`` adds two quantized copies of the float
    model to the table (each quantizes all 30 layers, so it takes longer); a
    method-qualified preset (``"w4a16-g32:gptq"``) is calibrated first (``calib*``).
    """
    import lowbit
    from lowbit.evaluation import evaluate, format_table, load_corpus
    from lowbit.runtime import check_positions

    _check_act_compute(act_compute)
    for text in (corpus, calib):
        if text is not None:
            load_corpus(text)  # a missing or unreadable file: say so before loading the model
    for r in compare:
        lowbit.Recipe.get(r)  # a bad recipe: say so before loading the model
    quant, tok, ref = _model_and_reference(model, _float_dtype(dtype), backend)
    for m in (quant, ref):
        if m is not None:
            check_positions(m, ctx, what="--ctx")
    models = {}
    if quant is not None:
        models[os.path.basename(os.path.normpath(model))] = quant
    own = _gguf_own_weights(model, _float_dtype(dtype), backend)
    if own is not None:  # a GGUF file: its own quantized tensors, next to their float dequantization
        models[own[0]] = own[1]
    if compare and ref is None:
        raise ValueError("--compare needs the float model; it is not available for this checkpoint")
    ids = _calibration(compare, tok, calib, calib_samples, calib_len) if ref is not None else None
    for r in compare:
        models[r] = lowbit.quantize_model(ref, r, backend=backend, inplace=False, calibration=ids,
                                          progress=not as_json)
    rows = evaluate(models, tok, reference=ref, corpus=corpus, ctx=ctx, max_windows=windows, protocol=protocol,
                    speed=speed, greedy_tokens=greedy_tokens, act_compute=act_compute, progress=not as_json)
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        r0 = rows[0]
        print(f"corpus: {r0['corpus']} (sha256 {r0['corpus_sha256']}), {r0['windows']} windows of {ctx} tokens, "
              f"{r0['scored_tokens']} scored ({protocol} protocol)"
              + ("; speed: 512-token prefill, 64-token decode" if speed else ""))
        if "greedy_match" in r0:
            print(f"greedy: leading tokens identical to the float model's {r0['greedy_tokens']} greedy tokens "
                  "(one near-tie flips the rest, so top-1 and KL are the steadier measures)")
        print(format_table(rows))
    return rows


def generate_cmd(model: str | None, prompt: str | list[str], *, max_new_tokens: int = 128, sample: bool = False,
                 temperature: float = 0.7, top_k: int | None = None, top_p: float | None = 0.9,
                 seed: int | None = None, raw: bool = False, recipe: str | None = None,
                 dtype: str = "auto", backend: str | None = None, act_compute: str | None = None):
    """Generate text from a checkpoint or a float model (optionally quantized on the fly
    with ``recipe``), streaming tokens; prints prefill and decode tokens/s to stderr.  A
    list of prompts is generated as one batch (``Runner.generate`` with a list): each
    continuation is printed when the batch is done, and the aggregate tokens/s.
    ``act_compute="int8"`` runs the weight-only quantized linears against int8 activation
    blocks (``lowbit.Runner``'s option).  ``dtype="auto"``: bfloat16 where the CPU
    multiplies it natively (``kernels.cpu.has_bf16_dot``), else float32.

    Example::

        >>> from lowbit.cli import generate_cmd
        >>> g = generate_cmd(None, "What is the capital of France?", max_new_tokens=8, dtype="float32")
        The capital of France is Paris.
        >>> g.prompt_tokens, len(g.tokens)    # the end-of-turn token ended it
        (37, 8)
        >>> b = generate_cmd(None, ["What is the capital of France?", "What is the capital of Germany?"],
        ...                  max_new_tokens=10, dtype="float32")
        [0] What is the capital of France?
        The capital of France is Paris.
        [1] What is the capital of Germany?
        The capital of Germany is Berlin.
        >>> b.new_tokens
        16
        >>> g = generate_cmd(None, "What is the capital of France?", max_new_tokens=8, dtype="float32",
        ...                  recipe="w4a16-g128-head8", act_compute="int8")  # doctest: +ELLIPSIS
        The capital of France is ...
    """
    import torch

    import lowbit
    from lowbit.evaluation import _prompt_ids
    from lowbit.runtime import check_positions

    _check_act_compute(act_compute)
    if dtype == "auto":
        dtype = "bfloat16" if lowbit.kernels.cpu.has_bf16_dot() else "float32"
    r = lowbit.Recipe.get(recipe) if recipe else None
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts:
        raise ValueError("no prompts to generate from")
    # A GGUF file runs on its own quantized tensors unless a recipe quantizes its float weights.
    m, tok = lowbit.load_model(model, dtype=_float_dtype(dtype), backend=backend,
                               gguf="float" if r is not None else "native")
    ids = [torch.tensor(tok(p).input_ids) if raw else _prompt_ids(tok, p) for p in prompts]
    for i, x in enumerate(ids):
        check_positions(m, x.numel(), max_new_tokens, what="the prompt" if isinstance(prompt, str) else f"prompt {i}")
    if r is not None:  # a calibrated method calibrates on the default text (lowbit quantize has the options)
        lowbit.quantize_model(m, r, backend=backend, calibration=_calibration([r], tok, None, 128, 512))
    eos = _eos_ids(m, tok)
    runner = lowbit.Runner(m, act_compute=act_compute)
    if not isinstance(prompt, str):
        b = runner.generate(ids, max_new_tokens, do_sample=sample, temperature=temperature, top_k=top_k,
                                      top_p=top_p, seed=seed, eos_token_id=eos)
        for i, (p, g) in enumerate(zip(prompts, b.sequences)):
            print(f"[{i}] {p}")
            print(tok.decode(g.tokens, skip_special_tokens=True).strip())
        tokens = sum(x.numel() for x in ids)
        _err(f"{len(prompts)} prompts, {tokens} tokens: prefill {tokens / b.prefill_seconds:.0f} tok/s; "
             f"{b.new_tokens} new tokens: "
             f"{b.tokens_per_s:.1f} tok/s with the prefill, decode {b.decode_tokens_per_s:.1f} tok/s")
        return b
    ids = ids[0]
    printed = ""
    new: list[int] = []

    def show(t: int) -> None:  # decode the whole continuation: multi-token characters print whole
        nonlocal printed
        new.append(t)
        text = tok.decode(new, skip_special_tokens=True)
        print(text[len(printed):], end="", flush=True)
        printed = text

    g = runner.generate(ids, max_new_tokens, do_sample=sample, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed, eos_token_id=eos, on_token=show)
    print()
    _err(f"prompt {g.prompt_tokens} tokens: prefill {g.prefill_tokens_per_s:.0f} tok/s; "
         f"{len(g.tokens)} new tokens: decode {g.decode_tokens_per_s:.1f} tok/s")
    return g


def _prompts(prompt: str | None, path: str | None) -> str | list[str]:
    """PROMPT, or the non-empty lines of the --prompts file; exactly one of them."""
    if (prompt is None) == (path is None):
        raise ValueError("give a PROMPT or --prompts FILE (one of them)" if path is None else
                         f"give either PROMPT or --prompts, not both (got PROMPT {prompt!r} and --prompts {path!r})")
    if path is None:
        return prompt
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts {path!r} is not UTF-8 text: {e}") from None
    prompts = [line for line in lines if line]
    if not prompts:
        raise ValueError(f"--prompts {path!r} has no non-empty line: expected one prompt per line")
    return prompts


def _eos_ids(model, tok) -> list[int]:
    """Token ids that end a generation: the generation config's, the tokenizer's, and
    the chat end-of-turn marker when the vocabulary has one."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    ids.append(tok.eos_token_id)
    vocab = tok.get_vocab()
    ids += [vocab[t] for t in ("<|im_end|>", "<|eot_id|>", "<|end|>") if t in vocab]
    return sorted({i for i in ids if isinstance(i, int)})


def info_cmd(path: str) -> dict:
    r"""Print what a checkpoint folder holds: recipe, schemes per module, sizes, versions.

    Example::

        >>> import tempfile, lowbit
        >>> from lowbit.cli import info_cmd
        >>> model, tok = lowbit.load_model()
        >>> model = lowbit.quantize_model(model, lowbit.Recipe(weight="int4-asym-g64", modules=[r"layers\.0\."]))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     meta = info_cmd(lowbit.save_quantized(model, d + "/ckpt", tok))  # doctest: +ELLIPSIS
        lowbit checkpoint .../ckpt (format 1, written by lowbit 0.1.0)
        source model: ...SmolLM2-135M-Instruct.Q4_1.gguf
        recipe: custom  {"weight": "int4-asym-g64", ...}
        float dtype: float32; model.safetensors: ... MB, ... tensors
             7 linears: weight int4-asym-g64
        >>> meta["recipe"]["weight"]
        'int4-asym-g64'
    """
    from lowbit.models.checkpoint import WEIGHTS, read_metadata

    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} does not exist (expected a lowbit checkpoint folder or a GGUF file)")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return _gguf_info(path)
        raise ValueError(f"{path!r} is a file; `lowbit info` describes a lowbit checkpoint folder (written by "
                         "`lowbit quantize`) or a GGUF file")
    if not os.path.exists(os.path.join(path, "lowbit.json")):
        from lowbit.models.foreign import quant_method

        if os.path.isfile(os.path.join(path, "config.json")) and quant_method(path) is not None:
            return _foreign_info(path)
    meta = read_metadata(path)
    files = list(meta.get("shards") or [WEIGHTS])
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    where = WEIGHTS if len(files) == 1 else f"{len(files)} shards"
    counts = Counter((v["kind"], v["weight"], v["activation"]) for v in meta["modules"].values())
    print(f"lowbit checkpoint {path} (format {meta['format_version']}, written by lowbit {meta['lowbit_version']})")
    print(f"source model: {meta.get('source')}")
    print(f"recipe: {meta['recipe'].get('name')}  {json.dumps(meta['recipe'])}")
    print(f"float dtype: {meta['dtype']}; {where}: {size / 1e6:.1f} MB, {len(meta['sha256'])} tensors")
    for (kind, w, a), n in sorted(counts.items(), key=lambda kv: str(kv[0])):
        print(f"  {n:4d} {kind}s: weight {w}" + (f", activations {a}" if a else ""))
    return meta


KERNEL_PLAN_RECIPES = ("w8a16", "w4a16-g128", "q8_0", "q4_0", "q4_1", "q8_0-a8", "q4_0-a8", "w8a8", "w4a8-g128")
KERNEL_PLAN_ROWS = (1, 4, 16, 64, 512)


def kernels_cmd(path: str | None = None, dtype: str | None = None, calibrate: bool = False) -> list[dict]:
    """Print which CPU kernel runs each quantized matmul, for activation rows M = 1 (a
    decode step) to 512 (a prefill), and why: the plan of ``lowbit.kernels.cpu`` on this
    machine, for the modules of a checkpoint (``path``) or for the presets at the bundled
    model's shapes (K = 576 and 1536), with activations of ``dtype`` (default: the
    checkpoint's float dtype; for the presets the one ``lowbit generate`` picks, bfloat16
    where the CPU multiplies it natively, else float32).  Returns the rows printed.
    ``calibrate`` first times the row kernels against the GEMM paths on this machine and
    saves the crossovers where the cpu backend reads them from now on
    (``lowbit.kernels.cpu.calibration``, about 8 s).

    Example::

        >>> from lowbit.cli import kernels_cmd
        >>> rows = kernels_cmd()  # doctest: +ELLIPSIS
        cpu: ...
        >>> sorted(rows[0])
        ['activation', 'k', 'kernels', 'weight']
    """
    import torch

    from lowbit.kernels import cpu, get_backend
    from lowbit.recipe import Recipe, fit_group
    from lowbit.scheme import QuantScheme

    if not cpu.available():
        raise ValueError(f"no CPU kernels to plan: {cpu.load_error()}")
    if path is not None:
        from lowbit.models.checkpoint import read_metadata

        meta = read_metadata(path)  # checked, config.json's checksum included
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
        hidden, inter = config.get("hidden_size"), config.get("intermediate_size")
        heads = config.get("num_attention_heads") or 1
        attn = heads * (config.get("head_dim") or (hidden or 0) // heads)

        def in_features(name: str) -> int:  # a Llama-family decoder: down_proj and o_proj read their own widths
            return inter if name.endswith("down_proj") else attn if name.endswith("o_proj") else hidden

        combos = sorted({(v["weight"], v["activation"], in_features(n)) for n, v in meta["modules"].items()
                         if v["kind"] == "linear"}, key=str)
        dtype = dtype or meta["dtype"]
        if not combos or not isinstance(hidden, int) or not isinstance(inter, int):
            raise ValueError(f"{path!r}: no quantized linear, or a config.json without hidden_size / "
                             "intermediate_size")
    else:
        combos = []
        for name in KERNEL_PLAN_RECIPES:
            r = Recipe.get(name)
            for k in (576, 1536):  # the group each module gets, as quantize_model fits it
                combos.append((fit_group(r.weight, k), r.activation, k))
    dtype = dtype or ("bfloat16" if cpu.has_bf16_dot() else "float32")
    dt = _float_dtype(dtype)
    f = cpu.features()
    print(f"cpu: {f['cpu']}; {torch.get_num_threads()} threads; flags {' '.join(f['machine']) or '(none of note)'}; "
          f"lowbit._C built for {' '.join(f['compiled']) or 'no SIMD extension'}")
    _print_calibration(cpu, calibrate)
    print(f"{dtype} activations, torch float32 matmul precision '{torch.get_float32_matmul_precision()}'")
    backend = get_backend("cpu")
    rows, reasons = [], {}
    head = f"{'weight':<25}{'activations':<16}{'K':>6}  " + "".join(f"{'M=' + str(m):<14}" for m in KERNEL_PLAN_ROWS)
    print(head)
    print("-" * len(head))
    for w, a, k in combos:
        plans = [backend.plan(QuantScheme.parse(w), None if a is None else QuantScheme.parse(a), m, k, dt)
                 for m in KERNEL_PLAN_ROWS]
        for p in plans:
            reasons.setdefault(p.kernel, set()).add(p.why)
        rows.append({"weight": w, "activation": a, "k": k, "kernels": [p.kernel for p in plans]})
        print(f"{w:<25}{a or '-':<16}{k:>6}  " + "".join(f"{p.kernel:<14}" for p in plans))
    print("why:")
    for kernel, whys in reasons.items():
        for why in sorted(whys):
            print(f"  {kernel:<16}{why}")
    beyond = "gemm_f32 (6 x 16 FMA register tiles)" if cpu._gemm_f32() else "torch's linear"
    dense = (f"dense_rows (float32 FMAs, each weight row read once) up to {cpu.dense_rows_max_m()} rows, "
             f"{beyond} beyond" if cpu.dense_rows_max_m() else beyond)
    print(f"float32 nn.Linear (float models, a float lm_head): decode steps {dense}; prefill torch's linear")
    if cpu.dense_amx_apply(torch.zeros(1, 64, dtype=torch.bfloat16), 1):
        print(f"bfloat16 nn.Linear: decode steps dense_amx (AMX bf16 tiles, the weight read as stored; K a "
              f"multiple of 32) up to {cpu.DENSE_AMX_MAX_M} rows, torch's linear beyond; prefill torch's linear")
    elif cpu.dense_rows_max_m(torch.bfloat16):
        dots = cpu.dense_dots_apply(torch.zeros(1, 64, dtype=torch.bfloat16), cpu.DENSE_DOTS_MAX_M)
        beyond = (f"dense_dots (vdpbf16ps tiles, the weight read as stored; K a multiple of 32) up to "
                  f"{cpu.DENSE_DOTS_MAX_M} rows, torch's linear beyond" if dots else "torch's linear beyond")
        print(f"bfloat16 nn.Linear: decode steps dense_rows (the bf16 values widened, float32 FMAs) up to "
              f"{cpu.dense_rows_max_m(torch.bfloat16)} rows, {beyond}; prefill torch's linear")
    if cpu.prefill_attention_available():
        sizes = [hd for hd in range(16, 257, 16) if cpu.prefill_attention_tiles(hd)]
        tiles = (f"; bf16 caches with heads of {', '.join(map(str, sizes))} values on AMX bf16 tiles (the softmax "
                 "weights in three bf16 parts)" if sizes else "")
        print(f"prefill attention: prefill_attention (register tiles of float32 FMAs, bf16 scores on vdpbf16ps "
              f"where AVX512-BF16 runs){tiles}")
    return rows


def _print_calibration(cpu, calibrate: bool) -> None:
    """Run the calibration (``calibrate``) and say which thresholds the plan uses: measured
    on this machine (with the times behind each) or built in."""
    from lowbit.kernels.cpu import calibration
    from lowbit.ops.calibrate import calibrate as run

    data = run(log=lambda line: print(f"calibrating: {line}")) if calibrate else cpu.CALIBRATION
    if data is None:
        print(f"row-kernel thresholds: built in (no calibration for this machine at {calibration.cache_path()}; "
              "`lowbit info --kernels --calibrate` measures them)")
        return
    print(f"row-kernel thresholds: measured on this machine {data['written']} ({calibration.cache_path()}), "
          f"ms summed over [N, K] = {data['shapes']} as rows kernel / GEMM path:")
    for name, v in data["thresholds"].items():
        times = "  ".join(f"M={m} {a:.3g}/{b:.3g}" for m, a, b in v["ms"] if m <= max(2 * v["value"], 4))
        print(f"  {name:<22} up to {v['value']:>4} rows (built in: {v['built_in']}): {times}")


def _foreign_info(path: str) -> dict:
    """Print and return what a folder quantized by another tool (compressed-tensors, GPTQ,
    AWQ) holds, as lowbit loads it: every check of loading runs."""
    from lowbit.models.foreign import load_foreign, quant_method

    method = quant_method(path)
    model, _ = load_foreign(path)
    counts = Counter((v["weight"], v["activation"]) for v in model.lowbit_modules.values())
    size = sum(f.stat().st_size for f in Path(path).iterdir() if f.name.endswith(".safetensors"))
    print(f"{method} folder {path} (not a lowbit checkpoint; lowbit loads it with the file's own codes)")
    print(f"model: {type(model).__name__}, {model.config.num_hidden_layers} layers; safetensors: {size / 1e6:.1f} MB")
    for (w, a), n in sorted(counts.items(), key=lambda kv: str(kv[0])):
        print(f"  {n:4d} linears: weight {w}" + (f", activations {a}" if a else ""))
    return {"format": method, "modules": model.lowbit_modules}


def _gguf_info(path: str) -> dict:
    """Print and return what a GGUF file holds: the model, its layers and context, and
    its tensors by storage type."""
    from .formats.gguf_file import read_gguf  # checked: damage is a GGUFError naming the file

    reader = read_gguf(path, model_checks=False)

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    kinds = Counter(t.tensor_type.name for t in reader.tensors)
    info = {"format": "gguf", "gguf_version": field("GGUF.version"), "name": field("general.name"),
            "architecture": arch, "layers": field(f"{arch}.block_count"),
            "context_length": field(f"{arch}.context_length"), "tensor_types": dict(sorted(kinds.items()))}
    print(f"GGUF file {path} (GGUF version {info['gguf_version']}; not a lowbit checkpoint: "
          "`lowbit quantize FILE --recipe R -o DIR` makes one)")
    print(f"model: {info['name']} ({arch}), {info['layers']} layers, context {info['context_length']} tokens")
    print(f"{os.path.getsize(path) / 1e6:.1f} MB, {len(reader.tensors)} tensors: "
          + ", ".join(f"{n} x {k}" for k, n in info["tensor_types"].items()))
    return info


class _LibraryChoices(Sequence):
    """Choices an option takes from the library (backend names, dtype names), read when
    argparse first needs them (to check a value or print that command's help), so that
    building the parser, and so ``lowbit --help``, does not import the kernels."""

    def __init__(self, read):
        self._read, self._items = read, None

    def _get(self) -> tuple[str, ...]:
        if self._items is None:
            self._items = tuple(self._read())
        return self._items

    def __getitem__(self, i):
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())


def _backends():
    from lowbit.kernels import BACKENDS

    return BACKENDS


def _methods():
    from lowbit.recipe import METHODS

    return METHODS


def _dtype_names():
    from lowbit.models.load import FLOAT_DTYPES_BY_NAME

    return FLOAT_DTYPES_BY_NAME


def _protocols():
    from lowbit.evaluation import PROTOCOLS

    return PROTOCOLS


def int_at_least(low: int):
    """argparse ``type=``: an integer >= ``low``; a bad value is a one-line usage error
    that names the option (``argument --ctx: expected an integer >= 2, got '-5'``)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return convert


def _float_in(text: str, ok, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ok(value):  # NaN fails every comparison
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite float > 0."""
    return _float_in(text, lambda v: 0 < v < math.inf, "a number > 0")


def probability(text: str) -> float:
    """argparse ``type=``: a float in (0, 1]."""
    return _float_in(text, lambda v: 0 < v <= 1, "a number in (0, 1]")


def window_count(text: str) -> int | None:
    """argparse ``type=``: a number of windows >= 1, or ``all`` (None)."""
    if text == "all":
        return None
    try:
        return int_at_least(1)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'all', got {text!r}") from None


def scheme_list(text: str) -> list[str]:
    """argparse ``type=``: comma-separated scheme names, at least one, none empty.

    Example::

        >>> from lowbit.cli import scheme_list
        >>> scheme_list("int8-sym, int4-asym-g64")
        ['int8-sym', 'int4-asym-g64']
    """
    names = [t.strip() for t in text.split(",")]
    if not any(names) or not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated scheme names such as "
                                         f"'int8-sym,int4-asym-g64', got {text!r}")
    return names


DESCRIPTION = """\
Low-bit quantized LLM inference: quantize a model with a recipe, save it, measure
what quantization costs, generate text.  MODEL is a GGUF file, a Hugging Face folder
or a lowbit checkpoint; without one, every command uses the bundled
SmolLM2-135M-Instruct (GGUF Q4_1).  `lowbit COMMAND --help` describes a command."""
MODEL_HELP = "GGUF file, Hugging Face folder or lowbit checkpoint (default: the bundled SmolLM2-135M-Instruct)"


def _command(sub, name: str, summary: str, description: str, examples: str) -> argparse.ArgumentParser:
    """A subcommand whose --help opens with ``description`` and ends with ``examples``.  Options
    are spelled out: an abbreviation would be taken silently (``generate --prompt TEXT`` read
    TEXT as the --prompts file)."""
    return sub.add_parser(name, help=summary, description=description.strip(),
                          epilog="examples:\n" + examples.strip("\n"),
                          formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)


def _model_options(p: argparse.ArgumentParser, dtype: str, dtype_help: str, names=None) -> None:
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--dtype", choices=_LibraryChoices(names or _dtype_names), default=dtype, metavar="DTYPE",
                   help=f"{dtype_help}: one of %(choices)s (default: %(default)s)")
    p.add_argument("--backend", choices=_LibraryChoices(_backends), metavar="BACKEND",
                   help="kernel backend of the quantized modules: one of %(choices)s "
                        "(default: the fastest available on the model's device)")


def _calib_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calib", metavar="FILE", help="UTF-8 text to calibrate on (default: the evaluation corpus; "
                   "calibration samples come from its second half, which evaluation never scores)")
    p.add_argument("--calib-samples", type=int_at_least(1), default=128, metavar="N",
                   help="calibration samples (default: %(default)s)")
    p.add_argument("--calib-len", type=int_at_least(2), default=512, metavar="L",
                   help="tokens per calibration sample (default: %(default)s)")


def alpha_or_auto(text: str):
    if text == "auto":
        return text
    return _float_in(text, lambda v: 0 <= v <= 1, "a number in [0, 1] or 'auto'")


def build_parser() -> argparse.ArgumentParser:
    """The ``lowbit`` argument parser (one subparser per command)."""
    from lowbit.recipe import RECIPE_PRESETS

    examples = __doc__ and __doc__.split("Example::\n", 1)[1]  # the module docstring's (None under python -OO)
    parser = argparse.ArgumentParser(
        prog="lowbit", formatter_class=argparse.RawDescriptionHelpFormatter, description=DESCRIPTION,
        epilog=examples and "examples:\n" + textwrap.indent(textwrap.dedent(examples).strip(), "  "))
    parser.add_argument("--version", action="version", version=f"lowbit {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _command(sub, "quantize", "quantize a model with a recipe and save a checkpoint folder", """
Load MODEL, quantize the linears the recipe selects and save a checkpoint folder: packed
codes and scales, the recipe, checksums, the config and the tokenizer.  Weights are
rounded by the recipe's method (round to nearest for presets) or --method: hqq needs no
data; gptq and awq (and --smoothquant) run calibration text through the model decoder
layer by decoder layer.  `lowbit info` shows what it holds; `lowbit eval` and
`lowbit generate` load it.""", """
  lowbit quantize --recipe w4a16-g128 -o smollm2-w4a16
  lowbit quantize ~/models/Llama-2-7b-hf --stream --recipe w4a16-g128 -o llama2-w4 --dtype bfloat16
  lowbit quantize --target-bits 4.5 -o smollm2-auto4.5   # mixed precision from measured sensitivities""")
    _model_options(p, "float32", "float dtype of the model's unquantized parts")
    p.add_argument("--recipe",
                   help=f"a preset ({', '.join(RECIPE_PRESETS)}) or a JSON/YAML recipe file; with --target-bits, "
                        "the base of the mix (which modules, method, activations) (default: required without "
                        "--target-bits, w4a16-g128 with it)")
    p.add_argument("--target-bits", type=positive_float, metavar="BITS",
                   help="choose each decoder linear's weight scheme for this average bits per weight (scales "
                        "and zero points counted) from sensitivities measured on 2 x 256 calibration tokens; "
                        "writes sensitivity.csv/.json/.png into the checkpoint (default: the recipe's schemes)")
    p.add_argument("--candidates", type=scheme_list, metavar="SCHEMES",
                   help="with --target-bits: comma-separated weight schemes to choose from (default: "
                        "int8-sym,int4-asym-g128-f16,int4-asym-g32-f16,int3-asym-g32-f16,int2-asym-g32-f16)")
    p.add_argument("--outliers", type=int_at_least(1), metavar="N",
                   help="keep N input channels of every selected linear at int8 (chosen from calibration input "
                        "statistics), the rest at the recipe's weight scheme: mixed int8/int4 weights "
                        "(weight-only, round to nearest) (default: none)")
    p.add_argument("-o", "--output", required=True, help="checkpoint folder to write (required)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder (default: refuse)")
    p.add_argument("--method", choices=_LibraryChoices(_methods), metavar="METHOD", help="how weights are rounded (default: the recipe's, rtn for "
                   "presets): rtn, hqq (no calibration), gptq, awq (calibrated layer by layer)")
    p.add_argument("--stream", action="store_true",
                   help="read MODEL (a Hugging Face safetensors folder) and write the checkpoint one decoder "
                   "layer at a time, for models larger than memory (default: load the whole model)")
    p.add_argument("--smoothquant", type=alpha_or_auto, metavar="ALPHA",
                   help="fold SmoothQuant scales with migration strength ALPHA in [0, 1] or 'auto' (W8A8) "
                   "(default: none)")
    _calib_options(p)

    p = _command(sub, "eval", "perplexity, KL, top-1 and greedy agreement vs float, memory, speed", """
Evaluate MODEL on token windows of a text corpus.  A lowbit checkpoint is compared with
the float model it came from: perplexity, KL divergence and top-1 agreement per token,
logit error, how many greedy tokens agree, weight memory, prefill and decode speed.
--compare applies more recipes to the float model and adds them to the same table.""", """
  lowbit eval smollm2-w4a16
  lowbit eval --compare w4a16-g32 w4a16-g32:gptq w4a16-g32:awq --calib-samples 32 --no-speed
  lowbit eval smollm2-w4a16 --corpus wiki.txt --ctx 1024 --windows all --protocol llama""")
    _model_options(p, "float32", "float dtype of the models")
    p.add_argument("--compare", nargs="*", default=[], metavar="RECIPE",
                   help="presets or recipe files to apply to the float model (default: none)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table (default: table)")
    p.add_argument("--corpus", help="UTF-8 text file (default: the Python language reference, offline)")
    p.add_argument("--ctx", type=int_at_least(2), default=512, help="window length in tokens (default: %(default)s)")
    p.add_argument("--windows", type=window_count, default=16,
                   help="number of windows, or 'all' (default: %(default)s)")
    p.add_argument("--protocol", choices=_LibraryChoices(_protocols), default="lowbit", metavar="PROTOCOL",
                   help="one of %(choices)s: 'lowbit' scores every token of a window, 'llama' the second half "
                        "as llama-perplexity does (default: %(default)s)")
    p.add_argument("--greedy-tokens", type=int_at_least(1), default=48,
                   help="greedy tokens to generate and compare with the float model's (default: %(default)s)")
    p.add_argument("--no-speed", action="store_true", help="skip the prefill/decode timing (default: timed)")
    p.add_argument("--act-compute", choices=["int8"],
                   help="int8: also evaluate each weight-only quantized model with its activations rounded to "
                        "int8 in blocks of 32 (lowbit generate --act-compute int8), in a row 'NAME act int8' "
                        "(default: none)")
    _calib_options(p)

    p = _command(sub, "generate", "generate text (greedy by default) with the fast runtime", """
Generate a continuation of PROMPT with MODEL and stream it; prefill and decode
tokens/s go to stderr.  The prompt is wrapped in the model's chat template unless
--raw.  Decoding is greedy; --sample samples instead, and only then do --temperature,
--top-k, --top-p and --seed apply.  --prompts FILE generates for each line of FILE in
one batch (one prefill of all prompts, then one matmul per projection per step for all
unfinished sequences) and prints each continuation and the aggregate tokens/s.""", """
  lowbit generate "What is the capital of France?"
  lowbit generate smollm2-w4a16 --prompts questions.txt -n 64
  lowbit generate "Write a haiku." --recipe w4a16-g64 --sample --temperature 0.8 --seed 1""")
    _model_options(p, "auto", "activation dtype (auto: bfloat16 where the CPU multiplies it natively, AVX512-BF16 "
                   "or AMX, else float32, which is faster there; float32 is exact)",
                   lambda: ["auto", *_dtype_names()])
    p.add_argument("prompt", nargs="?", help="the prompt (wrapped in the chat template unless --raw)")
    p.add_argument("--prompts", metavar="FILE",
                   help="generate for every non-empty line of this UTF-8 file (one prompt each) as one batch, "
                        "instead of PROMPT (default: none)")
    p.add_argument("--recipe", help="quantize a float model on the fly with this preset or recipe file "
                                    "(default: run the model as it is)")
    p.add_argument("-n", "--max-new-tokens", type=int_at_least(0), default=128,
                   help="most tokens to generate; stops earlier at end of turn (default: %(default)s)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding (default: greedy)")
    p.add_argument("--temperature", type=positive_float, default=0.7,
                   help="with --sample: softmax temperature (default: %(default)s)")
    p.add_argument("--top-k", type=int_at_least(1),
                   help="with --sample: keep the k most likely tokens (default: all)")
    p.add_argument("--top-p", type=probability, default=0.9,
                   help="with --sample: keep the smallest set of tokens with this total probability "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int_at_least(0), help="with --sample: random seed (default: 0)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template (default: apply it)")
    p.add_argument("--act-compute", choices=["int8"],
                   help="int8: run the weight-only quantized linears against activations rounded to int8 in "
                        "blocks of 32 (llama.cpp's arithmetic; faster decode, a change of numerics) "
                        "(default: the model's own activations)")

    p = _command(sub, "export", "write a model for another tool: GGUF (llama.cpp), compressed-tensors (vLLM)", """
Write MODEL (a lowbit checkpoint, a float model, or a float model quantized on the fly
with --recipe) as a GGUF file llama.cpp loads (--format gguf, the default) or as a
compressed-tensors folder vLLM and transformers load (--format compressed-tensors).

GGUF:   A weight whose scheme maps onto a ggml
type keeps its codes: symmetric codes of up to 4 bits are Q4_0, 8-bit ones Q8_0, both
exactly when the scales are float16 (the -f16 schemes); asymmetric 4-bit codes are Q4_1
with the min rounded to float16.  Anything else is re-quantized with ggml's quantizer.
The table at the end gives, per source scheme, the ggml type, how it was stored, the
worst relative error against lowbit's own weights, and the bits per weight; --strict
refuses to write a file in which any tensor is not exact.  The file is written to a
temporary name and renamed, so an interrupted export leaves no partial file.

compressed-tensors: every quantized linear keeps its codes, scales and integer zero
points (pack-quantized for weight-only schemes, int-quantized with int8 activations);
a scheme the format cannot hold (float or min zero points, a quantized embedding) is
refused.  The folder is written beside its name and renamed into place; --force
replaces only a folder an earlier compressed-tensors export wrote.

--graph: a torch.export program (.pt2, token ids [1, seq] -> logits, seq dynamic, no KV
cache) built by lowbit's graph passes: export, quantize_weights (codes, scales, zero
points as buffers, dequantized by aten ops before each linear), calibrate and
quantize_activations for recipes with int8 activations, fuse (dequantize -> linear
into lowbit's quantized matmuls; --unfused keeps the aten form) and lower (the kernel
plan of this machine in each matmul node's metadata).  The op counts after each pass
are printed.  Load it with `import lowbit.ops` and `torch.export.load(path)`.""", """
  lowbit export smollm2-gptq -o smollm2.gguf --strict   # after lowbit quantize --recipe q4_0 --method gptq -o smollm2-gptq
  lowbit export --recipe w8a8 --format compressed-tensors -o smollm2-w8a8   # for vLLM
  lowbit export --recipe w4a16-g128 --graph -o smollm2-w4a16.pt2   # a torch.export program""")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("-o", "--output", required=True,
                   help="file (gguf) or folder (compressed-tensors) to write (required)")
    p.add_argument("--format", choices=EXPORT_FORMATS, help="output format (default: gguf)")
    p.add_argument("--type", type=str.lower,  # checked by gguf_export.check_arguments, before loading
                   help="gguf: ggml type of every decoder linear weight: q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, "
                        "q3_k, q4_k, q5_k, q6_k, f16, bf16 or f32 (default: per weight, from its scheme: "
                        "Q4_0/Q4_1 up to 4 bits, Q8_0 for 8 bits, float weights stay float); a K-quant "
                        "(q2_k..q6_k) needs rows of whole 256-value super-blocks, other weights get "
                        "llama.cpp's fallback type (q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0, q2_k/q3_k -> q4_0) "
                        "and the table says so")
    p.add_argument("--float-type", type=str.lower,
                   help="gguf: ggml type of a float embedding / output weight, one of --type's (default: its "
                        "own dtype)")
    p.add_argument("--recipe", help="quantize a float MODEL with this preset or recipe file first "
                                    "(default: export the model as it is)")
    p.add_argument("--strict", action="store_true",
                   help="refuse (write nothing) unless every tensor is stored exactly (default: convert and report)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output, a compressed-tensors folder only if an earlier export "
                        "wrote it (default: refuse)")
    p.add_argument("--graph", action="store_true",
                   help="write a torch.export program (.pt2) instead: the model exported, quantized by graph "
                        "passes, fused and lowered; it runs with only `import lowbit.ops` (default: --format)")
    p.add_argument("--unfused", action="store_true",
                   help="with --graph: keep the dequantization as aten ops before each linear (default: fuse "
                        "into lowbit's quantized matmuls)")

    p = _command(sub, "info", "what a lowbit checkpoint folder (or a GGUF file, a quantized folder) holds", """
Print what a checkpoint folder written by `lowbit quantize` (or lowbit.save_quantized)
holds: the source model, the recipe, the schemes of its modules, the float dtype, the
size of its weights file, and the versions that wrote it.  For a GGUF file: the model,
its layers and context length, and its tensors by storage type.  For a folder another
tool quantized (compressed-tensors, GPTQ, AWQ): the lowbit scheme of every linear, as
`lowbit.load_model` reads it.  --kernels prints the CPU kernel plan instead: which kernel
runs each quantized matmul on this machine for 1 to 512 activation rows, and why.""", """
  lowbit info smollm2-w4a16
  lowbit info model.gguf
  lowbit info --kernels    # which CPU kernel runs each preset's matmuls here, and why""")
    p.add_argument("path", nargs="?", help="checkpoint folder or GGUF file (optional with --kernels)")
    p.add_argument("--kernels", action="store_true",
                   help="print which CPU kernel runs each quantized matmul on this machine, for 1 to 512 "
                        "activation rows, and why (of the checkpoint's modules, or of the presets) (default: off)")
    p.add_argument("--dtype", choices=_LibraryChoices(_dtype_names), metavar="DTYPE",
                   help="activation dtype for --kernels: one of %(choices)s (default: the checkpoint's float "
                        "dtype; for the presets generate's auto: bfloat16 with native bf16, else float32)")
    p.add_argument("--calibrate", action="store_true",
                   help="with --kernels: first time the row kernels against the GEMM paths on this machine "
                        "(about 8 s) and keep the crossovers for this CPU; the plan uses them from then on "
                        "(default: off; LOWBIT_KERNEL_CALIBRATION=0 ignores a saved calibration)")

    p = _command(sub, "demo", "weight error of every linear of a model at several schemes", """
Quantize every decoder linear weight of a GGUF model at several schemes and print, per
scheme, the bits per weight, the relative error, the SQNR, the worst error in units of
half a quantization step (at most 1 by construction) and the time taken.""", """
  lowbit demo
  lowbit demo --schemes int8-sym,int4-asym-g64 --limit 10
  lowbit demo other-model.gguf""")
    p.add_argument("model", nargs="?", help="GGUF file (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--schemes", type=scheme_list,
                   help=f"comma-separated schemes (default: {','.join(DEMO_SCHEMES)})")
    p.add_argument("--limit", type=int_at_least(1), help="only the first N linear weights (default: all)")
    return parser


def _version() -> str:
    from lowbit import __version__

    return __version__


def _positionals(parser: argparse.ArgumentParser, argv: list[str]) -> list[int]:
    """Where the positional arguments of the subcommand argv[0] are in argv: not an option,
    not an option's value."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    takes_value = {o for a in sub._actions if a.nargs != 0 for o in a.option_strings}
    pos, rest = [], iter(enumerate(argv[1:], 1))
    for i, a in rest:
        if a in takes_value:
            next(rest, None)
        elif not a.startswith("-"):
            pos.append(i)
    return pos


def _default_model(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with an empty MODEL (the bundled one) just before the prompt of `lowbit generate
    "prompt"`: right before it, as argparse fills both optional positionals from the first
    run of positional strings it meets (a placeholder after `generate` with options between
    it and the prompt would leave the prompt unrecognized)."""
    if len(argv) >= 2 and argv[0] == "generate" and "--prompts" not in argv:
        pos = _positionals(parser, argv)
        if len(pos) == 1 and not os.path.exists(argv[pos[0]]):
            return [*argv[:pos[0]], "", *argv[pos[0]:]]
    return argv


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lowbit`` command; returns the exit status (argparse exits
    with 2 on a usage error).

    Example::

        >>> from lowbit.cli import main
        >>> main(["info", "no-such-folder"])  # errors are one line on stderr, status 2
        2
    """
    parser = build_parser()
    # `lowbit generate "prompt"` (no model): argparse would take the prompt as the model
    if argv is None:
        argv = sys.argv[1:]
    args = parser.parse_args(_default_model(parser, argv))
    import torch

    try:
        with torch.no_grad():
            if args.command == "demo":
                demo(args.model, args.schemes, args.limit)
            elif args.command == "quantize":
                quantize_cmd(args.model, args.recipe, args.output, args.dtype, args.force, args.backend,
                             method=args.method, smoothquant=args.smoothquant, calib=args.calib,
                             calib_samples=args.calib_samples, calib_len=args.calib_len, stream=args.stream,
                             target_bits=args.target_bits, candidates=args.candidates, outliers=args.outliers)
            elif args.command == "eval":
                eval_cmd(args.model, args.compare, as_json=args.json, corpus=args.corpus, ctx=args.ctx,
                         windows=args.windows, protocol=args.protocol, speed=not args.no_speed,
                         greedy_tokens=args.greedy_tokens, dtype=args.dtype, backend=args.backend,
                         calib=args.calib, calib_samples=args.calib_samples, calib_len=args.calib_len,
                         act_compute=args.act_compute)
            elif args.command == "generate":
                generate_cmd(args.model or None, _prompts(args.prompt, args.prompts), max_new_tokens=args.max_new_tokens, sample=args.sample,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                             raw=args.raw, recipe=args.recipe, dtype=args.dtype, backend=args.backend,
                             act_compute=args.act_compute)
            elif args.command == "info":
                if args.kernels:
                    kernels_cmd(args.path, dtype=args.dtype, calibrate=args.calibrate)
                elif args.calibrate:
                    raise ValueError("--calibrate applies to --kernels only")
                elif args.dtype is not None:
                    raise ValueError("--dtype applies to --kernels only")
                elif args.path is None:
                    raise ValueError("give a checkpoint folder or GGUF file, or --kernels")
                else:
                    info_cmd(args.path)
            elif args.command == "export":
                export_cmd(args.model, args.output, format=args.format, type=args.type, float_type=args.float_type,
                           strict=args.strict, force=args.force, recipe=args.recipe, graph=args.graph,
                           unfused=args.unfused)
    except (OSError, ValueError, TypeError) as e:
        print(f"lowbit {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
