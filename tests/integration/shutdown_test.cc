// SIGTERM while a cross-node CopyPrefix runs (docs/api.md#drain): the operation finishes and
// answers OK, and its data is readable where it ended up, whether the node that gets the signal
// is the copy's destination (its drain waits for the copy, then moves what it wrote to the peer)
// or its source (it keeps serving the transfer before it shuts its servers down).
//
// Two real kvmesh-node processes on 127.0.0.1; the sender is slowed down
// (--testing-chunk-delay-ms) so that the signal comes mid-transfer, which the test sees as the
// sender's export copy existing (export_bytes > 0).
#include <signal.h>

#include <cstdint>
#include <future>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_util.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::HasSubstr;

constexpr char kDrains[] = "--drain-timeout-ms=30000";
constexpr char kStopsAtOnce[] = "--drain-timeout-ms=0";

// F16, 4 layers x 8 heads x head_dim 128: 16 KiB per token; 256 tokens are one 4 MiB chunk
// of the grpc-stream transport.
v1::CacheSpec BigSpec() {
  AttentionOptions a;
  a.num_layers = 4;
  a.num_kv_heads = 8;
  a.head_dim_k = 128;
  a.head_dim_v = 128;
  a.rope = v1::ROPE_TYPE_NEOX;
  a.rope_dims = 128;
  return SpecProto("big", 4, 4096, 512, {AttentionGroupProto(a)}, v1::DTYPE_F16);
}

std::vector<int32_t> Range(int32_t begin, int32_t end) {
  std::vector<int32_t> out(end - begin);
  std::iota(out.begin(), out.end(), begin);
  return out;
}

void AppendTokens(Stub& stub, const v1::CacheSpec& spec, int64_t seq, int32_t tokens,
                  uint64_t seed) {
  for (int32_t begin = 0; begin < tokens; begin += spec.max_batch()) {
    const int32_t end = std::min(tokens, begin + spec.max_batch());
    const grpc::Status status = Append(stub, MakeAppend(spec, seq, Range(begin, end), seed));
    ASSERT_TRUE(status.ok()) << StatusText(status);
  }
}

ReadOutput ReadAll(Stub& stub, const std::string& cache, int64_t seq) {
  ReadOutput out;
  const grpc::Status status = Read(stub, ReadRequest(cache, seq), &out);
  EXPECT_TRUE(status.ok()) << StatusText(status);
  return out;
}

void ExpectSameRead(const ReadOutput& got, const ReadOutput& want, const std::string& what) {
  EXPECT_EQ(got.header.SerializeAsString(), want.header.SerializeAsString())
      << what << ": " << got.header.DebugString() << " vs " << want.header.DebugString();
  EXPECT_TRUE(got.payload == want.payload) << what << ": payloads differ (" << got.payload.size()
                                           << " vs " << want.payload.size() << " bytes)";
}

uint64_t ExportBytes(Stub& stub) {
  v1::GetCacheResponse response;
  if (!GetCache(stub, "big", &response).ok()) return 0;
  return response.cache().usage().export_bytes();
}

grpc::Status CopyFrom(Stub& stub, const std::string& source, int64_t src, int64_t dst,
                      int32_t length) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(60));
  v1::CopyPrefixRequest request;
  request.set_cache("big");
  request.set_src_seq(src);
  request.set_dst_seq(dst);
  request.set_length(length);
  request.set_source_node(source);
  v1::CopyPrefixResponse response;
  return stub.CopyPrefix(&context, request, &response);
}

template <typename F>
bool Eventually(F condition, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return condition();
}

// node-a (index 0) and node-b (index 1), each with the big cache, knowing each other. The node
// a test signals drains for up to 30 s (kDrains); the other one, stopped at the end with its
// peer gone, does not drain (kStopsAtOnce).
class ShutdownTest : public ::testing::Test {
 protected:
  void Start(const std::vector<std::string>& a_flags, const std::vector<std::string>& b_flags) {
    const int ports[2] = {ReservePort(), ReservePort()};
    ASSERT_NE(ports[0], 0);
    ASSERT_NE(ports[1], 0);
    const char* names[2] = {"node-a", "node-b"};
    const std::vector<std::string>* flags[2] = {&a_flags, &b_flags};
    for (int i = 0; i < 2; ++i) {
      NodeProcess::Options options;
      options.node_name = names[i];
      options.port = ports[i];
      options.extra_args = {absl::StrCat("--peers=", names[1 - i], "=127.0.0.1:", ports[1 - i]),
                            "--memory-budget=512MiB", "--snapshot-budget=512MiB"};
      options.extra_args.insert(options.extra_args.end(), flags[i]->begin(), flags[i]->end());
      absl::StatusOr<std::unique_ptr<NodeProcess>> process = NodeProcess::Start(options);
      ASSERT_TRUE(process.ok()) << process.status();
      nodes_[i] = *std::move(process);
      stubs_[i] = nodes_[i]->NewStub();
    }
    spec_ = BigSpec();
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(CreateCache(*stubs_[i], spec_).ok());
  }

  // Sends SIGTERM to node i and waits for it to exit; it must exit 0.
  void Terminate(int i) {
    ASSERT_EQ(kill(nodes_[i]->pid(), SIGTERM), 0);
    stubs_[i].reset();
    nodes_[i]->ReleaseChannel();
    const ExitStatus exit = nodes_[i]->Stop(absl::Seconds(60));
    EXPECT_TRUE(exit.clean()) << exit.ToString() << "\n" << nodes_[i]->ReadStderr();
  }

  void TearDown() override {
    for (int i = 0; i < 2; ++i) {
      stubs_[i].reset();
      if (nodes_[i] == nullptr) continue;
      if (nodes_[i]->channel() != nullptr) nodes_[i]->ReleaseChannel();
      const ExitStatus exit = nodes_[i]->Stop();
      EXPECT_TRUE(exit.clean()) << exit.ToString() << "\n" << nodes_[i]->ReadStderr();
    }
  }

  std::unique_ptr<NodeProcess> nodes_[2];
  std::unique_ptr<Stub> stubs_[2];
  v1::CacheSpec spec_;
};

// b gets SIGTERM while it pulls two prefixes from a: one into a sequence it does not have yet
// (admitted before the drain began), one over a sequence it holds. Both copies answer OK; b's
// drain then moves both sequences to a, where they read as the source's prefix.
TEST_F(ShutdownTest, CopiesIntoANodeThatGetsSigtermFinishAndAreDrainedToThePeer) {
  // 1024 tokens are four 4 MiB chunks and a fifth with the rest: 2.5 s at 500 ms a chunk.
  constexpr int32_t kTokens = 1024;
  ASSERT_NO_FATAL_FAILURE(Start({"--testing-chunk-delay-ms=500", kStopsAtOnce}, {kDrains}));
  ASSERT_NO_FATAL_FAILURE(AppendTokens(*stubs_[0], spec_, 0, kTokens, 21));
  ASSERT_NO_FATAL_FAILURE(AppendTokens(*stubs_[1], spec_, 2, 16, 99));  // b's own sequence 2
  const ReadOutput source = ReadAll(*stubs_[0], "big", 0);

  Stub& b = *stubs_[1];
  // One export after the other exists on a: both payloads are on their way.
  auto into_new =
      std::async(std::launch::async, [&] { return CopyFrom(b, "node-a", 0, 1, kTokens); });
  uint64_t exported = 0;
  ASSERT_TRUE(
      Eventually([&] { return (exported = ExportBytes(*stubs_[0])) > 0; }, absl::Seconds(10)))
      << "the copy into a new sequence did not start";
  auto over_held =
      std::async(std::launch::async, [&] { return CopyFrom(b, "node-a", 0, 2, kTokens); });
  ASSERT_TRUE(Eventually([&] { return ExportBytes(*stubs_[0]) > exported; }, absl::Seconds(10)))
      << "the copy over a held sequence did not start";
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(kill(nodes_[1]->pid(), SIGTERM), 0);
  const grpc::Status new_status = into_new.get();
  const grpc::Status held_status = over_held.get();
  EXPECT_TRUE(new_status.ok()) << "copy into a new sequence: " << StatusText(new_status);
  EXPECT_TRUE(held_status.ok()) << "copy over a held sequence: " << StatusText(held_status);
  // The copies were still running when the signal came.
  EXPECT_GT(absl::Now() - signalled, absl::Milliseconds(500));
  ASSERT_NO_FATAL_FAILURE(Terminate(1));
  const std::string log = nodes_[1]->ReadStderr();
  EXPECT_THAT(log, HasSubstr("2 sequences and 0 snapshots moved, 0 items stayed")) << log;

  // a uses sequence 0 only, so both keep their ids there.
  v1::ListSequencesResponse listed;
  ASSERT_TRUE(ListSequences(*stubs_[0], "big", &listed).ok());
  ASSERT_EQ(listed.sequences_size(), 3) << listed.DebugString();
  ExpectSameRead(ReadAll(*stubs_[0], "big", 1), source, "the copy into a new sequence");
  ExpectSameRead(ReadAll(*stubs_[0], "big", 2), source, "the copy over a held sequence");
}

// a gets SIGTERM while b pulls a prefix from it, of a sequence that is gone from a by then (so
// a's drain has nothing to move and ends at once): a serves the transfer to its end (longer
// than the shutdown's 5 s grace for calls in flight) before it shuts down.
TEST_F(ShutdownTest, ANodeThatGetsSigtermServesATransferFromItToTheEnd) {
  // 255 tokens (16 KiB each) and the image's header fit one 4 MiB chunk: 6 s.
  constexpr int32_t kTokens = 255;
  ASSERT_NO_FATAL_FAILURE(Start({"--testing-chunk-delay-ms=6000", kDrains}, {kStopsAtOnce}));
  ASSERT_NO_FATAL_FAILURE(AppendTokens(*stubs_[0], spec_, 0, kTokens, 21));
  const ReadOutput source = ReadAll(*stubs_[0], "big", 0);

  auto copy =
      std::async(std::launch::async, [&] { return CopyFrom(*stubs_[1], "node-a", 0, 1, kTokens); });
  ASSERT_TRUE(Eventually([&] { return ExportBytes(*stubs_[0]) > 0; }, absl::Seconds(10)))
      << "the copy did not start";
  ASSERT_TRUE(Remove(*stubs_[0], "big", 0, 0, std::nullopt).ok());
  const absl::Time signalled = absl::Now();
  ASSERT_NO_FATAL_FAILURE(Terminate(0));
  const grpc::Status status = copy.get();
  EXPECT_TRUE(status.ok()) << StatusText(status);
  EXPECT_GT(absl::Now() - signalled, absl::Seconds(5));
  const std::string log = nodes_[0]->ReadStderr();
  EXPECT_THAT(log, HasSubstr("0 sequences and 0 snapshots moved, 0 items stayed")) << log;
  ExpectSameRead(ReadAll(*stubs_[1], "big", 1), source, "the copy");
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
