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
// Attention and Rotating groups use that K/V pattern. A Recurrent group's state is a function of
// (seed, group, layer, conv or delta, offset reached, element), where "offset reached" is one
// past the last token the state has seen: conv elements in the cache's dtype, delta elements in
// float32. So the state a plain Append of positions [a, b) carries is the pattern at offset b,
// a speculative Append's state after the token at position p is the pattern at p + 1, and a Read
// that returns a sequence's state (which belongs to the sequence's offset) verifies with the
// seed of the Append that produced it and that offset.
//
#ifndef KVMESH_SERVICE_CTL_PAYLOAD_H_
#define KVMESH_SERVICE_CTL_PAYLOAD_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "cache/spec.h"

namespace kvmesh {
namespace ctl {

// The Append payload for tokens at `positions` (one entry per token, in batch order, ascending)
// of a single sequence, filled from `seed`. Recurrent groups carry the state at offset
// (last position + 1), or with `speculative` one state per token, at offset (position + 1).
// Size: AppendPayloadBytes(spec, positions.size(), 1, speculative) (0 for no positions).
// REQUIRES: ValidateSpec(spec).ok().
std::string MakePatternPayload(const CacheSpec& spec, absl::Span<const int32_t> positions,
                               uint64_t seed, bool speculative = false);

// The payload of tokens [begin, end) of a batch of `num_tokens` tokens of one sequence, cut out
// of that batch's payload `payload` (so a large payload can be sent in several Appends). With
// `speculative`, Recurrent sections keep the states of tokens [begin, end). Otherwise a batch
// holds one state, the one after its last token, and every slice gets that state: it is right
// only for a slice that ends the batch (end == num_tokens), so a caller sending a plain payload
// of a cache with Recurrent groups must not split it.
// REQUIRES: ValidateSpec(spec).ok(),
// payload.size() == AppendPayloadBytes(spec, num_tokens, 1, speculative),
// 0 <= begin <= end <= num_tokens.
std::string SliceTokens(const CacheSpec& spec, absl::Span<const uint8_t> payload,
                        int64_t num_tokens, int64_t begin, int64_t end, bool speculative = false);

// Whether the spec has a Recurrent group (whose plain Append payload cannot be split).
bool HasRecurrentGroup(const CacheSpec& spec);

// Result of comparing a Read payload with the pattern of `seed`.
struct PatternCheck {
  size_t elements = 0;    // elements compared
  size_t mismatches = 0;  // elements whose bytes differ from the pattern
  // Where the first mismatch is, e.g. "group 0 layer 3 V pos 17 element 5"; empty when none.
  std::string first_mismatch;
};

// Compares `payload` (a Read payload: for each group, for each layer, K then V of the positions
// positions[g], or for a Recurrent group the state when it has one) with the pattern of `seed`.
// state_offsets[g]: the offset of the state a Recurrent group g returned (the sequence's
// offset), or nullopt when the Read returned no state for it. A payload whose size does not
// match is reported as every element mismatching with an explanation in first_mismatch.
// REQUIRES: ValidateSpec(spec).ok(), positions.size() == spec.groups.size() ==
// state_offsets.size().
PatternCheck CheckPatternPayload(const CacheSpec& spec,
                                 const std::vector<std::vector<int32_t>>& positions,
                                 const std::vector<std::optional<int32_t>>& state_offsets,
                                 absl::Span<const uint8_t> payload, uint64_t seed);

// The same for a Read that returned no Recurrent state.
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
