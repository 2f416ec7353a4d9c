// Fast CPU dequantization kernels behind lowbit's "cpu" backend.
//
// The arithmetic is the one of lowbit/scheme.py, which this file does not restate
// beyond the line that matters: out = Out((Acc(q) - Acc(zero_point)) * Acc(scale)),
// or Out(Acc(q) * Acc(scale) + Acc(min)) in the "min" zero-point domain (a product, then
// a sum), Acc = float (double for float64 output), one rounding to the output dtype.
// Contraction is off for this file (the pragma below), so the product of the min form is
// rounded before the sum, as in the reference, and the result equals it exactly.
//
// A tensor is seen as R rows of K logical values (K = last dim).  Row r, column k
// uses scale[(r / rows_per_scale) * (K / group) + k / group]; every granularity is
// one setting of (group, rows_per_scale): tensor (K, R), channel (K, R / N),
// token (K, 1), group (g, 1); int32 accumulators reuse it with group = their group.

#include "kernels.h"
#include "simd.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <cstring>
#include <immintrin.h>
#include <type_traits>

#pragma GCC optimize("fp-contract=off")

namespace {

// Value j of a packed word: bits [BITS*j, BITS*j + BITS), sign-extended if SIGNED.
template <typename Word, int BITS, bool SIGNED>
struct Codes {
  static constexpr int PER = BITS >= 8 ? 1 : int(sizeof(Word) * 8) / BITS;
  static inline int32_t get(Word w, int j) {
    if constexpr (BITS >= 8) {
      return static_cast<int32_t>(w);
    } else {
      uint32_t u = static_cast<uint32_t>(static_cast<std::make_unsigned_t<Word>>(w));
      int32_t v = static_cast<int32_t>((u >> (BITS * j)) & ((1u << BITS) - 1u));
      if constexpr (SIGNED) v -= (v >> (BITS - 1)) << BITS;
      return v;
    }
  }
};

// Round float32 to the output type, exactly as torch's .to(dtype) does (bf16: simd.h's bf16_bits).
template <typename Out, typename Acc>
inline void store(const Acc* src, Out* dst, int64_t n) {
  if constexpr (std::is_same_v<Out, c10::BFloat16>) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_bits(src[i]);
  } else if constexpr (std::is_same_v<Out, c10::Half>) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(src[i]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LOWBIT_NIBBLES_BF16 1
// nw u32x8 words of 4-bit codes (value j of a word: bits 4j..4j+3) to bf16, 16 values a
// vector: the scalar loop's float32 arithmetic, (q - z) * s or q * s, and bf16_bits'
// rounding (nearest, ties to even, NaN as 0x7FC0) in integer lanes, so the same bits;
// the tiles_bf16 prefill's dequantization took a quarter of its time in the scalar loop
// (1536 x 576 g64 at 512 rows, AMX Xeon: 0.24 ms of 1.04).
template <bool SIGNED, bool HAS_ZP>
inline void nibbles_to_bf16(const int32_t* words, int64_t nw, float s, float z, uint16_t* dst) {
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i shift = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
  const __m512i low = _mm512_set1_epi32(0xF), eight = _mm512_set1_epi32(8);
  const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
  for (int64_t w = 0; w + 2 <= nw; w += 2) {
    const __m128i pair = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(words + w));
    __m512i q = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(pick, _mm512_castsi128_si512(pair)), shift), low);
    if constexpr (SIGNED) q = _mm512_sub_epi32(_mm512_xor_si512(q, eight), eight);  // sign-extend 4 bits
    const __m512 qf = _mm512_cvtepi32_ps(q);
    const __m512 v = HAS_ZP ? _mm512_mul_ps(_mm512_sub_ps(qf, zv), sv) : _mm512_mul_ps(qf, sv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * w), bf16_bits16(v));
  }
}
#endif

template <typename Word, int BITS, bool SIGNED, bool HAS_ZP, typename Acc, typename Out, bool MIN_FORM = false>
void dequant_rows(const Word* codes, const Acc* scale, const Acc* zp, Out* out, int64_t R,
                  int64_t K, int64_t group, int64_t rows_per_scale) {
  using C = Codes<Word, BITS, SIGNED>;
  constexpr int64_t CHUNK_WORDS = 256 / C::PER;  // values computed in Acc, then stored as Out
  const int64_t groups = K / group, words_per_group = group / C::PER, row_words = K / C::PER;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
  at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
    alignas(64) Acc buf[CHUNK_WORDS * C::PER];
    for (int64_t r = r0; r < r1; ++r) {
      const Word* c = codes + r * row_words;
      Out* o = out + r * K;
      const int64_t srow = (r / rows_per_scale) * groups;
      for (int64_t g = 0; g < groups; ++g) {
        const Acc s = scale[srow + g];
        const Acc z = HAS_ZP ? zp[srow + g] : Acc(0);
        for (int64_t w0 = 0; w0 < words_per_group; w0 += CHUNK_WORDS) {
          const int64_t nw = std::min(CHUNK_WORDS, words_per_group - w0);
          const Word* cw = c + g * words_per_group + w0;
          Out* dst = o + g * group + w0 * C::PER;
#ifdef LOWBIT_NIBBLES_BF16
          if constexpr (BITS == 4 && std::is_same_v<Word, int32_t> && std::is_same_v<Out, c10::BFloat16> &&
                        std::is_same_v<Acc, float> && !MIN_FORM) {
            if (nw % 2 == 0) {
              nibbles_to_bf16<SIGNED, HAS_ZP>(cw, nw, s, z, reinterpret_cast<uint16_t*>(dst));
              continue;
            }
          }
#endif
          // float32/float64 output is written directly; 16-bit output goes through buf.
          Acc* vals = std::is_same_v<Out, Acc> ? reinterpret_cast<Acc*>(dst) : buf;
          for (int64_t w = 0; w < nw; ++w) {
            const Word word = cw[w];
#pragma GCC unroll 16
            for (int j = 0; j < C::PER; ++j) {
              const Acc q = static_cast<Acc>(C::get(word, j));
              vals[w * C::PER + j] = MIN_FORM ? q * s + z : HAS_ZP ? (q - z) * s : q * s;
            }
          }
          if constexpr (!std::is_same_v<Out, Acc>) store<Out, Acc>(buf, dst, nw * C::PER);
        }
      }
    }
  });
}

template <typename Word, int BITS, bool SIGNED, typename Acc, typename Out>
void dispatch_zp(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& zp,
                 at::Tensor& out, int64_t R, int64_t K, int64_t group, int64_t rows_per_scale) {
  const Word* c = codes.data_ptr<Word>();
  const Acc* s = scale.data_ptr<Acc>();
  Out* o = reinterpret_cast<Out*>(out.data_ptr());
  if (zp.has_value()) {
    dequant_rows<Word, BITS, SIGNED, true, Acc, Out>(c, s, zp->data_ptr<Acc>(), o, R, K, group, rows_per_scale);
  } else {
    dequant_rows<Word, BITS, SIGNED, false, Acc, Out>(c, s, nullptr, o, R, K, group, rows_per_scale);
  }
}

template <typename Word, int BITS, bool SIGNED>
void dispatch_out(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& zp,
                  at::Tensor& out, int64_t R, int64_t K, int64_t group, int64_t rows_per_scale) {
  switch (out.scalar_type()) {
    case at::kFloat: return dispatch_zp<Word, BITS, SIGNED, float, float>(codes, scale, zp, out, R, K, group, rows_per_scale);
    case at::kBFloat16: return dispatch_zp<Word, BITS, SIGNED, float, c10::BFloat16>(codes, scale, zp, out, R, K, group, rows_per_scale);
    case at::kHalf: return dispatch_zp<Word, BITS, SIGNED, float, c10::Half>(codes, scale, zp, out, R, K, group, rows_per_scale);
    case at::kDouble: return dispatch_zp<Word, BITS, SIGNED, double, double>(codes, scale, zp, out, R, K, group, rows_per_scale);
    default: TORCH_CHECK(false, "lowbit._C.dequantize: unsupported out dtype ", out.scalar_type());
  }
}

template <typename Word, int BITS>
void dispatch_min(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mn, at::Tensor& out,
                  int64_t R, int64_t K, int64_t group, int64_t rows_per_scale) {
  const Word* c = codes.data_ptr<Word>();
  void* o = out.data_ptr();
  switch (out.scalar_type()) {
    case at::kFloat:
      return dequant_rows<Word, BITS, false, true, float, float, true>(c, scale.data_ptr<float>(), mn.data_ptr<float>(),
                                                                      static_cast<float*>(o), R, K, group, rows_per_scale);
    case at::kBFloat16:
      return dequant_rows<Word, BITS, false, true, float, c10::BFloat16, true>(
          c, scale.data_ptr<float>(), mn.data_ptr<float>(), static_cast<c10::BFloat16*>(o), R, K, group, rows_per_scale);
    case at::kHalf:
      return dequant_rows<Word, BITS, false, true, float, c10::Half, true>(
          c, scale.data_ptr<float>(), mn.data_ptr<float>(), static_cast<c10::Half*>(o), R, K, group, rows_per_scale);
    case at::kDouble:
      return dequant_rows<Word, BITS, false, true, double, double, true>(
          c, scale.data_ptr<double>(), mn.data_ptr<double>(), static_cast<double*>(o), R, K, group, rows_per_scale);
    default: TORCH_CHECK(false, "lowbit._C.dequantize_min: unsupported out dtype ", out.scalar_type());
  }
}

// Rows of a [R, K] weight held in codes: packed words of `bits`-bit codes, or one code per element.
int64_t code_rows(const at::Tensor& codes, int64_t bits, int64_t K) {
  const int64_t word_bits = codes.element_size() * 8;
  return K ? codes.numel() * word_bits / (bits < 8 ? bits : word_bits) / K : 0;
}

}  // namespace

// The "min" zero-point domain: unsigned codes, out = q * scale + min (see dequantize below
// for the shapes; scale and min already in the compute dtype).
at::Tensor dequantize_min(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mn, int64_t bits,
                          int64_t K, int64_t group, int64_t rows_per_scale, at::ScalarType out_dtype) {
  at::Tensor out = at::empty({code_rows(codes, bits, K), K}, codes.options().dtype(out_dtype));
  dequantize_min_into(out, codes, scale, mn, bits, K, group, rows_per_scale);
  return out;
}

// dequantize_min into a caller's buffer, as dequantize_into below.
void dequantize_min_into(at::Tensor& out, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mn,
                         int64_t bits, int64_t K, int64_t group, int64_t rows_per_scale) {
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous() && mn.is_contiguous(),
              "lowbit._C.dequantize_min: contiguous inputs expected");
  const int64_t R = code_rows(codes, bits, K);
  TORCH_CHECK(out.is_contiguous() && out.numel() == R * K,
              "lowbit._C.dequantize_min_into: out must be a contiguous tensor of ", R, " x ", K, " elements, got ",
              out.sizes());
  if (R == 0 || K == 0) return;
  const auto t = codes.scalar_type();
  if (bits == 8 && t == at::kByte) dispatch_min<uint8_t, 8>(codes, scale, mn, out, R, K, group, rows_per_scale);
  else if (bits == 4 && t == at::kInt) dispatch_min<int32_t, 4>(codes, scale, mn, out, R, K, group, rows_per_scale);
  else if (bits == 4 && t == at::kByte) dispatch_min<uint8_t, 4>(codes, scale, mn, out, R, K, group, rows_per_scale);
  else if (bits == 2 && t == at::kInt) dispatch_min<int32_t, 2>(codes, scale, mn, out, R, K, group, rows_per_scale);
  else if (bits == 2 && t == at::kByte) dispatch_min<uint8_t, 2>(codes, scale, mn, out, R, K, group, rows_per_scale);
  else TORCH_CHECK(false, "lowbit._C.dequantize_min: no kernel for bits=", bits, " codes ", t);
}

// codes: [R, K * bits / word_bits] (packed) or [R, K]; scale, zero_point: flat, already in the
// compute dtype (float32, float64 for float64 output); returns [R, K] of out_dtype.
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& zero_point,
                      int64_t bits, bool is_signed, int64_t K, int64_t group, int64_t rows_per_scale,
                      at::ScalarType out_dtype) {
  at::Tensor out = at::empty({code_rows(codes, bits, K), K}, codes.options().dtype(out_dtype));
  dequantize_into(out, codes, scale, zero_point, bits, is_signed, K, group, rows_per_scale);
  return out;
}

// dequantize into a caller's buffer (out: contiguous, R * K elements of the output dtype),
// e.g. one reused across calls: a fresh multi-MiB tile per matmul page-faults its memory in.
void dequantize_into(at::Tensor& out, const at::Tensor& codes, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& zero_point, int64_t bits, bool is_signed, int64_t K,
                     int64_t group, int64_t rows_per_scale) {
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous(), "lowbit._C.dequantize: contiguous inputs expected");
  const int64_t R = code_rows(codes, bits, K);
  TORCH_CHECK(out.is_contiguous() && out.numel() == R * K,
              "lowbit._C.dequantize_into: out must be a contiguous tensor of ", R, " x ", K, " elements, got ",
              out.sizes());
  if (R == 0 || K == 0) return;
  const auto t = codes.scalar_type();
#define LOWBIT_CASE(WORD, BITS, SIGNED) \
  dispatch_out<WORD, BITS, SIGNED>(codes, scale, zero_point, out, R, K, group, rows_per_scale)
  if (bits == 8 && t == at::kChar) LOWBIT_CASE(int8_t, 8, true);
  else if (bits == 8 && t == at::kByte) LOWBIT_CASE(uint8_t, 8, false);
  else if (bits == 32 && t == at::kInt) LOWBIT_CASE(int32_t, 32, true);
  else if (bits == 4 && t == at::kInt && is_signed) LOWBIT_CASE(int32_t, 4, true);
  else if (bits == 4 && t == at::kInt) LOWBIT_CASE(int32_t, 4, false);
  else if (bits == 4 && t == at::kByte && is_signed) LOWBIT_CASE(uint8_t, 4, true);
  else if (bits == 4 && t == at::kByte) LOWBIT_CASE(uint8_t, 4, false);
  else if (bits == 2 && t == at::kInt && is_signed) LOWBIT_CASE(int32_t, 2, true);
  else if (bits == 2 && t == at::kInt) LOWBIT_CASE(int32_t, 2, false);
  else if (bits == 2 && t == at::kByte && is_signed) LOWBIT_CASE(uint8_t, 2, true);
  else if (bits == 2 && t == at::kByte) LOWBIT_CASE(uint8_t, 2, false);
  else TORCH_CHECK(false, "lowbit._C.dequantize: no kernel for bits=", bits, " codes ", t);
#undef LOWBIT_CASE
}

// Rows r0 .. r0 + R - 1 of a weight as float32 into out [R, K]: the values dequantize_into
// (dequantize_min_into where `min`) gives those rows with rows_per_scale 1, no tensor made.
// The caller has checked the codes, the float32 scale [rows, K / group] and zero_point (float32,
// the same shape, or none; the "min" domain's m where `min`).
void dequantize_rows_f32(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& zero_point,
                         int64_t bits, bool is_signed, bool min, int64_t K, int64_t group, int64_t r0, int64_t R,
                         float* out) {
  const int64_t G = K / group;
  const float* s = scale.data_ptr<float>() + r0 * G;
  const float* z = zero_point ? zero_point->data_ptr<float>() + r0 * G : nullptr;
  auto run = [&](auto word, auto bits_const, auto signed_const) {
    using Word = decltype(word);
    constexpr int B = decltype(bits_const)::value;
    constexpr bool S = decltype(signed_const)::value;
    const Word* c = codes.data_ptr<Word>() + r0 * (K / Codes<Word, B, S>::PER);
    if (min)
      dequant_rows<Word, B, false, true, float, float, true>(c, s, z, out, R, K, group, 1);
    else if (z)
      dequant_rows<Word, B, S, true, float, float>(c, s, z, out, R, K, group, 1);
    else
      dequant_rows<Word, B, S, false, float, float>(c, s, nullptr, out, R, K, group, 1);
  };
  using Four = std::integral_constant<int, 4>;
  using Eight = std::integral_constant<int, 8>;
  const auto t = codes.scalar_type();
  if (bits == 8 && t == at::kChar) run(int8_t{}, Eight{}, std::true_type{});
  else if (bits == 8 && t == at::kByte) run(uint8_t{}, Eight{}, std::false_type{});
  else if (bits == 4 && t == at::kInt && is_signed && !min) run(int32_t{}, Four{}, std::true_type{});
  else if (bits == 4 && t == at::kInt) run(int32_t{}, Four{}, std::false_type{});
  else if (bits == 4 && t == at::kByte && is_signed && !min) run(uint8_t{}, Four{}, std::true_type{});
  else if (bits == 4 && t == at::kByte) run(uint8_t{}, Four{}, std::false_type{});
  else TORCH_CHECK(false, "lowbit._C.dequantize_rows_f32: no kernel for bits=", bits, " codes ", t);
}

// out[m, n] = Out(float(acc[m, n]) * row[m] * col[n]), left to right in float32.
namespace {

template <typename Out>
void rowcol_rows(const int32_t* acc, const float* row, const float* col, Out* out, int64_t M, int64_t N) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float r = row[m];
      const int32_t* a = acc + m * N;
      Out* o = out + m * N;
      alignas(64) float buf[256];
      for (int64_t n0 = 0; n0 < N; n0 += 256) {
        const int64_t nn = std::min<int64_t>(256, N - n0);
        for (int64_t n = 0; n < nn; ++n) buf[n] = static_cast<float>(a[n0 + n]) * r * col[n0 + n];
        store<Out, float>(buf, o + n0, nn);
      }
    }
  });
}

}  // namespace

at::Tensor dequantize_rowcol(const at::Tensor& acc, const at::Tensor& row, const at::Tensor& col,
                             at::ScalarType out_dtype) {
  TORCH_CHECK(acc.is_contiguous() && row.is_contiguous() && col.is_contiguous(),
              "lowbit._C.dequantize_rowcol: contiguous inputs expected");
  const int64_t N = acc.size(-1), M = N ? acc.numel() / N : 0;
  at::Tensor out = at::empty(acc.sizes(), acc.options().dtype(out_dtype));
  if (M == 0 || N == 0) return out;
  dequantize_rowcol_into(acc.data_ptr<int32_t>(), row.data_ptr<float>(), col.data_ptr<float>(), out.data_ptr(),
                         out_dtype, M, N);
  return out;
}

void dequantize_rowcol_into(const int32_t* acc, const float* row, const float* col, void* out,
                            at::ScalarType out_dtype, int64_t M, int64_t N) {
  switch (out_dtype) {
    case at::kFloat: rowcol_rows<float>(acc, row, col, static_cast<float*>(out), M, N); break;
    case at::kBFloat16: rowcol_rows<c10::BFloat16>(acc, row, col, static_cast<c10::BFloat16*>(out), M, N); break;
    case at::kHalf: rowcol_rows<c10::Half>(acc, row, col, static_cast<c10::Half*>(out), M, N); break;
    default: TORCH_CHECK(false, "lowbit._C.dequantize_rowcol: unsupported out dtype ", out_dtype);
  }
}


// ---- per-token quantize, bit-exact with the reference -----------------------------------
// Per row: range -> scale (rounded up to the scale dtype) -> zero point -> codes, with the
// reference's operations in its order: x / scale is a division, rounding is to nearest
// even (nearbyint), and everything is float32 (float64 for float64 input).
namespace {

template <typename T>
inline float round_up_scale(float s) {
  if constexpr (std::is_same_v<T, float>) {
    return s;
  } else {
    T r = static_cast<T>(s);  // nearest; bump one ulp up if that went below
    if (static_cast<float>(r) < s) r.x = static_cast<uint16_t>(r.x + 1);  // s > 0
    return static_cast<float>(r);
  }
}

#ifdef __AVX512F__
// 16 values of T (float, bfloat16, float16) as float32, lanes beyond `mask` zero.
template <typename T>
inline __m512 load16(const T* p, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
}
#endif

// min, max and whether all finite of one row, with the scalar loop's semantics
// (min(v, lo) keeps lo when v is NaN: minps/maxps with v first do the same).
template <typename T, typename C>
void row_range(const T* xr, int64_t D, C& lo, C& hi, bool& finite) {
  lo = D ? static_cast<C>(xr[0]) : C(0);
  hi = lo;
  int64_t d = 0;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<C, float>) {
    __m512 vlo = _mm512_set1_ps(lo), vhi = vlo;
    __mmask16 bad = 0;
    for (; d < D; d += 16) {
      const __mmask16 m = D - d >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (D - d)) - 1);
      const __m512 v = load16(xr + d, m);
      vlo = _mm512_mask_min_ps(vlo, m, v, vlo);
      vhi = _mm512_mask_max_ps(vhi, m, v, vhi);
      const __m512 z = _mm512_mul_ps(v, _mm512_setzero_ps());  // NaN if v is NaN or Inf
      bad |= _mm512_mask_cmp_ps_mask(m, z, z, _CMP_UNORD_Q);
    }
    lo = _mm512_reduce_min_ps(vlo);
    hi = _mm512_reduce_max_ps(vhi);
    finite = bad == 0;
    return;
  }
#endif
  C poison = 0;
  for (; d < D; ++d) {
    const C v = static_cast<C>(xr[d]);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    poison += v * C(0);  // NaN if any v is NaN or Inf
  }
  finite = poison == poison;
}

// q[d] = clamp(nearbyint(x[d] / s) + zp, qmin, qmax): a true division and ties to even,
// in vectors for float32 arithmetic.
template <typename T, typename C, typename Q>
void row_codes(const T* xr, Q* qr, int64_t D, C s, C zp, int64_t qmin, int64_t qmax) {
  int64_t d = 0;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<C, float>) {
    const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(zp);
    const __m512 vmin = _mm512_set1_ps(static_cast<float>(qmin)), vmax = _mm512_set1_ps(static_cast<float>(qmax));
    for (; d < D; d += 16) {
      const __mmask16 m = D - d >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (D - d)) - 1);
      __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(xr + d, m), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, vz), vmin), vmax);
      const __m512i i = _mm512_cvtps_epi32(v);  // integer-valued already
      if constexpr (std::is_same_v<Q, int8_t>) _mm_mask_storeu_epi8(qr + d, m, _mm512_cvtsepi32_epi8(i));
      else _mm_mask_storeu_epi8(qr + d, m, _mm512_cvtusepi32_epi8(i));
    }
    return;
  }
#endif
  for (; d < D; ++d) {
    const C v = std::nearbyint(static_cast<C>(xr[d]) / s) + zp;
    qr[d] = static_cast<Q>(std::min<C>(std::max<C>(v, qmin), qmax));
  }
}

template <typename T, typename C, typename Q>
bool quantize_rows(const T* x, Q* q, T* scale_out, int32_t* zp_out, int64_t N, int64_t D, int64_t bits,
                   bool symmetric) {
  const int64_t qmin = symmetric ? -(int64_t(1) << (bits - 1)) : 0;
  const int64_t qmax = symmetric ? (int64_t(1) << (bits - 1)) - 1 : (int64_t(1) << bits) - 1;
  std::atomic<bool> finite{true};
  at::parallel_for(0, N, std::max<int64_t>(1, 4096 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      C lo, hi;
      bool ok;
      row_range<T, C>(xr, D, lo, hi, ok);
      if (!ok) finite = false;
      C s;
      if (symmetric) {
        s = std::max(-lo, hi) / static_cast<C>((qmax - qmin) / 2.0);
      } else {
        lo = std::min(lo, C(0));
        hi = std::max(hi, C(0));
        s = (hi - lo) / static_cast<C>(qmax - qmin);
      }
      if (!(s > 0)) s = 1;
      if constexpr (!std::is_same_v<C, double>) s = round_up_scale<T>(s);
      const C zp = symmetric ? C(0) : std::min<C>(std::max<C>(qmin - std::nearbyint(lo / s), qmin), qmax);
      scale_out[r] = static_cast<T>(s);
      if (!std::isfinite(static_cast<double>(scale_out[r]))) finite = false;  // a range beyond T's
      zp_out[r] = static_cast<int32_t>(zp);
      row_codes<T, C, Q>(xr, q + r * D, D, s, zp, qmin, qmax);
    }
  });
  return finite;
}

template <typename T, typename C>
bool quantize_dispatch(const at::Tensor& x, at::Tensor& q, at::Tensor& scale, at::Tensor& zp, int64_t bits,
                       bool symmetric) {
  const int64_t N = x.size(0), D = x.size(1);
  T* s = reinterpret_cast<T*>(scale.data_ptr());
  const T* px = reinterpret_cast<const T*>(x.data_ptr());
  if (symmetric) return quantize_rows<T, C, int8_t>(px, q.data_ptr<int8_t>(), s, zp.data_ptr<int32_t>(), N, D, bits, true);
  return quantize_rows<T, C, uint8_t>(px, q.data_ptr<uint8_t>(), s, zp.data_ptr<int32_t>(), N, D, bits, false);
}

}  // namespace

// x [N, D] float32/float64/float16/bfloat16 -> (q int8|uint8 [N, D], scale [N] x.dtype,
// zero_point int32 [N], all_finite).
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> quantize_per_token(const at::Tensor& x, int64_t bits,
                                                                        bool symmetric) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "lowbit._C.quantize_per_token: contiguous 2-D x expected");
  const int64_t N = x.size(0), D = x.size(1);
  at::Tensor q = at::empty({N, D}, x.options().dtype(symmetric ? at::kChar : at::kByte));
  at::Tensor scale = at::empty({N}, x.options());
  at::Tensor zp = at::empty({N}, x.options().dtype(at::kInt));
  bool ok = true;
  switch (x.scalar_type()) {
    case at::kFloat: ok = quantize_dispatch<float, float>(x, q, scale, zp, bits, symmetric); break;
    case at::kDouble: ok = quantize_dispatch<double, double>(x, q, scale, zp, bits, symmetric); break;
    case at::kBFloat16: ok = quantize_dispatch<c10::BFloat16, float>(x, q, scale, zp, bits, symmetric); break;
    case at::kHalf: ok = quantize_dispatch<c10::Half, float>(x, q, scale, zp, bits, symmetric); break;
    default: TORCH_CHECK(false, "lowbit._C.quantize_per_token: unsupported dtype ", x.scalar_type());
  }
  return {q, scale, zp, ok};
}

bool quantize_token_into(const void* x, at::ScalarType dtype, int64_t D, int64_t bits, bool symmetric, void* q,
                         float* scale, int32_t* zp) {
  const auto row = [&](auto t) {
    using T = decltype(t);
    T s;
    const bool ok = symmetric ? quantize_rows<T, float, int8_t>(static_cast<const T*>(x), static_cast<int8_t*>(q),
                                                                &s, zp, 1, D, bits, true)
                              : quantize_rows<T, float, uint8_t>(static_cast<const T*>(x), static_cast<uint8_t*>(q),
                                                                 &s, zp, 1, D, bits, false);
    *scale = static_cast<float>(s);  // as_float of the scale in x's dtype
    return ok;
  };
  switch (dtype) {
    case at::kFloat: return row(float());
    case at::kBFloat16: return row(c10::BFloat16());
    case at::kHalf: return row(c10::Half());
    default: TORCH_CHECK(false, "lowbit._C.quantize_per_token: unsupported dtype ", dtype);
  }
}
