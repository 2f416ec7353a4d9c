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
// in the "min" domain; signed 8-bit codes as int8, no zero-point term).  One tdpbusd
// (uint8 x int8) or tdpbssd (int8 x int8) multiplies a 16 x 32 tile of weight codes (16
// weight rows, one block, the codes as bytes in k order) by an 8 x 64 tile of activation
// codes (16 rows, 4 consecutive k per dword: the panel layout [k / 4][row][4]) into 16 x 16
// exact int32 sums, 8192 multiply-adds per instruction against 64 for a 512-bit vpdpbusd.
// Each block's sums leave the tiles (tilestored) and enter float32 as gemm_a8.cpp's do:
// one conversion, one product s * d and one FMA per block, in block order, so every lane
// runs the same IEEE operations in the same order as the AVX2 kernels' lanes.
//
// The weight is the A tile so that packing it only spreads 4-bit codes to bytes (no
// transposition), and its scales stay in their rows' order; the activations, a few rows per
// call, are laid out once.  With the weight as B (transposed into the panel layout, scales
// gathered per column) packing took 40-57% of a 1536 x 576 or 576 x 1536 call at 8-32
// rows; this way whole calls run 1.6-1.7x faster at 8 rows, 1.2-1.4x at 32, 1.15-1.2x at
// 128 (one thread) and level at 512 (two; Xeon family 6 model 207 VM), where the tiles'
// loads, products and stores set the pace: ~50 TSC cycles per 16 x 16 x 32 block.  A tile
// of 16 weight rows x 16 activation rows keeps its float accumulators in registers (one
// per weight row) while block b + 1's tile product runs beside block b - 1's floats.
// Tiles need the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM), asked once by
// has_amx_int8().

#include "a8_blocks.h"
#include "kernels.h"
#include "int8_epilogue.h"
#include "panels.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VBMI__) && defined(__linux__)  // VBMI: vpmultishiftqb (every AMX CPU has it)
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
// kstep bytes), tmm6-7 B (kstep / 4 dword rows x 16 columns of 4 codes); kstep: values of
// K per tile product (32: one activation block; 64 where whole groups of a W4A8 weight allow).
void configure_tiles(int kstep) {
  const uint8_t b = static_cast<uint8_t>(kstep / 4);
  const uint16_t a = static_cast<uint16_t>(kstep);
  load_tile_config({TILE, TILE, 0, 0, TILE, TILE, b, b}, {TILE * 4, TILE * 4, 0, 0, a, a, TILE * 4, TILE * 4});
}

// A thread's tile configuration (released when its items are done), its panel, per-group
// values of the panel's weight rows and C tiles.
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

// The loop of both tile GEMMs here: every panel of COLS weight rows of every weight of ws
// (one parallel region for q/k/v or gate/up) and every part of x's M rows (PanelItems),
// shared between the threads as each_item shares items; pack(wt, n0, panel) lays the panel's
// codes out in the thread's TileState, then f(state, wt, n0, cols, m0, m_end): the weight,
// the panel's first row and how many of its rows exist, the part's rows m0 .. m_end - 1.
template <typename Setup, typename Pack, typename F>
void each_panel_part(const std::vector<PackedWeight>& ws, int64_t M, Setup setup, Pack pack, F f) {
  std::vector<int64_t> Ns;
  for (const PackedWeight& wt : ws) Ns.push_back(wt.N);
  const PanelItems items(Ns, COLS, M, TILE);
  each_item(items.size(), setup, [&](TileState& st, int64_t i) {
    const auto [j, n0, m0, m_end] = items[i];
    const PackedWeight& wt = ws[j];
    pack(wt, n0, reinterpret_cast<uint8_t*>(st.panel.data));
    f(st, wt, n0, static_cast<int>(std::min<int64_t>(COLS, wt.N - n0)), m0, m_end);
  });
}

// ---- int8 blocks: tile A = 16 weight rows x one block, tile B = the block of 16 x rows --
// C[r][m] = the block's dot of weight row r and activation row m.

// x's codes, block scales and group sums (Rows, padded to whole tiles) by tile of 16 rows:
// q [tiles][K / 4][16][4] (B tiles: block b at q + b * 512), d [tiles][nb][16] and
// xs [tiles][G][16] (lane m: the tile's row m).
struct TiledRows {
  std::vector<int8_t> q;
  std::vector<float> d, xs;
  bool finite;
  template <typename X>
  TiledRows(const X* x, int64_t M, int64_t K, int64_t group) {
    const int64_t tiles = (M + TILE - 1) / TILE, nb = K / BLOCK, G = K / group;
    const a8::Rows<int8_t> rows(x, M, K, group, tiles * TILE);
    finite = rows.finite;
    if (!finite) return;
    q.resize(tiles * TILE * K), d.resize(tiles * TILE * nb), xs.resize(tiles * TILE * G);
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {  // a batch's few tiles on one thread
      for (int64_t t = t0; t < t1; ++t) {
        const int8_t* in = rows.q.data() + t * TILE * K;
        int8_t* out = q.data() + t * TILE * K;
        for (int64_t k = 0; k < K; k += 64) {  // 16 rows x 64 codes -> 16 panel rows of 16 dwords
          const int64_t n = std::min<int64_t>(64, K - k);
          const __mmask64 live = n == 64 ? ~0ULL : (1ULL << n) - 1;
          __m512i r[TILE];
          for (int i = 0; i < TILE; ++i) r[i] = _mm512_maskz_loadu_epi8(live, in + i * K + k);
          transpose16(r);  // r[j]: codes k + 4j .. k + 4j + 3 of the 16 rows
          for (int j = 0; j < n / 4; ++j) _mm512_storeu_si512(out + (k / 4 + j) * 64, r[j]);
        }
        for (int i = 0; i < TILE; ++i) {
          for (int64_t b = 0; b < nb; ++b) d[(t * nb + b) * TILE + i] = rows.d[(t * TILE + i) * nb + b];
          for (int64_t g = 0; g < G; ++g) xs[(t * G + g) * TILE + i] = rows.xs[(t * TILE + i) * G + g];
        }
      }
    });
  }
};

// Weight rows [n0, n0 + COLS) (rows past N repeat row N - 1: computed, never stored) as A
// tiles: panel + h * K * 16 + b * 512 holds block b of rows n0 + 16h .. n0 + 16h + 15, 32
// bytes a row; 4-bit codes as u8 (signed ones as q + 8), 8-bit ones as stored.
void pack_weight_rows(const PackedWeight& wt, int64_t K, int bits, int64_t n0, uint8_t* panel) {
  const int64_t nb = K / BLOCK, row_bytes = bits == 4 ? K / 2 : K;
  // 4-bit: two blocks at a time, raw dword j (codes 8j .. 8j + 7, code i in bits 4i..4i+3)
  // zero-extended to qword j, byte i of the qword picked at bit 4i, the high nibbles masked
  const __m512i pick = _mm512_set1_epi64(0x1C1814100C080400LL), low = _mm512_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(wt.z ? 0x00 : 0x08);
  for (int c = 0; c < COLS; ++c) {
    const uint8_t* row = wt.w + std::min<int64_t>(n0 + c, wt.N - 1) * row_bytes;
    uint8_t* out = panel + (c / TILE) * K * TILE + (c % TILE) * BLOCK;
    if (bits == 8) {
      for (int64_t b = 0; b < nb; ++b) std::memcpy(out + b * TILE * BLOCK, row + b * BLOCK, BLOCK);
      continue;
    }
    for (int64_t b = 0; b < nb; b += 2) {
      const int64_t n = std::min<int64_t>(2, nb - b);  // blocks here: 2, or a last 1
      const __m256i raw = _mm256_maskz_loadu_epi32(n == 2 ? 0xFF : 0x0F, row + b * BLOCK / 2);
      const __m512i u = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(pick, _mm512_cvtepu32_epi64(raw)),
                                                  low, flip, 0x6A);  // (v & low) ^ flip
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * TILE * BLOCK), _mm512_castsi512_si256(u));
      if (n == 2)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (b + 1) * TILE * BLOCK), _mm512_extracti64x4_epi64(u, 1));
    }
  }
}

// Per-row scales sp and zero-point factors sz (a8::zero_factor), [COLS][G], of the panel
// at weight row n0 (rows past N repeat row N - 1).  16 groups at a time (scale16,
// a8::zero_factors16: the same bits as a scalar conversion per group; calls with float16
// scales at 8-32 rows 1.06-1.17x, in-process A/B on the Xeon).
void pack_row_groups(const PackedWeight& wt, int64_t G, int64_t n0, float* sp, float* sz) {
  with_scales(wt, [&](const auto* s, const auto* z) {
    for (int c = 0; c < COLS; ++c) {
      const int64_t i0 = std::min<int64_t>(n0 + c, wt.N - 1) * G;
      float *ps = sp + c * G, *pz = sz + c * G;
      for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 in = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
        const __m512 sv = scale16(s + i0 + g, in);
        const __m512 zv = z ? a8::zero_factors16(sv, scale16(z + i0 + g, in), wt.min) : sv;
        _mm512_mask_storeu_ps(ps + g, in, sv);
        _mm512_mask_storeu_ps(pz + g, in, zv);
      }
    }
  });
}

// Tile C = tile A (block b of 16 weight rows) x tile B (block b of 16 activation rows).
#define LOWBIT_ROW_DOTS(C, A, B, b)                          \
  do {                                                       \
    _tile_zero(C);                                           \
    _tile_loadd(A, wa + (b) * wa_block, wa_stride);          \
    _tile_loadd(B, xb + (b) * TILE * BLOCK, TILE * 4);       \
    if constexpr (SIGNED_A) _tile_dpbssd(C, A, B);           \
    else _tile_dpbusd(C, A, B);                              \
  } while (0)

// 16 weight rows (wa: their A tiles, block b at wa + b * wa_block, wa_stride bytes from one
// row to the next; sp, sz [16][G]: their scales and zero-point factors)
// x one tile of 16 activation rows (xb, d, xs: TiledRows' at the tile): acc[r] lane m =
// sum_b fma(cvt(dot_b[r][m]), s[r, g(b)] * d[m, b], .), the blocks in order, block b + 1's
// tile product issued while block b - 1's floats run (the floats read a C tile stored one
// step earlier); then acc - the zero-point term, turned to activation rows, the first `rows`
// rows and `cols` columns stored (Y: float32, or bf16 rounded to nearest even as .to()
// rounds).  Lane m of acc[r] runs the AVX2 kernels' operations for y[m, n0 + r] (s * d is
// d * s).
template <bool SIGNED_A, typename Y>
void rows16(const uint8_t* wa, int64_t wa_block, int64_t wa_stride, const int8_t* xb, const float* d, const float* xs,
            int64_t nb, int64_t G, int64_t per_group, const float* sp, const float* sz, float zscale, Y* y, int64_t ldy,
            int rows, int cols, int32_t* c) {
  __m512 acc[TILE];
#pragma GCC unroll 16
  for (int r = 0; r < TILE; ++r) acc[r] = _mm512_setzero_ps();
  const auto floats = [&](int64_t b) {
    const int32_t* cb = c + (b % 2) * TILE * TILE;
    const __m512 dv = _mm512_loadu_ps(d + b * TILE);
    const int64_t g = b / per_group;
#pragma GCC unroll 16
    for (int r = 0; r < TILE; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + r * TILE)),
                               _mm512_mul_ps(_mm512_set1_ps(sp[r * G + g]), dv), acc[r]);
  };
  LOWBIT_ROW_DOTS(0, 4, 6, 0);
  for (int64_t b = 0; b < nb; b += 2) {  // block b in tiles 0/4/6, block b + 1 in 1/5/7
    if (b + 1 < nb) LOWBIT_ROW_DOTS(1, 5, 7, b + 1);
    _tile_stored(0, c, TILE * 4);
    if (b > 0) floats(b - 1);
    if (b + 1 >= nb) break;
    if (b + 2 < nb) LOWBIT_ROW_DOTS(0, 4, 6, b + 2);
    _tile_stored(1, c + TILE * TILE, TILE * 4);
    floats(b);
  }
  floats(nb - 1);
  __m512i out[TILE];
#pragma GCC unroll 4
  for (int r0 = 0; r0 < TILE; r0 += 4) {
    __m512 z[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    if (sz) {
      for (int64_t g = 0; g < G; ++g) {
        const __m512 f = _mm512_loadu_ps(xs + g * TILE);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) z[i] = _mm512_fmadd_ps(_mm512_set1_ps(sz[(r0 + i) * G + g]), f, z[i]);
      }
      if (zscale != 1.f)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) z[i] = _mm512_mul_ps(z[i], _mm512_set1_ps(zscale));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) out[r0 + i] = _mm512_castps_si512(_mm512_sub_ps(acc[r0 + i], z[i]));
  }
  transpose16(out);  // out[m]: activation row m's 16 weight rows
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int m = 0; m < rows; ++m) int8_epilogue::store<Y>(y + m * ldy, keep, _mm512_castsi512_ps(out[m]));
}
#undef LOWBIT_ROW_DOTS

// x [M, K] (X: float32 or bf16) quantized and laid out once (TiledRows), then every panel of
// 32 weight rows of every weight (of one kind: bits, zero points or not) times every tile of
// 16 rows into ys[j] [M, N] (weight j's), panels and row ranges split between threads as the
// other panel GEMMs (PanelItems).  False (nothing written) if x held NaN or Inf.
template <typename X, typename Y>
bool run(const X* x, int64_t M, int64_t K, int64_t group, int bits, const std::vector<PackedWeight>& ws,
         Y* const* ys) {
  // one row of x fills one column of the tiles' 16: 4-bit codes take vpdpbusd over 16 weight
  // rows there (gemv_a8_vnni.cpp, the same bits), 2.5x these tiles
  if (M == 1 && bits == 4 && a8_vnni_row_supported()) return a8_blocks_vnni_row(x, K, group, ws, ys);
  const int64_t G = K / group, nb = K / BLOCK, per_group = group / BLOCK;
  const TiledRows xt(x, M, K, group);
  if (!xt.finite) return false;
  const bool signed_a = bits == 8 && !ws[0].z;  // int8 codes; 4-bit and unsigned 8-bit ones are u8
  const float zscale = bits == 4 && !ws[0].z ? 8.f : 1.f;
  const bool has_term = bits == 4 || ws[0].z;
  const auto setup = [&] { return TileState(BLOCK, K * COLS / 4, G * COLS); };
  // 8-bit codes are the A tiles as stored (16 rows of a block, K bytes apart), but in a last
  // panel cut short (its rows past N repeat row N - 1).  Against copying each block into the
  // panel (32 bytes a memcpy), the same bits, AMX Xeon, in-process A/B: 1.16-1.35x at 8 and
  // 32 rows (the 49152 x 576 int8 head of a -head8 recipe: 5.8 -> 4.5 ms at 32 rows), level
  // at 512.
  const auto as_stored = [&](const PackedWeight& wt, int64_t n0) { return bits == 8 && n0 + COLS <= wt.N; };
  const auto pack = [&](const PackedWeight& wt, int64_t n0, uint8_t* panel) {
    if (!as_stored(wt, n0)) pack_weight_rows(wt, K, bits, n0, panel);
  };
  each_panel_part(ws, M, setup, pack,
                  [&](TileState& st, const PackedWeight& wt, int64_t n0, int cols, int64_t m0, int64_t m_end) {
    const int64_t N = wt.N;
    float *sp = st.sp.data(), *sz = st.sz.data();
    pack_row_groups(wt, G, n0, sp, sz);
    const bool stored = as_stored(wt, n0);
    const uint8_t* pb = stored ? wt.w + n0 * K : reinterpret_cast<const uint8_t*>(st.panel.data);
    const int64_t wa_block = stored ? BLOCK : TILE * BLOCK, wa_stride = stored ? K : BLOCK;
    for (int64_t m = m0; m < m_end; m += TILE) {
      const int rows = static_cast<int>(std::min<int64_t>(TILE, m_end - m));
      const int64_t t = m / TILE;
      const int8_t* xb = xt.q.data() + t * TILE * K;
      const float *d = xt.d.data() + t * nb * TILE, *xs = xt.xs.data() + t * G * TILE;
      for (int h = 0; h < 2 && TILE * h < cols; ++h) {
        const int hc = std::min(TILE, cols - TILE * h);
        const float* szp = has_term ? sz + TILE * h * G : nullptr;
        const uint8_t* wa = pb + h * K * TILE;  // both layouts: 16 rows of K bytes per half
        Y* ym = ys[&wt - ws.data()] + m * N + n0 + TILE * h;
        const float* sph = sp + TILE * h * G;
        if (signed_a)
          rows16<true>(wa, wa_block, wa_stride, xb, d, xs, nb, G, per_group, sph, szp, zscale, ym, N, rows, hc, st.c);
        else
          rows16<false>(wa, wa_block, wa_stride, xb, d, xs, nb, G, per_group, sph, szp, zscale, ym, N, rows, hc, st.c);
      }
    }
  });
  return true;
}

// ---- W4A8: per-token int8 activations with zero points, 4-bit codes in groups ----------
// w4a8_gemm_panels' integers, exact per group (gemm_int8.cpp), on tiles:
//   int_g = sum_{k in g} (x - xz) (u - z)
//   y = sum_g fma(float(int_g), s)  in group order, from zero
// The panels hold the codes less their group's zero point, u - z in [-15, 15] as int8
// (signed codes: q itself, z = 8), so one tdpbssd per step gives c = sum_{k in g} x (u - z)
// and int_g = c - xz w_g with w_g = sum_{k in g} (u - z), a number per column and group.
// In float32 that is one fnmadd: c (|c| <= 128 * 15 * |g| < 2^24 for groups up to 8192),
// xz and w_g (check_w4a8_zero_points) are exact floats, and fnmadd rounds c - xz w_g once:
// float(int_g), the value the other kernels convert.  Per group and row that is a
// conversion, the fnmadd and the FMA (the int32 form, two vpmulld and two subtractions more,
// left the vector work twice the tile work: 0.6-1.0x torch's bf16 GEMM at 512 rows).
// Larger groups take the int32 form (c - xz w_g exact in int32 there, as check_w4a8_zero_points
// bounds it).  Groups are whole tile products of kstep (64, or 32 for groups of an odd
// number of 32s), summed in the C tile, so the floats enter once per group, not once per 32
// values.
constexpr int64_t kFloatGroupMax = 8192;  // 128 * 15 * 8192 < 2^24

// A half panel's codes less their zero points (z [G][COLS] from the half's first column,
// each in 0..15) and its column sums w[g][c] = sum_{k in g} (u - z), int32.
void zero_point_panel(uint8_t* half_panel, int64_t K, int64_t group, const int32_t* z, int32_t* w) {
  const __m512i ones = _mm512_set1_epi8(1), bytes = _mm512_set1_epi32(0x01010101);
  for (int64_t g = 0; g < K / group; ++g) {
    const __m512i zb = _mm512_mullo_epi32(_mm512_loadu_si512(z + g * COLS), bytes);  // z in each byte of its column
    __m512i sum = _mm512_setzero_si512();
    for (int64_t q = g * group / 4; q < (g + 1) * group / 4; ++q) {
      const __m512i v = _mm512_sub_epi8(_mm512_loadu_si512(half_panel + q * 64), zb);
      _mm512_storeu_si512(half_panel + q * 64, v);
      sum = _mm512_dpbusd_epi32(sum, ones, v);
    }
    _mm512_storeu_si512(w + g * TILE, sum);
  }
}

// The tile products of group g into tile C (A, B: the tiles its steps load).
#define LOWBIT_GROUP_DOTS(C, A, B, g)                                                   \
  do {                                                                                  \
    _tile_zero(C);                                                                      \
    for (int64_t k = (g) * group; k < ((g) + 1) * group; k += kstep) {                  \
      _tile_loadd(A, xq + k, K);                                                        \
      _tile_loadd(B, half_panel + k * TILE, TILE * 4);                                  \
      _tile_dpbssd(C, A, B);                                                            \
    }                                                                                   \
  } while (0)

// The floats of group g for 16 rows: acc[r] = fma(float(int_g), s, acc[r]) (FLOAT: int_g
// by fnmadd from the float32 xz and w, else in int32).
template <bool FLOAT>
inline void group_floats(__m512 (&acc)[TILE], const int32_t* c, const int32_t* xz, const float* xzf, __m512 s,
                         __m512i w) {
  const __m512 wf = _mm512_cvtepi32_ps(w);
#pragma GCC unroll 16
  for (int r = 0; r < TILE; ++r) {
    const __m512i i = _mm512_load_si512(c + r * TILE);
    const __m512 v = FLOAT ? _mm512_fnmadd_ps(_mm512_set1_ps(xzf[r]), wf, _mm512_cvtepi32_ps(i))
                           : _mm512_cvtepi32_ps(_mm512_sub_epi32(i, _mm512_mullo_epi32(w, _mm512_set1_epi32(xz[r]))));
    acc[r] = _mm512_fmadd_ps(v, s, acc[r]);
  }
}

// 16 rows of x_q (padded with zeros past M) x one half panel (16 weight rows): the groups in
// order, group g + 1's tile products issued before group g's floats; each row's sums then
// times its scale xs[r] where xs is given, and stored as Y (bf16: rounded to nearest even,
// as .to() rounds).
template <bool FLOAT, typename Y>
void w4a8_tile16(const int8_t* xq, const int32_t* xz, const float* xzf, const float* xs, int64_t K, int64_t G,
                 int64_t group, int64_t kstep, const uint8_t* half_panel, const float* sp, const int32_t* wsum, Y* y,
                 int64_t ldy, int rows, int cols, int32_t* c) {
  __m512 acc[TILE];
#pragma GCC unroll 16
  for (int r = 0; r < TILE; ++r) acc[r] = _mm512_setzero_ps();
  const auto floats = [&](const int32_t* cg, int64_t g) {
    group_floats<FLOAT>(acc, cg, xz, xzf, _mm512_loadu_ps(sp + g * COLS), _mm512_loadu_si512(wsum + g * TILE));
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
  for (int r = 0; r < rows; ++r)
    int8_epilogue::store<Y>(y + r * ldy, keep, xs ? _mm512_mul_ps(acc[r], _mm512_set1_ps(xs[r])) : acc[r]);
}
#undef LOWBIT_GROUP_DOTS

// x_q [M, K] times every weight of ws (u32x8 codes, float32 scales, int32 zero points or
// none, all of one kind) into ys[j] [M, N_j]: their panels in one parallel region (a
// prefill's q/k/v or gate/up).  x_scale [M] or null: the rows' scales, applied last.
template <typename Y>
void w4a8_run(const int8_t* x_q, const int32_t* x_zp, const float* x_scale, int64_t M, int64_t K, int64_t group,
              const std::vector<PackedWeight>& ws, Y* const* ys) {
  const int64_t G = K / group, Mp = (M + TILE - 1) / TILE * TILE;
  const int64_t kstep = group % 64 == 0 ? 64 : 32;
  std::vector<int8_t> xq(Mp * K, 0);
  std::vector<int32_t> xz(Mp, 0);
  std::vector<float> xzf(Mp, 0.f), xs(x_scale ? Mp : 0, 0.f);
  std::copy(x_q, x_q + M * K, xq.begin());
  std::copy(x_zp, x_zp + M, xz.begin());
  std::copy(x_zp, x_zp + M, xzf.begin());  // exact: |x_zp| < 2^30 / (15 * 32) < 2^24
  if (x_scale) std::copy(x_scale, x_scale + M, xs.begin());
  const auto setup = [&] { return TileState(static_cast<int>(kstep), K * COLS / 4, G * COLS, G * COLS, 2 * G * TILE); };
  const auto pack = [&](const PackedWeight& wt, int64_t n0, uint8_t* panel) {
    a8::pack_half_panels(wt, K, 4, n0, 2, panel);
  };
  each_panel_part(ws, M, setup, pack,
                  [&](TileState& st, const PackedWeight& wt, int64_t n0, int cols, int64_t m0, int64_t m_end) {
    const int64_t N = wt.N;
    const float* s = static_cast<const float*>(wt.s);
    const int32_t* z = static_cast<const int32_t*>(wt.z);
    Y* y = ys[&wt - ws.data()];
    auto& sp = st.sp;
    auto &zp = st.zp, &wsum = st.usum;
    int32_t* c = st.c;
    uint8_t* pb = reinterpret_cast<uint8_t*>(st.panel.data);
    pack_groups<COLS>(N, G, n0, sp.data(), [&](int64_t n, int64_t g) { return s[n * G + g]; });
    pack_groups<COLS>(N, G, n0, zp.data(), [&](int64_t n, int64_t g) { return z ? z[n * G + g] : 8; });
    for (int h = 0; h < 2; ++h)
      zero_point_panel(pb + h * K * TILE, K, group, zp.data() + TILE * h, wsum.data() + h * G * TILE);
    for (int64_t m = m0; m < m_end; m += TILE) {
      const int rows = static_cast<int>(std::min<int64_t>(TILE, m_end - m));
      for (int h = 0; h < 2 && TILE * h < cols; ++h) {
        const auto tile = group <= kFloatGroupMax ? w4a8_tile16<true, Y> : w4a8_tile16<false, Y>;
        tile(xq.data() + m * K, xz.data() + m, xzf.data() + m, x_scale ? xs.data() + m : nullptr, K, G, group, kstep,
             pb + h * K * TILE, sp.data() + TILE * h, wsum.data() + h * G * TILE, y + m * N + n0 + TILE * h, N, rows,
             std::min(TILE, cols - TILE * h), c);
      }
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

// x float32 or bf16 [M, K]; codes int32 [N, K/8] (4-bit) or int8/uint8 [N, K] (8-bit), scale
// float32 or float16 [N, G] (packed_scales), zero_point of scale's dtype or none (signed
// codes).  Returns y [M, N] in x's dtype (bf16: the float32 outputs rounded once to nearest
// even, as .to(bfloat16) would, without a float32 copy of x or y) and whether x was finite
// (if not, nothing is written: the caller raises).  The bits of gemm_a8_blocks (4-bit) and
// gemm_a8_blocks8 (8-bit).
std::tuple<at::Tensor, bool> gemm_a8_blocks_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                                const c10::optional<at::Tensor>& zero_point, int64_t bits,
                                                int64_t group, bool zero_point_min) {
  const char* who = "lowbit._C.gemm_a8_blocks_amx";
  TORCH_CHECK(has_amx_int8(), who, " needs AMX (amx-tile, amx-int8) and the kernel's permission to use its tiles");
  TORCH_CHECK(bits == 4 || bits == 8, who, ": bits must be 4 or 8");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  a8::check_x(who, x, group, /*bf16_too=*/true);
  // bf16 x writes its own bf16 y: packed_weights then checks the weight against K only, its
  // float32 outputs having no rows
  std::vector<at::Tensor> ys;
  const std::vector<PackedWeight> weights =
      packed_weights(who, bf16 ? x.narrow(0, 0, 0) : x, {codes}, {scale}, {zero_point}, bits, group, ys, zero_point_min);
  at::Tensor y = bf16 ? at::empty({x.size(0), weights[0].N}, x.options()) : ys[0];
  if (y.numel() == 0) return {y, true};
  if (!bf16) return {y, a8_blocks_amx_into(x.data_ptr<float>(), x.size(0), x.size(1), bits, group, weights)};
  c10::BFloat16* py = y.data_ptr<c10::BFloat16>();
  return {y, a8_blocks_amx_into(x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), bits, group, weights, &py)};
}

bool a8_blocks_amx_into(const float* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                        const std::vector<PackedWeight>& weights) {
#ifdef LOWBIT_AMX
  std::vector<float*> ys;
  for (const PackedWeight& wt : weights) ys.push_back(wt.y);
  return run(x, M, K, group, static_cast<int>(bits), weights, ys.data());
#else
  TORCH_CHECK(false, "lowbit._C was built without the AMX tile kernels");
#endif
}

bool a8_blocks_amx_into(const c10::BFloat16* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                        const std::vector<PackedWeight>& weights, c10::BFloat16* const* ys) {
#ifdef LOWBIT_AMX
  return run(x, M, K, group, static_cast<int>(bits), weights, ys);
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
  if (w_zp) {  // the panels hold u - z as int8
    const int32_t* pz = w_zp->data_ptr<int32_t>();
    TORCH_CHECK(std::all_of(pz, pz + w_zp->numel(), [](int32_t v) { return v >= 0 && v <= 15; }),
                "lowbit._C.w4a8_gemm_amx: w_zp must lie in the 4-bit code range 0..15");
  }
  at::Tensor y = at::empty({M, N}, x_q.options().dtype(at::kFloat));
#ifdef LOWBIT_AMX
  if (M > 0 && N > 0) {
    float* py = y.data_ptr<float>();
    w4a8_run<float>(x_q.data_ptr<int8_t>(), x_zp.data_ptr<int32_t>(), nullptr, M, K, group,
                    {PackedWeight{reinterpret_cast<const uint8_t*>(codes.data_ptr()), w_scale.data_ptr<float>(),
                                  w_zp ? w_zp->data_ptr<int32_t>() : nullptr, N, nullptr}},
                    &py);
  }
#endif
  return y;
}

template <typename Y>
void w4a8_amx_into(const int8_t* x_q, const int32_t* x_zp, const float* x_scale, int64_t M, int64_t K, int64_t group,
                   const std::vector<PackedWeight>& weights, Y* const* ys) {
#ifdef LOWBIT_AMX
  if (M > 0) w4a8_run<Y>(x_q, x_zp, x_scale, M, K, group, weights, ys);
#else
  TORCH_CHECK(false, "lowbit._C was built without the AMX tile kernels");
#endif
}
template void w4a8_amx_into<float>(const int8_t*, const int32_t*, const float*, int64_t, int64_t, int64_t,
                                   const std::vector<PackedWeight>&, float* const*);
template void w4a8_amx_into<c10::BFloat16>(const int8_t*, const int32_t*, const float*, int64_t, int64_t, int64_t,
                                           const std::vector<PackedWeight>&, c10::BFloat16* const*);
