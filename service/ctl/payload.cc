#include "service/ctl/payload.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
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

// Hash of everything that names one part of one layer's recurrent state at an offset. The tag
// keeps these keys apart from RowKey's even if a group index were reused.
uint64_t StateKey(uint64_t seed, int group, int layer, int part, int64_t offset) {
  uint64_t h = SplitMix64(seed ^ 0x7265637572726e74ull);  // "recurrnt"
  h = SplitMix64(h ^ static_cast<uint64_t>(group));
  h = SplitMix64(h ^ (static_cast<uint64_t>(layer) << 1 | static_cast<uint64_t>(part)));
  return SplitMix64(h ^ static_cast<uint64_t>(static_cast<uint32_t>(offset)));
}

// Elements of one K or V row of an Attention or Rotating group (0 for a Recurrent group).
struct RowShape {
  size_t k_elements = 0;
  size_t v_elements = 0;
};

RowShape KvRowShape(const GroupSpec& group) {
  switch (group.kind) {
    case GroupKind::kAttention:
      return {static_cast<size_t>(group.attention.num_kv_heads) * group.attention.head_dim_k,
              static_cast<size_t>(group.attention.num_kv_heads) * group.attention.head_dim_v};
    case GroupKind::kRotating:
      return {static_cast<size_t>(group.rotating.num_kv_heads) * group.rotating.head_dim_k,
              static_cast<size_t>(group.rotating.num_kv_heads) * group.rotating.head_dim_v};
    case GroupKind::kRecurrent:
      return {};
  }
  return {};
}

// Elements of one layer's recurrent state: conv in the cache's dtype, delta in float32.
struct StateShape {
  size_t conv_elements = 0;
  size_t delta_elements = 0;
};

StateShape RecurrentStateShape(const GroupSpec& group) {
  if (group.kind != GroupKind::kRecurrent) return {};
  const RecurrentSpec& r = group.recurrent;
  return {static_cast<size_t>(r.conv_tail) * r.conv_dim,
          static_cast<size_t>(r.num_v_heads) * r.head_v_dim * r.head_k_dim};
}

// Writes one layer's state pattern at `offset` to `out`; returns the bytes written.
size_t FillState(const CacheSpec& spec, int group, int layer, const StateShape& shape,
                 int64_t offset, uint64_t seed, uint8_t* out) {
  FillRow(spec.dtype, StateKey(seed, group, layer, 0, offset), shape.conv_elements, out);
  const size_t conv_bytes = shape.conv_elements * DTypeSize(spec.dtype);
  FillRow(DType::kF32, StateKey(seed, group, layer, 1, offset), shape.delta_elements,
          out + conv_bytes);
  return conv_bytes + shape.delta_elements * sizeof(float);
}

// Counts the elements of `got` that differ from `want` (both `elements` elements of `esize`
// bytes) into `check`, describing the first with where() and the element index. `where` is only
// called on a mismatch.
template <typename Where>
void CompareElements(const uint8_t* want, const uint8_t* got, size_t elements, size_t esize,
                     const Where& where, PatternCheck* check) {
  check->elements += elements;
  if (std::memcmp(want, got, elements * esize) == 0) return;
  for (size_t i = 0; i < elements; ++i) {
    if (std::memcmp(want + i * esize, got + i * esize, esize) == 0) continue;
    if (check->mismatches == 0) check->first_mismatch = absl::StrCat(where(), " element ", i);
    ++check->mismatches;
  }
}

}  // namespace

bool HasRecurrentGroup(const CacheSpec& spec) {
  for (const GroupSpec& g : spec.groups) {
    if (g.kind == GroupKind::kRecurrent) return true;
  }
  return false;
}

std::string MakePatternPayload(const CacheSpec& spec, absl::Span<const int32_t> positions,
                               uint64_t seed, bool speculative) {
  if (positions.empty()) return std::string();
  const int64_t num_tokens = static_cast<int64_t>(positions.size());
  std::string payload(AppendPayloadBytes(spec, num_tokens, 1, speculative), '\0');
  uint8_t* out = reinterpret_cast<uint8_t*>(payload.data());
  const size_t esize = DTypeSize(spec.dtype);
  int32_t last = positions[0];
  for (int32_t pos : positions) last = std::max(last, pos);
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    const GroupSpec& group = spec.groups[g];
    const RowShape shape = KvRowShape(group);
    const StateShape state = RecurrentStateShape(group);
    for (int layer = 0; layer < group.num_layers; ++layer) {
      if (group.kind == GroupKind::kRecurrent) {
        if (speculative) {
          for (int32_t pos : positions) {
            out += FillState(spec, g, layer, state, int64_t{pos} + 1, seed, out);
          }
        } else {
          out += FillState(spec, g, layer, state, int64_t{last} + 1, seed, out);
        }
        continue;
      }
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
                        int64_t num_tokens, int64_t begin, int64_t end, bool speculative) {
  std::string out;
  out.reserve(AppendPayloadBytes(spec, end - begin, 1, speculative));
  const size_t esize = DTypeSize(spec.dtype);
  const uint8_t* in = payload.data();
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    const GroupSpec& group = spec.groups[g];
    const RowShape shape = KvRowShape(group);
    const StateShape state_shape = RecurrentStateShape(group);
    const size_t state =
        state_shape.conv_elements * esize + state_shape.delta_elements * sizeof(float);
    for (int layer = 0; layer < group.num_layers; ++layer) {
      if (group.kind == GroupKind::kRecurrent) {
        if (speculative) {
          out.append(reinterpret_cast<const char*>(in + begin * state), (end - begin) * state);
          in += num_tokens * state;
        } else {
          out.append(reinterpret_cast<const char*>(in), state);
          in += state;
        }
        continue;
      }
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
                                 const std::vector<std::optional<int32_t>>& state_offsets,
                                 absl::Span<const uint8_t> payload, uint64_t seed) {
  PatternCheck check;
  const size_t esize = DTypeSize(spec.dtype);
  size_t expected_bytes = 0;
  size_t expected_elements = 0;
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    const RowShape shape = KvRowShape(spec.groups[g]);
    expected_bytes += GroupTokenBytes(spec, g) * positions[g].size();
    expected_elements += static_cast<size_t>(spec.groups[g].num_layers) *
                         (shape.k_elements + shape.v_elements) * positions[g].size();
    if (state_offsets[g].has_value()) {
      const StateShape state = RecurrentStateShape(spec.groups[g]);
      expected_bytes += GroupStateBytes(spec, g);
      expected_elements += static_cast<size_t>(spec.groups[g].num_layers) *
                           (state.conv_elements + state.delta_elements);
    }
  }
  if (payload.size() != expected_bytes) {
    check.elements = expected_elements;
    check.mismatches = check.elements;
    check.first_mismatch = absl::StrCat("payload is ", payload.size(),
                                        " bytes, the positions and states need ", expected_bytes);
    return check;
  }
  const uint8_t* in = payload.data();
  std::vector<uint8_t> row;
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    const GroupSpec& group = spec.groups[g];
    const RowShape shape = KvRowShape(group);
    const StateShape state = RecurrentStateShape(group);
    for (int layer = 0; layer < group.num_layers; ++layer) {
      for (int plane = 0; plane < 2 && group.kind != GroupKind::kRecurrent; ++plane) {
        const size_t elements = plane == 0 ? shape.k_elements : shape.v_elements;
        row.resize(elements * esize);
        for (int32_t pos : positions[g]) {
          FillRow(spec.dtype, RowKey(seed, g, layer, plane, pos), elements, row.data());
          CompareElements(
              row.data(), in, elements, esize,
              [&] {
                return absl::StrCat("group ", g, " layer ", layer, plane == 0 ? " K" : " V",
                                    " pos ", pos);
              },
              &check);
          in += row.size();
        }
      }
      if (group.kind == GroupKind::kRecurrent && state_offsets[g].has_value()) {
        const int32_t offset = *state_offsets[g];
        row.resize(state.conv_elements * esize + state.delta_elements * sizeof(float));
        FillState(spec, g, layer, state, offset, seed, row.data());
        auto where = [&](absl::string_view part) {
          return [&, part] {
            return absl::StrCat("group ", g, " layer ", layer, " ", part, " state (offset ", offset,
                                ")");
          };
        };
        CompareElements(row.data(), in, state.conv_elements, esize, where("conv"), &check);
        const size_t conv_bytes = state.conv_elements * esize;
        CompareElements(row.data() + conv_bytes, in + conv_bytes, state.delta_elements,
                        sizeof(float), where("delta"), &check);
        in += row.size();
      }
    }
  }
  return check;
}

PatternCheck CheckPatternPayload(const CacheSpec& spec,
                                 const std::vector<std::vector<int32_t>>& positions,
                                 absl::Span<const uint8_t> payload, uint64_t seed) {
  return CheckPatternPayload(
      spec, positions, std::vector<std::optional<int32_t>>(spec.groups.size()), payload, seed);
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
