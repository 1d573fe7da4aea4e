// HealthClient: a client of grpc.health.v1.Health/Check, which kvmesh-node serves through gRPC's
// built-in health service. Debian's gRPC ships no generated code for health.proto, so the two
// one-field messages are encoded by hand and sent as raw bytes over a registered method, the
// same blocking path a generated stub uses (so latency figures compare fairly with those of
// generated stubs).
//
// Thread safety: thread-safe; Check may be called concurrently, like a generated stub.
#ifndef KVMESH_SERVICE_CTL_HEALTH_H_
#define KVMESH_SERVICE_CTL_HEALTH_H_

#include <memory>
#include <string>

#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/impl/codegen/rpc_method.h"
#include "grpcpp/support/status.h"

namespace kvmesh {
namespace ctl {

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

 private:
  std::shared_ptr<grpc::Channel> channel_;
  const grpc::internal::RpcMethod check_method_;
};

}  // namespace ctl
}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CTL_HEALTH_H_
