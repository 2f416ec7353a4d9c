// The register tile of the bf16 row-dot kernels (dense.cpp's dense_dots, gemm_bf16.cpp's
// rows of few activations): 4 weight rows, read as stored (bf16), times R <= 6 rows of x.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LOWBIT_DOTS 1
// dense_dots (a bf16 nn.Linear for the tens of rows of a batch's decode step on machines with
// AVX512-BF16 but no AMX) and gemm_bf16's rows path.  Where dense_rows is bound by its loads and widening (one weight
// vector and one float32 x vector per 16 multiply-adds) and oneDNN's bf16 linear packs the
// weight on every call, here a register tile of 4 weight rows x R <= 6 rows of x, read as
// stored, takes vdpbf16ps (32 multiply-adds each): 10 loads for 24 of them.  Output
// (m, n)'s accumulator sums, lane l, the pairs k = 32b + 2l, 32b + 2l + 1 for b = 0, 1, ..
// in order (each bf16 product exact in float32, then two float32 additions per pair,
// subnormal inputs and results flushed to zero, as the instruction defines); its 16 lanes
// are then added by one fixed tree (reduce4), whichever of the tile's slots it is in.  So
// every row is summed in one order whatever M is: a batch's row has the bits it has alone.
constexpr int kDotRows = 6;

// The sums of a, b, c, d (16 lanes each) in lanes 0, 4, 8 and 12, each by the same tree:
// the 128-bit quarters q0 + q2 and q1 + q3, those two added, then lanes l + (l ^ 1) and
// that + its neighbour (l ^ 2).
inline __m512 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // ab = [a0+a2, a1+a3, b0+b2, b1+b3] by quarters; the same for cd
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  // s = [a, b, c, d]: each quarter one output's 4 partial sums
  const __m512 t = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));  // lanes (l, l ^ 1)
  return _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));            // lanes (l, l ^ 2)
}

// R rows of x (row stride ldx, bf16) times weight rows w[0..3] (K values, a multiple of 32):
// y[i * ldy + r] for r < nw.  Prefetches the `lines` 64-byte lines from `ahead` on, spread
// over the k steps.
template <int R>
void dot_tile(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t K, float* y, int64_t ldy, int nw,
              const char* ahead, int64_t lines) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_setzero_ps();
  const int64_t steps = K / 32, per_step = (lines + steps - 1) / steps;
  for (int64_t k = 0, l = 0; k < K; k += 32) {
    __m512i wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = _mm512_loadu_si512(w[r] + k);
    for (int64_t e = std::min(lines, l + per_step); l < e; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
    for (int i = 0; i < R; ++i) {
      const __m512i xv = _mm512_loadu_si512(x + i * ldx + k);
      for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], (__m512bh)xv, (__m512bh)wv[r]);
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(64) float out[16];
    _mm512_store_ps(out, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    for (int r = 0; r < nw; ++r) y[i * ldy + r] = out[4 * r];
  }
}

using DotTile = void (*)(const uint16_t*, int64_t, const uint16_t* const*, int64_t, float*, int64_t, int,
                         const char*, int64_t);
constexpr DotTile kDotTiles[kDotRows] = {dot_tile<1>, dot_tile<2>, dot_tile<3>, dot_tile<4>, dot_tile<5>,
                                         dot_tile<6>};

// Weight rows are read 4 at a time, one contiguous block; the blocks kDotsAhead on are
// prefetched across the tiles of this one.  Prefetched only by the first tile, one block
// on, the 72 lines of 4 rows of 576 bf16 left the M = 32 tiles waiting on DRAM: 1536 x 576
// bf16, 2 threads, weights cycled through 96 MB (Zen 4): 262-451 us against 205 us in L2;
// spread over the tiles, 1 or 2 blocks on, 220-250 us (4 blocks on: 380).
constexpr int64_t kDotsAhead = 2;

// x's M rows (row stride ldx) times weight rows w[0..3] into y[m * ldy + r] for r < nw,
// kDotRows rows at a time, the `lines` lines from `ahead` on prefetched spread over the
// tiles (lines = 0: none).
inline void dot_all_rows(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* const* w, int64_t K, float* y,
                         int64_t ldy, int nw, const char* ahead, int64_t lines) {
  const int64_t tiles = (M + kDotRows - 1) / kDotRows;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m = t * kDotRows, l0 = t * lines / tiles, l1 = (t + 1) * lines / tiles;
    const int rows = static_cast<int>(std::min<int64_t>(kDotRows, M - m));
    kDotTiles[rows - 1](x + m * ldx, ldx, w, K, y + m * ldy, ldy, nw, ahead + 64 * l0, l1 - l0);
  }
}
#endif
