"""Activations quantized to int8 in blocks along K (``act_scheme="int8-sym-g32"``, llama.cpp's
Q8_0 activations) with weight-only weights: every backend against the reference."""

import pytest
import torch

import lowbit
from lowbit.kernels import cpu, get_backend
from lowbit.kernels import reference as ref
from lowbit.ops import linear
from lowbit.scheme import QuantScheme, check_act_weight

from .conftest import FAST_BACKENDS, skip_large_for_interpreter
from .test_matmul import UNIT, abs_products, gamma

ACT = "int8-sym-g32"
SCHEMES = ["int4-sym-g32-f16", "int4-asym-g64", "int4-asym-g32-zpfloat-f16", "int4-sym-g128-bf16",
           "int4-asym-channel", "int8-sym", "int8-sym-g32-f16", "int8-asym-g64", "int4-asym-g32-zpmin-f16",
           "int8-asym-g64-zpmin"]


def fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """x quantized and dequantized in the activation blocks, by the reference (float32)."""
    return ref.int8_blocks(x, QuantScheme.parse(ACT).group_size)


def a8_tolerance(x, qt, y_ref):
    """Both sides sum the same K products (xq * d) * ((q - z) * s) of the dequantized blocks
    and weight, in different groupings: the reference rounds each factor and sums float32
    products; the kernels sum exact integer dot products per block, then round once per
    block (d * dot), once per group (s * sum) and in the zero-point term.  No value passes
    through more than 2K + 16 float32 roundings on either side, so each side is within
    gamma_{2K+16} * A of the exact value (A = |x_dequantized| @ |W|, abs_products), plus one
    rounding of the result to x's dtype on each side."""
    k = x.shape[-1]
    a = abs_products(fake_quantized(x), qt)
    return 2 * gamma(2 * k + 16) * a + 2 * UNIT[x.dtype] * y_ref.double().abs().reshape(a.shape) + 1e-30


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 17, 40, 129])
def test_linear_with_activation_blocks_matches_the_reference(backend, scheme, dtype, m):
    # K = 576 (the bundled model): 18 blocks, groups of 32/64/128... that tile it or not (g128
    # falls back per scheme below); m covers the kernel's 4-row tiles, their tail, and the
    # many-row paths past a8_rows_max_m (16 with AVX-512; without, 8 for 4-bit codes: the
    # panel GEMM, 128 for 8-bit: dequantized blocks times float32 weight tiles).
    k = 576 if "g128" not in scheme else 512
    skip_large_for_interpreter(backend, m, 48, k)
    torch.manual_seed(m)
    qt = lowbit.quantize(torch.randn(48, k), scheme)
    x = (torch.randn(m, k) * 3).to(dtype)
    y_ref = linear(x, qt, act_scheme=ACT, backend="reference")
    y = linear(x, qt, act_scheme=ACT, backend=backend)
    assert y.dtype == dtype and y.shape == (m, 48)
    err = (y.double() - y_ref.double()).abs()
    assert bool((err <= a8_tolerance(x, qt, y_ref)).all()), float(err.max())


def test_the_reference_is_the_weight_only_matmul_of_the_dequantized_blocks():
    torch.manual_seed(0)
    qt = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
    x = torch.randn(3, 64)
    expected = linear(fake_quantized(x), qt, backend="reference")
    assert torch.equal(linear(x, qt, act_scheme=ACT, backend="reference"), expected)
    # and the blocks lose something: this is not the weight-only result
    assert not torch.equal(expected, linear(x, qt, backend="reference"))


def test_cpu_blocks_are_the_references_codes_and_scales_bit_for_bit():
    if not cpu.available():
        pytest.skip(cpu.load_error())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 256, generator=g) * torch.logspace(-30, 30, 7)[:, None]
    x[0, :32] = 0  # an all-zero block: scale 1
    x[1, 32:64] = torch.arange(32) - 16.0  # max 16: codes at ties of 127.5 / 16 steps
    x[2, 64:96] = 127.5  # x / scale == 127.5 exactly: rounds to 128, clamped to 127
    x[2, 96:128] = -127.5  # -128 exactly
    x[3, :] = torch.finfo(torch.float32).max * torch.sign(torch.randn(256, generator=g))
    x[4, :] = torch.finfo(torch.float32).tiny / 3  # subnormals
    xd, ok = cpu._C.fake_quantize_a8_blocks(x.contiguous())
    assert ok and torch.equal(xd, fake_quantized(x))


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
@pytest.mark.parametrize("m", [1, 40])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_activations_are_refused_naming_x(backend, m, bad):
    qt = lowbit.quantize(torch.randn(16, 64), "int8-sym")
    x = torch.randn(m, 64)
    x[m - 1, 37] = bad
    with pytest.raises(ValueError, match=rf"x contains NaN or Inf \(first at index \[{m - 1}, 37\]"):
        linear(x, qt, act_scheme=ACT, backend=backend)


@pytest.mark.parametrize("weight, act, k, message", [
    ("int2-asym-g64", ACT, 64, "need an 8-bit or a 4-bit weight"),
    ("int8-sym-g16", ACT, 64, "weight groups of 16"),
    ("int4-sym-channel", ACT, 48, "weight groups of 48"),
    ("int4-sym-g32", "int8-asym-g32", 64, "symmetric with float32 scales"),
    ("int4-sym-g32", "int8-sym-g32-f16", 64, "symmetric with float32 scales"),
])
def test_weights_and_blocks_that_do_not_fit_are_refused(weight, act, k, message):
    qt = lowbit.quantize(torch.randn(8, k), weight)
    with pytest.raises(ValueError, match=message):
        linear(torch.randn(2, k), qt, act_scheme=act)


def test_calibrated_scales_are_refused_with_blocks():
    qt = lowbit.quantize(torch.randn(8, 64), "int8-sym")
    with pytest.raises(ValueError, match="per block of x on the fly"):
        linear(torch.randn(2, 64), qt, act_scheme=ACT, act_scale=torch.tensor(0.1))


def test_check_act_weight_accepts_the_presets_pairs():
    for weight in ("int4-sym-g32-f16", "int8-sym-g32-f16", "int4-asym-g128-f16", "int8-sym"):
        check_act_weight(weight, ACT, 576)


def test_cpu_plan_runs_blocks_on_few_rows_and_a_gemm_beyond():
    if not cpu.available() or not cpu._has_a8_blocks():
        pytest.skip("no AVX2 build of lowbit._C")
    # (where AMX runs, one row of 4-bit codes takes gemm_amx.cpp's one-row kernel whatever
    # the threshold)
    plan = get_backend("cpu").plan
    w, a = QuantScheme.parse("int4-sym-g32"), QuantScheme.parse(ACT)
    assert plan(w, a, 1, 576, torch.bfloat16).kernel == ("a8_amx" if cpu._a8_amx_row(4, 32, True) else "a8_blocks")
    beyond = "a8_gemm" if not cpu._has_avx512() else "a8_amx" if cpu._C.has_amx_int8() else "a8_vnni"
    for w in (w, QuantScheme.parse("int8-sym-g32")):
        rows = cpu.a8_rows_max_m(w.bits)
        if rows > 1 or not cpu._a8_amx_row(w.bits, 32, True):
            assert plan(w, a, rows, 576, torch.float32).kernel == "a8_blocks"
        assert plan(w, a, rows + 1, 576, torch.float32).kernel == beyond
    assert plan(w, QuantScheme.parse("int8-sym-g64"), 1, 576, torch.float32).kernel == "reference"
    if cpu._a8_amx_row(4, 32, True):  # zero points in groups of 32 keep the rows kernel at one row
        assert plan(QuantScheme.parse("int4-asym-g32"), a, 1, 576, torch.float32).kernel == "a8_blocks"
        assert plan(QuantScheme.parse("int4-asym-g64"), a, 1, 576, torch.float32).kernel == "a8_amx"


def _needs_gemm():
    if not cpu.available() or not cpu._has_a8_blocks():
        pytest.skip("no AVX2 build of lowbit._C")


def _needs_vnni():
    if not cpu.available() or not cpu._C.has_a8_vnni():
        pytest.skip("no AVX-512 VNNI build of lowbit._C")


@pytest.mark.parametrize("scheme, k", [("int4-sym-g32", 576), ("int4-asym-g64", 576), ("int4-asym-channel", 96),
                                       ("int4-sym-g96", 288), ("int4-asym-g32-zpfloat", 64), ("int8-sym-g32", 576),
                                       ("int8-asym-g64", 192), ("int8-sym", 96), ("int8-asym-g96", 288),
                                       ("int4-asym-g32-zpmin-f16", 576), ("int8-asym-g64-zpmin", 192)])
@pytest.mark.parametrize("m", [1, 3, 4, 9, 70])
@pytest.mark.parametrize("n", [1, 15, 16, 40])
def test_cpu_panel_gemm_matches_the_reference(monkeypatch, scheme, k, m, n):
    # gemm_a8.cpp (4-bit) and gemm_i16.cpp (8-bit) at every row count (the plan's threshold
    # set to 0): 4-row tiles and their tail, panels of 16 columns and a last one cut short,
    # groups of one or several blocks
    _needs_gemm()
    monkeypatch.setattr(cpu, "AVX2_A8_ROWS_MAX_M", {4: 0, 8: 0})
    monkeypatch.setattr(cpu, "A8_ROWS_MAX_M", {4: 0, 8: 0})
    monkeypatch.setattr(cpu, "AMX_A8_ROWS_MAX_M", {4: 0, 8: 0})
    monkeypatch.setattr(cpu, "_a8_amx_row", lambda *a: False)
    monkeypatch.setattr(cpu, "_a8_gemm", lambda: True)
    cpu.clear_plans()
    try:
        torch.manual_seed(m + n + k)
        qt = lowbit.quantize(torch.randn(n, k), scheme)
        w = QuantScheme.parse(scheme)
        assert get_backend("cpu").plan(w, QuantScheme.parse(ACT), m, k, torch.float32).kernel == "a8_gemm"
        x = torch.randn(m, k) * 3
        y_ref = linear(x, qt, act_scheme=ACT, backend="reference")
        y = linear(x, qt, act_scheme=ACT, backend="cpu")
        err = (y.double() - y_ref.double()).abs()
        assert bool((err <= a8_tolerance(x, qt, y_ref)).all()), float(err.max())
    finally:
        monkeypatch.undo()
        cpu.clear_plans()


def _gemms(bits, kernel="avx2"):
    """(several weights, one weight) panel GEMMs of ``kernel`` for ``bits``-bit codes, both
    called as (x, codes, scales, zero points, group, zero_point_min)."""
    if kernel == "vnni":
        return (lambda *a: cpu._C.gemm_a8_blocks_vnni_many(*a[:4], bits, *a[4:]),
                lambda *a: cpu._C.gemm_a8_blocks_vnni(*a[:4], bits, *a[4:]))
    return ((cpu._C.gemm_a8_blocks_many, cpu._C.gemm_a8_blocks) if bits == 4
            else (cpu._C.gemm_a8_blocks8_many, cpu._C.gemm_a8_blocks8))


@pytest.mark.parametrize("kernel", ["avx2", "vnni"])
@pytest.mark.parametrize("scheme", ["int4-sym-g32", "int4-asym-g64", "int8-sym-g32", "int8-asym-g64",
                                    "int4-asym-g32-zpmin-f16", "int8-asym-g64-zpmin"])
def test_cpu_panel_gemm_of_several_weights_gives_the_bits_of_one_call_each(kernel, scheme):
    _needs_gemm() if kernel == "avx2" else _needs_vnni()
    from lowbit.ops.matmul import weight_parts

    torch.manual_seed(5)
    x = torch.randn(13, 192)
    parts = [weight_parts(lowbit.quantize(torch.randn(n, 192), scheme)) for n in (6, 3, 40)]
    args = [(c, s.float().contiguous(), None if z is None else z.float().contiguous()) for c, s, z, _, _ in parts]
    many, one = _gemms(parts[0][3], kernel)
    min_form = "zpmin" in scheme
    ys, ok = many(x, *map(list, zip(*args)), parts[0][4], min_form)
    assert ok and len(ys) == 3
    for y, (c, s, z) in zip(ys, args):
        y1, ok1 = one(x, c, s, z, parts[0][4], min_form)
        assert ok1 and torch.equal(y, y1)


@pytest.mark.parametrize("scheme", ["int4-sym-g32", "int8-sym-g32"])
def test_cpu_panel_gemm_reports_non_finite_x_and_checks_its_arguments(scheme):
    _needs_gemm()
    from lowbit.ops.matmul import weight_parts

    c, s, z, bits, group = weight_parts(lowbit.quantize(torch.randn(16, 64), scheme))
    s = s.float().contiguous()
    gemm = _gemms(bits)[1]
    x = torch.randn(5, 64)
    x[3, 7] = float("nan")
    assert gemm(x, c, s, None, group, False)[1] is False
    x[3, 7] = float("inf")
    assert gemm(x, c, s, None, group, False)[1] is False
    with pytest.raises(RuntimeError, match="contiguous float32 x"):
        gemm(x.double(), c, s, None, group, False)
    with pytest.raises(RuntimeError, match="multiple of 32 that divides K"):
        gemm(torch.randn(2, 64), c, s, None, 48, False)
    with pytest.raises(RuntimeError, match="scale must be contiguous float32"):
        gemm(torch.randn(2, 64), c, s[:8], None, group, False)
    with pytest.raises(RuntimeError, match="zero_point_min needs the mins"):
        gemm(torch.randn(2, 64), c, s, None, group, True)
    y, ok = gemm(torch.randn(0, 64), c, s, None, group, False)
    assert ok and y.shape == (0, 16)


@pytest.mark.parametrize("scheme", ["int4-sym-g32", "int4-asym-g64", "int8-sym", "int8-asym-g32",
                                    "int4-asym-g32-zpmin-f16", "int8-asym-g32-zpmin"])
@pytest.mark.parametrize("m", [1, 6])
def test_cpu_several_weights_in_one_call_give_the_bits_of_one_call_each(scheme, m):
    # the decode step's q/k/v and gate/up: one pass over x, one parallel region; row counts
    # that are not multiples of the 4-row tiles in every weight
    if not cpu.available() or not cpu._has_a8_blocks():
        pytest.skip("no AVX2 build of lowbit._C")
    from lowbit.ops.matmul import weight_parts

    torch.manual_seed(m)
    x = torch.randn(m, 192)
    parts = [weight_parts(lowbit.quantize(torch.randn(n, 192), scheme)) for n in (6, 3, 13)]
    args = [(c, s.float().contiguous(), None if z is None else z.float().contiguous()) for c, s, z, _, _ in parts]
    bits, group = parts[0][3], parts[0][4]
    min_form = "zpmin" in scheme
    ys, ok = cpu._C.linear_a8_blocks_many(x, *map(list, zip(*args)), bits, group, min_form)
    assert ok and len(ys) == 3
    for y, (c, s, z) in zip(ys, args):
        one, ok1 = cpu._C.linear_a8_blocks(x, c, s, z, bits, group, min_form)
        assert ok1 and torch.equal(y, one)


@pytest.mark.parametrize("scheme, k", [("int4-sym-g32", 576), ("int4-asym-g64", 1536), ("int4-sym-g32-f16", 1088),
                                       ("int8-sym-g32", 1536)])
def test_cpu_blocks_give_a_row_its_bits_whatever_m(scheme, k):
    # gemv_a8.cpp: one row of x takes 4-bit weight rows four at a time (w4_tile<1, 4>) where
    # a row's codes are shorter than 512 bytes, one at a time (w4_tile<1, 1>) where longer;
    # 4 rows of x take one weight row (w4_tile<4, 1>): the same operations per output, so the
    # same bits.  n = 39: whole tiles of 4 weight rows and a remainder.
    if not cpu.available() or not cpu._has_a8_blocks():
        pytest.skip("no AVX2 build of lowbit._C")
    from lowbit.ops.matmul import weight_parts

    torch.manual_seed(k)
    c, s, z, bits, group = weight_parts(lowbit.quantize(torch.randn(39, k), scheme))
    s, z = cpu._C.packed_scales(s, z)
    x = torch.randn(6, k) * 3
    full, ok = cpu._C.linear_a8_blocks(x, c, s, z, bits, group, False)
    assert ok
    for m in (1, 2, 3, 4, 5):
        y, ok = cpu._C.linear_a8_blocks(x[:m], c, s, z, bits, group, False)
        assert ok and torch.equal(y, full[:m])


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("scheme, k", [("int4-sym-g32", 32), ("int4-asym-g32", 96), ("int4-sym-channel", 160),
                                       ("int4-asym-g96", 288), ("int4-sym-g96", 96), ("int8-asym-g96", 288),
                                       ("int4-asym-g96-zpmin", 288),
                                       ("int8-sym-channel", 160)])
@pytest.mark.parametrize("m", [1, 5])
def test_odd_block_counts_and_groups_across_block_pairs(backend, scheme, k, m):
    # an odd number of 32-blocks (the 4-bit kernels' last block alone), groups of 96 (a pair of
    # blocks straddles two groups), one group per row (channel)
    torch.manual_seed(k + m)
    qt = lowbit.quantize(torch.randn(11, k), scheme)
    x = torch.randn(m, k)
    y_ref = linear(x, qt, act_scheme=ACT, backend="reference")
    y = linear(x, qt, act_scheme=ACT, backend=backend)
    err = (y.double() - y_ref.double()).abs()
    assert bool((err <= a8_tolerance(x, qt, y_ref)).all()), float(err.max())


def test_lm_head_activation_is_checked_and_saved():
    base = dict(weight="int4-sym-g32-f16", activation=ACT)
    with pytest.raises(ValueError, match="lm_head stays float"):
        lowbit.Recipe(**base, lm_head_activation=ACT)
    with pytest.raises(ValueError, match="per-tensor scheme needs calibrated scales"):
        lowbit.Recipe(**base, lm_head="int8-sym", lm_head_activation="int8-sym-tensor")
    with pytest.raises(ValueError, match="lm_head/lm_head_activation"):
        lowbit.Recipe(**base, lm_head="int2-asym-g64", lm_head_activation=ACT)
    r = lowbit.Recipe(**base, lm_head="int8-sym-g32-f16", lm_head_activation=ACT)
    assert r.scheme_for("lm_head") == ("int8-sym-g32-f16", ACT)
    assert lowbit.Recipe.from_dict(r.to_dict()) == r
    assert "lm_head_activation" not in lowbit.Recipe(**base).to_dict()  # older lowbit reads it


def test_compressed_tensors_refuses_block_activations_before_quantizing():
    from lowbit.formats.compressed_tensors import CompressedTensorsError, check_recipe

    for name in ("q4_0-a8", "q8_0-a8"):
        with pytest.raises(CompressedTensorsError, match="no compressed-tensors form"):
            check_recipe(lowbit.Recipe.get(name))
    with pytest.raises(CompressedTensorsError, match="no compressed-tensors form"):
        check_recipe(lowbit.Recipe(weight="int8-sym", lm_head="int8-sym", lm_head_activation=ACT))


@pytest.mark.parametrize("scheme", ["int4-sym-g32-f16", "int4-asym-g64-f16", "int4-asym-g96-f16", "int8-sym-g32-f16",
                                    "int8-asym-g64-f16", "int4-asym-g32-zpmin-f16", "int8-asym-g32-zpmin-f16"])
@pytest.mark.parametrize("m, k", [(1, 192), (6, 192), (9, 192), (1, 224)])  # 224: a last block alone
def test_cpu_float16_scales_give_the_bits_of_float32_ones(scheme, m, k):
    # the packed kernels read an f16 scheme's scales (and 8-bit or f16 zero points) as stored,
    # converted exactly: the same results as float32 copies, weight by weight in one call
    if not cpu.available() or not cpu._has_a8_blocks():
        pytest.skip("no AVX2 build of lowbit._C")
    from lowbit.ops.matmul import weight_parts

    torch.manual_seed(m)
    if k % QuantScheme.parse(scheme).group_size:
        scheme = scheme.replace("-g64", "-g32").replace("-g96", "-g32")
    x = torch.randn(m, k)
    parts = [weight_parts(lowbit.quantize(torch.randn(n, k), scheme)) for n in (6, 13)]
    bits, group, min_form = parts[0][3], parts[0][4], "zpmin" in scheme
    half = [cpu._C.packed_scales(s, z) for _, s, z, _, _ in parts]
    assert all(s.dtype == torch.float16 and (z is None or z.dtype == torch.float16) for s, z in half)
    full = [(s.float(), None if z is None else z.float()) for s, z in half]
    codes = [c for c, *_ in parts]
    # one weight's scales in float16, the other's in float32, in one call
    mixed = [half[0], full[1]]
    ys, ok = cpu._C.linear_a8_blocks_many(x, codes, *map(list, zip(*mixed)), bits, group, min_form)
    assert ok
    for y, c, (s, z) in zip(ys, codes, full):
        assert torch.equal(y, cpu._C.linear_a8_blocks(x, c, s, z, bits, group, min_form)[0])
    for c, (s, z), (s16, z16) in zip(codes, full, half):
        assert torch.equal(cpu._C.weight_only_matmul(x, c, s16, z16, bits, group, 0, min_form),
                           cpu._C.weight_only_matmul(x, c, s, z, bits, group, 0, min_form))
        gemm = _gemms(bits)[1]
        assert torch.equal(gemm(x, c, s16, z16, group, min_form)[0], gemm(x, c, s, z, group, min_form)[0])


def test_packed_scales_keep_float16_only_where_it_is_exact():
    s16 = torch.rand(4, 2).half()
    s, z = cpu._C.packed_scales(s16, torch.randint(0, 255, (4, 2), dtype=torch.uint8))
    assert s.dtype == z.dtype == torch.float16 and torch.equal(s, s16)
    s, z = cpu._C.packed_scales(s16, None)
    assert s.dtype == torch.float16 and z is None
    for other in (torch.rand(4, 2), torch.randint(0, 9, (4, 2), dtype=torch.int32)):  # float32 or int32 zero points
        s, z = cpu._C.packed_scales(s16, other)
        assert s.dtype == z.dtype == torch.float32 and torch.equal(z, other.float())
    s, z = cpu._C.packed_scales(s16.bfloat16(), None)
    assert s.dtype == torch.float32
    with pytest.raises(RuntimeError, match="zero_point must be contiguous, of scale's shape and dtype"):
        cpu._C.linear_a8_blocks(torch.randn(1, 64), torch.zeros(2, 8, dtype=torch.int32), torch.ones(2, 2).half(),
                                torch.ones(2, 2), 4, 32, False)


# the weights the AVX-512 block GEMMs are checked on against the AVX2 panels: signed /
# unsigned / "min" codes of 4 and 8 bits, groups of one or several blocks, per channel,
# K % 64 == 32 tails, float16 scales
PANEL_GEMM_WEIGHTS = [("int4-sym-g32", 576), ("int4-asym-g64", 576), ("int4-asym-channel", 96), ("int4-sym-g96", 288),
                      ("int4-asym-g32-zpfloat", 64), ("int8-sym-g32", 576), ("int8-asym-g64", 192), ("int8-sym", 96),
                      ("int8-asym-g96", 288), ("int4-asym-g32-zpmin-f16", 576), ("int8-asym-g64-zpmin", 192),
                      ("int4-sym-g32-f16", 1536)]


def _needs_amx():
    if not cpu.available() or not cpu._C.has_amx_int8():
        pytest.skip("no AMX int8 tiles on this machine (or not compiled in)")


@pytest.mark.parametrize("kernel", ["amx", "vnni"])
@pytest.mark.parametrize("scheme, k", PANEL_GEMM_WEIGHTS)
@pytest.mark.parametrize("m, n", [(1, 1), (1, 33), (1, 70), (3, 40), (6, 32), (7, 33), (16, 16), (17, 33), (70, 15),
                                  (129, 70)])
def test_avx512_block_gemms_give_the_bits_of_the_avx2_panel_gemm(kernel, scheme, k, m, n):
    # gemm_amx.cpp and gemm_a8_vnni.cpp run gemm_a8.cpp's / gemm_i16.cpp's float operations
    # lane for lane on the same exact block dot products (AMX: tdpbusd / tdpbssd tiles;
    # VNNI: vpdpbusd, signed 8-bit codes as q + 128 with the offset taken away in the
    # integers), so they agree with the AVX2 panels bit for bit: AMX tiles of 16 rows and
    # VNNI tiles of 6, their tails, panels of 32 columns and a half panel cut short (AMX,
    # 8-bit codes: full panels' A tiles loaded as stored, a panel cut short packed), and
    # the weights of PANEL_GEMM_WEIGHTS.  AMX at one row, 4-bit codes: gemv_a8_vnni.cpp
    # (strips of 16 weight rows, a strip cut short, K's last 64 code bytes cut short).
    _needs_amx() if kernel == "amx" else _needs_vnni()
    _needs_gemm()
    from lowbit.ops.matmul import weight_parts

    torch.manual_seed(m * 1000 + n + k)
    codes, scale, zero_point, bits, group = weight_parts(lowbit.quantize(torch.randn(n, k), scheme))
    s, zp = cpu._C.packed_scales(scale, zero_point)
    x = torch.randn(m, k) * 3
    x[0, :32] = 0  # an all-zero block: scale 1, codes and sums zero
    min_form = "zpmin" in scheme
    panel = cpu._C.gemm_a8_blocks if bits == 4 else cpu._C.gemm_a8_blocks8
    y_avx2, ok_avx2 = panel(x, codes.contiguous(), s, zp, group, min_form)
    gemm = cpu._C.gemm_a8_blocks_amx if kernel == "amx" else cpu._C.gemm_a8_blocks_vnni
    y, ok = gemm(x, codes.contiguous(), s, zp, bits, group, min_form)
    assert ok_avx2 and ok
    assert torch.equal(y, y_avx2)
    if kernel == "amx":  # bf16 x in, bf16 y out: the float32 call on the same values, rounded once
        xb = x.bfloat16()
        yb, ok = gemm(xb, codes.contiguous(), s, zp, bits, group, min_form)
        y32, _ = gemm(xb.float(), codes.contiguous(), s, zp, bits, group, min_form)
        assert ok and yb.dtype == torch.bfloat16 and torch.equal(yb, y32.bfloat16())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("m", [1, 20])
def test_amx_gemm_reports_non_finite_x_and_checks_its_arguments(bad, m):
    _needs_amx()
    from lowbit.ops.matmul import weight_parts

    codes, scale, zero_point, bits, group = weight_parts(lowbit.quantize(torch.randn(16, 64), "int4-sym-g32"))
    x = torch.randn(m, 64)
    x[m - 1, 5] = bad
    _, ok = cpu._C.gemm_a8_blocks_amx(x, codes.contiguous(), scale.float(), None, 4, group, False)
    assert not ok
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        cpu._C.gemm_a8_blocks_amx(x, codes.contiguous(), scale.float(), None, 2, group, False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu._C.gemm_a8_blocks_amx(torch.randn(4, 48), codes.contiguous(), scale.float(), None, 4, 48, False)
    _, ok = cpu._C.gemm_a8_blocks_amx(x.bfloat16(), codes.contiguous(), scale.float(), None, 4, group, False)
    assert not ok  # bf16 x: the same check
    with pytest.raises(RuntimeError, match="contiguous float32 or bf16 x"):
        cpu._C.gemm_a8_blocks_amx(x.half(), codes.contiguous(), scale.float(), None, 4, group, False)


def test_vnni_gemm_takes_the_extreme_codes_exactly():
    # signed 8-bit codes of -128 and 127 against activation codes of -128 and 127 (the offset
    # q + 128 reaches both ends of u8).  Blocks of +-127.5 have d = 1 and codes -128 / 127
    # (127.5 rounds to 128, clamped); with scales of 1 every float32 step is exact (block
    # sums at most 32 * 128 * 128 = 2^19, 8 blocks), so y is the exact integer product.
    _needs_vnni()
    k, n = 256, 40
    torch.manual_seed(0)
    codes = torch.where(torch.rand(n, k) < 0.5, -128, 127).to(torch.int8)
    x = torch.where(torch.rand(9, k) < 0.5, -127.5, 127.5)
    xq = torch.where(x < 0, -128.0, 127.0).double()
    y, ok = cpu._C.gemm_a8_blocks_vnni(x, codes, torch.ones(n, k // 32), None, 8, 32, False)
    assert ok and torch.equal(y.double(), xq @ codes.double().T)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_vnni_gemm_reports_non_finite_x_and_checks_its_arguments(bad):
    _needs_vnni()
    from lowbit.ops.matmul import weight_parts

    codes, scale, zero_point, bits, group = weight_parts(lowbit.quantize(torch.randn(16, 64), "int4-sym-g32"))
    s = scale.float().contiguous()
    x = torch.randn(20, 64)
    x[19, 5] = bad
    _, ok = cpu._C.gemm_a8_blocks_vnni(x, codes, s, None, 4, group, False)
    assert not ok
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        cpu._C.gemm_a8_blocks_vnni(x, codes, s, None, 2, group, False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu._C.gemm_a8_blocks_vnni(torch.randn(4, 48), codes, s, None, 4, 48, False)
    with pytest.raises(RuntimeError, match="contiguous float32 x"):
        cpu._C.gemm_a8_blocks_vnni(x.double(), codes, s, None, 4, group, False)
    with pytest.raises(RuntimeError, match="zero_point_min needs the mins"):
        cpu._C.gemm_a8_blocks_vnni(torch.randn(2, 64), codes, s, None, 4, group, True)
    y, ok = cpu._C.gemm_a8_blocks_vnni(torch.randn(0, 64), codes, s, None, 4, group, False)
    assert ok and y.shape == (0, 16)
