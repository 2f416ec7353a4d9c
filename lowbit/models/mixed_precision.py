"""Automated mixed precision: measure how much each linear costs at each candidate scheme
(the KL divergence of the model's next-token distribution on calibration text when
that module alone is quantized), predict it cheaply too (the input-weighted weight
error), then choose per module the scheme that meets an average bits-per-weight budget
with the least predicted loss, and write the choice as a recipe's overrides.

Bits per weight count everything a module stores: codes, scales and zero points
(``scheme_bits``).  The loss of a mix is predicted as the sum of the modules' measured
KL increases (first order: small perturbations add), and the allocation is a greedy
multiple-choice knapsack: start from every module's largest candidate, then repeatedly
take the step down (to the module's next candidate on the lower convex hull of its
(bits, KL) points) that saves bits at the least KL per bit, until the budget holds.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from ..ops import dequantize, quantize
from ..recipe import Recipe, fit_group
from ..scheme import QuantScheme, check_act_weight

# 8, 4, 3 and 2 bits; two group sizes at 4 bits (float16 scales and zero points, as GGUF stores them)
DEFAULT_CANDIDATES = ("int8-sym", "int4-asym-g128-f16", "int4-asym-g32-f16", "int3-asym-g32-f16",
                      "int2-asym-g32-f16")


def scheme_bits(scheme: str, n: int, k: int) -> float:
    """Bits per weight of an [n, k] weight stored in ``scheme``: codes, scales and zero
    points over n * k.

    Example::

        >>> from lowbit.models.mixed_precision import scheme_bits
        >>> scheme_bits("int4-sym-g32-f16", 64, 576), scheme_bits("int4-asym-g64-f16", 64, 576)
        (4.5, 4.375)
    """
    s = QuantScheme.parse(scheme)
    shape = (n, k)
    size = torch.empty(0, dtype=s.code_dtype).element_size()
    total = math.prod(s.packed_shape(shape)) * size * 8
    scales = math.prod(s.scale_shape(shape))
    total += scales * torch.empty(0, dtype=s.scale_dtype).element_size() * 8
    if not s.symmetric:
        total += scales * torch.empty(0, dtype=s.zero_point_dtype).element_size() * 8
    return total / (n * k)


@dataclass
class Sensitivity:
    """What each module costs at each candidate: ``kl[name][scheme]`` (measured, nats per
    token), ``proxy[name][scheme]`` (predicted: sum_j E[x_j^2] ||dW[:, j]||^2, the
    expected squared output error), ``bits[name][scheme]``, ``numel[name]``."""

    kl: dict[str, dict[str, float]] = field(default_factory=dict)
    proxy: dict[str, dict[str, float]] = field(default_factory=dict)
    bits: dict[str, dict[str, float]] = field(default_factory=dict)
    numel: dict[str, int] = field(default_factory=dict)
    tokens: int = 0

    def bits_per_weight(self, choice: dict[str, str]) -> float:
        """The average bits per weight of a choice of scheme per module, over the modules."""
        return sum(self.bits[n][s] * self.numel[n] for n, s in choice.items()) / sum(self.numel.values())

    def predicted_kl(self, choice: dict[str, str]) -> float:
        """The KL a choice is predicted to cost: the sum of its modules' measured KL."""
        return sum(self.kl[n][s] for n, s in choice.items())

    def spearman(self) -> dict[str, float | None]:
        """Rank correlation of the proxy with the measured KL over modules, per candidate
        scheme (as asked; a module's fitted group size counts as the same candidate) and
        over every (module, candidate) pair (``"all"``)."""
        pairs: dict[str, list[tuple[float, float]]] = {}
        for name, per in self.kl.items():
            for asked, kl in per.items():
                pairs.setdefault(asked, []).append((self.proxy[name][asked], kl))
        pairs["all"] = [p for v in list(pairs.values()) for p in v]
        return {key: _spearman(v) for key, v in pairs.items() if len(v) > 2}

    def rows(self, choice: dict[str, str] | None = None) -> list[dict]:
        """One row per (module, candidate): the table ``save`` writes."""
        return [{"module": name, "layer": _layer(name), "kind": name.rsplit(".", 1)[-1], "scheme": scheme,
                 "bits": round(self.bits[name][scheme], 4), "kl": self.kl[name][scheme],
                 "proxy": self.proxy[name][scheme], "chosen": bool(choice and choice.get(name) == scheme)}
                for name in self.kl for scheme in self.kl[name]]


def _ranks(v: torch.Tensor) -> torch.Tensor:
    """Ranks of ``v`` from 0, ties given the mean of the ranks they span."""
    order = v.argsort()
    ranks = torch.empty_like(v)
    ranks[order] = torch.arange(len(v), dtype=v.dtype)
    for value in v.unique():
        tied = v == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def _spearman(pairs: list[tuple[float, float]]) -> float | None:
    a = torch.tensor(pairs, dtype=torch.float64)
    ranks = torch.stack([_ranks(a[:, 0]), _ranks(a[:, 1])], dim=1)
    ranks -= ranks.mean(dim=0)
    denom = ranks.norm(dim=0).prod()
    return float((ranks[:, 0] * ranks[:, 1]).sum() / denom) if denom > 0 else None  # no spread: undefined


def _layer(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _kl(ref_logp: torch.Tensor, logits: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())


def measure_sensitivity(model: nn.Module, calibration: torch.Tensor, recipe: Recipe | str | None = None,
                        candidates=DEFAULT_CANDIDATES, progress: bool = False) -> Sensitivity:
    """Quantize each linear the recipe selects (default: the 7 decoder linears of every
    layer) alone at each candidate scheme (round to nearest; group sizes fitted as
    ``quantize_model`` fits them) and measure the KL divergence of the model's
    next-token distribution from the float model's on ``calibration`` (token ids
    [samples, length]); also the cheap proxy from one pass of input statistics.

    Example::

        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from lowbit.models.mixed_precision import measure_sensitivity
        >>> cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                   num_attention_heads=4, num_key_value_heads=2)
        >>> m = LlamaForCausalLM(cfg).eval().requires_grad_(False)
        >>> s = measure_sensitivity(m, torch.randint(0, 64, (2, 16)), candidates=["int8-sym", "int2-asym-g32-f16"])
        >>> name = "model.layers.0.mlp.down_proj"
        >>> s.kl[name]["int8-sym"] < s.kl[name]["int2-asym-g32-f16"], s.bits[name]["int8-sym"]
        (True, 8.25)
    """
    recipe = Recipe.get(recipe) if recipe is not None else Recipe(weight="int8-sym")
    if not isinstance(calibration, torch.Tensor) or calibration.dtype != torch.int64 or calibration.dim() != 2 \
            or calibration.numel() == 0:
        raise ValueError("calibration must be token ids: a non-empty int64 tensor [samples, length]")
    candidates = list(dict.fromkeys(candidates))
    if not candidates:
        raise ValueError("give at least one candidate scheme")
    for c in candidates:
        QuantScheme.parse(c)  # a bad scheme is named before any work
    # the output projection keeps the recipe's own scheme (Recipe.scheme_for gives it no
    # overrides; tied to the embedding, changing it would change the embedding too)
    linears = {name: mod for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and recipe.scheme_for(name) is not None
               and not (name == "lm_head" or name.endswith(".lm_head"))}
    if not linears:
        raise ValueError(f"recipe '{recipe.name}' selects no linear of this model")
    for name, mod in linears.items():  # every candidate must take the module's activations
        act = recipe.scheme_for(name)[1]
        for c in candidates:
            try:
                check_act_weight(fit_group(c, mod.in_features), act, mod.in_features)
            except ValueError as e:
                raise ValueError(f"candidate '{c}' cannot run module '{name}' with the recipe's activations: "
                                 f"{e}") from None
    device = next(model.parameters()).device
    calibration = calibration.to(device)
    energy = {name: torch.zeros(mod.in_features, dtype=torch.float64, device=device) for name, mod in linears.items()}

    def record(name):
        def hook(_mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            energy[name] += (x * x).sum(0)
        return hook

    handles = [mod.register_forward_pre_hook(record(name)) for name, mod in linears.items()]
    resume = _Resume(model)
    try:
        with torch.inference_mode():
            ref = []
            for row in calibration:
                resume.begin()
                ref.append(torch.log_softmax(model(row[None], use_cache=False).logits.float(), -1))
    finally:
        for h in handles + resume.handles:
            h.remove()
    out = Sensitivity(tokens=calibration.numel())
    items = list(linears.items())
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(items, desc=f"sensitivity ({len(candidates)} schemes)", unit="module")
    for name, mod in items:
        w = mod.weight
        n, k = w.shape
        out.numel[name] = n * k
        mean_sq = (energy[name] / out.tokens).to(torch.float32).to(w.device)
        for asked in candidates:
            scheme = fit_group(asked, k)
            dq = dequantize(quantize(w.detach().float(), scheme), w.dtype)
            out.proxy.setdefault(name, {})[asked] = float((((dq.float() - w.float()) ** 2) * mean_sq).sum())
            out.bits.setdefault(name, {})[asked] = scheme_bits(scheme, n, k)
            original = w.data
            w.data = dq
            try:
                with torch.inference_mode():
                    kl = sum(_kl(r, resume.logits(name, i, row)) for i, (r, row) in enumerate(zip(ref, calibration)))
                kl /= len(ref)
            finally:
                w.data = original
            out.kl.setdefault(name, {})[asked] = max(kl, 0.0)
    return out


class _Resume:
    """A Llama-family model's forward resumed at the decoder layer a module belongs to,
    from that layer's inputs recorded in the reference pass (the layers before it are
    unchanged, so their outputs are too): about half the work of a whole forward."""

    def __init__(self, model: nn.Module):
        self.model = model
        inner = getattr(model, "model", None)
        self.layers = getattr(inner, "layers", None)
        self.norm = getattr(inner, "norm", None)
        self.inputs: list[dict[int, tuple]] = []
        self.handles = []
        if isinstance(self.layers, nn.ModuleList) and self.norm is not None and hasattr(model, "lm_head"):
            for i, layer in enumerate(self.layers):
                self.handles.append(layer.register_forward_pre_hook(self._record(i), with_kwargs=True))
        else:
            self.layers = None

    def begin(self) -> None:
        self.inputs.append({})

    def _record(self, i):
        def hook(_mod, args, kwargs):
            self.inputs[-1][i] = (args, kwargs)
        return hook

    def logits(self, name: str, sample: int, row: torch.Tensor) -> torch.Tensor:
        start = _layer(name)
        if self.layers is None or start < 0 or start not in self.inputs[sample]:
            return self.model(row[None], use_cache=False).logits  # not a decoder layer's module: the whole forward
        args, kwargs = self.inputs[sample][start]
        h = args[0] if args else kwargs["hidden_states"]
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        if rest.get("past_key_values") is not None or rest.get("use_cache"):
            raise ValueError("the reference pass ran with a KV cache: resuming would attend to its keys")
        for layer in self.layers[start:]:
            out = layer(h, *args[1:], **rest)
            h = out[0] if isinstance(out, tuple) else out
        return self.model.lm_head(self.norm(h))


def _ladder(kl: dict[str, float], bits: dict[str, float]) -> list[str]:
    """A module's candidates worth stepping through, largest first: the lower convex hull
    of (bits, KL).  A candidate with more bits and no less KL than a smaller one is never
    worth taking; one above the line between its neighbours is never the cheapest way to
    save those bits (the greedy steps at the least KL per bit follow the hull)."""
    ladder: list[str] = []
    for scheme in sorted(kl, key=lambda s: (-bits[s], kl[s])):
        if ladder and bits[ladder[-1]] == bits[scheme]:
            continue  # as many bits as the one kept (sorted: no less KL): no step between them
        while ladder and kl[ladder[-1]] >= kl[scheme]:
            ladder.pop()  # more bits for no less loss
        while len(ladder) >= 2:
            a, b = ladder[-2], ladder[-1]  # is b above the line from a to this scheme?
            if (kl[b] - kl[a]) * (bits[a] - bits[scheme]) >= (kl[scheme] - kl[a]) * (bits[a] - bits[b]):
                ladder.pop()
            else:
                break
        ladder.append(scheme)
    return ladder


def allocate(sens: Sensitivity, target_bits: float) -> dict[str, str]:
    """Per module the candidate scheme (as asked) that meets an average of ``target_bits``
    bits per weight over the measured modules with the least summed KL (greedy: see the
    module docstring; then the bits the last step left over are spent on steps back up,
    and one scheme for every module wins if it fits with less loss).  Refuses a budget
    below the smallest candidates'; above the largest's, every module gets its largest.

    Example::

        >>> from lowbit.models.mixed_precision import Sensitivity, allocate
        >>> s = Sensitivity(kl={"a": {"8": 0.0, "4": 0.5}, "b": {"8": 0.0, "4": 0.1}},
        ...                 proxy={}, bits={"a": {"8": 8.0, "4": 4.0}, "b": {"8": 8.0, "4": 4.0}},
        ...                 numel={"a": 100, "b": 100})
        >>> allocate(s, 6.0)
        {'a': '8', 'b': '4'}
    """
    if isinstance(target_bits, bool) or not isinstance(target_bits, (int, float)) or not target_bits > 0:
        raise ValueError(f"target_bits must be a positive number, got {target_bits!r}")
    if not sens.kl:
        raise ValueError("the sensitivity holds no module to allocate bits to")
    total = sum(sens.numel.values())
    # each module's non-dominated candidates by bits, largest first: a candidate with more bits
    # and no less KL than a smaller one is never worth taking
    ladders = {name: _ladder(per, sens.bits[name]) for name, per in sens.kl.items()}
    lo = sens.bits_per_weight({n: ladder[-1] for n, ladder in ladders.items()})
    hi = sens.bits_per_weight({n: ladder[0] for n, ladder in ladders.items()})
    if target_bits < lo - 1e-9:
        raise ValueError(f"target_bits={target_bits} is below {lo:.3f}, the smallest the candidates reach")
    step = {name: 0 for name in ladders}
    used = hi * total
    budget = target_bits * total
    while used > budget + 1e-6:
        best, best_rate = None, math.inf
        for name, ladder in ladders.items():
            i = step[name]
            if i + 1 < len(ladder):
                a, b = ladder[i], ladder[i + 1]
                saved = (sens.bits[name][a] - sens.bits[name][b]) * sens.numel[name]
                rate = (sens.kl[name][b] - sens.kl[name][a]) / saved
                if rate < best_rate:
                    best, best_rate = name, rate
        if best is None:
            break
        a, b = ladders[best][step[best]], ladders[best][step[best] + 1]
        used -= (sens.bits[best][a] - sens.bits[best][b]) * sens.numel[best]
        step[best] += 1
    while True:  # the last step may have saved more than needed: spend what is left on steps back up
        best, best_gain = None, 0.0
        for name, ladder in ladders.items():
            i = step[name]
            if i > 0:
                a, b = ladder[i - 1], ladder[i]
                cost = (sens.bits[name][a] - sens.bits[name][b]) * sens.numel[name]
                gain = sens.kl[name][b] - sens.kl[name][a]
                if used + cost <= budget + 1e-6 and gain > best_gain:
                    best, best_gain = name, gain
        if best is None:
            break
        a, b = ladders[best][step[best] - 1], ladders[best][step[best]]
        used += (sens.bits[best][a] - sens.bits[best][b]) * sens.numel[best]
        step[best] -= 1
    choice = {name: ladders[name][step[name]] for name in ladders}
    # one scheme for all that fits is a mix too: the greedy's last step can lose to it
    common = set.intersection(*(set(per) for per in sens.kl.values()))
    for scheme in sorted(common):
        uniform = dict.fromkeys(sens.kl, scheme)
        if sens.bits_per_weight(uniform) * total <= budget + 1e-6 and \
                sens.predicted_kl(uniform) < sens.predicted_kl(choice):
            choice = uniform
    return choice


def mixed_recipe(base: Recipe | str, choice: dict[str, str], target_bits: float) -> Recipe:
    """``base`` with one override per module naming its chosen weight scheme (the most
    common choice is also the recipe's ``weight``); activations and the rest as in
    ``base``.

    Example::

        >>> from lowbit.models.mixed_precision import mixed_recipe
        >>> r = mixed_recipe("w4a16-g128", {"model.layers.0.mlp.up_proj": "int8-sym",
        ...                                 "model.layers.0.mlp.down_proj": "int4-asym-g32-f16",
        ...                                 "model.layers.1.mlp.down_proj": "int4-asym-g32-f16"}, 5)
        >>> r.weight, r.overrides[0], len(r.overrides), r.name
        ('int4-asym-g32-f16', ('^model\\\\.layers\\\\.0\\\\.mlp\\\\.up_proj$', {'weight': 'int8-sym'}), 3, 'auto-5b')
    """
    base = Recipe.get(base)
    counts: dict[str, int] = {}
    for s in choice.values():
        counts[s] = counts.get(s, 0) + 1
    weight = max(counts, key=counts.get)
    # one override per module, after the base's own: each module gets its choice whatever
    # the base's overrides say (the last matching override wins)
    overrides = tuple(base.overrides) + tuple((f"^{re.escape(name)}$", {"weight": s}) for name, s in choice.items())
    recipe = replace(base, weight=weight, overrides=overrides, name=f"auto-{target_bits:g}b")
    wrong = [n for n, s in choice.items() if (recipe.scheme_for(n) or (None,))[0] != s]
    if wrong:
        raise ValueError(f"the recipe cannot give these modules their chosen scheme: {wrong[:5]}")
    return recipe


def save_sensitivity(sens: Sensitivity, choice: dict[str, str], folder: str | Path, target_bits: float) -> list[Path]:
    """Write ``sensitivity.csv`` (one row per module and candidate), ``sensitivity.json``
    (the same, with the proxy's rank correlation and the choice) and ``sensitivity.png``
    (KL per layer and module kind at each candidate; the chosen bits) into ``folder``."""
    folder = Path(folder)
    rows = sens.rows(choice)
    paths = [folder / "sensitivity.csv", folder / "sensitivity.json", folder / "sensitivity.png"]
    for p in paths:
        if p.exists():
            raise ValueError(f"{p} exists")
    with open(paths[0], "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    achieved = sens.bits_per_weight(choice)
    paths[1].write_text(json.dumps({"target_bits": target_bits, "bits_per_weight": achieved,
                                    "calibration_tokens": sens.tokens, "spearman_proxy_vs_kl": sens.spearman(),
                                    "choice": choice, "rows": rows}, indent=1))
    _plot(sens, choice, paths[2], target_bits, achieved)
    return paths


def _plot(sens: Sensitivity, choice: dict[str, str], path: Path, target: float, achieved: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    kinds = sorted({n.rsplit(".", 1)[-1] for n in sens.kl})
    schemes = list(next(iter(sens.kl.values())))

    def x(name):  # the layer, the module kinds side by side within it
        return _layer(name) + (kinds.index(name.rsplit(".", 1)[-1]) - (len(kinds) - 1) / 2) * 0.1

    fig, axes = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    for scheme in schemes:
        names = [n for n in sens.kl if scheme in sens.kl[n]]
        axes[0].scatter([x(n) for n in names], [max(sens.kl[n][scheme], 1e-7) for n in names], s=8, label=scheme)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("KL when quantized alone (nats/token)")
    axes[0].set_title(f"sensitivity of each module (within a layer: {', '.join(kinds)})")
    axes[0].legend(fontsize=7)
    for kind in kinds:
        names = [n for n in choice if n.endswith("." + kind)]
        axes[1].scatter([x(n) for n in names], [sens.bits[n][choice[n]] for n in names], s=14, label=kind)
    axes[1].set_ylabel("chosen bits per weight")
    axes[1].set_xlabel("decoder layer")
    axes[1].set_title(f"allocation for {target:g} bits/weight (achieved {achieved:.3f})")
    axes[1].legend(fontsize=7, ncol=len(kinds))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
