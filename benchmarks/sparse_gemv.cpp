// Experimental 2:4 sparse int4 GEMV (M = 1) for benchmarks/sparse.py, AVX2 + FMA.
//
// Reads lowbit.sparse's format as it is: kept values as u32x8-packed 4-bit codes [N, K/2]
// (byte t: first kept value of 4-group t in the low nibble, second in the high one),
// scale / zero point float32 [N, K/2 / group] (group: kept values per scale), and 2-bit
// positions packed 4 per byte [N, K/8] (nibble t of a little-endian uint32: 4-group t,
// first position in bits 0-1, second in bits 2-3).
//
// x is split once per call into 4 planes, plane c holding x[4t + c]; then for 8 4-groups
// at a time the x value of each kept weight is picked out of the 4 planes with 2 blends
// on the position bits (moved to the sign bit), no gather.  Per 32 dense columns: 8 bytes
// of codes, 4 bytes of positions, 4 plane loads, 4 variable shifts, 4 blends, 2 FMAs.  Sums are float32 per
// scale group, then scaled, as lowbit's dense gemv_f32 kernel does.
#include <immintrin.h>
#include <cstring>
#include <torch/extension.h>

#include <ATen/Parallel.h>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x planes [4][K/4]; one row of codes (K/4 bytes), positions (K/8 bytes), scale/zp [G].
template <bool SIGNED>
float row(const float* xp, int64_t K, int64_t G, int64_t group, const uint8_t* codes, const uint8_t* pos,
          const float* s, const float* z) {
  const int64_t Q = K / 4;  // 4-groups per row = plane length
  // lane t shifts bit b of nibble t (bit 4t + b of the word) up to bit 31
  const __m256i top = _mm256_setr_epi32(31, 27, 23, 19, 15, 11, 7, 3);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i sh[4] = {top, _mm256_sub_epi32(top, one), _mm256_sub_epi32(top, _mm256_add_epi32(one, one)),
                         _mm256_sub_epi32(top, _mm256_set1_epi32(3))};
  const __m256i low4 = _mm256_set1_epi32(0xF);
  const int64_t chunks = group / 16;  // 16 kept values (8 4-groups) per chunk
  __m256 total = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 dot = _mm256_setzero_ps();
    const __m256i zg = _mm256_set1_epi32(SIGNED ? 0 : static_cast<int32_t>(z[g]));
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t t = (g * chunks + c) * 8;  // first 4-group of the chunk
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + t)));
      __m256i first, second;
      if constexpr (SIGNED) {
        first = _mm256_srai_epi32(_mm256_slli_epi32(v, 28), 28);
        second = _mm256_srai_epi32(_mm256_slli_epi32(v, 24), 28);
      } else {
        first = _mm256_sub_epi32(_mm256_and_si256(v, low4), zg);
        second = _mm256_sub_epi32(_mm256_srli_epi32(v, 4), zg);
      }
      // Bit b of 4-group t's nibble moved to the sign bit of lane t (what blendv reads).
      uint32_t p;
      std::memcpy(&p, pos + t / 2, 4);
      const __m256i all = _mm256_set1_epi32(static_cast<int32_t>(p));
      auto bit = [&](int b) { return _mm256_castsi256_ps(_mm256_sllv_epi32(all, sh[b])); };
      const __m256 p0 = _mm256_loadu_ps(xp + t), p1 = _mm256_loadu_ps(xp + Q + t);
      const __m256 p2 = _mm256_loadu_ps(xp + 2 * Q + t), p3 = _mm256_loadu_ps(xp + 3 * Q + t);
      // first position in {0, 1, 2}, second in {1, 2, 3} (Sparse24QTensor checks that they
      // increase): two blends each
      const __m256 x_first = _mm256_blendv_ps(_mm256_blendv_ps(p0, p1, bit(0)), p2, bit(1));
      const __m256 x_second = _mm256_blendv_ps(p1, _mm256_blendv_ps(p2, p3, bit(2)), bit(3));
      dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), x_first, dot);
      dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), x_second, dot);
    }
    total = _mm256_fmadd_ps(dot, _mm256_set1_ps(s[g]), total);
  }
  return hsum(total);
}

}  // namespace

// x float32 [K]; codes int32 [N, K/16]; scale float32 [N, G]; zero_point float32 [N, G] or
// undefined (signed codes); positions uint8 [N, K/8].  Returns float32 [N].
torch::Tensor sparse24_gemv_w4(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& zero_point, const torch::Tensor& positions,
                               int64_t group) {
  const int64_t K = x.numel(), N = codes.size(0), G = (K / 2) / group;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && codes.is_contiguous() &&
                  scale.scalar_type() == at::kFloat && scale.is_contiguous() && positions.is_contiguous(),
              "sparse24_gemv_w4: contiguous float32 x and scale expected");
  TORCH_CHECK(group % 16 == 0 && (K / 2) % group == 0, "sparse24_gemv_w4: group must be a multiple of 16");
  TORCH_CHECK(codes.size(1) * 16 == K && positions.size(1) * 8 == K && scale.size(1) == G,
              "sparse24_gemv_w4: shapes do not match K");
  const torch::Tensor xp = x.view({K / 4, 4}).t().contiguous();  // the 4 planes
  torch::Tensor y = torch::empty({N}, x.options());
  const float* px = xp.data_ptr<float>();
  const uint8_t* pc = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const uint8_t* pp = positions.data_ptr<uint8_t>();
  const float* ps = scale.data_ptr<float>();
  const float* pz = zero_point.has_value() ? zero_point->data_ptr<float>() : nullptr;
  float* py = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* c = pc + n * (K / 4);
      const uint8_t* p = pp + n * (K / 8);
      py[n] = pz ? row<false>(px, K, G, group, c, p, ps + n * G, pz + n * G)
                 : row<true>(px, K, G, group, c, p, ps + n * G, nullptr);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse24_gemv_w4", &sparse24_gemv_w4, "2:4 sparse int4 GEMV (AVX2)");
}
