// HealthClient: a client of grpc.health.v1.Health/Check, which kvmesh-node serves through gRPC's
// built-in health service. kvmeshctl, the RPC benchmark and cluster membership (which checks
// every peer) use it. Debian's gRPC ships no generated code for health.proto, so the two
// one-field messages are encoded by hand and sent as raw bytes over a registered method, the
// same paths a generated stub uses: blocking (so latency figures compare fairly with those of
// generated stubs) and callback.
//
// Thread safety: thread-safe; Check and CheckAsync may be called concurrently, like a generated
// stub.
#ifndef KVMESH_SERVICE_COMMON_HEALTH_CLIENT_H_
#define KVMESH_SERVICE_COMMON_HEALTH_CLIENT_H_

#include <functional>
#include <memory>
#include <string>

#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/impl/codegen/rpc_method.h"
#include "grpcpp/support/status.h"

namespace kvmesh {

// grpc.health.v1.HealthCheckResponse.ServingStatus.
enum class ServingStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };

// "SERVING", "NOT_SERVING", ...: the enum's name in health.proto (and in its JSON form).
const char* ServingStatusName(ServingStatus status);

class HealthClient {
 public:
  explicit HealthClient(std::shared_ptr<grpc::Channel> channel);

  // Asks for the status of `service` ("" is the whole server). On a non-OK RPC status `*status`
  // is unchanged. A response that does not parse is INTERNAL.
  grpc::Status Check(grpc::ClientContext* context, const std::string& service,
                     ServingStatus* status) const;

  // The same without blocking: `done` runs once, on a gRPC thread (it must not block), with the
  // RPC status and, when that is OK, the serving status (kUnknown otherwise).
  // REQUIRES: `context` outlives the call (until `done` has run); this client need not.
  void CheckAsync(grpc::ClientContext* context, const std::string& service,
                  std::function<void(grpc::Status, ServingStatus)> done) const;

 private:
  std::shared_ptr<grpc::Channel> channel_;
  const grpc::internal::RpcMethod check_method_;
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_HEALTH_CLIENT_H_
