// Element types of cached tensors and exact host conversions between them and float.
// Stateless; safe from any thread.
#ifndef KVMESH_CACHE_DTYPE_H_
#define KVMESH_CACHE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/strings/string_view.h"

namespace kvmesh {

enum class DType { kF32, kF16, kBF16 };

inline size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
absl::string_view DTypeName(DType t);

// IEEE binary16 <-> float, round to nearest even, NaN and infinity preserved.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);

// bfloat16 <-> float, round to nearest even, NaN kept quiet.
inline float BFloat16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
uint16_t FloatToBFloat16(float f);

// Loads element `i` of a `dtype` array as float / stores a float into it.
inline float LoadElement(DType dtype, const uint8_t* base, size_t i) {
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, base + 4 * i, 4);
      return f;
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, base + 2 * i, 2);
      return HalfToFloat(h);
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, base + 2 * i, 2);
      return BFloat16ToFloat(h);
    }
  }
  return 0.0f;
}

inline void StoreElement(DType dtype, uint8_t* base, size_t i, float v) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(base + 4 * i, &v, 4);
      return;
    case DType::kF16: {
      uint16_t h = FloatToHalf(v);
      std::memcpy(base + 2 * i, &h, 2);
      return;
    }
    case DType::kBF16: {
      uint16_t h = FloatToBFloat16(v);
      std::memcpy(base + 2 * i, &h, 2);
      return;
    }
  }
}

}  // namespace kvmesh

#endif  // KVMESH_CACHE_DTYPE_H_
