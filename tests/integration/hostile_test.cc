// Bounded before trusted (docs/security.md, "Attacks and their bounds"), with real kvmesh-node
// processes: a call is authenticated before its body is read, a request larger than its
// method's limit is refused before it is parsed, a name that is not UTF-8 or too long is
// INVALID_ARGUMENT naming the field in every method (streams included), a revoked token loses its
// open streams, and a stream that sends too slowly is ended rather than holding the in-flight
// budget.
#include <sys/types.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/auth.h"
#include "service/cache_service.h"
#include "service/common/client_channel.h"
#include "tests/integration/client_util.h"
#include "tests/testing/certs.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;

#define ASSERT_OK(expr)                                                \
  do {                                                                 \
    const grpc::Status status_ = (expr);                               \
    ASSERT_TRUE(status_.ok()) << #expr << ": " << StatusText(status_); \
  } while (0)

constexpr char kAlice[] = "alice-0123456789abcdef0123456789abcdef";  // team-a, tenant
constexpr char kRoot[] = "root-0123456789abcdef0123456789abcdef";    // ops, admin

std::string TokenLine(const std::string& token, const std::string& tenant,
                      const std::string& role) {
  return absl::StrCat("token sha256:", Sha256Hex(token), " ", tenant, " ", role, "\n");
}

// Writes `text` to `path` through a rename, as a Secret volume update swaps files.
void WriteFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
  }
  ASSERT_EQ(std::rename(tmp.c_str(), path.c_str()), 0);
}

std::shared_ptr<grpc::Channel> ChannelFor(const std::string& address, const std::string& token) {
  ClientConnectionOptions options;
  options.token = token;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = NewClientChannel(address, options, args);
  EXPECT_TRUE(channel.ok()) << channel.status();
  return *channel;
}

// A tiny Attention cache: 2 layers x 1 head x 8 dims, F32 (128 bytes per token).
v1::CacheSpec SmallSpec(const std::string& name, int32_t capacity = 64) {
  AttentionOptions a;
  a.num_layers = 2;
  a.num_kv_heads = 1;
  a.head_dim_k = 8;
  a.head_dim_v = 8;
  return SpecProto(name, 4, capacity, 64, {AttentionGroupProto(a)});
}

class HostileTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> extra = {}) {
    absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("kvmesh-hostile");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *std::move(dir);
    tokens_ = dir_->File("tokens");
    WriteFile(tokens_, Tokens(true));
    NodeProcess::Options options;
    options.node_name = "h0";
    options.extra_args = {absl::StrCat("--token-file=", tokens_), "--memory-budget=64MiB",
                          "--snapshot-budget=16MiB"};
    for (std::string& arg : extra) options.extra_args.push_back(std::move(arg));
    absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
    ASSERT_TRUE(node.ok()) << node.status();
    node_ = *std::move(node);
    alice_channel_ = ChannelFor(node_->address(), kAlice);
    alice_ = v1::CacheService::NewStub(alice_channel_);
    anonymous_ = ChannelFor(node_->address(), "");
  }

  static std::string Tokens(bool with_alice) {
    return absl::StrCat(with_alice ? TokenLine(kAlice, "team-a", "tenant") : "",
                        TokenLine(kRoot, "ops", "admin"));
  }

  void RevokeAlice() { WriteFile(tokens_, Tokens(false)); }
  // Alice's token, now of another tenant.
  void MoveAlice() {
    WriteFile(tokens_, absl::StrCat(TokenLine(kAlice, "team-b", "tenant"),
                                    TokenLine(kRoot, "ops", "admin")));
  }

  std::unique_ptr<TempDir> dir_;
  std::string tokens_;
  std::unique_ptr<NodeProcess> node_;
  std::shared_ptr<grpc::Channel> alice_channel_;
  std::unique_ptr<Stub> alice_;
  std::shared_ptr<grpc::Channel> anonymous_;
};

// Finding 1: a 10 MiB Visible of 5M empty queries without a token. Before, the node parsed it
// (and answered RESOURCE_EXHAUSTED, which told the caller the node's budget); now it answers
// UNAUTHENTICATED without reading the body, and its memory does not move. The same for the
// server streams, whose requests gRPC used to read whole before the node saw the call.
TEST_F(HostileTest, AnUnauthenticatedRequestIsRefusedBeforeItsBodyIsRead) {
  Start();
  std::string body;
  for (int i = 0; i < 5 * 1000 * 1000; ++i) body.append("\x1a\x00", 2);  // queries = {}
  const uint64_t rss_before = ProcessStatusBytes(node_->pid(), "VmRSS");
  for (const char* method :
       {"Visible", "LookupPrefix", "GetCache", "Append", "WatchEvents", "Read"}) {
    std::vector<std::string> responses;
    const grpc::Status status =
        CallRaw(anonymous_, absl::StrCat("/kvmesh.v1.CacheService/", method), body, &responses);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << method << ": " << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("bearer token")) << method;
  }
  const uint64_t rss_after = ProcessStatusBytes(node_->pid(), "VmRSS");
  // gRPC's stream window (a few MiB) at most, never the 10 MiB body, let alone its parse.
  EXPECT_LT(rss_after, rss_before + (uint64_t{8} << 20))
      << "RSS " << rss_before << " -> " << rss_after;
}

// A known caller's request larger than its method's limit is refused before it is parsed.
TEST_F(HostileTest, ARequestLargerThanItsMethodsLimitIsRefusedBeforeParsing) {
  Start();
  std::string body;
  while (body.size() <= kMaxVisibleRequestBytes) body.append("\x1a\x00", 2);
  std::vector<std::string> responses;
  grpc::Status status =
      CallRaw(alice_channel_, "/kvmesh.v1.CacheService/Visible", body, &responses);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(status);
  EXPECT_THAT(status.error_message(),
              HasSubstr(absl::StrCat("limit of ", kMaxVisibleRequestBytes, " bytes")));
  // Small methods have small limits: a GetCache of 100 KiB (an unknown field 15 beside the
  // name) is refused.
  const std::string big_get = StringField(1, "c") + StringField(15, std::string(100 << 10, 'x'));
  status = CallRaw(alice_channel_, "/kvmesh.v1.CacheService/GetCache", big_get, &responses);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(status);
  EXPECT_THAT(status.error_message(),
              HasSubstr(absl::StrCat("limit of ", kMaxSmallRequestBytes, " bytes")));
  // And the streams: a WatchEvents of 300k empty names, a Read of 1 MiB of positions.
  std::string names;
  for (int i = 0; i < 300000; ++i) names.append("\x0a\x00", 2);
  status = CallRaw(alice_channel_, "/kvmesh.v1.CacheService/WatchEvents", names, &responses);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(status);
  EXPECT_THAT(status.error_message(),
              HasSubstr(absl::StrCat("limit of ", kMaxWatchRequestBytes, " bytes")));
  while (body.size() <= kMaxReadRequestBytes) body.append("\x1a\x00", 2);
  status = CallRaw(alice_channel_, "/kvmesh.v1.CacheService/Read", body, &responses);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(status);
  EXPECT_THAT(status.error_message(),
              HasSubstr(absl::StrCat("limit of ", kMaxReadRequestBytes, " bytes")));
}

// Finding 6: a name that is not UTF-8 is INVALID_ARGUMENT naming the field, in every method
// (before, GetCache, DeleteCache, ListSequences and CreateCache answered UNIMPLEMENTED with an
// empty message).
TEST_F(HostileTest, NamesThatAreNotUtf8AreInvalidArgumentNamingTheField) {
  Start();
  const std::string bad = "\xff\xfe-cache";
  const int spec_field = v1::CreateCacheRequest::descriptor()->FindFieldByName("spec")->number();
  const int name_field = v1::CacheSpec::descriptor()->FindFieldByName("name")->number();
  struct Case {
    const char* method;
    std::string body;
    const char* field;
  };
  const std::vector<Case> cases = {
      {"GetCache", StringField(1, bad), "cache"},
      {"DeleteCache", StringField(1, bad), "cache"},
      {"ListSequences", StringField(1, bad), "cache"},
      {"CreateCache", StringField(spec_field, StringField(name_field, bad)), "spec.name"},
      {"Read", StringField(1, bad), "cache"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> responses;
    const grpc::Status status = CallRaw(
        alice_channel_, absl::StrCat("/kvmesh.v1.CacheService/", c.method), c.body, &responses);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.method << ": " << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr(absl::StrCat(c.field, " is not valid UTF-8")))
        << c.method;
  }
}

// Finding 3: WatchEvents takes the same 128-byte name limit as every RPC, and its error quotes
// a long name only in part (a 10 KB name echoed whole would not fit gRPC's metadata limit).
TEST_F(HostileTest, WatchEventsRefusesLongNamesWithABoundedMessage) {
  Start();
  for (const size_t length : {size_t{5000}, size_t{10240}}) {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(10));
    v1::WatchEventsRequest request;
    request.add_caches(std::string(length, 'n'));
    std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
        alice_->WatchEvents(&context, request);
    v1::WatchEventsResponse response;
    while (reader->Read(&response)) {
    }
    const grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr(absl::StrCat("caches is ", length, " bytes")));
    EXPECT_LT(status.error_message().size(), 300u) << status.error_message();
  }
}

// Finding 2: revoking a token ends the WatchEvents stream it opened (UNAUTHENTICATED) within
// about a second of the reload, instead of at the client's deadline or never.
TEST_F(HostileTest, ARevokedTokenEndsItsWatchEventsStream) {
  Start();
  ASSERT_OK(CreateCache(*alice_, SmallSpec("watched")));
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(60));
  v1::WatchEventsRequest request;
  std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
      alice_->WatchEvents(&context, request);
  v1::WatchEventsResponse response;
  ASSERT_TRUE(reader->Read(&response));  // the listing
  const absl::Time revoked = absl::Now();
  RevokeAlice();
  while (reader->Read(&response)) {
  }
  const grpc::Status status = reader->Finish();
  const absl::Duration took = absl::Now() - revoked;
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("WatchEvents ended"));
  // The file is polled once a second and the watcher checks once a second: a few seconds at
  // most (the client's deadline is a minute).
  EXPECT_LT(took, absl::Seconds(10)) << took;
}

// A token that now belongs to another tenant ends the streams it opened for the first one
// (PERMISSION_DENIED naming both tenants): a stream never changes whose data it sees.
TEST_F(HostileTest, ATokenMovedToAnotherTenantEndsItsStreams) {
  Start();
  ASSERT_OK(CreateCache(*alice_, SmallSpec("moved")));
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(60));
  std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
      alice_->WatchEvents(&context, v1::WatchEventsRequest());
  v1::WatchEventsResponse response;
  ASSERT_TRUE(reader->Read(&response));  // the listing
  MoveAlice();
  while (reader->Read(&response)) {
  }
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("tenant 'team-b'"));
  EXPECT_THAT(status.error_message(), HasSubstr("tenant 'team-a'"));
}

// Finding 2, for AppendStream: an open stream whose token is revoked ends (UNAUTHENTICATED)
// while it waits for its next message, and its reservation is freed.
TEST_F(HostileTest, ARevokedTokenEndsItsAppendStream) {
  Start();
  const v1::CacheSpec spec = SmallSpec("streamed");
  ASSERT_OK(CreateCache(*alice_, spec));
  const v1::AppendRequest append = MakeAppend(spec, 0, {0, 1, 2, 3});
  const std::vector<v1::AppendStreamRequest> messages = StreamMessages(append, 0, 64);
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(60));
  v1::AppendResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendStreamRequest>> writer =
      alice_->AppendStream(&context, &response);
  ASSERT_TRUE(writer->Write(messages[0]));  // the header, then nothing
  const absl::Time revoked = absl::Now();
  RevokeAlice();
  const grpc::Status status = writer->Finish();
  const absl::Duration took = absl::Now() - revoked;
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("AppendStream ended"));
  EXPECT_LT(took, absl::Seconds(10)) << took;
}

// Finding 5: a stream that sends a byte now and then holds its reservation for next to no
// progress; below --stream_min_rate (after the grace) it is ended with RESOURCE_EXHAUSTED
// naming the rate, long before the idle timeout (which it never meets).
TEST_F(HostileTest, ASlowDripStreamIsEndedBelowTheMinimumRate) {
  Start({"--stream_min_rate=64KiB", "--stream_min_rate_grace_ms=1000"});
  // 16,384 tokens of 128 bytes: the header's tokens alone hold over 1 MiB of the in-flight budget
  // (kMinRateReservationBytes), which is what makes the rate apply.
  AttentionOptions a;
  a.num_layers = 2;
  a.num_kv_heads = 1;
  a.head_dim_k = 8;
  a.head_dim_v = 8;
  const v1::CacheSpec spec = SpecProto("dripped", 4, 16384, 16384, {AttentionGroupProto(a)});
  ASSERT_OK(CreateCache(*alice_, spec));
  v1::AppendStreamRequest header;
  header.mutable_header()->set_cache(spec.name());
  v1::TokenRange* range = header.mutable_header()->add_token_ranges();
  range->set_seq(0);
  range->set_first(0);
  range->set_count(16384);
  header.mutable_header()->set_payload_bytes(int64_t{16384} * 128);
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(60));
  v1::AppendResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendStreamRequest>> writer =
      alice_->AppendStream(&context, &response);
  const absl::Time start = absl::Now();
  bool ok = writer->Write(header);
  while (ok && absl::Now() - start < absl::Seconds(20)) {
    absl::SleepFor(absl::Milliseconds(200));
    v1::AppendStreamRequest data;
    data.set_data("x");
    ok = writer->Write(data);
  }
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("--stream-min-rate"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  // The cache is as before.
  v1::ListSequencesResponse sequences;
  ASSERT_OK(ListSequences(*alice_, spec.name(), &sequences));
  EXPECT_EQ(sequences.sequences_size(), 0);
}

// A stream that holds little of the in-flight budget (its data goes into cells as it comes) may
// follow a slow producer: the minimum rate does not end it.
TEST_F(HostileTest, ASlowStreamThatHoldsLittleIsNotEnded) {
  Start({"--stream_min_rate=64KiB", "--stream_min_rate_grace_ms=500"});
  const v1::CacheSpec spec = SmallSpec("produced", 4096);
  ASSERT_OK(CreateCache(*alice_, spec));
  std::vector<int32_t> positions;
  for (int32_t p = 0; p < 64; ++p) positions.push_back(p);
  const v1::AppendRequest append = MakeAppend(spec, 0, positions);  // 8 KiB of payload
  const std::vector<v1::AppendStreamRequest> messages = StreamMessages(append, 0, 64);
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(60));
  v1::AppendResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendStreamRequest>> writer =
      alice_->AppendStream(&context, &response);
  for (const v1::AppendStreamRequest& message : messages) {
    ASSERT_TRUE(writer->Write(message));
    absl::SleepFor(absl::Milliseconds(40));  // 64 bytes every 40 ms: 1.6 KB/s for 5 s
  }
  writer->WritesDone();
  ASSERT_OK(writer->Finish());
  v1::ListSequencesResponse sequences;
  ASSERT_OK(ListSequences(*alice_, spec.name(), &sequences));
  ASSERT_EQ(sequences.sequences_size(), 1);
  EXPECT_EQ(sequences.sequences(0).offset(), 64);
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
