// How a client of kvmesh connects: TLS settings (tls.h), a bearer token sent as
// "authorization: Bearer <token>" and, for an admin acting for a tenant, "kvmesh-tenant:
// <tenant>" on every call. kvmeshctl, the benchmarks and the test helpers build their channels
// here, so all of them speak to a secured node the same way.
//
// The token and tenant travel as gRPC call credentials attached to the channel credentials, so
// every call on every stub of the channel carries them without each call site adding metadata.
// They are allowed over plaintext too (a loopback development node with a token file): the node,
// not the client, decides what it accepts.
//
// Thread safety: stateless functions, safe from any thread; the credentials and channels are
// gRPC's and thread-safe.
#ifndef KVMESH_SERVICE_COMMON_CLIENT_CHANNEL_H_
#define KVMESH_SERVICE_COMMON_CLIENT_CHANNEL_H_

#include <memory>
#include <string>

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

// Call credentials that add the bearer token (if not empty) and the tenant (if not empty) to
// every call. Null when both are empty.
std::shared_ptr<grpc::CallCredentials> TokenCallCredentials(const std::string& token,
                                                            const std::string& tenant);

// Channel credentials for `options`: ClientChannelCredentials(options.tls, flag_prefix) with
// TokenCallCredentials attached when a token or tenant is set. The errors of
// ClientChannelCredentials, ValidateBearerToken (what: "the bearer token") and
// ValidateTenantMetadata.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientCredentials(
    const ClientConnectionOptions& options, absl::string_view flag_prefix = "--tls-");

// A channel to `target` with ClientCredentials(options) and `args` (to which the TLS channel
// arguments are added). The errors of ClientCredentials.
absl::StatusOr<std::shared_ptr<grpc::Channel>> NewClientChannel(
    const std::string& target, const ClientConnectionOptions& options,
    grpc::ChannelArguments args = grpc::ChannelArguments(),
    absl::string_view flag_prefix = "--tls-");

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_CLIENT_CHANNEL_H_
