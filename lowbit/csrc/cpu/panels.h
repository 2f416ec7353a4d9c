// What the panel GEMMs (gemm_bf16.cpp, gemm_int8.cpp) share: the panel layout and its
// register tile, how their work is split between threads, and the 16 x 16 transpose that
// lays 16 rows of a weight out as the 16 lanes of a vector.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
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
struct PanelWork {
  int64_t parts, rows;  // rows per part: a multiple of the tile height
  PanelWork(int64_t panels, int64_t M, int64_t tile_rows, int64_t threads) {
    const int64_t want = panels >= 4 * threads ? 1 : (4 * threads + panels - 1) / panels;
    const int64_t tiles = (M + tile_rows - 1) / tile_rows;
    parts = std::max<int64_t>(1, std::min(want, tiles / 4));  // at least 4 tiles per part
    rows = (tiles + parts - 1) / parts * tile_rows;
    parts = (M + rows - 1) / rows;
  }
  int64_t items(int64_t panels) const { return panels * parts; }
};

#if defined(__AVX512F__)
// The tile's inner loop: acc[r][v] = sum over q < steps of dot(acc, the dword x[r * ldx + q]
// broadcast to every lane, columns 16v..16v+15 of panel row q), from zero.  Per step: NV
// loads and R broadcasts for R * NV dot products.
template <int R, typename Acc, typename Dot>
inline void panel_dots(Acc (&acc)[R][NV], const uint32_t* x, int64_t ldx, const uint32_t* panel, int64_t steps,
                       Dot dot) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Acc{};
  for (int64_t q = 0; q < steps; ++q) {
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(panel + q * NP + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(x[r * ldx + q]));
      for (int v = 0; v < NV; ++v) acc[r][v] = dot(acc[r][v], a, b[v]);
    }
  }
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
#endif
