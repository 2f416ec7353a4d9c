"""What loading and checkpoints share: the checkpoint description's file name, the float
dtypes a model loads in, and transformers without its noise."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

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
