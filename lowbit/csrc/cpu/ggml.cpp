// ggml block dequantization (GGUF tensor data), the fast path of lowbit/formats/ggml.py.
//
// The block layouts and formulas are those documented in ggml.py, which is the reference
// this file is tested against bit for bit.  Each value is ggml's float32 expression in its
// order: d * (q - o), d * q + m (two roundings), or (d * sc) * q - dmin * mn for the
// K-quants.  Contraction is off for this file (the pragma below): an FMA would round once
// where ggml rounds twice.  Blocks are independent, so threads split them.

#include "kernels.h"
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#pragma GCC optimize("fp-contract=off")

namespace {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// Q4_0 (offset 8, no min), Q4_1 (min), Q5_0 (offset 16), Q5_1 (min), Q8_0.
template <int BITS, bool MIN>
void simple_block(const uint8_t* b, float* out) {
  const float d = f16(b);
  const float m = MIN ? f16(b + 2) : 0.f;
  const uint8_t* p = b + (MIN ? 4 : 2);
  uint32_t qh = 0;
  if constexpr (BITS == 5) {
    std::memcpy(&qh, p, 4);
    p += 4;
  }
  if constexpr (BITS == 8) {
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(p[i]));
    return;
  }
  for (int i = 0; i < 16; ++i) {
    int lo = p[i] & 0x0F, hi = p[i] >> 4;
    if constexpr (BITS == 5) {
      lo |= ((qh >> i) & 1) << 4;
      hi |= ((qh >> (i + 16)) & 1) << 4;
    }
    if constexpr (MIN) {
      out[i] = d * static_cast<float>(lo) + m;
      out[i + 16] = d * static_cast<float>(hi) + m;
    } else {
      constexpr int OFF = 1 << (BITS - 1);
      out[i] = d * static_cast<float>(lo - OFF);
      out[i + 16] = d * static_cast<float>(hi - OFF);
    }
  }
}

void q2_k(const uint8_t* b, float* out) {
  const uint8_t *scales = b, *qs = b + 16;
  const float d = f16(b + 80), dmin = f16(b + 82);
  float dl[16], ml[16];
  for (int s = 0; s < 16; ++s) {
    dl[s] = d * static_cast<float>(scales[s] & 0x0F);
    ml[s] = dmin * static_cast<float>(scales[s] >> 4);
  }
  // element e = 128 h + 32 k + l (h: 64-byte half of qs, k: shift 2k, l < 32) reads qs[32 h + l] >> 2k
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) {
        const int e = 128 * h + 32 * k + l;
        out[e] = dl[e / 16] * static_cast<float>((qs[32 * h + l] >> (2 * k)) & 3) - ml[e / 16];
      }
}

void q3_k(const uint8_t* b, float* out) {
  const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
  const float d = f16(b + 108);
  float dl[16];
  for (int s = 0; s < 16; ++s) {
    const int lo = (sc[s % 8] >> (4 * (s / 8))) & 0x0F;
    const int hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 0x03;
    dl[s] = d * static_cast<float>((lo | (hi << 4)) - 32);
  }
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) {
        const int e = 128 * h + 32 * k + l;
        const int ql = (qs[32 * h + l] >> (2 * k)) & 3;
        const int qh = (hmask[l] >> (4 * h + k)) & 1;
        out[e] = dl[e / 16] * static_cast<float>(ql - ((qh ^ 1) << 2));
      }
}

inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 0x3F;
    mn = s[j + 4] & 0x3F;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

template <bool FIVE>
void q45_k(const uint8_t* b, float* out) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t *scales = b + 4, *qh = b + 16, *qs = FIVE ? b + 48 : b + 16;
  for (int j = 0; j < 8; ++j) {  // sub-block j: 32 values, nibble (j % 2) of qs[32 (j / 2) + l]
    int sc, mn;
    k_scale_min(scales, j, sc, mn);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(mn);
    for (int l = 0; l < 32; ++l) {
      int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
      if constexpr (FIVE) q |= ((qh[l] >> j) & 1) << 4;
      out[32 * j + l] = dl * static_cast<float>(q) - ml;
    }
  }
}

void q6_k(const uint8_t* b, float* out) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  float dl[16];
  for (int s = 0; s < 16; ++s) dl[s] = d * static_cast<float>(scales[s]);
  for (int h = 0; h < 2; ++h)          // 128-value halves
    for (int k = 0; k < 4; ++k)        // 32-value rows inside a half
      for (int l = 0; l < 32; ++l) {
        const int e = 128 * h + 32 * k + l;
        const int lo = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
        const int hi = (qh[32 * h + l] >> (2 * k)) & 0x03;
        out[e] = dl[e / 16] * static_cast<float>((lo | (hi << 4)) - 32);
      }
}

using BlockFn = void (*)(const uint8_t*, float*);

}  // namespace

// raw: uint8 [n_blocks * type_size] of ggml type `type` (lowbit's names); returns float32
// [n_blocks * block_size].
at::Tensor ggml_dequantize(const at::Tensor& raw, const std::string& type) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous(), "ggml_dequantize: contiguous uint8 data");
  BlockFn fn = nullptr;
  int64_t block = 32, size = 0;
  if (type == "Q4_0") fn = simple_block<4, false>, size = 18;
  else if (type == "Q4_1") fn = simple_block<4, true>, size = 20;
  else if (type == "Q5_0") fn = simple_block<5, false>, size = 22;
  else if (type == "Q5_1") fn = simple_block<5, true>, size = 24;
  else if (type == "Q8_0") fn = simple_block<8, false>, size = 34;
  else if (type == "Q2_K") fn = q2_k, block = 256, size = 84;
  else if (type == "Q3_K") fn = q3_k, block = 256, size = 110;
  else if (type == "Q4_K") fn = q45_k<false>, block = 256, size = 144;
  else if (type == "Q5_K") fn = q45_k<true>, block = 256, size = 176;
  else if (type == "Q6_K") fn = q6_k, block = 256, size = 210;
  TORCH_CHECK(fn != nullptr, "ggml_dequantize: no kernel for type ", type);
  TORCH_CHECK(raw.numel() % size == 0, "ggml_dequantize: ", raw.numel(), " bytes are not whole ", type, " blocks");
  const int64_t n = raw.numel() / size;
  at::Tensor out = at::empty({n * block}, raw.options().dtype(at::kFloat));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) fn(src + i * size, dst + i * block);
  });
  return out;
}
