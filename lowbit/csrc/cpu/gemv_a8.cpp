// Weight-only weights (4- or 8-bit codes, float scales) times activations quantized to
// int8 on the fly in blocks of 32 values (symmetric, float32 scale per block: the scheme
// int8-sym-g32), the way llama.cpp runs its Q4_0/Q8_0 matmuls against Q8_0 activations.
// The products inside a block are exact integer dot products; floats enter once per block.
// AVX2 only (every x86-64 since 2015, and the AVX-512 machines): what makes it fast where
// float32 FMAs are the bottleneck is the integer multiply-add, not the vector width.
//
//   x[m, k] ~ d[m, b] * xq[m, k]   for k in block b (32 values), xq in [-128, 127]
//   y[m, n] = sum_g s[n, g] * ( sum_{b in g} d[m, b] * sum_{k in b} xq[m, k] q[n, k]
//                               - z[n, g] * sum_{b in g} d[m, b] * sum_{k in b} xq[m, k] )
// which is the reference (x dequantized per block, then the weight-only matmul) regrouped.
//
// 4-bit codes: u32x8 words read as bytes (byte i of a row: element 2i in its low nibble,
// 2i + 1 in its high one); a block's 16 bytes give 16 low and 16 high nibbles, and the
// activations of each block are stored as its 16 even elements then its 16 odd ones, so
// one vpmaddubsw (unsigned nibble x signed int8, pairs summed in int16: at most
// 2 * 15 * 128, no saturation) and one vpmaddwd by ones give 8 int32 partial sums.
// Signed codes are read as u = q + 8 with zero point 8.
// 8-bit codes: widened to int16 and multiplied with int16 activations by vpmaddwd (pairs
// at most 2 * 255 * 128 in int32), as vpmaddubsw would saturate on 8-bit x 8-bit pairs.

#include "kernels.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define LOWBIT_A8_BLOCKS 1
#endif

namespace {

constexpr int64_t BLOCK = 32;  // activation values per int8 block

// Quantize row x [K] (float32, finite) into blocks: d[b] = max|x| / 127.5 (1 for an all-zero
// block), xq = clamp(round_half_even(x / d), -128, 127): choose_qparams and quantize of the
// reference for "int8-sym-g32", bit for bit.  Writes the codes in the kernel's layout
// (int8, even elements then odd ones per block, for 4-bit weights; int16 in order for
// 8-bit), d, and xs[g] = sum_{b in g} d[b] * sum_{k in b} xq[k] (the zero-point term).
// Returns whether the row was finite (NaN and Inf fail "a <= FLT_MAX").
template <typename Q>
bool quantize_row(const float* x, int64_t K, int64_t group, bool split, Q* xq, float* d, float* xs) {
  const int64_t per_group = group / BLOCK;
  bool finite = true;
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const float* xb = x + b * BLOCK;
    float amax = 0.f;
    for (int i = 0; i < BLOCK; ++i) {
      const float a = std::fabs(xb[i]);
      finite &= a <= std::numeric_limits<float>::max();
      amax = std::max(amax, a);
    }
    float scale = amax / 127.5f;
    if (!(scale > 0.f)) scale = 1.f;
    int32_t sum = 0;
    for (int i = 0; i < BLOCK; ++i) {
      const float q = std::min(127.f, std::max(-128.f, std::nearbyint(xb[i] / scale)));
      const int slot = split ? (i % 2) * (BLOCK / 2) + i / 2 : i;
      xq[b * BLOCK + slot] = static_cast<Q>(q);
      sum += static_cast<int32_t>(q);
    }
    d[b] = scale;
    if (b % per_group == 0) xs[b / per_group] = 0.f;
    xs[b / per_group] += scale * static_cast<float>(sum);
  }
  return finite;
}

#ifdef LOWBIT_A8_BLOCKS
constexpr int MB = 4;  // activation rows per weight row (each unpacked weight block reused MB times)

inline float fsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}


// R activation rows x one weight row of 4-bit codes.
template <int R, bool SIGNED, bool HAS_ZP>
void w4_rows(const int8_t* xq, const float* d, const float* xs, int64_t K, int64_t G, int64_t group,
             const uint8_t* w, const float* s, const float* z, float* y, int64_t ldy) {
  const int64_t nb = K / BLOCK, per_group = group / BLOCK;
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(SIGNED ? 0x08 : 0x00), ones = _mm256_set1_epi16(1);
  __m256 total[R];
  float corr[R];
  for (int r = 0; r < R; ++r) { total[r] = _mm256_setzero_ps(); corr[r] = 0.f; }
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * (BLOCK / 2)));
      const __m256i u = _mm256_xor_si256(
          _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low)), flip);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (r * nb + b) * BLOCK));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[r * nb + b]), acc[r]);
      }
    }
    const __m256 sg = _mm256_set1_ps(s[g]);
    const float zg = SIGNED ? 8.f : HAS_ZP ? z[g] : 0.f;
    for (int r = 0; r < R; ++r) {
      total[r] = _mm256_fmadd_ps(acc[r], sg, total[r]);
      if (SIGNED || HAS_ZP) corr[r] += s[g] * zg * xs[r * G + g];
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = fsum8(total[r]) - corr[r];
}

// R activation rows x one weight row of 8-bit codes.
template <int R, bool SIGNED, bool HAS_ZP>
void w8_rows(const int16_t* xq, const float* d, const float* xs, int64_t K, int64_t G, int64_t group,
             const uint8_t* w, const float* s, const float* z, float* y, int64_t ldy) {
  const int64_t nb = K / BLOCK, per_group = group / BLOCK;
  __m256 total[R];
  float corr[R];
  for (int r = 0; r < R; ++r) { total[r] = _mm256_setzero_ps(); corr[r] = 0.f; }
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * BLOCK));
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * BLOCK + 16));
      const __m256i w0 = SIGNED ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
      const __m256i w1 = SIGNED ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
      for (int r = 0; r < R; ++r) {
        const int16_t* xb = xq + (r * nb + b) * BLOCK;
        const __m256i p = _mm256_add_epi32(
            _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
            _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[r * nb + b]), acc[r]);
      }
    }
    const __m256 sg = _mm256_set1_ps(s[g]);
    for (int r = 0; r < R; ++r) {
      total[r] = _mm256_fmadd_ps(acc[r], sg, total[r]);
      if constexpr (HAS_ZP) corr[r] += s[g] * z[g] * xs[r * G + g];
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = fsum8(total[r]) - corr[r];
}

template <typename Q, bool SIGNED, bool HAS_ZP>
bool run(const float* x, int64_t M, int64_t N, int64_t K, int64_t group, const uint8_t* w, const float* s,
         const float* z, float* y) {
  const int64_t G = K / group, nb = K / BLOCK;
  constexpr bool four = std::is_same<Q, int8_t>::value;
  std::vector<Q> xq(M * K);
  std::vector<float> d(M * nb), xs(M * G);
  std::vector<char> finite(M);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      finite[m] = quantize_row<Q>(x + m * K, K, group, four, xq.data() + m * K, d.data() + m * nb, xs.data() + m * G);
  });
  if (!std::all_of(finite.begin(), finite.end(), [](char f) { return f; })) return false;
  const int64_t row_bytes = four ? K / 2 : K;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wn = w + n * row_bytes;
      const float* sn = s + n * G;
      const float* zn = HAS_ZP ? z + n * G : nullptr;
      auto rows = [&](auto r_const, int64_t m) {
        constexpr int R = decltype(r_const)::value;
        if constexpr (four)
          w4_rows<R, SIGNED, HAS_ZP>(xq.data() + m * K, d.data() + m * nb, xs.data() + m * G, K, G, group, wn, sn,
                                     zn, y + m * N + n, N);
        else
          w8_rows<R, SIGNED, HAS_ZP>(xq.data() + m * K, d.data() + m * nb, xs.data() + m * G, K, G, group, wn, sn,
                                     zn, y + m * N + n, N);
      };
      int64_t m = 0;
      for (; m + MB <= M; m += MB) rows(std::integral_constant<int, MB>{}, m);
      for (; m < M; ++m) rows(std::integral_constant<int, 1>{}, m);
    }
  });
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

// x float32 [M, K]; codes int8/uint8 [N, K] or int32 [N, K/8] (4-bit); scale float32 [N, G];
// zero_point float32 [N, G] or none (signed codes).  Returns float32 [M, N] and whether x
// was finite (if not, y is left unwritten: the caller raises).
std::tuple<at::Tensor, bool> linear_a8_blocks(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group) {
  TORCH_CHECK(has_a8_blocks(), "lowbit._C.linear_a8_blocks needs AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && codes.is_contiguous() &&
                  scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "lowbit._C.linear_a8_blocks: contiguous float32 x [M, K] and scale expected");
  TORCH_CHECK(bits == 4 || bits == 8, "lowbit._C.linear_a8_blocks: bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(group > 0 && group % BLOCK == 0 && K % group == 0,
              "lowbit._C.linear_a8_blocks: the weight group must be a multiple of 32 that divides K");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) == K / group,
              "lowbit._C.linear_a8_blocks: scale must be [N, K / group]");
  if (zero_point)
    TORCH_CHECK(zero_point->scalar_type() == at::kFloat && zero_point->is_contiguous() &&
                    zero_point->sizes() == scale.sizes(),
                "lowbit._C.linear_a8_blocks: zero_point must be float32 of scale's shape");
  at::Tensor y = at::empty({M, N}, x.options());
  bool finite = true;
#ifdef LOWBIT_A8_BLOCKS
  const uint8_t* w = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* px = x.data_ptr<float>();
  const float* s = scale.data_ptr<float>();
  const float* z = zero_point ? zero_point->data_ptr<float>() : nullptr;
  float* py = y.data_ptr<float>();
  if (bits == 4)
    finite = z ? run<int8_t, false, true>(px, M, N, K, group, w, s, z, py)
               : run<int8_t, true, false>(px, M, N, K, group, w, s, z, py);
  else
    finite = z ? run<int16_t, false, true>(px, M, N, K, group, w, s, z, py)
               : run<int16_t, true, false>(px, M, N, K, group, w, s, z, py);
#endif
  return {y, finite};
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
