// A float nn.Linear for the few rows of a decode step: y = x @ weight.T (+ bias), float32
// or bfloat16.
//
// ATen's at::linear for one row (MKL's sgemv) streams a float32 weight at 12-14 GB/s on a
// 2-thread Zen 2, where a plain read reaches ~30 GB/s; the bundled model's float lm_head
// (49152 x 576, 113 MB) alone then costs 8 ms per token.  Here every weight row is read
// once per call, eight rows at a time, and multiplied with every row of x while it is in L1.
//
// Each output y[m, n] is summed in one fixed order, whatever M is: one accumulator of 8
// lanes (AVX2) or 16 (AVX-512) takes the columns k = lane (mod lanes) in order, its lanes
// are reduced, the K % lanes tail columns are added one by one, and the bias last.  So a
// batch's rows get the bits each row gets alone (the runtime relies on it: a sequence
// decodes the same tokens in a batch as alone).
//
// A bfloat16 linear is the same float32 arithmetic on the bf16 values, widened exactly (a
// bf16 is the high half of a float32): the products of two bf16 are exact in float32, the
// sums are float32 as above, and the result is rounded to bf16 once, after the bias.  That
// is what oneDNN's bf16 GEMM computes too, up to the order of the sums; for one row it
// reads the weight at ~7 GB/s here (bf16 SmolLM2 decode step, AMX Xeon), far below a
// plain read.
#include "balance.h"
#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using F = __m512;
inline F fzero() { return _mm512_setzero_ps(); }
inline F fload(const float* p) { return _mm512_loadu_ps(p); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline float fsum(F a) { return _mm512_reduce_add_ps(a); }
inline F fload(const uint16_t* p) {  // 16 bf16 widened to float32 (<< 16: exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#define LOWBIT_DENSE 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using F = __m256;
inline F fzero() { return _mm256_setzero_ps(); }
inline F fload(const float* p) { return _mm256_loadu_ps(p); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline float fsum(F a) { return fsum8(a); }
inline F fload(const uint16_t* p) {  // 8 bf16 widened to float32 (<< 16: exact)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#define LOWBIT_DENSE 1
#endif

#ifdef LOWBIT_DENSE
inline float value(float w) { return w; }
inline float value(uint16_t w) { return bf16_value(w); }

// MR rows of x (row stride K) times R weight rows w (row stride K, float32 or bf16 bits):
// y[i * ldy + r] = sum_k x[i, k] * w[r, k], one accumulator per output, so every output
// is summed in the same order whatever MR and R are (MR * R accumulators in flight).
template <int MR, int R, typename W>
inline void dot_tile(const float* x, const W* w, int64_t K, float* y, int64_t ldy) {
  F acc[MR][R];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = fzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    F xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = fload(x + i * K + k);
    for (int r = 0; r < R; ++r) {
      const F wv = fload(w + r * K + k);
      for (int i = 0; i < MR; ++i) acc[i][r] = fmadd(wv, xv[i], acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) {
      float t = fsum(acc[i][r]);
      for (int64_t j = k; j < K; ++j) t += x[i * K + j] * value(w[r * K + j]);
      y[i * ldy + r] = t;
    }
}

// One x row against 8 weight rows, or 2 x rows against 4 (8 accumulators either way),
// the weight rows read once per call and kept in L1 across x's rows.  A bf16 weight's next
// 8 rows are fetched as these start (simd.h's prefetch_row); AMX Xeon, 2 threads, weights
// cycled through more than the L3, with against without: bf16 49152 x 576 M=1 1.12x, M=4
// 1.28x, 1536 x 576 1.25x; float32 M=4 1.06-1.08x but M=1 0.84-0.93x (18 KiB a block
// fetched at once), so float32 rows leave it to the hardware.
template <typename W>
void linear_rows(const float* px, const W* pw, const float* pb, float* py, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t R = 8;
  static_assert(R == kRowsAhead, "a block of R rows prefetches the next block");
  parallel_chunks(0, (N + R - 1) / R, 8, [&](int64_t b0, int64_t b1) {
    float out[2 * R];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * R, rows = std::min(R, N - n);
      const W* w = pw + n * K;
      if constexpr (sizeof(W) == 2)
        if (blk + 1 < b1) prefetch_row(w + R * K, std::min(R, N - n - R) * K * 2);
      int64_t m = 0;
      for (; m + 2 <= M && rows == R; m += 2) {
        dot_tile<2, 4>(px + m * K, w, K, out, R);
        dot_tile<2, 4>(px + m * K, w + 4 * K, K, out + 4, R);
        for (int64_t i = 0; i < 2; ++i)
          for (int64_t r = 0; r < R; ++r) py[(m + i) * N + n + r] = pb ? out[i * R + r] + pb[n + r] : out[i * R + r];
      }
      for (; m < M; ++m) {
        if (rows == R) {
          dot_tile<1, 8>(px + m * K, w, K, out, R);
        } else {
          for (int64_t r = 0; r < rows; ++r) dot_tile<1, 1>(px + m * K, w + r * K, K, out + r, R);
        }
        for (int64_t r = 0; r < rows; ++r) py[m * N + n + r] = pb ? out[r] + pb[n + r] : out[r];
      }
    }
  });
}
#endif

}  // namespace

bool has_dense_rows() {
#ifdef LOWBIT_DENSE
  return true;
#else
  return false;
#endif
}

// x [M, K] @ weight [N, K].T (+ bias [N]), all float32 or all bfloat16 (the result in that
// dtype: bf16 rounded once from the float32 sum plus the bias).
at::Tensor dense_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_dense_rows(), "lowbit._C.dense_rows needs AVX2 and FMA (or AVX-512)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lowbit._C.dense_rows: x must be a float32 or bfloat16 CPU tensor [M, K], got ", x.scalar_type(), " ",
              x.sizes());
  const auto dt = x.scalar_type();
  const char* name = dt == at::kFloat ? "float32" : "bfloat16";
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == dt && weight.size(1) == x.size(1),
              "lowbit._C.dense_rows: weight must be a ", name, " CPU tensor [N, ", x.size(1), "] (x's dtype), got ",
              weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(!bias || (bias->scalar_type() == dt && bias->dim() == 1 && bias->size(0) == weight.size(0)),
              "lowbit._C.dense_rows: bias must be ", name, " [", weight.size(0), "]");
  const at::Tensor xc = x.to(at::kFloat).contiguous(), wc = weight.contiguous();  // bf16 x widened: exact
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
#ifdef LOWBIT_DENSE
  const at::Tensor bc = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* pb = bias ? bc.data_ptr<float>() : nullptr;
  if (dt == at::kFloat)
    linear_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), pb, y.data_ptr<float>(), M, K, N);
  else
    linear_rows(xc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(wc.data_ptr()), pb, y.data_ptr<float>(), M, K, N);
#endif
  return dt == at::kFloat ? y : y.to(dt);
}
