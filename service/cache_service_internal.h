// Helpers shared by the files of CacheServiceImpl (cache_service.cc, cache_service_append.cc,
// cache_service_read.cc, cache_service_snapshots.cc). Private to those files: include it nowhere
// else.
#ifndef KVMESH_SERVICE_CACHE_SERVICE_INTERNAL_H_
#define KVMESH_SERVICE_CACHE_SERVICE_INTERNAL_H_

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"
#include "service/common/convert.h"
#include "service/request_gate.h"

namespace kvmesh {
namespace cache_service_internal {

// INVALID_ARGUMENT with `message`.
inline grpc::Status InvalidArgument(std::string message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::move(message));
}

// Heap bytes a parsed request holds for `n` elements of a repeated message field (one allocated
// message each, with malloc's header, and a pointer to it), plus the engine's copy of `n`
// `Engine` values: a request of many small tokens or queries parses to several times its size
// on the wire, so the in-flight budget counts this, not the wire size.
template <typename Proto, typename Engine>
uint64_t ParsedBytes(int64_t n) {
  return static_cast<uint64_t>(n) * (sizeof(Proto) + 16 + sizeof(void*) + sizeof(Engine));
}

// Answers a unary call at once with `status`, for a request refused before any work.
inline void FinishNow(UnaryCall* call, const absl::Status& status) {
  call->Answer(ToGrpcStatus(status));
}

// What a call cancelled by its client is answered (CancelledStatus, and RunOn's refusal).
inline constexpr char kCancelledMessage[] = "call cancelled by the client";

inline const grpc::Status& CancelledStatus() {
  static const grpc::Status* const status =
      new grpc::Status(grpc::StatusCode::CANCELLED, kCancelledMessage);
  return *status;
}

}  // namespace cache_service_internal
}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CACHE_SERVICE_INTERNAL_H_
