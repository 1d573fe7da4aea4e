// RpcObserver: a gRPC server interceptor that measures and logs every RPC the node serves.
//
// Per call it counts kvmesh_rpc_handled_total{service,method,code}, times
// kvmesh_rpc_handling_seconds and holds kvmesh_rpc_in_flight (service/common/metrics.h), and logs
// one line (service/common/log.h): at debug for a success, at warning for every error status,
// with the method, the code and message, the elapsed time, the caller's address, and what the
// request names: cache, sequence (seq, src_seq, dst_seq), snapshot, peer node.
//
// Labels stay bounded: a method of a service the node does not serve is labelled "other".
#ifndef KVMESH_SERVICE_RPC_OBSERVER_H_
#define KVMESH_SERVICE_RPC_OBSERVER_H_

#include <memory>
#include <vector>

#include "grpcpp/support/server_interceptor.h"
#include "service/common/metrics.h"

namespace kvmesh {

class RpcObserverFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `metrics` may be null (logs only); it must outlive the servers.
  explicit RpcObserverFactory(Metrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  Metrics* const metrics_;
};

// A factory list for grpc::ServerBuilder::experimental().SetInterceptorCreators.
std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
RpcObserverCreators(Metrics* metrics);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_RPC_OBSERVER_H_
