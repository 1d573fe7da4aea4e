// Paged answers of ListSequences, ListSnapshots and ListCaches (docs/api.md#paging).
//
// Each page is built from an engine call that lists a range from a key with a limit under the
// cache's (or the registry's) lock, so a page costs memory and time in proportion to its size,
// not to the whole listing. The order is stable: sequences by id, snapshots by id, caches by
// (tenant, name). A page token names the key the next page starts from, wrapped so that clients
// treat it as opaque: web-safe base64 of "<listing>:<key>". A token is checked before anything
// is listed; one that is not this listing's is INVALID_ARGUMENT naming it. Keys that vanish
// between pages are skipped and keys created behind the cursor are not seen: a listing is not
// a snapshot of one instant.
//
// Thread safety: stateless functions, safe from any thread.
#ifndef KVMESH_SERVICE_LIST_PAGES_H_
#define KVMESH_SERVICE_LIST_PAGES_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/cache.h"
#include "cache/cache_registry.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {

// Page sizes: a request's page_size of 0 gets the default; one above the maximum is taken as
// the maximum (the response is then shorter than asked, and next_page_token says more follow);
// a negative one is INVALID_ARGUMENT. The maxima keep one answer within a few MiB even for a
// cache of 64 groups.
inline constexpr int32_t kDefaultSequencePageSize = 1024;
inline constexpr int32_t kMaxSequencePageSize = 4096;
inline constexpr int32_t kDefaultSnapshotPageSize = 1024;
inline constexpr int32_t kMaxSnapshotPageSize = 4096;
inline constexpr int32_t kDefaultCachePageSize = 100;
inline constexpr int32_t kMaxCachePageSize = 1000;
// Longer page tokens are refused before they are decoded (the longest a node makes is a cache
// token: 64 bytes of tenant and 128 of name, base64).
inline constexpr size_t kMaxPageTokenBytes = 512;

// The number of entries to list for a request's page_size (see above).
absl::StatusOr<size_t> PageSize(int32_t requested, int32_t default_size, int32_t max_size);

// The tokens of the three listings, exposed for tests: a token that starts a page at
// sequence `seq`, at snapshot `id`, or after the cache (tenant, name). The parsers return
// INVALID_ARGUMENT naming the token for anything the matching maker did not make.
std::string SequencePageToken(int64_t seq);
absl::StatusOr<int64_t> ParseSequencePageToken(absl::string_view token);
std::string SnapshotPageToken(uint64_t id);
absl::StatusOr<uint64_t> ParseSnapshotPageToken(absl::string_view token);
struct CacheKey {
  std::string tenant;
  std::string name;
};
std::string CachePageToken(absl::string_view tenant, absl::string_view name);
absl::StatusOr<CacheKey> ParseCachePageToken(absl::string_view token);

// One page of `cache`'s sequences as `request` asks (page_size, page_token), with
// next_page_token set when more follow.
absl::Status ListSequencesPage(const Cache& cache, const v1::ListSequencesRequest& request,
                               v1::ListSequencesResponse* response);
// One page of `cache`'s snapshots.
absl::Status ListSnapshotsPage(const Cache& cache, const v1::ListSnapshotsRequest& request,
                               v1::ListSnapshotsResponse* response);
// One page of the caches of `tenant`, or with `every_tenant` (an admin naming no tenant) of
// every tenant's caches, each with its tenant set. INVALID_ARGUMENT for a token of another
// tenant's listing when listing one tenant's.
absl::Status ListCachesPage(const CacheRegistry& registry, absl::string_view tenant,
                            bool every_tenant, const v1::ListCachesRequest& request,
                            v1::ListCachesResponse* response);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_LIST_PAGES_H_
