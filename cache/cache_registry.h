// CacheRegistry: the caches of one node, by tenant and name.
//
// Every cache belongs to a tenant (the one that created it; kDefaultTenant on a node without
// tenants), and names are per tenant: two tenants may each have a cache "m", and a tenant never
// sees another's. Lookups of another tenant's cache fail exactly as for a name nobody uses.
//
// Thread safety: thread-safe. Callers get shared ownership of a cache, so a DeleteCache that
// races with an operation on the same cache frees the memory only when the operation ends.
#ifndef KVMESH_CACHE_CACHE_REGISTRY_H_
#define KVMESH_CACHE_CACHE_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache/cache.h"
#include "cache/device/device.h"
#include "cache/event_log.h"
#include "cache/mutex.h"
#include "cache/token_chain.h"

namespace kvmesh {

// What one tenant may hold: caches, and device bytes of their arenas (the memory a cache
// reserves when it is created). Unlimited by default.
struct TenantQuota {
  int64_t max_caches = std::numeric_limits<int64_t>::max();
  uint64_t max_bytes = std::numeric_limits<uint64_t>::max();
};

// What the bookkeeping of all a node's caches may take in host memory together, by default
// (CacheMetadataBytes of each; docs/api.md#metadata-budget).
inline constexpr uint64_t kDefaultMetadataBudget = uint64_t{512} << 20;

class CacheRegistry {
 public:
  // `device` must outlive the registry and every cache handed out.
  // `token_hash_bits` < 64 is a test hook passed to every Cache::Create (forced collisions).
  // With `events` (not owned, outliving the registry and its caches), every cache publishes
  // its changes there, and the registry the caches it creates and deletes.
  explicit CacheRegistry(Device* device, int token_hash_bits = 64, EventLog* events = nullptr)
      : device_(device), token_hash_bits_(token_hash_bits), events_(events) {}

  struct CreateResult {
    std::shared_ptr<Cache> cache;
    bool created = false;  // false: a cache with this exact spec already existed
  };

  // Creates the cache named spec.name for `tenant`. The memory is allocated outside the
  // registry's lock, so racing creates of one name may each allocate; one wins and the others'
  // memory is freed. Same name and same spec again is an idempotent success; same name with a
  // different spec is ALREADY_EXISTS. RESOURCE_EXHAUSTED naming the tenant and its quota when
  // the new cache would take the tenant past `quota` (checked under the lock against the
  // caches the tenant holds then, so racing creates cannot overshoot it), and naming the
  // cache's max_sequences, its CacheMetadataBytes and the budget when that would take the
  // node's caches past the metadata budget (checked before anything is allocated, and again
  // under the lock). Otherwise errors of Cache::Create.
  absl::StatusOr<CreateResult> Create(absl::string_view tenant, const CacheSpec& spec,
                                      const TenantQuota& quota);
  absl::StatusOr<CreateResult> Create(const CacheSpec& spec) {
    return Create(kDefaultTenant, spec, TenantQuota());
  }

  // NOT_FOUND "no cache named 'x'" when `tenant` has no cache of that name (whether or not
  // another tenant has one). Delete publishes CACHE_DELETED through the cache
  // (Cache::DetachEvents), under the registry's lock: it waits for an operation that holds the
  // cache's lock meanwhile.
  absl::Status Delete(absl::string_view tenant, absl::string_view name);
  absl::StatusOr<std::shared_ptr<Cache>> Get(absl::string_view tenant,
                                             absl::string_view name) const;
  absl::Status Delete(absl::string_view name) { return Delete(kDefaultTenant, name); }
  absl::StatusOr<std::shared_ptr<Cache>> Get(absl::string_view name) const {
    return Get(kDefaultTenant, name);
  }

  // The caches of `tenant`, ordered by name.
  std::vector<std::shared_ptr<Cache>> List(absl::string_view tenant) const;
  std::vector<std::shared_ptr<Cache>> List() const { return List(kDefaultTenant); }

  struct Entry {
    std::string tenant;
    std::shared_ptr<Cache> cache;
  };
  // Every cache of every tenant, ordered by tenant, then name.
  std::vector<Entry> ListAll() const;

  // One page of a listing: at most `limit` entries (0 is taken as 1), and whether more follow.
  struct Page {
    std::vector<Entry> entries;
    bool more = false;
  };
  // The caches of `tenant` whose names sort after `after` (empty: from the first), by name.
  Page ListPage(absl::string_view tenant, absl::string_view after, size_t limit) const;
  // Every tenant's caches after (after_tenant, after_name) in (tenant, name) order (both empty:
  // from the first). Names and tenants are never empty, so an empty key lies before them all.
  Page ListAllPage(absl::string_view after_tenant, absl::string_view after_name,
                   size_t limit) const;

  // The bound on the CacheMetadataBytes of all caches together (kDefaultMetadataBudget until
  // set). Set it before the first Create; caches that exist are not judged again.
  void SetMetadataBudget(uint64_t bytes);
  uint64_t metadata_budget() const;
  // What the caches hold of it now.
  uint64_t MetadataBytes() const;

  // The caches `tenant` holds and the arena bytes they reserve.
  struct TenantUsage {
    int64_t caches = 0;
    uint64_t bytes = 0;
  };
  TenantUsage Usage(absl::string_view tenant) const;

  Device* device() const { return device_; }

  // What every cache created from now on asks before it evicts or expires a sequence
  // (Cache::SetEvictionFilter), made for the cache's tenant and name: a node refuses sequences
  // under migration. Set it before the first Create.
  using EvictionFilterFactory = std::function<std::function<bool(int64_t seq)>(
      const std::string& tenant, const std::string& name)>;
  void SetEvictionFilterFactory(EvictionFilterFactory factory) {
    filter_factory_ = std::move(factory);
  }

  // Cache::ExpireIdle(now) of every cache; the number of sequences removed.
  int64_t ExpireIdle(absl::Time now) const;

  // Device bytes a cache's arenas reserve: what a TenantQuota's max_bytes counts.
  static uint64_t ArenaBytes(const Cache& cache);

 private:

  // The cache named spec.name of `tenant` if its spec equals `spec` (created = false), an empty
  // result when there is none, ALREADY_EXISTS when the specs differ.
  absl::StatusOr<CreateResult> FindLocked(absl::string_view tenant, const CacheSpec& spec) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  TenantUsage UsageLocked(absl::string_view tenant) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when a cache of `spec` would take the caches past the metadata budget.
  absl::Status CheckMetadataLocked(const CacheSpec& spec) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Up to `limit` entries from `it` on, of `tenant` only unless it is null.
  using Key = std::pair<std::string, std::string>;  // tenant, name
  Page PageFromLocked(std::map<Key, std::shared_ptr<Cache>>::const_iterator it,
                      const std::string* tenant, size_t limit) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // Publishes a cache's creation (with its token block size) or deletion (under mu_, so in the
  // order they happen).
  void Publish(EventKind kind, absl::string_view tenant, absl::string_view name,
               int32_t token_block_size = 0) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Device* const device_;
  const int token_hash_bits_;
  EventLog* const events_;
  EvictionFilterFactory filter_factory_;
  mutable Mutex mu_;
  std::map<Key, std::shared_ptr<Cache>> caches_ ABSL_GUARDED_BY(mu_);
  uint64_t metadata_budget_ ABSL_GUARDED_BY(mu_) = kDefaultMetadataBudget;
  uint64_t metadata_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // CacheMetadataBytes of caches_
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_CACHE_REGISTRY_H_
