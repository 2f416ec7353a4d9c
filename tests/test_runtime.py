"""The runtime's attention kernels (one new token, and many: a prefill) against a float64 reference."""

import math

import pytest
import torch

from lowbit.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available() or not hasattr(cpu._C, "decode_attention"),
                                reason="needs lowbit._C")


def gamma(k: int, u: float = 2.0**-24) -> float:
    return k * u / (1 - k * u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# hd 36: the scalar path (not a multiple of 8), over several chunks of 64 positions too; on
# AVX-512, hd a multiple of 64 runs 4 query heads of a group at a time (groups of 6 and 10:
# partial ones), rows of 64 and 128 values in registers, 192 not
@pytest.mark.parametrize("heads, kv_heads, n, hd", [(9, 3, 1, 64), (9, 3, 37, 64), (9, 3, 64, 64), (9, 3, 65, 64),
                                                    (8, 8, 600, 64), (4, 1, 129, 64), (6, 2, 200, 36),
                                                    (12, 2, 100, 128), (10, 1, 70, 192), (16, 16, 17, 128)])
def test_decode_attention_matches_float64_softmax_attention(dtype, heads, kv_heads, n, hd):
    cap = 640
    q = torch.randn(heads, hd).to(dtype)
    k = torch.randn(kv_heads, cap, hd).to(dtype)
    v = torch.randn(kv_heads, cap, hd).to(dtype)
    scale = hd ** -0.5
    out = cpu._C.decode_attention(q, k, v, n, scale)
    assert out.dtype == dtype and out.shape == (heads, hd)
    rep = heads // kv_heads
    kd, vd = k[:, :n].double().repeat_interleave(rep, 0), v[:, :n].double().repeat_interleave(rep, 0)
    scores = torch.einsum("hd,hsd->hs", q.double(), kd) * scale
    want = torch.einsum("hs,hsd->hd", torch.softmax(scores, -1), vd)
    # float32 on inputs exact in float32: each score is a hd-term dot product (gamma_{hd+1}
    # of sum|q k| * scale); a score error e changes a weight by a factor exp(+-e) and exp
    # adds a few units; the weighted sum of n values and the division add gamma_{n+2};
    # all of it scales max|v| (the output is a convex combination of the rows of V);
    # then one rounding to dtype.
    dot_err = gamma(hd + 1) * float((q.double().abs()[:, None] * kd.abs()).sum(-1).max()) * scale
    tol = (2 * dot_err + 4 * 2.0**-24 + gamma(n + 2)) * 2 * float(vd.abs().max())
    unit = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    err = (out.double() - want).abs()
    assert bool((err <= tol + unit * want.abs()).all()), float(err.max())


def test_decode_attention_gives_the_same_bits_on_any_number_of_threads():
    # work items of 64 positions of a kv head, merged per head in order after the parallel loop
    q, k, v = torch.randn(9, 64), torch.randn(3, 400, 64), torch.randn(3, 400, 64)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(cpu._C.decode_attention(q, k, v, 333, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_decode_attention_refuses_bad_sizes():
    q, kv = torch.randn(9, 64), torch.randn(3, 8, 64)
    with pytest.raises(RuntimeError, match="sizes"):
        cpu._C.decode_attention(q, kv, kv, 9, 1.0)  # more positions than the cache holds
    with pytest.raises(RuntimeError, match="dtypes"):
        cpu._C.decode_attention(q.double(), kv, kv, 4, 1.0)
    assert math.isfinite(float(cpu._C.decode_attention(q, kv, kv, 1, 1.0).sum()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [576, 4096, 37])
def test_rms_norm_rows_matches_float64(dtype, d):
    x = (torch.randn(3, d) * 4).to(dtype)
    w = torch.rand(d).to(dtype) + 0.5
    out = cpu._C.rms_norm_rows(x, w, 1e-5)
    xd = x.double()
    normed = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5)
    # float32: the sum of d squares (gamma_{d+1} relative), the division, sqrt and
    # reciprocal (a few units) move 1/rms by <= (gamma_{d+1} / 2 + 4u); then the product
    # is rounded to dtype (unit u_T), multiplied by w and rounded again (u_T each)
    unit = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    rel = gamma(d + 1) / 2 + 4 * 2.0**-24 + 2 * unit + unit * unit
    want = normed.to(dtype).double() * w.double()
    assert bool(((out.double() - normed * w.double()).abs() <= rel * want.abs() * 1.01 + 1e-30).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, heads, hd", [(1, 9, 64), (300, 3, 64), (7, 2, 6)])
def test_rope_has_the_bits_of_runners_aten_ops(dtype, n, heads, hd):
    x = (torch.randn(n, heads, hd) * 3).to(dtype)
    angle = torch.rand(n, 1, hd) * 100
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    rot = torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), dim=-1)
    assert torch.equal(cpu.rope(x, cos, sin), x * cos + rot * sin)


def test_rope_refuses_bad_shapes():
    x = torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="cos and sin of N rows"):
        cpu.rope(x, torch.ones(3, 8), torch.ones(3, 8))
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu.rope(x, torch.ones(4, 8).double(), torch.ones(4, 8).double())
    with pytest.raises(RuntimeError, match=r"x \[N, heads, head_dim\]"):
        cpu.rope(x[0], torch.ones(1, 8), torch.ones(1, 8))


def test_rms_norm_rows_normalizes_each_row_as_alone():
    # a prefill's rows are spread over the threads: each row has the bits it has alone
    x, w = torch.randn(300, 576).bfloat16(), torch.rand(576).bfloat16() + 0.5
    out = cpu._C.rms_norm_rows(x, w, 1e-5)
    assert all(torch.equal(out[i:i + 1], cpu._C.rms_norm_rows(x[i:i + 1], w, 1e-5)) for i in range(300))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_rows_is_decode_attention_per_query(dtype):
    B, H, KV, cap, hd = 5, 9, 3, 40, 64
    k = torch.randn(B, KV, cap, hd).to(dtype)
    v = torch.randn(B, KV, cap, hd).to(dtype)
    rows = torch.tensor([3, 0, 4, 1])               # a batch's running sequences, in any order
    lengths = torch.tensor([1, 40, 17, 2])
    q = torch.randn(4, H, hd).to(dtype)
    out = cpu._C.decode_attention_rows(q, k, v, rows, lengths, 0.125)
    for j in range(4):  # the same kernel on the same data: the same bits
        want = cpu._C.decode_attention(q[j], k[rows[j]], v[rows[j]], int(lengths[j]), 0.125)
        assert torch.equal(out[j], want)


@pytest.mark.parametrize("rows, lengths, match", [
    ([5], [3], "reads sequence 5"), ([0], [0], "over 0 positions"), ([0], [41], "over 41 positions"),
    ([-1], [3], "reads sequence -1"),
])
def test_decode_attention_rows_refuses_what_the_caches_do_not_hold(rows, lengths, match):
    kv = torch.randn(5, 3, 40, 64)
    with pytest.raises(RuntimeError, match=match):
        cpu._C.decode_attention_rows(torch.randn(1, 9, 64), kv, kv, torch.tensor(rows), torch.tensor(lengths), 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        cpu._C.decode_attention_rows(torch.randn(1, 9, 64), kv, kv, torch.tensor([0], dtype=torch.int32),
                                     torch.tensor([3]), 1.0)


@pytest.mark.skipif(not hasattr(cpu._C, "has_dense_rows") or not cpu._C.has_dense_rows(), reason="needs AVX2 + FMA")
@pytest.mark.parametrize("n, k", [(49, 576), (8, 40), (3, 7), (33, 1537), (64, 16)])
def test_dense_rows_matches_float64_and_gives_each_row_the_same_bits_at_any_row_count(n, k):
    x, w, b = torch.randn(9, k), torch.randn(n, k), torch.randn(n)
    out = cpu._C.dense_rows(x, w, b)
    want = x.double() @ w.double().T + b.double()
    # a k-term float32 dot product summed in any order is within gamma_k * sum|x w| of the
    # exact one; adding the bias rounds once more (u * (|dot| + |b|)): gamma_{k+1} overall
    tol = gamma(k + 1) * (x.double().abs() @ w.double().abs().T + b.double().abs())
    assert bool(((out.double() - want).abs() <= tol).all())
    for m in range(1, 10):  # every row count, and every row alone: the same bits
        assert torch.equal(cpu._C.dense_rows(x[:m], w, b), out[:m])
        assert torch.equal(cpu._C.dense_rows(x[m - 1:m], w, b), out[m - 1:m])
    assert torch.equal(cpu._C.dense_rows(x, w, None) + b, out)  # the bias is added last
    assert torch.equal(cpu.dense_linear(x.t().contiguous().t(), w, b), out)  # a strided x


@pytest.mark.skipif(not hasattr(cpu._C, "has_dense_rows") or not cpu._C.has_dense_rows(), reason="needs AVX2 + FMA")
@pytest.mark.parametrize("n, k", [(49, 576), (8, 40), (3, 7), (33, 1537)])
def test_dense_rows_in_bfloat16_is_the_float32_sum_of_the_bf16_values_rounded_once(n, k):
    x, w, b = (torch.randn(*s).bfloat16() for s in ((9, k), (n, k), (n,)))
    out = cpu._C.dense_rows(x, w, b)
    assert out.dtype == torch.bfloat16
    # the bf16 values widened exactly, products exact in float32, float32 sums in any order
    # (gamma_{k+1}, the bias included), then one rounding to bf16: half a bf16 ulp of the
    # float32 result, u = 2^-8 relative (so within u (1 + gamma) |exact| + gamma sum|x w|)
    want = x.double() @ w.double().T + b.double()
    mag = x.double().abs() @ w.double().abs().T + b.double().abs()
    tol = gamma(k + 1) * mag * (1 + 2.0**-8) + 2.0**-8 * want.abs()
    assert bool(((out.double() - want).abs() <= tol).all())
    # the float32 kernel on the same values, rounded once, gives these bits
    assert torch.equal(cpu._C.dense_rows(x.float(), w.float(), b.float()).bfloat16(), out)
    for m in range(1, 10):  # every row count, and every row alone: the same bits
        assert torch.equal(cpu._C.dense_rows(x[:m], w, b), out[:m])
        assert torch.equal(cpu._C.dense_rows(x[m - 1:m], w, b), out[m - 1:m])


def test_step_linear_runs_dense_rows_for_bfloat16_up_to_its_own_row_count(monkeypatch):
    if not cpu.dense_rows_max_m(torch.bfloat16):
        pytest.skip("no dense_rows in this build")
    calls = []
    real = cpu.dense_linear
    monkeypatch.setattr(cpu, "dense_linear", lambda x, w, b: calls.append((x.shape[0], x.dtype)) or real(x, w, b))
    w = torch.randn(24, 40).bfloat16()  # K not a multiple of 32: never dense_amx
    rows = cpu.dense_rows_max_m(torch.bfloat16)
    for m in (1, rows, rows + 1):
        x = torch.randn(m, 40).bfloat16()
        y = cpu.step_linear(x, w, None)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 24)
    assert calls == [(1, torch.bfloat16), (rows, torch.bfloat16)]  # beyond: torch's linear
    assert cpu.dense_rows_max_m(torch.float16) == 0  # no float16 rows: torch's linear
    assert not cpu.dense_rows_apply(w.half(), 0)  # not even for no rows
    calls.clear()
    assert cpu.step_linear(torch.randn(1, 40).half(), w.half(), None).dtype == torch.float16
    assert calls == []


AMX_BF16 = hasattr(cpu._C, "has_amx_bf16") and cpu._C.has_amx_bf16() and cpu._amx()


@pytest.mark.skipif(not AMX_BF16, reason="no AMX bf16 tiles on this machine (or not compiled in)")
@pytest.mark.parametrize("n, k", [(49, 576), (8, 64), (33, 1536), (70, 32), (1, 96)])
def test_dense_amx_is_the_float32_sum_of_the_bf16_values_rounded_once(n, k):
    x, w, b = (torch.randn(*s).bfloat16() for s in ((40, k), (n, k), (n,)))
    out = cpu._C.dense_amx(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (40, n)
    # tdpbf16ps: the bf16 products exact in float32, float32 sums (k + 1 terms with the bias,
    # each addition rounded at most once: gamma_{k+1}), then one rounding to bf16; the tiles
    # flush float32 subnormals to zero, at most 2^-126 per addition, far below the bound here
    want = x.double() @ w.double().T + b.double()
    mag = x.double().abs() @ w.double().abs().T + b.double().abs()
    tol = gamma(k + 1) * mag * (1 + 2.0**-8) + 2.0**-8 * want.abs() + (k + 1) * 2.0**-126
    assert bool(((out.double() - want).abs() <= tol).all())
    # every row count (one or two tiles of rows, the blocks of 32 weight rows cut short), and
    # every row alone: the same bits
    for m in (1, 2, 15, 16, 17, 31, 32, 33, 39):
        assert torch.equal(cpu._C.dense_amx(x[:m], w, b), out[:m])
        assert torch.equal(cpu._C.dense_amx(x[m - 1:m], w, b), out[m - 1:m])
    assert torch.equal(cpu._C.dense_amx(x.t().contiguous().t(), w, b), out)  # a strided x
    assert cpu._C.dense_amx(x[:0], w, b).shape == (0, n)


@pytest.mark.skipif(not AMX_BF16, reason="no AMX bf16 tiles on this machine (or not compiled in)")
@pytest.mark.parametrize("m", [128, 200])
def test_dense_amx_from_128_rows_gives_each_row_its_bits_alone(m):
    # from PACKED_WEIGHT_MIN_M = 128 rows the weight's blocks are packed as B tiles and x's
    # rows read as A tiles (200: the last 8 rows a zero-padded tile): the same sums in the
    # same order, so the bits of each row computed alone (the other layout)
    x, w, b = (torch.randn(*s).bfloat16() for s in ((m, 576), (70, 576), (70,)))
    out = cpu._C.dense_amx(x, w, b)
    for i in (0, 17, m - 9, m - 1):
        assert torch.equal(cpu._C.dense_amx(x[i:i + 1], w, b), out[i:i + 1])
    assert torch.equal(cpu._C.dense_amx(x[:100], w, b), out[:100])


@pytest.mark.skipif(not AMX_BF16, reason="no AMX bf16 tiles on this machine (or not compiled in)")
@pytest.mark.parametrize("x, w, b, match", [
    (torch.randn(2, 64).bfloat16(), torch.randn(4, 64), None, "bfloat16 x"),
    (torch.randn(2, 40).bfloat16(), torch.randn(4, 40).bfloat16(), None, "K must be a multiple of 32"),
    (torch.randn(2, 64).bfloat16(), torch.randn(4, 64).bfloat16(), torch.randn(4), "bfloat16 bias"),
    (torch.randn(2, 64).bfloat16(), torch.randn(4, 64).bfloat16(), torch.randn(3).bfloat16(), "bias"),
])
def test_dense_amx_refuses_what_it_does_not_take(x, w, b, match):
    with pytest.raises(RuntimeError, match=match):
        cpu._C.dense_amx(x, w, b)


DENSE_DOTS = hasattr(cpu._C, "has_dense_dots") and cpu._C.has_dense_dots()


@pytest.mark.skipif(not DENSE_DOTS, reason="no AVX512-BF16 in this build")
@pytest.mark.parametrize("n, k", [(49, 576), (8, 64), (33, 1536), (70, 32), (1, 96), (6, 160)])
def test_dense_dots_is_the_float32_sum_of_the_bf16_values_rounded_once(n, k):
    x, w, b = (torch.randn(*s).bfloat16() for s in ((40, k), (n, k), (n,)))
    out = cpu._C.dense_dots(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (40, n)
    # vdpbf16ps: the bf16 products exact in float32, float32 sums (k + 1 terms with the bias,
    # each addition rounded at most once: gamma_{k+1}), then one rounding to bf16; it flushes
    # float32 subnormals to zero, at most 2^-126 per addition, far below the bound here
    want = x.double() @ w.double().T + b.double()
    mag = x.double().abs() @ w.double().abs().T + b.double().abs()
    tol = gamma(k + 1) * mag * (1 + 2.0**-8) + 2.0**-8 * want.abs() + (k + 1) * 2.0**-126
    assert bool(((out.double() - want).abs() <= tol).all())
    # every row count (whole and cut tiles of 6 rows, groups of 4 weight rows cut short by
    # n), and every row alone: the same bits
    for m in (1, 2, 5, 6, 7, 12, 13, 31, 39):
        assert torch.equal(cpu._C.dense_dots(x[:m], w, b), out[:m])
        assert torch.equal(cpu._C.dense_dots(x[m - 1:m], w, b), out[m - 1:m])
    assert torch.equal(cpu._C.dense_dots(x.t().contiguous().t(), w, b), out)  # a column-major x
    assert torch.equal(cpu._C.dense_dots(torch.cat([x, x], 1)[:, :k], w, b), out)  # a row stride of 2k
    assert torch.equal(cpu._C.dense_dots(x, w, None), cpu._C.dense_dots(x, w, torch.zeros_like(b)))
    assert cpu._C.dense_dots(x[:0], w, b).shape == (0, n)


@pytest.mark.skipif(not DENSE_DOTS, reason="no AVX512-BF16 in this build")
@pytest.mark.parametrize("x, w, b, match", [
    (torch.randn(2, 64), torch.randn(4, 64).bfloat16(), None, "x must be a bfloat16"),
    (torch.randn(2, 64).bfloat16(), torch.randn(4, 64), None, "weight must be a bfloat16"),
    (torch.randn(2, 40).bfloat16(), torch.randn(4, 40).bfloat16(), None, "a multiple of 32"),
    (torch.randn(2, 64).bfloat16(), torch.randn(4, 96).bfloat16(), None, "x's K"),
    (torch.randn(2, 64).bfloat16(), torch.randn(4, 64).bfloat16(), torch.randn(4), "bias must be bfloat16"),
    (torch.randn(2, 64).bfloat16(), torch.randn(4, 64).bfloat16(), torch.randn(3).bfloat16(), "bias"),
])
def test_dense_dots_refuses_what_it_does_not_take(x, w, b, match):
    with pytest.raises(RuntimeError, match=match):
        cpu._C.dense_dots(x, w, b)


def test_step_linear_runs_dense_dots_for_bfloat16_rows_past_dense_rows_without_amx():
    w = torch.randn(24, 64).bfloat16()
    if AMX_BF16 or not DENSE_DOTS:
        assert not DENSE_DOTS or cpu.step_linear_kernel(w, 5) == "dense_amx"
        pytest.skip("AMX runs these rows here (or no AVX512-BF16 in this build)")
    few, most = cpu.dense_rows_max_m(torch.bfloat16), cpu.DENSE_DOTS_MAX_M
    kinds = [cpu.step_linear_kernel(w, m) for m in (1, few, few + 1, most, most + 1)]
    assert kinds == ["dense_rows", "dense_rows", "dense_dots", "dense_dots", "linear"]
    assert cpu.step_linear_kernel(torch.randn(24, 40).bfloat16(), few + 1) == "linear"  # K not a multiple of 32
    assert cpu.step_linear_kernel(w.float(), few + 1) != "dense_dots"
    x = torch.randn(7, 64).bfloat16()
    assert torch.equal(cpu.step_linear(x, w, None), cpu._C.dense_dots(x, w, None))


def test_step_linear_runs_dense_amx_for_bfloat16_rows_where_amx_runs(monkeypatch):
    if not AMX_BF16:
        assert not cpu.dense_amx_apply(torch.zeros(8, 64, dtype=torch.bfloat16), 1)
        pytest.skip("no AMX bf16 tiles on this machine (or not compiled in)")
    w = torch.randn(24, 64).bfloat16()
    rows = cpu.DENSE_AMX_MAX_M
    kinds = [cpu.step_linear_kernel(w, m) for m in (1, 5, rows, rows + 1)]
    assert kinds[:3] == ["dense_amx"] * 3 and kinds[3] != "dense_amx"
    assert cpu.step_linear_kernel(w.float(), 1) != "dense_amx"  # float32: no AMX tiles
    assert cpu.step_linear_kernel(torch.randn(24, 40).bfloat16(), 1) != "dense_amx"
    x = torch.randn(7, 64).bfloat16()
    assert torch.equal(cpu.step_linear(x, w, None), cpu._C.dense_amx(x, w, None))


@pytest.mark.skipif(not hasattr(cpu._C, "has_dense_rows") or not cpu._C.has_dense_rows(), reason="needs AVX2 + FMA")
@pytest.mark.parametrize("x, w, b, match", [
    (torch.randn(2, 8).double(), torch.randn(4, 8), None, "x must be a float32"),
    (torch.randn(8), torch.randn(4, 8), None, "x must be a float32"),
    (torch.randn(2, 8), torch.randn(4, 9), None, r"weight must be a float32 CPU tensor \[N, 8\]"),
    (torch.randn(2, 8), torch.randn(4, 8).half(), None, "weight must be"),
    (torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None, r"weight must be a float32 CPU tensor \[N, 8\] \(x's dtype\)"),
    (torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), torch.randn(4), r"bias must be bfloat16 \[4\]"),
    (torch.randn(2, 8).half(), torch.randn(4, 8).half(), None, "x must be a float32 or bfloat16"),
    (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5), r"bias must be float32 \[4\]"),
])
def test_dense_rows_refuses_what_is_not_a_float32_linear(x, w, b, match):
    with pytest.raises(RuntimeError, match=match):
        cpu._C.dense_rows(x, w, b)


def _needs_prefill():
    if not cpu.prefill_attention_available():
        pytest.skip("prefill_attention needs an AVX-512 build")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# t not a multiple of the 16-query blocks or of the 8- and 6-row tiles, groups of 3, 1 and 4
# query heads, keys not a multiple of 32, chunks after cached positions (pos > 0), several
# sequences of a batch's caches in any order, head sizes 48 (a 64-value step cut short),
# 64 and 128 (two steps); with AMX, bf16 tiles of every head size they take (32, 64, 96,
# 128: one to four 32-value steps of the scores, 2 to 8 value tiles in passes of 4)
@pytest.mark.parametrize("n_seq, t, heads, kv_heads, hd, pos", [(1, 37, 9, 3, 64, 0), (1, 16, 9, 3, 64, 100),
                                                               (2, 20, 8, 2, 128, 5), (1, 5, 4, 4, 48, 0),
                                                               (3, 2, 4, 1, 64, 0), (1, 70, 2, 2, 16, 33),
                                                               (1, 40, 4, 2, 32, 3), (1, 33, 2, 1, 96, 0)])
@pytest.mark.parametrize("bf16_dots", [True, False])  # bf16 scores on vdpbf16ps, or float32 FMAs (AMX tiles win)
def test_prefill_attention_matches_float64_causal_attention(dtype, n_seq, t, heads, kv_heads, hd, pos, bf16_dots):
    _needs_prefill()
    if not bf16_dots and dtype != torch.bfloat16:
        pytest.skip("the choice is bf16 caches' only")
    torch.manual_seed(t * 100 + pos)
    cap = pos + t + 9
    q = torch.randn(n_seq, t, heads, hd).to(dtype)
    k = torch.randn(n_seq + 2, kv_heads, cap, hd).to(dtype)
    v = torch.randn(n_seq + 2, kv_heads, cap, hd).to(dtype)
    seqs = torch.randperm(n_seq + 2)[:n_seq]
    scale = hd ** -0.5
    out = cpu._C.prefill_attention(q, k, v, seqs, pos, scale, bf16_dots)
    assert out.dtype == dtype and out.shape == q.shape
    rep, n = heads // kv_heads, pos + t
    unit = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    for i in range(n_seq):
        kd = k[seqs[i], :, :n].double().repeat_interleave(rep, 0)
        vd = v[seqs[i], :, :n].double().repeat_interleave(rep, 0)
        scores = torch.einsum("thd,hsd->hts", q[i].double(), kd) * scale
        scores = scores.masked_fill(~torch.ones(t, n, dtype=torch.bool).tril(pos), float("-inf"))
        want = torch.einsum("hts,hsd->thd", torch.softmax(scores, -1), vd)
        # decode_attention's bound (test above), with the longest row's n positions: each
        # score an hd-term dot product, exp's few units, an n-term weighted sum, the division.
        # bf16 on AMX tiles: each weight in three bf16 parts (within 2^-24 of it, parts below
        # 2^-126 lost), so 3n products in the weighted sum
        k_max = kd.abs().amax(-2)  # [heads, hd]: each dimension's largest |k| over the positions
        dot_err = gamma(hd + 1) * float((q[i].double().abs() * k_max).sum(-1).max()) * scale
        terms = 3 * n if dtype == torch.bfloat16 else n
        tol = (2 * dot_err + 5 * 2.0**-24 + gamma(terms + 2) + terms * 2.0**-126) * 2 * float(vd.abs().max())
        err = (out[i].double() - want).abs()
        assert bool((err <= tol + unit * want.abs()).all()), float(err.max())


def test_prefill_attention_takes_amx_tiles_for_the_head_sizes_they_fit_where_amx_bf16_runs():
    _needs_prefill()
    amx = cpu._C.has_amx_bf16()
    assert [cpu.prefill_attention_tiles(hd) for hd in (32, 64, 96, 128)] == [amx] * 4
    assert not any(cpu.prefill_attention_tiles(hd) for hd in (16, 48, 80, 160, 256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: AMX tiles where they run
def test_prefill_attention_gives_the_same_bits_on_any_number_of_threads(dtype):
    # each output row is one work item's: the threads only decide which item runs where
    _needs_prefill()
    q, k, v = (torch.randn(*s).to(dtype) for s in ((1, 100, 9, 64), (1, 3, 128, 64), (1, 3, 128, 64)))
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu.prefill_attention(q, k, v, torch.tensor([0]), 20, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_prefill_attention_refuses_bad_arguments():
    _needs_prefill()
    q, kv = torch.randn(1, 4, 9, 64), torch.randn(2, 3, 8, 64)
    seqs = torch.tensor([1])
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu.prefill_attention(q, kv, kv, seqs, 5, 1.0)  # positions 5..8 past the cache's 8
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu.prefill_attention(q.double(), kv, kv, seqs, 0, 1.0)
    with pytest.raises(RuntimeError, match="not in the caches"):
        cpu.prefill_attention(q, kv, kv, torch.tensor([2]), 0, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kv36 = torch.randn(2, 3, 8, 36)
        cpu.prefill_attention(torch.randn(1, 4, 9, 36), kv36, kv36, seqs, 0, 1.0)
    with pytest.raises(RuntimeError, match="seqs must be int64"):
        cpu.prefill_attention(q, kv, kv, seqs.int(), 0, 1.0)
    with pytest.raises(RuntimeError, match="caches must be contiguous"):
        cpu.prefill_attention(q, kv.transpose(2, 3), kv.transpose(2, 3), seqs, 0, 1.0)
