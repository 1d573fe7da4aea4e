// How kvmeshctl connects to a node, from its global flags: TLS (--tls-ca, --tls-cert,
// --tls-key, --tls-server-name), the bearer token (--token-file, else $KVMESH_TOKEN) and the
// tenant an admin acts for (--tenant). The result feeds NewClientChannel
// (service/common/client_channel.h), which sends the token and tenant on every call.
//
// Thread safety: stateless functions, safe from any thread.
#ifndef KVMESH_SERVICE_CTL_CONNECTION_H_
#define KVMESH_SERVICE_CTL_CONNECTION_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "service/common/client_channel.h"
#include "service/ctl/args.h"

namespace kvmesh {
namespace ctl {

// The environment variable kvmeshctl reads a bearer token from when --token-file is not given.
inline constexpr char kTokenEnv[] = "KVMESH_TOKEN";

// The global flags of the connection, to add to those a command allows.
inline constexpr absl::string_view kConnectionFlags[] = {"tls-ca",          "tls-cert",   "tls-key",
                                                         "tls-server-name", "token-file", "tenant"};

// The bearer token held by the file at `path`: its content without the whitespace around it.
// INVALID_ARGUMENT naming --token-file and the path when it cannot be read, is empty, or holds
// more than one word (e.g. the node's token file, which holds hashes, not tokens); the message
// never contains the file's content.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// The connection `args` ask for. `env_token`: the value of $KVMESH_TOKEN (null or empty: unset),
// used when --token-file is absent. INVALID_ARGUMENT naming the flag (or KVMESH_TOKEN) for a
// flag given empty, a token file as ReadTokenFile says, or a token or tenant that cannot be sent
// as gRPC metadata. The TLS files are read later, by ClientCredentials.
absl::StatusOr<ClientConnectionOptions> ConnectionFromArgs(const Args& args, const char* env_token);

}  // namespace ctl
}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CTL_CONNECTION_H_
