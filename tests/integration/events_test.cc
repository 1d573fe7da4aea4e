// WatchEvents (docs/api.md#watchevents) against real kvmesh-node processes: the listing, then
// events in order as the cache changes; resuming from a cursor; a restart (new boot id); a log
// too small for a watcher that does not read (ABORTED, never a slower writer); bad requests.
#include <signal.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_util.h"
#include "tests/integration/node_fixture.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<NodeProcess> StartEventsNode(const std::string& name,
                                             std::vector<std::string> args = {}) {
  NodeProcess::Options options;
  options.node_name = name;
  options.extra_args = std::move(args);
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  EXPECT_TRUE(node.ok()) << node.status();
  return node.ok() ? *std::move(node) : nullptr;
}

// Stops `node` after closing the test's connection to it (an idle client channel would hold the
// node's shutdown for its grace period). Every Watch must be gone: a ClientContext keeps its
// call's channel.
void Stop(std::unique_ptr<NodeProcess>& node, std::unique_ptr<Stub>& stub) {
  stub.reset();
  node->ReleaseChannel();
  const ExitStatus status = node->Stop();
  EXPECT_TRUE(status.clean()) << status.ToString() << "; stderr:\n" << node->ReadStderr();
}

v1::CacheSpec EventsSpec() {
  v1::CacheSpec spec =
      SpecProto("ev", 4, 64, 16, {AttentionGroupProto(AttentionOptions())}, v1::DTYPE_F16);
  spec.set_token_block_size(4);
  return spec;
}

// An Append of positions [begin, end) of `seq` with token id 100 + p at position p.
grpc::Status AppendIds(Stub& stub, const v1::CacheSpec& spec, int64_t seq, int32_t begin,
                       int32_t end) {
  std::vector<int32_t> positions;
  for (int32_t p = begin; p < end; ++p) positions.push_back(p);
  v1::AppendRequest request = MakeAppend(spec, seq, positions);
  for (v1::Token& t : *request.mutable_tokens()) t.set_token_id(100 + t.pos());
  return Append(stub, request);
}

// One open WatchEvents stream.
class Watch {
 public:
  Watch(Stub& stub, const v1::WatchEventsRequest& request) {
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    reader_ = stub.WatchEvents(&context_, request);
  }
  ~Watch() {
    if (finished_) return;
    context_.TryCancel();
    v1::WatchEventsResponse ignored;
    while (reader_->Read(&ignored)) {
    }
    (void)reader_->Finish();
  }

  // The next message; false when the stream ended (status() says why).
  bool Next(v1::WatchEventsResponse* message) { return reader_->Read(message); }
  // Once the stream ended: why.
  grpc::Status status() {
    finished_ = true;
    const grpc::Status status = reader_->Finish();
    reader_.reset();  // the call's reference to the channel goes with it
    return status;
  }

  // Events until one of `kind` arrives (it included); fails the test at the end of the stream.
  std::vector<v1::Event> Until(v1::EventKind kind) {
    std::vector<v1::Event> events;
    v1::WatchEventsResponse message;
    while (Next(&message)) {
      last_ = message;
      for (const v1::Event& e : message.events()) {
        events.push_back(e);
        if (e.kind() == kind) return events;
      }
    }
    ADD_FAILURE() << "the stream ended before a " << v1::EventKind_Name(kind) << " event";
    return events;
  }
  const v1::WatchEventsResponse& last() const { return last_; }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader_;
  v1::WatchEventsResponse last_;
  bool finished_ = false;
};

TEST(EventsTest, AListingThenEveryChangeInOrder) {
  std::unique_ptr<NodeProcess> node = StartEventsNode("ev-node");
  ASSERT_NE(node, nullptr);
  std::unique_ptr<Stub> stub = node->NewStub();
  const v1::CacheSpec spec = EventsSpec();
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  KVMESH_ASSERT_OK(AppendIds(*stub, spec, 1, 0, 9));  // two blocks of 4

  v1::WatchEventsRequest request;
  request.add_caches("ev");
  Watch watch(*stub, request);
  v1::WatchEventsResponse message;
  // The listing: seq 1's two blocks, then synced.
  std::vector<v1::Event> listed;
  while (watch.Next(&message)) {
    listed.insert(listed.end(), message.events().begin(), message.events().end());
    if (message.synced()) break;
  }
  ASSERT_TRUE(message.synced());
  const std::string boot_id = message.boot_id();
  EXPECT_EQ(boot_id.size(), 32u);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].kind(), v1::EVENT_KIND_BLOCKS);
  EXPECT_EQ(listed[0].number(), 0u);
  EXPECT_EQ(listed[0].seq(), 1);
  EXPECT_EQ(listed[0].offset(), 9);
  ASSERT_EQ(listed[0].block_hashes_size(), 2);
  const uint64_t second_block = listed[0].block_hashes(1);

  // A fork: seq 2 gets seq 1's blocks.
  KVMESH_ASSERT_OK(CopyPrefix(*stub, "ev", 1, 2, 9));
  std::vector<v1::Event> events = watch.Until(v1::EVENT_KIND_BLOCKS);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().seq(), 2);
  EXPECT_EQ(events.back().kept_blocks(), 0);
  ASSERT_EQ(events.back().block_hashes_size(), 2);
  EXPECT_EQ(events.back().block_hashes(1), second_block);
  uint64_t number = events.back().number();
  EXPECT_GT(number, 0u);
  // Growing seq 1 adds its third block only.
  KVMESH_ASSERT_OK(AppendIds(*stub, spec, 1, 9, 13));
  events = watch.Until(v1::EVENT_KIND_BLOCKS);
  EXPECT_EQ(events.back().seq(), 1);
  EXPECT_EQ(events.back().kept_blocks(), 2);
  EXPECT_EQ(events.back().block_hashes_size(), 1);
  EXPECT_EQ(events.back().offset(), 13);
  EXPECT_GT(events.back().number(), number);
  number = events.back().number();
  // A context shift: REMOVED, then the blocks from the removed range on go.
  KVMESH_ASSERT_OK(Remove(*stub, "ev", 1, 2, 3));
  events = watch.Until(v1::EVENT_KIND_BLOCKS);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events[events.size() - 2].kind(), v1::EVENT_KIND_REMOVED);
  EXPECT_EQ(events[events.size() - 2].begin(), 2);
  EXPECT_EQ(events[events.size() - 2].end(), 3);
  EXPECT_EQ(events.back().kept_blocks(), 0);  // [0, 4) held position 2
  EXPECT_EQ(events.back().block_hashes_size(), 0);
  // Snapshots.
  v1::SnapshotInfo snapshot;
  KVMESH_ASSERT_OK(Snapshot(*stub, "ev", 2, 0, &snapshot));
  events = watch.Until(v1::EVENT_KIND_SNAPSHOT_CREATED);
  EXPECT_EQ(events.back().snapshot(), snapshot.id());
  EXPECT_EQ(events.back().seq(), 2);
  const uint64_t resume_at = watch.last().next();
  // The whole sequence goes: its blocks go with it (offset 0).
  KVMESH_ASSERT_OK(Remove(*stub, "ev", 2, 0));
  events = watch.Until(v1::EVENT_KIND_BLOCKS);
  EXPECT_EQ(events.back().seq(), 2);
  EXPECT_EQ(events.back().offset(), 0);

  // Resuming from a cursor replays what came after it, in the same order.
  v1::WatchEventsRequest resume = request;
  resume.set_boot_id(boot_id);
  resume.set_next(resume_at);
  Watch again(*stub, resume);
  events = again.Until(v1::EVENT_KIND_BLOCKS);
  EXPECT_EQ(events.front().number(), resume_at);
  EXPECT_EQ(events.back().seq(), 2);
  EXPECT_EQ(events.back().offset(), 0);
  // Another cache's events are not this watcher's; its deletion is everyone's who watches all.
  v1::WatchEventsRequest all;
  Watch everything(*stub, all);
  v1::WatchEventsResponse first;
  ASSERT_TRUE(everything.Next(&first));
  while (!first.synced()) ASSERT_TRUE(everything.Next(&first));
  KVMESH_ASSERT_OK(DeleteCache(*stub, "ev"));
  events = everything.Until(v1::EVENT_KIND_CACHE_DELETED);
  EXPECT_EQ(events.back().cache(), "ev");
  // The node's shutdown ends the streams still open (UNAVAILABLE), at once.
  v1::WatchEventsResponse rest;
  node->ReleaseChannel();
  const absl::Time stop = absl::Now();
  ASSERT_EQ(kill(node->pid(), SIGTERM), 0);
  while (everything.Next(&rest)) {
  }
  const grpc::Status ended = everything.status();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(ended);
  EXPECT_THAT(ended.error_message(), HasSubstr("shutting down"));
  EXPECT_LT(absl::Now() - stop, absl::Seconds(4));
  Stop(node, stub);
}

TEST(EventsTest, BadRequestsAndARestart) {
  std::unique_ptr<NodeProcess> node = StartEventsNode("ev-restart");
  ASSERT_NE(node, nullptr);
  std::unique_ptr<Stub> stub = node->NewStub();
  v1::WatchEventsRequest unknown;
  unknown.add_caches("nosuch");
  {
    Watch watch(*stub, unknown);
    v1::WatchEventsResponse message;
    EXPECT_FALSE(watch.Next(&message));
    const grpc::Status status = watch.status();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << StatusText(status);
  }
  v1::WatchEventsRequest wrong_boot;
  wrong_boot.set_boot_id("0123456789abcdef0123456789abcdef");
  wrong_boot.set_next(1);
  {
    Watch watch(*stub, wrong_boot);
    v1::WatchEventsResponse message;
    EXPECT_FALSE(watch.Next(&message));
    const grpc::Status status = watch.status();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("restarted"));
  }
  // A cursor past what the node numbered.
  std::string boot_id;
  {
    Watch watch(*stub, v1::WatchEventsRequest());
    v1::WatchEventsResponse message;
    ASSERT_TRUE(watch.Next(&message));
    boot_id = message.boot_id();
  }
  v1::WatchEventsRequest ahead;
  ahead.set_boot_id(boot_id);
  ahead.set_next(1000000);
  {
    Watch watch(*stub, ahead);
    v1::WatchEventsResponse message;
    EXPECT_FALSE(watch.Next(&message));
    const grpc::Status status = watch.status();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("next = 1000000"));
  }
  // After a restart the boot id is new, and the old cursor is refused.
  Stop(node, stub);
  node = StartEventsNode("ev-restart");
  ASSERT_NE(node, nullptr);
  stub = node->NewStub();
  v1::WatchEventsRequest old;
  old.set_boot_id(boot_id);
  old.set_next(1);
  {
    Watch watch(*stub, old);
    v1::WatchEventsResponse message;
    EXPECT_FALSE(watch.Next(&message));
    const grpc::Status status = watch.status();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << StatusText(status);
  }
  Stop(node, stub);
}

// A log of 64 KiB and a watcher that reads nothing while 12 MiB of block hashes are published
// (more than gRPC's windows hold): the writers go on, the watcher is ended with ABORTED once its
// cursor is dropped (RESOURCE_EXHAUSTED: the log's bound), and resuming from that cursor is
// FAILED_PRECONDITION.
TEST(EventsTest, ASlowWatcherIsCutOffNotWaitedFor) {
  std::unique_ptr<NodeProcess> node = StartEventsNode("ev-slow", {"--event_log_bytes=64KiB"});
  ASSERT_NE(node, nullptr);
  std::unique_ptr<Stub> stub = node->NewStub();
  v1::CacheSpec spec = EventsSpec();
  spec.set_token_block_size(1);
  spec.set_capacity(4096);
  spec.set_max_batch(1024);
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  {
    Watch watch(*stub, v1::WatchEventsRequest());
    v1::WatchEventsResponse message;
    ASSERT_TRUE(watch.Next(&message));
    ASSERT_TRUE(message.synced());
    const std::string boot_id = message.boot_id();
    // Each round: 4,096 tokens in four Appends (a block hash per token), then a Remove of all.
    const absl::Time start = absl::Now();
    for (int round = 0; round < 400; ++round) {
      for (int32_t p = 0; p < 4096; p += 1024)
        KVMESH_ASSERT_OK(AppendIds(*stub, spec, 0, p, p + 1024));
      KVMESH_ASSERT_OK(Remove(*stub, "ev", 0, 0));
    }
    std::printf("[ events   ] 400 rounds of appends and removes in %s\n",
                absl::FormatDuration(absl::Now() - start).c_str());
    int messages = 0;
    while (watch.Next(&message)) ++messages;
    const grpc::Status status = watch.status();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("fell behind"));
    v1::WatchEventsRequest resume;
    resume.set_boot_id(boot_id);
    resume.set_next(1);
    Watch again(*stub, resume);
    EXPECT_FALSE(again.Next(&message));
    const grpc::Status resumed = again.status();
    EXPECT_EQ(resumed.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << StatusText(resumed);
    EXPECT_THAT(resumed.error_message(), HasSubstr("no longer kept"));
  }
  Stop(node, stub);
}

// Eviction over the service (docs/api.md#eviction): a cache created with the LRU policy makes
// room for an Append by evicting the least recently used unpinned sequence, says so in an
// EVICTED event, and the node's sweep removes a sequence idle past its TTL.
TEST(EventsTest, EvictionsAndExpiriesAreEventsAndRetentionIsListed) {
  std::unique_ptr<NodeProcess> node = StartEventsNode("ev-evict", {"--ttl_sweep_ms=50"});
  ASSERT_NE(node, nullptr);
  std::unique_ptr<Stub> stub = node->NewStub();
  // 4 sequences of 16 positions fill the cache's 64 cells.
  v1::CacheSpec spec =
      SpecProto("lru", 4, 16, 16, {AttentionGroupProto(AttentionOptions())}, v1::DTYPE_F16);
  spec.set_eviction(v1::EVICTION_POLICY_LRU);
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  v1::GetCacheResponse got;
  KVMESH_ASSERT_OK(GetCache(*stub, "lru", &got));
  EXPECT_EQ(got.cache().spec().eviction(), v1::EVICTION_POLICY_LRU);
  std::vector<int32_t> all;
  for (int32_t p = 0; p < 16; ++p) all.push_back(p);
  for (int64_t seq = 1; seq <= 4; ++seq) {
    KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, seq, all)));
    absl::SleepFor(absl::Milliseconds(5));
  }
  auto set_retention = [&](int64_t seq, int32_t priority, bool pinned, int64_t ttl_ms,
                           v1::SetRetentionResponse* response) {
    return SetRetention(*stub, "lru", seq, priority, pinned, ttl_ms, response);
  };
  v1::SetRetentionResponse set;
  KVMESH_ASSERT_OK(set_retention(1, 0, true, 0, &set));
  EXPECT_TRUE(set.sequence().pinned());
  EXPECT_EQ(set.sequence().offset(), 16);
  // Errors name the bad value and change nothing.
  grpc::Status bad = set_retention(9, 0, false, 0, &set);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::NOT_FOUND) << StatusText(bad);
  EXPECT_THAT(bad.error_message(), HasSubstr("9"));
  bad = set_retention(2, 0, false, -5, &set);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(bad);
  EXPECT_THAT(bad.error_message(), HasSubstr("-5"));

  v1::WatchEventsRequest request;
  request.add_caches("lru");
  std::optional<Watch> watch;
  watch.emplace(*stub, request);
  v1::WatchEventsResponse message;
  while (watch->Next(&message) && !message.synced()) {
  }
  ASSERT_TRUE(message.synced());
  // Sequence 1 is the least recently used but pinned: 2 goes.
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 5, all)));
  std::vector<v1::Event> events = watch->Until(v1::EVENT_KIND_EVICTED);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().seq(), 2);
  EXPECT_EQ(events.back().reason(), "lru");
  EXPECT_EQ(events.back().offset(), 16);
  v1::ListSequencesResponse listed;
  KVMESH_ASSERT_OK(ListSequences(*stub, "lru", &listed));
  std::vector<int64_t> seqs;
  for (const v1::SequenceInfo& info : listed.sequences()) {
    seqs.push_back(info.seq());
    EXPECT_EQ(info.pinned(), info.seq() == 1) << info.seq();
  }
  EXPECT_EQ(seqs, (std::vector<int64_t>{1, 3, 4, 5}));
  // With every other sequence pinned or in use, a refusal keeps everything and says why.
  for (int64_t seq : {3, 4, 5}) KVMESH_ASSERT_OK(set_retention(seq, 0, true, 0, &set));
  const grpc::Status refused = Append(*stub, MakeAppend(spec, 6, all));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(refused);
  EXPECT_THAT(refused.error_message(), HasSubstr("would not make room"));
  EXPECT_THAT(ShortageText(refused), HasSubstr("SEQUENCES_EXHAUSTED"));
  // A TTL: the sweep removes sequence 3 once it has been idle 200 ms, pinned or not.
  KVMESH_ASSERT_OK(set_retention(3, 0, true, 200, &set));
  EXPECT_EQ(set.sequence().ttl_ms(), 200);
  events = watch->Until(v1::EVENT_KIND_EVICTED);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().seq(), 3);
  EXPECT_EQ(events.back().reason(), "ttl");
  KVMESH_ASSERT_OK(ListSequences(*stub, "lru", &listed));
  EXPECT_EQ(listed.sequences_size(), 3);
  watch.reset();
  Stop(node, stub);
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
