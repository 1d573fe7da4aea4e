// TLS for kvmesh: gRPC credentials built from PEM files, for the node (its client port, its
// peer port, its channels to other members) and for clients (kvmeshctl, tests); the names a
// verified peer's certificate carries; and whether a listen address is loopback (plaintext is
// only quiet there).
//
// Everything cryptographic is gRPC's (TlsServerCredentials, TlsChannelCredentials,
// SslCredentials over OpenSSL); kvmesh only compares names, and only subject alternative names
// (never a common name). The node's files are read by gRPC's FileWatcherCertificateProvider,
// which re-reads them every refresh interval, so a rotated certificate (cert-manager, a
// Kubernetes Secret update) is used by new connections without a restart. OpenSSL is called
// directly only to check the files at start-up, so that a bad flag fails there with a message
// naming the flag and the file instead of as handshake failures later.
//
// Thread safety: the functions are stateless and NodeTls immutable, all safe from any thread; the
// credentials they return are gRPC's and may be shared by any number of servers and channels.
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
#include "grpcpp/security/tls_certificate_provider.h"
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
// --peer-ca does not verify as a TLS server and client certificate (other members could not
// accept it).
absl::Status ValidateNodeTls(const NodeTlsOptions& options);

// A node's credentials: one set of certificate files, watched by gRPC and reloaded every
// reload_interval_s, behind the client port, the peer port and the channels to other members.
// With TLS off every credential is insecure.
//
// Thread safety: immutable after Create; safe from any thread. It must outlive nothing: the
// credentials it returns keep what they need alive.
class NodeTls {
 public:
  // ValidateNodeTls, then the file watchers. The errors of ValidateNodeTls.
  static absl::StatusOr<std::unique_ptr<NodeTls>> Create(const NodeTlsOptions& options);

  NodeTls(const NodeTls&) = delete;
  NodeTls& operator=(const NodeTls&) = delete;

  bool enabled() const { return options_.enabled(); }
  const NodeTlsOptions& options() const { return options_; }

  // The client port (--listen): the node's certificate; with --tls-client-ca every client must
  // present a certificate that CA signed (REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY),
  // without it none is asked for.
  std::shared_ptr<grpc::ServerCredentials> ClientPortServerCredentials() const;

  // The peer port (--peer-listen): always mTLS, every caller must present a certificate that
  // --peer-ca verifies. Which subject alternative names are members is PeerService's check
  // (VerifiedPeerCertificate).
  std::shared_ptr<grpc::ServerCredentials> PeerPortServerCredentials() const;

  // A channel to the member `member_name` (empty when not known): the node presents its own
  // certificate and accepts the member's when --peer-ca verifies it and one of its subject
  // alternative names names the host dialled or `member_name`: a DNS or IP name (a DNS name may
  // be a "*.domain" wildcard for one label), or the URI MemberUri(member_name). Its common name
  // is never consulted; a certificate without subject alternative names is refused.
  std::shared_ptr<grpc::ChannelCredentials> PeerChannelCredentials(
      const std::string& member_name) const;

 private:
  explicit NodeTls(const NodeTlsOptions& options);

  const NodeTlsOptions options_;
  // Key and certificate with --tls-client-ca (client port) and with --peer-ca (peer plane);
  // null with TLS off.
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> client_port_files_;
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> peer_files_;
};

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
// gRPC's SslCredentials, whose own host name check verifies the node's certificate (unlike the
// member checks above, gRPC's check still takes a common name equal to the host when the
// certificate has no subject alternative name at all: give node certificates DNS names). The
// files are read once, now. INVALID_ARGUMENT naming the flag (spelt `flag_prefix` + "ca",
// "cert", "key", e.g. "--tls-") and the file when a file cannot be read, is not PEM, or a
// certificate comes without its key (or the other way round).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientChannelCredentials(
    const ClientTlsOptions& options, absl::string_view flag_prefix = "--tls-");

// Adds to `args` what `options` needs of the channel: the server-name override
// (GRPC_SSL_TARGET_NAME_OVERRIDE_ARG) when one is set. Nothing otherwise.
void AddClientTlsChannelArgs(const ClientTlsOptions& options, grpc::ChannelArguments* args);

// The URI subject alternative name that names member `member_name` (its node name):
// "kvmesh://member/<member_name>", compared byte for byte.
std::string MemberUri(absl::string_view member_name);

// What a verified peer certificate says about who it is. Identities come from its subject
// alternative names only (DNS, IP and URI names); the subject common name is kept for messages
// and is never an identity, even in a certificate without subject alternative names.
struct PeerCertificate {
  bool verified = false;  // false: plaintext, or TLS without a client certificate
  std::vector<std::string> dns_names;
  std::vector<std::string> ip_names;
  std::vector<std::string> uri_names;
  std::string common_name;  // for messages only

  bool has_names() const { return !dns_names.empty() || !ip_names.empty() || !uri_names.empty(); }
};
PeerCertificate VerifiedPeerCertificate(const grpc::AuthContext& context);

// The subject alternative names of a verified peer certificate: its DNS, IP and URI names, each
// once, in that order (never its common name). Empty when the peer is not authenticated.
std::vector<std::string> PeerCertificateNames(const grpc::AuthContext& context);

// Whether a certificate with these subject alternative names names `host`, a DNS name or an IP
// address: an IP name equal to it, or a DNS name equal to it ignoring case or a "*.domain"
// wildcard matching its first label. A certificate's common name is never consulted (RFC 9525,
// which replaced RFC 6125, drops the common name as an identity).
bool CertificateNamesHost(const std::vector<std::string>& dns_names,
                          const std::vector<std::string>& ip_names, absl::string_view host);

// Whether `address` (a --listen value: "host:port", "[v6]:port", a bare host, or a "unix:"
// path) only accepts connections from this machine: 127.0.0.0/8, ::1 (and ::ffff:127.x),
// "localhost", and Unix sockets. Empty hosts and wildcard addresses are not loopback.
bool IsLoopbackListenAddress(absl::string_view address);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_TLS_H_
