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

bool RotatingSpec::operator==(const RotatingSpec& o) const {
  return num_kv_heads == o.num_kv_heads && head_dim_k == o.head_dim_k &&
         head_dim_v == o.head_dim_v && max_size == o.max_size && rope == o.rope;
}

bool RecurrentSpec::operator==(const RecurrentSpec& o) const {
  return conv_tail == o.conv_tail && conv_dim == o.conv_dim && num_v_heads == o.num_v_heads &&
         head_v_dim == o.head_v_dim && head_k_dim == o.head_k_dim;
}

bool GroupSpec::operator==(const GroupSpec& o) const {
  if (num_layers != o.num_layers || kind != o.kind) return false;
  switch (kind) {
    case GroupKind::kAttention:
      return attention == o.attention;
    case GroupKind::kRotating:
      return rotating == o.rotating;
    case GroupKind::kRecurrent:
      return recurrent == o.recurrent;
  }
  return false;
}

const char* GroupKindName(GroupKind kind) {
  switch (kind) {
    case GroupKind::kAttention:
      return "attention";
    case GroupKind::kRotating:
      return "rotating";
    case GroupKind::kRecurrent:
      return "recurrent";
  }
  return "unknown";
}

const char* EvictionPolicyName(EvictionPolicy policy) {
  switch (policy) {
    case EvictionPolicy::kNone:
      return "none";
    case EvictionPolicy::kLru:
      return "lru";
  }
  return "unknown";
}

bool CacheSpec::operator==(const CacheSpec& o) const {
  return name == o.name && dtype == o.dtype && max_sequences == o.max_sequences &&
         capacity == o.capacity && max_batch == o.max_batch && groups == o.groups &&
         token_block_size == o.token_block_size && eviction == o.eviction;
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

absl::Status ValidateRope(const std::string& prefix, const RopeSpec& r, int32_t head_dim_k) {
  if (r.type != RopeType::kNone) {
    if (r.dims <= 0 || r.dims % 2 != 0 || r.dims > head_dim_k) {
      return Invalid(absl::StrCat(prefix, ".rope.dims = ", r.dims,
                                  " must be even and in [2, head_dim_k = ", head_dim_k, "]"));
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
  return ValidateRope(prefix, a.rope, a.head_dim_k);
}

absl::Status ValidateRotating(const std::string& prefix, const RotatingSpec& r,
                              const CacheSpec& spec) {
  absl::Status s;
  if (!(s = CheckRange(prefix + ".num_kv_heads", r.num_kv_heads, 1, kMaxHeads)).ok()) return s;
  if (!(s = CheckRange(prefix + ".head_dim_k", r.head_dim_k, 1, kMaxHeadDim)).ok()) return s;
  if (!(s = CheckRange(prefix + ".head_dim_v", r.head_dim_v, 1, kMaxHeadDim)).ok()) return s;
  if (!(s = CheckRange(prefix + ".max_size", r.max_size, 1, spec.capacity)).ok()) return s;
  return ValidateRope(prefix, r.rope, r.head_dim_k);
}

absl::Status ValidateRecurrent(const std::string& prefix, const RecurrentSpec& r) {
  absl::Status s;
  if (!(s = CheckRange(prefix + ".conv_tail", r.conv_tail, 1, kMaxConvTail)).ok()) return s;
  if (!(s = CheckRange(prefix + ".conv_dim", r.conv_dim, 1, kMaxConvDim)).ok()) return s;
  if (!(s = CheckRange(prefix + ".num_v_heads", r.num_v_heads, 0, kMaxHeads)).ok()) return s;
  if (r.num_v_heads == 0) {
    if (r.head_v_dim != 0 || r.head_k_dim != 0) {
      return Invalid(absl::StrCat(prefix, ".head_v_dim = ", r.head_v_dim, " and head_k_dim = ",
                                  r.head_k_dim, " must be 0 when num_v_heads is 0"));
    }
    return absl::OkStatus();
  }
  if (!(s = CheckRange(prefix + ".head_v_dim", r.head_v_dim, 1, kMaxHeadDim)).ok()) return s;
  return CheckRange(prefix + ".head_k_dim", r.head_k_dim, 1, kMaxHeadDim);
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
  if (!(s = CheckRange("token_block_size", spec.token_block_size, 1, kMaxTokenBlockSize)).ok()) {
    return s;
  }
  if (spec.groups.empty()) return Invalid("groups is empty: a cache needs at least one group");
  if (spec.groups.size() > static_cast<size_t>(kMaxGroups)) {
    return Invalid(
        absl::StrCat("groups has ", spec.groups.size(), " entries, more than ", kMaxGroups));
  }
  unsigned __int128 total = 0;
  unsigned __int128 token_bytes = 0;  // every group's bytes for one token (a state for Recurrent)
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const GroupSpec& group = spec.groups[g];
    const std::string prefix = absl::StrCat("groups[", g, "]");
    if (!(s = CheckRange(prefix + ".num_layers", group.num_layers, 1, kMaxLayersPerGroup)).ok()) {
      return s;
    }
    const unsigned __int128 layers = static_cast<unsigned>(group.num_layers);
    const size_t elem = DTypeSize(spec.dtype);
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
        const unsigned __int128 per_token =
            layers * unsigned(a.num_kv_heads) * unsigned(a.head_dim_k + a.head_dim_v) * elem;
        total += per_token * static_cast<uint64_t>(cells);
        token_bytes += per_token;
        break;
      }
      case GroupKind::kRotating: {
        if (!(s = ValidateRotating(prefix + ".rotating", group.rotating, spec)).ok()) return s;
        const RotatingSpec& r = group.rotating;
        const int64_t rows = int64_t{spec.max_sequences} * r.max_size;
        if (rows > kMaxCellsPerGroup) {
          return Invalid(absl::StrCat(prefix, " needs ", rows,
                                      " ring rows (max_sequences x max_size), more than ",
                                      kMaxCellsPerGroup));
        }
        const unsigned __int128 per_token =
            layers * unsigned(r.num_kv_heads) * unsigned(r.head_dim_k + r.head_dim_v) * elem;
        total += per_token * static_cast<uint64_t>(rows);
        token_bytes += per_token;
        break;
      }
      case GroupKind::kRecurrent: {
        if (!(s = ValidateRecurrent(prefix + ".recurrent", group.recurrent)).ok()) return s;
        const RecurrentSpec& r = group.recurrent;
        using u128 = unsigned __int128;
        const u128 state =
            layers * (u128(r.conv_tail) * unsigned(r.conv_dim) * elem +
                      u128(r.num_v_heads) * unsigned(r.head_v_dim) * unsigned(r.head_k_dim) * 4u);
        total += state * unsigned(spec.max_sequences);
        token_bytes += state;  // a speculative Append carries one state per token
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

int32_t TokenIdLimit(const CacheSpec& spec) {
  int64_t limit = spec.capacity;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    if (spec.groups[g].kind != GroupKind::kAttention) continue;
    limit = std::max(limit, ComputeAttentionGeometry(spec, static_cast<int>(g)).cells);
  }
  return static_cast<int32_t>(std::min(limit, kMaxCellsPerGroup));
}

RotatingGeometry ComputeRotatingGeometry(const CacheSpec& spec, int group) {
  const GroupSpec& g = spec.groups[group];
  const RotatingSpec& r = g.rotating;
  RotatingGeometry geo;
  geo.rings = spec.max_sequences;
  geo.max_size = r.max_size;
  geo.k_row_bytes = size_t(r.num_kv_heads) * r.head_dim_k * DTypeSize(spec.dtype);
  geo.v_row_bytes = size_t(r.num_kv_heads) * r.head_dim_v * DTypeSize(spec.dtype);
  geo.bytes = size_t(g.num_layers) * size_t(geo.rings) * size_t(geo.max_size) *
              (geo.k_row_bytes + geo.v_row_bytes);
  return geo;
}

RecurrentGeometry ComputeRecurrentGeometry(const CacheSpec& spec, int group) {
  const GroupSpec& g = spec.groups[group];
  const RecurrentSpec& r = g.recurrent;
  RecurrentGeometry geo;
  geo.slots = spec.max_sequences;
  geo.conv_bytes = size_t(r.conv_tail) * r.conv_dim * DTypeSize(spec.dtype);
  geo.delta_bytes = size_t(r.num_v_heads) * r.head_v_dim * r.head_k_dim * sizeof(float);
  geo.state_bytes = size_t(g.num_layers) * (geo.conv_bytes + geo.delta_bytes);
  geo.bytes = size_t(geo.slots) * geo.state_bytes;
  return geo;
}

bool RequiresContiguousPositions(const CacheSpec& spec) {
  for (const GroupSpec& g : spec.groups) {
    if (g.kind != GroupKind::kAttention) return true;
  }
  return false;
}

size_t GroupTokenBytes(const CacheSpec& spec, int group) {
  const GroupSpec& g = spec.groups[group];
  switch (g.kind) {
    case GroupKind::kAttention: {
      const AttentionSpec& a = g.attention;
      return size_t(g.num_layers) * a.num_kv_heads * (a.head_dim_k + a.head_dim_v) *
             DTypeSize(spec.dtype);
    }
    case GroupKind::kRotating: {
      const RotatingSpec& r = g.rotating;
      return size_t(g.num_layers) * r.num_kv_heads * (r.head_dim_k + r.head_dim_v) *
             DTypeSize(spec.dtype);
    }
    case GroupKind::kRecurrent:
      return 0;
  }
  return 0;
}

size_t GroupStateBytes(const CacheSpec& spec, int group) {
  if (spec.groups[group].kind != GroupKind::kRecurrent) return 0;
  return ComputeRecurrentGeometry(spec, group).state_bytes;
}

size_t AppendPayloadBytes(const CacheSpec& spec, int64_t num_tokens, int64_t num_sequences,
                          bool speculative) {
  const size_t states = static_cast<size_t>(speculative ? num_tokens : num_sequences);
  size_t total = 0;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    total += GroupTokenBytes(spec, static_cast<int>(g)) * static_cast<size_t>(num_tokens) +
             GroupStateBytes(spec, static_cast<int>(g)) * states;
  }
  return total;
}

size_t CacheBytes(const CacheSpec& spec) {
  size_t total = 0;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const int group = static_cast<int>(g);
    switch (spec.groups[g].kind) {
      case GroupKind::kAttention:
        total += ComputeAttentionGeometry(spec, group).bytes;
        break;
      case GroupKind::kRotating:
        total += ComputeRotatingGeometry(spec, group).bytes;
        break;
      case GroupKind::kRecurrent:
        total += ComputeRecurrentGeometry(spec, group).bytes;
        break;
    }
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
  if (a.token_block_size != b.token_block_size) {
    return absl::StrCat("token_block_size ", a.token_block_size, " vs ", b.token_block_size);
  }
  if (a.eviction != b.eviction) {
    return absl::StrCat("eviction ", EvictionPolicyName(a.eviction), " vs ",
                        EvictionPolicyName(b.eviction));
  }
  if (a.groups.size() != b.groups.size()) {
    return absl::StrCat("number of groups ", a.groups.size(), " vs ", b.groups.size());
  }
  for (size_t g = 0; g < a.groups.size(); ++g) {
    if (!(a.groups[g] == b.groups[g])) return absl::StrCat("groups[", g, "]");
  }
  return a.name != b.name ? absl::StrCat("name '", a.name, "' vs '", b.name, "'") : "nothing";
}

uint64_t CacheMetadataBytes(const CacheSpec& spec) {
  const uint64_t per_sequence =
      kSequenceMetadataBytes + kGroupSequenceMetadataBytes * spec.groups.size();
  uint64_t total = per_sequence * static_cast<uint64_t>(spec.max_sequences);
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const int group = static_cast<int>(g);
    switch (spec.groups[g].kind) {
      case GroupKind::kAttention:
        total += kCellMetadataBytes *
                 static_cast<uint64_t>(ComputeAttentionGeometry(spec, group).cells);
        break;
      case GroupKind::kRotating:
        total += kSlotMetadataBytes *
                 static_cast<uint64_t>(ComputeRotatingGeometry(spec, group).rings);
        break;
      case GroupKind::kRecurrent:
        total += kSlotMetadataBytes *
                 static_cast<uint64_t>(ComputeRecurrentGeometry(spec, group).slots);
        break;
    }
  }
  return total;
}

}  // namespace kvmesh
