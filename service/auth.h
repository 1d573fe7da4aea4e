// Tenants and bearer tokens (docs/security.md, "Tenants and tokens").
//
// A node started with --token-file knows its callers by the bearer token of each call (gRPC
// metadata `authorization: Bearer <token>`): the file maps the SHA-256 of every token to a
// tenant and a role, so the tokens themselves are never at rest on the node. Every cache belongs
// to the tenant that created it (CacheRegistry); an admin may act for another tenant by naming
// it in the `kvmesh-tenant` metadata. A node without a token file is in development mode: every
// caller is an admin of the tenant "default".
//
// Token file format, one entry per line, fields separated by spaces or tabs, `#` to the end of a
// line is a comment:
//
//   token sha256:<64 hex digits> <tenant> <role>     role: tenant or admin
//   quota <tenant> [caches=<N>] [bytes=<size>]        size as in --memory-budget: 512MiB
//
// Tenant names are 1 to 64 of [A-Za-z0-9._-]. The file is read at start-up (a malformed file is
// a start-up error) and again whenever it changes (its size, mtime, ctime or inode; a Kubernetes
// Secret volume swaps a symlink): a malformed new version is reported on stderr and the last
// good one stays in force, so a typo in a rotation never locks everybody out.
//
// Thread safety: thread-safe. A background thread polls the file; the destructor stops it.
#ifndef KVMESH_SERVICE_AUTH_H_
#define KVMESH_SERVICE_AUTH_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache/cache_registry.h"
#include "cache/mutex.h"
#include "grpcpp/server_context.h"

namespace kvmesh {

// Metadata keys a client sends.
inline constexpr char kAuthorizationMetadata[] = "authorization";
inline constexpr char kTenantMetadata[] = "kvmesh-tenant";

enum class Role { kTenant, kAdmin };

// Who a call runs as: the tenant whose caches it sees, and the caller's role.
struct Principal {
  std::string tenant;
  Role role = Role::kTenant;

  bool admin() const { return role == Role::kAdmin; }
};

// INVALID_ARGUMENT naming `field` unless `name` is 1 to 64 of [A-Za-z0-9._-].
absl::Status CheckTenantName(absl::string_view field, absl::string_view name);

// SHA-256 of `text` as 64 lowercase hex digits (OpenSSL).
std::string Sha256Hex(absl::string_view text);

// A parsed token file.
class TokenTable {
 public:
  // INVALID_ARGUMENT "line N: ..." for the first malformed line: an unknown keyword, a hash
  // that is not sha256:<64 hex>, a bad tenant name or role, a token listed twice, a bad or
  // repeated quota field, two quota lines for one tenant.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text);

  // The principal whose token is `token`, or null.
  const Principal* Find(absl::string_view token) const;
  // The quota of `tenant` (unlimited without a quota line).
  TenantQuota Quota(absl::string_view tenant) const;

  size_t tokens() const { return by_hash_.size(); }

 private:
  absl::flat_hash_map<std::string, Principal> by_hash_;  // lowercase hex SHA-256 -> principal
  absl::flat_hash_map<std::string, TenantQuota> quotas_;
};

class Authenticator {
 public:
  struct Options {
    // Empty: development mode (no tokens; every caller is an admin of kDefaultTenant).
    std::string token_file;
    // How often the file is checked for changes.
    absl::Duration reload_interval = absl::Seconds(1);
  };

  // Loads the token file: INVALID_ARGUMENT naming the file for an unreadable or malformed one.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(Options options);

  ~Authenticator();
  Authenticator(const Authenticator&) = delete;
  Authenticator& operator=(const Authenticator&) = delete;

  // Whether callers must present tokens (a token file is in force).
  bool enabled() const { return !options_.token_file.empty(); }

  // The principal a call runs as, from its metadata. UNAUTHENTICATED without an
  // `authorization: Bearer <token>` entry or with a token the file does not list (the token is
  // never echoed); PERMISSION_DENIED when a caller that is not an admin names a tenant in
  // `kvmesh-tenant`; INVALID_ARGUMENT for a malformed tenant name there.
  absl::StatusOr<Principal> Authenticate(const grpc::ServerContextBase& context) const;
  // The same from the two metadata values (absent: nullopt).
  absl::StatusOr<Principal> Authenticate(std::optional<absl::string_view> authorization,
                                         std::optional<absl::string_view> tenant) const;

  // PERMISSION_DENIED naming `what` unless `caller` is an admin.
  static absl::Status RequireAdmin(const Principal& caller, absl::string_view what);

  TenantQuota Quota(absl::string_view tenant) const;

  // Counts the versions of the token file in force: it grows at every reload that changed the
  // table. A long-lived call (a stream) authenticates again when it has grown, so a revoked
  // token ends its streams (docs/security.md, "Revocation").
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // Reads the file again when it changed since the last read: OK when unchanged or reloaded,
  // the parse error otherwise (the previous table stays in force). The polling thread calls it;
  // tests may too.
  absl::Status ReloadIfChanged();

 private:
  // What identifies one version of the file.
  struct FileStamp {
    int64_t size = -1;
    int64_t mtime_ns = 0;
    int64_t ctime_ns = 0;
    uint64_t inode = 0;
    bool operator==(const FileStamp& o) const {
      return size == o.size && mtime_ns == o.mtime_ns && ctime_ns == o.ctime_ns && inode == o.inode;
    }
  };

  explicit Authenticator(Options options);
  // Reads and parses the file; its stamp in *stamp.
  absl::StatusOr<TokenTable> Load(FileStamp* stamp) const;
  void PollLoop();

  const Options options_;
  mutable Mutex mu_;
  std::condition_variable_any stop_cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<const TokenTable> table_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> generation_{0};
  FileStamp stamp_ ABSL_GUARDED_BY(mu_);
  std::thread poller_;
};

// Whether the caller of a long-lived call (a stream) may still make it: authenticates the call's
// metadata again whenever the token file has changed since the last check, so a token revoked
// (or a tenant removed) at a reload ends the streams it opened.
//
// Thread safety: thread-compatible; one thread at a time calls Check.
class CallerRecheck {
 public:
  // `who` is the principal the call began as; `auth` may be null (development: always OK).
  // Copies what it needs of `context`'s metadata.
  CallerRecheck(const Authenticator* auth, const grpc::ServerContextBase& context, Principal who);

  // OK while the call's token is still known and maps to the same tenant and role; otherwise
  // UNAUTHENTICATED (the token is no longer listed) or PERMISSION_DENIED (it now belongs to
  // another tenant or role). Costs an atomic load while the token file is unchanged.
  absl::Status Check();

 private:
  const Authenticator* auth_;
  std::optional<std::string> authorization_;
  std::optional<std::string> tenant_;
  Principal who_;
  std::optional<uint64_t> generation_;  // of the last check; none before the first
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_AUTH_H_
