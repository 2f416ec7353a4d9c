"""The "min" zero-point domain (``-zpmin``): x ~= q * scale + zero_point, GGUF's d * q + m."""

import pytest
import torch

import lowbit
from lowbit.formats import ggml
from lowbit.formats.gguf_export import encode
from lowbit.scheme import QuantScheme

from lowbit.kernels import cpu, get_backend

from .conftest import BACKENDS
from .test_matmul import assert_weight_only_close

SCHEMES = ["int4-asym-g32-zpmin-f16", "int4-asym-g64-zpmin", "int8-asym-channel-zpmin-bf16",
           "int2-asym-g32-zpmin-f16", "int3-asym-g32-zpmin", "int4-asym-tensor-zpmin"]


def test_string_form_round_trips_and_needs_an_asymmetric_scheme():
    s = QuantScheme.parse("int4-asym-g32-zpmin-f16")
    assert (s.zero_point_domain, s.zero_point_dtype, str(s)) == ("min", torch.float16, "int4-asym-g32-zpmin-f16")
    with pytest.raises(ValueError, match="zero_point_domain='min' needs symmetric=False"):
        QuantScheme.parse("int4-sym-g32-zpmin")
    with pytest.raises(ValueError, match="'zpfloat' and 'zpmin' both set the zero point domain"):
        QuantScheme.parse("int4-asym-zpfloat-zpmin")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_min_is_below_the_block_and_values_are_within_half_a_step(scheme):
    """The stored min is the block's minimum rounded down to the scale dtype, so no value
    is clipped below; every value is within half a step of its code (plus the two
    roundings of q * s + m: a few ulps)."""
    x = torch.randn(16, 256) * 3 + 1
    qt = lowbit.quantize(x, scheme)
    blocks = x.reshape(qt.scale.numel(), -1)
    zp = qt.zero_point.float().reshape(-1)
    scale = qt.scale.float().reshape(-1)
    assert bool((zp <= blocks.amin(1)).all())
    err = (lowbit.dequantize(qt) - x).reshape(blocks.shape).abs()
    ulp = 4 * torch.finfo(torch.float32).eps * x.abs().amax()
    assert bool((err <= scale[:, None] / 2 + ulp).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_backend_dequantizes_q_times_s_plus_m(scheme, backend):
    qt = lowbit.quantize(torch.randn(8, 128), scheme)
    q = lowbit.ops.unpack_bits(qt.codes, qt.scheme.bits, qt.scheme.packing, signed=False).float() \
        if qt.scheme.is_packed else qt.codes.float()
    s = qt.scheme
    rows = qt.scale.float().reshape(-1, 1)
    by_block = q.reshape(rows.shape[0], -1) * rows + qt.zero_point.float().reshape(-1, 1)  # product, then sum
    for dtype in (torch.float32, torch.bfloat16):
        got = lowbit.dequantize(qt, dtype, backend=backend)
        assert torch.equal(got, by_block.reshape(8, 128).to(dtype)), (s, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_linear_runs_the_packed_weight_within_the_weight_only_bound(backend, m):
    """The reference is the matmul of the dequantized weight; the fast backends run the codes
    as they are (q * s + m: the float32 rows, the bf16 decode kernels with 128 s - m as the
    group's factor of sum x, the bf16 panels and tiles of q * s + m; on triton the
    reference), within tests/test_matmul.py's derived bound."""
    qt = lowbit.quantize(torch.randn(48, 128), "int4-asym-g32-zpmin-f16")
    x = torch.randn(m, 128)
    if backend == "reference":
        assert torch.equal(lowbit.linear(x, qt, backend=backend), torch.nn.functional.linear(x, lowbit.dequantize(qt)))
        return
    for dtype in (torch.float32, torch.bfloat16):
        kernel = get_backend(backend).plan(qt.scheme, None, m, 128, dtype).kernel
        assert backend != "triton" or kernel == "reference", kernel
        assert_weight_only_close(qt, x.to(dtype), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 40])
def test_the_ops_refuse_a_min_form_without_float_mins(backend, m):
    """Called directly, before any kernel: the same error on every backend and path."""
    qt = lowbit.quantize(torch.randn(8, 64), "int4-asym-g32")
    x, scale = torch.randn(m, 64), qt.scale.reshape(8, 2).float()
    with lowbit.kernels.use_backend(backend):
        for zp in (None, qt.zero_point.reshape(8, 2)):
            with pytest.raises(ValueError, match="zero_point_min=True needs zero_point: the float mins"):
                torch.ops.lowbit.weight_only_matmul(x, qt.codes, scale, zp, 4, 32, True)
            with pytest.raises(ValueError, match="zero_point_min=True needs zero_point: the float mins"):
                torch.ops.lowbit.linear_a8_blocks(x, qt.codes, scale, zp, 4, 32, 32, True)


def test_a_quant_linear_differentiates_exports_and_lowers_to_the_row_kernel():
    """The op's seventh argument (zero_point_min) reaches the backward pass (the
    dequantized q * s + m weight), the exported graph and the lowering pass's plan."""
    from lowbit.nn import QuantLinear
    from lowbit.passes import lower

    ql = QuantLinear.from_linear(torch.nn.Linear(64, 32, bias=False), "int4-asym-g32-zpmin-f16")
    x = torch.randn(3, 64, requires_grad=True)
    ql(x).sum().backward()
    assert torch.allclose(x.grad, torch.ones(3, 32) @ lowbit.dequantize(ql.qweight), rtol=0, atol=1e-5)
    ep = torch.export.export(torch.nn.Sequential(ql).requires_grad_(False), (torch.randn(2, 64),))
    node = next(n for n in ep.graph.nodes if n.target == torch.ops.lowbit.weight_only_matmul.default)
    assert node.args[6] is True
    from lowbit.kernels import cpu

    if cpu.available() and cpu._has_gemv_f32():  # the cpu plan of a q * s + m weight: never a bf16 kernel
        record = next(n for n in lower(ep, "cpu").graph.nodes if n.name == node.name).meta["custom"]
        assert record["lowbit_kernels"]["M=1"].startswith("gemv_f32"), record
    x2 = torch.randn(2, 64)
    assert torch.equal(ep.module()(x2), ql(x2))


@pytest.mark.parametrize("scheme", ["int4-asym-g32-zpmin-f16", "int2-asym-g64-zpmin-f16", "int3-asym-g32-zpmin-f16"])
def test_gguf_q4_1_holds_it_exactly(scheme):
    qt = lowbit.quantize(torch.randn(16, 256), scheme)
    raw, how = encode(qt, "Q4_1")
    assert how == "codes kept"
    assert torch.equal(ggml.dequantize(raw, "Q4_1", [16, 256]), lowbit.dequantize(qt))


def test_methods_that_do_not_handle_it_refuse_it():
    from lowbit.algorithms.gptq import gptq_quantize
    from lowbit.algorithms.hqq import hqq_qparams

    w = torch.randn(16, 64)
    with pytest.raises(ValueError, match="'min' zero point, which GPTQ"):
        gptq_quantize(w, torch.eye(64), "int4-asym-g32-zpmin")
    with pytest.raises(ValueError, match="'min' zero point, which HQQ"):
        hqq_qparams(w, "int4-asym-g32-zpmin")
    with pytest.raises(ValueError, match="W4A8 needs integer weight zero points"):
        lowbit.linear(torch.randn(2, 64), lowbit.quantize(w, "int4-asym-g32-zpmin"), act_scheme="int8-asym-token")


def test_a_model_saves_loads_and_generates(tmp_path):
    model, tok = lowbit.load_model(progress=False)
    r = lowbit.Recipe(weight="int4-asym-g32-zpmin-f16", modules=[r"layers\.[01]\."])
    q = lowbit.quantize_model(model, r, inplace=False)
    lowbit.save_quantized(q, tmp_path / "ck", tok)
    back, _ = lowbit.load_model(tmp_path / "ck")
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(back(ids).logits, q(ids).logits)
    ref = lowbit.models.dequantized_copy(q)
    with torch.no_grad():  # a prompt (M = 5) and one token (M = 1): the packed weight's kernels
        for x in (ids, ids[:, :1]):
            # as tests/test_model.py's int4 twin: float32 sums in another order (s * q.x + m * sum x per
            # group, against (q * s + m).x), ~1e-7 relative over K <= 1536 per layer, far inside 1e-4
            assert (q(x).logits - ref(x).logits).abs().max() <= 1e-4
    assert lowbit.Runner(back).generate(ids[0], 4).tokens == lowbit.Runner(ref).generate(ids[0], 4).tokens


@pytest.mark.skipif(not cpu.available(), reason="needs lowbit._C")
def test_the_cpu_kernels_refuse_the_min_form_where_they_cannot_take_it():
    """_C.weight_only_matmul refuses zero_point_min on every kernel without the mins."""
    qt = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32-zpmin")
    x, s, z = torch.randn(2, 64), qt.scale.reshape(16, 2).float(), qt.zero_point.reshape(16, 2).float()
    for kernel in ("gemv_f32", "gemv_bf16", "gemv_bf16_amx", "gemm_bf16", "gemm_fma", "gemm_f32_fma", "gemm_bf16_amx",
                   "gemm_f32_amx"):
        supported = {"gemv_bf16": cpu._C.gemv_bf16_supported, "gemv_bf16_amx": cpu._C.gemv_bf16_amx_supported,
                     "gemm_bf16": cpu._C.gemm_bf16_supported, "gemm_fma": cpu._C.gemm_bf16_supported,
                     "gemm_f32_fma": cpu._C.gemm_bf16_supported}.get(kernel)
        if (supported and not supported(64, 32)) or (kernel in ("gemm_bf16_amx", "gemm_f32_amx")
                                                        and not cpu._C.has_amx_bf16()):
            continue
        with pytest.raises(RuntimeError, match="zero_point_min needs the mins"):
            cpu._C.weight_only_matmul(x, qt.codes, s, None, 4, 32, cpu.weight_only_kernel_index(kernel), True)
