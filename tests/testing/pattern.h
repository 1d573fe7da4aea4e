// Deterministic test data for kvmesh: element patterns derived from (seed, index), a decoder of
// the cache dtypes written independently of cache/dtype.cc, and builders of the Append and Read
// payloads of a CacheSpec (docs/api.md#payload-layout).
//
// Every pattern element is a finite, normal, exactly representable value of its dtype with a
// magnitude in [1/16, 2) and a random sign: never zero, never rounded on the way in, so a wrong
// byte anywhere shows up. Header-only (the kvmesh_testing target is an INTERFACE library).
// Stateless; safe from any thread.
#ifndef KVMESH_TESTS_TESTING_PATTERN_H_
#define KVMESH_TESTS_TESTING_PATTERN_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "cache/dtype.h"
#include "cache/spec.h"

namespace kvmesh {
namespace testutil {

// splitmix64's finalizer: a bijective, well-mixed function of x.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint64_t HashPair(uint64_t seed, uint64_t index) {
  return Mix64(Mix64(seed) ^ (index * 0xD1B54A32D192ED03ull));
}

// Bytes [0, size) of pattern stream `seed`: 8 bytes per HashPair(seed, word index). For raw
// payloads (transport tests), where no dtype applies.
inline std::vector<uint8_t> PatternBytes(size_t size, uint64_t seed) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; i += 8) {
    const uint64_t word = HashPair(seed, i / 8);
    std::memcpy(bytes.data() + i, &word, std::min<size_t>(8, size - i));
  }
  return bytes;
}

// How many bytes of `actual` differ from `expected` (the larger size when the sizes differ).
inline size_t CountWrongBytes(const std::vector<uint8_t>& expected,
                              const std::vector<uint8_t>& actual) {
  if (expected.size() != actual.size()) return std::max(expected.size(), actual.size());
  if (expected == actual) return 0;  // memcmp: a byte loop over 100s of MiB is slow under ASan
  size_t wrong = 0;
  for (size_t i = 0; i < expected.size(); ++i) wrong += expected[i] != actual[i];
  return wrong;
}

inline size_t ElementBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

// Bits of element `index` of the pattern stream `seed` (low 16 bits used for F16/BF16).
inline uint32_t PatternBits(DType dtype, uint64_t seed, uint64_t index) {
  const uint64_t h = HashPair(seed, index);
  const uint32_t sign = static_cast<uint32_t>(h >> 63);
  const uint32_t exp_step = static_cast<uint32_t>((h >> 40) % 5);  // 2^-4 .. 2^0
  switch (dtype) {
    case DType::kF32:
      return (sign << 31) | ((127 - exp_step) << 23) | static_cast<uint32_t>(h & 0x7FFFFF);
    case DType::kF16:
      return (sign << 15) | ((15 - exp_step) << 10) | static_cast<uint32_t>(h & 0x3FF);
    case DType::kBF16:
      return (sign << 15) | ((127 - exp_step) << 7) | static_cast<uint32_t>(h & 0x7F);
  }
  return 0;
}

// Writes elements [0, n) of the pattern stream `seed` to dst (n * ElementBytes(dtype) bytes).
inline void FillPattern(DType dtype, uint64_t seed, size_t n, uint8_t* dst) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = PatternBits(dtype, seed, i);
    if (dtype == DType::kF32) {
      std::memcpy(dst + 4 * i, &bits, 4);
    } else {
      const uint16_t half = static_cast<uint16_t>(bits);
      std::memcpy(dst + 2 * i, &half, 2);
    }
  }
}

// Decodes one element of `dtype` at p (little-endian host assumed, as the payload layout).
inline double DecodeElement(DType dtype, const uint8_t* p) {
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const int sign = (h >> 15) ? -1 : 1;
      const int exp = (h >> 10) & 0x1F;
      const int mant = h & 0x3FF;
      if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), -24);
      if (exp == 31) {
        return mant == 0 ? sign * std::numeric_limits<double>::infinity()
                         : std::numeric_limits<double>::quiet_NaN();
      }
      return sign * std::ldexp(static_cast<double>(1024 + mant), exp - 25);
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
  }
  return 0;
}

inline double DecodeElement(DType dtype, absl::Span<const uint8_t> data, size_t i) {
  return DecodeElement(dtype, data.data() + i * ElementBytes(dtype));
}

// Elements of one token's K (or V) row in one layer of Attention or Rotating group `group`.
inline size_t KRowElements(const CacheSpec& spec, int group) {
  const GroupSpec& g = spec.groups[group];
  if (g.kind == GroupKind::kRotating) {
    return static_cast<size_t>(g.rotating.num_kv_heads) * g.rotating.head_dim_k;
  }
  return static_cast<size_t>(g.attention.num_kv_heads) * g.attention.head_dim_k;
}
inline size_t VRowElements(const CacheSpec& spec, int group) {
  const GroupSpec& g = spec.groups[group];
  if (g.kind == GroupKind::kRotating) {
    return static_cast<size_t>(g.rotating.num_kv_heads) * g.rotating.head_dim_v;
  }
  return static_cast<size_t>(g.attention.num_kv_heads) * g.attention.head_dim_v;
}

// The pattern stream of the K (key=true) or V row that token `token_id` has in `layer` of
// `group`. Token ids are chosen by the test; equal ids give equal rows.
inline uint64_t RowSeed(uint64_t token_id, int group, int layer, bool key) {
  return Mix64(token_id * 0x100000001B3ull ^
               Mix64((static_cast<uint64_t>(group) << 33) | (static_cast<uint64_t>(layer) << 1) |
                     (key ? 1u : 0u)));
}

inline std::vector<uint8_t> RowBytes(const CacheSpec& spec, uint64_t token_id, int group, int layer,
                                     bool key) {
  const size_t n = key ? KRowElements(spec, group) : VRowElements(spec, group);
  std::vector<uint8_t> row(n * ElementBytes(spec.dtype));
  FillPattern(spec.dtype, RowSeed(token_id, group, layer, key), n, row.data());
  return row;
}

// One layer of one recurrent state of Recurrent group `group`: conv [conv_tail][conv_dim] in
// the cache dtype, then delta [num_v_heads][head_v_dim][head_k_dim] in float32, from the pattern
// streams of `state_id`. States are identified by ids the test chooses, like token rows.
inline std::vector<uint8_t> StateLayerBytes(const CacheSpec& spec, uint64_t state_id, int group,
                                            int layer) {
  const RecurrentSpec& r = spec.groups[group].recurrent;
  const size_t conv = static_cast<size_t>(r.conv_tail) * r.conv_dim;
  const size_t delta = static_cast<size_t>(r.num_v_heads) * r.head_v_dim * r.head_k_dim;
  std::vector<uint8_t> out(conv * ElementBytes(spec.dtype) + delta * 4);
  const uint64_t seed = RowSeed(state_id ^ 0x5EC0DE5EC0DEull, group, layer, true);
  FillPattern(spec.dtype, seed, conv, out.data());
  FillPattern(DType::kF32, Mix64(seed), delta, out.data() + conv * ElementBytes(spec.dtype));
  return out;
}

// Appends the section of Recurrent group `group` holding the states `state_ids`: for each
// layer, each state's conv then delta.
inline void AppendGroupStates(const CacheSpec& spec, int group,
                              absl::Span<const uint64_t> state_ids, std::string* out) {
  for (int layer = 0; layer < spec.groups[group].num_layers; ++layer) {
    for (uint64_t id : state_ids) {
      const std::vector<uint8_t> bytes = StateLayerBytes(spec, id, group, layer);
      out->append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    }
  }
}

// Appends, for each group and layer, K rows then V rows of `ids_per_group[g]` to out.
inline void AppendGroupRows(const CacheSpec& spec, int group, absl::Span<const uint64_t> ids,
                            std::string* out) {
  for (int layer = 0; layer < spec.groups[group].num_layers; ++layer) {
    for (bool key : {true, false}) {
      for (uint64_t id : ids) {
        const std::vector<uint8_t> row = RowBytes(spec, id, group, layer, key);
        out->append(reinterpret_cast<const char*>(row.data()), row.size());
      }
    }
  }
}

// The Append payload for a batch whose i-th token has id token_ids[i]. Recurrent groups get
// the states `state_ids` (one per distinct sequence, or one per token when speculative).
inline std::vector<uint8_t> AppendPayload(const CacheSpec& spec,
                                          absl::Span<const uint64_t> token_ids,
                                          absl::Span<const uint64_t> state_ids = {}) {
  std::string bytes;
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    if (spec.groups[g].kind == GroupKind::kRecurrent) {
      AppendGroupStates(spec, g, state_ids, &bytes);
    } else {
      AppendGroupRows(spec, g, token_ids, &bytes);
    }
  }
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

// The Read payload when group g returns the rows of ids_per_group[g], in that order; for a
// Recurrent group ids_per_group[g] holds the id of the state returned (or nothing).
inline std::string ReadPayload(const CacheSpec& spec,
                               const std::vector<std::vector<uint64_t>>& ids_per_group) {
  std::string bytes;
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    if (spec.groups[g].kind == GroupKind::kRecurrent) {
      AppendGroupStates(spec, g, ids_per_group[g], &bytes);
    } else {
      AppendGroupRows(spec, g, ids_per_group[g], &bytes);
    }
  }
  return bytes;
}

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_TESTING_PATTERN_H_
