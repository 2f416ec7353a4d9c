// One row of int8 activation blocks times 4- or 8-bit weight codes on AMX int8 tiles: what
// a8_blocks_amx_into (gemm_amx.cpp) runs at M = 1, with its arithmetic, bit for bit.
//
// gemm_amx.cpp multiplies a tile of 16 weight rows x one block of 32 codes by a tile of one
// block of 16 activation rows.  At one row of x that tile product fills one column of 16,
// and its C tile leaves the tiles after every block: ~50 cycles per 16 x 32 codes, the
// AVX2 rows kernel (gemv_a8.cpp) being faster.  Here C's 16 columns are 16 blocks of the one
// row: B is block-diagonal, B row j (4 consecutive bytes of each A row) holding x's codes
// for those 4 values in the column of their block and zeros elsewhere, so
//
//   C[r][j] = the exact dot product of block j of weight row r with x's block j
//
// and 16 blocks (8 tile products of 64 bytes of codes) sum in one C tile, which leaves the
// tiles once per 16 x 512 codes.
//
// 4-bit codes: 64 bytes of a weight row (128 values) give two A rows with no reordering,
// their low nibbles (values 2i) and their high ones (2i + 1), 4 blocks each; the B tiles take
// x's even or odd values to match.  8-bit codes: 64 consecutive codes (2 blocks) a row.
// Signed 4-bit codes are read as u = q + 8 (tdpbusd, u8 x s8) and the 8 sum(x) term taken
// with the zero-point term, as gemm_amx.cpp does; signed 8-bit codes as int8 (tdpbssd).
//
// The floats, per weight row (a lane, once C is stored and transposed), blocks in order:
//   acc = fma(float(dot_b), s[g(b)] * d[b], acc)          from acc = 0
//   y   = acc - zscale * sum_g fma(sz[g], xs[g], .)        (no term for signed 8-bit codes)
// gemm_amx.cpp's rows16 lane for lane: the same operations in the same order.
//
// Code conversion and tile products run as gemv_amx.cpp's do: a ring of A buffers filled
// two units ahead of the tile loads (a tile load right after the vector stores of its rows
// waits for them to drain), each C tile scaled one step after it is stored, the next strip
// of weight rows prefetched a part per unit.

#include "a8_blocks.h"
#include "balance.h"
#include "int8_epilogue.h"
#include "kernels.h"
#include "panels.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__) && defined(__F16C__) && defined(__linux__)
#define LOWBIT_GEMV_A8_AMX 1
#endif

namespace {

#ifdef LOWBIT_GEMV_A8_AMX
using a8::BLOCK;
constexpr int TILE = 16;
constexpr int64_t kChunkBlocks = TILE;  // blocks per C tile: one a column
constexpr int kStepsPerC = 8;           // tile products of 64 code bytes per C tile (16 x 32 codes)
constexpr int kRing = 4;                // A buffers: unit i + kAhead converted while unit i's tiles run
constexpr int kAhead = 2;

// A thread's tile configuration, released when its items are done: tmm0-1 C (two, taking
// turns per 16 blocks), tmm2-3 A, tmm4-5 B (taking turns per step); all 16 x 64 bytes.
struct TileConfig {
  TileConfig() { load_tile_config({TILE, TILE, TILE, TILE, TILE, TILE, 0, 0}, {64, 64, 64, 64, 64, 64, 0, 0}); }
  ~TileConfig() { _tile_release(); }
  TileConfig(const TileConfig&) = delete;
  TileConfig& operator=(const TileConfig&) = delete;
};

// A thread's buffers, kept between calls.
struct Buffers {
  alignas(64) uint8_t a[kRing][2][TILE * 64];  // A tiles of a unit (4-bit: low, high nibbles)
  alignas(64) int32_t c[2][TILE * TILE];       // C as stored, by the parity of its 16 blocks
  std::vector<float> scale, zfactor;           // a strip's s and sz, [G][16 weight rows]
};
Buffers& buffers() {
  thread_local Buffers b;
  return b;
}

// x's one row in blocks (a8::quantize_row, codes in k order): codes, block scales d [nb],
// group sums xs [G], and the B tiles, 1 KiB per step.  A unit is the values one load of
// weight bytes gives: 4-bit, 128 (64 bytes: step 2u its low nibbles, 2u + 1 its high ones);
// 8-bit, 64 (one step).  B tile t, row j, column c, byte i: x's value at A byte 4j + i of
// step t if column c is the block of that value (mod 16), else 0.
struct Prepared {
  const int8_t* b;
  const float* d;
  const float* xs;
  bool finite;
};

template <typename X>
Prepared prepare(const X* x, int64_t K, int64_t group, int bits) {
  thread_local std::vector<int8_t> q_keep, b_keep;
  thread_local std::vector<float> d_keep, xs_keep;
  const int64_t nb = K / BLOCK, width = bits == 4 ? 128 : 64, units = (K + width - 1) / width;
  const int64_t steps = bits == 4 ? 2 * units : units;
  int8_t* q = grown(q_keep, K);
  float *d = grown(d_keep, nb), *xs = grown(xs_keep, K / group);
  if (!a8::quantize_row<int8_t>(x, K, group, false, q, d, xs)) return {nullptr, d, xs, false};
  int8_t* b = grown(b_keep, steps * TILE * 64);
  std::memset(b, 0, steps * TILE * 64);
  for (int64_t t = 0; t < steps; ++t)
    for (int j = 0; j < TILE; ++j)
      for (int i = 0; i < 4; ++i) {
        const int64_t pos = 4 * j + i;  // the A byte
        const int64_t k = bits == 4 ? (t / 2) * 128 + 2 * pos + t % 2 : t * 64 + pos;
        if (k < K) b[(t * TILE + j) * 64 + ((k / BLOCK) % kChunkBlocks) * 4 + i] = q[k];
      }
  return {b, d, xs, true};
}

// One tile product: C += A (16 weight rows x 64 code bytes) . B (the step's block-diagonal
// x).  A macro: GCC's tile intrinsics take the tile numbers as literal text.
#define LOWBIT_PRODUCT(C, A, B, a, b)               \
  do {                                              \
    _tile_loadd(A, a, 64);                          \
    _tile_loadd(B, b, 64);                          \
    if constexpr (SIGNED_A) _tile_dpbssd(C, A, B);  \
    else _tile_dpbusd(C, A, B);                     \
  } while (0)

// Weight rows n0 .. n1 - 1 of wt times the prepared row into y[n0 .. n1), strips of 16
// weight rows one after another, their steps in one pipeline.
template <int BITS, bool SIGNED_A, typename Y>
void weight_rows(const PackedWeight& wt, const Prepared& xp, int64_t K, int64_t group, int64_t n0, int64_t n1, Y* y) {
  constexpr int H = BITS == 4 ? 2 : 1;            // steps per unit
  constexpr int64_t WIDTH = BITS == 4 ? 128 : 64;  // values per unit
  Buffers& bf = buffers();
  const int64_t G = K / group, nb = K / BLOCK, per_group = group / BLOCK;
  const int64_t row_bytes = BITS == 4 ? K / 2 : K, U = (K + WIDTH - 1) / WIDTH, S_ = U * H;
  const int64_t strips = (n1 - n0 + TILE - 1) / TILE;
  if (strips <= 0) return;
  // the bytes of a row's last unit (the rest of its 64 masked off: zero codes, zero B rows)
  const int64_t tail = row_bytes - (U - 1) * 64;
  const __mmask64 tail_mask = tail >= 64 ? ~0ULL : (1ULL << tail) - 1;
  const bool has_term = BITS == 4 || wt.z != nullptr;
  const float zscale = BITS == 4 && !wt.z ? 8.f : 1.f;
  float* scale = grown(bf.scale, G * TILE);
  float* zfactor = grown(bf.zfactor, G * TILE);
  uint8_t(*ring)[2][TILE * 64] = bf.a;
  int32_t(*cbuf)[TILE * TILE] = bf.c;
  const auto rows_of = [&](int64_t strip) { return std::min<int64_t>(TILE, n1 - n0 - strip * TILE); };
  const auto row_index = [&](int64_t strip, int r) {  // rows past the end: the strip's last
    return n0 + strip * TILE + std::min<int64_t>(r, rows_of(strip) - 1);
  };
  const uint8_t* row[TILE];  // the rows of the strip being converted
  int64_t conv_strip = 0, conv_u = 0, conv_slot = 0;
  const auto set_rows = [&] {
    for (int r = 0; r < TILE; ++r) row[r] = wt.w + row_index(conv_strip, r) * row_bytes;
  };
  const int64_t lines = (TILE * row_bytes / 64 + U - 1) / U;  // of the next strip, per unit
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(SIGNED_A || wt.z ? 0x00 : 0x08);
  const auto convert_next = [&] {
    const char* next = reinterpret_cast<const char*>(wt.w + (n0 + (conv_strip + 1) * TILE) * row_bytes);
    for (int64_t l = conv_u * lines; l < (conv_u + 1) * lines; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
    const __mmask64 live = conv_u == U - 1 ? tail_mask : ~0ULL;
    uint8_t(*a)[TILE * 64] = ring[conv_slot];
#pragma GCC unroll 16
    for (int r = 0; r < TILE; ++r) {
      const __m512i raw = _mm512_maskz_loadu_epi8(live, row[r] + conv_u * 64);
      if constexpr (BITS == 4) {
        _mm512_store_si512(a[0] + r * 64, _mm512_ternarylogic_epi32(raw, low, flip, 0x6A));  // (raw & low) ^ flip
        _mm512_store_si512(a[1] + r * 64, _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), low, flip, 0x6A));
      } else {
        _mm512_store_si512(a[0] + r * 64, raw);
      }
    }
    conv_slot = (conv_slot + 1) % kRing;
    if (++conv_u == U && ++conv_strip < strips) conv_u = 0, set_rows();
  };
  __m512 acc = _mm512_setzero_ps();  // lanes: the strip's weight rows
  int64_t blk = 0, g = 0, in_group = 0;  // the next block to scale, its group, blocks of it done
  const auto begin_strip = [&](int64_t strip) {
    int64_t n[TILE];
    for (int r = 0; r < TILE; ++r) n[r] = row_index(strip, r);
    with_scales(wt, [&](const auto* s, const auto* z) { a8::strip_scales(s, z, wt.min, G, n, scale, zfactor); });
    acc = _mm512_setzero_ps();
    blk = 0, g = 0, in_group = 0;
  };
  // The C tile of blocks [blk, blk + 16) of `strip`, stored in cbuf[parity]: into acc, block
  // by block; after the strip's last block, its outputs.
  const auto finish = [&](int64_t strip, int parity) {
    __m512i v[TILE];
    for (int r = 0; r < TILE; ++r) v[r] = _mm512_load_si512(cbuf[parity] + r * TILE);
    transpose16(v);  // v[j]: block blk + j of the 16 weight rows
    const int64_t count = std::min<int64_t>(kChunkBlocks, nb - blk);
    for (int64_t j = 0; j < count; ++j, ++blk) {
      const __m512 sd = _mm512_mul_ps(_mm512_loadu_ps(scale + g * TILE), _mm512_set1_ps(xp.d[blk]));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v[j]), sd, acc);
      if (++in_group == per_group) ++g, in_group = 0;
    }
    if (blk < nb) return;  // the strip goes on
    __m512 zt = _mm512_setzero_ps();
    if (has_term) {
      for (int64_t i = 0; i < G; ++i)
        zt = _mm512_fmadd_ps(_mm512_loadu_ps(zfactor + i * TILE), _mm512_set1_ps(xp.xs[i]), zt);
      if (zscale != 1.f) zt = _mm512_mul_ps(zt, _mm512_set1_ps(zscale));
    }
    int8_epilogue::store<Y>(y + n0 + strip * TILE, lanes16(rows_of(strip)), _mm512_sub_ps(acc, zt));
    if (strip + 1 < strips) begin_strip(strip + 1);
  };
  set_rows();
  begin_strip(0);
  const int64_t units = strips * U;
  for (int64_t i = 0; i < std::min<int64_t>(kAhead, units); ++i) convert_next();
  int64_t slot = 0, left = units;
  int parity = 0;
  int64_t pending = -1;  // the strip whose C tile waits in cbuf[parity ^ 1] to be scaled
  for (int64_t strip = 0; strip < strips; ++strip)
    for (int64_t t = 0; t < S_; ++t) {
      const int h = BITS == 4 ? static_cast<int>(t % 2) : 0;
      if (h == 0) {
        if (left > kAhead) convert_next();
        --left;
      }
      const uint8_t* a = ring[slot][h];
      const int8_t* b = xp.b + t * TILE * 64;
      const bool first = t % kStepsPerC == 0, last = t % kStepsPerC == kStepsPerC - 1 || t == S_ - 1;
      if (parity == 0) {
        if (first) _tile_zero(0);
        if (t % 2 == 0) LOWBIT_PRODUCT(0, 2, 4, a, b);
        else LOWBIT_PRODUCT(0, 3, 5, a, b);
        if (last) _tile_stored(0, cbuf[0], 64);
      } else {
        if (first) _tile_zero(1);
        if (t % 2 == 0) LOWBIT_PRODUCT(1, 2, 4, a, b);
        else LOWBIT_PRODUCT(1, 3, 5, a, b);
        if (last) _tile_stored(1, cbuf[1], 64);
      }
      if (h == H - 1) slot = (slot + 1) % kRing;
      if (pending >= 0 && !last) finish(pending, parity ^ 1), pending = -1;
      if (!last) continue;
      if (pending >= 0) finish(pending, parity ^ 1);  // (a C tile of one step: no step between)
      pending = strip;
      parity ^= 1;
    }
  if (pending >= 0) finish(pending, parity ^ 1);
}
#undef LOWBIT_PRODUCT
#endif

}  // namespace

template <typename X, typename Y>
bool a8_blocks_amx_row(const X* x, int64_t K, int64_t bits, int64_t group, const std::vector<PackedWeight>& weights,
                       Y* const* ys) {
#ifdef LOWBIT_GEMV_A8_AMX
  // 4-bit codes: vpdpbusd over 16 weight rows (gemv_a8_vnni.cpp), 1.6x these tiles at one row
  if (bits == 4 && a8_vnni_row_supported()) return a8_blocks_vnni_row(x, K, group, weights, ys);
  const Prepared xp = prepare(x, K, group, static_cast<int>(bits));
  if (!xp.finite) return false;
  const bool signed_a = bits == 8 && !weights[0].z;  // as gemm_amx.cpp: only int8 codes are signed A
  parallel_weight_rows(weights, 64, [] { return TileConfig(); },
                       [&](TileConfig&, const PackedWeight& wt, int64_t n0, int64_t n1) {
                         Y* y = ys[&wt - weights.data()];
                         if (bits == 4) weight_rows<4, false>(wt, xp, K, group, n0, n1, y);
                         else if (signed_a) weight_rows<8, true>(wt, xp, K, group, n0, n1, y);
                         else weight_rows<8, false>(wt, xp, K, group, n0, n1, y);
                       });
  return true;
#else
  (void)x, (void)K, (void)bits, (void)group, (void)weights, (void)ys;
  TORCH_CHECK(false, "lowbit._C was built without the AMX tile kernels");
#endif
}

template bool a8_blocks_amx_row(const float*, int64_t, int64_t, int64_t, const std::vector<PackedWeight>&,
                                float* const*);
template bool a8_blocks_amx_row(const c10::BFloat16*, int64_t, int64_t, int64_t, const std::vector<PackedWeight>&,
                                c10::BFloat16* const*);
