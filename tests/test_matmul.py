"""Quantized matmuls: every backend against the reference, with derived tolerances."""

import pytest
import torch

import lowbit
from lowbit.kernels import cpu, get_backend, reference
from lowbit.ops import linear, quantized_matmul
from lowbit.scheme import QuantScheme

from .conftest import BACKENDS, FAST_BACKENDS, skip_large_for_interpreter

U32 = 2.0**-24  # unit roundoff of float32
UNIT = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

WEIGHT_SCHEMES = ["int8-sym", "int8-sym-g64", "int8-asym-g32", "int4-sym-g32", "int4-sym-g128",
                  "int4-asym-g64", "int4-asym-channel", "int4-asym-g32-zpfloat-f16", "int4-sym-g64-bf16",
                  "int4-asym-g64-u8", "int2-asym-g64", "int4-sym-tensor", "int4-asym-g32-zpmin-f16",
                  "int8-asym-g32-zpmin", "int4-asym-channel-zpmin-bf16"]


def gamma(k: int, u: float = U32) -> float:
    """Higham's bound for a k-term float sum of products: |fl(sum) - sum| <= gamma_k sum|terms|."""
    return k * u / (1 - k * u)


def abs_products(x: torch.Tensor, qt, offset: float = 0.0) -> torch.Tensor:
    """|x| @ (scale * (|q| + |z| + offset)).T in float64: bounds every partial sum either
    backend forms, whichever of (q - z) * s * x or s * ((q + offset).x - (z + offset) * sum x)
    it evaluates; in the "min" domain (q * s + m) |x| @ (|s| (|q| + offset) + |m|).T, which
    bounds s * (q + offset).x + m * sum x."""
    s = qt.scheme
    q = (reference.unpack(qt.codes, s.bits, s.packing, s.symmetric) if s.is_packed else qt.codes).double()
    z = qt.zero_point.double().abs() if qt.zero_point is not None else torch.zeros_like(qt.scale.double())
    scale = qt.scale.double().reshape(-1, 1).abs()
    if s.zero_point_domain == "min":
        w = ((reference.to_blocks(q.abs(), s) + offset) * scale + z.reshape(-1, 1)).reshape(qt.shape)
    else:
        w = ((reference.to_blocks(q.abs(), s) + z.reshape(-1, 1) + offset) * scale).reshape(qt.shape)
    return x.double().abs().reshape(-1, x.shape[-1]) @ w.T


def weight_only_tolerance(x, qt, y_ref, backend="cpu"):
    """Both results are within gamma_K * A of the exact float64 value (A = abs_products),
    plus: above cpu.gemv_max_m rows the cpu backend runs a bf16 GEMM (gemm_bf16.cpp) or, where
    that does not apply, bf16 tiles through torch.mm; both round the dequantized weight
    and x to bf16 (u_bf16 * A each) and sum float32 products of them (at the float32
    matmul precision "highest" float32 activations skip the bf16 roundings: a subset of
    this bound, checked tighter in tests/test_precision.py); up to gemv_max_m rows, 4-bit weights go
    through bf16 dot products on 128 + u (offset 128, +8 for signed codes; gemv_f32's float32
    FMAs on u = q + 8 for signed 4-bit codes: offset 8) and non-bf16
    x is split into two bf16 parts (|x - hi - lo| <= 2^-16 |x|); each output is rounded
    once to x's dtype (u_out * |y| each)."""
    k = x.shape[-1]
    m = x.reshape(-1, k).shape[0]
    s = qt.scheme
    # Which kernel the backend runs: its plan, the one the kernels follow (on a machine
    # without AVX-512 every 4/8-bit call on cpu runs weight tiles).
    kernel = get_backend(backend).plan(s, None, m, k, x.dtype).kernel
    bf16_tiles = backend == "cpu" and kernel in ("gemm_bf16", "gemm_fma", "gemm_bf16_amx", "tiles_bf16")
    bf16_dots = backend == "cpu" and kernel.startswith("gemv_bf16")  # or float32 FMAs: a tighter subset
    a = abs_products(x, qt)
    # what the float32 sums add up: gemv_f32 sums signed 4-bit codes as u = q + 8, less 8 sum x
    signed4 = s.bits == 4 and s.symmetric
    a_sums = (abs_products(x, qt, offset=136.0) if bf16_dots
              else abs_products(x, qt, offset=8.0) if backend == "cpu" and kernel == "gemv_f32" and signed4 else a)
    u_in = 2 * UNIT[torch.bfloat16] if bf16_tiles else 2.0**-16 if bf16_dots else 0.0
    if backend == "triton" and x.dtype == torch.float32:
        u_in = 2.0**-21  # tf32x3 on the tensor cores: |x - hi - lo| <= 2^-21 |x| (exact when interpreted)
    # No value passes through more than 2K + 16 float32 roundings on either side (products,
    # in-block sums, per-block scaling, the final reductions): gamma_{2K+16} covers both.
    return (2 * gamma(2 * k + 16) * a_sums + u_in * a
            + 2 * UNIT[x.dtype] * y_ref.double().abs().reshape(a.shape) + 1e-30)


def assert_weight_only_close(qt, x, backend):
    """linear(x, qt) on `backend`: x's dtype, shape [m, n], within weight_only_tolerance of
    the reference backend."""
    y_ref = linear(x, qt, backend="reference")
    y = linear(x, qt, backend=backend)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], qt.shape[0])
    err = (y.double() - y_ref.double()).abs()
    assert bool((err <= weight_only_tolerance(x, qt, y_ref, backend)).all()), float(err.max())


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 6, 16, 33])
def test_weight_only_linear_matches_the_reference(backend, scheme, dtype, m):
    n, k = 48, 256
    assert_weight_only_close(lowbit.quantize(torch.randn(n, k), scheme), torch.randn(m, k).to(dtype), backend)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int4-sym-g32", "int4-asym-g32-zpfloat-f16", "int8-sym-g64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_weight_only_linear_on_the_bundled_models_k576(backend, scheme, dtype, m):
    # K = 576 = 4 * 128 + 64: the 4-bit decode kernel ends on a 64-value tail block.
    assert_weight_only_close(lowbit.quantize(torch.randn(40, 576), scheme), torch.randn(m, 576).to(dtype), backend)


@pytest.mark.parametrize("scheme", ["int8-sym-g32-f16", "int8-asym-g32"])
def test_cpu_8bit_decode_kernel_gives_a_row_its_bits_whatever_m_and_n(scheme):
    # matmul.cpp's w8_rows in groups of 32: one chain q0 x0 + q1 x1 per group whether x has
    # one row (weight rows two at a time, or the last one alone) or four (rows of x in
    # fours, the rest one at a time): the same operations per output for float32 x, whose
    # products q x are rounded (bf16 x's are exact).  n = 39: pairs and a row alone.
    if cpu._C is None or not cpu._C.has_gemv_f32():
        pytest.skip("no float32-FMA decode kernels")
    from lowbit.ops.matmul import weight_parts
    g = torch.Generator().manual_seed(5)
    qt = lowbit.quantize(torch.randn(39, 576, generator=g), scheme)
    codes, s, z, bits, group = weight_parts(qt)
    x = torch.randn(6, 576, generator=g)
    index = cpu.weight_only_kernel_index("gemv_f32")
    full = cpu._C.weight_only_matmul(x, codes, s, z, bits, group, index, False)
    for m in (1, 2, 5):
        assert torch.equal(cpu._C.weight_only_matmul(x[:m], codes, s, z, bits, group, index, False), full[:m])
    for n in (1, 2, 7):
        z_n = None if z is None else z[:n]
        assert torch.equal(cpu._C.weight_only_matmul(x[4:5], codes[:n], s[:n], z_n, bits, group, index, False),
                           full[4:5, :n])


@pytest.mark.parametrize("scheme, k", [("int4-asym-g64", 576), ("int4-sym-g32", 256), ("int4-asym-g128", 512),
                                       ("int4-asym-g128", 1536), ("int4-sym-g32", 1088),
                                       ("int4-asym-g32-zpmin-f16", 576), ("int4-asym-g64-zpmin", 1536)])
@pytest.mark.parametrize("kernel", ["gemv_bf16", "gemv_bf16_split", "gemv_bf16_amx"])
def test_cpu_bf16_decode_kernel_gives_a_row_its_bits_whatever_m_and_n(scheme, k, kernel):
    # gemv_bf16.cpp: below 4 rows of x the weight rows go 4 at a time (rows<1, 4>) where a
    # row's codes are shorter than 512 bytes (K < 1024), the rest of a thread's range, long
    # rows and 4 rows of x or more one weight row at a time (rows<R>): the same operations
    # per output, so the same bits (K = 576's 64-value tails: two weight rows' in one 512-bit
    # block in rows<1, 4>, one row's in a 256-bit block otherwise).  n = 39: groups and a
    # remainder.  gemv_amx.cpp: one row of x in a C tile of one column, more in one of 16,
    # weight rows in strips of 16 (the last one short here): the same tile products and
    # float32 steps per output.
    if cpu._C is None:
        pytest.skip("no cpu kernels")
    supported = cpu._C.gemv_bf16_amx_supported if kernel == "gemv_bf16_amx" else cpu._C.gemv_bf16_supported
    if not supported(k, int(scheme.split("-g")[1].split("-")[0])):
        pytest.skip(f"no {kernel} kernel here")
    from lowbit.ops.matmul import weight_parts
    g = torch.Generator().manual_seed(k)
    qt = lowbit.quantize(torch.randn(39, k, generator=g), scheme)
    codes, s, z, bits, group = weight_parts(qt)
    s, z = s.float().contiguous(), None if z is None else z.float().contiguous()
    zmin = qt.scheme.zero_point_domain == "min"  # q * s + m: 128 s - m per group
    x = torch.randn(6, k, generator=g)
    if kernel != "gemv_bf16_split":
        x = x.bfloat16().float()
    index = cpu.weight_only_kernel_index(kernel)
    full = cpu._C.weight_only_matmul(x, codes, s, z, bits, group, index, zmin)
    for m in (1, 2, 3, 4, 5):
        assert torch.equal(cpu._C.weight_only_matmul(x[:m], codes, s, z, bits, group, index, zmin), full[:m])
    for n in (1, 4, 7, 33):  # other splits of the weight rows
        z_n = None if z is None else z[:n]
        assert torch.equal(cpu._C.weight_only_matmul(x[:1], codes[:n], s[:n], z_n, bits, group, index, zmin),
                           full[:1, :n])


@pytest.mark.parametrize("scheme, k", [("int4-asym-g64", 576), ("int4-sym-g32", 256), ("int4-sym-g128", 512),
                                       ("int4-asym-g32-zpmin-f16", 576)])
def test_cpu_amx_decode_kernel_takes_16_rows_of_x_a_pass(scheme, k):
    # gemv_amx.cpp: beyond 16 rows of x, one pass over the weights per 16 rows, each the
    # computation of those rows alone
    if cpu._C is None or not cpu._C.gemv_bf16_amx_supported(k, int(scheme.split("-g")[1].split("-")[0])):
        pytest.skip("no AMX bf16 tiles here")
    from lowbit.ops.matmul import weight_parts
    g = torch.Generator().manual_seed(k)
    qt = lowbit.quantize(torch.randn(40, k, generator=g), scheme)
    codes, s, z, bits, group = weight_parts(qt)
    s, z = s.float().contiguous(), None if z is None else z.float().contiguous()
    zmin = qt.scheme.zero_point_domain == "min"
    x = torch.randn(35, k, generator=g).bfloat16().float()
    index = cpu.weight_only_kernel_index("gemv_bf16_amx")
    full = cpu._C.weight_only_matmul(x, codes, s, z, bits, group, index, zmin)
    for rows in (slice(0, 16), slice(16, 32), slice(32, 35), slice(20, 21)):
        assert torch.equal(cpu._C.weight_only_matmul(x[rows], codes, s, z, bits, group, index, zmin), full[rows])
    y = x.double() @ lowbit.dequantize(qt, torch.float64).T  # the values (the bound: test above)
    assert (full.double() - y).abs().max() < 1e-4 * y.abs().max()


def test_cpu_amx_decode_kernel_takes_only_groups_that_its_steps_fit():
    # steps of 64 values (two A tiles) in groups that are multiples of 64, of 32 in groups of 32
    if cpu._C is None or not cpu._C.gemv_bf16_amx_supported(512, 64):
        pytest.skip("no AMX bf16 tiles here")
    assert cpu._C.gemv_bf16_amx_supported(576, 32) and cpu._C.gemv_bf16_amx_supported(576, 192)
    assert cpu._C.gemv_bf16_amx_supported(1536, 128) and cpu._C.gemv_bf16_amx_supported(512, 512)
    for k, group in [(576, 128), (576, 0), (576, 96), (576, 16), (0, 64), (48, 16)]:
        assert not cpu._C.gemv_bf16_amx_supported(k, group), (k, group)
    # and the kernel itself refuses what it does not take, naming what it expects
    from lowbit.ops.matmul import weight_parts
    index = cpu.weight_only_kernel_index("gemv_bf16_amx")
    codes, s, z, bits, group = weight_parts(lowbit.quantize(torch.randn(16, 576), "int4-asym-g96"))
    with pytest.raises(RuntimeError, match="groups of 32 or of a multiple of 64 that divide K"):
        cpu._C.weight_only_matmul(torch.randn(1, 576), codes, s.float(), z.float(), bits, group, index, False)


def test_cpu_bf16_decode_kernel_takes_only_groups_that_divide_k():
    # K = 576 with groups of 128 would leave the last 64 values out of every row
    if cpu._C is None:
        pytest.skip("no cpu kernels")
    assert not cpu._C.gemv_bf16_supported(576, 128) and not cpu._C.gemv_bf16_supported(576, 0)
    if not cpu._C.gemv_bf16_supported(576, 64):
        pytest.skip("no AVX512-BF16 decode kernel here")
    assert cpu._C.gemv_bf16_supported(512, 256)
    x, codes = torch.randn(1, 576), torch.zeros(8, 72, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="unsupported K/group"):
        cpu._C.weight_only_matmul(x, codes, torch.ones(8, 4), None, 4, 128, 1, False)


@pytest.mark.parametrize("scheme", ["int4-asym-g32-f16", "int4-asym-g64", "int4-sym-g128-f16", "int4-asym-g256",
                                    "int4-asym-g64-zpmin-f16"])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_cpu_4bit_decode_rows_give_a_row_the_same_bits_alone_in_a_pair_or_on_one_thread(scheme, m):
    # gemv_f32 takes AVX2 4-bit rows two at a time where both are in a thread's range (odd
    # N leaves one alone); groups of 32, 64 and 128 run a constant-count loop, 256 the
    # run-time one.  Each row: within the bound, and the same bits whichever way it ran.
    if not cpu.available():
        pytest.skip("no cpu kernels")
    w, x = torch.randn(37, 512), torch.randn(m, 512)
    qt = lowbit.quantize(w, scheme)
    if cpu.BACKEND.plan(qt.scheme, None, m, 512, x.dtype).kernel != "gemv_f32":
        pytest.skip("4-bit rows run another decode kernel here")
    assert_weight_only_close(qt, x, "cpu")
    y = linear(x, qt, backend="cpu")
    shifted = linear(x, lowbit.quantize(w[1:], scheme), backend="cpu")  # row n + 1 now pairs with n + 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = linear(x, qt, backend="cpu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shifted, y[:, 1:]) and torch.equal(one_thread, y)


def _force_gemm_f32(monkeypatch, on: bool):
    """The weight-only tiles (and a step's float32 rows) through gemm_f32 or not, whatever
    the machine would pick (it is compiled in wherever AVX2 and FMA are; AVX-512 machines
    keep torch.mm by default)."""
    if on and not (cpu.available() and cpu._C.has_gemm_f32()):
        pytest.skip("no gemm_f32 here")
    monkeypatch.setattr(cpu, "_gemm_f32", lambda: on)


@pytest.mark.parametrize("gemm_f32", [False, True])
@pytest.mark.parametrize("m", [3, 45, 200])
def test_cpu_weight_tiles_cover_w_in_tiles_or_in_one(monkeypatch, m, gemm_f32):
    # A 4 KiB tile budget is 16 rows of K = 64 (float32): m = 3 and 45 run 13 and 5 tiles
    # (a tail each), m = 200 one tile as large as x; all within the weight-only bound.  With
    # gemm_f32 (where the machine runs it) panels of 16 rows instead, the same bound.
    monkeypatch.setattr(cpu, "TILE_BYTES", 4096)
    _force_gemm_f32(monkeypatch, gemm_f32)
    qt = lowbit.quantize(torch.randn(200, 64), "int4-asym-g32")
    x = torch.randn(m, 64)
    y = cpu._tiles(x, qt.codes, qt.scale, qt.zero_point, 4, 32, torch.float32)
    y_ref = linear(x, qt, backend="reference")
    assert bool(((y.double() - y_ref.double()).abs() <= weight_only_tolerance(x, qt, y_ref)).all())


@pytest.fixture
def bf16_matmul_precision():
    """float32 activations may take the bf16 paths only below torch's "highest" precision."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int4-sym-g32", "int4-asym-g32-zpfloat-f16", "int8-sym",
                                    "int8-asym-g32", "int4-asym-channel", "int4-asym-g32-zpmin-f16",
                                    "int8-asym-g32-zpmin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k", [(7, 13, 576), (16, 48, 256), (37, 6, 2304), (129, 25, 64), (20, 200, 1216),
                                     (69, 6, 2304), (70, 200, 3328)])
def test_weight_only_gemm_rows_matches_the_reference(bf16_matmul_precision, backend, scheme, dtype, m, n, k):
    # Above cpu.gemv_max_m rows (gemm_bf16.cpp where AVX512-BF16 exists): its row-dot form up
    # to 64 rows, then panels of 64 columns (n = 200: three and a tail of 8, and tails below
    # 16 and 64), register tiles of 6 rows (m % 6 from 1 to 5), K in chunks of at most 1536
    # (2304: two, 3328: 1120 + 1120 + 1088, ending on part of a 16 x 16 transpose), rows of
    # codes shorter than a transpose (k = 64).
    skip_large_for_interpreter(backend, m, n, k)
    assert_weight_only_close(lowbit.quantize(torch.randn(n, k), scheme), torch.randn(m, k).to(dtype), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reference_weight_only_is_the_float_linear_of_the_dequantized_weight(backend):
    qt = lowbit.quantize(torch.randn(32, 128), "int4-asym-g32")
    x = torch.randn(2, 5, 128)
    bias = torch.randn(32)
    y = linear(x, qt, bias, backend=backend)
    expected = torch.nn.functional.linear(x.double(), lowbit.dequantize(qt, torch.float64), bias.double())
    tol = weight_only_tolerance(x, qt, expected, backend) + 4 * U32 * bias.double().abs()
    assert y.shape == (2, 5, 32)
    assert bool(((y.double() - expected).abs().reshape(tol.shape) <= tol).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", ["int8-sym-g32", "int4-asym-g64", "int4-sym-channel", "int4-asym-g32-zpfloat",
                                    "int4-asym-g32-zpmin-f16"])
def test_quantized_matmul_raw_api_equals_linear_and_writes_out(backend, scheme):
    qt = lowbit.quantize(torch.randn(24, 128), scheme)
    x = torch.randn(3, 128)
    s = qt.scheme
    group = s.group_size or 128
    scales = qt.scale.reshape(24, -1)
    zps = None if qt.zero_point is None else qt.zero_point.reshape(24, -1)
    codes = qt.codes
    kw = dict(bits=s.bits, group_size=group, zero_point_min=s.zero_point_domain == "min", backend=backend)
    y = quantized_matmul(x, codes, scales, zps, **kw)
    assert torch.equal(y, linear(x, qt, backend=backend))
    out = torch.empty(3, 24)
    assert quantized_matmul(x, codes, scales, zps, out=out, **kw) is out
    assert torch.equal(out, y)


def test_quantized_matmul_refuses_a_min_form_without_float_mins():
    qt = lowbit.quantize(torch.randn(8, 64), "int4-asym-g32")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="zero_point_min=True needs zero_point: the float mins m .* got None"):
        quantized_matmul(x, qt.codes, qt.scale.reshape(8, 2), bits=4, group_size=32, zero_point_min=True)
    with pytest.raises(ValueError, match="got torch.uint8"):
        quantized_matmul(x, qt.codes, qt.scale.reshape(8, 2), qt.zero_point.reshape(8, 2), bits=4, group_size=32,
                         zero_point_min=True)
    with pytest.raises(TypeError, match="zero_point_min must be a bool, got int"):
        quantized_matmul(x, qt.codes, qt.scale.reshape(8, 2), qt.zero_point.reshape(8, 2), bits=4, group_size=32,
                         zero_point_min=1)


# -- W8A8 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", ["int8-sym-token", "int8-asym-token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 17, 64])
def test_w8a8_is_bit_exact_across_backends(act, dtype, m):
    qt = lowbit.quantize(torch.randn(96, 320), "int8-sym")
    x = torch.randn(m, 320).to(dtype)
    ys = [linear(x, qt, act_scheme=act, backend=b) for b in BACKENDS]
    for y in ys[1:]:
        assert torch.equal(y, ys[0])


@pytest.mark.parametrize("act", ["int8-sym-token", "int8-asym-token"])
def test_w8a8_is_the_exact_integer_product_with_the_float32_epilogue(act):
    qt = lowbit.quantize(torch.randn(64, 256), "int8-sym")
    x = torch.randn(9, 256)
    q, s, z = lowbit.ops.quantize_per_token(x, 8, act.startswith("int8-sym") is True)
    acc = (q.double() - z.double()[:, None]) @ qt.codes.double().T  # exact in float64
    expected = ((acc.float() * s[:, None]) * qt.scale.float()[None, :])
    assert torch.equal(linear(x, qt, act_scheme=act), expected)


def test_w8a8_static_per_tensor_activation_scale():
    qt = lowbit.quantize(torch.randn(32, 64), "int8-sym")
    x = torch.randn(4, 64)
    scale = torch.tensor([0.05])
    y = linear(x, qt, act_scheme="int8-sym-tensor", act_scale=scale)
    xq = torch.clamp(torch.round(x / scale), -128, 127)
    expected = ((xq.double() @ qt.codes.double().T).float() * scale) * qt.scale.float()
    assert torch.equal(y, expected)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_point, bias", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("values", ["random", "extreme"])
@pytest.mark.parametrize("m, n, k", [(1, 8, 64), (13, 200, 584), (7, 70, 4100), (64, 70, 256), (24, 33, 576),
                                     (16, 200, 584), (30, 33, 4100), (32, 70, 256), (48, 17, 64)])
def test_cpu_w8a8_kernel_is_bit_exact_with_the_composed_ops(out_dtype, zero_point, bias, values, m, n, k):
    # gemm_int8.cpp: panels of 64 columns (n = 200: a tail of 8), tiles of 6 rows (13 = 6 + 6 + 1),
    # K in chunks of at most 2048 (4100: three, partial sums through the int32 scratch),
    # transposes of 64 bytes with a masked tail (584 = 9 * 64 + 8); with 2 panels for 64 rows
    # the rows are split between threads too (panels.h).  16, 30, 32 and 48 rows take
    # rows16_linear instead: blocks of 16 activation rows (30: the second one 14 rows; 48: two
    # blocks, then one), 16 weight rows at a time (n = 17, 33: a last tile of one column),
    # the activations' layout with a masked tail of dwords (584 / 4 = 9 * 16 + 2), the
    # weight's row sums with a masked tail of bytes (584 = 9 * 64 + 8).
    if not cpu.available():
        pytest.skip(cpu.load_error())
    if cpu._C.int8_gemm_supported(64):
        assert cpu._C.int8_linear_rows16(m) == (m in (16, 30, 32, 48))
    args = int8_linear_case(m, n, k, values, zero_point, bias, out_dtype)
    # the reference backend composes the op: int8_mm, zero-point correction, epilogue, bias
    assert torch.equal(get_backend("cpu").int8_linear(*args), get_backend("reference").int8_linear(*args))


@pytest.mark.parametrize("values", ["random", "extreme"])
@pytest.mark.parametrize("m, n, k", [(2, 8, 64), (13, 70, 1024), (7, 70, 4100)])
def test_cpu_int8_mm_in_float32_chunks_is_the_exact_integer_product(values, m, n, k):
    # the machines without VNNI: each K chunk's sums stay within 2^24 (exact in float32);
    # "extreme" reaches 128 * 128 * 1024 = 2^24 in every full chunk
    a, b = int8_linear_case(m, n, k, values, False, False, torch.float32)[:3:2]
    assert torch.equal(cpu.int8_mm_f32(a, b), reference.int8_mm(a, b))


@pytest.mark.parametrize("values", ["random", "extreme"])
@pytest.mark.parametrize("m, n, k", [(1, 8, 64), (5, 70, 1024), (4, 33, 17), (9, 20, 4100)])
def test_cpu_int8_mm_rows_is_the_exact_integer_product(values, m, n, k):
    # AVX2 without VNNI, a few rows: int16 vpmaddwd, 32 values a step (17, 4100: a scalar tail),
    # 4 rows at a time (5, 9: one left over); "extreme" sums reach 128 * 128 * 4100 ~ 2^26
    if not cpu.available() or not cpu._C.has_int8_rows():
        pytest.skip("needs lowbit._C built with AVX2")
    a, b = int8_linear_case(m, n, k, values, False, False, torch.float32)[:3:2]
    assert torch.equal(cpu._C.int8_mm_rows(a, b), reference.int8_mm(a, b))


@pytest.mark.parametrize("values", ["random", "extreme"])
@pytest.mark.parametrize("m, n, k", [(1, 8, 64), (5, 70, 1024), (4, 33, 17), (9, 20, 4100), (130, 16, 576),
                                     (6, 1, 3)])
def test_cpu_int8_mm_panels_is_the_exact_integer_product(values, m, n, k):
    # AVX2 without VNNI, many rows: the weight widened into int16 panels of 16 columns (70, 33,
    # 20, 1: a last panel cut short), K in steps of 16 (17, 4100, 3: zeros past K), tiles of
    # 4 rows and a tail; "extreme" sums reach 128 * 128 * 4100 ~ 2^26
    if not cpu.available() or not cpu._C.has_int8_rows():
        pytest.skip("needs lowbit._C built with AVX2")
    a, b = int8_linear_case(m, n, k, values, False, False, torch.float32)[:3:2]
    assert torch.equal(cpu._C.int8_mm_panels(a, b), reference.int8_mm(a, b))


def test_cpu_int8_mm_panels_checks_its_arguments():
    if not cpu.available() or not cpu._C.has_int8_rows():
        pytest.skip("needs lowbit._C built with AVX2")
    a = torch.zeros(3, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"int8 a \[M, K\] and b \[N, K\] expected"):
        cpu._C.int8_mm_panels(a, torch.zeros(2, 9, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="expected"):
        cpu._C.int8_mm_panels(a.to(torch.int16), a)
    with pytest.raises(RuntimeError, match="K must be below 2"):
        cpu._C.int8_mm_panels(torch.zeros(1, 1 << 17, dtype=torch.int8), torch.zeros(1, 1 << 17, dtype=torch.int8))
    assert cpu._C.int8_mm_panels(a[:0], a).shape == (0, 3)


def test_cpu_8bit_activation_plans_without_vnni(monkeypatch):
    # the AVX2 integer kernels: rows for a few rows, panels beyond
    if not cpu.available() or not cpu._C.has_int8_rows():
        pytest.skip("needs lowbit._C built with AVX2")
    plan = cpu._act8_plan
    try:
        monkeypatch.setattr(cpu, "_has_avx512", lambda: False)
        monkeypatch.setattr(cpu._C, "int8_gemm_supported", lambda k: False)
        plan.cache_clear()
        rows = cpu.INT8_ROWS_MAX_M
        assert [plan(8, 576, m, 576).kernel for m in (1, rows, rows + 1)] == ["int8_rows", "int8_rows", "int8_panels"]
        rows = cpu.W4A8_AVX2_ROWS_MAX_M
        assert [plan(4, 64, m, 576).kernel for m in (1, rows, rows + 1)] == ["w4a8_rows", "w4a8_rows", "w4a8_panels"]
        assert plan(4, 16, 1, 576).kernel == "w4a8_int_mm"  # groups of 16: no rows kernel
    finally:
        plan.cache_clear()


def test_cpu_w8a8_takes_the_float32_route_only_without_vnni(monkeypatch):
    plan = cpu._act8_plan
    try:
        monkeypatch.setattr(cpu, "_has_avx512", lambda: False)
        monkeypatch.setattr(cpu, "_C", None)  # no gemm_int8 either
        plan.cache_clear()
        assert plan(8, 576, 64, 576).kernel == "int_mm_f32"
        assert plan(8, 576, 1, 576).kernel == "int_mm"  # one row: torch._int_mm's GEMV
        monkeypatch.setattr(cpu, "_has_avx512", lambda: True)
        plan.cache_clear()
        assert plan(8, 576, 64, 576).kernel == "int_mm"
    finally:
        plan.cache_clear()


def int8_linear_case(m, n, k, values, zero_point, bias, out_dtype):
    """Arguments of ``Backend.int8_linear``: random int8 codes, or "extreme" ones where
    |a . b| = 128 * 128 * K (2^28 of int32's 2^31 at K = 4100)."""
    g = torch.Generator().manual_seed(m * n + k)
    if values == "extreme":
        a = torch.full((m, k), -128, dtype=torch.int8)
        b = torch.where(torch.rand(n, k, generator=g) < 0.5, -128, 127).to(torch.int8)
    else:
        a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    row, col = torch.rand(m, generator=g) * 0.01, torch.rand(n, generator=g).to(torch.bfloat16)
    azp = torch.randint(-128, 128, (m,), generator=g, dtype=torch.int32) if zero_point else None
    bvec = torch.randn(n, generator=g) if bias else None
    return a, azp, b, row, col, bvec, out_dtype


# -- W4A8 (linear_qta8a_qga4w_qta8o) ----------------------------------------------------------
def _qta8o_case(m, n, k, group, zp_kind, values, seed):
    g = torch.Generator().manual_seed(seed)
    if values == "extreme":
        x_q = torch.where(torch.rand(m, k, generator=g) < 0.5, -128, 127).to(torch.int8)
        w_q = torch.full((n, k), 15, dtype=torch.uint8)
    else:
        x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        w_q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    x_scale = torch.rand(m, generator=g) * 0.02 + 1e-3
    x_zp = torch.randint(-20, 21, (m,), generator=g, dtype=torch.int32)
    w_scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    w_zp = {"random": torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8),
            "zero": torch.zeros(n, k // group, dtype=torch.uint8), "none": None}[zp_kind]
    if w_zp is None:
        w_q = (w_q.to(torch.int16) - 8).to(torch.int8)  # symmetric: signed codes
    w_packed = reference.pack(w_q, 4, "u32")
    bias = torch.randn(n, generator=g)
    # Output scale so the int8 range is exercised (some values clamp).
    y = reference.linear_qta8a_qga4w(x_q, x_scale, x_zp, w_packed, w_scales, w_zp, group, bias)
    out_scale = y.abs().amax(dim=1) / 100 + 1e-6
    out_zp = torch.randint(-10, 11, (m,), generator=g, dtype=torch.int32)
    return (x_q, x_scale, x_zp, w_packed, w_scales, w_zp, group, out_scale, out_zp, bias)


def _exact_and_tie_tolerance(args):
    """The exact pre-rounding value v = y / out_scale (float64, from integers) and how far
    the float32 reference may sit from it: gamma_{K+3} * sum|terms| / out_scale, plus the
    division and zero-point addition (2 more roundings of |v|)."""
    x_q, x_scale, x_zp, w_packed, w_scales, w_zp, group, out_scale, out_zp, bias = args
    k = x_q.shape[1]
    x = (x_q.double() - x_zp.double()[:, None]) * x_scale.double()[:, None]
    w = reference.dequantize_weight(w_packed, w_scales.double(), None if w_zp is None else w_zp, 4, group, k,
                                    torch.float64)
    y = x @ w.T + bias.double()
    terms = x.abs() @ w.abs().T + bias.double().abs()
    v = y / out_scale.double()[:, None]
    tol = (gamma(k + 3) * terms / out_scale.double()[:, None] + 4 * U32 * v.abs())
    return v + out_zp.double()[:, None], tol


def _assert_ties_only(args, ref, fast):
    """At most 1 LSB apart, and only where the exact value sits within the reference's
    own rounding error of a .5 tie."""
    assert ref.dtype == fast.dtype == torch.int8
    diff = (ref.int() - fast.int()).abs()
    assert int(diff.max()) <= 1
    if bool((diff > 0).any()):
        exact, tol = _exact_and_tie_tolerance(args)
        distance_to_tie = ((exact - exact.floor()) - 0.5).abs()
        assert bool((distance_to_tie[diff > 0] <= tol[diff > 0]).all())


QTA8O_CASES = [
    (m, n, k, group, zp, values)
    for (m, n, k) in [(1, 8, 64), (7, 24, 256), (64, 48, 512), (3, 16, 4096), (2, 8, 16384)]
    for group in (32, 64, 128) if k % group == 0
    for zp in ("random", "zero", "none")
    for values in ("random", "extreme")
]


# Triton's interpreter runs a K loop in Python: it takes fewer cases at large K (K = 16384
# keeps int32 headroom, extreme values at g128, with and without zero points).
INTERPRETER_QTA8O_CASES = [c for c in QTA8O_CASES if c[2] <= 512 or (c[2] == 4096 and c[3] != 64 and c[4] != "zero")
                           or (c[2] == 16384 and c[3] == 128 and c[4] != "zero" and c[5] == "extreme")]


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("m, n, k, group, zp, values", QTA8O_CASES)
def test_w4a8_qta8o_agrees_with_the_reference_up_to_ties(backend, m, n, k, group, zp, values):
    if backend == "triton" and (m, n, k, group, zp, values) not in INTERPRETER_QTA8O_CASES:
        pytest.skip("triton's interpreter runs the smaller cases only")
    args = _qta8o_case(m, n, k, group, zp, values, seed=m * 1000 + k + group)
    ref = lowbit.ops.linear_qta8a_qga4w_qta8o(*args, backend="reference")
    _assert_ties_only(args, ref, lowbit.ops.linear_qta8a_qga4w_qta8o(*args, backend=backend))
    # The backend's unfused composition (the W4A8 linear, then requantize_per_token) meets the
    # same rule as its fused kernel.
    b = get_backend(backend)
    composed = b.requantize_per_token(b.linear_qta8a_qga4w(*args[:7], args[9]), args[7], args[8])
    _assert_ties_only(args, ref, composed)


@pytest.mark.parametrize("m, n, k, group", [(37, 200, 2304, 128), (9, 70, 1536, 32), (5, 64, 4096, 64),
                                           (64, 64, 1024, 128), (65, 40, 576, 64), (130, 24, 1536, 128)])
@pytest.mark.parametrize("zp", ["random", "none"])
@pytest.mark.parametrize("values", ["random", "extreme"])
def test_cpu_w4a8_panels_agree_with_the_reference_up_to_ties(m, n, k, group, zp, values):
    # With AVX-512 VNNI, beyond 4 rows the cpu backend runs gemm_int8.cpp's panels: 64 columns
    # (200: a tail of 8), 6-row tiles (37 = 6 * 6 + 1, 9, 5), chunks of whole groups near 1024
    # values (2304: 1024 + 1024 + 256), a flush per group; one panel for 64 rows: the rows split
    # between threads.  With AVX2 alone: matmul.cpp's rows kernel up to 64 rows (4 at a time,
    # 37 = 9 * 4 + 1), gemm_a8.cpp's panels beyond (65 = 16 * 4 + 1, 130; panels of 16 columns,
    # 40 and 24: one cut short).
    if not cpu.available():
        pytest.skip(cpu.load_error())
    args = _qta8o_case(m, n, k, group, zp, values, seed=m * 1000 + k + group)
    ref = lowbit.ops.linear_qta8a_qga4w_qta8o(*args, backend="reference")
    _assert_ties_only(args, ref, lowbit.ops.linear_qta8a_qga4w_qta8o(*args, backend="cpu"))


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("k, group", [(576, 32), (576, 64), (576, 96), (640, 128), (512, 256)])
@pytest.mark.parametrize("x_zp", [[-128, 127, 0, -1], [-256, 256, 255, -255], [257, -300, 0, 5], [1500, -1500, 1, 2]])
def test_cpu_w4a8_integers_are_exact_at_extreme_zero_points(k, group, x_zp, signed):
    # Unit scales make every output the exact integer sum_k (x - xz)(u - z): the rows kernels
    # sum u.x and u in int32 lanes and take xz sum u away lane by lane (AVX2 per group,
    # AVX-512 VNNI per block of 128 values, K = 576 ending on a 64-value tail, groups of 256
    # over two blocks); VNNI with groups of 96 per group, as a scalar.  Extreme codes (x =
    # -128 / 127, u = 0 / 15 with zero points, q = -8 / 7 signed) and every row count of the
    # decode kernels (1 to 4, then a tile and a row).
    if not cpu.available():
        pytest.skip(cpu.load_error())
    g = torch.Generator().manual_seed(group + x_zp[0])
    n = 24
    x_q = torch.where(torch.rand(5, k, generator=g) < 0.5, -128, 127).to(torch.int8)
    if signed:
        w_q = torch.where(torch.rand(n, k, generator=g) < 0.5, -8, 7).to(torch.int8)
        w_zp, w_full = None, w_q.long()
    else:
        w_q = torch.where(torch.rand(n, k, generator=g) < 0.5, 0, 15).to(torch.uint8)
        w_zp = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8)
        w_full = w_q.long() - w_zp.long().repeat_interleave(group, 1)
    zp = torch.tensor(x_zp + [x_zp[0]], dtype=torch.int32)
    exact = (x_q.long() - zp.long()[:, None]) @ w_full.T
    w_packed = reference.pack(w_q, 4, "u32")
    ones = torch.ones(n, k // group)
    for m in (1, 2, 3, 4, 5):
        y = get_backend("cpu").linear_qta8a_qga4w(x_q[:m], torch.ones(m), zp[:m], w_packed, ones, w_zp, group, None)
        assert torch.equal(y.double(), exact[:m].double()), m  # every sum below 2^24: exact in float32
    # and the many-row entry (gemm_int8.cpp's panels with VNNI, gemm_a8.cpp's without): 7 rows,
    # a tile and a row, each group's flush taking z sum (x - xz) and xz sum u away in int32
    x7, zp7 = x_q.repeat(2, 1)[:7], zp.repeat(2)[:7]
    y = cpu._C.w4a8_gemm_panels(x7, zp7, w_packed, ones, None if w_zp is None else w_zp.int(), group)
    assert torch.equal(y.double(), ((x7.long() - zp7.long()[:, None]) @ w_full.T).double())


def test_cpu_w4a8_kernel_refuses_zero_points_its_int32_terms_cannot_hold():
    if not cpu.available() or not cpu._C.has_w4a8_rows():
        pytest.skip("no W4A8 rows kernel here")
    w = lowbit.quantize(torch.randn(8, 64), "int4-asym-g32")
    codes, scale, zp = w.codes, w.scale.float().contiguous(), w.zero_point.int().contiguous()
    x_q = torch.zeros(2, 64, dtype=torch.int8)
    kernels = [cpu._C.w4a8_gemm, cpu._C.w4a8_gemm_panels]  # the rows and the many-row entry
    if cpu._C.has_amx_int8():
        kernels.append(cpu._C.w4a8_gemm_amx)
    for kernel in kernels:
        ok = kernel(x_q, torch.tensor([3, -2**20], dtype=torch.int32), codes, scale, zp, 32)
        assert ok.shape == (2, 8)  # 15 * 32 * 2^20 < 2^30; 15 * 32 * 2^22 is not
        with pytest.raises(RuntimeError, match="x_zp"):
            kernel(x_q, torch.tensor([3, 2**22], dtype=torch.int32), codes, scale, zp, 32)
        with pytest.raises(RuntimeError, match="x_zp must be contiguous int32"):
            kernel(x_q, torch.tensor([3], dtype=torch.int32), codes, scale, zp, 32)


@pytest.mark.parametrize("m, n, k, group", [(1, 1, 64, 32), (5, 40, 96, 32), (17, 33, 288, 96), (40, 70, 576, 64),
                                           (129, 24, 1536, 128), (16, 16, 576, 576)])
@pytest.mark.parametrize("zp", [True, False])
def test_cpu_w4a8_amx_gives_the_bits_of_the_vnni_panels(m, n, k, group, zp):
    # gemm_amx.cpp's W4A8 computes gemm_int8.cpp's exact group integers on AMX tiles (tile
    # products of 64 values, or 32 for groups of an odd number of 32s) and the same float
    # FMA per group and column in group order: the same bits.  Tiles of 16 rows and a tail,
    # half panels of 16 columns and a last one cut short.
    if not cpu.available() or not cpu._C.has_amx_int8():
        pytest.skip("no AMX int8 tiles on this machine (or not compiled in)")
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    x_zp = torch.randint(-300, 300, (m,), generator=g, dtype=torch.int32)
    codes = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int32)
    scale = torch.rand(n, k // group, generator=g)
    w_zp = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.int32) if zp else None
    expected = cpu._C.w4a8_gemm_panels(x_q, x_zp, codes, scale, w_zp, group)
    assert torch.equal(cpu._C.w4a8_gemm_amx(x_q, x_zp, codes, scale, w_zp, group), expected)


@pytest.mark.parametrize("group", [8192, 16384])
def test_cpu_w4a8_amx_groups_at_the_float32_limit(group):
    # w4a8_gemm_amx takes int_g = c - xz w_g by one float32 fnmadd where |c| <= 128 * 15 * group
    # stays below 2^24 (groups up to 8192), in int32 beyond: both give float(int_g) as the
    # panels do.  Extreme codes: x_q = -128 (7 of them -127) against u - z = -15 and 15, with
    # zero points xz = 0 and -1000.  At 16384 float(c) would round before the fnmadd and round
    # again: 214302816 for the weight rows with u - z = 15 and xz = -1000, where the exact
    # integer 214302825 rounds to 214302832.
    if not cpu.available() or not cpu._C.has_amx_int8():
        pytest.skip("no AMX int8 tiles on this machine (or not compiled in)")
    n, k = 16, group
    x_q = torch.full((2, k), -128, dtype=torch.int8)
    x_q[:, :7] = -127
    x_zp = torch.tensor([0, -1000], dtype=torch.int32)
    w_q = torch.zeros(n, k, dtype=torch.uint8)
    w_q[n // 2:] = 15
    w_zp = torch.full((n, 1), 15, dtype=torch.int32)
    w_zp[n // 2:] = 0
    codes = reference.pack(w_q, 4, "u32")
    scale = torch.ones(n, 1)
    exact = (x_q.long() - x_zp.long()[:, None]) @ (w_q.long() - w_zp.long()).T
    y = cpu._C.w4a8_gemm_amx(x_q, x_zp, codes, scale, w_zp, group)
    assert torch.equal(y, exact.double().float())  # one rounding of the exact integer
    assert torch.equal(y, cpu._C.w4a8_gemm_panels(x_q, x_zp, codes, scale, w_zp, group))


def test_cpu_w4a8_amx_refuses_zero_points_outside_the_code_range():
    if not cpu.available() or not cpu._C.has_amx_int8():
        pytest.skip("no AMX int8 tiles on this machine (or not compiled in)")
    codes = torch.zeros(16, 8, dtype=torch.int32)
    x_q, x_zp = torch.zeros(2, 64, dtype=torch.int8), torch.zeros(2, dtype=torch.int32)
    for bad in (-1, 16):
        w_zp = torch.full((16, 2), bad, dtype=torch.int32)
        with pytest.raises(RuntimeError, match="w_zp must lie in the 4-bit code range 0..15"):
            cpu._C.w4a8_gemm_amx(x_q, x_zp, codes, torch.ones(16, 2), w_zp, 32)


def test_w4a8_qta8o_is_the_written_reference():
    args = _qta8o_case(5, 16, 128, 32, "random", "random", seed=1)
    x_q, x_scale, x_zp, w_packed, w_scales, w_zp, group, out_scale, out_zp, bias = args
    x = (x_q.float() - x_zp.float()[:, None]) * x_scale[:, None]
    w = lowbit.ops.unpack_int4(w_packed, signed=False).float().reshape(16, 4, 32)
    w = ((w - w_zp.float()[..., None]) * w_scales[..., None]).reshape(16, 128)
    expected = torch.clamp(torch.round((x @ w.T + bias) / out_scale[:, None]) + out_zp[:, None], -128, 127)
    assert torch.equal(lowbit.ops.linear_qta8a_qga4w_qta8o(*args, backend="reference"), expected.to(torch.int8))


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_w4a8_linear_float_output_matches_the_reference(backend):
    qt = lowbit.quantize(torch.randn(40, 256), "int4-asym-g64")
    x = torch.randn(6, 256)
    y_ref = linear(x, qt, act_scheme="int8-asym-token", backend="reference")
    y = linear(x, qt, act_scheme="int8-asym-token", backend=backend)
    q, s, z = lowbit.ops.quantize_per_token(x)
    x_hat = lowbit.ops.dequantize_per_token(q, s, z)
    tol = 2 * gamma(256 + 3) * abs_products(x_hat, qt) + 1e-30
    assert bool(((y.double() - y_ref.double()).abs() <= tol).all())


# -- bad input -------------------------------------------------------------------------------
W4 = lowbit.quantize(torch.randn(16, 64), "int4-asym-g32")
X = torch.randn(2, 64)


@pytest.mark.parametrize("call, err, match", [
    (lambda: quantized_matmul(X, W4.codes, W4.scale, W4.zero_point, bits=4, group_size=48), ValueError,
     "group_size=48 does not divide K=64"),
    (lambda: quantized_matmul(X, W4.codes, W4.scale, W4.zero_point, bits=3, group_size=32), ValueError, "bits"),
    (lambda: quantized_matmul(X[:, :32], W4.codes, W4.scale, W4.zero_point, bits=4, group_size=32), ValueError,
     "codes must have shape"),
    (lambda: quantized_matmul(X, W4.codes.to(torch.uint8), W4.scale, W4.zero_point, bits=4, group_size=32),
     TypeError, "codes must have dtype"),
    (lambda: quantized_matmul(X, W4.codes, W4.scale[:, :1], W4.zero_point, bits=4, group_size=32), ValueError,
     "scale must have shape"),
    (lambda: quantized_matmul(X, W4.codes, W4.scale, W4.zero_point[:1], bits=4, group_size=32), ValueError,
     "zero_point must have shape"),
    (lambda: quantized_matmul(X.long(), W4.codes, W4.scale, W4.zero_point, bits=4, group_size=32), TypeError,
     "input must have dtype"),
    (lambda: quantized_matmul(X, W4.codes, W4.scale, W4.zero_point, bits=4, group_size=32, out=torch.empty(2, 8)),
     ValueError, "out must have shape"),
    (lambda: quantized_matmul(X, W4.codes, W4.scale.to("meta"), W4.zero_point, bits=4, group_size=32),
     ValueError, "scale is on meta"),
    (lambda: quantized_matmul(X, torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 1),
                              torch.zeros(16, 1, dtype=torch.uint8), bits=8, group_size=64), TypeError,
     "codes must have dtype"),  # zero points with int8 (signed, symmetric) codes
    (lambda: linear(X[:, :32], W4), ValueError, "does not match qweight in_features"),
    (lambda: linear(X, W4.codes), TypeError, "qweight must be a lowbit.QTensor"),
    (lambda: linear(X, W4, torch.ones(3)), ValueError, "bias must have shape"),
    (lambda: linear(X, W4, act_scheme="int4-sym-token"), ValueError, "act_scheme: activations are 8-bit"),
    (lambda: linear(X, lowbit.quantize(torch.randn(16, 64), "int8-asym"), act_scheme="int8-sym-token"),
     ValueError, "W8A8 needs an int8 symmetric per-channel weight"),
    (lambda: linear(X, W4, act_scheme="int8-sym-token", act_scale=torch.ones(1)), ValueError,
     "needs a per-tensor act_scheme"),
    (lambda: linear(X, W4, act_scale=torch.ones(1)), ValueError, "need an act_scheme"),
    (lambda: linear(X.double(), W4, act_scheme="int8-sym-token"), TypeError, "float64"),
    (lambda: linear(X, lowbit.quantize(torch.randn(16, 64), "int4-asym-g32-zpfloat"), act_scheme="int8-asym-token"),
     ValueError, "integer weight zero points"),
])
def test_bad_matmul_arguments_are_refused_before_any_work(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_bad_qta8o_arguments_name_the_argument():
    args = list(_qta8o_case(3, 8, 64, 32, "random", "random", seed=0))
    f = lowbit.ops.linear_qta8a_qga4w_qta8o
    for i, bad, match in [
        (0, args[0].to(torch.int32), "x_q must have dtype"),
        (1, args[1][:2], "x_scale must have shape"),
        (2, args[2].float(), "x_zero_point must have dtype"),
        (3, args[3][:, :4], "w_codes must have shape"),
        (4, args[4][:, :1], "w_scale must have shape"),
        (5, args[5].float(), "w_zero_point must be integer"),
        (6, 48, "group_size=48 does not divide"),
        (7, args[7][:1], "out_scale must have shape"),
        (8, args[8].to(torch.int64), "out_zero_point must have dtype"),
        (9, torch.ones(5), "bias must have shape"),
    ]:
        call = list(args)
        call[i] = bad
        with pytest.raises((ValueError, TypeError), match=match):
            f(*call)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme, act", [("int4-asym-g32", None), ("int8-sym", None), ("int8-sym", "int8-sym-token"),
                                         ("int4-asym-g32", "int8-asym-token")])
def test_zero_rows_are_a_no_op(backend, scheme, act):
    w = lowbit.quantize(torch.randn(16, 64), scheme)
    for dtype in (torch.float32, torch.bfloat16):
        y = linear(torch.empty(0, 64, dtype=dtype), w, act_scheme=act, backend=backend)
        assert y.shape == (0, 16) and y.dtype == dtype


@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int8-sym", "int4-sym-g32-f16"])
def test_cpu_dequantize_into_a_buffer_is_dequantize(scheme):
    if not cpu.available():
        pytest.skip(cpu.load_error())
    from lowbit.ops.matmul import weight_parts

    w = lowbit.quantize(torch.randn(48, 128), scheme)
    codes, scale, zp, _, _ = weight_parts(w)
    args = (codes.contiguous(), scale.float().contiguous(), None if zp is None else zp.float().contiguous(),
            w.scheme.bits, zp is None, 128, w.scheme.group_size or 128, 1)
    out = torch.full((48, 128), float("nan"))
    cpu._C.dequantize_into(out, *args)
    assert torch.equal(out, cpu._C.dequantize(*args, torch.float32))
    with pytest.raises(RuntimeError, match="out must be a contiguous tensor of 48 x 128 elements"):
        cpu._C.dequantize_into(torch.empty(47, 128), *args)


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 40])
@pytest.mark.parametrize("k", [1, 8, 511, 512, 513, 1030])
def test_cpu_gemm_f32_is_within_gamma_k_of_the_exact_product(m, n, k):
    # 6 x 16 register tiles (m, n: whole tiles and tails), k in chunks of 512 (511, 512, 513,
    # 1030: one chunk, exactly one, one and a value, three): each output a float32 sum of its
    # k products in order, so within gamma_k * sum |x w| of the exact value.
    if not cpu.available() or not cpu._C.has_gemm_f32():
        pytest.skip("no gemm_f32 here")
    g = torch.Generator().manual_seed(m * 10000 + n * 100 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    y = cpu._C.gemm_f32(x, w)
    exact = x.double() @ w.double().T
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert bool(((y.double() - exact).abs() <= gamma(k) * (x.double().abs() @ w.double().abs().T)).all())


def test_cpu_gemm_f32_gives_a_row_the_same_bits_in_any_batch():
    # every output is its own sum in the order of k, whichever tile (and place in it) its
    # row falls in: a batch's decode step gives each sequence the bits it gets alone
    if not cpu.available() or not cpu._C.has_gemm_f32():
        pytest.skip("no gemm_f32 here")
    x, w = torch.randn(40, 1100), torch.randn(50, 1100)
    y = cpu._C.gemm_f32(x, w)
    for rows in (slice(0, 1), slice(3, 20), slice(17, 18), slice(5, 40)):
        assert torch.equal(cpu._C.gemm_f32(x[rows], w), y[rows])
    assert torch.equal(cpu._C.gemm_f32(x, w[7:30]), y[:, 7:30])


@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int4-sym-g32", "int4-asym-g32-zpfloat-f16", "int8-sym",
                                    "int8-asym-g64", "int4-asym-g32-zpmin-f16"])
@pytest.mark.parametrize("m, n", [(1, 1), (7, 17), (40, 50)])
def test_cpu_weight_only_gemm_f32_is_gemm_f32_of_the_dequantized_weight(scheme, m, n):
    # panels of 16 rows dequantized as the GEMM reaches them (n = 17: a panel of one row):
    # the reference's values, then gemm_f32's sums, bit for bit
    from lowbit.ops.matmul import weight_parts

    if not cpu.available() or not cpu._C.has_gemm_f32():
        pytest.skip("no gemm_f32 here")
    k = 1088  # three chunks of k (512 + 512 + 64)
    qt = lowbit.quantize(torch.randn(n, k), scheme)
    codes, scale, zp, _, _ = weight_parts(qt)
    s, z = scale.float().contiguous(), None if zp is None else zp.float().contiguous()
    group, bits, minimum = qt.scheme.group_size or k, qt.scheme.bits, qt.scheme.zero_point_domain == "min"
    x = torch.randn(m, k)
    y = cpu._C.weight_only_gemm_f32(x, codes.contiguous(), s, z, bits, zp is None, group, minimum)
    w = reference.dequantize_weight(codes, s, z, bits, group, k, torch.float32, zero_point_min=minimum)
    assert torch.equal(y, cpu._C.gemm_f32(x, w))
    if bits == 4:  # the u32x8 words read as bytes are the u8x2 layout: the same weight
        bytes_ = codes.contiguous().view(torch.uint8)
        assert torch.equal(cpu._C.weight_only_gemm_f32(x, bytes_, s, z, 4, zp is None, group, minimum), y)


def test_cpu_weight_only_gemm_f32_refuses_what_does_not_fit():
    if not cpu.available() or not cpu._C.has_gemm_f32():
        pytest.skip("no gemm_f32 here")
    qt = lowbit.quantize(torch.randn(24, 128), "int4-asym-g64")
    codes, s, z = qt.codes, qt.scale.float().contiguous(), qt.zero_point.float().contiguous()
    x = torch.randn(3, 128)
    run = cpu._C.weight_only_gemm_f32
    assert run(x, codes, s, z, 4, False, 64, False).shape == (3, 24)
    with pytest.raises(RuntimeError, match=r"float32 x \[M, K\] on the CPU expected"):
        run(x.double(), codes, s, z, 4, False, 64, False)
    with pytest.raises(RuntimeError, match="the group \\(48\\) must divide K \\(128\\) and be a multiple of 8"):
        run(x, codes, s, z, 4, False, 48, False)
    with pytest.raises(RuntimeError, match="the group \\(4\\) must divide K \\(128\\) and be a multiple of 8"):
        run(x, codes, s.repeat_interleave(16, 1), z.repeat_interleave(16, 1), 4, False, 4, False)
    with pytest.raises(RuntimeError, match=r"scale must be contiguous float32"):
        run(x, codes, s.T.contiguous(), z, 4, False, 64, False)  # [G, N]: the wrong rows
    with pytest.raises(RuntimeError, match="contiguous codes of 4-bit values"):
        run(torch.randn(3, 64), codes, s, z, 4, False, 64, False)
    with pytest.raises(RuntimeError, match="scale must be contiguous float32 \\[N, K / group\\] = \\[24, 2\\]"):
        run(x, codes, s.half(), z, 4, False, 64, False)
    with pytest.raises(RuntimeError, match="zero_point must be contiguous float32"):
        run(x, codes, s, z[:12], 4, False, 64, False)
    with pytest.raises(RuntimeError, match="needs its zero_point"):
        run(x, codes, s, None, 4, False, 64, True)


def test_cpu_gemm_f32_edges_and_bad_input():
    if not cpu.available() or not cpu._C.has_gemm_f32():
        pytest.skip("no gemm_f32 here")
    assert torch.equal(cpu._C.gemm_f32(torch.randn(3, 0), torch.randn(4, 0)), torch.zeros(3, 4))
    assert cpu._C.gemm_f32(torch.randn(0, 8), torch.randn(4, 8)).shape == (0, 4)
    x = torch.randn(20, 64)
    w = torch.randn(64, 40)  # a transposed view: made contiguous, the same product
    assert torch.equal(cpu._C.gemm_f32(x, w.T), cpu._C.gemm_f32(x, w.T.contiguous()))
    with pytest.raises(RuntimeError, match=r"float32 x \[M, K\] and w \[N, K\] on the CPU expected"):
        cpu._C.gemm_f32(x, torch.randn(8, 63))
    with pytest.raises(RuntimeError, match=r"float32 x \[M, K\] and w \[N, K\] on the CPU expected"):
        cpu._C.gemm_f32(x.double(), torch.randn(8, 64).double())


def test_cpu_weight_tiles_keep_autograd_where_x_needs_a_gradient(monkeypatch):
    # gemm_f32 records no graph: where x needs a gradient the tiles go through torch.mm
    _force_gemm_f32(monkeypatch, True)
    qt = lowbit.quantize(torch.randn(96, 256), "int4-asym-g64")
    x = torch.randn(300, 256, requires_grad=True)
    y = cpu._tiles(x, qt.codes, qt.scale, qt.zero_point, 4, 64, torch.float32)
    y.sum().backward()
    w = lowbit.dequantize(qt)
    assert torch.allclose(x.grad, w.sum(0).expand(300, -1), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # and where none is wanted, gemm_f32's bits
        y = cpu._tiles(x, qt.codes, qt.scale, qt.zero_point, 4, 64, torch.float32)
    assert torch.equal(y, cpu._C.gemm_f32(x.detach(), w))


def test_cpu_step_rows_past_dense_rows_run_gemm_f32_with_the_bias(monkeypatch):
    _force_gemm_f32(monkeypatch, True)
    x, w, b = torch.randn(cpu.dense_rows_max_m() + 5, 64), torch.randn(24, 64), torch.randn(24)
    assert torch.equal(cpu.step_linear(x, w, b), cpu._C.gemm_f32(x, w) + b)
    assert torch.equal(cpu.step_linear(x, w, None), cpu._C.gemm_f32(x, w))
    w.requires_grad_(True)  # a gradient wanted: torch's linear, which records it
    y = cpu.step_linear(x, w, b)
    assert y.grad_fn is not None and torch.allclose(y, x @ w.T + b, atol=1e-4)


@pytest.mark.parametrize("gemm_f32", [False, True])
def test_cpu_weight_tiles_reused_across_calls_leave_earlier_results_alone(monkeypatch, request, gemm_f32):
    # the dequantized tiles (or gemm_f32's panels) live in buffers reused by the next call
    # (no fresh multi-MiB allocation per matmul): an earlier result must not be a view of one
    if not cpu.available():
        pytest.skip(cpu.load_error())
    _force_gemm_f32(monkeypatch, gemm_f32)
    # without gemm_bf16.cpp's panels (gemm_f32_fma takes float32 x where they run)
    monkeypatch.setattr(cpu._C, "gemm_bf16_supported", lambda k, group: False)
    cpu.clear_plans()
    request.addfinalizer(cpu.clear_plans)
    x = torch.randn(300, 256)
    # float zero points: the tiles path also where AMX runs (gemm_f32_amx takes integer ones)
    ws = [lowbit.quantize(torch.randn(96, 256), "int4-asym-g64-zpfloat") for _ in range(2)]
    assert cpu.BACKEND.plan(ws[0].scheme, None, 300, 256, torch.float32).kernel == "tiles_f32"
    first = linear(x, ws[0], backend="cpu")
    kept = first.clone()
    second = linear(x, ws[1], backend="cpu")
    assert torch.equal(first, kept) and not torch.equal(first, second)
    assert torch.equal(first, linear(x, ws[0], backend="cpu"))


def test_cpu_scratch_buffers_made_in_inference_mode_serve_calls_outside_it():
    # a buffer first made under torch.inference_mode must stay writable afterwards
    if not cpu.available():
        pytest.skip(cpu.load_error())
    cpu._scratch_buffers.__dict__.clear()
    a = torch.randint(-127, 128, (5, 64), dtype=torch.int8)
    w = lowbit.quantize(torch.randn(96, 256), "int4-asym-g64")
    x = torch.randn(300, 256)
    with torch.inference_mode():
        first = (cpu.int8_mm_f32(a, a), linear(x, w, backend="cpu"))
    assert torch.equal(cpu.int8_mm_f32(a, a), first[0]) and torch.equal(linear(x, w, backend="cpu"), first[1])


def _amx_weight(scheme, n, k, g):
    """(codes, scale, zero_point, bits, group) of a random [n, k] weight as the weight-only
    AMX kernels take them (float32 scales and zero points); skips where no AMX bf16 tiles run."""
    if not cpu.available() or not cpu._C.has_amx_bf16():
        pytest.skip("no AMX bf16 tiles on this machine (or not compiled in)")
    from lowbit.ops.matmul import weight_parts
    codes, s, z, bits, group = weight_parts(lowbit.quantize(torch.randn(n, k, generator=g), scheme))
    return codes.contiguous(), s.float().contiguous(), None if z is None else z.float().contiguous(), bits, group


@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int4-sym-g32", "q4_1", "int8-sym", "int8-asym-g64"])
@pytest.mark.parametrize("m, n, k", [(1, 1, 128), (5, 33, 576), (17, 70, 128), (40, 39, 1536), (64, 6, 576)])
def test_cpu_weight_only_gemm_bf16_rows_are_the_float32_sum_with_the_bf16_weight(scheme, m, n, k):
    # gemm_bf16.cpp up to 64 rows (kRowsMaxM): groups of 4 weight rows dequantized into bf16
    # rows (n = 1, 6, 33, 39: the last group cut short), x's rows 6 at a time (dots.h); the
    # weight is the reference's bf16 dequantization exactly, so only the float32 sums of the
    # exact bf16 products differ from float64: gamma_k sum |x w| (vdpbf16ps flushes float32
    # subnormals, at most 2^-126 per addition); each row summed in one order whatever m is
    if cpu._C is None or not cpu._C.gemm_bf16_supported(k, k if "-g" not in scheme else int(scheme.split("-g")[1])):
        pytest.skip("no AVX512-BF16 GEMM in this build")
    from lowbit.ops.matmul import weight_parts
    g = torch.Generator().manual_seed(m * n + k)
    codes, s, z, bits, group = weight_parts(lowbit.quantize(torch.randn(n, k, generator=g), scheme))
    codes, s, z = codes.contiguous(), s.float().contiguous(), None if z is None else z.float().contiguous()
    x = torch.randn(m, k, generator=g).bfloat16().float()  # bf16 values: exact in the kernel's bf16 x
    kernel = cpu.weight_only_kernel_index("gemm_bf16")

    def run(rows):
        return cpu._C.weight_only_matmul(rows, codes, s, z, bits, group, kernel, False)

    y = run(x)
    w = reference.dequantize_weight(codes, s, z, bits, group, k, torch.bfloat16).double()
    want = x.double() @ w.T
    tol = gamma(k) * (x.double().abs() @ w.abs().T) + k * 2.0**-126
    assert y.dtype == torch.float32 and bool(((y.double() - want).abs() <= tol).all())
    for rows in (1, 5, m):
        assert torch.equal(run(x[:rows]), y[:rows])
    assert torch.equal(run(x[m - 1:]), y[m - 1:])
    # rows of the identity read the dequantized weight back exactly (4-bit codes by their
    # table, 8-bit ones converted): column j of W, 64 at a time
    for j in range(0, k, 64):
        assert torch.equal(run(torch.eye(k)[j:j + 64]), w.T[j:j + 64].float())


@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int8-sym", "q4_1"])
@pytest.mark.parametrize("m, n, k", [(40, 33, 576), (65, 70, 256), (130, 70, 2304), (300, 33, 3328)])
def test_cpu_weight_only_gemm_bf16_gives_bf16_x_the_float32_sums_rounded_once(scheme, m, n, k):
    # bf16 x: the panels round each float32 sum to bf16 in their store (K = 2304 and 3328 in
    # two and three chunks, their partial sums kept in float32 in between; 256 in one), the
    # rows path (m <= 64) after its sums: the bits of the float32 result .to(bfloat16)
    if cpu._C is None or not cpu._C.gemm_bf16_supported(k, 64):
        pytest.skip("no AVX512-BF16 GEMM in this build")
    from lowbit.ops.matmul import weight_parts
    g = torch.Generator().manual_seed(m + n + k)
    codes, s, z, bits, group = weight_parts(lowbit.quantize(torch.randn(n, k, generator=g), scheme))
    codes, s, z = codes.contiguous(), s.float().contiguous(), None if z is None else z.float().contiguous()
    x = torch.randn(m, k, generator=g).bfloat16()
    kernel = cpu.weight_only_kernel_index("gemm_bf16")
    y = cpu._C.weight_only_matmul(x, codes, s, z, bits, group, kernel, scheme == "q4_1")
    y32 = cpu._C.weight_only_matmul(x.float(), codes, s, z, bits, group, kernel, scheme == "q4_1")
    assert y.dtype == torch.bfloat16 and y32.dtype == torch.float32 and torch.equal(y, y32.bfloat16())


@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int4-sym-g32", "int8-sym", "int8-asym-g64", "q4_1",
                                    "int8-asym-g64-zpmin"])
@pytest.mark.parametrize("m, n, k", [(1, 1, 128), (7, 33, 576), (65, 70, 256), (130, 64, 2304), (40, 129, 3328)])
def test_cpu_weight_only_gemm_fma_is_the_float32_sum_with_the_bf16_weight(scheme, m, n, k):
    # gemm_bf16.cpp's panels on float32 FMAs (gemm_fma): the weight is the reference's bf16
    # dequantization exactly (widened), x rounded to bf16, so every product is exact and only
    # the float32 sums differ from float64: gamma_k sum |x w| (K = 2304 and 3328 in two and three
    # chunks, their partial sums kept in float32 in between; m = 7, 65, 130: tiles of 6 rows and
    # tails; n = 33, 70, 129: the last panel of 64 cut short).  Each output sums k in order
    # whatever the other rows, so a row has its bits whatever m is; bf16 x gets the float32
    # result rounded once.
    if cpu._C is None or not cpu._C.gemm_bf16_supported(k, 32):
        pytest.skip("no AVX512-BF16 GEMM in this build")
    from lowbit.ops.matmul import weight_parts
    g = torch.Generator().manual_seed(m * n + k)
    qt = lowbit.quantize(torch.randn(n, k, generator=g), scheme)
    codes, s, z, bits, group = weight_parts(qt)
    codes, s, z = codes.contiguous(), s.float().contiguous(), None if z is None else z.float().contiguous()
    zmin = qt.scheme.zero_point_domain == "min"
    x = torch.randn(m, k, generator=g).bfloat16()
    kernel = cpu.weight_only_kernel_index("gemm_fma")

    def run(rows):
        return cpu._C.weight_only_matmul(rows, codes, s, z, bits, group, kernel, zmin)

    y = run(x.float())
    w = reference.dequantize_weight(codes, s, z, bits, group, k, torch.bfloat16, zero_point_min=zmin).double()
    want = x.double() @ w.T
    tol = gamma(k) * (x.double().abs() @ w.abs().T)
    assert y.dtype == torch.float32 and bool(((y.double() - want).abs() <= tol).all())
    for rows in (1, min(m, 6), m - 1):
        assert torch.equal(run(x[:rows].float()), y[:rows])
    assert torch.equal(run(x[m - 1:].float()), y[m - 1:])
    yb = run(x)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.bfloat16())
    for j in range(0, k, 64):  # rows of the identity read the bf16 weight back exactly
        assert torch.equal(run(torch.eye(k)[j:j + 64]), w.T[j:j + 64].float())


@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int4-sym-g32", "int8-sym", "int8-asym-g64", "q4_1",
                                    "int8-asym-g64-zpmin", "int4-asym-g32-zpfloat-f16"])
@pytest.mark.parametrize("m, n, k", [(1, 1, 128), (7, 33, 576), (65, 70, 256), (130, 64, 2304), (40, 129, 3328)])
def test_cpu_weight_only_gemm_f32_fma_is_the_float32_sum_with_the_reference_weight(scheme, m, n, k):
    # gemm_f32_fma: gemm_fma's panels holding the reference's float32 weight, x as it is: the
    # products are float32 FMAs of the reference's operands, so the result is within gamma_k
    # sum |x w| of the exact float64 sum (chunks of K, tiles and short panels as above); each
    # output sums k in order, so a row has its bits whatever m is; and where x and the weight
    # are bf16 values (scales powers of two) it is gemm_fma's chain, bit for bit.
    if cpu._C is None or not cpu._C.gemm_bf16_supported(k, 32):
        pytest.skip("no AVX512-BF16 GEMM in this build")
    from lowbit.ops.matmul import weight_parts
    g = torch.Generator().manual_seed(m * n + k + 1)
    qt = lowbit.quantize(torch.randn(n, k, generator=g), scheme)
    codes, s, z, bits, group = weight_parts(qt)
    codes, s, z = codes.contiguous(), s.float().contiguous(), None if z is None else z.float().contiguous()
    zmin = qt.scheme.zero_point_domain == "min"
    x = torch.randn(m, k, generator=g)
    kernel = cpu.weight_only_kernel_index("gemm_f32_fma")

    def run(rows, scale=s, zp=z, index=kernel):
        return cpu._C.weight_only_matmul(rows, codes, scale, zp, bits, group, index, zmin)

    y = run(x)
    w = reference.dequantize_weight(codes, s, z, bits, group, k, torch.float32, zero_point_min=zmin).double()
    tol = gamma(k) * (x.double().abs() @ w.abs().T)
    assert y.dtype == torch.float32 and bool(((y.double() - x.double() @ w.T).abs() <= tol).all())
    for rows in (1, min(m, 6), m - 1):
        assert torch.equal(run(x[:rows]), y[:rows])
    assert torch.equal(run(x[m - 1:]), y[m - 1:])
    for j in range(0, k, 64):  # rows of the identity read the float32 weight back exactly
        assert torch.equal(run(torch.eye(k)[j:j + 64]), w.T[j:j + 64].float())
    if zmin or (z is not None and not torch.equal(z, z.round())):
        return  # q * s + m, and (q - z) * s with z off the integers, are not bf16 values
    pow2 = torch.exp2(torch.log2(s).round())  # (q - z) * 2^e: a bf16 value for |q - z| < 256
    xb = x.bfloat16().float()
    assert torch.equal(run(xb, pow2), run(xb, pow2, index=cpu.weight_only_kernel_index("gemm_fma")))


def test_cpu_plan_takes_the_fma_gemm_where_bf16_dot_products_are_slow(monkeypatch):
    # gemm_fma where fma_over_bf16_dots (measured, or LOWBIT_FMA_GEMM), from FMA_GEMM_MIN_M + 1
    # rows of bf16 x, never for float32 x at "highest" (its own exact kernels)
    if cpu._C is None or not cpu._C.gemm_bf16_supported(576, 64) or cpu._amx():
        pytest.skip("no AVX512-BF16 GEMM in this build, or AMX runs the GEMMs")
    fma, dot = cpu.bf16_dot_cost()
    assert 0 < fma < 100 and 0 < dot < 100
    s = QuantScheme.parse("int4-asym-g64")
    big = cpu.FMA_GEMM_MIN_M + 1
    try:
        for forced, want in (("1", "gemm_fma"), ("0", "gemm_bf16")):
            monkeypatch.setenv("LOWBIT_FMA_GEMM", forced)
            cpu.clear_plans()
            assert cpu.BACKEND.plan(s, None, big, 576, torch.bfloat16).kernel == want
            assert cpu.BACKEND.plan(s, None, cpu.FMA_GEMM_MIN_M, 576, torch.bfloat16).kernel != "gemm_fma"
            assert cpu.BACKEND.plan(s, None, big, 576, torch.float32).kernel != "gemm_fma"
        monkeypatch.delenv("LOWBIT_FMA_GEMM")
        cpu.clear_plans()
        want = "gemm_fma" if dot > cpu.BF16_DOT_SLOW * 2 * fma else "gemm_bf16"
        assert cpu.BACKEND.plan(s, None, big, 576, torch.bfloat16).kernel == want
    finally:
        cpu.clear_plans()


@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int4-sym-g32", "int8-sym", "int8-asym-g64", "q4_1",
                                    "int8-asym-g64-zpmin"])
@pytest.mark.parametrize("m, n, k", [(1, 1, 128), (5, 33, 576), (17, 70, 128), (40, 32, 1536), (140, 33, 576),
                                     (300, 70, 128)])
def test_cpu_weight_only_gemm_bf16_amx_is_the_float32_sum_with_the_bf16_weight(scheme, m, n, k):
    # amx_linear.cpp: blocks of 32 weight rows dequantized into bf16 A tiles (n = 1, 33, 70:
    # the last block cut short), one or two tiles of rows (m = 17, 40: two and a tail); from
    # PACKED_WEIGHT_MIN_M = 128 rows the blocks packed as B tiles and the rows read as A tiles
    # (m = 140, 300: the last 12 rows a half tile, the last 44 one and a half);
    # the weight is the reference's bf16 dequantization exactly, so only the float32 sums
    # of the exact bf16 products differ from float64: gamma_k sum |x w| (the tiles flush
    # float32 subnormals, at most 2^-126 per addition)
    g = torch.Generator().manual_seed(m * n + k)
    codes, s, z, bits, group = _amx_weight(scheme, n, k, g)
    zmin = QuantScheme.parse(scheme).zero_point_domain == "min"  # q * s + m
    x = torch.randn(m, k, generator=g).bfloat16()
    y = cpu._C.weight_only_gemm_bf16_amx(x.float(), codes, s, z, bits, group, zmin)
    w = reference.dequantize_weight(codes, s, z, bits, group, k, torch.bfloat16, zero_point_min=zmin).double()
    want = x.double() @ w.T
    tol = gamma(k) * (x.double().abs() @ w.abs().T) + k * 2.0**-126
    assert y.dtype == torch.float32 and bool(((y.double() - want).abs() <= tol).all())
    for rows in (1, m):  # each row's bits whatever the number of rows
        assert torch.equal(cpu._C.weight_only_gemm_bf16_amx(x[:rows].float(), codes, s, z, bits, group, zmin),
                           y[:rows])
    # bf16 x: the same sums rounded once to bf16, without a float32 y
    assert torch.equal(cpu._C.weight_only_gemm_bf16_amx(x, codes, s, z, bits, group, zmin), y.bfloat16())


@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int4-sym-g32", "int4-asym-g128", "int8-sym", "int8-asym-g64",
                                    "q4_1", "int8-asym-g64-zpmin"])
@pytest.mark.parametrize("zero_point", ["integer", "fractional"])
def test_cpu_weight_only_gemm_bf16_amx_dequantizes_to_the_reference_bf16_weight_bit_for_bit(scheme, zero_point):
    # amx_linear.cpp's dequant_block (4-bit codes through a per-group table of their 16
    # values): x = the identity picks each weight value alone, y = bf16 w exactly (one exact
    # product, the other terms +0 or -0); every code of every group is read (groups of
    # 32, 64 and 128 along k = 640), and 70 rows leave the last block of 32 short.  640 rows
    # of x take the packed-weight layout; the rows layout dequantizes with the same function.
    g = torch.Generator().manual_seed(7)
    n, k = 70, 640
    codes, s, z, bits, group = _amx_weight(scheme, n, k, g)
    zmin = QuantScheme.parse(scheme).zero_point_domain == "min"  # q * s + m: the mins are floats anyway
    if zmin and zero_point == "fractional":
        pytest.skip("the min domain's zero points are the float mins")
    if z is not None and zero_point == "fractional":  # float zero points: (q - z) s rounded once
        z = (z + torch.rand(z.shape, generator=g) - 0.5).contiguous()
    elif z is None and zero_point == "fractional":
        pytest.skip("symmetric codes have no zero point")
    want = reference.dequantize_weight(codes, s, z, bits, group, k, torch.bfloat16, zero_point_min=zmin)
    y = cpu._C.weight_only_gemm_bf16_amx(torch.eye(k, dtype=torch.bfloat16), codes, s, z, bits, group, zmin)
    assert torch.equal(y.T.contiguous().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("scheme", ["int4-asym-g64", "int4-sym-g32", "int8-sym", "int8-asym-g64", "int4-asym-channel",
                                    "q4_1", "int8-asym-g64-zpmin"])
@pytest.mark.parametrize("m, n, k", [(1, 1, 128), (7, 33, 576), (17, 70, 128), (40, 32, 1536), (300, 70, 128)])
def test_cpu_weight_only_gemm_f32_amx_sums_exact_products_of_float32_x(scheme, m, n, k):
    # amx_linear.cpp's exact_run: x = x1 + x2 + x3 (three bf16 parts, exactly), q - z exact in
    # bf16, so every product is exact; each group's 3 * group products are float32 sums on the
    # tiles, then times s added over the G groups in float32: within gamma_(3 group + G) of
    # sum |x| |q - z| |s| (the tiles flush float32 subnormals, 2^-126 per addition).  The "min"
    # domain (q * s + m): the tiles take q, and each group adds m times x's float32 sum over it
    # (group / 16 + 4 roundings, inside the 3 group) with one more FMA: gamma_(3 group + 2 G) of
    # sum |x| (|q s| + |m|).  m = 1, 7, 17: a single tile of rows (the second skipped), 40: one
    # block of 32 rows and a tail (both in exact_few_rows' layout), 300: nine blocks and a tail
    # in the other layout, its first row also alone in the first; n = 1, 33, 70: blocks of 32
    # weight rows cut short
    g = torch.Generator().manual_seed(m * n + k)
    codes, s, z, bits, group = _amx_weight(scheme, n, k, g)
    zmin = QuantScheme.parse(scheme).zero_point_domain == "min"
    # magnitudes over 2^-20 .. 2^20, so every part of x matters
    x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-20, 21, (m, k), generator=g)
    y = cpu._C.weight_only_gemm_f32_amx(x, codes, s, z, bits, group, zmin)
    q = reference.dequantize_weight(codes, torch.ones_like(s), None if zmin else z, bits, group, k,
                                    torch.float64)  # q - z, or the min domain's q
    w = reference.dequantize_weight(codes, s, z, bits, group, k, torch.float64, zero_point_min=zmin)
    want = x.double() @ w.T
    if zmin:
        s_k, m_k = (t.double().repeat_interleave(group, 1) for t in (s, z))
        terms = x.double().abs() @ (q.abs() * s_k.abs() + m_k.abs()).T
        tol = gamma(3 * group + 2 * (k // group)) * terms + 2 * k * 2.0**-126 * (s.abs().max() + z.abs().max()).item()
    else:
        terms = x.double().abs() @ w.abs().T
        tol = gamma(3 * group + k // group) * terms + k * 2.0**-126 * s.abs().max().item()
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert bool(((y.double() - want).abs() <= tol).all()), float(((y.double() - want).abs() / terms).max())
    assert bool((q.abs() <= 255).all())  # the integers the tiles take exactly
    for rows in (1, m):  # each row's bits whatever the number of rows
        assert torch.equal(cpu._C.weight_only_gemm_f32_amx(x[:rows], codes, s, z, bits, group, zmin), y[:rows])


def test_cpu_weight_only_gemm_f32_amx_keeps_infinities_and_checks_its_zero_points():
    codes, s, z, bits, group = _amx_weight("int4-asym-g64", 40, 128, torch.Generator().manual_seed(0))
    x = torch.randn(3, 128)
    x[1, 5], x[2, 7] = float("inf"), float("nan")
    y = cpu._C.weight_only_gemm_f32_amx(x, codes, s, z, bits, group, False)
    want = x @ reference.dequantize_weight(codes, s, z, bits, group, 128, torch.float32).T
    # an infinite x is its first part (x - x1 would be inf - inf): the reference's inf * w
    assert torch.equal(torch.isinf(y), torch.isinf(want)) and torch.equal(torch.isnan(y), torch.isnan(want))
    assert torch.equal(y[1][torch.isinf(y[1])], want[1][torch.isinf(want[1])]) and bool(torch.isnan(y[2]).all())
    with pytest.raises(RuntimeError, match="integer zero points expected"):
        cpu._C.weight_only_gemm_f32_amx(x, codes, s, z + 0.5, bits, group, False)
    with pytest.raises(RuntimeError, match="float32 x"):
        cpu._C.weight_only_gemm_f32_amx(x.bfloat16(), codes, s, z, bits, group, False)
    with pytest.raises(RuntimeError, match="zero_point_min needs the mins"):
        cpu._C.weight_only_gemm_f32_amx(x, codes, s, None, bits, group, True)


def test_cpu_plan_runs_exact_amx_tiles_for_float32_at_highest_precision(monkeypatch):
    # float32 x at "highest" past the decode kernels: gemm_f32_amx for integer zero points (or
    # none) and the "min" domain (q exact, m times x's group sums); float zero points keep the
    # float32 tiles (q - z not exact in bf16)
    if not cpu.available() or not cpu._C.has_amx_bf16() or not cpu._amx():
        pytest.skip("no AMX bf16 tiles on this machine (or not compiled in)")
    plan = get_backend("cpu").plan
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    rows = cpu.GEMV_MAX_M + 1
    for scheme in ("int4-asym-g64", "int4-sym-g32", "int8-sym", "int8-asym-g64", "int4-asym-channel",
                   "int4-asym-g32-zpmin-f16"):
        assert plan(QuantScheme.parse(scheme), None, rows, 576, torch.float32).kernel == "gemm_f32_amx", scheme
    assert plan(QuantScheme.parse("int4-asym-g32-zpfloat-f16"), None, rows, 576, torch.float32).kernel == "tiles_f32"
    assert plan(QuantScheme.parse("int4-asym-g64"), None, rows - 1, 576, torch.float32).kernel == "gemv_f32"
    assert plan(QuantScheme.parse("int4-asym-g64"), None, rows, 80, torch.float32).kernel == "tiles_f32"  # K % 32
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert plan(QuantScheme.parse("int4-asym-g64"), None, rows, 576, torch.float32).kernel == "gemm_bf16_amx"


def test_cpu_plan_runs_amx_bf16_tiles_where_amx_runs():
    # the rows of test_weight_only_gemm_rows_matches_the_reference past the decode kernels run
    # weight_only_gemm_bf16_amx here (its 32-row steps, a 16-row half step, the bf16 panels),
    # and bf16 tiles through torch.mm beyond AMX_BF16_GEMM_MAX_M rows
    if not cpu.available() or not cpu._C.has_amx_bf16() or not cpu._amx():
        pytest.skip("no AMX bf16 tiles on this machine (or not compiled in)")
    plan = get_backend("cpu").plan
    w = QuantScheme.parse("int4-asym-g64")
    assert plan(w, None, 20, 576, torch.bfloat16).kernel == "gemm_bf16_amx"
    assert plan(QuantScheme.parse("int8-sym"), None, 129, 576, torch.bfloat16).kernel == "gemm_bf16_amx"
    assert plan(w, None, cpu.AMX_BF16_GEMM_MAX_M + 1, 576, torch.bfloat16).kernel == "tiles_bf16"
    # q * s + m weights too: the tiles dequantize q * s + m, the decode kernels take 128 s - m
    q4_1 = QuantScheme.parse("int4-asym-g32-zpmin-f16")
    assert plan(q4_1, None, 20, 576, torch.bfloat16).kernel == "gemm_bf16_amx"
    assert plan(q4_1, None, 8, 576, torch.bfloat16).kernel == "gemv_bf16_amx"
    assert plan(q4_1, None, 1, 576, torch.bfloat16).kernel == "gemv_bf16"


@pytest.mark.parametrize("m, n, k", [(1, 1, 64), (5, 40, 128), (16, 32, 576), (17, 33, 576), (40, 70, 1536),
                                     (64, 17, 64), (65, 33, 576), (129, 24, 4160), (300, 70, 576)])
@pytest.mark.parametrize("values", ["random", "extreme"])
def test_cpu_int8_mm_amx_gives_torch_int_mm_integers(m, n, k, values):
    # exact int32 sums on AMX tiles (tdpbssd): the same integers as torch._int_mm whatever
    # the order; blocks of 32 weight rows (n = 1, 17, 33, 70: the last one cut short) times
    # 32 rows of a (m = 1, 5, 17: one rows tile; 40, 65, 129: two and a last single one);
    # "extreme" sums reach 128 * 128 * 4160 ~ 2^26; from 128 rows (129, 300) the weight
    # blocks packed as B tiles, the rows of a read as stored
    if not cpu.available() or not cpu._C.has_amx_int8():
        pytest.skip("no AMX int8 tiles on this machine (or not compiled in)")
    a, _, b, *_ = int8_linear_case(m, n, k, values, False, False, torch.float32)
    assert torch.equal(cpu._C.int8_mm_amx(a, b), torch._int_mm(a, b.T))
    assert torch.equal(cpu._C.int8_mm_amx(a[:0], b), torch.zeros(0, n, dtype=torch.int32))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_point, bias", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("values", ["random", "extreme"])
@pytest.mark.parametrize("m, n, k", [(2, 8, 64), (17, 33, 576), (40, 70, 1536), (129, 24, 4160), (150, 33, 576)])
def test_cpu_int8_linear_amx_is_bit_exact_with_the_composed_ops(out_dtype, zero_point, bias, values, m, n, k):
    # amx_linear.cpp's epilogue (int8_epilogue.h, gemm_int8.cpp's) on the transposed C tiles,
    # the weight's row sums for the zero-point term taken from the tiles' rows
    if not cpu.available() or not cpu._C.has_amx_int8():
        pytest.skip("no AMX int8 tiles on this machine (or not compiled in)")
    args = int8_linear_case(m, n, k, values, zero_point, bias, out_dtype)
    assert torch.equal(cpu._C.int8_linear_amx(*args), get_backend("reference").int8_linear(*args))
    a, azp, b, row, *rest = args
    assert cpu._C.int8_linear_amx(a[:0], None if azp is None else azp[:0], b, row[:0], *rest).shape == (0, n)


@pytest.mark.parametrize("kernel", ["int8_linear", "int8_linear_amx"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cpu_int8_linear_keeps_subnormal_outputs_as_the_composed_ops_round_them(kernel, out_dtype):
    # scales of 1e-22 make every product (acc * row) * col a float32 subnormal (~1e-41): the
    # fused epilogue must round those to bf16 as .to(bfloat16) does (subnormals kept), not as
    # vcvtneps2bf16, which flushes them to zero
    if not cpu.available() or (kernel == "int8_linear_amx" and not cpu._C.has_amx_int8()):
        pytest.skip("no AMX int8 tiles on this machine (or not compiled in)")
    if kernel == "int8_linear" and not cpu._C.int8_gemm_supported(64):
        pytest.skip("no int8_linear kernel on this machine")
    a, azp, b, row, col, _, _ = int8_linear_case(17, 40, 64, "random", True, False, out_dtype)
    row, col = torch.full_like(row, 1e-22), torch.full_like(col, 1e-22)
    args = (a, azp, b, row, col, None, out_dtype)
    want = get_backend("reference").int8_linear(*args)
    assert bool((want.float().abs() < torch.finfo(torch.float32).tiny).any() & (want != 0).any())
    assert torch.equal(getattr(cpu._C, kernel)(*args), want)


def test_cpu_int8_mm_amx_refuses_what_it_does_not_take():
    if not cpu.available() or not cpu._C.has_amx_int8():
        pytest.skip("no AMX int8 tiles on this machine (or not compiled in)")
    a = torch.zeros(3, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="K must be a multiple of 64"):
        cpu._C.int8_mm_amx(a[:, :40], a[:, :40])
    with pytest.raises(RuntimeError, match=r"int8 a \[M, K\] and b \[N, K\] expected"):
        cpu._C.int8_mm_amx(a, a.to(torch.int16))
    with pytest.raises(RuntimeError, match=r"int8 a \[M, K\] and b \[N, K\] expected"):
        cpu._C.int8_mm_amx(a, a[:, :32])
    one = torch.ones(3)
    with pytest.raises(RuntimeError, match="K must be a multiple of 64"):
        cpu._C.int8_linear_amx(a[:, :40], None, a[:, :40], one, one, None, torch.float32)
    with pytest.raises(RuntimeError, match=r"row_scale and a_zero_point \[M\], col_scale and bias \[N\]"):
        cpu._C.int8_linear_amx(a, None, a, one[:2], one, None, torch.float32)
    with pytest.raises(RuntimeError, match="unsupported out dtype"):
        cpu._C.int8_linear_amx(a, None, a, one, one, None, torch.int32)


def test_cpu_int8_linear_refuses_what_it_does_not_take():
    if not cpu.available() or not cpu._C.int8_gemm_supported(64):
        pytest.skip("no VNNI int8 GEMM in this build")
    a, one = torch.zeros(3, 64, dtype=torch.int8), torch.ones(3)
    with pytest.raises(RuntimeError, match="K must be a multiple of 4"):
        cpu._C.int8_linear(a[:, :42], None, a[:, :42], one, one, None, torch.float32)
    with pytest.raises(RuntimeError, match=r"int8 a \[M, K\] and b \[N, K\] expected"):
        cpu._C.int8_linear(a, None, a[:, :32], one, one, None, torch.float32)
    for row, col, zp, bias in ((one[:2], one, None, None), (one, one[:2], None, None),
                               (one, one, torch.zeros(2, dtype=torch.int32), None), (one, one, None, one[:2])):
        with pytest.raises(RuntimeError, match=r"row_scale and a_zero_point \[M\], col_scale and bias \[N\]"):
            cpu._C.int8_linear(a, zp, a, row, col, bias, torch.float32)
    with pytest.raises(RuntimeError, match="unsupported out dtype"):
        cpu._C.int8_linear(a, None, a, one, one, None, torch.int32)


def test_cpu_w8a8_plan_takes_the_amx_tiles_from_their_row_count():
    if not cpu.available() or not cpu._C.has_amx_int8():
        pytest.skip("no AMX int8 tiles on this machine (or not compiled in)")
    plan = cpu._act8_plan
    rows = cpu.AMX_INT8_MIN_M
    assert plan(8, 576, rows, 576).kernel == "int8_amx" and plan(8, 576, 512, 1536).kernel == "int8_amx"
    assert plan(8, 576, rows - 1, 576).kernel != "int8_amx"
    assert plan(8, 96, 512, 96).kernel != "int8_amx"  # K not a multiple of 64
