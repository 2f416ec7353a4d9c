// Many rows of int8 activations times weight codes on AMX tiles (Sapphire Rapids and later
// Xeons), for prefills and large batches: activations in int8 blocks of 32 (a8_blocks.h)
// times 4- or 8-bit codes, the arithmetic of gemm_a8.cpp and gemm_i16.cpp bit for bit
// (gemm_a8_blocks_amx); and W4A8, per-token activations times 4-bit codes in groups, the
// arithmetic of gemm_int8.cpp's w4a8_gemm_panels bit for bit (w4a8_gemm_amx, below).
//
//   y[m, n] = sum_b (d[m, b] * s[n, g(b)]) * dot_b[m, n]  -  sum_g sz[n, g] * xs[m, g]
//
// dot_b is block b's exact integer dot product of the activation codes and the weight codes
// u (4-bit: u = q + 8 for signed codes, sz = 8 s; else the codes as stored, sz = s z, or -m
// in the "min" domain; signed 8-bit codes as int8, no zero-point term).  One tdpbsud
// (int8 x uint8) or tdpbssd (int8 x int8) multiplies a 16 x 32 tile of activation codes
// (16 rows, one block) by an 8 x 64 tile of codes (16 weight rows, 4 consecutive k per
// dword: the panel layout panel[k / 4][column][4]) into 16 x 16 exact int32 sums, 8192
// multiply-adds per instruction against 64 for a 512-bit vpdpbusd.  Each block's sums
// leave the tiles (tilestored) and enter float32 as gemm_a8.cpp's do: one conversion, one
// product d * s and one FMA per block, in block order, so every lane runs the same IEEE
// operations in the same order as the AVX2 kernels' lanes.
//
// A tile of 16 activation rows x 16 weight rows keeps its float accumulators in registers
// while block b + 1's tile product runs beside block b's floats.  Tiles need the kernel's
// permission (arch_prctl ARCH_REQ_XCOMP_PERM), asked once by has_amx_int8().

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

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define LOWBIT_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#ifdef LOWBIT_AMX
using a8::BLOCK;
constexpr int TILE = 16;         // rows of an A or C tile, columns of a B or C tile
constexpr int COLS = 2 * TILE;   // weight rows per panel (two halves of 16)

// Two tile sets, one per block in flight: tmm0-1 C (16 x 16 int32), tmm4-5 A (16 rows x
// kstep int8), tmm6-7 B (kstep / 4 dword rows x 16 columns of 4 codes); kstep: values of K
// per tile product (32: one activation block; 64 where whole groups of a W4A8 weight allow).
void configure_tiles(int kstep) {
  const uint8_t b = static_cast<uint8_t>(kstep / 4);
  const uint16_t a = static_cast<uint16_t>(kstep);
  load_tile_config({TILE, TILE, 0, 0, TILE, TILE, b, b}, {TILE * 4, TILE * 4, 0, 0, a, a, TILE * 4, TILE * 4});
}

// A thread's tile configuration (released when its items are done), its panel, per-group
// values of the panel's columns and C tiles.
struct TileState {
  TileState(int kstep, int64_t panel_dwords, int64_t values, int64_t zp_values = 0, int64_t usum_values = 0)
      : panel(panel_dwords), sp(values), sz(values), zp(zp_values), usum(usum_values) {
    configure_tiles(kstep);
  }
  TileState(const TileState&) = delete;  // one per thread, made in place (its panel points into itself)
  ~TileState() { _tile_release(); }
  PanelBuffer panel;
  std::vector<float> sp, sz;
  std::vector<int32_t> zp, usum;
  alignas(64) int32_t c[2 * TILE * TILE];
};

// The AMX half of one block: tile C = tile A (16 activation rows, block b) x tile B (block b
// of one half panel), exact int32.  A macro: GCC's tile intrinsics take the tile numbers as
// tokens of their assembly.
#define LOWBIT_BLOCK_DOTS(C, A, B, b)                                \
  do {                                                               \
    _tile_zero(C);                                                   \
    _tile_loadd(A, xq + (b) * BLOCK, K);                             \
    _tile_loadd(B, half_panel + (b) * BLOCK * TILE, TILE * 4);       \
    if constexpr (SIGNED_B) _tile_dpbssd(C, A, B);                   \
    else _tile_dpbsud(C, A, B);                                      \
  } while (0)

// The float half of one block: acc[r] = fma(cvt(dot), d[r, b] * s, acc[r]) for 16 rows.
inline void block_floats(__m512 (&acc)[TILE], const int32_t* c, const float* d, int64_t nb, int64_t b, __m512 s) {
#pragma GCC unroll 16
  for (int r = 0; r < TILE; ++r)
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + r * TILE)),
                             _mm512_mul_ps(_mm512_set1_ps(d[r * nb + b]), s), acc[r]);
}

// 16 activation rows (codes xq [16][K], rows past M zero) x 16 weight rows (one half panel,
// its scales sp and zero-point factors sz [g][COLS] at the half's first column): the blocks
// in order, block b + 1's tile product issued before block b's floats (two tile sets,
// alternating) so the tiles and the vector units work at once; then y = acc - the
// zero-point term for the first `rows` rows and `cols` columns.
template <bool SIGNED_B>
void tile16(const int8_t* xq, const float* d, const float* xs, int64_t K, int64_t G, int64_t per_group,
            const uint8_t* half_panel, const float* sp, const float* sz, float zscale, float* y, int64_t ldy,
            int rows, int cols, int32_t* c) {
  const int64_t nb = K / BLOCK;
  __m512 acc[TILE];
#pragma GCC unroll 16
  for (int r = 0; r < TILE; ++r) acc[r] = _mm512_setzero_ps();
  LOWBIT_BLOCK_DOTS(0, 4, 6, 0);
  for (int64_t b = 0; b < nb; b += 2) {  // block b in tiles 0/4/6, block b + 1 in 1/5/7
    if (b + 1 < nb) LOWBIT_BLOCK_DOTS(1, 5, 7, b + 1);
    _tile_stored(0, c, TILE * 4);
    block_floats(acc, c, d, nb, b, _mm512_loadu_ps(sp + b / per_group * COLS));
    if (b + 1 >= nb) break;
    if (b + 2 < nb) LOWBIT_BLOCK_DOTS(0, 4, 6, b + 2);
    _tile_stored(1, c + TILE * TILE, TILE * 4);
    block_floats(acc, c + TILE * TILE, d, nb, b + 1, _mm512_loadu_ps(sp + (b + 1) / per_group * COLS));
  }
  // the zero-point sums of all 16 rows (rows past M have zero sums), 4 FMA chains at a
  // time; every index a constant, so acc stays in registers
  __m512 out[TILE];
#pragma GCC unroll 4
  for (int r0 = 0; r0 < TILE; r0 += 4) {
    __m512 z[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    if (sz) {
      for (int64_t g = 0; g < G; ++g) {
        const __m512 f = _mm512_loadu_ps(sz + g * COLS);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) z[i] = _mm512_fmadd_ps(f, _mm512_set1_ps(xs[(r0 + i) * G + g]), z[i]);
      }
      if (zscale != 1.f)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) z[i] = _mm512_mul_ps(z[i], _mm512_set1_ps(zscale));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) out[r0 + i] = _mm512_sub_ps(acc[r0 + i], z[i]);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, out[r]);
}
#undef LOWBIT_BLOCK_DOTS

// The loop of both tile GEMMs here: every panel of COLS weight rows of every weight of ws
// (one parallel region for q/k/v or gate/up) and every part of x's M rows (PanelItems),
// shared between the threads as each_item shares items; the panel's codes packed into the
// thread's TileState, then f(state, wt, n0, cols, m0, m_end): the weight, the panel's first
// row and how many of its rows exist, the part's rows m0 .. m_end - 1.
template <typename Setup, typename F>
void each_panel_part(const std::vector<PackedWeight>& ws, int64_t M, int64_t K, int bits, Setup setup, F f) {
  std::vector<int64_t> Ns;
  for (const PackedWeight& wt : ws) Ns.push_back(wt.N);
  const PanelItems items(Ns, COLS, M, TILE);
  each_item(items.size(), setup, [&](TileState& st, int64_t i) {
    const auto [j, n0, m0, m_end] = items[i];
    const PackedWeight& wt = ws[j];
    a8::pack_half_panels(wt, K, bits, n0, 2, reinterpret_cast<uint8_t*>(st.panel.data));
    f(st, wt, n0, static_cast<int>(std::min<int64_t>(COLS, wt.N - n0)), m0, m_end);
  });
}

// x [M, K] quantized once (rows padded to a multiple of 16 with zero codes), then every
// panel of 32 weight rows of every weight (of one kind: bits, zero points or not) times
// every 16 rows, panels and row ranges split between threads as the other panel GEMMs
// (PanelItems).  False (nothing written) if x held NaN or Inf.
bool run(const float* x, int64_t M, int64_t K, int64_t group, int bits, const std::vector<PackedWeight>& ws) {
  const int64_t G = K / group, nb = K / BLOCK, per_group = group / BLOCK;
  const a8::Rows<int8_t> x8(x, M, K, group, (M + TILE - 1) / TILE * TILE);
  if (!x8.finite) return false;
  const int8_t* q = x8.q.data();
  const float *d = x8.d.data(), *xs = x8.xs.data();
  const bool signed_b = bits == 8 && !ws[0].z;  // int8 codes; 4-bit and unsigned 8-bit ones are u8
  const float zscale = bits == 4 && !ws[0].z ? 8.f : 1.f;
  const bool has_term = bits == 4 || ws[0].z;
  const auto setup = [&] { return TileState(BLOCK, K * COLS / 4, G * COLS); };
  each_panel_part(ws, M, K, bits, setup,
                  [&](TileState& st, const PackedWeight& wt, int64_t n0, int cols, int64_t m0, int64_t m_end) {
    const int64_t N = wt.N;
    auto &sp = st.sp, &sz = st.sz;
    int32_t* c = st.c;
    const uint8_t* pb = reinterpret_cast<const uint8_t*>(st.panel.data);
    pack_groups<COLS>(N, G, n0, sp.data(), [&](int64_t n, int64_t g) { return wt.scale(n * G + g); });
    pack_groups<COLS>(N, G, n0, sz.data(), [&](int64_t n, int64_t g) { return a8::zero_factor(wt, n * G + g); });
    for (int64_t m = m0; m < m_end; m += TILE) {
      const int rows = static_cast<int>(std::min<int64_t>(TILE, m_end - m));
      for (int h = 0; h < 2 && TILE * h < cols; ++h) {
        const int hc = std::min(TILE, cols - TILE * h);
        const float* szp = has_term ? sz.data() + TILE * h : nullptr;
        const uint8_t* hp = pb + h * K * TILE;
        float* ym = wt.y + m * N + n0 + TILE * h;
        if (signed_b)
          tile16<true>(q + m * K, d + m * nb, xs + m * G, K, G, per_group, hp,
                       sp.data() + TILE * h, szp, zscale, ym, N, rows, hc, c);
        else
          tile16<false>(q + m * K, d + m * nb, xs + m * G, K, G, per_group, hp,
                        sp.data() + TILE * h, szp, zscale, ym, N, rows, hc, c);
      }
    }
  });
  return true;
}

// ---- W4A8: per-token int8 activations with zero points, 4-bit codes in groups ----------
// w4a8_gemm_panels' integers, exact per group (gemm_int8.cpp), on tiles:
//   int_g = sum_{k in g} x u - z (sum_{k in g} x - |g| xz) - xz sum_{k in g} u
//   y = sum_g fma(float(int_g), s)  in group order, from zero
// Groups are whole tile products of kstep (64, or 32 for groups of an odd number of 32s),
// summed in the C tile, so the floats enter once per group, not once per 32 values.

// Column sums of the codes u per group, usum[g][c] for one half panel's 16 columns.
void code_sums(const uint8_t* half_panel, int64_t K, int64_t group, int32_t* usum) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t g = 0; g < K / group; ++g) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t q = g * group / 4; q < (g + 1) * group / 4; ++q)
      sum = _mm512_dpbusd_epi32(sum, _mm512_loadu_si512(half_panel + q * 64), ones);
    _mm512_storeu_si512(usum + g * TILE, sum);
  }
}

// The tile products of group g into tile C (A, B: the tiles its steps load).
#define LOWBIT_GROUP_DOTS(C, A, B, g)                                                   \
  do {                                                                                  \
    _tile_zero(C);                                                                      \
    for (int64_t k = (g) * group; k < ((g) + 1) * group; k += kstep) {                  \
      _tile_loadd(A, xq + k, K);                                                        \
      _tile_loadd(B, half_panel + k * TILE, TILE * 4);                                  \
      _tile_dpbsud(C, A, B);                                                            \
    }                                                                                   \
  } while (0)

// The floats of group g for 16 rows: acc[r] = fma(float(int_g), s, acc[r]).
inline void group_floats(__m512 (&acc)[TILE], const int32_t* c, const int32_t* xg, const int32_t* xz, int64_t G,
                         int64_t g, __m512 s, __m512i z, __m512i us) {
#pragma GCC unroll 16
  for (int r = 0; r < TILE; ++r) {
    __m512i i = _mm512_load_si512(c + r * TILE);
    i = _mm512_sub_epi32(i, _mm512_mullo_epi32(z, _mm512_set1_epi32(xg[r * G + g])));
    i = _mm512_sub_epi32(i, _mm512_mullo_epi32(us, _mm512_set1_epi32(xz[r])));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), s, acc[r]);
  }
}

// 16 rows of x_q (padded with zeros past M) x one half panel (16 weight rows): the groups in
// order, group g + 1's tile products issued before group g's floats, as tile16.
void w4a8_tile16(const int8_t* xq, const int32_t* xg, const int32_t* xz, int64_t K, int64_t G, int64_t group,
                 int64_t kstep, const uint8_t* half_panel, const float* sp, const int32_t* zp, const int32_t* usum,
                 float* y, int64_t ldy, int rows, int cols, int32_t* c) {
  __m512 acc[TILE];
#pragma GCC unroll 16
  for (int r = 0; r < TILE; ++r) acc[r] = _mm512_setzero_ps();
  const auto floats = [&](const int32_t* cg, int64_t g) {
    group_floats(acc, cg, xg, xz, G, g, _mm512_loadu_ps(sp + g * COLS),
                 _mm512_loadu_si512(zp + g * COLS), _mm512_loadu_si512(usum + g * TILE));
  };
  LOWBIT_GROUP_DOTS(0, 4, 6, 0);
  for (int64_t g = 0; g < G; g += 2) {  // group g in tiles 0/4/6, group g + 1 in 1/5/7
    if (g + 1 < G) LOWBIT_GROUP_DOTS(1, 5, 7, g + 1);
    _tile_stored(0, c, TILE * 4);
    floats(c, g);
    if (g + 1 >= G) break;
    if (g + 2 < G) LOWBIT_GROUP_DOTS(0, 4, 6, g + 2);
    _tile_stored(1, c + TILE * TILE, TILE * 4);
    floats(c + TILE * TILE, g + 1);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}
#undef LOWBIT_GROUP_DOTS

void w4a8_run(const int8_t* x_q, const int32_t* x_zp, int64_t M, int64_t K, const uint8_t* w, int64_t N,
              const float* s, const int32_t* z, int64_t group, float* y) {
  const int64_t G = K / group, Mp = (M + TILE - 1) / TILE * TILE;
  const int64_t kstep = group % 64 == 0 ? 64 : 32;
  std::vector<int8_t> xq(Mp * K, 0);
  std::vector<int32_t> xz(Mp, 0), xg(Mp * G, 0);
  std::copy(x_q, x_q + M * K, xq.begin());
  std::copy(x_zp, x_zp + M, xz.begin());
  for (int64_t m = 0; m < M; ++m) w4a8_group_sums(xq.data() + m * K, xz[m], K, group, xg.data() + m * G);
  const auto setup = [&] { return TileState(static_cast<int>(kstep), K * COLS / 4, G * COLS, G * COLS, 2 * G * TILE); };
  each_panel_part({PackedWeight{w, s, z, N, y}}, M, K, 4, setup,
                  [&](TileState& st, const PackedWeight&, int64_t n0, int cols, int64_t m0, int64_t m_end) {
    auto& sp = st.sp;
    auto &zp = st.zp, &usum = st.usum;
    int32_t* c = st.c;
    const uint8_t* pb = reinterpret_cast<const uint8_t*>(st.panel.data);
    pack_groups<COLS>(N, G, n0, sp.data(), [&](int64_t n, int64_t g) { return s[n * G + g]; });
    pack_groups<COLS>(N, G, n0, zp.data(), [&](int64_t n, int64_t g) { return z ? z[n * G + g] : 8; });
    for (int h = 0; h < 2; ++h) code_sums(pb + h * K * TILE, K, group, usum.data() + h * G * TILE);
    for (int64_t m = m0; m < m_end; m += TILE) {
      const int rows = static_cast<int>(std::min<int64_t>(TILE, m_end - m));
      for (int h = 0; h < 2 && TILE * h < cols; ++h)
        w4a8_tile16(xq.data() + m * K, xg.data() + m * G, xz.data() + m, K, G, group, kstep, pb + h * K * TILE,
                    sp.data() + TILE * h, zp.data() + TILE * h, usum.data() + h * G * TILE, y + m * N + n0 + TILE * h,
                    N, rows, std::min(TILE, cols - TILE * h), c);
    }
  });
}
#endif

}  // namespace

#ifdef LOWBIT_AMX
namespace {
// CPUID leaf 7's EDX bits: 22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8; then the kernel's
// permission for the tile data (asked once per process, for every thread).
bool amx_ready(unsigned bit) {
  static const bool permitted = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;  // the kernel's names
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  unsigned a, b, c, d;
  return permitted && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << bit));
}
}  // namespace
#endif

bool has_amx_int8() {
#ifdef LOWBIT_AMX
  static const bool ready = amx_ready(25);
  return ready;
#else
  return false;
#endif
}

bool has_amx_bf16() {
#if defined(LOWBIT_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  static const bool ready = amx_ready(22);
  return ready;
#else
  return false;
#endif
}

// x float32 [M, K]; codes int32 [N, K/8] (4-bit) or int8/uint8 [N, K] (8-bit), scale float32
// or float16 [N, G] (packed_scales), zero_point of scale's dtype or none (signed codes).
// Returns float32 [M, N] and whether x was finite (if not, nothing is written: the caller
// raises).  The bits of gemm_a8_blocks (4-bit) and gemm_a8_blocks8 (8-bit).
std::tuple<at::Tensor, bool> gemm_a8_blocks_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                                const c10::optional<at::Tensor>& zero_point, int64_t bits,
                                                int64_t group, bool zero_point_min) {
  TORCH_CHECK(has_amx_int8(), "lowbit._C.gemm_a8_blocks_amx needs AMX (amx-tile, amx-int8) and the kernel's "
                              "permission to use its tiles");
  TORCH_CHECK(bits == 4 || bits == 8, "lowbit._C.gemm_a8_blocks_amx: bits must be 4 or 8");
  a8::check_x("lowbit._C.gemm_a8_blocks_amx", x, group);
  std::vector<at::Tensor> ys;
  const std::vector<PackedWeight> weights = packed_weights("lowbit._C.gemm_a8_blocks_amx", x, {codes}, {scale},
                                                           {zero_point}, bits, group, ys, zero_point_min);
  bool finite = true;
  if (x.size(0) > 0 && weights[0].N > 0)
    finite = a8_blocks_amx_into(x.data_ptr<float>(), x.size(0), x.size(1), bits, group, weights);
  return {ys[0], finite};
}

bool a8_blocks_amx_into(const float* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                        const std::vector<PackedWeight>& weights) {
#ifdef LOWBIT_AMX
  return run(x, M, K, group, static_cast<int>(bits), weights);
#else
  TORCH_CHECK(false, "lowbit._C was built without the AMX tile kernels");
#endif
}

// w4a8_gemm_panels' contract and bits (x_scale and bias applied by the caller): x_q int8
// [M, K]; x_zp int32 [M]; codes int32 [N, K/8]; w_scale float32 [N, G]; w_zp int32 [N, G]
// or none (signed codes).  Returns float32 [M, N] = sum_g w_scale * int_g.
at::Tensor w4a8_gemm_amx(const at::Tensor& x_q, const at::Tensor& x_zp, const at::Tensor& codes,
                         const at::Tensor& w_scale, const c10::optional<at::Tensor>& w_zp, int64_t group) {
  TORCH_CHECK(has_amx_int8(), "lowbit._C.w4a8_gemm_amx needs AMX (amx-tile, amx-int8) and the kernel's "
                              "permission to use its tiles");
  TORCH_CHECK(x_q.dim() == 2 && x_q.scalar_type() == at::kChar && x_q.is_contiguous(),
              "lowbit._C.w4a8_gemm_amx: contiguous int8 x_q [M, K] expected");
  const int64_t M = x_q.size(0), K = x_q.size(1), N = codes.size(0);
  TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0,
              "lowbit._C.w4a8_gemm_amx: group must be a multiple of 32 dividing K");
  check_w4a8_zero_points("lowbit._C.w4a8_gemm_amx", x_q, x_zp, group);
  const int64_t G = K / group;
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kInt && codes.is_contiguous() && codes.size(1) * 8 == K &&
                  w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.dim() == 2 &&
                  w_scale.size(0) == N && w_scale.size(1) == G &&
                  (!w_zp || (w_zp->scalar_type() == at::kInt && w_zp->is_contiguous() && w_zp->sizes() == w_scale.sizes())),
              "lowbit._C.w4a8_gemm_amx: contiguous codes int32 [N, K/8], float32 scales and int32 zero points "
              "[N, K/group] expected");
  at::Tensor y = at::empty({M, N}, x_q.options().dtype(at::kFloat));
#ifdef LOWBIT_AMX
  if (M > 0 && N > 0)
    w4a8_run(x_q.data_ptr<int8_t>(), x_zp.data_ptr<int32_t>(), M, K, reinterpret_cast<const uint8_t*>(codes.data_ptr()),
             N, w_scale.data_ptr<float>(), w_zp ? w_zp->data_ptr<int32_t>() : nullptr, group, y.data_ptr<float>());
#endif
  return y;
}
