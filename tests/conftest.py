import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton's interpreter runs the triton backend's kernels on CPU tensors (tests/test_triton.py;
# CI has no GPU).  Triton reads the variable when it decorates a kernel and again while one
# runs, so it is set for the whole session, before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from lowbit.kernels import available_backends  # noqa: E402

settings.register_profile(
    "default", max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

BACKENDS = available_backends("cpu")
FAST_BACKENDS = [b for b in BACKENDS if b != "reference"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
