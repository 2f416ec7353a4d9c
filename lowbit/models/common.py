"""What loading and checkpoints share: the checkpoint description's file name, the float
dtypes a model loads in, transformers without its noise, and the reader of safetensors
files that lowbit checkpoints and other tools' folders both load through."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

CHECKPOINT_CONFIG = "lowbit.json"
# the float dtypes a model loads in, by the names checkpoints and the CLI use
FLOAT_DTYPES_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_transformers(progress: bool = False):
    """transformers without its warnings, and without its progress bars unless asked
    (loading a cached folder takes about a second; converting a GGUF file does not)."""
    import transformers

    transformers.logging.set_verbosity_error()
    if progress:
        transformers.utils.logging.enable_progress_bar()
    else:
        transformers.utils.logging.disable_progress_bar()
    return transformers


@contextlib.contextmanager
def cache_entry(entry: Path):
    """Write a cache folder atomically: yields a temporary sibling folder to fill, renamed
    to ``entry`` when the block ends; removed if it fails, or if another process wrote
    ``entry`` first (its entry is kept)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, entry)
        except OSError:  # another process won the race: keep its entry
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (what a checkpoint's ``lowbit.json`` records)."""
    # reshape before view: a 0-d tensor has no last dimension to view as bytes
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class TensorFiles:
    """Tensors read by name from safetensors files.  ``get`` checks each one's dtype and
    shape (and its SHA-256 against ``digests`` when given), marks it used and returns a
    copy; every refusal is an ``error`` naming the file and the tensor.

    ``files`` maps each file to the tensor names it must hold (None: any); ``named`` is
    the file errors about the whole set name; ``listing`` the file that lists what the
    tensor files hold (named when they disagree with it)."""

    def __init__(self, files: dict[Path, set[str] | None], named: Path, error: type[Exception],
                 digests: dict[str, str] | None = None, listing: str = ""):
        from safetensors import safe_open

        self.file, self.error, self.digests, self.listing = named, error, digests, listing
        self.used: set[str] = set()
        self.where: dict[str, Path] = {}
        self.handles = {}
        for file, expected in files.items():
            if not file.is_file():
                raise error(f"{file}: missing")
            try:
                handle = safe_open(str(file), framework="pt")
                keys = set(handle.keys())
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise error(f"{file}: unreadable or truncated safetensors file ({e})") from None
            if expected is not None and keys != expected:
                missing, extra = sorted(expected - keys), sorted(keys - expected)
                raise error(f"{file}: tensors do not match {listing} (missing {missing[:5]}, unexpected {extra[:5]})")
            self.handles[file] = handle
            self.where.update(dict.fromkeys(keys, file))

    @property
    def keys(self):
        """Every tensor name of the files."""
        return self.where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, dtypes, shape=None) -> torch.Tensor:
        if name not in self.where:
            raise self.error(f"{self.file}: tensor {name!r} is missing")
        file = self.where[name]
        try:
            t = self.handles[file].get_tensor(name)
        except Exception as e:
            raise self.error(f"{file}: tensor {name!r} could not be read ({e})") from None
        if dtypes is not None and t.dtype not in dtypes:
            raise self.error(f"{file}: tensor {name!r} has dtype {t.dtype}, expected one of "
                             f"{[str(d).removeprefix('torch.') for d in dtypes]}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise self.error(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if self.digests is not None and sha256(t) != self.digests[name]:
            raise self.error(f"{file}: tensor {name!r} is corrupted (SHA-256 mismatch with {self.listing})")
        self.used.add(name)
        # a copy in memory of torch's allocator: a tensor read from the file is aligned to its
        # offset there (8 bytes), and BLAS picks its float kernels by alignment, so a loaded
        # model's one-row matmuls (decode steps) would round differently from the saved one's
        return t.clone()

    def fill(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Give every parameter of ``model`` still on the meta device its float tensor
        from the files (its shape, cast to ``dtype``); an ``lm_head`` the config ties to
        the embedding and the files do not hold is tied to it.  Then refuse parameters or
        buffers left without a tensor, and tensors of the files the model does not use."""
        floats = (torch.float32, torch.bfloat16, torch.float16)
        tied = bool(getattr(model.config, "tie_word_embeddings", False)) and isinstance(model.lm_head, nn.Linear)
        for name, p in list(model.named_parameters()):
            if p.device.type != "meta" or (tied and name == "lm_head.weight" and name not in self):
                continue
            module, _, attr = name.rpartition(".")
            t = self.get(name, floats, p.shape).to(dtype)
            setattr(model.get_submodule(module), attr, nn.Parameter(t, requires_grad=False))
        if tied and model.lm_head.weight.device.type == "meta":
            model.lm_head.weight = model.get_input_embeddings().weight
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
        if left:
            raise self.error(f"{self.file}: no tensors for {left[:5]}")
        unused = sorted(self.keys - self.used)
        if unused:
            raise self.error(f"{self.file}: tensors the model does not use: {unused[:5]}")
