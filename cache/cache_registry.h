// CacheRegistry: the caches of one node, by name.
//
// Thread safety: thread-safe. Callers get shared ownership of a cache, so a DeleteCache that
// races with an operation on the same cache frees the memory only when the operation ends.
#ifndef KVMESH_CACHE_CACHE_REGISTRY_H_
#define KVMESH_CACHE_CACHE_REGISTRY_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/cache.h"
#include "cache/device/device.h"
#include "cache/mutex.h"

namespace kvmesh {

class CacheRegistry {
 public:
  // `device` must outlive the registry and every cache handed out.
  explicit CacheRegistry(Device* device) : device_(device) {}

  struct CreateResult {
    std::shared_ptr<Cache> cache;
    bool created = false;  // false: a cache with this exact spec already existed
  };

  // Creates the cache named spec.name. The memory is allocated outside the registry's lock, so
  // racing creates of one name may each allocate; one wins and the others' memory is freed. Same
  // name and same spec again is an idempotent success; same name with a different spec is
  // ALREADY_EXISTS. Otherwise errors of Cache::Create.
  absl::StatusOr<CreateResult> Create(const CacheSpec& spec);

  // NOT_FOUND when no cache has that name.
  absl::Status Delete(absl::string_view name);
  absl::StatusOr<std::shared_ptr<Cache>> Get(absl::string_view name) const;

  // All caches, ordered by name.
  std::vector<std::shared_ptr<Cache>> List() const;

  Device* device() const { return device_; }

 private:
  // The cache named spec.name if its spec equals `spec` (created = false), an empty result when
  // there is none, ALREADY_EXISTS when the specs differ.
  absl::StatusOr<CreateResult> FindLocked(const CacheSpec& spec) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  Device* const device_;
  mutable Mutex mu_;
  std::map<std::string, std::shared_ptr<Cache>, std::less<>> caches_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_CACHE_REGISTRY_H_
