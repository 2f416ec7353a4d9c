// Many rows of int8 activations times 4-bit weight codes on AVX2 machines (no VNNI), for
// prefills and large batches: activations in int8 blocks of 32 (a8_blocks.h; the GEMM of
// gemv_a8.cpp's arithmetic, gemm_a8_blocks), and per-token int8 activations with zero
// points (W4A8: w4a8_gemm's integers, w4a8_gemm_panels_avx2).  For the first:
//
//   y[m, n] = sum_b (d[m, b] * s[n, g(b)]) * sum_{k in b} xq[m, k] u[n, k]  -  zt[m, n]
//   zt[m, n] = sum_g (s[n, g] z[n, g]) * xs[m, g]     (z = 8 for signed codes, u = q + 8)
//
// gemv_a8.cpp multiplies each weight row with each activation row: horizontal int32 sums per
// (row, weight row), unpacked nibbles and a float conversion per pair of blocks; at many
// rows that loses to float32 FMAs (MKL's GEMM). Here the codes are unpacked once per call
// into panels of 16 weight rows, u8 in dwords of 4 consecutive k, panel[k / 4][column],
// and a register tile of R activation rows x 16 columns is fed by a broadcast dword of
// activations: per 4 values of K one vpmaddubsw (unsigned code x signed activation, pairs
// summed in int16) per row and 8 columns.  The int16 sums of one block's 8 steps are added
// in int16 (each step at most 2 * 15 * 128 = 3840, the block at most 30720 < 2^15: no
// saturation), then widened by one vpmaddwd by ones: 32 multiply-adds per vpmaddubsw and
// one vpaddw, against 8 per float32 FMA.  Floats enter once per block (the block's exact
// dot product times d * s, as gemv_a8.cpp), the zero-point term once per row and column.

#include "a8_blocks.h"
#include "kernels.h"
#include "panels.h"
#include "simd.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using a8::BLOCK;

#ifdef LOWBIT_A8_BLOCKS
constexpr int COLS = 16;  // weight rows per panel: two vectors of 8 int32 / float lanes
constexpr int ROWS = 4;   // activation rows per register tile

// The codes of weight rows [n0, n0 + 16) (rows past N repeat row N - 1; never stored) as u8
// in panel[k / 4][column][4].  4-bit codes: byte i of a row holds element 2i in its low
// nibble and 2i + 1 in its high one; signed codes (two's complement nibbles) are stored as
// u = q + 8 (the nibble xor 8).
void pack_codes(const uint8_t* w, int64_t N, int64_t K, int64_t n0, bool is_signed, uint8_t* panel) {
  const int64_t row_bytes = K / 2;
  const __m128i low = _mm_set1_epi8(0x0F), flip = _mm_set1_epi8(is_signed ? 0x08 : 0x00);
  for (int v = 0; v < COLS / 8; ++v) {
    int64_t rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = std::min<int64_t>(n0 + 8 * v + i, N - 1);
    for (int64_t kb = 0; kb < K; kb += BLOCK) {
      __m256i r[8];
      for (int i = 0; i < 8; ++i) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + rows[i] * row_bytes + kb / 2));
        const __m128i lo = _mm_xor_si128(_mm_and_si128(raw, low), flip);
        const __m128i hi = _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(raw, 4), low), flip);
        r[i] = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));  // 32 codes in order
      }
      transpose8(r);  // r[j]: dword j (values kb + 4j .. kb + 4j + 3) of the 8 rows
      for (int j = 0; j < 8; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + ((kb / 4 + j) * COLS + 8 * v) * 4), r[j]);
    }
  }
}

// 8 steps of 4 values (one block of 32) of R rows x the panel's 16 columns: int16 sums of
// vpmaddubsw (unsigned code x signed activation), at most 8 * 2 * 15 * 128 = 30720.
template <int R>
inline void block_sums(__m256i (&sum)[R][2], const int8_t* xb, int64_t ldx, const uint8_t* pb) {
  for (int q = 0; q < BLOCK / 4; ++q) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + q * COLS * 4));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + q * COLS * 4 + 32));
    for (int r = 0; r < R; ++r) {
      int32_t word;
      __builtin_memcpy(&word, xb + r * ldx + 4 * q, 4);
      const __m256i a = _mm256_set1_epi32(word);
      const __m256i p0 = _mm256_maddubs_epi16(w0, a), p1 = _mm256_maddubs_epi16(w1, a);
      sum[r][0] = q ? _mm256_add_epi16(sum[r][0], p0) : p0;
      sum[r][1] = q ? _mm256_add_epi16(sum[r][1], p1) : p1;
    }
  }
}

// R rows of activations (codes xq [R][K], block scales d [R][nb], group sums xs [R][G]) x
// the panel's 16 columns; writes y[r * ldy + c] for c < cols.
template <int R, bool SIGNED>
void tile(const int8_t* xq, const float* d, const float* xs, int64_t K, int64_t G, int64_t per_group,
          const uint8_t* panel, const float* sp, const float* sz, float* y, int64_t ldy, int cols) {
  const int64_t nb = K / BLOCK;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0, g = 0, left = per_group; b < nb; ++b) {  // block b of group g
    __m256i sum[R][2];
    block_sums<R>(sum, xq + b * BLOCK, K, panel + b * BLOCK * COLS);
    const __m256 s0 = _mm256_loadu_ps(sp + g * COLS), s1 = _mm256_loadu_ps(sp + g * COLS + 8);
    if (--left == 0) {
      ++g;
      left = per_group;
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dv = _mm256_set1_ps(d[r * nb + b]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][0], ones)), _mm256_mul_ps(dv, s0),
                                  acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][1], ones)), _mm256_mul_ps(dv, s1),
                                  acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 z0 = _mm256_setzero_ps(), z1 = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m256 x = _mm256_set1_ps(xs[r * G + g]);
      z0 = _mm256_fmadd_ps(_mm256_loadu_ps(sz + g * COLS), x, z0);
      z1 = _mm256_fmadd_ps(_mm256_loadu_ps(sz + g * COLS + 8), x, z1);
    }
    if constexpr (SIGNED) {
      z0 = _mm256_mul_ps(z0, _mm256_set1_ps(8.f));
      z1 = _mm256_mul_ps(z1, _mm256_set1_ps(8.f));
    }
    alignas(32) float out[COLS];
    _mm256_store_ps(out, _mm256_sub_ps(acc[r][0], z0));
    _mm256_store_ps(out + 8, _mm256_sub_ps(acc[r][1], z1));
    std::copy(out, out + cols, y + r * ldy);
  }
}

// W4A8 (per-token int8 activations with zero points, 4-bit codes in groups): R rows of x_q
// [R][K] x the panel's 16 columns, integers exact inside each group,
//   int_g = sum_{k in g} (x - x_zp) (u - z) = sum x u - z (xsum - |g| x_zp) - x_zp usum
// (xg = xsum - |g| x_zp per row and group, usum per column and group), then
//   y = sum_g fma(float(sum x u), s) + sum_g s * float(the rest)      as w4a8_rows.
template <int R>
void w4a8_tile(const int8_t* xq, const int32_t* xg, const int32_t* xzp, int64_t K, int64_t G, int64_t group,
               const uint8_t* panel, const float* sp, const int32_t* zp, const int32_t* usum, float* y, int64_t ldy,
               int cols) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t per_group = group / BLOCK;
  __m256 total[R][2], corr[R][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) total[r][v] = corr[r][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m256i sum[R][2];
      block_sums<R>(sum, xq + b * BLOCK, K, panel + b * BLOCK * COLS);
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < 2; ++v) acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(sum[r][v], ones));
    }
    for (int v = 0; v < 2; ++v) {
      const __m256 s = _mm256_loadu_ps(sp + g * COLS + 8 * v);
      const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(zp + g * COLS + 8 * v));
      const __m256i us = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(usum + g * COLS + 8 * v));
      for (int r = 0; r < R; ++r) {
        total[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][v]), s, total[r][v]);
        const __m256i rest = _mm256_sub_epi32(_mm256_setzero_si256(),
                                              _mm256_add_epi32(_mm256_mullo_epi32(z, _mm256_set1_epi32(xg[r * G + g])),
                                                               _mm256_mullo_epi32(us, _mm256_set1_epi32(xzp[r]))));
        corr[r][v] = _mm256_add_ps(corr[r][v], _mm256_mul_ps(s, _mm256_cvtepi32_ps(rest)));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[COLS];
    _mm256_store_ps(out, _mm256_add_ps(total[r][0], corr[r][0]));
    _mm256_store_ps(out + 8, _mm256_add_ps(total[r][1], corr[r][1]));
    std::copy(out, out + cols, y + r * ldy);
  }
}

// x [M, K] quantized once, then multiplied with every weight (q/k/v or gate/up share one
// pass over x and one parallel region).  False (nothing written) if x held NaN or Inf.
template <bool SIGNED>
bool run(const float* x, int64_t M, int64_t K, int64_t group, const std::vector<PackedWeight>& weights) {
  const int64_t G = K / group, per_group = group / BLOCK;
  return a8::blocks_by_panels<int8_t, uint8_t, COLS, ROWS>(
      x, M, K, group, weights,
      [&](const PackedWeight& wt, int64_t n0, uint8_t* panel) { pack_codes(wt.w, wt.N, K, n0, !wt.z, panel); },
      [&](auto r, const int8_t* xq, const float* d, const float* xs, const uint8_t* panel, const float* sp,
          const float* sz, float* y, int64_t ldy, int cols) {
        tile<decltype(r)::value, SIGNED>(xq, d, xs, K, G, per_group, panel, sp, sz, y, ldy, cols);
      });
}
#endif

}  // namespace

// x float32 [M, K]; for each weight, codes int32 [N, K/8] (4-bit), scale float32 or float16
// [N, G] (packed_scales), zero_point of scale's dtype or none (signed codes): all the same group and kind of codes.
// Returns float32 [M, N] per weight and whether x was finite (if not, nothing is written:
// the caller raises).  linear_a8_blocks_many's values within the same bound: the same
// exact block dot products and codes, summed in another order.
std::tuple<std::vector<at::Tensor>, bool> gemm_a8_blocks_many(const at::Tensor& x, const std::vector<at::Tensor>& codes,
                                                              const std::vector<at::Tensor>& scales,
                                                              const std::vector<c10::optional<at::Tensor>>& zero_points,
                                                              int64_t group, bool zero_point_min) {
  TORCH_CHECK(has_a8_blocks(), "lowbit._C.gemm_a8_blocks needs AVX2 and FMA");
  a8::check_x("lowbit._C.gemm_a8_blocks", x, group);
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> ys;
  const std::vector<PackedWeight> weights =
      packed_weights("lowbit._C.gemm_a8_blocks", x, codes, scales, zero_points, 4, group, ys, zero_point_min);
  bool finite = true;
#ifdef LOWBIT_A8_BLOCKS
  if (M > 0)
    finite = weights[0].z ? run<false>(x.data_ptr<float>(), M, K, group, weights)
                          : run<true>(x.data_ptr<float>(), M, K, group, weights);
#endif
  return {ys, finite};
}

std::tuple<at::Tensor, bool> gemm_a8_blocks(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                            const c10::optional<at::Tensor>& zero_point, int64_t group,
                                            bool zero_point_min) {
  auto [ys, finite] = gemm_a8_blocks_many(x, {codes}, {scale}, {zero_point}, group, zero_point_min);
  return {ys[0], finite};
}

// W4A8 for many rows without AVX-512 VNNI, w4a8_gemm's contract: x_q int8 [M, K], x_zp int32
// [M], codes int32 [N, K/8], w_scale float32 [N, G], w_zp int32 [N, G] or none (signed
// codes); returns float32 [M, N] = sum_g w_scale * int_g (x_scale and bias applied by the
// caller).  The integers are w4a8_gemm's, exactly; the float sums in another order.
at::Tensor w4a8_gemm_panels_avx2(const at::Tensor& x_q, const at::Tensor& x_zp, const at::Tensor& codes,
                                 const at::Tensor& w_scale, const c10::optional<at::Tensor>& w_zp, int64_t group) {
  TORCH_CHECK(has_a8_blocks(), "lowbit._C.w4a8_gemm_panels needs AVX2 (or AVX-512 with VNNI)");
  TORCH_CHECK(x_q.dim() == 2 && x_q.scalar_type() == at::kChar && x_zp.numel() == x_q.size(0),
              "lowbit._C.w4a8_gemm_panels: int8 x_q [M, K] and one zero point per row expected");
  const int64_t M = x_q.size(0), K = x_q.size(1), N = codes.size(0);
  TORCH_CHECK(group > 0 && group % BLOCK == 0 && K % group == 0,
              "lowbit._C.w4a8_gemm_panels: group must be a multiple of 32 dividing K");
  const int64_t G = K / group;
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kInt && codes.size(1) * 8 == K &&
                  w_scale.scalar_type() == at::kFloat && w_scale.dim() == 2 && w_scale.size(0) == N &&
                  w_scale.size(1) == G && (!w_zp || w_zp->sizes() == w_scale.sizes()),
              "lowbit._C.w4a8_gemm_panels: codes int32 [N, K/8], float32 scales and int32 zero points [N, K/group] "
              "expected");
  at::Tensor y = at::empty({M, N}, x_q.options().dtype(at::kFloat));
#ifdef LOWBIT_A8_BLOCKS
  if (M == 0 || N == 0) return y;
  const at::Tensor xc = x_q.contiguous(), cc = codes.contiguous(), sc = w_scale.contiguous();
  const at::Tensor xz = x_zp.to(at::kInt).contiguous();
  const at::Tensor zc = w_zp ? w_zp->to(at::kInt).contiguous() : at::Tensor();
  const int8_t* px = xc.data_ptr<int8_t>();
  const int32_t* pxz = xz.data_ptr<int32_t>();
  std::vector<int32_t> xg(M * G);  // per row and group: sum x - |g| x_zp
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) w4a8_group_sums(px + m * K, pxz[m], K, group, xg.data() + m * G);
  });
  const int32_t* pxg = xg.data();
  const uint8_t* w = reinterpret_cast<const uint8_t*>(cc.data_ptr());
  const float* s = sc.data_ptr<float>();
  const int32_t* z = zc.defined() ? zc.data_ptr<int32_t>() : nullptr;
  float* py = y.data_ptr<float>();
  struct Scratch {
    std::vector<uint8_t> panel;
    std::vector<float> sp;           // per group and column: s
    std::vector<int32_t> zp, usum;   // z (8 for signed codes), and the sum of the codes u
  };
  each_panel<COLS, ROWS>(
      {N}, M,
      [&] {
        return Scratch{std::vector<uint8_t>(K * COLS), std::vector<float>(G * COLS), std::vector<int32_t>(G * COLS),
                       std::vector<int32_t>(G * COLS)};
      },
      [&](size_t, int64_t n0, Scratch& t) {
        pack_codes(w, N, K, n0, z == nullptr, t.panel.data());
        pack_groups<COLS>(N, G, n0, t.sp.data(), [&](int64_t n, int64_t g) { return s[n * G + g]; });
        pack_groups<COLS>(N, G, n0, t.zp.data(), [&](int64_t n, int64_t g) { return z ? z[n * G + g] : 8; });
        const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
        for (int64_t g = 0; g < G; ++g)  // sum of the codes u per column and group: 4 bytes a dword
          for (int v = 0; v < 2; ++v) {
            __m256i sum = _mm256_setzero_si256();
            for (int64_t q = g * group / 4; q < (g + 1) * group / 4; ++q) {
              const __m256i u =
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.panel.data() + (q * COLS + 8 * v) * 4));
              sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, ones8), ones16));
            }
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.usum.data() + g * COLS + 8 * v), sum);
          }
      },
      [&](auto r, size_t, int64_t m, int64_t n0, int cols, Scratch& t) {
        w4a8_tile<decltype(r)::value>(px + m * K, pxg + m * G, pxz + m, K, G, group, t.panel.data(), t.sp.data(),
                                      t.zp.data(), t.usum.data(), py + m * N + n0, N, cols);
      });
#endif
  return y;
}
