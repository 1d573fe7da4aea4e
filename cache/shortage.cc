#include "cache/shortage.h"

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvmesh {
namespace {

struct ResourceName {
  Resource resource;
  absl::string_view reason;
};

constexpr ResourceName kReasons[] = {
    {Resource::kCells, "CELLS_EXHAUSTED"},
    {Resource::kRings, "RINGS_EXHAUSTED"},
    {Resource::kStateSlots, "STATE_SLOTS_EXHAUSTED"},
    {Resource::kSequences, "SEQUENCES_EXHAUSTED"},
    {Resource::kDeviceBytes, "DEVICE_MEMORY_EXHAUSTED"},
    {Resource::kPendingTokens, "PENDING_TOKENS_EXHAUSTED"},
    {Resource::kInflightBytes, "INFLIGHT_BUDGET_EXHAUSTED"},
    {Resource::kSnapshotBytes, "SNAPSHOT_POOL_EXHAUSTED"},
    {Resource::kMetadataBytes, "METADATA_BUDGET_EXHAUSTED"},
};

}  // namespace

absl::string_view ShortageReason(Resource resource) {
  for (const ResourceName& r : kReasons) {
    if (r.resource == resource) return r.reason;
  }
  return "RESOURCE_EXHAUSTED";
}

std::optional<Resource> ResourceOfReason(absl::string_view reason) {
  for (const ResourceName& r : kReasons) {
    if (r.reason == reason) return r.resource;
  }
  return std::nullopt;
}

// The payload is five decimal fields, space-separated: resource (the enum's value), group,
// needed, free, total. It never leaves the process as it is.
absl::Status ResourceExhaustedWith(absl::string_view message, const Shortage& shortage) {
  absl::Status status = absl::ResourceExhaustedError(message);
  status.SetPayload(
      kShortagePayloadUrl,
      absl::Cord(absl::StrCat(static_cast<int>(shortage.resource), " ", shortage.group, " ",
                              shortage.needed, " ", shortage.free, " ", shortage.total)));
  return status;
}

std::optional<Shortage> GetShortage(const absl::Status& status) {
  const auto payload = status.GetPayload(kShortagePayloadUrl);
  if (!payload.has_value()) return std::nullopt;
  const std::vector<std::string> fields = absl::StrSplit(std::string(*payload), ' ');
  int64_t v[5];
  if (fields.size() != 5) return std::nullopt;
  for (size_t i = 0; i < 5; ++i) {
    if (!absl::SimpleAtoi(fields[i], &v[i])) return std::nullopt;
  }
  if (v[0] < 0 || v[0] > static_cast<int64_t>(Resource::kMetadataBytes)) return std::nullopt;
  Shortage shortage;
  shortage.resource = static_cast<Resource>(v[0]);
  shortage.group = static_cast<int32_t>(v[1]);
  shortage.needed = v[2];
  shortage.free = v[3];
  shortage.total = v[4];
  return shortage;
}

}  // namespace kvmesh
