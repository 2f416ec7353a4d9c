// W4A16 for small M with AVX512-BF16 dot products (vdpbf16ps: 32 multiply-adds per
// instruction, float32 accumulation), the decode path for 4-bit weights.
//
// Nibble to bf16 without a table: the bf16 with bits 0x4300 | u is exactly 128 + u for
// u < 128, so one vpternlogd ((w >> 4j) & 0xF) | 0x4300 turns four nibbles of every
// 16-bit lane into bf16 numbers.  The offset comes back out per group:
//   sum_k (u_k - z) x_k = sum_k (128 + u_k) x_k - (128 + z) sum_k x_k
// Signed codes are read as u = nibble ^ 8 = q + 8 with z = 8.  In the "min" domain (q * s + m,
// GGUF's Q4_1) the group's term is s sum_k (128 + u_k) x_k - (128 s - m) sum_k x_k, 128 s - m
// rounded once (128 s is exact).  Products of bf16 numbers
// are exact in float32; sums are float32.  float32 activations are split x = hi + lo
// into two bf16 parts (|x - hi - lo| <= 2^-16 |x|) and both are multiplied.
//
// Lane bookkeeping: a 16-bit lane i of the weight vector holds elements 4i..4i+3 of its
// block (one nibble each, u32x8 order); the vector n_j built from nibble j holds element
// 4i + j in lane i, and vdpbf16ps sums lane pairs (2t, 2t+1), i.e. elements 8t + j and
// 8t + 4 + j, into float lane t.  The activations are laid out once per call to match.

#include "balance.h"
#include "kernels.h"
#include "simd.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define LOWBIT_HAVE_BF16_DOT 1
#endif

namespace {

#ifdef LOWBIT_HAVE_BF16_DOT
// Rows computed together: each unpacked weight vector is reused by all of them (16 rows
// measured slower than 4 on Zen 5: the extra accumulators spill).
constexpr int MB = 4;
// Weight rows rows<> takes together below MB rows of x (1.0-1.1x one at a time at M = 1),
// long rows too: with the L2 prefetches (rows) four interleaved rows of 768 bytes (SmolLM2's
// down projection, 576 x 1536) stream from DRAM as fast as one row at a time (1.01-1.06x,
// 2 threads, cycling through 120 MB), and in cache they take 1.17-1.43x less time (one x
// load for four rows; Zen 4, a standalone copy of the kernel, variants alternating in one
// process).  Eight rows were 0.91-0.97x four.
constexpr int kWeightGroup = 4;

// 512-bit block: 128 values, 64 packed bytes, float lanes t = 0..15.
struct Z {
  static constexpr int VALUES = 128;
  using I = __m512i;
  using F = __m512;
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I flip(I w) { return _mm512_xor_si512(w, _mm512_set1_epi16(0x8888)); }
  static I nib(I w, int shift) {
    const I s = shift == 0 ? w : shift == 4 ? _mm512_srli_epi16(w, 4) : shift == 8 ? _mm512_srli_epi16(w, 8) : _mm512_srli_epi16(w, 12);
    return _mm512_ternarylogic_epi32(s, _mm512_set1_epi16(0x000F), _mm512_set1_epi16(0x4300), 0xEA);  // (a & b) | c
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F dot(F acc, I w, const uint16_t* x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
  }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  // scale of the group of element p + 8t, for each lane t (groups of 32 or 64: groups of
  // 128 k take one scale for the whole block, read by rows): the block's 4 (2) scales in one
  // load, spread by one permute (four broadcasts and three inserts were 0.91x for groups of
  // 32 at M = 1, SmolLM2's 1536 x 576, Zen 4)
  template <int GROUP>
  static F scales(const float* s, int64_t p) {
    if constexpr (GROUP == 64)
      return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                   _mm512_castps256_ps512(_mm256_castps128_ps256(_mm_castpd_ps(
                                       _mm_load_sd(reinterpret_cast<const double*>(s + p / 64))))));
    return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(_mm_loadu_ps(s + p / 32)));
  }
};

// 256-bit block: 64 values, 32 packed bytes, float lanes t = 0..7 (the tail of K % 128 == 64).
struct Y {
  static constexpr int VALUES = 64;
  using I = __m256i;
  using F = __m256;
  static I load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static I flip(I w) { return _mm256_xor_si256(w, _mm256_set1_epi16(0x8888)); }
  static I nib(I w, int shift) {
    const I s = shift == 0 ? w : shift == 4 ? _mm256_srli_epi16(w, 4) : shift == 8 ? _mm256_srli_epi16(w, 8) : _mm256_srli_epi16(w, 12);
    return _mm256_ternarylogic_epi32(s, _mm256_set1_epi16(0x000F), _mm256_set1_epi16(0x4300), 0xEA);
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F dot(F acc, I w, const uint16_t* x) {
    return _mm256_dpbf16_ps(acc, (__m256bh)w, (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  template <int GROUP>
  static F scales(const float* s, int64_t p) {
    if constexpr (GROUP == 64) return _mm256_set1_ps(s[p / 64]);
    return _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s + p / 32)))),
        _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
  }
};

// One block of V::VALUES values for R rows from its codes wv (as V::load reads them);
// xh/xl point at the block's prepared activations of row 0 (4 vectors of V::VALUES / 4 bf16
// each), rows xstride apart; sv: the scale of each float lane's group.
template <typename V, int R, bool SIGNED, bool SPLIT>
inline void products(typename V::I wv, const uint16_t* xh, const uint16_t* xl, int64_t xstride, typename V::F sv,
                     typename V::F* total) {
  if constexpr (SIGNED) wv = V::flip(wv);
  const typename V::I n0 = V::nib(wv, 0), n1 = V::nib(wv, 4), n2 = V::nib(wv, 8), n3 = V::nib(wv, 12);
  constexpr int Q = V::VALUES / 4;  // bf16 per vector
  for (int r = 0; r < R; ++r) {
    // two chains of dot products, then one add: a single chain of four (eight split) held
    // one row's blocks back by their latency
    const uint16_t* h = xh + r * xstride;
    typename V::F d = V::dot(V::dot(V::zero(), n0, h), n1, h + Q);
    typename V::F e = V::dot(V::dot(V::zero(), n2, h + 2 * Q), n3, h + 3 * Q);
    if constexpr (SPLIT) {
      const uint16_t* l = xl + r * xstride;
      d = V::dot(V::dot(d, n0, l), n1, l + Q);
      e = V::dot(V::dot(e, n2, l + 2 * Q), n3, l + 3 * Q);
    }
    total[r] = V::fma(V::add(d, e), sv, total[r]);
  }
}

// The block of V::VALUES values at element p of the weight row w.
template <typename V, int R, bool SIGNED, bool SPLIT>
inline void block(const uint8_t* w, const uint16_t* xh, const uint16_t* xl, int64_t xstride, typename V::F sv,
                  int64_t p, typename V::F* total) {
  products<V, R, SIGNED, SPLIT>(V::load(w + p / 2), xh, xl, xstride, sv, total);
}

// The 64-value tail blocks (Y) of two weight rows as one 512-bit block: lanes 0-7 are the
// first row's, 8-15 the second's, each vector of x broadcast to both halves, so every lane
// takes Y's operations on its own row (the same bits as two Y blocks) for half the
// instructions.  At K = 576 (4 * 128 + 64, SmolLM2's hidden size) a Y block costs a Z
// block's instructions for half its values; pairing the tails of rows<1, 4> took 1536 x 576
// at one row of x from 43.3 to 39.2 us (a standalone copy of the loop, one thread, AMX
// Xeon), and decode steps of the bf16 model's 4-bit recipes (128 tokens of context,
// alternating in one process) 1.04-1.06x (w4a16-g128, q4_0, q4_1; w4a16-g128-head8 level).
struct P : Z {
  static constexpr int VALUES = Y::VALUES;
  static F dot(F acc, I w, const uint16_t* x) {  // x's 16 values in both halves
    return _mm512_dpbf16_ps(acc, (__m512bh)w,
                            (__m512bh)_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
  }
  static F join(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }
};

// products<P> for the tails at element p of weight rows wa and wb, their scales sa and sb
// and sums ta and tb (one per row of x).
template <int R, bool SIGNED, bool SPLIT>
inline void tail_pair(const uint8_t* wa, const uint8_t* wb, const uint16_t* xh, const uint16_t* xl, int64_t xstride,
                      __m256 sa, __m256 sb, int64_t p, __m256* ta, __m256* tb) {
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = P::join(ta[r], tb[r]);
  products<P, R, SIGNED, SPLIT>(_mm512_inserti64x4(_mm512_castsi256_si512(Y::load(wa + p / 2)), Y::load(wb + p / 2), 1),
                                xh, xl, xstride, P::join(sa, sb), total);
  for (int r = 0; r < R; ++r) {
    ta[r] = _mm512_castps512_ps256(total[r]);
    tb[r] = _mm512_extractf32x8_ps(total[r], 1);
  }
}

// A row's block sums t (float lanes) less the offset term, 16 groups per vector, taken from
// the lanes before their one reduction (a scalar loop over the groups and two reductions per
// row were a third of a row's work at K = 576).  xs: x's group sums, s and z the weight row's.
template <bool SIGNED, bool HAS_ZP, bool MIN>
inline __m512 offset_removed(__m512 t, const float* xs, const float* s, const float* z, int64_t G) {
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 in = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
    const __m512 sv = _mm512_maskz_loadu_ps(in, s + g);
    const __m512 c = HAS_ZP ? offset_factor(sv, _mm512_maskz_loadu_ps(in, z + g), MIN)
                            : _mm512_mul_ps(sv, _mm512_set1_ps(SIGNED ? 136.f : 128.f));
    t = _mm512_fnmadd_ps(c, _mm512_maskz_loadu_ps(in, xs + g), t);
  }
  return t;
}

// The sum of t's 16 lanes in one fixed tree: the two halves of 256 bits, of 128, then lanes
// two apart, then neighbours (GCC's _mm512_reduce_add_ps, written out so that lane_sums4
// can follow it whatever the compiler).
inline float lane_sum(__m512 t) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_permute_ps(q, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// lane_sum of a, b, c and d, the same additions of the same pairs, four rows at a time (15
// instructions for the four against ~9 each): rows<1, 4> at K = 576, one row of x, cycling
// through 40 MB of weights, 1.03-1.05x a call (in-process A/B, AMX Xeon).
inline __m128 lane_sums4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));  // halves of 256
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));  // halves of 128
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));  // lanes two apart
  v = _mm512_add_ps(v, _mm512_movehdup_ps(v));                          // neighbours: lane 4i the sum
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), v));
}

// y[r * ldy + j] = sum_blocks (scaled dots) - sum_g s_g (128 + z_g) xsum[r, g] for R rows of
// x (K apart) times W weight rows (K / 2 bytes apart; scales and zero points G apart): each
// unpacked weight vector serves the R rows, each block's x vectors the W weight rows.  Every
// output takes the same operations whatever R and W, so the same bits.  GROUP: 32, 64, or 0
// for a multiple of 128 (`group`; then K is one too).  No division per block: a 64-bit idiv
// there (~10 cycles each) was more than a block's vector work.  prefetch: each block's line
// of codes (64 bytes) prefetches the line kStreamAhead on into the L2 (simd.h).
template <int R, int W, bool SIGNED, bool HAS_ZP, bool MIN, bool SPLIT, int GROUP>
void rows(const uint8_t* w, const uint16_t* xh, const uint16_t* xl, const float* xsum, int64_t K, int64_t G,
          int64_t group, const float* s, const float* z, float* y, int64_t ldy, bool prefetch) {
  const auto fetch = [&](const uint8_t* at) {
    if (prefetch) prefetch_l2(at + kStreamAhead);
  };
  __m512 tz[W][R];
  __m256 ty[W][R];
  for (int j = 0; j < W; ++j)
    for (int r = 0; r < R; ++r) { tz[j][r] = Z::zero(); ty[j][r] = Y::zero(); }
  const int64_t full = K / 128 * 128, wstride = K / 2;
  if constexpr (GROUP == 0) {
    for (int64_t g = 0, p = 0; g < G; ++g)
      for (const int64_t end = p + group; p < end; p += 128)
        for (int j = 0; j < W; ++j) {
          fetch(w + j * wstride + p / 2);
          block<Z, R, SIGNED, SPLIT>(w + j * wstride, xh + p, xl + p, K, _mm512_set1_ps(s[j * G + g]), p, tz[j]);
        }
  } else {
    for (int64_t p = 0; p < full; p += 128)
      for (int j = 0; j < W; ++j) {
        fetch(w + j * wstride + p / 2);
        block<Z, R, SIGNED, SPLIT>(w + j * wstride, xh + p, xl + p, K, Z::scales<GROUP>(s + j * G, p), p, tz[j]);
      }
    if (full < K) {
      int j = 0;
      for (; j + 2 <= W; j += 2) {  // two weight rows' tails a 512-bit block
        fetch(w + j * wstride + full / 2);
        fetch(w + (j + 1) * wstride + full / 2);
        tail_pair<R, SIGNED, SPLIT>(w + j * wstride, w + (j + 1) * wstride, xh + full, xl + full, K,
                                    Y::scales<GROUP>(s + j * G, full), Y::scales<GROUP>(s + (j + 1) * G, full), full,
                                    ty[j], ty[j + 1]);
      }
      for (; j < W; ++j) {
        fetch(w + j * wstride + full / 2);
        block<Y, R, SIGNED, SPLIT>(w + j * wstride, xh + full, xl + full, K, Y::scales<GROUP>(s + j * G, full), full,
                                   ty[j]);
      }
    }
  }
  const auto row_total = [&](int j, int r) {
    return offset_removed<SIGNED, HAS_ZP, MIN>(_mm512_add_ps(tz[j][r], _mm512_zextps256_ps512(ty[j][r])), xsum + r * G,
                                               s + j * G, HAS_ZP ? z + j * G : nullptr, G);
  };
  for (int r = 0; r < R; ++r) {
    int j = 0;
    for (; j + 4 <= W; j += 4)  // outputs j .. j + 3 of row r are adjacent
      _mm_storeu_ps(y + r * ldy + j, lane_sums4(row_total(j, r), row_total(j + 1, r), row_total(j + 2, r),
                                                 row_total(j + 3, r)));
    for (; j < W; ++j) y[r * ldy + j] = lane_sum(row_total(j, r));
  }
}

// The W = 128 (or 64) bf16 values at v as the block's four vectors of W / 4 (lane bookkeeping
// above): vector j's lane 2t + e is v[8t + 4e + j].  Two-source word permutes (vpermt2w), each
// 32-lane output's halves from values 0-63 and 64-127, where a scalar loop stored each value
// (prepare runs on one thread before each call's parallel region): the same bits; decode steps
// on the Zen 4 1.02-1.12x (w4a16-g128-head8, w4a16-g64, q4_0; in-process A/B, medians of 8
// rounds at 128 positions).
struct LayOut {
  alignas(64) uint16_t z[4][32];  // vector j of a 128-block: (8t + 4e + j) mod 64 at lane 2t + e
  alignas(64) uint16_t y[2][32];  // vectors 2i and 2i + 1 of a 64-block, 16 lanes each
  constexpr LayOut() : z{}, y{} {
    for (int j = 0; j < 4; ++j)
      for (int lane = 0; lane < 32; ++lane) z[j][lane] = static_cast<uint16_t>((8 * (lane / 2) + 4 * (lane % 2) + j) % 64);
    for (int i = 0; i < 2; ++i)
      for (int lane = 0; lane < 16; ++lane) y[i][lane] = z[2 * i][lane], y[i][16 + lane] = z[2 * i + 1][lane];
  }
};
constexpr LayOut kLayOut{};

inline void lay_out(const uint16_t* v, uint16_t* out, int64_t W) {
  const __m512i a = _mm512_loadu_si512(v), b = _mm512_loadu_si512(v + 32);
  if (W == 128) {
    const __m512i c = _mm512_loadu_si512(v + 64), d = _mm512_loadu_si512(v + 96);
    for (int j = 0; j < 4; ++j) {
      const __m512i ix = _mm512_load_si512(kLayOut.z[j]);
      _mm512_storeu_si512(out + 32 * j, _mm512_mask_mov_epi16(_mm512_permutex2var_epi16(a, ix, b), 0xFFFF0000u,
                                                              _mm512_permutex2var_epi16(c, ix, d)));
    }
    return;
  }
  for (int i = 0; i < 2; ++i)  // 64 values: vectors 2i and 2i + 1 from one permute
    _mm512_storeu_si512(out + 32 * i, _mm512_permutex2var_epi16(a, _mm512_load_si512(kLayOut.y[i]), b));
}

// Lay out x [M, K] for the lane bookkeeping above: within each block of W values, vector j
// holds x[8t + j] in lane 2t and x[8t + 4 + j] in lane 2t + 1.  xsum [M, G] gets the group
// sums of the values actually multiplied (hi + lo), so the 128 offset cancels against them
// and the split error of x is not amplified by it.  Vector code: this runs on one thread
// before each call's parallel region (scalar, it was ~2 us of a decode step's ~90 calls).
void prepare(const float* x, uint16_t* hi, uint16_t* lo, float* xsum, int64_t M, int64_t K, int64_t group) {
  thread_local std::vector<uint16_t> h_keep, l_keep;  // a row's bf16 parts in x's order
  uint16_t* h = grown(h_keep, K);
  uint16_t* l = lo ? grown(l_keep, K) : nullptr;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    // vcvtneps2bf16 rounds to nearest even as bf16_bits but flushes subnormals to zero,
    // which vdpbf16ps reads as zero anyway
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_loadu_ps(xm + k);
      _mm256_storeu_si256((__m256i*)(h + k), (__m256i)_mm512_cvtneps_pbh(v));
      if (l) _mm256_storeu_si256((__m256i*)(l + k), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, bf16x16(h + k))));
    }
    for (int64_t g = 0; g < K / group; ++g) {
      __m512 t = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
        t = _mm512_add_ps(t, bf16x16(h + k));
        if (l) t = _mm512_add_ps(t, bf16x16(l + k));
      }
      xsum[m * (K / group) + g] = _mm512_reduce_add_ps(t);
    }
    for (int64_t p = 0; p < K;) {
      const int64_t W = K - p >= 128 ? 128 : 64;
      lay_out(h + p, hi + m * K + p, W);
      if (lo) lay_out(l + p, lo + m * K + p, W);
      p += W;
    }
  }
}

template <bool SIGNED, bool HAS_ZP, bool MIN, bool SPLIT, int GROUP>
void weight_rows(const PackedWeight& wt, const uint16_t* xh, const uint16_t* xl, const float* xsum, int64_t M,
                 int64_t K, int64_t G, int64_t group, int64_t n0, int64_t n1) {
  const int64_t N = wt.N;
  const float* s = static_cast<const float*>(wt.s);
  const float* z = static_cast<const float*>(wt.z);
  // A decode step's weights (SmolLM2's 53 MB of 4-bit codes) stream from beyond the L2,
  // where the hardware prefetcher alone leaves this loop waiting (AMX Xeon, 2 threads,
  // w4a16-g128-head8 step at 128 positions: 10.5-11.3 ms without prefetches, 8.8-9.6 with
  // row n + kRowsAhead's codes fetched into the L1 as row n was read).  Each block now
  // prefetches the codes kStreamAhead on into the L2 (simd.h), with the first row of x:
  // the same step on the Zen 4, 2 threads, 1.23x (in-process A/B, medians of 6 rounds at 128
  // positions; the 8-bit head's prefetch changed with it, see simd.h).
  int64_t n = n0;
  if (M < MB)  // fewer rows of x than rows<MB, 1> takes: weight rows kWeightGroup at a time
    for (; n + kWeightGroup <= n1; n += kWeightGroup) {
      const uint8_t* wn = wt.w + n * (K / 2);
      for (int64_t m = 0; m < M; ++m)
        rows<1, kWeightGroup, SIGNED, HAS_ZP, MIN, SPLIT, GROUP>(
            wn, xh + m * K, xl ? xl + m * K : nullptr, xsum + m * G, K, G, group, s + n * G,
            HAS_ZP ? z + n * G : nullptr, wt.y + m * N + n, N, m == 0);
    }
  for (; n < n1; ++n) {  // one weight row at a time
    const uint8_t* wn = wt.w + n * (K / 2);
    const float* sn = s + n * G;
    const float* zn = HAS_ZP ? z + n * G : nullptr;
    int64_t m = 0;
    for (; m + MB <= M; m += MB)
      rows<MB, 1, SIGNED, HAS_ZP, MIN, SPLIT, GROUP>(wn, xh + m * K, xl ? xl + m * K : nullptr, xsum + m * G, K, G,
                                                  group, sn, zn, wt.y + m * N + n, N, m == 0);
    for (; m < M; ++m)
      rows<1, 1, SIGNED, HAS_ZP, MIN, SPLIT, GROUP>(wn, xh + m * K, xl ? xl + m * K : nullptr, xsum + m * G, K, G,
                                                 group, sn, zn, wt.y + m * N + n, N, m == 0);
  }
}
#endif

}  // namespace

// Whether weight_only_gemv_bf16 handles this shape: K a multiple of 64, groups of 32, 64
// or a multiple of 128 (so each vector's lanes map onto whole groups) that divide K.
bool gemv_bf16_supported(int64_t K, int64_t group) {
#ifdef LOWBIT_HAVE_BF16_DOT
  return K % 64 == 0 && group > 0 && K % group == 0 && (group == 32 || group == 64 || group % 128 == 0);
#else
  (void)K, (void)group;
  return false;
#endif
}

void gemv_bf16_into(const float* x, int64_t M, int64_t K, int64_t group, bool split,
                    const std::vector<PackedWeight>& weights) {
  TORCH_CHECK(gemv_bf16_supported(K, group), "lowbit._C.weight_only_gemv_bf16: unsupported K/group");
  for (const PackedWeight& wt : weights)  // weight_rows reads s and z as float32, of one kind
    TORCH_CHECK(!wt.half && wt.min == weights[0].min && (wt.z != nullptr) == (weights[0].z != nullptr),
                "lowbit._C.weight_only_gemv_bf16: float32 scales expected, and zero points (or the \"min\" "
                "domain's mins) on all weights or none");
#ifdef LOWBIT_HAVE_BF16_DOT
  const int64_t G = K / group;
  thread_local std::vector<uint16_t> xh_keep, xl_keep;
  thread_local std::vector<float> xsum_keep;
  uint16_t* xh = grown(xh_keep, M * K);
  uint16_t* xl = split ? grown(xl_keep, M * K) : nullptr;
  float* xsum = grown(xsum_keep, M * G);
  prepare(x, xh, xl, xsum, M, K, group);
  const auto all = [&](auto signed_, auto has_zp, auto min_, auto split_) {
    parallel_weight_rows(weights, 32, [&](const PackedWeight& wt, int64_t n0, int64_t n1) {
      constexpr bool S = decltype(signed_)::value, H = decltype(has_zp)::value, N = decltype(min_)::value,
                     P = decltype(split_)::value;
      if (group == 32) weight_rows<S, H, N, P, 32>(wt, xh, xl, xsum, M, K, G, group, n0, n1);
      else if (group == 64) weight_rows<S, H, N, P, 64>(wt, xh, xl, xsum, M, K, G, group, n0, n1);
      else weight_rows<S, H, N, P, 0>(wt, xh, xl, xsum, M, K, G, group, n0, n1);
    });
  };
  using T = std::true_type;
  using F = std::false_type;
  const auto split_or_not = [&](auto signed_, auto has_zp, auto min_) {
    if (split) all(signed_, has_zp, min_, T{}); else all(signed_, has_zp, min_, F{});
  };
  if (weights[0].min) split_or_not(F{}, T{}, T{});
  else if (weights[0].z) split_or_not(F{}, T{}, F{});
  else split_or_not(T{}, F{}, F{});
#else
  (void)x, (void)M, (void)split, (void)weights;
#endif
}

// x float32 [M, K] (split into two bf16 parts when `split`, else rounded to bf16: exact for
// bf16 activations); codes int32 [N, K/8]; scale, zero_point float32 [N, G] (zero_point_min:
// the "min" domain's m, q * s + m).
at::Tensor weight_only_gemv_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& zero_point, int64_t group, bool split,
                                 bool zero_point_min) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
              "lowbit._C.weight_only_gemv_bf16: contiguous float32 x [M, K] expected");
  std::vector<at::Tensor> ys;
  const std::vector<PackedWeight> weights =
      packed_weights("lowbit._C.weight_only_gemv_bf16", x, {codes}, {scale}, {zero_point}, 4, group, ys,
                     zero_point_min);
  gemv_bf16_into(x.data_ptr<float>(), x.size(0), x.size(1), group, split, weights);
  return ys[0];
}
