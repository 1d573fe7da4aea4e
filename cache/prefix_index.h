// PrefixIndex: the token ids each sequence of one cache was given (its token chain,
// cache/token_chain.h), which sequences hold each block hash of those chains (a BlockIndex), and
// the prefix lookup over both.
//
// It knows which ids a sequence was given, not what the sequence stores: the Cache brings a
// chain in line with the sequence's offset (Sync) after every change to it, and makes matches of
// the sequences a lookup finds. Every change of a chain's block hashes is returned as a
// BlocksChange for the Cache to publish, so that watchers mirror the index exactly.
//
// Thread safety: none; the Cache guards it with its lock.
#ifndef KVMESH_CACHE_PREFIX_INDEX_H_
#define KVMESH_CACHE_PREFIX_INDEX_H_

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/block_index.h"
#include "cache/token_chain.h"
#include "cache/types.h"

namespace kvmesh {

class PrefixIndex {
 public:
  // Chains hold at most `token_limit` ids; blocks are hashed with `hasher`.
  PrefixIndex(const TokenHasher& hasher, int32_t token_limit)
      : hasher_(hasher), token_limit_(token_limit) {}
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  // A change of one sequence's block hashes: its first `kept` hashes stay, `added` follow them,
  // the rest are gone (a dropped chain: none kept, none added).
  struct BlocksChange {
    int32_t kept = 0;
    std::vector<uint64_t> added;
  };

  // seq's chain; null when it has none.
  const TokenChain* Find(int64_t seq) const;
  // seq's chain to change in place (its ids: TokenChain's mutations), then Sync; null when it
  // has none.
  TokenChain* FindMutable(int64_t seq);

  // Records the token ids an Append stored (`tokens`, grouped by sequence); a chain starts with
  // an id given at position 0. `speculative`: the tokens are pending. Sync each sequence next.
  void RecordAppend(absl::Span<const Token> tokens, bool speculative);
  // Brings seq's chain in line with what seq stores now: dropped when it stores nothing
  // (`live` false), else cut at `offset` and rehashed, the block index following. The change of
  // its block hashes, if any.
  std::optional<BlocksChange> Sync(int64_t seq, bool live, int32_t offset);
  // Replaces seq's chain by `chain` (hashed), with all its hashes returned as added when it or
  // the chain it replaces has any. Sync next.
  std::optional<BlocksChange> Set(int64_t seq, TokenChain chain);
  // Drops seq's chain; a change when it had block hashes.
  std::optional<BlocksChange> Drop(int64_t seq);

  // The hashes of the whole blocks of `tokens` as an index of `hasher` and `token_limit` keeps
  // them (ids past the limit not counted). INVALID_ARGUMENT naming a negative id.
  static absl::StatusOr<std::vector<uint64_t>> PromptHashes(const TokenHasher& hasher,
                                                            int32_t token_limit,
                                                            absl::Span<const int32_t> tokens);
  // Up to `max_matches` sequences sharing the longest prefixes with `tokens` (whose block
  // hashes are `hashes`), as (seq, length of the common prefix compared id by id), longest
  // first, then by seq. A prompt many sequences share is answered from its first candidates
  // (a budget of max(64, 4 * max_matches) comparisons).
  std::vector<std::pair<int64_t, int32_t>> Lookup(absl::Span<const int32_t> tokens,
                                                  absl::Span<const uint64_t> hashes,
                                                  int max_matches) const;

  TokenIndexStats Stats() const;
  // Calls `visit` for every sequence whose chain holds block hashes, in no particular order.
  void ForEachWithBlocks(absl::FunctionRef<void(int64_t seq, const TokenChain& chain)> visit) const;

 private:
  const TokenHasher hasher_;
  const int32_t token_limit_;
  // Never an empty chain.
  absl::flat_hash_map<int64_t, TokenChain> chains_;
  BlockIndex block_index_;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_PREFIX_INDEX_H_
