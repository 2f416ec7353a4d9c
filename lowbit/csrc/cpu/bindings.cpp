// Python bindings of lowbit._C; the kernels live in dequant.cpp, matmul.cpp, gemv_bf16.cpp and gemm_bf16.cpp,
// the one-call decode step of lowbit.runtime in decode.cpp.
#include <torch/extension.h>

at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& zero_point,
                      int64_t bits, bool is_signed, int64_t K, int64_t group, int64_t rows_per_scale,
                      at::ScalarType out_dtype);
at::Tensor dequantize_rowcol(const at::Tensor& acc, const at::Tensor& row, const at::Tensor& col,
                             at::ScalarType out_dtype);
bool has_avx512();
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> quantize_per_token(const at::Tensor& x, int64_t bits,
                                                                        bool symmetric);
at::Tensor weight_only_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group);
bool gemv_bf16_supported(int64_t K, int64_t group);
at::Tensor weight_only_gemv_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& zero_point, int64_t group, bool split);
bool gemm_bf16_supported(int64_t K, int64_t group);
at::Tensor weight_only_gemm_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group);
at::Tensor weight_only_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                              int64_t gemv_max_m, int64_t split_max_m);
at::Tensor w4a8_gemm(const at::Tensor& x_q, const at::Tensor& x_zp, const at::Tensor& codes,
                     const at::Tensor& w_scale, const c10::optional<at::Tensor>& w_zp, int64_t group);

void bind_decode(pybind11::module& m);  // decode.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode(m);
  m.def("dequantize", &dequantize, "unpack-and-dequantize rows of codes");
  m.def("dequantize_rowcol", &dequantize_rowcol, "int32 accumulators * row scale * column scale");
  m.def("quantize_per_token", &quantize_per_token, "per-row dynamic quantization, bit-exact with the reference");
  m.def("has_avx512", &has_avx512, "whether the AVX-512 (VNNI) kernels were compiled in");
  m.def("weight_only_gemv", &weight_only_gemv, "x @ dequantize(W).T for small M, W read packed");
  m.def("gemv_bf16_supported", &gemv_bf16_supported, "whether weight_only_gemv_bf16 handles K and group");
  m.def("weight_only_gemv_bf16", &weight_only_gemv_bf16, "W4A16 for small M with vdpbf16ps");
  m.def("gemm_bf16_supported", &gemm_bf16_supported, "whether weight_only_gemm_bf16 handles K and group");
  m.def("weight_only_gemm_bf16", &weight_only_gemm_bf16, "W4A16/W8A16 for larger M: bf16 panels, vdpbf16ps");
  m.def("weight_only_matmul", &weight_only_matmul, "weight-only matmul, kernel chosen by M; None if none fits");
  m.def("w4a8_gemm", &w4a8_gemm, "int8 x u4 per-group integer dot products, float scale per group");
}
