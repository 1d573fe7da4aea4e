// CacheServiceImpl's RPCs on snapshots and speculation: Snapshot, Restore, MergeSnapshots,
// SplitSnapshot, DropSnapshot, ListSnapshots, CommitSpeculation.
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"
#include "service/cache_service.h"
#include "service/common/convert.h"
#include "service/list_pages.h"

namespace kvmesh {
namespace {

// INVALID_ARGUMENT naming `field` when `value` is negative: the engine's ids and offsets are
// never negative.
absl::Status CheckNotNegative(absl::string_view field, int64_t value) {
  if (value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, " = ", value, " is negative"));
  }
  return absl::OkStatus();
}

}  // namespace

// ---- snapshots and speculation --------------------------------------------------------------

void CacheServiceImpl::HandleSnapshot(UnaryCall* call, const v1::SnapshotRequest* request,
                                      v1::SnapshotResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(call, request, [request, response](Cache& cache) -> absl::Status {
    RETURN_IF_ERROR(CheckNotNegative("seq", request->seq()));
    RETURN_IF_ERROR(CheckNotNegative("from_offset", request->from_offset()));
    ASSIGN_OR_RETURN(const SnapshotInfo info,
                     cache.Snapshot(request->seq(), request->from_offset()));
    *response->mutable_snapshot() = SnapshotInfoToProto(info);
    return absl::OkStatus();
  });
}

void CacheServiceImpl::HandleRestore(UnaryCall* call, const v1::RestoreRequest* request,
                                     v1::RestoreResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request, [this, request](Cache& cache, const Principal& caller) -> absl::Status {
        RETURN_IF_ERROR(CheckNotNegative("seq", request->seq()));
        RETURN_IF_ERROR(CheckNotNegative("target", request->target()));
        const std::optional<uint64_t> snapshot_id =
            request->has_snapshot_id() ? std::optional<uint64_t>(request->snapshot_id())
                                       : std::nullopt;
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSequence(Reservations::Key(caller.tenant, request->cache()),
                                       request->seq(), "Restore"));
        const int64_t seq[] = {request->seq()};
        ASSIGN_OR_RETURN(const DrainGate::Ticket admitted, AdmitSequences(cache, seq, "Restore"));
        return cache.Restore(request->seq(), snapshot_id, request->target());
      });
}

void CacheServiceImpl::HandleMergeSnapshots(UnaryCall* call,
                                            const v1::MergeSnapshotsRequest* request,
                                            v1::MergeSnapshotsResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request,
      [this, request, response](Cache& cache, const Principal& caller) -> absl::Status {
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSnapshots(Reservations::Key(caller.tenant, request->cache()),
                                        {request->parent(), request->child()}, "MergeSnapshots"));
        ASSIGN_OR_RETURN(const SnapshotInfo merged,
                         cache.MergeSnapshots(request->parent(), request->child()));
        *response->mutable_snapshot() = SnapshotInfoToProto(merged);
        return absl::OkStatus();
      });
}

void CacheServiceImpl::HandleSplitSnapshot(UnaryCall* call, const v1::SplitSnapshotRequest* request,
                                           v1::SplitSnapshotResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request,
      [this, request, response](Cache& cache, const Principal& caller) -> absl::Status {
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSnapshots(Reservations::Key(caller.tenant, request->cache()),
                                        {request->snapshot_id()}, "SplitSnapshot"));
        ASSIGN_OR_RETURN(const SplitResult split,
                         cache.SplitSnapshot(request->snapshot_id(), request->at()));
        if (split.parent.has_value())
          *response->mutable_parent() = SnapshotInfoToProto(*split.parent);
        if (split.child.has_value()) *response->mutable_child() = SnapshotInfoToProto(*split.child);
        return absl::OkStatus();
      });
}

void CacheServiceImpl::HandleDropSnapshot(UnaryCall* call, const v1::DropSnapshotRequest* request,
                                          v1::DropSnapshotResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request, [this, request](Cache& cache, const Principal& caller) -> absl::Status {
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSnapshots(Reservations::Key(caller.tenant, request->cache()),
                                        {request->snapshot_id()}, "DropSnapshot"));
        return cache.DropSnapshot(request->snapshot_id());
      });
}

void CacheServiceImpl::HandleListSnapshots(UnaryCall* call, const v1::ListSnapshotsRequest* request,
                                           v1::ListSnapshotsResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(call, request, [request, response](Cache& cache) -> absl::Status {
    return ListSnapshotsPage(cache, *request, response);
  });
}

void CacheServiceImpl::HandleCommitSpeculation(UnaryCall* call,
                                               const v1::CommitSpeculationRequest* request,
                                               v1::CommitSpeculationResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request,
      [this, request, response](Cache& cache, const Principal& caller) -> absl::Status {
        RETURN_IF_ERROR(CheckNotNegative("seq", request->seq()));
        RETURN_IF_ERROR(CheckNotNegative("accepted", request->accepted()));
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSequence(Reservations::Key(caller.tenant, request->cache()),
                                       request->seq(), "CommitSpeculation"));
        RETURN_IF_ERROR(cache.CommitSpeculation(request->seq(), request->accepted()));
        // The sequence's offset afterwards; a commit of 0 tokens may leave it storing nothing.
        int32_t offset = 0;
        for (const SequenceInfo& info : cache.ListSequences()) {
          if (info.seq == request->seq()) {
            offset = info.offset;
            break;
          }
        }
        response->set_offset(offset);
        return absl::OkStatus();
      });
}

}  // namespace kvmesh
