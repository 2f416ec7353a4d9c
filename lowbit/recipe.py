"""Recipes: which modules of a model get which weight and activation scheme.

A recipe is plain data (a frozen dataclass that round-trips through JSON) and is
saved with every quantized checkpoint.  Module names are matched with
``re.search`` against the names of ``model.named_modules()``; the last matching
override wins.

Example::

    >>> from lowbit.recipe import Recipe
    >>> r = Recipe.get("w4a16-g128")
    >>> r.weight, r.activation
    ('int4-asym-g128-f16', None)
    >>> r.scheme_for("model.layers.3.mlp.down_proj")
    ('int4-asym-g128-f16', None)
    >>> r.scheme_for("lm_head") is None
    True
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from .scheme import QuantScheme, act_scheme_problem, check_act_weight

# How weights are rounded (``lowbit.algorithms`` implements each; the names live here
# so that a recipe is checked without importing the algorithms).
METHODS = ("rtn", "hqq", "gptq", "awq")
WEIGHT_OBSERVERS = ("minmax", "mse")
ACT_OBSERVERS = ("minmax", "ema", "percentile")

# The 7 linears of every decoder layer of a Llama-family model.
DECODER_LINEARS = r"layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$"


@dataclass(frozen=True)
class Recipe:
    """How to quantize a model.

    Attributes:
        weight: weight scheme of the selected linears (``lowbit.QuantScheme`` string).
        activation: None (weight-only) or an 8-bit activation scheme: per token / per
            tensor (W8A8 / W4A8), or in blocks along K (``"int8-sym-g32"``: llama.cpp's
            Q8_0 activations with any 4/8-bit weight, integer dot products per block);
            every weight scheme it meets must be one ``lowbit.linear`` runs with it
            (``lowbit.scheme.check_act_weight``).
        modules: regexes selecting the linears to quantize (default: the 7 decoder
            linears q/k/v/o/gate/up/down); a single string is one regex.
        overrides: ``[regex, {"weight": scheme or None, "activation": scheme or None}]``
            pairs applied after ``modules``; ``"weight": None`` keeps a module float.
        lm_head: scheme for the output projection (None: stays float).  With tied
            embeddings the embedding stays float (and tied storage is split) unless
            ``embedding`` is set too.
        lm_head_activation: None (weight-only) or the activation scheme of ``lm_head``
            (blocks, ``"int8-sym-g32"``, as llama.cpp runs its output projection).
        embedding: scheme for the token embedding (None: stays float), rows quantized
            per row / group along the hidden dim.
        name: the preset name, or "custom".
        method: how weights are rounded: "rtn" (round to nearest), "hqq" (half-quadratic
            scale/zero-point optimization, no calibration), "gptq" or "awq" (both
            calibrated layer by layer).
        method_args: the method's parameters (e.g. ``{"act_order": true}`` for GPTQ);
            see ``lowbit.algorithms``.
        smoothquant: None, a migration strength alpha in [0, 1], or "auto" (a small search
            per layer): fold SmoothQuant scales into the norms before quantizing (W8A8).
        observer: weight scales from "minmax" or "mse" (MSE-optimal clipping, weighted by
            the input's energy when calibrating).
        act_observer: static per-tensor activation scales (activation ``...-tensor``) from
            "minmax", "ema" (moving-average min-max) or "percentile".

    A preset name followed by ``:method`` (``"w4a16-g128:gptq"``) is that preset with
    another method.

    Example::

        >>> Recipe(weight="int8-sym", overrides=(("down_proj", {"weight": None}),)).scheme_for(
        ...     "model.layers.0.mlp.down_proj") is None
        True
    """

    weight: str
    activation: str | None = None
    modules: tuple[str, ...] = (DECODER_LINEARS,)
    overrides: tuple[tuple[str, dict], ...] = ()
    lm_head: str | None = None
    lm_head_activation: str | None = None
    embedding: str | None = None
    name: str = "custom"
    method: str = "rtn"
    method_args: dict = field(default_factory=dict)
    smoothquant: float | str | None = None
    observer: str = "minmax"
    act_observer: str = "minmax"

    def __post_init__(self) -> None:
        _choice(self.method, METHODS, "method")
        _choice(self.observer, WEIGHT_OBSERVERS, "observer")
        _choice(self.act_observer, ACT_OBSERVERS, "act_observer")
        if not isinstance(self.method_args, Mapping) or not all(isinstance(k, str) for k in self.method_args):
            raise ValueError(f"recipe method_args: expected an object of parameter: value, got {self.method_args!r}")
        object.__setattr__(self, "method_args", dict(self.method_args))
        if self.method == "hqq" and self.observer != "minmax":
            raise ValueError("recipe observer: hqq chooses its own scales; the observer must be 'minmax'")
        sq = self.smoothquant
        if sq is not None and sq != "auto" and (isinstance(sq, bool) or not isinstance(sq, (int, float))
                                                  or not 0 <= sq <= 1):
            raise ValueError(f"recipe smoothquant: expected null, an alpha in [0, 1] or \"auto\", got {sq!r}")
        object.__setattr__(self, "modules", _patterns(self.modules))
        object.__setattr__(self, "overrides", _overrides(self.overrides))
        if not isinstance(self.name, str):
            raise ValueError(f"recipe name: expected a string, got {self.name!r}")
        for label, s in [("weight", self.weight), ("lm_head", self.lm_head), ("embedding", self.embedding)]:
            if s is not None or label == "weight":
                _weight_scheme(s, label)
        if self.activation is not None:
            _act_scheme(self.activation, "activation")
        if self.lm_head_activation is not None:
            if self.lm_head is None:
                raise ValueError("recipe lm_head_activation: lm_head stays float (no lm_head scheme)")
            _act_scheme(self.lm_head_activation, "lm_head_activation")
            if QuantScheme.parse(self.lm_head_activation).granularity == "tensor":
                raise ValueError("recipe lm_head_activation: a per-tensor scheme needs calibrated scales, which "
                                 "lm_head does not get; use one chosen on the fly (per token or in blocks)")
            try:
                check_act_weight(self.lm_head, self.lm_head_activation)
            except ValueError as e:
                raise ValueError(f"recipe lm_head/lm_head_activation: weights '{self.lm_head}' with activations "
                                 f"'{self.lm_head_activation}': {e}") from None
        for pattern, o in self.overrides:
            if o.get("weight") is not None:
                _weight_scheme(o["weight"], f"overrides[{pattern!r}].weight")
            if o.get("activation") is not None:
                _act_scheme(o["activation"], f"overrides[{pattern!r}].activation")
        for (w, a), label in self._combinations().items():
            try:
                check_act_weight(w, a)
            except ValueError as e:
                raise ValueError(f"recipe {label}: weights '{w}' with activations '{a}': {e}") from None

    def _combinations(self) -> dict[tuple[str, str | None], str]:
        """Every (weight, activation) pair some module could get (as ``scheme_for`` walks the
        overrides, each matching or not), with the field that makes it."""
        reached = {(self.weight, self.activation): "weight/activation"}
        for pattern, o in self.overrides:
            new = {}
            for w, a in [*reached, (self.weight, self.activation)]:  # the latter: a float module so far
                pair = (o.get("weight", w), o.get("activation", a))
                if pair[0] is not None and pair not in reached:
                    new[pair] = f"overrides[{pattern!r}]"
            reached.update(new)
        return reached

    @property
    def static_activations(self) -> bool:
        """Whether some module gets per-tensor activations (a scale from calibration)."""
        return any(a is not None and QuantScheme.parse(a).granularity == "tensor" for _, a in self._combinations())

    @property
    def needs_calibration(self) -> bool:
        """Whether quantizing with this recipe needs calibration data."""
        return self.method in ("gptq", "awq") or self.smoothquant is not None or self.static_activations

    def scheme_for(self, name: str) -> tuple[str, str | None] | None:
        """(weight scheme, activation scheme) for the linear module ``name``, or None
        when it stays float."""
        if name == "lm_head" or name.endswith(".lm_head"):
            return (self.lm_head, self.lm_head_activation) if self.lm_head else None
        chosen = (self.weight, self.activation) if any(re.search(p, name) for p in self.modules) else None
        for pattern, o in self.overrides:
            if re.search(pattern, name):
                w = o.get("weight", chosen[0] if chosen else self.weight)
                a = o.get("activation", chosen[1] if chosen else self.activation)
                chosen = None if w is None else (w, a)
        return chosen

    def to_dict(self) -> dict:
        d = asdict(self)
        d["modules"] = list(self.modules)
        d["overrides"] = [[p, o] for p, o in self.overrides]
        if d["lm_head_activation"] is None:  # left out, so that lowbit before it still reads the recipe
            del d["lm_head_activation"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        if not isinstance(d, dict):
            raise TypeError(f"a recipe must be a JSON object, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown recipe keys {sorted(map(str, unknown))}; expected some of {sorted(known)}")
        if "weight" not in d:
            raise ValueError("a recipe needs a 'weight' scheme")
        return cls(**d)

    @classmethod
    def get(cls, name_or_path: "str | Recipe | dict") -> "Recipe":
        """A preset by name (``RECIPE_PRESETS``), a recipe from a .json / .yaml file, or
        one from its dict form (``from_dict``).

        Example::

            >>> Recipe.get("w8a8").activation
            'int8-sym-token'
            >>> Recipe.get({"weight": "int8-sym"}).name
            'custom'
        """
        if isinstance(name_or_path, Recipe):
            return name_or_path
        if isinstance(name_or_path, dict):
            return cls.from_dict(name_or_path)
        if name_or_path in RECIPE_PRESETS:
            return RECIPE_PRESETS[name_or_path]
        if isinstance(name_or_path, str) and ":" in name_or_path and not os.path.exists(name_or_path):
            preset, _, method = name_or_path.rpartition(":")
            if preset in RECIPE_PRESETS:
                _choice(method, METHODS, f"method in {name_or_path!r}")
                return replace(RECIPE_PRESETS[preset], method=method, name=name_or_path)
        path = os.fspath(name_or_path) if isinstance(name_or_path, os.PathLike) else name_or_path
        if isinstance(path, str) and os.path.isfile(path):
            return cls._from_file(path)
        if isinstance(path, str) and os.path.isdir(path):
            raise ValueError(f"recipe {path!r} is a folder; expected a preset ({', '.join(RECIPE_PRESETS)}) "
                             "or a .json / .yaml recipe file")
        raise ValueError(f"recipe {name_or_path!r} is neither a preset ({', '.join(RECIPE_PRESETS)}) nor a file")

    @classmethod
    def _from_file(cls, path: str) -> "Recipe":
        """The recipe in a JSON or YAML file; every problem is a ValueError naming the file
        (and the field, when one is at fault)."""
        where = f"recipe file {path!r}"
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"{where}: cannot be read ({e.strerror})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None
        if path.endswith((".yaml", ".yml")):
            import yaml  # a dependency of transformers

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ValueError(f"{where}: not valid YAML ({' '.join(str(e).split())})") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
            except RecursionError:
                raise ValueError(f"{where}: nested too deeply to be a recipe") from None
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {str(e).removeprefix('recipe ')}") from None

def _choice(value, choices: tuple, label: str) -> None:
    if value not in choices:
        raise ValueError(f"recipe {label}: expected one of {', '.join(choices)}, got {value!r}")


def _patterns(modules) -> tuple[str, ...]:
    """``modules`` as a tuple of regexes: one string is one pattern, never its characters."""
    if isinstance(modules, str):
        modules = (modules,)
    if not isinstance(modules, (list, tuple)):
        raise ValueError(f"recipe modules: expected a regex or a list of regexes, got {modules!r}")
    for i, pattern in enumerate(modules):
        _regex(pattern, f"modules[{i}]")
    return tuple(modules)


def _overrides(overrides) -> tuple[tuple[str, dict], ...]:
    """``overrides`` checked as a list of ``[regex, {"weight": ..., "activation": ...}]`` pairs."""
    if not isinstance(overrides, (list, tuple)):
        raise ValueError(f"recipe overrides: expected a list of [regex, {{\"weight\": ..., \"activation\": "
                         f"...}}] pairs, got {overrides!r}")
    out = []
    for i, item in enumerate(overrides):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], Mapping)):
            hint = " (one override is written [[regex, {...}]])" if isinstance(item, str) else ""
            raise ValueError(f"recipe overrides[{i}]: expected a [regex, {{\"weight\": ..., \"activation\": "
                             f"...}}] pair, got {item!r}{hint}")
        pattern, o = item
        _regex(pattern, f"overrides[{i}]")
        unknown = set(o) - {"weight", "activation"}
        if unknown:
            raise ValueError(f"recipe overrides[{pattern!r}] has unknown keys {sorted(map(str, unknown))}; "
                             "expected 'weight' and/or 'activation'")
        out.append((pattern, dict(o)))
    return tuple(out)


def _weight_scheme(s: str, label: str) -> QuantScheme:
    if not isinstance(s, str):
        raise ValueError(f"recipe {label}: expected a scheme string such as 'int4-asym-g128', got {s!r}")
    try:
        scheme = QuantScheme.parse(s)
    except (ValueError, TypeError) as e:
        raise ValueError(f"recipe {label}: {e}") from None
    if scheme.granularity == "token":
        raise ValueError(f"recipe {label}: '{s}' is per token; weights are per tensor, channel or group")
    return scheme


def _act_scheme(s: str, label: str) -> QuantScheme:
    if not isinstance(s, str):
        raise ValueError(f"recipe {label}: expected a scheme string such as 'int8-sym-token', got {s!r}")
    try:
        scheme = QuantScheme.parse(s)
    except (ValueError, TypeError) as e:
        raise ValueError(f"recipe {label}: {e}") from None
    problem = act_scheme_problem(scheme)
    if problem:
        raise ValueError(f"recipe {label}: {problem}")
    if scheme.granularity == "tensor" and scheme.zero_point_domain == "float":
        raise ValueError(f"recipe {label}: a static per-tensor activation scheme needs an integer zero point, "
                         f"got '{s}'")
    return scheme


def _regex(pattern: str, label: str) -> None:
    if not isinstance(pattern, str):
        raise ValueError(f"recipe {label}: expected a regex string, got {pattern!r}")
    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as e:
        raise ValueError(f"recipe {label}: bad regex {pattern!r}: {e}") from None


def _preset(name: str, weight: str, activation: str | None = None, **kw) -> Recipe:
    return Recipe(weight=weight, activation=activation, name=name, **kw)


# Group sizes that do not divide a module's in_features (SmolLM2's 576 with g128) fall
# back to the largest power of two >= 32 that does (see lowbit.models.quantize_model).
RECIPE_PRESETS: dict[str, Recipe] = {
    r.name: r
    for r in [
        _preset("w8a16", "int8-sym"),
        _preset("w4a16-g128", "int4-asym-g128-f16"),
        _preset("w4a16-g64", "int4-asym-g64-f16"),
        _preset("w4a16-g32", "int4-asym-g32-f16"),
        _preset("w8a8", "int8-sym", "int8-sym-token"),
        _preset("w4a8-g128", "int4-asym-g128-f16", "int8-asym-token"),
        # int4 dequantization in the graph of a Llama model: int4 affine g64 packed 8 per uint32 on the 7 linears
        _preset("int4-g64", "int4-asym-g64"),
        # the bundled model's own storage form (GGUF Q4_1: g32, fp16 scale and min, d * q + m):
        # lands exactly back on its grid, so it measures the pipeline, not a second rounding
        _preset("q4_1", "int4-asym-g32-zpmin-f16"),
        # exactly GGUF's Q4_0 and Q8_0 (groups of 32, float16 scales, symmetric codes), the
        # output projection Q8_0 as in llama.cpp's own Q4_0 / Q8_0 files of the bundled model
        # (at 49152 x 576 it is a third of the 135M model, and half a decode step's bytes
        # when float): `lowbit export` stores them with their codes and scales unchanged
        _preset("q4_0", "int4-sym-g32-f16", lm_head="int8-sym-g32-f16"),
        _preset("q8_0", "int8-sym-g32-f16", lm_head="int8-sym-g32-f16"),
        # the output projection at 8 bits beside weights of other schemes
        _preset("w4a16-g128-head8", "int4-asym-g128-f16", lm_head="int8-sym"),
        _preset("w8a16-head8", "int8-sym", lm_head="int8-sym"),
        _preset("w8a8-head8", "int8-sym", "int8-sym-token", lm_head="int8-sym", lm_head_activation="int8-sym-token"),
        _preset("w4a8-g128-head8", "int4-asym-g128-f16", "int8-asym-token", lm_head="int8-sym",
                lm_head_activation="int8-sym-token"),
        # llama.cpp's arithmetic: GGUF Q4_0 / Q8_0 weights (the output projection Q8_0) times
        # activations quantized to int8 in blocks of 32 on the fly, integer dot products per block
        _preset("q4_0-a8", "int4-sym-g32-f16", "int8-sym-g32", lm_head="int8-sym-g32-f16",
                lm_head_activation="int8-sym-g32"),
        _preset("q8_0-a8", "int8-sym-g32-f16", "int8-sym-g32", lm_head="int8-sym-g32-f16",
                lm_head_activation="int8-sym-g32"),
    ]
}


def with_group_size(scheme: str, group_size: int) -> str:
    """The same scheme string with another group size."""
    return str(replace(QuantScheme.parse(scheme), group_size=group_size))


def fit_group(scheme: str, in_features: int) -> str:
    """``scheme`` with a group size that divides ``in_features``: the largest power of
    two from 32 up to the asked one (the sizes other runtimes load), else per channel.

    Example::

        >>> from lowbit.recipe import fit_group
        >>> fit_group("int4-asym-g128", 576), fit_group("int4-asym-g128", 100)
        ('int4-asym-g64', 'int4-asym')
    """
    s = QuantScheme.parse(scheme)
    if s.granularity != "group" or in_features % s.group_size == 0:
        return scheme
    g = 1 << (s.group_size.bit_length() - 1)
    while g >= 32:
        if in_features % g == 0:
            return with_group_size(scheme, g)
        g //= 2
    return str(replace(s, granularity="channel", group_size=None))


__all__ = ["Recipe", "RECIPE_PRESETS", "DECODER_LINEARS", "METHODS", "with_group_size", "fit_group"]
