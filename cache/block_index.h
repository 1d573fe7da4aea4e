// BlockIndex: which sequences of a cache hold each block hash of their token chains
// (cache/token_chain.h), so that a prefix lookup finds the sequences that share a prompt's
// blocks without walking every sequence.
//
// A hash maps to the sequences whose chains hold it, once per time they hold it (a sequence
// holds the same hash twice only through a collision). The index says nothing a chain does not:
// a lookup verifies every candidate against its chain.
//
// Thread safety: none; the cache guards it with its lock.
#ifndef KVMESH_CACHE_BLOCK_INDEX_H_
#define KVMESH_CACHE_BLOCK_INDEX_H_

#include <cstddef>
#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/types/span.h"

namespace kvmesh {

class BlockIndex {
 public:
  using Holders = absl::InlinedVector<int64_t, 1>;

  // `seq` holds (or no longer holds) each of `hashes`.
  void Add(int64_t seq, absl::Span<const uint64_t> hashes);
  void Remove(int64_t seq, absl::Span<const uint64_t> hashes);

  // The sequences that hold `hash`, in no particular order; null when none.
  const Holders* Find(uint64_t hash) const;

  // Distinct hashes, and (hash, sequence) entries.
  size_t hashes() const { return map_.size(); }
  size_t entries() const { return entries_; }
  // Host bytes the index takes, roughly: its table and the holder lists that outgrew it.
  size_t bytes() const;

 private:
  absl::flat_hash_map<uint64_t, Holders> map_;
  size_t entries_ = 0;
  size_t spilled_ = 0;  // holders in lists that left their inline storage
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_BLOCK_INDEX_H_
