// Helpers shared by the Cache's own files (cache.cc and cache_*.cc), private to them.
#ifndef KVMESH_CACHE_CACHE_INTERNAL_H_
#define KVMESH_CACHE_CACHE_INTERNAL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvmesh {
namespace cache_internal {

// INVALID_ARGUMENT "<what> = <value> is negative" for a negative value.
inline absl::Status CheckNonNegative(const char* what, int64_t value) {
  if (value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " = ", value, " is negative"));
  }
  return absl::OkStatus();
}

}  // namespace cache_internal
}  // namespace kvmesh

#endif  // KVMESH_CACHE_CACHE_INTERNAL_H_
