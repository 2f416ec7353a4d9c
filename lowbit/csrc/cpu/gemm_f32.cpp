// y = x @ w.T in float32 for many rows of x (prefill): AVX2 + FMA register tiles of 6 rows
// of x by 16 columns of y (12 accumulators, two weight vectors, one broadcast: 15 of the
// 16 ymm registers), the BLIS layout for 8-lane FMAs.  The weight-only recipes' prefill
// (kernels/cpu `_tiles`) ran MKL's sgemm on their dequantized weight: on Zen 2 (AVX2, 2
// threads) 512 x 576 @ 576 x 1536 took it 6.1 ms, these tiles ~4.8 ms.  For a quantized
// weight (weight_only_gemm_f32) each panel of 16 rows is dequantized as it is reached,
// into a buffer of the thread, so no float copy of the weight is written and read back.
//
//   x is packed once per call into tiles of 6 rows, k-major ([k][6], rows past M zero);
//   each thread takes panels of 16 weight rows and, KC values of k at a time, lays the
//   panel's chunk out k-major ([k][16], rows past N zero: 64 bytes a step, L1-sized), then
//   runs every tile of x against it.  Each output is the float32 sum of x[m, k] w[n, k] in
//   the order of k, one FMA a term, chunk by chunk: the partial sum of each chunk is added
//   to the previous chunks' (|error| <= gamma_K sum_k |x w|, tests/test_matmul.py).

#include "kernels.h"
#include "simd.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

#if defined(__AVX2__) && defined(__FMA__)
#define LOWBIT_GEMM_F32 1
constexpr int64_t TM = 6;     // rows of x per register tile
constexpr int64_t TN = 16;    // columns of y per register tile (two vectors of 8)
constexpr int64_t KC = 512;   // values of k per packed weight chunk: 32 KiB
// x's packed tiles stay allocated per calling thread up to this size (the Python side's
// scratch limit); a larger x gets a buffer for its call only
constexpr int64_t kKeepBytes = int64_t(64) << 20;

// Tile t of x packed: xp[k * TM + i] = x[t * TM + i, k] (0 past M).
void pack_x(const float* x, int64_t M, int64_t K, float* xp) {
  const int64_t tiles = (M + TM - 1) / TM;
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* out = xp + t * K * TM;
      for (int64_t i = 0; i < TM; ++i) {
        const int64_t m = t * TM + i;
        if (m < M)
          for (int64_t k = 0; k < K; ++k) out[k * TM + i] = x[m * K + k];
        else
          for (int64_t k = 0; k < K; ++k) out[k * TM + i] = 0.f;
      }
    }
  });
}

// wp[k * TN + j] = w[j, k0 + k] for k < kc (0 for j >= cols; w: the panel's first row, rows K
// apart): 8 x 8 dword transposes of the panel's rows where the chunk has 8 of them, a plain
// loop for the rest.
void pack_w(const float* w, int64_t K, int cols, int64_t k0, int64_t kc, float* wp) {
  int64_t k = 0;
  if (cols == TN)
    for (; k + 8 <= kc; k += 8)
      for (int64_t half = 0; half < 2; ++half) {
        __m256i r[8];  // 8 rows x 8 values of k, transposed as dwords (simd.h)
        for (int j = 0; j < 8; ++j) r[j] = _mm256_castps_si256(_mm256_loadu_ps(w + (half * 8 + j) * K + k0 + k));
        transpose8(r);  // r[i]: w[half * 8 .. + 7, k0 + k + i]
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(wp + (k + i) * TN + half * 8, _mm256_castsi256_ps(r[i]));
      }
  for (; k < kc; ++k)
    for (int j = 0; j < TN; ++j) wp[k * TN + j] = j < cols ? w[j * K + k0 + k] : 0.f;
}

// y[R rows, cols] (+)= one tile of x (xp, k-major, TM apart) times one packed chunk (wp), kc
// steps.  R < TM for the last tile of x: its FMAs only (a batch of 32 rows in 6-row tiles
// would pay for 36; a 2-row tile costs about a third of a full one, as its loads bound it).
template <int R>
void tile(const float* xp, const float* wp, int64_t kc, float* y, int64_t ldy, int cols, bool add) {
  __m256 c[R][2];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_loadu_ps(wp + k * TN), w1 = _mm256_loadu_ps(wp + k * TN + 8);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 a = _mm256_broadcast_ss(xp + k * TM + i);
      c[i][0] = _mm256_fmadd_ps(a, w0, c[i][0]);
      c[i][1] = _mm256_fmadd_ps(a, w1, c[i][1]);
    }
  }
  // (every loop over the accumulators has a constant count, fully unrolled: one indexed at
  // run time would keep them in memory, which made the whole loop 2x slower)
  if (cols == TN) {
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      float* yi = y + i * ldy;
      if (add) {
        c[i][0] = _mm256_add_ps(_mm256_loadu_ps(yi), c[i][0]);
        c[i][1] = _mm256_add_ps(_mm256_loadu_ps(yi + 8), c[i][1]);
      }
      _mm256_storeu_ps(yi, c[i][0]);
      _mm256_storeu_ps(yi + 8, c[i][1]);
    }
    return;
  }
  alignas(32) float buf[R][TN];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    _mm256_store_ps(buf[i], c[i][0]);
    _mm256_store_ps(buf[i] + 8, c[i][1]);
  }
  for (int64_t i = 0; i < R; ++i)
    for (int j = 0; j < cols; ++j) y[i * ldy + j] = add ? y[i * ldy + j] + buf[i][j] : buf[i][j];
}

using TileFn = void (*)(const float*, const float*, int64_t, float*, int64_t, int, bool);
constexpr TileFn kTiles[TM] = {tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// y = x @ W.T where rows(n0, cols) gives rows n0 .. n0 + cols - 1 of W as float32, K apart
// (valid until the next call on the same thread).
template <typename Rows>
void gemm_rows(const float* x, int64_t M, int64_t K, int64_t N, float* y, Rows rows) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    std::fill(y, y + M * N, 0.f);
    return;
  }
  thread_local std::vector<float> xp_keep;
  std::vector<float> xp_call;
  const int64_t tiles = (M + TM - 1) / TM, packed = tiles * TM * K;
  float* xp = packed * 4 <= kKeepBytes ? grown(xp_keep, packed) : (xp_call.resize(packed), xp_call.data());
  pack_x(x, M, K, xp);
  const int64_t panels = (N + TN - 1) / TN;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> wp_keep;
    float* wp = grown(wp_keep, KC * TN);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * TN;
      const int cols = static_cast<int>(std::min(TN, N - n0));
      const float* w = rows(n0, cols);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        pack_w(w, K, cols, k0, kc, wp);
        for (int64_t t = 0; t < tiles; ++t)
          kTiles[std::min(TM, M - t * TM) - 1](xp + t * K * TM + k0 * TM, wp, kc, y + t * TM * N + n0, N, cols,
                                               k0 > 0);
      }
    }
  });
}
#endif

}  // namespace

bool has_gemm_f32() {
#ifdef LOWBIT_GEMM_F32
  return true;
#else
  return false;
#endif
}

void gemm_f32_into(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
#ifdef LOWBIT_GEMM_F32
  gemm_rows(x, M, K, N, y, [&](int64_t n0, int) { return w + n0 * K; });
#else
  TORCH_CHECK(false, "lowbit._C.gemm_f32 needs AVX2 and FMA");
#endif
}

at::Tensor gemm_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(has_gemm_f32(), "lowbit._C.gemm_f32 needs AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  x.size(1) == w.size(1) && x.device().is_cpu() && w.device().is_cpu(),
              "lowbit._C.gemm_f32: float32 x [M, K] and w [N, K] on the CPU expected, got ", x.sizes(), " ",
              x.scalar_type(), " and ", w.sizes(), " ", w.scalar_type());
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  gemm_f32_into(xc.data_ptr<float>(), x.size(0), x.size(1), wc.data_ptr<float>(), w.size(0), y.data_ptr<float>());
  return y;
}

at::Tensor weight_only_gemm_f32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const c10::optional<at::Tensor>& zero_point, int64_t bits, bool is_signed,
                                int64_t group, bool zero_point_min) {
  const char* who = "lowbit._C.weight_only_gemm_f32";
  TORCH_CHECK(has_gemm_f32(), who, " needs AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), who,
              ": float32 x [M, K] on the CPU expected, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(codes.device().is_cpu() && scale.device().is_cpu() && (!zero_point || zero_point->device().is_cpu()),
              who, ": codes, scale and zero_point must be on the CPU");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(bits == 4 || bits == 8, who, ": bits must be 4 or 8");
  // values per code word (4-bit: 8 in int32, 2 in uint8); a group holds whole words
  const int64_t per_word = bits == 4 ? codes.element_size() * 2 : 1;
  TORCH_CHECK(group > 0 && K % group == 0 && group % per_word == 0, who, ": the group (", group,
              ") must divide K (", K, ") and be a multiple of ", per_word);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.size(1) * codes.element_size() * 8 == K * bits &&
                  (bits == 8 ? codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte
                             : codes.scalar_type() == at::kInt || codes.scalar_type() == at::kByte),
              who, ": contiguous codes of ", bits, "-bit values [N, K] (int8/uint8, or 4-bit int32/uint8 words) "
              "expected, got ", codes.sizes(), " ", codes.scalar_type());
  const int64_t N = codes.size(0), G = K / group;
  const auto fits = [&](const at::Tensor& t) {  // [N, G] (or [N] for one group)
    return t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == N * G && t.dim() >= 1 &&
           t.dim() <= 2 && t.size(0) == N;
  };
  TORCH_CHECK(fits(scale), who, ": scale must be contiguous float32 [N, K / group] = [", N, ", ", G, "]");
  TORCH_CHECK(!zero_point || fits(*zero_point), who, ": zero_point must be contiguous float32 [N, K / group]");
  TORCH_CHECK(!zero_point_min || zero_point, who, ": the \"min\" domain needs its zero_point (m)");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef LOWBIT_GEMM_F32
  gemm_rows(xc.data_ptr<float>(), M, K, N, y.data_ptr<float>(), [&](int64_t n0, int cols) {
    thread_local std::vector<float> rows_keep;  // this thread's panel of W in float32
    float* w = grown(rows_keep, TN * K);
    dequantize_rows_f32(codes, scale, zero_point, bits, is_signed, zero_point_min, K, group, n0, cols, w);
    return static_cast<const float*>(w);
  });
#endif
  return y;
}
