#include "service/peer_service.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "service/common/convert.h"

namespace kvmesh {

absl::Time ContextDeadline(const grpc::CallbackServerContext& context) {
  const std::chrono::system_clock::time_point deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

PeerServiceImpl::PeerServiceImpl(Cluster* cluster, LeaseTable* leases, Executor* engine_executor,
                                 Executor* cluster_executor, Options options)
    : cluster_(cluster),
      leases_(leases),
      engine_executor_(engine_executor),
      cluster_executor_(cluster_executor),
      options_(std::move(options)) {}

grpc::ServerUnaryReactor* PeerServiceImpl::RunOn(Executor* executor,
                                                 grpc::CallbackServerContext* context,
                                                 absl::AnyInvocable<absl::Status() &&> fn) {
  auto busy = [this, executor] {
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat("kvmesh-node ", options_.name, " is overloaded: its executor queue holds ",
                     executor->max_queued(), " tasks already; retry later"));
  };
  return RunUnaryOn(executor, context, std::move(fn), "call cancelled by the peer", busy);
}

grpc::ServerUnaryReactor* PeerServiceImpl::NodeInfo(grpc::CallbackServerContext* context,
                                                    const v1::NodeInfoRequest* request,
                                                    v1::NodeInfoResponse* response) {
  response->set_name(options_.name);
  response->set_backend(options_.backend);
  for (const std::string& t : options_.transports) response->add_transports(t);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* PeerServiceImpl::Export(grpc::CallbackServerContext* context,
                                                  const v1::ExportRequest* request,
                                                  v1::ExportResponse* response) {
  return RunOn(engine_executor_, context, [this, request, response]() -> absl::Status {
    absl::StatusOr<v1::ExportResponse> exported = cluster_->Export(*request);
    if (!exported.ok()) return exported.status();
    *response = *std::move(exported);
    return absl::OkStatus();
  });
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* PeerServiceImpl::Fetch(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return transport::ServeFetch(context, request, leases_, options_.sender);
}

grpc::ServerUnaryReactor* PeerServiceImpl::Release(grpc::CallbackServerContext* context,
                                                   const v1::ReleaseRequest* request,
                                                   v1::ReleaseResponse* response) {
  // Ending a lease frees host memory only (the export reader's pinned data): cheap enough for
  // gRPC's thread.
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(cluster_->Release(*request)));
  return reactor;
}

grpc::ServerUnaryReactor* PeerServiceImpl::Pull(grpc::CallbackServerContext* context,
                                                const v1::PullRequest* request,
                                                v1::PullResponse* response) {
  return RunOn(cluster_executor_, context, [this, context, request, response]() -> absl::Status {
    absl::StatusOr<v1::PullResponse> pulled =
        cluster_->Pull(*request, cluster_->Deadline(ContextDeadline(*context)));
    if (!pulled.ok()) return pulled.status();
    *response = *std::move(pulled);
    return absl::OkStatus();
  });
}

namespace {

// The interrupt of an nccl hook that serves `context`: the receiver's cancellation (or the
// call's deadline) stops the wait on the communicator instead of leaving it to the deadline.
PeerServiceImpl::Interrupt CancelledBy(grpc::CallbackServerContext* context, const char* rpc) {
  return [context, rpc]() -> absl::Status {
    if (!context->IsCancelled()) return absl::OkStatus();
    return absl::CancelledError(
        absl::StrCat(rpc, ": the receiver cancelled the call or its deadline passed"));
  };
}

}  // namespace

grpc::ServerUnaryReactor* PeerServiceImpl::NoNccl(grpc::CallbackServerContext* context) const {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(
      grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                   absl::StrCat("node '", options_.name, "' has no nccl transport (backend ",
                                options_.backend, ")")));
  return reactor;
}

grpc::ServerUnaryReactor* PeerServiceImpl::NcclConnect(grpc::CallbackServerContext* context,
                                                       const v1::NcclConnectRequest* request,
                                                       v1::NcclConnectResponse* response) {
  if (!options_.nccl.connect) {
    return NoNccl(context);
  }
  return RunOn(cluster_executor_, context, [this, context, request]() {
    return options_.nccl.connect(*request, cluster_->Deadline(ContextDeadline(*context)),
                                 CancelledBy(context, "NcclConnect"));
  });
}

grpc::ServerUnaryReactor* PeerServiceImpl::NcclSend(grpc::CallbackServerContext* context,
                                                    const v1::NcclSendRequest* request,
                                                    v1::NcclSendResponse* response) {
  if (!options_.nccl.send) {
    return NoNccl(context);
  }
  return RunOn(cluster_executor_, context, [this, context, request]() {
    return options_.nccl.send(*request, cluster_->Deadline(ContextDeadline(*context)),
                              CancelledBy(context, "NcclSend"));
  });
}

}  // namespace kvmesh
