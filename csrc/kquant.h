// What the K-quant kernels share (kquant.cpp reads rows in place, kquant_tiles.cpp reads rows
// repacked in tiles of 16): the block sizes, the scales' unpacking and the activations,
// quantized once per call to int8 per row and super-block of 256 (scale max |x| / 127, rounded
// half to even, as llama.cpp's Q8_K), with their sums over every 16 and 32 values.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec.h"

namespace quill {
namespace kq {

constexpr int kSuper = 256;  // weights per super-block
enum : int64_t { kQ2K = 10, kQ3K = 11, kQ4K = 12, kQ5K = 13, kQ6K = 14, kIQ4XS = 23 };

// Bytes of one super-block as the file stores it (0: not a type read here).
inline int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4K: return 144;
    case kQ5K: return 176;
    case kQ6K: return 210;
    case kIQ4XS: return 136;
    case kQ2K: return 84;
    case kQ3K: return 110;
    default: return 0;
  }
}

// The 16 values IQ4_XS's 4-bit codes stand for (ggml's non-linear table), and the same plus 128
// as unsigned bytes: the form the u8 x s8 dot products take (the 128 leaves through the
// activation sums, as Q6_K's offset of 32).
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr uint8_t kIQ4Unsigned[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

// IQ4_XS's eight 6-bit sub-block scales less 32: the low 4 bits in nibble j % 2 of byte
// 4 + j / 2, the top 2 at bits 2j, 2j + 1 of the uint16 at byte 2.
inline void iq4xs_scales(const uint8_t* b, int16_t sc[8]) {
  uint16_t high;
  std::memcpy(&high, b + 2, 2);
  for (int j = 0; j < 8; ++j)
    sc[j] = int16_t((((b[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4)) - 32);
}

// Q3_K's sixteen 6-bit scales (to be taken less 32), as 16 bytes: the low 4 bits of scale i in
// nibble i / 8 of byte i % 8, the top 2 at bits 2 (i / 4) of byte 8 + i % 4; four at a time in
// 32-bit words, moved into the vector whole (written to memory as words and read back as one
// vector, they stalled store forwarding at every super-block).
inline __m128i q3k_scales(const uint8_t* p) {
  uint32_t a0, a1, t;
  std::memcpy(&a0, p, 4);
  std::memcpy(&a1, p + 4, 4);
  std::memcpy(&t, p + 8, 4);
  const uint32_t low4 = 0x0F0F0F0F, top2 = 0x30303030;
  return _mm_setr_epi32(int((a0 & low4) | ((t << 4) & top2)), int((a1 & low4) | ((t << 2) & top2)),
                        int(((a0 >> 4) & low4) | (t & top2)), int(((a1 >> 4) & low4) | ((t >> 2) & top2)));
}

// The error when a type is not one the ops below read.
constexpr const char* kTypesRead = " is not Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), Q6_K (14) or IQ4_XS (23)";

inline float half_at(const uint8_t* p) {
  fp16 h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// Q4_K and Q5_K's eight 6-bit scales and mins from their 12 bytes: bytes 0-3 hold scales 0-3
// (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11
// the low 4 bits of scales 4-7 (low nibbles) and of mins 4-7 (high nibbles).
inline void scales_and_mins(const uint8_t* q, uint8_t sc[8], uint8_t mn[8]) {
  uint32_t w0, w1, w2;
  std::memcpy(&w0, q, 4);
  std::memcpy(&w1, q + 4, 4);
  std::memcpy(&w2, q + 8, 4);
  const uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, top2 = 0x30303030;
  const uint32_t words[4] = {w0 & low6, (w2 & low4) | ((w0 >> 2) & top2), w1 & low6,
                             ((w2 >> 4) & low4) | ((w1 >> 2) & top2)};
  std::memcpy(sc, words, 8);
  std::memcpy(mn, words + 2, 8);
}

// The activation rows as int8 per super-block: codes [rows, K], scales [rows, K / 256], and the
// sums of every 16 and every 32 codes.
struct Activations {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  std::vector<int16_t> sums16;  // [rows, K / 16]
  std::vector<int16_t> sums32;  // [rows, K / 32]
  int64_t k = 0;
  const int8_t* row(int64_t m) const { return codes.data() + m * k; }
};

// 16 whole numbers within int8 (kWidth-wide vectors, rounded) stored as int8 codes at dst, in
// order; returns their sum.
inline int store_codes16(const vfloat* v, int8_t* dst) {
#if defined(QUILL_AVX512)
  const __m512i i = _mm512_cvtps_epi32(v[0]);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(i));
  return _mm512_reduce_add_epi32(i);
#else
  const __m256i i0 = _mm256_cvtps_epi32(v[0]), i1 = _mm256_cvtps_epi32(v[1]);
  // packs interleaves the 128-bit lanes (i0 0-3, i1 0-3, i0 4-7, i1 4-7): put them in order.
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
  const __m256i s = _mm256_add_epi32(i0, i1);
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return _mm_cvtsi128_si32(h);
#endif
}

// `order`: where each group of 16 values of a super-block is kept, in 16s (null: in order). Rows are
// quantized in parallel, 16 values a step in vectors: a prompt chunk's activations are megabytes
// (512 x 2,048 values into a 640-row product took longer than the product itself, scalar).
template <typename T>
void quantize(const T* x, int64_t rows, int64_t k, int64_t stride, const int* order,
              Activations& out) {
  static_assert(16 % kWidth == 0, "a group of 16 values is whole vectors");
  const int64_t supers = k / kSuper;
  out.k = k;
  out.codes.resize(rows * k);
  out.scales.resize(rows * supers);
  out.sums16.resize(rows * k / 16);
  out.sums32.resize(rows * k / 32);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* row = x + m * stride;
      for (int64_t s = 0; s < supers; ++s) {
        const T* src = row + s * kSuper;
        const float scale = int8_scale(src, kSuper);
        const vfloat inverse = vset(scale > 0.0f ? 1.0f / scale : 0.0f);
        out.scales[m * supers + s] = scale;
        int8_t* dst = out.codes.data() + m * k + s * kSuper;
        int16_t* sums = out.sums16.data() + (m * k + s * kSuper) / 16;
        for (int g = 0; g < kSuper / 16; ++g) {
          const int at = order ? order[g] * 16 : g * 16;
          vfloat v[16 / kWidth];
          // Round half to even (the default rounding mode), as torch.round in the reference.
          for (int i = 0; i < 16 / kWidth; ++i) v[i] = vround(vmul(vload(src + g * 16 + i * kWidth), inverse));
          sums[g] = int16_t(store_codes16(v, dst + at));
        }
        int16_t* sums32 = out.sums32.data() + (m * k + s * kSuper) / 32;
        for (int j = 0; j < kSuper / 32; ++j) sums32[j] = int16_t(sums[2 * j] + sums[2 * j + 1]);
      }
    }
  });
}

// An op's input x ([rows, k], rows contiguous; float32, bf16 or fp16) quantized into `act`.
inline void quantize_input(const at::Tensor& x, const int* order, Activations& act, const char* op) {
  const int64_t rows = x.size(0), k = x.size(1), stride = x.stride(0);
  switch (x.scalar_type()) {
    case at::kFloat: quantize(x.data_ptr<float>(), rows, k, stride, order, act); break;
    case at::kBFloat16: quantize(reinterpret_cast<const bf16*>(x.data_ptr()), rows, k, stride, order, act); break;
    case at::kHalf: quantize(reinterpret_cast<const fp16*>(x.data_ptr()), rows, k, stride, order, act); break;
    default: TORCH_CHECK(false, op, ": x dtype ", x.scalar_type(), " is not supported");
  }
}

}  // namespace kq
}  // namespace quill
