// GPTQ's column loop inside one block (lowbit/algorithms/gptq.py), the loop whose Python
// version spends ~90 us of torch-call overhead per column at the bundled model's sizes.
//
// W, Q, E: [B, N] float32 rows of one block of the transposed weight (row i is column
// i1 + i of W), U: the block's [B, B] float32 inverse-Hessian factor.  For columns
// i in [a, b):
//   q = (clamp(round(w / s) + z) - z) * s   (int zero point; float: round(w / s + z))
//   e = (w - q) / U[i, i];  W[r] -= U[i, r] * e  for r in (i, B)
// with exactly the float32 operations, in the order, of the Python loop (torch.div,
// round_ half to even, add_/clamp_/sub_/mul_, torch.sub, div_, a product then sub_: not
// addr_, whose scalar tail torch compiles with FMA contraction).  g++ contracts a * b + c
// into an FMA even at -std=c++17, so contraction is switched off for this file's
// functions (the pragma below): the two agree bit for bit.  Rows of W are independent,
// so threads split N.

#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#pragma GCC optimize("fp-contract=off")

void gptq_columns(at::Tensor& W, at::Tensor& Q, at::Tensor& E, const at::Tensor& U, int64_t a, int64_t b,
                  const at::Tensor& scale, const c10::optional<at::Tensor>& zero_point, double qmin, double qmax,
                  bool int_zero_point) {
  TORCH_CHECK(W.dim() == 2 && W.scalar_type() == at::kFloat && W.is_contiguous(), "W: contiguous float32 [B, N]");
  const int64_t B = W.size(0), N = W.size(1);
  TORCH_CHECK(Q.sizes() == W.sizes() && E.sizes() == W.sizes() && Q.scalar_type() == at::kFloat &&
                  E.scalar_type() == at::kFloat && Q.stride(1) == 1 && E.stride(1) == 1,
              "Q, E: float32 [B, N] with contiguous rows");
  TORCH_CHECK(U.dim() == 2 && U.size(0) == B && U.size(1) == B && U.scalar_type() == at::kFloat, "U: float32 [B, B]");
  TORCH_CHECK(0 <= a && a <= b && b <= B, "columns [a, b) must lie in [0, B)");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == b - a && scale.size(1) == N && scale.scalar_type() == at::kFloat &&
                  scale.stride(1) == 1,
              "scale: float32 [b - a, N] with contiguous rows");
  const float* zp = nullptr;
  int64_t zp_stride = 0;
  if (zero_point.has_value()) {
    const at::Tensor& z = *zero_point;
    TORCH_CHECK(z.sizes() == scale.sizes() && z.scalar_type() == at::kFloat && z.stride(1) == 1,
                "zero_point: float32 like scale");
    zp = z.data_ptr<float>();
    zp_stride = z.stride(0);
  }
  float* w = W.data_ptr<float>();
  float* q = Q.data_ptr<float>();
  float* e = E.data_ptr<float>();
  const float* u = U.data_ptr<float>();
  const float* sc = scale.data_ptr<float>();
  const int64_t q_stride = Q.stride(0), e_stride = E.stride(0), sc_stride = scale.stride(0);
  const int64_t u_row = U.stride(0), u_col = U.stride(1);  // any layout: the factor is column-major
  const float lo = static_cast<float>(qmin), hi = static_cast<float>(qmax);
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t i = a; i < b; ++i) {
      float* wi = w + i * N;
      float* qi = q + i * q_stride;
      float* ei = e + i * e_stride;
      const float* s = sc + (i - a) * sc_stride;
      const float* z = zp ? zp + (i - a) * zp_stride : nullptr;
      const float d = u[i * u_row + i * u_col];
      for (int64_t n = n0; n < n1; ++n) {
        float v = wi[n] / s[n];
        if (z == nullptr) {
          v = std::min(std::max(std::nearbyint(v), lo), hi);
        } else if (int_zero_point) {
          v = std::min(std::max(std::nearbyint(v) + z[n], lo), hi) - z[n];
        } else {
          v = std::min(std::max(std::nearbyint(v + z[n]), lo), hi) - z[n];
        }
        v = v * s[n];
        qi[n] = v;
        ei[n] = (wi[n] - v) / d;
      }
      for (int64_t r = i + 1; r < B; ++r) {
        const float ur = u[i * u_row + r * u_col];
        float* wr = w + r * N;
        for (int64_t n = n0; n < n1; ++n) wr[n] = wr[n] - ur * ei[n];
      }
    }
  });
}
