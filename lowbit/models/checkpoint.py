"""Quantized checkpoints: a folder with

* ``model.safetensors``: packed codes, scales and zero points of every quantized
  module (``<module>.weight.codes`` / ``.scale`` / ``.zero_point``), the static
  activation scale (``<module>.act_scale``, and ``.act_zero_point`` when asymmetric) of
  every linear with a per-tensor activation scheme, and the float tensors of the rest
  (embeddings, norms, biases);
* ``lowbit.json``: format version, lowbit version, the recipe, every quantized
  module's schemes, the float dtype, a SHA-256 of every tensor (``sha256``) and of
  every other file of the folder (``files``: ``config.json`` and the tokenizer's);
* ``config.json`` and the tokenizer files, so transformers tools can read them.

Writing goes to a temporary sibling folder that is renamed into place at the end,
so a crash never leaves a half-written checkpoint.  Replacing a checkpoint
(``overwrite=True``) replaces only a folder that is one: the old folder is moved to a
hidden sibling ``.NAME.lowbit-old-*``, the new one renamed into place, and the old one
put back if that fails; a process killed in between leaves the old one there, and
the next ``check_output_dir`` or ``save_quantized`` for ``NAME`` puts it back.  The
folder and its files get the permissions of any new file (the umask's).

Loading checks, before any tensor is read, the structure of ``lowbit.json`` (its
recipe and schemes too), the checksums of ``config.json`` and the tokenizer files and
the tensors file's header (names; a truncated file), then every tensor's dtype, shape
and checksum, and names the file (and field or tensor) it refuses.  Checkpoints
written before ``files`` was recorded still load; their config and tokenizer files
are then not checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from .. import _folders
from ..nn import QuantEmbedding, QuantLinear, SplitQuantLinear
from ..sparse import SparseQuantLinear
from ..qtensor import QTensor, SplitQTensor
from ..recipe import Recipe
from ..scheme import QuantScheme
from .common import CHECKPOINT_CONFIG, FLOAT_DTYPES_BY_NAME, TensorFiles, quiet_transformers, sha256
from .quantize import _float_dtype, _set_module

FORMAT = "lowbit"
FORMAT_VERSION = 2  # 2: tensors in several files (``shards``), written by streaming quantization
WEIGHTS = "model.safetensors"
# files transformers reads from a model folder: with ``files`` recorded, one of these
# that lowbit.json does not cover is refused rather than silently used
_READ_BY_TRANSFORMERS = re.compile(r"config\.json|generation_config\.json|tokenizer.*|special_tokens_map\.json"
                                   r"|added_tokens\.json|chat_template.*|vocab.*|merges\.txt|.*\.model|.*\.tiktoken")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded (missing, corrupted or inconsistent)."""


def _file_digest(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without the second name of tied tensors (the tied lm_head)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key in seen or t.device.type == "meta":
            continue
        seen.add(key)
        out[name] = t.detach().contiguous()
    return out


# -- where a checkpoint may be written ---------------------------------------------------

def _not_a_checkpoint(p: Path) -> str | None:
    """Why the existing ``p`` is not a folder ``save_quantized`` may replace (None: it may)."""
    if p.is_symlink():
        return "is a symbolic link"
    if not p.is_dir():
        return "is not a folder"
    if os.path.ismount(p):
        return "is a mount point"
    try:
        meta = json.loads((p / CHECKPOINT_CONFIG).read_bytes())
    except (OSError, ValueError, RecursionError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"has no {CHECKPOINT_CONFIG} saying it is a lowbit checkpoint"
    try:
        if any(e.is_dir(follow_symlinks=False) for e in os.scandir(p)):
            return "holds folders, which a lowbit checkpoint never does"
    except OSError as e:
        return f"cannot be listed ({e.strerror})"
    return None


def check_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Check, before any work, that ``save_quantized(model, path, overwrite=overwrite)``
    can write its checkpoint folder ``path``; returns ``path`` as a Path.

    ``path`` must not exist, unless ``overwrite`` and it is a lowbit checkpoint folder
    (a folder, not a link, holding a ``lowbit.json`` that says so and no sub-folders);
    anything else (a file, a device, another folder) is refused.  The rest is
    ``lowbit._folders.check_output_dir``'s (the parent must be writable; an interrupted
    replacement is finished first).

    Example::

        >>> import tempfile
        >>> from lowbit.models.checkpoint import check_output_dir
        >>> with tempfile.TemporaryDirectory() as d:
        ...     ok = check_output_dir(d + "/new-checkpoint")
        ...     check_output_dir(d, overwrite=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        FileExistsError: '...' exists and has no lowbit.json saying it is a lowbit checkpoint; refusing to replace it
    """
    return _folders.check_output_dir(path, overwrite, replaceable=_not_a_checkpoint, what="checkpoint")


def save_quantized(model: nn.Module, path: str | os.PathLike, tokenizer=None, *, overwrite: bool = False) -> Path:
    r"""Write a quantized model (from ``lowbit.quantize_model``) to the folder ``path``;
    returns its path.  The folder must not exist unless ``overwrite``, and then it must
    be a lowbit checkpoint (see ``check_output_dir``, which runs first).

    Example (a preset such as ``"w4a16-g128"`` quantizes all 30 layers; this recipe only
    the first layer's 7 linears, to keep the example fast)::

        >>> import tempfile, lowbit
        >>> model, tok = lowbit.load_model()
        >>> model = lowbit.quantize_model(model, lowbit.Recipe(weight="int4-asym-g64", modules=[r"layers\.0\."]))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = lowbit.save_quantized(model, d + "/smollm2-int4", tok)
        ...     names = sorted(f.name for f in path.iterdir())
        >>> [n for n in names if not n.startswith(("tokenizer", "chat_template"))]  # and the tokenizer's files
        ['config.json', 'lowbit.json', 'model.safetensors']
    """
    from safetensors.torch import save_file

    sparse = next((n for n, m in model.named_modules() if isinstance(m, SparseQuantLinear)), None)
    if sparse is not None:
        raise ValueError(f"module {sparse!r} is a SparseQuantLinear (2:4 sparse), which a lowbit checkpoint "
                         "cannot hold yet")
    modules = getattr(model, "lowbit_modules", None)
    if not modules:
        raise ValueError("model has no quantized modules: quantize it with lowbit.quantize_model first")
    unrecorded = [n for n, m in model.named_modules() if isinstance(m, SplitQuantLinear)
                  and modules.get(n, {}).get("kind") != "split"]
    if unrecorded:  # load_quantized would not know to build it
        raise ValueError(f"module {unrecorded[0]!r} is a SplitQuantLinear that model.lowbit_modules does not "
                         "record; make split models with lowbit.models.split_model")
    uncalibrated = [n for n, m in model.named_modules() if isinstance(m, QuantLinear) and not m.act_calibrated]
    if uncalibrated:  # such a model cannot run, and load_quantized would refuse its checkpoint
        raise ValueError(f"activation scale not calibrated: {len(uncalibrated)} module(s) with a per-tensor "
                         f"activation scheme have no static act_scale (first: {uncalibrated[0]!r}); calibrate "
                         "them (QuantLinear.set_act_qparams / set_act_range) before saving")
    tensors = _unique_state(model)
    with staging(path, overwrite) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        finish(tmp, model, {n: sha256(t) for n, t in tensors.items()}, tokenizer)
    return Path(path)


def staging(path: str | os.PathLike, overwrite: bool = False):
    """A new hidden folder beside ``path`` to write a checkpoint into, renamed into place
    when the block ends without an error (``lowbit._folders.staging`` with the
    checkpoint's replacement rule).

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     with staging(d + "/ckpt") as tmp:
        ...         _ = (tmp / "lowbit.json").write_text('{"format": "lowbit"}')
        ...     sorted(p.name for p in Path(d).iterdir())
        ['ckpt']
    """
    return _folders.staging(path, overwrite, replaceable=_not_a_checkpoint, what="checkpoint")


# the fields of lowbit.json's record of a module, by kind ("split": int8 outlier channels
# + int4, lowbit.models.split; its weight is the 4-bit part's scheme, "high" the 8-bit one's)
_SPEC_KEYS = {"linear": ("kind", "weight", "activation"), "embedding": ("kind", "weight", "activation"),
              "split": ("kind", "weight", "activation", "high")}


def finish(tmp: Path, model: nn.Module, digests: dict[str, str], tokenizer=None,
           shards: dict[str, list[str]] | None = None) -> None:
    """Write ``config.json``, the tokenizer's files and ``lowbit.json`` into the staging
    folder ``tmp`` whose tensors files are written: ``digests`` holds the SHA-256 of every
    tensor, ``shards`` (None: one ``model.safetensors``) which file holds which tensors."""
    from .. import __version__

    meta = {
        "format": FORMAT, "format_version": 1 if shards is None else 2, "lowbit_version": __version__,
        "recipe": model.lowbit_recipe.to_dict(),
        "modules": {n: {k: v[k] for k in _SPEC_KEYS[v["kind"]]} for n, v in model.lowbit_modules.items()},
        "dtype": str(_float_dtype(model)).removeprefix("torch."),
        "source": getattr(model, "lowbit_source", None),
        # how the weights were rounded: method, its parameters, the calibration run
        "quantization": getattr(model, "lowbit_quantization", None),
        "sha256": digests,
    }
    if shards is not None:
        meta["shards"] = shards
    if hasattr(model, "config"):
        model.config.to_json_file(str(tmp / "config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    tensor_files = set(shards or [WEIGHTS])
    meta["files"] = {f.name: _file_digest(f) for f in sorted(tmp.iterdir())
                     if f.is_file() and f.name not in tensor_files}
    (tmp / CHECKPOINT_CONFIG).write_text(json.dumps(meta, indent=1))


# -- reading ---------------------------------------------------------------------------------

_SHA256 = re.compile(r"[0-9a-f]{64}")


def _expect(f: Path, field: str, value, types: tuple, what: str) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise CheckpointError(f"{f}: {field} must be {what}, got {type(value).__name__} {shown}")


def _check_digests(f: Path, field: str, digests, plain_names: bool = False) -> None:
    _expect(f, field, digests, (dict,), "an object of name: SHA-256")
    for name, d in digests.items():
        _expect(f, f"{field}[{name!r}]", d, (str,), "a SHA-256 (64 hex digits)")
        if not _SHA256.fullmatch(d):
            raise CheckpointError(f"{f}: {field}[{name!r}] is not a SHA-256 (64 hex digits): {d[:70]!r}")
        if plain_names and (name in ("", ".", "..", WEIGHTS, CHECKPOINT_CONFIG) or "/" in name or "\\" in name):
            raise CheckpointError(f"{f}: {field} names {name!r}, which is not a file of the checkpoint it may list")


def _validate(meta, f: Path) -> Recipe:
    """Check the structure of a parsed lowbit.json (``f``); returns its recipe."""
    _expect(f, "the file", meta, (dict,), "a JSON object")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a lowbit checkpoint description (format={meta.get('format')!r})")
    _expect(f, "format_version", meta.get("format_version"), (int,), "an integer")
    if meta["format_version"] < 1:
        raise CheckpointError(f"{f}: format_version {meta['format_version']} is not a version (>= 1)")
    if meta["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{f}: format_version {meta['format_version']} is newer than this lowbit "
                              f"reads ({FORMAT_VERSION}); upgrade lowbit")
    for key in ("lowbit_version", "recipe", "modules", "dtype", "sha256"):
        if key not in meta:
            raise CheckpointError(f"{f}: missing key {key!r}")
    _expect(f, "lowbit_version", meta["lowbit_version"], (str,), "a string")
    _expect(f, "dtype", meta["dtype"], (str,), "a string")
    if meta["dtype"] not in FLOAT_DTYPES_BY_NAME:
        raise CheckpointError(f"{f}: dtype {meta['dtype']!r} is unknown; expected one of {list(FLOAT_DTYPES_BY_NAME)}")
    _expect(f, "recipe", meta["recipe"], (dict,), "an object")
    try:
        recipe = Recipe.from_dict(meta["recipe"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{f}: recipe: {e}") from None
    _check_digests(f, "sha256", meta["sha256"])
    _expect(f, "quantization", meta.get("quantization"), (dict, type(None)), "an object or null")
    if "files" in meta:
        _check_digests(f, "files", meta["files"], plain_names=True)
    if "shards" in meta:
        _check_shards(f, meta)
    _expect(f, "modules", meta["modules"], (dict,), "an object of module name: schemes")
    for name, spec in meta["modules"].items():
        field = f"modules[{name!r}]"
        _expect(f, field, spec, (dict,), 'an object {"kind", "weight", "activation"}')
        if "kind" not in spec:
            raise CheckpointError(f"{f}: {field} has keys {sorted(spec)}; expected ['activation', 'kind', 'weight'] "
                                  "(and 'high' for kind 'split')")
        if not isinstance(spec["kind"], str) or spec["kind"] not in _SPEC_KEYS:
            raise CheckpointError(f"{f}: {field}.kind is {spec['kind']!r}; expected one of {list(_SPEC_KEYS)}")
        if set(spec) != set(_SPEC_KEYS[spec["kind"]]):
            raise CheckpointError(f"{f}: {field} has keys {sorted(spec)}; expected {sorted(_SPEC_KEYS[spec['kind']])}")
        _expect(f, f"{field}.weight", spec["weight"], (str,), "a scheme string")
        _expect(f, f"{field}.activation", spec["activation"], (str, type(None)), "a scheme string or null")
        if spec["kind"] != "linear" and spec["activation"] is not None:
            raise CheckpointError(f"{f}: {field}.activation must be null for a {spec['kind']} module")
        if spec["kind"] == "split":
            _expect(f, f"{field}.high", spec["high"], (str,), "a scheme string")
            try:
                Recipe(weight=spec["high"])
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"{f}: {field}.high {spec['high']!r}: {e}") from None
        try:  # the schemes a recipe accepts for weights and activations
            Recipe(weight=spec["weight"], activation=spec["activation"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{f}: {field} (weight {spec['weight']!r}, activation {spec['activation']!r}): "
                                  f"{e}") from None
        codes = f"{name}.weight.low.codes" if spec["kind"] == "split" else f"{name}.weight.codes"
        if codes not in meta["sha256"]:
            raise CheckpointError(f"{f}: {field} has no tensor {codes!r} in sha256")
        for key, needed in _static_act_tensors(name, spec["activation"]).items():
            if needed and key not in meta["sha256"]:
                raise CheckpointError(f"{f}: {field} has the per-tensor activation scheme {spec['activation']!r} "
                                      f"but no tensor {key!r} (its static qparams) in sha256")
            if not needed and key in meta["sha256"]:
                raise CheckpointError(f"{f}: sha256 lists {key!r}, but {field} has activation "
                                      f"{spec['activation']!r}, which takes no static activation qparams")
    return recipe


def _check_shards(f: Path, meta: dict) -> None:
    """``shards``: tensors file name -> its tensor names; every tensor of sha256 in one."""
    shards = meta["shards"]
    _expect(f, "shards", shards, (dict,), "an object of file name: tensor names")
    if not shards:
        raise CheckpointError(f"{f}: shards is empty")
    seen: dict[str, str] = {}
    for name, listed in shards.items():
        if (not name.endswith(".safetensors") or "/" in name or "\\" in name or name.startswith(".")
                or name in meta.get("files", {})):
            raise CheckpointError(f"{f}: shards names {name!r}, which is not a tensors file of the checkpoint")
        _expect(f, f"shards[{name!r}]", listed, (list,), "a list of tensor names")
        for t in listed:
            if t in seen:
                raise CheckpointError(f"{f}: tensor {t!r} is in two shards ({seen[t]!r} and {name!r})")
            seen[t] = name
    missing = sorted(set(meta["sha256"]) - set(seen))
    extra = sorted(set(seen) - set(meta["sha256"]))
    if missing or extra:
        raise CheckpointError(f"{f}: shards and sha256 list different tensors (not in a shard {missing[:5]}, "
                              f"not in sha256 {extra[:5]})")


def _static_act_tensors(name: str, activation: str | None) -> dict[str, bool]:
    """Tensor names of a module's static activation qparams: whether its activation scheme
    needs each (a per-tensor scheme: the scale, and the zero point when asymmetric)."""
    s = None if activation is None else QuantScheme.parse(activation)
    static = s is not None and s.granularity == "tensor"
    return {f"{name}.act_scale": static, f"{name}.act_zero_point": static and not s.symmetric}


def _check_files(folder: Path, meta: dict) -> None:
    """config.json and the tokenizer files against the checksums lowbit.json records."""
    if "files" not in meta:
        return  # written before lowbit recorded them: nothing to check against
    f = folder / CHECKPOINT_CONFIG
    for name, digest in meta["files"].items():
        p = folder / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing ({f} records its checksum)")
        if _file_digest(p) != digest:
            raise CheckpointError(f"{p}: changed since the checkpoint was written (SHA-256 mismatch with {f})")
    for e in os.scandir(folder):
        if e.name not in meta["files"] and _READ_BY_TRANSFORMERS.fullmatch(e.name) and e.is_file():
            raise CheckpointError(f"{folder / e.name}: not covered by the checksums of {f}; transformers would "
                                  "read it (remove it, or save the checkpoint again)")


def _reader(folder: Path, meta: dict) -> TensorFiles:
    """The tensors of a checkpoint (``model.safetensors``, or the files ``shards`` lists),
    each checked against its recorded checksum."""
    shards = meta.get("shards") or {WEIGHTS: list(meta["sha256"])}
    named = folder / (WEIGHTS if len(shards) == 1 else CHECKPOINT_CONFIG)  # named in errors
    return TensorFiles({folder / name: set(listed) for name, listed in shards.items()}, named, CheckpointError,
                       digests=meta["sha256"], listing=CHECKPOINT_CONFIG)


def _open(path: str | os.PathLike) -> tuple[dict, Recipe, TensorFiles]:
    """Everything of a checkpoint but its tensor data, checked: lowbit.json, the
    checksums of the other files, the tensors file's header."""
    folder = Path(path)
    f = folder / CHECKPOINT_CONFIG
    try:
        meta = json.loads(f.read_bytes())
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"{f}: missing; {str(path)!r} is not a lowbit checkpoint") from None
    except IsADirectoryError:
        raise CheckpointError(f"{f}: a folder, not a file; {str(path)!r} is not a lowbit checkpoint") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    recipe = _validate(meta, f)
    _check_files(folder, meta)
    return meta, recipe, _reader(folder, meta)


def read_metadata(path: str | os.PathLike) -> dict:
    r"""The ``lowbit.json`` of a checkpoint folder, checked: format, version and
    structure (recipe and schemes included), the checksums of ``config.json`` and the
    tokenizer files, and the tensor names and size of ``model.safetensors`` (a truncated
    or empty file is refused).  Tensor data is checked by ``load_quantized``.

    Example::

        >>> import tempfile, lowbit
        >>> from lowbit.models.checkpoint import read_metadata
        >>> model, tok = lowbit.load_model()
        >>> model = lowbit.quantize_model(model, lowbit.Recipe(weight="int8-sym", modules=[r"layers\.0\.mlp\."]))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     meta = read_metadata(lowbit.save_quantized(model, d + "/ckpt", tok))
        >>> meta["format"], len(meta["modules"]), "config.json" in meta["files"]
        ('lowbit', 3, True)
    """
    return _open(path)[0]


def _qtensor(reader: TensorFiles, prefix: str, scheme: QuantScheme, shape, what: str) -> QTensor:
    """The QTensor of the tensors ``<prefix>.codes`` / ``.scale`` / ``.zero_point``, checked."""
    parts = {part: reader.get(f"{prefix}.{part}", None) if f"{prefix}.{part}" in reader.keys else None
             for part in ("codes", "scale", "zero_point")}
    try:
        return QTensor(parts["codes"], parts["scale"], parts["zero_point"], scheme, torch.Size(shape))
    except (TypeError, ValueError) as e:
        file = reader.where.get(f"{prefix}.codes", reader.file)
        raise CheckpointError(f"{file}: {what} does not match '{scheme}' and shape {tuple(shape)}: {e}") from None


def _split_module(reader: TensorFiles, name: str, spec: dict, shell: nn.Module, dtype, backend):
    meta_file = reader.file.parent / CHECKPOINT_CONFIG
    if not isinstance(shell, nn.Linear):
        raise CheckpointError(f"{meta_file}: module {name!r} is a {type(shell).__name__}, not a Linear")
    n, k = shell.out_features, shell.in_features
    outliers = reader.get(f"{name}.weight.outliers", (torch.int64,))
    if outliers.dim() != 1 or not 0 < outliers.numel() <= k:
        raise CheckpointError(f"{reader.where[name + '.weight.outliers']}: tensor {name + '.weight.outliers'!r} "
                              f"must be 1-D with 1 to {k} (in_features) entries, got shape {tuple(outliers.shape)}")
    low = _qtensor(reader, f"{name}.weight.low", QuantScheme.parse(spec["weight"]), (n, k),
                   f"the 4-bit part of {name!r}")
    high = _qtensor(reader, f"{name}.weight.high", QuantScheme.parse(spec["high"]), (n, outliers.numel()),
                    f"the outlier part of {name!r}")
    bias = None
    if shell.bias is not None:
        bias = reader.get(f"{name}.bias", (torch.float32, torch.bfloat16, torch.float16), (n,)).to(dtype)
    try:
        return SplitQuantLinear(SplitQTensor(low, high, outliers), bias, backend)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{reader.where[name + '.weight.outliers']}: split weight of {name!r}: {e}") from None


def _quant_module(reader: TensorFiles, name: str, spec: dict, shell: nn.Module, dtype, backend):
    if spec["kind"] == "split":
        return _split_module(reader, name, spec, shell, dtype, backend)
    scheme = QuantScheme.parse(spec["weight"])
    meta_file = reader.file.parent / CHECKPOINT_CONFIG
    if spec["kind"] == "linear":
        if not isinstance(shell, nn.Linear):
            raise CheckpointError(f"{meta_file}: module {name!r} is a {type(shell).__name__}, not a Linear")
        shape = (shell.out_features, shell.in_features)
    else:
        if not isinstance(shell, nn.Embedding):
            raise CheckpointError(f"{meta_file}: module {name!r} is a {type(shell).__name__}, not an Embedding")
        shape = (shell.num_embeddings, shell.embedding_dim)
    qt = _qtensor(reader, f"{name}.weight", scheme, shape, f"quantized weight of {name!r}")
    if spec["kind"] == "embedding":
        return QuantEmbedding(qt, dtype, shell.padding_idx)
    bias = None
    if shell.bias is not None:
        bias = reader.get(f"{name}.bias", (torch.float32, torch.bfloat16, torch.float16),
                          (shell.out_features,)).to(dtype)
    order = None
    if f"{name}.input_order" in reader.keys:  # an act-order GPTQ import: its columns' input features
        order = reader.get(f"{name}.input_order", (torch.int64,), (shell.in_features,))
    try:
        mod = QuantLinear(qt, bias, spec["activation"], backend, input_order=order)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_file}: module {name!r}: {e}") from None
    needed = [k for k, need in _static_act_tensors(name, spec["activation"]).items() if need]
    if needed:  # a per-tensor activation scheme: its calibrated static scale (and zero point)
        act = QuantScheme.parse(spec["activation"])
        scale = reader.get(needed[0], (act.scale_dtype,), (1,))
        zp = reader.get(needed[1], (act.zero_point_dtype,), (1,)) if len(needed) > 1 else None
        try:
            mod.set_act_qparams(scale, zp)
        except (TypeError, ValueError) as e:
            file = reader.where.get(needed[0], reader.file)
            raise CheckpointError(f"{file}: static activation qparams of {name!r}: {e}") from None
    return mod


def load_quantized(path: str | os.PathLike, dtype: torch.dtype | None = None, backend: str | None = None):
    r"""Load a folder written by ``save_quantized``; returns ``(model, tokenizer)``
    (tokenizer None when the folder has none).  ``dtype`` None: the dtype it was saved in.

    Everything but the tensor data is checked before the model is built (see
    ``read_metadata``), then every tensor's dtype, shape and checksum; a refusal is a
    ``CheckpointError`` (a ValueError) naming the file.

    Example::

        >>> import tempfile, lowbit
        >>> model, tok = lowbit.load_model()
        >>> model = lowbit.quantize_model(model, lowbit.Recipe(weight="int8-sym", modules=[r"layers\.0\."]))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = lowbit.save_quantized(model, d + "/smollm2-int8", tok)
        ...     loaded, tok2 = lowbit.load_quantized(d + "/smollm2-int8")
        >>> loaded.lowbit_modules == model.lowbit_modules, type(loaded.model.layers[0].mlp.up_proj).__name__
        (True, 'QuantLinear')
    """
    from accelerate import init_empty_weights

    folder = Path(path)
    meta, recipe, reader = _open(folder)
    meta_file = folder / CHECKPOINT_CONFIG
    dtype = dtype or FLOAT_DTYPES_BY_NAME[meta["dtype"]]
    transformers = quiet_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        with init_empty_weights(include_buffers=False):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as e:  # transformers raises anything from a bad config: ValueError, KeyError, OSError...
        raise CheckpointError(f"{folder / 'config.json'}: cannot be read as a model config "
                              f"({type(e).__name__}: {e})") from None
    for name, spec in meta["modules"].items():
        try:
            shell = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"{meta_file}: the model has no module {name!r}") from None
        _set_module(model, name, _quant_module(reader, name, spec, shell, dtype, backend))
    reader.fill(model, dtype)
    model.eval()
    model.lowbit_recipe = recipe
    model.lowbit_modules = {n: {**s, "asked": s["weight"]} for n, s in meta["modules"].items()}
    model.lowbit_quantization = meta.get("quantization")
    model.lowbit_source = meta.get("source")
    tok = None
    tok_file = folder / "tokenizer.json"
    if tok_file.is_file() or (folder / "tokenizer_config.json").is_file():
        try:
            tok = transformers.AutoTokenizer.from_pretrained(folder)
        except Exception as e:  # tokenizers and transformers raise their own types
            named = tok_file if tok_file.is_file() else folder / "tokenizer_config.json"
            raise CheckpointError(f"{named}: cannot be read as a tokenizer ({type(e).__name__}: {e})") from None
    return model, tok


__all__ = ["save_quantized", "load_quantized", "read_metadata", "check_output_dir", "CheckpointError"]
