"""The "min" zero-point domain (``-zpmin``): x ~= q * scale + zero_point, GGUF's d * q + m."""

import pytest
import torch

import lowbit
from lowbit.formats import ggml
from lowbit.formats.gguf_export import encode
from lowbit.scheme import QuantScheme

from .conftest import BACKENDS

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
def test_linear_equals_the_dequantized_matmul(backend):
    qt = lowbit.quantize(torch.randn(48, 128), "int4-asym-g32-zpmin-f16")
    x = torch.randn(5, 128)
    y = lowbit.linear(x, qt, backend=backend)
    assert torch.equal(y, torch.nn.functional.linear(x, lowbit.dequantize(qt)))


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
    with torch.no_grad():
        assert torch.equal(q(ids).logits, ref(ids).logits)
    assert lowbit.Runner(back).generate(ids[0], 4).tokens == lowbit.Runner(ref).generate(ids[0], 4).tokens
