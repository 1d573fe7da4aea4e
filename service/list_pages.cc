#include "service/list_pages.h"

#include <limits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"
#include "service/common/convert.h"

namespace kvmesh {
namespace {

constexpr absl::string_view kSequencesListing = "seq";
constexpr absl::string_view kSnapshotsListing = "snap";
constexpr absl::string_view kCachesListing = "cache";
// What a refusal quotes of a bad token, at most (escaped).
constexpr size_t kQuotedTokenBytes = 64;

std::string MakeToken(absl::string_view listing, absl::string_view key) {
  return absl::WebSafeBase64Escape(absl::StrCat(listing, ":", key));
}

absl::Status BadToken(absl::string_view token, absl::string_view why) {
  std::string quoted = absl::CHexEscape(token.substr(0, kQuotedTokenBytes));
  if (token.size() > kQuotedTokenBytes) absl::StrAppend(&quoted, "...");
  return absl::InvalidArgumentError(
      absl::StrCat("page_token '", quoted, "' (", token.size(), " bytes) ", why,
                   "; pass next_page_token of the previous page as it came, or none"));
}

// The key inside `token`, a token of `listing`.
absl::StatusOr<std::string> TokenKey(absl::string_view token, absl::string_view listing) {
  if (token.size() > kMaxPageTokenBytes) {
    return BadToken(token,
                    absl::StrCat("is longer than any page token (", kMaxPageTokenBytes, " bytes)"));
  }
  std::string decoded;
  if (!absl::WebSafeBase64Unescape(token, &decoded)) {
    return BadToken(token, "is not a page token (not base64)");
  }
  const std::string prefix = absl::StrCat(listing, ":");
  if (!absl::StartsWith(decoded, prefix)) {
    return BadToken(token, absl::StrCat("is not a page token of this listing (", listing, ")"));
  }
  return decoded.substr(prefix.size());
}

// The id a token of `listing` starts at: decimal digits, at least `min`.
template <typename Id>
absl::StatusOr<Id> ParseId(absl::string_view token, absl::string_view listing, Id min) {
  ASSIGN_OR_RETURN(const std::string key, TokenKey(token, listing));
  Id id = 0;
  // SimpleAtoi takes a sign and surrounding blanks; a node's keys have neither.
  if (key.empty() || key.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(key, &id) || id < min) {
    return BadToken(token, "does not hold a valid position in the listing");
  }
  return id;
}

}  // namespace

absl::StatusOr<size_t> PageSize(int32_t requested, int32_t default_size, int32_t max_size) {
  if (requested < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size = ", requested, " is negative; 0 asks for the default (",
                     default_size, "), at most ", max_size, " are listed per page"));
  }
  if (requested == 0) return static_cast<size_t>(default_size);
  return static_cast<size_t>(requested < max_size ? requested : max_size);
}

std::string SequencePageToken(int64_t seq) {
  return MakeToken(kSequencesListing, absl::StrCat(seq));
}

absl::StatusOr<int64_t> ParseSequencePageToken(absl::string_view token) {
  return ParseId<int64_t>(token, kSequencesListing, 0);
}

std::string SnapshotPageToken(uint64_t id) {
  return MakeToken(kSnapshotsListing, absl::StrCat(id));
}

absl::StatusOr<uint64_t> ParseSnapshotPageToken(absl::string_view token) {
  return ParseId<uint64_t>(token, kSnapshotsListing, 1);
}

std::string CachePageToken(absl::string_view tenant, absl::string_view name) {
  // Tenants never hold a NUL (docs/security.md: [A-Za-z0-9._-]), so the first one ends it.
  return MakeToken(kCachesListing, absl::StrCat(tenant, absl::string_view("\0", 1), name));
}

absl::StatusOr<CacheKey> ParseCachePageToken(absl::string_view token) {
  ASSIGN_OR_RETURN(const std::string key, TokenKey(token, kCachesListing));
  const size_t nul = key.find('\0');
  if (nul == std::string::npos || nul == 0 || nul + 1 == key.size()) {
    return BadToken(token, "does not hold a valid position in the listing");
  }
  return CacheKey{key.substr(0, nul), key.substr(nul + 1)};
}

absl::Status ListSequencesPage(const Cache& cache, const v1::ListSequencesRequest& request,
                               v1::ListSequencesResponse* response) {
  ASSIGN_OR_RETURN(const size_t limit,
                   PageSize(request.page_size(), kDefaultSequencePageSize, kMaxSequencePageSize));
  int64_t first = 0;
  if (!request.page_token().empty()) {
    ASSIGN_OR_RETURN(first, ParseSequencePageToken(request.page_token()));
  }
  const Cache::SequencePage page = cache.ListSequences(first, limit);
  response->mutable_sequences()->Reserve(static_cast<int>(page.sequences.size()));
  for (const SequenceInfo& info : page.sequences) {
    *response->add_sequences() = SequenceInfoToProto(info);
  }
  // A page that ends at the largest id has nothing after it.
  if (page.more && !page.sequences.empty() &&
      page.sequences.back().seq < std::numeric_limits<int64_t>::max()) {
    response->set_next_page_token(SequencePageToken(page.sequences.back().seq + 1));
  }
  return absl::OkStatus();
}

absl::Status ListSnapshotsPage(const Cache& cache, const v1::ListSnapshotsRequest& request,
                               v1::ListSnapshotsResponse* response) {
  ASSIGN_OR_RETURN(const size_t limit,
                   PageSize(request.page_size(), kDefaultSnapshotPageSize, kMaxSnapshotPageSize));
  uint64_t first = 1;
  if (!request.page_token().empty()) {
    ASSIGN_OR_RETURN(first, ParseSnapshotPageToken(request.page_token()));
  }
  const Cache::SnapshotPage page = cache.ListSnapshots(first, limit);
  response->mutable_snapshots()->Reserve(static_cast<int>(page.snapshots.size()));
  for (const SnapshotInfo& info : page.snapshots) {
    *response->add_snapshots() = SnapshotInfoToProto(info);
  }
  if (page.more && !page.snapshots.empty() &&
      page.snapshots.back().id < std::numeric_limits<uint64_t>::max()) {
    response->set_next_page_token(SnapshotPageToken(page.snapshots.back().id + 1));
  }
  return absl::OkStatus();
}

absl::Status ListCachesPage(const CacheRegistry& registry, absl::string_view tenant,
                            bool every_tenant, const v1::ListCachesRequest& request,
                            v1::ListCachesResponse* response) {
  ASSIGN_OR_RETURN(const size_t limit,
                   PageSize(request.page_size(), kDefaultCachePageSize, kMaxCachePageSize));
  CacheKey after;
  if (!request.page_token().empty()) {
    ASSIGN_OR_RETURN(after, ParseCachePageToken(request.page_token()));
    if (!every_tenant && after.tenant != tenant) {
      return BadToken(request.page_token(), "belongs to another listing");
    }
  }
  const CacheRegistry::Page page = every_tenant
                                       ? registry.ListAllPage(after.tenant, after.name, limit)
                                       : registry.ListPage(tenant, after.name, limit);
  for (const CacheRegistry::Entry& entry : page.entries) {
    v1::CacheInfo* info = response->add_caches();
    *info = CacheInfoToProto(*entry.cache);
    info->set_tenant(entry.tenant);
  }
  if (page.more && !page.entries.empty()) {
    const CacheRegistry::Entry& last = page.entries.back();
    response->set_next_page_token(CachePageToken(last.tenant, last.cache->spec().name));
  }
  return absl::OkStatus();
}

}  // namespace kvmesh
