// 8-bit weights times 8-bit activations for many rows on AVX2 machines (no VNNI), in int16
// panels: the weight's codes widened once per call into panels of 16 rows, int16 pairs
// of consecutive k in dwords, panel[k / 2][column][2], and a register tile of R
// activation rows x 16 columns fed by a broadcast dword of two int16 activations: one
// vpmaddwd per row and 8 columns multiplies 16 pairs and sums them in exact int32 lanes.
// 16 multiply-adds per vpmaddwd and one vpaddd, against 8 per float32 FMA.  (vpmaddubsw,
// twice as wide, would saturate: a pair of 8-bit x 8-bit products reaches 2 * 128 * 128.)
//
//   int8_mm_panels:  exact int32 a @ b.T (torch._int_mm's result), for W8A8's epilogue.
//   gemm_a8_blocks8: activations in int8 blocks of 32 (a8_blocks.h) times 8-bit codes, the
//                    arithmetic of gemv_a8.cpp's w8_tile: exact block dot products, floats
//                    once per block, the zero-point term once per row and column.

#include "a8_blocks.h"
#include "kernels.h"
#include "panels.h"
#include "simd.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX2__) && defined(__FMA__)
#define LOWBIT_I16_PANELS 1
constexpr int COLS = 16;   // weight rows per panel: two vectors of 8 int32 lanes
constexpr int ROWS = 4;    // activation rows per register tile
constexpr int64_t KC = 16; // values of K per packing step (8 dwords of int16 pairs)

// Rows [n0, n0 + 16) of the 8-bit codes b [N, K] (rows past N repeat row N - 1; never
// stored), widened to int16 (sign- or zero-extended) into panel[k / 2][column][2] for
// k < Kp (a multiple of KC; zeros past K).
template <bool SIGNED>
void pack_panel(const uint8_t* b, int64_t N, int64_t K, int64_t Kp, int64_t n0, int16_t* panel) {
  for (int v = 0; v < COLS / 8; ++v) {
    const uint8_t* rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = b + std::min<int64_t>(n0 + 8 * v + i, N - 1) * K;
    for (int64_t kb = 0; kb < Kp; kb += KC) {
      __m256i r[8];
      for (int i = 0; i < 8; ++i) {
        __m128i raw;
        if (kb + KC <= K) {
          raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + kb));
        } else {
          alignas(16) uint8_t tail[KC] = {};
          if (kb < K) std::memcpy(tail, rows[i] + kb, K - kb);
          raw = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
        }
        r[i] = SIGNED ? _mm256_cvtepi8_epi16(raw) : _mm256_cvtepu8_epi16(raw);
      }
      transpose8(r);  // r[j]: dword j (values kb + 2j, kb + 2j + 1) of the 8 rows
      for (int j = 0; j < 8; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + ((kb / 2 + j) * COLS + 8 * v) * 2), r[j]);
    }
  }
}

// out[r][v] = sum over dword steps q < steps of pairs x[r * ldx + 2q .. +1] times the
// panel's columns 8v..8v+7, from zero (exact int32).  The sums stay in a local array until
// the end: accumulating in `out` itself (a reference the loop's loads might alias) made
// GCC store every accumulator at every step, 2.5x slower.
template <int R, bool PIN>
inline void dots(__m256i (&out)[R][2], const int16_t* x, int64_t ldx, const int16_t* panel, int64_t steps) {
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t q = 0; q < steps; ++q) {
    __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * COLS * 2));
    __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * COLS * 2 + 16));
    // in registers: GCC folds them into every vpmaddwd as memory operands otherwise, and 2R
    // loads a step instead of 2 leave the loads the bottleneck (int_tile on Zen 2: 1.5x
    // slower).  Not in block_tile, whose 8 float sums need the registers (there: 1.1x slower).
    if constexpr (PIN) asm("" : "+x"(w0), "+x"(w1));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * q, 4);
      const __m256i a = _mm256_set1_epi32(pair);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, a));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, a));
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r][0] = acc[r][0];
    out[r][1] = acc[r][1];
  }
}

// The first `cols` of 16 values to y.
template <typename T>
inline void store_cols(T* y, const T (&out)[COLS], int cols) {
  std::copy(out, out + cols, y);
}

// R rows of a x the panel: exact int32 sums over all of Kp.
template <int R>
void int_tile(const int16_t* a, int64_t Kp, const int16_t* panel, int32_t* c, int64_t ldc, int cols) {
  __m256i acc[R][2];
  dots<R, true>(acc, a, Kp, panel, Kp / 2);
  for (int r = 0; r < R; ++r) {
    alignas(32) int32_t out[COLS];
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), acc[r][0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 8), acc[r][1]);
    store_cols(c + r * ldc, out, cols);
  }
}

// R rows of activations in blocks (int16 codes xq [R][K], block scales d [R][nb], group sums
// xs [R][G]) x the panel (scales sp[g][column], zero-point factors sz[g][column]: s * z, or
// none for signed codes): y = sum_b cvt(dot_b) * (d * s) - sum_g sz * xs.
template <int R>
void block_tile(const int16_t* xq, const float* d, const float* xs, int64_t K, int64_t G, int64_t per_group,
                const int16_t* panel, const float* sp, const float* sz, float* y, int64_t ldy, int cols) {
  const int64_t nb = K / a8::BLOCK;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0, g = 0, left = per_group; b < nb; ++b) {  // block b of group g
    __m256i dot[R][2];
    dots<R, false>(dot, xq + b * a8::BLOCK, K, panel + b * a8::BLOCK * COLS, a8::BLOCK / 2);
    const __m256 s0 = _mm256_loadu_ps(sp + g * COLS), s1 = _mm256_loadu_ps(sp + g * COLS + 8);
    if (--left == 0) {
      ++g;
      left = per_group;
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dv = _mm256_set1_ps(d[r * nb + b]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), _mm256_mul_ps(dv, s0), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][1]), _mm256_mul_ps(dv, s1), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 z0 = _mm256_setzero_ps(), z1 = _mm256_setzero_ps();
    if (sz)
      for (int64_t g = 0; g < G; ++g) {
        const __m256 x = _mm256_set1_ps(xs[r * G + g]);
        z0 = _mm256_fmadd_ps(_mm256_loadu_ps(sz + g * COLS), x, z0);
        z1 = _mm256_fmadd_ps(_mm256_loadu_ps(sz + g * COLS + 8), x, z1);
      }
    alignas(32) float out[COLS];
    _mm256_store_ps(out, _mm256_sub_ps(acc[r][0], z0));
    _mm256_store_ps(out + 8, _mm256_sub_ps(acc[r][1], z1));
    store_cols(y + r * ldy, out, cols);
  }
}

#endif

}  // namespace

// int8 a [M, K] @ int8 b [N, K].T: exact int32 [M, N] (|a b| <= 2^14 per product, K < 2^17).
at::Tensor int8_mm_panels(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(has_int8_rows(), "lowbit._C.int8_mm_panels needs AVX2");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.scalar_type() == at::kChar && b.scalar_type() == at::kChar &&
                  a.size(1) == b.size(1),
              "lowbit._C.int8_mm_panels: int8 a [M, K] and b [N, K] expected");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(K < (int64_t(1) << 17), "lowbit._C.int8_mm_panels: K must be below 2^17 (int32 sums)");
  at::Tensor c = at::empty({M, N}, a.options().dtype(at::kInt));
#ifdef LOWBIT_I16_PANELS
  if (M == 0 || N == 0) return c;
  const int64_t Kp = (K + KC - 1) / KC * KC;
  at::Tensor a16 = at::zeros({M, Kp}, a.options().dtype(at::kShort));
  a16.narrow(1, 0, K).copy_(a);
  const at::Tensor bc = b.contiguous();
  const int16_t* pa = a16.data_ptr<int16_t>();
  const uint8_t* pb = reinterpret_cast<const uint8_t*>(bc.data_ptr<int8_t>());
  int32_t* pc = c.data_ptr<int32_t>();
  each_panel<COLS, ROWS>(
      {N}, M, [&] { return std::vector<int16_t>(Kp * COLS); },
      [&](size_t, int64_t n0, std::vector<int16_t>& panel) { pack_panel<true>(pb, N, K, Kp, n0, panel.data()); },
      [&](auto r, size_t, int64_t m, int64_t n0, int cols, const std::vector<int16_t>& panel) {
        int_tile<decltype(r)::value>(pa + m * Kp, Kp, panel.data(), pc + m * N + n0, N, cols);
      });
#endif
  return c;
}

// x float32 [M, K]; for each weight, 8-bit codes [N, K] (int8 with no zero points, uint8
// with), scale float32 or float16 [N, G] (packed_scales), zero_point of scale's dtype or none:
// all the same group and kind.  Returns float32 [M, N] per weight and whether x was finite (if not, nothing is
// written: the caller raises).  linear_a8_blocks_many's values within the same bound: the
// same codes and exact block dot products, summed in another order.
std::tuple<std::vector<at::Tensor>, bool> gemm_a8_blocks8_many(const at::Tensor& x, const std::vector<at::Tensor>& codes,
                                                               const std::vector<at::Tensor>& scales,
                                                               const std::vector<c10::optional<at::Tensor>>& zero_points,
                                                               int64_t group, bool zero_point_min) {
  TORCH_CHECK(has_a8_blocks(), "lowbit._C.gemm_a8_blocks8 needs AVX2 and FMA");
  a8::check_x("lowbit._C.gemm_a8_blocks8", x, group);
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> ys;
  const std::vector<PackedWeight> weights =
      packed_weights("lowbit._C.gemm_a8_blocks8", x, codes, scales, zero_points, 8, group, ys, zero_point_min);
  bool finite = true;
#ifdef LOWBIT_I16_PANELS
  if (M == 0) return {ys, true};
  const int64_t G = K / group, per_group = group / a8::BLOCK;
  const bool has_zp = weights[0].z != nullptr;  // unsigned codes
  finite = a8::blocks_by_panels<int16_t, int16_t, COLS, ROWS>(
      x.data_ptr<float>(), M, K, group, weights,
      [&](const PackedWeight& wt, int64_t n0, int16_t* panel) {
        if (has_zp) pack_panel<false>(wt.w, wt.N, K, K, n0, panel);
        else pack_panel<true>(wt.w, wt.N, K, K, n0, panel);
      },
      [&](auto r, const int16_t* xq, const float* d, const float* xs, const int16_t* panel, const float* sp,
          const float* sz, float* y, int64_t ldy, int cols) {
        block_tile<decltype(r)::value>(xq, d, xs, K, G, per_group, panel, sp, has_zp ? sz : nullptr, y, ldy, cols);
      });
#endif
  return {ys, finite};
}

std::tuple<at::Tensor, bool> gemm_a8_blocks8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                             const c10::optional<at::Tensor>& zero_point, int64_t group,
                                             bool zero_point_min) {
  auto [ys, finite] = gemm_a8_blocks8_many(x, {codes}, {scale}, {zero_point}, group, zero_point_min);
  return {ys[0], finite};
}
