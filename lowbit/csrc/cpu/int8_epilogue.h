// W8A8's epilogue (lowbit::int8_linear's composed path, dequantize_accumulator_rowcol),
// shared by the kernels that fuse it into their store (gemm_int8.cpp's VNNI panels,
// amx_linear.cpp's AMX tiles) so both give its bits:
//
//   y[m, n] = round((float32(acc[m, n] - a_zp[m] * colsum[n]) * row[m]) * col[n])
//             (+ bias[n], the bias already rounded to y's dtype, rounded again)
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include "simd.h"

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace int8_epilogue {

struct RowCol {
  const float* row;     // [M]
  const int32_t* a_zp;  // [M] or null
  const float* col;     // [N]
  const float* bias;    // [N] (rounded to the output dtype) or null
  at::ScalarType out;
  void* y;              // [M, N] of `out`
  int64_t N;
};

// Round 16 floats to T's grid and back (T: float, bf16 or f16), as .to(T) rounds.
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits16(v)), 16));
  else if constexpr (std::is_same_v<T, c10::Half>)
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  else return v;
}

template <typename T>
inline void store(T* out, __mmask16 mask, __m512 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    _mm256_mask_storeu_epi16(out, mask, bf16_bits16(v));
  else if constexpr (std::is_same_v<T, c10::Half>)
    _mm256_mask_storeu_epi16(out, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  else _mm512_mask_storeu_ps(out, mask, v);
}

// y[m, n .. n + 15] (the lanes of `mask`) from their int32 sums `acc` and colsum[n ..].
template <typename T>
inline void rowcol16(const RowCol& e, __m512i acc, __m512i colsum, int64_t m, int64_t n, __mmask16 mask) {
  if (e.a_zp) acc = _mm512_sub_epi32(acc, _mm512_mullo_epi32(_mm512_set1_epi32(e.a_zp[m]), colsum));
  __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(e.row[m])),
                           _mm512_maskz_loadu_ps(mask, e.col + n));
  // an add with its own rounding: a plain _mm512_add_ps is GCC's vector +, which it may fuse
  // with the multiply above into one FMA (-ffp-contract=fast, the default) where inlined
  if (e.bias)
    f = _mm512_add_round_ps(round_to<T>(f), _mm512_maskz_loadu_ps(mask, e.bias + n),
                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  store<T>(static_cast<T*>(e.y) + m * e.N + n, mask, f);
}

}  // namespace int8_epilogue
#endif
