// Many rows of int8-block activations (a8_blocks.h) times 4- or 8-bit codes on AVX-512 VNNI
// without AMX (Zen 4, Ice Lake and later Xeons without tiles), for prefills and large
// batches: the arithmetic of gemm_a8.cpp and gemm_i16.cpp bit for bit, as gemm_amx.cpp's.
//
//   y[m, n] = sum_b (d[m, b] * s[n, g(b)]) * dot_b[m, n]  -  sum_g sz[n, g] * xs[m, g]
//
// dot_b is block b's exact integer dot product of the activation codes and the weight codes
// (4-bit: u = q + 8 for signed codes, the zero-point term then 8 s; else the codes as
// stored, the term s z, or -m in the "min" domain).  vpdpbusd multiplies unsigned bytes by
// signed ones, so signed 8-bit codes enter as u = q + 128 and each block's sum starts from
// -128 * (the block's sum of activation codes): the exact dot of q, as gemm_i16.cpp's int16
// products give it.  Per 4 values of K one vpdpbusd multiplies a broadcast dword of one
// row's codes with 16 columns' 4 codes and adds 64 products to 16 int32 lanes (against 32
// products in two vpmaddubsw and two vpaddw of gemm_a8.cpp's AVX2 tile, or 16 in one
// vpmaddwd of gemm_i16.cpp's); the panels are gemm_amx.cpp's B tiles (half_panel[k / 4]
// [column][4], a8::pack_half_panels).  Each block's sums enter float32 as the AVX2 kernels'
// do, lane for lane: one conversion, one product d * s and one FMA per block, in block
// order; the zero-point term once per row and column, in group order.

#include "a8_blocks.h"
#include "kernels.h"
#include "panels.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(LOWBIT_A8_BLOCKS) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LOWBIT_A8_VNNI 1
#endif

namespace {

#ifdef LOWBIT_A8_VNNI
using a8::BLOCK;
constexpr int NV = 2;         // half panels of 16 columns per panel
constexpr int COLS = 16 * NV;  // weight rows per panel
constexpr int ROWS = 6;        // activation rows per register tile: 2 * ROWS * NV accumulators

// How a weight's codes enter the integers and its zero-point term the floats.
struct Kind {
  bool flip8;    // signed 8-bit codes as u = q + 128: block sums start at -128 * sum(codes of x)
  bool term;     // a zero-point term (all but signed 8-bit codes)
  float zscale;  // its factor: 8 for signed 4-bit codes (u = q + 8), else 1
};

// R rows of activations (codes xq [R][K], block scales d [R][nb], group sums xs [R][G], and
// with flip8 the blocks' 128 * sums of codes xc [R][nb]) x one panel (NV half panels of K x
// 16 codes; scales sp and zero-point factors sz [g][COLS]); writes y[r * ldy + c], c < cols.
template <int R, bool FLIP8>
void tile(const int8_t* xq, const float* d, const float* xs, const int32_t* xc, int64_t K, int64_t G,
          int64_t per_group, const uint8_t* panel, const float* sp, const float* sz, float zscale, float* y,
          int64_t ldy, int cols) {
  const int64_t nb = K / BLOCK;
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0, g = 0, left = per_group; b < nb; ++b) {  // block b of group g
    __m512i dot[R][NV];
    for (int r = 0; r < R; ++r) {
      const __m512i start = FLIP8 ? _mm512_set1_epi32(-xc[r * nb + b]) : _mm512_setzero_si512();
      for (int v = 0; v < NV; ++v) dot[r][v] = start;
    }
    const uint8_t* pb = panel + b * BLOCK * 16;
    const int8_t* xb = xq + b * BLOCK;
#pragma GCC unroll 8
    for (int q = 0; q < BLOCK / 4; ++q) {
      __m512i w[NV];
      for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_si512(pb + v * K * 16 + q * 64);
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, xb + r * K + 4 * q, 4);
        const __m512i a = _mm512_set1_epi32(word);
        for (int v = 0; v < NV; ++v) dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], w[v], a);
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m512 s = _mm512_loadu_ps(sp + g * COLS + 16 * v);
      for (int r = 0; r < R; ++r)
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][v]), _mm512_mul_ps(_mm512_set1_ps(d[r * nb + b]), s),
                                    acc[r][v]);
    }
    if (--left == 0) {
      ++g;
      left = per_group;
    }
  }
  for (int v = 0; v < NV && 16 * v < cols; ++v) {  // the zero-point sums, R chains at once
    __m512 z[R];
    for (int r = 0; r < R; ++r) z[r] = _mm512_setzero_ps();
    if (sz) {
      for (int64_t gi = 0; gi < G; ++gi) {
        const __m512 f = _mm512_loadu_ps(sz + gi * COLS + 16 * v);
        for (int r = 0; r < R; ++r) z[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(xs[r * G + gi]), z[r]);
      }
      if (zscale != 1.f)
        for (int r = 0; r < R; ++r) z[r] = _mm512_mul_ps(z[r], _mm512_set1_ps(zscale));
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << std::min(16, cols - 16 * v)) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, keep, _mm512_sub_ps(acc[r][v], z[r]));
  }
}

// x [M, K] quantized once, then every weight (all of one kind) in panels of COLS rows,
// panels and row ranges split between threads as the other panel GEMMs (each_panel).
// False (nothing written) if x held NaN or Inf.
bool run(const float* x, int64_t M, int64_t K, int64_t group, int bits, const std::vector<PackedWeight>& weights) {
  const int64_t G = K / group, nb = K / BLOCK, per_group = group / BLOCK;
  const a8::Rows<int8_t> x8(x, M, K, group);
  if (!x8.finite) return false;
  const Kind kind{bits == 8 && !weights[0].z, bits == 4 || weights[0].z != nullptr,
                  bits == 4 && !weights[0].z ? 8.f : 1.f};
  std::vector<int32_t> xc;
  if (kind.flip8) {  // 128 * each block's sum of codes (at most 128 * 32 * 128 = 2^19)
    xc.resize(M * nb);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t i = m0 * nb; i < m1 * nb; ++i) {
        int32_t t = 0;
        for (int64_t k = 0; k < BLOCK; ++k) t += x8.q[i * BLOCK + k];
        xc[i] = 128 * t;
      }
    });
  }
  std::vector<int64_t> Ns;
  for (const PackedWeight& wt : weights) Ns.push_back(wt.N);
  struct Scratch {
    PanelBuffer panel;
    std::vector<float> sp, sz;
  };
  each_panel<COLS, ROWS>(
      Ns, M, [&] { return Scratch{PanelBuffer(K * COLS / 4), std::vector<float>(G * COLS), std::vector<float>(G * COLS)}; },
      [&](size_t j, int64_t n0, Scratch& t) {
        const PackedWeight& wt = weights[j];
        a8::pack_half_panels(wt, K, bits, n0, NV, reinterpret_cast<uint8_t*>(t.panel.data), kind.flip8);
        pack_groups<COLS>(wt.N, G, n0, t.sp.data(), [&](int64_t n, int64_t g) { return wt.scale(n * G + g); });
        pack_groups<COLS>(wt.N, G, n0, t.sz.data(), [&](int64_t n, int64_t g) { return a8::zero_factor(wt, n * G + g); });
      },
      [&](auto r, size_t j, int64_t m, int64_t n0, int cols, const Scratch& t) {
        constexpr int R = decltype(r)::value;
        const PackedWeight& wt = weights[j];
        const uint8_t* panel = reinterpret_cast<const uint8_t*>(t.panel.data);
        const float* sz = kind.term ? t.sz.data() : nullptr;
        float* y = wt.y + m * wt.N + n0;
        if (kind.flip8)
          tile<R, true>(x8.q.data() + m * K, x8.d.data() + m * nb, x8.xs.data() + m * G, xc.data() + m * nb, K, G,
                        per_group, panel, t.sp.data(), sz, kind.zscale, y, wt.N, cols);
        else
          tile<R, false>(x8.q.data() + m * K, x8.d.data() + m * nb, x8.xs.data() + m * G, nullptr, K, G, per_group,
                         panel, t.sp.data(), sz, kind.zscale, y, wt.N, cols);
      });
  return true;
}
#endif

}  // namespace

bool has_a8_vnni() {
#ifdef LOWBIT_A8_VNNI
  return true;
#else
  return false;
#endif
}

// x float32 [M, K]; for each weight, codes int32 [N, K/8] (4-bit) or int8 / uint8 [N, K]
// (8-bit), scale float32 or float16 [N, G] (packed_scales), zero_point of scale's dtype or
// none (signed codes): all the same group and kind.  Returns float32 [M, N] per weight and
// whether x was finite (if not, nothing is written: the caller raises).  The bits of
// gemm_a8_blocks_many (4-bit) and gemm_a8_blocks8_many (8-bit).
std::tuple<std::vector<at::Tensor>, bool> gemm_a8_blocks_vnni_many(
    const at::Tensor& x, const std::vector<at::Tensor>& codes, const std::vector<at::Tensor>& scales,
    const std::vector<c10::optional<at::Tensor>>& zero_points, int64_t bits, int64_t group, bool zero_point_min) {
  TORCH_CHECK(has_a8_vnni(), "lowbit._C.gemm_a8_blocks_vnni needs AVX-512 (BW) with VNNI");
  TORCH_CHECK(bits == 4 || bits == 8, "lowbit._C.gemm_a8_blocks_vnni: bits must be 4 or 8");
  a8::check_x("lowbit._C.gemm_a8_blocks_vnni", x, group);
  std::vector<at::Tensor> ys;
  const std::vector<PackedWeight> weights = packed_weights("lowbit._C.gemm_a8_blocks_vnni", x, codes, scales,
                                                           zero_points, bits, group, ys, zero_point_min);
  bool finite = true;
#ifdef LOWBIT_A8_VNNI
  if (x.size(0) > 0)
    finite = run(x.data_ptr<float>(), x.size(0), x.size(1), group, static_cast<int>(bits), weights);
#endif
  return {ys, finite};
}

std::tuple<at::Tensor, bool> gemm_a8_blocks_vnni(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                                 const c10::optional<at::Tensor>& zero_point, int64_t bits,
                                                 int64_t group, bool zero_point_min) {
  auto [ys, finite] = gemm_a8_blocks_vnni_many(x, {codes}, {scale}, {zero_point}, bits, group, zero_point_min);
  return {ys[0], finite};
}
