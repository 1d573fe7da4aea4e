#include "cache/token_chain.h"

#include <algorithm>
#include <cstring>
#include <string>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvmesh {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "block hashes read token ids as little-endian 32-bit values in place");

uint64_t TokenHasher::Block(uint64_t previous, absl::Span<const int32_t> ids) const {
  const uint64_t hash = XXH3_64bits_withSeed(ids.data(), ids.size() * sizeof(int32_t), previous);
  return bits >= 64 ? hash : hash & ((uint64_t{1} << bits) - 1);
}

uint64_t TokenHashSeed(absl::string_view tenant, absl::string_view cache_name) {
  std::string key;
  key.reserve(tenant.size() + 1 + cache_name.size());
  key.append(tenant.data(), tenant.size());
  key.push_back('\0');
  key.append(cache_name.data(), cache_name.size());
  return XXH3_64bits(key.data(), key.size());
}

TokenChain::TokenChain(const TokenIds& tokens, const TokenHasher& hasher)
    : ids_(tokens.ids), settled_(static_cast<int32_t>(tokens.ids.size())), taint_(tokens.taint) {
  Rehash(hasher);
}

TokenIds TokenIds::Prefix(int32_t length) const {
  TokenIds out;
  const size_t n = std::min(ids.size(), static_cast<size_t>(std::max(length, 0)));
  out.ids.assign(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(n));
  if (taint < length) out.taint = taint;
  return out;
}

TokenIds TokenChain::Prefix(int32_t length) const {
  TokenIds out;
  const size_t n = static_cast<size_t>(std::min(settled_, std::max(length, 0)));
  out.ids.assign(ids_.begin(), ids_.begin() + static_cast<ptrdiff_t>(n));
  if (taint_ < length) out.taint = taint_;
  return out;
}

TokenChain TokenChain::CopyPrefix(int32_t length) const {
  TokenChain out;
  const int32_t n = std::min(settled_, std::max(length, 0));
  out.ids_.assign(ids_.begin(), ids_.begin() + n);
  out.settled_ = n;
  if (taint_ < length) out.taint_ = taint_;
  // The source's hashes of blocks below n are the copy's; Rehash drops the others.
  out.hashes_ = hashes_;
  out.unchanged_ = n;
  return out;
}

void TokenChain::Stored(int32_t pos, int32_t id, bool pending, int32_t limit) {
  const int32_t size = static_cast<int32_t>(ids_.size());
  if (pos < size) {
    // A position below the known ids was stored again (a sliding window's pruned position):
    // the ids from it on go. Later positions that are still stored have no id now, so the
    // chain cannot grow past them: what they saw at `pos` was something else.
    ids_.resize(pos);
    settled_ = std::min(settled_, pos);
    Invalidate(pos);
  }
  if (id == kNoTokenId || pos != static_cast<int32_t>(ids_.size()) || pos >= limit) return;
  ids_.push_back(id);
  if (!pending && settled_ == pos) settled_ = pos + 1;
}

void TokenChain::Settle(int32_t end) {
  if (end < static_cast<int32_t>(ids_.size())) {
    ids_.resize(std::max(end, 0));
    Invalidate(end);
  }
  settled_ = static_cast<int32_t>(ids_.size());
}

void TokenChain::Truncate(int32_t end) {
  if (end < static_cast<int32_t>(ids_.size())) {
    ids_.resize(std::max(end, 0));
    Invalidate(end);
  }
  settled_ = std::min(settled_, static_cast<int32_t>(ids_.size()));
  if (taint_ >= end) taint_ = kNoTaint;
}

void TokenChain::Erase(int32_t begin, int32_t end) {
  const int32_t size = static_cast<int32_t>(ids_.size());
  if (begin < size) {
    ids_.erase(ids_.begin() + begin, ids_.begin() + std::min(end, size));
    settled_ = static_cast<int32_t>(ids_.size());
    Invalidate(begin);
  }
  Taint(begin);
}

void TokenChain::Taint(int32_t pos) { taint_ = std::min(taint_, pos); }

size_t TokenChain::Rehash(const TokenHasher& hasher, std::vector<uint64_t>* dropped) {
  const size_t b = static_cast<size_t>(hasher.block_size);
  const size_t blocks = static_cast<size_t>(exact()) / b;
  const size_t kept = std::min({hashes_.size(), static_cast<size_t>(unchanged_) / b, blocks});
  if (dropped != nullptr) dropped->assign(hashes_.begin() + kept, hashes_.end());
  hashes_.resize(kept);
  while (hashes_.size() < blocks) {
    const size_t i = hashes_.size();
    const uint64_t previous = i == 0 ? hasher.seed : hashes_[i - 1];
    hashes_.push_back(hasher.Block(previous, absl::MakeConstSpan(ids_.data() + i * b, b)));
  }
  unchanged_ = static_cast<int32_t>(ids_.size());
  return kept;
}

}  // namespace kvmesh
