"""Implementations behind the operators, one ``Backend`` each (``interface.py``):
``reference`` (plain PyTorch, the ground truth; ``Backend`` itself), ``cpu`` (a C++
extension built at install time) and ``triton`` (Triton kernels for CUDA tensors, an
optional dependency imported on first use).  A fast backend implements what it can and
hands everything else to the reference.

Which backend runs is not part of an op's arguments (graphs stay device-neutral): the
``lowbit::*`` ops run ``for_device(device)``, the fastest backend available for the
tensors' device, unless a ``use_backend(name)`` block chooses another one.

Kernels import nothing above this package.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from . import cpu
from . import triton as triton_kernels
from .interface import Backend, Plan

BACKENDS = ("reference", "cpu", "triton")
REFERENCE = Backend()
_CHOSEN: ContextVar[str | None] = ContextVar("lowbit_backend", default=None)
_DEFAULT: dict[str, str] = {}


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


def resolve(backend: str | None, device: torch.device | str) -> str:
    """The backend to use on ``device``: the fastest available one when ``backend`` is
    None; a named one is checked to be able to run there.

    Example::

        >>> from lowbit.kernels import resolve
        >>> resolve("reference", "cpu")
        'reference'
    """
    device = torch.device(device)
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


def get_backend(name: str) -> Backend:
    """The ``Backend`` object of a backend name (``BACKENDS``).

    Example::

        >>> from lowbit.kernels import get_backend
        >>> get_backend("reference").name
        'reference'
    """
    if name == "cpu":
        return cpu.BACKEND
    if name == "triton":
        return triton_kernels.load_backend()
    if name == "reference":
        return REFERENCE
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")


@contextmanager
def use_backend(name: str | None, device: torch.device | str = "cpu"):
    """Run the ``lowbit::*`` ops inside the block on backend ``name`` (checked against
    ``device``); None keeps the automatic choice.  The public functions' ``backend=``
    argument is this block around one call.

    Example::

        >>> import torch, lowbit
        >>> from lowbit.kernels import use_backend
        >>> with use_backend("reference"):
        ...     qt = lowbit.quantize(torch.ones(2, 8), "int8-sym")
        >>> qt.codes.tolist()[0][:3]
        [127, 127, 127]
    """
    token = _CHOSEN.set(None if name is None else resolve(name, device))
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def for_device(device_type: str) -> Backend:
    """The backend the ops run on tensors of ``device_type`` ("cpu", "cuda", ...): the
    one ``use_backend`` chose, else the fastest available there.

    Example::

        >>> from lowbit.kernels import for_device, use_backend
        >>> with use_backend("reference"):
        ...     for_device("cpu").name
        'reference'
    """
    name = _CHOSEN.get()
    if name is None:
        name = _DEFAULT.get(device_type)
        if name is None:
            name = _DEFAULT[device_type] = available_backends(device_type)[-1]
    return get_backend(name)


__all__ = ["BACKENDS", "Backend", "Plan", "available_backends", "resolve", "get_backend", "use_backend",
           "for_device"]
