#include "cache/cache_registry.h"

#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"

namespace kvmesh {
namespace {

absl::Status NoSuchCache(absl::string_view name) {
  return absl::NotFoundError(absl::StrCat("no cache named '", name, "'"));
}

}  // namespace

uint64_t CacheRegistry::ArenaBytes(const Cache& cache) {
  uint64_t bytes = 0;
  for (const GroupUsage& group : cache.Usage().groups) bytes += group.bytes;
  return bytes;
}

absl::StatusOr<CacheRegistry::CreateResult> CacheRegistry::FindLocked(absl::string_view tenant,
                                                                      const CacheSpec& spec) const {
  auto it = caches_.find(Key(tenant, spec.name));
  if (it == caches_.end()) return CreateResult{};
  if (it->second->spec() != spec) {
    return absl::AlreadyExistsError(
        absl::StrCat("cache '", spec.name, "' already exists with a different spec (",
                     DescribeSpecDifference(it->second->spec(), spec), ")"));
  }
  return CreateResult{it->second, false};
}

CacheRegistry::TenantUsage CacheRegistry::UsageLocked(absl::string_view tenant) const {
  TenantUsage usage;
  for (auto it = caches_.lower_bound(Key(tenant, ""));
       it != caches_.end() && it->first.first == tenant; ++it) {
    ++usage.caches;
    usage.bytes += ArenaBytes(*it->second);
  }
  return usage;
}

CacheRegistry::TenantUsage CacheRegistry::Usage(absl::string_view tenant) const {
  ReaderMutexLock lock(&mu_);
  return UsageLocked(tenant);
}

absl::StatusOr<CacheRegistry::CreateResult> CacheRegistry::Create(absl::string_view tenant,
                                                                  const CacheSpec& spec,
                                                                  const TenantQuota& quota) {
  RETURN_IF_ERROR(ValidateSpec(spec));
  {
    MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(CreateResult found, FindLocked(tenant, spec));
    if (found.cache != nullptr) return found;
    if (UsageLocked(tenant).caches >= quota.max_caches) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tenant '", tenant, "' holds ", quota.max_caches,
                       " caches already, its quota (delete one first)"));
    }
  }
  // Allocate without the lock: a device allocation can be slow, and every RPC looks caches up.
  // The device's budget is reserved atomically, so racing creates cannot overshoot it.
  ASSIGN_OR_RETURN(std::unique_ptr<Cache> cache,
                   Cache::Create(spec, device_, tenant, token_hash_bits_, events_));
  if (filter_factory_) cache->SetEvictionFilter(filter_factory_(std::string(tenant), spec.name));
  std::shared_ptr<Cache> shared(std::move(cache));
  const uint64_t bytes = ArenaBytes(*shared);
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(CreateResult found, FindLocked(tenant, spec));
  if (found.cache != nullptr) return found;  // a racing create won; ours is freed
  const TenantUsage usage = UsageLocked(tenant);
  if (usage.caches >= quota.max_caches) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tenant '", tenant, "' holds ", quota.max_caches,
                     " caches already, its quota (delete one first)"));
  }
  if (bytes > quota.max_bytes || usage.bytes > quota.max_bytes - bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cache '", spec.name, "' needs ", bytes, " bytes, but tenant '", tenant,
                     "' holds ", usage.bytes, " of its quota of ", quota.max_bytes, " bytes"));
  }
  caches_.emplace(Key(tenant, spec.name), shared);
  Publish(EventKind::kCacheCreated, tenant, spec.name, spec.token_block_size);
  return CreateResult{std::move(shared), true};
}

absl::Status CacheRegistry::Delete(absl::string_view tenant, absl::string_view name) {
  std::shared_ptr<Cache> doomed;  // freed outside the lock
  {
    MutexLock lock(&mu_);
    auto it = caches_.find(Key(tenant, name));
    if (it == caches_.end()) return NoSuchCache(name);
    doomed = std::move(it->second);
    caches_.erase(it);
    // Under mu_, so that it comes before a new cache of the name is created (and published);
    // through the cache, so that nothing of the deleted one is published after it.
    Event deleted;
    deleted.kind = EventKind::kCacheDeleted;
    deleted.tenant = std::string(tenant);
    deleted.cache = std::string(name);
    doomed->DetachEvents(std::move(deleted));
  }
  return absl::OkStatus();
}

void CacheRegistry::Publish(EventKind kind, absl::string_view tenant, absl::string_view name,
                            int32_t token_block_size) {
  if (events_ == nullptr) return;
  Event event;
  event.kind = kind;
  event.token_block_size = token_block_size;
  event.tenant = std::string(tenant);
  event.cache = std::string(name);
  events_->Publish(std::move(event));
}

absl::StatusOr<std::shared_ptr<Cache>> CacheRegistry::Get(absl::string_view tenant,
                                                          absl::string_view name) const {
  ReaderMutexLock lock(&mu_);
  auto it = caches_.find(Key(tenant, name));
  if (it == caches_.end()) return NoSuchCache(name);
  return it->second;
}

std::vector<std::shared_ptr<Cache>> CacheRegistry::List(absl::string_view tenant) const {
  ReaderMutexLock lock(&mu_);
  std::vector<std::shared_ptr<Cache>> out;
  for (auto it = caches_.lower_bound(Key(tenant, ""));
       it != caches_.end() && it->first.first == tenant; ++it) {
    out.push_back(it->second);
  }
  return out;
}

std::vector<CacheRegistry::Entry> CacheRegistry::ListAll() const {
  ReaderMutexLock lock(&mu_);
  std::vector<Entry> out;
  out.reserve(caches_.size());
  for (const auto& [key, cache] : caches_) out.push_back(Entry{key.first, cache});
  return out;
}

int64_t CacheRegistry::ExpireIdle(absl::Time now) const {
  int64_t removed = 0;
  for (const Entry& entry : ListAll()) {
    removed += static_cast<int64_t>(entry.cache->ExpireIdle(now).size());
  }
  return removed;
}

}  // namespace kvmesh
