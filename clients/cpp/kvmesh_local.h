// The worker's end of kvmesh's local data path (proto/kvmesh/v1/local.proto,
// docs/api.md#local-data-path), for C++ inference engines on the same machine as a node: a
// session over the node's --local-socket, caches' memory mapped into this process, and pins of
// cells to read in place.
//
//   auto session = kvmesh::local::Session::Connect("/run/kvmesh/local.sock", token);
//   auto cache = (*session)->Attach("llama");         // maps every group's memory
//   auto pin = (*session)->Pin("llama", seq, 0, std::nullopt);
//   // group g's plane p, cell pin->cells[g][i]:
//   const uint8_t* row = cache->Row(g, p, pin->cells[g][i]);
//   ...
//   (*session)->Unpin(pin->id);
//
//   auto plan = (*session)->BeginAppend("llama", {seq, seq}, {10, 11});
//   // write token i's row of plane p of group g at cache->Row(g, p, plan->cells[g][i])
//   (*session)->CommitAppend(plan->id);
//
// Attach maps every page of the cache's memory at once (MAP_POPULATE), so that no write or read
// in place takes a page fault later. CopyRows copies runs of rows in or out at memory speed.
//
// Thread safety: a Session is used by one thread at a time. A MappedCache may be read from any
// thread; it stays mapped until destroyed, after the session too.
#ifndef KVMESH_CLIENTS_CPP_KVMESH_LOCAL_H_
#define KVMESH_CLIENTS_CPP_KVMESH_LOCAL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "kvmesh/v1/local.pb.h"

namespace kvmesh {
namespace local {

// One group's memory: host memory mapped at `base`, or GPU memory of CUDA device `cuda_device`
// (base null) that the engine imports from `cuda_fd` with its driver, as a CUDA VMM allocation
// of `bytes`: cuMemImportFromShareableHandle(&h, (void*)(uintptr_t)cuda_fd,
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), cuMemAddressReserve(&p, bytes, 0, 0, 0),
// cuMemMap(p, bytes, 0, h, 0), cuMemSetAccess(p, bytes, {device cuda_device, read-write}, 1),
// cuMemRelease(h); then row r of plane q is at p + planes[q].offset + r * planes[q].row_bytes.
// The MappedCache owns and closes `cuda_fd`.
struct MappedGroup {
  uint8_t* base = nullptr;
  size_t bytes = 0;
  int cuda_device = -1;
  int cuda_fd = -1;
  int64_t cells = 0;
  struct Plane {
    size_t offset = 0;
    size_t row_bytes = 0;
  };
  std::vector<Plane> planes;  // payload order (docs/api.md#payload-layout)
};

class MappedCache {
 public:
  ~MappedCache();
  MappedCache(const MappedCache&) = delete;
  MappedCache& operator=(const MappedCache&) = delete;

  const v1::CacheSpec& spec() const { return spec_; }
  const std::vector<MappedGroup>& groups() const { return groups_; }
  // Row `cell` of plane `plane` of group `group`. REQUIRES: all three in range; host memory.
  uint8_t* Row(size_t group, size_t plane, int32_t cell) const {
    const MappedGroup& g = groups_[group];
    return g.base + g.planes[plane].offset + static_cast<size_t>(cell) * g.planes[plane].row_bytes;
  }

 private:
  friend class Session;
  MappedCache() = default;
  v1::CacheSpec spec_;
  std::vector<MappedGroup> groups_;
};

// Copies `bytes` from `src` to `dst` as memcpy does. A copy of at least kStreamCopyBytes writes
// with non-temporal stores, past the CPU's caches: glibc's memcpy does so only above its own
// threshold (a share of the last-level cache, 24 MiB on a 32 MiB L3), so a run of cells of a few
// MiB, copied in or out of a mapped cache, would otherwise read every destination line into the
// cache before overwriting it (a third more memory traffic; docs/benchmarks.md, "Local data
// path"). The ranges must not overlap.
inline constexpr size_t kStreamCopyBytes = size_t{1} << 20;
void CopyRows(void* dst, const void* src, size_t bytes);

// Where an Append's tokens go (Session::BeginAppend): per group, the cell of each token in batch
// order (-1: a token a later one of the batch overwrites; write nothing for it); a Recurrent
// group's plain batch has one cell per sequence (the state slot of its state after the batch).
// Where a group's cells are rows of the plan's own staging memory (a speculative batch of a
// Rotating or Recurrent group), `staging` maps it: write group g's rows at
// staging->Row(g, p, cells[g][i]) (staging->groups()[g].bytes is 0 for the other groups).
struct AppendPlan {
  uint64_t id = 0;
  std::vector<std::vector<int32_t>> cells;
  absl::Time expires;
  std::shared_ptr<MappedCache> staging;  // null when no group stages
};

// Positions first..last, both included.
struct PositionRange {
  int32_t first = 0;
  int32_t last = 0;
};

// Cells pinned for reading in place: per group, the positions held and the cell of each, and
// per group and query (PinCells' queries), the pinned positions the query attends to.
struct Pin {
  uint64_t id = 0;
  std::vector<std::vector<int32_t>> positions;
  std::vector<std::vector<int32_t>> cells;
  std::vector<std::vector<std::vector<PositionRange>>> visible;
  absl::Time expires;
};

class Session {
 public:
  // Connects to `path` and says Hello with `token` (empty in development mode) and, for an
  // admin, the tenant to act for. The node's error (UNAUTHENTICATED, ...) when it refuses;
  // UNAVAILABLE when it cannot connect.
  static absl::StatusOr<std::unique_ptr<Session>> Connect(const std::string& path,
                                                          const std::string& token = "",
                                                          const std::string& tenant = "");
  ~Session();  // ends the session: the node drops its pins
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // The tenant the node runs the session as.
  const std::string& tenant() const { return tenant_; }

  // Maps every group of the session tenant's cache `cache`.
  absl::StatusOr<std::unique_ptr<MappedCache>> Attach(const std::string& cache);
  // Pins the cells of seq's positions [begin, end) (end absent: to its end) for `lease`
  // (zero: the node's default). With `queries` (positions of queries of seq, a batch's), the
  // pin also says what each attends to among the pinned positions (Pin::visible).
  absl::StatusOr<Pin> PinCells(const std::string& cache, int64_t seq, int32_t begin,
                               std::optional<int32_t> end,
                               absl::Duration lease = absl::ZeroDuration(),
                               const std::vector<int32_t>& queries = {});
  absl::Status Unpin(uint64_t pin);

  // Takes cells for an Append of tokens (seqs[i], positions[i]) (token_ids empty or one per
  // token) whose rows the worker then writes in place, every plane of every group, before
  // CommitAppend; AbandonAppend (or the lease, or the session's end) gives them back.
  absl::StatusOr<AppendPlan> BeginAppend(const std::string& cache, const std::vector<int64_t>& seqs,
                                         const std::vector<int32_t>& positions,
                                         const std::vector<int32_t>& token_ids = {},
                                         bool speculative = false,
                                         absl::Duration lease = absl::ZeroDuration());
  absl::Status CommitAppend(uint64_t plan);
  absl::Status AbandonAppend(uint64_t plan);

  // Sends `request` as it is and returns the node's response (with the descriptors it came
  // with, which the caller then owns): for tests of the protocol itself.
  absl::StatusOr<v1::LocalResponse> Call(v1::LocalRequest request, std::vector<int>* fds = nullptr);

 private:
  explicit Session(int fd) : fd_(fd) {}
  // Call, with the node's answer as a status (a request whose result is empty).
  absl::Status CallForStatus(v1::LocalRequest request);
  const int fd_;
  uint64_t next_id_ = 1;
  std::string tenant_;
};

}  // namespace local
}  // namespace kvmesh

#endif  // KVMESH_CLIENTS_CPP_KVMESH_LOCAL_H_
