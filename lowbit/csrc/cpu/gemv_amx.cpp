// W4A16 for a few rows of bf16 x on AMX bf16 tiles (gemv_bf16_amx): gemv_bf16.cpp's
// arithmetic with the products on tiles.  On the AMX Xeon this project measures on, a
// vdpbf16ps of 32 products takes about as long as four float32 FMAs of 16 (eight
// independent chains: 0.78 ns per vdpbf16ps, 0.20 ns per vfmadd231ps, one thread), so
// gemv_bf16 waits on it and on the shifts that feed it, and at M rows it does all that M
// times; a tile product takes 16 weight rows x 32 values for up to 16 rows of x at once,
// while the vector ports only turn the codes into bf16, once for all the rows of x.
//
// Codes as bf16 without scaling: the bf16 with bits 0x4300 | u is exactly 128 + u, so each
// code byte b of a weight row, widened to a 16-bit lane, gives two bf16 numbers with one
// vpternlogd each ((b & 0xF) | 0x4300 and ((b >> 4) & 0xF) | 0x4300; signed codes read as
// u = q + 8, the xor folded into the same instruction).  The A tiles hold 16 weight rows of
// those; the B tiles the rows of x as bf16 pairs, laid out once per call to match; one C
// tile sums a group's exact float32 products (the low nibbles' tile, then the high ones'),
// and per group
//   y = fnmadd(s (128 + z), sum_k x_k, fma(s, C, y))     (signed codes: 136 for 128 + z)
// in float32, x's group sums taken over the bf16 values the tiles multiply; in the "min"
// domain (q * s + m) the factor of sum_k x_k is 128 s - m (gemv_bf16.cpp's).  The same
// quantities as gemv_bf16 in another order: tdpbf16ps adds each product to the float32 sum
// in turn and treats subnormal bf16 inputs as zero (so x is rounded to bf16 with its
// subnormals flushed, as gemv_bf16's prepare does).
//
// Tile steps: one step converts the codes of 16 weight rows x 64 values (32 bytes a row:
// vpmovzxbw, two vpternlogd) into two A tiles, low nibbles (values 2j) and high nibbles
// (2j + 1), for groups that are multiples of 64; for groups of 32 a step is 32 values and
// one A tile, lows then highs.  The stores of a step's A tiles and its tile loads are kept
// two steps apart (a ring of four A buffers): a tile load that follows the vector stores of
// its rows at once waits for them to drain, and the conversion and the tile products then
// take turns instead of overlapping (a standalone version, 1536 x 576 at one row, one
// thread: 7.6 ns per 128 values one step apart, 3.8 two steps apart).  Each group's C tile
// is stored and scaled one step later, for the same reason.  Per step the tile loads, the
// C store and the A stores are ~130 memory operations for 16 x 64 codes: at one row of x
// that is where the time goes (level with gemv_bf16 there), from 3 rows on it is shared.
//
// 16 rows of x per pass over the weights.  Every output is the same sequence of tile
// products and float32 operations whatever M, its column in the tiles, its row in the A
// tile and the thread: the same bits.

#include "balance.h"
#include "kernels.h"
#include "panels.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512BF16__) && defined(__linux__)
#define LOWBIT_GEMV_AMX 1
#endif

namespace {

#ifdef LOWBIT_GEMV_AMX
constexpr int TILE = 16;
constexpr int64_t kPassRows = TILE;  // rows of x per pass over the weights: one C tile of columns
constexpr int kRing = 4;             // A buffers: step i + kAhead converted while step i's tiles run
constexpr int kAhead = 2;

// A thread's tile configuration, released when its items are done.  tmm0: C (16 weight
// rows x `columns` rows of x); tmm2-3: A (low, high nibbles); tmm4-5: B (low, high).
struct TileConfig {
  explicit TileConfig(int64_t columns) {
    const uint16_t cb = static_cast<uint16_t>(4 * columns);
    const uint8_t rows[8] = {TILE, 0, TILE, TILE, TILE, TILE, 0, 0};
    const uint16_t colsb[8] = {cb, 0, 64, 64, cb, cb, 0, 0};
    load_tile_config(rows, colsb);
  }
  ~TileConfig() { _tile_release(); }
  TileConfig(const TileConfig&) = delete;
  TileConfig& operator=(const TileConfig&) = delete;
};

// A thread's buffers, kept between calls.
struct Buffers {
  alignas(64) uint16_t a[kRing][2][TILE * 32];  // A tiles (rows past a weight's end: its last row)
  alignas(64) float c[2][TILE * TILE];          // C as stored, by the parity of its group
  std::vector<float> scale, offsets;            // one row of x: a strip's s and offset_factor, [G][16]
};
Buffers& buffers() {
  thread_local Buffers b;
  return b;
}

// x [M, K] as the B tiles read it: step t (of `width` values, 64 or 32) has `halves` B tiles,
// [16 pairs][columns] of bf16 pairs, pair p of half h being the values in A columns 2p and
// 2p + 1 of the step (see convert); column m holds row m of x.  Columns: 1 for one row of x
// (C then stores as 16 contiguous floats, one per weight row), else 16, zero past M (C as
// [weight row][16 columns]).  Also x's group sums over the same bf16 values, xsum[g * 16 + m]
// (zero past M).
struct Prepared {
  const uint32_t* b;
  const float* xsum;
};

// The words of 64 (32) consecutive bf16 values that pairs p = 0..15 of half h take: A column
// j holds value 2j + h of a 64-value step; a 32-value step has one tile, its 16 bytes' low
// nibbles in columns 0-15 and high ones in 16-31 (values 2j and 2(j - 16) + 1).
inline __m512i pair_index(int64_t width, int h) {
  alignas(64) uint16_t idx[32];
  for (int j = 0; j < 32; ++j) idx[j] = static_cast<uint16_t>(width == 64 ? 2 * j + h : j < 16 ? 2 * j : 2 * (j - 16) + 1);
  return _mm512_load_si512(idx);
}

inline int64_t columns(int64_t M) { return M == 1 ? 1 : TILE; }

Prepared prepare(const float* x, int64_t M, int64_t K, int64_t group, int64_t width) {
  thread_local std::vector<uint16_t> rows_keep;
  thread_local std::vector<uint32_t> b_keep;
  thread_local std::vector<float> sum_keep;
  const int halves = width == 64 ? 2 : 1;
  const int64_t steps = K / width, G = K / group;
  uint16_t* rows = grown(rows_keep, M * K);
  const int64_t cols = columns(M);
  uint32_t* b = grown(b_keep, steps * halves * TILE * cols);
  float* xsum = grown(sum_keep, G * TILE);
  std::fill(xsum, xsum + G * TILE, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    uint16_t* row = rows + m * K;
    // vcvtneps2bf16: to nearest even, subnormals to zero (which tdpbf16ps reads as zero)
    for (int64_t k = 0; k < K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xm + k)));
    for (int64_t g = 0; g < G; ++g) {
      __m512 t = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 16) t = _mm512_add_ps(t, bf16x16(row + k));
      xsum[g * TILE + m] = _mm512_reduce_add_ps(t);
    }
  }
  for (int h = 0; h < halves; ++h) {
    const __m512i idx = pair_index(width, h);
    for (int64_t t = 0; t < steps; ++t) {
      uint32_t* out = b + (t * halves + h) * TILE * cols;
      const auto pairs = [&](int64_t m) {  // the 16 pairs of row m, pair p in dword p
        const uint16_t* v = rows + m * K + t * width;
        return width == 64 ? _mm512_permutex2var_epi16(_mm512_loadu_si512(v), idx, _mm512_loadu_si512(v + 32))
                           : _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(v));
      };
      if (M == 1) {
        _mm512_storeu_si512(out, pairs(0));
        continue;
      }
      __m512i r[TILE];  // r[m]: row m's pairs
      for (int m = 0; m < TILE; ++m) r[m] = m < M ? pairs(m) : _mm512_setzero_si512();
      transpose16(r);  // r[p]: pair p of every row
      for (int p = 0; p < TILE; ++p) _mm512_storeu_si512(out + p * TILE, r[p]);
    }
  }
  return {b, xsum};
}

// The codes of step t of 16 weight rows (row r at w + row[r]) as bf16 128 + u into a[0]
// (and a[1]): low nibbles of a row's bytes, then high ones (see pair_index).
template <bool SIGNED, int64_t WIDTH>
inline void convert(const uint8_t* const* row, int64_t t, uint16_t (*a)[TILE * 32]) {
  const __m512i low = _mm512_set1_epi16(0x000F), base = _mm512_set1_epi16(SIGNED ? 0x4308 : 0x4300);
#pragma GCC unroll 16
  for (int r = 0; r < TILE; ++r) {
    const uint8_t* p = row[r] + t * (WIDTH / 2);
    if constexpr (WIDTH == 64) {
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      _mm512_store_si512(a[0] + r * 32, _mm512_ternarylogic_epi32(b, low, base, 0x6A));  // (b & low) ^ base
      _mm512_store_si512(a[1] + r * 32, _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), low, base, 0x6A));
    } else {
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256i l = _mm512_castsi512_si256(low), s = _mm512_castsi512_si256(base);
      const __m256i lo = _mm256_ternarylogic_epi32(b, l, s, 0x6A);
      const __m256i hi = _mm256_ternarylogic_epi32(_mm256_srli_epi16(b, 4), l, s, 0x6A);
      _mm512_store_si512(a[0] + r * 32, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    }
  }
}

// One row of x: a strip's scales, and for unsigned codes offset_factor(s, z), as [G][16 weight rows]
// (row n[r] in lane r): 16 x 16 transposes of the rows' [G] values.
template <bool SIGNED>
void strip_scales(const float* s, const float* z, bool min, int64_t G, const int64_t* n, float* scale,
                  float* offsets) {
  strip_columns(G, [&](int r, int64_t g0, __mmask16 in) { return _mm512_maskz_loadu_ps(in, s + n[r] * G + g0); },
                scale);
  if (!SIGNED)
    strip_columns(G, [&](int r, int64_t g0, __mmask16 in) {
      return offset_factor(_mm512_maskz_loadu_ps(in, s + n[r] * G + g0), _mm512_maskz_loadu_ps(in, z + n[r] * G + g0),
                           min);
    }, offsets);
}

// Weight rows n0 .. n1 - 1 of wt times the prepared x: y[m * N + n], strips of 16 weight rows
// one after another, their steps in one pipeline.
template <bool SIGNED, int64_t WIDTH>
void weight_rows(const PackedWeight& wt, const Prepared& xp, int64_t M, int64_t K, int64_t group, int64_t n0,
                 int64_t n1) {
  constexpr int H = WIDTH == 64 ? 2 : 1;
  Buffers& bf = buffers();
  const int64_t N = wt.N, G = K / group, S = K / WIDTH, per_group = group / WIDTH;
  const int64_t strips = (n1 - n0 + TILE - 1) / TILE, steps = strips * S;
  if (strips <= 0) return;
  float* scale = grown(bf.scale, G * TILE);
  float* offsets = grown(bf.offsets, G * TILE);  // (unsigned codes)
  uint16_t(*ring)[2][TILE * 32] = bf.a;  // (TLS addresses taken once: not per step)
  float(*cbuf)[TILE * TILE] = bf.c;
  const auto rows_of = [&](int64_t strip) { return std::min<int64_t>(TILE, n1 - n0 - strip * TILE); };
  // weight row r of a strip (rows past the end: its last)
  const auto row_index = [&](int64_t strip, int r) {
    return n0 + strip * TILE + std::min<int64_t>(r, rows_of(strip) - 1);
  };
  // Steps are counted as they go (no division per step: a 64-bit idiv costs about as much as
  // a step's conversion of 16 x 64 codes).
  const uint8_t* row[TILE];  // the rows of the strip being converted
  int64_t conv_strip = 0, conv_t = 0, conv_slot = 0;
  const auto set_rows = [&] {
    for (int r = 0; r < TILE; ++r) row[r] = wt.w + row_index(conv_strip, r) * (K / 2);
  };
  // The next strip's codes (16 rows side by side: one block of 16 K / 2 bytes) are fetched
  // into the L1 a part per step while this strip's are converted: the weights of a decode
  // step stream from the L3 or DRAM, and 16 rows read 32 bytes at a time are 16 streams that
  // the hardware prefetcher follows late (amx_linear.cpp's blocks fetch ahead the same way).
  const int64_t lines = (TILE * (K / 2) / 64 + S - 1) / S;  // per step
  const auto convert_next = [&] {
    const char* next = reinterpret_cast<const char*>(wt.w + (n0 + (conv_strip + 1) * TILE) * (K / 2));
    for (int64_t l = conv_t * lines; l < (conv_t + 1) * lines; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
    convert<SIGNED, WIDTH>(row, conv_t, ring[conv_slot]);
    conv_slot = (conv_slot + 1) % kRing;
    if (++conv_t == S && ++conv_strip < strips) conv_t = 0, set_rows();
  };
  const float* s = static_cast<const float*>(wt.s);
  const float* z = static_cast<const float*>(wt.z);
  int64_t n[TILE];  // the weight rows of the strip being finished (row_index)
  __m512 total[TILE];  // one row: lanes are the strip's weight rows (total[0]); else [weight row][column]
  const auto begin_strip = [&](int64_t strip) {
    for (int r = 0; r < TILE; ++r) n[r] = row_index(strip, r);
    if (M == 1) strip_scales<SIGNED>(s, z, wt.min, G, n, scale, offsets);
    for (int r = 0; r < TILE; ++r) total[r] = _mm512_setzero_ps();
  };
  // Group g of a strip ended, its sums in cbuf[parity]: scaled into the totals (per weight row
  // and row of x, the same operations for one row or more: fma(s, C, total), then
  // fnmadd(offset_factor, xsum, total)), and after its last group its outputs stored.
  struct Ended {
    int64_t strip, g, parity;
  };
  const auto finish = [&](const Ended& e) {
    const float* c = cbuf[e.parity];
    const int64_t g = e.g;
    if (M == 1) {
      const __m512 sv = _mm512_loadu_ps(scale + g * TILE);
      const __m512 ov = SIGNED ? _mm512_mul_ps(sv, _mm512_set1_ps(136.f)) : _mm512_loadu_ps(offsets + g * TILE);
      total[0] = _mm512_fmadd_ps(sv, _mm512_load_ps(c), total[0]);
      total[0] = _mm512_fnmadd_ps(ov, _mm512_set1_ps(xp.xsum[g * TILE]), total[0]);
    } else {
      const __m512 xs = _mm512_loadu_ps(xp.xsum + g * TILE);
      for (int r = 0; r < TILE; ++r) {
        const float sr = s[n[r] * G + g], o = SIGNED ? sr * 136.f : offset_factor(sr, z[n[r] * G + g], wt.min);
        total[r] = _mm512_fmadd_ps(_mm512_set1_ps(sr), _mm512_load_ps(c + r * TILE), total[r]);
        total[r] = _mm512_fnmadd_ps(_mm512_set1_ps(o), xs, total[r]);
      }
    }
    if (g < G - 1) return;  // the strip goes on
    const int64_t nb = n0 + e.strip * TILE;
    const __mmask16 valid = lanes16(rows_of(e.strip));
    if (M == 1) {
      _mm512_mask_storeu_ps(wt.y + nb, valid, total[0]);
    } else {
      __m512i t[TILE];
      for (int r = 0; r < TILE; ++r) t[r] = _mm512_castps_si512(total[r]);
      transpose16(t);  // t[m]: column m of every weight row
      for (int64_t m = 0; m < M; ++m) _mm512_mask_storeu_ps(wt.y + m * N + nb, valid, _mm512_castsi512_ps(t[m]));
    }
    if (e.strip + 1 < strips) begin_strip(e.strip + 1);
  };
  set_rows();
  begin_strip(0);
  for (int64_t i = 0; i < std::min<int64_t>(kAhead, steps); ++i) convert_next();
  const int64_t cols = columns(M), bstride = 4 * cols;
  Ended pending{0, 0, 0};
  bool waiting = false;  // pending's C tile waits to be scaled
  int64_t slot = 0, parity = 0;
  for (int64_t strip = 0, left = steps; strip < strips; ++strip)
    for (int64_t t = 0, g = 0, in_group = 0; t < S; ++t, --left) {
      if (left > kAhead) convert_next();
      if (in_group == 0) _tile_zero(0);
      const uint32_t* b = xp.b + t * H * TILE * cols;
      _tile_loadd(2, ring[slot][0], 64);
      _tile_loadd(4, b, bstride);
      _tile_dpbf16ps(0, 2, 4);
      if constexpr (H == 2) {  // the high nibbles into the same C: one chain, one C store a group
        _tile_loadd(3, ring[slot][1], 64);
        _tile_loadd(5, b + TILE * cols, bstride);
        _tile_dpbf16ps(0, 3, 5);
      }
      slot = (slot + 1) % kRing;
      if (waiting) finish(pending), waiting = false;
      if (++in_group < per_group) continue;
      _tile_stored(0, cbuf[parity], bstride);
      pending = Ended{strip, g, parity};
      waiting = true;
      parity ^= 1, ++g, in_group = 0;
    }
  if (waiting) finish(pending);
}
#endif

}  // namespace

// Whether gemv_bf16_amx runs here for this shape: AMX bf16 usable, groups of 32 or of a
// multiple of 64 that divide K.
bool gemv_bf16_amx_supported(int64_t K, int64_t group) {
#ifdef LOWBIT_GEMV_AMX
  return has_amx_bf16() && K > 0 && group > 0 && K % group == 0 && (group == 32 || group % 64 == 0);
#else
  (void)K, (void)group;
  return false;
#endif
}

void gemv_bf16_amx_into(const float* x, int64_t M, int64_t K, int64_t group, const std::vector<PackedWeight>& weights) {
  TORCH_CHECK(gemv_bf16_amx_supported(K, group), "lowbit._C.weight_only_gemv_bf16_amx: needs AMX bf16 tiles and groups "
                                                 "of 32 or of a multiple of 64 that divide K");
  for (const PackedWeight& wt : weights)
    TORCH_CHECK(!wt.half && wt.min == weights[0].min && (wt.z != nullptr) == (weights[0].z != nullptr),
                "lowbit._C.weight_only_gemv_bf16_amx: float32 scales expected, and zero points (or the \"min\" "
                "domain's mins) on all weights or none");
#ifdef LOWBIT_GEMV_AMX
  const int64_t width = group % 64 == 0 ? 64 : 32;
  const bool is_signed = weights[0].z == nullptr;
  thread_local std::vector<PackedWeight> part;
  for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {  // 16 rows of x at a time, each a pass over the weights
    const int64_t rows = std::min(kPassRows, M - m0);
    part.assign(weights.begin(), weights.end());
    for (PackedWeight& wt : part) wt.y += m0 * wt.N;
    const Prepared xp = prepare(x + m0 * K, rows, K, group, width);
    // chunks of 64 weight rows: four strips of 16 per pipeline
    parallel_weight_rows(part, 64, [&] { return TileConfig(columns(rows)); },
                         [&](TileConfig&, const PackedWeight& wt, int64_t n0, int64_t n1) {
                           if (is_signed && width == 64) weight_rows<true, 64>(wt, xp, rows, K, group, n0, n1);
                           else if (is_signed) weight_rows<true, 32>(wt, xp, rows, K, group, n0, n1);
                           else if (width == 64) weight_rows<false, 64>(wt, xp, rows, K, group, n0, n1);
                           else weight_rows<false, 32>(wt, xp, rows, K, group, n0, n1);
                         });
  }
#else
  (void)x, (void)M;
#endif
}

// x float32 [M, K] (rounded to bf16: exact for bf16 activations); codes int32 [N, K/8];
// scale, zero_point float32 [N, G] (zero_point_min: the "min" domain's m, q * s + m).
at::Tensor weight_only_gemv_bf16_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                     const c10::optional<at::Tensor>& zero_point, int64_t group,
                                     bool zero_point_min) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
              "lowbit._C.weight_only_gemv_bf16_amx: contiguous float32 x [M, K] expected");
  std::vector<at::Tensor> ys;
  const std::vector<PackedWeight> weights =
      packed_weights("lowbit._C.weight_only_gemv_bf16_amx", x, {codes}, {scale}, {zero_point}, 4, group, ys,
                     zero_point_min);
  gemv_bf16_amx_into(x.data_ptr<float>(), x.size(0), x.size(1), group, weights);
  return ys[0];
}
