// The service layer in-process, where the test controls the executor: an overloaded executor
// refuses calls at once with UNAVAILABLE, an accepted call waits for a worker without holding a
// gRPC thread, and the executor drains on shutdown. Also the protobuf <-> engine conversions.
#include <atomic>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/cache_registry.h"
#include "cache/device/host_device.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "service/cache_service.h"
#include "service/common/convert.h"
#include "service/common/flags.h"
#include "service/executor.h"
#include "tests/integration/client_util.h"
#include "tests/integration/node_fixture.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::HasSubstr;

// A CacheServiceImpl on an in-process server, with an executor of `threads` workers and room
// for `queue` waiting tasks.
class InProcessNode {
 public:
  InProcessNode(int threads, size_t queue)
      : device_(64 << 20),
        registry_(&device_),
        executor_(threads, queue),
        service_(&registry_, &executor_, CacheServiceImpl::Options()) {
    grpc::ServerBuilder builder;
    builder.RegisterService(&service_);
    builder.RegisterCallbackGenericService(service_.request_gate());
    server_ = builder.BuildAndStart();
    stub_ = v1::CacheService::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }

  ~InProcessNode() {
    stub_.reset();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    executor_.Shutdown();
    server_->Wait();
  }

  Executor& executor() { return executor_; }
  Stub& stub() { return *stub_; }

 private:
  HostDevice device_;
  CacheRegistry registry_;
  Executor executor_;
  CacheServiceImpl service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Stub> stub_;
};

// Occupies every worker of an executor until Release().
class Blocker {
 public:
  Blocker() : released_(release_.get_future().share()) {}
  ~Blocker() { Release(); }

  // Submits a task that blocks one worker and waits until it runs.
  bool BlockOneWorker(Executor& executor) {
    auto started = std::make_shared<std::promise<void>>();
    std::future<void> running = started->get_future();
    std::shared_future<void> released = released_;
    if (!executor.Submit([started, released] {
          started->set_value();
          released.wait();
        })) {
      return false;
    }
    running.wait();
    return true;
  }

  // Queues a task that waits for Release() too.
  bool QueueBlocked(Executor& executor) {
    std::shared_future<void> released = released_;
    return executor.Submit([released] { released.wait(); });
  }

  void Release() {
    if (!done_) release_.set_value();
    done_ = true;
  }

 private:
  std::promise<void> release_;
  std::shared_future<void> released_;
  bool done_ = false;
};

// Polls `condition` until it holds or 30 seconds pass.
template <typename Condition>
bool PollUntil(Condition condition) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

v1::CacheSpec TinySpec(const std::string& name) {
  AttentionOptions a;
  a.num_layers = 1;
  a.num_kv_heads = 1;
  return SpecProto(name, 2, 8, 4, {AttentionGroupProto(a)});
}

TEST(ServiceInProcessTest, FullExecutorRefusesEveryRpcWithUnavailable) {
  InProcessNode node(/*threads=*/1, /*queue=*/1);
  KVMESH_ASSERT_OK(CreateCache(node.stub(), TinySpec("c")));
  Blocker blocker;
  ASSERT_TRUE(blocker.BlockOneWorker(node.executor()));
  ASSERT_TRUE(blocker.QueueBlocked(node.executor()));
  EXPECT_FALSE(node.executor().Submit([] {}));

  std::vector<std::pair<std::string, grpc::Status>> results;
  v1::GetCacheResponse got;
  results.emplace_back("GetCache", GetCache(node.stub(), "c", &got));
  results.emplace_back("Append", Append(node.stub(), MakeAppend(TinySpec("c"), 0, {0})));
  results.emplace_back(
      "AppendStream",
      AppendStream(node.stub(), StreamMessages(MakeAppend(TinySpec("c"), 0, {0}), 0, 8)));
  ReadOutput out;
  results.emplace_back("Read", Read(node.stub(), ReadRequest("c", 0), &out));
  bool can_resume = false;
  results.emplace_back("CanResume", CanResume(node.stub(), "c", 0, 0, &can_resume));
  results.emplace_back("Snapshot", Snapshot(node.stub(), "c", 0, 0));
  results.emplace_back("Restore", Restore(node.stub(), "c", 0, std::nullopt, 0));
  results.emplace_back("MergeSnapshots", MergeSnapshots(node.stub(), "c", 1, 2));
  results.emplace_back("SplitSnapshot", SplitSnapshot(node.stub(), "c", 1, 0));
  results.emplace_back("DropSnapshot", DropSnapshot(node.stub(), "c", 1));
  v1::ListSnapshotsResponse snapshots;
  results.emplace_back("ListSnapshots", ListSnapshots(node.stub(), "c", &snapshots));
  results.emplace_back("CommitSpeculation", CommitSpeculation(node.stub(), "c", 0, 0));
  for (const auto& [rpc, status] : results) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
        << rpc << ": " << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("overloaded")) << rpc;
  }

  blocker.Release();
  ASSERT_TRUE(PollUntil([&] { return node.executor().queued() == 0; }));
  // Nothing was applied, and the node serves again.
  v1::ListSequencesResponse seqs;
  const grpc::Status listed = ListSequences(node.stub(), "c", &seqs);
  EXPECT_TRUE(listed.ok()) << StatusText(listed);
  EXPECT_EQ(seqs.sequences_size(), 0);
}

TEST(ServiceInProcessTest, AcceptedCallWaitsForAWorkerNotForAGrpcThread) {
  InProcessNode node(/*threads=*/1, /*queue=*/8);
  KVMESH_ASSERT_OK(CreateCache(node.stub(), TinySpec("c")));
  Blocker blocker;
  ASSERT_TRUE(blocker.BlockOneWorker(node.executor()));

  // Both calls are accepted and queued while the only worker is busy.
  grpc::Status appended, listed;
  v1::ListCachesResponse caches;
  std::thread append([&] { appended = Append(node.stub(), MakeAppend(TinySpec("c"), 1, {0, 1})); });
  std::thread list([&] { listed = ListCaches(node.stub(), &caches); });
  ASSERT_TRUE(PollUntil([&] { return node.executor().queued() == 2; }));

  blocker.Release();
  append.join();
  list.join();
  EXPECT_TRUE(appended.ok()) << StatusText(appended);
  EXPECT_TRUE(listed.ok()) << StatusText(listed);
  ASSERT_EQ(caches.caches_size(), 1);
  EXPECT_EQ(caches.caches(0).spec().name(), "c");
}

TEST(ExecutorTest, ShutdownRunsEveryAcceptedTaskThenRefuses) {
  Executor executor(2, 100);
  Blocker blocker;
  ASSERT_TRUE(blocker.BlockOneWorker(executor));
  ASSERT_TRUE(blocker.BlockOneWorker(executor));
  std::atomic<int> ran{0};
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(executor.Submit([&ran] { ran.fetch_add(1); }));
  EXPECT_FALSE(executor.Submit([] {})) << "the queue holds 100 tasks";
  EXPECT_EQ(executor.queued(), 100u);

  std::thread shutdown([&executor] { executor.Shutdown(); });
  ASSERT_TRUE(PollUntil([&] { return !executor.Submit([] {}); }));
  blocker.Release();
  shutdown.join();
  EXPECT_EQ(ran.load(), 100);
  EXPECT_FALSE(executor.Submit([&ran] { ran.fetch_add(1); }));
  executor.Shutdown();  // idempotent
  EXPECT_EQ(ran.load(), 100);
}

// ---- conversions ----------------------------------------------------------------------------

CacheSpec EngineSpecWith(WindowSpec window, RopeSpec rope, DType dtype) {
  CacheSpec spec;
  spec.name = "conv";
  spec.dtype = dtype;
  spec.max_sequences = 3;
  spec.capacity = 100;
  spec.max_batch = 10;
  GroupSpec group;
  group.num_layers = 2;
  group.attention.num_kv_heads = 2;
  group.attention.head_dim_k = 8;
  group.attention.head_dim_v = 6;
  group.attention.window = window;
  group.attention.rope = rope;
  spec.groups = {group, group};
  spec.groups[1].num_layers = 3;
  return spec;
}

TEST(ConvertTest, SpecsRoundTripThroughProto) {
  WindowSpec full;
  WindowSpec sliding;
  sliding.kind = WindowKind::kSliding;
  sliding.window = 16;
  sliding.memory = 20;
  WindowSpec chunked;
  chunked.kind = WindowKind::kChunked;
  chunked.chunk = 32;
  RopeSpec none;
  RopeSpec normal{RopeType::kNormal, 8, 500000.0f, 0.25f};
  RopeSpec neox{RopeType::kNeox, 4, 10000.0f, 1.0f};
  for (const WindowSpec& window : {full, sliding, chunked}) {
    for (const RopeSpec& rope : {none, normal, neox}) {
      for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
        const CacheSpec spec = EngineSpecWith(window, rope, dtype);
        ASSERT_TRUE(ValidateSpec(spec).ok()) << ValidateSpec(spec);
        const v1::CacheSpec proto = SpecToProto(spec);
        absl::StatusOr<CacheSpec> back = SpecFromProto(proto);
        ASSERT_TRUE(back.ok()) << back.status();
        EXPECT_TRUE(*back == spec) << proto.DebugString();
      }
    }
  }
}

TEST(ConvertTest, UnsetWindowMeansFullAndFieldsMapOneToOne) {
  v1::CacheSpec proto =
      SpecProto("p", 2, 16, 4, {AttentionGroupProto(AttentionOptions())}, v1::DTYPE_BF16);
  ASSERT_FALSE(proto.groups(0).attention().has_window());
  absl::StatusOr<CacheSpec> spec = SpecFromProto(proto);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "p");
  EXPECT_EQ(spec->dtype, DType::kBF16);
  EXPECT_EQ(spec->max_sequences, 2);
  EXPECT_EQ(spec->capacity, 16);
  EXPECT_EQ(spec->max_batch, 4);
  ASSERT_EQ(spec->groups.size(), 1u);
  EXPECT_EQ(spec->groups[0].num_layers, 2);
  EXPECT_EQ(spec->groups[0].attention.window.kind, WindowKind::kFull);
  EXPECT_EQ(spec->groups[0].attention.rope.type, RopeType::kNormal);
  EXPECT_EQ(spec->groups[0].attention.rope.dims, 2);
  // An empty Window message is no different.
  proto.mutable_groups(0)->mutable_attention()->mutable_window();
  absl::StatusOr<CacheSpec> again = SpecFromProto(proto);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*again == *spec);
}

TEST(ConvertTest, StatusCodesMapOneToOne) {
  for (int code = 0; code <= 16; ++code) {
    const absl::Status status(static_cast<absl::StatusCode>(code), "the message");
    const grpc::Status grpc_status = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(grpc_status.error_code()), code);
    EXPECT_EQ(grpc_status.error_message(), code == 0 ? "" : "the message");
    EXPECT_EQ(FromGrpcStatus(grpc_status), status);
  }
}

TEST(ConvertTest, UsageReportsUnlimitedMemoryAsZero) {
  CacheUsage usage;
  usage.groups.push_back(GroupUsage{100, 7, kUnlimitedMemory, 4096});
  usage.groups.push_back(GroupUsage{30, 3, 9, 1024});
  usage.groups[0].cells_reserved = 5;
  usage.sequences_live = 2;
  usage.sequences_reserved = 1;
  usage.bytes_held = 5120;
  const v1::CacheUsage proto = UsageToProto(usage);
  EXPECT_EQ(proto.groups(0).cells_reserved(), 5);
  EXPECT_EQ(proto.groups(1).cells_reserved(), 0);
  EXPECT_EQ(proto.sequences_reserved(), 1);
  ASSERT_EQ(proto.groups_size(), 2);
  EXPECT_EQ(proto.groups(0).group(), 0);
  EXPECT_EQ(proto.groups(0).memory(), 0);
  EXPECT_EQ(proto.groups(0).cells_total(), 100);
  EXPECT_EQ(proto.groups(0).cells_used(), 7);
  EXPECT_EQ(proto.groups(0).bytes(), 4096);
  EXPECT_EQ(proto.groups(1).group(), 1);
  EXPECT_EQ(proto.groups(1).memory(), 9);
  EXPECT_EQ(proto.sequences_live(), 2);
  EXPECT_EQ(proto.bytes_held(), 5120);
}

TEST(FlagsTest, ByteSizesParseWithBinarySuffixes) {
  EXPECT_EQ(*ParseByteSize("0"), 0u);
  EXPECT_EQ(*ParseByteSize("1234"), 1234u);
  EXPECT_EQ(*ParseByteSize("512B"), 512u);
  EXPECT_EQ(*ParseByteSize("64KiB"), 64u << 10);
  EXPECT_EQ(*ParseByteSize("8MiB"), 8u << 20);
  EXPECT_EQ(*ParseByteSize("8GiB"), uint64_t{8} << 30);
  EXPECT_EQ(*ParseByteSize("2TiB"), uint64_t{2} << 40);
  for (const char* bad : {"", "GiB", "8GB", "8 GiB", "-1", "1.5GiB", "0x10", "99999999999TiB"}) {
    const absl::StatusOr<uint64_t> parsed = ParseByteSize(bad);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(absl::StrCat("'", bad, "'")));
  }
  EXPECT_EQ(FormatByteSize(uint64_t{8} << 30), "8GiB");
  EXPECT_EQ(FormatByteSize(3 << 20), "3MiB");
  EXPECT_EQ(FormatByteSize(1000), "1000");
  EXPECT_EQ(FormatByteSize(0), "0");
}

TEST(FlagsTest, FlagNamesTakeDashes) {
  std::vector<std::string> in = {"prog", "--node-name=a-b", "--memory-budget", "1GiB", "-v",
                                 "--",   "--not-a-flag"};
  std::vector<char*> argv;
  for (std::string& arg : in) argv.push_back(arg.data());
  std::vector<std::string> storage;
  const std::vector<char*> out =
      NormalizeFlagNames(static_cast<int>(argv.size()), argv.data(), &storage);
  ASSERT_EQ(out.size(), in.size() + 1);
  EXPECT_STREQ(out[1], "--node_name=a-b");
  EXPECT_STREQ(out[2], "--memory_budget");
  EXPECT_STREQ(out[3], "1GiB");
  EXPECT_STREQ(out[4], "-v");
  EXPECT_STREQ(out[5], "--");
  EXPECT_STREQ(out[6], "--not-a-flag");
  EXPECT_EQ(out[7], nullptr);
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
