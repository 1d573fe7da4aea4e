#include "cache/prefix_index.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kvmesh {

const TokenChain* PrefixIndex::Find(int64_t seq) const {
  auto it = chains_.find(seq);
  return it == chains_.end() ? nullptr : &it->second;
}

TokenChain* PrefixIndex::FindMutable(int64_t seq) {
  auto it = chains_.find(seq);
  return it == chains_.end() ? nullptr : &it->second;
}

void PrefixIndex::RecordAppend(absl::Span<const Token> tokens, bool speculative) {
  int64_t last_seq = -1;
  TokenChain* chain = nullptr;
  for (const Token& t : tokens) {
    if (t.seq != last_seq) {
      last_seq = t.seq;
      auto it = chains_.find(t.seq);
      if (it == chains_.end() && t.id != kNoTokenId && t.pos == 0) {
        it = chains_.emplace(t.seq, TokenChain()).first;
      }
      chain = it == chains_.end() ? nullptr : &it->second;
    }
    if (chain != nullptr) chain->Stored(t.pos, t.id, speculative, token_limit_);
  }
}

std::optional<PrefixIndex::BlocksChange> PrefixIndex::Sync(int64_t seq, bool live, int32_t offset) {
  auto it = chains_.find(seq);
  if (it == chains_.end()) return std::nullopt;
  if (!live) return Drop(seq);
  TokenChain& chain = it->second;
  chain.Truncate(offset);
  std::vector<uint64_t> dropped;
  const size_t kept = chain.Rehash(hasher_, &dropped);
  const absl::Span<const uint64_t> added = absl::MakeConstSpan(chain.hashes()).subspan(kept);
  block_index_.Remove(seq, dropped);
  block_index_.Add(seq, added);
  std::optional<BlocksChange> change;
  if (!dropped.empty() || !added.empty()) {
    change = BlocksChange{static_cast<int32_t>(kept), {added.begin(), added.end()}};
  }
  if (chain.empty()) chains_.erase(it);  // no ids, so no hashes: no block changes
  return change;
}

std::optional<PrefixIndex::BlocksChange> PrefixIndex::Set(int64_t seq, TokenChain chain) {
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
  if (!had_blocks && hashes.empty()) return std::nullopt;
  return BlocksChange{0, hashes};
}

std::optional<PrefixIndex::BlocksChange> PrefixIndex::Drop(int64_t seq) {
  auto it = chains_.find(seq);
  if (it == chains_.end()) return std::nullopt;
  const bool had_blocks = !it->second.hashes().empty();
  block_index_.Remove(seq, it->second.hashes());
  chains_.erase(it);
  if (!had_blocks) return std::nullopt;
  return BlocksChange{};
}

absl::StatusOr<std::vector<uint64_t>> PrefixIndex::PromptHashes(const TokenHasher& hasher,
                                                                int32_t token_limit,
                                                                absl::Span<const int32_t> tokens) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "] = ", tokens[i], " is negative"));
    }
  }
  tokens = tokens.subspan(0, std::min(tokens.size(), static_cast<size_t>(token_limit)));
  const size_t b = static_cast<size_t>(hasher.block_size);
  std::vector<uint64_t> hashes(tokens.size() / b);
  for (size_t i = 0; i < hashes.size(); ++i) {
    hashes[i] = hasher.Block(i == 0 ? hasher.seed : hashes[i - 1], tokens.subspan(i * b, b));
  }
  return hashes;
}

std::vector<std::pair<int64_t, int32_t>> PrefixIndex::Lookup(absl::Span<const int32_t> tokens,
                                                             absl::Span<const uint64_t> hashes,
                                                             int max_matches) const {
  // No chain holds ids past the limit, so no match reaches past it.
  tokens = tokens.subspan(0, std::min(tokens.size(), static_cast<size_t>(token_limit_)));
  const size_t b = static_cast<size_t>(hasher_.block_size);
  std::vector<std::pair<int64_t, int32_t>> matches;
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
      matches.emplace_back(seq, static_cast<int32_t>(length));
    }
  }
  std::sort(matches.begin(), matches.end(), [](const auto& x, const auto& y) {
    return x.second != y.second ? x.second > y.second : x.first < y.first;
  });
  if (matches.size() > static_cast<size_t>(max_matches)) matches.resize(max_matches);
  return matches;
}

TokenIndexStats PrefixIndex::Stats() const {
  TokenIndexStats stats;
  stats.sequences = chains_.size();
  stats.hashes = block_index_.hashes();
  stats.entries = block_index_.entries();
  stats.bytes = block_index_.bytes();
  return stats;
}

void PrefixIndex::ForEachWithBlocks(
    absl::FunctionRef<void(int64_t seq, const TokenChain& chain)> visit) const {
  for (const auto& [seq, chain] : chains_) {
    if (!chain.hashes().empty()) visit(seq, chain);
  }
}

}  // namespace kvmesh
