// W4A16 for small M with AVX512-BF16 dot products (vdpbf16ps: 32 multiply-adds per
// instruction, float32 accumulation), the decode path for 4-bit weights.
//
// Nibble to bf16 without a table: the bf16 with bits 0x4300 | u is exactly 128 + u for
// u < 128, so one vpternlogd ((w >> 4j) & 0xF) | 0x4300 turns four nibbles of every
// 16-bit lane into bf16 numbers.  The offset comes back out per group:
//   sum_k (u_k - z) x_k = sum_k (128 + u_k) x_k - (128 + z) sum_k x_k
// Signed codes are read as u = nibble ^ 8 = q + 8 with z = 8.  Products of bf16 numbers
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define LOWBIT_HAVE_BF16_DOT 1
#endif

namespace {

#ifdef LOWBIT_HAVE_BF16_DOT
// Rows computed together: each unpacked weight vector is reused by all of them (16 rows
// measured slower than 4 on Zen 5: the extra accumulators spill).
constexpr int MB = 4;

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
  // scale of the group of element p + 8t, for each lane t
  static F scales(const float* s, int64_t p, int64_t group) {
    if (group % 128 == 0) return _mm512_set1_ps(s[p / group]);
    if (group == 64) {
      const int64_t g = p / 64;
      return _mm512_insertf32x8(_mm512_set1_ps(s[g]), _mm256_set1_ps(s[g + 1]), 1);
    }
    const int64_t g = p / 32;  // group == 32
    __m512 v = _mm512_set1_ps(s[g]);
    v = _mm512_insertf32x4(v, _mm_set1_ps(s[g + 1]), 1);
    v = _mm512_insertf32x4(v, _mm_set1_ps(s[g + 2]), 2);
    return _mm512_insertf32x4(v, _mm_set1_ps(s[g + 3]), 3);
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
  static F scales(const float* s, int64_t p, int64_t group) {
    if (group % 64 == 0) return _mm256_set1_ps(s[p / group]);
    const int64_t g = p / 32;
    return _mm256_insertf32x4(_mm256_set1_ps(s[g]), _mm_set1_ps(s[g + 1]), 1);
  }
};

// One block of V::VALUES values at element p for R rows; xh/xl point at the block's
// prepared activations of row 0 (4 vectors of V::VALUES / 4 bf16 each), rows xstride apart.
template <typename V, int R, bool SIGNED, bool SPLIT>
inline void block(const uint8_t* w, const uint16_t* xh, const uint16_t* xl, int64_t xstride, const float* s,
                  int64_t p, int64_t group, typename V::F* total) {
  typename V::I wv = V::load(w + p / 2);
  if constexpr (SIGNED) wv = V::flip(wv);
  const typename V::I n0 = V::nib(wv, 0), n1 = V::nib(wv, 4), n2 = V::nib(wv, 8), n3 = V::nib(wv, 12);
  const typename V::F sv = V::scales(s, p, group);
  constexpr int Q = V::VALUES / 4;  // bf16 per vector
  for (int r = 0; r < R; ++r) {
    const uint16_t* h = xh + r * xstride;
    typename V::F d = V::zero();
    d = V::dot(d, n0, h);
    d = V::dot(d, n1, h + Q);
    d = V::dot(d, n2, h + 2 * Q);
    d = V::dot(d, n3, h + 3 * Q);
    if constexpr (SPLIT) {
      const uint16_t* l = xl + r * xstride;
      d = V::dot(d, n0, l);
      d = V::dot(d, n1, l + Q);
      d = V::dot(d, n2, l + 2 * Q);
      d = V::dot(d, n3, l + 3 * Q);
    }
    total[r] = V::fma(d, sv, total[r]);
  }
}

// y[r] = sum_blocks (scaled dots) - sum_g s_g (128 + z_g) xsum[r, g]
template <int R, bool SIGNED, bool HAS_ZP, bool SPLIT>
void rows(const uint8_t* w, const uint16_t* xh, const uint16_t* xl, const float* xsum, int64_t K, int64_t G,
          int64_t group, const float* s, const float* z, float* y, int64_t ldy) {
  __m512 tz[R];
  __m256 ty[R];
  for (int r = 0; r < R; ++r) { tz[r] = Z::zero(); ty[r] = Y::zero(); }
  const int64_t full = K / 128 * 128;
  for (int64_t p = 0; p < full; p += 128) block<Z, R, SIGNED, SPLIT>(w, xh + p, xl + p, K, s, p, group, tz);
  if (full < K) block<Y, R, SIGNED, SPLIT>(w, xh + full, xl + full, K, s, full, group, ty);
  // The offset term, 16 groups per vector, taken from the dot products' lanes before their
  // one reduction (a scalar loop over the groups and two reductions per row were a third
  // of a row's work at K = 576).
  for (int r = 0; r < R; ++r) {
    __m512 t = _mm512_add_ps(tz[r], _mm512_zextps256_ps512(ty[r]));
    const float* xs = xsum + r * G;
    for (int64_t g = 0; g < G; g += 16) {
      const __mmask16 in = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
      const __m512 offset = HAS_ZP ? _mm512_add_ps(_mm512_maskz_loadu_ps(in, z + g), _mm512_set1_ps(128.f))
                                   : _mm512_set1_ps(SIGNED ? 136.f : 128.f);
      t = _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(in, s + g), offset), _mm512_maskz_loadu_ps(in, xs + g), t);
    }
    y[r * ldy] = _mm512_reduce_add_ps(t);
  }
}

// Lay out x [M, K] for the lane bookkeeping above: within each block of W values, vector j
// holds x[8t + j] in lane 2t and x[8t + 4 + j] in lane 2t + 1.  xsum [M, G] gets the group
// sums of the values actually multiplied (hi + lo), so the 128 offset cancels exactly
// against them and the split error of x is not amplified by it.
void prepare(const float* x, uint16_t* hi, uint16_t* lo, float* xsum, int64_t M, int64_t K, int64_t group) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    for (int64_t g = 0; g < K / group; ++g) {
      float t = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {
        const uint16_t h = bf16_bits(xm[k]);
        t += bf16_value(h);
        if (lo) t += bf16_value(bf16_bits(xm[k] - bf16_value(h)));
      }
      xsum[m * (K / group) + g] = t;
    }
    for (int64_t p = 0; p < K;) {
      const int64_t W = K - p >= 128 ? 128 : 64, Q = W / 4;
      for (int j = 0; j < 4; ++j)
        for (int64_t t = 0; t < W / 8; ++t)
          for (int e = 0; e < 2; ++e) {
            const float v = xm[p + 8 * t + 4 * e + j];
            const uint16_t h = bf16_bits(v);
            const int64_t at = m * K + p + j * Q + 2 * t + e;
            hi[at] = h;
            if (lo) lo[at] = bf16_bits(v - bf16_value(h));
          }
      p += W;
    }
  }
}

template <bool SIGNED, bool HAS_ZP, bool SPLIT>
void run(const uint8_t* w, const uint16_t* xh, const uint16_t* xl, const float* xsum, int64_t M, int64_t N,
         int64_t K, int64_t G, int64_t group, const float* s, const float* z, float* y) {
  // Row n + kRowsAhead is fetched as row n starts: a decode step's weights (SmolLM2's
  // 53 MB of 4-bit codes) stream from beyond the L2, where the hardware prefetcher alone
  // leaves this loop waiting (AMX Xeon, 2 threads, w4a16-g128-head8 step at 128 positions:
  // 10.5-11.3 ms without, 8.8-9.6 with; 1536 x 576 cycling through 53 MB of weights, one
  // thread: 96 -> 73 us a call, 63 us cache-resident).
  parallel_chunks(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wn = w + n * (K / 2);
      if (n + kRowsAhead < N) prefetch_row(wn + kRowsAhead * (K / 2), K / 2);
      const float* sn = s + n * G;
      const float* zn = HAS_ZP ? z + n * G : nullptr;
      int64_t m = 0;
      for (; m + MB <= M; m += MB)
        rows<MB, SIGNED, HAS_ZP, SPLIT>(wn, xh + m * K, xl ? xl + m * K : nullptr, xsum + m * G, K, G, group, sn, zn,
                                        y + m * N + n, N);
      for (; m < M; ++m)
        rows<1, SIGNED, HAS_ZP, SPLIT>(wn, xh + m * K, xl ? xl + m * K : nullptr, xsum + m * G, K, G, group, sn, zn,
                                       y + m * N + n, N);
    }
  });
}
#endif

}  // namespace

// Whether weight_only_gemv_bf16 handles this shape: K a multiple of 64, groups of 32, 64
// or a multiple of 128 (so each vector's lanes map onto whole groups).
bool gemv_bf16_supported(int64_t K, int64_t group) {
#ifdef LOWBIT_HAVE_BF16_DOT
  return K % 64 == 0 && (group == 32 || group == 64 || group % 128 == 0);
#else
  (void)K, (void)group;
  return false;
#endif
}

// x float32 [M, K] (split into two bf16 parts when `split`, else rounded to bf16: exact for
// bf16 activations); codes int32 [N, K/8]; scale, zero_point float32 [N, G].
at::Tensor weight_only_gemv_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& zero_point, int64_t group, bool split) {
  TORCH_CHECK(gemv_bf16_supported(x.size(1), group), "lowbit._C.weight_only_gemv_bf16: unsupported K/group");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && codes.is_contiguous() && scale.is_contiguous(),
              "lowbit._C.weight_only_gemv_bf16: contiguous float32 x and scale expected");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / group;
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef LOWBIT_HAVE_BF16_DOT
  at::Tensor xh = at::empty({M, K}, x.options().dtype(at::kShort));
  at::Tensor xl = split ? at::empty({M, K}, x.options().dtype(at::kShort)) : at::Tensor();
  uint16_t* ph = reinterpret_cast<uint16_t*>(xh.data_ptr());
  uint16_t* pl = split ? reinterpret_cast<uint16_t*>(xl.data_ptr()) : nullptr;
  at::Tensor xsum = at::empty({M, G}, x.options());
  prepare(x.data_ptr<float>(), ph, pl, xsum.data_ptr<float>(), M, K, group);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* s = scale.data_ptr<float>();
  const float* z = zero_point.has_value() ? zero_point->data_ptr<float>() : nullptr;
  float* py = y.data_ptr<float>();
  const float* pxs = xsum.data_ptr<float>();
#define LOWBIT_RUN(SIGNED, HAS_ZP, SPLIT) run<SIGNED, HAS_ZP, SPLIT>(w, ph, pl, pxs, M, N, K, G, group, s, z, py)
  if (z) {
    if (split) LOWBIT_RUN(false, true, true); else LOWBIT_RUN(false, true, false);
  } else {
    if (split) LOWBIT_RUN(true, false, true); else LOWBIT_RUN(true, false, false);
  }
#undef LOWBIT_RUN
#endif
  return y;
}
