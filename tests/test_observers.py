"""Observers: activation ranges on known data, qparams by lowbit's own rule, and the
MSE clip search never worse than round-to-nearest (and better where clipping pays)."""

import pytest
import torch

import lowbit
from lowbit import QuantScheme
from lowbit.algorithms.observers import (
    ACTIVATION_OBSERVERS, MinMax, MovingAverageMinMax, Percentile, activation_observer, clipped_qparams,
    mse_clip_qparams, weight_qparams)
from lowbit.kernels import reference
from lowbit.ops import choose_qparams

from .conftest import gen

OBSERVERS = [MinMax, MovingAverageMinMax, Percentile]
TENSOR_SCHEMES = ["int8-sym-tensor", "int8-asym-tensor", "int8-asym-tensor-zpfloat", "int8-sym-tensor-bf16",
                  "int4-asym-tensor", "int3-sym-tensor-f16"]
WEIGHT_SCHEMES = ["int4-asym-g32", "int4-sym-g64", "int3-asym-g64", "int8-sym"]


def student_t(shape, df: int, seed: int) -> torch.Tensor:
    """Heavy-tailed weights: z / sqrt(chi2_df / df), from one seeded generator."""
    g = gen(seed)
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn((df, *shape), generator=g).square().sum(0)
    return z / (chi2 / df).sqrt()


WEIGHTS = {"gaussian": lambda: torch.randn(128, 1024, generator=gen(1)),
           "student_t3": lambda: student_t((128, 1024), 3, seed=2)}


def sq_error(w, s, qparams, x_sq=None) -> float:
    """sum((w - dequantize(quantize(w)))^2 * x_sq) through lowbit's public operators."""
    e = (lowbit.dequantize(lowbit.quantize(w, s, *qparams)) - w).square()
    return float((e if x_sq is None else e * x_sq).double().sum())


# -- activation observers: ranges ----------------------------------------------------------------
def test_minmax_range_is_the_min_and_max_over_all_batches():
    batches = [torch.randn(4, 16, generator=gen(i)) * (i + 1) for i in range(3)]
    obs = MinMax()
    for b in batches:
        obs.update(b)
    both = torch.cat([b.reshape(-1) for b in batches])
    assert obs.range() == (both.min().item(), both.max().item())
    a = both.abs().max().item()
    assert obs.range(symmetric=True) == (-a, a)
    for s in ("int8-asym-tensor", "int8-sym-tensor"):  # static qparams of all batches = dynamic ones of the lot
        scale, zp = obs.qparams(s)
        want_scale, want_zp = choose_qparams(both, s)
        assert torch.equal(scale, want_scale) and (zp is None) == (want_zp is None)
        assert zp is None or torch.equal(zp, want_zp)


def test_minmax_accepts_half_precision_and_empty_batches():
    obs = MinMax()
    obs.update(torch.tensor([[-0.5, 2.0]], dtype=torch.bfloat16))
    obs.update(torch.empty(0, 8))  # no values: nothing changes
    obs.update(torch.tensor([1.0, -4.0], dtype=torch.float16))
    assert obs.range() == (-4.0, 2.0) and obs.batches == 2


def test_ema_follows_its_formula_on_two_batches():
    obs = MovingAverageMinMax(momentum=0.9)
    obs.update(torch.tensor([-2.0, 0.0, 4.0]))
    assert obs.range() == (-2.0, 4.0)  # the first batch initializes
    obs.update(torch.tensor([[-12.0, 1.0], [3.0, 14.0]]))
    lo, hi = obs.range()
    assert lo == pytest.approx(0.9 * -2.0 + 0.1 * -12.0, rel=1e-12)  # -3.0
    assert hi == pytest.approx(0.9 * 4.0 + 0.1 * 14.0, rel=1e-12)  # 5.0
    assert obs.range(symmetric=True) == pytest.approx((-5.0, 5.0), rel=1e-12)


@pytest.mark.parametrize("q", [99.99, 99.0, 90.0])
def test_percentile_on_one_batch_is_torch_quantile(q):
    x = student_t((64, 512), 3, seed=3)
    obs = Percentile(q=q)
    obs.update(x)
    flat = x.reshape(-1).double()
    lo, hi = obs.range()
    # kthvalue finds the same order statistics as torch.quantile's sort; only the
    # interpolation's rounding differs (float32 ranks there): relative 1e-5 covers it.
    assert lo == pytest.approx(torch.quantile(flat, (100 - q) / 100).item(), rel=1e-5)
    assert hi == pytest.approx(torch.quantile(flat, q / 100).item(), rel=1e-5)
    a = torch.quantile(flat.abs(), q / 100).item()
    assert obs.range(symmetric=True) == pytest.approx((-a, a), rel=1e-5)
    assert hi < x.max().item() and lo > x.min().item()  # the outliers are clipped


def test_percentile_averages_the_batches_weighted_by_their_size():
    small, large = torch.arange(0.0, 11.0), torch.arange(100.0, 131.0)  # 11 and 31 values
    obs = Percentile(q=90.0)
    obs.update(small)
    obs.update(large)
    hi_small, hi_large = 9.0, 127.0  # positions 0.9 * 10 and 0.9 * 30, exact
    assert obs.range()[1] == pytest.approx((11 * hi_small + 31 * hi_large) / 42, rel=1e-12)


def test_percentile_takes_a_batch_above_torch_quantiles_16M_limit():
    n = (1 << 24) + 1001
    x = torch.randperm(n, generator=gen(4)).double()  # 0 .. n - 1 in some order
    obs = Percentile(q=99.99)
    obs.update(x)
    lo, hi = obs.range()
    assert lo == pytest.approx(0.0001 * (n - 1), rel=1e-9)
    assert hi == pytest.approx(0.9999 * (n - 1), rel=1e-9)


# -- activation observers: qparams -----------------------------------------------------------------
@pytest.mark.parametrize("scheme", TENSOR_SCHEMES)
@pytest.mark.parametrize("kind", sorted(ACTIVATION_OBSERVERS))
def test_qparams_are_choose_qparams_of_a_tensor_with_that_min_and_max(kind, scheme):
    s = QuantScheme.parse(scheme)
    obs = activation_observer(kind)
    for i in range(3):
        obs.update(student_t((32, 256), 3, seed=10 + i) + 0.5 * i)  # drifting, asymmetric batches
    lo, hi = obs.range(symmetric=s.symmetric)
    t = lo + (hi - lo) * torch.rand(4, 64, generator=gen(5))
    t[0, 0], t[-1, -1] = lo, hi  # float32 rounding: the min and max the observer's tensor holds
    scale, zp = obs.qparams(s)
    want_scale, want_zp = choose_qparams(t, s)
    assert scale.shape == (1,) and scale.dtype == s.scale_dtype
    assert torch.equal(scale, want_scale)
    assert (zp is None) == s.symmetric and (zp is None or torch.equal(zp, want_zp))
    lowbit.quantize(torch.randn(2, 64), s, scale, zp)  # static qparams a quantize accepts


def test_qparams_before_any_update_raise():
    for cls in OBSERVERS:
        with pytest.raises(RuntimeError, match="observed no activations"):
            cls().qparams("int8-sym-tensor")
        with pytest.raises(RuntimeError, match="observed no activations"):
            cls().range()


def test_qparams_need_a_per_tensor_scheme():
    obs = MinMax()
    obs.update(torch.randn(8))
    with pytest.raises(ValueError, match="per-tensor scheme.*'int8-sym-token'"):
        obs.qparams("int8-sym-token")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("cls", OBSERVERS)
def test_non_finite_activations_are_refused_naming_the_observer(cls, bad):
    obs = cls()
    obs.update(torch.randn(16))
    x = torch.randn(4, 8)
    x[2, 3] = bad
    with pytest.raises(ValueError, match=rf"activations hold NaN or Inf .*{cls.__name__}\("):
        obs.update(x)
    assert obs.batches == 1  # the bad batch left no trace


def test_factory_makes_each_observer_and_refuses_unknown_names():
    assert isinstance(activation_observer("minmax"), MinMax)
    assert activation_observer("ema", momentum=0.5).momentum == 0.5
    assert activation_observer("percentile", q=99.0).q == 99.0
    with pytest.raises(ValueError, match=r"unknown activation observer 'mse'; expected one of "
                                         r"\['ema', 'minmax', 'percentile'\]"):
        activation_observer("mse")
    with pytest.raises(ValueError, match="momentum"):
        activation_observer("ema", momentum=1.5)
    with pytest.raises(ValueError, match="q"):
        Percentile(q=40)


# -- weight clip search -------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES + ["int4-asym-g32-zpfloat-f16", "int4-sym-g64-bf16",
                                                     "int2-asym-g64"])
@pytest.mark.parametrize("ratio", [1.0, 0.8137, 0.5, 0.3])
def test_clipped_qparams_are_choose_qparams_of_the_scaled_weight(scheme, ratio):
    w = student_t((16, 128), 3, seed=6)
    scale, zp = clipped_qparams(w, scheme, ratio)
    want_scale, want_zp = choose_qparams(w * ratio, scheme)  # min(w * r) = min(w) * r: rounding is monotone
    assert torch.equal(scale, want_scale)
    assert (zp is None and want_zp is None) or torch.equal(zp, want_zp)


@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
@pytest.mark.parametrize("dist", sorted(WEIGHTS))
def test_mse_clip_is_never_worse_than_round_to_nearest(scheme, dist):
    w = WEIGHTS[dist]()
    rtn = sq_error(w, scheme, choose_qparams(w, scheme))
    assert sq_error(w, scheme, mse_clip_qparams(w, scheme)) <= rtn
    x_sq = torch.rand(w.shape[1], generator=gen(7)) ** 4  # uneven channel energies
    weighted = mse_clip_qparams(w, scheme, x_sq=x_sq)
    assert sq_error(w, scheme, weighted, x_sq) <= sq_error(w, scheme, choose_qparams(w, scheme), x_sq)


# Measured ratios mse_clip / RTN of the squared weight error on WEIGHTS["student_t3"]
# (128 x 1024, defaults grid=20, min_ratio=0.5): int4-asym-g32 0.957, int4-sym-g64 0.873,
# int3-asym-g64 0.853 (other seeds within 0.01).  Asserted: about half of each gain.
@pytest.mark.parametrize("scheme, max_ratio", [("int4-asym-g32", 0.98), ("int4-sym-g64", 0.94),
                                               ("int3-asym-g64", 0.93)])
def test_mse_clip_beats_round_to_nearest_on_heavy_tailed_weights(scheme, max_ratio):
    w = WEIGHTS["student_t3"]()
    ratio = sq_error(w, scheme, mse_clip_qparams(w, scheme)) / sq_error(w, scheme, choose_qparams(w, scheme))
    assert ratio <= max_ratio


@pytest.mark.parametrize("scheme", ["int4-asym-g32", "int4-sym-g64", "int3-asym-g64-bf16"])
def test_mse_clip_picks_each_blocks_best_ratio_on_the_grid(scheme):
    """The vectorized search against a plain loop over the grid with lowbit's public
    quantize/dequantize: per block, the chosen error is the least over the ratios."""
    s = QuantScheme.parse(scheme)
    w, x_sq = student_t((8, 256), 3, seed=8), torch.rand(256, generator=gen(9)) * 3
    per_ratio = []
    for r in torch.linspace(0.6, 1.0, 9).tolist():
        e = (lowbit.dequantize(lowbit.quantize(w, s, *clipped_qparams(w, s, r))) - w).square() * x_sq
        per_ratio.append(reference.to_blocks(e, s).double().sum(1))
    best = torch.stack(per_ratio).min(0).values
    chosen = mse_clip_qparams(w, s, grid=9, min_ratio=0.6, x_sq=x_sq)
    e = (lowbit.dequantize(lowbit.quantize(w, s, *chosen)) - w).square() * x_sq
    torch.testing.assert_close(reference.to_blocks(e, s).double().sum(1), best, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scheme", ["int4-asym-g32", "int4-sym-g64", "int3-asym-channel"])
def test_h_blocks_pick_each_blocks_best_output_error_on_correlated_inputs(scheme):
    """With h_blocks the error of a block is the layer output's: against a plain loop over
    the grid measuring ||X_b dw_b||^2 on the inputs themselves, per row and group."""
    s = QuantScheme.parse(scheme)
    k = 128
    x = torch.randn(512, k, generator=gen(20)) @ (torch.randn(k, k, generator=gen(21)) / k**0.5)
    w = student_t((8, k), 3, seed=22)
    g = s.block_len(w.shape)
    h = x.T.double() @ x.double()
    blocks = torch.stack([h[i:i + g, i:i + g] for i in range(0, k, g)])

    def out_err(qp):  # [rows * groups]
        d = (lowbit.dequantize(lowbit.quantize(w, s, *qp)) - w).double()
        return torch.stack([(x[:, i:i + g].double() @ d[:, i:i + g].T).square().sum(0)
                            for i in range(0, k, g)], 1).reshape(-1)

    best = torch.stack([out_err(clipped_qparams(w, s, r)) for r in torch.linspace(0.6, 1.0, 9).tolist()]).min(0)
    chosen = mse_clip_qparams(w, s, grid=9, min_ratio=0.6, h_blocks=blocks.float())
    torch.testing.assert_close(out_err(chosen), best.values, rtol=1e-4, atol=0)
    # the diagonal alone (x_sq) ignores the correlations: it loses on the output error
    diag = mse_clip_qparams(w, s, grid=9, min_ratio=0.6, x_sq=h.diagonal().float())
    assert float(out_err(diag).sum()) > float(out_err(chosen).sum())


@pytest.mark.parametrize("scheme", ["int4-sym", "int4-sym-g32", "int4-asym-g32", "int3-asym-g64"])
def test_x_sq_weighting_changes_the_choice_when_one_input_channel_dominates(scheme):
    """Gaussian rows whose extreme value sits in input channel 0.  Weight error alone
    clips the range (a finer grid for the many values inside it); when channel 0 carries
    nearly all the input energy, its error decides, and clipping it costs more."""
    s = QuantScheme.parse(scheme)
    w = torch.randn(32, 128, generator=gen(11))
    sign = torch.where(torch.arange(32) % 2 == 0, 1.0, -1.0)
    w[:, 0] = sign * 1.1 * w[:, 1:].abs().amax(1)
    x_sq = torch.ones(128)
    x_sq[0] = 1e4
    rtn_scale = choose_qparams(w, s)[0].reshape(32, -1)[:, 0]  # the blocks that hold channel 0
    plain, weighted = mse_clip_qparams(w, s), mse_clip_qparams(w, s, x_sq=x_sq)
    plain_scale, weighted_scale = plain[0].reshape(32, -1)[:, 0], weighted[0].reshape(32, -1)[:, 0]
    assert (plain_scale < rtn_scale).float().mean() >= 0.5  # clipped without x_sq ...
    assert (weighted_scale != plain_scale).float().mean() >= 0.5  # ... a different choice with it
    if s.symmetric:
        # A positive extreme is code 7.5 -> 7 at ratio 1, further off at any clip: no clip.
        # (A negative one is code -8 exactly at ratio 7.5 / 8, so a clip may serve it best.)
        assert torch.equal(weighted_scale[sign > 0], rtn_scale[sign > 0])
    # each is the better choice under its own measure
    assert sq_error(w, s, weighted, x_sq) < sq_error(w, s, plain, x_sq)
    assert sq_error(w, s, plain) < sq_error(w, s, weighted)


@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES + ["int4-asym-g32-zpfloat-f16", "int4-sym-g64-bf16"])
def test_mse_clip_returns_what_quantize_takes_and_is_deterministic(scheme):
    s = QuantScheme.parse(scheme)
    w = student_t((32, 128), 3, seed=12).to(torch.bfloat16)
    scale, zp = mse_clip_qparams(w, s)
    assert scale.dtype == s.scale_dtype and list(scale.shape) == s.scale_shape(w.shape)
    assert (zp is None) == s.symmetric
    assert zp is None or (zp.dtype == s.zero_point_dtype and zp.shape == scale.shape)
    lowbit.quantize(w, s, scale, zp)  # its checks accept them
    again = mse_clip_qparams(w, s)
    assert torch.equal(scale, again[0]) and (zp is None or torch.equal(zp, again[1]))
    only_one = mse_clip_qparams(w, s, grid=1)  # the grid {1}: round to nearest exactly
    rtn = choose_qparams(w, s)
    assert torch.equal(only_one[0], rtn[0]) and (zp is None or torch.equal(only_one[1], rtn[1]))


def test_weight_qparams_dispatches_by_observer_name():
    w, x_sq = student_t((16, 64), 3, seed=13), torch.rand(64, generator=gen(14))
    for got, want in [(weight_qparams(w, "int4-asym-g32"), choose_qparams(w, "int4-asym-g32")),
                      (weight_qparams(w, "int4-asym-g32", "mse", x_sq),
                       mse_clip_qparams(w, "int4-asym-g32", x_sq=x_sq))]:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match=r"unknown weight observer 'gptq'; expected one of \['minmax', 'mse'\]"):
        weight_qparams(w, "int4-asym-g32", "gptq")


@pytest.mark.parametrize("kw, match", [
    ({"grid": 0}, "grid must be an int >= 1"),
    ({"min_ratio": 0.0}, r"min_ratio must be a number in \(0, 1\]"),
    ({"norm": -1.0}, "norm must be a finite number > 0"),
    ({"x_sq": torch.ones(32)}, r"x_sq must have shape \(64,\)"),
    ({"x_sq": -torch.ones(64)}, "x_sq must be finite and >= 0"),
    ({"h_blocks": torch.ones(2, 16, 16)}, r"h_blocks must have shape \(2, 32, 32\)"),
    ({"h_blocks": torch.ones(2, 32, 32), "norm": 3.0}, "h_blocks weighs the error .* with norm 2"),
    ({"h_blocks": torch.full((2, 32, 32), float("inf"))}, "h_blocks must be finite"),
])
def test_mse_clip_refuses_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        mse_clip_qparams(torch.randn(4, 64), "int4-asym-g32", **kw)


def test_mse_clip_refuses_bad_weights():
    with pytest.raises(ValueError, match="w must be 2-D"):
        mse_clip_qparams(torch.randn(2, 4, 64), "int4-asym-g32")
    with pytest.raises(ValueError, match="group_size=32 .* does not divide w.shape"):
        mse_clip_qparams(torch.randn(4, 48), "int4-asym-g32")
    w = torch.randn(4, 64)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="w contains NaN or Inf"):
        mse_clip_qparams(w, "int4-asym-g32")
