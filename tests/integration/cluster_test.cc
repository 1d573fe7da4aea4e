// Cluster operations between real kvmesh-node processes on 127.0.0.1 (docs/cluster.md):
// ListMembers, CopyPrefix from another node, Migrate, MigrateSnapshot and Remove across the
// cluster, on a hybrid cache (full and sliding Attention, Rotating, Recurrent) and an
// Attention-only one; then the faults: the receiver killed mid-transfer, the sender killed
// mid-transfer, a frozen sender (SIGSTOP), a corrupted chunk, concurrent migrations of one
// sequence. Whatever survives is compared byte for byte with what was written (pattern
// payloads of tests/testing/pattern.h), and leftovers are checked through Usage: a lease that
// expired has freed its copy (export_bytes back to 0), a failed receiver holds no partial
// sequence.
//
// Two flavours of cluster (tests/integration/CMakeLists.txt registers both): host nodes moving
// payloads over grpc-stream (cluster_test), and, with KVMESH_TEST_CLUSTER=nccl, nodes on the
// simulated GPU of a -DKVMESH_CUDA=SIM build (--backend=cuda) moving them over the nccl
// transport through the simulated NCCL (cluster_test_nccl). The fault knobs of the sender
// (--testing-chunk-delay-ms, --testing-corrupt-chunk) act on grpc-stream chunks or nccl pieces
// alike; nccl pieces are 4 MiB there, so that a transfer has several.
#include <signal.h>
#include <algorithm>
#include <array>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

bool NcclCluster() {
  const char* flavour = std::getenv("KVMESH_TEST_CLUSTER");
  return flavour != nullptr && std::string(flavour) == "nccl";
}

// The transport cross-node operations of this flavour use.
std::string ExpectedTransport() { return NcclCluster() ? "nccl" : "grpc-stream"; }

std::vector<int32_t> Range(int32_t begin, int32_t end) {
  std::vector<int32_t> out(end - begin);
  std::iota(out.begin(), out.end(), begin);
  return out;
}

// F32, one layer per group: full Attention, sliding Attention (window 2), Rotating (max_size
// 4), Recurrent (conv 2 x 3, delta 1 x 2 x 2).
v1::CacheSpec HybridSpec() {
  AttentionOptions full;
  full.num_layers = 1;
  full.num_kv_heads = 1;
  AttentionOptions sliding = full;
  sliding.sliding_window = 2;
  RotatingOptions rotating;
  rotating.max_size = 4;
  return SpecProto("hybrid", 4, 64, 16,
                   {AttentionGroupProto(full), AttentionGroupProto(sliding),
                    RotatingGroupProto(rotating), RecurrentGroupProto(RecurrentOptions())});
}

// F16, 4 layers x 8 heads x head_dim 128: 16 KiB per token, so 2048 tokens are 32 MiB, which
// the slowed-down sender of the fault tests needs seconds to send.
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
constexpr int32_t kBigTokens = 2048;

struct ClusterNode {
  std::string name;
  NodeProcess::Options options;
  std::unique_ptr<NodeProcess> process;
  std::unique_ptr<Stub> stub;
};

// Nodes that know each other from --peers (ports reserved before they start).
class Cluster {
 public:
  // extra[i]: more flags for node i.
  void Start(const std::vector<std::string>& names,
             const std::vector<std::vector<std::string>>& extra = {}) {
    std::vector<int> ports;
    for (size_t i = 0; i < names.size(); ++i) {
      ports.push_back(ReservePort());
      ASSERT_NE(ports.back(), 0);
    }
    for (size_t i = 0; i < names.size(); ++i) {
      std::vector<std::string> peers;
      for (size_t j = 0; j < names.size(); ++j) {
        if (j != i) peers.push_back(absl::StrCat(names[j], "=127.0.0.1:", ports[j]));
      }
      NodeProcess::Options options;
      options.node_name = names[i];
      options.port = ports[i];
      options.extra_args = {absl::StrCat("--peers=", absl::StrJoin(peers, ",")),
                            "--memory-budget=512MiB", "--snapshot-budget=512MiB"};
      if (NcclCluster()) {
        options.extra_args.insert(options.extra_args.end(), {"--backend=cuda", "--transport=nccl",
                                                             "--testing-nccl-chunk-bytes=4MiB"});
        options.env = {absl::StrCat("KVMESH_NCCL_LIBRARY=", KVMESH_TEST_NCCL_LIBRARY)};
      }
      if (i < extra.size()) {
        options.extra_args.insert(options.extra_args.end(), extra[i].begin(), extra[i].end());
      }
      absl::StatusOr<std::unique_ptr<NodeProcess>> process = NodeProcess::Start(options);
      ASSERT_TRUE(process.ok()) << process.status();
      ClusterNode node;
      node.name = names[i];
      node.options = options;
      node.process = *std::move(process);
      node.stub = node.process->NewStub();
      nodes_.push_back(std::move(node));
    }
  }
  // Stops node i and starts a new process in its place (same name and port, so the others
  // reach it again), with `extra` flags added to those it had.
  void Restart(size_t i, const std::vector<std::string>& extra = {}) {
    ClusterNode& node = nodes_[i];
    node.stub.reset();
    node.process->ReleaseChannel();
    const ExitStatus stopped = node.process->Stop();
    EXPECT_TRUE(stopped.clean()) << node.name << ": kvmesh-node " << stopped.ToString()
                                 << "; stderr:\n"
                                 << node.process->ReadStderr();
    NodeProcess::Options options = node.options;
    options.extra_args.insert(options.extra_args.end(), extra.begin(), extra.end());
    absl::StatusOr<std::unique_ptr<NodeProcess>> process = NodeProcess::Start(options);
    ASSERT_TRUE(process.ok()) << process.status();
    node.process = *std::move(process);
    node.stub = node.process->NewStub();
  }
  // Clients drop their connections first, so that no node waits for an idle client during
  // its shutdown; then every node is stopped at once.
  ~Cluster() {
    for (ClusterNode& node : nodes_) {
      node.stub.reset();
      node.process->ReleaseChannel();
    }
    std::vector<std::thread> stops;
    std::vector<ExitStatus> statuses(nodes_.size());
    for (size_t i = 0; i < nodes_.size(); ++i) {
      stops.emplace_back([this, &statuses, i] { statuses[i] = nodes_[i].process->Stop(); });
    }
    for (std::thread& t : stops) t.join();
    // Every node that the test did not kill (SIGKILL) exits 0 on SIGTERM: a sanitizer report
    // or a crash in a node fails the test that ran it.
    for (size_t i = 0; i < nodes_.size(); ++i) {
      const ExitStatus& s = statuses[i];
      const bool killed_by_test = !s.exited && s.signal == SIGKILL && !s.killed_after_timeout;
      EXPECT_TRUE(s.clean() || killed_by_test)
          << nodes_[i].name << ": kvmesh-node " << s.ToString() << "; stderr:\n"
          << nodes_[i].process->ReadStderr();
    }
  }
  ClusterNode& operator[](size_t i) { return nodes_[i]; }
  Stub& stub(size_t i) { return *nodes_[i].stub; }

 private:
  std::vector<ClusterNode> nodes_;
};

// Appends `tokens` positions of `seq` (pattern ids of `seed`) in batches of max_batch.
void AppendTokens(Stub& stub, const v1::CacheSpec& spec, int64_t seq, int32_t tokens,
                  uint64_t seed) {
  for (int32_t begin = 0; begin < tokens; begin += spec.max_batch()) {
    const int32_t end = std::min(tokens, begin + spec.max_batch());
    const grpc::Status status = Append(stub, MakeAppend(spec, seq, Range(begin, end), seed));
    ASSERT_TRUE(status.ok()) << StatusText(status);
  }
}

// AppendTokens with token ids: id 1000 + p at position p.
void AppendPrompt(Stub& stub, const v1::CacheSpec& spec, int64_t seq, int32_t tokens,
                  uint64_t seed) {
  for (int32_t begin = 0; begin < tokens; begin += spec.max_batch()) {
    const int32_t end = std::min(tokens, begin + spec.max_batch());
    v1::AppendRequest request = MakeAppend(spec, seq, Range(begin, end), seed);
    for (v1::Token& t : *request.mutable_tokens()) t.set_token_id(1000 + t.pos());
    const grpc::Status status = Append(stub, request);
    ASSERT_TRUE(status.ok()) << StatusText(status);
  }
}

// The token chain of `seq` as ListSequences reports it: (tokens, exact_tokens, token_blocks).
std::array<int32_t, 3> TokenCounts(Stub& stub, const std::string& cache, int64_t seq) {
  v1::ListSequencesResponse listed;
  const grpc::Status status = ListSequences(stub, cache, &listed);
  EXPECT_TRUE(status.ok()) << StatusText(status);
  for (const v1::SequenceInfo& s : listed.sequences()) {
    if (s.seq() == seq) return {s.tokens(), s.exact_tokens(), s.token_blocks()};
  }
  return {-1, -1, -1};
}

// What a Read of the whole sequence returns: header and payload.
ReadOutput ReadAll(Stub& stub, const std::string& cache, int64_t seq) {
  ReadOutput out;
  const grpc::Status status = Read(stub, ReadRequest(cache, seq), &out);
  EXPECT_TRUE(status.ok()) << StatusText(status);
  return out;
}

// Whether two reads returned the same positions, states and bytes.
void ExpectSameRead(const ReadOutput& a, const ReadOutput& b) {
  EXPECT_EQ(a.header.SerializeAsString(), b.header.SerializeAsString())
      << a.header.DebugString() << " vs " << b.header.DebugString();
  EXPECT_EQ(a.payload.size(), b.payload.size());
  EXPECT_TRUE(a.payload == b.payload) << "payloads differ";
}

std::vector<int64_t> LiveSeqs(Stub& stub, const std::string& cache) {
  v1::ListSequencesResponse list;
  const grpc::Status status = ListSequences(stub, cache, &list);
  EXPECT_TRUE(status.ok()) << StatusText(status);
  std::vector<int64_t> seqs;
  for (const v1::SequenceInfo& s : list.sequences()) seqs.push_back(s.seq());
  return seqs;
}

v1::CacheUsage Usage(Stub& stub, const std::string& cache) {
  v1::GetCacheResponse response;
  const grpc::Status status = GetCache(stub, cache, &response);
  EXPECT_TRUE(status.ok()) << StatusText(status);
  return response.cache().usage();
}

grpc::Status CopyFrom(Stub& stub, const std::string& cache, const std::string& source, int64_t src,
                      int64_t dst, int32_t length, v1::CopyPrefixResponse* response,
                      absl::Duration timeout = kCallTimeout, int32_t require_src_offset = 0) {
  grpc::ClientContext context;
  SetDeadline(&context, timeout);
  v1::CopyPrefixRequest request;
  request.set_cache(cache);
  request.set_src_seq(src);
  request.set_dst_seq(dst);
  request.set_length(length);
  request.set_source_node(source);
  request.set_require_src_offset(require_src_offset);
  return stub.CopyPrefix(&context, request, response);
}

grpc::Status MigrateSeq(Stub& stub, const std::string& cache, int64_t seq,
                        const std::string& target, int64_t target_seq, bool keep_source,
                        v1::MigrateResponse* response = nullptr,
                        absl::Duration timeout = kCallTimeout) {
  grpc::ClientContext context;
  SetDeadline(&context, timeout);
  v1::MigrateRequest request;
  request.set_cache(cache);
  request.set_seq(seq);
  request.set_target_node(target);
  request.set_target_seq(target_seq);
  request.set_keep_source(keep_source);
  v1::MigrateResponse ignored;
  return stub.Migrate(&context, request, response != nullptr ? response : &ignored);
}

// Polls `condition` every 50 ms until it holds or `timeout` passes.
template <typename F>
bool Eventually(F condition, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return condition();
}

// ---- happy paths ---------------------------------------------------------------------------

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(cluster_.Start({"node-a", "node-b", "node-c"}));
    for (size_t i = 0; i < 3; ++i) {
      ASSERT_TRUE(CreateCache(cluster_.stub(i), HybridSpec()).ok());
    }
  }
  Cluster cluster_;
};

TEST_F(ClusterTest, ListMembersReportsEveryNode) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ListMembersResponse members;
  const grpc::Status status =
      cluster_.stub(1).ListMembers(&context, v1::ListMembersRequest(), &members);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  ASSERT_EQ(members.members_size(), 3);
  EXPECT_EQ(members.members(0).name(), "node-b");
  EXPECT_TRUE(members.members(0).self());
  EXPECT_EQ(members.members(1).name(), "node-a");
  EXPECT_EQ(members.members(2).name(), "node-c");
  for (const v1::Member& m : members.members()) {
    EXPECT_EQ(m.health(), v1::MEMBER_HEALTH_SERVING) << m.DebugString();
    // A node on the simulated GPU says so (never passing for one on a GPU).
    EXPECT_EQ(m.backend(), NcclCluster() ? "cuda:0 (simulated)" : "host") << m.DebugString();
    EXPECT_THAT(m.transports(), ::testing::Contains("grpc-stream"));
    if (NcclCluster()) {
      EXPECT_THAT(m.transports(), ::testing::Contains("nccl"));
    }
  }
  EXPECT_EQ(members.members(1).address(), cluster_[0].process->address());

  // A stopped member is reported unreachable, quickly.
  cluster_[2].process->Stop();
  grpc::ClientContext again;
  SetDeadline(&again);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(cluster_.stub(1).ListMembers(&again, v1::ListMembersRequest(), &members).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_EQ(members.members_size(), 3);
  EXPECT_EQ(members.members(2).health(), v1::MEMBER_HEALTH_UNREACHABLE);
  EXPECT_FALSE(members.members(2).detail().empty());
}

TEST_F(ClusterTest, CopyPrefixFromAnotherNodeCopiesEveryGroupByteForByte) {
  const v1::CacheSpec spec = HybridSpec();
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 1, 11, 7));
  const ReadOutput source = ReadAll(cluster_.stub(0), "hybrid", 1);

  v1::CopyPrefixResponse response;
  grpc::Status status = CopyFrom(cluster_.stub(1), "hybrid", "node-a", 1, 1, 11, &response);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_EQ(response.transfer().transport(), ExpectedTransport());
  EXPECT_GT(response.transfer().bytes(), 0);
  ExpectSameRead(ReadAll(cluster_.stub(1), "hybrid", 1), source);
  // The source is unchanged and holds no export copy once the receiver released it.
  ExpectSameRead(ReadAll(cluster_.stub(0), "hybrid", 1), source);
  EXPECT_TRUE(Eventually([&] { return Usage(cluster_.stub(0), "hybrid").export_bytes() == 0; },
                         absl::Seconds(5)));
  EXPECT_EQ(Usage(cluster_.stub(1), "hybrid").snapshot_bytes(), 0);

  // The copy (same sequence id, so that the patterns agree) continues like the original: one
  // more token on both, same bytes in every group.
  ASSERT_TRUE(Append(cluster_.stub(0), MakeAppend(spec, 1, {11}, 8)).ok());
  ASSERT_TRUE(Append(cluster_.stub(1), MakeAppend(spec, 1, {11}, 8)).ok());
  ExpectSameRead(ReadAll(cluster_.stub(1), "hybrid", 1), ReadAll(cluster_.stub(0), "hybrid", 1));

  // A recurrent group cannot take a prefix below the state's offset, as locally.
  status = CopyFrom(cluster_.stub(1), "hybrid", "node-a", 1, 2, 5, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << StatusText(status);
  EXPECT_THAT(LiveSeqs(cluster_.stub(1), "hybrid"), ::testing::ElementsAre(1));

  // From a sequence that stores nothing, dst is emptied.
  status = CopyFrom(cluster_.stub(1), "hybrid", "node-a", 2, 1, 8, &response);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_THAT(LiveSeqs(cluster_.stub(1), "hybrid"), ::testing::IsEmpty());
}

// A scheduler's index names a source that has since been removed or truncated: with the
// offset the index recorded as a precondition, the copy is refused on the source before any
// byte moves, and dst keeps what it held. For the hybrid cache (exported through a snapshot)
// and an Attention-only one (exported straight from the cells).
TEST_F(ClusterTest, CrossNodeCopyWithAStaleSourceIsRefusedAndDstKept) {
  const v1::CacheSpec hybrid = HybridSpec();
  const v1::CacheSpec big = BigSpec();
  for (size_t i = 0; i < 2; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), big).ok());
  for (const v1::CacheSpec& spec : {hybrid, big}) {
    SCOPED_TRACE(spec.name());
    ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 1, 12, 7));
    ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(1), spec, 4, 3, 9));
    const ReadOutput before = ReadAll(cluster_.stub(1), spec.name(), 4);
    v1::CopyPrefixResponse response;
    // Met: the copy goes through and says how far dst reaches.
    grpc::Status status = CopyFrom(cluster_.stub(1), spec.name(), "node-a", 1, 5, 12, &response,
                                   kCallTimeout, /*require_src_offset=*/12);
    ASSERT_TRUE(status.ok()) << StatusText(status);
    EXPECT_EQ(response.offset(), 12);
    EXPECT_GT(response.transfer().bytes(), 0);
    // Truncated since (the hybrid cache's wrapped ring allows no truncation): refused, naming
    // both offsets.
    if (spec.name() == "big") {
      ASSERT_TRUE(Remove(cluster_.stub(0), spec.name(), 1, 8).ok());
      status = CopyFrom(cluster_.stub(1), spec.name(), "node-a", 1, 4, 12, &response, kCallTimeout,
                        /*require_src_offset=*/12);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << StatusText(status);
      EXPECT_THAT(status.error_message(),
                  HasSubstr("offset 8 on node 'node-a', below the required 12"));
    }
    // Removed since: refused too, where without the precondition dst would be emptied.
    ASSERT_TRUE(Remove(cluster_.stub(0), spec.name(), 1, 0).ok());
    status = CopyFrom(cluster_.stub(1), spec.name(), "node-a", 1, 4, 12, &response, kCallTimeout,
                      /*require_src_offset=*/8);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("stores nothing"));
    // A precondition on a copy of nothing is a bad argument.
    status = CopyFrom(cluster_.stub(1), spec.name(), "node-a", 1, 4, 0, &response, kCallTimeout,
                      /*require_src_offset=*/3);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("require_src_offset = 3"));
    ExpectSameRead(ReadAll(cluster_.stub(1), spec.name(), 4), before);
    EXPECT_EQ(Usage(cluster_.stub(1), spec.name()).snapshot_bytes(), 0);
    // The sender's transport lets go of the first copy's payload once its stream ends, which
    // may be just after the receiver answered.
    EXPECT_TRUE(Eventually([&] { return Usage(cluster_.stub(0), spec.name()).export_bytes() == 0; },
                           absl::Seconds(10)));
    // Without the precondition, the removed source empties dst (the seed's semantics).
    status = CopyFrom(cluster_.stub(1), spec.name(), "node-a", 1, 4, 12, &response);
    ASSERT_TRUE(status.ok()) << StatusText(status);
    EXPECT_EQ(response.offset(), 0);
    EXPECT_THAT(LiveSeqs(cluster_.stub(1), spec.name()), ::testing::ElementsAre(5));
  }
}

// Token ids move with the data: a cross-node CopyPrefix gives dst src's ids below the length,
// and a migration takes the whole chain along, through a snapshot (hybrid cache) or straight
// from the cells (Attention-only).
TEST_F(ClusterTest, TokenIdsTravelWithCopiesAndMigrations) {
  const v1::CacheSpec hybrid = HybridSpec();
  const v1::CacheSpec big = BigSpec();
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), big).ok());
  for (const v1::CacheSpec& spec : {hybrid, big}) {
    SCOPED_TRACE(spec.name());
    ASSERT_NO_FATAL_FAILURE(AppendPrompt(cluster_.stub(0), spec, 1, 40, 7));
    const std::array<int32_t, 3> source = TokenCounts(cluster_.stub(0), spec.name(), 1);
    EXPECT_EQ(source, (std::array<int32_t, 3>{40, 40, 2}));  // blocks of the default 16
    v1::CopyPrefixResponse response;
    grpc::Status status = CopyFrom(cluster_.stub(1), spec.name(), "node-a", 1, 3, 40, &response);
    ASSERT_TRUE(status.ok()) << StatusText(status);
    EXPECT_EQ(TokenCounts(cluster_.stub(1), spec.name(), 3), source);
    status = MigrateSeq(cluster_.stub(0), spec.name(), 1, "node-c", 6, false);
    ASSERT_TRUE(status.ok()) << StatusText(status);
    EXPECT_EQ(TokenCounts(cluster_.stub(2), spec.name(), 6), source);
  }
}

// An incremental pull: a destination that already holds the first positions of the prefix,
// with the same token ids, keeps them and receives only the rest; one whose ids differ, or a
// cache with a sliding group, receives everything.
TEST_F(ClusterTest, CrossNodeCopyMovesOnlyTheTailADestinationLacks) {
  const v1::CacheSpec big = BigSpec();
  for (size_t i = 0; i < 2; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), big).ok());
  ASSERT_NO_FATAL_FAILURE(AppendPrompt(cluster_.stub(0), big, 1, 40, 7));
  // node-b: seq 5 holds the prompt's first 24 tokens (its own data, seed 9); seq 6 the same
  // positions with other ids.
  ASSERT_NO_FATAL_FAILURE(AppendPrompt(cluster_.stub(1), big, 5, 24, 9));
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(1), big, 6, 24, 9));
  ReadOutput kept;
  ASSERT_TRUE(Read(cluster_.stub(1), ReadRequest("big", 5, 0, 24), &kept).ok());
  ReadOutput tail;
  ASSERT_TRUE(Read(cluster_.stub(0), ReadRequest("big", 1, 24, 40), &tail).ok());

  v1::CopyPrefixResponse incremental;
  grpc::Status status = CopyFrom(cluster_.stub(1), "big", "node-a", 1, 5, 40, &incremental);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_EQ(incremental.kept_positions(), 24);
  EXPECT_EQ(incremental.offset(), 40);
  ReadOutput got;
  ASSERT_TRUE(Read(cluster_.stub(1), ReadRequest("big", 5, 0, 24), &got).ok());
  ExpectSameRead(got, kept);
  ASSERT_TRUE(Read(cluster_.stub(1), ReadRequest("big", 5, 24, 40), &got).ok());
  ExpectSameRead(got, tail);
  EXPECT_EQ(TokenCounts(cluster_.stub(1), "big", 5), (std::array<int32_t, 3>{40, 40, 2}));

  v1::CopyPrefixResponse whole;
  status = CopyFrom(cluster_.stub(1), "big", "node-a", 1, 6, 40, &whole);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_EQ(whole.kept_positions(), 0);
  ExpectSameRead(ReadAll(cluster_.stub(1), "big", 6), ReadAll(cluster_.stub(0), "big", 1));
  // 16 of 40 positions' bytes, plus the image's header.
  EXPECT_LT(incremental.transfer().bytes(), whole.transfer().bytes() / 2);
  EXPECT_GT(incremental.transfer().bytes(), whole.transfer().bytes() * 16 / 40);

  // A cache with a sliding group sends everything: its dst may lack positions its ids cover.
  const v1::CacheSpec hybrid = HybridSpec();
  ASSERT_NO_FATAL_FAILURE(AppendPrompt(cluster_.stub(0), hybrid, 1, 12, 7));
  ASSERT_NO_FATAL_FAILURE(AppendPrompt(cluster_.stub(1), hybrid, 2, 8, 9));
  status = CopyFrom(cluster_.stub(1), "hybrid", "node-a", 1, 2, 12, &whole);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_EQ(whole.kept_positions(), 0);
  ExpectSameRead(ReadAll(cluster_.stub(1), "hybrid", 2), ReadAll(cluster_.stub(0), "hybrid", 1));
}

// A sequence that moves away leaves no reservation behind: its room would otherwise hold a
// sequence slot and cells back from others on the node it left until the TTL.
TEST_F(ClusterTest, MigrateDropsTheSourcesReservation) {
  const v1::CacheSpec spec = BigSpec();
  for (size_t i = 0; i < 2; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), spec).ok());
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 2, 8, 3));
  v1::CacheUsage usage;
  ASSERT_TRUE(Reserve(cluster_.stub(0), "big", 2, 64, 0, &usage).ok());
  EXPECT_EQ(usage.groups(0).cells_reserved(), 56);
  // keep_source: the sequence stays, and so does its room.
  grpc::Status status = MigrateSeq(cluster_.stub(0), "big", 2, "node-b", 2, true);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_EQ(Usage(cluster_.stub(0), "big").groups(0).cells_reserved(), 56);
  status = MigrateSeq(cluster_.stub(0), "big", 2, "node-b", 3, false);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  usage = Usage(cluster_.stub(0), "big");
  EXPECT_EQ(usage.groups(0).cells_reserved(), 0);
  EXPECT_EQ(usage.sequences_reserved(), 0);
}

TEST_F(ClusterTest, CrossNodeCopyRefusalsNameTheBadValueAndChangeNothing) {
  const v1::CacheSpec spec = HybridSpec();
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 1, 6, 7));
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(1), spec, 1, 3, 9));
  const ReadOutput before = ReadAll(cluster_.stub(1), "hybrid", 1);
  v1::CopyPrefixResponse response;
  // A node that is not a member.
  grpc::Status status = CopyFrom(cluster_.stub(1), "hybrid", "node-z", 1, 1, 6, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("node-z"));
  // The same cache name with another spec on the source.
  ASSERT_TRUE(DeleteCache(cluster_.stub(2), "hybrid").ok());
  v1::CacheSpec other = spec;
  other.set_max_sequences(spec.max_sequences() + 1);
  ASSERT_TRUE(CreateCache(cluster_.stub(2), other).ok());
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(2), other, 1, 6, 7));
  status = CopyFrom(cluster_.stub(1), "hybrid", "node-c", 1, 1, 6, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("max_sequences"));
  // A cache the source does not have.
  ASSERT_TRUE(DeleteCache(cluster_.stub(2), "hybrid").ok());
  status = CopyFrom(cluster_.stub(1), "hybrid", "node-c", 1, 1, 6, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("hybrid"));
  // Nothing changed on the receiver.
  ExpectSameRead(ReadAll(cluster_.stub(1), "hybrid", 1), before);
  EXPECT_EQ(Usage(cluster_.stub(1), "hybrid").snapshot_bytes(), 0);
}

TEST_F(ClusterTest, CopyPrefixOfAnAttentionCacheSendsOnlyThePrefix) {
  const v1::CacheSpec spec = BigSpec();
  for (size_t i = 0; i < 2; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), spec).ok());
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 0, 600, 3));
  v1::CopyPrefixResponse response;
  const grpc::Status status = CopyFrom(cluster_.stub(1), "big", "node-a", 0, 5, 100, &response);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  const int64_t token_bytes = 4 * 2 * 8 * 128 * 2;
  EXPECT_GE(response.transfer().bytes(), 100 * token_bytes);
  EXPECT_LT(response.transfer().bytes(), 101 * token_bytes);
  ReadOutput expected;
  ASSERT_TRUE(Read(cluster_.stub(0), ReadRequest("big", 0, 0, 100), &expected).ok());
  ExpectSameRead(ReadAll(cluster_.stub(1), "big", 5), expected);
}

// The source snapshots only the prefix it sends: with a snapshot pool smaller than the
// source sequence (600 tokens, 9.4 MiB) but larger than the prefix (64 tokens, 1 MiB), the copy
// works; it failed with RESOURCE_EXHAUSTED while Export snapshotted the whole sequence first.
TEST(ClusterSnapshotPoolTest, CopyPrefixNeedsSnapshotRoomForThePrefixOnly) {
  Cluster cluster;
  ASSERT_NO_FATAL_FAILURE(cluster.Start({"node-a", "node-b"},
                                        {{"--snapshot-budget=4MiB"}, {"--snapshot-budget=4MiB"}}));
  const v1::CacheSpec spec = BigSpec();
  for (size_t i = 0; i < 2; ++i) ASSERT_TRUE(CreateCache(cluster.stub(i), spec).ok());
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster.stub(0), spec, 0, 600, 3));
  v1::CopyPrefixResponse response;
  const grpc::Status status = CopyFrom(cluster.stub(1), "big", "node-a", 0, 5, 64, &response);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  ReadOutput expected;
  ASSERT_TRUE(Read(cluster.stub(0), ReadRequest("big", 0, 0, 64), &expected).ok());
  ExpectSameRead(ReadAll(cluster.stub(1), "big", 5), expected);
  // The whole sequence does not fit the pool: a copy of all of it is refused, naming the pool.
  const grpc::Status whole = CopyFrom(cluster.stub(1), "big", "node-a", 0, 6, 600, &response);
  EXPECT_EQ(whole.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(whole);
  // In numbers: at least 301 rows of 16 KiB, against the 4 MiB pool.
  EXPECT_EQ(ShortageText(whole),
            "SNAPSHOT_POOL_EXHAUSTED needed=4931584 free=4194304 total=4194304");
}

// A receiver without a free sequence slot refuses once the sender has said what it holds and
// before the payload moves (the message is the pre-check's, not Restore's), and stays as it was.
TEST_F(ClusterTest, CopyPrefixIntoAFullCacheIsRefusedBeforeTheBytesMove) {
  const v1::CacheSpec spec = BigSpec();  // max_sequences = 4
  for (size_t i = 0; i < 2; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), spec).ok());
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 0, 100, 3));
  for (int64_t seq = 0; seq < 4; ++seq) {
    ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(1), spec, seq, 10, 7));
  }
  ReadOutput before;
  ASSERT_TRUE(Read(cluster_.stub(1), ReadRequest("big", 3, 0, 10), &before).ok());
  v1::CopyPrefixResponse response;
  const grpc::Status full = CopyFrom(cluster_.stub(1), "big", "node-a", 0, 9, 50, &response);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(full);
  EXPECT_THAT(full.error_message(), HasSubstr("taking a sequence from node 'node-a'"));
  EXPECT_THAT(full.error_message(), HasSubstr("max_sequences = 4"));
  EXPECT_EQ(ShortageText(full), "SEQUENCES_EXHAUSTED needed=1 free=0 total=4");
  // Asked of the source, a Migrate into the full node is refused by it, and the source passes
  // its numbers on to the caller.
  const grpc::Status migrate = MigrateSeq(cluster_.stub(0), "big", 0, "node-b", 9, false);
  EXPECT_EQ(migrate.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(migrate);
  EXPECT_THAT(migrate.error_message(), HasSubstr("node-b"));
  EXPECT_EQ(ShortageText(migrate), "SEQUENCES_EXHAUSTED needed=1 free=0 total=4");
  ExpectSameRead(ReadAll(cluster_.stub(1), "big", 3), before);
  // Into a live sequence there is room: it is replaced.
  const grpc::Status into_live = CopyFrom(cluster_.stub(1), "big", "node-a", 0, 3, 50, &response);
  ASSERT_TRUE(into_live.ok()) << StatusText(into_live);
  ReadOutput expected;
  ASSERT_TRUE(Read(cluster_.stub(0), ReadRequest("big", 0, 0, 50), &expected).ok());
  ExpectSameRead(ReadAll(cluster_.stub(1), "big", 3), expected);
}

// Under LRU the same copy into a full receiver evicts the receiver's least recently used
// sequence, atomically with the restore (the pre-check evicts nothing), and so does a Migrate.
TEST_F(ClusterTest, CopyPrefixIntoAFullLruCacheEvicts) {
  v1::CacheSpec spec = BigSpec();  // max_sequences = 4
  spec.set_eviction(v1::EVICTION_POLICY_LRU);
  for (size_t i = 0; i < 2; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), spec).ok());
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 0, 100, 3));
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 1, 20, 4));
  for (int64_t seq = 0; seq < 4; ++seq) {
    ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(1), spec, seq, 10, 7));
    absl::SleepFor(absl::Milliseconds(2));  // 0 is the least recently used
  }
  v1::CopyPrefixResponse response;
  const grpc::Status copied = CopyFrom(cluster_.stub(1), "big", "node-a", 0, 9, 50, &response);
  ASSERT_TRUE(copied.ok()) << StatusText(copied);
  ReadOutput expected;
  ASSERT_TRUE(Read(cluster_.stub(0), ReadRequest("big", 0, 0, 50), &expected).ok());
  ExpectSameRead(ReadAll(cluster_.stub(1), "big", 9), expected);
  ReadOutput gone;
  EXPECT_EQ(Read(cluster_.stub(1), ReadRequest("big", 0), &gone).error_code(),
            grpc::StatusCode::NOT_FOUND);
  // A Migrate into it evicts the next least recently used (1).
  const grpc::Status migrated = MigrateSeq(cluster_.stub(0), "big", 1, "node-b", 8, false);
  ASSERT_TRUE(migrated.ok()) << StatusText(migrated);
  EXPECT_EQ(Read(cluster_.stub(1), ReadRequest("big", 1), &gone).error_code(),
            grpc::StatusCode::NOT_FOUND);
  ReadOutput moved;
  EXPECT_TRUE(Read(cluster_.stub(1), ReadRequest("big", 8), &moved).ok());
}

// The retention of `seq` as ListSequences shows it: priority, pinned, ttl_ms.
std::tuple<int32_t, bool, int64_t> RetentionOf(v1::CacheService::Stub& stub,
                                               const std::string& cache, int64_t seq) {
  v1::ListSequencesResponse listed;
  const grpc::Status status = ListSequences(stub, cache, &listed);
  EXPECT_TRUE(status.ok()) << StatusText(status);
  for (const v1::SequenceInfo& info : listed.sequences()) {
    if (info.seq() == seq) return {info.priority(), info.pinned(), info.ttl_ms()};
  }
  ADD_FAILURE() << "sequence " << seq << " of '" << cache << "' is not listed";
  return {};
}

TEST_F(ClusterTest, MigrateMovesTheSequenceAndRemovesItAtTheSource) {
  const v1::CacheSpec spec = HybridSpec();
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 2, 9, 11));
  const ReadOutput source = ReadAll(cluster_.stub(0), "hybrid", 2);
  // The sequence keeps its retention where it goes; the target's own sequence 1 had another.
  grpc::Status status = SetRetention(cluster_.stub(0), "hybrid", 2, 4, true, 3'600'000);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(2), spec, 1, 3, 5));
  status = SetRetention(cluster_.stub(2), "hybrid", 1, -2, false, 60'000);
  ASSERT_TRUE(status.ok()) << StatusText(status);

  v1::MigrateResponse response;
  status = MigrateSeq(cluster_.stub(0), "hybrid", 2, "node-c", 1, false, &response);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_GT(response.transfer().bytes(), 0);
  ExpectSameRead(ReadAll(cluster_.stub(2), "hybrid", 1), source);
  EXPECT_THAT(LiveSeqs(cluster_.stub(0), "hybrid"), ::testing::IsEmpty());
  EXPECT_EQ(RetentionOf(cluster_.stub(2), "hybrid", 1), std::make_tuple(4, true, 3'600'000));

  // keep_source leaves it on both nodes, with the same retention.
  status = SetRetention(cluster_.stub(2), "hybrid", 1, 7, false, 0);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  status = MigrateSeq(cluster_.stub(2), "hybrid", 1, "node-b", 0, true);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  ExpectSameRead(ReadAll(cluster_.stub(1), "hybrid", 0), source);
  ExpectSameRead(ReadAll(cluster_.stub(2), "hybrid", 1), source);
  EXPECT_EQ(RetentionOf(cluster_.stub(1), "hybrid", 0), std::make_tuple(7, false, 0));
  EXPECT_EQ(RetentionOf(cluster_.stub(2), "hybrid", 1), std::make_tuple(7, false, 0));

  // Errors name what is wrong, and nothing changes.
  status = MigrateSeq(cluster_.stub(0), "hybrid", 2, "node-c", 1, false);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << StatusText(status);
  status = MigrateSeq(cluster_.stub(2), "hybrid", 1, "node-z", 1, false);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("node-z"));
  status = MigrateSeq(cluster_.stub(2), "hybrid", 1, "node-c", 1, false);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  ExpectSameRead(ReadAll(cluster_.stub(2), "hybrid", 1), source);
}

TEST_F(ClusterTest, MigrateSnapshotMovesASnapshotThatRestoresTheSameBytes) {
  const v1::CacheSpec spec = HybridSpec();
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 0, 6, 5));
  const ReadOutput at6 = ReadAll(cluster_.stub(0), "hybrid", 0);
  v1::SnapshotInfo snapshot;
  ASSERT_TRUE(Snapshot(cluster_.stub(0), "hybrid", 0, 0, &snapshot).ok());

  grpc::ClientContext context;
  SetDeadline(&context);
  v1::MigrateSnapshotRequest request;
  request.set_cache("hybrid");
  request.set_snapshot_id(snapshot.id());
  request.set_target_node("node-b");
  v1::MigrateSnapshotResponse response;
  const grpc::Status status = cluster_.stub(0).MigrateSnapshot(&context, request, &response);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_EQ(response.snapshot().from_offset(), 0);
  EXPECT_EQ(response.snapshot().to_offset(), 6);
  v1::ListSnapshotsResponse left;
  ASSERT_TRUE(ListSnapshots(cluster_.stub(0), "hybrid", &left).ok());
  EXPECT_EQ(left.snapshots_size(), 0);

  ASSERT_TRUE(Restore(cluster_.stub(1), "hybrid", 2, response.snapshot().id(), 6).ok());
  ExpectSameRead(ReadAll(cluster_.stub(1), "hybrid", 2), at6);
}

// Migrate, MigrateSnapshot and a cross-node CopyPrefix answer only once the source holds nothing
// more for the transfer: the cells or snapshot chunks its export pinned are back by the time the
// caller sees OK. The source here frees an export's payload 300 ms after its lease is released
// (--testing-release-lag-ms: what gRPC does, briefly, when it finishes the Fetch stream after
// the receiver has its last chunk). Before Release waited for the payload, a usage read right
// after the call still counted the export (the fuzzer's "cells_used dropped 9 -> 3" in a
// read-only call after a Migrate). Both kinds of export: an Attention-only cache exports
// straight from the cells, a hybrid one through a snapshot.
TEST(ClusterConsistencyTest, CallsAnswerOnceTheSourceHasFreedItsExport) {
  Cluster cluster;
  ASSERT_NO_FATAL_FAILURE(cluster.Start({"node-a", "node-b"}, {{"--testing-release-lag-ms=300"}}));
  AttentionOptions full;
  full.num_layers = 1;
  full.num_kv_heads = 1;
  const v1::CacheSpec attention = SpecProto("attention", 4, 64, 16, {AttentionGroupProto(full)});
  for (const v1::CacheSpec& spec : {attention, HybridSpec()}) {
    SCOPED_TRACE(spec.name());
    for (size_t i = 0; i < 2; ++i) ASSERT_TRUE(CreateCache(cluster.stub(i), spec).ok());
    const v1::CacheUsage empty = Usage(cluster.stub(0), spec.name());
    auto expect_source_back_to = [&](const v1::CacheUsage& expected, const char* after) {
      const v1::CacheUsage now = Usage(cluster.stub(0), spec.name());
      EXPECT_EQ(now.export_bytes(), 0) << after << ": " << now.DebugString();
      EXPECT_EQ(now.snapshot_bytes(), expected.snapshot_bytes()) << after;
      EXPECT_EQ(now.bytes_held(), expected.bytes_held()) << after;
      ASSERT_EQ(now.groups_size(), expected.groups_size());
      for (int g = 0; g < now.groups_size(); ++g) {
        EXPECT_EQ(now.groups(g).cells_used(), expected.groups(g).cells_used())
            << after << ", group " << g << ": " << now.DebugString();
      }
    };

    // Migrate: the sequence leaves, and so does everything it held.
    ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster.stub(0), spec, 1, 9, 3));
    grpc::Status status = MigrateSeq(cluster.stub(0), spec.name(), 1, "node-b", 1, false);
    ASSERT_TRUE(status.ok()) << StatusText(status);
    expect_source_back_to(empty, "Migrate");

    // MigrateSnapshot: the snapshot leaves; its chunks are free.
    ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster.stub(0), spec, 2, 6, 4));
    const v1::CacheUsage with_seq = Usage(cluster.stub(0), spec.name());
    v1::SnapshotInfo snapshot;
    ASSERT_TRUE(Snapshot(cluster.stub(0), spec.name(), 2, 0, &snapshot).ok());
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::MigrateSnapshotRequest request;
    request.set_cache(spec.name());
    request.set_snapshot_id(snapshot.id());
    request.set_target_node("node-b");
    v1::MigrateSnapshotResponse migrated;
    status = cluster.stub(0).MigrateSnapshot(&context, request, &migrated);
    ASSERT_TRUE(status.ok()) << StatusText(status);
    expect_source_back_to(with_seq, "MigrateSnapshot");

    // CopyPrefix from node-a: the source keeps its sequence, and nothing more.
    v1::CopyPrefixResponse copied;
    status = CopyFrom(cluster.stub(1), spec.name(), "node-a", 2, 2, 6, &copied);
    ASSERT_TRUE(status.ok()) << StatusText(status);
    expect_source_back_to(with_seq, "CopyPrefix");
  }
}

TEST_F(ClusterTest, RemoveWithClusterScopeReportsEveryNode) {
  const v1::CacheSpec spec = HybridSpec();
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 1, 4, 1));
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(2), spec, 1, 4, 1));
  ASSERT_TRUE(DeleteCache(cluster_.stub(1), "hybrid").ok());

  grpc::ClientContext context;
  SetDeadline(&context);
  v1::RemoveRequest request;
  request.set_cache("hybrid");
  request.set_seq(1);
  request.set_begin(0);
  request.set_scope(v1::REMOVE_SCOPE_CLUSTER);
  v1::RemoveResponse response;
  const grpc::Status status = cluster_.stub(2).Remove(&context, request, &response);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  ASSERT_EQ(response.nodes_size(), 3);
  EXPECT_EQ(response.nodes(0).node(), "node-c");
  EXPECT_EQ(response.nodes(0).code(), 0);
  EXPECT_EQ(response.nodes(1).node(), "node-a");
  EXPECT_EQ(response.nodes(1).code(), 0);
  EXPECT_EQ(response.nodes(2).node(), "node-b");
  EXPECT_EQ(response.nodes(2).code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_THAT(response.nodes(2).message(), HasSubstr("hybrid"));
  EXPECT_THAT(LiveSeqs(cluster_.stub(0), "hybrid"), ::testing::IsEmpty());
  EXPECT_THAT(LiveSeqs(cluster_.stub(2), "hybrid"), ::testing::IsEmpty());
}

TEST_F(ClusterTest, ConcurrentMigrationsOfOneSequenceOneWinsTheOtherIsAborted) {
  const v1::CacheSpec spec = BigSpec();
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), spec).ok());
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec, 0, kBigTokens, 9));
  const ReadOutput source = ReadAll(cluster_.stub(0), "big", 0);

  for (int round = 0; round < 3; ++round) {
    std::unique_ptr<Stub> other = cluster_[0].process->NewStub();
    auto to_b = std::async(std::launch::async, [&] {
      return MigrateSeq(cluster_.stub(0), "big", 0, "node-b", 0, false);
    });
    auto to_c = std::async(std::launch::async,
                           [&] { return MigrateSeq(*other, "big", 0, "node-c", 0, false); });
    const grpc::Status b = to_b.get();
    const grpc::Status c = to_c.get();
    // One wins; the other is ABORTED, or, when it started after the winner had removed the
    // sequence, NOT_FOUND. Never both.
    ASSERT_NE(b.ok(), c.ok()) << StatusText(b) << " / " << StatusText(c);
    const grpc::Status& loser = b.ok() ? c : b;
    EXPECT_TRUE(loser.error_code() == grpc::StatusCode::ABORTED ||
                loser.error_code() == grpc::StatusCode::NOT_FOUND)
        << StatusText(loser);
    const size_t winner = b.ok() ? 1 : 2;
    ExpectSameRead(ReadAll(cluster_.stub(winner), "big", 0), source);
    EXPECT_THAT(LiveSeqs(cluster_.stub(0), "big"), ::testing::IsEmpty());
    // Back to node-a for the next round.
    ASSERT_TRUE(MigrateSeq(cluster_.stub(winner), "big", 0, "node-a", 0, false).ok());
    ExpectSameRead(ReadAll(cluster_.stub(0), "big", 0), source);
  }
}

// ---- prefix lookups across the cluster -----------------------------------------------------

// One small Attention layer, 16 sequences of up to 512 tokens, token blocks of 16 (the default).
v1::CacheSpec PromptSpec() {
  AttentionOptions a;
  a.num_layers = 1;
  a.num_kv_heads = 1;
  return SpecProto("prompts", 16, 512, 64, {AttentionGroupProto(a)});
}

// Appends positions [0, ids.size()) of `seq` with those token ids.
void AppendIds(Stub& stub, const v1::CacheSpec& spec, int64_t seq,
               const std::vector<int32_t>& ids) {
  const int32_t n = static_cast<int32_t>(ids.size());
  for (int32_t begin = 0; begin < n; begin += spec.max_batch()) {
    const int32_t end = std::min(n, begin + spec.max_batch());
    v1::AppendRequest request = MakeAppend(spec, seq, Range(begin, end), 5);
    for (v1::Token& t : *request.mutable_tokens()) t.set_token_id(ids[t.pos()]);
    const grpc::Status status = Append(stub, request);
    ASSERT_TRUE(status.ok()) << StatusText(status);
  }
}

// AppendPrompt's ids for positions [0, n), then `extra` ids no sequence holds.
std::vector<int32_t> Prompt(int32_t n, int32_t extra = 0) {
  std::vector<int32_t> ids(n + extra);
  for (int32_t p = 0; p < n + extra; ++p) ids[p] = p < n ? 1000 + p : 7;
  return ids;
}

// The matches as "node/seq/length", each followed by " verified" or " hashed".
std::vector<std::string> Found(const v1::LookupPrefixResponse& response) {
  std::vector<std::string> out;
  for (const v1::PrefixMatch& m : response.matches()) {
    out.push_back(absl::StrCat(m.node(), "/", m.seq(), "/", m.length(),
                               m.verified() ? " verified" : " hashed"));
  }
  return out;
}

// The boot id a node's events carry (its first WatchEvents message).
std::string BootId(Stub& stub) {
  grpc::ClientContext context;
  SetDeadline(&context);
  std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
      stub.WatchEvents(&context, v1::WatchEventsRequest());
  v1::WatchEventsResponse message;
  std::string boot_id = reader->Read(&message) ? message.boot_id() : "";
  context.TryCancel();
  (void)reader->Finish();
  return boot_id;
}

// LookupPrefix with the cluster scope (up to 8 matches); "error: ..." when it fails.
std::vector<std::string> LookupCluster(Stub& stub, const std::string& cache,
                                       const std::vector<int32_t>& tokens, bool verify) {
  v1::LookupPrefixResponse response;
  const grpc::Status status =
      LookupPrefix(stub, cache, tokens, &response, 8, v1::LOOKUP_SCOPE_CLUSTER, verify);
  if (!status.ok()) return {absl::StrCat("error: ", StatusText(status))};
  if (response.unverified_size() > 0) {
    return {absl::StrCat("unverified: ", response.unverified(0).node(), " ",
                         response.unverified(0).message())};
  }
  return Found(response);
}

// Waits until the cluster lookup on `stub` answers `expected` (what the index holds follows
// the peers' events, within a second or so).
void ExpectClusterLookup(Stub& stub, const std::vector<int32_t>& tokens, bool verify,
                         const std::vector<std::string>& expected) {
  std::vector<std::string> got;
  EXPECT_TRUE(Eventually(
      [&] {
        got = LookupCluster(stub, "prompts", tokens, verify);
        return got == expected;
      },
      absl::Seconds(15)))
      << "got: " << absl::StrJoin(got, ", ") << "\nexpected: " << absl::StrJoin(expected, ", ");
}

class ClusterLookupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The index is the same on either transport: run once.
    if (NcclCluster()) GTEST_SKIP() << "the cluster index does not depend on the transport";
    ASSERT_NO_FATAL_FAILURE(
        cluster_.Start({"node-a", "node-b", "node-c"}, {Flags(), Flags(), Flags()}));
    for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), PromptSpec()).ok());
  }
  virtual std::vector<std::string> Flags() const { return {}; }
  Cluster cluster_;
};

// A prompt appended on one node is found from the others, by hash from the index and verified
// by its holder when asked; forks (local and across nodes), removals and migrations show in the
// answers as the events arrive.
TEST_F(ClusterLookupTest, FindsPrefixesOnOtherNodesThroughForksRemovesAndMigrations) {
  const v1::CacheSpec spec = PromptSpec();
  ASSERT_NO_FATAL_FAILURE(AppendPrompt(cluster_.stub(1), spec, 1, 40, 7));
  const std::vector<int32_t> prompt = Prompt(40, 8);
  // Two whole blocks by hash; 40 tokens compared id by id on node-b.
  ExpectClusterLookup(cluster_.stub(0), prompt, false, {"node-b/1/32 hashed"});
  ExpectClusterLookup(cluster_.stub(0), prompt, true, {"node-b/1/40 verified"});
  {
    v1::LookupPrefixResponse response;
    ASSERT_TRUE(LookupPrefix(cluster_.stub(0), "prompts", prompt, &response, 8,
                             v1::LOOKUP_SCOPE_CLUSTER, true)
                    .ok());
    ASSERT_EQ(response.matches_size(), 1);
    EXPECT_TRUE(response.matches(0).can_resume());
    EXPECT_EQ(response.matches(0).offset(), 40);
    // The local scope knows nothing of node-b.
    ASSERT_TRUE(LookupPrefix(cluster_.stub(0), "prompts", prompt, &response).ok());
    EXPECT_EQ(response.matches_size(), 0);
  }

  // Forks: on node-b itself, and onto node-c (24 positions: one whole block).
  ASSERT_TRUE(CopyPrefix(cluster_.stub(1), "prompts", 1, 2, 40).ok());
  v1::CopyPrefixResponse copied;
  grpc::Status status = CopyFrom(cluster_.stub(2), "prompts", "node-b", 1, 5, 24, &copied);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  ExpectClusterLookup(cluster_.stub(0), prompt, false,
                      {"node-b/1/32 hashed", "node-b/2/32 hashed", "node-c/5/16 hashed"});
  ExpectClusterLookup(cluster_.stub(0), prompt, true,
                      {"node-b/1/40 verified", "node-b/2/40 verified", "node-c/5/24 verified"});
  // node-c answers with its own match verified, its peers' by hash.
  ExpectClusterLookup(cluster_.stub(2), prompt, false,
                      {"node-b/1/32 hashed", "node-b/2/32 hashed", "node-c/5/24 verified"});

  // A removed sequence leaves the index; a truncated one keeps the blocks it still has.
  ASSERT_TRUE(Remove(cluster_.stub(1), "prompts", 1, 0).ok());
  ASSERT_TRUE(Remove(cluster_.stub(1), "prompts", 2, 20).ok());
  ExpectClusterLookup(cluster_.stub(0), prompt, true,
                      {"node-c/5/24 verified", "node-b/2/20 verified"});
  ExpectClusterLookup(cluster_.stub(0), prompt, false,
                      {"node-b/2/16 hashed", "node-c/5/16 hashed"});

  // A migration moves the entry: node-c's sequence to node-a, where it is local.
  status = MigrateSeq(cluster_.stub(2), "prompts", 5, "node-a", 7, false);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  ExpectClusterLookup(cluster_.stub(0), prompt, false,
                      {"node-a/7/24 verified", "node-b/2/16 hashed"});
  ExpectClusterLookup(cluster_.stub(1), prompt, true,
                      {"node-a/7/24 verified", "node-b/2/20 verified"});
  // A deleted cache takes its entries along.
  ASSERT_TRUE(DeleteCache(cluster_.stub(1), "prompts").ok());
  ExpectClusterLookup(cluster_.stub(0), prompt, false, {"node-a/7/24 verified"});
}

// A node that stops is forgotten at once; once restarted (new boot id, nothing stored), what it
// stores is found again. A node started without the index refuses the cluster scope.
TEST_F(ClusterLookupTest, ARestartedNodesEntriesDisappearAndComeBack) {
  const v1::CacheSpec spec = PromptSpec();
  ASSERT_NO_FATAL_FAILURE(AppendPrompt(cluster_.stub(1), spec, 1, 32, 7));
  const std::vector<int32_t> prompt = Prompt(32);
  ExpectClusterLookup(cluster_.stub(0), prompt, false, {"node-b/1/32 hashed"});
  const std::string boot_before = BootId(cluster_.stub(1));
  ASSERT_FALSE(boot_before.empty());

  ASSERT_NO_FATAL_FAILURE(cluster_.Restart(1, {"--cluster-index=false"}));
  EXPECT_NE(BootId(cluster_.stub(1)), boot_before);
  ExpectClusterLookup(cluster_.stub(0), prompt, false, {});
  ASSERT_TRUE(CreateCache(cluster_.stub(1), spec).ok());
  ASSERT_NO_FATAL_FAILURE(AppendPrompt(cluster_.stub(1), spec, 3, 20, 7));
  ExpectClusterLookup(cluster_.stub(0), prompt, false, {"node-b/3/16 hashed"});
  ExpectClusterLookup(cluster_.stub(2), prompt, true, {"node-b/3/20 verified"});

  v1::LookupPrefixResponse response;
  const grpc::Status status =
      LookupPrefix(cluster_.stub(1), "prompts", prompt, &response, 1, v1::LOOKUP_SCOPE_CLUSTER);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("keeps no index of the cluster"));
}

// A peer that falls silent without closing its connections (SIGSTOP: as a partition or a hung
// host looks) is forgotten once its heartbeats stop, within the 5 s silence timeout, and found
// again once it answers.
TEST_F(ClusterLookupTest, AFrozenPeerIsForgottenAndFoundAgainWhenItThaws) {
  const v1::CacheSpec spec = PromptSpec();
  ASSERT_NO_FATAL_FAILURE(AppendPrompt(cluster_.stub(1), spec, 1, 32, 7));
  const std::vector<int32_t> prompt = Prompt(32);
  ExpectClusterLookup(cluster_.stub(0), prompt, false, {"node-b/1/32 hashed"});
  {
    const absl::Status s = cluster_[1].process->Freeze();
    ASSERT_TRUE(s.ok()) << s;
  }
  const absl::Time frozen = absl::Now();
  {
    // Still indexed, but it cannot verify: within half the caller's 4 s, the answer says so
    // instead of failing as a whole.
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(4));
    v1::LookupPrefixRequest request;
    request.set_cache("prompts");
    request.mutable_tokens()->Add(prompt.begin(), prompt.end());
    request.set_scope(v1::LOOKUP_SCOPE_CLUSTER);
    request.set_verify(true);
    v1::LookupPrefixResponse response;
    const grpc::Status status = cluster_.stub(0).LookupPrefix(&context, request, &response);
    ASSERT_TRUE(status.ok()) << StatusText(status);
    EXPECT_EQ(response.matches_size(), 0);
    ASSERT_EQ(response.unverified_size(), 1);
    EXPECT_EQ(response.unverified(0).node(), "node-b");
    EXPECT_EQ(response.unverified(0).code(), static_cast<int>(grpc::StatusCode::DEADLINE_EXCEEDED))
        << response.unverified(0).message();
  }
  ExpectClusterLookup(cluster_.stub(0), prompt, false, {});
  // Not before the timeout: a quiet peer is not a lost one.
  EXPECT_GE(absl::Now() - frozen, absl::Seconds(4));
  {
    const absl::Status s = cluster_[1].process->Thaw();
    ASSERT_TRUE(s.ok()) << s;
  }
  ExpectClusterLookup(cluster_.stub(0), prompt, false, {"node-b/1/32 hashed"});
  ExpectClusterLookup(cluster_.stub(2), prompt, true, {"node-b/1/32 verified"});
}

// Block hashes cut to 2 bits: nearly every block hash collides with another. The index's
// candidates may then be wrong, but a verified match is always the real longest common prefix.
class ClusterLookupCollisionTest : public ClusterLookupTest {
 protected:
  std::vector<std::string> Flags() const override { return {"--testing-token-hash-bits=2"}; }
};

TEST_F(ClusterLookupCollisionTest, VerifiedMatchesAreExactDespiteCollisions) {
  const v1::CacheSpec spec = PromptSpec();
  // mt19937's output is the same everywhere (std's distributions are not).
  std::mt19937 random(42);
  auto id = [&random] { return static_cast<int32_t>(random() % 51); };
  auto cut = [&random] { return static_cast<size_t>(random() % 65); };
  // Six stored prompts of 64 ids on node-b, two on node-a; each shares a random-length prefix
  // with the first.
  std::vector<int32_t> base(64);
  for (int32_t& t : base) t = id();
  std::map<std::pair<size_t, int64_t>, std::vector<int32_t>> stored;  // (node, seq) -> ids
  for (int64_t seq = 0; seq < 8; ++seq) {
    std::vector<int32_t> ids = base;
    const size_t shared = cut();
    for (size_t p = shared; p < ids.size(); ++p) ids[p] = id();
    const size_t node = seq < 6 ? 1 : 0;
    ASSERT_NO_FATAL_FAILURE(AppendIds(cluster_.stub(node), spec, seq, ids));
    stored[{node, seq}] = ids;
  }
  int real_matches = 0;
  int fake_candidates = 0;  // the index's, longer than the sequence really matches
  for (int query = 0; query < 12; ++query) {
    SCOPED_TRACE(query);
    std::vector<int32_t> prompt = base;
    const size_t shared = cut();
    for (size_t p = shared; p < prompt.size(); ++p) prompt[p] = id();
    // What each sequence really shares with the prompt, where that is a whole block or more.
    std::vector<std::string> expected;
    for (const auto& [where, ids] : stored) {
      const size_t common =
          std::mismatch(prompt.begin(), prompt.end(), ids.begin()).first - prompt.begin();
      if (common >= 16) {
        ++real_matches;
        expected.push_back(absl::StrCat(where.first == 0 ? "node-a" : "node-b", "/", where.second,
                                        "/", common, " verified"));
      }
    }
    v1::LookupPrefixResponse response;
    const grpc::Status status = LookupPrefix(cluster_.stub(0), "prompts", prompt, &response, 8,
                                             v1::LOOKUP_SCOPE_CLUSTER, true);
    ASSERT_TRUE(status.ok()) << StatusText(status);
    // node-b's entries reach node-a's index within a second; until then only node-a's own.
    std::vector<std::string> got = Found(response);
    std::sort(got.begin(), got.end());
    std::sort(expected.begin(), expected.end());
    if (query == 0) {
      ASSERT_TRUE(Eventually(
          [&] {
            v1::LookupPrefixResponse again;
            if (!LookupPrefix(cluster_.stub(0), "prompts", prompt, &again, 8,
                              v1::LOOKUP_SCOPE_CLUSTER, true)
                     .ok()) {
              return false;
            }
            got = Found(again);
            std::sort(got.begin(), got.end());
            return got == expected;
          },
          absl::Seconds(15)));
    }
    EXPECT_EQ(got, expected);
    v1::LookupPrefixResponse hashed;
    ASSERT_TRUE(
        LookupPrefix(cluster_.stub(0), "prompts", prompt, &hashed, 8, v1::LOOKUP_SCOPE_CLUSTER)
            .ok());
    for (const v1::PrefixMatch& m : hashed.matches()) {
      if (m.verified()) continue;
      const std::vector<int32_t>& ids = stored.at({1, m.seq()});
      const size_t common =
          std::mismatch(prompt.begin(), prompt.end(), ids.begin()).first - prompt.begin();
      if (static_cast<size_t>(m.length()) > common) ++fake_candidates;
    }
  }
  // The test means something: real matches were found, and the index alone was fooled.
  EXPECT_GT(real_matches, 3);
  EXPECT_GT(fake_candidates, 0);
}

// ---- faults -------------------------------------------------------------------------------

// Node a sends slowly (one 4 MiB chunk every 250 ms: 32 MiB take 2 s), with short leases.
class ClusterFaultTest : public ::testing::Test {
 protected:
  void StartWith(const std::vector<std::string>& sender_flags) {
    std::vector<std::string> a = {"--testing-chunk-delay-ms=250", "--lease-ms=1500"};
    a.insert(a.end(), sender_flags.begin(), sender_flags.end());
    ASSERT_NO_FATAL_FAILURE(cluster_.Start({"node-a", "node-b"}, {a, {"--lease-ms=1500"}}));
    spec_ = BigSpec();
    for (size_t i = 0; i < 2; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), spec_).ok());
    ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), spec_, 0, kBigTokens, 21));
    source_ = ReadAll(cluster_.stub(0), "big", 0);
  }
  // Node a still holds the sequence byte for byte, and its export copy (export_bytes) is gone
  // within the lease time.
  void ExpectSenderIntactAndLeaseExpired() {
    ExpectSameRead(ReadAll(cluster_.stub(0), "big", 0), source_);
    EXPECT_TRUE(Eventually([&] { return Usage(cluster_.stub(0), "big").export_bytes() == 0; },
                           absl::Seconds(10)))
        << "the export lease did not expire";
  }

  Cluster cluster_;
  v1::CacheSpec spec_;
  ReadOutput source_;
};

TEST_F(ClusterFaultTest, ReceiverKilledMidTransferLeavesTheSenderIntact) {
  ASSERT_NO_FATAL_FAILURE(StartWith({}));
  auto copy = std::async(std::launch::async, [&] {
    v1::CopyPrefixResponse response;
    return CopyFrom(cluster_.stub(1), "big", "node-a", 0, 1, kBigTokens, &response);
  });
  // Mid-transfer: the export copy exists on node a.
  ASSERT_TRUE(Eventually([&] { return Usage(cluster_.stub(0), "big").export_bytes() > 0; },
                         absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_EQ(kill(cluster_[1].process->pid(), SIGKILL), 0);
  EXPECT_FALSE(copy.get().ok());
  ExpectSenderIntactAndLeaseExpired();
}

TEST_F(ClusterFaultTest, SenderKilledMidTransferFailsUnavailableWithNoPartialSequence) {
  ASSERT_NO_FATAL_FAILURE(StartWith({}));
  auto copy = std::async(std::launch::async, [&] {
    v1::CopyPrefixResponse response;
    return CopyFrom(cluster_.stub(1), "big", "node-a", 0, 1, kBigTokens, &response);
  });
  ASSERT_TRUE(Eventually([&] { return Usage(cluster_.stub(0), "big").export_bytes() > 0; },
                         absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_EQ(kill(cluster_[0].process->pid(), SIGKILL), 0);
  const grpc::Status status = copy.get();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("node-a"));
  EXPECT_THAT(LiveSeqs(cluster_.stub(1), "big"), ::testing::IsEmpty());
  const v1::CacheUsage usage = Usage(cluster_.stub(1), "big");
  EXPECT_EQ(usage.snapshot_bytes(), 0);
  EXPECT_EQ(usage.sequences_live(), 0);
}

TEST_F(ClusterFaultTest, FrozenSenderEndsWithDeadlineExceededAndTheLeaseExpires) {
  ASSERT_NO_FATAL_FAILURE(StartWith({}));
  const absl::Time start = absl::Now();
  auto copy = std::async(std::launch::async, [&] {
    v1::CopyPrefixResponse response;
    return CopyFrom(cluster_.stub(1), "big", "node-a", 0, 1, kBigTokens, &response,
                    absl::Seconds(4));
  });
  ASSERT_TRUE(Eventually([&] { return Usage(cluster_.stub(0), "big").export_bytes() > 0; },
                         absl::Seconds(3)));
  {
    const absl::Status s = cluster_[0].process->Freeze();
    ASSERT_TRUE(s.ok()) << s;
  }
  const grpc::Status status = copy.get();
  const absl::Duration took = absl::Now() - start;
  {
    const absl::Status s = cluster_[0].process->Thaw();
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << StatusText(status);
  EXPECT_LT(took, absl::Seconds(8)) << "the call outlived its deadline";
  EXPECT_THAT(LiveSeqs(cluster_.stub(1), "big"), ::testing::IsEmpty());
  EXPECT_EQ(Usage(cluster_.stub(1), "big").snapshot_bytes(), 0);
  ExpectSenderIntactAndLeaseExpired();
}

TEST_F(ClusterFaultTest, CorruptedChunkIsDataLossAndNothingIsStored) {
  ASSERT_NO_FATAL_FAILURE(StartWith({"--testing-corrupt-chunk=2"}));
  v1::CopyPrefixResponse response;
  grpc::Status status = CopyFrom(cluster_.stub(1), "big", "node-a", 0, 1, kBigTokens, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DATA_LOSS) << StatusText(status);
  // Caught by the chunk's (piece's) own CRC-32C, before its bytes went anywhere.
  EXPECT_THAT(status.error_message(), HasSubstr("CRC-32C")) << StatusText(status);
  if (NcclCluster()) {
    EXPECT_THAT(status.error_message(), HasSubstr("piece 2 ")) << StatusText(status);
  }
  EXPECT_THAT(LiveSeqs(cluster_.stub(1), "big"), ::testing::IsEmpty());
  EXPECT_EQ(Usage(cluster_.stub(1), "big").snapshot_bytes(), 0);
  // A migration through the same corrupting sender fails the same way and keeps the source.
  status = MigrateSeq(cluster_.stub(0), "big", 0, "node-b", 0, false);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DATA_LOSS) << StatusText(status);
  EXPECT_THAT(LiveSeqs(cluster_.stub(1), "big"), ::testing::IsEmpty());
  ExpectSameRead(ReadAll(cluster_.stub(0), "big", 0), source_);
  EXPECT_TRUE(Eventually([&] { return Usage(cluster_.stub(0), "big").export_bytes() == 0; },
                         absl::Seconds(10)));
}

TEST_F(ClusterFaultTest, TargetKilledDuringAMigrationKeepsTheSequenceAtTheSource) {
  // Here node b is the sender's target: node a migrates to b, and b (the receiver) dies.
  ASSERT_NO_FATAL_FAILURE(StartWith({}));
  auto migration = std::async(std::launch::async, [&] {
    return MigrateSeq(cluster_.stub(0), "big", 0, "node-b", 0, false);
  });
  ASSERT_TRUE(Eventually([&] { return Usage(cluster_.stub(0), "big").export_bytes() > 0; },
                         absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_EQ(kill(cluster_[1].process->pid(), SIGKILL), 0);
  const grpc::Status status = migration.get();
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(status.error_code() == grpc::StatusCode::UNAVAILABLE ||
              status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
      << StatusText(status);
  ExpectSenderIntactAndLeaseExpired();
  // The sequence is not reserved any more: it can be appended to.
  EXPECT_TRUE(Append(cluster_.stub(0), MakeAppend(spec_, 0, {kBigTokens}, 21)).ok());
}

TEST_F(ClusterFaultTest, AppendsDuringAMigrationAreAbortedNeverLost) {
  ASSERT_NO_FATAL_FAILURE(StartWith({}));
  SequenceModel model(spec_.groups_size());
  ModelAppend(spec_, 0, Range(0, kBigTokens), 21, &model);
  auto migration = std::async(std::launch::async, [&] {
    return MigrateSeq(cluster_.stub(0), "big", 0, "node-b", 0, false);
  });
  // Appends to the sequence while the (2 s) migration runs: applied before the reservation,
  // ABORTED during it.
  std::unique_ptr<Stub> other = cluster_[0].process->NewStub();
  int32_t next = kBigTokens;
  grpc::Status refused;
  while (migration.wait_for(std::chrono::milliseconds(0)) != std::future_status::ready) {
    const grpc::Status s = Append(*other, MakeAppend(spec_, 0, {next}, 21));
    if (!s.ok()) {
      refused = s;
      break;
    }
    ModelAppend(spec_, 0, {next}, 21, &model);
    ++next;
  }
  // Room for the migrating sequence is refused too, as long as the migration runs (a Reserve
  // that returns before the migration has ended ran during it).
  const grpc::Status reserve = Reserve(*other, "big", 0, kBigTokens + 64);
  if (migration.wait_for(std::chrono::milliseconds(0)) != std::future_status::ready) {
    EXPECT_EQ(reserve.error_code(), grpc::StatusCode::ABORTED) << StatusText(reserve);
    EXPECT_THAT(reserve.error_message(), HasSubstr("under migration"));
  }
  const grpc::Status migrated = migration.get();
  ASSERT_TRUE(migrated.ok()) << StatusText(migrated);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::ABORTED) << StatusText(refused);
  EXPECT_THAT(refused.error_message(), HasSubstr("under migration"));
  // Every token applied before the reservation moved with the sequence, byte for byte.
  const ReadOutput moved = ReadAll(cluster_.stub(1), "big", 0);
  const std::vector<std::vector<int32_t>> positions = HeaderPositions(moved.header);
  ASSERT_EQ(positions.size(), 1u);
  EXPECT_EQ(positions[0], Range(0, next));
  EXPECT_TRUE(moved.payload == ExpectedReadPayload(spec_, model, positions));
  EXPECT_THAT(LiveSeqs(cluster_.stub(0), "big"), ::testing::IsEmpty());
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh

// ---- drain (docs/api.md#drain) -----------------------------------------------------------------

namespace kvmesh {
namespace testutil {
namespace {

grpc::Status DrainNode(Stub& stub, v1::DrainResponse* response, int64_t timeout_ms = 20000,
                       bool resume = false) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Milliseconds(timeout_ms) + absl::Seconds(30));
  v1::DrainRequest request;
  request.set_timeout_ms(timeout_ms);
  request.set_resume(resume);
  return stub.Drain(&context, request, response);
}

int Readiness(const NodeProcess& node) {
  int status = -1;
  const grpc::Status rpc = HealthCheck(node.channel(), "kvmesh.v1.CacheService", &status);
  return rpc.ok() ? status : -1;
}
constexpr int kServing = 1;
constexpr int kNotServing = 2;

// What a drained sequence's reads must equal, wherever it went.
struct Held {
  std::string cache;
  int64_t seq;
  ReadOutput read;
};

// HybridSpec without its sliding group, whose positions outside the window go as other
// sequences append (engine semantics, docs/semantics.md), which would blur byte comparisons of
// reads taken at different times.
v1::CacheSpec DrainSpec() {
  v1::CacheSpec spec = HybridSpec();
  spec.mutable_groups()->DeleteSubrange(1, 1);
  return spec;
}

class DrainTest : public ::testing::Test {
 protected:
  // a holds hybrid sequences 0..2 and a snapshot of seq 1, and big sequence 5; b has the hybrid
  // cache with its own sequence 0 (so a's sequence 0 needs another id there); nobody else has
  // the big cache, so the drain creates it on a peer.
  void Fill() {
    hybrid_ = DrainSpec();
    big_ = BigSpec();
    for (size_t i = 0; i < 2; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), hybrid_).ok());
    ASSERT_TRUE(CreateCache(cluster_.stub(0), big_).ok());
    ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(1), hybrid_, 0, 3, 99));
    for (int64_t seq = 0; seq < 3; ++seq) {
      ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), hybrid_, seq, 5 + seq, 10 + seq));
    }
    ASSERT_TRUE(Snapshot(cluster_.stub(0), "hybrid", 1, 0, &snapshot_).ok());
    ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), big_, 5, 300, 55));
    for (int64_t seq = 0; seq < 3; ++seq) {
      held_.push_back({"hybrid", seq, ReadAll(cluster_.stub(0), "hybrid", seq)});
    }
    held_.push_back({"big", 5, ReadAll(cluster_.stub(0), "big", 5)});
  }
  // b's own sequence 0 is still its own (3 positions), not replaced by a drained one.
  void ExpectBSequence0Kept() {
    v1::ListSequencesResponse list;
    ASSERT_TRUE(ListSequences(cluster_.stub(1), "hybrid", &list).ok());
    bool kept = false;
    for (const v1::SequenceInfo& s : list.sequences()) kept |= s.seq() == 0 && s.offset() == 3;
    EXPECT_TRUE(kept) << list.DebugString();
  }

  Cluster cluster_;
  v1::CacheSpec hybrid_;
  v1::CacheSpec big_;
  std::vector<Held> held_;
  v1::SnapshotInfo snapshot_;
};

TEST_F(DrainTest, DrainRpcMovesEverySequenceAndSnapshotByteForByte) {
  ASSERT_NO_FATAL_FAILURE(cluster_.Start({"node-a", "node-b", "node-c"}));
  ASSERT_NO_FATAL_FAILURE(Fill());
  EXPECT_EQ(Readiness(*cluster_[0].process), kServing);
  ExpectBSequence0Kept();
  // Each sequence is kept its own way; it is kept so where it goes.
  for (size_t i = 0; i < held_.size(); ++i) {
    const grpc::Status kept =
        SetRetention(cluster_.stub(0), held_[i].cache, held_[i].seq, static_cast<int32_t>(10 + i),
                     i % 2 == 1, static_cast<int64_t>(i + 1) * 60'000);
    ASSERT_TRUE(kept.ok()) << StatusText(kept);
  }

  v1::DrainResponse drained;
  grpc::Status status = DrainNode(cluster_.stub(0), &drained);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_TRUE(drained.draining());
  EXPECT_EQ(drained.stayed_size(), 0) << drained.DebugString();
  ASSERT_EQ(drained.sequences_size(), 4) << drained.DebugString();
  ASSERT_EQ(drained.snapshots_size(), 1) << drained.DebugString();

  // Every sequence reads back the same where the response says it went; a's sequence 0 took
  // another id on b, whose own sequence 0 is untouched.
  std::map<std::string, size_t> node_index = {{"node-b", 1}, {"node-c", 2}};
  for (const Held& held : held_) {
    const v1::DrainedSequence* moved = nullptr;
    for (const v1::DrainedSequence& s : drained.sequences()) {
      if (s.cache() == held.cache && s.seq() == held.seq) moved = &s;
    }
    ASSERT_NE(moved, nullptr) << held.cache << " seq " << held.seq;
    EXPECT_EQ(moved->tenant(), "default");
    EXPECT_EQ(moved->transfer().transport(), ExpectedTransport());
    ASSERT_EQ(node_index.count(moved->node()), 1u) << moved->DebugString();
    if (held.cache == "hybrid") {
      // The peer that has the cache is chosen over one that would need it created.
      EXPECT_EQ(moved->node(), "node-b");
      if (held.seq == 0) {
        EXPECT_NE(moved->target_seq(), 0);
      } else {
        EXPECT_EQ(moved->target_seq(), held.seq);
      }
    }
    ExpectSameRead(
        ReadAll(cluster_.stub(node_index[moved->node()]), held.cache, moved->target_seq()),
        held.read);
    const size_t i = static_cast<size_t>(&held - held_.data());
    EXPECT_EQ(
        RetentionOf(cluster_.stub(node_index[moved->node()]), held.cache, moved->target_seq()),
        std::make_tuple(static_cast<int32_t>(10 + i), i % 2 == 1,
                        static_cast<int64_t>(i + 1) * 60'000))
        << held.cache << " seq " << held.seq;
  }
  ExpectBSequence0Kept();
  // The big cache was created from its spec on the peer it went to.
  ASSERT_EQ(drained.caches_created_size(), 1);
  EXPECT_THAT(drained.caches_created(0), HasSubstr("/default/big"));
  // The snapshot restores the same bytes there.
  const v1::DrainedSnapshot& moved_snapshot = drained.snapshots(0);
  EXPECT_EQ(moved_snapshot.snapshot_id(), snapshot_.id());
  ASSERT_EQ(moved_snapshot.node(), "node-b");
  // (b holds 4 sequences, its max_sequences: restore over a's sequence 1, whose bytes these are.)
  ASSERT_TRUE(Restore(cluster_.stub(1), "hybrid", 1, moved_snapshot.target_snapshot_id(), 6).ok());
  ExpectSameRead(ReadAll(cluster_.stub(1), "hybrid", 1), held_[1].read);

  // Nothing is left on a, which takes no new work and is not ready.
  EXPECT_TRUE(LiveSeqs(cluster_.stub(0), "hybrid").empty());
  EXPECT_TRUE(LiveSeqs(cluster_.stub(0), "big").empty());
  v1::ListSnapshotsResponse left;
  ASSERT_TRUE(ListSnapshots(cluster_.stub(0), "hybrid", &left).ok());
  EXPECT_EQ(left.snapshots_size(), 0);
  EXPECT_EQ(Readiness(*cluster_[0].process), kNotServing);
  status = Append(cluster_.stub(0), MakeAppend(hybrid_, 7, {0}, 1));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  EXPECT_THAT(status.error_message(),
              AllOf(HasSubstr("node 'node-a' is draining"), HasSubstr("sequence 7")));
  // An AppendStream into an Attention-only cache (which would write into cells) is refused as
  // the unary Append is, and leaves no cell taken.
  v1::AppendResponse streamed;
  status =
      AppendStream(cluster_.stub(0),
                   StreamMessages(MakeAppend(big_, 7, Range(0, 64), 1), 0, 1 << 16), &streamed);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  EXPECT_THAT(status.error_message(),
              AllOf(HasSubstr("node 'node-a' is draining"), HasSubstr("sequence 7")));
  v1::GetCacheResponse big_now;
  ASSERT_TRUE(GetCache(cluster_.stub(0), "big", &big_now).ok());
  EXPECT_EQ(big_now.cache().usage().groups(0).cells_used(), 0);
  // Nor is room reserved for a new sequence there; dropping a reservation is always allowed.
  status = Reserve(cluster_.stub(0), "big", 7, 64);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  EXPECT_THAT(status.error_message(),
              AllOf(HasSubstr("node 'node-a' is draining"), HasSubstr("sequence 7")));
  EXPECT_TRUE(Reserve(cluster_.stub(0), "big", 7, 0).ok());
  ASSERT_TRUE(GetCache(cluster_.stub(0), "big", &big_now).ok());
  EXPECT_EQ(big_now.cache().usage().groups(0).cells_reserved(), 0);
  v1::CacheSpec other = hybrid_;
  other.set_name("other");
  status = CreateCache(cluster_.stub(0), other);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("new cache 'other'"));
  // Asking for a cache it has stays idempotent; a peer does not move data to a draining node.
  EXPECT_TRUE(CreateCache(cluster_.stub(0), hybrid_).ok());
  v1::MigrateResponse migrated;
  status = MigrateSeq(cluster_.stub(1), "hybrid", 1, "node-a", 1, false, &migrated);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("is draining"));
  ExpectSameRead(ReadAll(cluster_.stub(1), "hybrid", 1), held_[1].read);

  // A second drain finds nothing to do; resume makes the node ready and open again.
  ASSERT_TRUE(DrainNode(cluster_.stub(0), &drained).ok());
  EXPECT_EQ(drained.sequences_size() + drained.snapshots_size() + drained.stayed_size(), 0);
  ASSERT_TRUE(DrainNode(cluster_.stub(0), &drained, 0, /*resume=*/true).ok());
  EXPECT_FALSE(drained.draining());
  EXPECT_EQ(Readiness(*cluster_[0].process), kServing);
  EXPECT_TRUE(CreateCache(cluster_.stub(0), other).ok());
  EXPECT_TRUE(Append(cluster_.stub(0), MakeAppend(hybrid_, 7, {0}, 1)).ok());
}

TEST_F(DrainTest, DrainWithNoRoomReportsExactlyWhatStayedAndKeepsIt) {
  // b cannot hold the big cache (its memory budget is too small to create it) and has no
  // hybrid cache with a free cell: everything stays on a, intact, and the drain says why.
  ASSERT_NO_FATAL_FAILURE(cluster_.Start({"node-a", "node-b"},
                                         {{}, {"--memory-budget=8MiB", "--snapshot-budget=8MiB"}}));
  big_ = BigSpec();
  ASSERT_TRUE(CreateCache(cluster_.stub(0), big_).ok());
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), big_, 2, 64, 3));
  const ReadOutput before = ReadAll(cluster_.stub(0), "big", 2);
  v1::SnapshotInfo snapshot;
  ASSERT_TRUE(Snapshot(cluster_.stub(0), "big", 2, 0, &snapshot).ok());

  const absl::Time start = absl::Now();
  v1::DrainResponse drained;
  const grpc::Status status = DrainNode(cluster_.stub(0), &drained, 20000);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  // Failures that cannot pass end the drain at once, not at its deadline.
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(drained.sequences_size(), 0);
  EXPECT_EQ(drained.snapshots_size(), 0);
  EXPECT_EQ(drained.caches_created_size(), 0);
  ASSERT_EQ(drained.stayed_size(), 2) << drained.DebugString();
  EXPECT_EQ(drained.stayed(0).cache(), "big");
  EXPECT_EQ(drained.stayed(0).seq(), 2);
  EXPECT_EQ(drained.stayed(1).snapshot_id(), snapshot.id());
  for (const v1::DrainStayed& stayed : drained.stayed()) {
    EXPECT_EQ(stayed.tenant(), "default");
    EXPECT_THAT(stayed.reason(), AllOf(HasSubstr("RESOURCE_EXHAUSTED"), HasSubstr("node-b")))
        << stayed.DebugString();
  }
  ExpectSameRead(ReadAll(cluster_.stub(0), "big", 2), before);
  v1::ListSnapshotsResponse snapshots;
  ASSERT_TRUE(ListSnapshots(cluster_.stub(0), "big", &snapshots).ok());
  EXPECT_EQ(snapshots.snapshots_size(), 1);
  v1::ListCachesResponse caches;
  grpc::ClientContext context;
  SetDeadline(&context);
  ASSERT_TRUE(cluster_.stub(1).ListCaches(&context, v1::ListCachesRequest(), &caches).ok());
  EXPECT_EQ(caches.caches_size(), 0);
}

TEST_F(DrainTest, AMoveWhoseReplyIsLostIsAskedAgainNotCopiedTwice) {
  // b commits the first two migrations into it but answers UNAVAILABLE, as when the reply is
  // lost. The drain asks b again under the same migration ids; b says they are done; nothing
  // goes to c as well.
  ASSERT_NO_FATAL_FAILURE(
      cluster_.Start({"node-a", "node-b", "node-c"}, {{}, {"--testing-lose-pull-replies=2"}}));
  hybrid_ = DrainSpec();
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(CreateCache(cluster_.stub(i), hybrid_).ok());
  ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(2), hybrid_, 9, 2, 1));  // b ranks first
  for (int64_t seq = 0; seq < 2; ++seq) {
    ASSERT_NO_FATAL_FAILURE(AppendTokens(cluster_.stub(0), hybrid_, seq, 4 + seq, 30 + seq));
    held_.push_back({"hybrid", seq, ReadAll(cluster_.stub(0), "hybrid", seq)});
  }
  v1::DrainResponse drained;
  const grpc::Status status = DrainNode(cluster_.stub(0), &drained);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_EQ(drained.stayed_size(), 0) << drained.DebugString();
  ASSERT_EQ(drained.sequences_size(), 2) << drained.DebugString();
  for (const v1::DrainedSequence& moved : drained.sequences()) {
    EXPECT_EQ(moved.node(), "node-b") << moved.DebugString();
    EXPECT_EQ(moved.transfer().transport(), "none (committed before)") << moved.DebugString();
    ExpectSameRead(ReadAll(cluster_.stub(1), "hybrid", moved.target_seq()),
                   held_[moved.seq()].read);
  }
  EXPECT_THAT(LiveSeqs(cluster_.stub(1), "hybrid"), ::testing::ElementsAre(0, 1));
  EXPECT_THAT(LiveSeqs(cluster_.stub(2), "hybrid"), ::testing::ElementsAre(9));
  EXPECT_TRUE(LiveSeqs(cluster_.stub(0), "hybrid").empty());
}

TEST_F(DrainTest, SigtermDrainsToThePeersAndASecondSigtermLosesNothing) {
  // a sends slowly, so that the drain is still running when the second SIGTERM comes.
  ASSERT_NO_FATAL_FAILURE(
      cluster_.Start({"node-a", "node-b", "node-c"},
                     {{"--testing-chunk-delay-ms=300", "--drain-timeout-ms=30000"}}));
  ASSERT_NO_FATAL_FAILURE(Fill());
  NodeProcess& a = *cluster_[0].process;
  ASSERT_EQ(kill(a.pid(), SIGTERM), 0);
  EXPECT_TRUE(Eventually([&] { return Readiness(a) == kNotServing; }, absl::Seconds(5)))
      << "readiness did not turn NOT_SERVING while the node drained";
  // Meanwhile a Drain call is ABORTED and nothing resumes the node.
  v1::DrainResponse ignored;
  grpc::Status status = DrainNode(cluster_.stub(0), &ignored);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("draining already (it shuts down)"));
  status = DrainNode(cluster_.stub(0), &ignored, 0, /*resume=*/true);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("cannot be resumed"));
  // The second SIGTERM (Stop sends it) does not cut the drain short: the node exits cleanly
  // once everything has moved.
  cluster_[0].stub.reset();
  a.ReleaseChannel();
  const ExitStatus exit = a.Stop(absl::Seconds(60));
  EXPECT_TRUE(exit.clean()) << exit.ToString() << "\n" << a.ReadStderr();
  const std::string log = a.ReadStderr();
  EXPECT_THAT(log, HasSubstr("while draining: the drain goes on"));
  EXPECT_THAT(log, HasSubstr("4 sequences and 1 snapshots moved, 0 items stayed"));

  // Every sequence is on a survivor, byte for byte; the scheduler finds them with
  // ListSequences (the test knows its data, so it matches reads).
  for (const Held& held : held_) {
    bool found = false;
    for (size_t node = 1; node < 3 && !found; ++node) {
      v1::ListCachesResponse caches;
      grpc::ClientContext context;
      SetDeadline(&context);
      ASSERT_TRUE(cluster_.stub(node).ListCaches(&context, v1::ListCachesRequest(), &caches).ok());
      bool has_cache = false;
      for (const v1::CacheInfo& c : caches.caches()) has_cache |= c.spec().name() == held.cache;
      if (!has_cache) continue;
      for (const int64_t seq : LiveSeqs(cluster_.stub(node), held.cache)) {
        const ReadOutput read = ReadAll(cluster_.stub(node), held.cache, seq);
        if (read.payload == held.read.payload &&
            read.header.SerializeAsString() == held.read.header.SerializeAsString()) {
          found = true;
        }
      }
    }
    EXPECT_TRUE(found) << held.cache << " seq " << held.seq << " is on no survivor";
  }
  v1::ListSnapshotsResponse snapshots;
  ASSERT_TRUE(ListSnapshots(cluster_.stub(1), "hybrid", &snapshots).ok());
  ASSERT_EQ(snapshots.snapshots_size(), 1);
  EXPECT_EQ(snapshots.snapshots(0).to_offset(), 6);
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
