// A float32 nn.Linear for the few rows of a decode step: y = x @ weight.T (+ bias).
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
#include "kernels.h"
#include "simd.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using F = __m512;
inline F fzero() { return _mm512_setzero_ps(); }
inline F fload(const float* p) { return _mm512_loadu_ps(p); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline float fsum(F a) { return _mm512_reduce_add_ps(a); }
#define LOWBIT_DENSE 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using F = __m256;
inline F fzero() { return _mm256_setzero_ps(); }
inline F fload(const float* p) { return _mm256_loadu_ps(p); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline float fsum(F a) { return fsum8(a); }
#define LOWBIT_DENSE 1
#endif

#ifdef LOWBIT_DENSE
// MR rows of x (row stride K) times R weight rows w (row stride K):
// y[i * ldy + r] = sum_k x[i, k] * w[r, k], one accumulator per output, so every output
// is summed in the same order whatever MR and R are (MR * R accumulators in flight).
template <int MR, int R>
inline void dot_tile(const float* x, const float* w, int64_t K, float* y, int64_t ldy) {
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
      for (int64_t j = k; j < K; ++j) t += x[i * K + j] * w[r * K + j];
      y[i * ldy + r] = t;
    }
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

at::Tensor dense_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_dense_rows(), "lowbit._C.dense_rows needs AVX2 and FMA (or AVX-512)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat,
              "lowbit._C.dense_rows: x must be a float32 CPU tensor [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kFloat &&
                  weight.size(1) == x.size(1),
              "lowbit._C.dense_rows: weight must be a float32 CPU tensor [N, ", x.size(1), "], got ",
              weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == weight.size(0)),
              "lowbit._C.dense_rows: bias must be float32 [", weight.size(0), "]");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
#ifdef LOWBIT_DENSE
  const float *px = xc.data_ptr<float>(), *pw = wc.data_ptr<float>();
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  const float* pb = bias ? bc.data_ptr<float>() : nullptr;
  float* py = y.data_ptr<float>();
  // One x row against 8 weight rows, or 2 x rows against 4 (8 accumulators either way),
  // the weight rows read once per call and kept in L1 across x's rows.
  constexpr int64_t R = 8;
  at::parallel_for(0, (N + R - 1) / R, 8, [&](int64_t b0, int64_t b1) {
    float out[2 * R];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * R, rows = std::min(R, N - n);
      const float* w = pw + n * K;
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
#endif
  return y;
}
