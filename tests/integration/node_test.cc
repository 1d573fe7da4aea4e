// kvmesh-node as a program: its flags, its startup failures, its listening line and port file,
// its message size limit, and a clean shutdown on SIGTERM and SIGINT, also with calls in flight.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/device/cuda_device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_util.h"
#include "tests/integration/node_fixture.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::MatchesRegex;

// Runs kvmesh-node with `args` and expects it to fail at startup with exit code 1 and `message`
// in its stderr, having printed nothing to stdout.
void ExpectStartupFailure(const std::vector<std::string>& args, const std::string& message) {
  absl::StatusOr<NodeRun> run = RunNodeToExit(args);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->status.exited) << run->status.ToString();
  EXPECT_EQ(run->status.code, 1) << run->stderr_text;
  EXPECT_THAT(run->stderr_text, HasSubstr(message));
  EXPECT_THAT(run->stdout_text, IsEmpty());
}

std::unique_ptr<NodeProcess> StartNode(std::vector<std::string> extra_args,
                                       const std::string& name = "node-test") {
  NodeProcess::Options options;
  options.node_name = name;
  options.extra_args = std::move(extra_args);
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  EXPECT_TRUE(node.ok()) << node.status();
  return node.ok() ? *std::move(node) : nullptr;
}

// A scratch directory for files the node writes.
std::string TempDir() {
  const char* env = std::getenv("TEST_TMPDIR");
  std::string dir =
      absl::StrCat(env != nullptr && *env != '\0' ? env : "/tmp", "/kvmesh-node-test-XXXXXX");
  return mkdtemp(dir.data()) != nullptr ? dir : "";
}

TEST(NodeTest, CudaDeviceThatDoesNotExistIsRefusedAtStartup) {
  // Ordinal 64 exists on no machine; without a GPU (or a CUDA build) ordinal 0 fails too.
  ExpectStartupFailure({"--listen=127.0.0.1:0", "--backend=cuda", "--device=64"},
                       CudaBuilt() ? "--backend=cuda --device=64: CUDA device 64 does not exist"
                                   : "built without CUDA");
  if (CudaDeviceCount() == 0) {
    ExpectStartupFailure({"--listen=127.0.0.1:0", "--backend=cuda"},
                         CudaBuilt() ? "CUDA device 0 does not exist: 0 CUDA devices are visible"
                                     : "built without CUDA");
  }
}

TEST(NodeTest, UnknownBackendIsRefused) {
  ExpectStartupFailure({"--listen=127.0.0.1:0", "--backend=tpu"}, "--backend=tpu");
}

TEST(NodeTest, BadFlagValuesAreRefused) {
  ExpectStartupFailure({"--listen=127.0.0.1:0", "--memory-budget=8GB"}, "'8GB'");
  ExpectStartupFailure({"--listen=127.0.0.1:0", "--memory-budget=-1"}, "'-1'");
  ExpectStartupFailure({"--listen=127.0.0.1:0", "--max-message-bytes=1KiB"},
                       "--max_message_bytes=1024");
  ExpectStartupFailure({"--listen=127.0.0.1:0", "--executor-threads=-2"}, "--executor_threads=-2");
  ExpectStartupFailure({"--listen=127.0.0.1:0", "--executor-queue=0"}, "--executor_queue=0");
  ExpectStartupFailure({"--listen=nohostport"}, "--listen=nohostport");
  ExpectStartupFailure({"--listen=127.0.0.1:0", "--no-such-flag=1"}, "no_such_flag");
}

TEST(NodeTest, PrintsOneListeningLineAndWritesThePortFile) {
  const std::string dir = TempDir();
  ASSERT_FALSE(dir.empty());
  const std::string port_file = dir + "/port";
  std::unique_ptr<NodeProcess> node = StartNode({"--port-file=" + port_file}, "alpha-1");
  ASSERT_NE(node, nullptr);
  EXPECT_THAT(node->listening_line(),
              MatchesRegex("kvmesh-node alpha-1 listening on 127\\.0\\.0\\.1:[0-9]+ backend=host peers=0"));
  std::ifstream in(port_file);
  int port = 0;
  in >> port;
  EXPECT_EQ(port, node->port());
  node->ReleaseChannel();
  EXPECT_TRUE(node->Stop().clean()) << node->ReadStderr();
  std::remove(port_file.c_str());
  rmdir(dir.c_str());
}

TEST(NodeTest, FlagsTakeUnderscoresToo) {
  std::unique_ptr<NodeProcess> node = StartNode({"--memory_budget=1MiB"});
  ASSERT_NE(node, nullptr);
  node->ReleaseChannel();
  EXPECT_TRUE(node->Stop().clean()) << node->ReadStderr();
}

TEST(NodeTest, ASecondNodeOnTheSamePortFailsToStart) {
  std::unique_ptr<NodeProcess> node = StartNode({});
  ASSERT_NE(node, nullptr);
  ExpectStartupFailure({absl::StrCat("--listen=127.0.0.1:", node->port())}, "cannot listen");
  node->ReleaseChannel();
  EXPECT_TRUE(node->Stop().clean()) << node->ReadStderr();
}

TEST(NodeTest, MemoryBudgetBoundsTheCaches) {
  std::unique_ptr<NodeProcess> node = StartNode({"--memory-budget=1MiB"});
  ASSERT_NE(node, nullptr);
  {
    std::unique_ptr<Stub> stub = node->NewStub();
    AttentionOptions a;
    a.num_layers = 4;
    a.num_kv_heads = 4;
    a.head_dim_k = 32;
    a.head_dim_v = 32;
    // 4 layers x 4 heads x 64 x 4 bytes = 4 KiB per token: 128 tokens = 512 KiB.
    KVMESH_EXPECT_OK(CreateCache(*stub, SpecProto("half", 1, 128, 8, {AttentionGroupProto(a)})));
    // Another 768 KiB does not fit the remaining 512 KiB.
    const grpc::Status status =
        CreateCache(*stub, SpecProto("too-much", 1, 192, 8, {AttentionGroupProto(a)}));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("786432"));
    EXPECT_THAT(status.error_message(), HasSubstr("1048576"));
    // Deleting the first cache gives its memory back.
    KVMESH_EXPECT_OK(DeleteCache(*stub, "half"));
    KVMESH_EXPECT_OK(
        CreateCache(*stub, SpecProto("too-much", 1, 192, 8, {AttentionGroupProto(a)})));
  }
  node->ReleaseChannel();
  EXPECT_TRUE(node->Stop().clean()) << node->ReadStderr();
}

TEST(NodeTest, MessageLimitBoundsAppendAndCutsReadChunks) {
  std::unique_ptr<NodeProcess> node = StartNode({"--max-message-bytes=64KiB"});
  ASSERT_NE(node, nullptr);
  {
    std::unique_ptr<Stub> stub = node->NewStub();
    AttentionOptions a;
    a.num_layers = 2;
    a.num_kv_heads = 4;
    a.head_dim_k = 32;
    a.head_dim_v = 32;
    // 2 x 4 x 64 x 4 = 2 KiB per token; 50 tokens = 100 KiB.
    const v1::CacheSpec spec = SpecProto("limits", 1, 64, 64, {AttentionGroupProto(a)});
    KVMESH_ASSERT_OK(CreateCache(*stub, spec));
    std::vector<int32_t> positions(50);
    for (int32_t i = 0; i < 50; ++i) positions[i] = i;
    const v1::AppendRequest request = MakeAppend(spec, 0, positions);
    const grpc::Status too_big = Append(*stub, request);
    EXPECT_EQ(too_big.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(too_big);
    // The same payload in 32 KiB stream messages fits.
    KVMESH_ASSERT_OK(AppendStream(*stub, StreamMessages(request, 0, 32 << 10)));

    // Asking for 1 MiB chunks: each message is cut to fit 64 KiB.
    ReadOutput out;
    KVMESH_ASSERT_OK(Read(*stub, ReadRequest("limits", 0, 0, std::nullopt, 1 << 20), &out));
    SequenceModel model;
    ModelAppend(spec, 0, positions, 0, &model);
    EXPECT_EQ(out.payload, ExpectedReadPayload(spec, model, {positions}));
    EXPECT_EQ(out.messages, 2);
    for (size_t size : out.chunk_sizes) EXPECT_LT(size, size_t{64} << 10);
  }
  node->ReleaseChannel();
  EXPECT_TRUE(node->Stop().clean()) << node->ReadStderr();
}

TEST(NodeTest, SigintShutsDownCleanly) {
  std::unique_ptr<NodeProcess> node = StartNode({});
  ASSERT_NE(node, nullptr);
  node->ReleaseChannel();
  ASSERT_EQ(kill(node->pid(), SIGINT), 0);
  const ExitStatus status = node->Stop();
  EXPECT_TRUE(status.clean()) << status.ToString() << node->ReadStderr();
  EXPECT_THAT(node->ReadStderr(), HasSubstr("shutting down"));
}

TEST(NodeTest, SigtermWithAStalledReadInFlightShutsDownCleanly) {
  std::unique_ptr<NodeProcess> node = StartNode({});
  ASSERT_NE(node, nullptr);
  std::unique_ptr<Stub> stub = node->NewStub();
  AttentionOptions a;
  a.num_layers = 8;
  a.num_kv_heads = 8;
  a.head_dim_k = 64;
  a.head_dim_v = 64;
  // 8 x 8 x 128 x 4 = 32 KiB per token: 1024 tokens = 32 MiB, far beyond what HTTP/2 flow
  // control and the socket buffers take without the client reading.
  const v1::CacheSpec spec = SpecProto("stall", 1, 1024, 1024, {AttentionGroupProto(a)});
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  std::vector<int32_t> positions(1024);
  for (int32_t i = 0; i < 1024; ++i) positions[i] = i;
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 0, positions)));

  // The client reads one message and then stops, so the node's writes stall until the
  // shutdown's grace period ends and the call is cancelled.
  grpc::ClientContext context;
  SetDeadline(&context);
  std::unique_ptr<grpc::ClientReader<v1::ReadResponse>> reader =
      stub->Read(&context, ReadRequest("stall", 0, 0, std::nullopt, 64 << 10));
  v1::ReadResponse message;
  ASSERT_TRUE(reader->Read(&message));
  const ExitStatus status = node->Stop();
  EXPECT_TRUE(status.clean()) << status.ToString() << node->ReadStderr();
  size_t received = message.data().size();
  while (reader->Read(&message)) received += message.data().size();
  EXPECT_LT(received, size_t{32} << 20);
  EXPECT_NE(reader->Finish().error_code(), grpc::StatusCode::OK);
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
