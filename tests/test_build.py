import os

import pytest

from lowbit.kernels import available_backends, cpu


@pytest.mark.skipif(os.environ.get("LOWBIT_NO_EXT") == "1", reason="installed without the C++ extension")
def test_cpu_extension_is_built_so_the_fast_backend_is_tested():
    # Without this the backend-parametrized tests would silently test only the reference.
    assert cpu.available(), cpu.load_error()
    assert available_backends("cpu") == ["reference", "cpu"]
