// Readable output of kvmeshctl: sizes, rates and times; the protobuf objects the commands
// print (a cache's spec in --group shorthand, its usage, snapshots, transfer statistics,
// per-node results of a cluster-wide Remove, the member table); and the parser of
// `remove --scope`. Kept apart from the commands so that the unit tests can check them.
//
// Stateless functions; safe from any thread.
#ifndef KVMESH_SERVICE_CTL_FORMAT_H_
#define KVMESH_SERVICE_CTL_FORMAT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache/shortage.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {
namespace ctl {

// "12.3 MiB".
std::string Mib(int64_t bytes);

// "1.23 GB/s" (decimal GB); "-" when `elapsed` is not positive.
std::string Rate(int64_t bytes, absl::Duration elapsed);

// "75.3 ms".
std::string Ms(absl::Duration d);

// "f32", "f16" or "bf16"; the enum's name for anything else.
std::string DTypeText(v1::DType dtype);

// The --group shorthand of a group (what ParseGroup reads), so that `get` output can be pasted
// back into `create`; "layers=N (unknown kind)" for a group without a kind.
std::string GroupText(const v1::LayerGroup& group);

// The kind of group `g` of `spec`; KIND_NOT_SET when `g` is out of range.
v1::LayerGroup::KindCase GroupKindOf(const v1::CacheSpec& spec, int g);

// "VALID", "INVALID" or "none"; the enum's name for anything else.
std::string StateText(v1::StateStatus state);

// A cache's usage, each line indented by two spaces and ending with a newline: live sequences,
// bytes and snapshots, then one line per group in its kind's terms (cells, ring rows or state
// slots).
std::string UsageText(const v1::CacheUsage& usage, const v1::CacheSpec& spec);

// A cache as `get` prints it: name, spec (groups in --group shorthand), then "usage" and
// UsageText. Ends with a newline.
std::string InfoText(const v1::CacheInfo& info);

// One line summary of the usage an Append answers with: live sequences, cells per group, bytes
// held and, when there are any, snapshots.
std::string UsageLine(const v1::CacheUsage& usage);

// One line describing a snapshot of a cache with `spec`: id, source sequence, range, bytes and
// what each group holds.
std::string SnapshotLine(const v1::SnapshotInfo& snap, const v1::CacheSpec& spec);

// "grpc-stream, 64.0 MiB in 75.3 ms, 0.89 GB/s" (the rate only when the time is > 0; "?" for
// an empty transport name).
std::string TransferLine(const v1::TransferStats& stats);

// "CELLS_EXHAUSTED in group 0: needed 8, free 7 of 8" (without "in group" for a resource that
// is not a group's): what a RESOURCE_EXHAUSTED's details say.
std::string ShortageLine(const Shortage& shortage);

// "node-b: OK" or "node-c: NOT_FOUND: cache 'x' does not exist".
std::string NodeResultLine(const v1::NodeResult& result);

// "SERVING", "NOT_SERVING", "UNREACHABLE" or "UNKNOWN".
std::string MemberHealthText(v1::MemberHealth health);

// The members as an aligned table with a header line: NAME (this node marked "*"), ADDRESS,
// HEALTH, BACKEND, TRANSPORTS, BOOT (the boot id's first 8 hex digits: a new one means the
// node restarted and holds nothing it held), STARTED (UTC), DETAIL; "-" for an empty cell. Ends
// with a newline.
std::string MembersTable(const v1::ListMembersResponse& response);

// "local" or "cluster" (any case, "REMOVE_SCOPE_" prefix allowed). INVALID_ARGUMENT otherwise.
absl::StatusOr<v1::RemoveScope> ParseRemoveScope(absl::string_view text);

}  // namespace ctl
}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CTL_FORMAT_H_
