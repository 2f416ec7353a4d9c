"""Implementations behind the operators: ``reference`` (plain PyTorch, the ground
truth) and fast backends (``cpu``: a C++ extension built at install time).  A fast
backend implements what it can and hands everything else to the reference.

Kernels import nothing above this package."""

from __future__ import annotations

from types import ModuleType

import torch

from . import cpu, reference

BACKENDS = ("reference", "cpu", "triton")


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on ``device``, slowest (the reference) first.

    Example::

        >>> from lowbit.kernels import available_backends
        >>> available_backends("cpu")[0]
        'reference'
    """
    kind = torch.device(device).type
    backends = ["reference"]
    if kind == "cpu" and cpu.available():
        backends.append("cpu")
    return backends


def resolve(backend: str | None, device: torch.device) -> str:
    """The backend to use: the fastest available one when ``backend`` is None."""
    if backend is None:
        return available_backends(device)[-1]
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    if backend not in available_backends(device):
        why = cpu.load_error() if backend == "cpu" and device.type == "cpu" else None
        raise ValueError(
            f"backend={backend!r} is not available for tensors on {device}; available: "
            f"{available_backends(device)}" + (f" ({why})" if why else "")
        )
    return backend


def module(backend: str) -> ModuleType:
    return cpu if backend == "cpu" else reference
