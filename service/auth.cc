#include "service/auth.h"

#include <openssl/evp.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cache/status_macros.h"
#include "service/common/flags.h"
#include "service/common/log.h"

namespace kvmesh {
namespace {

constexpr size_t kMaxTenantName = 64;
constexpr absl::string_view kBearer = "Bearer ";
constexpr absl::string_view kSha256Prefix = "sha256:";

absl::Status LineError(int line, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", message));
}

bool IsLowerHex(absl::string_view s) {
  for (const char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// The metadata value of `key`, if the call carries one.
std::optional<absl::string_view> Metadata(const grpc::ServerContextBase& context,
                                          absl::string_view key) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  if (it == metadata.end()) return std::nullopt;
  return absl::string_view(it->second.data(), it->second.size());
}

int64_t Nanos(const struct timespec& t) {
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

}  // namespace

absl::Status CheckTenantName(absl::string_view field, absl::string_view name) {
  if (name.empty() || name.size() > kMaxTenantName) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " is ", name.size(), " bytes long: a tenant name has 1 to ", kMaxTenantName));
  }
  for (const char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " '", name, "' is not a tenant name: use letters, digits, '.', '_', '-'"));
    }
  }
  return absl::OkStatus();
}

std::string Sha256Hex(absl::string_view text) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  // EVP_Digest fails only when OpenSSL cannot allocate its context; a node without memory for
  // that cannot serve the call either.
  if (EVP_Digest(text.data(), text.size(), digest, &length, EVP_sha256(), nullptr) != 1 ||
      length != 32) {
    std::fprintf(stderr, "kvmesh: OpenSSL's SHA-256 failed\n");
    std::abort();
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex(2 * length, '\0');
  for (unsigned int i = 0; i < length; ++i) {
    hex[2 * i] = kHex[digest[i] >> 4];
    hex[2 * i + 1] = kHex[digest[i] & 0xf];
  }
  return hex;
}

// ---- TokenTable -----------------------------------------------------------------------------

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text) {
  TokenTable table;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    if (const size_t hash = line.find('#'); hash != absl::string_view::npos) {
      line = line.substr(0, hash);
    }
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields[0] == "token") {
      if (fields.size() != 4) {
        return LineError(line_number, absl::StrCat("a token entry is 'token sha256:<hex> <tenant> "
                                                   "<role>', but this one has ",
                                                   fields.size(), " fields"));
      }
      absl::string_view hash = fields[1];
      if (!absl::ConsumePrefix(&hash, kSha256Prefix) || hash.size() != 64 || !IsLowerHex(hash)) {
        return LineError(line_number,
                         "the token hash is not sha256:<64 lowercase hex digits> (make it with "
                         "printf %s \"$TOKEN\" | sha256sum)");
      }
      Principal principal;
      principal.tenant = std::string(fields[2]);
      if (const absl::Status s = CheckTenantName("the tenant", fields[2]); !s.ok()) {
        return LineError(line_number, s.message());
      }
      if (fields[3] == "tenant") {
        principal.role = Role::kTenant;
      } else if (fields[3] == "admin") {
        principal.role = Role::kAdmin;
      } else {
        return LineError(line_number,
                         absl::StrCat("role '", fields[3], "' is not a role: use tenant or admin"));
      }
      if (!table.by_hash_.emplace(std::string(hash), std::move(principal)).second) {
        return LineError(line_number, "this token hash is listed before");
      }
    } else if (fields[0] == "quota") {
      if (fields.size() < 2) return LineError(line_number, "a quota entry names its tenant");
      if (const absl::Status s = CheckTenantName("the tenant", fields[1]); !s.ok()) {
        return LineError(line_number, s.message());
      }
      TenantQuota quota;
      bool have_caches = false;
      bool have_bytes = false;
      for (size_t i = 2; i < fields.size(); ++i) {
        absl::string_view value = fields[i];
        if (absl::ConsumePrefix(&value, "caches=") && !have_caches) {
          if (!absl::SimpleAtoi(value, &quota.max_caches) || quota.max_caches < 0) {
            return LineError(line_number, absl::StrCat("caches=", value, " is not a count"));
          }
          have_caches = true;
        } else if (absl::ConsumePrefix(&value, "bytes=") && !have_bytes) {
          absl::StatusOr<uint64_t> bytes = ParseByteSize(value);
          if (!bytes.ok()) {
            return LineError(line_number,
                             absl::StrCat("bytes=", value, ": ", bytes.status().message()));
          }
          quota.max_bytes = *bytes;
          have_bytes = true;
        } else {
          return LineError(line_number, absl::StrCat("'", fields[i],
                                                     "' is not caches=<N> or bytes=<size> (or "
                                                     "repeats one)"));
        }
      }
      if (!table.quotas_.emplace(std::string(fields[1]), quota).second) {
        return LineError(line_number, absl::StrCat("tenant '", fields[1], "' has a quota before"));
      }
    } else {
      return LineError(line_number,
                       absl::StrCat("'", fields[0].substr(0, 32), "' is not token or quota"));
    }
  }
  return table;
}

const Principal* TokenTable::Find(absl::string_view token) const {
  auto it = by_hash_.find(Sha256Hex(token));
  return it == by_hash_.end() ? nullptr : &it->second;
}

TenantQuota TokenTable::Quota(absl::string_view tenant) const {
  auto it = quotas_.find(tenant);
  return it == quotas_.end() ? TenantQuota() : it->second;
}

// ---- Authenticator --------------------------------------------------------------------------

Authenticator::Authenticator(Options options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(Options options) {
  if (options.reload_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the token file's reload interval must be positive");
  }
  std::unique_ptr<Authenticator> auth(new Authenticator(std::move(options)));
  if (!auth->enabled()) return auth;
  FileStamp stamp;
  absl::StatusOr<TokenTable> table = auth->Load(&stamp);
  if (!table.ok()) return table.status();
  {
    MutexLock lock(&auth->mu_);
    auth->table_ = std::make_shared<const TokenTable>(*std::move(table));
    auth->stamp_ = stamp;
  }
  auth->poller_ = std::thread([a = auth.get()] { a->PollLoop(); });
  return auth;
}

Authenticator::~Authenticator() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (poller_.joinable()) poller_.join();
}

absl::StatusOr<TokenTable> Authenticator::Load(FileStamp* stamp) const {
  const std::string& path = options_.token_file;
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, ": ", std::strerror(errno)));
  }
  stamp->size = st.st_size;
  stamp->mtime_ns = Nanos(st.st_mtim);
  stamp->ctime_ns = Nanos(st.st_ctim);
  stamp->inode = st.st_ino;
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, ": cannot read it"));
  }
  absl::StatusOr<TokenTable> table = TokenTable::Parse(text.str());
  if (!table.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, ": ", table.status().message()));
  }
  return table;
}

absl::Status Authenticator::ReloadIfChanged() {
  if (!enabled()) return absl::OkStatus();
  struct stat st;
  FileStamp now;
  if (stat(options_.token_file.c_str(), &st) == 0) {
    now.size = st.st_size;
    now.mtime_ns = Nanos(st.st_mtim);
    now.ctime_ns = Nanos(st.st_ctim);
    now.inode = st.st_ino;
  }
  {
    MutexLock lock(&mu_);
    if (now == stamp_) return absl::OkStatus();
  }
  FileStamp stamp;
  absl::StatusOr<TokenTable> table = Load(&stamp);
  MutexLock lock(&mu_);
  stamp_ = stamp;  // a bad version is reported once, not at every poll
  if (!table.ok()) return table.status();
  table_ = std::make_shared<const TokenTable>(*std::move(table));
  generation_.fetch_add(1, std::memory_order_acq_rel);
  return absl::OkStatus();
}

void Authenticator::PollLoop() {
  MutexLock lock(&mu_);
  while (!stopping_) {
    stop_cv_.wait_for(mu_, absl::ToChronoMicroseconds(options_.reload_interval));
    if (stopping_) break;
    const std::shared_ptr<const TokenTable> before = table_;
    mu_.Unlock();
    const absl::Status status = ReloadIfChanged();
    mu_.Lock();
    if (!status.ok()) {
      Log(LogLevel::kWarning,
          absl::StrCat(status.message(), "; the previous version stays in force"));
    } else if (table_ != before) {
      Log(LogLevel::kInfo, absl::StrCat("token file ", options_.token_file,
                                        " reloaded: ", table_->tokens(), " tokens"));
    }
  }
}

absl::StatusOr<Principal> Authenticator::Authenticate(
    const grpc::ServerContextBase& context) const {
  return Authenticate(Metadata(context, kAuthorizationMetadata),
                      Metadata(context, kTenantMetadata));
}

absl::StatusOr<Principal> Authenticator::Authenticate(
    std::optional<absl::string_view> authorization, std::optional<absl::string_view> tenant) const {
  Principal principal;
  if (!enabled()) {
    principal.tenant = kDefaultTenant;
    principal.role = Role::kAdmin;
  } else {
    if (!authorization.has_value()) {
      return absl::UnauthenticatedError(
          "this node needs a bearer token: send the metadata 'authorization: Bearer <token>'");
    }
    absl::string_view token = *authorization;
    if (!absl::ConsumePrefix(&token, kBearer) || token.empty()) {
      return absl::UnauthenticatedError("the authorization metadata is not 'Bearer <token>'");
    }
    std::shared_ptr<const TokenTable> table;
    {
      MutexLock lock(&mu_);
      table = table_;
    }
    const Principal* found = table->Find(token);
    if (found == nullptr) {
      return absl::UnauthenticatedError(
          "the bearer token is not one this node knows (revoked, or from another cluster?)");
    }
    principal = *found;
  }
  if (tenant.has_value()) {
    RETURN_IF_ERROR(CheckTenantName(kTenantMetadata, *tenant));
    if (!principal.admin()) {
      return absl::PermissionDeniedError(
          absl::StrCat("only an admin may act for another tenant (", kTenantMetadata,
                       " metadata); this token belongs to tenant '", principal.tenant, "'"));
    }
    principal.tenant = std::string(*tenant);
  }
  return principal;
}

absl::Status Authenticator::RequireAdmin(const Principal& caller, absl::string_view what) {
  if (caller.admin()) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(what, " needs an admin token; this one belongs to tenant '", caller.tenant,
                   "' with role tenant"));
}

CallerRecheck::CallerRecheck(const Authenticator* auth, const grpc::ServerContextBase& context,
                             Principal who)
    : auth_(auth), who_(std::move(who)) {
  if (auth_ == nullptr || !auth_->enabled()) return;
  // No generation yet: the first Check authenticates again, so a reload between the call's
  // authentication and this constructor is not missed.
  if (std::optional<absl::string_view> v = Metadata(context, kAuthorizationMetadata)) {
    authorization_ = std::string(*v);
  }
  if (std::optional<absl::string_view> v = Metadata(context, kTenantMetadata)) {
    tenant_ = std::string(*v);
  }
}

absl::Status CallerRecheck::Check() {
  if (auth_ == nullptr || !auth_->enabled()) return absl::OkStatus();
  const uint64_t generation = auth_->generation();
  if (generation_.has_value() && generation == *generation_) return absl::OkStatus();
  generation_ = generation;
  auto view = [](const std::optional<std::string>& v) -> std::optional<absl::string_view> {
    if (!v.has_value()) return std::nullopt;
    return absl::string_view(*v);
  };
  ASSIGN_OR_RETURN(const Principal now, auth_->Authenticate(view(authorization_), view(tenant_)));
  if (now.tenant != who_.tenant || now.role != who_.role) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the call's token now acts for tenant '", now.tenant, "' as ",
        now.admin() ? "admin" : "tenant", ", not for tenant '", who_.tenant, "' as ",
        who_.admin() ? "admin" : "tenant", " as when the call began (the token file changed)"));
  }
  return absl::OkStatus();
}

TenantQuota Authenticator::Quota(absl::string_view tenant) const {
  if (!enabled()) return TenantQuota();
  MutexLock lock(&mu_);
  return table_->Quota(tenant);
}

}  // namespace kvmesh
