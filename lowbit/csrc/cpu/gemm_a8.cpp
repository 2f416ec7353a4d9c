// Many rows of activations in int8 blocks of 32 (a8_blocks.h) times 4-bit weight codes: the
// GEMM of gemv_a8.cpp's arithmetic, for prefills and large batches on AVX2 machines.
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

// The panel of weight rows [n0, n0 + 16) (rows past N repeat row N - 1; never stored):
// codes as u8 in panel[k / 4][column][4], the scales sp[g][column] and the zero-point
// factors sz[g][column] (s * z, or s for signed codes).  4-bit codes: byte i of a row holds
// element 2i in its low nibble and 2i + 1 in its high one; signed codes (two's complement
// nibbles) are stored as u = q + 8 (the nibble xor 8).
void pack_panel(const uint8_t* w, const float* s, const float* z, int64_t N, int64_t K, int64_t G, int64_t n0,
                uint8_t* panel, float* sp, float* sz) {
  const int64_t row_bytes = K / 2;
  const __m128i low = _mm_set1_epi8(0x0F), flip = _mm_set1_epi8(z ? 0x00 : 0x08);
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
    for (int64_t g = 0; g < G; ++g)
      for (int i = 0; i < 8; ++i) {
        const float sg = s[rows[i] * G + g];
        sp[g * COLS + 8 * v + i] = sg;
        sz[g * COLS + 8 * v + i] = z ? sg * z[rows[i] * G + g] : sg;
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
    const uint8_t* pb = panel + b * (BLOCK / 4) * COLS * 4;
    const int8_t* xb = xq + b * BLOCK;
    __m256i sum[R][2];
    for (int q = 0; q < BLOCK / 4; ++q) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + q * COLS * 4));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + q * COLS * 4 + 32));
      for (int r = 0; r < R; ++r) {
        int32_t word;
        __builtin_memcpy(&word, xb + r * K + 4 * q, 4);
        const __m256i a = _mm256_set1_epi32(word);
        const __m256i p0 = _mm256_maddubs_epi16(w0, a), p1 = _mm256_maddubs_epi16(w1, a);
        sum[r][0] = q ? _mm256_add_epi16(sum[r][0], p0) : p0;
        sum[r][1] = q ? _mm256_add_epi16(sum[r][1], p1) : p1;
      }
    }
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

// x [M, K] quantized once, then multiplied with every weight (q/k/v or gate/up share one
// pass over x and one parallel region).  False (nothing written) if x held NaN or Inf.
template <bool SIGNED>
bool run(const float* x, int64_t M, int64_t K, int64_t group, const std::vector<PackedWeight>& weights) {
  const int64_t G = K / group, nb = K / BLOCK, per_group = group / BLOCK;
  std::vector<int8_t> xq(M * K);
  std::vector<float> d(M * nb), xs(M * G);
  std::vector<char> finite(M);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      finite[m] = a8::quantize_row<int8_t>(x + m * K, K, group, false, xq.data() + m * K, d.data() + m * nb,
                                           xs.data() + m * G);
  });
  if (!std::all_of(finite.begin(), finite.end(), [](char f) { return f; })) return false;
  std::vector<int64_t> first_panel{0};  // the panels of every weight, numbered in one range
  for (const PackedWeight& wt : weights) first_panel.push_back(first_panel.back() + (wt.N + COLS - 1) / COLS);
  const int64_t panels = first_panel.back();
  const PanelWork work(panels, M, ROWS, at::get_num_threads());
  at::parallel_for(0, work.items(panels), 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint8_t> panel(K * COLS);
    std::vector<float> sp(G * COLS), sz(G * COLS);
    size_t j = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / work.parts, part = i % work.parts;
      while (p >= first_panel[j + 1]) ++j;
      const PackedWeight& wt = weights[j];
      const int64_t n0 = (p - first_panel[j]) * COLS, cols = std::min<int64_t>(COLS, wt.N - n0);
      pack_panel(wt.w, wt.s, wt.z, wt.N, K, G, n0, panel.data(), sp.data(), sz.data());
      const int64_t m_end = std::min(M, (part + 1) * work.rows);
      int64_t m = part * work.rows;
      for (; m + ROWS <= m_end; m += ROWS)
        tile<ROWS, SIGNED>(xq.data() + m * K, d.data() + m * nb, xs.data() + m * G, K, G, per_group, panel.data(),
                           sp.data(), sz.data(), wt.y + m * wt.N + n0, wt.N, static_cast<int>(cols));
      for (; m < m_end; ++m)
        tile<1, SIGNED>(xq.data() + m * K, d.data() + m * nb, xs.data() + m * G, K, G, per_group, panel.data(),
                        sp.data(), sz.data(), wt.y + m * wt.N + n0, wt.N, static_cast<int>(cols));
    }
  });
  return true;
}
#endif

}  // namespace

// x float32 [M, K]; for each weight, codes int32 [N, K/8] (4-bit), scale float32 [N, G],
// zero_point float32 [N, G] or none (signed codes): all the same group and kind of codes.
// Returns float32 [M, N] per weight and whether x was finite (if not, nothing is written:
// the caller raises).  linear_a8_blocks_many's values within the same bound: the same
// exact block dot products and codes, summed in another order.
std::tuple<std::vector<at::Tensor>, bool> gemm_a8_blocks_many(const at::Tensor& x, const std::vector<at::Tensor>& codes,
                                                              const std::vector<at::Tensor>& scales,
                                                              const std::vector<c10::optional<at::Tensor>>& zero_points,
                                                              int64_t group) {
  TORCH_CHECK(has_a8_blocks(), "lowbit._C.gemm_a8_blocks needs AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "lowbit._C.gemm_a8_blocks: contiguous float32 x [M, K] expected");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(group > 0 && group % BLOCK == 0 && K % group == 0,
              "lowbit._C.gemm_a8_blocks: the weight group must be a multiple of 32 that divides K");
  std::vector<at::Tensor> ys;
  const std::vector<PackedWeight> weights =
      packed_weights("lowbit._C.gemm_a8_blocks", x, codes, scales, zero_points, 4, group, ys);
  bool finite = true;
#ifdef LOWBIT_A8_BLOCKS
  if (M > 0)
    finite = weights[0].z ? run<false>(x.data_ptr<float>(), M, K, group, weights)
                          : run<true>(x.data_ptr<float>(), M, K, group, weights);
#endif
  return {ys, finite};
}

std::tuple<at::Tensor, bool> gemm_a8_blocks(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                            const c10::optional<at::Tensor>& zero_point, int64_t group) {
  auto [ys, finite] = gemm_a8_blocks_many(x, {codes}, {scale}, {zero_point}, group);
  return {ys[0], finite};
}
