// One decode step (one token) of a Llama-family decoder in C++: the same arithmetic, in
// the same order, as lowbit.runtime.Runner.forward, without a Python round trip per op.
// At batch 1 on a small model the Python dispatch of ~25 ops and 7 projections per layer
// costs more than the matmuls; here it is one call per token, and the elementwise ops
// (rotary embedding, KV cache writes, residual adds, the MLP's product) are loops rather
// than ATen ops.  Bit-identical to the Python path (tested).
#include "balance.h"
#include "kernels.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }
template <>
inline float to_f(c10::BFloat16 v) { return bf16_value(v.x); }  // a shift, which the compiler vectorizes

// sum_i a[i] * b[i] in float32: 16 independent partial sums (one AVX-512 register, so the
// compiler vectorizes it), then the tail, then the partial sums in order.
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  float part[16] = {0.0f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += to_f(a[i + j]) * to_f(b[i + j]);
  float sum = 0.0f;
  for (; i < n; ++i) sum += to_f(a[i]) * to_f(b[i]);
  for (int j = 0; j < 16; ++j) sum += part[j];
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOWBIT_ATTEND_AVX2 1
// 8 values of a cache row as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
template <typename T>
constexpr bool kLoad8 = std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value ||
                        std::is_same<T, c10::Half>::value;

// exp(x) for x <= 0 (softmax weights), 8 at a time: x = k ln2 + r with |r| <= ln2 / 2
// (ln2 in two parts, the high one with 15 significant bits, so k ln2 is exact for the
// |k| <= 126 used), exp(r) by its degree-7 Taylor polynomial (truncation r^8 / 8! < 2^-27
// relative there) in Horner form (a rounding per step: about 2 units of the last place in
// all), times 2^k set in the exponent bits.  Below -87 (about 2^-125.5) it flushes to 0.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145752f), x);  // ln2 high part: 16 bits
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.42860677e-6f), r);        // ln2 - high part
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// The 8 lane sums of a[0..7] as one vector (lane i: the sum of a[i]).
inline __m256 sums8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // lanes: [0 1 2 3 | 0 1 2 3] halves of s0123, the same for 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// One head over n positions (a chunk), hd a multiple of 8: scores 8 positions at a time (8
// accumulators, one vector reduction), the softmax weights with exp8, then p . V with hd / 8
// accumulators per pass of at most 64 values.  Writes the chunk's max score m, its sum of
// weights l and acc = sum of weight * V row (not divided by l).  p: scratch of n floats.
template <typename T>
void partial_head(const float* qf, const T* kh, const T* vh, int64_t n, int64_t hd, float* p, float& m_out,
                  float& l_out, float* out) {
  int64_t s = 0;
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (; s + 8 <= n; s += 8) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      const __m256 qv = _mm256_loadu_ps(qf + d);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, load8(kh + (s + i) * hd + d), acc[i]);
    }
    const __m256 sc = sums8(acc);
    _mm256_storeu_ps(p + s, sc);
    mx = _mm256_max_ps(mx, sc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = *std::max_element(lanes, lanes + 8);
  for (; s < n; ++s) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + d), load8(kh + s * hd + d), acc);
    p[s] = fsum8(acc);
    m = std::max(m, p[s]);
  }
  const __m256 mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  s = 0;
  for (; s + 8 <= n; s += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s), mv));
    _mm256_storeu_ps(p + s, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = fsum8(total);
  for (; s < n; ++s) sum += (p[s] = std::exp(p[s] - m));
  m_out = m;
  l_out = sum;
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    const int64_t w = std::min<int64_t>(64, hd - d0) / 8;
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t]);
      const T* vt = vh + t * hd + d0;
      for (int c = 0; c < w; ++c) acc[c] = _mm256_fmadd_ps(pt, load8(vt + 8 * c), acc[c]);
    }
    for (int c = 0; c < w; ++c) _mm256_storeu_ps(out + d0 + 8 * c, acc[c]);
  }
}
#endif

// Positions a work item of attend covers: a kv head's group of query heads over one chunk.
constexpr int64_t kChunk = 64;

#if defined(LOWBIT_ATTEND_AVX2) && defined(__AVX512F__)
#define LOWBIT_ATTEND_AVX512 1
// 16 values of a cache row as float32 (exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// The 16 lane sums of a[0..15] as one vector (lane i: the sum of a[i]'s lanes): pairs of
// neighbours folded within 128-bit lanes (32-bit, then 64-bit interleaves), then across them.
inline __m512 sums16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: a[2i], a[2i+1], a[2i], a[2i+1]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: a[4i..4i+3], summed over that lane
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const auto fold = [](__m512 x, __m512 y) {  // [x L0+L1, x L2+L3, y L0+L1, y L2+L3] of 128-bit lanes
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return fold(fold(c[0], c[1]), fold(c[2], c[3]));
}

// p . V of up to G <= 4 heads (weights p[g * kChunk + t]) over n rows of V, hd a multiple of
// 64: each row of V widened once for all of them, 64 values at a time.  The first
// ahead_rows rows of `ahead` (rows of hd values) are prefetched on the way.
template <int G, typename T>
void weighted_rows(const float* p, int64_t pstride, const T* vh, int64_t n, int64_t hd, float* out, int64_t ostride,
                   const T* ahead, int64_t ahead_rows) {
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      if (d0 == 0 && t < ahead_rows) prefetch_row(ahead + t * hd, hd * int64_t(sizeof(T)));
      const T* vt = vh + t * hd + d0;
      const __m512 v0 = load16(vt), v1 = load16(vt + 16), v2 = load16(vt + 32), v3 = load16(vt + 48);
      for (int g = 0; g < G; ++g) {
        const __m512 pt = _mm512_set1_ps(p[g * pstride + t]);
        acc[g][0] = _mm512_fmadd_ps(pt, v0, acc[g][0]);
        acc[g][1] = _mm512_fmadd_ps(pt, v1, acc[g][1]);
        acc[g][2] = _mm512_fmadd_ps(pt, v2, acc[g][2]);
        acc[g][3] = _mm512_fmadd_ps(pt, v3, acc[g][3]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * ostride + d0 + 16 * c, acc[g][c]);
  }
}

// partial_head for gs <= 4 query heads of one kv head at once (qf + g hd, g < gs), hd a
// multiple of 64: each row of K and V is read and widened once for all of them, in 16 float
// lanes.  Scores: per position a chain of hd / 16 FMAs per head, 16 positions' chains then
// folded into one vector (sums16); weights exp16; p . V by weighted_rows.  Head g's m, l and
// acc go to m_out[g * stride], l_out[g * stride] and out + g * stride * hd.  W: hd / 16 where
// the row fits in registers (64 or 128 values), else 0.  Each row of V is prefetched as the
// same row of K is read, and the first ahead_rows rows of `ahead` during p . V.
template <int W, typename T>
void partial_heads(const float* qf, int64_t gs, const T* kh, const T* vh, int64_t n, int64_t hd, float* m_out,
                   float* l_out, float* out, int64_t stride, const T* ahead, int64_t ahead_rows) {
  alignas(64) float p[4][kChunk];
  alignas(64) float part[4][16][16];
  __m512 mx[4];
  for (int g = 0; g < 4; ++g) mx[g] = _mm512_set1_ps(-INFINITY);
  for (int64_t s0 = 0; s0 < n; s0 += 16) {
    const int64_t len = std::min<int64_t>(16, n - s0);
    const __mmask16 valid = static_cast<__mmask16>((1u << len) - 1);
    for (int64_t i = 0; i < 16; ++i) {
      if (i >= len) {
        for (int64_t g = 0; g < gs; ++g) _mm512_store_ps(part[g][i], _mm512_setzero_ps());
        continue;
      }
      const T* kr = kh + (s0 + i) * hd;
      prefetch_row(vh + (s0 + i) * hd, hd * int64_t(sizeof(T)));
      if constexpr (W > 0) {  // the row widened once, into registers, for every head
        __m512 k[W];
        for (int w = 0; w < W; ++w) k[w] = load16(kr + 16 * w);
        for (int64_t g = 0; g < gs; ++g) {
          const float* qg = qf + g * hd;
          __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
          for (int w = 1; w < W; ++w) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * w), k[w], acc);
          _mm512_store_ps(part[g][i], acc);
        }
      } else {
        for (int64_t g = 0; g < gs; ++g) {
          const float* qg = qf + g * hd;
          __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), load16(kr));
          for (int64_t d = 16; d < hd; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), load16(kr + d), acc);
          _mm512_store_ps(part[g][i], acc);
        }
      }
    }
    for (int64_t g = 0; g < gs; ++g) {
      __m512 rows[16];
      for (int i = 0; i < 16; ++i) rows[i] = _mm512_load_ps(part[g][i]);
      const __m512 sc = sums16(rows);
      _mm512_mask_storeu_ps(p[g] + s0, valid, sc);
      mx[g] = _mm512_mask_max_ps(mx[g], valid, mx[g], sc);
    }
  }
  for (int64_t g = 0; g < gs; ++g) {
    const float m = _mm512_reduce_max_ps(mx[g]);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 total = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < n; s0 += 16) {
      const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - s0)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, p[g] + s0), mv)));
      _mm512_mask_storeu_ps(p[g] + s0, valid, e);
      total = _mm512_add_ps(total, e);
    }
    m_out[g * stride] = m;
    l_out[g * stride] = _mm512_reduce_add_ps(total);
  }
  const int64_t os = stride * hd;
  switch (gs) {
    case 1: weighted_rows<1>(p[0], kChunk, vh, n, hd, out, os, ahead, ahead_rows); break;
    case 2: weighted_rows<2>(p[0], kChunk, vh, n, hd, out, os, ahead, ahead_rows); break;
    case 3: weighted_rows<3>(p[0], kChunk, vh, n, hd, out, os, ahead, ahead_rows); break;
    default: weighted_rows<4>(p[0], kChunk, vh, n, hd, out, os, ahead, ahead_rows); break;
  }
}
#endif

// partial_head without AVX2 (or hd not a multiple of 8).
template <typename T>
void partial_scalar(const float* qf, const T* kh, const T* vh, int64_t n, int64_t hd, float* p, float& m_out,
                    float& l_out, float* out) {
  float mx = -INFINITY;
  for (int64_t s = 0; s < n; ++s) {
    p[s] = dot(qf, kh + s * hd, hd);
    mx = std::max(mx, p[s]);
  }
  float sum = 0.0f;
  for (int64_t s = 0; s < n; ++s) sum += (p[s] = std::exp(p[s] - mx));
  for (int64_t d = 0; d < hd; ++d) out[d] = 0.0f;
  for (int64_t s = 0; s < n; ++s) {
    const float w = p[s];
    const T* vs = vh + s * hd;
    for (int64_t d = 0; d < hd; ++d) out[d] += w * to_f(vs[d]);
  }
  m_out = mx;
  l_out = sum;
}


// Attention of one new token over n cached positions, float32 arithmetic: for head h
// (kv head h / (H / KV)), p = softmax(scale * q_h . K[0:n]) and out_h = p . V[0:n].  Work
// items of kChunk positions of one kv head, all of its query heads (the chunk of K and V is
// read from memory once, and the items spread over the threads evenly whatever the number
// of heads); then each head's chunks merged in order, weights exp(m_c - max m): the same
// bits on any number of threads (one chunk, AVX2: acc * (1 / l), the bits before chunks).
// Called inside a parallel region (a batch's tokens spread over the threads) it runs on
// its thread alone.  On AVX-512 (hd a multiple of 64) partial_heads takes a group's query
// heads four at a time: bf16 SmolLM2 shapes 1.5-1.7x the one-head AVX2 path (one token over
// 128 or 512 positions, 32 tokens over 100 each; AVX-512 Xeon, 2 threads).
template <typename T>
void attend(const T* q, const T* k, const T* v, T* out, int64_t H, int64_t KV, int64_t cap, int64_t n,
            int64_t hd, float scale) {
  const int64_t group = H / KV, chunks = (n + kChunk - 1) / kChunk;
  thread_local std::vector<float> qf_keep, m_keep, l_keep, acc_keep, o_keep;  // every value written before read
  float *qf = grown(qf_keep, H * hd), *m = grown(m_keep, H * chunks), *l = grown(l_keep, H * chunks);
  float *acc = grown(acc_keep, H * chunks * hd), *o = grown(o_keep, hd);
  for (int64_t i = 0; i < H * hd; ++i) qf[i] = to_f(q[i]) * scale;
#pragma omp parallel for schedule(static) if (n * H * hd > 16384 && !at::in_parallel_region())
  for (int64_t item = 0; item < KV * chunks; ++item) {
    const int64_t j = item / chunks, c = item % chunks, s0 = c * kChunk, len = std::min(kChunk, n - s0);
    const T* kc = k + (j * cap + s0) * hd;
    const T* vc = v + (j * cap + s0) * hd;
#ifdef LOWBIT_ATTEND_AVX512
    if constexpr (kLoad8<T>) {
      if (hd % 64 == 0) {  // the group's heads four at a time, each row of K and V widened once for them
        // The caches come from DRAM (a decode step reads tens of MB of weights between two
        // reads of a layer's cache), in chunks of 2 x 8 KiB: each row of V is fetched as its
        // row of K is read, the next item's rows of K during this one's last p . V (SmolLM2,
        // bf16, 512 positions, caches cycled through 53 MB, 2 threads, Zen 4: 42 -> 27 us).
        const int64_t next_j = (item + 1) / chunks, next_s0 = (item + 1) % chunks * kChunk;
        const T* ahead = item + 1 < KV * chunks ? k + (next_j * cap + next_s0) * hd : nullptr;
        const int64_t ahead_rows = ahead ? std::min(kChunk, n - next_s0) : 0;
        for (int64_t h = j * group; h < (j + 1) * group; h += 4) {
          const int64_t at = h * chunks + c;
          const int64_t gs = std::min<int64_t>(4, (j + 1) * group - h);
          const bool last = h + 4 >= (j + 1) * group;
          const auto run = hd == 64 ? partial_heads<4, T> : hd == 128 ? partial_heads<8, T> : partial_heads<0, T>;
          run(qf + h * hd, gs, kc, vc, len, hd, m + at, l + at, acc + at * hd, chunks, ahead, last ? ahead_rows : 0);
        }
        continue;
      }
    }
#endif
    float p[kChunk];
    for (int64_t h = j * group; h < (j + 1) * group; ++h) {
      const int64_t at = h * chunks + c;
#ifdef LOWBIT_ATTEND_AVX2
      if constexpr (kLoad8<T>) {
        if (hd % 8 == 0) {
          partial_head<T>(qf + h * hd, kc, vc, len, hd, p, m[at], l[at], acc + at * hd);
          continue;
        }
      }
#endif
      partial_scalar<T>(qf + h * hd, kc, vc, len, hd, p, m[at], l[at], acc + at * hd);
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    const float* mh = m + h * chunks;
    const float top = *std::max_element(mh, mh + chunks);
    float total = 0.0f;
    std::fill(o, o + hd, 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float w = std::exp(mh[c] - top);  // 1 for the top chunk
      total += w * l[h * chunks + c];
      const float* a = acc + (h * chunks + c) * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] += w * a[d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < hd; ++d) out[h * hd + d] = static_cast<T>(o[d] * inv);
  }
}

template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    const float inv = 1.0f / std::sqrt(dot(xr, xr, d) / static_cast<float>(d) + eps);
    if constexpr (std::is_same<T, c10::BFloat16>::value) {  // c10's rounding as bf16_bits, a loop the compiler vectorizes
      const uint16_t* xb = reinterpret_cast<const uint16_t*>(xr);
      const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
      uint16_t* ob = reinterpret_cast<uint16_t*>(out + r * d);
      for (int64_t i = 0; i < d; ++i) ob[i] = bf16_bits(bf16_value(bf16_bits(bf16_value(xb[i]) * inv)) * bf16_value(wb[i]));
    } else {
      for (int64_t i = 0; i < d; ++i)  // as transformers: normalize in float32, round to T, then scale
        out[r * d + i] = static_cast<T>(to_f(static_cast<T>(to_f(xr[i]) * inv)) * to_f(w[i]));
    }
  }
}

// The elementwise parts of a decode step in the model's dtype T, each value rounded where
// the Python path's ATen op rounds it (T arithmetic: float32, or float32 rounded to
// bf16/f16 after every operation, as ATen's kernels for those dtypes do), as plain loops:
// an ATen op costs 1-3 us of dispatch and allocation, ~25 of them a layer.

// Rotary embedding of heads rows of x [heads, hd] (as Runner.forward's rope: x * cos +
// rotate_half(x) * sin, three roundings) into out, row h at out + h * stride.  The compiler
// may not contract a * b + c into an FMA here (one rounding fewer than ATen's two ops).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t heads, int64_t hd, int64_t stride) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* xh = x + h * hd;
    T* oh = out + h * stride;
    for (int64_t i = 0; i < hd; ++i) {
      const T rot = i < half ? static_cast<T>(-xh[i + half]) : xh[i - half];
      const T a = xh[i] * cos[i];
      const T b = rot * sin[i];
      oh[i] = a + b;
    }
  }
}
// rope_rows on bf16 values: each c10::BFloat16 operation is float32 arithmetic rounded to
// bf16, here on float lanes with bf16_bits' rounding (the same bits), in loops the compiler
// vectorizes; c10's scalar conversions made the generic loop a tenth of a batch's step.
template <>
void rope_rows<c10::BFloat16>(const c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* sin,
                              c10::BFloat16* out, int64_t heads, int64_t hd, int64_t stride) {
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x);
  const uint16_t* cb = reinterpret_cast<const uint16_t*>(cos);
  const uint16_t* sb = reinterpret_cast<const uint16_t*>(sin);
  uint16_t* ob = reinterpret_cast<uint16_t*>(out);
  const int64_t half = hd / 2;
  const auto one = [&](const uint16_t* xh, uint16_t* oh, int64_t i, float rot) {
    const float a = bf16_value(bf16_bits(bf16_value(xh[i]) * bf16_value(cb[i])));
    const float b = bf16_value(bf16_bits(rot * bf16_value(sb[i])));
    oh[i] = bf16_bits(a + b);
  };
  for (int64_t h = 0; h < heads; ++h) {
    const uint16_t* xh = xb + h * hd;
    uint16_t* oh = ob + h * stride;
    for (int64_t i = 0; i < half; ++i) one(xh, oh, i, -bf16_value(xh[i + half]));
    for (int64_t i = half; i < hd; ++i) one(xh, oh, i, bf16_value(xh[i - half]));
  }
}
#pragma GCC pop_options

// h += y (h = h + y), and a *= b (silu(gate) * up), in T.
// For bf16, c10::BFloat16's operators (float32 arithmetic, then round_to_nearest_even) on
// the bits, as bf16_value and bf16_bits (the same rounding, NaN as 0x7FC0): loops the compiler
// vectorizes, where c10's conversion (a branch per value) kept these, rms_rows and Group's
// output conversions scalar.  The same bits; with gemv_bf16's long rows four at a time,
// decode steps 1.01-1.04x (Zen 4, 128 positions, in-process A/B, medians of 8 rounds).
template <typename T, typename Op>
void each_bf16(T* a, const T* b, int64_t n, Op op) {
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    uint16_t* ab = reinterpret_cast<uint16_t*>(a);
    const uint16_t* bb = reinterpret_cast<const uint16_t*>(b);
    for (int64_t i = 0; i < n; ++i) ab[i] = bf16_bits(op(bf16_value(ab[i]), bf16_value(bb[i])));
  } else {
    for (int64_t i = 0; i < n; ++i) a[i] = op(a[i], b[i]);
  }
}
template <typename T>
void add_into(T* h, const T* y, int64_t n) {
  each_bf16(h, y, n, [](auto u, auto v) { return u + v; });
}
// The first index of the largest of x[0..n) compared as float32, a NaN the largest (the
// first NaN, as numpy's argmax), 0 for n = 0: the maximum (and whether there is a NaN) in
// one pass, then the first index that holds it (the NaN) in another; 16 lanes at a time
// where AVX-512 is built in (the compiler's vectorization of the plain loops: 55 us a row of
// 49152 bf16 logits, 3-4x that).
template <typename T>
int64_t first_max(const T* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef LOWBIT_ATTEND_AVX512
  if constexpr (!std::is_same<T, double>::value) {  // load16: the attention's loads, float32 exactly
    __m512 most = _mm512_set1_ps(top);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = load16(x + i);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      most = _mm512_max_ps(most, v);  // a NaN lane goes wrong here, but then `nan` decides
    }
    top = _mm512_reduce_max_ps(most);
    nan = unordered != 0;
  }
#endif
  for (; i < n; ++i) {
    const float v = to_f(x[i]);
    top = v > top ? v : top;
    nan |= v != v;
  }
  int64_t j = 0;
#ifdef LOWBIT_ATTEND_AVX512
  if constexpr (!std::is_same<T, double>::value) {
    const __m512 t = _mm512_set1_ps(top);
    for (; j + 16 <= n; j += 16) {
      const __m512 v = load16(x + j);
      const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, t, _CMP_EQ_OQ);
      if (hit) return j + __builtin_ctz(hit);
    }
  }
#endif
  for (; j < n; ++j) {
    const float v = to_f(x[j]);
    if (nan ? v != v : v == top) return j;
  }
  return 0;
}

template <typename T>
void mul_into(T* a, const T* b, int64_t n) {
  each_bf16(a, b, n, [](auto u, auto v) { return u * v; });
}

}  // namespace

// RMSNorm of the rows of x [rows, d] (one pass, float32 arithmetic), for decode steps.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm_rows: shapes");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm_rows: dtypes differ");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t d = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_rows", [&] {
    const scalar_t *px = xc.data_ptr<scalar_t>(), *pw = wc.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    // each row on its own, so the same bits on any number of threads (a prefill's rows spread)
    at::parallel_for(0, x.size(0), std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t r0, int64_t r1) {
      rms_rows<scalar_t>(px + r0 * d, pw, po + r0 * d, r1 - r0, d, static_cast<float>(eps));
    });
  });
  return out;
}

// The first index of the largest value of each row of x [R, n] (first_max: numpy's argmax of
// the row as float32, the first NaN where there is one), rows spread over the threads:
// torch's argmax(-1) took 3.1 ms for a 32-sequence batch step's bf16 logits [32, 49152]
// (8% of the step), 90 us a row against 0.18 ms for one row alone (Zen 4, 2 threads).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be [rows, n] with n > 0, got ", x.sizes());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* po = out.data_ptr<int64_t>();
  const int64_t n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* px = xc.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) po[r] = first_max(px + r * n, n);
    });
  });
  return out;
}

// The rotary embedding of x [N, heads, hd] at N positions (cos, sin: N rows of hd values),
// as Runner's rope (x * cos + rotate_half(x) * sin, three roundings in x's dtype): the
// decode step's rope_rows, each row on its own (a prefill's rows spread over the threads).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3, "rope: x [N, heads, head_dim] expected");
  const int64_t N = x.size(0), heads = x.size(1), hd = x.size(2);
  TORCH_CHECK(hd % 2 == 0 && cos.numel() == N * hd && sin.numel() == N * hd,
              "rope: cos and sin of N rows of head_dim values (head_dim even) expected");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rope: dtypes differ");
  const at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor out = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    const scalar_t *px = xc.data_ptr<scalar_t>(), *pc = cc.data_ptr<scalar_t>(), *ps = sc.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, std::max<int64_t>(1, 8192 / std::max<int64_t>(heads * hd, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        rope_rows<scalar_t>(px + r * heads * hd, pc + r * hd, ps + r * hd, po + r * heads * hd, heads, hd, hd);
    });
  });
  return out;
}

// q: [H, hd]; keys/values: [KV, capacity, hd] caches, the first n positions valid.
// Returns [H, hd] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t n,
                            double scale) {
  TORCH_CHECK(q.dim() == 2 && keys.dim() == 3 && values.sizes() == keys.sizes(), "decode_attention: shapes");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "decode_attention: caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "decode_attention: dtypes differ");
  const int64_t H = q.size(0), hd = q.size(1), KV = keys.size(0), cap = keys.size(1);
  TORCH_CHECK(keys.size(2) == hd && H % KV == 0 && n >= 1 && n <= cap, "decode_attention: sizes");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({H, hd}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    attend<scalar_t>(qc.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                     out.data_ptr<scalar_t>(), H, KV, cap, n, hd, static_cast<float>(scale));
  });
  return out;
}

// A batch's decode step: q [N, H, hd] of one new token of each of N sequences; keys/values
// [B, KV, capacity, hd] caches of B sequences, query j attending over the first lengths[j]
// positions of sequence rows[j].  Returns [N, H, hd]: query j exactly as decode_attention
// of it over its own cache, the queries spread over the threads.
at::Tensor decode_attention_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                 const at::Tensor& rows, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(), "decode_attention_rows: shapes");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "decode_attention_rows: caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "decode_attention_rows: dtypes differ");
  const int64_t N = q.size(0), H = q.size(1), hd = q.size(2), B = keys.size(0), KV = keys.size(1),
                cap = keys.size(2);
  TORCH_CHECK(keys.size(3) == hd && H % KV == 0, "decode_attention_rows: sizes");
  TORCH_CHECK(rows.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && rows.dim() == 1 &&
                  lengths.dim() == 1 && rows.size(0) == N && lengths.size(0) == N,
              "decode_attention_rows: rows and lengths must be int64 [N]");
  const at::Tensor rc = rows.contiguous(), lc = lengths.contiguous();
  const int64_t *r = rc.data_ptr<int64_t>(), *len = lc.data_ptr<int64_t>();
  for (int64_t j = 0; j < N; ++j)
    TORCH_CHECK(r[j] >= 0 && r[j] < B && len[j] >= 1 && len[j] <= cap,
                "decode_attention_rows: query ", j, " reads sequence ", r[j], " over ", len[j],
                " positions; the caches hold ", B, " sequences of ", cap);
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({N, H, hd}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention_rows", [&] {
    const scalar_t *qp = qc.data_ptr<scalar_t>(), *kp = keys.data_ptr<scalar_t>(), *vp = values.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t seq = KV * cap * hd;
    parallel_chunks(0, N, 1, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j)
        attend<scalar_t>(qp + j * H * hd, kp + r[j] * seq, vp + r[j] * seq, op + j * H * hd, H, KV, cap, len[j],
                         hd, static_cast<float>(scale));
    });
  });
  return out;
}

// Attention of t new tokens of a sequence at once (a prefill, or a chunk of one): query i
// (position pos + i) over the first pos + i + 1 positions of its sequence's cache, float32
// arithmetic, as GEMMs rather than as t single-query passes: a work item is a block of
// kQueryBlock queries of one sequence and kv head, all of the kv head's query heads (rows
// = group x queries), so every key and value row it reads serves all of those rows.
//   scores s[r][j] = (q_r * scale) . k_j   register tiles of 8 rows x 32 keys, the keys laid
//                                           out as 16-key panels (kt[b][d][i] = k[16b + i][d])
//                                           so a tile's step is 2 loads, 8 broadcasts, 16 FMAs;
//                                           each score one FMA chain over d in order (bf16
//                                           caches with AVX512-BF16: (q_r . k_j) * scale, the
//                                           same tile on vdpbf16ps, two values of d a step:
//                                           1.3x the attention of 512 tokens)
//   p = exp(s - max_r) over the row's own positions (exp16, zero past them), l_r = sum p
//   out_r = (p . V) * (1 / l_r)              register tiles of 6 rows x 64 values of V, the
//                                           positions in order
// Against float64 softmax attention the bound of decode_attention holds (an hd-term dot
// product, exp16's few units, an n-term weighted sum and the division); the roundings are
// not decode_attention's (its scores sum 16 lanes of partial products, its positions come
// in chunks of 64), so a prefill's row and the same token's decode step agree within it,
// not bit for bit.  The panels of K and the float32 rows of V are made once per call
// (sequence and kv head), then items spread over the threads (each_item).
// bf16 caches where AMX bf16 tiles run (attend_tiles_run: head sizes 32 to 128 in steps of
// 32) take both products on tiles instead (attend_amx.cpp), a row tile per query head of
// the item (16 queries, zero rows past the block): the scores as above up to the order of
// the hd-term sums; the weights in three bf16 parts (within 2^-24 of each weight, as if
// rounded once more in float32) times V's bf16 pairs, 3n exact products summed in float32.
// 1.5-1.75x the vector tiles on the bundled model's 512-token attention (9 heads of 64, Xeon
// family 6 model 207 VM); the exp and the split of the weights, not the tiles, set its pace.
#ifdef LOWBIT_ATTEND_AVX512
namespace {

constexpr int64_t kQueryBlock = 16;
constexpr int kScoreRows = 8, kScorePanels = 2;  // a score tile: 8 rows x 32 keys
constexpr int kValueRows = 6;                    // a p . V tile: 6 rows x 64 values

// R rows of q [R][steps] times the key panels kt (panel stride steps * 16) from key 0 to
// npad (a multiple of 32): s[r * ld + j].  E = float: one value of d a step, q already
// times scale, FMAs.  E = uint32_t (bf16 caches with AVX512-BF16, kPairScores): the bf16
// pairs (d, d + 1) as stored (kt[b][dd][i]: key 16b + i's pair dd), two values of d a
// step on vdpbf16ps, each product exact in float32 and added in order of d, then times
// scale: hd + 1 roundings either way (the instruction flushes subnormal inputs and sums:
// at most 2^-126 an addition).  A step is 2 loads, 8 broadcasts and 16 FMAs or dot products.
template <int R, typename E>
void score_rows(const E* q, int64_t steps, const E* kt, int64_t npad, float scale, float* s, int64_t ld) {
  constexpr bool pairs = std::is_same<E, uint32_t>::value;
  for (int64_t j0 = 0; j0 < npad; j0 += 16 * kScorePanels) {
    const E* panel = kt + (j0 / 16) * steps * 16;
    __m512 acc[R][kScorePanels];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < kScorePanels; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int64_t d = 0; d < steps; ++d) {
      if constexpr (pairs) {
#ifdef __AVX512BF16__
        __m512i k[kScorePanels];
        for (int b = 0; b < kScorePanels; ++b) k[b] = _mm512_loadu_si512(panel + (b * steps + d) * 16);
        for (int r = 0; r < R; ++r) {
          const __m512i qv = _mm512_set1_epi32(static_cast<int>(q[r * steps + d]));
          for (int b = 0; b < kScorePanels; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)qv, (__m512bh)k[b]);
        }
#endif
      } else {
        __m512 k[kScorePanels];
        for (int b = 0; b < kScorePanels; ++b) k[b] = _mm512_loadu_ps(panel + (b * steps + d) * 16);
        for (int r = 0; r < R; ++r) {
          const __m512 qv = _mm512_set1_ps(q[r * steps + d]);
          for (int b = 0; b < kScorePanels; ++b) acc[r][b] = _mm512_fmadd_ps(qv, k[b], acc[r][b]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < kScorePanels; ++b)
        _mm512_storeu_ps(s + r * ld + j0 + 16 * b, pairs ? _mm512_mul_ps(acc[r][b], _mm512_set1_ps(scale)) : acc[r][b]);
  }
}
#ifdef __AVX512BF16__
template <typename T>
constexpr bool kPairScores = std::is_same<T, c10::BFloat16>::value;
#else
template <typename T>
constexpr bool kPairScores = false;
#endif

// R rows of weights p [R][ld] times the first n rows of v [n][hd] (float32), W vectors of
// 16 values from column d0: o[r * hd + d0 ..] (not yet divided by l).
template <int R, int W>
void weighted_values(const float* p, int64_t ld, const float* v, int64_t n, int64_t hd, int64_t d0, float* o) {
  __m512 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[W];
    for (int w = 0; w < W; ++w) vv[w] = _mm512_loadu_ps(v + j * hd + d0 + 16 * w);
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * ld + j]);
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_fmadd_ps(pr, vv[w], acc[r][w]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(o + r * hd + d0 + 16 * w, acc[r][w]);
}

template <int R>
void weighted_rows_all(const float* p, int64_t ld, const float* v, int64_t n, int64_t hd, float* o) {
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    switch (std::min<int64_t>(64, hd - d0) / 16) {
      case 1: weighted_values<R, 1>(p, ld, v, n, hd, d0, o); break;
      case 2: weighted_values<R, 2>(p, ld, v, n, hd, d0, o); break;
      case 3: weighted_values<R, 3>(p, ld, v, n, hd, d0, o); break;
      default: weighted_values<R, 4>(p, ld, v, n, hd, d0, o); break;
    }
  }
}

// Rows [r0, rows) in tiles of R, then single rows: f(std::integral_constant<int, R or 1>, r).
template <int R, typename F>
void each_tile(int64_t rows, F f) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) f(std::integral_constant<int, R>{}, r);
  for (; r < rows; ++r) f(std::integral_constant<int, 1>{}, r);
}

// A row of scores sr as softmax weights: exp(s - max) over its first len positions, zeros
// from len to kpad; returns their sum.
inline float softmax_row(float* sr, int64_t len, int64_t kpad) {
  const __m512 mv = _mm512_set1_ps(row_max16(sr, len));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < kpad; j0 += 16) {
    const __mmask16 valid = lanes16(len - j0);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j0), mv)));
    _mm512_storeu_ps(sr + j0, e);
    total = _mm512_add_ps(total, e);
  }
  return _mm512_reduce_add_ps(total);
}

// The calling thread's AMX tile configuration while prefill_attend's items run on it.
struct AttendTiles {
  const bool on;
  explicit AttendTiles(bool use) : on(use) {
    if (on) attend_tiles_begin();
  }
  AttendTiles(const AttendTiles&) = delete;
  ~AttendTiles() {
    if (on) attend_tiles_end();
  }
};

// PAIRS: bf16 caches' scores on vdpbf16ps (kPairScores), else float32 FMAs.
template <typename T, bool PAIRS>
void prefill_attend(const T* q, const T* k, const T* v, T* out, const int64_t* seqs, int64_t N, int64_t t,
                    int64_t H, int64_t KV, int64_t cap, int64_t hd, int64_t pos, float scale) {
  const int64_t group = H / KV, n = pos + t, npad = (n + 31) / 32 * 32;
  const int64_t blocks = (t + kQueryBlock - 1) / kQueryBlock;
  // K as 16-key panels (bf16 pairs for bf16 caches, else float32) and V as float32 rows,
  // per (query sequence, kv head)
  // (AMX tiles: V as bf16 pairs of positions, attend_value_pairs)
  constexpr bool pairs = PAIRS;
  const bool tiles = pairs && attend_tiles_run(hd);
  const int64_t hd2 = hd / 2;
  std::vector<float> kt(pairs ? 0 : N * KV * npad * hd), vf(tiles ? 0 : N * KV * n * hd);
  std::vector<uint32_t> kt2(pairs ? N * KV * npad * hd2 : 0), vt(tiles ? N * KV * npad * hd2 : 0);
  parallel_chunks(0, N * KV, 1, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t head = seqs[a / KV] * KV + a % KV;  // the cache's kv head row
      const T* kh = k + head * cap * hd;
      const T* vh = v + head * cap * hd;
      if constexpr (pairs) {
        uint32_t* kp = kt2.data() + a * npad * hd2;
        const uint32_t* k2 = reinterpret_cast<const uint32_t*>(kh);
        for (int64_t j = 0; j < npad; ++j)
          for (int64_t dd = 0; dd < hd2; ++dd) kp[((j / 16) * hd2 + dd) * 16 + j % 16] = j < n ? k2[j * hd2 + dd] : 0u;
        if (tiles) {
          attend_value_pairs(vh, n, npad, hd, vt.data() + a * npad * hd2);
          continue;
        }
      } else {
        float* kp = kt.data() + a * npad * hd;
        for (int64_t j = 0; j < npad; ++j)
          for (int64_t d = 0; d < hd; ++d) kp[((j / 16) * hd + d) * 16 + j % 16] = j < n ? to_f(kh[j * hd + d]) : 0.0f;
      }
      float* vp = vf.data() + a * n * hd;
      for (int64_t i = 0; i < n * hd; ++i) vp[i] = to_f(vh[i]);
    }
  });
  struct Scratch {
    std::vector<float> qf, s, o, l;
    std::vector<uint32_t> q2;
    AttendTiles use;
  };
  const int64_t rows_max = group * kQueryBlock;
  each_item(
      N * KV * blocks,
      [&] {
        return Scratch{std::vector<float>(pairs ? 0 : rows_max * hd), std::vector<float>(rows_max * npad),
                       std::vector<float>(rows_max * hd), std::vector<float>(rows_max),
                       std::vector<uint32_t>(pairs ? rows_max * hd2 : 0),
                       AttendTiles(tiles)};
      },
      [&](Scratch& sc, int64_t item) {
        const int64_t a = item / blocks, b = item % blocks, seq = a / KV, j = a % KV;
        const int64_t i0 = b * kQueryBlock, qb = std::min(kQueryBlock, t - i0), rows = group * qb;
        const int64_t keys = pos + i0 + qb, kpad = (keys + 31) / 32 * 32;  // the block's last query sees `keys`
        if constexpr (pairs) {
          if (tiles) {  // row g * 16 + i: head j * group + g, query i0 + i (zeros past qb)
            auto* qt = reinterpret_cast<c10::BFloat16*>(sc.q2.data());
            float *s = sc.s.data(), *o = sc.o.data();
            for (int64_t g = 0; g < group; ++g) {
              for (int64_t i = 0; i < kQueryBlock; ++i) {
                c10::BFloat16* row = qt + (g * kQueryBlock + i) * hd;
                if (i < qb) std::memcpy(row, q + ((seq * t + i0 + i) * H + j * group + g) * hd, hd * sizeof(T));
                else std::memset(row, 0, hd * sizeof(T));
              }
              int64_t len[kQueryBlock];
              float l[kQueryBlock];
              for (int64_t i = 0; i < kQueryBlock; ++i) len[i] = i < qb ? pos + i0 + i + 1 : 0;
              attend_row_tile(qt + g * kQueryBlock * hd, kt2.data() + a * npad * hd2, vt.data() + a * npad * hd2, hd,
                              kpad, len, scale, s, o, l);
              for (int64_t i = 0; i < qb; ++i) {
                const float inv = 1.0f / l[i];
                T* orow = out + ((seq * t + i0 + i) * H + j * group + g) * hd;
                for (int64_t d = 0; d < hd; ++d) orow[d] = static_cast<T>(o[i * hd + d] * inv);
              }
            }
            return;
          }
        }
        float *qf = sc.qf.data(), *s = sc.s.data(), *o = sc.o.data(), *l = sc.l.data();
        uint32_t* q2 = sc.q2.data();
        for (int64_t g = 0; g < group; ++g)  // row g * qb + i: head j * group + g, query i0 + i
          for (int64_t i = 0; i < qb; ++i) {
            const T* qr = q + ((seq * t + i0 + i) * H + j * group + g) * hd;
            if constexpr (pairs) std::memcpy(q2 + (g * qb + i) * hd2, qr, hd * sizeof(T));
            else
              for (int64_t d = 0; d < hd; ++d) qf[(g * qb + i) * hd + d] = to_f(qr[d]) * scale;
          }
        each_tile<kScoreRows>(rows, [&](auto r, int64_t r0) {
          constexpr int R = decltype(r)::value;
          if constexpr (pairs)
            score_rows<R>(q2 + r0 * hd2, hd2, kt2.data() + a * npad * hd2, kpad, scale, s + r0 * npad, npad);
          else score_rows<R>(qf + r0 * hd, hd, kt.data() + a * npad * hd, kpad, scale, s + r0 * npad, npad);
        });
        for (int64_t r = 0; r < rows; ++r)  // softmax over the row's own positions, zeros to kpad
          l[r] = softmax_row(s + r * npad, pos + i0 + r % qb + 1, kpad);
        each_tile<kValueRows>(rows, [&](auto r, int64_t r0) {
          weighted_rows_all<decltype(r)::value>(s + r0 * npad, npad, vf.data() + a * n * hd, keys, hd, o + r0 * hd);
        });
        for (int64_t r = 0; r < rows; ++r) {
          const float inv = 1.0f / l[r];
          T* orow = out + ((seq * t + i0 + r % qb) * H + j * group + r / qb) * hd;
          for (int64_t d = 0; d < hd; ++d) orow[d] = static_cast<T>(o[r * hd + d] * inv);
        }
      });
}

}  // namespace
#endif

bool has_prefill_attention() {
#ifdef LOWBIT_ATTEND_AVX512
  return true;
#else
  return false;
#endif
}

// q [N, t, H, hd]: t new tokens of each of N sequences, at positions pos .. pos + t - 1 of
// sequence seqs[i] of the caches keys/values [B, KV, capacity, hd], whose first pos + t
// positions hold its keys and values (these tokens' included).  Returns [N, t, H, hd] in
// q's dtype: query i of each over positions 0 .. pos + i (causal), float32 arithmetic.
// bf16_dots: bf16 caches take their scores on vdpbf16ps (or AMX tiles where they run); false:
// on float32 FMAs (for cores whose vdpbf16ps costs several FMAs), unless AMX tiles run.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                             const at::Tensor& seqs, int64_t pos, double scale, bool bf16_dots) {
  TORCH_CHECK(has_prefill_attention(), "prefill_attention needs AVX-512 (use scaled_dot_product_attention)");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "prefill_attention: q [N, t, H, hd] and caches [B, KV, capacity, hd] expected");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "prefill_attention: caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "prefill_attention: dtypes differ");
  const int64_t N = q.size(0), t = q.size(1), H = q.size(2), hd = q.size(3), B = keys.size(0), KV = keys.size(1),
                cap = keys.size(2);
  TORCH_CHECK(keys.size(3) == hd && hd % 16 == 0 && H % KV == 0 && t >= 1,
              "prefill_attention: head size a multiple of 16, heads a multiple of the kv heads, t >= 1 expected");
  TORCH_CHECK(pos >= 0 && pos + t <= cap, "prefill_attention: positions ", pos, " + ", t,
              " do not fit the caches' ", cap);
  TORCH_CHECK(seqs.scalar_type() == at::kLong && seqs.dim() == 1 && seqs.size(0) == N,
              "prefill_attention: seqs must be int64 [N]");
  const at::Tensor sc = seqs.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < B, "prefill_attention: sequence ", sp[i], " of query ", i,
                " is not in the caches' ", B);
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
#ifdef LOWBIT_ATTEND_AVX512
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    const auto run = [&](auto pairs) {
      prefill_attend<scalar_t, decltype(pairs)::value>(qc.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(),
                                                       values.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), sp, N, t,
                                                       H, KV, cap, hd, pos, static_cast<float>(scale));
    };
    if (kPairScores<scalar_t> && (bf16_dots || attend_tiles_run(hd)))
      run(std::integral_constant<bool, kPairScores<scalar_t>>{});
    else
      run(std::false_type{});
  });
#endif
  return out;
}

namespace {

// x's shape with its last dimension n: a projection's output for x.
std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

// n 8-bit codes in place shifted by 128 (x ^ 0x80): unsigned u to the int8 u - 128, as
// lowbit.linear shifts them, or int8 q to the unsigned q + 128 (a byte loop was a sixth of a
// 512-row W4A8 projection).
void shift_by_128(void* codes, int64_t n) {
  int8_t* q = static_cast<int8_t*>(codes);
  int64_t k = 0;
#ifdef __AVX512BW__
  for (; k + 64 <= n; k += 64)
    _mm512_storeu_si512(q + k, _mm512_xor_si512(_mm512_loadu_si512(q + k), _mm512_set1_epi8(static_cast<char>(0x80))));
#endif
  for (; k < n; ++k) q[k] = static_cast<int8_t>(static_cast<uint8_t>(q[k]) ^ 0x80);
}

// A projection: a float nn.Linear (weight, bias; kernel 1: dense_rows, 2: gemm_f32 then the
// bias, 3: dense_amx, 4: dense_dots, else at::linear, as lowbit.kernels.cpu.step_linear decides for the
// step's rows), a weight-only quantized one (lowbit.linear's parts: codes, scales [N, G] and
// zero points as packed_scales gives them, bits, group, and the weight_only_matmul kernel
// lowbit.kernels.cpu's plan chose for the step's rows; zero_point_min: the "min" domain's
// q * s + m; bias added after), one with 8-bit activations in blocks of 32 (act 3, the weight as for weight-only;
// kernel 0: linear_a8_blocks, 1: gemm_a8_blocks_amx, 2: gemm_a8_blocks / gemm_a8_blocks8,
// 3: gemm_a8_blocks_vnni), or
// one with 8-bit per-token activations (act 1: symmetric, 2: asymmetric): W8A8 (int8 codes
// [N, K], scale [N] float32; kernel 0: torch._int_mm, 1: int8_mm_rows, 2: int8_linear, the
// epilogue and bias fused, 3: int8_mm_panels, 4: int8_linear_amx, the same on AMX tiles) or
// W4A8 (u32x8 codes, scale [N, G] float32, int32 zero points or none; kernel 0: w4a8_gemm,
// 1: w4a8_gemm_panels, 2: w4a8_gemm_amx).
// The paths are lowbit.linear's, op for op: per-token quantization, unsigned codes shifted to
// int8, the integer product, then the row x column epilogue (W8A8) or the row scale (W4A8),
// the bias added in x's dtype.  lowbit.kernels.cpu.quant_projection names the kernels.
struct Proj {
  at::Tensor weight, codes, scale;
  c10::optional<at::Tensor> zero_point, bias;
  int64_t bits = 0, group = 0, act = 0, kernel = 0;
  bool zero_point_min = false;

  at::Tensor operator()(const at::Tensor& x) const {
    if (!codes.defined()) {
      if (kernel == 1) return dense_rows(x, weight, bias);
      if (kernel == 3) return dense_amx(x.reshape({-1, x.size(-1)}), weight, bias).view(out_shape(x, weight.size(0)));
      if (kernel == 4) return dense_dots(x.reshape({-1, x.size(-1)}), weight, bias).view(out_shape(x, weight.size(0)));
      if (kernel != 2) return at::linear(x, weight, bias);
      const at::Tensor y = gemm_f32(x, weight);
      return bias ? y + *bias : y;
    }
    if (act && act != 3 && bits == 8 && (kernel == 2 || kernel == 4))
      return int8_linear_fused(x);  // the bias in its epilogue
    at::Tensor y = act == 3 ? int8_blocks(x)
                   : act   ? int8_activations(x)
                           : weight_only_matmul(x, codes, scale, zero_point, bits, group, kernel, zero_point_min);
    return bias ? y + bias->to(y.scalar_type()) : y;
  }

  // W8A8 on gemm_int8.cpp's int8_linear (kernel 2) or amx_linear.cpp's int8_linear_amx (4):
  // per-token codes as int8_activations makes them, the zero-point correction, epilogue and
  // bias in the kernel (the composed path's bits).
  at::Tensor int8_linear_fused(const at::Tensor& x) const;

  at::Tensor int8_blocks(const at::Tensor& x) const;

  // The ATen ops of lowbit.linear's path as loops over this step's few rows (the same
  // integers and the same float32 products: the same bits): 8 ops a projection were ~10 us.
  at::Tensor int8_activations(const at::Tensor& x) const {
    const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
    auto [q, s, z] = token_codes(x2);
    const int64_t M = q.size(0);
    const at::Tensor s32 = as_float(s);
    at::Tensor y;
    if (bits == 8) {
      at::Tensor acc = kernel == 1   ? int8_mm_rows(q, codes)
                       : kernel == 3 ? int8_mm_panels(q, codes)
                                     : at::_int_mm(q, codes.t());
      if (act == 2) acc = acc - z.unsqueeze(1) * codes.sum(1, false, at::kInt).unsqueeze(0);
      y = dequantize_rowcol(acc, s32, scale, x.scalar_type());
    } else {
      y = kernel == 1   ? w4a8_gemm_panels(q, z, codes, scale, zero_point, group)
          : kernel == 2 ? w4a8_gemm_amx(q, z, codes, scale, zero_point, group)
                        : w4a8_gemm(q, z, codes, scale, zero_point, group);  // times the row scales, as lowbit.linear
      float* py = y.data_ptr<float>();
      const float* ps = s32.data_ptr<float>();
      const int64_t N = y.size(1);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) py[m * N + n] *= ps[m];
      if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
    }
    return y.view(out_shape(x, codes.size(0)));
  }

  // x2 [M, K] quantized per token to 8 bits as lowbit.linear does (unsigned codes shifted
  // by 128 to int8: u - 128 is u ^ 0x80 as int8): int8 codes, scales, int32 zero points.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> token_codes(const at::Tensor& x2) const {
    auto [q, s, z, finite] = quantize_per_token(x2, 8, act == 1);
    TORCH_CHECK(finite, "lowbit decode: the activations contain NaN or Inf, or a row's range overflows its scale");
    if (q.scalar_type() == at::kByte) {
      q = q.view(at::kChar);
      shift_by_128(q.data_ptr<int8_t>(), q.numel());
      int32_t* pz = z.data_ptr<int32_t>();
      for (int64_t m = 0; m < q.size(0); ++m) pz[m] -= 128;
    }
    return {q, s, z};
  }
};

at::Tensor Proj::int8_linear_fused(const at::Tensor& x) const {
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  auto [q, s, z] = token_codes(x2);
  const c10::optional<at::Tensor> zp = act == 2 ? c10::optional<at::Tensor>(z) : c10::nullopt;
  const at::Tensor y = (kernel == 4 ? int8_linear_amx : int8_linear)(q, zp, codes, s, scale, bias, x.scalar_type());
  return y.view(out_shape(x, codes.size(0)));
}

// Projections of the same input with activations in int8 blocks and the same kind of
// weight (bits, group, zero points or not) on the same kernel run as one call: x is
// quantized once and one parallel region covers all their rows (a8_blocks_into: the rows
// kernel, kernel 0; a8_blocks_amx_into: AMX tiles, kernel 1).  The same arithmetic per
// output as one call each, so the same bits.
bool share_blocks(const std::vector<const Proj*>& ps) {
  for (const Proj* p : ps)
    if (!p->codes.defined() || p->act != 3 || (p->kernel != 0 && p->kernel != 1) || p->kernel != ps[0]->kernel ||
        p->bits != ps[0]->bits || p->group != ps[0]->group ||
        p->zero_point.has_value() != ps[0]->zero_point.has_value() || p->zero_point_min != ps[0]->zero_point_min)
      return false;
  return true;
}

// x through the int8-block kernel (linear_a8_blocks), bias not added; outputs in x's dtype.
at::Tensor Proj::int8_blocks(const at::Tensor& x) const {
  const at::Tensor x2 = as_float(x.dim() == 2 ? x : x.reshape({-1, x.size(-1)}));
  auto [y, finite] = kernel == 1 ? gemm_a8_blocks_amx(x2, codes, scale, zero_point, bits, group, zero_point_min)
                     : kernel == 2 ? (bits == 4 ? gemm_a8_blocks(x2, codes, scale, zero_point, group, zero_point_min)
                                                : gemm_a8_blocks8(x2, codes, scale, zero_point, group, zero_point_min))
                     : kernel == 3 ? gemm_a8_blocks_vnni(x2, codes, scale, zero_point, bits, group, zero_point_min)
                                   : linear_a8_blocks(x2, codes, scale, zero_point, bits, group, zero_point_min);
  TORCH_CHECK(finite, "lowbit decode: the activations contain NaN or Inf");
  if (x.dim() == 2 && x.scalar_type() == at::kFloat) return y;
  return y.to(x.scalar_type()).view(out_shape(x, codes.size(0)));
}

// Weight-only projections on the float32 FMA kernel (gemv_f32) with the same kind of
// weight share x's preparation and one parallel region (gemv_f32_into): the same
// arithmetic per output as one call each.
bool share_gemv_f32(const std::vector<const Proj*>& ps) {
  for (const Proj* p : ps)
    if (!p->codes.defined() || p->act != 0 || p->kernel != static_cast<int64_t>(WeightOnlyKernel::kGemvF32) ||
        p->bits != ps[0]->bits || p->group != ps[0]->group || p->zero_point_min != ps[0]->zero_point_min ||
        p->zero_point.has_value() != ps[0]->zero_point.has_value() ||
        (p->scale.scalar_type() != at::kFloat && p->scale.scalar_type() != at::kHalf) ||
        (p->zero_point.has_value() && p->zero_point->scalar_type() != p->scale.scalar_type()))
      return false;
  return true;
}

// Weight-only 4-bit projections on the bf16 dot-product kernels (gemv_bf16, x rounded to
// bf16 or split in two bf16 parts, or gemv_bf16_amx: the same kernel for all) share x's
// preparation and one parallel region (gemv_bf16_into, gemv_bf16_amx_into), as
// share_gemv_f32's do.
bool share_gemv_bf16(const std::vector<const Proj*>& ps) {
  const int64_t kernel = ps[0]->kernel;
  if (kernel != static_cast<int64_t>(WeightOnlyKernel::kGemvBf16) &&
      kernel != static_cast<int64_t>(WeightOnlyKernel::kGemvBf16Split) &&
      kernel != static_cast<int64_t>(WeightOnlyKernel::kGemvBf16Amx))
    return false;
  for (const Proj* p : ps)
    if (!p->codes.defined() || p->act != 0 || p->kernel != kernel || p->bits != 4 || p->group != ps[0]->group ||
        p->zero_point_min != ps[0]->zero_point_min || p->zero_point.has_value() != ps[0]->zero_point.has_value() ||
        (p->zero_point_min && !p->zero_point.has_value()))
      return false;
  return true;
}

// Projections of one input that a decode step runs as one call: q/k/v, gate/up, or one alone.
// Where they share a kernel that takes several weights (share_blocks, share_gemv_f32,
// share_gemv_bf16, share_tokens, share_int8_linear, share_amx_bf16, share_panels), the step calls it on
// its own buffers (a8_blocks_into, gemv_f32_into, ...): no tensor and no allocation per
// call, x prepared once, the weights checked once, here.  A step makes ~120 such calls, and
// their tensors, checks and mallocs were ~1 ms of a 6 ms step (SmolLM2, q4_0-a8, 2 threads,
// perf).  Otherwise each runs Proj's tensor path.  The same bits either way.
class Group {
 public:
  explicit Group(std::vector<Proj> projs) : ps_(std::move(projs)) {
    std::vector<const Proj*> ptrs;
    for (size_t i = 0; i < ps_.size(); ++i) {
      Proj& p = ps_[i];
      TORCH_CHECK(in_features(p) == in_features(ps_[0]), "lowbit decode: projections of one input differ in size");
      if (p.bias) {
        TORCH_CHECK(p.bias->dim() == 1 && p.bias->size(0) == out_features(i),
                    "lowbit decode: a bias must hold one value per output feature");
        p.bias = p.bias->contiguous();
      }
      ptrs.push_back(&p);
    }
    const Proj& p0 = ps_[0];
    if (share_blocks(ptrs) && has_a8_blocks())
      kind_ = kBlocks;
    else if (share_gemv_f32(ptrs) && has_gemv_f32())
      kind_ = kGemv;
    else if (share_gemv_bf16(ptrs) && (p0.kernel == static_cast<int64_t>(WeightOnlyKernel::kGemvBf16Amx)
                                           ? gemv_bf16_amx_supported(in_features(p0), p0.group)
                                           : gemv_bf16_supported(in_features(p0), p0.group)))
      kind_ = kGemvBf16;
    else if (share_tokens(ptrs))
      kind_ = kTokens;
    else if (share_int8_linear(ptrs))
      kind_ = kInt8Linear;
    else if (share_amx_bf16(ptrs))
      kind_ = kAmxBf16;
    else if (share_panels(ptrs))
      kind_ = kPanels;
    if (kind_ == kTensors) return;
    K_ = in_features(p0);
    bits_ = p0.codes.defined() ? p0.bits : 0;
    group_ = p0.group;
    if (kind_ == kInt8Linear) return;
    const auto floats = [&](const at::Tensor& t) {  // float32, as the kernels read it, kept alive here
      converted_.push_back(as_float(t).contiguous());
      return converted_.back().data_ptr<float>();
    };
    if (kind_ == kPanels) {  // the bias added after the rounding (add_bias), as Proj adds it
      for (size_t i = 0; i < ps_.size(); ++i) {
        const Proj& p = ps_[i];
        panels_.push_back(PanelWeight{static_cast<const uint8_t*>(p.codes.data_ptr()), floats(p.scale),
                                      p.zero_point ? floats(*p.zero_point) : nullptr, out_features(i), nullptr});
      }
      return;
    }
    if (kind_ == kAmxBf16) {
      for (size_t i = 0; i < ps_.size(); ++i) {
        const Proj& p = ps_[i];
        if (p.codes.defined())  // the bias added after the rounding (add_bias)
          amx_.push_back(Bf16Out{p.codes.data_ptr(), floats(p.scale), p.zero_point ? floats(*p.zero_point) : nullptr,
                                 out_features(i), nullptr, nullptr, p.zero_point_min});
        else  // bf16 weights: the bias in the float32 sums, as dense_amx
          amx_.push_back(Bf16Out{p.weight.data_ptr(), nullptr, nullptr, out_features(i),
                                 p.bias ? floats(*p.bias) : nullptr, nullptr});
      }
      return;
    }
    if (kind_ == kTokens) {
      if (p0.act == 2 && bits_ == 8)  // the weight's code sums, for the activations' zero point
        for (const Proj& p : ps_) code_sums_.push_back(p.codes.sum(1, false, at::kInt).contiguous());
      return;
    }
    const char* who = kind_ == kBlocks   ? "lowbit._C.linear_a8_blocks"
                      : kind_ == kGemv   ? "lowbit._C.weight_only_gemv"
                                         : "lowbit._C.weight_only_gemv_bf16";
    TORCH_CHECK(bits_ == 4 || bits_ == 8, who, ": bits must be 4 or 8");
    TORCH_CHECK(group_ > 0 && group_ % (kind_ == kBlocks || bits_ == 4 ? 32 : 16) == 0 && K_ % group_ == 0, who,
                ": the weight group must divide K, a multiple of ", kind_ == kBlocks || bits_ == 4 ? 32 : 16);
    std::vector<at::Tensor> codes, scales, ys;
    std::vector<c10::optional<at::Tensor>> zero_points;
    for (const Proj& p : ps_) {
      codes.push_back(p.codes);
      scales.push_back(kind_ == kGemvBf16 ? as_float(p.scale) : p.scale);  // gemv_bf16 reads float32
      zero_points.push_back(kind_ == kGemvBf16 && p.zero_point ? as_float(*p.zero_point) : p.zero_point);
    }
    converted_ = scales;  // kept alive: w_ points into them
    for (const auto& z : zero_points)
      if (z) converted_.push_back(*z);
    const at::Tensor x = at::empty({1, K_}, at::kFloat);  // packed_weights' checks against [1, K]
    w_ = packed_weights(who, x, codes, scales, zero_points, bits_, group_, ys, p0.zero_point_min);
    for (PackedWeight& w : w_) w.y = nullptr;  // ys is freed here: each call sets its own
  }

  int64_t in_features() const { return in_features(ps_[0]); }
  size_t size() const { return ps_.size(); }
  bool quantized() const { return ps_[0].codes.defined(); }

  // Whether run() takes M rows (float32 or narrower) through all the projections in one
  // kernel call, x prepared once, rather than each projection's tensor path.
  bool one_call(int64_t M) const { return kind_ != kTensors && !(kind_ == kTokens && M != 1 && !w4a8_tiles()); }

  int64_t out_features(size_t i) const {
    return ps_[i].codes.defined() ? ps_[i].codes.size(0) : ps_[i].weight.size(0);
  }

  // x [M, K] in T through every projection: ys[i] [M, out_features(i)] in T, bias added, as
  // Proj gives them.  The per-token int8 path on pointers (kTokens) takes one row (W4A8 on
  // AMX tiles or VNNI panels any number); more rows go through Proj's tensor path, the same
  // arithmetic.  W8A8 on gemm_int8's panels
  // or AMX tiles (kInt8Linear) takes any number of rows; so do AMX bf16 tiles (kAmxBf16)
  // for bf16 x (and float32 x with quantized weights), other dtypes the tensor path.
  template <typename T>
  void run(const T* x, T* const* ys, int64_t M = 1) const {
    constexpr bool bf16 = std::is_same<T, c10::BFloat16>::value;
    if (!one_call(M) || ((kind_ == kTokens || kind_ == kInt8Linear) && std::is_same<T, double>::value) ||
        (kind_ == kAmxBf16 && !(bf16 || (bits_ && std::is_same<T, float>::value))) ||
        (kind_ == kPanels && !panels_take<T>()))
      return run_tensors(x, ys, M);
    if (kind_ == kTokens) {
      if (!w4a8_tiles()) return run_tokens(x, ys);
      if constexpr (std::is_same<T, float>::value || bf16) return run_w4a8_tiles(x, ys, M);
      return run_tensors(x, ys, M);  // Proj's path, the same kernel
    }
    if (kind_ == kInt8Linear) return run_int8_linear(x, ys, M);
    if (kind_ == kAmxBf16) return run_amx_bf16(x, ys, M);
    if constexpr (bf16 || std::is_same<T, float>::value)
      if (kind_ == kPanels) return run_panels(x, ys, M);
    if constexpr (std::is_same<T, c10::BFloat16>::value) {
      if (kind_ == kBlocks && ps_[0].kernel == 1) {  // bf16 in and out of the tiles: no float32 copies
        thread_local std::vector<PackedWeight> w;
        w.assign(w_.begin(), w_.end());
        TORCH_CHECK(a8_blocks_amx_into(x, M, K_, bits_, group_, w, ys),
                    "lowbit decode: the activations contain NaN or Inf");
        for (size_t i = 0; i < w.size(); ++i) add_bias(i, ys[i], M);
        return;
      }
    }
    constexpr bool f32 = std::is_same<T, float>::value;
    thread_local std::vector<float> xf_keep, yf_keep;
    thread_local std::vector<PackedWeight> w;  // this call's outputs (a Group may be stepped on two threads)
    const float* xf = reinterpret_cast<const float*>(x);
    if constexpr (!f32) {  // float32 x, as as_float gives it (exact)
      float* buf = grown(xf_keep, M * K_);
      convert(x, buf, M * K_);
      xf = buf;
    }
    w.assign(w_.begin(), w_.end());
    int64_t total = 0;
    for (size_t i = 0; i < w.size(); ++i) total += w[i].N;
    float* yf = f32 ? nullptr : grown(yf_keep, M * total);
    for (size_t i = 0, off = 0; i < w.size(); off += M * w[i].N, ++i)
      w[i].y = f32 ? reinterpret_cast<float*>(ys[i]) : yf + off;
    if (kind_ == kBlocks) {
      TORCH_CHECK(ps_[0].kernel == 1 ? a8_blocks_amx_into(xf, M, K_, bits_, group_, w)
                                     : a8_blocks_into(xf, M, K_, bits_, group_, w),
                  "lowbit decode: the activations contain NaN or Inf");
    } else if (kind_ == kGemv) {
      gemv_f32_into(xf, M, K_, bits_, group_, w);
    } else if (ps_[0].kernel == static_cast<int64_t>(WeightOnlyKernel::kGemvBf16Amx)) {
      gemv_bf16_amx_into(xf, M, K_, group_, w);
    } else {
      gemv_bf16_into(xf, M, K_, group_, ps_[0].kernel == static_cast<int64_t>(WeightOnlyKernel::kGemvBf16Split), w);
    }
    for (size_t i = 0; i < w.size(); ++i) {
      if constexpr (!f32) convert(w[i].y, ys[i], M * w[i].N);  // rounded to T, as .to(x's dtype)
      add_bias(i, ys[i], M);
    }
  }

 private:
  enum Kind { kTensors, kBlocks, kGemv, kGemvBf16, kTokens, kInt8Linear, kAmxBf16, kPanels };
  // Values from which convert() and add_bias() leave the work to ATen (vectorized, and
  // parallel from 32768 values): below, a loop costs less than wrapping the buffers in
  // tensors.  A decode step's x is ~1000 values; a prefill's, or a batch's outputs, 10^4-10^6.
  static constexpr int64_t kAtenFrom = 4096;

  // dst[0, n) = src[0, n) in D, rounded to nearest even: the same bits either way.
  template <typename S, typename D>
  static void convert(const S* src, D* dst, int64_t n) {
    if (n < kAtenFrom) {
      if constexpr (std::is_same<S, float>::value && std::is_same<D, c10::BFloat16>::value) {
        uint16_t* db = reinterpret_cast<uint16_t*>(dst);  // c10's rounding (each_bf16), vectorized
        for (int64_t k = 0; k < n; ++k) db[k] = bf16_bits(src[k]);
      } else {
        for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<D>(to_f(src[k]));
      }
      return;
    }
    at::from_blob(dst, {n}, dtype<D>()).copy_(at::from_blob(const_cast<S*>(src), {n}, dtype<S>()));
  }

  // W8A8 with per-token activations (act 1 or 2, the same for all), all on gemm_int8.cpp's
  // panels (kernel 2) or all on AMX tiles (kernel 4, K a multiple of 64): int8 codes [N, K],
  // one float32 scale per row.
  static bool share_int8_linear(const std::vector<const Proj*>& ps) {
    const Proj& p0 = *ps[0];
    const int64_t K = in_features(p0);
    for (const Proj* p : ps)
      if (!p->codes.defined() || (p->act != 1 && p->act != 2) || p->act != p0.act || p->bits != 8 ||
          (p->kernel != 2 && p->kernel != 4) || p->kernel != p0.kernel || p->codes.scalar_type() != at::kChar ||
          p->codes.dim() != 2 || !p->codes.is_contiguous() || in_features(*p) != K ||
          p->scale.scalar_type() != at::kFloat || !p->scale.is_contiguous() || p->scale.numel() != p->codes.size(0))
        return false;
    return p0.kernel == 4 ? K % 64 == 0 : int8_gemm_supported(K);
  }

  // What Proj::int8_linear_fused does for each projection, x quantized once for all of them
  // and their weights in one parallel region (int8_linear_into: gemm_int8's panels, kernel 2;
  // int8_linear_amx_into: AMX tiles, kernel 4): the same integers and epilogue, so the same
  // bits.
  template <typename T>
  void run_int8_linear(const T* x, T* const* ys, int64_t M) const {
    const bool symmetric = ps_[0].act == 1, amx = ps_[0].kernel == 4;
    thread_local std::vector<uint8_t> au_keep;
    thread_local std::vector<float> s_keep;
    thread_local std::vector<int32_t> z_keep;
    uint8_t* au = grown(au_keep, M * K_);
    float* s = grown(s_keep, M);
    int32_t* z = grown(z_keep, M);
    // gemm_int8 takes a + 128 for int8 a: symmetric codes q + 128; the AMX tiles take int8 a:
    // unsigned codes u are a = u - 128
    token_rows(x, M, symmetric == !amx, au, s, z);
    std::vector<at::Tensor> biases;  // rounded to T, as float32 (int8_linear's bias)
    std::vector<Int8Out> ws;
    for (size_t i = 0; i < ps_.size(); ++i) {
      const Proj& p = ps_[i];
      const float* bias = nullptr;
      if (p.bias) {
        biases.push_back(p.bias->to(dtype<T>()).to(at::kFloat).contiguous());
        bias = biases.back().data_ptr<float>();
      }
      ws.push_back(Int8Out{p.codes.data_ptr<int8_t>(), out_features(i), p.scale.data_ptr<float>(), bias, ys[i]});
    }
    if (amx)
      int8_linear_amx_into(reinterpret_cast<const int8_t*>(au), M, K_, s, symmetric ? nullptr : z, dtype<T>(), ws);
    else
      int8_linear_into(au, M, K_, s, symmetric ? nullptr : z, dtype<T>(), ws);
  }

  // bf16 weights on dense_amx (kernel 3: bf16 x, a bf16 bias or none), or 4- or 8-bit ones on
  // weight_only_gemm_bf16_amx, all of one kind (bits, group, zero points or none): AMX bf16
  // tiles, K a multiple of 32.
  static bool share_amx_bf16(const std::vector<const Proj*>& ps) {
    const Proj& p0 = *ps[0];
    const int64_t K = in_features(p0);
    if (!has_amx_bf16() || K <= 0 || K % 32 != 0) return false;
    for (const Proj* p : ps) {
      if (p->codes.defined() != p0.codes.defined() || in_features(*p) != K) return false;
      if (!p->codes.defined()) {
        if (p->kernel != 3 || p->weight.scalar_type() != at::kBFloat16 || p->weight.dim() != 2 ||
            !p->weight.is_contiguous() || (p->bias && p->bias->scalar_type() != at::kBFloat16))
          return false;
        continue;
      }
      const bool zp = p->zero_point.has_value();
      if (p->act != 0 || p->kernel != static_cast<int64_t>(WeightOnlyKernel::kGemmBf16Amx) || p->bits != p0.bits ||
          (p->bits != 4 && p->bits != 8) || p->group != p0.group || p->group <= 0 || p->group % 32 != 0 ||
          K % p->group != 0 || p->zero_point_min != p0.zero_point_min || zp != p0.zero_point.has_value() ||
          (p->zero_point_min && !zp) || !p->codes.is_contiguous() ||
          p->codes.dim() != 2 ||
          p->codes.scalar_type() != (p->bits == 4 ? at::kInt : zp ? at::kByte : at::kChar) ||
          p->scale.dim() != 2 || p->scale.size(0) != p->codes.size(0) || p->scale.size(1) != K / p->group ||
          (zp && p->zero_point->sizes() != p->scale.sizes()))
        return false;
    }
    return true;
  }

  // What Proj gives through dense_amx or weight_only_gemm_bf16_amx for each projection, x
  // rounded to bf16 once for all of them and their weights in one parallel region
  // (bf16_linear_amx_into): the same tile products in the same order, so the same bits.
  template <typename T>
  void run_amx_bf16(const T* x, T* const* ys, int64_t M) const {
    if (M == 0) return;
    const c10::BFloat16* xb;
    if constexpr (std::is_same<T, c10::BFloat16>::value) {
      xb = x;
    } else {  // as x.to(bfloat16)
      thread_local std::vector<c10::BFloat16> xb_keep;
      c10::BFloat16* buf = grown(xb_keep, M * K_);
      convert(x, buf, M * K_);
      xb = buf;
    }
    thread_local std::vector<Bf16Out> ws;
    ws.assign(amx_.begin(), amx_.end());
    for (size_t i = 0; i < ws.size(); ++i) ws[i].y = ys[i];
    bf16_linear_amx_into(xb, M, K_, bits_, group_, dtype<T>(), ws);
    if (bits_)  // a weight-only projection's bias after the rounding, as Proj adds it
      for (size_t i = 0; i < ws.size(); ++i) add_bias(i, ys[i], M);
  }

  // Weight-only 4- or 8-bit weights on gemm_bf16.cpp's panels (weight_only_gemm_bf16,
  // weight_only_gemm_fma or weight_only_gemm_f32_fma: the same kernel for all), all of one
  // kind (bits, group, zero points or none, the "min" domain or not), K and group as the
  // panels take them.
  static bool share_panels(const std::vector<const Proj*>& ps) {
    const Proj& p0 = *ps[0];
    const int64_t K = in_features(p0);
    if (!p0.codes.defined() || (p0.kernel != static_cast<int64_t>(WeightOnlyKernel::kGemmBf16) &&
                                p0.kernel != static_cast<int64_t>(WeightOnlyKernel::kGemmFma) &&
                                p0.kernel != static_cast<int64_t>(WeightOnlyKernel::kGemmF32Fma)))
      return false;
    for (const Proj* p : ps) {
      const bool zp = p->zero_point.has_value();
      if (!p->codes.defined() || p->act != 0 || p->kernel != p0.kernel || p->bits != p0.bits ||
          (p->bits != 4 && p->bits != 8) || p->group != p0.group || p->group <= 0 ||
          !gemm_bf16_supported(K, p->group) || K % p->group != 0 || p->zero_point_min != p0.zero_point_min ||
          zp != p0.zero_point.has_value() || (p->zero_point_min && !zp) || !p->codes.is_contiguous() ||
          p->codes.dim() != 2 || p->codes.size(1) != (p->bits == 4 ? K / 8 : K) ||
          p->codes.scalar_type() != (p->bits == 4 ? at::kInt : zp ? at::kByte : at::kChar) ||
          p->scale.dim() != 2 || p->scale.size(0) != p->codes.size(0) || p->scale.size(1) != K / p->group ||
          (zp && p->zero_point->sizes() != p->scale.sizes()))
        return false;
    }
    return true;
  }

  // The x the panels take: float32 for weight_only_gemm_f32_fma, bf16 for the others (other
  // dtypes go through the tensor path, which converts them).
  template <typename T>
  bool panels_take() const {
    return ps_[0].kernel == static_cast<int64_t>(WeightOnlyKernel::kGemmF32Fma) ? std::is_same<T, float>::value
                                                                                : std::is_same<T, c10::BFloat16>::value;
  }

  // What Proj gives through weight_only_gemm_bf16, weight_only_gemm_fma or
  // weight_only_gemm_f32_fma for each projection, their panels in one parallel region and x
  // prepared once (weight_only_panels_into, weight_only_panels_f32_into), then the bias: the
  // same bits.  x as panels_take says.
  template <typename T>
  void run_panels(const T* x, T* const* ys, int64_t M) const {
    thread_local std::vector<PanelWeight> ws;
    ws.assign(panels_.begin(), panels_.end());
    for (size_t i = 0; i < ws.size(); ++i) ws[i].y = ys[i];
    const Proj& p0 = ps_[0];
    if constexpr (std::is_same<T, float>::value)
      weight_only_panels_f32_into(x, M, K_, bits_, group_, p0.zero_point.has_value(), p0.zero_point_min, ws);
    else
      weight_only_panels_into(x, M, K_, bits_, group_, p0.zero_point.has_value(), p0.zero_point_min,
                              p0.kernel == static_cast<int64_t>(WeightOnlyKernel::kGemmFma), ws);
    for (size_t i = 0; i < ws.size(); ++i) add_bias(i, ys[i], M);
  }

  // Per-token int8 activations (act 1: symmetric, 2: asymmetric) with W8A8 codes on
  // int8_mm_rows or W4A8 codes, all of one kind: what Proj::int8_activations does, on
  // pointers, x quantized once for all of them.
  static bool share_tokens(const std::vector<const Proj*>& ps) {
    const Proj& p0 = *ps[0];
    if (!p0.codes.defined() || (p0.act != 1 && p0.act != 2)) return false;
    const int64_t K = in_features(p0);
    for (const Proj* p : ps) {
      if (!p->codes.defined() || p->act != p0.act || p->bits != p0.bits || in_features(*p) != K ||
          !p->codes.is_contiguous() || !p->scale.is_contiguous() || p->scale.scalar_type() != at::kFloat)
        return false;
      if (p0.bits == 8) {  // int8 codes [N, K], one float32 scale per row; int8_mm_rows (kernel 1)
        if (p->kernel != 1 || !has_int8_rows() || p->codes.scalar_type() != at::kChar || p->codes.dim() != 2 ||
            p->scale.numel() != p->codes.size(0) || K >= (int64_t(1) << 17))
          return false;
      } else {  // W4A8: u32x8 codes [N, K / 8], scales and int32 zero points [N, K / group]; w4a8_rows
        // (kernel 0) for one row, VNNI panels (kernel 1) or AMX tiles (kernel 2) for any number
        const bool zp = p->zero_point.has_value();
        const bool kernel_runs = p->kernel == 0   ? has_w4a8_rows()
                                 : p->kernel == 1 ? has_w4a8_panels()
                                                  : p->kernel == 2 && has_amx_int8();
        if (p0.bits != 4 || p->kernel != p0.kernel || !kernel_runs || p->codes.scalar_type() != at::kInt || p->group != p0.group ||
            p->group % 32 != 0 || K % p->group != 0 || 128 * 15 * p->group >= (int64_t(1) << 30) ||
            p->scale.dim() != 2 || p->scale.size(0) != p->codes.size(0) || p->scale.size(1) != K / p->group ||
            zp != p0.zero_point.has_value() ||
            (zp && (p->zero_point->scalar_type() != at::kInt || !p->zero_point->is_contiguous() ||
                    p->zero_point->sizes() != p->scale.sizes())))
          return false;
        if (zp && p->kernel == 2 && p->zero_point->numel() &&  // the tiles hold u - z as int8 (else Proj's
            (p->zero_point->min().item<int32_t>() < 0 || p->zero_point->max().item<int32_t>() > 15))  // path refuses)
          return false;
      }
    }
    return true;
  }

  // M rows of x quantized per token to 8 bits as lowbit.linear quantizes them: codes q [M, K_]
  // (shifted by 128 where `shift`), scales s and zero points z [M] (z - 128 for unsigned
  // codes, the zero point of u - 128 or of gemm_int8's u).  Rows spread over the threads from
  // a prefill's many (a decode step's few stay on one: a parallel region costs more than they do).
  template <typename T>
  void token_rows(const T* x, int64_t M, bool shift, void* q, float* s, int32_t* z) const {
    const bool symmetric = ps_[0].act == 1;
    at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        int8_t* qm = static_cast<int8_t*>(q) + m * K_;
        TORCH_CHECK(quantize_token_into(x + m * K_, dtype<T>(), K_, 8, symmetric, qm, s + m, z + m),
                    "lowbit decode: the activations contain NaN or Inf, or a row's range overflows its scale");
        if (shift) shift_by_128(qm, K_);
        if (!symmetric) z[m] -= 128;
      }
    });
  }

  // W4A8 on AMX tiles (kernel 2) or on gemm_int8.cpp's VNNI panels (kernel 1, where
  // w4a8_gemm_panels runs them): M rows in one call.
  bool w4a8_tiles() const {
    return kind_ == kTokens && bits_ == 4 && (ps_[0].kernel == 2 || (ps_[0].kernel == 1 && has_w4a8_panels()));
  }

  // M rows of x through W4A8 projections on AMX tiles or VNNI panels: each row quantized as
  // run_tokens quantizes one (token_rows, unsigned codes shifted to int8), every weight's
  // panels in one parallel region, the row scales and the rounding to T in the store
  // (w4a8_amx_into, w4a8_panels_into), then the bias.  On the panels, where q/k/v (gate/up)
  // each quantized x and went through ATen ops around their own call: 512-token prefills of
  // w4a8-g128 and w4a8-g128-head8 1.20x and 1.25x (Zen 4, in-process A/B, medians of 8
  // rounds), the same bits.
  template <typename T>
  void run_w4a8_tiles(const T* x, T* const* ys, int64_t M) const {
    std::vector<int8_t> q(M * K_);
    std::vector<float> s(M);
    std::vector<int32_t> z(M);
    token_rows(x, M, ps_[0].act != 1, q.data(), s.data(), z.data());
    std::vector<PackedWeight> ws;
    for (size_t i = 0; i < ps_.size(); ++i) {
      const Proj& p = ps_[i];
      ws.push_back(PackedWeight{reinterpret_cast<const uint8_t*>(p.codes.data_ptr()), p.scale.data_ptr<float>(),
                                p.zero_point ? p.zero_point->data_ptr<int32_t>() : nullptr, out_features(i), nullptr});
    }
    if (ps_[0].kernel == 2)
      w4a8_amx_into(q.data(), z.data(), s.data(), M, K_, group_, ws, ys);
    else
      w4a8_panels_into(q.data(), z.data(), s.data(), M, K_, group_, ws, ys);
    for (size_t i = 0; i < ps_.size(); ++i) add_bias(i, ys[i], M);
  }

  template <typename T>
  void run_tokens(const T* x, T* const* ys) const {
    const bool symmetric = ps_[0].act == 1;
    thread_local std::vector<int8_t> q_keep;
    thread_local std::vector<int32_t> acc_keep;
    thread_local std::vector<float> yf_keep;
    int8_t* q = grown(q_keep, K_);
    float s;
    int32_t z;
    TORCH_CHECK(quantize_token_into(x, dtype<T>(), K_, 8, symmetric, q, &s, &z),
                "lowbit decode: the activations contain NaN or Inf, or a row's range overflows its scale");
    if (!symmetric) {  // unsigned codes shifted by 128 to int8
      shift_by_128(q, K_);
      z -= 128;
    }
    if (bits_ == 4) {  // W4A8: every projection in one call (one parallel region), float32 outputs
      thread_local std::vector<PackedWeight> ws;
      ws.clear();
      int64_t total = 0;
      for (size_t i = 0; i < ps_.size(); ++i) total += out_features(i);
      float* yf = grown(yf_keep, total);
      for (size_t i = 0, off = 0; i < ps_.size(); off += out_features(i), ++i) {
        const Proj& p = ps_[i];
        ws.push_back(PackedWeight{reinterpret_cast<const uint8_t*>(p.codes.data_ptr()), p.scale.data_ptr<float>(),
                                  p.zero_point ? p.zero_point->data_ptr<int32_t>() : nullptr, out_features(i),
                                  std::is_same<T, float>::value ? reinterpret_cast<float*>(ys[i]) : yf + off});
      }
      w4a8_gemm_many_into(q, &z, 1, K_, group_, ws);
      for (size_t i = 0; i < ps_.size(); ++i) {
        float* y = ws[i].y;
        const int64_t N = ws[i].N;
        for (int64_t n = 0; n < N; ++n) y[n] *= s;  // times the row scale, then x's dtype
        if constexpr (!std::is_same<T, float>::value)
          for (int64_t n = 0; n < N; ++n) ys[i][n] = static_cast<T>(y[n]);
        add_bias(i, ys[i]);
      }
      return;
    }
    for (size_t i = 0; i < ps_.size(); ++i) {
      const Proj& p = ps_[i];
      const int64_t N = out_features(i);
      int32_t* acc = grown(acc_keep, N);
      int8_mm_rows_into(q, 1, K_, p.codes.data_ptr<int8_t>(), N, acc);
      if (!symmetric) {
        const int32_t* sums = code_sums_[i].data_ptr<int32_t>();
        for (int64_t n = 0; n < N; ++n) acc[n] -= z * sums[n];
      }
      dequantize_rowcol_into(acc, &s, p.scale.data_ptr<float>(), ys[i], dtype<T>(), 1, N);
      add_bias(i, ys[i]);
    }
  }

  // Each of y's M rows += bias.to(T), in T, as Proj adds it.
  template <typename T>
  void add_bias(size_t i, T* y, int64_t M = 1) const {
    const auto& b = ps_[i].bias;
    if (!b) return;
    const int64_t N = out_features(i);
    const at::Tensor bt = b->scalar_type() == dtype<T>() ? *b : b->to(dtype<T>());
    if (M * N >= kAtenFrom) {
      at::from_blob(y, {M, N}, dtype<T>()).add_(bt);
      return;
    }
    const T* pb = bt.data_ptr<T>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] = y[m * N + n] + pb[n];
  }

  template <typename T>
  static constexpr at::ScalarType dtype() {
    return c10::CppTypeToScalarType<T>::value;
  }

  template <typename T>
  void run_tensors(const T* x, T* const* ys, int64_t M) const {
    const at::Tensor xt = at::from_blob(const_cast<T*>(x), {M, in_features()}, at::TensorOptions().dtype(dtype<T>()));
    for (size_t i = 0; i < ps_.size(); ++i) {
      const at::Tensor y = ps_[i](xt).contiguous();
      TORCH_CHECK(y.scalar_type() == dtype<T>() && y.numel() == M * out_features(i),
                  "lowbit decode: a projection gave ", y.sizes(), " ", y.scalar_type(), "; expected ", M, " x ",
                  out_features(i), " values of the model's dtype");
      std::memcpy(ys[i], y.data_ptr<T>(), M * out_features(i) * sizeof(T));
    }
  }

  static int64_t in_features(const Proj& p) {  // codes: bytes [N, K] or u32x8 words [N, K / 8]
    if (!p.codes.defined()) return p.weight.size(1);
    return p.bits == 4 ? p.codes.size(1) * 8 : p.codes.size(1);
  }

  std::vector<Proj> ps_;
  Kind kind_ = kTensors;
  std::vector<PackedWeight> w_;  // kBlocks, kGemv, kGemvBf16: the packed weights (y set at each call)
  std::vector<Bf16Out> amx_;  // kAmxBf16: the weights (y set at each call)
  std::vector<PanelWeight> panels_;  // kPanels: the weights (y set at each call)
  std::vector<at::Tensor> converted_;  // the scales, zero points and biases w_, amx_ and panels_ point to
  std::vector<at::Tensor> code_sums_;  // kTokens, asymmetric x, 8-bit codes: int32 sums of each row's codes
  int64_t K_ = 0, bits_ = 0, group_ = 0;
};

// One projection for one row of x outside a decode step (lowbit.linear's eager path at
// M = 1): the step's Group, its weight checked and laid out once, called with a tensor.
// Around a kernel of 20-40 us, lowbit.linear's tensor path spent ~10 us on the Python
// checks and ATen conversions (bfloat16 x to float32 and back) this does in loops.
class RowLinear {
 public:
  explicit RowLinear(Proj p) : g_({std::move(p)}) {}

  // x [..., K] holding one row, float32/bfloat16/float16/float64: y [..., N] in x's dtype.
  at::Tensor operator()(const at::Tensor& x) const {
    const int64_t K = g_.in_features(), N = g_.out_features(0);
    TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == K && x.numel() == K,
                "lowbit._C.RowLinear: one row of ", K, " values on the CPU expected, got ", x.sizes());
    at::Tensor y = at::empty(out_shape(x, N), x.options());
    const at::Tensor xc = x.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lowbit_row_linear", [&] {
      scalar_t* py = y.data_ptr<scalar_t>();
      g_.run<scalar_t>(xc.data_ptr<scalar_t>(), &py);
    });
    return y;
  }

 private:
  Group g_;
};

struct Layer {
  at::Tensor ln1, ln2;
  Group qkv, o, gate_up, down;
};

class Decoder {
 public:
  Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, double eps, double scaling)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), hidden_(hidden), eps_(eps), scaling_(scaling) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0 && hidden > 0,
                "lowbit decode: heads a multiple of kv_heads, an even head_dim and hidden > 0 expected");
  }

  void add_layer(at::Tensor ln1, at::Tensor ln2, Proj q, Proj k, Proj v, Proj o, Proj gate, Proj up,
                 Proj down) {
    Layer L{ln1, ln2, Group({q, k, v}), Group({o}), Group({gate, up}), Group({down})};
    TORCH_CHECK(L.qkv.in_features() == hidden_ && L.qkv.out_features(0) == heads_ * head_dim_ &&
                    L.qkv.out_features(1) == kv_heads_ * head_dim_ && L.qkv.out_features(2) == kv_heads_ * head_dim_ &&
                    L.o.in_features() == heads_ * head_dim_ && L.o.out_features(0) == hidden_ &&
                    L.gate_up.in_features() == hidden_ && L.gate_up.out_features(1) == L.gate_up.out_features(0) &&
                    L.down.in_features() == L.gate_up.out_features(0) && L.down.out_features(0) == hidden_,
                "lowbit decode: the layer's projections do not have the model's sizes");
    layers_.push_back(std::move(L));
  }

  void set_head(at::Tensor norm, Proj lm_head) {
    Group head({lm_head});
    TORCH_CHECK(head.in_features() == hidden_, "lowbit decode: the lm_head must take hidden features");
    norm_ = norm;
    head_.emplace(std::move(head));
  }

  // The token embedding table [vocab, hidden] in the model's dtype, for greedy().
  void set_embedding(at::Tensor weight) {
    TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden_ && weight.is_contiguous(),
                "lowbit decode: the embedding must be a contiguous [vocab, hidden] table");
    embedding_ = weight;
  }

  // A greedy decode step from a token id: its row of the embedding, position pos's rows of
  // the rotary tables cos_all and sin_all [>= pos + 1, head_dim], step()'s arithmetic, and
  // the first index of the largest logit (numpy's argmax of the logits as float32: a NaN
  // counts as the largest).  One call and one integer back instead of a dozen Python and
  // ATen ops around step(), each run from caches that the step's weights have flushed.
  int64_t greedy(int64_t token, int64_t pos, const at::Tensor& cos_all, const at::Tensor& sin_all,
                 std::vector<at::Tensor> keys, std::vector<at::Tensor> values) const {
    TORCH_CHECK(embedding_.defined(), "lowbit decode: set_embedding first");
    TORCH_CHECK(token >= 0 && token < embedding_.size(0), "lowbit decode: token ", token,
                " is not an id of the embedding's ", embedding_.size(0), " rows");
    TORCH_CHECK(cos_all.dim() == 2 && sin_all.sizes() == cos_all.sizes() && cos_all.size(1) == head_dim_ &&
                    pos >= 0 && pos < cos_all.size(0) && cos_all.is_contiguous() && sin_all.is_contiguous(),
                "lowbit decode: cos_all and sin_all must be contiguous [positions, head_dim] tables that hold "
                "position ", pos);
    TORCH_CHECK(embedding_.scalar_type() == cos_all.scalar_type(),
                "lowbit decode: the embedding and the rotary tables must have one dtype");
    const at::Tensor h = embedding_.narrow(0, token, 1);
    const at::Tensor logits = step(h, cos_all.narrow(0, pos, 1), sin_all.narrow(0, pos, 1), std::move(keys),
                                   std::move(values), pos);
    int64_t best = 0;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "lowbit_decode_argmax", [&] {
      best = first_max(logits.data_ptr<scalar_t>(), logits.numel());
    });
    return best;
  }

  // h: [1, hidden] embedded token; cos/sin: [1, 1, head_dim] rows for position pos; keys
  // and values: each layer's cache [kv_heads, capacity, head_dim].  Returns logits [1, vocab].
  at::Tensor step(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> keys,
                  std::vector<at::Tensor> values, int64_t pos) const {
    TORCH_CHECK(h.dim() == 2 && h.size(0) == 1 && h.size(1) == hidden_, "lowbit decode: h must be [1, hidden]");
    TORCH_CHECK(pos >= 0, "lowbit decode: pos must be >= 0");
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "lowbit decode: cache size");
    for (size_t i = 0; i < keys.size(); ++i)
      TORCH_CHECK(keys[i].dim() == 3 && values[i].dim() == 3 && pos < keys[i].size(1),
                  "lowbit decode: the KV cache must be contiguous [kv_heads, capacity, head_dim] in h's dtype, "
                  "with room for position ", pos);
    const int64_t zero = 0;
    return steps(h, cos, sin, keys, values, &zero, &pos, 1);
  }

  // A batch's decode step: h [N, hidden], one new token of each of N sequences; cos/sin
  // [N, 1, head_dim] of their positions; keys and values: each layer's caches [B, kv_heads,
  // capacity, head_dim]; token j is sequence rows[j]'s, at position positions[j] (distinct
  // rows).  Each row through the same ops as step() (the projections on the kernels their
  // Proj names, planned for N rows), its attention over its own cache.  Logits [N, vocab].
  at::Tensor step_rows(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> keys,
                       std::vector<at::Tensor> values, const at::Tensor& rows, const at::Tensor& positions) const {
    TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden_ && h.size(0) >= 1, "lowbit decode: h must be [N, hidden]");
    const int64_t N = h.size(0);
    TORCH_CHECK(rows.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && rows.dim() == 1 &&
                    positions.dim() == 1 && rows.size(0) == N && positions.size(0) == N,
                "lowbit decode: rows and positions must be int64 [N], one per row of h");
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "lowbit decode: cache size");
    TORCH_CHECK(!keys.empty() && keys[0].dim() == 4, "lowbit decode: batched caches [B, kv_heads, capacity, head_dim]");
    const int64_t B = keys[0].size(0), cap = keys[0].size(2);
    const at::Tensor rc = rows.contiguous(), pc = positions.contiguous();
    const int64_t *r = rc.data_ptr<int64_t>(), *p = pc.data_ptr<int64_t>();
    std::vector<bool> seen(B, false);
    for (int64_t j = 0; j < N; ++j) {
      TORCH_CHECK(r[j] >= 0 && r[j] < B && !seen[r[j]] && p[j] >= 0 && p[j] < cap, "lowbit decode: token ", j,
                  " goes to sequence ", r[j], " at position ", p[j], "; the caches hold ", B, " sequences of ", cap,
                  " positions, each written by one token a step");
      seen[r[j]] = true;
    }
    for (size_t i = 0; i < keys.size(); ++i)
      TORCH_CHECK(keys[i].dim() == 4 && values[i].dim() == 4 && keys[i].size(0) == B && keys[i].size(2) == cap,
                  "lowbit decode: every layer's caches must be [", B, ", kv_heads, ", cap, ", head_dim]");
    return steps(h, cos, sin, keys, values, r, p, N);
  }

  // Layer `layer`'s projections of one input (which: 0 q/k/v, 1 o, 2 gate/up, 3 down) of the
  // rows x [M, in_features] in the model's dtype, as a step runs them: a prefill's q/k/v and
  // gate/up in one call each where they share a kernel (x quantized or rounded once, their
  // weights in one parallel region), the same bits as each projection alone.
  std::vector<at::Tensor> project(int64_t layer, int64_t which, const at::Tensor& x) const {
    const Layer& L = layers_[checked_layer(layer, which)];
    const Group& g = group(L, which);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == g.in_features() && x.device().is_cpu(),
                "lowbit decode: project takes rows [M, ", g.in_features(), "] on the CPU, got ", x.sizes());
    TORCH_CHECK(x.scalar_type() == L.ln1.scalar_type(), "lowbit decode: project takes rows in the model's dtype ",
                L.ln1.scalar_type(), ", got ", x.scalar_type());
    const int64_t M = x.size(0);
    const at::Tensor xc = x.contiguous();
    std::vector<at::Tensor> ys;
    for (size_t i = 0; i < g.size(); ++i) ys.push_back(at::empty({M, g.out_features(i)}, x.options()));
    if (M == 0) return ys;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lowbit_decode_project", [&] {
      std::vector<scalar_t*> py;
      for (at::Tensor& y : ys) py.push_back(y.data_ptr<scalar_t>());
      g.run<scalar_t>(xc.data_ptr<scalar_t>(), py.data(), M);
    });
    return ys;
  }

  // Whether project(layer, which, x) of M rows runs the projections in one call and a
  // prefill takes it: not float projections, which a prefill keeps on torch's linear
  // (transformers' bits), while a decode step runs them on its own kernels.
  bool fuses(int64_t layer, int64_t which, int64_t M) const {
    const Group& g = group(layers_[checked_layer(layer, which)], which);
    return g.one_call(M) && g.quantized();
  }

 private:
  size_t checked_layer(int64_t layer, int64_t which) const {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && which >= 0 && which < 4,
                "lowbit decode: a layer below ", layers_.size(), " and which in 0..3 expected, got ", layer, ", ",
                which);
    return static_cast<size_t>(layer);
  }
  static const Group& group(const Layer& L, int64_t which) {
    return which == 0 ? L.qkv : which == 1 ? L.o : which == 2 ? L.gate_up : L.down;
  }

  // The checks both steps share (each checked the number of caches already), then steps_as
  // in h's dtype.  A cache [KV, cap, hd] is sequence 0 of [1, KV, cap, hd]: the same memory.
  at::Tensor steps(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                   const std::vector<at::Tensor>& values, const int64_t* rows, const int64_t* positions,
                   int64_t N) const {
    TORCH_CHECK(head_.has_value(), "lowbit decode: set_head first");
    TORCH_CHECK(cos.numel() == N * head_dim_ && sin.numel() == N * head_dim_ && cos.scalar_type() == h.scalar_type() &&
                    sin.scalar_type() == h.scalar_type(),
                "lowbit decode: cos and sin must be one row of head_dim values a token, in h's dtype");
    const auto norm_ok = [&](const at::Tensor& w) {
      return w.dim() == 1 && w.size(0) == hidden_ && w.is_contiguous() && w.scalar_type() == h.scalar_type();
    };
    TORCH_CHECK(norm_ok(norm_), "lowbit decode: the norm weights must be contiguous [hidden] in h's dtype");
    for (size_t i = 0; i < keys.size(); ++i) {
      const int64_t d = keys[i].dim();
      TORCH_CHECK(keys[i].is_contiguous() && values[i].is_contiguous() && keys[i].size(d - 3) == kv_heads_ &&
                      keys[i].size(d - 1) == head_dim_ && values[i].sizes() == keys[i].sizes() &&
                      keys[i].scalar_type() == h.scalar_type() && values[i].scalar_type() == h.scalar_type(),
                  "lowbit decode: the KV caches must be contiguous [..., kv_heads, capacity, head_dim] in h's dtype");
      TORCH_CHECK(norm_ok(layers_[i].ln1) && norm_ok(layers_[i].ln2),
                  "lowbit decode: the norm weights must be contiguous [hidden] in h's dtype");
    }
    at::Tensor out;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "lowbit_decode_step", [&] {
      out = steps_as<scalar_t>(h.contiguous().clone(), cos.contiguous(), sin.contiguous(), keys, values, rows,
                               positions, N);
    });
    return out;
  }

  // N tokens in the model's dtype T; h is this step's own copy, updated in place.  Every
  // intermediate lives in one buffer of this step; the gate in a tensor of its own, for
  // at::silu_ (Runner.forward's F.silu, the same bits).
  template <typename T>
  at::Tensor steps_as(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                      const std::vector<at::Tensor>& values, const int64_t* rows, const int64_t* positions,
                      int64_t N) const {
    const int64_t H = heads_, KV = kv_heads_, hd = head_dim_, D = hidden_;
    int64_t inter = 0;
    for (const Layer& L : layers_) inter = std::max(inter, L.gate_up.out_features(0));
    const T* pc = cos.data_ptr<T>();
    const T* ps = sin.data_ptr<T>();
    T* ph = h.data_ptr<T>();
    // x (a norm's output), q, k, v, roped q, attention, a projection's output, up: each at
    // 64 bytes, as a tensor of its own would be (the CPU allocator's alignment)
    const int64_t sizes[] = {N * D, N * H * hd, N * KV * hd, N * KV * hd, N * H * hd, N * H * hd, N * D, N * inter};
    const auto padded = [](int64_t n) { return (n * int64_t(sizeof(T)) + 63) / 64 * 64 / int64_t(sizeof(T)); };
    int64_t total = 0;
    for (int64_t n : sizes) total += padded(n);
    at::Tensor buf = at::empty({total}, h.options());
    T* part[8];
    T* next = buf.data_ptr<T>();
    for (int i = 0; i < 8; ++i) {
      part[i] = next;
      next += padded(sizes[i]);
    }
    T *xn = part[0], *xq = part[1], *xk = part[2], *xv = part[3], *q = part[4], *att = part[5], *y = part[6],
      *up = part[7];
    at::Tensor gate = at::empty({N * inter}, h.options());  // [N, I] of each layer's I at its start
    const float eps = static_cast<float>(eps_), scale = static_cast<float>(scaling_);
    // the per-token work between projections, over the tokens j0..j1: one token on this
    // thread, a batch's spread over the threads (each token's values as alone)
    const auto each_token = [N](const auto& f) {
      if (N == 1)
        f(int64_t(0), int64_t(1));
      else
        parallel_chunks(0, N, 1, f);
    };
    // h += y (unless y is null), then x = RMSNorm(h) with weight w, token by token
    const auto add_norm = [&](const T* y_add, const at::Tensor& w) {
      each_token([&](int64_t j0, int64_t j1) {
        if (y_add) add_into<T>(ph + j0 * D, y_add + j0 * D, (j1 - j0) * D);
        rms_rows<T>(ph + j0 * D, w.data_ptr<T>(), xn + j0 * D, j1 - j0, D, eps);
      });
    };
    add_norm(nullptr, layers_.empty() ? norm_ : layers_[0].ln1);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      const int64_t cap = keys[i].size(-2), I_i = L.gate_up.out_features(0), seq = KV * cap * hd;
      T* const kp = keys[i].data_ptr<T>();
      T* const vp = values[i].data_ptr<T>();
      T* const qkv[] = {xq, xk, xv};
      L.qkv.run<T>(xn, qkv, N);
      // rotary embedding; k and v into the cache (head m's row at m * cap * hd); attention
      each_token([&](int64_t j0, int64_t j1) {
        for (int64_t j = j0; j < j1; ++j) {
          const T *cj = pc + j * hd, *sj = ps + j * hd;
          rope_rows<T>(xq + j * H * hd, cj, sj, q + j * H * hd, H, hd, hd);
          T* kc = kp + rows[j] * seq + positions[j] * hd;
          T* vc = vp + rows[j] * seq + positions[j] * hd;
          rope_rows<T>(xk + j * KV * hd, cj, sj, kc, KV, hd, cap * hd);
          for (int64_t m = 0; m < KV; ++m) std::memcpy(vc + m * cap * hd, xv + (j * KV + m) * hd, hd * sizeof(T));
          // one token: attend's own threads over the chunks of its cache
          attend<T>(q + j * H * hd, kp + rows[j] * seq, vp + rows[j] * seq, att + j * H * hd, H, KV, cap,
                    positions[j] + 1, hd, scale);
        }
      });
      L.o.run<T>(att, &y, N);
      add_norm(y, L.ln2);
      at::Tensor gi = gate.narrow(0, 0, N * I_i).view({N, I_i});
      T* gp = gi.data_ptr<T>();
      T* const gu[] = {gp, up};
      L.gate_up.run<T>(xn, gu, N);
      at::silu_(gi);
      each_token([&](int64_t j0, int64_t j1) { mul_into<T>(gp + j0 * I_i, up + j0 * I_i, (j1 - j0) * I_i); });
      L.down.run<T>(gp, &y, N);
      add_norm(y, i + 1 < layers_.size() ? layers_[i + 1].ln1 : norm_);
    }
    at::Tensor logits = at::empty({N, head_->out_features(0)}, h.options());
    T* pl = logits.data_ptr<T>();
    head_->run<T>(xn, &pl, N);
    return logits;
  }

  int64_t heads_, kv_heads_, head_dim_, hidden_;
  double eps_, scaling_;
  std::vector<Layer> layers_;
  at::Tensor norm_, embedding_;
  c10::optional<Group> head_;
};

}  // namespace

void bind_decode(pybind11::module& m) {
  namespace py = pybind11;
  m.def("decode_attention", &decode_attention, "attention of one new token over a KV cache, float32 arithmetic");
  m.def("decode_attention_rows", &decode_attention_rows,
        "decode_attention for one new token of each of a batch's sequences, over its own cache");
  m.def("has_prefill_attention", &has_prefill_attention, "whether prefill_attention (AVX-512) was compiled in");
  m.def("prefill_attention_tiles", &attend_tiles_run,
        "whether prefill_attention runs bf16 caches of head size hd on AMX bf16 tiles here");
  m.def("prefill_attention", &prefill_attention,
        "causal attention of t new tokens of each of N sequences over their caches, float32 arithmetic",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("seqs"), py::arg("pos"), py::arg("scale"),
        py::arg("bf16_dots") = true);
  m.def("argmax_rows", &argmax_rows, "the first index of each row's largest value (a NaN the largest), as int64");
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm of rows, one pass, float32 arithmetic");
  m.def("rope", &rope, "rotary embedding of [N, heads, head_dim] rows, as Runner's rope in x's dtype");
  py::class_<Proj>(m, "DecodeProj")
      .def(py::init([](c10::optional<at::Tensor> weight, c10::optional<at::Tensor> codes,
                       c10::optional<at::Tensor> scale, c10::optional<at::Tensor> zero_point,
                       c10::optional<at::Tensor> bias, int64_t bits, int64_t group, int64_t act, int64_t kernel,
                       bool zero_point_min) {
             Proj p;
             if (weight) p.weight = *weight;
             if (codes) p.codes = *codes;
             if (scale) p.scale = *scale;
             p.zero_point = zero_point;
             p.bias = bias;
             p.bits = bits;
             p.group = group;
             p.act = act;
             p.kernel = kernel;
             p.zero_point_min = zero_point_min;
             return p;
           }),
           py::arg("weight"), py::arg("codes"), py::arg("scale"), py::arg("zero_point"), py::arg("bias"),
           py::arg("bits"), py::arg("group"), py::arg("act") = 0, py::arg("kernel") = 0,
           py::arg("zero_point_min") = false);
  py::class_<RowLinear>(m, "RowLinear")
      .def(py::init<Proj>())
      .def("__call__", &RowLinear::operator(), py::call_guard<py::gil_scoped_release>());
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &Decoder::add_layer)
      .def("set_head", &Decoder::set_head)
      .def("set_embedding", &Decoder::set_embedding)
      .def("greedy", &Decoder::greedy, py::call_guard<py::gil_scoped_release>())
      .def("step", &Decoder::step, py::call_guard<py::gil_scoped_release>())
      .def("step_rows", &Decoder::step_rows, py::call_guard<py::gil_scoped_release>())
      .def("project", &Decoder::project, py::call_guard<py::gil_scoped_release>())
      .def("fuses", &Decoder::fuses);
}
