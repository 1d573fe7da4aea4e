// A RESOURCE_EXHAUSTED status that says in numbers what ran short, so that a caller acts on
// numbers rather than on the message's text: which resource, of which layer group, how many
// units the operation needed, how many were free and how many there are in all.
//
// The numbers travel as a payload of the absl::Status (type URL kShortagePayloadUrl), which
// RETURN_IF_ERROR and absl::StatusOr keep; the node turns it into a google.rpc.ErrorInfo in
// the gRPC status details (service/common/convert.h). A status rebuilt from its code and
// message loses it: pass statuses on as they are.
#ifndef KVMESH_CACHE_SHORTAGE_H_
#define KVMESH_CACHE_SHORTAGE_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvmesh {

enum class Resource {
  kCells,          // an Attention group's cells
  kRings,          // a Rotating group's rings
  kStateSlots,     // a Recurrent group's state slots
  kSequences,      // the cache's max_sequences
  kDeviceBytes,    // the device's memory budget
  kPendingTokens,  // a sequence's speculative tokens (max_batch)
  kInflightBytes,  // the node's in-flight budget for request and response bytes
  kSnapshotBytes,  // the device's snapshot pool
  kMetadataBytes,  // the node's budget for its caches' host bookkeeping (CacheMetadataBytes)
};

// ErrorInfo's `reason` for a resource: "CELLS_EXHAUSTED", "RINGS_EXHAUSTED", ...
absl::string_view ShortageReason(Resource resource);
// The resource of a reason ShortageReason gives; nullopt for any other text.
std::optional<Resource> ResourceOfReason(absl::string_view reason);

struct Shortage {
  Resource resource = Resource::kCells;
  int32_t group = -1;  // the layer group's index, -1 when not a group's resource
  int64_t needed = 0;  // units the operation needed (beyond what it held already)
  int64_t free = 0;    // units free when it was refused
  int64_t total = 0;   // units in all; 0 when not known
};

inline constexpr absl::string_view kShortagePayloadUrl = "kvmesh.io/kvmesh.Shortage";

// absl::ResourceExhaustedError(message) carrying `shortage`.
absl::Status ResourceExhaustedWith(absl::string_view message, const Shortage& shortage);

// The shortage a status carries; nullopt when it carries none (or a malformed one).
std::optional<Shortage> GetShortage(const absl::Status& status);

}  // namespace kvmesh

#endif  // KVMESH_CACHE_SHORTAGE_H_
