#include "service/ctl_payload.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "cache/dtype.h"

namespace kvmesh {
namespace ctl {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Hash of everything that names one row (one token of one layer's K or V).
uint64_t RowKey(uint64_t seed, int group, int layer, int plane, int32_t pos) {
  uint64_t h = SplitMix64(seed);
  h = SplitMix64(h ^ static_cast<uint64_t>(group));
  h = SplitMix64(h ^ (static_cast<uint64_t>(layer) << 1 | static_cast<uint64_t>(plane)));
  return SplitMix64(h ^ static_cast<uint64_t>(static_cast<uint32_t>(pos)));
}

// Writes the `elements` pattern values of one row into `out` in `dtype`.
void FillRow(DType dtype, uint64_t key, size_t elements, uint8_t* out) {
  for (size_t i = 0; i < elements; ++i) {
    const uint64_t h = SplitMix64(key + i * 0x9e3779b97f4a7c15ull);
    // 24 random bits scaled to [-1, 1): exact in float, and short enough to survive f16/bf16
    // rounding as *some* deterministic value (only the bytes are compared).
    const float v = static_cast<float>(h >> 40) * (1.0f / 8388608.0f) - 1.0f;
    StoreElement(dtype, out, i, v);
  }
}

struct RowShape {
  size_t k_elements = 0;
  size_t v_elements = 0;
};

RowShape AttentionRowShape(const GroupSpec& group) {
  switch (group.kind) {
    case GroupKind::kAttention:
      return {static_cast<size_t>(group.attention.num_kv_heads) * group.attention.head_dim_k,
              static_cast<size_t>(group.attention.num_kv_heads) * group.attention.head_dim_v};
  }
  return {};
}

}  // namespace

std::string MakePatternPayload(const CacheSpec& spec, absl::Span<const int32_t> positions,
                               uint64_t seed) {
  std::string payload(AppendPayloadBytes(spec, static_cast<int64_t>(positions.size()), 1), '\0');
  uint8_t* out = reinterpret_cast<uint8_t*>(payload.data());
  const size_t esize = DTypeSize(spec.dtype);
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    const RowShape shape = AttentionRowShape(spec.groups[g]);
    for (int layer = 0; layer < spec.groups[g].num_layers; ++layer) {
      for (int plane = 0; plane < 2; ++plane) {
        const size_t elements = plane == 0 ? shape.k_elements : shape.v_elements;
        for (int32_t pos : positions) {
          FillRow(spec.dtype, RowKey(seed, g, layer, plane, pos), elements, out);
          out += elements * esize;
        }
      }
    }
  }
  return payload;
}

std::string SliceTokens(const CacheSpec& spec, absl::Span<const uint8_t> payload,
                        int64_t num_tokens, int64_t begin, int64_t end) {
  std::string out;
  out.reserve(AppendPayloadBytes(spec, end - begin, 1));
  const size_t esize = DTypeSize(spec.dtype);
  const uint8_t* in = payload.data();
  for (const GroupSpec& group : spec.groups) {
    const RowShape shape = AttentionRowShape(group);
    for (int layer = 0; layer < group.num_layers; ++layer) {
      for (size_t elements : {shape.k_elements, shape.v_elements}) {
        const size_t row = elements * esize;
        out.append(reinterpret_cast<const char*>(in + begin * row), (end - begin) * row);
        in += num_tokens * row;
      }
    }
  }
  return out;
}

PatternCheck CheckPatternPayload(const CacheSpec& spec,
                                 const std::vector<std::vector<int32_t>>& positions,
                                 absl::Span<const uint8_t> payload, uint64_t seed) {
  PatternCheck check;
  const size_t esize = DTypeSize(spec.dtype);
  size_t expected_bytes = 0;
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    expected_bytes += GroupTokenBytes(spec, g) * positions[g].size();
  }
  if (payload.size() != expected_bytes) {
    check.elements = expected_bytes / esize;
    check.mismatches = check.elements;
    check.first_mismatch =
        absl::StrCat("payload is ", payload.size(), " bytes, the positions need ", expected_bytes);
    return check;
  }
  const uint8_t* in = payload.data();
  std::vector<uint8_t> row;
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    const RowShape shape = AttentionRowShape(spec.groups[g]);
    for (int layer = 0; layer < spec.groups[g].num_layers; ++layer) {
      for (int plane = 0; plane < 2; ++plane) {
        const size_t elements = plane == 0 ? shape.k_elements : shape.v_elements;
        row.resize(elements * esize);
        for (int32_t pos : positions[g]) {
          FillRow(spec.dtype, RowKey(seed, g, layer, plane, pos), elements, row.data());
          check.elements += elements;
          if (std::memcmp(row.data(), in, row.size()) != 0) {
            for (size_t i = 0; i < elements; ++i) {
              if (std::memcmp(row.data() + i * esize, in + i * esize, esize) == 0) continue;
              if (check.mismatches == 0) {
                check.first_mismatch =
                    absl::StrCat("group ", g, " layer ", layer, plane == 0 ? " K" : " V", " pos ",
                                 pos, " element ", i);
              }
              ++check.mismatches;
            }
          }
          in += row.size();
        }
      }
    }
  }
  return check;
}

uint64_t Fnv1a64(absl::Span<const uint8_t> data, uint64_t state) {
  for (uint8_t b : data) {
    state ^= b;
    state *= 0x100000001b3ull;
  }
  return state;
}

}  // namespace ctl
}  // namespace kvmesh
