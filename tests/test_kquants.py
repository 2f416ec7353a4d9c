"""lowbit.formats.kquants: K-quant bytes that ggml's readers agree on, the nearest code for
every value under its sub-block's stored scale and min, less error than the simple ggml
types of as many bits, finite output on the blocks that break quantizers, refusals
before any work, and an importance that lowers the error it weights."""

import numpy as np
import pytest
import torch

from lowbit.formats import ggml, kquants

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

NAMES = list(kquants.TYPES)
# Byte ranges of each type's codes (ggml's layout, as the module docstring lists it):
# all zero bits there read as the lowest code q = qmin, all one bits as the highest, qmax.
CODE_BYTES = {"Q2_K": (16, 80), "Q3_K": (0, 96), "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}
EPS = float(torch.finfo(torch.float32).eps)


def weights(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows of random scale, a few columns of 5x outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
    x[:, ::37] *= 5
    return x


def odd_weights(k: int = 512) -> torch.Tensor:
    """One row per block that breaks quantizers first (each row's first 256 values; the rest
    Gaussian)."""
    x = weights(10, k, seed=1)
    x[0, :256] = 0                                  # all zero
    x[1, :256] = 0.75                               # constant > 0: min clamps to 0
    x[2, :256] = -0.75                              # constant < 0: zero span
    x[3, :256] = 1e-30                              # below float16's resolution: sub-scales 0
    x[4, :256] = torch.randn(256, generator=torch.Generator().manual_seed(9)) * 1e-5  # float16 subnormal d
    x[5, :256] = torch.linspace(-6e4, 6e4, 256)     # near float16's largest
    x[6, 100] = 1e4                                 # one huge outlier in a Gaussian block
    x[7, :256] = torch.where(torch.arange(256) % 2 == 0, 1.0, -1.0)  # ties at the largest magnitude
    x[8, :16] = 1e30                                # beyond what any float16 d reaches: clipped
    x[9, :128] = 3.0                                # half constant (sub-blocks sharing d with Gaussians)
    return x


def grid_ends(raw: torch.Tensor, name: str, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value, the reconstructions of the lowest and the highest code of its sub-block:
    the same bytes with every code set to qmin, then to qmax, read by ggml.dequantize."""
    t = ggml.block_type(name)
    lo, hi = CODE_BYTES[name]
    ends = []
    for fill in (0x00, 0xFF):
        blocks = raw.reshape(-1, t.type_size).clone()
        blocks[:, lo:hi] = fill
        ends.append(ggml.dequantize(blocks.reshape(-1), name, shape))
    return torch.minimum(*ends), torch.maximum(*ends)


def beyond_nearest_code(x: torch.Tensor, raw: torch.Tensor, name: str) -> torch.Tensor:
    """How far each value's error exceeds that of the nearest code of its sub-block's stored
    grid [lo, hi]: step / 2 inside it, the distance to the nearer end outside it, step =
    (hi - lo) / (qmax - qmin); plus a few float32 roundings (the quantizer's (x + mq) / sq,
    ggml's d * sc * q - dmin * m) of magnitude |x| + |lo| + |hi|.  <= 0 everywhere when every
    value got its nearest code."""
    t = kquants.TYPES[name]
    deq = ggml.dequantize(raw, name, x.shape)
    lo, hi = grid_ends(raw, name, x.shape)
    step = (hi - lo) / (t.qmax - t.qmin)
    outside = (lo - x).clamp(min=0) + (x - hi).clamp(min=0)
    tol = 4 * EPS * (x.abs() + lo.abs() + hi.abs())
    return (x - deq).abs() - (step / 2 + outside + tol)


def rel_rms(x: torch.Tensor, name: str, quantize) -> float:
    return float((ggml.dequantize(quantize(x, name), name, x.shape) - x).norm() / x.norm())


@pytest.mark.parametrize("name", NAMES)
def test_bytes_have_ggmls_layout_and_gguf_reads_them_as_lowbit_does(name):
    t = ggml.block_type(name)
    x = torch.cat([weights(6, 512), odd_weights()])
    raw = kquants.quantize(x, name)
    assert raw.dtype == torch.uint8 and raw.shape == (16, 512 // 256 * t.type_size)
    ours = ggml.dequantize(raw, name, x.shape, backend="reference")
    theirs = gguf_dequantize(raw.numpy(), gguf.GGMLQuantizationType[name]).reshape(x.shape)
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))
    assert torch.isfinite(ours).all()
    # leading dims are kept; a row's bytes do not depend on the rows beside it
    batched = kquants.quantize(x[:6].reshape(2, 3, 512), name)
    assert batched.shape == (2, 3, 2 * t.type_size) and torch.equal(batched.reshape(6, -1), raw[:6])


@pytest.mark.parametrize("name", NAMES)
def test_each_value_gets_the_nearest_code_of_its_sub_blocks_stored_grid(name):
    """Step 4 rounds every value to the nearest code under the *stored* (quantized) scale
    and min, so |x - xhat| <= step / 2 inside its sub-block's grid and the distance to the
    nearer end outside it (the values the least-squares fit chose to clip, and anything
    beyond float16's reach): ``beyond_nearest_code`` <= 0."""
    x = torch.cat([weights(32, 512, seed=2), odd_weights()])
    excess = beyond_nearest_code(x, kquants.quantize(x, name), name)
    assert excess.max() <= 0, f"value {excess.argmax().item()} is {excess.max().item()} past its bound"


@pytest.mark.parametrize("name, simple", [("Q4_K", "Q4_0"), ("Q4_K", "Q4_1"), ("Q5_K", "Q5_0"),
                                          ("Q5_K", "Q5_1"), ("Q6_K", "Q5_1")])
def test_rms_error_is_below_the_simple_types_of_as_many_bits(name, simple):
    """Q4_K (4.5 bits/value) against Q4_0 (4.5) and Q4_1 (5), Q5_K (5.5) against Q5_0 (5.5)
    and Q5_1 (6), Q6_K (6.56) against Q5_1.  Q4_1/Q5_1 store the min/max grid of each 32
    values; the search's first candidate is that grid with scale and min refitted to its
    codes (never worse), so only the 6-bit rounding of the sub-scales can put a K-type
    behind, and on Gaussian data it costs less than the fit gains.  Q4_0/Q5_0 are
    symmetric (no min) on the same blocks: worse still.  Q6_K has one more code bit."""
    x = weights(64, 512, seed=3)
    assert rel_rms(x, name, kquants.quantize) < rel_rms(x, simple, ggml.quantize)


def test_rms_error_falls_with_every_bit():
    """One more code bit about halves the step: Q2_K > Q3_K > Q4_K > Q5_K > Q6_K, each at
    least 1.4x the next (Q3_K -> Q4_K: the symmetric 16-value blocks of Q3_K against the
    min of Q4_K's 32-value blocks, the smallest gain)."""
    x = weights(64, 512, seed=4)
    errors = [rel_rms(x, name, kquants.quantize) for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")]
    assert all(a > 1.4 * b for a, b in zip(errors, errors[1:])), errors


@pytest.mark.parametrize("name", NAMES)
def test_odd_blocks_stay_finite_and_close(name):
    """Zeros and constants come back within float16's rounding of d (rounded up: relative
    2^-10); values below float16's resolution come back as zeros; values beyond the type's
    reach come back clipped to ``KQuant.limit``; everything finite."""
    t = kquants.TYPES[name]
    x = odd_weights()
    deq = ggml.dequantize(kquants.quantize(x, name), name, x.shape)
    assert torch.isfinite(deq).all()
    assert torch.equal(deq[0, :256], torch.zeros(256))
    for row, c in ((1, 0.75), (2, -0.75)):
        assert (deq[row, :256] - c).abs().max() <= abs(c) * 2 ** -10, (row, deq[row, :256])
    assert (deq[3, :256] - x[3, :256]).abs().max() <= 1e-30
    assert deq[8, :16].abs().max() <= t.limit


def test_values_beyond_a_types_reach_are_clipped_not_infinite():
    x = torch.full((1, 256), 1e30)
    x[0, ::2] = -1e30
    for name, t in kquants.TYPES.items():
        deq = ggml.dequantize(kquants.quantize(x, name), name, x.shape)
        assert torch.isfinite(deq).all() and deq.abs().max() <= t.limit


BAD = [
    (dict(x=torch.zeros(2, 200)), ValueError, "x's last dim"),
    (dict(x=torch.zeros(())), ValueError, "x must have at least 1"),
    (dict(x=torch.tensor([float("nan")] + [0.0] * 255)), ValueError, "x contains NaN or Inf"),
    (dict(x=torch.tensor([float("inf")] + [0.0] * 255)), ValueError, "x contains NaN or Inf"),
    (dict(name="Q7_K"), ValueError, "name must be a K-quant type"),
    (dict(name="Q4_0"), ValueError, "name must be a K-quant type"),
    (dict(importance=torch.ones(257)), ValueError, "importance must have shape"),
    (dict(importance=torch.ones(1, 256)), ValueError, "importance must have shape"),
    (dict(importance=-torch.ones(256)), ValueError, "importance must be >= 0"),
    (dict(importance=torch.full((256,), float("nan"))), ValueError, "importance contains NaN"),
    (dict(x=torch.zeros(2, 256, dtype=torch.int32)), TypeError, "x must have dtype"),
    (dict(importance=torch.ones(256, dtype=torch.int64)), TypeError, "importance must have dtype"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_is_refused_naming_the_argument(kwargs, error, message):
    args = dict(x=torch.zeros(2, 256), name="Q4_K", importance=None) | kwargs
    with pytest.raises(error, match=message):
        kquants.quantize(args["x"], args["name"], importance=args["importance"])


@pytest.mark.parametrize("name", NAMES)
def test_importance_lowers_the_error_it_weights(name):
    """Column weights spread over four decades: the search minimizes sum w (x - xhat)^2
    when given w, the plain squared error without, so the weighted error must drop
    (by a fifth at least: the weights vary within every sub-block, so each fit can trade
    the cheap columns for the dear ones)."""
    x = weights(32, 512, seed=5)
    imp = 10 ** (torch.rand(512, generator=torch.Generator().manual_seed(6)) * 4 - 2)

    def weighted(raw):
        return float(((ggml.dequantize(raw, name, x.shape) - x) ** 2 * imp).sum())

    assert weighted(kquants.quantize(x, name, importance=imp)) < 0.8 * weighted(kquants.quantize(x, name))


@pytest.mark.parametrize("name", NAMES)
def test_extreme_importance_keeps_every_value_on_its_nearest_code(name):
    """Zero weights (whole sub-blocks and single columns) and weights 30 decades apart leave
    no fit to some sub-blocks and ill-conditioned ones to others: still finite bytes and
    the nearest code for every value."""
    x = torch.cat([weights(8, 512, seed=8), odd_weights()])
    imp = torch.ones(512)
    imp[:64] = 0
    imp[100::7] = 0
    imp[300:400] = 1e-30
    raw = kquants.quantize(x, name, importance=imp)
    assert torch.isfinite(ggml.dequantize(raw, name, x.shape)).all()
    assert beyond_nearest_code(x, raw, name).max() <= 0


@pytest.mark.parametrize("name", NAMES)
def test_uniform_importance_of_any_size_gives_the_bytes_of_none(name):
    """The search is scale-free in the weights (they are divided by their max), and weights
    of 1 are the unweighted search."""
    x = weights(8, 512, seed=7)
    raw = kquants.quantize(x, name)
    for c in (1.0, 3.0, 1e-20, 1e20):
        assert torch.equal(kquants.quantize(x, name, importance=torch.full((512,), c)), raw)


def test_every_type_follows_ggmls_block_rules():
    """The K-quant table agrees with ggml's: 256-value super-blocks of whole sub-blocks, and
    codes and sub-scales that fit the bits the layout gives them."""
    bits = {"Q2_K": (2, 4), "Q3_K": (3, 6), "Q4_K": (4, 6), "Q5_K": (5, 6), "Q6_K": (6, 8)}
    assert set(kquants.TYPES) == set(bits)
    for name, t in kquants.TYPES.items():
        code_bits, scale_bits = bits[name]
        assert ggml.block_type(name).block_size == t.n_sub * t.sub == 256
        assert t.qmax - t.qmin == 2 ** code_bits - 1
        assert t.smax - t.smin == 2 ** scale_bits - 1 or (t.has_min and t.smax == 2 ** scale_bits - 1)


@pytest.mark.parametrize("name", list(kquants.TYPES))
def test_from_parts_gives_back_the_quantizers_bytes(name):
    """Blocks read into their parts (what a native GGUF load keeps) and written back:
    the same bytes, except super-blocks whose sub-scales are all 0 (their d is lost;
    their values, zeros, are not)."""
    x = odd_weights()
    raw = kquants.quantize(x, name)
    blocks = raw.reshape(-1, ggml.block_type(name).type_size)
    scale, low, q = ggml._K_PARTS[name](blocks)
    back = kquants.from_parts(name, scale, low, q)
    settled = (scale != 0).any(-1)
    assert torch.equal(back[settled], blocks[settled]) and settled.float().mean() > 0.8
    n = blocks.shape[0] * ggml.QK_K
    assert torch.equal(ggml.dequantize(back, name, [n]), ggml.dequantize(blocks, name, [n]))


@pytest.mark.parametrize("name", list(kquants.TYPES))
def test_from_parts_keeps_every_bit_of_random_blocks(name):
    """Random bytes (finite scales): one of the float16 d's that reproduce every product
    d * sc bit for bit, signed zeros included; the bytes may differ where several do."""
    raw = torch.randint(0, 256, (400, ggml.block_type(name).type_size), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(5))
    scale, low, q = ggml._K_PARTS[name](raw)
    finite = scale.isfinite().all(-1) & (True if low is None else low.isfinite().all(-1))
    raw = raw[finite]
    back = kquants.from_parts(name, *ggml._K_PARTS[name](raw))
    n = raw.shape[0] * ggml.QK_K
    assert torch.equal(ggml.dequantize(back, name, [n]).view(torch.int32), ggml.dequantize(raw, name, [n]).view(torch.int32))


def test_from_parts_refuses_what_no_k_quant_holds():
    scale, low = torch.full((1, 8), 0.1), torch.zeros(1, 8)
    assert kquants.from_parts("Q4_K", scale, low, torch.full((1, 8, 32), 16)) is None  # a code past 15
    odd = torch.tensor([[0.1, 0.1 / 3, 0, 0, 0, 0, 0, 0]])  # no float16 d makes both d * integer
    assert kquants.from_parts("Q4_K", odd, low, torch.zeros(1, 8, 32)) is None
    with pytest.raises(ValueError, match="Q6_K takes no min"):
        kquants.from_parts("Q6_K", scale, low, torch.zeros(1, 8, 32))
