// TokenChain on its own: which ids it keeps, where its exact prefix ends, and that its hashes
// after any sequence of changes are those of a chain built from scratch from the same ids.
#include "cache/token_chain.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvmesh {
namespace {

TokenHasher Hasher(int32_t block_size = 4, int bits = 64) {
  TokenHasher h;
  h.seed = TokenHashSeed("default", "m");
  h.block_size = block_size;
  h.bits = bits;
  return h;
}

// The hashes a chain of `ids` with exact prefix `exact` must have, computed block by block.
std::vector<uint64_t> Expected(const TokenHasher& h, const std::vector<int32_t>& ids,
                               int32_t exact) {
  std::vector<uint64_t> out;
  for (int32_t b = 0; (b + 1) * h.block_size <= exact; ++b) {
    const uint64_t previous = b == 0 ? h.seed : out.back();
    out.push_back(h.Block(previous, absl::MakeConstSpan(ids.data() + b * h.block_size,
                                                        static_cast<size_t>(h.block_size))));
  }
  return out;
}

TokenChain Chain(const std::vector<int32_t>& ids, const TokenHasher& h) {
  TokenChain chain;
  for (size_t p = 0; p < ids.size(); ++p) {
    chain.Stored(static_cast<int32_t>(p), ids[p], false, INT32_MAX);
  }
  chain.Rehash(h);
  return chain;
}

TEST(TokenChainTest, ContiguousIdsFromZeroAreKeptAndHashedByWholeBlocks) {
  const TokenHasher h = Hasher();
  const std::vector<int32_t> ids = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
  TokenChain chain = Chain(ids, h);
  EXPECT_EQ(chain.ids(), ids);
  EXPECT_EQ(chain.exact(), 10);
  ASSERT_EQ(chain.hashes().size(), 2u);  // blocks [0,4) and [4,8); [8,10) is not whole
  EXPECT_EQ(chain.hashes(), Expected(h, ids, 10));
  // A position without an id ends the chain; ids after it are not kept.
  chain.Stored(10, kNoTokenId, false, INT32_MAX);
  chain.Stored(11, 3, false, INT32_MAX);
  chain.Rehash(h);
  EXPECT_EQ(chain.ids().size(), 10u);
  // So does a gap.
  TokenChain gap = Chain({1, 2}, h);
  gap.Stored(3, 4, false, INT32_MAX);
  EXPECT_EQ(gap.ids().size(), 2u);
  // And the limit.
  TokenChain limited;
  for (int32_t p = 0; p < 6; ++p) limited.Stored(p, p, false, 5);
  EXPECT_EQ(limited.ids().size(), 5u);
}

TEST(TokenChainTest, TheSeedSeparatesTenantsAndCaches) {
  EXPECT_NE(TokenHashSeed("a", "m"), TokenHashSeed("b", "m"));
  EXPECT_NE(TokenHashSeed("a", "m"), TokenHashSeed("a", "n"));
  // The separator keeps "ab"+"c" apart from "a"+"bc".
  EXPECT_NE(TokenHashSeed("ab", "c"), TokenHashSeed("a", "bc"));
  TokenHasher other = Hasher();
  other.seed = TokenHashSeed("other", "m");
  const std::vector<int32_t> ids = {1, 2, 3, 4};
  EXPECT_NE(Chain(ids, Hasher()).hashes(), Chain(ids, other).hashes());
  // Equal ids and seed: equal hashes, on every node (the function is fixed: XXH3).
  EXPECT_EQ(Chain(ids, Hasher()).hashes(), Chain(ids, Hasher()).hashes());
}

TEST(TokenChainTest, AnEraseTaintsWhatMovedAndTruncationClearsIt) {
  const TokenHasher h = Hasher();
  TokenChain chain = Chain({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, h);
  chain.Erase(5, 7);  // [5, 7) removed; 7.. move down to 5..
  chain.Rehash(h);
  EXPECT_EQ(chain.ids(), (std::vector<int32_t>{0, 1, 2, 3, 4, 7, 8, 9, 10, 11}));
  EXPECT_EQ(chain.taint(), 5);
  EXPECT_EQ(chain.exact(), 5);
  EXPECT_EQ(chain.hashes(), Expected(h, chain.ids(), 5));  // one block: [0, 4)
  // Positions appended after it saw the moved ones: still not exact.
  chain.Stored(10, 42, false, INT32_MAX);
  chain.Rehash(h);
  EXPECT_EQ(chain.exact(), 5);
  // Truncating below the taint drops every moved position: exact again as the ids grow.
  chain.Truncate(5);
  EXPECT_EQ(chain.taint(), kNoTaint);
  for (int32_t p = 5; p < 9; ++p) chain.Stored(p, 100 + p, false, INT32_MAX);
  chain.Rehash(h);
  EXPECT_EQ(chain.exact(), 9);
  EXPECT_EQ(chain.hashes(), Expected(h, chain.ids(), 9));
}

TEST(TokenChainTest, PendingIdsAreNotExactUntilSettled) {
  const TokenHasher h = Hasher();
  TokenChain chain = Chain({1, 2, 3}, h);
  for (int32_t p = 3; p < 8; ++p) chain.Stored(p, 10 + p, /*pending=*/true, INT32_MAX);
  chain.Rehash(h);
  EXPECT_EQ(chain.ids().size(), 8u);
  EXPECT_EQ(chain.settled(), 3);
  EXPECT_EQ(chain.exact(), 3);
  EXPECT_TRUE(chain.hashes().empty());
  EXPECT_EQ(chain.Prefix(8).ids.size(), 3u);  // what a snapshot keeps: settled ids only
  chain.Settle(6);                            // three of the five accepted
  chain.Rehash(h);
  EXPECT_EQ(chain.ids(), (std::vector<int32_t>{1, 2, 3, 13, 14, 15}));
  EXPECT_EQ(chain.exact(), 6);
  EXPECT_EQ(chain.hashes(), Expected(h, chain.ids(), 6));
}

TEST(TokenChainTest, APositionStoredAgainBelowTheIdsCutsThem) {
  const TokenHasher h = Hasher();
  TokenChain chain = Chain({1, 2, 3, 4, 5, 6}, h);
  chain.Stored(2, 9, false, INT32_MAX);  // a pruned position appended again
  chain.Rehash(h);
  EXPECT_EQ(chain.ids(), (std::vector<int32_t>{1, 2, 9}));
  EXPECT_EQ(chain.exact(), 3);
}

TEST(TokenChainTest, CopyPrefixAndPrefix) {
  const TokenHasher h = Hasher();
  const std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const TokenChain chain = Chain(ids, h);
  TokenChain copy = chain.CopyPrefix(6);
  copy.Rehash(h);
  EXPECT_EQ(copy.ids(), (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(copy.hashes(), Expected(h, copy.ids(), 6));
  const TokenIds prefix = chain.Prefix(5);
  EXPECT_EQ(prefix.ids.size(), 5u);
  EXPECT_EQ(prefix.taint, kNoTaint);
  TokenChain tainted = chain;
  tainted.Taint(3);
  EXPECT_EQ(tainted.Prefix(5).taint, 3);
  EXPECT_EQ(tainted.Prefix(3).taint, kNoTaint);  // the taint lies outside the prefix
  EXPECT_EQ(TokenChain(tainted.Prefix(9), h).exact(), 3);
}

TEST(TokenChainTest, FewHashBitsCollideButTheChainStillMatchesItsIds) {
  const TokenHasher h = Hasher(2, /*bits=*/2);
  const TokenChain chain = Chain({1, 2, 3, 4, 5, 6, 7, 8}, h);
  for (uint64_t hash : chain.hashes()) EXPECT_LT(hash, 4u);
  EXPECT_EQ(chain.hashes(), Expected(h, chain.ids(), 8));
}

// Random changes: the hashes always equal those of a chain built from its ids at once.
TEST(TokenChainTest, RandomChangesKeepTheHashesRight) {
  std::mt19937 rng(7);
  for (int block : {1, 3, 4}) {
    const TokenHasher h = Hasher(block);
    TokenChain chain;
    int32_t offset = 0;  // one past the last stored position
    for (int step = 0; step < 3000; ++step) {
      const int op = static_cast<int>(rng() % 8);
      if (op <= 3) {
        const int32_t id = rng() % 10 == 0 ? kNoTokenId : static_cast<int32_t>(rng() % 5);
        chain.Stored(offset, id, false, 64);
        ++offset;
      } else if (op == 4 && offset > 0) {
        const int32_t end = static_cast<int32_t>(rng() % (offset + 1));
        chain.Truncate(end);
        offset = std::min(offset, end);
      } else if (op == 5 && offset > 1) {
        const int32_t begin = static_cast<int32_t>(rng() % offset);
        const int32_t end = begin + 1 + static_cast<int32_t>(rng() % (offset - begin));
        if (end < offset) {
          chain.Erase(begin, end);
          offset -= end - begin;
        } else {
          chain.Truncate(begin);
          offset = begin;
        }
      } else if (op == 6 && offset > 0) {
        chain.Taint(static_cast<int32_t>(rng() % offset));
      } else if (op == 7) {
        chain.Truncate(offset);
      }
      chain.Rehash(h);
      ASSERT_LE(chain.ids().size(), static_cast<size_t>(offset));
      ASSERT_EQ(chain.hashes(), Expected(h, chain.ids(), chain.exact())) << "step " << step;
      const TokenChain rebuilt(chain.Prefix(INT32_MAX), h);
      ASSERT_EQ(rebuilt.hashes(), chain.hashes()) << "step " << step;
    }
  }
}

}  // namespace
}  // namespace kvmesh
