// A float nn.Linear for the few rows of a decode step: y = x @ weight.T (+ bias), float32
// or bfloat16.
//
// ATen's at::linear for one row (MKL's sgemv) streams a float32 weight at 12-14 GB/s on a
// 2-thread Zen 2, where a plain read reaches ~30 GB/s; the bundled model's float lm_head
// (49152 x 576, 113 MB) alone then costs 8 ms per token.  Here the weight is read once per
// call, one row after another, front to back: each row is multiplied with every row of x
// (in L1) before the next row starts.  Reading several rows side by side instead (8 rows,
// 16 values of each in turn, as this file did before) is 8 interleaved streams 1 KiB
// apart, which the Zen 4 prefetcher does not follow: the bf16 head streamed at 12-14 GB/s
// there against 29-33 GB/s one row at a time (a plain read: 26-37 GB/s).
//
// Each output y[m, n] is summed in one fixed order, whatever M is: two accumulators of 8
// lanes (AVX2) or 16 (AVX-512) take the blocks of `lanes` columns alternately (block b
// into accumulator b % 2, each in order), the two are added, their lanes reduced, the
// K % lanes tail columns added one by one, and the bias last.  So a batch's rows get the
// bits each row gets alone (the runtime relies on it: a sequence decodes the same tokens
// in a batch as alone).  Two accumulators, not one: one row's FMAs are then two chains,
// not one (in-cache weights, 1536 x 576 bf16: 1.3-1.5x one chain).
//
// A bfloat16 linear is the same float32 arithmetic on the bf16 values, widened exactly (a
// bf16 is the high half of a float32): the products of two bf16 are exact in float32, the
// sums are float32 as above, and the result is rounded to bf16 once, after the bias.  That
// is what oneDNN's bf16 GEMM computes too, up to the order of the sums; for one row it
// reads the weight at ~7 GB/s here (bf16 SmolLM2 decode step, AMX Xeon), far below a
// plain read.
#include "balance.h"
#include "dots.h"
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
inline F fadd(F a, F b) { return _mm512_add_ps(a, b); }
inline float fsum(F a) { return _mm512_reduce_add_ps(a); }
inline F fload(const uint16_t* p) { return bf16x16(p); }  // 16 bf16 widened to float32 (exact)
#define LOWBIT_DENSE 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using F = __m256;
inline F fzero() { return _mm256_setzero_ps(); }
inline F fload(const float* p) { return _mm256_loadu_ps(p); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F fadd(F a, F b) { return _mm256_add_ps(a, b); }
inline float fsum(F a) { return fsum8(a); }
inline F fload(const uint16_t* p) {  // 8 bf16 widened to float32 (<< 16: exact)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#define LOWBIT_DENSE 1
#endif

#ifdef LOWBIT_DENSE
inline float value(float w) { return w; }
inline float value(uint16_t w) { return bf16_value(w); }

// MR rows of x (row stride K) times one weight row w (float32 or bf16 bits):
// y[i * ldy] = sum_k x[i, k] * w[k] in the order the header gives, whatever MR is.
template <int MR, typename W>
inline void dot_rows(const float* x, const W* w, int64_t K, float* y, int64_t ldy) {
  F acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = fzero();
  int64_t k = 0;
  for (; k + 2 * kLanes <= K; k += 2 * kLanes)
    for (int h = 0; h < 2; ++h) {
      const F wv = fload(w + k + h * kLanes);
      for (int i = 0; i < MR; ++i) acc[i][h] = fmadd(wv, fload(x + i * K + k + h * kLanes), acc[i][h]);
    }
  if (k + kLanes <= K) {  // an odd block: accumulator 0's turn
    const F wv = fload(w + k);
    for (int i = 0; i < MR; ++i) acc[i][0] = fmadd(wv, fload(x + i * K + k), acc[i][0]);
    k += kLanes;
  }
  for (int i = 0; i < MR; ++i) {
    float t = fsum(fadd(acc[i][0], acc[i][1]));
    for (int64_t j = k; j < K; ++j) t += x[i * K + j] * value(w[j]);
    y[i * ldy] = t;
  }
}

// Weight rows in chunks of 8 shared between the threads; each row read once, against x's
// rows four at a time (eight accumulators), then the rest.
template <typename W>
void linear_rows(const float* px, const W* pw, const float* pb, float* py, int64_t M, int64_t K, int64_t N) {
  parallel_chunks(0, N, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const W* w = pw + n * K;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) dot_rows<4>(px + m * K, w, K, py + m * N + n, N);
      for (; m + 2 <= M; m += 2) dot_rows<2>(px + m * K, w, K, py + m * N + n, N);
      if (m < M) dot_rows<1>(px + m * K, w, K, py + m * N + n, N);
      if (pb)
        for (int64_t i = 0; i < M; ++i) py[i * N + n] += pb[n];
    }
  });
}
#endif

#ifdef LOWBIT_DOTS
#define LOWBIT_DENSE_DOTS 1
// y [M, N] float32 = x [M, K] . w [N, K]^T: weight rows four at a time (in chunks of 16
// shared between the threads), each group against all of x's rows (dot_all_rows).
void dots(const uint16_t* x, int64_t ldx, const uint16_t* pw, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t lines = 4 * K * 2 / 64;  // of a group of rows
  parallel_chunks(0, (N + 3) / 4, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = 4 * g;
      const uint16_t* w[4];
      for (int r = 0; r < 4; ++r) w[r] = pw + std::min(n + r, N - 1) * K;  // rows past N: never stored
      const bool pf = n + 4 * kDotsAhead + 4 <= N;
      dot_all_rows(x, ldx, M, w, K, y + n, N, static_cast<int>(std::min<int64_t>(4, N - n)),
                   reinterpret_cast<const char*>(pw + (n + 4 * kDotsAhead) * K), pf ? lines : 0);
    }
  });
}
#endif

}  // namespace

bool has_dense_dots() {
#ifdef LOWBIT_DENSE_DOTS
  return true;
#else
  return false;
#endif
}

// x [M, K] @ weight [N, K].T (+ bias [N]), all bfloat16, K a multiple of 32: the float32 sum
// of the bf16 products (vdpbf16ps, see dots) plus the bias, rounded to bf16 once.
at::Tensor dense_dots(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_dense_dots(), "lowbit._C.dense_dots needs AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "lowbit._C.dense_dots: x must be a bfloat16 CPU tensor [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(1) == x.size(1) && x.size(1) % 32 == 0,
              "lowbit._C.dense_dots: weight must be a bfloat16 CPU tensor [N, K] with x's K, a multiple of 32, got ",
              weight.scalar_type(), " ", weight.sizes(), " for x ", x.sizes());
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == weight.size(0)),
              "lowbit._C.dense_dots: bias must be bfloat16 [", weight.size(0), "]");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous(), wc = weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options().dtype(at::kFloat));
#ifdef LOWBIT_DENSE_DOTS
  if (M > 0)
    dots(reinterpret_cast<const uint16_t*>(xc.data_ptr()), xc.stride(0),
         reinterpret_cast<const uint16_t*>(wc.data_ptr()), M, K, N, y.data_ptr<float>());
#endif
  if (bias) y += bias->to(at::kFloat);
  return y.to(at::kBFloat16);
}

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
