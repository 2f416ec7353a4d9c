// W4A16 / W8A16 beyond the decode kernels (M rows of activations, prefill): a bf16 GEMM
// with AVX512-BF16 dot products (vdpbf16ps: 32 multiply-adds per instruction, float32
// accumulation) whose weight panels are dequantized on the fly, so no float copy of the
// whole weight is ever made.
//
// Per thread, for a slice of output columns and a chunk of K (KC values, so a chunk of
// activations stays in L2 while every panel of the slice reuses it):
//   1. dequantize NR weight rows of the chunk to bf16, (q - z) * s in float32 as the
//      reference computes it, then rounded to bf16 (the one rounding of the weight);
//   2. multiply every MR rows of activations (bf16) with that panel: MR x NR
//      accumulators, each a vector over 32 consecutive k, summed across lanes at the end.
// A weight element is unpacked once per call whatever M is; the panel (NR x KC bf16)
// stays in L1/L2 while all M rows stream past it.
//
// Order inside a block of 32 values: 4-bit codes are u32x8 words, byte i holding element
// 2i (low nibble) and 2i + 1 (high nibble); unpacking a 16-byte block gives the even
// elements in one vector and the odd ones in the other.  Rather than shuffle the weight,
// the activations are laid out once per call in the same order (evens, then odds, of
// every 32-block); a dot product does not care about the order of its terms.
//
// Register budget: MR x NR = 4 x 6 accumulators + 4 activation vectors + 1 weight
// vector = 29 of the 32 zmm registers; each 32-value step issues 10 loads for 24 dot
// products.

#include "kernels.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define LOWBIT_HAVE_BF16_GEMM 1
#endif

namespace {

#ifdef LOWBIT_HAVE_BF16_GEMM
constexpr int MR = 4;
constexpr int NR = 6;
// Activations chunk: KC values of M rows (128 rows x 2048 x 2 bytes = 512 KiB fits the
// 1 MiB L2 of Zen 4 next to the panel).
// (Measured on Zen 4: 512 or 1024 with the activations of MR rows reused from L1 across
// 4 panels was 5-20% slower: the lane sums at the end of every chunk cost more.)
constexpr int64_t KC_MAX = 2048;

// Rows [n0, n0 + nr) of W, values [k0, k0 + kc), dequantized to bf16 rows of kc values.
template <int BITS, bool SIGNED, bool HAS_ZP>
void pack_panel(const uint8_t* w, const float* s, const float* z, int64_t K, int64_t G, int64_t group, int64_t n0,
                int nr, int64_t k0, int64_t kc, uint16_t* buf) {
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  for (int c = 0; c < nr; ++c) {
    const uint8_t* wr = w + (n0 + c) * row_bytes;
    const float* sr = s + (n0 + c) * G;
    const float* zr = HAS_ZP ? z + (n0 + c) * G : nullptr;
    uint16_t* out = buf + c * kc;
    for (int64_t k = k0; k < k0 + kc; k += 32) {
      const int64_t g = k / group;
      __m512i lo, hi;  // block values 0..15 and 16..31 (4-bit: even and odd elements)
      if constexpr (BITS == 4) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k / 2)));
        if constexpr (SIGNED) {
          lo = _mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28);
          hi = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 28);
        } else {
          lo = _mm512_and_si512(v, _mm512_set1_epi32(0xF));
          hi = _mm512_srli_epi32(v, 4);
        }
      } else {
        const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k));
        const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k + 16));
        lo = SIGNED ? _mm512_cvtepi8_epi32(b0) : _mm512_cvtepu8_epi32(b0);
        hi = SIGNED ? _mm512_cvtepi8_epi32(b1) : _mm512_cvtepu8_epi32(b1);
      }
      __m512 a = _mm512_cvtepi32_ps(lo), b = _mm512_cvtepi32_ps(hi);
      if constexpr (HAS_ZP) {
        const __m512 zv = _mm512_set1_ps(zr[g]);
        a = _mm512_sub_ps(a, zv);
        b = _mm512_sub_ps(b, zv);
      }
      const __m512 sv = _mm512_set1_ps(sr[g]);
      a = _mm512_mul_ps(a, sv);
      b = _mm512_mul_ps(b, sv);
      // vcvtne2ps2bf16 rounds to nearest even, as torch's .to(torch.bfloat16)
      _mm512_storeu_si512(out + (k - k0), (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

// {sum(a), sum(b), sum(c), sum(d)}: add 256-bit halves, then 128-bit quarters, then lanes.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12), u));
}

// y[r, c] (+)= sum_k a[r, k] b[c, k] over kc values (a multiple of 32).
template <int R, int C>
void tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kc, float* y, int64_t ldy, bool accumulate) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; k += 32) {
    __m512i av[R];
    for (int r = 0; r < R; ++r) av[r] = _mm512_loadu_si512(a + r * lda + k);
    for (int c = 0; c < C; ++c) {
      const __m512i bv = _mm512_loadu_si512(b + c * kc + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)av[r], (__m512bh)bv);
    }
  }
  // Lane sums four accumulators at a time (3.5 instructions per sum instead of 8).
  alignas(16) float sums[(R * C + 3) / 4 * 4];
  const __m512* flat = &acc[0][0];
  for (int i = 0; i < R * C; i += 4) {
    const __m512 zero = _mm512_setzero_ps();
    _mm_store_ps(sums + i, hsum4(flat[i], i + 1 < R * C ? flat[i + 1] : zero, i + 2 < R * C ? flat[i + 2] : zero,
                                 i + 3 < R * C ? flat[i + 3] : zero));
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = accumulate ? y[r * ldy + c] + sums[r * C + c] : sums[r * C + c];
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool);

template <int R, int... Cs>
constexpr std::array<TileFn, NR> tile_row(std::integer_sequence<int, Cs...>) {
  return {tile<R, Cs + 1>...};
}
template <int... Rs>
constexpr std::array<std::array<TileFn, NR>, MR> tile_table(std::integer_sequence<int, Rs...>) {
  return {tile_row<Rs + 1>(std::make_integer_sequence<int, NR>{})...};
}
constexpr auto TILES = tile_table(std::make_integer_sequence<int, MR>{});

inline uint16_t bf16_bits(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// x [M, K] -> bf16 [M, K], each 32-block reordered to (evens, odds) when `deinterleave`.
template <typename T>
void prepare(const T* x, uint16_t* xa, int64_t M, int64_t K, bool deinterleave) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* xm = x + m * K;
      uint16_t* am = xa + m * K;
      for (int64_t b = 0; b < K; b += 32)
        for (int i = 0; i < 32; ++i) {
          const int64_t src = deinterleave ? b + (i < 16 ? 2 * i : 2 * (i - 16) + 1) : b + i;
          if constexpr (std::is_same_v<T, c10::BFloat16>)
            am[b + i] = xm[src].x;
          else
            am[b + i] = bf16_bits(static_cast<float>(xm[src]));
        }
    }
  });
}

template <int BITS, bool SIGNED, bool HAS_ZP>
void gemm(const uint16_t* xa, const uint8_t* w, const float* s, const float* z, int64_t M, int64_t N, int64_t K,
          int64_t G, int64_t group, float* y) {
  const int64_t panels = (N + NR - 1) / NR;
  // K in equal chunks of at most KC_MAX values (whole 32-blocks): each chunk ends with
  // lane sums of every accumulator, so fewer, longer chunks waste less.
  const int64_t chunks = (K + KC_MAX - 1) / KC_MAX;
  const int64_t KC = (K / 32 + chunks - 1) / chunks * 32;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint16_t> buf(NR * KC);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * NR;
        const int nr = static_cast<int>(std::min<int64_t>(NR, N - n0));
        pack_panel<BITS, SIGNED, HAS_ZP>(w, s, z, K, G, group, n0, nr, k0, kc, buf.data());
        for (int64_t m = 0; m < M; m += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, M - m));
          TILES[mr - 1][nr - 1](xa + m * K + k0, K, buf.data(), kc, y + m * N + n0, N, k0 > 0);
        }
      }
    }
  });
}
#endif

}  // namespace

// Whether weight_only_gemm_bf16 handles K and group: whole 32-value blocks, each inside
// one group.
bool gemm_bf16_supported(int64_t K, int64_t group) {
#ifdef LOWBIT_HAVE_BF16_GEMM
  return K % 32 == 0 && group % 32 == 0;
#else
  (void)K, (void)group;
  return false;
#endif
}

// x float32/bfloat16/float16 [M, K] (rounded to bf16); codes int8/uint8 [N, K] or int32
// [N, K/8]; scale, zero_point float32 [N, G].  Returns float32 [M, N].
at::Tensor weight_only_gemm_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group) {
  TORCH_CHECK(gemm_bf16_supported(x.size(1), group), "lowbit._C.weight_only_gemm_bf16: unsupported K/group");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scale.is_contiguous() &&
                  scale.scalar_type() == at::kFloat,
              "lowbit._C.weight_only_gemm_bf16: contiguous x and float32 scale expected");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / group;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
#ifdef LOWBIT_HAVE_BF16_GEMM
  if (M == 0 || N == 0) return y;
  at::Tensor xa = at::empty({M, K}, x.options().dtype(at::kShort));
  uint16_t* pa = reinterpret_cast<uint16_t*>(xa.data_ptr());
  const bool de = bits == 4;
  switch (x.scalar_type()) {
    case at::kFloat: prepare<float>(x.data_ptr<float>(), pa, M, K, de); break;
    case at::kBFloat16: prepare<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), pa, M, K, de); break;
    case at::kHalf: prepare<c10::Half>(x.data_ptr<c10::Half>(), pa, M, K, de); break;
    default: TORCH_CHECK(false, "lowbit._C.weight_only_gemm_bf16: unsupported x dtype ", x.scalar_type());
  }
  const uint8_t* w = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* s = scale.data_ptr<float>();
  const float* z = zero_point.has_value() ? zero_point->data_ptr<float>() : nullptr;
  float* py = y.data_ptr<float>();
#define LOWBIT_GEMM(B, S, Z) gemm<B, S, Z>(pa, w, s, z, M, N, K, G, group, py)
  if (bits == 4) {
    if (z) LOWBIT_GEMM(4, false, true); else LOWBIT_GEMM(4, true, false);
  } else {
    if (z) LOWBIT_GEMM(8, false, true); else LOWBIT_GEMM(8, true, false);
  }
#undef LOWBIT_GEMM
#endif
  return y;
}
