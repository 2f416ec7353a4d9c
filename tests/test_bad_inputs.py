"""Bad input to the operators, modules and schemes: each is refused before any work with
an error that names the argument, or handled exactly; and the integer accumulators
are exact at the largest K each path accepts.  (Files, checkpoints, recipes and the
CLI: tests/test_bad_checkpoint.py, test_bad_cli.py, test_bad_gguf.py.)"""

import pytest
import torch

import lowbit
from lowbit import kernels
from lowbit.kernels import reference
from lowbit.nn import QuantEmbedding
from lowbit.ops import library, linear, linear_qta8a_qga4w_qta8o, quantize_per_token
from lowbit.ops.matmul import weight_parts
from lowbit.scheme import W4A8_MAX_GROUP, QuantScheme

from .conftest import BACKENDS, gen, skip_large_for_interpreter
from .test_matmul import _qta8o_case, gamma


# -- 1. W8A8: exact for any K ----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ["int8-asym-token", "int8-sym-token"])
@pytest.mark.parametrize("k", [66560, 135168])
def test_w8a8_past_the_int32_bound_is_the_exact_integer_product(backend, act, k):
    # The probe: K past 2^31 / (255 * 128) (asymmetric) or 2^31 / (128 * 128) wrapped int32.
    skip_large_for_interpreter(backend, 1, 4, k)
    qw = lowbit.quantize(-torch.ones(4, k), "int8-sym")
    x = torch.ones(1, k)
    x[:, 0] = 0
    y = linear(x, qw, act_scheme=act, backend=backend)
    q, s, z = lowbit.ops.quantize_per_token(x, 8, act == "int8-sym-token")
    acc = (q.double() - z.double()[:, None]) @ qw.codes.double().T  # exact in float64 (< 2^53)
    expected = (acc.float() * s[:, None]) * qw.scale.float()[None, :]
    assert torch.equal(y, expected)
    assert float(y[0, 0]) < -0.99 * (k - 1)  # the sign the int32 wrap-around flipped


def _extreme_int8(m, n, k, seed):
    g = gen(seed)
    a = torch.full((m, k), -128, dtype=torch.int8)
    b = torch.where(torch.rand(n, k, generator=g) < 0.5, -128, 127).to(torch.int8)
    b[0] = -128  # one column at the bound: |a . b| = 128 * 128 * K
    return a, b


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_mm_is_exact_at_its_largest_k_and_refuses_past_it(backend):
    k = library.INT8_MM_MAX_K  # 128 * 128 * K < 2^31
    skip_large_for_interpreter(backend, 1, 2, k)
    a, b = _extreme_int8(1, 2, k, 1)
    with kernels.use_backend(backend):
        acc = torch.ops.lowbit.int8_mm(a, b)
    assert torch.equal(acc.long(), a.long() @ b.long().T)
    with pytest.raises(ValueError, match=f"K={k + 1} is past {k}"):
        torch.ops.lowbit.int8_mm(*_extreme_int8(1, 2, k + 1, 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [library.INT8_LINEAR_CHUNK_K, 2 * library.INT8_LINEAR_CHUNK_K + 40])
def test_int8_linear_with_zero_points_is_exact_at_and_past_one_chunk(backend, k):
    # a - a_zp = -128 - 127 = -255 on every term: |acc| = 255 * 128 * K, the largest a
    # zero-point correction reaches (one chunk at the first K, three chunks at the second).
    skip_large_for_interpreter(backend, 2, 3, k)
    a, b = _extreme_int8(2, 3, k, 2)
    azp = torch.tensor([127, -128], dtype=torch.int32)
    row, col = torch.tensor([1e-3, 2e-3]), torch.tensor([0.5, 0.25, 0.125])
    with kernels.use_backend(backend):
        y = torch.ops.lowbit.int8_linear(a, azp, b, row, col, None, torch.float32)
    acc = (a.long() - azp.long()[:, None]) @ b.long().T
    assert torch.equal(y, (acc.float() * row[:, None]) * col[None, :])


@pytest.mark.parametrize("backend", BACKENDS)
def test_w4a8_is_exact_per_group_at_the_largest_group(backend):
    # (x_q - x_zp) (q - z) = 255 * 15 on every term of one group of W4A8_MAX_GROUP (rounded
    # down to whole u32 words): an int32 group sum at its bound.
    k = W4A8_MAX_GROUP // 32 * 32
    skip_large_for_interpreter(backend, 1, 2, k)
    x_q = torch.full((1, k), -128, dtype=torch.int8)
    x_zp = torch.tensor([127], dtype=torch.int32)
    w_q = torch.full((2, k), 15, dtype=torch.uint8)
    w_zp = torch.zeros(2, 1, dtype=torch.uint8)
    w_scale, x_scale = torch.tensor([[1.0], [0.5]]), torch.tensor([2.0**-20])
    args = (x_q, x_scale, x_zp, reference.pack(w_q, 4, "u32"), w_scale, w_zp, k, None)
    with kernels.use_backend(backend):
        y = torch.ops.lowbit.linear_qta8a_qga4w(*args)
    exact = -255.0 * 15 * k * 2.0**-20 * w_scale.double().reshape(1, 2)
    assert bool(((y.double() - exact).abs() <= gamma(k + 3) * exact.abs()).all())
    with pytest.raises(ValueError, match="group_size=.* is past"):
        linear_qta8a_qga4w_qta8o(*_qta8o_big_group(W4A8_MAX_GROUP + 32 - W4A8_MAX_GROUP % 32))


def _qta8o_big_group(group):
    args = list(_qta8o_case(1, 8, 64, 32, "random", "random", seed=0))
    args[0] = torch.zeros(1, group, dtype=torch.int8)
    args[3] = torch.zeros(8, group // 8, dtype=torch.int32)
    args[4], args[5], args[6] = torch.ones(8, 1), torch.zeros(8, 1, dtype=torch.uint8), group
    return args


# -- 2. huge finite values -------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_quantization_of_huge_values_is_refused_like_quantize(backend):
    x = torch.tensor([[3e38, -3e38, 1.0, 0.0]])
    with pytest.raises(ValueError, match="scale of a row of x overflows torch.float32"):
        quantize_per_token(x, backend=backend)
    with pytest.raises(ValueError, match="overflows torch.float32"):
        lowbit.quantize(x, "int8-asym-token", backend=backend)
    with pytest.raises(ValueError, match="overflows"):
        linear(x, lowbit.quantize(torch.randn(8, 4), "int8-sym"), act_scheme="int8-asym-token", backend=backend)


def test_scale_overflow_message_suggests_float32_only_for_a_float16_scale():
    with pytest.raises(ValueError, match="overflows torch.float16.*float32 scale"):
        lowbit.quantize(torch.tensor([[1e7, -1e7] * 16]), "int8-asym-g32-f16")
    with pytest.raises(ValueError, match="overflows torch.float32.*scale the data down") as e:
        lowbit.quantize(torch.tensor([[3e38, -3e38] * 16]), "int8-asym-g32")
    assert "scale_dtype=torch.float32" not in str(e.value)


# -- 4, 5. static quantization parameters are value-checked ---------------------------------
X = torch.randn(4, 64, generator=gen(0))
NAN = float("nan")


@pytest.mark.parametrize("scheme, scale, zp, match", [
    ("int8-sym", torch.zeros(4), None, "scale must be finite and > 0, got 0.0"),
    ("int8-sym", torch.full((4,), NAN), None, "scale must be finite and > 0, got nan"),
    ("int8-sym", torch.full((4,), float("inf")), None, "scale must be finite and > 0, got inf"),
    ("int8-sym", -torch.ones(4), None, "scale must be finite and > 0, got -1.0"),
    ("int4-asym-g32", torch.ones(4, 2), torch.full((4, 2), 200, dtype=torch.uint8),
     r"zero_point must lie in \[0, 15\].*got 200"),
    ("int4-asym-g32-zpfloat", torch.ones(4, 2), torch.full((4, 2), NAN), "zero_point contains NaN"),
])
def test_static_qparams_are_value_checked(scheme, scale, zp, match):
    with pytest.raises(ValueError, match=match):
        lowbit.quantize(X, scheme, scale, zp)
    with pytest.raises(ValueError, match=match):
        lowbit.ops.fake_quantize(X, scheme, scale, zp)


@pytest.mark.parametrize("scale, zp, match", [
    (torch.tensor([0.0]), None, "act_scale must be finite and > 0"),
    (torch.tensor([NAN]), None, "act_scale must be finite and > 0"),
])
def test_w8a8_act_scale_is_value_checked(scale, zp, match):
    qw = lowbit.quantize(torch.randn(8, 64), "int8-sym")
    with pytest.raises(ValueError, match=match):
        linear(X, qw, act_scheme="int8-sym-tensor", act_scale=scale, act_zero_point=zp)


def test_w8a8_act_zero_point_is_range_checked():
    qw = lowbit.quantize(torch.randn(8, 64), "int8-sym")
    with pytest.raises(TypeError, match="act_zero_point must have dtype"):
        linear(X, qw, act_scheme="int8-asym-tensor", act_scale=torch.tensor([0.1]),
               act_zero_point=torch.tensor([300], dtype=torch.int32))


@pytest.mark.parametrize("index, value, match", [
    (1, torch.zeros(3), "x_scale must be finite and > 0"),
    (7, torch.full((3,), NAN), "out_scale must be finite and > 0"),
    (7, torch.zeros(3), "out_scale must be finite and > 0"),
    (2, torch.full((3,), 2**30, dtype=torch.int32), r"x_zero_point must lie in \[-128, 127\]"),
    (8, torch.full((3,), -200, dtype=torch.int32), r"out_zero_point must lie in \[-128, 127\]"),
    (5, torch.full((8, 2), 16, dtype=torch.uint8), r"w_zero_point must lie in \[0, 15\]"),
    (4, torch.full((8, 2), NAN), "w_scale contains NaN"),
])
def test_qta8o_values_are_checked_on_every_backend(index, value, match):
    args = list(_qta8o_case(3, 8, 64, 32, "random", "random", seed=1))
    args[index] = value
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=match):
            linear_qta8a_qga4w_qta8o(*args, backend=backend)


# -- 6. embeddings ------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["int8-sym", "int4-asym-g32"])
@pytest.mark.parametrize("ids", [[-1], [100], [3, 100, 4]])
def test_embedding_refuses_ids_outside_the_vocabulary_as_a_float_embedding_does(scheme, ids):
    emb = torch.nn.Embedding(100, 64)
    q = QuantEmbedding.from_embedding(emb, scheme, torch.float32)
    with pytest.raises(IndexError):
        emb(torch.tensor(ids))
    with pytest.raises(IndexError, match=r"ids must lie in \[0, 100\)"):
        q(torch.tensor(ids))
    with pytest.raises(TypeError, match="ids must be an int64 or int32 tensor"):
        q(torch.tensor(ids, dtype=torch.float32))
    assert q(torch.tensor([[0, 99]])).shape == (1, 2, 64)


# -- 9. schemes --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, match", [
    ("int4-sym-g32-g64", "'g32' and 'g64' both set the granularity"),
    ("int4-sym-tensor-token", "'tensor' and 'token' both set the granularity"),
    ("int4-sym-channel-g32", "'channel' and 'g32' both set the granularity"),
    ("int4-sym-g32-f16-bf16", "'f16' and 'bf16' both set the scale dtype"),
    ("int4-asym-zpfloat-zpfloat", "both set the zero point domain"),
    ("int4-sym-u8-u32", "both set the packing"),
    ("int8-sym-u8", "8-bit codes are stored one per byte"),
])
def test_contradictory_scheme_parts_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        QuantScheme.parse(text)


def test_an_8_bit_scheme_has_one_form():
    s = QuantScheme(8, True, packing="u8")
    assert s == QuantScheme.parse("int8-sym") and QuantScheme.parse(str(s)) == s


# -- 19, 20. odd K -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_u8_packed_int4_weight_with_k_not_a_multiple_of_8(backend):
    qt = lowbit.quantize(torch.randn(4, 34, generator=gen(3)), "int4-asym-u8")
    x = torch.randn(2, 34, generator=gen(4))
    y = linear(x, qt, backend=backend)
    assert torch.allclose(y, x @ lowbit.dequantize(qt).T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="W4A8 needs in_features a positive multiple of 8"):
        linear(x, qt, act_scheme="int8-asym-token", backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_zero_is_an_empty_sum(backend):
    codes, scale = torch.zeros(4, 0, dtype=torch.int8), torch.ones(4, 0)
    y = lowbit.quantized_matmul(torch.randn(3, 0), codes, scale, bits=8, group_size=1, backend=backend)
    assert torch.equal(y, torch.zeros(3, 4))
    out = torch.full((3, 4), 7.0)
    lowbit.quantized_matmul(torch.randn(3, 0), codes, scale, bits=8, group_size=1, out=out, backend=backend)
    assert torch.equal(out, torch.zeros(3, 4))


# -- 21. meta tensors run as shapes ------------------------------------------------------------
def test_meta_tensors_give_shapes_without_values():
    x = torch.empty(4, 64, device="meta")
    qt = lowbit.quantize(x, "int4-asym-g32")
    assert qt.codes.device.type == "meta" and qt.codes.shape == (4, 8) and qt.scale.shape == (4, 2)
    q, s, z = quantize_per_token(x)
    assert q.shape == (4, 64) and s.shape == (4,) and q.device.type == "meta"
    assert lowbit.ops.pack_int4(torch.empty(4, 64, dtype=torch.uint8, device="meta")).shape == (4, 8)
    assert lowbit.dequantize(qt).shape == (4, 64)
    assert linear(torch.empty(2, 64, device="meta"), qt).shape == (2, 4)


# -- 22. gradients -----------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["int4-asym-g32", "int8-sym", "int2-asym-g32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_linear_has_the_input_gradient_of_the_dequantized_weight(scheme, dtype):
    qt = lowbit.quantize(torch.randn(16, 64, generator=gen(5)), scheme)
    x = torch.randn(3, 64, generator=gen(6)).to(dtype).requires_grad_()
    g = torch.randn(3, 16, generator=gen(7)).to(dtype)
    linear(x, qt).backward(g)
    w = lowbit.dequantize(qt)
    expected = g.float() @ w
    assert x.grad.dtype == dtype
    # float32 sums of N = 16 products (gamma_16 A, A = |g| @ |W|), a bf16 copy of W where
    # the 2-bit path dequantizes to x's dtype first (2^-8 A), one rounding to x's dtype.
    a = g.float().abs() @ w.abs()
    tol = (2 * gamma(16) + 2.0**-8) * a + 2.0**-8 * expected.abs()
    assert bool(((x.grad.float() - expected).abs() <= tol).all())


def test_activation_quantized_linear_refuses_a_gradient_at_call_time():
    qt = lowbit.quantize(torch.randn(16, 64), "int8-sym")
    x = torch.randn(3, 64, requires_grad=True)
    with pytest.raises(ValueError, match="no gradient.*fake_quantize"):
        linear(x, qt, act_scheme="int8-sym-token")
    with torch.no_grad():
        assert linear(x, qt, act_scheme="int8-sym-token").shape == (3, 16)


# -- 23. messages that name the module ----------------------------------------------------------
def test_a_nan_weight_names_its_module():
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Module()])
    m.layers[0].mlp = torch.nn.Module()
    m.layers[0].mlp.up_proj = torch.nn.Linear(64, 8)
    with torch.no_grad():
        m.layers[0].mlp.up_proj.weight[2, 3] = NAN
    with pytest.raises(ValueError, match="'layers.0.mlp.up_proj'.*NaN"):
        lowbit.quantize_model(m, "w8a16", inplace=False)


def test_dequantized_copy_of_a_quantized_embedding():
    m = torch.nn.Module()
    m.embed_tokens = torch.nn.Embedding(50, 64)
    m.embed_tokens_q = QuantEmbedding.from_embedding(m.embed_tokens, "int8-sym", torch.float32)
    out = lowbit.models.dequantized_copy(m)
    assert isinstance(out.embed_tokens_q, torch.nn.Embedding)
    assert torch.equal(out.embed_tokens_q.weight, lowbit.dequantize(m.embed_tokens_q.weight.qtensor()))


def test_weight_parts_still_refuse_a_3d_qtensor():
    with pytest.raises(ValueError, match="2-D"):
        weight_parts(lowbit.quantize(torch.randn(2, 4, 64), "int8-sym"))


def test_w4a8_recipe_on_a_linear_of_odd_in_features_is_refused_before_any_quantization():
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Module()])
    m.layers[0].mlp = torch.nn.Module()
    m.layers[0].mlp.up_proj = torch.nn.Linear(36, 8)   # 36: no whole u32 words of 4-bit codes
    m.layers[0].mlp.down_proj = torch.nn.Linear(64, 8)
    recipe = lowbit.Recipe(weight="int4-asym-channel-u8", activation="int8-asym-token")
    with pytest.raises(ValueError, match="'layers.0.mlp.up_proj'.*multiple of 8.*got 36"):
        lowbit.quantize_model(m, recipe)
    assert type(m.layers[0].mlp.down_proj) is torch.nn.Linear  # nothing was quantized
