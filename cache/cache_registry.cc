#include "cache/cache_registry.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cache/shortage.h"
#include "cache/status_macros.h"

namespace kvmesh {
namespace {

absl::Status NoSuchCache(absl::string_view name) {
  return absl::NotFoundError(absl::StrCat("no cache named '", name, "'"));
}

// Caches whose bookkeeping may reach this many bytes give the heap they freed back to the system
// when they go (FreeCache).
constexpr uint64_t kTrimAfterMetadataBytes = uint64_t{8} << 20;

// The deleter of every cache the registry hands out, run by whoever drops the last reference.
// glibc keeps what a cache's millions of small bookkeeping blocks occupied as free heap, mostly
// in pages that are not at the top of a heap (so M_TRIM_THRESHOLD never returns them), and
// reuses it only for the process's later allocations: after a cache of 2^20 one-position
// sequences was deleted the node stayed hundreds of MiB above where it started
// (docs/benchmarks.md, "Metadata"). malloc_trim(0) hands every free page of every arena back
// (madvise), which costs milliseconds, so only caches that could have held that much trim.
void FreeCache(Cache* cache) {
  const bool trim = CacheMetadataBytes(cache->spec()) >= kTrimAfterMetadataBytes;
  delete cache;
#if defined(__GLIBC__)
  if (trim) malloc_trim(0);
#else
  (void)trim;
#endif
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

absl::Status CacheRegistry::CheckMetadataLocked(const CacheSpec& spec) const {
  const uint64_t needed = CacheMetadataBytes(spec);
  if (needed <= metadata_budget_ && metadata_bytes_ <= metadata_budget_ - needed) {
    return absl::OkStatus();
  }
  const uint64_t free = metadata_budget_ - std::min(metadata_bytes_, metadata_budget_);
  return ResourceExhaustedWith(
      absl::StrCat("cache '", spec.name, "' with max_sequences = ", spec.max_sequences,
                   " needs ", needed, " bytes of host memory for its bookkeeping (",
                   kSequenceMetadataBytes + kGroupSequenceMetadataBytes * spec.groups.size(),
                   " per sequence, plus its cells), but the node's caches hold ",
                   metadata_bytes_, " of the metadata budget of ", metadata_budget_,
                   " bytes; use a smaller max_sequences or delete a cache"),
      {Resource::kMetadataBytes, -1, static_cast<int64_t>(needed), static_cast<int64_t>(free),
       static_cast<int64_t>(metadata_budget_)});
}

void CacheRegistry::SetMetadataBudget(uint64_t bytes) {
  MutexLock lock(&mu_);
  metadata_budget_ = bytes;
}

uint64_t CacheRegistry::metadata_budget() const {
  ReaderMutexLock lock(&mu_);
  return metadata_budget_;
}

uint64_t CacheRegistry::MetadataBytes() const {
  ReaderMutexLock lock(&mu_);
  return metadata_bytes_;
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
    RETURN_IF_ERROR(CheckMetadataLocked(spec));
  }
  // Allocate without the lock: a device allocation can be slow, and every RPC looks caches up.
  // The device's budget is reserved atomically, so racing creates cannot overshoot it.
  ASSIGN_OR_RETURN(std::unique_ptr<Cache> cache,
                   Cache::Create(spec, device_, tenant, token_hash_bits_, events_));
  if (filter_factory_) cache->SetEvictionFilter(filter_factory_(std::string(tenant), spec.name));
  std::shared_ptr<Cache> shared(cache.release(), &FreeCache);
  const uint64_t bytes = ArenaBytes(*shared);
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(CreateResult found, FindLocked(tenant, spec));
  if (found.cache != nullptr) return found;  // a racing create won; ours is freed
  RETURN_IF_ERROR(CheckMetadataLocked(spec));
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
  metadata_bytes_ += CacheMetadataBytes(spec);
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
    metadata_bytes_ -= CacheMetadataBytes(doomed->spec());
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

CacheRegistry::Page CacheRegistry::PageFromLocked(
    std::map<Key, std::shared_ptr<Cache>>::const_iterator it, const std::string* tenant,
    size_t limit) const {
  limit = std::max<size_t>(limit, 1);
  Page page;
  for (; it != caches_.end() && (tenant == nullptr || it->first.first == *tenant); ++it) {
    if (page.entries.size() == limit) {
      page.more = true;
      break;
    }
    page.entries.push_back(Entry{it->first.first, it->second});
  }
  return page;
}

CacheRegistry::Page CacheRegistry::ListPage(absl::string_view tenant, absl::string_view after,
                                            size_t limit) const {
  const std::string owner(tenant);
  ReaderMutexLock lock(&mu_);
  return PageFromLocked(caches_.upper_bound(Key(owner, after)), &owner, limit);
}

CacheRegistry::Page CacheRegistry::ListAllPage(absl::string_view after_tenant,
                                               absl::string_view after_name,
                                               size_t limit) const {
  ReaderMutexLock lock(&mu_);
  return PageFromLocked(caches_.upper_bound(Key(after_tenant, after_name)), nullptr, limit);
}

int64_t CacheRegistry::ExpireIdle(absl::Time now) const {
  int64_t removed = 0;
  for (const Entry& entry : ListAll()) {
    removed += static_cast<int64_t>(entry.cache->ExpireIdle(now).size());
  }
  return removed;
}

}  // namespace kvmesh
