// How a client of kvmesh connects: TLS settings (tls.h), a bearer token sent as
// "authorization: Bearer <token>" and, for an admin acting for a tenant, "kvmesh-tenant:
// <tenant>" on every call. kvmeshctl, the benchmarks and the test helpers build their channels
// here, so all of them speak to a secured node the same way.
//
// The token and tenant are added to the initial metadata of every call by a client interceptor
// of the channel, so every call on every stub of the channel (generated or generic, such as the
// health client's) carries them without each call site adding metadata. An interceptor rather
// than gRPC call credentials because they are sent over plaintext too (a loopback development
// node with a token file), where gRPC refuses call credentials: the node, not the client,
// decides what it accepts.
//
// Thread safety: stateless functions, safe from any thread; the credentials and channels are
// gRPC's and thread-safe.
#ifndef KVMESH_SERVICE_COMMON_CLIENT_CHANNEL_H_
#define KVMESH_SERVICE_COMMON_CLIENT_CHANNEL_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "service/common/tls.h"

namespace kvmesh {

// The metadata keys a client sends (gRPC keys are lower case).
inline constexpr char kAuthorizationMetadataKey[] = "authorization";
inline constexpr char kTenantMetadataKey[] = "kvmesh-tenant";

struct ClientConnectionOptions {
  ClientTlsOptions tls;
  std::string token;   // bearer token; empty: none is sent
  std::string tenant;  // kvmesh-tenant; empty: none is sent
};

// INVALID_ARGUMENT naming `what` ("--token-file 'path'", "KVMESH_TOKEN") when `token` cannot be
// a bearer token: empty, or a character outside printable ASCII or a space (gRPC metadata
// values are printable ASCII; a space would end the token). The message never contains the
// token itself.
absl::Status ValidateBearerToken(absl::string_view token, absl::string_view what);

// INVALID_ARGUMENT naming the value when `tenant` is empty or not printable ASCII without spaces
// (the node checks the tenant name rules; this only keeps the metadata well formed).
absl::Status ValidateTenantMetadata(absl::string_view tenant);

// What a client needs to open channels as `options` says, made once: the TLS credentials (the
// files are read by Create) and the metadata of every call. Copyable; thread-safe.
class ClientConnector {
 public:
  // The errors of ClientChannelCredentials (flag names spelt with `flag_prefix`),
  // ValidateBearerToken (what: "the bearer token") and ValidateTenantMetadata.
  static absl::StatusOr<ClientConnector> Create(const ClientConnectionOptions& options,
                                                absl::string_view flag_prefix = "--tls-");

  // A channel to `target` with `args`, to which the TLS channel arguments are added.
  std::shared_ptr<grpc::Channel> NewChannel(const std::string& target,
                                            grpc::ChannelArguments args = {}) const;

  const ClientConnectionOptions& options() const { return options_; }

 private:
  ClientConnector(ClientConnectionOptions options,
                  std::shared_ptr<grpc::ChannelCredentials> credentials)
      : options_(std::move(options)), credentials_(std::move(credentials)) {}

  ClientConnectionOptions options_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
};

// ClientConnector::Create(options, flag_prefix), then NewChannel(target, args).
absl::StatusOr<std::shared_ptr<grpc::Channel>> NewClientChannel(
    const std::string& target, const ClientConnectionOptions& options,
    grpc::ChannelArguments args = grpc::ChannelArguments(),
    absl::string_view flag_prefix = "--tls-");

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_CLIENT_CHANNEL_H_
