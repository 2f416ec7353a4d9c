// Activations quantized to int8 in blocks of 32 values (the scheme int8-sym-g32,
// llama.cpp's Q8_0 activations), as the kernels that multiply them (gemv_a8.cpp for a few
// rows, gemm_a8.cpp and gemm_i16.cpp for many) take them: the reference's codes and
// scales, bit for bit.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "kernels.h"
#include "panels.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOWBIT_A8_BLOCKS 1
#endif

namespace a8 {

constexpr int64_t BLOCK = 32;  // activation values per int8 block

// One block of 32 values: d = max|x| / 127.5 (1 for an all-zero block) and the codes
// q = clamp(round_half_even(x / d), -128, 127) as int32: choose_qparams and quantize of the
// reference for "int8-sym-g32", bit for bit.  Returns whether the block was finite (NaN and
// Inf fail "a <= FLT_MAX").
inline bool block_codes(const float* xb, float& scale, int32_t* q) {
#ifdef LOWBIT_A8_BLOCKS
  const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 v[4], mx = _mm256_setzero_ps();
  int ok = 0xFF;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 a = _mm256_andnot_ps(sign, v[i]);
    ok &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ));  // NaN and Inf fail
    mx = _mm256_max_ps(mx, a);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  scale = _mm_cvtss_f32(m4) / 127.5f;
  if (!(scale > 0.f)) scale = 1.f;
  const __m256 sv = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
  for (int i = 0; i < 4; ++i) {  // x / scale correctly rounded, then to nearest even: as torch
    const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i), _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r))));
  }
  return ok == 0xFF;
#else
  bool finite = true;
  float amax = 0.f;
  for (int i = 0; i < BLOCK; ++i) {
    const float a = std::fabs(xb[i]);
    finite &= a <= std::numeric_limits<float>::max();
    amax = std::max(amax, a);
  }
  scale = amax / 127.5f;
  if (!(scale > 0.f)) scale = 1.f;
  for (int i = 0; i < BLOCK; ++i) q[i] = static_cast<int32_t>(std::min(127.f, std::max(-128.f, std::nearbyint(xb[i] / scale))));
  return finite;
#endif
}

// The same for bf16 values (widened to float32: exact).
inline bool block_codes(const c10::BFloat16* xb, float& scale, int32_t* q) {
  float x[BLOCK];
  for (int i = 0; i < BLOCK; ++i) x[i] = static_cast<float>(xb[i]);
  return block_codes(x, scale, q);
}

#ifdef LOWBIT_A8_BLOCKS
// One block's 32 codes (int32 c[0..3], 8 each, all in [-128, 127]: the packs are exact) stored
// as Q: in order at q, or (int8 only) split, its 16 even values at q and 16 odd at q + odd.
inline void store_codes(const __m256i c[4], int8_t* q, int64_t odd, bool split) {
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  // dword j of packed holds values [0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31][j]
  const __m256i v = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (!split) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v);
    return;
  }
  const __m256i by_parity = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                                             0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  // each lane [its 8 even | its 8 odd], then the lanes' even quads together: [16 even | 16 odd]
  const __m256i eo = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, by_parity), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm256_castsi256_si128(eo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + odd), _mm256_extracti128_si256(eo, 1));
}
inline void store_codes(const __m256i c[4], int16_t* q, int64_t, bool) {  // int16: 8-bit weights, never split
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8));
}
#endif

// Quantize row x [K] (float32 or bf16) into blocks (block_codes): writes the codes in the
// kernel's layout (int8, even elements then odd ones per block, for 4-bit weights; int16 in
// order for 8-bit), d, and xs[g] = sum_{b in g} d[b] * sum_{k in b} xq[k] (the zero-point
// term).  Returns whether the row was finite.
template <typename Q, typename X>
inline bool quantize_row(const X* x, int64_t K, int64_t group, bool split, Q* xq, float* d, float* xs) {
  const int64_t per_group = group / BLOCK;
  bool finite = true;
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    float scale;
    int32_t codes[BLOCK];
    finite &= block_codes(x + b * BLOCK, scale, codes);
    int32_t sum = 0;
    // split (4-bit weights): blocks in pairs of 64 bytes, [b0 even | b1 even | b0 odd | b1 odd],
    // 16 values each; a last block without a pair is [even | odd].
    const bool alone = b == K / BLOCK - 1 && b % 2 == 0;
    const int64_t base = (b / 2) * 2 * BLOCK + (alone ? 0 : (b % 2) * (BLOCK / 2));
#ifdef LOWBIT_A8_BLOCKS
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 8 * i));
    store_codes(c, xq + (split ? base : b * BLOCK), alone ? BLOCK / 2 : BLOCK, split);
    sum = isum8(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
#else
    for (int i = 0; i < BLOCK; ++i) {
      const int64_t slot = split ? base + (i % 2) * (alone ? BLOCK / 2 : BLOCK) + i / 2 : b * BLOCK + i;
      xq[slot] = static_cast<Q>(codes[i]);
      sum += codes[i];
    }
#endif
    d[b] = scale;
    if (b % per_group == 0) xs[b / per_group] = 0.f;
    xs[b / per_group] += scale * static_cast<float>(sum);
  }
  return finite;
}

// The checks every kernel taking float32 x [M, K] into blocks makes (`who` names it):
// x contiguous float32 2-D, the weight's group whole blocks that tile K.
inline void check_x(const char* who, const at::Tensor& x, int64_t group, bool bf16_too = false) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || (bf16_too && x.scalar_type() == at::kBFloat16)) &&
                  x.is_contiguous(),
              who, bf16_too ? ": contiguous float32 or bf16 x [M, K] expected" : ": contiguous float32 x [M, K] expected");
  TORCH_CHECK(group > 0 && group % BLOCK == 0 && x.size(1) % group == 0, who,
              ": the weight group must be a multiple of 32 that divides K");
}

// x [M, K] (float32 or bf16) quantized row by row (quantize_row, in order, rows in
// parallel): codes q [M][K], block scales d [M][K / 32], group sums xs [M][K / group], and
// whether x was finite.  With `padded` > M the arrays hold that many rows, those past M
// zero (tiles that read whole 16-row blocks).
template <typename Q>
struct Rows {
  std::vector<Q> q;
  std::vector<float> d, xs;
  bool finite = true;
  template <typename X>
  Rows(const X* x, int64_t M, int64_t K, int64_t group, int64_t padded = 0)
      : q(std::max(M, padded) * K), d(std::max(M, padded) * (K / BLOCK)), xs(std::max(M, padded) * (K / group)) {
    const int64_t nb = K / BLOCK, G = K / group;
    std::vector<char> ok(M);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        ok[m] = quantize_row<Q>(x + m * K, K, group, false, q.data() + m * K, d.data() + m * nb, xs.data() + m * G);
    });
    finite = std::all_of(ok.begin(), ok.end(), [](char f) { return f; });
  }
};

// The factor of the zero-point term of weight value i (per row and group): s z, or s again
// for signed codes (the kernel scales that term by its offset), or -m in the "min" domain
// (q * s + m: the term subtracted is then -m times the group sums).  From the value's scale s
// and zero point z (has_z false: signed codes, z unused; min: z holds m).
inline float zero_factor(float s, float z, bool has_z, bool min) { return !has_z ? s : min ? -z : s * z; }
inline float zero_factor(const PackedWeight& wt, int64_t i) {
  return zero_factor(wt.scale(i), wt.z ? wt.zero(i) : 0.f, wt.z != nullptr, wt.min);
}
#if defined(__AVX512F__)
// zero_factor of 16 groups with zero points (z): s * z, or -m (an exact sign flip).
inline __m512 zero_factors16(__m512 s, __m512 z, bool min) {
  return min ? _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(z), _mm512_set1_epi32(INT32_MIN)))
             : _mm512_mul_ps(s, z);
}
#endif

// The loop of the many-row kernels (gemm_a8.cpp, gemm_i16.cpp): x [M, K] in blocks
// (Rows<Q>), then every weight in panels of COLS of its rows (each_panel), each thread
// with its own panel of K x COLS codes of type P that pack_codes(weight, n0, panel) lays
// out, and per group and column the panel's s and s * z (s again for signed codes, -m for
// the "min" domain's q * s + m: the term subtracted is then -m times the group sums);
// tile(rows, xq, d, xs, panel, s, sz, y, ldy, cols) for each tile, with x's codes, block
// scales and group sums at the tile's first row.  False (nothing written) if x held NaN or Inf.
template <typename Q, typename P, int COLS, int ROWS, typename PackCodes, typename Tile>
bool blocks_by_panels(const float* x, int64_t M, int64_t K, int64_t group, const std::vector<PackedWeight>& weights,
                      PackCodes pack_codes, Tile tile) {
  const int64_t G = K / group, nb = K / BLOCK;
  const Rows<Q> rows(x, M, K, group);
  if (!rows.finite) return false;
  std::vector<int64_t> Ns;
  for (const PackedWeight& wt : weights) Ns.push_back(wt.N);
  struct Scratch {
    std::vector<P> panel;
    std::vector<float> s, sz;
  };
  each_panel<COLS, ROWS>(
      Ns, M,
      [&] { return Scratch{std::vector<P>(K * COLS), std::vector<float>(G * COLS), std::vector<float>(G * COLS)}; },
      [&](size_t j, int64_t n0, Scratch& t) {
        const PackedWeight& wt = weights[j];
        pack_codes(wt, n0, t.panel.data());
        pack_groups<COLS>(wt.N, G, n0, t.s.data(), [&](int64_t n, int64_t g) { return wt.scale(n * G + g); });
        pack_groups<COLS>(wt.N, G, n0, t.sz.data(), [&](int64_t n, int64_t g) { return zero_factor(wt, n * G + g); });
      },
      [&](auto r, size_t j, int64_t m, int64_t n0, int cols, Scratch& t) {
        const PackedWeight& wt = weights[j];
        tile(r, rows.q.data() + m * K, rows.d.data() + m * nb, rows.xs.data() + m * G, t.panel.data(), t.s.data(),
             t.sz.data(), wt.y + m * wt.N + n0, wt.N, cols);
      });
  return true;
}

#if defined(LOWBIT_A8_BLOCKS) && defined(__AVX512F__) && defined(__AVX512BW__)
// The panel layout of the AVX-512 block GEMMs (gemm_amx.cpp's B tiles, gemm_a8_vnni.cpp's
// register tiles): 16 weight rows as the 16 dword lanes of a vector, 4 consecutive codes
// of K in each dword, half_panel[k / 4][column][4], one byte per code.

// 64 codes of weight row `row` from element k (32 past a K % 64 == 32 tail: the rest zero),
// one byte each in k order: 4-bit codes (byte i holds element 2i in its low nibble) as u8,
// signed ones as q + 8; 8-bit codes as stored, or with flip8 as u = q + 128 (q ^ 0x80: signed
// 8-bit codes as the unsigned operand of vpdpbusd).
inline __m512i row_codes(const uint8_t* row, int64_t k, int64_t K, int bits, bool is_signed, bool flip8) {
  const int64_t n = std::min<int64_t>(64, K - k);
  if (bits == 8) {
    const __m512i c = _mm512_maskz_loadu_epi8(n == 64 ? ~0ULL : (1ULL << n) - 1, row + k);
    return flip8 ? _mm512_xor_si512(c, _mm512_set1_epi8(static_cast<char>(0x80))) : c;
  }
  const __m128i low = _mm_set1_epi8(0x0F), flip = _mm_set1_epi8(is_signed ? 0x08 : 0x00);
  __m256i half[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int h = 0; h < n / 32; ++h) {  // 16 bytes: 32 codes
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2 + 16 * h));
    const __m128i lo = _mm_xor_si128(_mm_and_si128(raw, low), flip);
    const __m128i hi = _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(raw, 4), low), flip);
    half[h] = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
  }
  return _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);
}

// Weight rows [n0, n0 + 16 * halves) (rows past N repeat row N - 1: computed, never stored)
// into `halves` panels of 16 columns, panel + h * K * 16 for half h (row_codes' bytes).
inline void pack_half_panels(const PackedWeight& wt, int64_t K, int bits, int64_t n0, int halves, uint8_t* panel,
                             bool flip8 = false) {
  const int64_t row_bytes = bits == 4 ? K / 2 : K;
  for (int h = 0; h < halves; ++h) {
    uint8_t* out = panel + h * K * 16;
    const uint8_t* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = wt.w + std::min<int64_t>(n0 + 16 * h + i, wt.N - 1) * row_bytes;
    for (int64_t k = 0; k < K; k += 64) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = row_codes(rows[i], k, K, bits, !wt.z, flip8);
      transpose16(r);  // r[j]: dword j (values k + 4j .. k + 4j + 3) of the 16 rows
      for (int j = 0; j < 16 && k + 4 * j < K; ++j) _mm512_storeu_si512(out + (k / 4 + j) * 64, r[j]);
    }
  }
}

// The scales and zero-point factors (zero_factor) of a strip of 16 weight rows as [G][16]
// (row n[r] in lane r), for the one-row kernel whose lanes are weight rows (gemv_a8_vnni.cpp).
// Signed codes (no z): their factor is s itself, so zfactor is left alone (read scale).
#if defined(__AVX512VL__)
template <typename S>
inline void strip_scales(const S* s, const S* z, bool min, int64_t G, const int64_t* n, float* scale, float* zfactor) {
  strip_columns(G, [&](int r, int64_t g0, __mmask16 in) { return scale16(s + n[r] * G + g0, in); }, scale);
  if (!z) return;
  strip_columns(G, [&](int r, int64_t g0, __mmask16 in) {
    return zero_factors16(scale16(s + n[r] * G + g0, in), scale16(z + n[r] * G + g0, in), min);
  }, zfactor);
}
#endif
#endif

}  // namespace a8
