// The local data path (proto/kvmesh/v1/local.proto) against a real kvmesh-node process: a worker
// session over --local-socket maps a cache's memory and pins cells; the rows it sees in place
// are the bytes gRPC Read returns, a row written in place is what Read returns next, pins keep
// cells from being freed until they go (Unpin, lease, session end), and a worker sees only its
// own tenant's caches.
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cache/device/cuda_device.h"
#include "clients/cpp/kvmesh_local.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/auth.h"
#include "service/common/client_channel.h"
#include "tests/integration/client_util.h"
#include "tests/integration/node_fixture.h"
#include "tests/testing/certs.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::HasSubstr;

constexpr char kAlice[] = "alice-0123456789abcdef0123456789abcdef";  // team-a
constexpr char kBob[] = "bob-0123456789abcdef0123456789abcdef";      // team-b

// Two layers of one head of 8 dims, F32: 4 planes (K and V of each layer) of 32-byte rows.
v1::CacheSpec SmallSpec(const std::string& name) {
  AttentionOptions a;
  a.num_layers = 2;
  a.num_kv_heads = 1;
  a.head_dim_k = 8;
  a.head_dim_v = 8;
  return SpecProto(name, 4, 64, 16, {AttentionGroupProto(a)});
}

std::unique_ptr<Stub> StubFor(const std::string& address, const std::string& token) {
  ClientConnectionOptions options;
  options.token = token;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = NewClientChannel(address, options, args);
  EXPECT_TRUE(channel.ok()) << channel.status();
  return v1::CacheService::NewStub(*channel);
}

int64_t CellsUsed(Stub& stub, const std::string& cache) {
  v1::GetCacheResponse response;
  const grpc::Status status = GetCache(stub, cache, &response);
  EXPECT_TRUE(status.ok()) << StatusText(status);
  return response.cache().usage().groups(0).cells_used();
}

// A plain connection to a node's local socket, for what the client library never sends.
int RawConnect(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// Reads one framed response.
v1::LocalResponse ReadFrame(int fd) {
  char header[4];
  EXPECT_EQ(recv(fd, header, 4, MSG_WAITALL), 4);
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= uint32_t{static_cast<uint8_t>(header[i])} << (8 * i);
  std::string body(n, '\0');
  EXPECT_EQ(recv(fd, body.data(), n, MSG_WAITALL), static_cast<ssize_t>(n));
  v1::LocalResponse response;
  EXPECT_TRUE(response.ParseFromString(body));
  return response;
}

// Sends `request` framed: its 4-byte little-endian length, then its bytes.
void SendFrame(int fd, const v1::LocalRequest& request) {
  const std::string body = request.SerializeAsString();
  std::string frame(4, '\0');
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((body.size() >> (8 * i)) & 0xff);
  frame += body;
  ASSERT_EQ(send(fd, frame.data(), frame.size(), 0), static_cast<ssize_t>(frame.size()));
}

class LocalTest : public ::testing::Test {
 protected:
  void Start(const std::string& token_file) {
    absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("kvmesh-local");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *std::move(dir);
    socket_ = dir_->File("local.sock");
    NodeProcess::Options options;
    options.node_name = "local-node";
    options.extra_args = {absl::StrCat("--local-socket=", socket_), "--memory-budget=64MiB",
                          "--snapshot-budget=16MiB"};
    if (!token_file.empty()) options.extra_args.push_back("--token-file=" + token_file);
    absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
    ASSERT_TRUE(node.ok()) << node.status();
    node_ = *std::move(node);
  }

  std::unique_ptr<TempDir> dir_;
  std::string socket_;
  std::unique_ptr<NodeProcess> node_;
};

TEST_F(LocalTest, CellsReadInPlaceAreReadsBytesAndWritesInPlaceAreSeen) {
  ASSERT_NO_FATAL_FAILURE(Start(""));
  std::unique_ptr<Stub> stub = node_->NewStub();
  const v1::CacheSpec spec = SmallSpec("m");
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 3, {0, 1, 2, 3, 4, 5, 6})));
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 5, {0, 1, 2})));

  absl::StatusOr<std::unique_ptr<local::Session>> session = local::Session::Connect(socket_);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->tenant(), "default");
  absl::StatusOr<std::unique_ptr<local::MappedCache>> cache = (*session)->Attach("m");
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ((*cache)->spec().name(), "m");
  ASSERT_EQ((*cache)->groups().size(), 1u);
  const local::MappedGroup& group = (*cache)->groups()[0];
  v1::GetCacheResponse info;
  KVMESH_ASSERT_OK(GetCache(*stub, "m", &info));
  EXPECT_EQ(group.cells, info.cache().usage().groups(0).cells_total());
  ASSERT_EQ(group.planes.size(), 4u);  // K and V of two layers
  for (const auto& plane : group.planes) EXPECT_EQ(plane.row_bytes, 32u);

  absl::StatusOr<local::Pin> pin = (*session)->PinCells("m", 3, 2, 6);
  ASSERT_TRUE(pin.ok()) << pin.status();
  ASSERT_EQ(pin->cells.size(), 1u);
  EXPECT_EQ(pin->positions[0], (std::vector<int32_t>{2, 3, 4, 5}));
  ASSERT_EQ(pin->cells[0].size(), 4u);
  EXPECT_GT(pin->expires, absl::Now());

  // Read's payload: each plane's rows in position order.
  auto expect_rows_as_read = [&] {
    ReadOutput read;
    KVMESH_ASSERT_OK(Read(*stub, ReadRequest("m", 3, 2, 6), &read));
    ASSERT_EQ(read.payload.size(), 4u * 4u * 32u);
    for (size_t p = 0; p < 4; ++p) {
      for (size_t i = 0; i < 4; ++i) {
        const uint8_t* row = (*cache)->Row(0, p, pin->cells[0][i]);
        EXPECT_EQ(std::memcmp(row, read.payload.data() + (p * 4 + i) * 32, 32), 0)
            << "plane " << p << " position " << pin->positions[0][i];
      }
    }
  };
  ASSERT_NO_FATAL_FAILURE(expect_rows_as_read());
  // A row written in place is what gRPC reads next.
  std::memset((*cache)->Row(0, 1, pin->cells[0][2]), 0x5c, 32);
  ASSERT_NO_FATAL_FAILURE(expect_rows_as_read());
  ReadOutput read;
  KVMESH_ASSERT_OK(Read(*stub, ReadRequest("m", 3, 4, 5), &read));
  EXPECT_EQ(read.payload.substr(32, 32), std::string(32, '\x5c'));

  KVMESH_EXPECT_OK(grpc::Status::OK);
  EXPECT_TRUE((*session)->Unpin(pin->id).ok());
  const absl::Status again = (*session)->Unpin(pin->id);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound) << again;
  EXPECT_THAT(std::string(again.message()), HasSubstr("no pin"));
}

TEST_F(LocalTest, PinnedCellsStayUsedUntilUnpinLeaseOrSessionEnd) {
  ASSERT_NO_FATAL_FAILURE(Start(""));
  std::unique_ptr<Stub> stub = node_->NewStub();
  const v1::CacheSpec spec = SmallSpec("m");
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  auto session = local::Session::Connect(socket_);
  ASSERT_TRUE(session.ok()) << session.status();

  // Unpin: a removed sequence's pinned cells are used until the pin goes.
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 1, {0, 1, 2, 3})));
  absl::StatusOr<local::Pin> pin = (*session)->PinCells("m", 1, 0, std::nullopt);
  ASSERT_TRUE(pin.ok()) << pin.status();
  KVMESH_ASSERT_OK(Remove(*stub, "m", 1, 0));
  EXPECT_EQ(CellsUsed(*stub, "m"), 4);
  ASSERT_TRUE((*session)->Unpin(pin->id).ok());
  EXPECT_EQ(CellsUsed(*stub, "m"), 0);

  // A lease that runs out.
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 1, {0, 1, 2})));
  pin = (*session)->PinCells("m", 1, 0, std::nullopt, absl::Milliseconds(300));
  ASSERT_TRUE(pin.ok()) << pin.status();
  KVMESH_ASSERT_OK(Remove(*stub, "m", 1, 0));
  EXPECT_EQ(CellsUsed(*stub, "m"), 3);
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (CellsUsed(*stub, "m") != 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(CellsUsed(*stub, "m"), 0);
  EXPECT_EQ((*session)->Unpin(pin->id).code(), absl::StatusCode::kNotFound);

  // The session ends: its pins go.
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 2, {0, 1})));
  pin = (*session)->PinCells("m", 2, 0, std::nullopt);
  ASSERT_TRUE(pin.ok()) << pin.status();
  KVMESH_ASSERT_OK(Remove(*stub, "m", 2, 0));
  EXPECT_EQ(CellsUsed(*stub, "m"), 2);
  session->reset();
  const absl::Time until2 = absl::Now() + absl::Seconds(5);
  while (CellsUsed(*stub, "m") != 0 && absl::Now() < until2) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(CellsUsed(*stub, "m"), 0);
}

TEST_F(LocalTest, BadRequestsAreRefusedWithTheirValues) {
  ASSERT_NO_FATAL_FAILURE(Start(""));
  std::unique_ptr<Stub> stub = node_->NewStub();
  const v1::CacheSpec spec = SmallSpec("m");
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 1, {0, 1})));
  auto session = local::Session::Connect(socket_);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<std::unique_ptr<local::MappedCache>> missing = (*session)->Attach("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  absl::StatusOr<local::Pin> pin = (*session)->PinCells("m", 9, 0, std::nullopt);
  EXPECT_EQ(pin.status().code(), absl::StatusCode::kNotFound) << pin.status();
  pin = (*session)->PinCells("m", 1, -1, std::nullopt);
  EXPECT_EQ(pin.status().code(), absl::StatusCode::kInvalidArgument) << pin.status();
  pin = (*session)->PinCells("m", 1, 0, std::nullopt, absl::Hours(1));
  EXPECT_EQ(pin.status().code(), absl::StatusCode::kInvalidArgument) << pin.status();
  EXPECT_THAT(std::string(pin.status().message()), HasSubstr("lease_ms = 3600000"));
  v1::LocalRequest hello;
  hello.mutable_hello();
  absl::StatusOr<v1::LocalResponse> twice = (*session)->Call(hello);
  ASSERT_TRUE(twice.ok()) << twice.status();
  EXPECT_EQ(twice->code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  // The session still works after refusals.
  pin = (*session)->PinCells("m", 1, 0, std::nullopt);
  EXPECT_TRUE(pin.ok()) << pin.status();
}

// A pin with queries answers what each query attends to among the pinned positions, per group,
// as gRPC's Visible (in ranges) answers it, cut to the pinned range.
TEST_F(LocalTest, APinWithQueriesSaysWhatEachAttendsTo) {
  ASSERT_NO_FATAL_FAILURE(Start(""));
  std::unique_ptr<Stub> stub = node_->NewStub();
  AttentionOptions full;
  full.num_layers = 1;
  AttentionOptions sliding = full;
  sliding.sliding_window = 3;
  sliding.sliding_memory = 6;
  const v1::CacheSpec spec =
      SpecProto("w", 4, 64, 32, {AttentionGroupProto(full), AttentionGroupProto(sliding)});
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  std::vector<int32_t> positions;
  for (int32_t p = 0; p < 12; ++p) positions.push_back(p);
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 2, positions)));
  auto session = local::Session::Connect(socket_);
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<int32_t> queries = {0, 5, 11, 12, 40};
  for (const int32_t begin : {0, 7}) {
    absl::StatusOr<local::Pin> pin =
        (*session)->PinCells("w", 2, begin, std::nullopt, absl::ZeroDuration(), queries);
    ASSERT_TRUE(pin.ok()) << pin.status();
    ASSERT_EQ(pin->visible.size(), 2u);
    for (int g = 0; g < 2; ++g) {
      v1::VisibleRequest request;
      request.set_cache("w");
      request.set_group(g);
      request.set_as_ranges(true);
      for (int32_t q : queries) {
        v1::Query* query = request.add_queries();
        query->set_seq(2);
        query->set_pos(q);
      }
      v1::VisibleResponse response;
      const grpc::Status status = Visible(*stub, request, &response);
      ASSERT_TRUE(status.ok()) << StatusText(status);
      ASSERT_EQ(pin->visible[g].size(), queries.size());
      for (size_t i = 0; i < queries.size(); ++i) {
        std::vector<std::pair<int32_t, int32_t>> want;
        for (const v1::PositionRange& r : response.visible(static_cast<int>(i)).ranges()) {
          const int32_t first = std::max(r.first(), begin);
          if (first <= r.last()) want.emplace_back(first, r.last());
        }
        std::vector<std::pair<int32_t, int32_t>> got;
        for (const local::PositionRange& r : pin->visible[g][i]) got.emplace_back(r.first, r.last);
        EXPECT_EQ(got, want) << "group " << g << ", query at " << queries[i] << ", pin from "
                             << begin;
        // Every position it names is pinned.
        for (const auto& [first, last] : got) {
          EXPECT_TRUE(
              std::binary_search(pin->positions[g].begin(), pin->positions[g].end(), first));
          EXPECT_TRUE(std::binary_search(pin->positions[g].begin(), pin->positions[g].end(), last));
        }
      }
    }
    // The sliding group: a query at 11 sees [8, 11]; at 40 nothing.
    if (begin == 0) {
      ASSERT_EQ(pin->visible[1][2].size(), 1u);
      EXPECT_EQ(pin->visible[1][2][0].first, 8);
      EXPECT_EQ(pin->visible[1][2][0].last, 11);
      EXPECT_TRUE(pin->visible[1][4].empty());
    }
    EXPECT_TRUE((*session)->Unpin(pin->id).ok());
  }
  absl::StatusOr<local::Pin> bad =
      (*session)->PinCells("w", 2, 0, std::nullopt, absl::ZeroDuration(), {3, -4});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("queries[1] = -4"));

  // An answer that could exceed 2^18 ranges is refused before it is built: 9,000 queries over a
  // sequence of 128 runs (every other position stored).
  AttentionOptions one;
  one.num_layers = 1;
  const v1::CacheSpec gaps = SpecProto("gaps", 2, 256, 256, {AttentionGroupProto(one)});
  KVMESH_ASSERT_OK(CreateCache(*stub, gaps));
  std::vector<int32_t> even;
  for (int32_t p = 0; p < 256; p += 2) even.push_back(p);
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(gaps, 0, even)));
  const std::vector<int32_t> many(9000, 300);
  bad = (*session)->PinCells("gaps", 0, 0, std::nullopt, absl::ZeroDuration(), many);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kResourceExhausted) << bad.status();
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("more than 262144 ranges"));
  absl::StatusOr<local::Pin> fewer = (*session)->PinCells(
      "gaps", 0, 0, std::nullopt, absl::ZeroDuration(), std::vector<int32_t>(2000, 300));
  ASSERT_TRUE(fewer.ok()) << fewer.status();
  EXPECT_EQ(fewer->visible[0][1999].size(), 128u);
}

// An Append written in place: nothing is seen before its commit, the committed rows are what
// gRPC reads, and a plan abandoned, expired or left by its session changes nothing.
TEST_F(LocalTest, AppendsWrittenInPlaceAreCommittedAllOrNothing) {
  ASSERT_NO_FATAL_FAILURE(Start(""));
  std::unique_ptr<Stub> stub = node_->NewStub();
  const v1::CacheSpec spec = SmallSpec("m");
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  absl::StatusOr<std::unique_ptr<local::Session>> session = local::Session::Connect(socket_);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<std::unique_ptr<local::MappedCache>> cache = (*session)->Attach("m");
  ASSERT_TRUE(cache.ok()) << cache.status();

  // The rows MakeAppend would send, written where the plan says: plane p of token i is at
  // (p * 3 + i) * 32 in its payload.
  const v1::AppendRequest reference = MakeAppend(spec, 4, {0, 1, 2});
  absl::StatusOr<local::AppendPlan> plan =
      (*session)->BeginAppend("m", {4, 4, 4}, {0, 1, 2}, {70, 71, 72});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->cells.size(), 1u);
  ASSERT_EQ(plan->cells[0].size(), 3u);
  ReadOutput read;
  EXPECT_EQ(Read(*stub, ReadRequest("m", 4), &read).error_code(), grpc::StatusCode::NOT_FOUND);
  for (size_t p = 0; p < 4; ++p) {
    for (size_t i = 0; i < 3; ++i) {
      std::memcpy((*cache)->Row(0, p, plan->cells[0][i]),
                  reference.payload().data() + (p * 3 + i) * 32, 32);
    }
  }
  EXPECT_EQ(Read(*stub, ReadRequest("m", 4), &read).error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE((*session)->CommitAppend(plan->id).ok());
  KVMESH_ASSERT_OK(Read(*stub, ReadRequest("m", 4), &read));
  EXPECT_EQ(read.payload, reference.payload());
  EXPECT_EQ(HeaderPositions(read.header)[0], (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(CellsUsed(*stub, "m"), 3);
  const absl::Status again = (*session)->CommitAppend(plan->id);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound) << again;

  // Abandoned: its cells are free again and nothing was stored.
  plan = (*session)->BeginAppend("m", {5, 5}, {0, 1});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE((*session)->AbandonAppend(plan->id).ok());
  EXPECT_EQ(Read(*stub, ReadRequest("m", 5), &read).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ((*session)->CommitAppend(plan->id).code(), absl::StatusCode::kNotFound);
  // Expired.
  plan = (*session)->BeginAppend("m", {6}, {0}, {}, false, absl::Milliseconds(200));
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ((*session)->CommitAppend(plan->id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Read(*stub, ReadRequest("m", 6), &read).error_code(), grpc::StatusCode::NOT_FOUND);
  // Refused batches name their values and leave nothing behind.
  absl::StatusOr<local::AppendPlan> bad = (*session)->BeginAppend("m", {7, 7}, {0});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("seqs (2), positions (1)"));
  bad = (*session)->BeginAppend("m", {7}, {-3});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  bad = (*session)->BeginAppend("m", std::vector<int64_t>(17, 7),
                                {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  // The session ends with a plan open: its cells go back.
  plan = (*session)->BeginAppend("m", {8, 8, 8, 8}, {0, 1, 2, 3});
  ASSERT_TRUE(plan.ok()) << plan.status();
  session->reset();
  cache->reset();
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (CellsUsed(*stub, "m") != 3 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(CellsUsed(*stub, "m"), 3);
  EXPECT_EQ(Read(*stub, ReadRequest("m", 8), &read).error_code(), grpc::StatusCode::NOT_FOUND);
  // The cache takes a plain Append of every cell left (64 of 4 sequences, 3 used).
  KVMESH_EXPECT_OK(Append(*stub, MakeAppend(spec, 9, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11})));
}

// Writes `payload` (an Append's, in payload order) where `plan` says: each group's section into
// its cells of the cache's memory, or of the plan's staging memory where it has some.
void WriteInPlace(const local::MappedCache& cache, const local::AppendPlan& plan,
                  const std::string& payload) {
  const char* src = payload.data();
  for (size_t g = 0; g < plan.cells.size(); ++g) {
    const bool staged = plan.staging != nullptr && plan.staging->groups()[g].bytes > 0;
    const local::MappedCache& memory = staged ? *plan.staging : cache;
    for (size_t p = 0; p < memory.groups()[g].planes.size(); ++p) {
      const size_t n = memory.groups()[g].planes[p].row_bytes;
      for (const int32_t cell : plan.cells[g]) {
        if (cell >= 0) std::memcpy(memory.Row(g, p, cell), src, n);
        src += n;
      }
    }
  }
  ASSERT_EQ(src, payload.data() + payload.size());
}

// `request` for sequence `seq` instead (the same rows).
v1::AppendRequest ForSequence(v1::AppendRequest request, int64_t seq) {
  for (v1::Token& t : *request.mutable_tokens()) t.set_seq(seq);
  for (v1::TokenRange& r : *request.mutable_token_ranges()) r.set_seq(seq);
  return request;
}

// A cache with a ring and a conv state, through the C++ client: a plain plan (staged in a free
// ring and state slot) and a speculative one (staged in memory the plan maps) leave the sequence
// as the same Appends through gRPC leave a twin sequence, with a pin of the ring and the state
// held meanwhile.
TEST_F(LocalTest, RingsAndStatesAreWrittenInPlaceToo) {
  ASSERT_NO_FATAL_FAILURE(Start(""));
  std::unique_ptr<Stub> stub = node_->NewStub();
  AttentionOptions a;
  a.num_layers = 1;
  a.num_kv_heads = 1;
  RotatingOptions r;
  r.num_layers = 2;
  RecurrentOptions c;
  c.num_v_heads = 0;
  c.head_v_dim = 0;
  c.head_k_dim = 0;
  const v1::CacheSpec spec = SpecProto(
      "h", 4, 64, 16, {AttentionGroupProto(a), RotatingGroupProto(r), RecurrentGroupProto(c)});
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  absl::StatusOr<std::unique_ptr<local::Session>> session = local::Session::Connect(socket_);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<std::unique_ptr<local::MappedCache>> cache = (*session)->Attach("h");
  ASSERT_TRUE(cache.ok()) << cache.status();

  // Seq 1 in place, seq 2 (the twin) through gRPC; positions 0 and 1 fall out of the ring.
  const std::vector<int32_t> first = {0, 1, 2, 3, 4, 5};
  absl::StatusOr<local::AppendPlan> plan =
      (*session)->BeginAppend("h", std::vector<int64_t>(6, 1), first);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->staging, nullptr);
  EXPECT_EQ(plan->cells[1][0], -1);
  EXPECT_EQ(plan->cells[2].size(), 1u);  // the state slot of the one sequence
  ASSERT_NO_FATAL_FAILURE(WriteInPlace(**cache, *plan, MakeAppend(spec, 1, first).payload()));
  ASSERT_TRUE((*session)->CommitAppend(plan->id).ok());
  KVMESH_ASSERT_OK(Append(*stub, ForSequence(MakeAppend(spec, 1, first), 2)));

  absl::StatusOr<local::Pin> pin = (*session)->PinCells("h", 1, 0, std::nullopt);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->positions[1], (std::vector<int32_t>{2, 3, 4, 5}));
  EXPECT_EQ(pin->positions[2], (std::vector<int32_t>{5}));
  const std::vector<int32_t> drafts = {6, 7, 8};
  plan = (*session)->BeginAppend("h", {1, 1, 1}, drafts, {}, /*speculative=*/true);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_NE(plan->staging, nullptr);
  EXPECT_EQ(plan->staging->groups()[0].bytes, 0u);  // attention: pending rows are cells
  EXPECT_GT(plan->staging->groups()[1].bytes, 0u);
  EXPECT_EQ(plan->staging->groups()[2].cells, 3);  // a state per draft
  ASSERT_NO_FATAL_FAILURE(
      WriteInPlace(**cache, *plan, MakeSpeculativeAppend(spec, 1, drafts).payload()));
  ASSERT_TRUE((*session)->CommitAppend(plan->id).ok());
  KVMESH_ASSERT_OK(Append(*stub, ForSequence(MakeSpeculativeAppend(spec, 1, drafts), 2)));
  KVMESH_ASSERT_OK(CommitSpeculation(*stub, "h", 1, 2));
  KVMESH_ASSERT_OK(CommitSpeculation(*stub, "h", 2, 2));
  ASSERT_TRUE((*session)->Unpin(pin->id).ok());

  ReadOutput mine, theirs;
  KVMESH_ASSERT_OK(Read(*stub, ReadRequest("h", 1), &mine));
  KVMESH_ASSERT_OK(Read(*stub, ReadRequest("h", 2), &theirs));
  EXPECT_EQ(HeaderPositions(mine.header), HeaderPositions(theirs.header));
  EXPECT_EQ(HeaderPositions(mine.header)[1], (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_EQ(mine.payload, theirs.payload);
}

// What one worker can make the node hold: 64 sessions, 1,024 pins a session.
TEST_F(LocalTest, SessionsAndPinsAreBounded) {
  ASSERT_NO_FATAL_FAILURE(Start(""));
  std::unique_ptr<Stub> stub = node_->NewStub();
  const v1::CacheSpec spec = SmallSpec("m");
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 1, {0, 1})));
  std::vector<std::unique_ptr<local::Session>> sessions;
  for (int i = 0; i < 64; ++i) {
    absl::StatusOr<std::unique_ptr<local::Session>> session = local::Session::Connect(socket_);
    ASSERT_TRUE(session.ok()) << i << ": " << session.status();
    sessions.push_back(*std::move(session));
  }
  absl::StatusOr<std::unique_ptr<local::Session>> over = local::Session::Connect(socket_);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("64 local sessions"));
  // One that ends makes room.
  sessions.pop_back();
  const absl::Time until = absl::Now() + absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<local::Session>> again = local::Session::Connect(socket_);
  while (!again.ok() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(50));
    again = local::Session::Connect(socket_);
  }
  ASSERT_TRUE(again.ok()) << again.status();
  for (int i = 0; i < 1024; ++i) {
    absl::StatusOr<local::Pin> pin = (*again)->PinCells("m", 1, 0, std::nullopt);
    ASSERT_TRUE(pin.ok()) << i << ": " << pin.status();
  }
  absl::StatusOr<local::Pin> pin = (*again)->PinCells("m", 1, 0, std::nullopt);
  EXPECT_EQ(pin.status().code(), absl::StatusCode::kResourceExhausted) << pin.status();
  EXPECT_THAT(std::string(pin.status().message()), HasSubstr("1024 pins"));
  // Append plans: 16 a session, each holding its tokens' cells.
  for (int i = 0; i < 16; ++i) {
    absl::StatusOr<local::AppendPlan> plan = (*again)->BeginAppend("m", {1}, {2 + i});
    ASSERT_TRUE(plan.ok()) << i << ": " << plan.status();
  }
  absl::StatusOr<local::AppendPlan> plan = (*again)->BeginAppend("m", {1}, {40});
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted) << plan.status();
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("16 Append plans"));
}

// Raw frames: a request before Hello, and a frame over the limit, end the session.
TEST_F(LocalTest, NothingButAHelloIsReadBeforeTheSessionIsAuthenticated) {
  ASSERT_NO_FATAL_FAILURE(Start(""));
  {
    const int fd = RawConnect(socket_);
    v1::LocalRequest request;
    request.mutable_attach()->set_cache("m");
    ASSERT_NO_FATAL_FAILURE(SendFrame(fd, request));
    const v1::LocalResponse response = ReadFrame(fd);
    EXPECT_EQ(response.code(), static_cast<int>(absl::StatusCode::kUnauthenticated));
    char byte;
    EXPECT_EQ(recv(fd, &byte, 1, 0), 0);  // closed
    close(fd);
  }
  {
    const int fd = RawConnect(socket_);
    const uint32_t huge = 100 << 20;
    char header[4];
    for (int i = 0; i < 4; ++i) header[i] = static_cast<char>((huge >> (8 * i)) & 0xff);
    ASSERT_EQ(send(fd, header, 4, 0), 4);
    const v1::LocalResponse response = ReadFrame(fd);
    EXPECT_EQ(response.code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
    EXPECT_THAT(response.message(), HasSubstr("104857600 bytes"));
    char byte;
    EXPECT_EQ(recv(fd, &byte, 1, 0), 0);
    close(fd);
  }
}

// A worker that stops reading its answers cannot keep its pins: the node's send of an answer
// larger than the socket's buffer gives up after 5 s and ends the session, pins and all.
TEST_F(LocalTest, AWorkerThatStopsReadingLosesItsSessionAndPins) {
  ASSERT_NO_FATAL_FAILURE(Start(""));
  std::unique_ptr<Stub> stub = node_->NewStub();
  AttentionOptions a;
  a.num_layers = 1;
  a.num_kv_heads = 1;
  const v1::CacheSpec spec = SpecProto("big", 2, 131072, 131072, {AttentionGroupProto(a)});
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  std::vector<int32_t> positions(120000);
  for (int32_t p = 0; p < 120000; ++p) positions[p] = p;
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 0, positions)));

  const int fd = RawConnect(socket_);
  int buffer = 0;
  socklen_t length = sizeof(buffer);
  ASSERT_EQ(getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer, &length), 0);
  // The answer (positions and cells, ~700 KB) must be more than the node's socket can hold.
  ASSERT_LT(2 * static_cast<size_t>(buffer), size_t{700000}) << "socket buffers of " << buffer;
  v1::LocalRequest hello;
  hello.set_id(1);
  hello.mutable_hello();
  ASSERT_NO_FATAL_FAILURE(SendFrame(fd, hello));
  EXPECT_EQ(ReadFrame(fd).code(), 0);
  v1::LocalRequest pin;
  pin.set_id(2);
  pin.mutable_pin()->set_cache("big");
  pin.mutable_pin()->set_seq(0);
  ASSERT_NO_FATAL_FAILURE(SendFrame(fd, pin));
  // The node pins before it answers: once the answer's first bytes arrive, the pin is held.
  int pending = 0;
  for (absl::Time end = absl::Now() + absl::Seconds(10); absl::Now() < end && pending == 0;) {
    ASSERT_EQ(ioctl(fd, FIONREAD, &pending), 0);
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_GT(pending, 0) << "no answer to the pin";
  // The sequence goes; its cells stay while the pin (whose answer, ~700 KB of positions and
  // cells, is several socket buffers of ~`buffer` bytes) is held by the stuck session.
  v1::RemoveRequest remove;
  remove.set_cache("big");
  remove.set_seq(0);
  v1::RemoveResponse removed;
  {
    grpc::ClientContext context;
    KVMESH_ASSERT_OK(stub->Remove(&context, remove, &removed));
  }
  absl::SleepFor(absl::Seconds(1));
  EXPECT_EQ(CellsUsed(*stub, "big"), 120000) << "socket buffer " << buffer << " bytes";
  const absl::Time start = absl::Now();
  int64_t used = -1;
  while (absl::Now() - start < absl::Seconds(20)) {
    used = CellsUsed(*stub, "big");
    if (used == 0) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(used, 0) << "the stuck session still holds its pin";
  // The session is gone: the socket reads to its end (within 10 s, not forever if it is not).
  const timeval receive_timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &receive_timeout, sizeof(receive_timeout));
  std::string rest(1 << 20, '\0');
  ssize_t got = 0;
  while ((got = recv(fd, rest.data(), rest.size(), 0)) > 0) {
  }
  EXPECT_EQ(got, 0);
  close(fd);
}

// On a GPU node, Attach hands over GPU memory: per group a CUDA VMM descriptor (not mapped by the
// client: the engine imports it with its driver; the Python worker test does so on the simulated
// GPU), whose rows Pin and BeginAppend name as on the host.
TEST(LocalCudaTest, AttachOnAGpuNodeHandsOverGpuMemory) {
  if (!CudaSimulated()) GTEST_SKIP() << "not a -DKVMESH_CUDA=SIM build";
  absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("kvmesh-local-cuda");
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string socket_path = (*dir)->File("local.sock");
  NodeProcess::Options options;
  options.node_name = "local-gpu";
  options.extra_args = {absl::StrCat("--local-socket=", socket_path), "--backend=cuda",
                        "--transport=grpc-stream", "--memory-budget=64MiB",
                        "--snapshot-budget=16MiB"};
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  ASSERT_TRUE(node.ok()) << node.status();
  std::unique_ptr<Stub> stub = (*node)->NewStub();
  const v1::CacheSpec spec = SmallSpec("m");
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 1, {0, 1, 2})));
  auto session = local::Session::Connect(socket_path);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<std::unique_ptr<local::MappedCache>> cache = (*session)->Attach("m");
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_EQ((*cache)->groups().size(), 1u);
  const local::MappedGroup& group = (*cache)->groups()[0];
  EXPECT_EQ(group.base, nullptr);
  EXPECT_EQ(group.cuda_device, 0);
  EXPECT_GE(group.cuda_fd, 0);
  EXPECT_EQ(group.bytes % (size_t{2} << 20), 0u) << group.bytes;  // whole 2 MiB granules
  struct stat st;
  ASSERT_EQ(fstat(group.cuda_fd, &st), 0);
  EXPECT_EQ(static_cast<size_t>(st.st_size), group.bytes);
  absl::StatusOr<local::Pin> pin = (*session)->PinCells("m", 1, 0, std::nullopt);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->positions[0], (std::vector<int32_t>{0, 1, 2}));
  session->reset();
  cache->reset();
  (*node)->ReleaseChannel();
  EXPECT_TRUE((*node)->Stop().clean()) << (*node)->ReadStderr();
}

// With a token file: a worker needs a valid token, and maps and pins only its tenant's caches.
TEST_F(LocalTest, AWorkerSeesOnlyItsOwnTenantsCaches) {
  absl::StatusOr<std::unique_ptr<TempDir>> tokens_dir = TempDir::Create("kvmesh-local-tokens");
  ASSERT_TRUE(tokens_dir.ok()) << tokens_dir.status();
  const std::string tokens = (*tokens_dir)->File("tokens");
  {
    std::ofstream out(tokens);
    out << "token sha256:" << Sha256Hex(kAlice) << " team-a tenant\n"
        << "token sha256:" << Sha256Hex(kBob) << " team-b tenant\n";
  }
  ASSERT_NO_FATAL_FAILURE(Start(tokens));
  std::unique_ptr<Stub> alice = StubFor(node_->address(), kAlice);
  const v1::CacheSpec spec = SmallSpec("secret");
  KVMESH_ASSERT_OK(CreateCache(*alice, spec));
  KVMESH_ASSERT_OK(Append(*alice, MakeAppend(spec, 1, {0, 1, 2})));

  absl::StatusOr<std::unique_ptr<local::Session>> none = local::Session::Connect(socket_);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnauthenticated) << none.status();
  absl::StatusOr<std::unique_ptr<local::Session>> wrong =
      local::Session::Connect(socket_, "not-a-token");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kUnauthenticated) << wrong.status();
  EXPECT_THAT(std::string(wrong.status().message()), ::testing::Not(HasSubstr("not-a-token")));
  // Bob may not name Alice's tenant (he is no admin), nor find her cache under his own.
  absl::StatusOr<std::unique_ptr<local::Session>> as_a =
      local::Session::Connect(socket_, kBob, "team-a");
  EXPECT_EQ(as_a.status().code(), absl::StatusCode::kPermissionDenied) << as_a.status();
  absl::StatusOr<std::unique_ptr<local::Session>> bob = local::Session::Connect(socket_, kBob);
  ASSERT_TRUE(bob.ok()) << bob.status();
  EXPECT_EQ((*bob)->tenant(), "team-b");
  EXPECT_EQ((*bob)->Attach("secret").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*bob)->PinCells("secret", 1, 0, std::nullopt).status().code(),
            absl::StatusCode::kNotFound);
  absl::StatusOr<std::unique_ptr<local::Session>> a = local::Session::Connect(socket_, kAlice);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE((*a)->Attach("secret").ok());
  EXPECT_TRUE((*a)->PinCells("secret", 1, 0, std::nullopt).ok());
}

// CopyRows is memcpy at every size and alignment, below and above its streaming threshold, and
// touches nothing outside the destination range.
TEST(CopyRowsTest, CopiesExactlyTheRangeAtEveryAlignmentAndSize) {
  const size_t big = local::kStreamCopyBytes;
  std::string source(big + 4096, '\0');
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<char>((i * 131 + 7) % 251);
  for (const size_t bytes :
       {size_t{0}, size_t{1}, size_t{63}, size_t{4096}, big - 1, big, big + 1, big + 65}) {
    for (const size_t dst_offset : {0, 1, 15, 16, 33}) {
      for (const size_t src_offset : {0, 3}) {
        std::string destination(big + 4096 + 64, '\x5a');
        local::CopyRows(destination.data() + dst_offset, source.data() + src_offset, bytes);
        std::string want(big + 4096 + 64, '\x5a');
        std::memcpy(want.data() + dst_offset, source.data() + src_offset, bytes);
        ASSERT_TRUE(destination == want)
            << bytes << " bytes to offset " << dst_offset << " from offset " << src_offset;
      }
    }
  }
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
