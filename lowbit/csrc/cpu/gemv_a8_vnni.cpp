// One row of int8 activation blocks times 4-bit weight codes on AVX-512 VNNI, with
// gemm_a8.cpp's arithmetic bit for bit (so gemm_amx.cpp's and gemm_a8_vnni.cpp's too):
// what gemm_amx.cpp (the a8 blocks' AMX path) runs for one row of x.
//
// 16 weight rows at a time, 128 values (64 code bytes) a step: a row's bytes give its low
// nibbles (values 2i) and high ones (2i + 1) as two vectors of 64 u8 codes with no
// reordering, and x's codes are laid out once per call to match (per 128 values, the 64 even
// ones then the 64 odd ones), so two vpdpbusd give 16 int32 lanes, 4 per block of 32:
//   p[r] lane 4b + i = part i of block b's exact dot product (of this step's 4 blocks)
// Adding the parts while transposing (two rounds of unpack and add, then a 4 x 4 transpose
// of 128-bit lanes: 44 instructions for 16 rows x 4 blocks) gives per block one vector of
// the 16 rows' exact sums, and the floats run with the weight rows in the lanes:
//   acc = fma(float(dot_b), s[g(b)] * d[b], acc)           blocks in order, from acc = 0
//   y   = acc - zscale * sum_g fma(sz[g], xs[g], .)         groups in order
// gemm_amx.cpp's rows16 lane for lane (signed codes as u = q + 8, zscale 8).
//
// There the tile products would fill one column of 16: this is 2.5x those tiles, 1.1-1.4x
// gemv_a8.cpp's AVX2 rows with the weights in L2 and 1.0-1.24x with them in the L3 (figures
// at the plan's AMX_A8_ROWS_MAX_M).  A tile version (x as a block-diagonal B tile, 16 blocks
// a tile product, one C store per 16 x 512 codes) took 1.4-1.6x as long for 4-bit codes: its
// A tiles pass through memory, and a tile product with its two tile loads costs ~17-20 ns on
// this VM however few of its columns count.  For 8-bit codes it beat gemv_a8 1.1-1.4x with
// the weights in L2 but decoded q8_0-a8 at 0.85x, so it was dropped.

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
#include <vector>

#if defined(LOWBIT_A8_BLOCKS) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define LOWBIT_GEMV_A8_VNNI 1
#endif

namespace {

#ifdef LOWBIT_GEMV_A8_VNNI
using a8::BLOCK;
constexpr int ROWS = 16;        // weight rows a strip: one float lane each
constexpr int64_t WIDTH = 128;  // values a step: 64 code bytes of a row
// The strip two on is fetched a part per step: weights of a decode step come from the L3,
// 16 rows read side by side are 16 streams, and one strip ahead was too late (1536 x 576 and
// 576 x 1536 from the L3, 2 threads: 1.07-1.13x / 1.23-1.24x gemv_a8 two ahead, 1.00-1.03x /
// 1.10-1.16x one ahead).
constexpr int64_t kStripsAhead = 2;

// x's one row in blocks (a8::quantize_row): codes by step, [even 64 | odd 64] (zero past K),
// block scales d [nb] and group sums xs [G].
struct Prepared {
  const int8_t* q;
  const float* d;
  const float* xs;
  bool finite;
};

template <typename X>
Prepared prepare(const X* x, int64_t K, int64_t group) {
  thread_local std::vector<int8_t> codes_keep, q_keep;
  thread_local std::vector<float> d_keep, xs_keep;
  const int64_t steps = (K + WIDTH - 1) / WIDTH;
  int8_t* codes = grown(codes_keep, K);
  float *d = grown(d_keep, K / BLOCK), *xs = grown(xs_keep, K / group);
  if (!a8::quantize_row<int8_t>(x, K, group, false, codes, d, xs)) return {nullptr, d, xs, false};
  int8_t* q = grown(q_keep, steps * WIDTH);
  std::memset(q, 0, steps * WIDTH);
  for (int64_t k = 0; k < K; ++k) q[(k / WIDTH) * WIDTH + (k % 2) * 64 + (k % WIDTH) / 2] = codes[k];
  return {q, d, xs, true};
}

// p[r]: 16 lanes, 4 parts of each of 4 blocks (lane 4b + i) of row r -> v[b]: block b's
// sums of the 16 rows (lane r).  Exact int32 sums in any order.
inline void sum_parts(__m512i p[ROWS], __m512i v[4]) {
  __m512i q[8], w[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [r parts 0+2, r+1 parts 0+2, r 1+3, r+1 1+3]
    q[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * i], p[2 * i + 1]),
                            _mm512_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
  for (int j = 0; j < 4; ++j)  // per 128-bit lane b: block b of rows 4j .. 4j + 3
    w[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(q[2 * j], q[2 * j + 1]),
                            _mm512_unpackhi_epi64(q[2 * j], q[2 * j + 1]));
  const __m512i t0 = _mm512_shuffle_i32x4(w[0], w[1], 0x44), t1 = _mm512_shuffle_i32x4(w[0], w[1], 0xEE);
  const __m512i t2 = _mm512_shuffle_i32x4(w[2], w[3], 0x44), t3 = _mm512_shuffle_i32x4(w[2], w[3], 0xEE);
  v[0] = _mm512_shuffle_i32x4(t0, t2, 0x88), v[1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
  v[2] = _mm512_shuffle_i32x4(t1, t3, 0x88), v[3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
}

// Weight rows n0 .. n1 - 1 of wt times the prepared row into y[n0 .. n1), 16 at a time.
template <bool SIGNED, typename Y>
void weight_rows(const PackedWeight& wt, const Prepared& xp, int64_t K, int64_t group, int64_t n0, int64_t n1, Y* y) {
  thread_local std::vector<float> scale_keep, zfactor_keep;
  const int64_t G = K / group, nb = K / BLOCK, per_group = group / BLOCK, row_bytes = K / 2;
  const int64_t steps = (K + WIDTH - 1) / WIDTH;
  float* scale = grown(scale_keep, G * ROWS);
  float* zfactor = grown(zfactor_keep, G * ROWS);
  // the bytes of a row's last step (the rest masked off: zero codes against zero x)
  const int64_t tail = row_bytes - (steps - 1) * 64;
  const __mmask64 tail_mask = tail >= 64 ? ~0ULL : (1ULL << tail) - 1;
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(SIGNED ? 0x08 : 0x00);
  const int64_t lines = (ROWS * row_bytes / 64 + steps - 1) / steps;  // of the next strip, per step
  for (int64_t n = n0; n < n1; n += ROWS) {
    const int rows = static_cast<int>(std::min<int64_t>(ROWS, n1 - n));
    int64_t idx[ROWS];  // rows past the end: the strip's last
    const uint8_t* row[ROWS];
    for (int r = 0; r < ROWS; ++r) idx[r] = n + std::min(r, rows - 1), row[r] = wt.w + idx[r] * row_bytes;
    with_scales(wt, [&](const auto* s, const auto* z) { a8::strip_scales(s, z, wt.min, G, idx, scale, zfactor); });
    const char* next = reinterpret_cast<const char*>(wt.w + (n + kStripsAhead * ROWS) * row_bytes);
    __m512 acc = _mm512_setzero_ps();
    int64_t blk = 0, g = 0, in_group = 0;
    for (int64_t t = 0; t < steps; ++t) {
      for (int64_t l = t * lines; l < (t + 1) * lines; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
      const __mmask64 live = t == steps - 1 ? tail_mask : ~0ULL;
      const __m512i xe = _mm512_loadu_si512(xp.q + t * WIDTH), xo = _mm512_loadu_si512(xp.q + t * WIDTH + 64);
      __m512i p[ROWS];
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) {
        const __m512i raw = _mm512_maskz_loadu_epi8(live, row[r] + t * 64);
        const __m512i lo = _mm512_ternarylogic_epi32(raw, low, flip, 0x6A);  // (raw & low) ^ flip
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), low, flip, 0x6A);
        p[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
      }
      __m512i v[4];
      sum_parts(p, v);
      for (int b = 0; b < 4 && blk < nb; ++b, ++blk) {
        const __m512 sd = _mm512_mul_ps(_mm512_loadu_ps(scale + g * ROWS), _mm512_set1_ps(xp.d[blk]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v[b]), sd, acc);
        if (++in_group == per_group) ++g, in_group = 0;
      }
    }
    __m512 zt = _mm512_setzero_ps();
    const float* zf = wt.z ? zfactor : scale;  // signed codes: the factor is s (strip_scales)
    for (int64_t i = 0; i < G; ++i) zt = _mm512_fmadd_ps(_mm512_loadu_ps(zf + i * ROWS), _mm512_set1_ps(xp.xs[i]), zt);
    if (SIGNED) zt = _mm512_mul_ps(zt, _mm512_set1_ps(8.f));
    int8_epilogue::store<Y>(y + n, lanes16(rows), _mm512_sub_ps(acc, zt));
  }
}
#endif

}  // namespace

bool a8_vnni_row_supported() {
#ifdef LOWBIT_GEMV_A8_VNNI
  return true;
#else
  return false;
#endif
}

template <typename X, typename Y>
bool a8_blocks_vnni_row(const X* x, int64_t K, int64_t group, const std::vector<PackedWeight>& weights, Y* const* ys) {
#ifdef LOWBIT_GEMV_A8_VNNI
  const Prepared xp = prepare(x, K, group);
  if (!xp.finite) return false;
  const bool is_signed = weights[0].z == nullptr;
  parallel_weight_rows(weights, 64, [&](const PackedWeight& wt, int64_t n0, int64_t n1) {
    Y* y = ys[&wt - weights.data()];
    if (is_signed) weight_rows<true>(wt, xp, K, group, n0, n1, y);
    else weight_rows<false>(wt, xp, K, group, n0, n1, y);
  });
  return true;
#else
  (void)x, (void)K, (void)group, (void)weights, (void)ys;
  TORCH_CHECK(false, "lowbit._C was built without AVX-512 VNNI");
#endif
}

template bool a8_blocks_vnni_row(const float*, int64_t, int64_t, const std::vector<PackedWeight>&, float* const*);
template bool a8_blocks_vnni_row(const c10::BFloat16*, int64_t, int64_t, const std::vector<PackedWeight>&,
                                 c10::BFloat16* const*);
