// W8A8: int8 activations [M, K] times an int8 weight [N, K], exact int32 sums, with the
// dequantize_accumulator epilogue fused into the store:
//
//   y[m, n] = round((float32(acc[m, n] - a_zp[m] * sum_k b[n, k]) * row[m]) * col[n])
//             (+ bias[n], rounded again: the bits of lowbit::int8_linear's composed path)
//
// vpdpbusd multiplies unsigned by signed bytes, four pairs per 32-bit lane (64
// multiply-adds per instruction, twice vdpbf16ps).  The activations are made unsigned,
// a + 128 (a byte xor), and 128 * sum_k b[n, k] comes back out per column; sums wrap in
// int32 but the true value fits (|acc| <= 128 * 128 * K < 2^31 for K < 2^17), so the
// result is exact, as torch._int_mm's.
//
// The layout is gemm_bf16.cpp's: panels of NP = 64 weight rows for a chunk of K, stored
// as panel[k / 4][column] dwords of four consecutive bytes of one row (a 16 x 16
// transpose of dwords per 16 rows; no arithmetic), 6 x 64 register tiles of int32
// accumulators fed by a broadcast dword of activations.  Partial sums of all but the
// last chunk go to the thread's int32 scratch; the last chunk writes y.  Several weights of
// one input (int8_linear_into) share one parallel region, their panels items of one list.
// A batch step's 16-48 rows take the transposed form instead (rows16_linear): the
// activations laid out as panels, the weight read as it is.

#include "balance.h"
#include "int8_epilogue.h"
#include "kernels.h"
#include "panels.h"
#include "simd.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BF16__)
#define LOWBIT_HAVE_INT8_GEMM 1
#endif

namespace {

#ifdef LOWBIT_HAVE_INT8_GEMM
// Values of K per chunk: the panel is KC_MAX * 64 bytes (128 KiB, in L2, as gemm_bf16's).
constexpr int64_t KC_MAX = 2048;

// Rows [n0, n0 + 64) of b (rows beyond N repeat row N - 1, never stored), bytes
// [k0, k0 + kc) (multiples of 4) into panel[(k - k0) / 4][column]; adds
// sum_{k in chunk} b[n, k] to colsum[column].  Prefetches the next call's block as it goes
// (gemm_bf16.cpp's pack_panel says why).
void pack_panel(const int8_t* b, int64_t N, int64_t K, int64_t n0, int64_t k0, int64_t kc, uint32_t* panel,
                int32_t* colsum, int64_t next_n0, int64_t next_k0) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int v = 0; v < NV; ++v) {
    const int8_t* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = b + std::min<int64_t>(n0 + 16 * v + i, N - 1) * K;
    const int8_t* next[16];
    for (int i = 0; i < 16; ++i) next[i] = b + std::min<int64_t>(next_n0 + 16 * v + i, N - 1) * K;
    __m512i sum = _mm512_loadu_si512(colsum + 16 * v);
    for (int64_t kb = k0; kb < k0 + kc; kb += 64) {  // 16 dwords of each row
      const int dwords = static_cast<int>(std::min<int64_t>(16, (k0 + kc - kb) / 4));
      const __mmask16 mask = static_cast<__mmask16>((1u << dwords) - 1);
      const int64_t ahead = next_k0 + (kb - k0);
      if (next_n0 >= 0 && ahead < K)
        for (int i = 0; i < 16; ++i) _mm_prefetch(reinterpret_cast<const char*>(next[i] + ahead), _MM_HINT_T1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_epi32(mask, rows[i] + kb);
      transpose16(r);
      uint32_t* out = panel + (kb - k0) / 4 * NP + 16 * v;
      for (int j = 0; j < dwords; ++j) {
        _mm512_storeu_si512(out + j * NP, r[j]);
        sum = _mm512_dpbusd_epi32(sum, ones, r[j]);
      }
    }
    _mm512_storeu_si512(colsum + 16 * v, sum);
  }
}

// What the last chunk's store needs: the epilogue's operands (int8_epilogue.h) and this
// panel's sum_k b.
struct Epilogue {
  int8_epilogue::RowCol rc;
  const int32_t* colsum;  // [NP]
};

// Rows m .. m + rows of y from their int32 sums (NP per row).
template <typename T>
__attribute__((noinline)) void finish(const int32_t* sums, int rows, int64_t m, int64_t n0, int ncols,
                                      const Epilogue& e) {
  for (int v = 0; v < NV; ++v) {
    const int left = ncols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512i colsum = _mm512_loadu_si512(e.colsum + 16 * v);
    for (int r = 0; r < rows; ++r)
      int8_epilogue::rowcol16<T>(e.rc, _mm512_load_si512(sums + r * NP + 16 * v), colsum, m + r, n0 + 16 * v, mask);
  }
}

// acc += dot(a, b) per 4 bytes.  GCC (12, 13) spills accumulators around its vpdpbusd
// intrinsic in a loop of 24 (its pattern does not tie the accumulator to the output);
// the instruction written out keeps them in registers, as vdpbf16ps's intrinsic does.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// R rows x 64 columns over kq dwords of K: acc = sum (a + 128) b - 128 sum b (+ scratch);
// stored to scratch, or through the epilogue when `last`.
template <int R>
void tile(const uint32_t* a, int64_t lda, const uint32_t* panel, int64_t kq, const __m512i* comp, int32_t* scratch,
          int64_t lds, bool first, bool last, int64_t m, int64_t n0, int ncols, const Epilogue& e) {
  __m512i acc[R][NV];  // activations (+128) unsigned, weights signed
  panel_dots<R>(acc, a, lda, panel, kq, [](__m512i c, __m512i x, __m512i b) { return dpbusd(c, x, b); });
  // the sums reach the epilogue (one function per output dtype) through memory
  alignas(64) int32_t sums[R][NP];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      __m512i t = _mm512_sub_epi32(acc[r][v], comp[v]);
      if (!first) t = _mm512_add_epi32(t, _mm512_loadu_si512(scratch + r * lds + 16 * v));
      _mm512_storeu_si512(last ? &sums[r][16 * v] : static_cast<void*>(scratch + r * lds + 16 * v), t);
    }
  if (!last) return;
  switch (e.rc.out) {
    case at::kBFloat16: finish<c10::BFloat16>(&sums[0][0], R, m, n0, ncols, e); break;
    case at::kHalf: finish<c10::Half>(&sums[0][0], R, m, n0, ncols, e); break;
    default: finish<float>(&sums[0][0], R, m, n0, ncols, e);
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, const __m512i*, int32_t*, int64_t, bool,
                        bool, int64_t, int64_t, int, const Epilogue&);
template <int... Rs>
constexpr std::array<TileFn, MR> tile_table(std::integer_sequence<int, Rs...>) {
  return {tile<Rs + 1>...};
}
constexpr auto TILES = tile_table(std::make_integer_sequence<int, MR>{});

// ---- a batch step's rows: the weight read as it is --------------------------------------
// With a batch step's 16-48 rows of activations each 64-row panel serves only a few tiles,
// and packing the panels was 17.5% of a 32-sequence W8A8 step (perf, Zen 4).  Here the
// operands swap places: each block of 16 rows of activations (a + 128) becomes one vector
// per dword of K (xp[k / 4][16], laid out once per call), and a dword of each weight row is
// broadcast from the weight as it is stored into the accumulators of its row, lane r
// holding activation row r (dots8: 8 weight rows x 2 blocks at a time).  Each 16 x 16
// block of sums is transposed into rows for the panels' epilogue: the same exact int32
// sums through the same store, so the same bits.

// au [M, K] -> xp[block][k / 4][16]: block b's lane r is row 16 b + r (zero past M).
void pack_rows16(const uint8_t* au, int64_t M, int64_t K, uint32_t* xp) {
  const int64_t kq = K / 4;
  for (int64_t b = 0; b < (M + 15) / 16; ++b)
    for (int64_t q0 = 0; q0 < kq; q0 += 16) {
      const int dwords = static_cast<int>(std::min<int64_t>(16, kq - q0));
      const __mmask16 mask = static_cast<__mmask16>((1u << dwords) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = 16 * b + i < M ? _mm512_maskz_loadu_epi32(mask, au + (16 * b + i) * K + 4 * q0) : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < dwords; ++j) _mm512_store_si512(xp + (b * kq + q0 + j) * 16, r[j]);
    }
}

// sum_k b[n, k] of the 16 rows (lane i: rows[i]).
__m512i row_sums16(const int8_t* const rows[16], int64_t K) {
  alignas(64) int32_t sums[16];
  const __m512i ones = _mm512_set1_epi8(1);
  for (int i = 0; i < 16; ++i) {
    __m512i s = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
      const __mmask64 mask = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
      s = _mm512_dpbusd_epi32(s, ones, _mm512_maskz_loadu_epi8(mask, rows[i] + k));
    }
    sums[i] = _mm512_reduce_add_epi32(s);
  }
  return _mm512_load_si512(sums);
}

// acc[i][v] (lane r) = sum_k (a[16 (b + v) + r, k] + 128) * w[i][k]: 8 weight rows times V
// blocks of xp (b: the first, at xp), kq dwords of K.  Eight rows' pointers stay in registers
// (sixteen did not: their reloads doubled the loads per dot product); each broadcast dword
// serves the V blocks.  The dwords of next[0..7] (the next tile's rows) are prefetched a
// cache line at a time.
template <int V>
inline void dots8(const uint32_t* xp, int64_t kq, const int8_t* const* w, const int8_t* const* next,
                  __m512i (&acc)[8][V]) {
  const int8_t *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3], *w4 = w[4], *w5 = w[5], *w6 = w[6], *w7 = w[7];
  for (int i = 0; i < 8; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = _mm512_setzero_si512();
  const auto dword = [](const int8_t* p) {
    int32_t d;
    std::memcpy(&d, p, 4);
    return _mm512_set1_epi32(d);
  };
  for (int64_t q = 0; q < kq; ++q) {
    if (next && q % 16 == 0)
      for (int i = 0; i < 8; ++i) _mm_prefetch(reinterpret_cast<const char*>(next[i] + 4 * q), _MM_HINT_T0);
    __m512i x[V];
    for (int v = 0; v < V; ++v) x[v] = _mm512_load_si512(xp + (v * kq + q) * 16);
    const __m512i b[8] = {dword(w0 + 4 * q), dword(w1 + 4 * q), dword(w2 + 4 * q), dword(w3 + 4 * q),
                          dword(w4 + 4 * q), dword(w5 + 4 * q), dword(w6 + 4 * q), dword(w7 + 4 * q)};
    for (int i = 0; i < 8; ++i)
      for (int v = 0; v < V; ++v) acc[i][v] = dpbusd(acc[i][v], x[v], b[i]);
  }
}

template <typename T>
void store_rows16(__m512i acc[16], __m512i colsum, int rows, int64_t m, int64_t n0, __mmask16 mask,
                  const int8_epilogue::RowCol& rc) {
  transpose16(acc);  // acc[r]: row m + r, lanes the 16 columns
  const __m512i comp = _mm512_slli_epi32(colsum, 7);
  for (int r = 0; r < rows; ++r)
    int8_epilogue::rowcol16<T>(rc, _mm512_sub_epi32(acc[r], comp), colsum, m + r, n0, mask);
}

// Rows m .. m + 16 V (those below M) of y's 16 columns n0.. (the weight rows `rows`).
template <int V>
void tile16(const uint32_t* xp, int64_t kq, const int8_t* const rows[16], const int8_t* const* next, __m512i colsum,
            int64_t M, int64_t m, int64_t n0, __mmask16 mask, const int8_epilogue::RowCol& rc) {
  alignas(64) int32_t sums[V][16][16];  // [block][weight row][activation row]
  for (int half = 0; half < 2; ++half) {
    __m512i acc[8][V];
    dots8<V>(xp + m / 16 * kq * 16, kq, rows + 8 * half, next ? next + 8 * half : nullptr, acc);
    for (int i = 0; i < 8; ++i)
      for (int v = 0; v < V; ++v) _mm512_store_si512(sums[v][8 * half + i], acc[i][v]);
  }
  for (int v = 0; v < V && m + 16 * v < M; ++v) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(sums[v][i]);
    const int rs = static_cast<int>(std::min<int64_t>(16, M - m - 16 * v));
    switch (rc.out) {
      case at::kBFloat16: store_rows16<c10::BFloat16>(r, colsum, rs, m + 16 * v, n0, mask, rc); break;
      case at::kHalf: store_rows16<c10::Half>(r, colsum, rs, m + 16 * v, n0, mask, rc); break;
      default: store_rows16<float>(r, colsum, rs, m + 16 * v, n0, mask, rc);
    }
  }
}

// int8_linear_into's work on xp: items of 16 weight rows of one weight (PanelItems of 16
// columns; one tile of all M rows, so one part: every item takes all the rows).
void rows16_linear(const uint32_t* xp, int64_t M, int64_t K, const float* row, const int32_t* a_zp,
                   at::ScalarType out, const std::vector<Int8Out>& ws, const std::vector<int64_t>& Ns) {
  const PanelItems items(Ns, 16, M, M);
  const int64_t kq = K / 4;
  each_item(items.size(), [] { return 0; }, [&](int, int64_t i) {
    const size_t j = items[i].j;
    const Int8Out& w = ws[j];
    const int64_t n0 = items[i].n0;
    const int8_t* rows[16];
    const int8_t* next[16];
    const bool has_next = i + 1 < items.first[j + 1];
    for (int r = 0; r < 16; ++r) {
      rows[r] = w.b + std::min<int64_t>(n0 + r, w.N - 1) * K;
      next[r] = w.b + std::min<int64_t>(n0 + 16 + r, w.N - 1) * K;
    }
    const int ncols = static_cast<int>(std::min<int64_t>(16, w.N - n0));
    const __mmask16 mask = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
    const __m512i colsum = row_sums16(rows, K);
    const int8_epilogue::RowCol rc{row, a_zp, w.col, w.bias, out, w.y, w.N};
    for (int64_t m = 0; m < M; m += 32) {
      const int8_t* const* ahead = has_next && m == 0 ? next : nullptr;
      if (M - m > 16) tile16<2>(xp, kq, rows, ahead, colsum, M, m, n0, mask, rc);
      else tile16<1>(xp, kq, rows, ahead, colsum, M, m, n0, mask, rc);
    }
  });
}
#endif

}  // namespace

bool int8_gemm_supported(int64_t K) {
#ifdef LOWBIT_HAVE_INT8_GEMM
  return K % 4 == 0 && K < (int64_t(1) << 17);
#else
  (void)K;
  return false;
#endif
}

// a int8 [M, K], a_zero_point int32 [M] or none, b int8 [N, K], row_scale float32 [M],
// col_scale float32 [N], bias [N] or none; y [M, N] in out_dtype.
at::Tensor int8_linear(const at::Tensor& a, const c10::optional<at::Tensor>& a_zero_point, const at::Tensor& b,
                       const at::Tensor& row_scale, const at::Tensor& col_scale, const c10::optional<at::Tensor>& bias,
                       at::ScalarType out_dtype) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.scalar_type() == at::kChar && b.scalar_type() == at::kChar &&
                  b.size(1) == a.size(1),
              "lowbit._C.int8_linear: int8 a [M, K] and b [N, K] expected");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(int8_gemm_supported(K), "lowbit._C.int8_linear: K must be a multiple of 4 below 2^17");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "lowbit._C.int8_linear: unsupported out dtype ", out_dtype);
  TORCH_CHECK(row_scale.numel() == M && col_scale.numel() == N && (!bias || bias->numel() == N) &&
                  (!a_zero_point || a_zero_point->numel() == M),
              "lowbit._C.int8_linear: row_scale and a_zero_point [M], col_scale and bias [N] expected");
  at::Tensor y = at::empty({M, N}, a.options().dtype(out_dtype));
  if (M == 0 || N == 0) return y;
  const at::Tensor au = a.contiguous().view(at::kByte).bitwise_xor(128);  // a + 128 as unsigned bytes
  const at::Tensor bc = b.contiguous();
  const at::Tensor row = row_scale.to(at::kFloat).contiguous(), col = col_scale.to(at::kFloat).contiguous();
  const at::Tensor zp = a_zero_point ? a_zero_point->to(at::kInt).contiguous() : at::Tensor();
  const at::Tensor bias_f = bias ? bias->to(out_dtype).to(at::kFloat).contiguous() : at::Tensor();
  int8_linear_into(au.data_ptr<uint8_t>(), M, K, row.data_ptr<float>(), zp.defined() ? zp.data_ptr<int32_t>() : nullptr,
                   out_dtype,
                   {Int8Out{bc.data_ptr<int8_t>(), N, col.data_ptr<float>(),
                            bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, y.data_ptr()}});
  return y;
}

// Whether int8_linear_into takes M rows through rows16_linear rather than the panels: from
// 16 to 48 rows where blocks of 16 leave at most one lane in 8 idle.  A 32-sequence W8A8
// batch step (SmolLM2, w8a8-head8, Zen 4, in-process A/B) ran 1.07-1.11x faster with it, 48
// sequences 1.07x, 16 1.02x; 24 (a quarter of the lanes idle) 0.97x.  Below 16 the panels'
// tiles of 6 rows waste less; past 48 each packed panel serves enough tiles.
bool int8_linear_rows16(int64_t M) {
#ifdef LOWBIT_HAVE_INT8_GEMM
  return M >= 16 && M <= 48 && 8 * M >= 7 * 16 * ((M + 15) / 16);
#else
  (void)M;
  return false;
#endif
}

void int8_linear_into(const uint8_t* au, int64_t M, int64_t K, const float* row, const int32_t* a_zp,
                      at::ScalarType out, const std::vector<Int8Out>& ws) {
  TORCH_CHECK(int8_gemm_supported(K), "lowbit._C.int8_linear: K must be a multiple of 4 below 2^17");
#ifdef LOWBIT_HAVE_INT8_GEMM
  if (M == 0) return;
  std::vector<int64_t> Ns;
  for (const Int8Out& w : ws) Ns.push_back(w.N);
  if (int8_linear_rows16(M)) {
    thread_local std::vector<uint32_t> xp_keep;
    uint32_t* xp = reinterpret_cast<uint32_t*>(
        (reinterpret_cast<uintptr_t>(grown(xp_keep, (M + 15) / 16 * 16 * (K / 4) + 16)) + 63) & ~uintptr_t(63));
    pack_rows16(au, M, K, xp);
    return rows16_linear(xp, M, K, row, a_zp, out, ws, Ns);
  }
  const int64_t chunks = (K + KC_MAX - 1) / KC_MAX;
  const int64_t KC = (K / 4 + chunks - 1) / chunks * 4;
  const PanelItems items(Ns, NP, M, MR);
  const uint32_t* pa = reinterpret_cast<const uint32_t*>(au);
  const int64_t lda = K / 4;
  struct State {
    PanelBuffer panel;
    std::vector<int32_t> partial;  // the part's sums over the chunks of K before the last
  };
  each_item(
      items.size(),
      [&] { return State{PanelBuffer(KC / 4 * NP), std::vector<int32_t>(chunks > 1 ? items.work.rows * NP : 0)}; },
      [&](State& st, int64_t i) {
        const auto [j, n0, m0, m1] = items[i];
        const Int8Out& w = ws[j];
        const int ncols = static_cast<int>(std::min<int64_t>(NP, w.N - n0));
        // the next item's panel, prefetched as this one is packed, when it is this weight's
        int64_t next_n0 = -1;
        if (i + 1 < items.size()) {
          const PanelItems::Item next = items[i + 1];
          if (next.j == j) next_n0 = next.n0;
        }
        alignas(64) int32_t colsum[NP] = {};
        alignas(64) int32_t chunk_sum[NP];
        const Epilogue e{{row, a_zp, w.col, w.bias, out, w.y, w.N}, colsum};
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t kc = std::min(KC, K - k0);
          const bool last = k0 + kc >= K;
          std::fill(chunk_sum, chunk_sum + NP, 0);
          pack_panel(w.b, w.N, K, n0, k0, kc, st.panel.data, chunk_sum, last ? next_n0 : n0, last ? 0 : k0 + kc);
          __m512i comp[NV];  // 128 * sum over the chunk
          for (int v = 0; v < NV; ++v) {
            const __m512i s = _mm512_load_si512(chunk_sum + 16 * v);
            _mm512_store_si512(colsum + 16 * v, _mm512_add_epi32(_mm512_load_si512(colsum + 16 * v), s));
            comp[v] = _mm512_slli_epi32(s, 7);
          }
          for (int64_t m = m0; m < m1; m += MR) {
            const int mr = static_cast<int>(std::min<int64_t>(MR, m1 - m));
            TILES[mr - 1](pa + m * lda + k0 / 4, lda, st.panel.data, kc / 4, comp,
                          chunks > 1 ? st.partial.data() + (m - m0) * NP : nullptr, NP, k0 == 0, last, m, n0, ncols,
                          e);
          }
        }
      });
#else
  (void)au, (void)M, (void)row, (void)a_zp, (void)out, (void)ws;
#endif
}

// ---- W4A8 for many rows: the same panels and tiles, int32 sums per weight group ---------
//
//   y[m, n] = sum_g s[n, g] * float32(sum_{k in g} (x[m, k] - xz[m]) (q[n, k] - z[n, g]))
//
// with the integer part exact per group:  sum x u - z (sum x - |g| xz) - xz sum u  (u the
// unsigned code; signed codes are read as u = q + 8 with z = 8).  vpdpbusd takes the
// codes as its unsigned operand and the activations, as they are, as its signed one.  A
// dword of packed codes holds 8 values of a row, byte b the pair (2b, 2b + 1): its low
// nibbles (values 0, 2, 4, 6) make one panel dword and its high nibbles (1, 3, 5, 7) the
// next, and the activations are laid out once per call in that order (evens, then odds,
// of every 8).  Each group ends with a flush of the R x 64 sums into float32 y:
// y += s * float32(int_g), in group order.
namespace {
#ifdef LOWBIT_HAVE_INT8_GEMM
// Codes of rows [n0, n0 + 64), values [k0, k0 + kc) (whole groups) -> panel[(k - k0) / 4]
// [column]; usum[(k - k0) / group][column] = sum of u over each group.
void pack_panel_u4(const uint8_t* w, bool is_signed, int64_t N, int64_t K, int64_t group, int64_t n0, int64_t k0,
                   int64_t kc, uint32_t* panel, int32_t* usum, int64_t next_n0, int64_t next_k0) {
  const int64_t row_bytes = K / 2;
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(is_signed ? 0x08 : 0x00);
  const __m512i ones = _mm512_set1_epi8(1);
  std::fill(usum, usum + kc / group * NP, 0);
  for (int v = 0; v < NV; ++v) {
    const uint8_t* rows[16];
    const uint8_t* next[16];
    for (int i = 0; i < 16; ++i) {
      rows[i] = w + std::min<int64_t>(n0 + 16 * v + i, N - 1) * row_bytes;
      next[i] = w + std::min<int64_t>(next_n0 + 16 * v + i, N - 1) * row_bytes;
    }
    for (int64_t kb = k0; kb < k0 + kc; kb += 128) {  // 16 dwords (8 values each) of every row
      const int dwords = static_cast<int>(std::min<int64_t>(16, (k0 + kc - kb) / 8));
      const __mmask16 mask = static_cast<__mmask16>((1u << dwords) - 1);
      const int64_t ahead = next_k0 + (kb - k0);
      if (next_n0 >= 0 && ahead < K)
        for (int i = 0; i < 16; ++i) _mm_prefetch(reinterpret_cast<const char*>(next[i] + ahead / 2), _MM_HINT_T1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_epi32(mask, rows[i] + kb / 2);
      transpose16(r);
      uint32_t* out = panel + (kb - k0) / 4 * NP + 16 * v;
      for (int j = 0; j < dwords; ++j) {
        const __m512i even = _mm512_xor_si512(_mm512_and_si512(r[j], nib), flip);
        const __m512i odd = _mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi32(r[j], 4), nib), flip);
        _mm512_storeu_si512(out + (2 * j) * NP, even);
        _mm512_storeu_si512(out + (2 * j + 1) * NP, odd);
        int32_t* us = usum + (kb - k0 + 8 * j) / group * NP + 16 * v;
        __m512i s = _mm512_loadu_si512(us);
        s = dpbusd(dpbusd(s, even, ones), odd, ones);
        _mm512_storeu_si512(us, s);
      }
    }
  }
}

// What a group's flush needs besides the sums.
struct GroupTerms {
  const float* st;      // [G][Npad] weight scales
  const int32_t* zt;    // [G][Npad] weight zero points, or null: 8 (signed codes)
  const int32_t* xg;    // [M][G]: sum_{k in g} x - |g| xz
  const int32_t* xz;    // [M]
  const int32_t* usum;  // this chunk's [groups][NP]
  int64_t G, Npad;
};

// R rows x 64 columns over the groups of one chunk (g0: its first group index), each
// group's exact int32 sum scaled into y (float32 [M, N], ldy = N).
template <int R>
void tile_u4(const uint32_t* x, int64_t ldx, const uint32_t* panel, int64_t groups, int64_t quads, int64_t g0,
             float* y, int64_t ldy, int64_t m, int64_t n0, int ncols, bool first_chunk, const GroupTerms& t) {
  alignas(64) int32_t sums[R][NP];
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512i acc[R][NV];  // codes unsigned, activations signed
    panel_dots<R>(acc, x + gi * quads, ldx, panel + gi * quads * NP, quads,
                  [](__m512i c, __m512i xv, __m512i b) { return dpbusd(c, b, xv); });
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) _mm512_store_si512(&sums[r][16 * v], acc[r][v]);
    const int64_t g = g0 + gi;
    for (int v = 0; v < NV; ++v) {
      const int left = ncols - 16 * v;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      const __m512 s = _mm512_loadu_ps(t.st + g * t.Npad + n0 + 16 * v);
      const __m512i z = t.zt ? _mm512_loadu_si512(t.zt + g * t.Npad + n0 + 16 * v) : _mm512_set1_epi32(8);
      const __m512i us = _mm512_loadu_si512(t.usum + gi * NP + 16 * v);
      for (int r = 0; r < R; ++r) {
        __m512i i = _mm512_load_si512(&sums[r][16 * v]);
        i = _mm512_sub_epi32(i, _mm512_mullo_epi32(z, _mm512_set1_epi32(t.xg[(m + r) * t.G + g])));
        i = _mm512_sub_epi32(i, _mm512_mullo_epi32(us, _mm512_set1_epi32(t.xz[m + r])));
        float* out = y + r * ldy + 16 * v;
        const __m512 prev = first_chunk && gi == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, out);
        _mm512_mask_storeu_ps(out, mask, _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), s, prev));
      }
    }
  }
}

using TileU4Fn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t, int64_t, float*, int64_t,
                          int64_t, int64_t, int, bool, const GroupTerms&);
template <int... Rs>
constexpr std::array<TileU4Fn, MR> tile_u4_table(std::integer_sequence<int, Rs...>) {
  return {tile_u4<Rs + 1>...};
}
constexpr auto TILES_U4 = tile_u4_table(std::make_integer_sequence<int, MR>{});
#endif
}  // namespace

namespace {
#ifdef LOWBIT_HAVE_INT8_GEMM
// The W4A8 panel GEMM over the weights ws (codes u32x8 [N, K/8], float32 scales [N, G],
// int32 zero points [N, G] or none: signed codes) of one x, their panels in one parallel
// region: every panel of every weight times every part of x's rows (PanelItems), a thread's
// items in order, each summed group by group into float32 yf (y * x_scale[m] rounded to Y
// as the caller's loop and .to() round it, once the item's last chunk is done).
template <typename Y>
void w4a8_panels_run(const int8_t* x_q, const int32_t* x_zp, const float* x_scale, int64_t M, int64_t K,
                     int64_t group, const std::vector<PackedWeight>& ws, Y* const* ys) {
  const int64_t G = K / group;
  // activations in panel order (each 8 values as 0, 2, 4, 6, 1, 3, 5, 7) and per row and
  // group sum x - |g| xz (exact: check_w4a8_zero_points), one pass over x in parallel (as
  // ATen ops, a strided copy and a reduction, they were a fifth of a W4A8 prefill)
  std::vector<int8_t> xr(M * K);
  std::vector<int32_t> xg(M * G);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int8_t* xs = x_q + m * K;
      int8_t* xd = xr.data() + m * K;
      for (int64_t k = 0; k < K; k += 8)
        for (int i = 0; i < 4; ++i) {
          xd[k + i] = xs[k + 2 * i];
          xd[k + 4 + i] = xs[k + 2 * i + 1];
        }
      w4a8_group_sums(xs, x_zp[m], K, group, xg.data() + m * G);
    }
  });
  // per weight: scales and zero points as [G][Npad] (lane i of a load at column c is column
  // c + i's), and where the result is not float32 y itself, its float32 sums
  constexpr bool direct = std::is_same<Y, float>::value;
  std::vector<std::vector<float>> st(ws.size()), yf(ws.size());
  std::vector<std::vector<int32_t>> zt(ws.size());
  std::vector<int64_t> Ns;
  for (size_t j = 0; j < ws.size(); ++j) {
    const PackedWeight& wt = ws[j];
    const int64_t N = wt.N, Npad = (N + NP - 1) / NP * NP;
    const float* sc = static_cast<const float*>(wt.s);
    const int32_t* zp = static_cast<const int32_t*>(wt.z);
    st[j].assign(G * Npad, 0.0f);
    if (zp) zt[j].assign(G * Npad, 0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < G; ++g) {
        st[j][g * Npad + n] = sc[n * G + g];
        if (zp) zt[j][g * Npad + n] = zp[n * G + g];
      }
    if (!direct || x_scale) yf[j].resize(M * N);
    Ns.push_back(N);
  }
  // chunks of whole groups, about 1024 values (the panel: 64 KiB)
  const int64_t KC = std::max<int64_t>(1, 1024 / group) * group;
  const uint32_t* px = reinterpret_cast<const uint32_t*>(xr.data());
  const int64_t ldx = K / 4;
  const PanelItems items(Ns, NP, M, MR);
  at::parallel_for(0, items.size(), 1, [&](int64_t i0, int64_t i1) {
    PanelBuffer buf(KC / 4 * NP);
    uint32_t* panel = buf.data;
    std::vector<int32_t> usum(KC / group * NP);
    for (int64_t i = i0; i < i1; ++i) {
      const auto [j, n0, m0, m1] = items[i];
      const PackedWeight& wt = ws[j];
      const int64_t N = wt.N, Npad = (N + NP - 1) / NP * NP;
      const int ncols = static_cast<int>(std::min<int64_t>(NP, N - n0));
      float* py = yf[j].empty() ? reinterpret_cast<float*>(ys[j]) : yf[j].data();
      const GroupTerms terms{st[j].data(), zt[j].empty() ? nullptr : zt[j].data(), xg.data(), x_zp, usum.data(), G,
                             Npad};
      // the codes of this item's next chunk, or of the next item's panel when it is this weight's
      const int64_t later = i + 1 < i1 && items[i + 1].j == j ? items[i + 1].n0 : -1;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        pack_panel_u4(wt.w, wt.z == nullptr, N, K, group, n0, k0, kc, panel, usum.data(), k0 + kc < K ? n0 : later,
                      k0 + kc < K ? k0 + kc : 0);
        for (int64_t m = m0; m < m1; m += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, m1 - m));
          TILES_U4[mr - 1](px + m * ldx + k0 / 4, ldx, panel, kc / group, group / 4, k0 / group, py + m * N + n0, N, m,
                           n0, ncols, k0 == 0, terms);
        }
      }
      if (!yf[j].empty())
        for (int64_t m = m0; m < m1; ++m) {
          const float xs = x_scale ? x_scale[m] : 1.0f;
          const float* src = py + m * N + n0;
          Y* dst = ys[j] + m * N + n0;
          if constexpr (direct) {
            for (int c = 0; c < ncols; ++c) dst[c] = src[c] * xs;
          } else {
            uint16_t* db = reinterpret_cast<uint16_t*>(dst);  // c10's rounding of the scaled sum
            for (int c = 0; c < ncols; ++c) db[c] = bf16_bits(x_scale ? src[c] * xs : src[c]);
          }
        }
    }
  });
}
#endif
}  // namespace

// x_q int8 [M, K]; x_zp int32 [M]; codes int32 [N, K/8] (u32x8); w_scale float32 [N, G];
// w_zp int32 [N, G] or none (signed codes).  Returns float32 [M, N] = sum_g w_scale * int_g,
// the contract of matmul.cpp's w4a8_gemm (x_scale and bias applied by the caller).
at::Tensor w4a8_gemm_panels(const at::Tensor& x_q, const at::Tensor& x_zp, const at::Tensor& codes,
                            const at::Tensor& w_scale, const c10::optional<at::Tensor>& w_zp, int64_t group) {
  TORCH_CHECK(group % 32 == 0 && x_q.size(1) % group == 0,
              "lowbit._C.w4a8_gemm_panels: group must be a multiple of 32 dividing K");
  check_w4a8_zero_points("lowbit._C.w4a8_gemm_panels", x_q, x_zp, group);
  const int64_t M = x_q.size(0), K = x_q.size(1), N = codes.size(0), G = K / group;
  TORCH_CHECK(x_q.dim() == 2 && x_q.scalar_type() == at::kChar && codes.dim() == 2 &&
                  codes.scalar_type() == at::kInt && codes.size(1) * 8 == K && w_scale.scalar_type() == at::kFloat &&
                  w_scale.dim() == 2 && w_scale.size(0) == N && w_scale.size(1) == G &&
                  (!w_zp || w_zp->sizes() == w_scale.sizes()),
              "lowbit._C.w4a8_gemm_panels: int8 x_q [M, K], codes int32 [N, K/8], float32 scales and zero points "
              "[N, K/group] expected");
#ifdef LOWBIT_HAVE_INT8_GEMM
  at::Tensor y = at::empty({M, N}, x_q.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const at::Tensor xc = x_q.contiguous(), cc = codes.contiguous(), sc = w_scale.contiguous();
  const at::Tensor xz = x_zp.to(at::kInt).contiguous();
  const at::Tensor zc = w_zp.has_value() ? w_zp->to(at::kInt).contiguous() : at::Tensor();
  float* py = y.data_ptr<float>();
  w4a8_panels_run<float>(xc.data_ptr<int8_t>(), xz.data_ptr<int32_t>(), nullptr, M, K, group,
                         {PackedWeight{reinterpret_cast<const uint8_t*>(cc.data_ptr()), sc.data_ptr<float>(),
                                       zc.defined() ? zc.data_ptr<int32_t>() : nullptr, N, nullptr}},
                         &py);
  return y;
#else
  return w4a8_gemm_panels_avx2(x_q, x_zp, codes, w_scale, w_zp, group);  // gemm_a8.cpp: vpmaddubsw, no VNNI
#endif
}

bool has_w4a8_panels() {
#ifdef LOWBIT_HAVE_INT8_GEMM
  return true;
#else
  return false;
#endif
}

template <typename Y>
void w4a8_panels_into(const int8_t* x_q, const int32_t* x_zp, const float* x_scale, int64_t M, int64_t K,
                      int64_t group, const std::vector<PackedWeight>& weights, Y* const* ys) {
#ifdef LOWBIT_HAVE_INT8_GEMM
  if (M > 0) w4a8_panels_run<Y>(x_q, x_zp, x_scale, M, K, group, weights, ys);
#else
  (void)x_q, (void)x_zp, (void)x_scale, (void)M, (void)K, (void)group, (void)weights, (void)ys;
  TORCH_CHECK(false, "lowbit._C.w4a8_panels_into needs AVX-512 with VNNI");
#endif
}
template void w4a8_panels_into<float>(const int8_t*, const int32_t*, const float*, int64_t, int64_t, int64_t,
                                      const std::vector<PackedWeight>&, float* const*);
template void w4a8_panels_into<c10::BFloat16>(const int8_t*, const int32_t*, const float*, int64_t, int64_t, int64_t,
                                              const std::vector<PackedWeight>&, c10::BFloat16* const*);

// ---- W8A8 for a few rows without VNNI: int8 x int8 with vpmaddwd ------------------------
//
//   acc[m, n] = sum_k a[m, k] b[n, k]   (exact int32, as torch._int_mm)
//
// AVX2 has no int8 x int8 multiply-add that cannot saturate (vpmaddubsw's pairs of
// 255 * 128 overflow int16), so both sides are widened to int16 (a once per call, b as it
// is read) and vpmaddwd sums pairs into int32 lanes: |pair| <= 2 * 128 * 128 = 2^15, and
// |acc| <= 128 * 128 * K < 2^31 for K < 2^17.  Four rows of a share each widened b.
namespace {
#if defined(__AVX2__)
template <int R>
void int8_rows(const int16_t* a, int64_t K, const int8_t* b, bool prefetch, int32_t* c, int64_t ldc) {
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    // the codes kStreamAhead on into the L2 as this row is read (simd.h; it was row n + 8's
    // into the L1: w8a8's decode step on the Zen 4 1.07-1.10x, medians of in-process rounds)
    if (prefetch) prefetch_l2(b + k + kStreamAhead);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + k)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + k + 16)));
    for (int r = 0; r < R; ++r) {  // two pairs' sums (each <= 2^15) added in int32
      const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * K + k)));
      const __m256i p1 =
          _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * K + k + 16)));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(p0, p1));
    }
  }
  int32_t tail[R] = {};
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r) tail[r] += static_cast<int32_t>(a[r * K + k]) * b[k];
  for (int r = 0; r < R; ++r) c[r * ldc] = isum8(acc[r]) + tail[r];
}
#endif
}  // namespace

bool has_int8_rows() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

// a int8 [M, K], b int8 [N, K] -> int32 [M, N] = a @ b.T, exactly torch._int_mm's result.
at::Tensor int8_mm_rows(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(has_int8_rows(), "lowbit._C.int8_mm_rows needs AVX2");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.scalar_type() == at::kChar && b.scalar_type() == at::kChar &&
                  a.size(1) == b.size(1),
              "lowbit._C.int8_mm_rows: int8 a [M, K] and b [N, K] expected");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(K < (int64_t(1) << 17), "lowbit._C.int8_mm_rows: K must be below 2^17 (int32 sums)");
  at::Tensor c = at::empty({M, N}, a.options().dtype(at::kInt));
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  int8_mm_rows_into(ac.data_ptr<int8_t>(), M, K, bc.data_ptr<int8_t>(), N, c.data_ptr<int32_t>());
  return c;
}

void int8_mm_rows_into(const int8_t* a, int64_t M, int64_t K, const int8_t* pb, int64_t N, int32_t* pc) {
#if defined(__AVX2__)
  thread_local std::vector<int16_t> a16;  // a widened to int16 (exact)
  int16_t* pa = grown(a16, M * K);
  for (int64_t i = 0; i < M * K; ++i) pa[i] = a[i];
  parallel_chunks(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const bool prefetch = n + kRowsAhead < N;  // (not the last rows)
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) int8_rows<4>(pa + m * K, K, pb + n * K, prefetch, pc + m * N + n, N);
      for (; m < M; ++m) int8_rows<1>(pa + m * K, K, pb + n * K, prefetch, pc + m * N + n, N);
    }
  });
#else
  TORCH_CHECK(false, "lowbit._C.int8_mm_rows needs AVX2");
#endif
}
