"""Argument checks for the public boundary: each error names the argument, its value
and what was expected.  Kernels never check; operators check before any work."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch._subclasses.fake_tensor import is_fake

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def tensor(name: str, t, *, dtypes: Iterable[torch.dtype] | None = None, ndim: int | None = None,
           min_ndim: int | None = None) -> torch.Tensor:
    """Check that ``t`` is a tensor with an allowed dtype and rank; return it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in {_names(dtypes)}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)} ({t.dim()}-D)")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dim(s), got shape {tuple(t.shape)}"
        )
    return t


def shape(name: str, t: torch.Tensor, expected: Iterable[int], why: str = "") -> None:
    expected = tuple(expected)
    if tuple(t.shape) != expected:
        why = f" ({why})" if why else ""
        raise ValueError(f"{name} must have shape {expected}{why}, got {tuple(t.shape)}")


def increasing_indices(name: str, t: torch.Tensor, k: int) -> None:
    """Raise unless ``t`` (1-D, with values) holds strictly increasing indices in [0, k)."""
    if has_values(t) and (int(t[0]) < 0 or int(t[-1]) >= k or bool((t[1:] <= t[:-1]).any())):
        raise ValueError(f"{name} must be strictly increasing input channels in [0, {k}), got "
                         f"{t.tolist()[:8]}{'...' if t.numel() > 8 else ''}")


def same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(
                f"{name} is on {t.device} but {reference_name} is on {reference.device}; "
                "expected both on the same device"
            )


def float_dtype(name: str, dtype, allowed: Iterable[torch.dtype] = FLOAT_DTYPES) -> torch.dtype:
    allowed = tuple(allowed)
    if dtype not in allowed:
        raise TypeError(f"{name} must be one of {_names(allowed)}, got {dtype!r}")
    return dtype


def has_values(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values a check can read: not empty, not a meta tensor (meta and
    fake tensors carry shapes only; value checks skip them, and so do traces)."""
    if type(t) is not torch.Tensor and is_fake(t):  # torch.export, make_fx: no values to read
        return False
    if torch.compiler.is_exporting():  # non-strict torch.export shows buffers as plain tensors
        return False
    return t.numel() > 0 and t.device.type != "meta"


def all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor with values holds no NaN or Inf: aminmax propagates NaN and shows
    Inf in one pass without a mask (12x faster than isfinite().all() on a 45M-element
    weight)."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(t))).all())


def finite(name: str, t: torch.Tensor) -> None:
    """Refuse NaN/Inf in a tensor to be quantized: they would poison its scale."""
    if has_values(t) and not all_finite(t):
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        raise ValueError(
            f"{name} contains NaN or Inf (first at index {bad}: {t[tuple(bad)].item()}); "
            "a non-finite value would poison the scale of its block"
        )


def positive_finite(name: str, t: torch.Tensor | None) -> None:
    """Refuse a scale that is zero, negative, NaN or Inf (it would divide by zero or
    poison every value it touches)."""
    if t is not None and has_values(t):
        bad = ~(torch.isfinite(t) & (t > 0))
        if bool(bad.any()):
            index = bad.nonzero()[0].tolist()
            raise ValueError(f"{name} must be finite and > 0, got {t[tuple(index)].item()} at index {index}")


def in_range(name: str, t: torch.Tensor | None, lo: int, hi: int, why: str) -> None:
    """Refuse an integer tensor (a zero point) with a value outside [lo, hi]."""
    if t is not None and has_values(t):
        bad = (t < lo) | (t > hi)
        if bool(bad.any()):
            index = bad.nonzero()[0].tolist()
            raise ValueError(f"{name} must lie in [{lo}, {hi}] ({why}), got {t[tuple(index)].item()} "
                             f"at index {index}")


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "(" + ", ".join(str(d).replace("torch.", "") for d in dtypes) + ")"
