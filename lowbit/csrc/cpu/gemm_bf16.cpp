// W4A16 / W8A16 beyond the decode kernels (M rows of activations, prefill): a bf16 GEMM
// with AVX512-BF16 dot products (vdpbf16ps: 32 multiply-adds per instruction, float32
// accumulation) whose weight panels are dequantized on the fly, so no float copy of the
// whole weight is ever made.
//
// Layout (the one oneDNN and BLIS use for bf16): a panel holds NP = 64 output columns of
// W for a chunk of K, as dwords of two bf16 (k, k + 1), panel[k / 2][column].  One
// vdpbf16ps multiplies 16 columns of a panel row with one dword of activations (the pair
// x[m, k], x[m, k + 1] broadcast to every lane), so each accumulator holds 16 outputs and
// needs no lane sums.  A register tile is MR = 6 rows x 64 columns: 24 accumulators, 4
// weight vectors and 1 broadcast (29 of the 32 zmm registers); each k pair issues 4 loads
// and 6 broadcasts for 24 dot products.  bf16 activations are read in place (a pair of
// bf16 is a dword); others are rounded to bf16 once per call.
//
// Per thread, for each panel of its column range and each chunk of K (KC values, so the
// panel stays in L2):
//   1. dequantize the chunk of 64 weight rows, (q - z) * s (q * s + m in the "min"
//      domain) in float32 as the reference computes it, rounded to bf16 (the one rounding of the weight).  16 rows at a time:
//      a 16 x 16 transpose of dwords turns 16 rows of packed codes into vectors whose
//      lane i belongs to row i (4-bit: a dword is 8 values, its byte b the pair
//      (2b, 2b + 1); 8-bit: a dword is 4 values, two pairs);
//   2. multiply every MR rows of activations with that panel, adding to the thread's
//      float32 partial sums of the earlier chunks; after the last chunk each sum is stored
//      into y, rounded once (bf16 y for bf16 x, else float32).
// A weight element is unpacked once per call whatever M is.
//
// The same GEMM on float32 FMAs (weight_only_gemm_fma), for cores whose vdpbf16ps costs
// several FMAs (the AVX-512 Xeon without AMX: 4): the panel holds each bf16 value widened
// to float32, panel[k][column], x is widened once per call, and the register tile (MR x 64,
// the same registers) multiplies one value of k per step, each accumulator one chain over
// all of K (chunks continue it from the partial sums): twice the panel bytes for twice the
// multiply-adds a cycle there.  For float32 x at matmul precision "highest"
// (weight_only_gemm_f32_fma) the same float32 panels hold the reference's float32 weight,
// not rounded to bf16, and x is read as it is: the reference's products, summed in order.

#include "dots.h"
#include "int8_epilogue.h"
#include "kernels.h"
#include "panels.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define LOWBIT_HAVE_BF16_GEMM 1
#endif

namespace {

#ifdef LOWBIT_HAVE_BF16_GEMM
// Values of K per chunk: the panel is KC_MAX * 128 bytes (192 KiB, in L2).  Measured on
// Zen 5, 2 threads, weights cold (4096x4096 and 14336x4096, M = 16 and 128, 4- and 8-bit):
// 256, 512, 1024 and 2048 within the noise of each other (about 10%); what mattered was
// prefetching the codes (pack_panel), 1.3-1.9x at M = 16.  On Zen 4 at 512 rows, K = 576
// and 1536 in one chunk rather than chunks of 288 and 512: 1.025x (576x1536 and 1536x576,
// 3 alternating rounds of two builds), 1.01-1.05x a 512-token W4A16 prefill.
constexpr int64_t KC_MAX = 1536;

// Columns [n0, n0 + 64) of W (rows beyond N repeat row N - 1; their outputs are never
// stored), values [k0, k0 + kc) with k0, kc multiples of 32, dequantized into
// panel[(k - k0) / 2][column] pairs of bf16 (F32: each value widened, panel[k - k0][column];
// F32 and EXACT: the float32 values themselves, not rounded to bf16).
// Npad a multiple of 64.  Each 16 x 64-byte block read also prefetches the
// same block of the next call's panel (rows next_n0 of next_src from next_k0; next_src null:
// none): 64 rows read
// in short runs are too many streams for the hardware prefetchers, and weights read once
// come from DRAM.
// vpermw index interleaving the two halves of cvtne2ps_pbh(hi, lo): lo0 hi0 lo1 hi1 ...
alignas(64) constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Codes lo and hi (16 int32 lanes each) of one group dequantized as the reference computes
// them in float32 ((q - z) * s; q * s for signed codes; q * s + m in the "min" domain, the
// product rounded, then the sum: its two steps), each rounded once to bf16 (vcvtne2ps2bf16
// rounds to nearest even, as torch's .to(torch.bfloat16)): lo's 16 values, then hi's.
template <bool HAS_ZP, bool MIN>
inline __m512 dequant_f32(__m512i q, __m512 sv, __m512 zv) {
  __m512 a = _mm512_cvtepi32_ps(q);
  if constexpr (HAS_ZP && !MIN) a = _mm512_sub_ps(a, zv);
  if constexpr (MIN) return mul_add_unfused(a, sv, zv);
  return _mm512_mul_ps(a, sv);
}

template <bool HAS_ZP, bool MIN>
inline __m512i dequant_bf16(__m512i lo, __m512i hi, __m512 sv, __m512 zv) {
  return (__m512i)_mm512_cvtne2ps_pbh(dequant_f32<HAS_ZP, MIN>(hi, sv, zv), dequant_f32<HAS_ZP, MIN>(lo, sv, zv));
}

// One weight of a panel GEMM call: codes w (rows of K / 2 bytes, 4-bit, or K bytes), scale and
// zero point transposed to [G][Npad] (st, zt; zt null without zero points), N rows, and its
// output y [M, N].
struct PanelSource {
  const uint8_t* w;
  const float* st;
  const float* zt;
  int64_t N, Npad;
  void* y;
};

template <int BITS, bool SIGNED, bool HAS_ZP, bool MIN, bool F32, bool EXACT>
void pack_panel(const PanelSource& src, int64_t K, int64_t group, int64_t n0, int64_t k0, int64_t kc,
                uint32_t* panel, const PanelSource* next_src, int64_t next_n0, int64_t next_k0) {
  constexpr int VALS = BITS == 4 ? 8 : 4;  // values per dword of a row
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  const uint8_t* w = src.w;
  const float *st = src.st, *zt = src.zt;
  const int64_t N = src.N, Npad = src.Npad;
  const __m512i inter = _mm512_load_si512(kInterleave);
  for (int v = 0; v < NV; ++v) {
    const int64_t c0 = n0 + 16 * v;
    const uint8_t* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = w + std::min<int64_t>(c0 + i, N - 1) * row_bytes;
    const uint8_t* next[16];
    if (next_src)
      for (int i = 0; i < 16; ++i)
        next[i] = next_src->w + std::min<int64_t>(next_n0 + 16 * v + i, next_src->N - 1) * row_bytes;
    for (int64_t kb = k0; kb < k0 + kc; kb += 16 * VALS) {  // 16 dwords of each row
      const int dwords = static_cast<int>(std::min<int64_t>(16, (k0 + kc - kb) / VALS));
      const __mmask16 mask = static_cast<__mmask16>((1u << dwords) - 1);
      const int64_t ahead = next_k0 + (kb - k0);
      if (next_src && ahead < K)
        for (int i = 0; i < 16; ++i) _mm_prefetch(reinterpret_cast<const char*>(next[i] + ahead / VALS * 4), _MM_HINT_T1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_epi32(mask, rows[i] + kb / VALS * 4);
      transpose16(r);
      for (int j = 0; j < dwords; ++j) {
        const int64_t k = kb + j * VALS;
        const int64_t g = k / group;
        const __m512 sv = _mm512_loadu_ps(st + g * Npad + c0);
        const __m512 zv = HAS_ZP ? _mm512_loadu_ps(zt + g * Npad + c0) : _mm512_setzero_ps();
        uint32_t* out = panel + (F32 ? k - k0 : (k - k0) / 2) * NP + 16 * v;
        for (int p = 0; p < VALS / 2; ++p) {  // pair p of the dword: values 2p, 2p + 1
          __m512i lo, hi;
          constexpr int W = BITS;  // bits per value
          if constexpr (SIGNED) {
            lo = _mm512_srai_epi32(_mm512_slli_epi32(r[j], 32 - W * (2 * p + 1)), 32 - W);
            hi = _mm512_srai_epi32(_mm512_slli_epi32(r[j], 32 - W * (2 * p + 2)), 32 - W);
          } else {
            const __m512i m = _mm512_set1_epi32((1 << W) - 1);
            lo = _mm512_and_si512(_mm512_srli_epi32(r[j], W * 2 * p), m);
            hi = _mm512_and_si512(_mm512_srli_epi32(r[j], W * (2 * p + 1)), m);
          }
          if constexpr (EXACT) {  // the float32 values themselves: rows k + 2p and k + 2p + 1
            _mm512_storeu_ps(reinterpret_cast<float*>(out + 2 * p * NP), dequant_f32<HAS_ZP, MIN>(lo, sv, zv));
            _mm512_storeu_ps(reinterpret_cast<float*>(out + (2 * p + 1) * NP), dequant_f32<HAS_ZP, MIN>(hi, sv, zv));
            continue;
          }
          const __m512i ab = dequant_bf16<HAS_ZP, MIN>(lo, hi, sv, zv);
          if constexpr (F32) {  // the same bf16 values widened: rows k + 2p and k + 2p + 1
            _mm512_storeu_ps(reinterpret_cast<float*>(out + 2 * p * NP), bf16x16(_mm512_castsi512_si256(ab)));
            _mm512_storeu_ps(reinterpret_cast<float*>(out + (2 * p + 1) * NP), bf16x16(_mm512_extracti64x4_epi64(ab, 1)));
          } else {
            _mm512_storeu_si512(out + p * NP, _mm512_permutexvar_epi16(inter, ab));
          }
        }
      }
    }
  }
}

// A tile's R x 64 sums acc (plus the partial sums in part where add_part) stored: into part,
// or rounded once into y[r, 0:ncols] (T: float32 or bf16) at the `last` chunk of K.
template <int R, typename T>
void store_tile(__m512 (&acc)[R][NV], float* part, T* y, int64_t ldy, int ncols, bool add_part, bool last) {
  for (int v = 0; v < NV; ++v) {
    const int left = ncols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    for (int r = 0; r < R; ++r) {
      __m512 s = acc[r][v];
      if (add_part) s = _mm512_add_ps(s, _mm512_loadu_ps(part + r * NP + 16 * v));
      if (last) int8_epilogue::store<T>(y + r * ldy + 16 * v, mask, s);
      else _mm512_storeu_ps(part + r * NP + 16 * v, s);
    }
  }
}

// The sums over kp pairs of x[r] . panel, R rows (R <= MR) x 64 columns, added to the
// float32 partial sums of the earlier chunks of K (part, rows of NP; not `first`), then
// stored (store_tile).
template <int R, typename T>
void tile(const uint32_t* x, int64_t ldx, const uint32_t* panel, int64_t kp, float* part, T* y, int64_t ldy,
          int ncols, bool first, bool last) {
  __m512 acc[R][NV];
  panel_dots<R>(acc, x, ldx, panel, kp,
                [](__m512 c, __m512i a, __m512i b) { return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b); });
  store_tile<R>(acc, part, y, ldy, ncols, !first, last);
}

// The float32 panels' tile: the same R x 64 outputs from x and the panel as float32 (one
// value of k per dword, kc steps), by FMAs; each accumulator continues the partial sums of
// the earlier chunks (part; not `first`): one chain per output over all of K, in order.
// (A 12 x 32 tile, half the panel bytes per FMA, and chunks of 64-384 values, the panel in
// L1, were level with this one on the Xeon without AMX.)
template <int R, typename T>
void tile_f32(const uint32_t* x, int64_t ldx, const uint32_t* panel, int64_t kc, float* part, T* y, int64_t ldy,
              int ncols, bool first, bool last) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + r * NP + 16 * v);
  panel_dots_add<R>(acc, x, ldx, panel, kc, [](__m512 c, __m512i a, __m512i b) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), c);
  });
  store_tile<R>(acc, part, y, ldy, ncols, false, last);
}

template <typename T>
using TileFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*, T*, int64_t, int, bool, bool);
template <typename T, bool F32, int... Rs>
constexpr std::array<TileFn<T>, MR> tile_table(std::integer_sequence<int, Rs...>) {
  if constexpr (F32) return {tile_f32<Rs + 1, T>...};
  else return {tile<Rs + 1, T>...};
}
template <typename T, bool F32>
constexpr auto TILES = tile_table<T, F32>(std::make_integer_sequence<int, MR>{});


// The GEMM's loop over the weights ws of one x: every panel of NP rows of every weight and
// every part of the activation rows (PanelItems, tiles of tile_rows rows) shared between
// threads as each_item shares items (a static split waits for the slower of the VM's two
// threads: 1.03-1.13x at the bundled model's shapes, M = 128 and 512, on the Xeon without
// AMX, in-process A/B); for each item and each chunk of K (equal chunks of at most kc_max
// values, whole 32-blocks) the chunk dequantized into the thread's panel and step(j, panel,
// part, m0, m1, n0, k0, kc, ncols) for weight j's rows n0.. and the item's rows [m0, m1),
// part: the thread's float32 buffer for their partial sums over the chunks (rows of NP; null
// where K is one chunk).  The codes of the next chunk (or item) arrive while this one is
// multiplied.
template <int BITS, bool SIGNED, bool HAS_ZP, bool MIN, bool F32, bool EXACT, typename Step>
void each_chunk(const std::vector<PanelSource>& ws, int64_t M, int64_t K, int64_t group, int64_t kc_max,
                int64_t tile_rows, Step step) {
  const int64_t chunks = (K + kc_max - 1) / kc_max;
  const int64_t KC = (K / 32 + chunks - 1) / chunks * 32;
  std::vector<int64_t> Ns;
  for (const PanelSource& src : ws) Ns.push_back(src.N);
  const PanelItems items(Ns, NP, M, tile_rows);
  const int64_t n = items.size();
  struct Scratch {
    PanelBuffer buf;
    std::vector<float> part;
  };
  const auto make = [&] {
    return Scratch{PanelBuffer((F32 ? KC : KC / 2) * NP), std::vector<float>(KC < K ? items.work.rows * NP : 0)};
  };
  each_item(n, make, [&](Scratch& s, int64_t i) {
    const auto [j, n0, m0, m1] = items[i];
    const int ncols = static_cast<int>(std::min<int64_t>(NP, ws[j].N - n0));
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      const bool more = k0 + kc < K;  // then the next chunk of this panel, else the next item's first
      const PanelItems::Item next = more || i + 1 == n ? PanelItems::Item{j, n0, 0, 0} : items[i + 1];
      pack_panel<BITS, SIGNED, HAS_ZP, MIN, F32, EXACT>(ws[j], K, group, n0, k0, kc, s.buf.data,
                                                 more || i + 1 < n ? &ws[next.j] : nullptr, next.n0,
                                                 more ? k0 + kc : 0);
      step(j, static_cast<const uint32_t*>(s.buf.data), s.part.empty() ? nullptr : s.part.data(), m0, m1, n0, k0,
           kc, ncols);
    }
  });
}

// xa: x as pairs of bf16 [M][K / 2], or F32: as float32 [M][K] (bf16 values widened; EXACT:
// float32 x as it is); each weight's y of type T.
template <int BITS, bool SIGNED, bool HAS_ZP, bool MIN, bool F32, bool EXACT, typename T>
void gemm(const uint32_t* xa, const std::vector<PanelSource>& ws, int64_t M, int64_t K, int64_t group) {
  constexpr int64_t per = F32 ? 1 : 2;  // values of K per dword
  const int64_t ldx = K / per;
  each_chunk<BITS, SIGNED, HAS_ZP, MIN, F32, EXACT>(
      ws, M, K, group, KC_MAX, MR,
      [&](size_t j, const uint32_t* panel, float* part, int64_t m0, int64_t m1, int64_t n0, int64_t k0, int64_t kc,
          int ncols) {
        const int64_t N = ws[j].N;
        T* y = static_cast<T*>(ws[j].y);
        for (int64_t m = m0; m < m1; m += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, m1 - m));
          TILES<T, F32>[mr - 1](xa + m * ldx + k0 / per, ldx, panel, kc / per, part ? part + (m - m0) * NP : nullptr,
                                y + m * N + n0, N, ncols, k0 == 0, k0 + kc >= K);
        }
      });
}

// Up to kRowsMaxM rows of x, the weight-only GEMM takes the row-dot form instead (dots.h):
// each group of 4 weight rows dequantized once per call into bf16 rows in L1, as pack_panel
// computes each value, then multiplied with every row of x, kDotRows at a time.  The panels'
// 16 x 16 transposes and layout cost more than their register tile saves at tens of rows.
constexpr int64_t kRowsMaxM = 64;

// Rows n .. n + 3 of W (rows past N repeat row N - 1), dequantized into out[r * K + k].
// 4-bit codes go through a table: at each group's start, the 16 values its codes can take,
// computed by dequant_bf16 as for any code (so with the same bits), then one vpermw per
// 32 values (5 operations where converting each value took 11).
template <int BITS, bool SIGNED, bool HAS_ZP, bool MIN>
void dequant_rows(const uint8_t* w, const float* s, const float* z, int64_t N, int64_t K, int64_t G, int64_t group,
                  int64_t n, uint16_t* out) {
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  // lane c: the value of code c (a signed nibble c >= 8 is c - 16)
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i codes16 = SIGNED ? _mm512_srai_epi32(_mm512_slli_epi32(iota, 28), 28) : iota;
  for (int r = 0; r < 4; ++r) {
    const int64_t row = std::min(n + r, N - 1);
    const uint8_t* codes = w + row * row_bytes;
    __m512i table = _mm512_setzero_si512();  // words 0..15: code c's bf16 value in this group
    for (int64_t k = 0; k < K; k += 32) {
      const int64_t g = row * G + k / group;
      const auto sv = [&] { return _mm512_set1_ps(s[g]); };
      const auto zv = [&] { return HAS_ZP ? _mm512_set1_ps(z[g]) : _mm512_setzero_ps(); };
      __m512i v;
      if constexpr (BITS == 4) {
        if (k % group == 0) table = dequant_bf16<HAS_ZP, MIN>(codes16, codes16, sv(), zv());
        // dword i = byte i of the codes; word 2i its low nibble (value 2i), word 2i + 1 its high one
        const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k / 2)));
        const __m512i idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F),
                                                      0xA8);  // (a | b) & c
        v = _mm512_permutexvar_epi16(idx, table);
      } else {  // values i and 16 + i
        const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k));
        const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k + 16));
        v = dequant_bf16<HAS_ZP, MIN>(SIGNED ? _mm512_cvtepi8_epi32(b0) : _mm512_cvtepu8_epi32(b0),
                                      SIGNED ? _mm512_cvtepi8_epi32(b1) : _mm512_cvtepu8_epi32(b1), sv(), zv());
      }
      _mm512_storeu_si512(out + r * K + k, v);
    }
  }
}

template <int BITS, bool SIGNED, bool HAS_ZP, bool MIN>
void rows_gemm(const uint16_t* x, const uint8_t* w, const float* s, const float* z, int64_t M, int64_t N, int64_t K,
               int64_t G, int64_t group, float* y) {
  const int64_t row_bytes = BITS == 4 ? K / 2 : K, lines = (4 * row_bytes + 63) / 64;  // of a group's codes
  each_item(
      (N + 3) / 4, [K] { return std::vector<uint16_t>(4 * K); },
      [&](std::vector<uint16_t>& buf, int64_t grp) {
        const int64_t n = 4 * grp;
        dequant_rows<BITS, SIGNED, HAS_ZP, MIN>(w, s, z, N, K, G, group, n, buf.data());
        const uint16_t* rows[4] = {buf.data(), buf.data() + K, buf.data() + 2 * K, buf.data() + 3 * K};
        const bool pf = n + 4 * kDotsAhead + 4 <= N;
        dot_all_rows(x, K, M, rows, K, y + n, N, static_cast<int>(std::min<int64_t>(4, N - n)),
                     reinterpret_cast<const char*>(w + (n + 4 * kDotsAhead) * row_bytes), pf ? lines : 0);
      });
}

#endif

}  // namespace

// Whether weight_only_gemm_bf16 handles K and group: whole 32-value blocks, each inside
// one group.
bool gemm_bf16_supported(int64_t K, int64_t group) {
#ifdef LOWBIT_HAVE_BF16_GEMM
  return K % 32 == 0 && group % 32 == 0;
#else
  (void)K, (void)group;
  return false;
#endif
}

#ifdef LOWBIT_HAVE_BF16_GEMM
namespace {
// f(bits, signed codes, zero points, "min" domain) as integral constants: signed codes
// without z, unsigned ones with z (or with mins).
template <typename F>
void with_kind(int64_t bits, bool zero_point, bool zero_point_min, F f) {
  using std::false_type, std::true_type;
  const auto kind = [&](auto b) {
    if (zero_point_min) f(b, false_type{}, true_type{}, true_type{});
    else if (zero_point) f(b, false_type{}, true_type{}, false_type{});
    else f(b, true_type{}, false_type{}, false_type{});
  };
  if (bits == 4) kind(std::integral_constant<int, 4>{});
  else kind(std::integral_constant<int, 8>{});
}

// The panels' arithmetic: bf16 dot products (gemm_bf16), float32 FMAs on the same bf16 values
// widened (gemm_fma), or float32 FMAs on float32 x and the reference's float32 weight
// (gemm_f32_fma: float32 x at matmul precision "highest").
enum class PanelMath { kBf16Dots, kFma, kF32 };

// x (bf16 [M, K], kF32: float32) times each weight of ws (as stored: scale and zero point
// float32 [N, G]; one kind, `zero_point` or not, all of `bits` and `group`) into its y [M, N]:
// bf16 where bf16_out (each float32 sum rounded once), else float32.  Up to kRowsMaxM rows
// of bf16 dots the rows form per weight; else the panels of all weights in one loop
// (each_chunk), bf16 x widened once for kFma.
void panels_run(const void* x, int64_t M, int64_t K, int64_t bits, int64_t group, bool zero_point,
                bool zero_point_min, PanelMath math, bool bf16_out, const std::vector<PanelWeight>& ws) {
  if (M == 0) return;
  const int64_t G = K / group;
  const uint16_t* xb = static_cast<const uint16_t*>(x);
  if (M <= kRowsMaxM && math == PanelMath::kBf16Dots) {
    thread_local std::vector<float> yf_keep;
    for (const PanelWeight& wt : ws) {
      float* py = bf16_out ? grown(yf_keep, M * wt.N) : static_cast<float*>(wt.y);
      with_kind(bits, zero_point, zero_point_min, [&](auto b, auto sg, auto zp, auto mn) {
        rows_gemm<decltype(b)::value, decltype(sg)::value, decltype(zp)::value, decltype(mn)::value>(
            xb, wt.w, wt.s, wt.z, M, wt.N, K, G, group, py);
      });
      if (bf16_out)  // rounded to nearest even, as .to(bfloat16)
        at::from_blob(wt.y, {M * wt.N}, at::kBFloat16).copy_(at::from_blob(py, {M * wt.N}, at::kFloat));
    }
    return;
  }
  // scale and zero point as [G][Npad], zeros past row N: lane i of a vector load at column c
  // is column c + i's value
  std::vector<std::vector<float>> st(ws.size()), zt(ws.size());
  std::vector<PanelSource> src;
  for (size_t j = 0; j < ws.size(); ++j) {
    const PanelWeight& wt = ws[j];
    const int64_t N = wt.N, Npad = (N + NP - 1) / NP * NP;
    st[j].assign(G * Npad, 0.0f);
    if (zero_point) zt[j].assign(G * Npad, 0.0f);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < G; ++g) {
        st[j][g * Npad + n] = wt.s[n * G + g];
        if (zero_point) zt[j][g * Npad + n] = wt.z[n * G + g];
      }
    src.push_back(PanelSource{wt.w, st[j].data(), zero_point ? zt[j].data() : nullptr, N, Npad, wt.y});
  }
  const uint32_t* xa = static_cast<const uint32_t*>(x);
  thread_local std::vector<float> xf_keep;
  if (math == PanelMath::kFma) {  // the bf16 values widened (exact), rows split between the threads
    float* dst = grown(xf_keep, M * K);
    at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * K; i < r1 * K; i += 16) _mm512_storeu_ps(dst + i, bf16x16(xb + i));  // K: 32s
    });
    xa = reinterpret_cast<const uint32_t*>(dst);
  }
  with_kind(bits, zero_point, zero_point_min, [&](auto b, auto sg, auto zp, auto mn) {
    constexpr int B = decltype(b)::value;
    constexpr bool S = decltype(sg)::value, Z = decltype(zp)::value, MN = decltype(mn)::value;
    if (math == PanelMath::kF32) gemm<B, S, Z, MN, true, true, float>(xa, src, M, K, group);
    else if (math == PanelMath::kFma && bf16_out) gemm<B, S, Z, MN, true, false, c10::BFloat16>(xa, src, M, K, group);
    else if (math == PanelMath::kFma) gemm<B, S, Z, MN, true, false, float>(xa, src, M, K, group);
    else if (bf16_out) gemm<B, S, Z, MN, false, false, c10::BFloat16>(xa, src, M, K, group);
    else gemm<B, S, Z, MN, false, false, float>(xa, src, M, K, group);
  });
}
}  // namespace
#endif

namespace {
// The entries below: their checks, x rounded to bf16 (kF32: float32 x as it is), then
// panels_run for the one weight.
at::Tensor panel_gemm(const char* who, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group, bool zero_point_min,
                      PanelMath math) {
  TORCH_CHECK(x.dim() == 2 && gemm_bf16_supported(x.size(1), group), who,
              ": x [M, K] with K and the group multiples of 32, each 32-block inside one group, expected");
  TORCH_CHECK(bits == 4 || bits == 8, who, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              who, ": contiguous x [M, K] and float32 scale expected");
  TORCH_CHECK(math != PanelMath::kF32 || x.scalar_type() == at::kFloat, who, ": float32 x expected, got ",
              x.scalar_type());
  TORCH_CHECK(!zero_point_min || zero_point.has_value(), who, ": zero_point_min needs the mins (zero_point)");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) * (codes.element_size() * 8 / bits) == K, who, ": codes [", N,
              ", ", K, " values] expected");
  // bf16 x: y in bf16, each float32 sum rounded once (in the panels' store; after the rows')
  const bool bf16_out = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({M, N}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
#ifdef LOWBIT_HAVE_BF16_GEMM
  if (M == 0 || N == 0) return y;
  // rounded to nearest even, as torch does
  const at::Tensor xb = math == PanelMath::kF32 ? x : x.to(at::kBFloat16).contiguous();
  const at::Tensor zc = zero_point ? zero_point->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(scale.numel() == N * (K / group) && (!zc.defined() || zc.numel() == N * (K / group)), who,
              ": scale and zero point [N, ", K / group, "] expected");
  panels_run(xb.data_ptr(), M, K, bits, group, zc.defined(), zero_point_min, math, bf16_out,
             {PanelWeight{reinterpret_cast<const uint8_t*>(codes.data_ptr()), scale.data_ptr<float>(),
                          zc.defined() ? zc.data_ptr<float>() : nullptr, N, y.data_ptr()}});
#else
  (void)K, (void)zero_point_min, (void)math;
  TORCH_CHECK(false, who, " needs AVX-512 with BF16 (F, BW, VL)");
#endif
  return y;
}
}  // namespace

// panels_run for several weights of one bf16 x (q/k/v, gate/up: one parallel region, x
// widened once); the same bits as weight_only_gemm_bf16 (fma: weight_only_gemm_fma) on each.
void weight_only_panels_into(const c10::BFloat16* x, int64_t M, int64_t K, int64_t bits, int64_t group,
                             bool zero_point, bool zero_point_min, bool fma, const std::vector<PanelWeight>& ws) {
  TORCH_CHECK(gemm_bf16_supported(K, group) && (bits == 4 || bits == 8) && (zero_point || !zero_point_min),
              "lowbit._C.weight_only_panels_into: unsupported K/group/bits");
#ifdef LOWBIT_HAVE_BF16_GEMM
  panels_run(x, M, K, bits, group, zero_point, zero_point_min, fma ? PanelMath::kFma : PanelMath::kBf16Dots, true,
             ws);
#else
  (void)x, (void)M, (void)ws, (void)fma;
#endif
}

// The same for float32 x on weight_only_gemm_f32_fma's panels (float32 y): its bits on each.
void weight_only_panels_f32_into(const float* x, int64_t M, int64_t K, int64_t bits, int64_t group, bool zero_point,
                                 bool zero_point_min, const std::vector<PanelWeight>& ws) {
  TORCH_CHECK(gemm_bf16_supported(K, group) && (bits == 4 || bits == 8) && (zero_point || !zero_point_min),
              "lowbit._C.weight_only_panels_f32_into: unsupported K/group/bits");
#ifdef LOWBIT_HAVE_BF16_GEMM
  panels_run(x, M, K, bits, group, zero_point, zero_point_min, PanelMath::kF32, false, ws);
#else
  (void)x, (void)M, (void)ws;
#endif
}

// x float32/bfloat16/float16 [M, K] (rounded to bf16); codes int8/uint8 [N, K] or int32
// [N, K/8]; scale, zero_point float32 [N, G]: (q - z) * s, or q * s + z with zero_point_min
// (unsigned codes, the "min" domain).  Returns [M, N]: bf16 for bf16 x (each float32 sum
// rounded once, as .to(bfloat16)), else float32.
at::Tensor weight_only_gemm_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                                 bool zero_point_min) {
  return panel_gemm("lowbit._C.weight_only_gemm_bf16", x, codes, scale, zero_point, bits, group, zero_point_min,
                    PanelMath::kBf16Dots);
}

// weight_only_gemm_bf16's contract and weight (the reference's dequantization rounded once
// to bf16) on float32 FMAs: x rounded to bf16 and widened to float32 once per call, the
// panels' bf16 values widened as they are packed (twice the bytes: KC_MAX * 256), each
// product exact in float32 (8-bit significands), each output the float32 sum in the order
// of k.  For machines whose vdpbf16ps costs much more than two FMAs (bf16_dot_cost).  Any
// M goes through the panels.
at::Tensor weight_only_gemm_fma(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                                bool zero_point_min) {
  return panel_gemm("lowbit._C.weight_only_gemm_fma", x, codes, scale, zero_point, bits, group, zero_point_min,
                    PanelMath::kFma);
}

// Float32 x [M, K] at matmul precision "highest": weight_only_gemm_fma's panels and FMAs on x
// as it is and the reference's float32 weight, (q - z) * s (q * s + m in the "min" domain:
// the product rounded, then the sum), never rounded to bf16; each output the float32 FMA
// chain over k in order (within gamma_K of sum |x| |w|; bit for bit weight_only_gemm_fma's
// where x and the weight are bf16 values).  Returns float32 [M, N].
at::Tensor weight_only_gemm_f32_fma(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                    const c10::optional<at::Tensor>& zero_point, int64_t bits, int64_t group,
                                    bool zero_point_min) {
  return panel_gemm("lowbit._C.weight_only_gemm_f32_fma", x, codes, scale, zero_point, bits, group, zero_point_min,
                    PanelMath::kF32);
}

// Nanoseconds per 512-bit FMA (16 multiply-adds) and per vdpbf16ps (32), each timed on 12
// independent chains (more than latency x throughput on the machines seen), the best of 16
// alternating tries on the calling thread: {fma, vdpbf16ps}; empty without AVX512-BF16.  Where
// a vdpbf16ps costs more than two FMAs (Intel's AVX-512 cores without AMX: ~4), float32
// FMAs on widened bf16 values do more multiply-adds a cycle than bf16 dot products.
std::vector<double> bf16_dot_cost() {
#ifdef LOWBIT_HAVE_BF16_GEMM
  constexpr int kChains = 12, kIters = 2000;
  const auto timed = [](auto step) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / (kChains * kIters);
  };
  volatile float sink = 0;
  const auto fmas = [&] {
    __m512 acc[kChains];
    for (auto& a : acc) a = _mm512_setzero_ps();
    const __m512 a = _mm512_set1_ps(1e-8f), b = _mm512_set1_ps(1e-8f);
    for (int i = 0; i < kIters; ++i)
      for (auto& c : acc) c = _mm512_fmadd_ps(a, b, c);
    __m512 t = acc[0];
    for (int c = 1; c < kChains; ++c) t = _mm512_add_ps(t, acc[c]);
    sink = _mm512_reduce_add_ps(t);
  };
  const auto dots = [&] {
    __m512 acc[kChains];
    for (auto& a : acc) a = _mm512_setzero_ps();
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-4f), _mm512_set1_ps(1e-4f));
    for (int i = 0; i < kIters; ++i)
      for (auto& c : acc) c = _mm512_dpbf16_ps(c, a, a);
    __m512 t = acc[0];
    for (int c = 1; c < kChains; ++c) t = _mm512_add_ps(t, acc[c]);
    sink = _mm512_reduce_add_ps(t);
  };
  double best_fma = 1e30, best_dot = 1e30;
  for (int i = 0; i < 16; ++i) {
    best_fma = std::min(best_fma, timed(fmas));
    best_dot = std::min(best_dot, timed(dots));
  }
  (void)sink;
  return {best_fma, best_dot};
#else
  return {};
#endif
}
