#include "cache/types.h"

namespace kvmesh {

const char* StateStatusName(StateStatus status) {
  switch (status) {
    case StateStatus::kNone:
      return "NONE";
    case StateStatus::kValid:
      return "VALID";
    case StateStatus::kInvalid:
      return "INVALID";
  }
  return "UNKNOWN";
}

}  // namespace kvmesh
