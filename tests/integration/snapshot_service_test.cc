// The happy path of the snapshot and speculation RPCs (Snapshot, Restore, MergeSnapshots,
// SplitSnapshot, DropSnapshot, ListSnapshots, CommitSpeculation, speculative Append and
// AppendStream) on a hybrid cache (full and sliding Attention, Rotating, Recurrent) and on an
// Attention-only cache, against a real kvmesh-node process. Data is checked byte for byte
// against the patterns of tests/testing/pattern.h. The conversions of the new messages are
// checked in-process at the end.
#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/common/convert.h"
#include "tests/integration/client_util.h"
#include "tests/integration/node_fixture.h"
#include "tests/testing/pattern.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::IsEmpty;

std::vector<int32_t> Range(int32_t begin, int32_t end) {
  std::vector<int32_t> out(end - begin);
  std::iota(out.begin(), out.end(), begin);
  return out;
}

// Group indices of HybridSpec.
constexpr int kFull = 0;
constexpr int kSliding = 1;
constexpr int kRotating = 2;
constexpr int kRecurrent = 3;
constexpr int32_t kMaxSize = 4;  // the Rotating group's window
constexpr int32_t kWindow = 2;   // the sliding group's window (memory 3)

// F32, one layer per group: full Attention (RoPE NORMAL), sliding Attention (window 2),
// Rotating (max_size 4, RoPE NORMAL), Recurrent (conv 2 x 3, delta 1 x 2 x 2).
v1::CacheSpec HybridSpec(const std::string& name) {
  AttentionOptions full;
  full.num_layers = 1;
  full.num_kv_heads = 1;
  AttentionOptions sliding = full;
  sliding.sliding_window = kWindow;
  RotatingOptions rotating;
  rotating.max_size = kMaxSize;
  return SpecProto(name, 4, 32, 8,
                   {AttentionGroupProto(full), AttentionGroupProto(sliding),
                    RotatingGroupProto(rotating), RecurrentGroupProto(RecurrentOptions())});
}

// F32, 2 layers x 2 heads, head_dim 4: 128 bytes per token.
v1::CacheSpec AttentionSpec(const std::string& name) {
  AttentionOptions a;
  return SpecProto(name, 4, 32, 8, {AttentionGroupProto(a)});
}

// What a sequence of a HybridSpec cache holds: the rows of its positions (full group), where
// the Rotating window starts, and its Recurrent state.
struct HybridModel {
  std::map<int32_t, uint64_t> rows;
  int32_t rotating_first = 0;
  std::optional<uint64_t> state;

  void Add(int64_t seq, const std::vector<int32_t>& positions, uint64_t seed) {
    for (int32_t pos : positions) rows[pos] = TokenId(seq, pos, seed);
  }
  int32_t offset() const { return rows.empty() ? 0 : rows.rbegin()->first + 1; }
};

class SnapshotServiceTest : public NodeSuite {
 protected:
  static void SetUpTestSuite() { StartNode({"--memory-budget=256MiB", "--snapshot-budget=1MiB"}); }

  v1::CacheUsage Usage(const std::string& cache) {
    v1::GetCacheResponse response;
    const grpc::Status status = GetCache(stub(), cache, &response);
    EXPECT_TRUE(status.ok()) << StatusText(status);
    return response.cache().usage();
  }

  v1::SequenceInfo Sequence(const std::string& cache, int64_t seq) {
    v1::ListSequencesResponse response;
    const grpc::Status status = ListSequences(stub(), cache, &response);
    EXPECT_TRUE(status.ok()) << StatusText(status);
    for (const v1::SequenceInfo& info : response.sequences()) {
      if (info.seq() == seq) return info;
    }
    ADD_FAILURE() << "sequence " << seq << " of " << cache << " is not listed";
    return v1::SequenceInfo();
  }

  std::vector<uint64_t> SnapshotIds(const std::string& cache) {
    v1::ListSnapshotsResponse response;
    const grpc::Status status = ListSnapshots(stub(), cache, &response);
    EXPECT_TRUE(status.ok()) << StatusText(status);
    std::vector<uint64_t> ids;
    for (const v1::SnapshotInfo& info : response.snapshots()) ids.push_back(info.id());
    return ids;
  }

  // Reads all of `seq` of a HybridSpec cache and checks it against `model`: the full group
  // holds every row, the sliding group a suffix of them that covers its window, the Rotating
  // group the rows from rotating_first, the Recurrent group the model's state; the payload is
  // the pattern of exactly those rows and that state.
  void ExpectHybridRead(const v1::CacheSpec& spec, int64_t seq, const HybridModel& model,
                        ReadOutput* read = nullptr) {
    ReadOutput out;
    KVMESH_ASSERT_OK(Read(stub(), ReadRequest(spec.name(), seq), &out));
    ASSERT_EQ(out.header.groups_size(), 4);
    std::vector<int32_t> all;
    for (const auto& [pos, id] : model.rows) all.push_back(pos);
    const std::vector<std::vector<int32_t>> positions = HeaderPositions(out.header);
    EXPECT_EQ(positions[kFull], all);

    // Sliding: a contiguous suffix of the rows holding at least the last kWindow positions.
    const std::vector<int32_t>& sliding = positions[kSliding];
    const size_t min_kept = std::min<size_t>(kWindow, all.size());
    EXPECT_GE(sliding.size(), min_kept) << "sequence " << seq;
    EXPECT_TRUE(sliding.size() <= all.size() &&
                std::equal(sliding.begin(), sliding.end(), all.end() - sliding.size()))
        << "sliding positions of sequence " << seq << " are not a suffix of the stored ones";

    std::vector<int32_t> rotating;
    for (int32_t pos : all) {
      if (pos >= model.rotating_first) rotating.push_back(pos);
    }
    EXPECT_EQ(positions[kRotating], rotating);
    EXPECT_THAT(positions[kRecurrent], IsEmpty());
    EXPECT_EQ(out.header.groups(kRecurrent).state(),
              model.state.has_value() ? v1::STATE_STATUS_VALID : v1::STATE_STATUS_NONE);
    for (int g : {kFull, kSliding, kRotating}) {
      EXPECT_EQ(out.header.groups(g).state(), v1::STATE_STATUS_NONE) << "group " << g;
    }

    std::vector<std::vector<uint64_t>> ids(4);
    for (int g : {kFull, kSliding, kRotating}) {
      for (int32_t pos : positions[g]) {
        auto it = model.rows.find(pos);
        ids[g].push_back(it == model.rows.end() ? ~uint64_t{0} : it->second);
      }
    }
    if (model.state.has_value()) ids[kRecurrent].push_back(*model.state);
    EXPECT_EQ(out.header.payload_bytes(), static_cast<int64_t>(out.payload.size()));
    EXPECT_TRUE(out.payload == ReadPayload(EngineSpec(spec), ids))
        << "payload of sequence " << seq << " differs from the pattern";
    if (read != nullptr) *read = out;
  }

  // Reads all of `seq` and checks the header and payload equal `expected`.
  void ExpectSameRead(const std::string& cache, int64_t seq, const ReadOutput& expected) {
    ReadOutput out;
    KVMESH_ASSERT_OK(Read(stub(), ReadRequest(cache, seq), &out));
    KVMESH_EXPECT_PROTO_EQ(out.header, expected.header);
    EXPECT_TRUE(out.payload == expected.payload) << "payload of sequence " << seq << " differs";
  }

  // Reads all of `seq` of an AttentionSpec cache: positions `positions` with rows `ids`.
  void ExpectAttentionRead(const v1::CacheSpec& spec, int64_t seq,
                           const std::vector<int32_t>& positions,
                           const std::vector<uint64_t>& ids) {
    ReadOutput out;
    KVMESH_ASSERT_OK(Read(stub(), ReadRequest(spec.name(), seq), &out));
    ASSERT_EQ(out.header.groups_size(), 1);
    EXPECT_THAT(out.header.groups(0).positions(), ElementsAreArray(positions));
    EXPECT_TRUE(out.payload == ReadPayload(EngineSpec(spec), {ids}))
        << "payload of sequence " << seq << " differs from the pattern";
  }
};

std::vector<uint64_t> TokenIds(int64_t seq, const std::vector<int32_t>& positions,
                               uint64_t seed = 0) {
  std::vector<uint64_t> ids;
  for (int32_t pos : positions) ids.push_back(TokenId(seq, pos, seed));
  return ids;
}

TEST_F(SnapshotServiceTest, SnapshotExtendRestoreReadsThePreExtensionData) {
  const v1::CacheSpec spec = HybridSpec("snap-restore");
  v1::CreateCacheResponse created;
  KVMESH_ASSERT_OK(CreateCache(stub(), spec, &created));
  // The hybrid spec round-trips through the service.
  v1::CacheSpec expected_spec = spec;
  expected_spec.mutable_groups(kFull)->mutable_attention()->mutable_window()->mutable_full();
  KVMESH_EXPECT_PROTO_EQ(created.cache().spec(), expected_spec);
  ASSERT_EQ(created.cache().usage().groups_size(), 4);
  EXPECT_EQ(created.cache().usage().groups(kRotating).cells_total(), 4 * kMaxSize);
  EXPECT_EQ(created.cache().usage().groups(kRecurrent).cells_total(), 4);
  EXPECT_EQ(created.cache().usage().snapshots(), 0);
  EXPECT_EQ(created.cache().usage().snapshot_bytes(), 0);

  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, Range(0, 6))));
  HybridModel model;
  model.Add(0, Range(0, 6), 0);
  model.rotating_first = 6 - kMaxSize;
  model.state = StateId(0, 5);
  ReadOutput before;
  ExpectHybridRead(spec, 0, model, &before);

  const v1::SequenceInfo info = Sequence("snap-restore", 0);
  EXPECT_EQ(info.offset(), 6);
  EXPECT_EQ(info.pending(), 0);
  ASSERT_EQ(info.groups_size(), 4);
  EXPECT_EQ(info.groups(kRotating).stored(), kMaxSize);
  EXPECT_EQ(info.groups(kRotating).first(), 2);
  EXPECT_EQ(info.groups(kRotating).last(), 5);
  EXPECT_EQ(info.groups(kRecurrent).stored(), 0);
  EXPECT_EQ(info.groups(kRecurrent).state(), v1::STATE_STATUS_VALID);
  EXPECT_EQ(info.groups(kFull).state(), v1::STATE_STATUS_NONE);

  v1::SnapshotInfo snapshot;
  KVMESH_ASSERT_OK(Snapshot(stub(), "snap-restore", 0, 0, &snapshot));
  EXPECT_GT(snapshot.id(), 0u);
  EXPECT_EQ(snapshot.seq(), 0);
  EXPECT_EQ(snapshot.from_offset(), 0);
  EXPECT_EQ(snapshot.to_offset(), 6);
  EXPECT_GT(snapshot.bytes(), 0);
  ASSERT_EQ(snapshot.groups_size(), 4);
  for (int g = 0; g < 4; ++g) EXPECT_EQ(snapshot.groups(g).group(), g);
  EXPECT_EQ(snapshot.groups(kFull).stored(), 6);
  EXPECT_EQ(snapshot.groups(kFull).ring_index(), -1);
  EXPECT_EQ(snapshot.groups(kSliding).stored(), before.header.groups(kSliding).positions_size());
  EXPECT_EQ(snapshot.groups(kRotating).stored(), kMaxSize);
  EXPECT_EQ(snapshot.groups(kRotating).ring_index(), 6 % kMaxSize);
  EXPECT_EQ(snapshot.groups(kRecurrent).state(), v1::STATE_STATUS_VALID);

  v1::CacheUsage usage = Usage("snap-restore");
  EXPECT_EQ(usage.snapshots(), 1);
  EXPECT_EQ(usage.snapshot_bytes(), snapshot.bytes());
  v1::ListSnapshotsResponse listed;
  KVMESH_ASSERT_OK(ListSnapshots(stub(), "snap-restore", &listed));
  ASSERT_EQ(listed.snapshots_size(), 1);
  KVMESH_EXPECT_PROTO_EQ(listed.snapshots(0), snapshot);

  // Extend with other data: every group changes.
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, Range(6, 9), /*seed=*/1)));
  HybridModel extended = model;
  extended.Add(0, Range(6, 9), 1);
  extended.rotating_first = 9 - kMaxSize;
  extended.state = StateId(0, 8, 1);
  ExpectHybridRead(spec, 0, extended);

  // Restore to the snapshot's end: the sequence reads as before the extension.
  KVMESH_ASSERT_OK(Restore(stub(), "snap-restore", 0, snapshot.id(), 6));
  ExpectSameRead("snap-restore", 0, before);
  EXPECT_EQ(Sequence("snap-restore", 0).offset(), 6);
  EXPECT_EQ(Sequence("snap-restore", 0).groups(kRecurrent).state(), v1::STATE_STATUS_VALID);

  // Into a sequence that does not exist yet: the same data.
  KVMESH_ASSERT_OK(Restore(stub(), "snap-restore", 2, snapshot.id(), 6));
  ExpectSameRead("snap-restore", 2, before);
  EXPECT_EQ(Usage("snap-restore").sequences_live(), 2);

  // A live rewind to the offset changes nothing; the snapshot stays after both restores.
  KVMESH_ASSERT_OK(Restore(stub(), "snap-restore", 0, std::nullopt, 6));
  ExpectSameRead("snap-restore", 0, before);
  KVMESH_ASSERT_OK(ListSnapshots(stub(), "snap-restore", &listed));
  ASSERT_EQ(listed.snapshots_size(), 1);
  KVMESH_EXPECT_PROTO_EQ(listed.snapshots(0), snapshot);

  // The restored sequence continues at the snapshot's end.
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, {6}, /*seed=*/2)));
  HybridModel continued = model;
  continued.Add(0, {6}, 2);
  continued.rotating_first = 7 - kMaxSize;
  continued.state = StateId(0, 6, 2);
  ExpectHybridRead(spec, 0, continued);
  bool can_resume = false;
  KVMESH_ASSERT_OK(CanResume(stub(), "snap-restore", 0, 7, &can_resume));
  EXPECT_TRUE(can_resume);

  KVMESH_ASSERT_OK(DeleteCache(stub(), "snap-restore"));
}

TEST_F(SnapshotServiceTest, MergeConcatenatesAttentionAndKeepsTheChildsStateSplitConsumes) {
  const v1::CacheSpec spec = HybridSpec("snap-merge");
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, Range(0, 6))));
  v1::SnapshotInfo parent;
  KVMESH_ASSERT_OK(Snapshot(stub(), "snap-merge", 0, 0, &parent));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, Range(6, 9))));
  v1::SnapshotInfo child;
  KVMESH_ASSERT_OK(Snapshot(stub(), "snap-merge", 0, 6, &child));
  EXPECT_GT(child.id(), parent.id());
  EXPECT_EQ(child.from_offset(), 6);
  EXPECT_EQ(child.to_offset(), 9);
  ASSERT_EQ(child.groups_size(), 4);
  EXPECT_EQ(child.groups(kFull).stored(), 3);
  EXPECT_EQ(child.groups(kRotating).stored(), kMaxSize);  // the whole window
  EXPECT_EQ(child.groups(kRotating).ring_index(), 9 % kMaxSize);
  EXPECT_EQ(Usage("snap-merge").snapshots(), 2);
  EXPECT_EQ(Usage("snap-merge").snapshot_bytes(), parent.bytes() + child.bytes());

  v1::SnapshotInfo merged;
  KVMESH_ASSERT_OK(MergeSnapshots(stub(), "snap-merge", parent.id(), child.id(), &merged));
  EXPECT_GT(merged.id(), child.id());
  EXPECT_EQ(merged.seq(), 0);
  EXPECT_EQ(merged.from_offset(), 0);
  EXPECT_EQ(merged.to_offset(), 9);
  ASSERT_EQ(merged.groups_size(), 4);
  EXPECT_EQ(merged.groups(kFull).stored(), 9);
  EXPECT_EQ(merged.groups(kRotating).stored(), kMaxSize);
  EXPECT_EQ(merged.groups(kRotating).ring_index(), 9 % kMaxSize);
  EXPECT_EQ(merged.groups(kRecurrent).state(), v1::STATE_STATUS_VALID);
  EXPECT_THAT(SnapshotIds("snap-merge"), ElementsAre(merged.id()));
  EXPECT_EQ(Usage("snap-merge").snapshots(), 1);
  EXPECT_EQ(Usage("snap-merge").snapshot_bytes(), merged.bytes());

  // Restored into a new sequence, the merged snapshot reads as sequence 0: the full group
  // concatenated, the Rotating window and the state of the child.
  KVMESH_ASSERT_OK(Restore(stub(), "snap-merge", 1, merged.id(), 9));
  HybridModel model;
  model.Add(0, Range(0, 9), 0);
  model.rotating_first = 9 - kMaxSize;
  model.state = StateId(0, 8);
  ExpectHybridRead(spec, 0, model);
  ExpectHybridRead(spec, 1, model);

  // With a Rotating or Recurrent group a snapshot does not split: no parent, the whole as
  // child under a new id.
  v1::SplitSnapshotResponse split;
  KVMESH_ASSERT_OK(SplitSnapshot(stub(), "snap-merge", merged.id(), 4, &split));
  EXPECT_FALSE(split.has_parent());
  ASSERT_TRUE(split.has_child());
  EXPECT_GT(split.child().id(), merged.id());
  EXPECT_EQ(split.child().from_offset(), 0);
  EXPECT_EQ(split.child().to_offset(), 9);
  EXPECT_EQ(split.child().bytes(), merged.bytes());
  v1::SnapshotInfo renamed = merged;
  renamed.set_id(split.child().id());
  KVMESH_EXPECT_PROTO_EQ(split.child(), renamed);
  EXPECT_THAT(SnapshotIds("snap-merge"), ElementsAre(split.child().id()));

  KVMESH_ASSERT_OK(DropSnapshot(stub(), "snap-merge", split.child().id()));
  EXPECT_THAT(SnapshotIds("snap-merge"), IsEmpty());
  EXPECT_EQ(Usage("snap-merge").snapshots(), 0);
  EXPECT_EQ(Usage("snap-merge").snapshot_bytes(), 0);
  EXPECT_EQ(DropSnapshot(stub(), "snap-merge", split.child().id()).error_code(),
            grpc::StatusCode::NOT_FOUND);
  // Dropping changes no sequence.
  ExpectHybridRead(spec, 1, model);
  KVMESH_ASSERT_OK(DeleteCache(stub(), "snap-merge"));
}

TEST_F(SnapshotServiceTest, AttentionSnapshotsSplitMergeAndRestoreClamped) {
  const v1::CacheSpec spec = AttentionSpec("snap-attn");
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, Range(0, 8))));
  v1::SnapshotInfo whole;
  KVMESH_ASSERT_OK(Snapshot(stub(), "snap-attn", 0, 0, &whole));
  EXPECT_EQ(whole.to_offset(), 8);
  ASSERT_EQ(whole.groups_size(), 1);
  EXPECT_EQ(whole.groups(0).stored(), 8);

  v1::SplitSnapshotResponse split;
  KVMESH_ASSERT_OK(SplitSnapshot(stub(), "snap-attn", whole.id(), 3, &split));
  ASSERT_TRUE(split.has_parent());
  ASSERT_TRUE(split.has_child());
  EXPECT_EQ(split.parent().from_offset(), 0);
  EXPECT_EQ(split.parent().to_offset(), 3);
  EXPECT_EQ(split.parent().groups(0).stored(), 3);
  EXPECT_EQ(split.child().from_offset(), 3);
  EXPECT_EQ(split.child().to_offset(), 8);
  EXPECT_EQ(split.child().groups(0).stored(), 5);
  EXPECT_EQ(split.parent().bytes() + split.child().bytes(), whole.bytes());
  EXPECT_GT(split.parent().id(), whole.id());
  EXPECT_GT(split.child().id(), whole.id());
  EXPECT_NE(split.parent().id(), split.child().id());
  std::vector<uint64_t> ids = {split.parent().id(), split.child().id()};
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(SnapshotIds("snap-attn"), ids);

  // The parent alone restores the prefix.
  KVMESH_ASSERT_OK(Restore(stub(), "snap-attn", 1, split.parent().id(), 3));
  ExpectAttentionRead(spec, 1, Range(0, 3), TokenIds(0, Range(0, 3)));

  // Merged back, the halves restore the whole, and clamped to a target below the end.
  v1::SnapshotInfo merged;
  KVMESH_ASSERT_OK(
      MergeSnapshots(stub(), "snap-attn", split.parent().id(), split.child().id(), &merged));
  EXPECT_EQ(merged.from_offset(), 0);
  EXPECT_EQ(merged.to_offset(), 8);
  EXPECT_EQ(merged.groups(0).stored(), 8);
  EXPECT_EQ(merged.bytes(), whole.bytes());
  KVMESH_ASSERT_OK(Restore(stub(), "snap-attn", 2, merged.id(), 8));
  ExpectAttentionRead(spec, 2, Range(0, 8), TokenIds(0, Range(0, 8)));
  KVMESH_ASSERT_OK(Restore(stub(), "snap-attn", 3, merged.id(), 5));
  ExpectAttentionRead(spec, 3, Range(0, 5), TokenIds(0, Range(0, 5)));

  // A restore over a sequence keeps its positions below the snapshot's start: sequence 1 holds
  // 0..2 of its own; restoring the child [3, 8) onto it at target 6 adds 3..5.
  KVMESH_ASSERT_OK(Remove(stub(), "snap-attn", 1, 0));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 1, Range(0, 3))));
  v1::SplitSnapshotResponse halves;
  KVMESH_ASSERT_OK(SplitSnapshot(stub(), "snap-attn", merged.id(), 3, &halves));
  KVMESH_ASSERT_OK(Restore(stub(), "snap-attn", 1, halves.child().id(), 6));
  std::vector<uint64_t> mixed = TokenIds(1, Range(0, 3));
  for (uint64_t id : TokenIds(0, Range(3, 6))) mixed.push_back(id);
  ExpectAttentionRead(spec, 1, Range(0, 6), mixed);

  // Split at or below the start gives the whole as child; at or past the end as parent.
  v1::SplitSnapshotResponse low;
  KVMESH_ASSERT_OK(SplitSnapshot(stub(), "snap-attn", halves.child().id(), 3, &low));
  EXPECT_FALSE(low.has_parent());
  ASSERT_TRUE(low.has_child());
  EXPECT_EQ(low.child().from_offset(), 3);
  EXPECT_EQ(low.child().to_offset(), 8);
  v1::SplitSnapshotResponse high;
  KVMESH_ASSERT_OK(SplitSnapshot(stub(), "snap-attn", low.child().id(), 8, &high));
  ASSERT_TRUE(high.has_parent());
  EXPECT_FALSE(high.has_child());
  EXPECT_EQ(high.parent().from_offset(), 3);
  EXPECT_EQ(high.parent().to_offset(), 8);

  // A live rewind (no snapshot) truncates.
  KVMESH_ASSERT_OK(Restore(stub(), "snap-attn", 0, std::nullopt, 5));
  ExpectAttentionRead(spec, 0, Range(0, 5), TokenIds(0, Range(0, 5)));
  KVMESH_ASSERT_OK(DeleteCache(stub(), "snap-attn"));
}

TEST_F(SnapshotServiceTest, SpeculativeAppendIsReadUntilCommitKeepsAPrefix) {
  const v1::CacheSpec spec = HybridSpec("snap-spec");
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, Range(0, 4))));
  const int64_t base_bytes = Usage("snap-spec").bytes_held();

  KVMESH_ASSERT_OK(Append(stub(), MakeSpeculativeAppend(spec, 0, Range(4, 7), /*seed=*/1)));
  // One more pending token through AppendStream.
  KVMESH_ASSERT_OK(AppendStream(
      stub(), StreamMessages(MakeSpeculativeAppend(spec, 0, {7}, /*seed=*/1), 16, 64)));
  v1::SequenceInfo info = Sequence("snap-spec", 0);
  EXPECT_EQ(info.offset(), 8);
  EXPECT_EQ(info.pending(), 4);
  EXPECT_GT(Usage("snap-spec").bytes_held(), base_bytes);

  // Pending tokens are read: the Rotating group holds its committed window and the pending
  // tokens, the Recurrent group the state after the last pending token.
  HybridModel pending;
  pending.Add(0, Range(0, 4), 0);
  pending.Add(0, Range(4, 8), 1);
  pending.rotating_first = 0;
  pending.state = StateId(0, 7, 1);
  ExpectHybridRead(spec, 0, pending);

  int32_t offset = -1;
  KVMESH_ASSERT_OK(CommitSpeculation(stub(), "snap-spec", 0, 2, &offset));
  EXPECT_EQ(offset, 6);
  info = Sequence("snap-spec", 0);
  EXPECT_EQ(info.offset(), 6);
  EXPECT_EQ(info.pending(), 0);
  HybridModel committed;
  committed.Add(0, Range(0, 4), 0);
  committed.Add(0, Range(4, 6), 1);
  committed.rotating_first = 6 - kMaxSize;
  committed.state = StateId(0, 5, 1);
  ExpectHybridRead(spec, 0, committed);
  EXPECT_EQ(Usage("snap-spec").bytes_held(), base_bytes);

  // A plain Append continues after the commit; a commit of 0 keeps the old state.
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, {6}, /*seed=*/2)));
  committed.Add(0, {6}, 2);
  committed.rotating_first = 7 - kMaxSize;
  committed.state = StateId(0, 6, 2);
  KVMESH_ASSERT_OK(Append(stub(), MakeSpeculativeAppend(spec, 0, {7, 8}, /*seed=*/3)));
  EXPECT_EQ(Sequence("snap-spec", 0).pending(), 2);
  KVMESH_ASSERT_OK(CommitSpeculation(stub(), "snap-spec", 0, 0, &offset));
  EXPECT_EQ(offset, 7);
  ExpectHybridRead(spec, 0, committed);

  // A snapshot after the commit holds the committed data only.
  v1::SnapshotInfo snapshot;
  KVMESH_ASSERT_OK(Snapshot(stub(), "snap-spec", 0, 0, &snapshot));
  EXPECT_EQ(snapshot.to_offset(), 7);
  KVMESH_ASSERT_OK(Restore(stub(), "snap-spec", 1, snapshot.id(), 7));
  HybridModel copy = committed;
  ExpectHybridRead(spec, 1, copy);

  // A speculative batch of a new sequence starts it; a full commit makes it ordinary.
  KVMESH_ASSERT_OK(Append(stub(), MakeSpeculativeAppend(spec, 2, Range(0, 3), /*seed=*/4)));
  KVMESH_ASSERT_OK(CommitSpeculation(stub(), "snap-spec", 2, 3, &offset));
  EXPECT_EQ(offset, 3);
  HybridModel fresh;
  fresh.Add(2, Range(0, 3), 4);
  fresh.state = StateId(2, 2, 4);
  ExpectHybridRead(spec, 2, fresh);
  KVMESH_ASSERT_OK(DeleteCache(stub(), "snap-spec"));
}

// The node runs with --snapshot-budget=1MiB: 300 tokens of 2 KiB fit once, not twice; dropping a
// snapshot or deleting its cache gives the bytes back.
TEST_F(SnapshotServiceTest, SnapshotBudgetIsEnforcedAndFreedByDropAndDeleteCache) {
  AttentionOptions a;
  a.num_layers = 1;
  a.num_kv_heads = 4;
  a.head_dim_k = 64;
  a.head_dim_v = 64;
  a.rope_dims = 4;
  const v1::CacheSpec spec = SpecProto("snap-budget", 2, 320, 64, {AttentionGroupProto(a)});
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    KVMESH_ASSERT_OK(CreateCache(stub(), spec));
    for (int32_t begin = 0; begin < 300; begin += 60) {
      KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, Range(begin, begin + 60))));
    }
    v1::SnapshotInfo first;
    KVMESH_ASSERT_OK(Snapshot(stub(), "snap-budget", 0, 0, &first));
    EXPECT_EQ(first.bytes(), 300 * 2048);
    const grpc::Status full = Snapshot(stub(), "snap-budget", 0, 0);
    EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(full);
    EXPECT_THAT(full.error_message(), ::testing::HasSubstr("614400 bytes"));
    EXPECT_THAT(full.error_message(), ::testing::HasSubstr("snapshot budget"));
    // The refused snapshot left nothing behind.
    EXPECT_EQ(Usage("snap-budget").snapshots(), 1);
    EXPECT_EQ(Usage("snap-budget").snapshot_bytes(), first.bytes());
    EXPECT_THAT(SnapshotIds("snap-budget"), ElementsAre(first.id()));
    KVMESH_ASSERT_OK(DropSnapshot(stub(), "snap-budget", first.id()));
    v1::SnapshotInfo second;
    KVMESH_ASSERT_OK(Snapshot(stub(), "snap-budget", 0, 0, &second));
    EXPECT_GT(second.id(), first.id());  // ids are never reused
    // The second round only passes when DeleteCache freed this snapshot.
    KVMESH_ASSERT_OK(DeleteCache(stub(), "snap-budget"));
  }
}

// ---- conversions (no node) --------------------------------------------------------------

CacheSpec HybridEngineSpec(DType dtype, RopeSpec rope, RecurrentSpec recurrent) {
  CacheSpec spec;
  spec.name = "conv-hybrid";
  spec.dtype = dtype;
  spec.max_sequences = 3;
  spec.capacity = 64;
  spec.max_batch = 8;
  GroupSpec attention;
  attention.num_layers = 2;
  attention.attention.num_kv_heads = 2;
  attention.attention.head_dim_k = 8;
  attention.attention.head_dim_v = 6;
  attention.attention.rope = rope;
  GroupSpec rotating;
  rotating.num_layers = 3;
  rotating.kind = GroupKind::kRotating;
  rotating.rotating.num_kv_heads = 4;
  rotating.rotating.head_dim_k = 8;
  rotating.rotating.head_dim_v = 2;
  rotating.rotating.max_size = 16;
  rotating.rotating.rope = rope;
  GroupSpec rec;
  rec.num_layers = 1;
  rec.kind = GroupKind::kRecurrent;
  rec.recurrent = recurrent;
  spec.groups = {attention, rotating, rec};
  return spec;
}

TEST(ConvertTest, HybridSpecsRoundTripThroughProto) {
  RopeSpec none;
  RopeSpec normal{RopeType::kNormal, 8, 500000.0f, 0.25f};
  RopeSpec neox{RopeType::kNeox, 4, 10000.0f, 1.0f};
  RecurrentSpec conv_only{3, 96, 0, 0, 0};
  RecurrentSpec gated{3, 96, 4, 16, 8};
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const RopeSpec& rope : {none, normal, neox}) {
      for (const RecurrentSpec& recurrent : {conv_only, gated}) {
        const CacheSpec spec = HybridEngineSpec(dtype, rope, recurrent);
        ASSERT_TRUE(ValidateSpec(spec).ok()) << ValidateSpec(spec);
        const v1::CacheSpec proto = SpecToProto(spec);
        ASSERT_EQ(proto.groups_size(), 3);
        EXPECT_TRUE(proto.groups(0).has_attention());
        EXPECT_TRUE(proto.groups(1).has_rotating());
        EXPECT_TRUE(proto.groups(2).has_recurrent());
        EXPECT_EQ(proto.groups(1).rotating().max_size(), 16);
        EXPECT_EQ(proto.groups(1).rotating().rope().dims(), rope.dims);
        EXPECT_EQ(proto.groups(2).recurrent().conv_dim(), 96);
        EXPECT_EQ(proto.groups(2).recurrent().head_k_dim(), recurrent.head_k_dim);
        absl::StatusOr<CacheSpec> back = SpecFromProto(proto);
        ASSERT_TRUE(back.ok()) << back.status();
        EXPECT_TRUE(*back == spec) << proto.DebugString();
      }
    }
  }
}

TEST(ConvertTest, RotatingRopeIsCheckedLikeAttentions) {
  v1::CacheSpec proto = SpecProto("p", 2, 16, 4, {RotatingGroupProto(RotatingOptions())});
  proto.mutable_groups(0)->mutable_rotating()->mutable_rope()->set_type(
      static_cast<v1::RopeType>(7));
  absl::StatusOr<CacheSpec> spec = SpecFromProto(proto);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(), ::testing::HasSubstr("groups[0].rotating.rope.type = 7"));
  proto.mutable_groups(0)->clear_rotating();
  spec = SpecFromProto(proto);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(), ::testing::HasSubstr("groups[0] has no kind"));
}

TEST(ConvertTest, SnapshotInfoRoundTripsAndRejectsMalformedProtos) {
  SnapshotInfo info;
  info.id = 7;
  info.seq = 3;
  info.from = 4;
  info.to = 12;
  info.bytes = 4096;
  info.groups = {SnapshotGroupInfo{8, -1, StateStatus::kNone},
                 SnapshotGroupInfo{4, 0, StateStatus::kNone},
                 SnapshotGroupInfo{0, -1, StateStatus::kValid}};
  const v1::SnapshotInfo proto = SnapshotInfoToProto(info);
  EXPECT_EQ(proto.id(), 7u);
  EXPECT_EQ(proto.seq(), 3);
  EXPECT_EQ(proto.from_offset(), 4);
  EXPECT_EQ(proto.to_offset(), 12);
  EXPECT_EQ(proto.bytes(), 4096);
  ASSERT_EQ(proto.groups_size(), 3);
  EXPECT_EQ(proto.groups(1).group(), 1);
  EXPECT_EQ(proto.groups(1).ring_index(), 0);
  EXPECT_EQ(proto.groups(2).state(), v1::STATE_STATUS_VALID);
  absl::StatusOr<SnapshotInfo> back = SnapshotInfoFromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->id, info.id);
  EXPECT_EQ(back->seq, info.seq);
  EXPECT_EQ(back->from, info.from);
  EXPECT_EQ(back->to, info.to);
  EXPECT_EQ(back->bytes, info.bytes);
  ASSERT_EQ(back->groups.size(), 3u);
  for (size_t g = 0; g < 3; ++g) {
    EXPECT_EQ(back->groups[g].stored, info.groups[g].stored) << g;
    EXPECT_EQ(back->groups[g].ring_index, info.groups[g].ring_index) << g;
    EXPECT_EQ(back->groups[g].state, info.groups[g].state) << g;
  }

  v1::SnapshotInfo bad = proto;
  bad.set_bytes(-1);
  EXPECT_THAT(SnapshotInfoFromProto(bad).status().message(),
              ::testing::HasSubstr("snapshot.bytes = -1"));
  bad = proto;
  bad.mutable_groups(1)->set_group(2);
  EXPECT_THAT(SnapshotInfoFromProto(bad).status().message(),
              ::testing::HasSubstr("snapshot.groups[1].group = 2"));
  bad = proto;
  bad.mutable_groups(2)->set_state(static_cast<v1::StateStatus>(5));
  EXPECT_THAT(SnapshotInfoFromProto(bad).status().message(),
              ::testing::HasSubstr("snapshot.groups[2].state = 5"));
}

TEST(ConvertTest, StatesPendingAndSnapshotUsageReachTheProtos) {
  for (const auto& [engine, proto] : std::vector<std::pair<StateStatus, v1::StateStatus>>{
           {StateStatus::kNone, v1::STATE_STATUS_NONE},
           {StateStatus::kValid, v1::STATE_STATUS_VALID},
           {StateStatus::kInvalid, v1::STATE_STATUS_INVALID}}) {
    EXPECT_EQ(StateStatusToProto(engine), proto);
    EXPECT_EQ(*StateStatusFromProto("state", proto), engine);
  }

  SequenceInfo info;
  info.seq = 5;
  info.offset = 9;
  info.pending = 3;
  info.groups = {GroupSequenceInfo{9, 0, 0, 8, StateStatus::kNone},
                 GroupSequenceInfo{0, 1, -1, -1, StateStatus::kInvalid}};
  const v1::SequenceInfo seq = SequenceInfoToProto(info);
  EXPECT_EQ(seq.pending(), 3);
  EXPECT_EQ(seq.offset(), 9);
  ASSERT_EQ(seq.groups_size(), 2);
  EXPECT_EQ(seq.groups(0).state(), v1::STATE_STATUS_NONE);
  EXPECT_EQ(seq.groups(1).state(), v1::STATE_STATUS_INVALID);
  EXPECT_EQ(seq.groups(1).shared(), 1);

  ReadResult read;
  read.positions = {{1, 2}, {}};
  read.states = {StateStatus::kNone, StateStatus::kValid};
  read.payload = "abc";
  const v1::ReadHeader header = ReadHeaderToProto(read);
  ASSERT_EQ(header.groups_size(), 2);
  EXPECT_THAT(header.groups(0).positions(), ElementsAre(1, 2));
  EXPECT_EQ(header.groups(0).state(), v1::STATE_STATUS_NONE);
  EXPECT_EQ(header.groups(1).state(), v1::STATE_STATUS_VALID);
  EXPECT_EQ(header.payload_bytes(), 3);

  CacheUsage usage;
  usage.snapshots = 4;
  usage.snapshot_bytes = size_t{3} << 33;
  const v1::CacheUsage usage_proto = UsageToProto(usage);
  EXPECT_EQ(usage_proto.snapshots(), 4);
  EXPECT_EQ(usage_proto.snapshot_bytes(), int64_t{3} << 33);
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
