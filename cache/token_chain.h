// TokenChain: the token ids a sequence was given and the chain of hashes over their blocks
// (docs/api.md#tokens), which is what a prefix lookup matches a prompt against.
//
// A sequence's ids are known for the positions [0, ids().size()): an Append that carries the id
// of the position just past them extends them; one that does not (or leaves a gap) ends them
// until a Remove truncates back. Of those positions, the first exact() hold K/V computed from
// ids()[0, exact()) and nothing else, as a prefill of those tokens would compute them: that
// excludes pending speculative tokens, and positions from the taint() on, the first position
// whose K/V saw something other than the ids before it (a Remove that moved later positions
// down, a Restore of data computed after a different prefix). Only exact positions are shared
// by hash: hashes()[b] covers block b, ids [b * block_size, (b + 1) * block_size), for every
// block that lies wholly below exact(). hashes()[0] is seeded by the cache's tenant and name,
// and hashes()[b] by hashes()[b - 1], so equal hashes mean equal prefixes (up to collisions,
// which a lookup rules out by comparing the ids).
//
// Thread safety: plain values; the cache guards them with its lock.
#ifndef KVMESH_CACHE_TOKEN_CHAIN_H_
#define KVMESH_CACHE_TOKEN_CHAIN_H_

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvmesh {

// The tenant of a node that has no tenants, and of the calls that name none.
inline constexpr char kDefaultTenant[] = "default";

// A Token without a token id.
inline constexpr int32_t kNoTokenId = -1;
// A chain without a taint.
inline constexpr int32_t kNoTaint = INT32_MAX;

// Computes block hashes: XXH3 (64 bit) of a block's ids as little-endian 32-bit values, seeded
// with the previous block's hash, or for block 0 with the seed.
struct TokenHasher {
  uint64_t seed = 0;
  int32_t block_size = 16;
  // Test hook: only the low `bits` bits of every hash are kept (64: all), so that tests can
  // force collisions.
  int bits = 64;

  uint64_t Block(uint64_t previous, absl::Span<const int32_t> ids) const;
};

// The seed of a cache's chains: XXH3 of "<tenant>\0<cache name>". Equal prompts in caches of
// different tenants (or names) never share a hash chain; the same cache name of one tenant on
// two nodes does, which is what a cluster-wide lookup needs.
uint64_t TokenHashSeed(absl::string_view tenant, absl::string_view cache_name);

// The ids a snapshot keeps of its sequence: those of positions [0, ids.size()), none pending,
// and the taint then (kNoTaint: none).
struct TokenIds {
  std::vector<int32_t> ids;
  int32_t taint = kNoTaint;
  // The ids of positions below `length`, and the taint if below it.
  TokenIds Prefix(int32_t length) const;
  bool operator==(const TokenIds& other) const { return ids == other.ids && taint == other.taint; }
};

class TokenChain {
 public:
  TokenChain() = default;
  // A chain of `tokens`' ids, all settled, hashed with `hasher`.
  TokenChain(const TokenIds& tokens, const TokenHasher& hasher);

  const std::vector<int32_t>& ids() const { return ids_; }
  // Ids that are not pending speculative tokens: ids()[0, settled()).
  int32_t settled() const { return settled_; }
  int32_t taint() const { return taint_; }
  int32_t exact() const { return settled_ < taint_ ? settled_ : taint_; }
  const std::vector<uint64_t>& hashes() const { return hashes_; }
  // Whether the chain says nothing: no ids and no taint.
  bool empty() const { return ids_.empty() && taint_ == kNoTaint; }

  // The settled ids of positions below `length`, and the taint if below it.
  TokenIds Prefix(int32_t length) const;
  // The chain of a copy of positions below `length` (CopyPrefix's destination): settled ids
  // only. Rehash before use.
  TokenChain CopyPrefix(int32_t length) const;

  // An Append stored position `pos`, with token id `id` (kNoTokenId: none given). The id extends
  // the chain when pos is just past its ids and there are fewer than `limit`; a position below
  // them replaces what was there, so the ids from it on go. `pending`: a speculative token.
  void Stored(int32_t pos, int32_t id, bool pending, int32_t limit);
  // Pending ids below `end` settle (CommitSpeculation); those from `end` on go.
  void Settle(int32_t end);
  // Positions from `end` on are gone: their ids go, and the taint with them if it lies there.
  void Truncate(int32_t end);
  // Positions [begin, end) are gone and those after moved down by end - begin (a Remove with a
  // shift): their ids move with them, and the taint becomes begin at the latest, since what
  // moved was computed with the removed positions before it.
  void Erase(int32_t begin, int32_t end);
  // Positions from `pos` on were computed after something other than the ids before them.
  void Taint(int32_t pos);
  // Brings hashes() up to date after the mutations above. Returns how many of the hashes it had
  // before are still there (they stay first); `dropped`, when given, receives the others.
  size_t Rehash(const TokenHasher& hasher, std::vector<uint64_t>* dropped = nullptr);

 private:
  // The ids from `pos` on changed: hashes of blocks reaching it are stale.
  void Invalidate(int32_t pos) { unchanged_ = pos < unchanged_ ? pos : unchanged_; }

  std::vector<int32_t> ids_;
  int32_t settled_ = 0;
  int32_t taint_ = kNoTaint;
  std::vector<uint64_t> hashes_;
  // Ids below this position have not changed since hashes_ was last brought up to date.
  int32_t unchanged_ = 0;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_TOKEN_CHAIN_H_
