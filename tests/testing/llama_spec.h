// The Llama-3-8B KV shape that benchmarks and demos measure: 32 full-attention layers, 8 KV
// heads, head dim 128, F16, NEOX RoPE over 128 dims with base 500000 (128 KiB per token).
#ifndef KVMESH_TESTS_TESTING_LLAMA_SPEC_H_
#define KVMESH_TESTS_TESTING_LLAMA_SPEC_H_

#include <string>

#include "cache/spec.h"

namespace kvmesh {
namespace testutil {

inline CacheSpec Llama3_8BSpec(const std::string& name, int32_t max_sequences, int32_t capacity,
                               int32_t max_batch) {
  CacheSpec spec;
  spec.name = name;
  spec.dtype = DType::kF16;
  spec.max_sequences = max_sequences;
  spec.capacity = capacity;
  spec.max_batch = max_batch;
  GroupSpec group;
  group.num_layers = 32;
  group.kind = GroupKind::kAttention;
  group.attention.num_kv_heads = 8;
  group.attention.head_dim_k = 128;
  group.attention.head_dim_v = 128;
  group.attention.window.kind = WindowKind::kFull;
  group.attention.rope.type = RopeType::kNeox;
  group.attention.rope.dims = 128;
  group.attention.rope.base = 500000.0f;
  group.attention.rope.freq_scale = 1.0f;
  spec.groups.push_back(group);
  return spec;
}

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_TESTING_LLAMA_SPEC_H_
