// W4A16 for up to 32 rows of bf16 x on AMX bf16 tiles (gemv_bf16_amx): gemv_bf16.cpp's
// arithmetic with the dot products on tiles.  On the AMX Xeon this project measures on,
// vdpbf16ps takes two cycles of the vector ports per 32 products, so gemv_bf16's blocks
// wait on it; a tile product takes the weights' 16 rows x 32 values at once on its own unit
// while the vector ports only turn codes into bf16.
//
// Codes as bf16 without scaling: the bf16 with bits 0x4300 | u is exactly 128 + u, so each
// code byte b of a weight row, widened to a 16-bit lane, gives two bf16 numbers with one
// vpternlogd each ((b & 0xF) | 0x4300 and ((b >> 4) & 0xF) | 0x4300; signed codes read as
// u = q + 8, the xor folded into the same instruction).  The A tiles hold 16 weight rows of
// those; the B tiles the rows of x as bf16 pairs, laid out once per call to match; the C
// tiles sum the exact float32 products per group, and per group
//   y += s * (C - (128 + z) * sum_k x_k)     (z = 8 for signed codes, offset 136)
// in float32, x's group sums taken over the bf16 values the tiles multiply.  The same
// operations as gemv_bf16 in another order: tdpbf16ps adds each product to the float32 sum
// in turn and treats subnormal bf16 inputs as zero (so x is rounded to bf16 with its
// subnormals flushed, as gemv_bf16's prepare does).
//
// Tile steps: one step converts the codes of 16 weight rows x 64 values (32 bytes a row:
// vpmovzxbw, two vpternlogd) into two A tiles, low nibbles (values 2j) and high nibbles
// (2j + 1), for groups that are multiples of 64; for groups of 32 a step is 32 values and
// one A tile, lows then highs.  The stores of a step's A tiles and its tile loads are kept
// two steps apart (a ring of four A buffers): a tile load that follows the vector stores of
// its rows at once waits for them to drain, and the conversion and the tile products then
// take turns instead of overlapping (1536 x 576 at one row: 7.6 ns per 128 values one step
// apart, 3.8 two steps apart; gemv_bf16 5.7).  Each group's C tiles are stored and scaled
// one step later, for the same reason.
//
// Every output is the same sequence of tile products and float32 operations whatever M,
// its column in the tiles, its row in the A tile and the thread: the same bits.

#include "balance.h"
#include "kernels.h"
#include "panels.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512BF16__) && defined(__linux__)
#define LOWBIT_GEMV_AMX 1
#endif

namespace {

#ifdef LOWBIT_GEMV_AMX
constexpr int TILE = 16;
constexpr int64_t kMaxRows = 2 * TILE;  // rows of x: two C tiles of 16 columns
constexpr int kRing = 4;                // A buffers: step i + kAhead converted while step i's tiles run
constexpr int kAhead = 2;

// Per thread: the tile configuration for M rows of x and the buffers the tiles read.
// tmm0-1: C (16 weight rows x columns 0-15 / 16-31 of x's rows); tmm2-3: A (low, high
// nibbles); tmm4-5: B of columns 0-15 (low, high), tmm6-7: B of columns 16-31.
struct Tiles {
  explicit Tiles(int64_t M) {
    const uint8_t two = M > TILE ? TILE : 0;
    const uint16_t c0 = static_cast<uint16_t>(4 * std::min<int64_t>(M, TILE));
    const uint16_t c1 = static_cast<uint16_t>(M > TILE ? 4 * (M - TILE) : 0);
    const uint8_t rows[8] = {TILE, two, TILE, TILE, TILE, TILE, two, two};
    const uint16_t colsb[8] = {c0, c1, 64, 64, c0, c0, c1, c1};
    load_tile_config(rows, colsb);
    std::memset(a, 0, sizeof(a));  // rows past a weight's end are read, never stored: finite
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  alignas(64) uint16_t a[kRing][2][TILE * 32];
  alignas(64) float c[2][2][TILE * TILE];  // [group parity][C tile], as stored
  alignas(64) float total[2][TILE][TILE];   // M > 1: [C tile][weight row][column]
};

// x [M, K] as the B tiles read it.  Step t (of `width` values: 64 or 32) has `halves` B
// tiles, each [16 pairs][M columns] of bf16 pairs: pair p of half h is A columns 2p and
// 2p + 1, which hold values column_k(2p) and column_k(2p + 1) of the step.  Also x's group
// sums over the same bf16 values: xsum[g * kMaxRows + m] (zero past M).
struct Prepared {
  const uint32_t* b;
  const float* xsum;
};

// Value of the step (0 .. width - 1) in column j of A half h: 64-value steps hold values
// 2j + h; 32-value steps one tile, the low nibbles of its 16 bytes in columns 0-15, the high
// ones in 16-31.
inline int64_t column_k(int64_t width, int h, int64_t j) {
  return width == 64 ? 2 * j + h : 2 * (j % 16) + j / 16;
}

Prepared prepare(const float* x, int64_t M, int64_t K, int64_t group, int64_t width) {
  thread_local std::vector<uint16_t> row_keep;
  thread_local std::vector<uint32_t> b_keep;
  thread_local std::vector<float> sum_keep;
  const int64_t halves = width == 64 ? 2 : 1, steps = K / width, G = K / group;
  uint16_t* row = grown(row_keep, K);
  uint32_t* b = grown(b_keep, steps * halves * TILE * M);
  float* xsum = grown(sum_keep, G * kMaxRows);
  std::fill(xsum, xsum + G * kMaxRows, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    // vcvtneps2bf16: to nearest even, subnormals to zero (which tdpbf16ps reads as zero)
    for (int64_t k = 0; k < K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xm + k)));
    for (int64_t g = 0; g < G; ++g) {
      __m512 t = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 16)
        t = _mm512_add_ps(t, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k))),
                                 16)));
      xsum[g * kMaxRows + m] = _mm512_reduce_add_ps(t);
    }
    for (int64_t t = 0; t < steps; ++t)
      for (int h = 0; h < halves; ++h)
        for (int64_t p = 0; p < TILE; ++p) {
          const uint16_t* v = row + t * width;
          b[((t * halves + h) * TILE + p) * M + m] =
              v[column_k(width, h, 2 * p)] | static_cast<uint32_t>(v[column_k(width, h, 2 * p + 1)]) << 16;
        }
  }
  return {b, xsum};
}

// Codes of step t of 16 weight rows (rows of the chunk from `w`, `rows` of them, K / 2 bytes
// apart) as bf16 128 + u into a[0] (and a[1]).
template <bool SIGNED, int64_t WIDTH>
inline void convert(const uint8_t* w, int64_t K, int rows, int64_t t, uint16_t (*a)[TILE * 32]) {
  const __m512i low = _mm512_set1_epi16(0x000F), base = _mm512_set1_epi16(SIGNED ? 0x4308 : 0x4300);
  const uint8_t* p = w + t * (WIDTH / 2);
  for (int r = 0; r < rows; ++r, p += K / 2) {
    if constexpr (WIDTH == 64) {
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      _mm512_store_si512(a[0] + r * 32, _mm512_ternarylogic_epi32(b, low, base, 0x6A));  // (b & low) ^ base
      _mm512_store_si512(a[1] + r * 32, _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), low, base, 0x6A));
    } else {
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256i l = _mm512_castsi512_si256(low), s = _mm512_castsi512_si256(base);
      _mm256_store_si256(reinterpret_cast<__m256i*>(a[0] + r * 32), _mm256_ternarylogic_epi32(b, l, s, 0x6A));
      _mm256_store_si256(reinterpret_cast<__m256i*>(a[0] + r * 32 + 16),
                         _mm256_ternarylogic_epi32(_mm256_srli_epi16(b, 4), l, s, 0x6A));
    }
  }
}

// Weight rows n0 .. n1 - 1 of wt times the prepared x: y[m * N + n].  Steps run over the
// chunk's strips of 16 rows, strip after strip.
template <bool SIGNED, int64_t WIDTH>
void weight_rows(Tiles& tl, const PackedWeight& wt, const Prepared& xp, int64_t M, int64_t K, int64_t group,
                 int64_t n0, int64_t n1) {
  constexpr int H = WIDTH == 64 ? 2 : 1;
  const int64_t N = wt.N, G = K / group, S = K / WIDTH, per_group = group / WIDTH;
  const int64_t strips = (n1 - n0 + TILE - 1) / TILE, steps = strips * S;
  const bool two = M > TILE;
  const float* s = static_cast<const float*>(wt.s);
  const float* z = static_cast<const float*>(wt.z);
  const int64_t bstride = 4 * M;  // bytes from one B row (pair) to the next
  const auto rows_of = [&](int64_t strip) { return static_cast<int>(std::min<int64_t>(TILE, n1 - n0 - strip * TILE)); };
  const auto convert_step = [&](int64_t i) {
    const int64_t strip = i / S;
    convert<SIGNED, WIDTH>(wt.w + (n0 + strip * TILE) * (K / 2), K, rows_of(strip), i % S, tl.a[i % kRing]);
  };
  __m512 total1 = _mm512_setzero_ps();  // M = 1: lanes are the strip's weight rows
  if (M > 1) std::memset(tl.total, 0, sizeof(tl.total));
  // the group that ended at step i: scaled into the totals, and a strip's outputs stored
  const auto finish = [&](int64_t i) {
    const int64_t strip = i / S, g = i % S / per_group, parity = i / per_group % 2;
    const int rows = rows_of(strip);
    const int64_t nb = n0 + strip * TILE;
    if (M == 1) {
      alignas(64) float sv[TILE], ov[TILE];
      for (int r = 0; r < TILE; ++r) {
        const int64_t n = nb + std::min(r, rows - 1);  // rows past the end repeat the last: finite
        sv[r] = s[n * G + g];
        ov[r] = sv[r] * ((z ? z[n * G + g] : 0.f) + (SIGNED ? 136.f : 128.f));
      }
      const __m512 c = _mm512_load_ps(tl.c[parity][0]);
      total1 = _mm512_fmadd_ps(_mm512_load_ps(sv), c, total1);
      total1 = _mm512_fnmadd_ps(_mm512_load_ps(ov), _mm512_set1_ps(xp.xsum[g * kMaxRows]), total1);
    } else {
      for (int ct = 0; ct < (two ? 2 : 1); ++ct) {
        const __m512 xs = _mm512_loadu_ps(xp.xsum + g * kMaxRows + ct * TILE);
        for (int r = 0; r < rows; ++r) {
          const int64_t n = nb + r;
          const float sc = s[n * G + g], off = sc * ((z ? z[n * G + g] : 0.f) + (SIGNED ? 136.f : 128.f));
          __m512 t = _mm512_load_ps(tl.total[ct][r]);
          t = _mm512_fmadd_ps(_mm512_set1_ps(sc), _mm512_load_ps(tl.c[parity][ct] + r * TILE), t);
          _mm512_store_ps(tl.total[ct][r], _mm512_fnmadd_ps(_mm512_set1_ps(off), xs, t));
        }
      }
    }
    if (i % S != S - 1) return;  // the strip goes on
    if (M == 1) {
      _mm512_mask_storeu_ps(wt.y + nb, lanes16(rows), total1);
      total1 = _mm512_setzero_ps();
    } else {
      for (int64_t m = 0; m < M; ++m)
        for (int r = 0; r < rows; ++r) wt.y[m * N + nb + r] = tl.total[m / TILE][r][m % TILE];
      std::memset(tl.total, 0, sizeof(tl.total));
    }
  };
  for (int64_t i = 0; i < std::min<int64_t>(kAhead, steps); ++i) convert_step(i);
  int64_t pending = -1;  // a group's last step whose C tiles wait to be scaled
  for (int64_t i = 0; i < steps; ++i) {
    if (i + kAhead < steps) convert_step(i + kAhead);
    const int64_t t = i % S;
    if (t % per_group == 0) {
      _tile_zero(0);
      if (two) _tile_zero(1);
    }
    const uint16_t(*a)[TILE * 32] = tl.a[i % kRing];
    const uint32_t* b = xp.b + t * H * TILE * M;
    _tile_loadd(2, a[0], 64);
    _tile_loadd(4, b, bstride);
    _tile_dpbf16ps(0, 2, 4);
    if (two) {
      _tile_loadd(6, b + TILE, bstride);
      _tile_dpbf16ps(1, 2, 6);
    }
    if constexpr (H == 2) {
      _tile_loadd(3, a[1], 64);
      _tile_loadd(5, b + TILE * M, bstride);
      _tile_dpbf16ps(0, 3, 5);
      if (two) {
        _tile_loadd(7, b + TILE * M + TILE, bstride);
        _tile_dpbf16ps(1, 3, 7);
      }
    }
    if (pending >= 0) finish(pending), pending = -1;
    if (t % per_group == per_group - 1) {
      const int64_t parity = i / per_group % 2;
      _tile_stored(0, tl.c[parity][0], M == 1 ? 4 : 64);
      if (two) _tile_stored(1, tl.c[parity][1], 64);
      pending = i;
    }
  }
  if (pending >= 0) finish(pending);
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
    TORCH_CHECK(!wt.half && !wt.min && (wt.z != nullptr) == (weights[0].z != nullptr),
                "lowbit._C.weight_only_gemv_bf16_amx: float32 scales and zero points on all weights or none expected "
                "(not float16, not the \"min\" domain)");
#ifdef LOWBIT_GEMV_AMX
  const int64_t width = group % 64 == 0 ? 64 : 32;
  const bool is_signed = weights[0].z == nullptr;
  thread_local std::vector<PackedWeight> part;
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {  // 32 rows of x at a time, each a pass over the weights
    const int64_t rows = std::min(kMaxRows, M - m0);
    part.assign(weights.begin(), weights.end());
    for (PackedWeight& wt : part) wt.y += m0 * wt.N;
    const Prepared xp = prepare(x + m0 * K, rows, K, group, width);
    // chunks of 64 weight rows: four strips of 16 per pipeline
    parallel_weight_rows(part, 64, [&] { return std::make_unique<Tiles>(rows); },
                         [&](std::unique_ptr<Tiles>& tl, const PackedWeight& wt, int64_t n0, int64_t n1) {
                           if (is_signed && width == 64) weight_rows<true, 64>(*tl, wt, xp, rows, K, group, n0, n1);
                           else if (is_signed) weight_rows<true, 32>(*tl, wt, xp, rows, K, group, n0, n1);
                           else if (width == 64) weight_rows<false, 64>(*tl, wt, xp, rows, K, group, n0, n1);
                           else weight_rows<false, 32>(*tl, wt, xp, rows, K, group, n0, n1);
                         });
  }
#else
  (void)x, (void)M;
#endif
}

// x float32 [M, K] (rounded to bf16: exact for bf16 activations); codes int32 [N, K/8];
// scale, zero_point float32 [N, G].
at::Tensor weight_only_gemv_bf16_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                     const c10::optional<at::Tensor>& zero_point, int64_t group) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
              "lowbit._C.weight_only_gemv_bf16_amx: contiguous float32 x [M, K] expected");
  std::vector<at::Tensor> ys;
  const std::vector<PackedWeight> weights =
      packed_weights("lowbit._C.weight_only_gemv_bf16_amx", x, {codes}, {scale}, {zero_point}, 4, group, ys);
  gemv_bf16_amx_into(x.data_ptr<float>(), x.size(0), x.size(1), group, weights);
  return ys[0];
}
