// Deterministic K/V payloads for kvmeshctl and the benchmarks, and a checksum to compare them.
//
// A pattern payload is a function of (seed, group, layer, K or V, position, element): every
// element is a value in [-1, 1) derived from a hash of those, stored in the cache's dtype. Because
// the value depends on the token's position and not on where the token sits in a batch, a range
// appended with one seed, in any number of Append calls, can be verified from any Read of it
// (and from a CopyPrefix of it, which keeps positions), using only the positions in the Read
// header. The sequence id is deliberately not part of the key, so forks verify with their
// source's seed.
//
// Stateless functions; safe from any thread.
#ifndef KVMESH_SERVICE_CTL_PAYLOAD_H_
#define KVMESH_SERVICE_CTL_PAYLOAD_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "cache/spec.h"

namespace kvmesh {
namespace ctl {

// The Append payload for tokens at `positions` (one entry per token, in batch order) of a single
// sequence, filled from `seed`. Size: AppendPayloadBytes(spec, positions.size(), 1).
// REQUIRES: ValidateSpec(spec).ok().
std::string MakePatternPayload(const CacheSpec& spec, absl::Span<const int32_t> positions,
                               uint64_t seed);

// The payload of tokens [begin, end) of a batch of `num_tokens` tokens of one sequence, cut out
// of that batch's payload `payload` (so a large payload can be sent in several Appends).
// REQUIRES: ValidateSpec(spec).ok(), payload.size() == AppendPayloadBytes(spec, num_tokens, 1),
// 0 <= begin <= end <= num_tokens.
std::string SliceTokens(const CacheSpec& spec, absl::Span<const uint8_t> payload,
                        int64_t num_tokens, int64_t begin, int64_t end);

// Result of comparing a Read payload with the pattern of `seed`.
struct PatternCheck {
  size_t elements = 0;    // elements compared
  size_t mismatches = 0;  // elements whose bytes differ from the pattern
  // Where the first mismatch is, e.g. "group 0 layer 3 V pos 17 element 5"; empty when none.
  std::string first_mismatch;
};

// Compares `payload` (a Read payload: for each group, for each layer, K then V of the positions
// positions[g]) with the pattern of `seed`. INVALID_ARGUMENT-like problems (a payload whose size
// does not match the positions) are reported as every element mismatching with an explanation
// in first_mismatch. REQUIRES: ValidateSpec(spec).ok(), positions.size() == spec.groups.size().
PatternCheck CheckPatternPayload(const CacheSpec& spec,
                                 const std::vector<std::vector<int32_t>>& positions,
                                 absl::Span<const uint8_t> payload, uint64_t seed);

// 64-bit FNV-1a of `data`, continuing from `state` (start with kFnvOffsetBasis), so a payload
// that arrives in chunks can be hashed as it comes.
inline constexpr uint64_t kFnvOffsetBasis = 0xcbf29ce484222325ull;
uint64_t Fnv1a64(absl::Span<const uint8_t> data, uint64_t state = kFnvOffsetBasis);

}  // namespace ctl
}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CTL_PAYLOAD_H_
