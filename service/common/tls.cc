#include "service/common/tls.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "cache/status_macros.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace kvmesh {
namespace {

// --- OpenSSL owners (only for the start-up checks; gRPC does the TLS itself) -------------------

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
struct StackFree {
  void operator()(STACK_OF(X509) * s) const { sk_X509_free(s); }
};
using UniqueBio = std::unique_ptr<BIO, BioFree>;
using UniqueX509 = std::unique_ptr<X509, X509Free>;
using UniquePkey = std::unique_ptr<EVP_PKEY, PkeyFree>;

// A flag and the file it names, for messages: "--tls-cert '/etc/kvmesh/tls.crt'".
std::string Where(absl::string_view flag, absl::string_view path) {
  return absl::StrCat(flag, " '", path, "'");
}

// OpenSSL's queued errors as one string (and the queue cleared), for a message's tail.
std::string OpenSslErrors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out;
}

absl::StatusOr<std::string> ReadWholeFile(absl::string_view flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read '", path, "': ", std::strerror(errno)));
  }
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  }
  return data;
}

UniqueBio MemoryBio(const std::string& pem) {
  return UniqueBio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// Every certificate in a PEM file, in order; INVALID_ARGUMENT when there is none or one does
// not parse.
absl::StatusOr<std::vector<UniqueX509>> ParseCertificates(absl::string_view flag,
                                                          const std::string& path,
                                                          const std::string& pem) {
  ERR_clear_error();
  UniqueBio bio = MemoryBio(pem);
  std::vector<UniqueX509> certs;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    certs.emplace_back(x);
  }
  // The loop ends at the end of the data (PEM_R_NO_START_LINE) or at a block that does not parse.
  const unsigned long last = ERR_peek_last_error();
  const bool clean_end =
      ERR_GET_LIB(last) == ERR_LIB_PEM && ERR_GET_REASON(last) == PEM_R_NO_START_LINE;
  if (last != 0 && !clean_end) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(flag, path), " holds a PEM certificate that does not parse: ", OpenSslErrors()));
  }
  ERR_clear_error();
  if (certs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(flag, path), " holds no PEM certificate (\"-----BEGIN CERTIFICATE-----\")"));
  }
  return certs;
}

// A passphrase callback that refuses: kvmesh never prompts (an encrypted key is an error).
int NoPassphrase(char* /*buf*/, int /*size*/, int /*rwflag*/, void* /*u*/) { return -1; }

absl::StatusOr<UniquePkey> ParsePrivateKey(absl::string_view flag, const std::string& path,
                                           const std::string& pem) {
  ERR_clear_error();
  UniqueBio bio = MemoryBio(pem);
  UniquePkey key(PEM_read_bio_PrivateKey(bio.get(), nullptr, &NoPassphrase, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(flag, path),
        " holds no unencrypted PEM private key (\"-----BEGIN PRIVATE KEY-----\" or an RSA/EC "
        "key): ",
        OpenSslErrors()));
  }
  return key;
}

std::string Asn1TimeText(const ASN1_TIME* t) {
  UniqueBio bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || ASN1_TIME_print(bio.get(), t) != 1) return "?";
  char* data = nullptr;
  long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

// The leaf certificate of a cert/key pair, checked: both parse, the key is the certificate's,
// the certificate has not expired. The whole chain comes back (leaf first).
absl::StatusOr<std::vector<UniqueX509>> CheckKeyPair(absl::string_view cert_flag,
                                                     const std::string& cert_path,
                                                     absl::string_view key_flag,
                                                     const std::string& key_path) {
  ASSIGN_OR_RETURN(std::string cert_pem, ReadWholeFile(cert_flag, cert_path));
  ASSIGN_OR_RETURN(std::string key_pem, ReadWholeFile(key_flag, key_path));
  ASSIGN_OR_RETURN(std::vector<UniqueX509> chain,
                   ParseCertificates(cert_flag, cert_path, cert_pem));
  ASSIGN_OR_RETURN(UniquePkey key, ParsePrivateKey(key_flag, key_path, key_pem));
  ERR_clear_error();
  if (X509_check_private_key(chain.front().get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(Where(key_flag, key_path),
                                                   " is not the private key of the certificate in ",
                                                   Where(cert_flag, cert_path)));
  }
  const ASN1_TIME* not_after = X509_get0_notAfter(chain.front().get());
  if (X509_cmp_current_time(not_after) < 0) {
    return absl::InvalidArgumentError(absl::StrCat("the certificate in ",
                                                   Where(cert_flag, cert_path), " expired on ",
                                                   Asn1TimeText(not_after)));
  }
  return chain;
}

// Checks that the CA bundle in `ca_flag` verifies `chain` (leaf first, intermediates after) for
// use as a TLS certificate of `purpose` (X509_PURPOSE_SSL_SERVER or _SSL_CLIENT), as a member
// receiving it would.
absl::Status CheckVerifies(absl::string_view cert_flag, const std::string& cert_path,
                           const std::vector<UniqueX509>& chain, absl::string_view ca_flag,
                           const std::string& ca_path, const std::vector<UniqueX509>& cas,
                           int purpose, absl::string_view role) {
  std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  std::unique_ptr<X509_STORE_CTX, StoreCtxFree> ctx(X509_STORE_CTX_new());
  std::unique_ptr<STACK_OF(X509), StackFree> untrusted(sk_X509_new_null());
  if (store == nullptr || ctx == nullptr || untrusted == nullptr) {
    return absl::ResourceExhaustedError("out of memory checking certificates");
  }
  for (const UniqueX509& ca : cas) X509_STORE_add_cert(store.get(), ca.get());
  for (size_t i = 1; i < chain.size(); ++i) sk_X509_push(untrusted.get(), chain[i].get());
  ERR_clear_error();
  if (X509_STORE_CTX_init(ctx.get(), store.get(), chain.front().get(), untrusted.get()) != 1 ||
      X509_STORE_CTX_set_purpose(ctx.get(), purpose) != 1) {
    return absl::InternalError(
        absl::StrCat("cannot set up certificate verification: ", OpenSslErrors()));
  }
  if (X509_verify_cert(ctx.get()) != 1) {
    const int error = X509_STORE_CTX_get_error(ctx.get());
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("the certificate in ", Where(cert_flag, cert_path),
                     " does not verify against ", Where(ca_flag, ca_path), " as a ", role, ": ",
                     X509_verify_cert_error_string(error), " (other members would refuse it)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<UniqueX509>> ReadCaBundle(absl::string_view flag,
                                                     const std::string& path) {
  ASSIGN_OR_RETURN(std::string pem, ReadWholeFile(flag, path));
  return ParseCertificates(flag, path, pem);
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentialsVerifying(
    const std::shared_ptr<grpc::experimental::CertificateProviderInterface>& files,
    bool verify_clients) {
  grpc::experimental::TlsServerCredentialsOptions tls(files);
  tls.watch_identity_key_cert_pairs();
  if (verify_clients) {
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(tls);
}

// The host of a target name ("host:port", "[v6]:port", or a bare host).
absl::string_view TargetHost(absl::string_view target) {
  if (absl::ConsumePrefix(&target, "[")) return target.substr(0, target.find(']'));
  if (std::count(target.begin(), target.end(), ':') == 1) return target.substr(0, target.find(':'));
  return target;
}

std::vector<std::string> Strings(const std::vector<grpc::string_ref>& refs) {
  std::vector<std::string> out;
  out.reserve(refs.size());
  for (const grpc::string_ref& r : refs) out.emplace_back(r.data(), r.size());
  return out;
}

// Runs after gRPC verified the member's chain against --peer-ca (set_verify_server_certs), in
// place of gRPC's host name check: accepts a certificate whose subject alternative names name
// the host dialled (what the host name check does, without its common-name fallback) or the
// member's node name (a DNS name or MemberUri), so members found through --peer-dns (dialled by
// IP address) may carry certificates that name their pods.
class MemberVerifier : public grpc::experimental::ExternalCertificateVerifier {
 public:
  explicit MemberVerifier(std::string member_name) : member_name_(std::move(member_name)) {}

  bool Verify(grpc::experimental::TlsCustomVerificationCheckRequest* request,
              std::function<void(grpc::Status)> /*callback*/, grpc::Status* sync_status) override {
    const std::vector<std::string> dns = Strings(request->dns_names());
    const std::vector<std::string> ips = Strings(request->ip_names());
    const std::vector<std::string> uris = Strings(request->uri_names());
    const grpc::string_ref target_ref = request->target_name();
    const absl::string_view host =
        TargetHost(absl::string_view(target_ref.data(), target_ref.size()));
    const bool names_member =
        !member_name_.empty() &&
        (CertificateNamesHost(dns, ips, member_name_) ||
         std::find(uris.begin(), uris.end(), MemberUri(member_name_)) != uris.end());
    if (CertificateNamesHost(dns, ips, host) || names_member) {
      *sync_status = grpc::Status::OK;
    } else {
      std::string why = absl::StrCat(
          "the peer certificate's subject alternative names name neither the host dialled ('", host,
          "') nor the member '", member_name_, "'");
      if (dns.empty() && ips.empty() && uris.empty()) {
        const grpc::string_ref cn = request->common_name();
        absl::StrAppend(&why, " (it has none; its common name '",
                        absl::string_view(cn.data(), std::min<size_t>(cn.size(), 64)),
                        "' is not an identity)");
      }
      *sync_status = grpc::Status(grpc::StatusCode::UNAUTHENTICATED, why);
    }
    return true;  // answered synchronously
  }

  void Cancel(grpc::experimental::TlsCustomVerificationCheckRequest* /*request*/) override {}

 private:
  const std::string member_name_;
};

}  // namespace

absl::Status ValidateNodeTls(const NodeTlsOptions& options) {
  if (!options.key_file.empty() && options.cert_file.empty()) {
    return absl::InvalidArgumentError("--tls-key is set but --tls-cert is not: give both");
  }
  if (!options.enabled()) {
    if (!options.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca needs TLS on the client port: give --tls-cert and --tls-key too");
    }
    if (!options.peer_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--peer-ca needs TLS: give --tls-cert and --tls-key too (the peer plane presents them)");
    }
    return absl::OkStatus();
  }
  if (options.key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert is set but --tls-key is not: give both");
  }
  if (options.peer_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--peer-ca is required when TLS is on (--tls-cert): the peer plane always uses mTLS, "
        "and --peer-ca is the CA that signs every member's certificate");
  }
  if (options.reload_interval_s == 0) {
    return absl::InvalidArgumentError("the certificate reload interval must be at least 1 s");
  }
  ASSIGN_OR_RETURN(std::vector<UniqueX509> chain,
                   CheckKeyPair("--tls-cert", options.cert_file, "--tls-key", options.key_file));
  if (!options.client_ca_file.empty()) {
    RETURN_IF_ERROR(ReadCaBundle("--tls-client-ca", options.client_ca_file).status());
  }
  ASSIGN_OR_RETURN(std::vector<UniqueX509> peer_cas,
                   ReadCaBundle("--peer-ca", options.peer_ca_file));
  // This node's certificate is both the server certificate of its peer port and the client
  // certificate of its peer channels: members check it against their --peer-ca (the same CA).
  RETURN_IF_ERROR(CheckVerifies("--tls-cert", options.cert_file, chain, "--peer-ca",
                                options.peer_ca_file, peer_cas, X509_PURPOSE_SSL_SERVER,
                                "TLS server certificate"));
  RETURN_IF_ERROR(CheckVerifies("--tls-cert", options.cert_file, chain, "--peer-ca",
                                options.peer_ca_file, peer_cas, X509_PURPOSE_SSL_CLIENT,
                                "TLS client certificate"));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NodeTls>> NodeTls::Create(const NodeTlsOptions& options) {
  RETURN_IF_ERROR(ValidateNodeTls(options));
  return std::unique_ptr<NodeTls>(new NodeTls(options));
}

NodeTls::NodeTls(const NodeTlsOptions& options) : options_(options) {
  if (!options_.enabled()) return;
  client_port_files_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options_.key_file, options_.cert_file, options_.client_ca_file, options_.reload_interval_s);
  peer_files_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options_.key_file, options_.cert_file, options_.peer_ca_file, options_.reload_interval_s);
}

std::shared_ptr<grpc::ServerCredentials> NodeTls::ClientPortServerCredentials() const {
  if (!enabled()) return grpc::InsecureServerCredentials();
  return ServerCredentialsVerifying(client_port_files_, !options_.client_ca_file.empty());
}

std::shared_ptr<grpc::ServerCredentials> NodeTls::PeerPortServerCredentials() const {
  if (!enabled()) return grpc::InsecureServerCredentials();
  return ServerCredentialsVerifying(peer_files_, /*verify_clients=*/true);
}

std::shared_ptr<grpc::ChannelCredentials> NodeTls::PeerChannelCredentials(
    const std::string& member_name) const {
  if (!enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions tls;
  tls.set_certificate_provider(peer_files_);
  tls.watch_identity_key_cert_pairs();
  tls.watch_root_certs();
  tls.set_verify_server_certs(true);  // the chain, against --peer-ca
  tls.set_certificate_verifier(
      grpc::experimental::ExternalCertificateVerifier::Create<MemberVerifier>(member_name));
  // The verifier checked the names at the handshake; gRPC's per-call check would compare each
  // call's authority (the address dialled) with the certificate again and refuse a member whose
  // certificate names the member rather than its host.
  tls.set_check_call_host(false);
  return grpc::experimental::TlsCredentials(tls);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientChannelCredentials(
    const ClientTlsOptions& options, absl::string_view flag_prefix) {
  if (!options.enabled()) return grpc::InsecureChannelCredentials();
  const std::string ca_flag = absl::StrCat(flag_prefix, "ca");
  const std::string cert_flag = absl::StrCat(flag_prefix, "cert");
  const std::string key_flag = absl::StrCat(flag_prefix, "key");
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError(
        options.cert_file.empty()
            ? absl::StrCat(key_flag, " is set but ", cert_flag, " is not: give both")
            : absl::StrCat(cert_flag, " is set but ", key_flag, " is not: give both"));
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadWholeFile(ca_flag, options.ca_file));
    RETURN_IF_ERROR(ParseCertificates(ca_flag, options.ca_file, ssl.pem_root_certs).status());
  }
  if (!options.cert_file.empty()) {
    RETURN_IF_ERROR(
        CheckKeyPair(cert_flag, options.cert_file, key_flag, options.key_file).status());
    ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadWholeFile(cert_flag, options.cert_file));
    ASSIGN_OR_RETURN(ssl.pem_private_key, ReadWholeFile(key_flag, options.key_file));
  }
  return grpc::SslCredentials(ssl);
}

void AddClientTlsChannelArgs(const ClientTlsOptions& options, grpc::ChannelArguments* args) {
  if (!options.server_name.empty()) {
    args->SetSslTargetNameOverride(options.server_name);
  }
}

std::string MemberUri(absl::string_view member_name) {
  return absl::StrCat("kvmesh://member/", member_name);
}

PeerCertificate VerifiedPeerCertificate(const grpc::AuthContext& context) {
  PeerCertificate cert;
  if (!context.IsPeerAuthenticated()) return cert;
  cert.verified = true;
  auto collect = [&context](const char* property, std::vector<std::string>* out) {
    for (const grpc::string_ref& value : context.FindPropertyValues(property)) {
      std::string name(value.data(), value.size());
      if (!name.empty() && std::find(out->begin(), out->end(), name) == out->end()) {
        out->push_back(std::move(name));
      }
    }
  };
  collect(GRPC_PEER_DNS_PROPERTY_NAME, &cert.dns_names);
  collect(GRPC_PEER_IP_PROPERTY_NAME, &cert.ip_names);
  collect(GRPC_PEER_URI_PROPERTY_NAME, &cert.uri_names);
  for (const grpc::string_ref& value : context.FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
    cert.common_name.assign(value.data(), value.size());
    break;
  }
  return cert;
}

std::vector<std::string> PeerCertificateNames(const grpc::AuthContext& context) {
  PeerCertificate cert = VerifiedPeerCertificate(context);
  std::vector<std::string> names;
  for (std::vector<std::string>* kind : {&cert.dns_names, &cert.ip_names, &cert.uri_names}) {
    for (std::string& name : *kind) {
      if (std::find(names.begin(), names.end(), name) == names.end()) {
        names.push_back(std::move(name));
      }
    }
  }
  return names;
}

bool CertificateNamesHost(const std::vector<std::string>& dns_names,
                          const std::vector<std::string>& ip_names, absl::string_view host) {
  if (host.empty()) return false;
  for (const std::string& ip : ip_names) {
    if (ip == host) return true;
  }
  for (const std::string& dns : dns_names) {
    if (absl::EqualsIgnoreCase(dns, host)) return true;
    // "*.domain" stands for exactly one label: "a.domain", not "domain" nor "a.b.domain".
    absl::string_view domain = dns;
    const size_t dot = host.find('.');
    if (absl::ConsumePrefix(&domain, "*.") && dot != absl::string_view::npos && dot > 0 &&
        absl::EqualsIgnoreCase(host.substr(dot + 1), domain)) {
      return true;
    }
  }
  return false;
}

bool IsLoopbackListenAddress(absl::string_view address) {
  // Unix sockets are reachable only through this machine's file system.
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
    return true;
  }
  absl::string_view host = address;
  if (absl::ConsumePrefix(&host, "[")) {
    const size_t close = host.find(']');
    if (close == absl::string_view::npos) return false;
    host = host.substr(0, close);
  } else if (std::count(host.begin(), host.end(), ':') == 1) {
    host = host.substr(0, host.find(':'));
  }
  // Otherwise: a bare host, or a bare IPv6 address (several colons, no port).
  if (host.empty()) return false;  // ":7700" listens on every interface.
  if (absl::AsciiStrToLower(host) == "localhost") return true;
  const std::string text(host);
  in_addr v4;
  if (inet_pton(AF_INET, text.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, text.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

}  // namespace kvmesh
