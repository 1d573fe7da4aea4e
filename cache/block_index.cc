#include "cache/block_index.h"

#include <algorithm>

namespace kvmesh {

void BlockIndex::Add(int64_t seq, absl::Span<const uint64_t> hashes) {
  for (uint64_t hash : hashes) {
    Holders& holders = map_[hash];
    if (holders.size() == 1) spilled_ += 2;  // the list leaves its inline slot
    if (holders.size() > 1) ++spilled_;
    holders.push_back(seq);
    ++entries_;
  }
}

void BlockIndex::Remove(int64_t seq, absl::Span<const uint64_t> hashes) {
  for (uint64_t hash : hashes) {
    auto it = map_.find(hash);
    if (it == map_.end()) continue;
    Holders& holders = it->second;
    auto found = std::find(holders.begin(), holders.end(), seq);
    if (found == holders.end()) continue;
    *found = holders.back();
    holders.pop_back();
    --entries_;
    if (holders.size() == 1) {
      spilled_ -= 2;
    } else if (holders.size() > 1) {
      --spilled_;
    }
    if (holders.empty()) map_.erase(it);
  }
}

const BlockIndex::Holders* BlockIndex::Find(uint64_t hash) const {
  auto it = map_.find(hash);
  return it == map_.end() ? nullptr : &it->second;
}

size_t BlockIndex::bytes() const {
  // A slot holds the key and an inline list; flat_hash_map adds a control byte per slot.
  const size_t slot = sizeof(uint64_t) + sizeof(Holders) + 1;
  return map_.capacity() * slot + spilled_ * sizeof(int64_t);
}

}  // namespace kvmesh
