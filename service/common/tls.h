// TLS for kvmesh: gRPC credentials built from PEM files, for the node (its client port, its
// peer port, its channels to other members) and for clients (kvmeshctl, tests); the names a
// verified peer's certificate carries; and whether a listen address is loopback (plaintext is
// only quiet there).
//
// Everything cryptographic is gRPC's (TlsServerCredentials, TlsChannelCredentials,
// SslCredentials over OpenSSL); the node's files are read by gRPC's
// FileWatcherCertificateProvider, which re-reads them every refresh interval, so a rotated
// certificate (cert-manager, a Kubernetes Secret update) is used by new connections without a
// restart. OpenSSL is called directly only to check the files at start-up, so that a bad flag
// fails there with a message naming the flag and the file instead of as handshake failures later.
//
// Thread safety: the functions are stateless and safe from any thread; the credentials they
// return are gRPC's and may be shared by any number of servers and channels.
#ifndef KVMESH_SERVICE_COMMON_TLS_H_
#define KVMESH_SERVICE_COMMON_TLS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvmesh {

// How often a node re-reads its certificate files when no interval is given.
inline constexpr unsigned kDefaultTlsReloadIntervalSeconds = 60;

// A node's TLS files, as its flags give them. TLS is on when `cert_file` is set.
struct NodeTlsOptions {
  std::string cert_file;       // --tls-cert: PEM certificate (chain), leaf first.
  std::string key_file;        // --tls-key: PEM private key of the leaf.
  std::string client_ca_file;  // --tls-client-ca: when set, clients must present a cert it signed.
  std::string peer_ca_file;    // --peer-ca: the CA bundle of the peer plane (mTLS both ways).
  unsigned reload_interval_s = kDefaultTlsReloadIntervalSeconds;

  bool enabled() const { return !cert_file.empty(); }
};

// Checks a node's TLS flags and files before anything listens. OK with TLS off (no file flag
// set). INVALID_ARGUMENT naming the flag: a key without a certificate or the other way round,
// --tls-client-ca or --peer-ca without --tls-cert, TLS on without --peer-ca, a reload interval
// of 0; naming the flag and the file: a file that cannot be read, holds no PEM certificate (or
// key), a key that does not belong to the certificate, a certificate that has expired or that
// --peer-ca does not verify (other members could not accept it).
absl::Status ValidateNodeTls(const NodeTlsOptions& options);

// Server credentials for the client port (--listen). TLS off: insecure. TLS on: the node's
// certificate, reloaded; with --tls-client-ca every client must present a certificate that CA
// signed (REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY), without it none is asked for.
// REQUIRES: ValidateNodeTls(options) is OK.
std::shared_ptr<grpc::ServerCredentials> ClientPortServerCredentials(const NodeTlsOptions& options);

// Server credentials for the peer port (--peer-listen). TLS off: insecure. TLS on: always mTLS,
// every caller must present a certificate that --peer-ca verifies; which certificate names are
// members is PeerService's check (PeerCertificateNames).
// REQUIRES: ValidateNodeTls(options) is OK.
std::shared_ptr<grpc::ServerCredentials> PeerPortServerCredentials(const NodeTlsOptions& options);

// Channel credentials for this node's channels to other members. TLS off: insecure. TLS on: the
// node presents its own certificate and verifies the member's against --peer-ca, including that
// it names the host of the address dialled (gRPC's host name check); both reloaded.
// REQUIRES: ValidateNodeTls(options) is OK.
std::shared_ptr<grpc::ChannelCredentials> PeerChannelCredentials(const NodeTlsOptions& options);

// A client's TLS settings (kvmeshctl --tls-*, the tests). TLS is on when any is set.
struct ClientTlsOptions {
  std::string ca_file;      // CA bundle that verifies the node; empty: gRPC's default roots.
  std::string cert_file;    // client certificate, for a node with --tls-client-ca ...
  std::string key_file;     // ... and its key; both or neither.
  std::string server_name;  // name checked in the node's certificate instead of the target host.

  bool enabled() const {
    return !ca_file.empty() || !cert_file.empty() || !key_file.empty() || !server_name.empty();
  }
};

// Channel credentials for a client: insecure when `options` is not enabled(), else TLS with
// gRPC's SslCredentials. The files are read once, now. INVALID_ARGUMENT naming the flag (spelt
// `flag_prefix` + "ca", "cert", "key", e.g. "--tls-") and the file when a file cannot be read,
// is not PEM, or a certificate comes without its key (or the other way round).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientChannelCredentials(
    const ClientTlsOptions& options, absl::string_view flag_prefix = "--tls-");

// Adds to `args` what `options` needs of the channel: the server-name override
// (GRPC_SSL_TARGET_NAME_OVERRIDE_ARG) when one is set. Nothing otherwise.
void AddClientTlsChannelArgs(const ClientTlsOptions& options, grpc::ChannelArguments* args);

// The names a verified peer certificate carries: its DNS and IP subject alternative names and
// its subject common name, each once, in that order. Empty when the peer is not authenticated
// (plaintext, or TLS without a client certificate).
std::vector<std::string> PeerCertificateNames(const grpc::AuthContext& context);

// Whether `address` (a --listen value: "host:port", "[v6]:port", a bare host, or a "unix:"
// path) only accepts connections from this machine: 127.0.0.0/8, ::1 (and ::ffff:127.x),
// "localhost", and Unix sockets. Empty hosts and wildcard addresses are not loopback.
bool IsLoopbackListenAddress(absl::string_view address);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_TLS_H_
