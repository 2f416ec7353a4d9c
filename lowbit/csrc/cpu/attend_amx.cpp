// prefill_attention's two products (decode.cpp) on AMX bf16 tiles, for bf16 caches: a work
// item's 16-row tiles of queries (one query head, 16 queries) times its keys, and its
// softmax weights times its values.
//
// Scores: tile A = 16 query rows x 32 values of d (bf16, as stored), tile B = 16 keys' pairs
// (d, d + 1) for 16 pairs (prefill_attend's key panels: kt[panel][pair][key]), C = 16 x 16
// float32 sums of the exact bf16 products (tdpbf16ps), one tile product per 32 values of d:
// hd products summed in float32 like the vdpbf16ps tile it replaces, in another order.
//
// Weights times values: each 32-position step's softmax weights e of the 16 rows are made
// in three bf16 parts (weights_step: e = hi + mid + lo + r, |r| <= 2^-24 e), A = 16 rows x 32
// positions of one part; B = 16 position pairs x 16 values of V (bf16 pairs (v[2i][d],
// v[2i + 1][d]), laid out per call); C = 16 rows x 16 values, float32 sums of the exact
// products over 3 n terms.  The tiles read bf16 subnormals as zero (DAZ): parts below
// 2^-126 are lost, at most 3 n 2^-126 max|v| a row.  The next step's weights are made while
// a step's tile products run (two part buffers).
//
// Measured on the bundled model's 512-token prefill (Xeon family 6 model 207 VM): the
// attention took 24-26% of a prefill on AVX-512 register tiles; on AMX tiles it runs
// 1.5-1.75x faster, bound by the exp and the split, not by the tiles.

#include "kernels.h"
#include "panels.h"
#include "simd.h"

#include <immintrin.h>

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__) && defined(__linux__)
#define LOWBIT_ATTEND_AMX 1
#endif

bool attend_tiles_run(int64_t hd) {
#ifdef LOWBIT_ATTEND_AMX
  return has_amx_bf16() && hd % 32 == 0 && hd <= 128;
#else
  (void)hd;
  return false;
#endif
}

#ifdef LOWBIT_ATTEND_AMX
namespace {

constexpr int TILE = 16;

// Scores of one row tile: tmm4.. hold the S 32-value chunks of the 16 query rows; key panels
// go through tmm1 / tmm3 into C tiles tmm0 / tmm2, two panels (32 keys) a step.
template <int S>
void score_tiles(const c10::BFloat16* q, const uint32_t* kt, int64_t kpad, float* s, int64_t lds) {
  constexpr int64_t panel = 16 * S * TILE;  // u32 of one 16-key panel (hd / 2 pairs x 16 keys)
  const int64_t qb = S * 32 * 2;            // bytes of a query row (hd bf16)
  _tile_loadd(4, q, qb);
  if constexpr (S > 1) _tile_loadd(5, q + 32, qb);
  if constexpr (S > 2) _tile_loadd(6, q + 64, qb);
  if constexpr (S > 3) _tile_loadd(7, q + 96, qb);
  for (int64_t j0 = 0; j0 < kpad; j0 += 2 * TILE) {
    const uint32_t* p0 = kt + (j0 / TILE) * panel;
    const uint32_t* p1 = p0 + panel;
    _tile_zero(0);
    _tile_zero(2);
#define LOWBIT_SCORE_STEP(c, a)                      \
  _tile_loadd(1, p0 + (c) * TILE * TILE, 64);        \
  _tile_loadd(3, p1 + (c) * TILE * TILE, 64);        \
  _tile_dpbf16ps(0, a, 1);                           \
  _tile_dpbf16ps(2, a, 3);
    LOWBIT_SCORE_STEP(0, 4)
    if constexpr (S > 1) { LOWBIT_SCORE_STEP(1, 5) }
    if constexpr (S > 2) { LOWBIT_SCORE_STEP(2, 6) }
    if constexpr (S > 3) { LOWBIT_SCORE_STEP(3, 7) }
#undef LOWBIT_SCORE_STEP
    _tile_stored(0, s + j0, lds * 4);
    _tile_stored(2, s + j0 + TILE, lds * 4);
  }
}

// One 32-position step of a row tile's weights: e = exp(s * scale - max) of the 16 rows at
// positions j0 .. j0 + 31 (zero from each row's len), in three bf16 parts parts[part][row][32]
// (nearest even: e = hi + mid + lo within 2^-24 e, each part 8 bits of what the ones before
// left, each difference exact in float32; vcvtneps2bf16 flushes what falls below 2^-126);
// with sum, each row's e added in 16-position chunks in order to total[row].
inline void weights_step(const float* s, int64_t lds, const int64_t* len, const float* mx, __m512 scale, int64_t j0,
                         uint16_t (*parts)[TILE][2 * TILE], __m512* total) {
  for (int r = 0; r < TILE; ++r)
    for (int h = 0; h < 2; ++h) {
      const int64_t j = j0 + h * TILE;
      const __m512 e = _mm512_maskz_mov_ps(
          lanes16(len[r] - j), exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + r * lds + j), scale), _mm512_set1_ps(mx[r]))));
      if (total) total[r] = _mm512_add_ps(total[r], e);
      const __m256bh hi = _mm512_cvtneps_pbh(e);
      const __m512 r1 = _mm512_sub_ps(e, _mm512_cvtpbh_ps(hi));
      const __m256bh mid = _mm512_cvtneps_pbh(r1);
      const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, _mm512_cvtpbh_ps(mid)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(&parts[0][r][h * TILE]), (__m256i)hi);
      _mm256_store_si256(reinterpret_cast<__m256i*>(&parts[1][r][h * TILE]), (__m256i)mid);
      _mm256_store_si256(reinterpret_cast<__m256i*>(&parts[2][r][h * TILE]), (__m256i)lo);
    }
}

// D tiles of 16 values of V from column d0 (C tiles tmm0 .. tmm(D - 1)), each 32-position
// step's weights made by weights_step into the three part tiles tmm4-6, V's pairs through
// tmm7; totals summed on the first pass over the positions (d0 = 0).
template <int D>
void value_tiles(const float* s, int64_t lds, const int64_t* len, const float* mx, float scale, const uint32_t* vt,
                 int64_t hd, int64_t kpad, int64_t d0, float* o, __m512* total) {
  alignas(64) uint16_t parts[2][3][TILE][2 * TILE];  // step j0 / 32's in parts[j0 / 32 % 2]
  const __m512 sv = _mm512_set1_ps(scale);
  _tile_zero(0);
  if constexpr (D > 1) _tile_zero(1);
  if constexpr (D > 2) _tile_zero(2);
  if constexpr (D > 3) _tile_zero(3);
  weights_step(s, lds, len, mx, sv, 0, parts[0], d0 == 0 ? total : nullptr);
  for (int64_t j0 = 0; j0 < kpad; j0 += 2 * TILE) {
    auto* now = parts[j0 / (2 * TILE) % 2];
    _tile_loadd(4, now[0], 64);
    _tile_loadd(5, now[1], 64);
    _tile_loadd(6, now[2], 64);
    const uint32_t* v = vt + (j0 / 2) * hd + d0;
#define LOWBIT_VALUE_STEP(c)                    \
  _tile_loadd(7, v + (c) * TILE, hd * 4);       \
  _tile_dpbf16ps(c, 4, 7);                      \
  _tile_dpbf16ps(c, 5, 7);                      \
  _tile_dpbf16ps(c, 6, 7);
    LOWBIT_VALUE_STEP(0)
    if constexpr (D > 1) { LOWBIT_VALUE_STEP(1) }
    if constexpr (D > 2) { LOWBIT_VALUE_STEP(2) }
    if constexpr (D > 3) { LOWBIT_VALUE_STEP(3) }
#undef LOWBIT_VALUE_STEP
    // the next step's weights while these tile products run
    if (j0 + 2 * TILE < kpad)
      weights_step(s, lds, len, mx, sv, j0 + 2 * TILE, parts[(j0 / (2 * TILE) + 1) % 2], d0 == 0 ? total : nullptr);
  }
  _tile_stored(0, o + d0, hd * 4);
  if constexpr (D > 1) _tile_stored(1, o + d0 + TILE, hd * 4);
  if constexpr (D > 2) _tile_stored(2, o + d0 + 2 * TILE, hd * 4);
  if constexpr (D > 3) _tile_stored(3, o + d0 + 3 * TILE, hd * 4);
}

}  // namespace

void attend_tiles_begin() {
  load_tile_config({TILE, TILE, TILE, TILE, TILE, TILE, TILE, TILE}, {64, 64, 64, 64, 64, 64, 64, 64});
}

void attend_tiles_end() { _tile_release(); }

void attend_row_tile(const c10::BFloat16* q, const uint32_t* kt, const uint32_t* vt, int64_t hd, int64_t kpad,
                     const int64_t* len, float scale, float* s, float* o, float* l) {
  switch (hd / 32) {
    case 1: score_tiles<1>(q, kt, kpad, s, kpad); break;
    case 2: score_tiles<2>(q, kt, kpad, s, kpad); break;
    case 3: score_tiles<3>(q, kt, kpad, s, kpad); break;
    default: score_tiles<4>(q, kt, kpad, s, kpad); break;
  }
  // each row's largest s * scale: its largest s times scale, rounded (scale > 0)
  float mx[TILE];
  for (int r = 0; r < TILE; ++r) mx[r] = len[r] > 0 ? row_max16(s + r * kpad, len[r]) * scale : 0.0f;
  __m512 total[TILE];
  for (int r = 0; r < TILE; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t d0 = 0; d0 < hd; d0 += 4 * TILE) {
    switch (std::min<int64_t>(4, (hd - d0) / TILE)) {
      case 1: value_tiles<1>(s, kpad, len, mx, scale, vt, hd, kpad, d0, o, total); break;
      case 2: value_tiles<2>(s, kpad, len, mx, scale, vt, hd, kpad, d0, o, total); break;
      case 3: value_tiles<3>(s, kpad, len, mx, scale, vt, hd, kpad, d0, o, total); break;
      default: value_tiles<4>(s, kpad, len, mx, scale, vt, hd, kpad, d0, o, total); break;
    }
  }
  for (int r = 0; r < TILE; ++r) l[r] = _mm512_reduce_add_ps(total[r]);
}

void attend_value_pairs(const c10::BFloat16* v, int64_t n, int64_t npad, int64_t hd, uint32_t* vt) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(v);
  for (int64_t i = 0; i < npad / 2; ++i)
    for (int64_t d = 0; d < hd; d += 16) {
      const __m256i z = _mm256_setzero_si256();
      const __m256i a = 2 * i < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 2 * i * hd + d)) : z;
      const __m256i b = 2 * i + 1 < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + (2 * i + 1) * hd + d)) : z;
      const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      _mm512_storeu_si512(vt + i * hd + d, pair);
    }
}

#else
// Not compiled in: attend_tiles_run says false, so prefill_attention never calls these.
void attend_tiles_begin() { TORCH_CHECK(false, "attend_tiles_begin: no AMX bf16 in this build"); }
void attend_tiles_end() {}
void attend_row_tile(const c10::BFloat16*, const uint32_t*, const uint32_t*, int64_t, int64_t, const int64_t*, float,
                     float*, float*, float*) {
  TORCH_CHECK(false, "attend_row_tile: no AMX bf16 in this build");
}
void attend_value_pairs(const c10::BFloat16*, int64_t, int64_t, int64_t, uint32_t*) {
  TORCH_CHECK(false, "attend_value_pairs: no AMX bf16 in this build");
}
#endif
