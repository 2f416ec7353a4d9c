// Fused quantized matmuls for small M (decode): the weight is read once, in its packed
// form, and never written out as floats.  Conventions: lowbit/scheme.py.
//
// Layout facts used here (all from the scheme): a weight is [N, K] with groups of
// `group` along K; 4-bit codes are u32x8 words, which read as bytes are the u8x2 layout:
// byte i of a row holds element 2i in its low nibble and 2i+1 in its high nibble.
// So a block of 32 values is 16 bytes whose low nibbles are the even elements and
// high nibbles the odd ones; the activations are split the same way once per call
// (x_even, x_odd), and no shuffle is needed in the inner loop.
//
// Weight-only (W4A16, W8A16), per output n and row m:
//   y = sum_g s[n,g] * (sum_{k in g} q[n,k] x[k]  -  z[n,g] * sum_{k in g} x[k])
// which is the reference sum_k (q - z) s x regrouped, in float32.
//
// W4A8 (linear_qta8a_qga4w), all integer inside a group, with u = unsigned nibble
// (signed weights: u = q + 8, zero point 8), int8 x with per-token zero point xz:
//   sum_{k in g} (x - xz)(u - z) = x.u - z sum x - xz sum u + |g| xz z
// x.u and sum u are vpdpbusd dot products (u8 x s8 -> s32); the float scale is
// applied once per group.

#include "balance.h"
#include "kernels.h"
#include "simd.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kHaveAvx512 = true;
#else
constexpr bool kHaveAvx512 = false;
#endif
// The weight-only decode kernels exist in two widths: 16 float lanes (AVX-512) and 8
// (AVX2 + FMA, most x86-64 CPUs since 2013-2015: the portable path, e.g. an AVX2-only Zen 2).
// (F16C too, for float16 scales: every CPU with AVX2 has it.)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__F16C__)
#define LOWBIT_GEMV_F32 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOWBIT_GEMV_F32 256
#endif

constexpr int MB = 4;  // activation rows computed together (each unpacked weight reused MB times)

// f(std::integral_constant<int, GROUP>) with GROUP = group where it is 32, 64 or 128, else 0
// (the kernels then take the run-time group).
template <typename F>
void with_group(int64_t group, F&& f) {
  switch (group) {
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    default: f(std::integral_constant<int, 0>{});
  }
}

#ifdef LOWBIT_GEMV_F32

// ---- weight-only, float32 accumulation ----------------------------------------------------
// One kernel at two widths: `Lanes` is 16 float lanes (AVX-512) or 8 (AVX2 + FMA), the only
// place the width shows.  xe/xo: [M, K/2] even/odd activations of each 32-block; xs: [M, G]
// group sums of x.  4-bit codes take the zero point as z * sum(x) once per group (xs) after
// the sum of q x (signed codes as u = q + 8 and z = 8: each widened byte xor 0x88, then
// the unsigned nibbles' and / shift, where sign-extending each nibble took two shifts; one
// op fewer per 8 codes, against the vectorized 8 s sum(x) per row: 1536 x 576 and 576 x
// 1536 int4-sym-g32-f16 at one row 1.05-1.09x faster, in the L2 or cycling through 70 MB,
// AVX2 EPYC; xor before the widening measured 0.91x, one uop more); 8-bit codes have it
// subtracted from each code (q - z, exact in float32) before its product.  The per-group
// term cancels against the sum of q x, within the same bound (sum (|q| + |z|) |x|,
// tests/test_matmul.py): the bundled model's logits against the
// float model on its dequantized weights (int4 g64 with zero points, one row) are 5.9e-5
// apart with it and 2.0e-5 with q - z, of logits up to 27; without the two subtractions per
// 16 codes a w4a16-g128-head8 decode step is 1.11x faster (AVX2 EPYC).
// (A 16-entry vpermps table of (code - z) * s per group measured 1.9x slower on Zen 5:
// cross-lane permutes of zmm registers are expensive there.)
#if LOWBIT_GEMV_F32 == 512
struct Lanes {
  static constexpr int N = 16;
  using F = __m512;
  using I = __m512i;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static __m128i bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static I widen(__m128i b, bool is_signed) { return is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static I srl(I v, int n) { return _mm512_srli_epi32(v, n); }
  static I low4(I v) { return _mm512_and_si512(v, _mm512_set1_epi32(0xF)); }
  static I flip(I v) { return _mm512_xor_si512(v, _mm512_set1_epi32(0x88)); }  // signed nibbles q to q + 8
};
#else
struct Lanes {
  static constexpr int N = 8;
  using F = __m256;
  using I = __m256i;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static float sum(F v) { return fsum8(v); }
  static __m128i bytes(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
  static I widen(__m128i b, bool is_signed) { return is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static I srl(I v, int n) { return _mm256_srli_epi32(v, n); }
  static I low4(I v) { return _mm256_and_si256(v, _mm256_set1_epi32(0xF)); }
  static I flip(I v) { return _mm256_xor_si256(v, _mm256_set1_epi32(0x88)); }  // signed nibbles q to q + 8
};
#endif
using F = Lanes::F;
constexpr int L = Lanes::N;

// One activation row alone would chain every FMA of a group on the one before it (4-5
// cycles of latency each): it gets A = 4 independent accumulators (summed per group),
// several rows share the weight's unpacking and are independent chains already.
template <int R>
constexpr int kChains = R == 1 ? 4 : 1;
template <int A>
inline F sum_of(const F* d) {
  if constexpr (A == 1) return d[0];
  else if constexpr (A == 2) return Lanes::add(d[0], d[1]);
  else return Lanes::add(Lanes::add(d[0], d[1]), Lanes::add(d[2], d[3]));
}

// sum_g s[g] z[g] xs[g] (z == nullptr: sum_g s[g] xs[g]) over one row's G groups, as eight
// lanes to be summed: eight groups a vector, the last G % 8 in the window of the row's last
// eight groups with the lanes already counted masked off (nothing read past the row), rows
// of fewer than eight groups by scalar FMAs.  The zero points' term of w4_rows and
// the "min" form's offsets (add_mins).  (Both were a scalar FMA per group after the group's
// dot product, with its float16 conversions: int4-asym-g32-f16 at one row 1.09x faster
// without it, the "min" form (Q4_1's) 1.16-1.23x, 64- and 128-groups the same (0.95-1.02x),
// 1536 x 576 and 576 x 1536 in the L2 or cycling through 70 MB, one and two threads, AVX2
// EPYC, each against the scalar loop in one process.)
template <typename S>
inline __m256 group_terms(const S* s, const S* z, const float* xs, int64_t G) {
  const auto factor = [z, s](int64_t g) { return z ? _mm256_mul_ps(scale8(s + g), scale8(z + g)) : scale8(s + g); };
  __m256 c = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) c = _mm256_fmadd_ps(factor(g), _mm256_loadu_ps(xs + g), c);
  if (g == G) return c;
  if (G >= 8) {
    const int64_t start = G - 8;  // lanes i with start + i < g were counted above
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(g - start - 1))));
    return _mm256_add_ps(c, _mm256_and_ps(_mm256_mul_ps(factor(start), _mm256_loadu_ps(xs + start)), keep));
  }
  // fewer than eight groups: scalar FMAs after the row (a zero-padded copy measured 2.2x
  // slower at K = 128; these, against the FMA per group inside the group loop they replaced,
  // 0.82x for int4-g32 at K = 128, the same for the "min" form)
  float t = 0.f;
  for (int64_t i = 0; i < G; ++i) t = std::fma(z ? scale1(s + i) * scale1(z + i) : scale1(s + i), xs[i], t);
  return _mm256_setr_ps(t, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f);
}

// R activation rows x W weight rows (row_bytes apart; their scales and zero points G apart,
// outputs 1 apart).  One activation row keeps the low and the high nibbles' products in two
// chains per weight row, and takes two weight rows at once where it can (W = 2: four chains,
// the x loads shared): every weight row is summed in the same order whether it runs alone or
// in a pair.  GROUP: the group size where it is a common one (32, 64, 128), so that the
// block loop has a constant count and unrolls; 0: any multiple of 32.  A 32-block's 16 code
// bytes are read L at a time (one step at 16 lanes, two at 8), each line of them prefetching
// the line kStreamAhead on into the L2 (as w8_rows; float32 models' 4-bit decode steps on the
// Zen 4 1.03-1.10x, q4_0 and q4_1, in-process A/B).
template <int R, int W, bool SIGNED, bool HAS_ZP, int GROUP, typename S>
void w4_rows(const float* xe, const float* xo, const float* xs, int64_t K, int64_t G, int64_t group, const uint8_t* w,
             int64_t row_bytes, const S* s, const S* z, float* y, int64_t ldy) {
  constexpr int C = R == 1 ? 2 : 1;
  const int64_t size = GROUP ? GROUP : group;
  F total[R][W];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) total[r][j] = Lanes::zero();
  for (int64_t g = 0; g < G; ++g) {
    F dot[R][W][C];
    for (int j = 0; j < W; ++j) {
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) dot[r][j][c] = Lanes::zero();
    }
    for (int64_t b = 0; b < size / 32; ++b)
      for (int part = 0; part < 16 / L; ++part) {
        const int64_t off = (g * size + b * 32) / 2 + L * part;  // byte offset == index into xe/xo
        for (int j = 0; j < W; ++j) {
          if (off % 64 == 0) prefetch_l2(w + j * row_bytes + off + kStreamAhead);
          Lanes::I v = Lanes::widen(Lanes::bytes(w + j * row_bytes + off), false);
          if constexpr (SIGNED) v = Lanes::flip(v);
          const Lanes::I lo = Lanes::low4(v), hi = Lanes::srl(v, 4);
          const F flo = Lanes::cvt(lo), fhi = Lanes::cvt(hi);
          for (int r = 0; r < R; ++r) {
            dot[r][j][0] = Lanes::fma(flo, Lanes::load(xe + r * (K / 2) + off), dot[r][j][0]);
            dot[r][j][C - 1] = Lanes::fma(fhi, Lanes::load(xo + r * (K / 2) + off), dot[r][j][C - 1]);
          }
        }
      }
    for (int j = 0; j < W; ++j) {
      const F sg = Lanes::set1(scale1(s + j * G + g));
      for (int r = 0; r < R; ++r) {
        const F d = C == 2 ? Lanes::add(dot[r][j][0], dot[r][j][C - 1]) : dot[r][j][0];
        total[r][j] = Lanes::fma(d, sg, total[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) {
      float corr = 0.f;
      if constexpr (HAS_ZP) corr = fsum8(group_terms(s + j * G, z + j * G, xs + r * G, G));
      if constexpr (SIGNED) corr = 8.f * fsum8(group_terms<S>(s + j * G, nullptr, xs + r * G, G));
      y[r * ldy + j] = Lanes::sum(total[r][j]) - corr;
    }
}

// The n <= 8 scales at p as float32: p itself, or float16 bits converted into buf (one
// conversion per 8 groups rather than a scalar one per group).
inline const float* as_floats(const float* p, int64_t, float*) { return p; }
inline const float* as_floats(const uint16_t* p, int64_t n, float* buf) {
  if (n == 8) _mm256_storeu_ps(buf, scale8(p));
  else for (int64_t i = 0; i < n; ++i) buf[i] = scale1(p + i);
  return buf;
}

// R activation rows x W weight rows (K bytes apart, their scales G apart, outputs 1 apart),
// 8-bit codes.  Inlined into wo_rows: as a call per row (GCC kept it one) each row's
// horizontal sum and the call ended before the next row's loads could start; inlined,
// 1536 x 576 int8 at one row and thread, cache-resident, 63 -> 56 us (AVX2 EPYC).  Each
// line of codes read prefetches the line kStreamAhead on into the L2 (simd.h; it was rows
// n + 8 and n + 9 into the L1 as a pair started): a decode step of w8a16-head8 on the Zen 4,
// all its linears here, 1.40x (in-process A/B, 6 rounds, 128 positions: 109.6 -> 144.6
// tok/s median), q8_0 1.22x.  Blocks of L codes: group is a multiple of 16.
// GROUP: the group size where it is a common one (with_group), else 0: a constant block
// count, and no more chains than a group has blocks.  The first block of a chain is a
// product, the others FMAs onto it: one row of x in groups of 32 at 16 lanes is one chain
// q0 x0 + q1 x1, the order of the MB-row kernel, so a row's sums are the same alone or in
// a batch (and the same as the two chains and an add this replaced wherever q x is exact:
// bf16 x).  One row of x takes two weight rows at once (W = 2: two chains per group, the x
// loads shared; each weight row summed as alone), and float16 scales are converted 8 at a
// time (as_floats) rather than one per group: 1536 x 576 int8-sym-g32-f16 at one row
// 1.12-1.14x faster in the L2 and 1.03-1.05x cycling through the L3 (Xeon, two threads).
template <int R, int W, bool SIGNED, bool HAS_ZP, int GROUP, typename S>
__attribute__((always_inline)) inline void w8_rows(const float* x, int64_t K, int64_t G, int64_t group,
                                                   const uint8_t* w, const S* s, const S* z, float* y, int64_t ldy) {
  constexpr int A = GROUP == 32 && R == 1 ? 1 : GROUP && GROUP / L < kChains<R> ? GROUP / L : kChains<R>;
  F total[R][W];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) total[r][j] = Lanes::zero();
  const int64_t blocks = (GROUP ? GROUP : group) / L;
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int64_t g1 = std::min(G, g0 + 8);
    float sf[W][8], zf[W][8];
    const float* sg8[W];
    const float* zg8[W];
    for (int j = 0; j < W; ++j) {
      sg8[j] = as_floats(s + j * G + g0, g1 - g0, sf[j]);
      zg8[j] = HAS_ZP ? as_floats(z + j * G + g0, g1 - g0, zf[j]) : nullptr;
    }
    for (int64_t g = g0; g < g1; ++g) {
      F dot[R][W][A], zg[W];
      for (int j = 0; j < W; ++j) zg[j] = Lanes::set1(HAS_ZP ? zg8[j][g - g0] : 0.f);
      const auto block = [&](int64_t b, int a, bool first) {  // block b into chain a (a constant: in registers)
        const int64_t off = g * group + b * L;
        for (int j = 0; j < W; ++j) {
          if (off % 64 == 0) prefetch_l2(w + j * K + off + kStreamAhead);
          F q = Lanes::cvt(Lanes::widen(Lanes::bytes(w + j * K + off), SIGNED));
          if constexpr (HAS_ZP) q = Lanes::sub(q, zg[j]);
          for (int r = 0; r < R; ++r)
            dot[r][j][a] = first ? Lanes::mul(q, Lanes::load(x + r * K + off))
                                 : Lanes::fma(q, Lanes::load(x + r * K + off), dot[r][j][a]);
        }
      };
      for (int a = 0; a < A; ++a)  // the first block of each chain (a run-time group may have fewer)
        if (a < blocks) block(a, a, true);
        else for (int r = 0; r < R; ++r)
          for (int j = 0; j < W; ++j) dot[r][j][a] = Lanes::zero();
      int64_t b = A;
      for (; b + A <= blocks; b += A)  // whole rounds of the A chains, no exit test per block
        for (int a = 0; a < A; ++a) block(b + a, a, false);
      for (int a = 0; a < A; ++a)  // the last blocks (group / L not a multiple of A)
        if (b + a < blocks) block(b + a, a, false);
      for (int j = 0; j < W; ++j) {
        const F sg = Lanes::set1(sg8[j][g - g0]);
        for (int r = 0; r < R; ++r) total[r][j] = Lanes::fma(sum_of<A>(dot[r][j]), sg, total[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) y[r * ldy + j] = Lanes::sum(total[r][j]);
}
#endif

// ---- W4A8: int8 activations x u4 weights, integer dot products --------------------------
// With AVX-512 VNNI: vpdpbusd (u8 x s8, four products summed into each int32 lane).  With
// AVX2 alone: vpmaddubsw (u8 x s8, pairs summed in int16: the low and the high nibbles'
// pairs together are at most 2 * 2 * 15 * 128 = 7680, no saturation) and vpmaddwd by ones
// into int32 lanes: the same exact integers, for 16- and 32-byte vectors.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LOWBIT_W4A8_VNNI 1
#endif
#if defined(LOWBIT_W4A8_VNNI) || defined(__AVX2__)
#define LOWBIT_W4A8 1
// xe/xo: [M, K/2] int8 even/odd activations of each 32-block; xsum: [M, G] int32 sums.
inline int32_t hsum(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
  return _mm_cvtsi128_si32(v);
}
inline int32_t hsum(__m256i v) {
  return hsum(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
#ifdef LOWBIT_W4A8_VNNI
inline int32_t hsum(__m512i v) { return _mm512_reduce_add_epi32(v); }
#endif

// One vector width of the W4A8 inner loop: BYTES packed bytes = 2 * BYTES values.
template <int BYTES> struct Vec;
template <> struct Vec<16> {
  using I = __m128i;
  using F = __m128;
  static I load(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
  static I zero() { return _mm_setzero_si128(); }
  static I bytes(int8_t v) { return _mm_set1_epi8(v); }
  static I lo(I w, I mask, I flip) { return _mm_xor_si128(_mm_and_si128(w, mask), flip); }
  static I hi(I w, I mask, I flip) { return _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(w, 4), mask), flip); }
#ifdef LOWBIT_W4A8_VNNI
  // acc + u1.x1 + u2.x2, four u8 x s8 products per int32 lane
  static I dot2(I acc, I u1, I x1, I u2, I x2) { return _mm_dpbusd_epi32(_mm_dpbusd_epi32(acc, u1, x1), u2, x2); }
#else
  // acc + u1.x1 + u2.x2 in int32 lanes: pairs of u8 x s8 products in int16 (the low and the
  // high nibbles' together at most 2 * 2 * 15 * 128 = 7680), widened by vpmaddwd
  static I dot2(I acc, I u1, I x1, I u2, I x2) {
    const I pairs = _mm_add_epi16(_mm_maddubs_epi16(u1, x1), _mm_maddubs_epi16(u2, x2));
    return _mm_add_epi32(acc, _mm_madd_epi16(pairs, _mm_set1_epi16(1)));
  }
#endif
  // acc + the sums of u1 + u2 over each 8 bytes, in the low dword of each 64-bit lane (vpsadbw)
  static I add_sums(I acc, I u1, I u2) { return _mm_add_epi64(acc, _mm_sad_epu8(_mm_add_epi8(u1, u2), zero())); }
  static I sub_mul(I a, I b, int32_t c) { return _mm_sub_epi32(a, _mm_mullo_epi32(b, _mm_set1_epi32(c))); }  // a - b c
  static F fzero() { return _mm_setzero_ps(); }
  static F fma(I acc, float s, F t) { return _mm_fmadd_ps(_mm_cvtepi32_ps(acc), _mm_set1_ps(s), t); }
  static float fsum(F t) {
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
  }
};
template <> struct Vec<32> {
  using I = __m256i;
  using F = __m256;
  static I load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I bytes(int8_t v) { return _mm256_set1_epi8(v); }
  static I lo(I w, I mask, I flip) { return _mm256_xor_si256(_mm256_and_si256(w, mask), flip); }
  static I hi(I w, I mask, I flip) { return _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), mask), flip); }
#ifdef LOWBIT_W4A8_VNNI
  static I dot2(I acc, I u1, I x1, I u2, I x2) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, u1, x1), u2, x2);
  }
#else
  static I dot2(I acc, I u1, I x1, I u2, I x2) {
    const I pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u1, x1), _mm256_maddubs_epi16(u2, x2));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
#endif
  static I add_sums(I acc, I u1, I u2) {
    return _mm256_add_epi64(acc, _mm256_sad_epu8(_mm256_add_epi8(u1, u2), zero()));
  }
  static I sub_mul(I a, I b, int32_t c) { return _mm256_sub_epi32(a, _mm256_mullo_epi32(b, _mm256_set1_epi32(c))); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fma(I acc, float s, F t) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(s), t); }
  static float fsum(F t) {
    return Vec<16>::fsum(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }
};
#ifdef LOWBIT_W4A8_VNNI
template <> struct Vec<64> {
  using I = __m512i;
  using F = __m512;
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I zero() { return _mm512_setzero_si512(); }
  static I bytes(int8_t v) { return _mm512_set1_epi8(v); }
  static I lo(I w, I mask, I flip) { return _mm512_xor_si512(_mm512_and_si512(w, mask), flip); }
  static I hi(I w, I mask, I flip) { return _mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi16(w, 4), mask), flip); }
  static I dot2(I acc, I u1, I x1, I u2, I x2) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, u1, x1), u2, x2);
  }
  static I add_sums(I acc, I u1, I u2) {
    return _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_add_epi8(u1, u2), zero()));
  }
  static I sub_mul(I a, I b, int32_t c) { return _mm512_sub_epi32(a, _mm512_mullo_epi32(b, _mm512_set1_epi32(c))); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fma(I acc, float s, F t) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(s), t); }
  static float fsum(F t) { return _mm512_reduce_add_ps(t); }
};
#endif

#ifdef LOWBIT_W4A8_VNNI
// R activation rows x one weight row, any group (a multiple of 32; w4a8_rows512 below takes
// the usual ones).  The products x.u accumulate in int32 lanes inside a group (exact: a
// lane holds at most group/16 * 4 products of |x| <= 128, u <= 15), are converted to float
// once per group and scaled by s[g]; the zero-point terms are exact int32 scalars per group
// (xg: w4a8_group_sums, sum x - |g| xz).
template <int R, int BYTES>
void w4a8_rows(const int8_t* xe, const int8_t* xo, const int32_t* xg, const int32_t* xzp, int64_t K,
               int64_t G, int64_t group, const uint8_t* w, const float* s, const int32_t* z, bool is_signed,
               float* y, int64_t ldy) {
  using V = Vec<BYTES>;
  typename V::F total[R];
  float corr[R];
  for (int r = 0; r < R; ++r) { total[r] = V::fzero(); corr[r] = 0.f; }
  const auto mask = V::bytes(0x0F), flip = V::bytes(is_signed ? 0x08 : 0x00), ones = V::bytes(1);
  const int64_t blocks = group / (2 * BYTES);
  for (int64_t g = 0; g < G; ++g) {
    typename V::I acc[R];
    auto accw = V::zero();
    for (int r = 0; r < R; ++r) acc[r] = V::zero();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t off = (g * group + b * 2 * BYTES) / 2;
      const auto bytes = V::load(w + off);
      const auto lo = V::lo(bytes, mask, flip), hi = V::hi(bytes, mask, flip);
      accw = V::dot2(accw, lo, ones, hi, ones);
      for (int r = 0; r < R; ++r)
        acc[r] = V::dot2(acc[r], lo, V::load(xe + r * (K / 2) + off), hi, V::load(xo + r * (K / 2) + off));
    }
    const int32_t zg = is_signed ? 8 : (z ? z[g] : 0);
    const int32_t wsum = hsum(accw);  // sum of u over the group, shared by the R rows
    for (int r = 0; r < R; ++r) {
      total[r] = V::fma(acc[r], s[g], total[r]);
      const int32_t xz = xzp[r];
      corr[r] += s[g] * static_cast<float>(-zg * xg[r * G + g] - xz * wsum);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = V::fsum(total[r]) + corr[r];
}

// Whether w4a8_rows512 takes K and group: whole 64-value halves of a block, groups that
// tile a block (32, 64) or whole blocks (multiples of 128).
inline bool rows512_fits(int64_t K, int64_t group) {
  return K % 64 == 0 && (group == 32 || group == 64 || group % 128 == 0);
}

// The scale of each dword lane's group in a block of 128 values from element p: lane i holds
// values p + 8i .. p + 8i + 7 (GROUP 32: four lanes a group, 64: eight).
template <int GROUP>
inline __m512 lane_scales(const float* s, int64_t p) {
  const int64_t g = p / GROUP;
  if constexpr (GROUP == 64) return _mm512_insertf32x8(_mm512_set1_ps(s[g]), _mm256_set1_ps(s[g + 1]), 1);
  __m512 v = _mm512_set1_ps(s[g]);
  v = _mm512_insertf32x4(v, _mm_set1_ps(s[g + 1]), 1);
  v = _mm512_insertf32x4(v, _mm_set1_ps(s[g + 2]), 2);
  return _mm512_insertf32x4(v, _mm_set1_ps(s[g + 3]), 3);
}

// R activation rows x one weight row in blocks of 128 values (64 code bytes, one zmm), the
// decode kernel of W4A8.  Per block and row: u.x by two vpdpbusd into dword lanes (each lane
// 8 values of one group), the sums of u by one vpsadbw into the low dword of each qword
// lane (shared by the R rows), xz times them taken away lane by lane; the lanes then hold
// exact integer parts of sum (x - xz).u of their group, are converted (exact below 2^24),
// scaled by their group's s and added into float lanes, summed once per row at the end.
// Groups of 128 or more first add their blocks in the int32 lanes.  The rest of each group,
// -z sum (x - xz) = -z xg[g] (w4a8_group_sums), is one exact int32 product per row and group,
// converted and scaled 16 groups at a time.  No horizontal sum per group: the previous
// kernel took one of u per group (hsum) and a scalar zero-point term, 2-3x the instructions
// of this one per value (3072 x 576 at M = 1: 7 GB/s, weights in L2 or not).  A 64-value
// tail (K = 576) runs in ymm lanes the same way.  SIGNED codes are flipped to u = q + 8, z = 8.
// ahead > 0: the codes `ahead` bytes on are prefetched, a line per line read.
template <int R, bool SIGNED, int GROUP>
void w4a8_rows512(const int8_t* xe, const int8_t* xo, const int32_t* xg, const int32_t* xzp, int64_t K, int64_t G,
                  int64_t group, const uint8_t* w, const float* s, const int32_t* z, float* y, int64_t ldy,
                  int64_t ahead = 0) {
  const int64_t half = K / 2, full = K / 128 * 128;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  // The codes of 2 * V bytes of values at element p unpacked (u, flipped when SIGNED) and
  // their sums added into us; then row r's u.x added into acc.
  const auto unpack = [&](auto v, int64_t p, auto& lo, auto& hi, auto& us) {
    using V = decltype(v);
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w + p / 2 + ahead), _MM_HINT_T0);
    const auto bytes = V::load(w + p / 2), mask = V::bytes(0x0F), flip = V::bytes(SIGNED ? 0x08 : 0x00);
    lo = V::lo(bytes, mask, flip);
    hi = V::hi(bytes, mask, flip);
    us = V::add_sums(us, lo, hi);
  };
  const auto dot = [&](auto v, auto acc, auto lo, auto hi, int r, int64_t p) {
    using V = decltype(v);
    return V::dot2(acc, lo, V::load(xe + r * half + p / 2), hi, V::load(xo + r * half + p / 2));
  };
  using Z = Vec<64>;
  using Y = Vec<32>;
  if constexpr (GROUP == 0) {
    for (int64_t g = 0, p = 0; g < G; ++g) {
      Z::I acc[R], us = Z::zero(), lo, hi;
      for (int r = 0; r < R; ++r) acc[r] = Z::zero();
      for (const int64_t end = p + group; p < end; p += 128) {
        unpack(Z{}, p, lo, hi, us);
        for (int r = 0; r < R; ++r) acc[r] = dot(Z{}, acc[r], lo, hi, r, p);
      }
      const __m512 sv = _mm512_set1_ps(s[g]);
      for (int r = 0; r < R; ++r)
        total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Z::sub_mul(acc[r], us, xzp[r])), sv, total[r]);
    }
  } else {
    for (int64_t p = 0; p < full; p += 128) {
      Z::I us = Z::zero(), lo, hi;
      unpack(Z{}, p, lo, hi, us);
      const __m512 sv = lane_scales<GROUP>(s, p);
      for (int r = 0; r < R; ++r)
        total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Z::sub_mul(dot(Z{}, Z::zero(), lo, hi, r, p), us, xzp[r])),
                                   sv, total[r]);
    }
    if (full < K) {  // the last 64 values: one group of 64 or two of 32, in ymm lanes
      Y::I us = Y::zero(), lo, hi;
      unpack(Y{}, full, lo, hi, us);
      const int64_t g = full / GROUP;
      const __m256 sv = GROUP == 64 ? _mm256_set1_ps(s[g])
                                    : _mm256_insertf128_ps(_mm256_set1_ps(s[g]), _mm_set1_ps(s[g + 1]), 1);
      for (int r = 0; r < R; ++r) {
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(Y::sub_mul(dot(Y{}, Y::zero(), lo, hi, r, full), us, xzp[r])), sv);
        total[r] = _mm512_add_ps(total[r], _mm512_zextps256_ps512(t));
      }
    }
  }
  for (int r = 0; r < R; ++r) {  // - sum_g s[g] z[g] xg[g], 16 groups at a time
    __m512 corr = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g += 16) {
      const __mmask16 in = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
      const __m512i zv = SIGNED ? _mm512_set1_epi32(8) : _mm512_maskz_loadu_epi32(in, z + g);
      const __m512i t = _mm512_mullo_epi32(zv, _mm512_maskz_loadu_epi32(in, xg + r * G + g));
      corr = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_maskz_loadu_ps(in, s + g), corr);
    }
    y[r * ldy] = _mm512_reduce_add_ps(total[r]) - _mm512_reduce_add_ps(corr);
  }
}
#else
// R activation rows x one weight row without VNNI.  Per step of 2 * BYTES values: u.x in
// int32 lanes (dot2), and the sums of u, shared by the R rows, in the low dwords of 64-bit
// lanes (vpsadbw of lo + hi: at most 8 * 30 a step).  At the end of a group every lane
// takes xz times its sum of u away: the lanes then add up to the group's sum (x - xz).u,
// exactly (int32: w4a8_gemm keeps |xz| 15 |g| below 2^30).  The lanes are
// scaled by s[g] and summed once per row at the end (no horizontal sum per group); the
// rest of the group's integer, -z sum (x - xz) = -z xg[g], is one exact product per row
// and group.  The same integers per group as the VNNI kernel.  SIGNED codes are flipped to
// u = q + 8 (zero point 8); unsigned ones are used as they are.
template <int R, int BYTES, bool SIGNED, int GROUP = 0>
void w4a8_rows(const int8_t* xe, const int8_t* xo, const int32_t* xg, const int32_t* xzp, int64_t K,
               int64_t G, int64_t group, const uint8_t* w, const float* s, const int32_t* z, bool /*is_signed*/,
               float* y, int64_t ldy) {
  using V = Vec<BYTES>;
  typename V::F total[R];
  float corr[R];
  for (int r = 0; r < R; ++r) {
    total[r] = V::fzero();
    corr[r] = 0.f;
  }
  const auto mask = V::bytes(0x0F), flip = V::bytes(SIGNED ? 0x08 : 0x00);
  const int64_t group_bytes = (GROUP ? GROUP : group) / 2;  // == values of the group in xe (and in xo)
  for (int64_t g = 0; g < G; ++g) {
    typename V::I acc[R], usum = V::zero();
    for (int r = 0; r < R; ++r) acc[r] = V::zero();
    const uint8_t* wg = w + g * group_bytes;
    const int8_t *xeg = xe + g * group_bytes, *xog = xo + g * group_bytes;
    for (int64_t off = 0; off < group_bytes; off += BYTES) {
      const auto bytes = V::load(wg + off);
      const auto lo = V::lo(bytes, mask, flip), hi = V::hi(bytes, mask, flip);  // (a constant 0 flip folds away)
      usum = V::add_sums(usum, lo, hi);
      for (int r = 0; r < R; ++r)
        acc[r] = V::dot2(acc[r], lo, V::load(xeg + r * (K / 2) + off), hi, V::load(xog + r * (K / 2) + off));
    }
    const int32_t zg = SIGNED ? 8 : z[g];
    for (int r = 0; r < R; ++r) {
      total[r] = V::fma(V::sub_mul(acc[r], usum, xzp[r]), s[g], total[r]);
      corr[r] += s[g] * static_cast<float>(zg * xg[r * G + g]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = V::fsum(total[r]) - corr[r];
}
#endif
#endif

#ifdef LOWBIT_GEMV_F32
// y[m, n] += sum_g mn[g] xs[m, g] for M rows n apart: the "min" domain's offsets times the
// group sums of x (group_terms).
template <typename S>
inline void add_mins(const S* mn, const float* xs, int64_t M, int64_t G, float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) y[m * ldy] += fsum8(group_terms<S>(mn, nullptr, xs + m * G, G));
}

// Rows n0..n1 of one weight (codes wt.w, scales s, zero points z: float32 or float16 bits)
// times x (prepared once: xa/xb even/odd halves for 4-bit codes, xs group sums), each row's
// kernel call in one loop.  MIN: the weights are q * s + m (unsigned codes, z holds m): the
// kernels run the codes as unsigned without a zero point, then add_mins.  (A range per call
// rather than a row, with w4_rows' pairs and constant groups: SmolLM2's w4a16-g128-head8
// decode step 1.08x faster on the AVX2 EPYC, 7.8 against 8.45 ms at 128 tokens of context.)
template <bool SIGNED, bool HAS_ZP, bool MIN, int GROUP, typename S>
void wo_rows(const float* xa, const float* xb, const float* xs, int64_t M, int64_t K, int64_t G, int64_t group,
             int64_t bits, const PackedWeight& wt, const S* s, const S* z, int64_t n0, int64_t n1) {
  const int64_t row_bytes = bits == 4 ? K / 2 : K, N = wt.N, full = M - M % MB;
  float* y = wt.y;
  for (int64_t n = n0; n < n1;) {
    // rows n and n + 1 in one call where both are in the range
    const int64_t rows = n + 1 < n1 ? 2 : 1;
    const uint8_t* wn = wt.w + n * row_bytes;
    const S* sn = s + n * G;
    const S* zn = HAS_ZP ? z + n * G : nullptr;
    if (bits == 4) {
      auto w4 = [&](auto r, auto nw, int64_t m, int64_t j) {  // r rows of x from m, nw weight rows from n + j
        w4_rows<decltype(r)::value, decltype(nw)::value, SIGNED, HAS_ZP, GROUP>(
            xa + m * (K / 2), xb + m * (K / 2), xs + m * G, K, G, group, wn + j * row_bytes, row_bytes, sn + j * G,
            HAS_ZP ? zn + j * G : nullptr, y + m * N + n + j, N);
      };
      using One = std::integral_constant<int, 1>;
      for (int64_t j = 0; j < rows; ++j)  // MB rows of x: MB chains already
        for (int64_t m = 0; m < full; m += MB) w4(std::integral_constant<int, MB>{}, One{}, m, j);
      for (int64_t m = full; m < M; ++m)
        rows == 2 ? w4(One{}, std::integral_constant<int, 2>{}, m, 0) : w4(One{}, One{}, m, 0);
    } else {
      for (int64_t j = 0; j < rows; ++j)
        for (int64_t m = 0; m < full; m += MB)
          w8_rows<MB, 1, SIGNED, HAS_ZP, GROUP>(xa + m * K, K, G, group, wn + j * K, sn + j * G,
                                                HAS_ZP ? zn + j * G : nullptr, y + m * N + n + j, N);
      for (int64_t m = full; m < M; ++m)
        if (rows == 2) w8_rows<1, 2, SIGNED, HAS_ZP, GROUP>(xa + m * K, K, G, group, wn, sn, zn, y + m * N + n, N);
        else w8_rows<1, 1, SIGNED, HAS_ZP, GROUP>(xa + m * K, K, G, group, wn, sn, zn, y + m * N + n, N);
    }
    if constexpr (MIN)
      for (int64_t j = 0; j < rows; ++j) add_mins(z + (n + j) * G, xs, M, G, y + n + j, N);
    n += rows;
  }
}

// x times every weight, in one parallel region over all their rows (q/k/v or gate/up of a
// decode step).  Scales float32 or float16 (wt.half).
template <bool SIGNED, bool HAS_ZP, bool MIN = false>
void wo_all(const float* xa, const float* xb, const float* xs, int64_t M, int64_t K, int64_t G, int64_t group,
            int64_t bits, const std::vector<PackedWeight>& weights) {
  parallel_weight_rows(weights, 32, [&](const PackedWeight& wt, int64_t n0, int64_t n1) {
    with_scales(wt, [&](auto s, auto z) {  // s, z: float32 or float16 bits
      with_group(group, [&](auto size) {
        wo_rows<SIGNED, HAS_ZP, MIN, decltype(size)::value>(xa, xb, xs, M, K, G, group, bits, wt, s, z, n0, n1);
      });
    });
  });
}

#endif

// Split x [M, K] into the even/odd elements of every 32-block: [M, K/2] each.
template <typename T>
void deinterleave(const T* x, T* xe, T* xo, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b)
      for (int i = 0; i < 16; ++i) {
        xe[m * (K / 2) + b * 16 + i] = x[m * K + b * 32 + 2 * i];
        xo[m * (K / 2) + b * 16 + i] = x[m * K + b * 32 + 2 * i + 1];
      }
}

}  // namespace

bool has_avx512() { return kHaveAvx512; }

bool has_w4a8_rows() {
#ifdef LOWBIT_W4A8
  return true;
#else
  return false;
#endif
}

bool has_gemv_f32() {
#ifdef LOWBIT_GEMV_F32
  return true;
#else
  return false;
#endif
}

// x: float32 [M, K]; per weight, codes int8/uint8 [N, K] or int32 [N, K/8], scale and zero_point
// [N, G] float32 or float16 (packed_scales; all with zero points or none); float32 [M, N] per
// weight, x prepared once.
std::vector<at::Tensor> weight_only_gemv_many(const at::Tensor& x, const std::vector<at::Tensor>& codes,
                                              const std::vector<at::Tensor>& scales,
                                              const std::vector<c10::optional<at::Tensor>>& zero_points,
                                              int64_t bits, int64_t group, bool zero_point_min) {
#ifndef LOWBIT_GEMV_F32
  TORCH_CHECK(false, "lowbit._C.weight_only_gemv needs AVX-512 (VNNI, BW, VL) or AVX2 and FMA");
#endif
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "lowbit._C.weight_only_gemv: contiguous float32 x [M, K] expected");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(group % (bits == 4 ? 32 : 16) == 0 && K % group == 0,
              "lowbit._C.weight_only_gemv: group must be a multiple of ", bits == 4 ? 32 : 16, " that divides K");
  std::vector<at::Tensor> ys;
  const std::vector<PackedWeight> weights =
      packed_weights("lowbit._C.weight_only_gemv", x, codes, scales, zero_points, bits, group, ys, zero_point_min);
  gemv_f32_into(x.data_ptr<float>(), M, K, bits, group, weights);
  return ys;
}

void gemv_f32_into(const float* px, int64_t M, int64_t K, int64_t bits, int64_t group,
                   const std::vector<PackedWeight>& weights) {
#ifdef LOWBIT_GEMV_F32
  // Plain buffers and loops, not ATen ops: at decode sizes an op's dispatch costs as much as
  // the work (the group sums of x, the even/odd split).
  const int64_t G = K / group;
  const bool has_zp = weights[0].z != nullptr, zero_point_min = weights[0].min;
  thread_local std::vector<float> xs_keep, xa_keep, xb_keep;
  // group sums of x: read by the 4-bit kernels (z * sum(x) per group, 8 * sum(x) for signed
  // codes) and by add_mins
  float* xs = grown(xs_keep, M * G);
  if (bits == 4 || zero_point_min)  // group sums of x
    for (int64_t i = 0; i < M * G; ++i) {
      __m256 sum = _mm256_setzero_ps();
      for (int64_t k = 0; k < group; k += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(px + i * group + k));
      xs[i] = fsum8(sum);
    }
  const float *pa = px, *pb = px;
  if (bits == 4) {
    float *xa = grown(xa_keep, M * K / 2), *xb = grown(xb_keep, M * K / 2);
    deinterleave<float>(px, xa, xb, M, K);
    pa = xa;
    pb = xb;
  }
  if (zero_point_min)  // unsigned codes, q * s + m
    wo_all<false, false, true>(pa, pb, xs, M, K, G, group, bits, weights);
  else if (!has_zp)  // signed codes
    wo_all<true, false>(pa, pb, xs, M, K, G, group, bits, weights);
  else
    wo_all<false, true>(pa, pb, xs, M, K, G, group, bits, weights);
#else
  TORCH_CHECK(false, "lowbit._C.weight_only_gemv needs AVX-512 (VNNI, BW, VL) or AVX2 and FMA");
#endif
}

at::Tensor weight_only_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                            bool zero_point_min) {
  return weight_only_gemv_many(x, {codes}, {scale}, {zero_point}, bits, group, zero_point_min)[0];
}

// x_q int8 [M, K]; x_zp int32 [M]; codes int32 [N, K/8]; w_scale float32 [N, G]; w_zp int32 [N, G] or none
// (signed codes).  Returns float32 [M, N] = sum_g w_scale * int_g  (x_scale and bias applied by the caller).
void check_w4a8_zero_points(const char* who, const at::Tensor& x_q, const at::Tensor& x_zp, int64_t group) {
  TORCH_CHECK(x_zp.scalar_type() == at::kInt && x_zp.dim() == 1 && x_zp.size(0) == x_q.size(0) && x_zp.is_contiguous(),
              who, ": x_zp must be contiguous int32 [M], one zero point per row of x_q");
  // the kernels' int32 zero-point terms (xz sum u, |g| xz z, z sum (x - xz)) stay exact
  const int32_t* pz = x_zp.data_ptr<int32_t>();
  const auto fits = [&](int32_t v) { return std::abs(static_cast<int64_t>(v)) * 15 * group < (int64_t(1) << 30); };
  TORCH_CHECK(std::all_of(pz, pz + x_zp.numel(), fits), who, ": |x_zp| * 15 * group must stay below 2^30");
}

void w4a8_group_sums(const int8_t* x, int32_t xz, int64_t K, int64_t group, int32_t* xg) {
  for (int64_t g = 0; g < K / group; ++g) {
    int32_t t = 0;
    for (int64_t k = g * group; k < (g + 1) * group; ++k) t += x[k];
    xg[g] = t - static_cast<int32_t>(group) * xz;
  }
}

at::Tensor w4a8_gemm(const at::Tensor& x_q, const at::Tensor& x_zp, const at::Tensor& codes,
                     const at::Tensor& w_scale, const c10::optional<at::Tensor>& w_zp, int64_t group) {
  TORCH_CHECK(has_w4a8_rows(), "lowbit._C.w4a8_gemm needs AVX2 (or AVX-512 with VNNI, BW, VL)");
  TORCH_CHECK(x_q.is_contiguous() && codes.is_contiguous() && w_scale.is_contiguous() && x_zp.is_contiguous(),
              "lowbit._C.w4a8_gemm: contiguous inputs expected");
  TORCH_CHECK(group % 32 == 0, "lowbit._C.w4a8_gemm: group must be a multiple of 32");
  check_w4a8_zero_points("lowbit._C.w4a8_gemm", x_q, x_zp, group);
  const int64_t M = x_q.size(0), K = x_q.size(1), N = codes.size(0);
  at::Tensor y = at::empty({M, N}, x_q.options().dtype(at::kFloat));
  w4a8_gemm_into(x_q.data_ptr<int8_t>(), x_zp.data_ptr<int32_t>(), M, K,
                 reinterpret_cast<const uint8_t*>(codes.data_ptr()), N, w_scale.data_ptr<float>(),
                 w_zp ? w_zp->data_ptr<int32_t>() : nullptr, group, y.data_ptr<float>());
  return y;
}

#ifdef LOWBIT_W4A8
namespace {
// Rows n0..n1 of a W4A8 weight (w4a8_gemm_into's operands), the kernel for BYTES, SIGNED
// and GROUP (with_group; the AVX2 kernel's group loop, 0 with VNNI) chosen once for the
// range (a call per range rather than per row, as wo_rows).
template <int BYTES, bool SIGNED, int GROUP>
void w4a8_range(const int8_t* pe, const int8_t* po, const int32_t* xsum, const int32_t* pz, int64_t M, int64_t K,
                int64_t G, int64_t group, const uint8_t* w, int64_t N, const float* s, const int32_t* z, float* py,
                int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * (K / 2);
    // row n + kRowsAhead fetched while row n is read: spread over the row by w4a8_rows512
    // (hot 1.0-1.3x the burst, from DRAM the same or better), in a burst here for the others
#ifdef LOWBIT_W4A8_VNNI
    constexpr bool spread = GROUP != 1;
#else
    constexpr bool spread = false;
#endif
    const int64_t ahead = n + kRowsAhead < N ? kRowsAhead * (K / 2) : 0;
    if (ahead && !spread) prefetch_row(wn + ahead, K / 2);
    const int32_t* zn = z ? z + n * G : nullptr;
    auto call = [&](auto r, int64_t m) {
      constexpr int R = decltype(r)::value;
#ifdef LOWBIT_W4A8_VNNI
      if constexpr (GROUP != 1)
        w4a8_rows512<R, SIGNED, GROUP>(pe + m * (K / 2), po + m * (K / 2), xsum + m * G, pz + m, K, G, group, wn,
                                       s + n * G, zn, py + m * N + n, N, m == 0 ? ahead : 0);
      else
        w4a8_rows<R, BYTES>(pe + m * (K / 2), po + m * (K / 2), xsum + m * G, pz + m, K, G, group, wn, s + n * G,
                            zn, SIGNED, py + m * N + n, N);
#else
      w4a8_rows<R, BYTES, SIGNED, GROUP>(pe + m * (K / 2), po + m * (K / 2), xsum + m * G, pz + m, K, G, group, wn,
                                         s + n * G, zn, SIGNED, py + m * N + n, N);
#endif
    };
    int64_t m = 0;
    for (; m + MB <= M; m += MB) call(std::integral_constant<int, MB>{}, m);
    for (; m < M; ++m) call(std::integral_constant<int, 1>{}, m);
  }
}
}  // namespace
#endif

void w4a8_gemm_into(const int8_t* pq, const int32_t* pz, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                    const float* s, const int32_t* z, int64_t group, float* py) {
  w4a8_gemm_many_into(pq, pz, M, K, group, {PackedWeight{w, s, z, N, py}});
}

void w4a8_gemm_many_into(const int8_t* pq, const int32_t* pz, int64_t M, int64_t K, int64_t group,
                         const std::vector<PackedWeight>& weights) {
#ifdef LOWBIT_W4A8
  const int64_t G = K / group;
  thread_local std::vector<int8_t> xe_keep, xo_keep;
  thread_local std::vector<int32_t> xsum_keep;
  int8_t *pe = grown(xe_keep, M * K / 2), *po = grown(xo_keep, M * K / 2);
  deinterleave<int8_t>(pq, pe, po, M, K);
  // per row and group: sum x - |g| xz = sum (x - xz); plain loops, not ATen ops, at decode sizes
  int32_t* xsum = grown(xsum_keep, M * G);
  for (int64_t m = 0; m < M; ++m) w4a8_group_sums(pq + m * K, pz[m], K, group, xsum + m * G);
  const bool is_signed = weights[0].z == nullptr;  // all or none
  // Widest vector whose value count (2 * bytes) divides the group (64 bytes: AVX-512 only).
  const int width = group % 128 == 0 && kHaveAvx512 ? 64 : group % 64 == 0 ? 32 : 16;
  parallel_weight_rows(weights, 32, [&](const PackedWeight& wt, int64_t n0, int64_t n1) {
    const float* s = static_cast<const float*>(wt.s);
    const int32_t* z = static_cast<const int32_t*>(wt.z);
    // GROUP: with VNNI, 32, 64 or 0 (a multiple of 128) for w4a8_rows512, 1 for w4a8_rows;
    // without, with_group's
    auto rows = [&](auto bytes, auto sign, auto size) {
      w4a8_range<decltype(bytes)::value, decltype(sign)::value, decltype(size)::value>(pe, po, xsum, pz, M, K, G,
                                                                                      group, wt.w, wt.N, s, z, wt.y,
                                                                                      n0, n1);
    };
    using T = std::true_type;
    using F = std::false_type;
    auto with_sign = [&](auto bytes, auto size) { is_signed ? rows(bytes, T{}, size) : rows(bytes, F{}, size); };
#ifdef LOWBIT_W4A8_VNNI
    using Z = std::integral_constant<int, 64>;  // w4a8_rows512 takes no BYTES
    if (rows512_fits(K, group)) {
      if (group == 32) with_sign(Z{}, std::integral_constant<int, 32>{});
      else if (group == 64) with_sign(Z{}, std::integral_constant<int, 64>{});
      else with_sign(Z{}, std::integral_constant<int, 0>{});
      return;
    }
    const auto other = [&](auto bytes) { with_sign(bytes, std::integral_constant<int, 1>{}); };
    if (width == 64) other(Z{});
    else if (width == 32) other(std::integral_constant<int, 32>{});
    else other(std::integral_constant<int, 16>{});
#else
    const auto any = [&](auto bytes) { with_group(group, [&](auto size) { with_sign(bytes, size); }); };
    if (width == 32) any(std::integral_constant<int, 32>{});
    else any(std::integral_constant<int, 16>{});
#endif
  });
#else
  TORCH_CHECK(false, "lowbit._C.w4a8_gemm needs AVX2 (or AVX-512 with VNNI, BW, VL)");
#endif
}

// ---- the eager entry of weight-only matmuls --------------------------------------------
// One call from Python for a whole weight-only matmul (per-call overhead is what a decode
// step of a small model spends most of its time on).  x float32/bfloat16/float16 [..., K];
// scale, zero_point [N, G] of any float (zero_point also integer) dtype.  Runs the kernel
// lowbit.kernels.cpu's plan chose (WeightOnlyKernel) and returns [..., N] in x's dtype.

const char* const kWeightOnlyKernels[] = {"gemv_f32", "gemv_bf16", "gemv_bf16_split", "gemm_bf16", "gemm_bf16_amx",
                                           "gemm_f32_amx", "gemv_bf16_amx", "gemm_fma", "gemm_f32_fma"};

std::vector<std::string> weight_only_kernels() {
  return std::vector<std::string>(std::begin(kWeightOnlyKernels), std::end(kWeightOnlyKernels));
}

at::Tensor as_float(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() ? t : t.to(at::kFloat).contiguous();
}

std::tuple<at::Tensor, c10::optional<at::Tensor>> packed_scales(const at::Tensor& scale,
                                                                const c10::optional<at::Tensor>& zero_point) {
  const auto exact_in_half = [](at::ScalarType t) { return t == at::kHalf || t == at::kByte || t == at::kChar; };
  const bool half = scale.scalar_type() == at::kHalf && (!zero_point || exact_in_half(zero_point->scalar_type()));
  const auto as = [&](const at::Tensor& t) {
    return half ? (t.scalar_type() == at::kHalf && t.is_contiguous() ? t : t.to(at::kHalf).contiguous()) : as_float(t);
  };
  c10::optional<at::Tensor> z;
  if (zero_point) z = as(*zero_point);
  return {as(scale), z};
}

std::vector<PackedWeight> packed_weights(const char* who, const at::Tensor& x, const std::vector<at::Tensor>& codes,
                                         const std::vector<at::Tensor>& scales,
                                         const std::vector<c10::optional<at::Tensor>>& zero_points, int64_t bits,
                                         int64_t group, std::vector<at::Tensor>& ys, bool zero_point_min) {
  TORCH_CHECK(!codes.empty() && scales.size() == codes.size() && zero_points.size() == codes.size(), who,
              ": one scale and zero point per weight");
  const int64_t M = x.size(0), K = x.size(1);
  const bool has_zp = zero_points[0].has_value();
  TORCH_CHECK(has_zp || !zero_point_min, who, ": zero_point_min needs the mins (zero_point)");
  std::vector<PackedWeight> weights;
  for (size_t i = 0; i < codes.size(); ++i) {
    const at::Tensor &c = codes[i], &s = scales[i];
    const int64_t N = c.size(0);
    TORCH_CHECK(c.is_contiguous() && c.dim() == 2 && c.size(1) * (bits == 4 ? 8 : 1) == K &&
                    c.element_size() == (bits == 4 ? 4 : 1),
                who, ": codes must be contiguous [N, K] bytes or [N, K/8] int32 words");
    const bool half = s.scalar_type() == at::kHalf;
    TORCH_CHECK((half || s.scalar_type() == at::kFloat) && s.is_contiguous() && s.dim() == 2 && s.size(0) == N &&
                    s.size(1) == K / group,
                who, ": scale must be contiguous float32 or float16 [N, K / group]");
    TORCH_CHECK(zero_points[i].has_value() == has_zp, who, ": zero points on all or none");
    if (has_zp)
      TORCH_CHECK(zero_points[i]->scalar_type() == s.scalar_type() && zero_points[i]->is_contiguous() &&
                      zero_points[i]->sizes() == s.sizes(),
                  who, ": zero_point must be contiguous, of scale's shape and dtype");
    ys.push_back(at::empty({M, N}, x.options().dtype(at::kFloat)));
    weights.push_back(PackedWeight{reinterpret_cast<const uint8_t*>(c.data_ptr()), s.data_ptr(),
                                   has_zp ? zero_points[i]->data_ptr() : nullptr, N, ys.back().data_ptr<float>(),
                                   zero_point_min, half});
  }
  return weights;
}

namespace {
// x2 [M, K] times the weight with the chosen kernel: float32 [M, N] from the decode
// kernels (gemv_*) and gemm_f32_amx, and from gemm_bf16 and gemm_bf16_amx but for bf16 x
// (then bf16).
at::Tensor weight_only_rows(const at::Tensor& x2, const at::Tensor& codes, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                            int64_t kernel, bool zero_point_min) {
  const at::Tensor c = codes.contiguous();
  if (static_cast<WeightOnlyKernel>(kernel) == WeightOnlyKernel::kGemvF32) {
    const auto [s, z] = packed_scales(scale, zero_point);
    return weight_only_gemv(as_float(x2), c, s, z, bits, group, zero_point_min);
  }
  const at::Tensor s = as_float(scale);
  c10::optional<at::Tensor> z;
  if (zero_point.has_value()) z = as_float(*zero_point);
  at::Tensor y;
  switch (static_cast<WeightOnlyKernel>(kernel)) {
    case WeightOnlyKernel::kGemvBf16:
    case WeightOnlyKernel::kGemvBf16Split:
      TORCH_CHECK(bits == 4, "lowbit._C.weight_only_matmul: the bf16 decode kernel is 4-bit only");
      y = weight_only_gemv_bf16(as_float(x2), c, s, z, group,
                                static_cast<WeightOnlyKernel>(kernel) == WeightOnlyKernel::kGemvBf16Split,
                                zero_point_min);
      break;
    case WeightOnlyKernel::kGemvBf16Amx:
      TORCH_CHECK(bits == 4, "lowbit._C.weight_only_matmul: the bf16 decode kernel is 4-bit only");
      y = weight_only_gemv_bf16_amx(as_float(x2), c, s, z, group, zero_point_min);
      break;
    case WeightOnlyKernel::kGemmBf16:
      y = weight_only_gemm_bf16(x2, c, s, z, bits, group, zero_point_min);
      break;
    case WeightOnlyKernel::kGemmFma:
      y = weight_only_gemm_fma(x2, c, s, z, bits, group, zero_point_min);
      break;
    case WeightOnlyKernel::kGemmF32Fma:
      y = weight_only_gemm_f32_fma(as_float(x2), c, s, z, bits, group, zero_point_min);
      break;
    case WeightOnlyKernel::kGemmBf16Amx:
      y = weight_only_gemm_bf16_amx(x2, c, s, z, bits, group, zero_point_min);
      break;
    case WeightOnlyKernel::kGemmF32Amx:
      y = weight_only_gemm_f32_amx(as_float(x2), c, s, z, bits, group, zero_point_min);
      break;
    default:
      TORCH_CHECK(false, "lowbit._C.weight_only_matmul: unknown kernel ", kernel);
  }
  return y;
}
}  // namespace

at::Tensor weight_only_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                              int64_t kernel, bool zero_point_min) {
  const int64_t K = x.size(-1), N = codes.size(0);
  const int64_t M = K ? x.numel() / K : 0;
  const at::Tensor x2 = x.dim() == 2 && x.is_contiguous() ? x : x.reshape({M, K}).contiguous();
  at::Tensor y = weight_only_rows(x2, codes, scale, zero_point, bits, group, kernel, zero_point_min);
  if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
  if (x.dim() == 2) return y;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return y.view(shape);
}

// ---- mixed int8/int4 weights (lowbit.SplitQTensor) --------------------------------------
// One call: the low part's decode kernel over x (float32 [M, N]), then the J outlier
// columns' 8-bit codes added to it in float32,
//   y[m, n] += sum_g hs[n, g] * sum_{j in g} (hq[n, j] - hz[n, g]) * x[m, outliers[j]],
// and one rounding to x's dtype.  (q - z) is exact in float32; J is small (16-64), so a
// plain loop over the gathered x[:, outliers] costs a few microseconds.
at::Tensor split_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group, int64_t kernel,
                        const at::Tensor& outliers, const at::Tensor& high_codes, const at::Tensor& high_scale,
                        const c10::optional<at::Tensor>& high_zero_point, int64_t high_group) {
  TORCH_CHECK(static_cast<WeightOnlyKernel>(kernel) != WeightOnlyKernel::kGemmBf16 &&
                  static_cast<WeightOnlyKernel>(kernel) != WeightOnlyKernel::kGemmFma &&
                  static_cast<WeightOnlyKernel>(kernel) != WeightOnlyKernel::kGemmF32Fma &&
                  static_cast<WeightOnlyKernel>(kernel) != WeightOnlyKernel::kGemmBf16Amx &&
                  static_cast<WeightOnlyKernel>(kernel) != WeightOnlyKernel::kGemmF32Amx,
              "lowbit._C.split_matmul: decode kernels (gemv_*) only");
  TORCH_CHECK(high_codes.scalar_type() == (high_zero_point.has_value() ? at::kByte : at::kChar),
              "lowbit._C.split_matmul: high codes must be int8 (no zero point) or uint8 (with one)");
  const int64_t K = x.size(-1), N = codes.size(0), J = outliers.size(0);
  const int64_t M = K ? x.numel() / K : 0, G = J / high_group;
  const at::Tensor x2 = x.reshape({M, K}).to(at::kFloat).contiguous();
  at::Tensor y = weight_only_rows(x2, codes, scale, zero_point, bits, group, kernel, false).contiguous();
  const at::Tensor xh = x2.index_select(1, outliers).contiguous();
  const at::Tensor hs = high_scale.to(at::kFloat).contiguous();
  const at::Tensor hc = high_codes.contiguous();
  at::Tensor hz;
  if (high_zero_point.has_value()) hz = high_zero_point->to(at::kFloat).contiguous();
  const float* px = xh.data_ptr<float>();
  const float* ps = hs.data_ptr<float>();
  const float* pz = hz.defined() ? hz.data_ptr<float>() : nullptr;
  float* py = y.data_ptr<float>();
  // One thread: the outlier part is a few multiply-adds per output (J = 16-64), less
  // than what waking the pool costs.  8 codes at a time with AVX2 (exact int -> float,
  // then (q - z) * x as FMAs), the rest scalar.
  auto run = [&](auto* q) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const float z = pz ? pz[n * G + g] : 0.f;
          const auto* qg = q + n * J + g * high_group;
          const float* xg = px + m * J + g * high_group;
          float dot = 0.f;
          int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
          __m256 v = _mm256_setzero_ps();
          const __m256 vz = _mm256_set1_ps(z);
          for (; j + 8 <= high_group; j += 8) {
            const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + j));
            const __m256i w = std::is_signed_v<std::remove_pointer_t<decltype(q)>> ? _mm256_cvtepi8_epi32(b)
                                                                                   : _mm256_cvtepu8_epi32(b);
            v = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(w), vz), _mm256_loadu_ps(xg + j), v);
          }
          __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
          h = _mm_add_ps(h, _mm_movehl_ps(h, h));
          dot = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
          for (; j < high_group; ++j) dot += (static_cast<float>(qg[j]) - z) * xg[j];
          acc += ps[n * G + g] * dot;
        }
        py[m * N + n] += acc;
      }
    }
  };
  if (hz.defined()) run(hc.data_ptr<uint8_t>());
  else run(hc.data_ptr<int8_t>());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return y.to(x.scalar_type()).view(shape);
}
