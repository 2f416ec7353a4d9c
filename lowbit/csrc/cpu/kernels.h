// The entry points of lowbit's CPU kernels, declared once: bindings.cpp exposes them to
// Python, matmul.cpp and decode.cpp call them from C++.
#pragma once
#include <torch/extension.h>

#include "balance.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

// dequant.cpp
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& zero_point,
                      int64_t bits, bool is_signed, int64_t K, int64_t group, int64_t rows_per_scale,
                      at::ScalarType out_dtype);
void dequantize_into(at::Tensor& out, const at::Tensor& codes, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& zero_point, int64_t bits, bool is_signed, int64_t K,
                     int64_t group, int64_t rows_per_scale);
at::Tensor dequantize_min(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mn, int64_t bits,
                          int64_t K, int64_t group, int64_t rows_per_scale, at::ScalarType out_dtype);
void dequantize_min_into(at::Tensor& out, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mn,
                         int64_t bits, int64_t K, int64_t group, int64_t rows_per_scale);
// Rows r0 .. r0 + R - 1 of a 4/8-bit weight as float32 into out [R, K] (float32 scale and zero
// point, rows_per_scale 1; `min`: the "min" domain), the values dequantize_into gives them.
void dequantize_rows_f32(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& zero_point,
                         int64_t bits, bool is_signed, bool min, int64_t K, int64_t group, int64_t r0, int64_t R,
                         float* out);
at::Tensor dequantize_rowcol(const at::Tensor& acc, const at::Tensor& row, const at::Tensor& col,
                             at::ScalarType out_dtype);
// out[m, n] = acc[m, n] * row[m] * col[n] in out_dtype (float32, bf16 or f16): dequantize_rowcol
// without tensors.
void dequantize_rowcol_into(const int32_t* acc, const float* row, const float* col, void* out,
                            at::ScalarType out_dtype, int64_t M, int64_t N);
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> quantize_per_token(const at::Tensor& x, int64_t bits,
                                                                        bool symmetric);
// quantize_per_token of one row x [D] (float32, bf16 or f16: dtype) without tensors: codes
// int8 (symmetric) or uint8 into q, the scale (in x's dtype, then float32) and the zero point;
// whether x was finite.
bool quantize_token_into(const void* x, at::ScalarType dtype, int64_t D, int64_t bits, bool symmetric, void* q,
                         float* scale, int32_t* zp);
// matmul.cpp
// t as contiguous float32, without an op when it already is (a no-op .to() still costs a dispatch).
at::Tensor as_float(const at::Tensor& t);
// One packed weight of a call over several weights of one kind (weight_only_gemv_many,
// linear_a8_blocks_many): codes [N, row bytes], scales and zero points [N, G], and its
// float32 output y [M, N]; min: z holds the "min" domain's m (W = q * s + m, unsigned
// codes), not a zero point ((q - z) * s).  Scales and zero points are float32, or float16
// where `half` (packed_scales: an f16 scheme's own storage, which a decode step then reads
// at 2 bytes a group instead of 4; converted to float32 exactly, so the same results).
struct PackedWeight {
  const uint8_t* w;
  const void* s;
  const void* z;
  int64_t N;
  float* y;
  bool min = false;
  bool half = false;
  float scale(int64_t i) const { return value(s, i); }
  float zero(int64_t i) const { return value(z, i); }

 private:
  float value(const void* p, int64_t i) const {
    return half ? static_cast<float>(static_cast<const c10::Half*>(p)[i]) : static_cast<const float*>(p)[i];
  }
};
// f(weight, n0, n1) for rows n0 .. n1 - 1 of every weight, all weights' rows numbered in one
// range and shared between the threads in chunks of `chunk` rows (as each_item shares
// items): one parallel region for q/k/v or gate/up of a decode step.  With `setup`, a
// per-thread state: state = setup() once per thread, then f(state, weight, n0, n1).
template <typename Setup, typename F>
void parallel_weight_rows(const std::vector<PackedWeight>& weights, int64_t chunk, Setup setup, const F& f) {
  thread_local std::vector<int64_t> first_keep;  // no malloc per call (see grown)
  first_keep.assign(weights.size() + 1, 0);
  const int64_t* first = first_keep.data();
  for (size_t i = 0; i < weights.size(); ++i) first_keep[i + 1] = first[i] + weights[i].N;
  const int64_t total = first[weights.size()];
  if (total <= 0) return;
  each_item((total + chunk - 1) / chunk, setup, [&](auto& state, int64_t c) {
    const int64_t r0 = c * chunk, r1 = std::min(total, r0 + chunk);
    size_t i = 0;
    for (int64_t r = r0; r < r1;) {
      while (r >= first[i + 1]) ++i;
      const int64_t n0 = r - first[i], n1 = std::min(r1, first[i + 1]) - first[i];
      f(state, weights[i], n0, n1);
      r += n1 - n0;
    }
  });
}
template <typename F>
void parallel_weight_rows(const std::vector<PackedWeight>& weights, int64_t chunk, const F& f) {
  parallel_weight_rows(weights, chunk, [] { return 0; },
                       [&](int, const PackedWeight& wt, int64_t n0, int64_t n1) { f(wt, n0, n1); });
}
// n values of scratch memory in v, which keeps it between calls: a function's buffers as
// `thread_local std::vector<T>`, one per calling thread.  A decode step calls its kernels
// ~120 times a token, and a malloc there cost about a microsecond each (glibc, 2 threads).
template <typename T>
T* grown(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}
// f(s, z) with the weight's scales and zero points as typed pointers: const uint16_t*
// (float16 bits, for simd.h's scale1/scale2/scale8) where wt.half, else const float*.
template <typename F>
void with_scales(const PackedWeight& wt, F&& f) {
  if (wt.half)
    f(static_cast<const uint16_t*>(wt.s), static_cast<const uint16_t*>(wt.z));
  else
    f(static_cast<const float*>(wt.s), static_cast<const float*>(wt.z));
}
// Scale and zero point as the packed kernels take them: both float16 where the scale is
// float16 and the zero point, if any, float16 or 8-bit integer (exact in float16), else
// both float32; contiguous.
std::tuple<at::Tensor, c10::optional<at::Tensor>> packed_scales(const at::Tensor& scale,
                                                                const c10::optional<at::Tensor>& zero_point);
// Checks each weight against x [M, K] (codes [N, K] bytes or [N, K/8] int32 words, scale
// float32 or float16 [N, K / group], zero points of scale's shape and dtype on all or none;
// errors start with `who`), allocates ys (float32 [M, N] each) and returns the weights' pointers.
std::vector<PackedWeight> packed_weights(const char* who, const at::Tensor& x, const std::vector<at::Tensor>& codes,
                                         const std::vector<at::Tensor>& scales,
                                         const std::vector<c10::optional<at::Tensor>>& zero_points, int64_t bits,
                                         int64_t group, std::vector<at::Tensor>& ys, bool zero_point_min = false);
bool has_avx512();
bool has_gemv_f32();
// weight_only_gemv_many's kernel on weights packed_weights took (y set by the caller): x
// float32 [M, K] contiguous; the same kind of weight (bits, group, zero points or not) in all.
void gemv_f32_into(const float* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                   const std::vector<PackedWeight>& weights);
bool has_w4a8_rows();
// zero_point_min: the weights are q * s + zero_point (the "min" domain), else (q - zero_point) * s.
at::Tensor weight_only_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                            bool zero_point_min);
std::vector<at::Tensor> weight_only_gemv_many(const at::Tensor& x, const std::vector<at::Tensor>& codes,
                                              const std::vector<at::Tensor>& scales,
                                              const std::vector<c10::optional<at::Tensor>>& zero_points,
                                              int64_t bits, int64_t group, bool zero_point_min);
// The kernels weight_only_matmul runs, in the order of weight_only_kernels() (their names,
// which lowbit.kernels.cpu's plan returns).
enum class WeightOnlyKernel : int64_t {
  kGemvF32 = 0, kGemvBf16 = 1, kGemvBf16Split = 2, kGemmBf16 = 3, kGemmBf16Amx = 4, kGemmF32Amx = 5,
  kGemvBf16Amx = 6, kGemmFma = 7, kGemmF32Fma = 8
};
std::vector<std::string> weight_only_kernels();
at::Tensor weight_only_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                              int64_t kernel, bool zero_point_min);
at::Tensor split_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group, int64_t kernel,
                        const at::Tensor& outliers, const at::Tensor& high_codes, const at::Tensor& high_scale,
                        const c10::optional<at::Tensor>& high_zero_point, int64_t high_group);
// x_zp of x_q [M, K] as the W4A8 kernels take it (int32 [M]) and small enough that their
// int32 zero-point terms are exact; errors name `who`.
void check_w4a8_zero_points(const char* who, const at::Tensor& x_q, const at::Tensor& x_zp, int64_t group);
// One row of the W4A8 kernels' activation term: xg[g] = sum_{k in g} x[k] - |g| xz for each
// of the K / group groups (exact in int32 where check_w4a8_zero_points passed).
void w4a8_group_sums(const int8_t* x, int32_t xz, int64_t K, int64_t group, int32_t* xg);
at::Tensor w4a8_gemm(const at::Tensor& x_q, const at::Tensor& x_zp, const at::Tensor& codes,
                     const at::Tensor& w_scale, const c10::optional<at::Tensor>& w_zp, int64_t group);
// w4a8_gemm without tensors, its inputs checked by the caller: y float32 [M, N].
void w4a8_gemm_into(const int8_t* x_q, const int32_t* x_zp, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                    const float* w_scale, const int32_t* w_zp, int64_t group, float* y);
// w4a8_gemm_into for several weights of one x (a decode step's q/k/v or gate/up): x laid out
// once, one parallel region over all their rows.  Each weight's w: u32x8 codes [N, K / 8] as
// bytes, s: float32 scales [N, G], z: int32 zero points [N, G] or null, y: float32 [M, N].
void w4a8_gemm_many_into(const int8_t* x_q, const int32_t* x_zp, int64_t M, int64_t K, int64_t group,
                         const std::vector<PackedWeight>& weights);
// gemv_a8.cpp
bool has_a8_blocks();
// zero_point_min (here and in gemm_a8_blocks*): W = q * s + zero_point, the "min" domain.
std::tuple<at::Tensor, bool> linear_a8_blocks(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                              const c10::optional<at::Tensor>& zero_point, int64_t bits,
                                              int64_t group, bool zero_point_min);
std::tuple<std::vector<at::Tensor>, bool> linear_a8_blocks_many(const at::Tensor& x,
                                                                const std::vector<at::Tensor>& codes,
                                                                const std::vector<at::Tensor>& scales,
                                                                const std::vector<c10::optional<at::Tensor>>& zero_points,
                                                                int64_t bits, int64_t group, bool zero_point_min);
std::tuple<at::Tensor, bool> fake_quantize_a8_blocks(const at::Tensor& x);
// linear_a8_blocks_many's kernel on weights packed_weights took (y set by the caller), as
// gemv_f32_into; false (nothing written) if x held NaN or Inf.
bool a8_blocks_into(const float* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                    const std::vector<PackedWeight>& weights);
// gemm_a8.cpp
std::tuple<std::vector<at::Tensor>, bool> gemm_a8_blocks_many(const at::Tensor& x, const std::vector<at::Tensor>& codes,
                                                              const std::vector<at::Tensor>& scales,
                                                              const std::vector<c10::optional<at::Tensor>>& zero_points,
                                                              int64_t group, bool zero_point_min);
std::tuple<at::Tensor, bool> gemm_a8_blocks(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                            const c10::optional<at::Tensor>& zero_point, int64_t group,
                                            bool zero_point_min);
at::Tensor w4a8_gemm_panels_avx2(const at::Tensor& x_q, const at::Tensor& x_zp, const at::Tensor& codes,
                                 const at::Tensor& w_scale, const c10::optional<at::Tensor>& w_zp, int64_t group);
// gemm_i16.cpp
at::Tensor int8_mm_panels(const at::Tensor& a, const at::Tensor& b);
std::tuple<std::vector<at::Tensor>, bool> gemm_a8_blocks8_many(const at::Tensor& x, const std::vector<at::Tensor>& codes,
                                                               const std::vector<at::Tensor>& scales,
                                                               const std::vector<c10::optional<at::Tensor>>& zero_points,
                                                               int64_t group, bool zero_point_min);
std::tuple<at::Tensor, bool> gemm_a8_blocks8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                             const c10::optional<at::Tensor>& zero_point, int64_t group,
                                             bool zero_point_min);
// decode.cpp: causal attention of t new tokens per sequence (AVX-512), and whether it was compiled in
bool has_prefill_attention();
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                             const at::Tensor& seqs, int64_t pos, double scale, bool bf16_dots = true);
// attend_amx.cpp: prefill_attention's products for bf16 caches on AMX bf16 tiles.
// Whether they run here for head size hd (AMX bf16 tiles usable, hd 32, 64, 96 or 128).
bool attend_tiles_run(int64_t hd);
// The calling thread's tile configuration for the calls below, and its release.
void attend_tiles_begin();
void attend_tiles_end();
// One row tile of a prefill_attention work item: 16 query rows (q bf16 [16][hd]) of one query
// head, row r over the first len[r] positions (0: a padding row), against its kv head's key
// panels kt and value pairs vt, positions < kpad (a multiple of 32 and >= every len):
// o [16][hd] = sum_j e_rj v_j, not yet divided by l[r] = sum_j e_rj, e = exp(s * scale -
// max); s: scratch [16][kpad].
void attend_row_tile(const c10::BFloat16* q, const uint32_t* kt, const uint32_t* vt, int64_t hd, int64_t kpad,
                     const int64_t* len, float scale, float* s, float* o, float* l);
// The first n rows of v (bf16 [n][hd]) as pairs vt[i][d] = v[2i][d] | v[2i + 1][d] << 16,
// zero pairs up to npad (even) positions.
void attend_value_pairs(const c10::BFloat16* v, int64_t n, int64_t npad, int64_t hd, uint32_t* vt);
// gemm_a8_vnni.cpp
bool has_a8_vnni();
std::tuple<std::vector<at::Tensor>, bool> gemm_a8_blocks_vnni_many(
    const at::Tensor& x, const std::vector<at::Tensor>& codes, const std::vector<at::Tensor>& scales,
    const std::vector<c10::optional<at::Tensor>>& zero_points, int64_t bits, int64_t group, bool zero_point_min);
std::tuple<at::Tensor, bool> gemm_a8_blocks_vnni(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                                 const c10::optional<at::Tensor>& zero_point, int64_t bits,
                                                 int64_t group, bool zero_point_min);
// gemm_amx.cpp
// Whether AMX int8 tiles run here: compiled in, in CPUID, and the kernel's permission granted.
bool has_amx_int8();
// Whether AMX bf16 tiles run here (amx_linear.cpp: dense_amx, weight_only_gemm_bf16_amx).
bool has_amx_bf16();
// x float32 or bf16; y in x's dtype (bf16: rounded once from the float32 outputs).
std::tuple<at::Tensor, bool> gemm_a8_blocks_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                                const c10::optional<at::Tensor>& zero_point, int64_t bits,
                                                int64_t group, bool zero_point_min);
// gemm_a8_blocks_amx's kernel on weights packed_weights took, all of one kind, in one parallel
// region (y set by the caller), as a8_blocks_into; false (nothing written) if x held NaN or Inf.
bool a8_blocks_amx_into(const float* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                        const std::vector<PackedWeight>& weights);
// The same for bf16 x (quantized as its float32 values) into bf16 ys[j] [M, N] (weight j's;
// each weight's y unused): each output rounded once to nearest even, as the float32 call's
// outputs converted with .to(bfloat16).
bool a8_blocks_amx_into(const c10::BFloat16* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                        const std::vector<PackedWeight>& weights, c10::BFloat16* const* ys);
// gemv_a8_vnni.cpp
// Whether the one-row AVX-512 VNNI kernel of int8 blocks x 4-bit codes is compiled in.
bool a8_vnni_row_supported();
// That kernel (gemm_a8.cpp's bits): x [K] (float32 or bf16) into ys[j] [N] (float32 or bf16),
// 4-bit codes.  False (nothing written) if x held NaN or Inf.
template <typename X, typename Y>
bool a8_blocks_vnni_row(const X* x, int64_t K, int64_t group, const std::vector<PackedWeight>& weights, Y* const* ys);
// w4a8_gemm_amx for several weights of one x (their panels in one parallel region), checked
// by the caller (zero points in 0..15, as w4a8_gemm_amx checks them): ys[j] [M, N_j] of
// weight j, each row times x_scale[m] (null: not scaled), rounded to Y (float or
// c10::BFloat16) as y * x_scale then .to() would.  Needs has_amx_int8().
template <typename Y>
void w4a8_amx_into(const int8_t* x_q, const int32_t* x_zp, const float* x_scale, int64_t M, int64_t K, int64_t group,
                   const std::vector<PackedWeight>& weights, Y* const* ys);
at::Tensor w4a8_gemm_amx(const at::Tensor& x_q, const at::Tensor& x_zp, const at::Tensor& codes,
                         const at::Tensor& w_scale, const c10::optional<at::Tensor>& w_zp, int64_t group);
// amx_linear.cpp
// Exact int32 a [M, K] @ b [N, K].T of int8 matrices on AMX tiles, K a multiple of 64.
at::Tensor int8_mm_amx(const at::Tensor& a, const at::Tensor& b);
// A bf16 nn.Linear (bf16 x [M, K], weight [N, K], K a multiple of 32, bias or none) on AMX
// bf16 tiles, float32 sums, one rounding to bf16.
at::Tensor dense_amx(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
// weight_only_gemm_bf16's contract (gemm_bf16.cpp) on AMX bf16 tiles, each block of 32 weight
// rows dequantized once (the same bf16 weight values, the same bits);
// y bf16 for bf16 x (the float32 sums rounded once), float32 otherwise.
at::Tensor weight_only_gemm_bf16_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                     const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                                     bool zero_point_min);
// float32 x @ W.T for a 4/8-bit weight with integer zero points (or the "min" domain's q * s + m,
// zero_point_min: the products of q exact, m times x's group sum added), every product exact
// (x in three bf16 parts on AMX bf16 tiles), y float32.
at::Tensor weight_only_gemm_f32_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                    const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                                    bool zero_point_min);
// int8_linear (gemm_int8.cpp) on AMX tiles: the same contract and bits, K a multiple of 64.
at::Tensor int8_linear_amx(const at::Tensor& a, const c10::optional<at::Tensor>& a_zero_point, const at::Tensor& b,
                           const at::Tensor& row_scale, const at::Tensor& col_scale,
                           const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype);
// dense.cpp
bool has_dense_rows();
bool has_dense_dots();
at::Tensor dense_dots(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor dense_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
// gemv_bf16.cpp
bool gemv_bf16_supported(int64_t K, int64_t group);
// weight_only_gemv_bf16 over several weights of one kind (4-bit, float32 scales and zero
// points on all or none, the "min" domain on all or none), y set by the caller: one
// preparation of x [M, K] float32 and one parallel region.
void gemv_bf16_into(const float* x, int64_t M, int64_t K, int64_t group, bool split,
                    const std::vector<PackedWeight>& weights);
at::Tensor weight_only_gemv_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& zero_point, int64_t group, bool split,
                                 bool zero_point_min);
// gemv_amx.cpp: gemv_bf16's arithmetic on AMX bf16 tiles for bf16 x (float32 x rounded to
// bf16), 16 rows of x per pass over the weights; gemv_bf16_amx_into as gemv_bf16_into.
bool gemv_bf16_amx_supported(int64_t K, int64_t group);
void gemv_bf16_amx_into(const float* x, int64_t M, int64_t K, int64_t group, const std::vector<PackedWeight>& weights);
at::Tensor weight_only_gemv_bf16_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                     const c10::optional<at::Tensor>& zero_point, int64_t group,
                                     bool zero_point_min);
// gemm_bf16.cpp
bool gemm_bf16_supported(int64_t K, int64_t group);
at::Tensor weight_only_gemm_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                                 bool zero_point_min = false);
at::Tensor weight_only_gemm_fma(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                                bool zero_point_min);
// Float32 x at matmul precision "highest": the panels and FMAs of weight_only_gemm_fma on x as
// it is and the reference's float32 weight (never rounded to bf16); float32 y.
at::Tensor weight_only_gemm_f32_fma(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                    const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                                    bool zero_point_min);
// One weight of a weight_only_panels_into call: codes (4-bit: int32 [N, K / 8], 8-bit: [N, K]),
// scale and zero point float32 [N, K / group] (z null: signed codes; with zero_point_min the
// "min" domain's m), and its bf16 output y [M, N].
struct PanelWeight {
  const uint8_t* w;
  const float* s;
  const float* z;
  int64_t N;
  void* y;
};
// weight_only_gemm_bf16 (fma: weight_only_gemm_fma) for several weights of one bf16 input x
// [M, K] (q/k/v, gate/up) in one parallel region, x widened once: the same bits as one call
// each.  All weights of one kind: bits, group, zero points or none, the "min" domain or not.
void weight_only_panels_into(const c10::BFloat16* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                             bool zero_point, bool zero_point_min, bool fma, const std::vector<PanelWeight>& ws);
// weight_only_panels_into for float32 x on weight_only_gemm_f32_fma's panels (y float32).
void weight_only_panels_f32_into(const float* x, int64_t M, int64_t K, int64_t bits, int64_t group, bool zero_point,
                                 bool zero_point_min, const std::vector<PanelWeight>& ws);
std::vector<double> bf16_dot_cost();
// gemm_f32.cpp
bool has_gemm_f32();
// y float32 [M, N] = x [M, K] @ w [N, K].T, contiguous float32 (AVX2 + FMA register tiles).
void gemm_f32_into(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y);
at::Tensor gemm_f32(const at::Tensor& x, const at::Tensor& w);
// x [M, K] @ W.T for a 4/8-bit weight W (codes [N, ...], float32 scale and zero point [N, K / group]
// or none; `min`: the "min" domain): gemm_f32 on panels of 16 rows dequantized as it goes (the
// bits of gemm_f32(x, dequantize(W))), no float copy of W.
at::Tensor weight_only_gemm_f32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const c10::optional<at::Tensor>& zero_point, int64_t bits, bool is_signed,
                                int64_t group, bool zero_point_min);
// gemm_int8.cpp
bool int8_gemm_supported(int64_t K);
at::Tensor int8_linear(const at::Tensor& a, const c10::optional<at::Tensor>& a_zero_point, const at::Tensor& b,
                       const at::Tensor& row_scale, const at::Tensor& col_scale, const c10::optional<at::Tensor>& bias,
                       at::ScalarType out_dtype);
// One weight of an int8_linear_into call: int8 codes b [N, K], its column scales [N], the
// bias [N] rounded to the output dtype, as float32, or null, and y [M, N] of that dtype.
struct Int8Out {
  const int8_t* b;
  int64_t N;
  const float* col;
  const float* bias;
  void* y;
};
// int8_linear without tensors for several weights of one input (q/k/v, gate/up) in one
// parallel region: au = a + 128 as unsigned bytes [M, K], row scales [M], a_zp [M] or null.
void int8_linear_into(const uint8_t* au, int64_t M, int64_t K, const float* row, const int32_t* a_zp,
                      at::ScalarType out, const std::vector<Int8Out>& ws);
// int8_linear_into's contract on AMX tiles (int8_linear_amx's kernel), int8 a [M, K] as stored
// (not a + 128), K a multiple of 64.
void int8_linear_amx_into(const int8_t* a, int64_t M, int64_t K, const float* row, const int32_t* a_zp,
                          at::ScalarType out, const std::vector<Int8Out>& ws);
// One weight of a bf16_linear_amx_into call: bf16 rows [N, K] (bits 0), or 4-bit codes
// (int32 [N, K/8]) or 8-bit ones ([N, K]) with float32 scale and zero_point [N, K/group]
// (zero_point null: signed codes); bias float32 [N] or null (bf16 weights only: added to
// the float32 sums before their rounding, as dense_amx); y [M, N] of the call's dtype; min:
// zero_point holds the "min" domain's m (q * s + m, unsigned codes), the same on all weights
// of a call.
struct Bf16Out {
  const void* w;
  const float* scale;
  const float* zero_point;
  int64_t N;
  const float* bias;
  void* y;
  bool min = false;
};
// dense_amx (bits 0) or weight_only_gemm_bf16_amx (bits 4 or 8, `group`) for several weights of
// one bf16 input x [M, K] (q/k/v, gate/up) in one parallel region, the same bits as one call
// each: y bf16, or float32 (weight-only only).  All weights of one kind: bits, zero points
// or none.  K a multiple of 32.
void bf16_linear_amx_into(const c10::BFloat16* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                          at::ScalarType out, const std::vector<Bf16Out>& ws);
// Whether int8_linear_into runs M rows with the weight read as stored (gemm_int8.cpp's
// rows16_linear: a batch step's 16-48 rows), not its packed panels.
bool int8_linear_rows16(int64_t M);
bool has_int8_rows();
at::Tensor int8_mm_rows(const at::Tensor& a, const at::Tensor& b);
// int8_mm_rows without tensors: c int32 [M, N] = a [M, K] @ b [N, K].T, K below 2^17.
void int8_mm_rows_into(const int8_t* a, int64_t M, int64_t K, const int8_t* b, int64_t N, int32_t* c);
at::Tensor w4a8_gemm_panels(const at::Tensor& x_q, const at::Tensor& x_zp, const at::Tensor& codes,
                            const at::Tensor& w_scale, const c10::optional<at::Tensor>& w_zp, int64_t group);
// w4a8_gemm_panels for several weights of one x (their panels in one parallel region), as
// w4a8_amx_into takes them (the same bits as w4a8_gemm_panels, then * x_scale[m] and .to()).
// Needs has_w4a8_panels() (AVX-512 VNNI; without it w4a8_gemm_panels is gemm_a8.cpp's).
bool has_w4a8_panels();
template <typename Y>
void w4a8_panels_into(const int8_t* x_q, const int32_t* x_zp, const float* x_scale, int64_t M, int64_t K,
                      int64_t group, const std::vector<PackedWeight>& weights, Y* const* ys);
// gptq.cpp
void gptq_columns(at::Tensor& W, at::Tensor& Q, at::Tensor& E, const at::Tensor& U, int64_t a, int64_t b,
                  const at::Tensor& scale, const c10::optional<at::Tensor>& zero_point, double qmin, double qmax,
                  bool int_zero_point);
// ggml.cpp
at::Tensor ggml_dequantize(const at::Tensor& raw, const std::string& type);
// decode.cpp
void bind_decode(pybind11::module& m);
