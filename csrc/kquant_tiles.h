// The layout of K-quant weights repacked in tiles of 16 rows (kquant_tiles.cpp writes and
// multiplies them, kquant_dequant.cpp turns them back into floats): shared facts only.
#pragma once

#include <cstdint>

#include "kquant.h"

namespace quill {
namespace kq {

constexpr int kTile = 16;
// Tiles are stored in groups of 4 (64 rows), a group's super-blocks interleaved (Place below),
// so the kernel that runs 4 tiles at once (a single token row) reads one forward stream. A
// thread runs every token group over a group of tiles before it moves on.
constexpr int kGroup = 4;

inline int64_t tile_super_bytes(int64_t type) {
  switch (type) {
    case kQ4K: return 2048 + 128 + 128 + 32 + 32;
    case kQ5K: return 2048 + 512 + 128 + 128 + 32 + 32;
    case kQ6K: return 2048 + 1024 + 256 + 32;
    case kIQ4XS: return 2048 + 128 + 32;
    default: return 0;
  }
}

constexpr const char* kTilesRead = " is not a type kept in tiles: Q4_K (12), Q5_K (13), Q6_K (14) or IQ4_XS (23)";

constexpr bool has_mins(int64_t type) { return type == kQ4K || type == kQ5K; }
// Bytes of a tile's scales in a super-block: one per row and sub-block (Q6_K: group of 16).
constexpr int64_t scale_bytes(int64_t type) { return type == kQ6K ? 256 : 128; }

inline int64_t bits_bytes(int64_t type) { return type == kQ5K ? 512 : type == kQ6K ? 1024 : 0; }

// Where tile t's pieces of a group's super-block lie, from the super-block's start: each field
// interleaved across the group's 4 tiles at its own unit (64 bytes of codes, 8 or 16 of high
// bits, 16 of scales, 32 of d), so the kernel that runs the 4 tiles together reads forward.
template <int64_t Type>
struct Place {
  static constexpr int64_t kBitsUnit = Type == kQ5K ? 8 : 16;
  static constexpr int64_t kBits = Type == kQ5K ? 512 : Type == kQ6K ? 1024 : 0;
  static constexpr int64_t kAfter = kGroup * (2048 + kBits);
  static int64_t codes(int c, int t) { return (int64_t(c) * kGroup + t) * 64; }
  static int64_t bits(int vec, int t) { return kGroup * 2048 + (int64_t(vec) * kGroup + t) * kBitsUnit; }
  // Q4_K, Q5_K: sub-block j's scales (mins); Q6_K: group g's scales.
  static int64_t scales(int j, int t) { return kAfter + (int64_t(j) * kGroup + t) * 16; }
  static int64_t mins(int j, int t) { return kAfter + kGroup * 128 + (int64_t(j) * kGroup + t) * 16; }
  static constexpr int64_t kD = kAfter + kGroup * (scale_bytes(Type) + (has_mins(Type) ? 128 : 0));
  static int64_t d(int t) { return kD + t * 32; }
  static int64_t dmin(int t) { return kD + kGroup * 32 + t * 32; }
};

}  // namespace kq
}  // namespace quill
