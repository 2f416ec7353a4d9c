"""How accurate each quantization method is on the bundled model: one table from
lowbit's own ``evaluate`` (default corpus, 16 windows of 512 tokens, lowbit protocol).

Rows: float; RTN, HQQ, GPTQ (with and without act-order) and AWQ at W4A16 g128 (g64
where 128 does not divide a module's in_features), g32 and symmetric g32 (Q4_0's grid),
and W3A16 g64; W8A8 with dynamic per-token activations, with SmoothQuant (dynamic,
and static per-tensor activation scales from calibration).  Columns: bits per weight of
the decoder linears (scales and zero points counted), perplexity, KL vs float, top-1
agreement, quantization time, peak resident memory of the process that quantized.

Each row runs in its own process (so peak memory is that method's), loads the float
model, quantizes it with the calibration set (``lowbit.evaluation.calibration_set``:
the corpus's second half, which evaluation never scores) and evaluates it against the
float model.  ``--peers FILE`` appends rows written by ``benchmarks/accuracy_peers.py``
(llm-compressor, hqq, optimum-quanto evaluated by the same code).

Usage::

    python benchmarks/accuracy.py                      # every row, 128 calibration samples
    python benchmarks/accuracy.py --calib-samples 32 --only w4a16-g32 --json out.json
    python benchmarks/accuracy.py --peers peers.json   # with the peers' rows
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rows_spec() -> dict[str, dict]:
    """Row name -> recipe fields (``lowbit.Recipe`` keyword arguments)."""
    spec: dict[str, dict] = {}
    for tag, weight in [("w4a16-g128", "int4-asym-g128-f16"), ("w4a16-g32", "int4-asym-g32-f16"),
                        ("w4a16-sym-g32", "int4-sym-g32-f16"), ("w3a16-g64", "int3-asym-g64-f16")]:
        spec[f"{tag} rtn"] = dict(weight=weight)
        spec[f"{tag} hqq"] = dict(weight=weight, method="hqq")
        spec[f"{tag} gptq"] = dict(weight=weight, method="gptq", method_args={"act_order": False})
        spec[f"{tag} gptq act-order"] = dict(weight=weight, method="gptq", method_args={"act_order": True})
        spec[f"{tag} gptq mse"] = dict(weight=weight, method="gptq", observer="mse", method_args={"act_order": False})
        spec[f"{tag} gptq act-order mse"] = dict(weight=weight, method="gptq", observer="mse",
                                                 method_args={"act_order": True})
        spec[f"{tag} awq no-clip"] = dict(weight=weight, method="awq", method_args={"clip": False})
        spec[f"{tag} awq"] = dict(weight=weight, method="awq")  # clip search on
    spec["w8a8 rtn"] = dict(weight="int8-sym", activation="int8-sym-token")
    spec["w8a8 smoothquant-0.5"] = dict(weight="int8-sym", activation="int8-sym-token", smoothquant=0.5)
    spec["w8a8 smoothquant-auto"] = dict(weight="int8-sym", activation="int8-sym-token", smoothquant="auto")
    spec["w8a8 gptq smoothquant-auto"] = dict(weight="int8-sym", activation="int8-sym-token", smoothquant="auto",
                                              method="gptq")
    spec["w8a8 static smoothquant-0.5"] = dict(weight="int8-sym", activation="int8-sym-tensor", smoothquant=0.5)
    spec["w8a8 static rtn"] = dict(weight="int8-sym", activation="int8-sym-tensor")
    spec["w8a8 static smoothquant-0.5 percentile"] = dict(weight="int8-sym", activation="int8-sym-tensor",
                                                          smoothquant=0.5, act_observer="percentile")
    return spec


def _evaluate(model, tok, ref):
    from lowbit.evaluation import evaluate

    return evaluate({"x": model}, tok, reference=ref, speed=False, greedy_tokens=16)


def worker(name: str, calib_samples: int, calib_len: int) -> dict:
    """Quantize and evaluate one row in this process."""
    import torch

    import lowbit
    from lowbit.evaluation import calibration_set

    torch.manual_seed(0)
    model, tok = lowbit.load_model()
    if name == "float":
        row = _evaluate(model, tok, None)[0]
        row.update(model="float", quant_seconds=0.0)
    else:
        recipe = lowbit.Recipe(name=name, **rows_spec()[name])
        ids = calibration_set(tok, samples=calib_samples, length=calib_len) if recipe.needs_calibration else None
        t0 = time.perf_counter()
        q = lowbit.quantize_model(model, recipe, inplace=False, calibration=ids)
        seconds = time.perf_counter() - t0
        row = _evaluate(q, tok, model)[1]
        row.update(model=name, quant_seconds=seconds, method=recipe.method,
                   calibration=q.lowbit_quantization.get("calibration"))
    row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


COLUMNS = [("row", "model", "{}"), ("bits/w", "bits_per_linear_weight", "{:.2f}"), ("ppl", "perplexity", "{:.3f}"),
           ("ppl vs float", "ppl_increase", "{:+.1%}"), ("KL", "kl_divergence", "{:.4f}"),
           ("top-1", "top1_agreement", "{:.1%}"), ("quant s", "quant_seconds", "{:.1f}"),
           ("peak MB", "peak_rss_mb", "{:.0f}")]


def table(rows: list[dict]) -> str:
    float_ppl = next((r["perplexity"] for r in rows if r["model"] == "float"), None)
    cells = []
    for r in rows:
        if float_ppl and "perplexity" in r:
            r["ppl_increase"] = r["perplexity"] / float_ppl - 1
        if "error" in r:
            cells.append([r["model"], f"error: {r['error'][:90]}"] + [""] * (len(COLUMNS) - 2))
            continue
        cells.append(["-" if r.get(k) is None else f.format(r[k]) for _, k, f in COLUMNS])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(COLUMNS)]
    line = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                                  for i, (v, w) in enumerate(zip(vals, widths)))
    head = line([h for h, _, _ in COLUMNS])
    return "\n".join([head, "-" * len(head)] + [line(c) for c in cells])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="row names (exact), in this order (default: all rows)")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--peers", help="append the rows of a benchmarks/accuracy_peers.py JSON file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.calib_samples, a.calib_len)))
        return
    unknown = set(a.only or ()) - set(rows_spec()) - {"float"}
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}; rows: {', '.join(rows_spec())}")
    names = ["float"] + [n for n in (a.only or rows_spec()) if n != "float"]
    rows = []
    for name in names:
        cmd = [sys.executable, __file__, "--worker", name, "--calib-samples", str(a.calib_samples),
               "--calib-len", str(a.calib_len)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        else:
            rows.append({"model": name, "error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # each row as it comes
    if a.peers:
        with open(a.peers) as f:
            peers = json.load(f)
        rows += [dict(r, model=f"{r.get('peer', 'peer')}: {r['model']}") for r in peers]
    print(f"calibration: {a.calib_samples} x {a.calib_len} tokens; evaluation: {rows[0].get('corpus')}, "
          f"{rows[0].get('windows')} windows of {rows[0].get('ctx')}")
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
