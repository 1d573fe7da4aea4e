// The raw loopback TCP reference of the benchmarks (migrate_bench, rpc_bench): what the same
// bytes cost through a plain TCP connection on 127.0.0.1 in the same run.
#ifndef KVMESH_TESTS_BENCH_TCP_REFERENCE_H_
#define KVMESH_TESTS_BENCH_TCP_REFERENCE_H_

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvmesh {
namespace testutil {

// User buffers on both sides of the reference connection.
inline constexpr size_t kTcpBufferBytes = size_t{4} << 20;

// INTERNAL "<what>: <strerror(errno)>".
absl::Status ErrnoStatus(absl::string_view what);

// Writes `bytes` bytes (from one 4 MiB buffer, touched first) through a loopback TCP connection
// to a thread that reads them into another 4 MiB buffer, `reps` times on one connection
// (SO_SNDBUF/SO_RCVBUF left default); the seconds of each rep, from the sender's first write to
// the receiver's last read.
absl::StatusOr<std::vector<double>> LoopbackTcpSeconds(size_t bytes, int reps);

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_BENCH_TCP_REFERENCE_H_
