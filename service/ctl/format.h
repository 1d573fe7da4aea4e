// Readable output of kvmeshctl's cluster commands: transfer statistics, per-node results of a
// cluster-wide Remove, the member table; and the parser of `remove --scope`. Kept apart from
// kvmeshctl.cc so that the unit tests can check them.
//
// Stateless functions; safe from any thread.
#ifndef KVMESH_SERVICE_CTL_FORMAT_H_
#define KVMESH_SERVICE_CTL_FORMAT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {
namespace ctl {

// "grpc-stream, 64.0 MiB in 75.3 ms, 0.89 GB/s" (the rate only when the time is > 0; "?" for
// an empty transport name).
std::string TransferLine(const v1::TransferStats& stats);

// "node-b: OK" or "node-c: NOT_FOUND: cache 'x' does not exist".
std::string NodeResultLine(const v1::NodeResult& result);

// "SERVING", "NOT_SERVING", "UNREACHABLE" or "UNKNOWN".
std::string MemberHealthText(v1::MemberHealth health);

// The members as an aligned table with a header line: NAME (this node marked "*"), ADDRESS,
// HEALTH, BACKEND, TRANSPORTS, DETAIL; "-" for an empty cell. Ends with a newline.
std::string MembersTable(const v1::ListMembersResponse& response);

// "local" or "cluster" (any case, "REMOVE_SCOPE_" prefix allowed). INVALID_ARGUMENT otherwise.
absl::StatusOr<v1::RemoveScope> ParseRemoveScope(absl::string_view text);

}  // namespace ctl
}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CTL_FORMAT_H_
