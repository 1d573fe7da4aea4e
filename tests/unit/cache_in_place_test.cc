// Cache::BeginAppend with in_place and Cache::PinCells, as a local worker uses them, on caches
// with Rotating and Recurrent groups: rows written where an in-place plan says and committed
// leave the cache exactly as Cache::Append of the same payload leaves a twin; a plan given up
// leaves it exactly as before; a pinned ring or state slot keeps its bytes while its sequence
// goes on, and is free again after its last unpin; and the rings and slots that pins and plans
// hold are refused cleanly to operations that need one.
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/cache.h"
#include "cache/device/host_device.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::CaptureState;
using testutil::Full;
using testutil::Group;
using testutil::IsError;
using testutil::PayloadFor;
using testutil::RecurrentGroup;
using testutil::RotatingGroup;
using testutil::SameState;
using testutil::Spec;
using testutil::Tokens;

// Attention, a ring of 4 rows, and a recurrent state, F16; `sequences` rings and slots.
CacheSpec HybridSpec(int32_t sequences = 4) {
  return Spec(DType::kF16, sequences, 64, 16,
              {Group(Full(), 1, 1, 4, 4), RotatingGroup(4, 2), RecurrentGroup()});
}

// The same cache, appended to through Cache::Append.
struct Twin {
  explicit Twin(const CacheSpec& spec) : device(std::make_unique<HostDevice>(size_t{1} << 28)) {
    absl::StatusOr<std::unique_ptr<Cache>> created = Cache::Create(spec, device.get());
    EXPECT_TRUE(created.ok()) << created.status();
    cache = std::move(created).value();
  }
  std::unique_ptr<HostDevice> device;  // outlives the cache
  std::unique_ptr<Cache> cache;
};

// A cache on a HostDevice whose group memory is shared, mapped here as a worker maps it.
class MappedCache {
 public:
  explicit MappedCache(const CacheSpec& spec)
      : device_(std::make_unique<HostDevice>(size_t{1} << 28, size_t{1} << 28,
                                             HostDevice::kDefaultKeptLimit, false,
                                             /*shareable=*/true)) {
    absl::StatusOr<std::unique_ptr<Cache>> created = Cache::Create(spec, device_.get());
    EXPECT_TRUE(created.ok()) << created.status();
    cache_ = std::shared_ptr<Cache>(std::move(created).value());
    absl::StatusOr<std::vector<Cache::SharedGroup>> groups = cache_->SharedGroups();
    EXPECT_TRUE(groups.ok()) << groups.status();
    groups_ = *std::move(groups);
    for (const Cache::SharedGroup& g : groups_) {
      void* base = mmap(nullptr, g.memory.size, PROT_READ | PROT_WRITE, MAP_SHARED, g.memory.fd, 0);
      EXPECT_NE(base, MAP_FAILED);
      bases_.push_back(static_cast<uint8_t*>(base));
    }
  }
  ~MappedCache() {
    for (size_t g = 0; g < bases_.size(); ++g) munmap(bases_[g], groups_[g].memory.size);
  }

  Cache& cache() { return *cache_; }
  const SharedGroup& group(size_t g) const { return groups_[g]; }
  const std::shared_ptr<Cache>& shared() { return cache_; }
  uint8_t* Row(size_t group, size_t plane, int32_t row) {
    const Plane& p = groups_[group].planes[plane];
    return bases_[group] + p.offset + size_t(row) * p.row_bytes;
  }
  std::string RowBytes(size_t group, size_t plane, int32_t row) {
    return std::string(reinterpret_cast<const char*>(Row(group, plane, row)),
                       groups_[group].planes[plane].row_bytes);
  }

  // An in-place Append of `tokens`: a plan, the payload Append would take written where the
  // plan says (each group's section: every plane's rows in turn, a row per cell of the plan),
  // then committed.
  absl::Status AppendInPlace(const std::vector<Token>& tokens, uint64_t salt = 0) {
    const std::vector<uint8_t> payload = PayloadFor(cache_->spec(), tokens, salt);
    absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
        Cache::BeginAppend(cache_, tokens, payload.size(), false, /*in_place=*/true);
    if (!writer.ok()) return writer.status();
    const std::vector<std::vector<int32_t>> cells = (*writer)->Cells();
    const uint8_t* src = payload.data();
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (size_t p = 0; p < groups_[g].planes.size(); ++p) {
        for (const int32_t cell : cells[g]) {
          const size_t n = groups_[g].planes[p].row_bytes;
          if (cell >= 0) std::memcpy(Row(g, p, cell), src, n);
          src += n;
        }
      }
    }
    EXPECT_EQ(src, payload.data() + payload.size());
    return (*writer)->CommitInPlace();
  }

 private:
  std::unique_ptr<HostDevice> device_;  // outlives the cache
  std::shared_ptr<Cache> cache_;
  std::vector<Cache::SharedGroup> groups_;
  std::vector<uint8_t*> bases_;
};

// Batches that fill a ring, wrap it several times, and move two sequences at once: each
// equals Cache::Append on a twin, through the copy from the staging ring (few new rows) and
// the adoption of it (many).
TEST(CacheInPlaceTest, PlansEqualAppendOnATwin) {
  MappedCache local(HybridSpec());
  Twin twin(HybridSpec());
  const std::vector<std::vector<Token>> batches = {
      Tokens(1, 0, 3),   Tokens(1, 3, 4), Tokens(1, 4, 11), Tokens(2, 0, 2),
      Tokens(1, 11, 12), Tokens(2, 2, 9), Tokens(1, 12, 14)};
  uint64_t salt = 0;
  for (const std::vector<Token>& batch : batches) {
    ++salt;
    ASSERT_TRUE(local.AppendInPlace(batch, salt).ok());
    ASSERT_TRUE(testutil::AppendTokens(*twin.cache, batch, salt).ok());
    ASSERT_TRUE(SameState(CaptureState(*twin.cache), CaptureState(local.cache())));
  }
  // Two sequences in one batch.
  std::vector<Token> both = Tokens(1, 14, 16);
  for (const Token& t : Tokens(2, 9, 10)) both.push_back(t);
  ASSERT_TRUE(local.AppendInPlace(both, 99).ok());
  ASSERT_TRUE(testutil::AppendTokens(*twin.cache, both, 99).ok());
  EXPECT_TRUE(SameState(CaptureState(*twin.cache), CaptureState(local.cache())));
}

// A speculative plan stages the ring's and the state's rows in memory of its own (one row per
// draft), shared like the cache's; committed, and its speculation committed, it equals the same
// drafts appended through Cache::Append on a twin. Given up, it changes nothing.
TEST(CacheInPlaceTest, ASpeculativePlanStagesItsDraftsInSharedMemory) {
  MappedCache local(HybridSpec());
  Twin twin(HybridSpec());
  ASSERT_TRUE(local.AppendInPlace(Tokens(1, 0, 5), 1).ok());
  ASSERT_TRUE(testutil::AppendTokens(*twin.cache, Tokens(1, 0, 5), 1).ok());
  const std::vector<Token> drafts = Tokens(1, 5, 9);
  const std::vector<uint8_t> payload = PayloadFor(local.cache().spec(), drafts, 2, true);
  for (const bool commit : {false, true}) {
    const testutil::CacheState before = CaptureState(local.cache());
    absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
        Cache::BeginAppend(local.shared(), drafts, payload.size(), true, /*in_place=*/true);
    ASSERT_TRUE(writer.ok()) << writer.status();
    absl::StatusOr<std::vector<std::optional<SharedGroup>>> staging = (*writer)->StagingMemory();
    ASSERT_TRUE(staging.ok()) << staging.status();
    ASSERT_EQ(staging->size(), 3u);
    EXPECT_FALSE((*staging)[0].has_value());  // attention: pending rows are cells
    ASSERT_TRUE((*staging)[1].has_value() && (*staging)[2].has_value());
    // Each group's section into its rows: the cache's cells, or the plan's staging memory.
    const std::vector<std::vector<int32_t>> cells = (*writer)->Cells();
    const uint8_t* src = payload.data();
    for (size_t g = 0; g < 3; ++g) {
      const std::optional<SharedGroup>& own = (*staging)[g];
      uint8_t* base = nullptr;
      if (own.has_value()) {
        ASSERT_EQ(own->cells, 4);  // a row per draft (a state per draft, Recurrent)
        void* mapped =
            mmap(nullptr, own->memory.size, PROT_READ | PROT_WRITE, MAP_SHARED, own->memory.fd, 0);
        ASSERT_NE(mapped, MAP_FAILED);
        base = static_cast<uint8_t*>(mapped);
      }
      const std::vector<Plane>& planes = own.has_value() ? own->planes : local.group(g).planes;
      for (size_t p = 0; p < planes.size(); ++p) {
        for (const int32_t cell : cells[g]) {
          uint8_t* dst = own.has_value()
                             ? base + planes[p].offset + size_t(cell) * planes[p].row_bytes
                             : local.Row(g, p, cell);
          std::memcpy(dst, src, planes[p].row_bytes);
          src += planes[p].row_bytes;
        }
      }
      if (base != nullptr) munmap(base, own->memory.size);
    }
    ASSERT_EQ(src, payload.data() + payload.size());
    if (!commit) {
      writer->reset();  // given up
      EXPECT_TRUE(SameState(before, CaptureState(local.cache())));
      continue;
    }
    ASSERT_TRUE((*writer)->CommitInPlace().ok());
  }
  ASSERT_TRUE(twin.cache->Append(drafts, payload, /*speculative=*/true).ok());
  EXPECT_TRUE(SameState(CaptureState(*twin.cache), CaptureState(local.cache())));
  ASSERT_TRUE(local.cache().CommitSpeculation(1, 3).ok());
  ASSERT_TRUE(twin.cache->CommitSpeculation(1, 3).ok());
  EXPECT_TRUE(SameState(CaptureState(*twin.cache), CaptureState(local.cache())));
}

// A plan given up (destroyed uncommitted) changes nothing and gives its rings and slots back:
// with 2 sequences' worth, the next plan of two sequences finds them free.
TEST(CacheInPlaceTest, AnAbandonedPlanChangesNothing) {
  MappedCache local(HybridSpec(3));
  ASSERT_TRUE(local.AppendInPlace(Tokens(1, 0, 6)).ok());
  const testutil::CacheState before = CaptureState(local.cache());
  for (int i = 0; i < 3; ++i) {
    std::vector<Token> tokens = Tokens(1, 6, 8);
    tokens.push_back(Token{2, 0});
    const std::vector<uint8_t> payload = PayloadFor(local.cache().spec(), tokens, 7);
    absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
        Cache::BeginAppend(local.shared(), tokens, payload.size(), false, true);
    ASSERT_TRUE(writer.ok()) << writer.status();
    // Rows written into the staging ring and slot, then the plan goes.
    for (const std::vector<int32_t>& cells : (*writer)->Cells()) ASSERT_FALSE(cells.empty());
    std::memset(local.Row(1, 0, (*writer)->Cells()[1][0]), 0x5a, 8);  // one F16 row of 4 dims
  }
  EXPECT_TRUE(SameState(before, CaptureState(local.cache())));
}

// A pin over pending rows (outside the ring and the slots) is refused; too few free rings or
// slots for a plan is RESOURCE_EXHAUSTED naming them. Nothing changes.
TEST(CacheInPlaceTest, WhatAPlanCannotDoIsRefusedWithItsReason) {
  MappedCache local(HybridSpec(3));
  ASSERT_TRUE(local.AppendInPlace(Tokens(1, 0, 3)).ok());
  ASSERT_TRUE(testutil::AppendSpeculative(local.cache(), 1, 3, 5).ok());
  const testutil::CacheState before = CaptureState(local.cache());
  absl::StatusOr<Cache::PinnedCells> pin = Cache::PinCells(local.shared(), 1, 0, std::nullopt);
  EXPECT_TRUE(IsError(pin.status(), absl::StatusCode::kFailedPrecondition, {"pending"}));
  pin = Cache::PinCells(local.shared(), 1, 0, 3);  // below the drafts: fine
  EXPECT_TRUE(pin.ok()) << pin.status();
  pin = absl::UnknownError("released");
  EXPECT_TRUE(SameState(before, CaptureState(local.cache())));

  // Three rings: seq 1 holds one and an open plan of seq 2 another, so a plan of seqs 1 and 3
  // finds one of the two it stages into.
  ASSERT_TRUE(local.cache().CommitSpeculation(1, 2).ok());
  const std::vector<Token> open = Tokens(2, 0, 1);
  absl::StatusOr<std::unique_ptr<AppendWriter>> plan = Cache::BeginAppend(
      local.shared(), open, PayloadFor(local.cache().spec(), open).size(), false, true);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const testutil::CacheState committed = CaptureState(local.cache());
  std::vector<Token> two = Tokens(1, 5, 6);
  two.push_back(Token{3, 0});
  EXPECT_TRUE(IsError(local.AppendInPlace(two), absl::StatusCode::kResourceExhausted,
                      {"1 of 3 rings are free"}));
  EXPECT_TRUE(SameState(committed, CaptureState(local.cache())));
}

// What pins and plans hold is refused by name: a plan short of state slots, a receiver's
// pre-check short of rings (before any byte of a cross-node copy moves), a plan that would have
// to prune a sliding window.
TEST(CacheInPlaceTest, RingsAndSlotsHeldByPinsAndPlansAreRefusedByName) {
  MappedCache local(HybridSpec(3));
  ASSERT_TRUE(local.AppendInPlace(Tokens(1, 0, 3)).ok());
  ASSERT_TRUE(testutil::AppendTokens(local.cache(), Tokens(2, 0, 3)).ok());
  absl::StatusOr<Cache::PinnedCells> pin = Cache::PinCells(local.shared(), 1, 0, std::nullopt);
  ASSERT_TRUE(pin.ok()) << pin.status();
  ASSERT_TRUE(testutil::AppendTokens(local.cache(), Tokens(1, 3, 4)).ok());  // the last ring, slot
  const testutil::CacheState before = CaptureState(local.cache());
  EXPECT_TRUE(IsError(local.AppendInPlace(Tokens(2, 3, 4)), absl::StatusCode::kResourceExhausted,
                      {"0 of 3 rings are free"}));
  EXPECT_TRUE(IsError(local.cache().CheckRoomForSequence(3, {0, 4, 0}, "a copy"),
                      absl::StatusCode::kResourceExhausted, {"no free ring for sequence 3"}));
  EXPECT_TRUE(SameState(before, CaptureState(local.cache())));
  pin = absl::UnknownError("released");
  EXPECT_TRUE(local.cache().CheckRoomForSequence(3, {0, 4, 0}, "a copy").ok());

  // The recurrent group alone: its slots.
  MappedCache states(Spec(DType::kF16, 2, 16, 8, {testutil::RecurrentGroup()}));
  ASSERT_TRUE(states.AppendInPlace(Tokens(1, 0, 2)).ok());
  ASSERT_TRUE(testutil::AppendTokens(states.cache(), Tokens(2, 0, 2)).ok());
  EXPECT_TRUE(IsError(states.AppendInPlace(Tokens(1, 2, 3)), absl::StatusCode::kResourceExhausted,
                      {"0 of 2 slots are free"}));

  // A sliding window with room only by pruning: 20 cells (memory 4 + max_batch 16), 12 used.
  MappedCache sliding(Spec(DType::kF16, 1, 16, 16, {Group(testutil::Sliding(4), 1, 1, 4, 4)}));
  ASSERT_TRUE(sliding.AppendInPlace(Tokens(0, 0, 12)).ok());
  const testutil::CacheState window = CaptureState(sliding.cache());
  EXPECT_TRUE(IsError(sliding.AppendInPlace(Tokens(0, 12, 28)),
                      absl::StatusCode::kFailedPrecondition, {"16 tokens", "8 are free"}));
  EXPECT_TRUE(SameState(window, CaptureState(sliding.cache())));
}

// A pinned ring keeps the bytes of the pinned window while its sequence goes on (through
// Append, an in-place plan and a speculation commit), and the sequence reads as on a twin. The
// pinned ring is free again only after the unpin: until then a second sequence finds no ring.
TEST(CacheInPlaceTest, APinnedRingKeepsItsBytesAndIsFreedAtItsUnpin) {
  MappedCache local(HybridSpec(3));
  Twin twin(HybridSpec(3));
  ASSERT_TRUE(local.AppendInPlace(Tokens(1, 0, 6), 1).ok());
  ASSERT_TRUE(testutil::AppendTokens(*twin.cache, Tokens(1, 0, 6), 1).ok());
  absl::StatusOr<Cache::PinnedCells> pin = Cache::PinCells(local.shared(), 1, 0, std::nullopt);
  ASSERT_TRUE(pin.ok()) << pin.status();
  ASSERT_EQ(pin->positions[1], (std::vector<int32_t>{2, 3, 4, 5}));
  ASSERT_EQ(pin->positions[2], (std::vector<int32_t>{5}));  // the state after position 5
  std::vector<std::string> window, state;
  for (const int32_t cell : pin->cells[1]) window.push_back(local.RowBytes(1, 0, cell));
  state.push_back(local.RowBytes(2, 0, pin->cells[2][0]));

  ASSERT_TRUE(testutil::AppendTokens(local.cache(), Tokens(1, 6, 8), 2).ok());
  ASSERT_TRUE(testutil::AppendTokens(*twin.cache, Tokens(1, 6, 8), 2).ok());
  ASSERT_TRUE(local.AppendInPlace(Tokens(1, 8, 9), 3).ok());
  ASSERT_TRUE(testutil::AppendTokens(*twin.cache, Tokens(1, 8, 9), 3).ok());
  // (Usage differs while pinned: the pinned state slot counts as used.)
  absl::StatusOr<ReadResult> read = local.cache().Read(1, 0, std::nullopt);
  absl::StatusOr<ReadResult> expected = twin.cache->Read(1, 0, std::nullopt);
  ASSERT_TRUE(read.ok() && expected.ok());
  EXPECT_EQ(read->positions, expected->positions);
  EXPECT_TRUE(testutil::SameBytes(expected->payload, read->payload));
  for (size_t i = 0; i < window.size(); ++i) {
    EXPECT_EQ(local.RowBytes(1, 0, pin->cells[1][i]), window[i]) << "row " << i;
  }
  EXPECT_EQ(local.RowBytes(2, 0, pin->cells[2][0]), state[0]);

  // Seq 2 takes the last free ring (seq 1 holds one, the pin another): seq 3 gets none, though
  // the cache has room for 3 sequences, cleanly.
  ASSERT_TRUE(testutil::AppendTokens(local.cache(), Tokens(2, 0, 1)).ok());
  const testutil::CacheState before = CaptureState(local.cache());
  EXPECT_TRUE(IsError(testutil::AppendTokens(local.cache(), Tokens(3, 0, 1)),
                      absl::StatusCode::kResourceExhausted, {"rings"}));
  EXPECT_TRUE(IsError(local.cache().CopyPrefix(1, 3, 9), absl::StatusCode::kResourceExhausted,
                      {"no free ring for sequence 3"}));
  EXPECT_TRUE(SameState(before, CaptureState(local.cache())));
  pin = absl::UnknownError("released");
  ASSERT_TRUE(testutil::AppendTokens(local.cache(), Tokens(3, 0, 1)).ok());
}

// A speculation whose commit needs a ring while a pinned ring holds the last one is refused
// before anything changes, and commits once the pin goes.
TEST(CacheInPlaceTest, ACommitThatFindsNoFreeRingIsRefusedCleanly) {
  MappedCache local(HybridSpec(2));
  ASSERT_TRUE(local.AppendInPlace(Tokens(1, 0, 3)).ok());
  ASSERT_TRUE(testutil::AppendSpeculative(local.cache(), 2, 0, 2).ok());  // no ring yet
  absl::StatusOr<Cache::PinnedCells> pin = Cache::PinCells(local.shared(), 1, 0, std::nullopt);
  ASSERT_TRUE(pin.ok()) << pin.status();
  ASSERT_TRUE(testutil::AppendTokens(local.cache(), Tokens(1, 3, 4)).ok());  // moves off the pin
  const testutil::CacheState before = CaptureState(local.cache());
  EXPECT_TRUE(IsError(local.cache().CommitSpeculation(2, 1), absl::StatusCode::kResourceExhausted,
                      {"no free ring for sequence 2"}));
  EXPECT_TRUE(SameState(before, CaptureState(local.cache())));
  pin = absl::UnknownError("released");
  ASSERT_TRUE(local.cache().CommitSpeculation(2, 1).ok());
  EXPECT_EQ(testutil::FindSequence(local.cache(), 2)->offset, 1);
}

// Under LRU the same commit makes room by evicting a sequence that is not in use (never the one
// being read, whose pinned ring holds one of the rings).
TEST(CacheInPlaceTest, UnderLruACommitThatNeedsARingEvicts) {
  CacheSpec spec = HybridSpec(3);
  spec.eviction = EvictionPolicy::kLru;
  MappedCache local(spec);
  ASSERT_TRUE(local.AppendInPlace(Tokens(1, 0, 3)).ok());
  ASSERT_TRUE(testutil::AppendTokens(local.cache(), Tokens(3, 0, 2)).ok());
  ASSERT_TRUE(testutil::AppendSpeculative(local.cache(), 2, 0, 2).ok());  // no ring yet
  absl::StatusOr<Cache::PinnedCells> pin = Cache::PinCells(local.shared(), 1, 0, std::nullopt);
  ASSERT_TRUE(pin.ok()) << pin.status();
  ASSERT_TRUE(testutil::AppendTokens(local.cache(), Tokens(1, 3, 4)).ok());  // the last ring
  const absl::Status committed = local.cache().CommitSpeculation(2, 1);
  ASSERT_TRUE(committed.ok()) << committed;
  EXPECT_FALSE(testutil::FindSequence(local.cache(), 3).has_value());
  EXPECT_EQ(testutil::FindSequence(local.cache(), 1)->offset, 4);
  EXPECT_EQ(testutil::FindSequence(local.cache(), 2)->offset, 1);
  EXPECT_EQ(local.cache().Evictions().lru, 1);
}

// A pinned state slot is shared with its pin: the sequence's next state goes to another slot
// (whether appended through Append or a plan), the pinned bytes stay, and the slot is free after
// the unpin.
TEST(CacheInPlaceTest, APinnedStateSlotKeepsItsBytes) {
  MappedCache local(HybridSpec(3));
  ASSERT_TRUE(local.AppendInPlace(Tokens(1, 0, 2), 1).ok());
  absl::StatusOr<Cache::PinnedCells> pin = Cache::PinCells(local.shared(), 1, 0, std::nullopt);
  ASSERT_TRUE(pin.ok()) << pin.status();
  ASSERT_EQ(pin->cells[2].size(), 1u);
  const int32_t slot = pin->cells[2][0];
  const std::string pinned = local.RowBytes(2, 0, slot);
  ASSERT_TRUE(local.AppendInPlace(Tokens(1, 2, 3), 2).ok());
  ASSERT_TRUE(testutil::AppendTokens(local.cache(), Tokens(1, 3, 4), 3).ok());
  EXPECT_EQ(local.RowBytes(2, 0, slot), pinned);
  absl::StatusOr<Cache::PinnedCells> now = Cache::PinCells(local.shared(), 1, 0, std::nullopt);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_NE(now->cells[2][0], slot);
  now = absl::UnknownError("released");
  // Three slots: seq 1's, the pinned one, and one free; two new sequences fit after the unpin.
  std::vector<Token> two = Tokens(2, 0, 1);
  two.push_back(Token{3, 0});
  EXPECT_EQ(local.AppendInPlace(two).code(), absl::StatusCode::kResourceExhausted);
  pin = absl::UnknownError("released");
  EXPECT_TRUE(local.AppendInPlace(two).ok());
}

}  // namespace
}  // namespace kvmesh
