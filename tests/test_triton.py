"""What is specific to the triton backend (split-K GEMV, fused epilogues, the choice of
backend), run on the CPU by Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py;
CI has no GPU).  The shared parametrized tests (test_quant, test_matmul, ...) run the
triton backend like every other, at small shapes."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lowbit.kernels.triton._common import code_plane, interleave8  # noqa: E402

from lowbit.kernels.triton import interpreting, weight_only  # noqa: E402
import lowbit  # noqa: E402
from lowbit import kernels  # noqa: E402
from lowbit.kernels import reference  # noqa: E402
from lowbit.ops import dequantize_per_token, linear, quantize_per_token  # noqa: E402

from .conftest import gen  # noqa: E402
from .test_matmul import abs_products, gamma, weight_only_tolerance  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="TRITON_INTERPRET is off: these tests run the kernels "
                                "on CPU tensors through Triton's interpreter")

T = "triton"


# -- what only the triton backend has (the shared tests in test_*.py run it too, at small shapes) --
@pytest.mark.parametrize("scheme", ["int4-asym-g128", "int8-sym"])
def test_decode_gemv_splits_k_and_adds_the_splits_in_order(scheme):
    n, k = 16, 4096
    assert weight_only.split_k(n, k, torch.device("cpu")) > 1  # the split path is what runs
    qt = lowbit.quantize(torch.randn(n, k), scheme)
    x = torch.randn(1, k)
    y_ref = linear(x, qt, backend="reference")
    y = linear(x, qt, backend=T)
    assert bool(((y.double() - y_ref.double()).abs() <= weight_only_tolerance(x, qt, y_ref, T)).all())
    assert torch.equal(linear(x, qt, backend=T), y)  # no atomics: the same bits every run


def test_weight_only_zero_rows_and_float64_fall_back():
    qt = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
    assert linear(torch.empty(0, 64, dtype=torch.bfloat16), qt, backend=T).shape == (0, 16)
    x = torch.randn(3, 64, dtype=torch.float64)  # no float64 tensor-core path: the reference runs
    assert torch.equal(linear(x, qt, backend=T), linear(x, qt, backend="reference"))


@triton.jit
def _planes(w_ptr, y_ptr, BITS: tl.constexpr, SIGNED: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
    """y [R, W * codes per word] = the codes of words [R, W] as float32, through code_plane
    (and interleave8 for 4-bit words)."""
    rr, rw = tl.arange(0, R), tl.arange(0, W)
    words = tl.load(w_ptr + rr[:, None] * W + rw[None, :]).to(tl.int32)
    if BITS == 8:
        y = code_plane(words, 0, BITS, SIGNED)
    else:
        y = interleave8(code_plane(words, 0, BITS, SIGNED), code_plane(words, 1, BITS, SIGNED),
                        code_plane(words, 2, BITS, SIGNED), code_plane(words, 3, BITS, SIGNED),
                        code_plane(words, 4, BITS, SIGNED), code_plane(words, 5, BITS, SIGNED),
                        code_plane(words, 6, BITS, SIGNED), code_plane(words, 7, BITS, SIGNED))
    CODES: tl.constexpr = W * (32 // BITS if BITS < 8 else 1)
    tl.store(y_ptr + rr[:, None] * CODES + tl.arange(0, CODES)[None, :], y)


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_code_planes_are_every_code_exactly_and_interleave_to_k_order(bits, signed):
    """_common.code_plane (codes to float32 through the mantissa of 2^23) gives every code
    value of every field position exactly, and interleave8 puts the planes of u32x8 words
    back in K order: the same values as lowbit.ops.unpack_bits."""
    lo = -(2 ** (bits - 1)) if signed else 0
    r, k = 16, 256  # every code value at every position of a word (a shift of 1 per row)
    q = ((torch.arange(k)[None, :] + torch.arange(r)[:, None]) % 2**bits + lo)
    q = q.to(torch.int8 if signed else torch.uint8)
    words = lowbit.ops.pack_bits(q, 4) if bits == 4 else q
    y = torch.empty(r, k)
    _planes[(1,)](words.contiguous(), y, BITS=bits, SIGNED=signed, R=r, W=words.shape[1])
    assert torch.equal(y, q.float())


# -- W8A8 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 40])
def test_fused_w8a8_epilogue_is_bit_exact_with_the_unfused_ops(out_dtype, zero_point, bias, m):
    g = gen(m)
    n, k = 72, 200  # K = 3 * 64 + 8: a masked tail tile
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    row, col = torch.rand(m, generator=g) * 0.01, torch.rand(n, generator=g).to(torch.bfloat16)
    azp = torch.randint(-256, 128, (m,), generator=g, dtype=torch.int32) if zero_point else None
    bvec = torch.randn(n, generator=g) if bias else None
    acc = reference.int8_mm(a, b)
    if zero_point:
        acc = acc - azp[:, None] * b.sum(dim=1, dtype=torch.int32)[None, :]
    expected = reference.dequantize_accumulator_rowcol(acc, row, col, out_dtype)
    if bias:
        expected = expected + bvec.to(out_dtype)
    assert torch.equal(kernels.get_backend(T).int8_linear(a, azp, b, row, col, bvec, out_dtype), expected)


@pytest.mark.parametrize("values", ["random", "extreme"])
@pytest.mark.parametrize("m, n, k", [(1, 8, 64), (17, 40, 200), (16, 16, 4096)])
def test_int8_mm_is_the_exact_int32_product(values, m, n, k):
    g = gen(k)
    if values == "extreme":  # |sum| = 128 * 128 * K: int32 headroom at K = 4096 is 2^26 of 2^31
        a = torch.full((m, k), -128, dtype=torch.int8)
        b = torch.where(torch.rand(n, k, generator=g) < 0.5, -128, 127).to(torch.int8)
    else:
        a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    out = kernels.get_backend(T).int8_mm(a, b)
    assert out.dtype == torch.int32 and torch.equal(out, reference.int8_mm(a, b))


# -- W4A8 (linear_qta8a_qga4w_qta8o) --------------------------------------------------------------
def test_w4a8_linear_float_output_matches_the_reference():
    qt = lowbit.quantize(torch.randn(40, 256), "int4-asym-g64")
    x = torch.randn(6, 256)
    y_ref = linear(x, qt, act_scheme="int8-asym-token", backend="reference")
    y = linear(x, qt, act_scheme="int8-asym-token", backend=T)
    q, s, z = quantize_per_token(x)
    x_hat = dequantize_per_token(q, s, z)
    # Both sides: gamma_{K+3} * sum|terms| from the float32 sums and scalings.
    tol = 2 * gamma(256 + 3) * abs_products(x_hat, qt) + 1e-30
    assert bool(((y.double() - y_ref.double()).abs() <= tol).all())


# -- dequantize, per token, accumulators: bit-exact -----------------------------------------------
# -- selection and errors --------------------------------------------------------------------------
def test_triton_is_chosen_for_cuda_and_only_by_name_on_the_cpu():
    assert "triton" in kernels.available_backends("cuda")
    assert "triton" not in kernels.available_backends("cpu")  # interpreter mode never becomes the default
    assert kernels.resolve(None, torch.device("cuda")) == "triton"
    assert kernels.resolve("triton", torch.device("cpu")) == "triton"  # interpreter mode: by name


def test_triton_on_cpu_tensors_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernels.triton_kernels, "interpreting", lambda: False)
    with pytest.raises(ValueError, match=r"backend='triton' is not available for tensors on cpu.*CUDA tensors"
                                         r".*TRITON_INTERPRET=1"):
        linear(torch.randn(2, 64), lowbit.quantize(torch.randn(16, 64), "int4-sym-g32"), backend="triton")


def test_import_lowbit_needs_no_triton_and_asking_for_it_names_the_cause():
    # A fresh interpreter: lowbit imports without importing triton; then `import triton`
    # is made to fail, as on a machine without it.
    code = (
        "import sys, torch, lowbit\n"
        "assert 'triton' not in sys.modules\n"
        "sys.modules['triton'] = None\n"
        "from lowbit import kernels\n"
        "assert kernels.available_backends('cuda') == ['reference'], kernels.available_backends('cuda')\n"
        "qt = lowbit.quantize(torch.randn(8, 32), 'int4-sym-g32')\n"
        "assert lowbit.linear(torch.randn(1, 32), qt).shape == (1, 8)\n"
        "try:\n"
        "    kernels.resolve('triton', torch.device('cuda'))\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "backend='triton' is not available for tensors on cuda" in out.stdout
    assert "pip install triton" in out.stdout
