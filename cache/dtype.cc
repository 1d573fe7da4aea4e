#include "cache/dtype.h"

#include <cmath>

namespace kvmesh {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "?";
}

}  // namespace kvmesh
