"""Implementations behind the operators: ``reference`` (plain PyTorch, the ground
truth) and fast backends (``cpu``: a C++ extension built at install time; ``triton``:
Triton kernels for CUDA tensors, an optional dependency imported on first use).  A
fast backend implements what it can and hands everything else to the reference.

Kernels import nothing above this package."""

from __future__ import annotations

from types import ModuleType

import torch

from . import cpu, reference
from . import triton as triton_kernels

BACKENDS = ("reference", "cpu", "triton")


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on ``device``, slowest (the reference) first.  ``triton``
    is listed for CUDA devices when triton is installed; on the CPU it runs only when
    asked for by name under ``TRITON_INTERPRET=1`` (Triton's interpreter, for tests).

    Example::

        >>> from lowbit.kernels import available_backends
        >>> available_backends("cpu")[0]
        'reference'
    """
    kind = torch.device(device).type
    backends = ["reference"]
    if kind == "cpu" and cpu.available():
        backends.append("cpu")
    if kind == "cuda" and triton_kernels.available():
        backends.append("triton")
    return backends


def resolve(backend: str | None, device: torch.device) -> str:
    """The backend to use: the fastest available one when ``backend`` is None."""
    if backend is None:
        return available_backends(device)[-1]
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and triton_kernels.supports(device):
        return backend
    if backend not in available_backends(device):
        why = (cpu.load_error() if backend == "cpu" and device.type == "cpu"
               else triton_kernels.why_not(device) if backend == "triton" else None)
        raise ValueError(
            f"backend={backend!r} is not available for tensors on {device}; available: "
            f"{available_backends(device)}" + (f" ({why})" if why else "")
        )
    return backend


def module(backend: str) -> ModuleType:
    if backend == "triton":
        return triton_kernels.module()
    return cpu if backend == "cpu" else reference
