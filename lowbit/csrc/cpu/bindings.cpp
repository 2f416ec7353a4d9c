// Python bindings of lowbit._C; the kernels live in dequant.cpp, matmul.cpp, gemv_bf16.cpp, gemv_amx.cpp,
// gemm_bf16.cpp, gemm_int8.cpp, gemv_a8.cpp, gemm_a8.cpp, gemm_i16.cpp, gemm_a8_vnni.cpp, gemm_amx.cpp, dense.cpp, gptq.cpp and ggml.cpp, the one-call decode step of lowbit.runtime in decode.cpp.
#include "kernels.h"

// The instruction-set extensions this build was compiled for (-march=native at install).
static std::vector<std::string> compiled_features() {
  std::vector<std::string> f;
#ifdef __AVX2__
  f.push_back("avx2");
#endif
#ifdef __FMA__
  f.push_back("fma");
#endif
#ifdef __F16C__
  f.push_back("f16c");
#endif
#ifdef __AVX512F__
  f.push_back("avx512f");
#endif
#ifdef __AVX512BW__
  f.push_back("avx512bw");
#endif
#ifdef __AVX512VL__
  f.push_back("avx512vl");
#endif
#ifdef __AVX512VNNI__
  f.push_back("avx512_vnni");
#endif
#ifdef __AVX512BF16__
  f.push_back("avx512_bf16");
#endif
#ifdef __AVXVNNI__
  f.push_back("avx_vnni");
#endif
#ifdef __AMX_TILE__
  f.push_back("amx_tile");
#endif
  return f;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode(m);
  m.def("compiled_features", &compiled_features, "the x86 extensions this build was compiled for");
  m.def("dequantize", &dequantize, "unpack-and-dequantize rows of codes");
  m.def("dequantize_into", &dequantize_into, "dequantize into a caller's contiguous buffer [R, K] (its dtype)");
  m.def("dequantize_min", &dequantize_min, "unpack-and-dequantize rows of codes in the 'min' zero-point domain");
  m.def("dequantize_min_into", &dequantize_min_into, "dequantize_min into a caller's contiguous buffer [R, K]");
  m.def("dequantize_rowcol", &dequantize_rowcol, "int32 accumulators * row scale * column scale");
  m.def("quantize_per_token", &quantize_per_token, "per-row dynamic quantization, bit-exact with the reference");
  m.def("has_avx512", &has_avx512, "whether the AVX-512 (VNNI) kernels were compiled in");
  m.def("has_gemv_f32", &has_gemv_f32, "whether the float32-FMA decode kernels (AVX-512 or AVX2) were compiled in");
  m.def("has_w4a8_rows", &has_w4a8_rows, "whether the W4A8 integer rows kernels (AVX-512 VNNI or AVX2) were compiled in");
  m.def("packed_scales", &packed_scales,
        "scale and zero point as the packed kernels read them: both float16 where that is exact, else float32");
  m.def("has_a8_blocks", &has_a8_blocks, "whether linear_a8_blocks (AVX2 integer dot products) was compiled in");
  m.def("linear_a8_blocks", &linear_a8_blocks,
        "weight-only weights x activations quantized to int8 in blocks of 32, integer dot products per block");
  m.def("linear_a8_blocks_many", &linear_a8_blocks_many,
        "linear_a8_blocks of one x with several weights of one kind: x quantized once, one parallel region");
  m.def("gemm_a8_blocks", &gemm_a8_blocks,
        "linear_a8_blocks for many rows and 4-bit codes: panels of unpacked codes, vpmaddubsw register tiles");
  m.def("gemm_a8_blocks_many", &gemm_a8_blocks_many,
        "gemm_a8_blocks of one x with several weights of one kind: x quantized once, one parallel region");
  m.def("gemm_a8_blocks8", &gemm_a8_blocks8,
        "linear_a8_blocks for many rows and 8-bit codes: int16 panels of the codes, vpmaddwd register tiles");
  m.def("gemm_a8_blocks8_many", &gemm_a8_blocks8_many,
        "gemm_a8_blocks8 of one x with several weights of one kind: x quantized once, one parallel region");
  m.def("has_a8_vnni", &has_a8_vnni, "whether gemm_a8_blocks_vnni (AVX-512 VNNI register tiles) was compiled in");
  m.def("a8_vnni_row_supported", &a8_vnni_row_supported,
        "whether gemv_a8_vnni.cpp's one-row kernel (int8 blocks x 4-bit codes, vpdpbusd) was compiled in");
  m.def("gemm_a8_blocks_vnni", &gemm_a8_blocks_vnni,
        "gemm_a8_blocks / gemm_a8_blocks8 on AVX-512 VNNI register tiles (vpdpbusd per block), the same bits");
  m.def("gemm_a8_blocks_vnni_many", &gemm_a8_blocks_vnni_many,
        "gemm_a8_blocks_vnni of one x with several weights of one kind: x quantized once, one parallel region");
  m.def("has_amx_int8", &has_amx_int8, "whether AMX int8 tiles run here (compiled in, CPUID, kernel permission)");
  m.def("gemm_a8_blocks_amx", &gemm_a8_blocks_amx,
        "gemm_a8_blocks / gemm_a8_blocks8 on AMX int8 tiles (tdpbsud / tdpbssd per block), the same bits");
  m.def("has_amx_bf16", &has_amx_bf16, "whether AMX bf16 tiles run here (compiled in, CPUID, kernel permission)");
  m.def("weight_only_gemm_bf16_amx", &weight_only_gemm_bf16_amx,
        "weight_only_gemm_bf16 on AMX bf16 tiles (tdpbf16ps), each block of 32 weight rows dequantized once");
  m.def("weight_only_gemm_f32_amx", &weight_only_gemm_f32_amx,
        "float32 x @ W.T, a 4/8-bit weight with integer zero points or q * s + m (zero_point_min), exact products "
        "(x in three bf16 parts, AMX)");
  m.def("w4a8_gemm_amx", &w4a8_gemm_amx, "w4a8_gemm_panels on AMX int8 tiles (tdpbssd on u - z, a group per C tile), the same bits");
  m.def("int8_mm_amx", &int8_mm_amx, "exact int32 a @ b.T of int8 matrices on AMX tiles (tdpbssd), K a multiple of 64");
  m.def("dense_amx", &dense_amx, "a bf16 nn.Linear on AMX bf16 tiles (tdpbf16ps), the weight read as stored");
  m.def("int8_linear_amx", &int8_linear_amx,
        "W8A8: int8_linear's contract and bits on AMX int8 tiles (tdpbssd), K a multiple of 64");
  m.def("int8_mm_panels", &int8_mm_panels, "exact int32 a @ b.T of int8 matrices: int16 panels, vpmaddwd (AVX2)");
  m.def("fake_quantize_a8_blocks", &fake_quantize_a8_blocks, "x quantized to int8 in blocks of 32 and dequantized");
  m.def("has_dense_dots", &has_dense_dots, "whether dense_dots (AVX512-BF16 vdpbf16ps tiles) was compiled in");
  m.def("dense_dots", &dense_dots,
        "a bf16 nn.Linear on vdpbf16ps register tiles, the weight read as stored, each row summed in one order");
  m.def("has_dense_rows", &has_dense_rows, "whether dense_rows (float32 FMAs on float32 or bf16 values, AVX2 or AVX-512) was compiled in");
  m.def("dense_rows", &dense_rows,
        "x [M, K] @ weight [N, K].T (+ bias), float32 or bfloat16, for a few rows, each row summed in one order whatever M");
  m.def("gemv_bf16_supported", &gemv_bf16_supported, "whether weight_only_gemv_bf16 handles K and group");
  m.def("gemv_bf16_amx_supported", &gemv_bf16_amx_supported,
        "whether weight_only_gemv_bf16_amx runs here (AMX bf16) for K and group");
  m.def("gemm_bf16_supported", &gemm_bf16_supported, "whether weight_only_gemm_bf16 handles K and group");
  m.def("bf16_dot_cost", &bf16_dot_cost,
        "ns per 512-bit FMA and per vdpbf16ps on this core, [fma, dot] (empty without AVX512-BF16)");
  m.def("weight_only_kernels", &weight_only_kernels, "the names of weight_only_matmul's kernels, by index");
  m.def("weight_only_matmul", &weight_only_matmul, "weight-only matmul with the kernel the plan chose (an index)");
  m.def("split_matmul", &split_matmul,
        "mixed int8/int4 weight: the low part's decode kernel, the int8 outlier columns added in float32");
  m.def("has_gemm_f32", &has_gemm_f32, "whether gemm_f32 (AVX2 + FMA register tiles) was compiled in");
  m.def("gemm_f32", &gemm_f32, "float32 x [M, K] @ w [N, K].T for many rows: 6 x 16 register tiles, k in order");
  m.def("weight_only_gemm_f32", &weight_only_gemm_f32,
        "x [M, K] @ W.T for a 4/8-bit weight: gemm_f32 on panels of W dequantized as it goes");
  m.def("int8_gemm_supported", &int8_gemm_supported, "whether int8_linear handles K");
  m.def("int8_linear_rows16", &int8_linear_rows16,
        "whether int8_linear takes M rows with the weight as stored (a batch step's 16-48), not packed panels");
  m.def("int8_linear", &int8_linear, "W8A8: int8 GEMM (vpdpbusd) with the dequantize_accumulator epilogue fused");
  m.def("has_int8_rows", &has_int8_rows, "whether int8_mm_rows (AVX2 vpmaddwd) was compiled in");
  m.def("int8_mm_rows", &int8_mm_rows, "int8 a [M, K] @ int8 b [N, K].T, exact int32, for a few rows without VNNI");
  m.def("w4a8_gemm", &w4a8_gemm, "int8 x u4 per-group integer dot products, float scale per group");
  m.def("gptq_columns", &gptq_columns, "GPTQ's column loop in one block, bit-exact with algorithms.gptq._columns");
  m.def("ggml_dequantize", &ggml_dequantize, "ggml block types (GGUF data) to float32, bit-exact with formats.ggml");
  m.def("w4a8_gemm_panels", &w4a8_gemm_panels, "w4a8_gemm for many rows: gemm_int8.cpp's panels and tiles");
  m.def("has_w4a8_panels", &has_w4a8_panels,
        "whether w4a8_gemm_panels runs on gemm_int8.cpp's VNNI panels (then a decode step or prefill runs q/k/v and "
        "gate/up through them in one call each); else gemm_a8.cpp's AVX2 panels, a projection at a time");
}
