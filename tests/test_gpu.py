"""The triton backend compiled for a real NVIDIA GPU, against the reference on the CPU.

CI has no GPU: this module skips there, and tests/test_triton.py plus the shared
tests run the same kernels through Triton's interpreter instead.  On a machine with
CUDA, run it with the interpreter off (conftest.py turns it on by default):

    TRITON_INTERPRET=0 python -m pytest tests/test_gpu.py

The rules are the shared tests' own: bit-exact where the arithmetic is (quantize,
dequantize, packing, per-token quantization, the int8 GEMMs and W8A8), the derived
tolerances of tests/test_matmul.py for float matmuls, and "ties only" for W4A8's
requantized int8 output.  Shapes are the GPU's: split-K GEMVs, masked tails in M, N
and K, and every autotuner bucket (M = 1, small M, prefill).
"""

import pytest
import torch

import lowbit
from lowbit import kernels
from lowbit.kernels import triton as triton_kernels
from lowbit.ops import linear

from .conftest import gen
from .test_matmul import (WEIGHT_SCHEMES, _assert_ties_only, _qta8o_case, int8_linear_case,
                          weight_only_tolerance)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or triton_kernels.interpreting() or not triton_kernels.available(),
    reason="needs a CUDA GPU, triton, and TRITON_INTERPRET=0")

CUDA = torch.device("cuda")


def _cuda(args):
    return tuple(a.to(CUDA) if isinstance(a, torch.Tensor) else a for a in args)


def test_cuda_tensors_run_the_triton_backend():
    assert kernels.resolve(None, CUDA) == "triton"
    assert "triton" in kernels.available_backends("cuda")


# -- elementwise: bit-exact ---------------------------------------------------------------------
QUANT_SCHEMES = WEIGHT_SCHEMES + ["int3-asym-g32", "int8-asym-token", "int4-asym-g128-zpfloat-bf16"]


@pytest.mark.parametrize("scheme", QUANT_SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_and_dequantize_are_bit_exact_with_the_cpu_reference(scheme, dtype):
    w = (torch.randn(200, 512, generator=gen(7)) * 0.05).to(dtype)
    ref = lowbit.quantize(w, scheme, backend="reference")
    qt = lowbit.quantize(w.to(CUDA), scheme)
    assert qt.codes.device.type == "cuda"
    for name in ("codes", "scale", "zero_point"):
        a, b = getattr(ref, name), getattr(qt, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b.cpu()), name
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(lowbit.dequantize(qt, out).cpu(), lowbit.dequantize(ref, out, backend="reference"))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_and_unpack_are_bit_exact(bits):
    q = torch.randint(0, 2**bits, (96, 256), generator=gen(bits), dtype=torch.uint8)
    packed = lowbit.ops.pack_bits(q.to(CUDA), bits)
    assert torch.equal(packed.cpu(), lowbit.ops.pack_bits(q, bits, backend="reference"))
    assert torch.equal(lowbit.ops.unpack_bits(packed, bits, signed=False).cpu(), q)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, k", [(1, 4096), (37, 576), (300, 1000)])
def test_per_token_quantization_is_bit_exact(symmetric, dtype, m, k):
    x = torch.randn(m, k, generator=gen(m + k)).to(dtype) * 3
    x[0, :7] = 0  # a row with zeros: the scale's floor path
    ref = lowbit.ops.quantize_per_token(x, 8, symmetric, backend="reference")
    got = lowbit.ops.quantize_per_token(x.to(CUDA), 8, symmetric)
    for a, b in zip(ref, got):
        assert torch.equal(a, b.cpu())
    back_ref = lowbit.ops.dequantize_per_token(*ref, backend="reference")
    assert torch.equal(lowbit.ops.dequantize_per_token(*got).cpu(), back_ref)


# -- weight-only matmuls: derived tolerance -----------------------------------------------------
# (N, K): K = 4096 with few rows splits K in the GEMV; K = 576 is the bundled model's hidden
# size (4.5 groups of 128: the reference path), N = 200 / 72 leave masked column tails.
WEIGHT_SHAPES = [(96, 4096), (200, 576), (72, 1216)]


@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 64, 300])
@pytest.mark.parametrize("n, k", WEIGHT_SHAPES)
def test_weight_only_linear_matches_the_reference(scheme, dtype, m, n, k):
    s = lowbit.QuantScheme.parse(scheme)
    if s.group_size and k % s.group_size:
        pytest.skip(f"K={k} is not a multiple of the group size")
    w = torch.randn(n, k, generator=gen(n + k)) * 0.05
    x = torch.randn(m, k, generator=gen(m)).to(dtype)
    qt = lowbit.quantize(w, scheme, backend="reference")
    y_ref = linear(x, qt, backend="reference")
    y = linear(x.to(CUDA), qt.to(CUDA))
    assert y.dtype == dtype and y.shape == (m, n) and y.device.type == "cuda"
    err = (y.cpu().double() - y_ref.double()).abs()
    assert bool((err <= weight_only_tolerance(x, qt, y_ref, "triton")).all()), float(err.max())
    assert torch.equal(linear(x.to(CUDA), qt.to(CUDA)), y)  # deterministic: no atomics


def test_weight_only_leading_dims_and_bias():
    qt = lowbit.quantize(torch.randn(64, 256, generator=gen(1)), "int4-asym-g64")
    x = torch.randn(2, 3, 256, generator=gen(2)).to(torch.bfloat16)
    bias = torch.randn(64, generator=gen(3)).to(torch.bfloat16)
    y = linear(x.to(CUDA), qt.to(CUDA), bias.to(CUDA))
    assert y.shape == (2, 3, 64)
    flat = linear(x.reshape(6, 256).to(CUDA), qt.to(CUDA), bias.to(CUDA))
    assert torch.equal(y.reshape(6, 64), flat)


# -- W8A8 and the int8 GEMM: bit-exact ----------------------------------------------------------
@pytest.mark.parametrize("m, n, k", [(1, 8, 64), (13, 200, 584), (64, 70, 4100), (300, 256, 1024)])
def test_int8_mm_is_the_exact_integer_product(m, n, k):
    a = torch.randint(-128, 128, (m, k), generator=gen(m), dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=gen(n), dtype=torch.int8)
    expected = (a.double() @ b.double().T).to(torch.int32)  # exact: |a . b| < 2^53
    assert torch.equal(kernels.get_backend(kernels.resolve(None, CUDA)).int8_mm(a.to(CUDA), b.to(CUDA)).cpu(), expected)


@pytest.mark.parametrize("act", ["int8-sym-token", "int8-asym-token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 17, 64, 300])
def test_w8a8_linear_is_bit_exact_with_the_cpu_reference(act, dtype, m):
    qt = lowbit.quantize(torch.randn(200, 1216, generator=gen(5)), "int8-sym", backend="reference")
    x = torch.randn(m, 1216, generator=gen(m)).to(dtype)
    bias = torch.randn(200, generator=gen(6)).to(dtype)
    y_ref = linear(x, qt, bias, act_scheme=act, backend="reference")
    y = linear(x.to(CUDA), qt.to(CUDA), bias.to(CUDA), act_scheme=act)
    assert torch.equal(y.cpu(), y_ref)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_point, bias", [(False, False), (True, True)])
@pytest.mark.parametrize("values", ["random", "extreme"])
@pytest.mark.parametrize("m, n, k", [(1, 8, 64), (13, 200, 584), (7, 70, 4100), (256, 128, 2048)])
def test_fused_w8a8_is_bit_exact_with_the_reference_composition(out_dtype, zero_point, bias, values, m, n, k):
    args = int8_linear_case(m, n, k, values, zero_point, bias, out_dtype)
    expected = kernels.get_backend("reference").int8_linear(*args)
    y = kernels.get_backend("triton").int8_linear(*_cuda(args))
    assert torch.equal(y.cpu(), expected)


# -- W4A8: ties only ---------------------------------------------------------------------------
@pytest.mark.parametrize("m, n, k, group", [(1, 8, 64, 32), (7, 24, 256, 64), (64, 48, 512, 128),
                                           (3, 200, 4096, 128), (2, 8, 16384, 128), (300, 256, 2048, 64)])
@pytest.mark.parametrize("zp", ["random", "zero", "none"])
@pytest.mark.parametrize("values", ["random", "extreme"])
def test_w4a8_qta8o_agrees_with_the_reference_up_to_ties(m, n, k, group, zp, values):
    args = _qta8o_case(m, n, k, group, zp, values, seed=m * 1000 + k + group)
    ref = lowbit.ops.linear_qta8a_qga4w_qta8o(*args, backend="reference")
    fast = lowbit.ops.linear_qta8a_qga4w_qta8o(*_cuda(args))
    _assert_ties_only(args, ref, fast.cpu())


# -- a model end to end ------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["w4a16-g128", "w8a16", "w8a8"])
def test_a_quantized_llama_generates_the_same_tokens_on_the_gpu(recipe):
    """A tiny random Llama (float32), quantized once on the CPU: the GPU's greedy tokens are
    the reference's wherever the reference's top-2 logit margin exceeds both runs' error."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    q = lowbit.quantize_model(model, recipe, inplace=False, backend="reference")
    ids = torch.randint(0, 512, (1, 12), generator=gen(0))
    with torch.no_grad():
        ref = q(ids).logits
        q_gpu = q.to(CUDA)
        for m in q_gpu.modules():
            if isinstance(m, lowbit.nn.QuantLinear):
                m.backend = None  # the device's own backend: triton
        got = q_gpu(ids.to(CUDA)).logits.cpu()
    # Weight-only and W8A8 linears stay within 1e-5 relative of the reference per layer
    # (float32, K <= 512: gamma_K ~ 3e-5 of the abs products); through two layers and
    # the float ops (attention, norms: cuBLAS vs CPU ordering) 1e-3 of the logits' scale
    # is a loose bound, which an indexing or packing bug (errors of O(1)) breaks.
    assert float((got - ref).abs().max()) <= 1e-3 * float(ref.abs().max())


@pytest.mark.parametrize("scheme, act", [("int4-asym-g128", None), ("int8-sym", "int8-sym-token"),
                                         ("int4-asym-g64", "int8-asym-token")])
def test_linear_replays_from_a_cuda_graph(scheme, act):
    """No host sync inside linear: it can be captured, and a replay on new input gives the
    eager call's bits."""
    qt = lowbit.quantize(torch.randn(256, 512, generator=gen(1)).to(CUDA), scheme)
    x = torch.randn(4, 512, generator=gen(2)).to(CUDA, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear(x, qt, act_scheme=act)  # autotune and compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear(x, qt, act_scheme=act)
    x.copy_(torch.randn(4, 512, generator=gen(3)).to(CUDA, torch.bfloat16))
    graph.replay()
    assert torch.equal(y, linear(x, qt, act_scheme=act))
