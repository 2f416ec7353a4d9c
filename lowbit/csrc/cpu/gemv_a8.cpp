// Weight-only weights (4- or 8-bit codes, float scales) times activations quantized to
// int8 on the fly in blocks of 32 values (symmetric, float32 scale per block: the scheme
// int8-sym-g32), the way llama.cpp runs its Q4_0/Q8_0 matmuls against Q8_0 activations.
// The products inside a block are exact integer dot products; floats enter once per block.
// AVX2 only (most x86-64 CPUs since 2013-2015, the AVX-512 ones included): what makes it fast where
// float32 FMAs are the bottleneck is the integer multiply-add, not the vector width.
//
//   x[m, k] ~ d[m, b] * xq[m, k]   for k in block b (32 values), xq in [-128, 127]
//   y[m, n] = sum_g s[n, g] * ( sum_{b in g} d[m, b] * sum_{k in b} xq[m, k] q[n, k]
//                               - z[n, g] * sum_{b in g} d[m, b] * sum_{k in b} xq[m, k] )
// which is the reference (x dequantized per block, then the weight-only matmul) regrouped;
// a weight in the "min" domain (W = q * s + m, unsigned codes) has + m[n, g] * (the same
// sum of x) in place of - s z (llama.cpp's Q4_1 x Q8_1 arithmetic).
//
// 4-bit codes: u32x8 words read as bytes (byte i of a row: element 2i in its low nibble,
// 2i + 1 in its high one); a block's 16 bytes give 16 low and 16 high nibbles, and the
// activations of each block are stored as its 16 even elements then its 16 odd ones, so
// one vpmaddubsw (unsigned nibble x signed int8, pairs summed in int16: at most
// 2 * 15 * 128, no saturation) and one vpmaddwd by ones give 8 int32 partial sums.
// Signed codes are read as u = q + 8, and 8 x taken away inside each block's sum.
// 8-bit codes: widened to int16 and multiplied with int16 activations by vpmaddwd (pairs
// at most 2 * 255 * 128 in int32), as vpmaddubsw would saturate on 8-bit x 8-bit pairs.

#include "a8_blocks.h"
#include "balance.h"
#include "kernels.h"
#include "simd.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using a8::BLOCK;
using a8::quantize_row;

#ifdef LOWBIT_A8_BLOCKS
constexpr int MB = 4;  // activation rows computed together

// R activation rows x NR weight rows of 4-bit codes, two blocks (64 values, 32 code bytes)
// per step: the low nibbles of both blocks against their even activations, the high ones
// against the odd, int16 sums of the two (at most 2 * 3840), vpmaddwd by ones: int32 lanes
// 0-3 hold block b0's partial sums, 4-7 block b1's, scaled by [d0 s0 x4 | d1 s1 x4].  R * NR
// independent accumulators (one alone would wait on its own FMA latency every step); each
// weight step unpacked once for the R rows, each activation step loaded once for NR rows.
// Signed codes are read as u = q + 8 and their products taken back to q x inside each int16
// lane, where 8 (x_2i + x_2i+1) of the same activations is subtracted (at most 7680 + 4096):
// exact per block, with no float term after the sum that cancels against it (that term per
// output row made a 3072 x 576 Q4_0 call 1.09x slower, one thread, weights in cache).
// Zero points: sum_g s[g] z[g] xs[g] (-m[g] in place of s z for the "min" domain: z holds
// m), 8 groups at a time.
template <bool HAS_ZP, typename S>
inline float zero_point_term(const S* s, const S* z, const float* xs, int64_t G, bool min) {
  if constexpr (!HAS_ZP) return 0.f;
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    const __m256 sz =
        min ? _mm256_sub_ps(_mm256_setzero_ps(), scale8(z + g)) : _mm256_mul_ps(scale8(s + g), scale8(z + g));
    acc = _mm256_fmadd_ps(sz, _mm256_loadu_ps(xs + g), acc);
  }
  // explicit FMAs: the same roundings whatever the compiler contracts, float16 scales or not
  float tail = 0.f;
  for (; g < G; ++g) tail = std::fma(min ? -scale1(z + g) : scale1(s + g) * scale1(z + g), xs[g], tail);
  return fsum8(acc) + tail;
}

// Weight rows of the next tile (NR rows on) are prefetched as each step reads its own: a tile
// reads NR rows in parallel, which the hardware prefetcher follows poorly (Zen 2, weights
// from DRAM: 1.7x on 576 x 1536 Q4_0).
// PAIRS says where a step's two blocks fall: 1, in two groups (groups of 32); 2, in one group
// (an even number of blocks a group); 0, either (decided each step).  Known at compile time,
// the choice leaves the inner loop, whose accumulators then stay in registers (GCC 12 kept
// them on the stack around the branch: 3072 x 576 Q4_0 in cache, one thread, 1.07x slower).
template <int R, int NR, bool SIGNED, bool HAS_ZP, int PAIRS, typename S>
void w4_tile(const int8_t* xq, const float* d, const float* dp, const float* xs, int64_t K, int64_t G,
             int64_t group, const uint8_t* w, const S* s, const S* z, bool min, float* y, int64_t ldy) {
  const int64_t nb = K / BLOCK, row_bytes = K / 2, np = (nb + 1) / 2, per_group = group / BLOCK;
  const bool pow2 = (per_group & (per_group - 1)) == 0;
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(per_group));
  constexpr int64_t AHEAD = R == 1 && NR == 1 ? kRowsAhead : NR;  // rows prefetched ahead, as w8_tile
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(SIGNED ? 0x08 : 0x00);
  const __m256i ones = _mm256_set1_epi16(1), eight = _mm256_set1_epi8(8);
  const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    // a group is at least one block, so the pair's second block is in the same group or the next
    // (a shift for the usual power-of-two groups: an integer division here cost 10% of the step)
    const int64_t g0 = pow2 ? b >> shift : b / per_group, g1 = pow2 ? (b + 1) >> shift : (b + 1) / per_group;
    __m256 dv[R];  // [d(b) x4 | d(b+1) x4] of each row, laid out when x was quantized
    for (int r = 0; r < R; ++r) dv[r] = _mm256_loadu_ps(dp + (r * np + b / 2) * 8);
    for (int j = 0; j < NR; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + AHEAD) * row_bytes + b * (BLOCK / 2)), _MM_HINT_T0);
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * row_bytes + b * (BLOCK / 2)));
      const __m256i lo = _mm256_xor_si256(_mm256_and_si256(raw, low), flip);
      const __m256i hi = _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), flip);
      const S* sj = s + j * G;
      // [s(g0) x4 | s(g1) x4]: one broadcast, or two adjacent scales spread over the halves
      const __m256 sv = PAIRS == 2 || (PAIRS == 0 && g0 == g1)
                            ? _mm256_set1_ps(scale1(sj + g0))
                            : _mm256_permutevar8x32_ps(_mm256_castps128_ps256(scale2(sj + g0)), halves);
      for (int r = 0; r < R; ++r) {
        const int8_t* xp = xq + r * K + b * BLOCK;
        const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
        const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + BLOCK));
        __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
        if constexpr (SIGNED)
          p16 = _mm256_sub_epi16(p16,
                                 _mm256_add_epi16(_mm256_maddubs_epi16(eight, xe), _mm256_maddubs_epi16(eight, xo)));
        const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc[r][j] = _mm256_fmadd_ps(p, _mm256_mul_ps(dv[r], sv), acc[r][j]);
      }
    }
  }
  if (b < nb) {  // a last block alone: the same at 128 bits
    const __m128i low4 = _mm_set1_epi8(0x0F), flip4 = _mm_set1_epi8(SIGNED ? 0x08 : 0x00);
    const __m128i ones4 = _mm_set1_epi16(1), eight4 = _mm_set1_epi8(8);
    const int64_t g = b / per_group;
    for (int j = 0; j < NR; ++j) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * row_bytes + b * (BLOCK / 2)));
      const __m128i l = _mm_xor_si128(_mm_and_si128(raw, low4), flip4);
      const __m128i h = _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), flip4);
      for (int r = 0; r < R; ++r) {
        const int8_t* xp = xq + r * K + b * BLOCK;
        const __m128i xe = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xp));
        const __m128i xo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xp + BLOCK / 2));
        __m128i p16 = _mm_add_epi16(_mm_maddubs_epi16(l, xe), _mm_maddubs_epi16(h, xo));
        if constexpr (SIGNED)
          p16 = _mm_sub_epi16(p16, _mm_add_epi16(_mm_maddubs_epi16(eight4, xe), _mm_maddubs_epi16(eight4, xo)));
        const __m128 p = _mm_mul_ps(_mm_cvtepi32_ps(_mm_madd_epi16(p16, ones4)),
                                    _mm_set1_ps(d[r * nb + b] * scale1(s + j * G + g)));
        acc[r][j] = _mm256_add_ps(acc[r][j], _mm256_zextps128_ps256(p));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j)  // sum_g s z sum_{b in g} d sum xq
      y[r * ldy + j] =
          fsum8(acc[r][j]) - zero_point_term<HAS_ZP>(s + j * G, HAS_ZP ? z + j * G : nullptr, xs + r * G, G, min);
}

// R activation rows x NR weight rows of 8-bit codes, one block per step: two vpmaddwd per
// block and row pair, the block's scale d[r, b] * s[n, g] one float32 product.
template <int R, int NR, bool SIGNED, bool HAS_ZP, typename S>
void w8_tile(const int16_t* xq, const float* d, const float* xs, int64_t K, int64_t G, int64_t group,
             const uint8_t* w, const S* s, const S* z, bool min, float* y, int64_t ldy) {
  const int64_t nb = K / BLOCK, per_group = group / BLOCK;
  // Rows prefetched ahead.  One activation row takes 8-bit weight rows one at a time (run):
  // SmolLM2's 49152 x 576 head from DRAM, 2 threads on Zen 2, took 1117 us so (28.5 GB/s,
  // a plain read of its codes 1014 us) against 1503 us as 4-row tiles; weights in L2 it is
  // the other way, 40 against 33 us for 3072 rows, but a decode step reads them from DRAM.
  constexpr int64_t AHEAD = R == 1 && NR == 1 ? kRowsAhead : NR;
  __m256 acc[R][NR];
  float corr[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) { acc[r][j] = _mm256_setzero_ps(); corr[r][j] = 0.f; }
  for (int64_t g = 0; g < G; ++g) {
    float sg[NR];
    for (int j = 0; j < NR; ++j) sg[j] = scale1(s + j * G + g);
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      for (int j = 0; j < NR; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (j + AHEAD) * K + b * BLOCK), _MM_HINT_T0);
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * K + b * BLOCK));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * K + b * BLOCK + 16));
        const __m256i w0 = SIGNED ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
        const __m256i w1 = SIGNED ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
        for (int r = 0; r < R; ++r) {
          const int16_t* xb = xq + (r * nb + b) * BLOCK;
          const __m256i p = _mm256_add_epi32(
              _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
              _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[r * nb + b] * sg[j]), acc[r][j]);
        }
      }
    }
    if constexpr (HAS_ZP)
      for (int j = 0; j < NR; ++j)
        for (int r = 0; r < R; ++r) {
          const float zg = scale1(z + j * G + g);
          corr[r][j] = std::fma(min ? -zg : sg[j] * zg, xs[r * G + g], corr[r][j]);
        }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) y[r * ldy + j] = fsum8(acc[r][j]) - corr[r][j];
}

// x [M, K] quantized once, then multiplied with every weight (q/k/v or gate/up of a decode
// step share one pass over x and one parallel region).  False (nothing written) if x held
// NaN or Inf.
template <typename Q, bool SIGNED, bool HAS_ZP>
bool run(const float* x, int64_t M, int64_t K, int64_t group, const std::vector<PackedWeight>& weights) {
  const int64_t G = K / group, nb = K / BLOCK;
  constexpr bool four = std::is_same<Q, int8_t>::value;
  const int64_t np = (nb + 1) / 2;
  thread_local std::vector<Q> xq_keep;
  thread_local std::vector<float> d_keep, dp_keep, xs_keep;
  thread_local std::vector<char> finite_keep;
  Q* xq = grown(xq_keep, M * K);
  float *d = grown(d_keep, M * nb), *dp = grown(dp_keep, four ? M * np * 8 : 0), *xs = grown(xs_keep, M * G);
  char* finite = grown(finite_keep, M);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      finite[m] = quantize_row<Q>(x + m * K, K, group, four, xq + m * K, d + m * nb, xs + m * G);
      if (four)  // block scales in pairs, [d(2p) x4 | d(2p+1) x4] (0 past the last block)
        for (int64_t i = 0; i < np * 8; ++i) {
          const int64_t blk = 2 * (i / 8) + (i % 8) / 4;
          dp[m * np * 8 + i] = blk < nb ? d[m * nb + blk] : 0.f;
        }
    }
  });
  if (!std::all_of(finite, finite + M, [](char f) { return f; })) return false;
  const int64_t row_bytes = four ? K / 2 : K;
  // One row of x: 4 weight rows at a time (8-bit codes, and 4-bit rows of kLongRow bytes or
  // more: one, see w8_tile and simd.h); 4 rows of x: one
  // (4 accumulators either way, so that they, the unpacked codes and the scales fit the 16
  // vector registers).  s, z: the weight's scales and zero points (with_scales).
  auto tile_of = [&](auto r_const, auto nr_const, const PackedWeight& wt, auto s, auto z, int64_t m, int64_t n) {
    constexpr int R = decltype(r_const)::value, NR = decltype(nr_const)::value;
    const uint8_t* wn = wt.w + n * row_bytes;
    const auto zn = HAS_ZP ? z + n * G : nullptr;
    if constexpr (four) {
      auto w4 = [&](auto pairs) {
        w4_tile<R, NR, SIGNED, HAS_ZP, decltype(pairs)::value>(xq + m * K, d + m * nb, dp + m * np * 8, xs + m * G,
                                                               K, G, group, wn, s + n * G, zn, wt.min,
                                                               wt.y + m * wt.N + n, wt.N);
      };
      const int64_t per_group = group / BLOCK;
      if (per_group == 1)
        w4(std::integral_constant<int, 1>{});
      else if (per_group % 2 == 0)
        w4(std::integral_constant<int, 2>{});
      else
        w4(std::integral_constant<int, 0>{});
    } else
      w8_tile<R, NR, SIGNED, HAS_ZP>(xq + m * K, d + m * nb, xs + m * G, K, G, group, wn, s + n * G, zn, wt.min,
                                     wt.y + m * wt.N + n, wt.N);
  };
  auto tile = [&](auto r_const, auto nr_const, const PackedWeight& wt, int64_t m, int64_t n) {
    with_scales(wt, [&](auto s, auto z) { tile_of(r_const, nr_const, wt, s, z, m, n); });
  };
  using One = std::integral_constant<int, 1>;
  using Four = std::integral_constant<int, 4>;
  thread_local std::vector<int64_t> first_keep;  // tiles of 4 rows of every weight, numbered in one range
  int64_t* first_tile = grown(first_keep, weights.size() + 1);
  first_tile[0] = 0;
  for (size_t i = 0; i < weights.size(); ++i) first_tile[i + 1] = first_tile[i] + weights[i].N / 4;
  parallel_chunks(0, first_tile[weights.size()], 8, [&](int64_t t0, int64_t t1) {
    size_t i = 0;
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= first_tile[i + 1]) ++i;
      const PackedWeight& wt = weights[i];
      const int64_t n = 4 * (t - first_tile[i]);
      int64_t m = 0;
      for (; m + MB <= M; m += MB)
        for (int64_t j = 0; j < 4; ++j) tile(Four{}, One{}, wt, m, n + j);
      for (; m < M; ++m)
        if constexpr (four) {
          if (row_bytes < kLongRow)
            tile(One{}, Four{}, wt, m, n);
          else  // long rows one at a time, as gemv_bf16.cpp's
            for (int64_t j = 0; j < 4; ++j) tile(One{}, One{}, wt, m, n + j);
        }
        else  // 8-bit codes a weight row at a time, prefetched 8 rows ahead: one stream
          for (int64_t j = 0; j < 4; ++j) tile(One{}, One{}, wt, m, n + j);
    }
  });
  for (const PackedWeight& wt : weights)
    for (int64_t n = wt.N / 4 * 4; n < wt.N; ++n)
      for (int64_t m = 0; m < M; ++m) tile(One{}, One{}, wt, m, n);
  return true;
}
#endif

}  // namespace

bool has_a8_blocks() {
#ifdef LOWBIT_A8_BLOCKS
  return true;
#else
  return false;
#endif
}

// x float32 [M, K]; for each weight, codes int8/uint8 [N, K] or int32 [N, K/8] (4-bit), scale
// float32 or float16 [N, G] (packed_scales), zero_point [N, G] of scale's dtype or none (signed
// codes): all the same bits, group and kind of codes.  Returns float32 [M, N] per weight (x
// quantized once) and whether x was finite (if not, nothing is written: the caller raises).
std::tuple<std::vector<at::Tensor>, bool> linear_a8_blocks_many(const at::Tensor& x,
                                                                const std::vector<at::Tensor>& codes,
                                                                const std::vector<at::Tensor>& scales,
                                                                const std::vector<c10::optional<at::Tensor>>& zero_points,
                                                                int64_t bits, int64_t group, bool zero_point_min) {
  TORCH_CHECK(has_a8_blocks(), "lowbit._C.linear_a8_blocks needs AVX2 and FMA");
  a8::check_x("lowbit._C.linear_a8_blocks", x, group);
  TORCH_CHECK(bits == 4 || bits == 8, "lowbit._C.linear_a8_blocks: bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> ys;
  const std::vector<PackedWeight> weights =
      packed_weights("lowbit._C.linear_a8_blocks", x, codes, scales, zero_points, bits, group, ys, zero_point_min);
  return {ys, a8_blocks_into(x.data_ptr<float>(), M, K, bits, group, weights)};
}

bool a8_blocks_into(const float* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                    const std::vector<PackedWeight>& weights) {
#ifdef LOWBIT_A8_BLOCKS
  const bool has_zp = weights[0].z != nullptr;
  if (bits == 4)  // int8 codes of x against 4-bit ones, int16 against 8-bit (see w8_tile)
    return has_zp ? run<int8_t, false, true>(x, M, K, group, weights)
                  : run<int8_t, true, false>(x, M, K, group, weights);
  return has_zp ? run<int16_t, false, true>(x, M, K, group, weights)
                : run<int16_t, true, false>(x, M, K, group, weights);
#else
  TORCH_CHECK(false, "lowbit._C.linear_a8_blocks needs AVX2 and FMA");
#endif
}

std::tuple<at::Tensor, bool> linear_a8_blocks(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                              const c10::optional<at::Tensor>& zero_point, int64_t bits,
                                              int64_t group, bool zero_point_min) {
  auto [ys, finite] = linear_a8_blocks_many(x, {codes}, {scale}, {zero_point}, bits, group, zero_point_min);
  return {ys[0], finite};
}

// x float32 [M, K] quantized to int8 in blocks of 32 and dequantized (the reference's
// float32 (q * d)), for the many-row path that multiplies it with float weight tiles.
// Returns it and whether x was finite.
std::tuple<at::Tensor, bool> fake_quantize_a8_blocks(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % BLOCK == 0,
              "lowbit._C.fake_quantize_a8_blocks: contiguous float32 x [M, K] with K a multiple of 32 expected");
  const int64_t M = x.size(0), K = x.size(1), nb = K / BLOCK;
  at::Tensor out = at::empty_like(x);
  std::vector<char> finite(M);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<int16_t> q(K);
    std::vector<float> d(nb), xs(nb);
    for (int64_t m = m0; m < m1; ++m) {
      finite[m] = quantize_row<int16_t>(x.data_ptr<float>() + m * K, K, BLOCK, false, q.data(), d.data(), xs.data());
      float* o = out.data_ptr<float>() + m * K;
      for (int64_t k = 0; k < K; ++k) o[k] = static_cast<float>(q[k]) * d[k / BLOCK];
    }
  });
  return {out, std::all_of(finite.begin(), finite.end(), [](char f) { return f; })};
}
