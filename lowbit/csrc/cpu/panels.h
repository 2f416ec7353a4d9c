// What the panel GEMMs (gemm_bf16.cpp, gemm_int8.cpp, gemm_a8.cpp, gemm_i16.cpp) share:
// how their work is split between threads (PanelWork, PanelItems, each_panel), per-group values laid
// out per panel (pack_groups), and for the AVX-512 ones the panel layout, its register tile
// and the 16 x 16 transpose that lays 16 rows of a weight out as the 16 lanes of a vector.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "balance.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

// A panel holds NP = 64 output columns (weight rows) as dwords, panel[k-step][column]; a
// register tile is MR rows of activations x those 64 columns (NV vectors of 16).
constexpr int MR = 6;
constexpr int NV = 4;
constexpr int NP = 16 * NV;

// A thread's panel: `dwords` dwords, 64-byte aligned.
struct PanelBuffer {
  std::vector<uint32_t> storage;
  uint32_t* data;
  explicit PanelBuffer(int64_t dwords)
      : storage(dwords + 16),
        data(reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63))) {}
};

// Work items of a panel GEMM: every panel of NP weight rows times `parts` ranges of
// activation rows.  With at least 4 panels per thread, parts = 1 (each panel packed
// once).  Fewer panels (the 135M model's 192- and 576-wide projections: 3 and 9) would
// leave threads idle, so the rows are split too and each part packs its panels itself.
// Then more parts where the items do not share evenly: 9 items on 2 threads (5 + 4) take as
// long as 10 (576 columns at 512 rows took 979 us, 640 columns 1011 us); 18 take 18.
struct PanelWork {
  int64_t parts, rows;  // rows per part: a multiple of the tile height
  PanelWork(int64_t panels, int64_t M, int64_t tile_rows, int64_t threads) {
    int64_t want = panels >= 4 * threads ? 1 : (4 * threads + panels - 1) / panels;
    const auto uneven = [&](int64_t p) {  // the busiest thread more than 5% above the average
      return 20 * ((panels * p + threads - 1) / threads) * threads > 21 * panels * p;
    };
    while (uneven(want) && want < 4 * threads) ++want;
    const int64_t tiles = (M + tile_rows - 1) / tile_rows;
    parts = std::max<int64_t>(1, std::min(want, tiles / 4));  // at least 4 tiles per part
    rows = std::max<int64_t>(1, (tiles + parts - 1) / parts) * tile_rows;  // (M = 0: no parts, no division by 0)
    parts = (M + rows - 1) / rows;
  }
  int64_t items(int64_t panels) const { return panels * parts; }
};

// The items of a panel GEMM over several weights of one input (q/k/v or gate/up share one
// parallel region): every panel of `cols` weight rows of every weight (numbered in one
// range, weight j has Ns[j] rows) times every part of the activation rows (PanelWork).
struct PanelItems {
  struct Item {
    size_t j;            // the weight
    int64_t n0, m0, m1;  // its first column; the activation rows [m0, m1)
  };
  std::vector<int64_t> first;  // weight j's panels are first[j] .. first[j + 1] - 1
  int64_t cols, M;
  PanelWork work;  // made from first, declared before it

  PanelItems(const std::vector<int64_t>& Ns, int64_t cols_, int64_t M_, int64_t tile_rows,
             int64_t threads = at::get_num_threads())
      : first(firsts(Ns, cols_)), cols(cols_), M(M_), work(first.back(), M_, tile_rows, threads) {}
  int64_t size() const { return work.items(first.back()); }
  Item operator[](int64_t i) const {
    const int64_t p = i / work.parts, m0 = i % work.parts * work.rows;
    const size_t j = std::upper_bound(first.begin(), first.end(), p) - first.begin() - 1;  // p's weight
    return {j, (p - first[j]) * cols, m0, std::min(M, m0 + work.rows)};
  }
  static std::vector<int64_t> firsts(const std::vector<int64_t>& Ns, int64_t cols) {
    std::vector<int64_t> out{0};
    for (int64_t N : Ns) out.push_back(out.back() + (N + cols - 1) / cols);
    return out;
  }
};

// The loop of a panel GEMM over PanelItems: for each item pack(j, n0, scratch), then
// tile(rows, j, m, n0, cols, scratch) for the item's rows in tiles of ROWS rows (rows:
// std::integral_constant<int, ROWS>) and a tail of single rows; cols = the panel's columns
// that exist.  scratch = make(), one per thread.
template <int COLS, int ROWS, typename Make, typename Pack, typename Tile>
void each_panel(const std::vector<int64_t>& Ns, int64_t M, Make make, Pack pack, Tile tile) {
  const PanelItems items(Ns, COLS, M, ROWS);
  each_item(items.size(), make, [&](auto& scratch, int64_t i) {
    const auto [j, n0, m0, m1] = items[i];
    const int cols = static_cast<int>(std::min<int64_t>(COLS, Ns[j] - n0));
    pack(j, n0, scratch);
    int64_t m = m0;
    for (; m + ROWS <= m1; m += ROWS) tile(std::integral_constant<int, ROWS>{}, j, m, n0, cols, scratch);
    for (; m < m1; ++m) tile(std::integral_constant<int, 1>{}, j, m, n0, cols, scratch);
  });
}

// out[g][c] = value(n0 + c, g) for the COLS columns of the panel at weight row n0 and the
// G groups (rows past N repeat row N - 1: they are computed, never stored).
template <int COLS, typename T, typename F>
void pack_groups(int64_t N, int64_t G, int64_t n0, T* out, F value) {
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < COLS; ++c) out[g * COLS + c] = value(std::min<int64_t>(n0 + c, N - 1), g);
}

#if defined(__AVX512F__)
// The tile's inner loop (panel_dots): acc[r][v] = sum over q < steps of dot(acc, the dword x[r * ldx + q]
// broadcast to every lane, columns 16v..16v+15 of panel row q), from zero.  Per step: NV
// loads and R broadcasts for R * NV dot products.
// panel_dots_add: the same steps added to acc as it is.
template <int R, typename Acc, typename Dot>
inline void panel_dots_add(Acc (&acc)[R][NV], const uint32_t* x, int64_t ldx, const uint32_t* panel, int64_t steps,
                           Dot dot) {
  for (int64_t q = 0; q < steps; ++q) {
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(panel + q * NP + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(x[r * ldx + q]));
      for (int v = 0; v < NV; ++v) acc[r][v] = dot(acc[r][v], a, b[v]);
    }
  }
}
template <int R, typename Acc, typename Dot>
inline void panel_dots(Acc (&acc)[R][NV], const uint32_t* x, int64_t ldx, const uint32_t* panel, int64_t steps,
                       Dot dot) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Acc{};
  panel_dots_add<R>(acc, x, ldx, panel, steps, dot);
}

// r[i] <- dword i of every r[j] (a 16 x 16 transpose of 32-bit elements).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4a + b] now holds, in its 128-bit lane L, dword 4L + b of rows 4a..4a+3; gather
  // lane L of r[b], r[4 + b], r[8 + b], r[12 + b] into r[4L + b].
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// One value per group of 16 rows laid out as [G][16] (row r in lane r), for kernels whose
// lanes are weight rows: row(r, g0, in) gives row r's values g0 .. g0 + 15 (the lanes of
// `in`, the rest zero), 16 x 16 transposes of them into out[g * 16 + r].
template <typename Row>
inline void strip_columns(int64_t G, Row row, float* out) {
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const __mmask16 in = lanes16(G - g0);
    __m512i v[16];
    for (int r = 0; r < 16; ++r) v[r] = _mm512_castps_si512(row(r, g0, in));
    transpose16(v);
    for (int64_t g = g0; g < std::min(G, g0 + 16); ++g) _mm512_storeu_si512(out + g * 16, v[g - g0]);
  }
}
#endif

#if defined(__AMX_TILE__)
// An AMX tile configuration (palette 1): tile t gets rows[t] rows of colsb[t] bytes (0: unused).
// Loaded by each thread before its first tile instruction (the configuration is per thread).
inline void load_tile_config(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } c;
  for (int t = 0; t < 8; ++t) c.rows[t] = rows[t], c.colsb[t] = colsb[t];
  // GCC 12 does not count ldtilecfg as a read of the whole 64 bytes and dropped these stores
  // (seen: only the palette byte written, then SIGILL on the first tile instruction); the
  // empty asm with a memory clobber keeps them
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}
#endif
