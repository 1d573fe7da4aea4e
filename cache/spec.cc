#include "cache/spec.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvmesh {

bool RopeSpec::operator==(const RopeSpec& o) const {
  // Without rotation the other fields mean nothing (and are not validated), so they must not
  // make two otherwise identical specs differ.
  if (type == RopeType::kNone || o.type == RopeType::kNone) return type == o.type;
  return type == o.type && dims == o.dims && base == o.base && freq_scale == o.freq_scale;
}

bool WindowSpec::operator==(const WindowSpec& o) const {
  return kind == o.kind && window == o.window && memory == o.memory && chunk == o.chunk;
}

bool AttentionSpec::operator==(const AttentionSpec& o) const {
  return num_kv_heads == o.num_kv_heads && head_dim_k == o.head_dim_k &&
         head_dim_v == o.head_dim_v && window == o.window && rope == o.rope;
}

bool GroupSpec::operator==(const GroupSpec& o) const {
  return num_layers == o.num_layers && kind == o.kind && attention == o.attention;
}

bool CacheSpec::operator==(const CacheSpec& o) const {
  return name == o.name && dtype == o.dtype && max_sequences == o.max_sequences &&
         capacity == o.capacity && max_batch == o.max_batch && groups == o.groups;
}

namespace {

absl::Status Invalid(const std::string& what) { return absl::InvalidArgumentError(what); }

absl::Status CheckRange(const std::string& field, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return Invalid(absl::StrCat(field, " = ", value, " is out of range [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

bool ValidNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

absl::Status ValidateAttention(const std::string& prefix, const AttentionSpec& a) {
  absl::Status s;
  if (!(s = CheckRange(prefix + ".num_kv_heads", a.num_kv_heads, 1, kMaxHeads)).ok()) return s;
  if (!(s = CheckRange(prefix + ".head_dim_k", a.head_dim_k, 1, kMaxHeadDim)).ok()) return s;
  if (!(s = CheckRange(prefix + ".head_dim_v", a.head_dim_v, 1, kMaxHeadDim)).ok()) return s;
  const WindowSpec& w = a.window;
  switch (w.kind) {
    case WindowKind::kFull:
      break;
    case WindowKind::kSliding:
      if (!(s = CheckRange(prefix + ".window.sliding.window", w.window, 1, INT32_MAX)).ok()) {
        return s;
      }
      if (w.memory < 0) {
        return Invalid(absl::StrCat(prefix, ".window.sliding.memory = ", w.memory, " is negative"));
      }
      if (w.memory != 0 && w.memory < w.window) {
        return Invalid(absl::StrCat(prefix, ".window.sliding.memory = ", w.memory,
                                    " is smaller than window = ", w.window));
      }
      break;
    case WindowKind::kChunked:
      if (!(s = CheckRange(prefix + ".window.chunked.chunk", w.chunk, 1, INT32_MAX)).ok()) {
        return s;
      }
      break;
  }
  const RopeSpec& r = a.rope;
  if (r.type != RopeType::kNone) {
    if (r.dims <= 0 || r.dims % 2 != 0 || r.dims > a.head_dim_k) {
      return Invalid(absl::StrCat(prefix, ".rope.dims = ", r.dims,
                                  " must be even and in [2, head_dim_k = ", a.head_dim_k, "]"));
    }
    if (!(std::isfinite(r.base) && r.base > 0.0f)) {
      return Invalid(absl::StrCat(prefix, ".rope.base = ", r.base, " must be finite and > 0"));
    }
    if (!(std::isfinite(r.freq_scale) && r.freq_scale > 0.0f)) {
      return Invalid(
          absl::StrCat(prefix, ".rope.freq_scale = ", r.freq_scale, " must be finite and > 0"));
    }
  }
  return absl::OkStatus();
}

// Effective per-sequence memory of a sliding group, following the seed's Init.
int32_t EffectiveMemory(const CacheSpec& spec, const WindowSpec& w) {
  if (w.kind != WindowKind::kSliding) return kUnlimitedMemory;
  int64_t memory = w.memory == 0 ? w.window : w.memory;
  // The extra token keeps a sequence resumable after its stop token when several sequences
  // share the pool.
  if (spec.max_sequences > 1) memory = std::max<int64_t>(memory, int64_t{w.window} + 1);
  if (memory >= spec.capacity) return kUnlimitedMemory;
  return static_cast<int32_t>(memory);
}

}  // namespace

absl::Status ValidateSpec(const CacheSpec& spec) {
  if (spec.name.empty()) return Invalid("name is empty");
  if (spec.name.size() > kMaxNameLength) {
    return Invalid(
        absl::StrCat("name is ", spec.name.size(), " characters, more than ", kMaxNameLength));
  }
  for (char c : spec.name) {
    if (!ValidNameChar(c)) {
      return Invalid(absl::StrCat("name '", spec.name, "' has a character outside [A-Za-z0-9._-]"));
    }
  }
  absl::Status s;
  if (!(s = CheckRange("max_sequences", spec.max_sequences, 1, kMaxSequences)).ok()) return s;
  if (!(s = CheckRange("capacity", spec.capacity, 1, INT32_MAX)).ok()) return s;
  if (!(s = CheckRange("max_batch", spec.max_batch, 1, kMaxCellsPerGroup)).ok()) return s;
  if (spec.groups.empty()) return Invalid("groups is empty: a cache needs at least one group");
  if (spec.groups.size() > static_cast<size_t>(kMaxGroups)) {
    return Invalid(
        absl::StrCat("groups has ", spec.groups.size(), " entries, more than ", kMaxGroups));
  }
  unsigned __int128 total = 0;
  unsigned __int128 token_bytes = 0;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const GroupSpec& group = spec.groups[g];
    const std::string prefix = absl::StrCat("groups[", g, "]");
    if (!(s = CheckRange(prefix + ".num_layers", group.num_layers, 1, kMaxLayersPerGroup)).ok()) {
      return s;
    }
    switch (group.kind) {
      case GroupKind::kAttention: {
        if (!(s = ValidateAttention(prefix + ".attention", group.attention)).ok()) return s;
        const int32_t memory = EffectiveMemory(spec, group.attention.window);
        const int64_t cells = memory == kUnlimitedMemory
                                  ? int64_t{spec.max_sequences} * spec.capacity
                                  : int64_t{spec.max_sequences} * memory + spec.max_batch;
        if (cells > kMaxCellsPerGroup) {
          return Invalid(absl::StrCat(prefix, " needs ", cells,
                                      " cells (max_sequences x capacity or memory), more than ",
                                      kMaxCellsPerGroup));
        }
        const AttentionSpec& a = group.attention;
        const unsigned __int128 per_token = static_cast<unsigned __int128>(group.num_layers) *
                                            a.num_kv_heads * (a.head_dim_k + a.head_dim_v) *
                                            DTypeSize(spec.dtype);
        total += per_token * cells;
        token_bytes += per_token;
        break;
      }
    }
  }
  if (token_bytes * static_cast<unsigned>(spec.max_batch) > kMaxCacheBytes) {
    return Invalid(absl::StrCat("max_batch = ", spec.max_batch,
                                " tokens would make an Append payload larger than ", kMaxCacheBytes,
                                " bytes"));
  }
  if (total > kMaxCacheBytes) {
    return Invalid(absl::StrCat("the cache would need more than ", kMaxCacheBytes,
                                " bytes; check the spec's sizes"));
  }
  return absl::OkStatus();
}

AttentionGeometry ComputeAttentionGeometry(const CacheSpec& spec, int group) {
  const GroupSpec& g = spec.groups[group];
  const AttentionSpec& a = g.attention;
  AttentionGeometry geo;
  geo.memory = EffectiveMemory(spec, a.window);
  geo.cells = geo.memory == kUnlimitedMemory
                  ? int64_t{spec.max_sequences} * spec.capacity
                  : int64_t{spec.max_sequences} * geo.memory + spec.max_batch;
  geo.k_row_bytes = size_t(a.num_kv_heads) * a.head_dim_k * DTypeSize(spec.dtype);
  geo.v_row_bytes = size_t(a.num_kv_heads) * a.head_dim_v * DTypeSize(spec.dtype);
  geo.bytes = size_t(g.num_layers) * geo.cells * (geo.k_row_bytes + geo.v_row_bytes);
  return geo;
}

size_t GroupTokenBytes(const CacheSpec& spec, int group) {
  const GroupSpec& g = spec.groups[group];
  switch (g.kind) {
    case GroupKind::kAttention: {
      const AttentionSpec& a = g.attention;
      return size_t(g.num_layers) * a.num_kv_heads * (a.head_dim_k + a.head_dim_v) *
             DTypeSize(spec.dtype);
    }
  }
  return 0;
}

size_t AppendPayloadBytes(const CacheSpec& spec, int64_t num_tokens, int64_t num_sequences) {
  size_t total = 0;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    total += GroupTokenBytes(spec, static_cast<int>(g)) * static_cast<size_t>(num_tokens);
  }
  return total;
}

size_t CacheBytes(const CacheSpec& spec) {
  size_t total = 0;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    total += ComputeAttentionGeometry(spec, static_cast<int>(g)).bytes;
  }
  return total;
}

}  // namespace kvmesh

namespace kvmesh {

std::string DescribeSpecDifference(const CacheSpec& a, const CacheSpec& b) {
  if (a.dtype != b.dtype) {
    return absl::StrCat("dtype ", DTypeName(a.dtype), " vs ", DTypeName(b.dtype));
  }
  if (a.max_sequences != b.max_sequences) {
    return absl::StrCat("max_sequences ", a.max_sequences, " vs ", b.max_sequences);
  }
  if (a.capacity != b.capacity) return absl::StrCat("capacity ", a.capacity, " vs ", b.capacity);
  if (a.max_batch != b.max_batch) {
    return absl::StrCat("max_batch ", a.max_batch, " vs ", b.max_batch);
  }
  if (a.groups.size() != b.groups.size()) {
    return absl::StrCat("number of groups ", a.groups.size(), " vs ", b.groups.size());
  }
  for (size_t g = 0; g < a.groups.size(); ++g) {
    if (!(a.groups[g] == b.groups[g])) return absl::StrCat("groups[", g, "]");
  }
  return a.name != b.name ? absl::StrCat("name '", a.name, "' vs '", b.name, "'") : "nothing";
}

}  // namespace kvmesh
