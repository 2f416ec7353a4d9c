"""Triton kernels for NVIDIA GPUs: the ``"triton"`` backend.

Triton is an optional dependency: nothing here imports it until the backend is
first used, so ``import lowbit`` works without it.  The kernels run on CUDA tensors;
with ``TRITON_INTERPRET=1`` set before they are first loaded they also run on CPU
tensors through Triton's interpreter (slow, for testing the kernels without a GPU).

Files: ``weight_only.py`` (W4A16/W8A16 fused-dequant GEMV and GEMM), ``int8.py``
(W8A8 int8 GEMM with the accumulator epilogue, W4A8 with per-group integer
accumulation), ``elementwise.py`` (dequantize, per-token quantize, accumulator
epilogues), ``backend.py`` (``TritonBackend``: what it does not cover goes to the reference).
"""

from __future__ import annotations

import importlib
import os
import sys

_IMPORT_ERROR: str | None = None
_CHECKED = False


def available() -> bool:
    """Whether the ``triton`` package imports (checked once, on first call)."""
    global _CHECKED, _IMPORT_ERROR
    if not _CHECKED:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
        except Exception as e:  # an absent or broken install: the backend is unavailable
            _IMPORT_ERROR = f"triton did not import ({type(e).__name__}: {e}); pip install triton"
        _CHECKED = True
    return _IMPORT_ERROR is None


def load_error() -> str | None:
    available()
    return _IMPORT_ERROR


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter: fixed when they are first
    loaded (Triton reads TRITON_INTERPRET when it decorates a kernel)."""
    loaded = sys.modules.get(__name__ + "._common")
    if loaded is not None:
        return loaded.INTERPRET
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def supports(device) -> bool:
    """Whether the backend can run on tensors of ``device``: CUDA with triton
    installed, or the CPU under the interpreter."""
    kind = device.type
    if kind == "cuda":
        return available()
    return kind == "cpu" and interpreting() and available()


def why_not(device) -> str:
    if not available():
        return load_error()
    if device.type == "cpu":
        return ("the Triton kernels need CUDA tensors; set TRITON_INTERPRET=1 before lowbit first "
                "uses them to run them on the CPU through Triton's interpreter (testing only)")
    return f"the Triton kernels run on CUDA tensors, not {device.type}"


def load_backend():
    """The ``TritonBackend`` (imports triton and compiles nothing until a kernel runs)."""
    return importlib.import_module(__name__ + ".backend").BACKEND
