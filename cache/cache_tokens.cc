// The Cache's PrefixIndex kept in line with what its sequences store, the prefix lookup's
// matches, and the events the Cache publishes (cache/cache.h, "Where things live").
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
  tokens_.RecordAppend(batch.tokens, batch.speculative);
  for (int64_t seq : batch.seqs) SyncTokensLocked(seq);
  TouchLocked(batch.seqs);
}

void Cache::SyncTokensLocked(int64_t seq) {
  if (tokens_.Find(seq) == nullptr) return;
  PublishBlocksLocked(seq, tokens_.Sync(seq, IsLiveLocked(seq), OffsetLocked(seq)));
}

void Cache::SetChainLocked(int64_t seq, TokenChain chain) {
  PublishBlocksLocked(seq, tokens_.Set(seq, std::move(chain)));
  SyncTokensLocked(seq);
}

void Cache::DropChainLocked(int64_t seq) { PublishBlocksLocked(seq, tokens_.Drop(seq)); }

void Cache::PublishBlocksLocked(int64_t seq, std::optional<PrefixIndex::BlocksChange> change) {
  if (!change.has_value()) return;
  Event event;
  event.kind = EventKind::kBlocks;
  event.seq = seq;
  event.offset = OffsetLocked(seq);
  event.kept_blocks = change->kept;
  event.block_hashes = std::move(change->added);
  PublishLocked(std::move(event));
}

TokenChain Cache::Tokens(int64_t seq) const {
  ReaderMutexLock lock(&mu_);
  const TokenChain* chain = tokens_.Find(seq);
  return chain == nullptr ? TokenChain() : *chain;
}

absl::StatusOr<std::vector<PrefixMatch>> Cache::LookupPrefix(absl::Span<const int32_t> tokens,
                                                             int max_matches) const {
  if (max_matches < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_matches = ", max_matches, " is below 1"));
  }
  ASSIGN_OR_RETURN(const std::vector<uint64_t> hashes, PromptHashes(tokens));
  std::vector<PrefixMatch> matches;
  ReaderMutexLock lock(&mu_);
  for (const auto& [seq, length] : tokens_.Lookup(tokens, hashes, max_matches)) {
    PrefixMatch match;
    match.seq = seq;
    match.length = length;
    match.offset = OffsetLocked(seq);
    match.can_resume = true;
    for (const auto& group : groups_) match.can_resume &= group->CanResume(seq, match.length);
    matches.push_back(match);
  }
  return matches;
}

absl::StatusOr<std::vector<uint64_t>> Cache::PromptHashes(absl::Span<const int32_t> tokens) const {
  return PrefixIndex::PromptHashes(hasher_, token_limit_, tokens);
}

TokenIndexStats Cache::TokenIndex() const {
  ReaderMutexLock lock(&mu_);
  return tokens_.Stats();
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
  tokens_.ForEachWithBlocks(
      [&](int64_t seq, const TokenChain& chain) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        listing.sequences.push_back({seq, OffsetLocked(seq), chain.hashes()});
      });
  std::sort(listing.sequences.begin(), listing.sequences.end(),
            [](const SequenceBlocks& a, const SequenceBlocks& b) { return a.seq < b.seq; });
  return listing;
}

}  // namespace kvmesh
