// Linear layers on AMX tiles (Sapphire Rapids and later Xeons) with the weight read as
// stored, for a decode step's or a batch's rows and for prefills:
// * W8A8: int8 activations a [M, K] times an int8 weight b [N, K], exact int32 sums
//   (tdpbssd: int8 x int8, |sum| <= K 2^14 < 2^31 for K < 2^17, so the integers of
//   torch._int_mm), then either stored as int32 (int8_mm_amx) or through W8A8's epilogue
//   (int8_epilogue.h, int8_linear_amx: the bits of gemm_int8.cpp's int8_linear and of the
//   composed path);
// * W4A16 / W8A16 (weight_only_gemm_bf16_amx): each block of 32 weight rows dequantized once
//   per call into bf16 rows ((q - z) * s in float32, rounded: the reference's bf16 weight),
//   the A tiles as stored (B tiles from PACKED_WEIGHT_MIN_M rows), times bf16 x, float32 sums
//   out (rounded once to bf16 for bf16 x);
// * a bf16 nn.Linear (dense_amx): bf16 x [M, K] times a bf16 weight [N, K], float32 sums of
//   the exact products (tdpbf16ps), the bias added in float32, one rounding to bf16: what
//   dense.cpp's dense_rows and oneDNN's bf16 GEMM compute, up to the order of the sums;
// * W4A16 / W8A16 with float32 x at the matmul precision "highest" (weight_only_gemm_f32_amx):
//   x in three bf16 parts and q - z (or the "min" domain's q) on bf16 tiles, every product
//   exact (exact_run).
//
// 16 weight rows x 64 bytes of K are an A tile (tileloadd with the row stride; no packing,
// so a decode step streams the weight once, straight into the tiles).  The rows of x are the
// B tiles, packed once per call into [k / 4][16 rows][4 bytes] (a 16 x 16 dword transpose
// per 16 rows x 64 bytes; zero rows past M), so C = W x a^T, [16 weight rows][16 rows of
// a], transposed back on the way out.  A block of 32 weight rows x 32 rows of a keeps four
// C tiles: per 64 bytes of K two A and two B tile loads feed four tile products (the loads,
// not the products, would bound a 1 x 2 block).  Blocks of 32 weight rows and ranges of
// rows of a (PanelWork) go to the threads as they ask (each_item).  From PACKED_WEIGHT_MIN_M
// rows on, the roles swap (see there).  Each output is summed in the same order
// (k ascending, one tile product per 64 bytes) whatever M and its place in the tiles.

#include "int8_epilogue.h"
#include "kernels.h"
#include "panels.h"
#include "simd.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__linux__)
#define LOWBIT_AMX_LINEAR 1
#endif

namespace {

#ifdef LOWBIT_AMX_LINEAR
constexpr int TILE = 16;       // rows of an A or C tile, columns (of 4 bytes) of a B tile
constexpr int BLOCK = 2 * TILE;  // weight rows and rows of a per block

// tmm0-3 C (C[2h + j]: weight half h x rows tile j), tmm4-5 A (weight halves), tmm6-7 B (rows
// tiles), all 16 rows of 64 bytes.
void configure() {
  load_tile_config({TILE, TILE, TILE, TILE, TILE, TILE, TILE, TILE},
                   {64, 64, 64, 64, 64, 64, 64, 64});
}

// A thread's tile configuration (configure), released when its items are done: one per thread
// in each_item's state.
struct Tiles {
  Tiles() { configure(); }
  ~Tiles() { _tile_release(); }
};

// a [M, K] into B tiles: dword xp[(t * K / 4 + q) * 16 + r] = bytes 4q .. 4q + 3 of row 16t + r
// (zero past M); tile t's product with the A tile at k reads the 1 KiB at q = k / 4.
inline void pack_tile(const uint8_t* a, int64_t M, int64_t K, int64_t t, int32_t* xp) {
  for (int64_t k = 0; k < K; k += 64) {
    __m512i r[TILE];
    for (int i = 0; i < TILE; ++i)
      r[i] = TILE * t + i < M ? _mm512_loadu_si512(a + (TILE * t + i) * K + k) : _mm512_setzero_si512();
    transpose16(r);  // r[q]: dword q of every row
    int32_t* out = xp + (t * (K / 4) + k / 4) * TILE;
    for (int q = 0; q < TILE; ++q) _mm512_store_si512(out + q * TILE, r[q]);
  }
}

void pack_rows(const uint8_t* a, int64_t M, int64_t K, int64_t tiles, int32_t* xp) {
  at::parallel_for(0, tiles, M * K >= (1 << 16) ? 1 : tiles, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) pack_tile(a, M, K, t, xp);
  });
}

// sum_k w[i, k] for the block's 32 weight rows (signed bytes times unsigned ones).
void row_sums(const int8_t* w, int64_t K, int32_t* sums) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int i = 0; i < BLOCK; ++i) {
    __m512i s = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) s = _mm512_dpbusd_epi32(s, ones, _mm512_loadu_si512(w + i * K + k));
    sums[i] = _mm512_reduce_add_epi32(s);
  }
}

// The C tiles' [16 weight rows][16 rows of a] as 16 vectors, one per row of a, lanes the
// weight rows (c: the tile as stored).
inline void rows_of(const int32_t* c, __m512i r[TILE]) {
  for (int i = 0; i < TILE; ++i) r[i] = _mm512_load_si512(c + i * TILE);
  transpose16(r);
}

// One block: weight rows w (32 rows of Kb bytes, stride Kb) x the packed rows tiles xt (one,
// or two with `two`), every 64 bytes of K (64 int8 values: tdpbssd, exact int32; or 32 bf16
// pairs: tdpbf16ps, float32 sums); the C tiles stored to c[2h + j] (256 lanes each).  The
// tile loads read 32 rows side by side, a line of each per step, which the hardware
// prefetcher follows late when the weights stream from the L3 (a decode step's): each step
// fetches the 32 lines kBlockAhead bytes on.  dense_amx cycling through 60 bf16 weights,
// AMX Xeon, in-process A/B: 1536x576 1.18x at one row, 1.26x at 32; 576x1536 1.17x, 1.16x
// (128 bytes ahead about the same, 512 and 1024 less); one 49152x576 weight (the lm_head,
// one long stream) level.  A bf16 SmolLM2 decode of 64 tokens: 1.06-1.14x.
constexpr int64_t kBlockAhead = 256;
#define LOWBIT_TDP(C, A, B) \
  if constexpr (BF16) _tile_dpbf16ps(C, A, B); \
  else _tile_dpbssd(C, A, B)
template <bool BF16, bool TWO>
inline void block(const uint8_t* w, int64_t Kb, const int32_t* xt, int32_t (*c)[TILE * TILE]) {
  const int64_t step = Kb / 4 * TILE;  // dwords from one rows tile to the next
  _tile_zero(0);
  _tile_zero(2);
  if (TWO) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < Kb; k += 64) {
    const int32_t* b = xt + k / 4 * TILE;
    if (k + kBlockAhead < Kb)
      for (int i = 0; i < BLOCK; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + i * Kb + k + kBlockAhead), _MM_HINT_T0);
    _tile_loadd(4, w + k, Kb);
    _tile_loadd(6, b, 64);
    _tile_loadd(5, w + TILE * Kb + k, Kb);
    LOWBIT_TDP(0, 4, 6);
    LOWBIT_TDP(2, 5, 6);
    if (TWO) {
      _tile_loadd(7, b + step, 64);
      LOWBIT_TDP(1, 4, 7);
      LOWBIT_TDP(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(2, c[2], 64);
  if (TWO) {
    _tile_stored(1, c[1], 64);
    _tile_stored(3, c[3], 64);
  }
}
#undef LOWBIT_TDP

// A block of 32 weight rows as the tiles read it: w (32 rows of Kb bytes, Kb apart) and, for
// W8A8 with activation zero points, sum_k w of each row (else null).
struct Block {
  const uint8_t* w;
  const int32_t* sums;
};

// The weights as stored (int8, or bf16 with BF16; weight j: rows of Kb bytes at bs[j], Ns[j]
// of them): a block is its rows in place, or a zero-padded copy of the last rows; their sums
// where `sums`.  One per thread.
struct StoredRows {
  std::vector<const uint8_t*> bs;
  std::vector<int64_t> Ns;
  int64_t Kb;
  bool sums;
  std::vector<uint8_t> tail;
  alignas(64) int32_t colsum[BLOCK] = {};
  Block operator()(size_t j, int64_t n0) {
    const uint8_t* w = bs[j] + n0 * Kb;
    if (Ns[j] - n0 < BLOCK) {  // tile loads read 32 weight rows: the missing ones zero
      tail.assign(BLOCK * Kb, 0);
      std::copy(w, w + (Ns[j] - n0) * Kb, tail.begin());
      w = tail.data();
    }
    if (!sums) return {w, nullptr};
    row_sums(reinterpret_cast<const int8_t*>(w), Kb, colsum);
    return {w, colsum};
  }
};

// Rows of a from which the weight is packed instead of a: from here on each block of 32
// weight rows is laid out once per call as B tiles (the transposes pack_rows does for a),
// a's rows are read as stored into A tiles, and the C tiles come out as rows of a, without
// the 4 transposes per block of the other layout.  Both sum every output in one order.
// Median us, 2 threads, this layout (with each_item) against the other (with a static
// split), AMX Xeon: 576x1536 M=512 int8_linear_amx 277 / 446, dense_amx 561 / 823, 4-bit
// weight_only_gemm_bf16_amx 846 / 1269; 192x576 M=512 int8 48 / 99, dense 88 / 181.  Below
// 128 rows the packing costs more than it saves (M=96, both with each_item: 1536x576 int8
// 149 / 147, dense 303 / 256; M=32 int8 69 / 50).
constexpr int64_t PACKED_WEIGHT_MIN_M = 128;

// Every block of 32 weight rows of every weight (weight j has Ns[j] rows of Kb bytes: int8
// values, or bf16 ones with BF16; source = make(), one per thread, gives block n0 of weight
// j as source(j, n0)) x 32 rows of a, all in one parallel region (q/k/v or gate/up share
// a's packing); out(j, r, m, rows, n0, cols, sums) writes one C tile's outputs, r[i] (int32,
// or float32 bits) the 16 rows n0 .. of weight j for row m + i of a, `rows` and `cols` of
// them real, sums: the block's from n0 on.
template <bool BF16, typename Make, typename Out>
void run(const uint8_t* a, int64_t M, int64_t Kb, const std::vector<int64_t>& Ns, Make make, Out out) {
  const bool packed_weight = M >= PACKED_WEIGHT_MIN_M;
  // the rows of a as B tiles; or, with the weight packed, a's last rows past a multiple of
  // 32 with zero rows after them (tile loads read 32 rows)
  const int64_t tiles = packed_weight ? 0 : (M + TILE - 1) / TILE;
  const int64_t tail = packed_weight ? M % BLOCK : 0;
  std::vector<int32_t> keep((packed_weight ? BLOCK * Kb / 4 : tiles * Kb / 4 * TILE) + 16);
  int32_t* xp = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(keep.data()) + 63) & ~uintptr_t(63));
  if (packed_weight) {
    std::memset(xp, 0, BLOCK * Kb);
    std::memcpy(xp, a + (M - tail) * Kb, tail * Kb);
  } else {
    pack_rows(a, M, Kb, tiles, xp);
  }
  // at least 8 items per thread: each_item gives them out as threads ask, so a thread running
  // slower than the other takes fewer
  const PanelItems items(Ns, BLOCK, M, BLOCK, 2 * at::get_num_threads());
  struct State {
    Tiles tiles;
    decltype(make()) source;
    std::vector<int32_t> wp;  // a block's weight rows as B tiles (packed_weight)
    alignas(64) int32_t c[4][TILE * TILE];
  };
  const auto setup = [&] {
    return State{{}, make(), std::vector<int32_t>(packed_weight ? BLOCK * Kb / 4 + 16 : 0), {}};
  };
  each_item(items.size(), setup, [&](State& s, int64_t i) {
    const auto [j, n0, m_begin, m_end] = items[i];
    const int cols = static_cast<int>(std::min<int64_t>(BLOCK, Ns[j] - n0));
    const Block blk = s.source(j, n0);
    __m512i r[TILE];
    if (packed_weight) {
      int32_t* wp = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(s.wp.data()) + 63) & ~uintptr_t(63));
      pack_tile(blk.w, BLOCK, Kb, 0, wp);
      pack_tile(blk.w, BLOCK, Kb, 1, wp);
      for (int64_t m = m_begin; m < m_end; m += BLOCK) {
        const uint8_t* rows = m + BLOCK <= M ? a + m * Kb : reinterpret_cast<const uint8_t*>(xp);
        block<BF16, true>(rows, Kb, wp, s.c);  // c[2h + c]: rows of a m + 16h .. x weight rows n0 + 16c ..
        for (int h = 0; h < 2 && m + TILE * h < m_end; ++h)
          for (int c = 0; c < 2 && TILE * c < cols; ++c) {
            for (int q = 0; q < TILE; ++q) r[q] = _mm512_load_si512(s.c[2 * h + c] + q * TILE);
            out(j, r, m + TILE * h, static_cast<int>(std::min<int64_t>(TILE, m_end - m - TILE * h)), n0 + TILE * c,
                std::min(TILE, cols - TILE * c), blk.sums ? blk.sums + TILE * c : nullptr);
          }
      }
      return;
    }
    for (int64_t m = m_begin; m < m_end; m += BLOCK) {
      const bool two = m + TILE < m_end;
      const int32_t* xt = xp + m / TILE * (Kb / 4 * TILE);
      if (two) block<BF16, true>(blk.w, Kb, xt, s.c);  // c[2h + t]: weight rows n0 + 16h .. x rows m + 16t ..
      else block<BF16, false>(blk.w, Kb, xt, s.c);
      for (int t = 0; t < (two ? 2 : 1); ++t)
        for (int h = 0; h < 2 && TILE * h < cols; ++h) {
          rows_of(s.c[2 * h + t], r);
          out(j, r, m + TILE * t, static_cast<int>(std::min<int64_t>(TILE, m_end - m - TILE * t)), n0 + TILE * h,
              std::min(TILE, cols - TILE * h), blk.sums ? blk.sums + TILE * h : nullptr);
        }
    }
  });
}

// W8A8 for every weight of ws (one input a, one parallel region): int8_epilogue's outputs.
template <typename T>
void linear_run(const int8_t* a, int64_t M, int64_t K, const float* row, const int32_t* a_zp, at::ScalarType out,
                const std::vector<Int8Out>& ws) {
  std::vector<const uint8_t*> bs;
  std::vector<int64_t> Ns;
  std::vector<int8_epilogue::RowCol> es;
  for (const Int8Out& w : ws) {
    bs.push_back(reinterpret_cast<const uint8_t*>(w.b));
    Ns.push_back(w.N);
    es.push_back({row, a_zp, w.col, w.bias, out, w.y, w.N});
  }
  run<false>(reinterpret_cast<const uint8_t*>(a), M, K, Ns, [&] { return StoredRows{bs, Ns, K, a_zp != nullptr}; },
             [&](size_t j, const __m512i* r, int64_t m, int rows, int64_t n0, int cols, const int32_t* sums) {
    const __mmask16 mask = lanes16(cols);
    const __m512i colsum = sums ? _mm512_maskz_loadu_epi32(mask, sums) : _mm512_setzero_si512();
    for (int i = 0; i < rows; ++i) int8_epilogue::rowcol16<T>(es[j], r[i], colsum, m + i, n0, mask);
  });
}

// y[m, n] = bf16(acc (+ bias[n])) for one C tile of float32 sums.
void dense_out(const __m512i* r, int64_t m, int rows, int64_t n0, int cols, const float* bias, uint16_t* y,
               int64_t N) {
  const __mmask16 mask = lanes16(cols);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int i = 0; i < rows; ++i) {
    __m512 f = _mm512_castsi512_ps(r[i]);
    if (bias) f = _mm512_add_ps(f, b);
    int8_epilogue::store<c10::BFloat16>(reinterpret_cast<c10::BFloat16*>(y + (m + i) * N + n0), mask, f);
  }
}

// Weight rows [n0, n0 + 32) of a 4- or 8-bit weight (codes: packed u32x8 words, or one byte
// each) dequantized to bf16 into out [32][K], the A tiles' rows as stored: (q - z) * s (or
// q * s for signed codes; with `min`, q * s + z: the "min" domain, the product rounded, then
// the sum) in float32, rounded to nearest even, as gemm_bf16.cpp's panels and the reference
// compute it (s, z float32 [N, G]); rows past N zero.  With s null, q - z (or q) unscaled:
// exact in bf16 for integer z (|q - z| <= 255, 8 significant bits).
//
// A group of 4-bit codes has 16 values: they are computed once per group, those very float32
// operations and rounding, into a table of 16 bf16 (twice over: 32 words), and each 32 codes
// are looked up in it by one vpermw.  Its word indices come straight from the code bytes
// widened to dwords: byte b | b << 12 holds b (low 5 bits: the low nibble, and one bit of
// the high one, which the doubled table ignores) in its low word and b >> 4 in its high word,
// i.e. elements 2i and 2i + 1 in k order.  Per 32 codes 4 vector instructions instead of
// 12-14 (widen, mask, two conversions, two subtractions, two products, a rounding and an
// interleave): a batch of 32 SmolLM2 w4a16-g64 decode steps spent 28% of its time here.
// A timer-sampled profile then put half of what was left on the instruction after the
// codes' load (a decode step's weights come from the L3; the VM has no hardware counters,
// so that attribution is loose): the row kRowsAhead on is fetched as each row starts.
// In-process A/B on the AMX Xeon, Runner.generate of 16 tokens, 8 / 32 prompts / a
// 512-token prefill: both 1.20x / 1.14x / 1.07x; the table alone 1.07x / 1.04x / level;
// the prefetch alone (medians of a noisy run) 1.10x / 1.05x / level.
template <int BITS, bool SIGNED>
void dequant_block(const uint8_t* w, const float* s, const float* z, int64_t N, int64_t K, int64_t G,
                   int64_t group, int64_t n0, uint16_t* out, bool min = false) {
  // the value of each 4-bit pattern: u, or the signed q = (u ^ 8) - 8
  const __m512 codes = SIGNED ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1)
                              : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  for (int r = 0; r < BLOCK; ++r) {
    uint16_t* o = out + r * K;
    const int64_t n = n0 + r;
    if (n >= N) {
      std::fill(o, o + K, uint16_t(0));
      continue;
    }
    const uint8_t* row = w + n * row_bytes;
    if (n + kRowsAhead < N) prefetch_row(row + kRowsAhead * row_bytes, row_bytes);
    // group by group (no division per 32 values: a 64-bit idiv each was ~10 cycles)
    for (int64_t k = 0, g = n * G; k < K; ++g) {
      const __m512 sv = _mm512_set1_ps(s ? s[g] : 1.f);  // s null: q - z unscaled (exact in bf16); z null: q
      if constexpr (BITS == 4) {
        const __m256i half =
            bf16_bits16(min ? mul_add_unfused(codes, sv, _mm512_set1_ps(z[g]))
                            : _mm512_mul_ps(SIGNED || !z ? codes : _mm512_sub_ps(codes, _mm512_set1_ps(z[g])), sv));
        const __m512i table = _mm512_inserti64x4(_mm512_castsi256_si512(half), half, 1);
        for (const int64_t end = k + group; k < end; k += 32) {
          const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
          _mm512_storeu_si512(o + k, _mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), table));
        }
      } else {
        for (const int64_t end = k + group; k < end; k += 32) {  // 8-bit codes: values 0..15 and 16..31
          const __m128i* p = reinterpret_cast<const __m128i*>(row + k);
          __m512 a = SIGNED ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)))
                            : _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p)));
          __m512 b = SIGNED ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)))
                            : _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p + 1)));
          if (min) {
            const __m512 mv = _mm512_set1_ps(z[g]);
            a = mul_add_unfused(a, sv, mv), b = mul_add_unfused(b, sv, mv);
          } else {
            if (!SIGNED && z) {
              const __m512 zv = _mm512_set1_ps(z[g]);
              a = _mm512_sub_ps(a, zv), b = _mm512_sub_ps(b, zv);
            }
            a = _mm512_mul_ps(a, sv), b = _mm512_mul_ps(b, sv);
          }
          // a in the low half; vcvtne2ps2bf16 flushes subnormals to zero, as tdpbf16ps reads them
          _mm512_storeu_si512(o + k, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
      }
    }
  }
}

// The bf16 rows of 4- or 8-bit weights, block by block (dequant_block).  One per thread.
template <int BITS, bool SIGNED>
struct DequantizedRows {
  const std::vector<Bf16Out>& ws;
  int64_t K, group;
  std::vector<uint16_t> buf = std::vector<uint16_t>(BLOCK * K + 32);
  Block operator()(size_t j, int64_t n0) {  // weight j's block n0
    uint16_t* wb = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    const Bf16Out& w = ws[j];
    dequant_block<BITS, SIGNED>(static_cast<const uint8_t*>(w.w), w.scale, w.zero_point, w.N, K, K / group, group,
                                n0, wb, w.min);
    return {reinterpret_cast<const uint8_t*>(wb), nullptr};
  }
};

// x bf16 [M, K] (as bytes) times 4- or 8-bit weights, each block of 32 weight rows
// dequantized once; y [M, N] float32 (T float), or its sums rounded once to bf16.
template <int BITS, bool SIGNED, typename T>
void weight_only_run(const uint8_t* x, int64_t M, int64_t K, int64_t group, const std::vector<Bf16Out>& ws) {
  std::vector<int64_t> Ns;
  for (const Bf16Out& w : ws) Ns.push_back(w.N);
  run<true>(x, M, 2 * K, Ns, [&] { return DequantizedRows<BITS, SIGNED>{ws, K, group}; },
            [&](size_t j, const __m512i* r, int64_t m, int rows, int64_t n0, int cols, const int32_t*) {
              T* y = static_cast<T*>(ws[j].y) + n0;
              for (int i = 0; i < rows; ++i)
                int8_epilogue::store<T>(y + (m + i) * ws[j].N, lanes16(cols), _mm512_castsi512_ps(r[i]));
            });
}

template <typename T>
void weight_only_bits(const uint8_t* x, int64_t M, int64_t K, int64_t group, int64_t bits,
                      const std::vector<Bf16Out>& ws) {
  const bool z = ws[0].zero_point != nullptr;
  if (bits == 4)
    (z ? weight_only_run<4, false, T> : weight_only_run<4, true, T>)(x, M, K, group, ws);
  else
    (z ? weight_only_run<8, false, T> : weight_only_run<8, true, T>)(x, M, K, group, ws);
}

// bf16 weights as stored, bias in float32 before the one rounding (dense_out).
void dense_run(const uint8_t* x, int64_t M, int64_t K, const std::vector<Bf16Out>& ws) {
  std::vector<const uint8_t*> bs;
  std::vector<int64_t> Ns;
  for (const Bf16Out& w : ws) {
    bs.push_back(static_cast<const uint8_t*>(w.w));
    Ns.push_back(w.N);
  }
  run<true>(x, M, 2 * K, Ns, [&] { return StoredRows{bs, Ns, 2 * K, false}; },
            [&](size_t j, const __m512i* r, int64_t m, int rows, int64_t n0, int cols, const int32_t*) {
              dense_out(r, m, rows, n0, cols, ws[j].bias, static_cast<uint16_t*>(ws[j].y), ws[j].N);
            });
}

// float32 x times a weight with integer zero points, every product exact (the float32
// matmul precision "highest" on bf16 tiles): x = x1 + x2 + x3, three bf16 numbers that are
// x's significand 8 bits at a time (truncated: x1 = x's top 16 bits, x2 the top 16 bits of
// x - x1, x3 = x - x1 - x2, each difference exact in float32); d = q - z, an integer of at
// most 8 significant bits, exact in bf16.  Each tdpbf16ps adds exact products x_p d in
// float32; a group's three parts are summed in the C tiles, times s[n, g] added to float32
// sums per output.  Bound: |y - sum_k x w| <= gamma_(3 group + G) sum_k |x| |q - z| |s| (the
// tiles path: gamma_(K + 1)), plus what tdpbf16ps flushes: bf16 parts below 2^-126 read as
// zero (only where |x| < 2^-110) and partial sums below 2^-126 flushed to zero.  A weight in
// the "min" domain (q * s + m, GGUF's Q4_1): d = q, and after each group's fma(C, s, acc)
// comes acc = fma(sum_g x, m, acc), x's group sums in float32 (group_sums): within
// gamma_(3 group + 2 G) of sum_k |x| (|q s| + |m|).
//
// grown(v, n) 64-byte aligned (tile loads and aligned vector stores).
template <typename T>
T* aligned_grown(std::vector<T>& v, size_t n) {
  T* p = grown(v, n + 64 / sizeof(T));
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// x's parts [3][M][K], bf16 bits; an infinite x is x1 (x2 = x3 = 0, as x * d would give),
// a NaN stays NaN in every part.
void split3(const float* x, int64_t M, int64_t K, uint16_t* parts) {
  const int64_t n = M * K;
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto bits = [](__m512i v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)); };
  parallel_chunks(0, (n + 15) / 16, 4096, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) {
      const int64_t i = 16 * v;
      const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
      const __m512i h1 = _mm512_and_si512(_mm512_castps_si512(xv), top);
      // x - x1 where they differ (inf - inf would be NaN)
      const __m512 r = _mm512_maskz_sub_ps(_mm512_cmp_ps_mask(xv, _mm512_castsi512_ps(h1), _CMP_NEQ_UQ), xv,
                                           _mm512_castsi512_ps(h1));
      const __m512i h2 = _mm512_and_si512(_mm512_castps_si512(r), top);
      const __m512i h3 = _mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(h2)));
      _mm256_mask_storeu_epi16(parts + i, m, bits(h1));
      _mm256_mask_storeu_epi16(parts + n + i, m, bits(h2));
      _mm256_mask_storeu_epi16(parts + 2 * n + i, m, bits(h3));
    }
  });
}

// exact_run's pieces, both layouts: a block's q - z rows (the calling thread's buffer), the
// four C tiles zeroed and stored.
template <int BITS, bool SIGNED>
const uint16_t* unscaled_block(const uint8_t* w, const float* z, int64_t N, int64_t K, int64_t group, int64_t n0) {
  thread_local std::vector<uint16_t> d_keep;  // [32][K]
  uint16_t* d = aligned_grown(d_keep, BLOCK * K);
  dequant_block<BITS, SIGNED>(w, nullptr, z, N, K, K / group, group, n0, d);
  return d;
}

inline void zero_c_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// used: a bit per C tile that holds products (tile loads name their tile at compile time)
inline void store_c_tiles(float (*c)[TILE * TILE], unsigned used) {
  if (used & 1) _tile_stored(0, c[0], 64);
  if (used & 2) _tile_stored(1, c[1], 64);
  if (used & 4) _tile_stored(2, c[2], 64);
  if (used & 8) _tile_stored(3, c[3], 64);
}

// x's sums over each group, in float32, as [G][Mp] (rows M .. Mp - 1 zero), in the buffer v:
// the "min" domain's term m * sum_k x_k per group.  16 lanes of partial sums in k order, then
// their sum (a group is a multiple of 32): one order per row whatever M, within
// gamma_(group / 16 + 4) of sum |x| (a scalar chain over 512 x 576 values was ~0.4 ms a call).
float* group_sums(const float* x, int64_t M, int64_t K, int64_t group, int64_t Mp, std::vector<float>& v) {
  const int64_t G = K / group;
  float* out = grown(v, G * Mp);
  std::fill(out, out + G * Mp, 0.f);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g) {
        __m512 t = _mm512_setzero_ps();
        for (int64_t k = g * group; k < (g + 1) * group; k += 16) t = _mm512_add_ps(t, _mm512_loadu_ps(x + m * K + k));
        out[g * Mp + m] = _mm512_reduce_add_ps(t);
      }
  });
  return out;
}

// Below this many rows exact_run takes exact_few_rows' layout: against the other one (the same
// bits), AMX Xeon, 2 threads, 4-bit weights, median ms: M=8 1536x576 0.17 / 0.24, 576x1536
// 0.15 / 0.22, 192x576 0.037 / 0.043; M=32 0.35 / 0.41, 0.27 / 0.36, 0.068 / 0.077; M=64
// 0.41 / 0.43, 0.34 / 0.39, 0.112 / 0.094.
constexpr int64_t kExactFewRowsM = 64;

// One group's floats of exact_few_rows' block (c[2h + j]: weight rows n0 + 16h .. times rows
// 16j .. of x; `two`: both tiles of rows): acc[16h + r][16j ..] = c row r times the weight
// row's scale (+ acc, past the first group), then with MINS + x's sums over the group (xs[16j
// ..]) times the row's min.  Rows past N take row N - 1's scales (their products are zero).
// See group_floats for why a function of its own.
template <bool MINS>
inline void few_rows_floats(const float (*c)[TILE * TILE], float (*acc)[BLOCK], const float* s, const float* mins,
                            int64_t G, int64_t g, int64_t n0, int64_t N, const float* xs, bool two, bool first) {
  for (int h = 0; h < 2; ++h) {
    int64_t at[TILE];
#pragma GCC unroll 16
    for (int r = 0; r < TILE; ++r) at[r] = std::min<int64_t>(n0 + TILE * h + r, N - 1) * G + g;
    for (int j = 0; j < (two ? 2 : 1); ++j) {
      const float* ct = c[2 * h + j];
      float* a = acc[TILE * h] + TILE * j;
      const __m512 xv = MINS ? _mm512_loadu_ps(xs + TILE * j) : _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int r = 0; r < TILE; ++r) {
        const __m512 cv = _mm512_load_ps(ct + r * TILE), sv = _mm512_set1_ps(s[at[r]]);
        __m512 v = first ? _mm512_mul_ps(cv, sv) : _mm512_fmadd_ps(cv, sv, _mm512_load_ps(a + r * BLOCK));
        if (MINS) v = _mm512_fmadd_ps(xv, _mm512_set1_ps(mins[at[r]]), v);
        _mm512_store_ps(a + r * BLOCK, v);
      }
    }
  }
}

// exact_run below kExactFewRowsM rows (a batch's decode step, a short prompt): the roles
// of run's small-M layout, so no block of the weight is transposed.  x's three parts packed
// once as B tiles; each block of 32 weight rows dequantized to q - z rows, the A tiles as
// stored; per 32 rows of x (or 16: `two` false), C[2h + j] = weight rows n0 + 16h .. x rows
// m + 16j .., the three parts of a step sharing the A tiles; per group each C row times its
// weight row's scale into float32 sums [weight rows][rows of x], transposed on the way out.
// The same products and order of sums per output as exact_run's other layout.
template <int BITS, bool SIGNED>
void exact_few_rows(const uint16_t* parts, int64_t M, int64_t K, const uint8_t* w, const float* s, const float* z,
                    int64_t N, int64_t group, float* y, const float* mins, const float* xsum, int64_t Mp) {
  const int64_t Kb = 2 * K, G = K / group, tiles = (M + TILE - 1) / TILE, part_dwords = tiles * Kb / 4 * TILE;
  thread_local std::vector<int32_t> xp_keep;
  int32_t* xp = aligned_grown(xp_keep, 3 * part_dwords);
  for (int p = 0; p < 3; ++p)
    pack_rows(reinterpret_cast<const uint8_t*>(parts + p * M * K), M, Kb, tiles, xp + p * part_dwords);
  struct State {
    Tiles tiles;
    alignas(64) float c[4][TILE * TILE];
    alignas(64) float acc[BLOCK][BLOCK];  // [weight rows][rows of x]
  };
  each_item((N + BLOCK - 1) / BLOCK, [] { return State{}; }, [&](State& st, int64_t i) {
    const int64_t n0 = i * BLOCK;
    const int cols = static_cast<int>(std::min<int64_t>(BLOCK, N - n0));
    const uint16_t* d = unscaled_block<BITS, SIGNED>(w, mins ? nullptr : z, N, K, group, n0);
    for (int64_t m = 0; m < M; m += BLOCK) {
      const bool two = m + TILE < M;  // rows m + 16 .. exist
      const int64_t t = m / TILE;
      for (int64_t g = 0; g < G; ++g) {
        zero_c_tiles();
        for (int64_t k = g * group, end = k + group; k < end; k += 32) {  // 32 values of K: 64 bytes
          _tile_loadd(4, d + k, Kb);
          _tile_loadd(5, d + TILE * K + k, Kb);
          for (int p = 2; p >= 0; --p) {  // the smallest part first
            const int32_t* b = xp + p * part_dwords + (t * Kb / 4 + k / 2) * TILE;
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (!two) continue;
            _tile_loadd(7, b + Kb / 4 * TILE, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        store_c_tiles(st.c, two ? 0xF : 0x5);
        if (mins) few_rows_floats<true>(st.c, st.acc, s, mins, G, g, n0, N, xsum + g * Mp + m, two, g == 0);
        else few_rows_floats<false>(st.c, st.acc, s, nullptr, G, g, n0, N, nullptr, two, g == 0);
      }
      __m512i r[TILE];
      for (int j = 0; j < (two ? 2 : 1); ++j)
        for (int h = 0; h < 2 && TILE * h < cols; ++h) {
          for (int q = 0; q < TILE; ++q) r[q] = _mm512_load_si512(st.acc[TILE * h + q] + TILE * j);
          transpose16(r);  // r[q]: row m + 16j + q of x, lanes the weight rows
          const int64_t rows = std::min<int64_t>(TILE, M - m - TILE * j);
          for (int64_t q = 0; q < rows; ++q)
            _mm512_mask_storeu_ps(y + (m + TILE * j + q) * N + n0 + TILE * h, lanes16(cols - TILE * h),
                                  _mm512_castsi512_ps(r[q]));
        }
    }
  });
}

// One group's floats of exact_run's block (c[2h + j]: rows 16h .. of x times weight rows
// 16j .., `hs` tiles of rows): acc[16h + r][16j ..] = c row r times the weight rows' scales
// sb (+ acc, past the first group), then with MINS + the group's sum of x (xs[16h + r]) times
// the rows' mins mb.  Its own function with every pointer an argument: written in
// exact_run's lambda, GCC reloaded the captured pointers for each row (an __m512 store may
// alias anything) in a rolled loop; as here, with few_rows_floats, the same bits 1.04-1.23x
// faster calls (4- and 8-bit, groups 32 and 64, 8-512 rows of 1536x576 and 576x1536; AMX
// Xeon, in-process A/B).
template <bool MINS>
inline void group_floats(const float (*c)[TILE * TILE], float (*acc)[BLOCK], const float* sb, const float* mb,
                         const float* xs, int hs, bool first) {
  for (int j = 0; j < 2; ++j) {
    const __m512 sv = _mm512_loadu_ps(sb + TILE * j);
    const __m512 mv = MINS ? _mm512_loadu_ps(mb + TILE * j) : sv;
    for (int h = 0; h < hs; ++h) {
      const float* ct = c[2 * h + j];
      float* a = acc[TILE * h] + TILE * j;
#pragma GCC unroll 16
      for (int r = 0; r < TILE; ++r) {
        const __m512 cv = _mm512_load_ps(ct + r * TILE);
        __m512 v = first ? _mm512_mul_ps(cv, sv) : _mm512_fmadd_ps(cv, sv, _mm512_load_ps(a + r * BLOCK));
        if (MINS) v = _mm512_fmadd_ps(_mm512_set1_ps(xs[TILE * h + r]), mv, v);
        _mm512_store_ps(a + r * BLOCK, v);
      }
    }
  }
}

// Bytes of x's parts that one chunk of rows keeps (in the L2 of the thread running it, while
// the weight's blocks stream past), and of q - z packed per range of the weight.
constexpr int64_t kExactChunkBytes = int64_t(1) << 20;
constexpr int64_t kExactRangeBytes = int64_t(4) << 20;

// y [M, N] float32 = x [M, K] float32 times the weight (codes, s, z as in weight_only_run; z
// integer).  The weight goes by ranges of blocks of 32 rows: each block's q - z in bf16,
// packed as B tiles (two per 32 values of K), with its scales [G][32]; then every chunk of
// rows of x (its three parts read as A tiles as stored) runs against every block of the
// range, a thread taking a chunk's blocks one after the other.  Per 32 rows of the chunk,
// four C tiles per group (rows m, m + 16 x weight rows n0, n0 + 16), the three parts of a
// step sharing its B tiles.
template <int BITS, bool SIGNED>
void exact_run(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* s, const float* z, int64_t N,
               int64_t group, float* y, bool min) {
  const int64_t Kb = 2 * K, G = K / group, n = M * K;
  // the calling thread's buffers, kept between calls (no allocation, page faults or zeroing per call)
  thread_local std::vector<uint16_t> parts_keep, tail_keep;
  thread_local std::vector<int32_t> wp_keep;
  thread_local std::vector<float> sb_keep;
  uint16_t* parts = aligned_grown(parts_keep, 3 * n);
  split3(x, M, K, parts);
  // the "min" domain: the tiles take q, and each group adds m times x's sum over it
  const float* mins = min ? z : nullptr;
  const int64_t Mp = (M + BLOCK - 1) / BLOCK * BLOCK;
  thread_local std::vector<float> xsum_keep;
  float* xsum = min ? group_sums(x, M, K, group, Mp, xsum_keep) : nullptr;
  if (M < kExactFewRowsM) return exact_few_rows<BITS, SIGNED>(parts, M, K, w, s, z, N, group, y, mins, xsum, Mp);
  // the last M % 32 rows of every part with zero rows after them (tile loads read 32 rows)
  const int64_t tail = M % BLOCK;
  uint16_t* tails = tail ? aligned_grown(tail_keep, 3 * BLOCK * K) : nullptr;
  if (tail) {
    std::fill(tails, tails + 3 * BLOCK * K, uint16_t(0));
    for (int p = 0; p < 3; ++p) std::memcpy(tails + p * BLOCK * K, parts + p * n + (M - tail) * K, tail * K * 2);
  }
  const int64_t blocks = (N + BLOCK - 1) / BLOCK, block_dwords = BLOCK * K / 2;
  const int64_t range = std::max<int64_t>(1, std::min(blocks, kExactRangeBytes / (4 * block_dwords)));
  const int64_t chunk = std::max<int64_t>(1, kExactChunkBytes / (3 * Kb * BLOCK)) * BLOCK;  // rows of x
  const int64_t chunks = (M + chunk - 1) / chunk;
  int32_t* wp_all = aligned_grown(wp_keep, range * block_dwords);
  float* sb_all = grown(sb_keep, range * G * BLOCK);
  thread_local std::vector<float> mb_keep;
  float* mb_all = mins ? grown(mb_keep, range * G * BLOCK) : nullptr;
  struct State {
    Tiles tiles;
    alignas(64) float c[4][TILE * TILE];
    alignas(64) float acc[BLOCK][BLOCK];
  };
  const int64_t tile_dwords = Kb / 4 * TILE;  // dwords from one B tile of a block to the next
  for (int64_t b0 = 0; b0 < blocks; b0 += range) {
    const int64_t nb = std::min(range, blocks - b0);
    const auto prepare = [&](int64_t i) {  // block b0 + i into slot i
      const int64_t n0 = (b0 + i) * BLOCK;
      const uint16_t* d = unscaled_block<BITS, SIGNED>(w, mins ? nullptr : z, N, K, group, n0);
      pack_tile(reinterpret_cast<const uint8_t*>(d), BLOCK, Kb, 0, wp_all + i * block_dwords);
      pack_tile(reinterpret_cast<const uint8_t*>(d), BLOCK, Kb, 1, wp_all + i * block_dwords);
      pack_groups<BLOCK>(N, G, n0, sb_all + i * G * BLOCK, [&](int64_t row, int64_t g) { return s[row * G + g]; });
      if (mins)
        pack_groups<BLOCK>(N, G, n0, mb_all + i * G * BLOCK, [&](int64_t row, int64_t g) { return mins[row * G + g]; });
    };
    // with one chunk of rows each block is read by one item, which lays it out itself (no
    // parallel region of its own, the block still in the thread's cache)
    if (chunks > 1) each_item(nb, [] { return 0; }, [&](int, int64_t i) { prepare(i); });
    each_item(chunks * nb, [] { return State{}; }, [&](State& st, int64_t i) {
      const int64_t c0 = i / nb * chunk, bi = i % nb, n0 = (b0 + bi) * BLOCK;
      if (chunks == 1) prepare(bi);
      const int cols = static_cast<int>(std::min<int64_t>(BLOCK, N - n0));
      const int32_t* wp = wp_all + bi * block_dwords;
      const float* sb = sb_all + bi * G * BLOCK;
      const float* mb = mins ? mb_all + bi * G * BLOCK : nullptr;
      for (int64_t m = c0; m < std::min(M, c0 + chunk); m += BLOCK) {
        const bool full = m + BLOCK <= M, two = m + TILE < M;  // two: rows m + 16 .. exist
        const uint16_t* xs[3];
        for (int p = 0; p < 3; ++p) xs[p] = full ? parts + p * n + m * K : tails + p * BLOCK * K;
        for (int64_t g = 0; g < G; ++g) {
          zero_c_tiles();
          for (int64_t k = g * group, end = k + group; k < end; k += 32) {  // 32 values of K: 64 bytes
            const int32_t* b = wp + k / 2 * TILE;
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + tile_dwords, 64);
            // the smallest part first; each A tile loaded again as soon as its two products are issued
            _tile_loadd(4, xs[2] + k, Kb);
            if (two) _tile_loadd(5, xs[2] + TILE * K + k, Kb);
            for (int p = 2; p >= 0; --p) {
              _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(1, 4, 7);
              if (p) _tile_loadd(4, xs[p - 1] + k, Kb);
              if (!two) continue;
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
              if (p) _tile_loadd(5, xs[p - 1] + TILE * K + k, Kb);
            }
          }
          store_c_tiles(st.c, two ? 0xF : 0x3);
          const int hs = two ? 2 : 1;
          if (mb)  // + m times the group's sum of x, as exact_few_rows adds it
            group_floats<true>(st.c, st.acc, sb + g * BLOCK, mb + g * BLOCK, xsum + g * Mp + m, hs, g == 0);
          else
            group_floats<false>(st.c, st.acc, sb + g * BLOCK, nullptr, nullptr, hs, g == 0);
        }
        const int64_t rows = std::min<int64_t>(BLOCK, M - m);
        for (int64_t r = 0; r < rows; ++r)
          for (int j = 0; j < 2 && TILE * j < cols; ++j)
            _mm512_mask_storeu_ps(y + (m + r) * N + n0 + TILE * j, lanes16(cols - TILE * j),
                                  _mm512_load_ps(st.acc[r] + TILE * j));
      }
    });
  }
}
#endif

void check_int8_pair(const char* name, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(has_amx_int8(), name, " needs AMX (amx-tile, amx-int8) and the kernel's permission to use its tiles");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.scalar_type() == at::kChar && b.scalar_type() == at::kChar &&
                  a.size(1) == b.size(1),
              name, ": int8 a [M, K] and b [N, K] expected, got ", a.sizes(), " ", a.scalar_type(), " and ", b.sizes(),
              " ", b.scalar_type());
  TORCH_CHECK(a.size(1) % 64 == 0 && a.size(1) < (int64_t(1) << 17), name,
              ": K must be a multiple of 64 below 2^17, got ", a.size(1));
}

// The weight-only AMX entries' checks (x's dtype is the caller's): x [M, K], 4- or 8-bit codes,
// float32 scale and zero_point [N, K / group] as the kernels read them.
void check_weight_only_amx(const char* who, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group) {
  TORCH_CHECK(has_amx_bf16(), who, " needs AMX (amx-tile, amx-bf16) and the kernel's permission to use its tiles");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && (bits == 4 || bits == 8), who,
              ": x [M, K], codes [N, ...] and 4 or 8 bits expected");
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % 32 == 0 && group > 0 && group % 32 == 0 && K % group == 0, who,
              ": K and group must be multiples of 32, group dividing K");
  TORCH_CHECK(codes.is_contiguous() && codes.size(1) * (bits == 4 ? 8 : 1) == K &&
                  (bits == 4 ? codes.scalar_type() == at::kInt
                             : (codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte)) &&
                  scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == N && scale.size(1) == K / group &&
                  (!zero_point || (zero_point->scalar_type() == at::kFloat && zero_point->is_contiguous() &&
                                   zero_point->sizes() == scale.sizes())),
              who, ": contiguous codes (int32 [N, K/8] or 8-bit [N, K]), float32 scale and zero_point [N, K/group] "
              "expected");
}

}  // namespace

// Exact int32 a [M, K] @ b [N, K].T of int8 matrices on AMX tiles (K a multiple of 64):
// torch._int_mm's integers (W8A8's product; the caller's epilogue gives the same bits).
at::Tensor int8_mm_amx(const at::Tensor& a, const at::Tensor& b) {
  check_int8_pair("lowbit._C.int8_mm_amx", a, b);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor y = at::empty({M, N}, a.options().dtype(at::kInt));
#ifdef LOWBIT_AMX_LINEAR
  if (M == 0 || N == 0) return y;
  int32_t* py = y.data_ptr<int32_t>();
  const uint8_t* pb = reinterpret_cast<const uint8_t*>(bc.data_ptr());
  run<false>(reinterpret_cast<const uint8_t*>(ac.data_ptr()), M, K, {N}, [&] { return StoredRows{{pb}, {N}, K, false}; },
      [&](size_t, const __m512i* r, int64_t m, int rows, int64_t n0, int cols, const int32_t*) {
        for (int i = 0; i < rows; ++i) _mm512_mask_storeu_epi32(py + (m + i) * N + n0, lanes16(cols), r[i]);
      });
#else
  TORCH_CHECK(false, "lowbit._C was built without the AMX linear kernels");
#endif
  return y;
}

#ifdef LOWBIT_AMX_LINEAR
void int8_linear_amx_into(const int8_t* a, int64_t M, int64_t K, const float* row, const int32_t* a_zp,
                          at::ScalarType out, const std::vector<Int8Out>& ws) {
  switch (out) {
    case at::kBFloat16: return linear_run<c10::BFloat16>(a, M, K, row, a_zp, out, ws);
    case at::kHalf: return linear_run<c10::Half>(a, M, K, row, a_zp, out, ws);
    default: return linear_run<float>(a, M, K, row, a_zp, out, ws);
  }
}
#else
void int8_linear_amx_into(const int8_t*, int64_t, int64_t, const float*, const int32_t*, at::ScalarType,
                          const std::vector<Int8Out>&) {
  TORCH_CHECK(false, "lowbit._C was built without the AMX linear kernels");
}
#endif

// int8_linear's contract and bits (gemm_int8.cpp) on AMX tiles: a int8 [M, K], a_zero_point
// int32 [M] or none, b int8 [N, K], row_scale float32 [M], col_scale float32 [N], bias [N] or
// none; y [M, N] in out_dtype.  K a multiple of 64.
at::Tensor int8_linear_amx(const at::Tensor& a, const c10::optional<at::Tensor>& a_zero_point, const at::Tensor& b,
                           const at::Tensor& row_scale, const at::Tensor& col_scale,
                           const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  check_int8_pair("lowbit._C.int8_linear_amx", a, b);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "lowbit._C.int8_linear_amx: unsupported out dtype ", out_dtype);
  TORCH_CHECK(row_scale.numel() == M && col_scale.numel() == N && (!bias || bias->numel() == N) &&
                  (!a_zero_point || a_zero_point->numel() == M),
              "lowbit._C.int8_linear_amx: row_scale and a_zero_point [M], col_scale and bias [N] expected");
  at::Tensor y = at::empty({M, N}, a.options().dtype(out_dtype));
#ifdef LOWBIT_AMX_LINEAR
  if (M == 0 || N == 0) return y;
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  const at::Tensor row = row_scale.to(at::kFloat).contiguous(), col = col_scale.to(at::kFloat).contiguous();
  const at::Tensor zp = a_zero_point ? a_zero_point->to(at::kInt).contiguous() : at::Tensor();
  const at::Tensor bias_f = bias ? bias->to(out_dtype).to(at::kFloat).contiguous() : at::Tensor();
  int8_linear_amx_into(ac.data_ptr<int8_t>(), M, K, row.data_ptr<float>(),
                       zp.defined() ? zp.data_ptr<int32_t>() : nullptr, out_dtype,
                       {Int8Out{bc.data_ptr<int8_t>(), N, col.data_ptr<float>(),
                                bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, y.data_ptr()}});
#else
  TORCH_CHECK(false, "lowbit._C was built without the AMX linear kernels");
#endif
  return y;
}

#ifdef LOWBIT_AMX_LINEAR
void bf16_linear_amx_into(const c10::BFloat16* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                          at::ScalarType out, const std::vector<Bf16Out>& ws) {
  const uint8_t* px = reinterpret_cast<const uint8_t*>(x);
  if (bits == 0) return dense_run(px, M, K, ws);
  (out == at::kBFloat16 ? weight_only_bits<c10::BFloat16> : weight_only_bits<float>)(px, M, K, group, bits, ws);
}
#else
void bf16_linear_amx_into(const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, at::ScalarType,
                          const std::vector<Bf16Out>&) {
  TORCH_CHECK(false, "lowbit._C was built without the AMX linear kernels");
}
#endif

// A bf16 nn.Linear's rows on AMX bf16 tiles: x bf16 [M, K], weight bf16 [N, K] (K a multiple of
// 32), bias bf16 [N] or none; y bf16 [M, N] = round(sum_k x w (+ bias)), float32 sums.
at::Tensor dense_amx(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_amx_bf16(), "lowbit._C.dense_amx needs AMX (amx-tile, amx-bf16) and the kernel's permission to use "
                              "its tiles");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
                  weight.scalar_type() == at::kBFloat16 && x.size(1) == weight.size(1),
              "lowbit._C.dense_amx: bfloat16 x [M, K] and weight [N, K] expected, got ", x.sizes(), " ",
              x.scalar_type(), " and ", weight.sizes(), " ", weight.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % 32 == 0, "lowbit._C.dense_amx: K must be a multiple of 32, got ", K);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kBFloat16 && bias->numel() == N),
              "lowbit._C.dense_amx: a bfloat16 bias [N] expected");
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef LOWBIT_AMX_LINEAR
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias ? y.copy_(bias->expand({M, N})) : y.zero_();
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor bias_f = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  dense_run(reinterpret_cast<const uint8_t*>(xc.data_ptr()), M, K,
            {Bf16Out{wc.data_ptr(), nullptr, nullptr, N, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                     y.data_ptr()}});
#else
  TORCH_CHECK(false, "lowbit._C was built without the AMX linear kernels");
#endif
  return y;
}

// weight_only_gemm_bf16's contract (gemm_bf16.cpp) on AMX tiles (run's two layouts): x float32,
// bf16 or float16 [M, K] (rounded to bf16), codes int32 [N, K/8] (4-bit) or int8/uint8 [N, K],
// scale and zero_point float32 [N, K/group] (zero_point none: signed codes; zero_point_min: the
// "min" domain's m, q * s + m); y float32 [M, N],
// or for bf16 x the float32 sums rounded once to bf16 (as y.to(bf16), without the float32 y).
at::Tensor weight_only_gemm_bf16_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                     const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                                     bool zero_point_min) {
  check_weight_only_amx("lowbit._C.weight_only_gemm_bf16_amx", x, codes, scale, zero_point, bits, group);
  TORCH_CHECK(!zero_point_min || zero_point.has_value(),
              "lowbit._C.weight_only_gemm_bf16_amx: zero_point_min needs the mins (zero_point)");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({M, N}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
#ifdef LOWBIT_AMX_LINEAR
  if (M == 0 || N == 0) return y;
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  const uint8_t* px = reinterpret_cast<const uint8_t*>(xb.data_ptr());
  const std::vector<Bf16Out> ws{Bf16Out{codes.data_ptr(), scale.data_ptr<float>(),
                                         zero_point ? zero_point->data_ptr<float>() : nullptr, N, nullptr,
                                         y.data_ptr(), zero_point_min}};
  (bf16 ? weight_only_bits<c10::BFloat16> : weight_only_bits<float>)(px, M, K, group, bits, ws);
#else
  TORCH_CHECK(false, "lowbit._C was built without the AMX linear kernels");
#endif
  return y;
}

// x float32 [M, K] @ W.T for a 4- or 8-bit weight with integer zero points (or signed codes),
// every product exact: x in three bf16 parts on AMX bf16 tiles (exact_run).  codes, scale,
// zero_point as weight_only_gemm_bf16_amx's (zero_point's values integers: float32 [N, K/group]);
// y float32 [M, N].
at::Tensor weight_only_gemm_f32_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                    const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                                    bool zero_point_min) {
  const char* who = "lowbit._C.weight_only_gemm_f32_amx";
  TORCH_CHECK(x.scalar_type() == at::kFloat, who, ": float32 x expected, got ", x.scalar_type());
  check_weight_only_amx(who, x, codes, scale, zero_point, bits, group);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(!zero_point_min || zero_point, who, ": zero_point_min needs the mins (zero_point)");
  if (zero_point && !zero_point_min)  // q - z exact in bf16 only for integers z (|q - z| <= 255)
    TORCH_CHECK(at::equal(*zero_point, zero_point->round()), who,
                ": integer zero points expected (or the \"min\" domain's mins, zero_point_min)");
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef LOWBIT_AMX_LINEAR
  if (M == 0 || N == 0) return y;
  const at::Tensor xc = x.contiguous();
  const uint8_t* w = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* s = scale.data_ptr<float>();
  const float* z = zero_point ? zero_point->data_ptr<float>() : nullptr;
  if (bits == 4)
    (z ? exact_run<4, false> : exact_run<4, true>)(xc.data_ptr<float>(), M, K, w, s, z, N, group, y.data_ptr<float>(),
                                                   zero_point_min);
  else
    (z ? exact_run<8, false> : exact_run<8, true>)(xc.data_ptr<float>(), M, K, w, s, z, N, group, y.data_ptr<float>(),
                                                   zero_point_min);
#else
  TORCH_CHECK(false, "lowbit._C was built without the AMX linear kernels");
#endif
  return y;
}
