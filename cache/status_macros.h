// Status propagation macros for the whole tree. Debian's Abseil (20220623) ships neither
// RETURN_IF_ERROR nor ASSIGN_OR_RETURN, so kvmesh defines them once, here.
#ifndef KVMESH_CACHE_STATUS_MACROS_H_
#define KVMESH_CACHE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVMESH_CONCAT_INNER_(a, b) a##b
#define KVMESH_CONCAT_(a, b) KVMESH_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function if not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    const ::absl::Status kvmesh_status_ = (expr);    \
    if (!kvmesh_status_.ok()) return kvmesh_status_; \
  } while (0)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status from the function.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  ASSIGN_OR_RETURN_IMPL_(KVMESH_CONCAT_(kvmesh_statusor_, __LINE__), lhs, rexpr)

#define ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                           \
  if (!statusor.ok()) return statusor.status();      \
  lhs = std::move(statusor).value()

#endif  // KVMESH_CACHE_STATUS_MACROS_H_
