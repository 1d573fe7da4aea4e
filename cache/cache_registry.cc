#include "cache/cache_registry.h"

#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"

namespace kvmesh {

absl::StatusOr<CacheRegistry::CreateResult> CacheRegistry::FindLocked(const CacheSpec& spec) const {
  auto it = caches_.find(spec.name);
  if (it == caches_.end()) return CreateResult{};
  if (it->second->spec() != spec) {
    return absl::AlreadyExistsError(
        absl::StrCat("cache '", spec.name, "' already exists with a different spec (",
                     DescribeSpecDifference(it->second->spec(), spec), ")"));
  }
  return CreateResult{it->second, false};
}

absl::StatusOr<CacheRegistry::CreateResult> CacheRegistry::Create(const CacheSpec& spec) {
  RETURN_IF_ERROR(ValidateSpec(spec));

  {
    MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(CreateResult found, FindLocked(spec));
    if (found.cache != nullptr) return found;
  }
  // Allocate without the lock: a device allocation can be slow, and every RPC looks caches up.
  // The device's budget is reserved atomically, so racing creates cannot overshoot it.
  ASSIGN_OR_RETURN(std::unique_ptr<Cache> cache, Cache::Create(spec, device_));
  std::shared_ptr<Cache> shared(std::move(cache));
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(CreateResult found, FindLocked(spec));
  if (found.cache != nullptr) return found;  // a racing create won; ours is freed
  caches_.emplace(spec.name, shared);
  return CreateResult{std::move(shared), true};
}

absl::Status CacheRegistry::Delete(absl::string_view name) {
  std::shared_ptr<Cache> doomed;  // freed outside the lock
  {
    MutexLock lock(&mu_);
    auto it = caches_.find(name);
    if (it == caches_.end()) {
      return absl::NotFoundError(absl::StrCat("no cache named '", name, "'"));
    }
    doomed = std::move(it->second);
    caches_.erase(it);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Cache>> CacheRegistry::Get(absl::string_view name) const {
  ReaderMutexLock lock(&mu_);
  auto it = caches_.find(name);
  if (it == caches_.end()) return absl::NotFoundError(absl::StrCat("no cache named '", name, "'"));
  return it->second;
}

std::vector<std::shared_ptr<Cache>> CacheRegistry::List() const {
  ReaderMutexLock lock(&mu_);
  std::vector<std::shared_ptr<Cache>> out;
  out.reserve(caches_.size());
  for (const auto& [name, cache] : caches_) out.push_back(cache);
  return out;
}

}  // namespace kvmesh
