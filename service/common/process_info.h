// What identifies this process and its build: a boot id new at every start, the start time, the
// version (git describe at build time) and the build type. NodeInfo, ListMembers, /metrics
// (kvmesh_build_info), the logs and `kvmesh-node --version` report them.
//
// A node keeps its caches in memory only: a restarted node holds nothing, whatever its name.
// Its boot id is how a scheduler tells the restarted node from the one it knew.
#ifndef KVMESH_SERVICE_COMMON_PROCESS_INFO_H_
#define KVMESH_SERVICE_COMMON_PROCESS_INFO_H_

#include <string>

#include "absl/time/time.h"

namespace kvmesh {

struct ProcessInfo {
  std::string boot_id;  // 32 lowercase hex digits: 128 bits from getrandom, drawn at start
  absl::Time start_time;
  std::string version;     // e.g. "0.1.0-g5b0f470" (no tag yet) or "v0.2.0-3-gabcdef0-dirty"
  std::string build_type;  // CMAKE_BUILD_TYPE, with "+asan"/"+tsan" for sanitizer builds
};

// This process's; drawn on the first call (the node calls it first thing in main).
const ProcessInfo& ThisProcess();

// 128 bits from the kernel's CSPRNG (getrandom) as 32 lowercase hex digits. getrandom blocks
// only before the kernel's pool is initialized at boot, long before a node serves; without
// randomness ids would be guessable, so a failure aborts the process rather than go on.
std::string RandomHex128();

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_PROCESS_INFO_H_
