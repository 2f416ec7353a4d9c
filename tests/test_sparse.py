"""2:4 sparse quantized weights (lowbit.sparse) and SparseGPT (lowbit.algorithms.sparsegpt)."""

import pytest
import torch
import torch.utils._pytree as pytree

import lowbit
from lowbit.algorithms.sparsegpt import sparsegpt_quantize
from lowbit.sparse import (Sparse24QTensor, SparseQuantLinear, check_mask, compress, densify, prune_2_4,
                           sparse_linear, sparsify)

SCHEMES = ["int8-sym", "int8-asym-g32", "int4-asym-g32-f16", "int4-sym-g16", "int4-asym-g32-zpfloat-bf16"]


def random_mask(n, k, gen=None):
    """A uniformly random 2:4 mask, independent of any weight."""
    order = torch.rand(n, k // 4, 4, generator=gen).argsort(-1)[..., :2]
    return torch.zeros(n, k // 4, 4, dtype=torch.bool).scatter_(-1, order, True).view(n, k)


@pytest.mark.parametrize("n,k", [(1, 8), (3, 64), (17, 256)])
def test_index_pack_unpack_round_trip_is_bit_exact(n, k):
    mask = random_mask(n, k)
    w = torch.rand(n, k) + 1  # in [1, 2): no kept value rounds to 0
    kept, idx = compress(w, mask)
    positions = mask.view(n, k // 4, 4).nonzero()[:, 2].view(n, k // 2)
    sqt = Sparse24QTensor(lowbit.quantize(kept, "int8-sym"), idx, (n, k))
    assert torch.equal(sqt.positions().long(), positions)
    assert torch.equal(densify(sqt) != 0, mask)  # what was packed is where it lands
    assert torch.equal(compress(densify(sqt), mask)[1], idx)


def test_magnitude_mask_is_exactly_2_4_and_keeps_the_largest():
    w = torch.randn(64, 128)
    w[0, :8] = 0.0                    # ties: all-zero groups still keep exactly 2
    w[1, :4] = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = prune_2_4(w)
    check_mask(mask, w.shape)
    a = w.abs().view(64, 32, 4)
    m = mask.view(64, 32, 4)
    kept_min = a.masked_fill(~m, float("inf")).amin(-1)
    pruned_max = a.masked_fill(m, -1.0).amax(-1)
    assert bool((kept_min >= pruned_max).all())
    assert mask[1, :4].tolist() == [True, True, False, False]  # ties go to the lower column


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_mask_is_exactly_2_4(scheme):
    x = torch.randn(256, 64)
    w = torch.randn(16, 64)
    for sqt in (sparsify(w, scheme), sparsify(w, scheme, random_mask(16, 64)),
                sparsegpt_quantize(w, x.T @ x, scheme)):
        pos = sqt.positions().view(16, 16, 2)
        assert bool((pos[..., 0] < pos[..., 1]).all())      # 2 distinct positions per group of 4
        assert bool(((densify(sqt) != 0).view(16, 16, 4).sum(-1) <= 2).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_densify_equals_the_masked_dequantized_weight(scheme, dtype):
    n, k = 24, 128
    w, mask = torch.randn(n, k), random_mask(n, k)
    expected = torch.zeros(n, k, dtype=dtype)
    expected[mask] = lowbit.dequantize(lowbit.quantize(w[mask].view(n, k // 2), scheme), dtype).flatten()
    assert torch.equal(densify(sparsify(w, scheme, mask), dtype), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["int8-sym", "int4-asym-g32-f16"])
def test_sparse_linear_matches_a_float64_sum_over_the_kept_values(scheme, dtype):
    n, k = 40, 192
    sqt = sparsify(torch.randn(n, k), scheme)
    x, bias = torch.randn(2, 3, k).to(dtype), torch.randn(n)
    y = sparse_linear(x, sqt, bias)
    assert y.shape == (2, 3, n) and y.dtype == dtype
    # the kept values only, gathered by their positions, summed in float64
    cols = torch.arange(k // 2) // 2 * 4 + sqt.positions().long()          # [n, k/2]
    v = lowbit.dequantize(sqt.values, torch.float64)
    x64 = x.double()
    exact = (x64[..., cols] * v).sum(-1) + bias.double()
    # float32 dot products of K terms: |error| <= K * 2^-24 * sum |x| |w| (+ bias rounding),
    # then one rounding to dtype: half an ulp of the output
    bound = k * 2.0**-24 * ((x64.abs()[..., cols] * v.abs()).sum(-1) + bias.abs().double())
    ulp = torch.finfo(dtype).eps * exact.abs()
    assert bool(((y.double() - exact).abs() <= bound + ulp / 2 + 1e-30).all())


def test_sparse_quant_linear_is_the_linear_with_the_pruned_weight():
    lin = torch.nn.Linear(64, 16)
    q = SparseQuantLinear.from_linear(lin, "int8-sym")
    x = torch.randn(5, 64)
    assert torch.equal(q(x), sparse_linear(x, q.sqt, lin.bias))
    w = lin.weight.detach() * prune_2_4(lin.weight.detach())
    assert (q(x) - torch.nn.functional.linear(x, w, lin.bias)).abs().max() < 0.02  # int8: |dw| <= max|w| / 255


@pytest.mark.parametrize("scheme", ["int8-sym", "int4-asym-g32-f16", "int4-sym-g16"])
def test_sparsegpt_beats_magnitude_pruning_and_rtn_on_the_layer_output(scheme):
    torch.manual_seed(1)
    k, n = 128, 64
    x = torch.randn(2048, k) @ torch.randn(k, k) / k**0.5 + 0.1 * torch.randn(2048, k)  # correlated inputs
    w = torch.randn(n, k)
    err = lambda v: float((x @ (v - w).T).norm())  # noqa: E731
    sparse_gpt = err(densify(sparsegpt_quantize(w, x.T @ x / len(x), scheme)))
    magnitude = err(densify(sparsify(w, scheme)))
    # measured 0.78-0.79x; without error feedback (a diagonal factor) it is 0.997x
    assert sparse_gpt < 0.9 * magnitude, (sparse_gpt, magnitude)


@pytest.mark.parametrize("scheme", ["int8-sym", "int4-asym-g32-f16"])
def test_sparsegpt_with_an_identity_hessian_is_magnitude_pruning_and_rtn(scheme):
    # no correlation: no error feedback, and the saliency is |w| scaled by a constant
    w = torch.randn(32, 128)
    a, b = sparsegpt_quantize(w, torch.eye(128), scheme), sparsify(w, scheme)
    assert torch.equal(a.indices, b.indices)
    assert torch.equal(densify(a), densify(b))


def test_sparsegpt_zeroes_dead_input_columns():
    x = torch.randn(512, 64)
    x[:, 5] = 0.0
    sqt = sparsegpt_quantize(torch.randn(8, 64), x.T @ x, "int8-sym")
    assert bool((densify(sqt)[:, 5] == 0).all())


def test_pytree_round_trip():
    sqt = sparsify(torch.randn(8, 64), "int4-asym-g32-f16")
    leaves, spec = pytree.tree_flatten(sqt)
    assert [t.dtype for t in leaves] == [torch.int32, torch.float16, torch.uint8, torch.uint8]
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, Sparse24QTensor) and back.shape == sqt.shape
    assert torch.equal(densify(back), densify(sqt))
    doubled = pytree.tree_map(lambda t: t, {"w": sqt})["w"]
    assert torch.equal(doubled.indices, sqt.indices)


W = torch.randn(4, 16)


def _bad_indices():
    sqt = sparsify(W, "int8-sym")
    return Sparse24QTensor(sqt.values, torch.full_like(sqt.indices, 0b0000_1011), sqt.shape)  # positions 3, 2


@pytest.mark.parametrize("call, error, match", [
    (lambda: prune_2_4(W.int()), TypeError, r"w must have dtype in \(float32"),
    (lambda: prune_2_4(torch.randn(4, 6)), ValueError, r"w.shape\[1\]=6 \(in_features\) must be a multiple of 4"),
    (lambda: prune_2_4(torch.randn(16)), ValueError, r"w must be 2-D"),
    (lambda: prune_2_4(W, torch.randn(4, 8)), ValueError, r"scores must have shape \(4, 16\)"),
    (lambda: prune_2_4(torch.tensor([[1.0, float("nan"), 0.0, 0.0]])), ValueError, r"w contains NaN or Inf"),
    (lambda: sparsify(torch.randn(4, 12), "int8-sym"), ValueError, r"multiple of 8"),
    (lambda: sparsify(W.masked_fill(W > 1, float("inf")), "int8-sym"), ValueError, r"w contains NaN or Inf"),
    (lambda: sparsify(W, "int8-sym", torch.ones(4, 16, dtype=torch.bool)), ValueError,
     r"mask must keep exactly 2 of every 4 .* row 0, columns 0..3 keep 4"),
    (lambda: sparsify(W, "int8-sym", torch.ones(4, 16)), TypeError, r"mask must have dtype in \(bool\)"),
    (lambda: sparsify(W, "int8-sym", random_mask(4, 32)), ValueError, r"mask must have shape \(4, 16\)"),
    (lambda: sparsify(W, "int4-asym-g32"), ValueError, r"group_size=32 must divide the 8 kept values"),
    (lambda: sparsify(torch.randn(4, 8), "int4-sym"), ValueError, r"multiple of 8 to pack 4-bit codes"),
    (lambda: sparsify(W, "int9"), ValueError, r"cannot parse scheme 'int9'"),
    (lambda: densify(W), TypeError, r"sqt must be a lowbit.sparse.Sparse24QTensor, got Tensor"),
    (lambda: densify(sparsify(W, "int8-sym"), torch.int8), TypeError, r"dtype must be one of"),
    (lambda: sparse_linear(torch.randn(2, 8), sparsify(W, "int8-sym")), ValueError,
     r"x.shape\[-1\]=8 does not match the weight's in_features=16"),
    (lambda: sparse_linear(torch.randn(2, 16), sparsify(W, "int8-sym"), torch.zeros(5)), ValueError,
     r"bias must have shape \(4,\)"),
    (lambda: sparse_linear(torch.ones(2, 16, dtype=torch.int32), sparsify(W, "int8-sym")), TypeError,
     r"x must have dtype in"),
    (lambda: Sparse24QTensor(lowbit.quantize(torch.randn(4, 8), "int8-sym"), torch.zeros(4, 3, dtype=torch.uint8),
                             (4, 16)), ValueError, r"indices must have shape \(4, 2\)"),
    (lambda: Sparse24QTensor(lowbit.quantize(torch.randn(4, 6), "int8-sym"), torch.zeros(4, 2, dtype=torch.uint8),
                             (4, 16)), ValueError, r"values must have shape \(4, 8\)"),
    (lambda: Sparse24QTensor(W, torch.zeros(4, 2, dtype=torch.uint8), (4, 16)), TypeError,
     r"values must be a lowbit.QTensor, got Tensor"),
    (_bad_indices, ValueError, r"two increasing positions per group of 4; row 0, group 0 .*\[3, 2\]"),
    (lambda: sparsegpt_quantize(W, torch.eye(8), "int8-sym"), ValueError, r"h \(the Hessian\) must be \[16, 16\]"),
    (lambda: sparsegpt_quantize(W, torch.eye(16), "int8-sym-token"), ValueError, r"per channel or per group"),
    (lambda: sparsegpt_quantize(W, torch.eye(16), "int8-sym", damp=2.0), ValueError, r"damp must be a fraction"),
    (lambda: sparsegpt_quantize(torch.randn(4, 12), torch.eye(12), "int8-sym"), ValueError, r"multiple of 8"),
])
def test_bad_inputs_raise_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.slow
def test_bundled_model_layer_runs_sparse():
    model, tok = lowbit.load_model()
    lin = model.model.layers[0].mlp.down_proj
    q = SparseQuantLinear.from_linear(lin, "int4-asym-g32-f16")
    x = torch.randn(3, lin.in_features)
    dense = x @ (lin.weight.detach() * prune_2_4(lin.weight.detach())).T
    assert (q(x) - dense).norm() < 0.2 * dense.norm()


def test_sparse_module_holds_its_weight_as_buffers():
    lin = torch.nn.Linear(64, 16)
    q = SparseQuantLinear.from_linear(lin, "int4-asym-g32-f16")
    assert sorted(q.state_dict()) == ["bias", "codes", "indices", "scale", "zero_point"]
    other = SparseQuantLinear.from_linear(torch.nn.Linear(64, 16), "int4-asym-g32-f16")
    other.load_state_dict(q.state_dict())
    x = torch.randn(2, 64)
    assert torch.equal(other(x), q(x))  # the rebuilt tensor follows the loaded buffers
