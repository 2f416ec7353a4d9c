// Small vector helpers the CPU kernels share.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

// The float32 value of bf16 bits (the high half of a float32: exact).
inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float32 rounded to bf16 bits as torch's .to(bfloat16) does (nearest, ties to even; NaN
// as 0x7FC0), in a form the compiler vectorizes (c10's scalar conversion is not).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7FC0) : uint16_t(rounded);
}

#if defined(__AVX512F__)
// exp of 16 float32 lanes (decode.cpp's exp8 widened: the same operations, so the same value
// in each lane; 0 below -87).
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

// The mask of the first n of 16 lanes: none for n <= 0, all from 16 on.
inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// The largest of s[0 .. len), 16 lanes at a time (-inf for len <= 0).
inline float row_max16(const float* s, int64_t len) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 valid = lanes16(len - j);
    m = _mm512_mask_max_ps(m, valid, m, _mm512_maskz_loadu_ps(valid, s + j));
  }
  return _mm512_reduce_max_ps(m);
}
#endif

#if defined(__AVX512F__)
// bf16_bits of 16 floats at once, in integer lanes.  Not vcvtneps2bf16: that one flushes
// float32 subnormals to zero, which .to(bfloat16) keeps (bf16 has float32's exponent range).
inline __m256i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i b = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(b);
}
// a * s + m rounded twice, as the reference's two steps ("min" domain weights): the explicit
// rounding mode keeps GCC from contracting the pair into one FMA (-ffp-contract=fast treats
// _mm512_mul_ps and _mm512_add_ps as plain vector arithmetic).
inline __m512 mul_add_unfused(__m512 a, __m512 s, __m512 m) {
  return _mm512_add_round_ps(_mm512_mul_ps(a, s), m, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// The factor of x's group sum in the bf16 decode kernels (gemv_bf16.cpp, gemv_amx.cpp: codes
// read as the bf16 numbers 128 + u): s (128 + z), or 128 s - m in the "min" domain (z holding
// m; 128 s exact, one rounding).  16 groups at once, or one: the same operations.
inline __m512 offset_factor(__m512 s, __m512 z, bool min) {
  return min ? _mm512_sub_ps(_mm512_mul_ps(s, _mm512_set1_ps(128.f)), z)
             : _mm512_mul_ps(s, _mm512_add_ps(z, _mm512_set1_ps(128.f)));
}
inline float offset_factor(float s, float z, bool min) { return min ? s * 128.f - z : s * (z + 128.f); }
// 16 bf16 values (bits, in memory or in 16-bit lanes) widened to float32: exact.
inline __m512 bf16x16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
inline __m512 bf16x16(const uint16_t* p) { return bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

// Scales (and zero points) as the kernels read them: float32, or float16 bits (uint16_t,
// PackedWeight::half) converted to float32, exactly, with F16C: one value, two (the low half
// of a __m128), or eight.
#if defined(__F16C__)
inline float scale1(const float* p) { return *p; }
inline float scale1(const uint16_t* p) { return _cvtsh_ss(*p); }
inline __m128 scale2(const float* p) { return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))); }
inline __m128 scale2(const uint16_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}
inline __m256 scale8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 scale8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#if defined(__AVX512F__)
// Sixteen, the lanes beyond `in` zero.
inline __m512 scale16(const float* p, __mmask16 in) { return _mm512_maskz_loadu_ps(in, p); }
inline __m512 scale16(const uint16_t* p, __mmask16 in) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, p)); }
#endif
#endif

// Prefetch the bytes of a weight row that is read later, one cache line at a time: the
// decode kernels that read weight rows one after another take row n + kRowsAhead's as they
// start row n, as the hardware prefetcher alone falls behind from DRAM (Zen 2, 2 threads,
// SmolLM2's 49152 x 576 int8 head: gemv_f32's rows 1.2x; spread over the row instead, as
// int8_mm_rows and gemv_a8.cpp's 8-bit rows do it, 1.15x and 1.35x there).
constexpr int64_t kRowsAhead = 8;
// Rows of at least kLongRow bytes of codes are read one at a time by gemv_a8.cpp's 4-bit
// decode rows (L1 prefetches), which take shorter ones four at a time: four
// interleaved streams of 768-byte rows (SmolLM2's down projection, K = 1536) ran at 8 GB/s
// from DRAM against 16 GB/s for the same bytes in rows of 288 (Zen 4, 2 threads, cycling
// through 128 MiB of weights); one row at a time, with the prefetches spread over the row,
// 1.6-1.8x that (weights in L2: 0.94-0.98x).
constexpr int64_t kLongRow = 512;
inline void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(row) + i, _MM_HINT_T0);
}
// Kernels that stream a weight's rows in order prefetch kStreamAhead bytes on into the L2,
// one line per line read (prefetch_l2): on the Zen 4, 2 threads, SmolLM2's 49152 x 576 int8
// head cycling through 4 copies (113 MB, L3 32 MiB), w8_rows' loop took 1.56 ms a call (median)
// with the burst of rows n + 8 and n + 9 into the L1 at each pair, 1.23 ms with that burst
// into the L2, 1.92 ms spread into the L1 8 KiB on, 1.20 / 1.08 / 1.06 ms spread into the L2
// 4 / 8 / 16 KiB on, 2.54 ms without prefetches (a standalone copy of the loop, the variants
// alternating in one process, 40 rounds): the L1's miss buffers fill long before the
// memory's latency is covered, the L2's do not.  Decode steps (in-process A/B, same VM):
// w8a16-head8 1.40x, w4a16-g128-head8 1.16-1.23x, q4_0 1.10-1.14x.  gemv_a8.cpp's rows and
// w4a8_rows512 keep row n + kRowsAhead's codes into the L1: the L2 there was level or slower
// (q8_0-a8 0.94x, w4a8-g128 0.96-0.99x).  Measured on the Zen 4 only.
constexpr int64_t kStreamAhead = 8192;
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

#if defined(__AVX2__) && defined(__FMA__)
// The sum of the 8 float lanes of v.
inline float fsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX2__)
// r[i] <- dword i of every r[j] (an 8 x 8 transpose of 32-bit elements).
inline void transpose8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // u[4a + b] holds, in its 128-bit lane L, dword 4L + b of rows 4a..4a+3
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// The sum of the 8 int32 lanes of v.
inline int32_t isum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#endif
