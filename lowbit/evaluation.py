"""What quantization cost: perplexity, agreement with the float model, weight memory
and speed, for several models side by side.

Default corpus: the English prose of the Python Language Reference that every
CPython installation carries (``pydoc_data.topics``, about 465k characters, 110k
SmolLM2 tokens): offline everywhere, no download, and the same bytes for a given
Python version (its SHA-256 is reported with every result, so figures from two
machines are comparable exactly when the hashes match).  ``corpus=PATH`` uses a
user's UTF-8 text file instead.

Protocols (``protocol=``):

* ``"lowbit"``: non-overlapping windows of ``ctx`` tokens; every token of a window
  but the first is scored (predicted from the tokens before it in the window).
* ``"llama"``: llama.cpp's llama-perplexity: the same windows, the first token of each
  replaced by BOS when the tokenizer adds one, and only the second half of each
  window scored, so every scored token sees at least ``ctx/2`` tokens of context.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from .nn import QuantLinear, SplitQuantLinear
from .sparse import SparseQuantLinear
from .runtime import ACT_COMPUTE, Runner, check_positions

PROTOCOLS = ("lowbit", "llama")
# The corpus's tokens are split once: evaluation windows come from the first half,
# calibration samples from the second, so no calibrated model has seen its test text.
EVAL_SHARE = 0.5
GREEDY_PROMPT = "Write a short story about a robot who learns to paint."


def default_corpus() -> tuple[str, str]:
    """(text, name) of the default evaluation corpus.

    Example::

        >>> from lowbit.evaluation import default_corpus
        >>> text, name = default_corpus()
        >>> name.startswith("pydoc_data.topics"), len(text) > 100_000
        (True, True)
    """
    import platform

    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return text, f"pydoc_data.topics (Python {platform.python_version()} language reference)"


def load_corpus(corpus: str | os.PathLike | None) -> tuple[str, str]:
    """(text, name): the default corpus for None, else a UTF-8 text file.

    Example::

        >>> import tempfile
        >>> from lowbit.evaluation import load_corpus
        >>> with tempfile.TemporaryDirectory() as d:
        ...     load_corpus(d)
        Traceback (most recent call last):
        ...
        ValueError: corpus ... is a folder; expected a UTF-8 text file
    """
    if corpus is None:
        return default_corpus()
    p = Path(corpus)
    if p.is_dir():
        raise ValueError(f"corpus {str(corpus)!r} is a folder; expected a UTF-8 text file")
    if not p.is_file():
        raise FileNotFoundError(f"corpus file {str(corpus)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus file {str(corpus)!r} is not UTF-8 text ({e})") from None
    if not text.strip():
        raise ValueError(f"corpus file {str(corpus)!r} is empty")
    return text, str(p)


def _bos(tokenizer) -> int | None:
    """The BOS id when the tokenizer prepends one (llama.cpp's add_bos), else None."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True).input_ids
    return bos if ids and ids[0] == bos else None


def windows(tokenizer, text: str, ctx: int, limit: int | None, protocol: str) -> tuple[list[torch.Tensor], int]:
    """Token windows [ctx] and the index of the first scored logit in each."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    _check_count("ctx", ctx, 2)
    if limit is not None:
        _check_count("windows", limit, 1)
    ids = split_tokens(tokenizer, text)[0]
    n = ids.numel() // ctx
    if n == 0:
        raise ValueError(f"the evaluation part of the corpus has {ids.numel()} tokens, fewer than one "
                         f"window of ctx={ctx}")
    if limit is not None:
        n = min(n, limit)
    out = [ids[i * ctx:(i + 1) * ctx].clone() for i in range(n)]
    first = 0
    if protocol == "llama":
        bos = _bos(tokenizer)
        if bos is not None:
            for w in out:
                w[0] = bos
        first = ctx // 2
    return out, first


def split_tokens(tokenizer, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's token ids split into (evaluation part, calibration part): the first
    ``EVAL_SHARE`` of the tokens and the rest."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=True).input_ids, dtype=torch.long)
    cut = int(ids.numel() * EVAL_SHARE)
    return ids[:cut], ids[cut:]


def calibration_set(tokenizer, corpus: str | os.PathLike | None = None, *, samples: int = 128,
                    length: int = 512, seed: int = 0) -> torch.Tensor:
    """Calibration token ids [samples, length]: windows at seeded random offsets in the
    calibration part of the corpus (its second half, which ``evaluate`` never scores).

    Example::

        >>> import lowbit
        >>> from lowbit.evaluation import calibration_set
        >>> _, tok = lowbit.load_model()
        >>> ids = calibration_set(tok, samples=4, length=64)
        >>> ids.shape, bool((ids == calibration_set(tok, samples=4, length=64)).all())
        (torch.Size([4, 64]), True)
    """
    _check_count("calibration samples", samples, 1)
    _check_count("calibration length", length, 2)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"calibration seed must be an integer, got {seed!r}")
    text, name = load_corpus(corpus)
    part = split_tokens(tokenizer, text)[1]
    if part.numel() < length:
        raise ValueError(f"calibration length {length} is longer than the calibration part of the corpus "
                         f"{name!r} ({part.numel()} tokens, its second half)")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, part.numel() - length + 1, (samples,), generator=gen)
    return torch.stack([part[int(s):int(s) + length] for s in starts])


def _check_count(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of all (unique) parameters and buffers, and of the decoder linears' weights
    (``lm_head`` excluded; codes + scales + zero points for quantized ones)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.data_ptr(), t.dtype, t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    linear = sum(_linear_bytes(m) for _, m in _body_linears(model))
    return {"weight_bytes": total, "linear_weight_bytes": linear}


def _linear_bytes(m: nn.Module) -> int:
    """A linear's weight bytes: codes, scales, zero points and (act-order) input order."""
    if isinstance(m, SplitQuantLinear):
        return m.weight.nbytes
    if isinstance(m, SparseQuantLinear):
        return m.sqt.nbytes
    if not isinstance(m, QuantLinear):
        return m.weight.numel() * m.weight.element_size()
    order = m.input_order
    return m.weight.nbytes + (0 if order is None else order.numel() * order.element_size())


def _body_linears(model: nn.Module):
    """The linears of the decoder layers (not the output head)."""
    for name, m in model.named_modules():
        if isinstance(m, (QuantLinear, SplitQuantLinear, SparseQuantLinear, nn.Linear)) and not (name == "lm_head" or name.endswith(".lm_head")):
            yield name, m


def _has_weight_only(model: nn.Module) -> bool:
    """Whether the model has a quantized linear without an activation scheme (one that
    ``act_compute`` changes)."""
    return any(isinstance(m, QuantLinear) and m.act_scheme is None for m in model.modules())


def _linear_params(model: nn.Module) -> int:
    return sum(m.in_features * m.out_features for _, m in _body_linears(model))


def _prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
    return torch.tensor(tokenizer(prompt).input_ids)


def measure_speed(model: nn.Module, prompt: torch.Tensor, decode_tokens: int, repeats: int = 1,
                  act_compute: str | None = None) -> dict[str, float]:
    """Prefill tokens/s (one forward over ``prompt``) and decode tokens/s (greedy, one
    token per step with the KV cache), best of ``repeats`` after a warm-up, with
    ``Runner(model, act_compute=act_compute)``."""
    r = Runner(model, act_compute=act_compute)
    r.generate(prompt[:8], 2)  # warm-up: first-call allocations, kernel dispatch caches
    best_p = best_d = 0.0
    for _ in range(repeats):
        g = r.generate(prompt, decode_tokens)
        best_p, best_d = max(best_p, g.prefill_tokens_per_s), max(best_d, g.decode_tokens_per_s)
    return {"prefill_tokens_per_s": best_p, "decode_tokens_per_s": best_d}


@torch.inference_mode()
def evaluate(models: nn.Module | dict[str, nn.Module], tokenizer, *, reference: nn.Module | None = None,
             corpus: str | os.PathLike | None = None, ctx: int = 512, max_windows: int | None = 16,
             protocol: str = "lowbit", greedy_tokens: int = 48, prompt: str = GREEDY_PROMPT,
             speed: bool = True, prefill_tokens: int = 512, decode_tokens: int = 64,
             act_compute: str | None = None, progress: bool = False) -> list[dict]:
    r"""Evaluate one or several models (``{"name": model}``) on the same token windows.

    Per model: ``perplexity``; against ``reference`` (the float model, also reported as
    its own row): ``kl_divergence`` (mean KL(reference || model) per scored token,
    nats), ``top1_agreement`` (fraction of scored tokens whose argmax agrees),
    ``max_abs_logit_error`` / ``mean_abs_logit_error``, ``greedy_match`` (how many of
    ``greedy_tokens`` greedy tokens from ``prompt`` equal the reference's before the
    first difference); ``weight_bytes``, ``bits_per_linear_weight``; with ``speed``,
    ``prefill_tokens_per_s`` (``prefill_tokens`` corpus tokens in one forward) and
    ``decode_tokens_per_s`` (``decode_tokens`` greedy steps).  With ``act_compute``
    (``"int8"``), every model with weight-only quantized linears is evaluated a second
    time as ``Runner(model, act_compute=...)`` runs it, in a row ``"<name> act int8"``
    right after its own: the accuracy of that compute mode next to the weight-only one.

    Example::

        >>> import lowbit
        >>> from lowbit.evaluation import evaluate
        >>> model, tok = lowbit.load_model()
        >>> layer0 = lowbit.Recipe(weight="int4-asym-g64", modules=[r"layers\.0\."])  # one layer: fast
        >>> q = lowbit.quantize_model(model, layer0, inplace=False)
        >>> rows = evaluate({"int4-layer0": q}, tok, reference=model, ctx=32, max_windows=1,
        ...                 greedy_tokens=4, speed=False)
        >>> [(r["model"], r["scored_tokens"], r["greedy_tokens"]) for r in rows]
        [('float', 31, 4), ('int4-layer0', 31, 4)]
        >>> rows[0]["kl_divergence"], 0 < rows[1]["kl_divergence"] < 0.1, rows[1]["bits_per_linear_weight"] < 32
        (0.0, True, True)
    """
    if isinstance(models, nn.Module):
        models = {getattr(getattr(models, "lowbit_recipe", None), "name", "model"): models}
    if act_compute is not None and act_compute not in ACT_COMPUTE:
        raise ValueError(f"act_compute must be None or one of {sorted(ACT_COMPUTE)}, got {act_compute!r}")
    named = ({"float": reference} if reference is not None else {}) | dict(models)
    acts = {n: None for n in named}  # row name -> the Runner's act_compute
    runners = {}  # row name -> its Runner, built here where building it is the check
    if act_compute is not None:
        rows_in_order = {}
        for n, m in named.items():
            rows_in_order[n] = m
            if n in models and _has_weight_only(m):
                try:
                    r = Runner(m, act_compute=act_compute)
                except ValueError as e:  # weights it cannot take (2/3-bit codes): no row, said
                    warnings.warn(f"no '{n} act {act_compute}' row: {e}", stacklevel=3)
                    continue
                rows_in_order[f"{n} act {act_compute}"] = m
                acts[f"{n} act {act_compute}"] = act_compute
                runners[f"{n} act {act_compute}"] = r
        named = rows_in_order
    _check_count("ctx", ctx, 2)
    prompt_ids = _prompt_ids(tokenizer, prompt)
    for name, m in named.items():  # before any work: every window, generation and timing fits
        check_positions(m, ctx, what=f"ctx for model {name!r}")
        if reference is not None:
            check_positions(m, prompt_ids.numel(), greedy_tokens, what=f"the greedy prompt for model {name!r}")
        if speed:
            check_positions(m, prefill_tokens, decode_tokens, what=f"the speed prompt for model {name!r}")
    text, corpus_name = load_corpus(corpus)
    wins, first = windows(tokenizer, text, ctx, max_windows, protocol)
    runners = {n: runners[n] if n in runners else Runner(m, act_compute=acts[n]) for n, m in named.items()}
    acc = {n: dict(nll=0.0, kl=0.0, top1=0, max_err=0.0, abs_err=0.0, count=0) for n in named}
    it = wins
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(wins, desc=f"evaluating {len(named)} model(s) on {len(wins)} windows", unit="window", leave=False)
    for w in it:
        target = w[first + 1:]
        ref_logp = None
        for name, r in runners.items():
            logits = r.forward(w, r.new_cache(ctx), all_logits=True)[first:-1].float()
            # float64 log-probabilities: KL's terms nearly cancel for close models, and in
            # float32 their rounding alone made it negative (-1.7e-8 for q4_1 on its own grid)
            logp = torch.log_softmax(logits.double(), dim=-1)
            a = acc[name]
            a["nll"] -= float(logp.gather(1, target[:, None]).sum())
            a["count"] += target.numel()
            if reference is not None and name == "float":
                ref_logp, ref_logits = logp, logits
            elif ref_logp is not None:
                a["kl"] += float((ref_logp.exp() * (ref_logp - logp)).sum())
                a["top1"] += int((ref_logits.argmax(-1) == logits.argmax(-1)).sum())
                err = (logits - ref_logits).abs()
                a["max_err"] = max(a["max_err"], float(err.max()))
                a["abs_err"] += float(err.mean(-1).sum())
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    ref_tokens = runners["float"].generate(prompt_ids, greedy_tokens).tokens if reference is not None else None
    speed_prompt = torch.cat(wins)[:prefill_tokens] if speed else None
    rows = []
    for name, model in named.items():
        a = acc[name]
        sizes = weight_bytes(model)
        row = {
            "model": name,
            "recipe": getattr(getattr(model, "lowbit_recipe", None), "name", None),
            "act_compute": acts[name],
            "perplexity": math.exp(a["nll"] / a["count"]),
            "scored_tokens": a["count"],
            **sizes,
            "bits_per_linear_weight": sizes["linear_weight_bytes"] * 8 / max(_linear_params(model), 1),
            "corpus": corpus_name, "corpus_sha256": digest, "ctx": ctx, "protocol": protocol,
            "windows": len(wins),
        }
        if reference is not None:
            is_ref = name == "float"
            toks = ref_tokens if is_ref else runners[name].generate(prompt_ids, greedy_tokens).tokens
            same = next((i for i, (x, y) in enumerate(zip(toks, ref_tokens)) if x != y), min(len(toks), len(ref_tokens)))
            row.update(kl_divergence=0.0 if is_ref else a["kl"] / a["count"],
                       top1_agreement=1.0 if is_ref else a["top1"] / a["count"],
                       max_abs_logit_error=0.0 if is_ref else a["max_err"],
                       mean_abs_logit_error=0.0 if is_ref else a["abs_err"] / a["count"],
                       greedy_match=same, greedy_tokens=len(ref_tokens))
        if speed:
            row.update(measure_speed(model, speed_prompt, decode_tokens, act_compute=acts[name]))
        rows.append(row)
    return rows


COLUMNS = [
    ("model", "model", "{}"), ("bits/w", "bits_per_linear_weight", "{:.2f}"), ("weights MB", "weight_bytes", "{:.1f}"),
    ("ppl", "perplexity", "{:.3f}"), ("KL", "kl_divergence", "{:.4f}"), ("top-1", "top1_agreement", "{:.1%}"),
    ("max|dlogit|", "max_abs_logit_error", "{:.3f}"), ("mean|dlogit|", "mean_abs_logit_error", "{:.4f}"),
    ("greedy", "greedy_match", "{}"), ("prefill tok/s", "prefill_tokens_per_s", "{:.0f}"),
    ("decode tok/s", "decode_tokens_per_s", "{:.1f}"),
]


def format_table(rows: list[dict]) -> str:
    """An aligned text table of ``evaluate`` rows (columns a row lacks are left out).

    Example::

        >>> print(format_table([{"model": "float", "perplexity": 13.6, "weight_bytes": 538e6}]))
        model  weights MB     ppl
        -------------------------
        float       538.0  13.600
    """
    cols = [c for c in COLUMNS if any(c[1] in r for r in rows)]
    cells = []
    for r in rows:
        line = []
        for _, key, fmt in cols:
            v = r.get(key)
            if key == "weight_bytes" and v is not None:
                v = v / 1e6
            if key == "greedy_match" and v is not None:
                v = f"{v}/{r['greedy_tokens']}"
            line.append("-" if v is None else fmt.format(v))
        cells.append(line)
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(cols)]
    fmt_row = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                                     for i, (v, w) in enumerate(zip(vals, widths)))
    head = fmt_row([h for h, _, _ in cols])
    return "\n".join([head, "-" * len(head)] + [fmt_row(c) for c in cells])


__all__ = ["evaluate", "default_corpus", "load_corpus", "windows", "split_tokens", "calibration_set", "EVAL_SHARE", "weight_bytes", "measure_speed",
           "format_table", "PROTOCOLS"]
