// kvmesh-node as a program: its flags, its startup failures, its listening line and port file,
// its message size limit, a clean shutdown on SIGTERM and SIGINT, also with calls in flight, and
// which transports it offers: when it loads NCCL and when it refuses to start without it.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cache/device/cuda_device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "tests/integration/client_util.h"
#include "tests/integration/node_fixture.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::MatchesRegex;
using ::testing::Not;

// Whether this kvmesh-node was built with the nccl transport, and the libnccl the build found
// for tests (empty: none).
constexpr bool kNodeHasNccl = KVMESH_TEST_NODE_HAS_NCCL;
constexpr char kNcclLibrary[] = KVMESH_TEST_NCCL_LIBRARY;
constexpr char kMissingNccl[] = "/nonexistent-kvmesh-dir/libnccl.so.2";

// Runs kvmesh-node with `args` (and `env`, as NodeProcess::Options::env) and expects it to fail
// at startup with exit code 1 and `message` in its stderr, having printed nothing to stdout.
// Returns the stderr.
std::string ExpectStartupFailure(const std::vector<std::string>& args, const std::string& message,
                                 const std::vector<std::string>& env = {}) {
  absl::StatusOr<NodeRun> run = RunNodeToExit(args, absl::Seconds(30), env);
  EXPECT_TRUE(run.ok()) << run.status();
  if (!run.ok()) return "";
  EXPECT_TRUE(run->status.exited) << run->status.ToString();
  EXPECT_EQ(run->status.code, 1) << run->stderr_text;
  EXPECT_THAT(run->stderr_text, HasSubstr(message));
  EXPECT_THAT(run->stdout_text, IsEmpty());
  return run->stderr_text;
}

// How often `needle` occurs in `text`.
int Count(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

// PeerService/NodeInfo of a running node.
v1::NodeInfoResponse NodeInfo(const NodeProcess& node) {
  std::unique_ptr<v1::PeerService::Stub> stub = v1::PeerService::NewStub(node.channel());
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::NodeInfoResponse info;
  const grpc::Status status = stub->NodeInfo(&context, v1::NodeInfoRequest(), &info);
  EXPECT_TRUE(status.ok()) << StatusText(status);
  return info;
}

// /proc/<pid>/maps: the files mapped into process `pid`.
std::string MappedFiles(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/maps"));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
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

TEST(NodeTest, HelpListsTheNodesOwnFlagsWithDefaults) {
  absl::StatusOr<NodeRun> run = RunNodeToExit({"--help"}, absl::Seconds(30));
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string help = run->stdout_text + run->stderr_text;
  EXPECT_THAT(help, HasSubstr("Caches live in memory only: a node that restarts starts empty"));
  EXPECT_THAT(help, HasSubstr("Flags from service/node_main.cc:"));
  for (const char* flag :
       {"--listen", "--memory_budget", "--metrics_port", "--log_level", "--log_format",
        "--kept_arena_limit", "--drain_timeout_ms", "--peers", "--token_file"}) {
    EXPECT_THAT(help, HasSubstr(absl::StrCat("    ", flag, " ("))) << flag;
  }
  EXPECT_THAT(help, HasSubstr("default: \"127.0.0.1:7700\""));
  // absl's own flags are under --helpfull only.
  EXPECT_THAT(help, Not(HasSubstr("--flagfile")));
  EXPECT_THAT(help, Not(HasSubstr("No flags matched")));
}

TEST(NodeTest, VersionPrintsTheBuildsVersionAndType) {
  absl::StatusOr<NodeRun> run = RunNodeToExit({"--version"}, absl::Seconds(30));
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->status.exited && run->status.code == 0) << run->status.ToString();
  // "kvmesh-node 0.1.0-g5b0f470 (RelWithDebInfo build)", or a tag, or -dirty.
  EXPECT_THAT(run->stdout_text,
              MatchesRegex("kvmesh-node [0-9v][^ ]* \\([A-Za-z]+(\\+[a-z]+)? build[^)]*\\)\n"));
  EXPECT_THAT(run->stdout_text, Not(HasSubstr("Debug build\n")));
}

TEST(NodeTest, NodeInfoCarriesABootIdNewAtEveryStart) {
  std::unique_ptr<NodeProcess> first = StartNode({}, "boot-node");
  ASSERT_NE(first, nullptr);
  const absl::Time before = absl::Now();
  const v1::NodeInfoResponse a = NodeInfo(*first);
  EXPECT_EQ(a.boot_id().size(), 32u);
  EXPECT_FALSE(a.version().empty());
  EXPECT_LE(a.start_time_unix_ms(), absl::ToUnixMillis(before));
  EXPECT_GT(a.start_time_unix_ms(), absl::ToUnixMillis(before - absl::Minutes(2)));
  EXPECT_EQ(NodeInfo(*first).boot_id(), a.boot_id());  // stable while it runs
  first->ReleaseChannel();
  ASSERT_TRUE(first->Stop().clean());
  std::unique_ptr<NodeProcess> second = StartNode({}, "boot-node");
  ASSERT_NE(second, nullptr);
  const v1::NodeInfoResponse b = NodeInfo(*second);
  EXPECT_EQ(b.name(), a.name());
  EXPECT_NE(b.boot_id(), a.boot_id());
  EXPECT_GE(b.start_time_unix_ms(), a.start_time_unix_ms());
  second->ReleaseChannel();
  EXPECT_TRUE(second->Stop().clean());
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
  EXPECT_THAT(
      node->listening_line(),
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

TEST(NodeTest, NcclTransportNeedsTheCudaBackend) {
  const std::string message =
      "--transport=nccl needs --backend=cuda, but this node has --backend=host";
  ExpectStartupFailure({"--listen=127.0.0.1:0", "--transport=nccl"}, message);
  ExpectStartupFailure({"--listen=127.0.0.1:0", "--backend=host", "--transport=nccl"}, message);
  ExpectStartupFailure({"--listen=127.0.0.1:0", "--transport=rdma"},
                       "--transport=rdma is not a transport");
}

TEST(NodeTest, HostNodeNeverLoadsNccl) {
  // Even with a loadable NCCL named in its environment, a host node neither links nor loads it
  // (it runs where there is none), and offers grpc-stream only.
  NodeProcess::Options options;
  options.node_name = "host-node";
  options.extra_args = {"--transport=auto"};
  if (kNcclLibrary[0] != '\0') options.env = {absl::StrCat("KVMESH_NCCL_LIBRARY=", kNcclLibrary)};
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  ASSERT_TRUE(node.ok()) << node.status();
  const std::string maps = MappedFiles((*node)->pid());
  ASSERT_THAT(maps, HasSubstr("kvmesh-node"));  // the file was readable
  EXPECT_THAT(maps, Not(HasSubstr("libnccl")));
  const v1::NodeInfoResponse info = NodeInfo(**node);
  EXPECT_EQ(info.backend(), "host");
  EXPECT_THAT(info.transports(), ElementsAre("grpc-stream"));
  (*node)->ReleaseChannel();
  EXPECT_TRUE((*node)->Stop().clean()) << (*node)->ReadStderr();
  EXPECT_THAT((*node)->ReadStderr(), Not(HasSubstr("nccl")));
}

TEST(NodeTest, TransportNcclWithoutLoadableNcclIsRefused) {
  const std::vector<std::string> args = {"--listen=127.0.0.1:0", "--backend=cuda",
                                         "--transport=nccl"};
  if (!kNodeHasNccl) {
    ExpectStartupFailure(args, "--transport=nccl: this kvmesh-node was built without NCCL");
    return;
  }
  // Refused before the device is opened: the library and dlerror's reason.
  const std::string missing = ExpectStartupFailure(
      args, absl::StrCat("--transport=nccl: cannot load NCCL from ", kMissingNccl, ": "),
      {absl::StrCat("KVMESH_NCCL_LIBRARY=", kMissingNccl)});
  EXPECT_THAT(missing, HasSubstr("No such file or directory"));
  EXPECT_THAT(missing, Not(HasSubstr("CUDA device")));
  // A library that is not NCCL: the first symbol it lacks.
  ExpectStartupFailure(args, "has no symbol ncclGetVersion", {"KVMESH_NCCL_LIBRARY=libz.so.1"});
}

TEST(NodeTest, TransportAutoWithoutLoadableNcclGoesOnWithGrpcStream) {
  if (!kNodeHasNccl) GTEST_SKIP() << "kvmesh-node was built without NCCL";
  const std::vector<std::string> env = {absl::StrCat("KVMESH_NCCL_LIBRARY=", kMissingNccl)};
  const std::string line = absl::StrCat(
      "kvmesh-node cuda-node: no nccl transport, grpc-stream only: cannot load NCCL from ",
      kMissingNccl);
  if (CudaDeviceCount() == 0) {
    // One line about NCCL, then the node goes on, and stops at the missing GPU.
    const std::string err = ExpectStartupFailure(
        {"--listen=127.0.0.1:0", "--node-name=cuda-node", "--backend=cuda", "--transport=auto"},
        "CUDA device 0 does not exist", env);
    EXPECT_EQ(Count(err, line), 1) << err;
    return;
  }
  NodeProcess::Options options;
  options.node_name = "cuda-node";
  options.extra_args = {"--backend=cuda", "--transport=auto", "--memory-budget=64MiB",
                        "--snapshot-budget=64MiB"};
  options.env = env;
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  ASSERT_TRUE(node.ok()) << node.status();
  EXPECT_EQ(Count((*node)->ReadStderr(), line), 1) << (*node)->ReadStderr();
  EXPECT_THAT(NodeInfo(**node).transports(), ElementsAre("grpc-stream"));
  (*node)->ReleaseChannel();
  EXPECT_TRUE((*node)->Stop().clean()) << (*node)->ReadStderr();
}

// A node on the simulated GPU of a -DKVMESH_CUDA=SIM build never passes for one on a GPU: its
// backend (NodeInfo, and so ListMembers) and its start-up say so.
TEST(NodeTest, SimulatedGpuNodeSaysItIsSimulated) {
  if (!CudaSimulated()) GTEST_SKIP() << "not a -DKVMESH_CUDA=SIM build";
  NodeProcess::Options options;
  options.node_name = "sim-node";
  options.extra_args = {"--backend=cuda", "--transport=grpc-stream", "--memory-budget=64MiB",
                        "--snapshot-budget=64MiB"};
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  ASSERT_TRUE(node.ok()) << node.status();
  EXPECT_EQ(NodeInfo(**node).backend(), "cuda:0 (simulated)");
  EXPECT_THAT((*node)->ReadStderr(), HasSubstr("cuda:0 (simulated) is the SIMULATED GPU"));
  (*node)->ReleaseChannel();
  EXPECT_TRUE((*node)->Stop().clean()) << (*node)->ReadStderr();
}

TEST(NodeTest, CudaNodeLoadsNccl) {
  if (!kNodeHasNccl) GTEST_SKIP() << "kvmesh-node was built without NCCL";
  if (kNcclLibrary[0] == '\0') GTEST_SKIP() << "the build found no libnccl";
  const std::vector<std::string> env = {absl::StrCat("KVMESH_NCCL_LIBRARY=", kNcclLibrary)};
  const std::string line = "kvmesh-node cuda-node: nccl transport: NCCL ";
  const std::string from = absl::StrCat(" from ", kNcclLibrary, "\n");
  if (CudaDeviceCount() == 0) {
    // NCCL loads (its version checked against nccl.h) before the device is opened.
    const std::string err = ExpectStartupFailure(
        {"--listen=127.0.0.1:0", "--node-name=cuda-node", "--backend=cuda", "--transport=nccl"},
        "CUDA device 0 does not exist", env);
    EXPECT_EQ(Count(err, line), 1) << err;
    EXPECT_THAT(err, HasSubstr(from));
    return;
  }
  NodeProcess::Options options;
  options.node_name = "cuda-node";
  options.extra_args = {"--backend=cuda", "--transport=nccl", "--memory-budget=64MiB",
                        "--snapshot-budget=64MiB"};
  options.env = env;
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  ASSERT_TRUE(node.ok()) << node.status();
  EXPECT_EQ(Count((*node)->ReadStderr(), line), 1) << (*node)->ReadStderr();
  EXPECT_THAT((*node)->ReadStderr(), HasSubstr(from));
  EXPECT_THAT(NodeInfo(**node).transports(), ElementsAre("grpc-stream", "nccl"));
  (*node)->ReleaseChannel();
  EXPECT_TRUE((*node)->Stop().clean()) << (*node)->ReadStderr();
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
