// An independent float64 reference of the RoPE shift in docs/api.md#rope-shift: shifting a key by d
// positions rotates, in each head, pair i (elements 2i, 2i+1 for NORMAL; i and i + dims/2 for
// NEOX; i < dims/2) by the angle d * freq_scale * base^(-2i/dims), counterclockwise
// (x0' = x0 cos - x1 sin, x1' = x0 sin + x1 cos, as ggml's rope); elements past dims stay.
#ifndef KVMESH_TESTS_UNIT_ROPE_REFERENCE_H_
#define KVMESH_TESTS_UNIT_ROPE_REFERENCE_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "cache/dtype.h"
#include "cache/spec.h"

namespace kvmesh {
namespace testutil {

// Rotates `row` ([num_heads][head_dim], float64) by `delta` positions in place.
inline void ReferenceRopeShift(const RopeSpec& rope, int num_heads, int head_dim, int64_t delta,
                               std::vector<double>* row) {
  if (rope.type == RopeType::kNone || delta == 0) return;
  const int half = rope.dims / 2;
  for (int h = 0; h < num_heads; ++h) {
    double* x = row->data() + static_cast<size_t>(h) * head_dim;
    for (int i = 0; i < half; ++i) {
      const double theta = static_cast<double>(delta) * static_cast<double>(rope.freq_scale) *
                           std::pow(static_cast<double>(rope.base), -2.0 * i / rope.dims);
      const int a = rope.type == RopeType::kNormal ? 2 * i : i;
      const int b = rope.type == RopeType::kNormal ? 2 * i + 1 : i + half;
      const double x0 = x[a];
      const double x1 = x[b];
      x[a] = x0 * std::cos(theta) - x1 * std::sin(theta);
      x[b] = x0 * std::sin(theta) + x1 * std::cos(theta);
    }
  }
}

// Tolerance of one rounded RoPE shift, relative to the magnitude of the rotated values: float32
// arithmetic plus one rounding to the dtype. Shifts accumulate: allow k times this after k.
inline double RopeTolerancePerShift(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 1e-4;
    case DType::kF16:
      return 2e-3;
    case DType::kBF16:
      return 1.6e-2;
  }
  return 0;
}

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_UNIT_ROPE_REFERENCE_H_
