// The Cache's token chains, block index and prefix lookup, and the events it publishes
// (cache/cache.h, "Where things live").
#include "cache/cache.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cache/attention_group.h"
#include "cache/cache_internal.h"
#include "cache/layer_group.h"
#include "cache/recurrent_group.h"
#include "cache/rotating_group.h"
#include "cache/shortage.h"
#include "cache/snapshot_wire.h"
#include "cache/status_macros.h"

namespace kvmesh {

using cache_internal::CheckNonNegative;

void Cache::RecordTokensLocked(const AppendBatch& batch) {
  int64_t last_seq = -1;
  TokenChain* chain = nullptr;
  for (const Token& t : batch.tokens) {
    if (t.seq != last_seq) {
      last_seq = t.seq;
      auto it = chains_.find(t.seq);
      if (it == chains_.end() && t.id != kNoTokenId && t.pos == 0) {
        it = chains_.emplace(t.seq, TokenChain()).first;
      }
      chain = it == chains_.end() ? nullptr : &it->second;
    }
    if (chain != nullptr) chain->Stored(t.pos, t.id, batch.speculative, token_limit_);
  }
  for (int64_t seq : batch.seqs) SyncTokensLocked(seq);
  TouchLocked(batch.seqs);
}

void Cache::SyncTokensLocked(int64_t seq) {
  auto it = chains_.find(seq);
  if (it == chains_.end()) return;
  TokenChain& chain = it->second;
  if (!IsLiveLocked(seq)) return DropChainLocked(seq);
  chain.Truncate(OffsetLocked(seq));
  std::vector<uint64_t> dropped;
  const size_t kept = chain.Rehash(hasher_, &dropped);
  const absl::Span<const uint64_t> added = absl::MakeConstSpan(chain.hashes()).subspan(kept);
  block_index_.Remove(seq, dropped);
  block_index_.Add(seq, added);
  if (!dropped.empty() || !added.empty()) {
    Event event;
    event.kind = EventKind::kBlocks;
    event.seq = seq;
    event.offset = OffsetLocked(seq);
    event.kept_blocks = static_cast<int32_t>(kept);
    event.block_hashes.assign(added.begin(), added.end());
    PublishLocked(std::move(event));
  }
  if (chain.empty()) DropChainLocked(seq);
}

void Cache::SetChainLocked(int64_t seq, TokenChain chain) {
  auto it = chains_.find(seq);
  bool had_blocks = false;
  if (it == chains_.end()) {
    it = chains_.emplace(seq, std::move(chain)).first;
  } else {
    had_blocks = !it->second.hashes().empty();
    block_index_.Remove(seq, it->second.hashes());
    it->second = std::move(chain);
  }
  const std::vector<uint64_t>& hashes = it->second.hashes();
  block_index_.Add(seq, hashes);
  if (had_blocks || !hashes.empty()) {
    Event event;
    event.kind = EventKind::kBlocks;
    event.seq = seq;
    event.offset = OffsetLocked(seq);
    event.block_hashes = hashes;
    PublishLocked(std::move(event));
  }
  SyncTokensLocked(seq);
}

void Cache::DropChainLocked(int64_t seq) {
  auto it = chains_.find(seq);
  if (it == chains_.end()) return;
  const bool had_blocks = !it->second.hashes().empty();
  block_index_.Remove(seq, it->second.hashes());
  chains_.erase(it);
  if (had_blocks) {
    Event event;
    event.kind = EventKind::kBlocks;
    event.seq = seq;
    event.offset = OffsetLocked(seq);
    PublishLocked(std::move(event));
  }
}

TokenChain Cache::Tokens(int64_t seq) const {
  ReaderMutexLock lock(&mu_);
  auto it = chains_.find(seq);
  return it == chains_.end() ? TokenChain() : it->second;
}

absl::StatusOr<std::vector<PrefixMatch>> Cache::LookupPrefix(absl::Span<const int32_t> tokens,
                                                             int max_matches) const {
  if (max_matches < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_matches = ", max_matches, " is below 1"));
  }
  ASSIGN_OR_RETURN(const std::vector<uint64_t> hashes, PromptHashes(tokens));
  // No chain holds ids past the limit, so no match reaches past it.
  tokens = tokens.subspan(0, std::min(tokens.size(), static_cast<size_t>(token_limit_)));
  const size_t b = static_cast<size_t>(hasher_.block_size);
  std::vector<PrefixMatch> matches;
  ReaderMutexLock lock(&mu_);
  // Every block of a real match is in the index, so the match ends before the first block that
  // is not; a collision can only make `depth` larger, and verification sorts that out.
  size_t depth = 0;
  while (depth < hashes.size() && block_index_.Find(hashes[depth]) != nullptr) ++depth;
  // Level by level from the deepest: a sequence that really holds block `level` (and not the
  // next, or it would have been met a level deeper) matches [(level + 1) * b, (level + 2) * b)
  // tokens, so whole levels come in order of length, and the longest max_matches are among the
  // levels visited until that many matched. Each candidate costs a comparison of up to the
  // prompt's length: a prompt that many sequences share is answered from the first `budget`
  // candidates.
  // Within a level, the holders are ranked by how far they go past the level's blocks (at most
  // b - 1 ids compared each), and only those taken are compared from position 0.
  int64_t budget = std::max<int64_t>(64, int64_t{4} * max_matches);
  absl::flat_hash_set<int64_t> seen;
  std::vector<std::pair<size_t, int64_t>> ranked;  // (length if the blocks match, seq)
  for (size_t level = depth;
       level-- > 0 && budget > 0 && matches.size() < static_cast<size_t>(max_matches);) {
    const size_t base = (level + 1) * b;
    ranked.clear();
    for (int64_t seq : *block_index_.Find(hashes[level])) {
      // A sequence matched a level deeper holds this block too: it costs nothing here.
      if (seen.contains(seq)) continue;
      if (budget-- <= 0) break;
      const TokenChain& chain = chains_.at(seq);
      const size_t n = std::min(tokens.size(), static_cast<size_t>(chain.exact()));
      if (n < base) continue;  // its chain ends before this block: a collision
      const size_t tail = static_cast<size_t>(
          std::mismatch(tokens.begin() + base, tokens.begin() + n, chain.ids().begin() + base)
              .first -
          (tokens.begin() + base));
      ranked.emplace_back(base + tail, seq);
    }
    std::sort(ranked.begin(), ranked.end(), [](const auto& x, const auto& y) {
      return x.first != y.first ? x.first > y.first : x.second < y.second;
    });
    for (const auto& [length, seq] : ranked) {
      if (matches.size() >= static_cast<size_t>(max_matches)) break;
      // The index lists a sequence once per time it holds a hash: twice only by a collision.
      if (seen.contains(seq)) continue;
      // The blocks themselves, id by id: a hash that collided leaves the sequence to the
      // levels below, where it may really match.
      const TokenChain& chain = chains_.at(seq);
      if (!std::equal(tokens.begin(), tokens.begin() + base, chain.ids().begin())) continue;
      seen.insert(seq);
      PrefixMatch match;
      match.seq = seq;
      match.length = static_cast<int32_t>(length);
      match.offset = OffsetLocked(seq);
      match.can_resume = true;
      for (const auto& group : groups_) match.can_resume &= group->CanResume(seq, match.length);
      matches.push_back(match);
    }
  }
  std::sort(matches.begin(), matches.end(), [](const PrefixMatch& x, const PrefixMatch& y) {
    return x.length != y.length ? x.length > y.length : x.seq < y.seq;
  });
  if (matches.size() > static_cast<size_t>(max_matches)) matches.resize(max_matches);
  return matches;
}

absl::StatusOr<std::vector<uint64_t>> Cache::PromptHashes(absl::Span<const int32_t> tokens) const {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "] = ", tokens[i], " is negative"));
    }
  }
  tokens = tokens.subspan(0, std::min(tokens.size(), static_cast<size_t>(token_limit_)));
  const size_t b = static_cast<size_t>(hasher_.block_size);
  std::vector<uint64_t> hashes(tokens.size() / b);
  for (size_t i = 0; i < hashes.size(); ++i) {
    hashes[i] = hasher_.Block(i == 0 ? hasher_.seed : hashes[i - 1], tokens.subspan(i * b, b));
  }
  return hashes;
}

TokenIndexStats Cache::TokenIndex() const {
  ReaderMutexLock lock(&mu_);
  TokenIndexStats stats;
  stats.sequences = chains_.size();
  stats.hashes = block_index_.hashes();
  stats.entries = block_index_.entries();
  stats.bytes = block_index_.bytes();
  return stats;
}

void Cache::DetachEvents(Event last) {
  MutexLock lock(&mu_);
  if (events_ == nullptr) return;
  events_->Publish(std::move(last));
  events_ = nullptr;
}

void Cache::PublishLocked(Event event) {
  if (events_ == nullptr) return;
  event.tenant = tenant_;
  event.cache = spec_.name;
  if (event.kind == EventKind::kBlocks) event.token_block_size = spec_.token_block_size;
  last_event_ = events_->Publish(std::move(event));
}

ChainListing Cache::ListChains() const {
  ReaderMutexLock lock(&mu_);
  ChainListing listing;
  listing.last_event = last_event_;
  listing.sequences.reserve(chains_.size());
  for (const auto& [seq, chain] : chains_) {
    if (chain.hashes().empty()) continue;
    listing.sequences.push_back({seq, OffsetLocked(seq), chain.hashes()});
  }
  std::sort(listing.sequences.begin(), listing.sequences.end(),
            [](const SequenceBlocks& a, const SequenceBlocks& b) { return a.seq < b.seq; });
  return listing;
}

}  // namespace kvmesh
