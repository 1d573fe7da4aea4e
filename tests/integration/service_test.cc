// The happy path of every kvmesh.v1.CacheService RPC, the health service and reflection,
// against a real kvmesh-node process. Data is checked byte for byte against the patterns of
// tests/testing/pattern.h.
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "service/common/bulk_client.h"
#include "service/common/convert.h"
#include "tests/integration/client_util.h"
#include "tests/integration/node_fixture.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::vector<int32_t> Range(int32_t begin, int32_t end) {
  std::vector<int32_t> out(end - begin);
  std::iota(out.begin(), out.end(), begin);
  return out;
}

// F32, 2 layers x 2 heads, head_dim_k 8 (RoPE NORMAL on the first 4), head_dim_v 4:
// 2 * 2 * (8 + 4) * 4 = 192 bytes per token.
v1::CacheSpec BasicSpec(const std::string& name, int32_t max_sequences = 4, int32_t capacity = 64,
                        int32_t max_batch = 32) {
  AttentionOptions a;
  a.num_layers = 2;
  a.num_kv_heads = 2;
  a.head_dim_k = 8;
  a.head_dim_v = 4;
  a.rope = v1::ROPE_TYPE_NORMAL;
  a.rope_dims = 4;
  return SpecProto(name, max_sequences, capacity, max_batch, {AttentionGroupProto(a)});
}
constexpr size_t kBasicTokenBytes = 192;

class ServiceTest : public NodeSuite {
 protected:
  static void SetUpTestSuite() { StartNode({"--memory-budget=1GiB"}); }

  v1::CacheUsage Usage(const std::string& cache) {
    v1::GetCacheResponse response;
    const grpc::Status status = GetCache(stub(), cache, &response);
    EXPECT_TRUE(status.ok()) << StatusText(status);
    return response.cache().usage();
  }

  v1::ListSequencesResponse Sequences(const std::string& cache) {
    v1::ListSequencesResponse response;
    const grpc::Status status = ListSequences(stub(), cache, &response);
    EXPECT_TRUE(status.ok()) << StatusText(status);
    return response;
  }

  // A raw call's one response, an AppendResponse whose first group uses `cells_used` cells.
  void ExpectAppendResponse(const std::vector<std::string>& responses, int64_t cells_used) {
    ASSERT_EQ(responses.size(), 1u);
    v1::AppendResponse response;
    ASSERT_TRUE(response.ParseFromString(responses[0]));
    EXPECT_EQ(response.usage().groups(0).cells_used(), cells_used);
  }

  // Reads all of `seq` and checks header and bytes against `model` (every group holds what the
  // model holds).
  void ExpectReadMatches(const v1::CacheSpec& spec, int64_t seq, const SequenceModel& model) {
    ReadOutput out;
    KVMESH_ASSERT_OK(Read(stub(), ReadRequest(spec.name(), seq), &out));
    std::vector<std::vector<int32_t>> expected_positions;
    for (const auto& group : model) {
      std::vector<int32_t> positions;
      for (const auto& [pos, id] : group) positions.push_back(pos);
      expected_positions.push_back(positions);
    }
    EXPECT_EQ(HeaderPositions(out.header), expected_positions);
    EXPECT_EQ(out.header.payload_bytes(), static_cast<int64_t>(out.payload.size()));
    EXPECT_TRUE(out.payload == ExpectedReadPayload(spec, model, expected_positions))
        << "payload of sequence " << seq << " differs from the pattern";
  }
};

TEST_F(ServiceTest, HealthServesTheServerAndTheCacheService) {
  int serving = -1;
  KVMESH_ASSERT_OK(HealthCheck(node().channel(), "", &serving));
  EXPECT_EQ(serving, 1);  // SERVING
  serving = -1;
  KVMESH_ASSERT_OK(HealthCheck(node().channel(), "kvmesh.v1.CacheService", &serving));
  EXPECT_EQ(serving, 1);
  EXPECT_EQ(HealthCheck(node().channel(), "no.such.Service", &serving).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, ReflectionListsTheServices) {
  std::vector<std::string> services;
  KVMESH_ASSERT_OK(ListReflectedServices(node().channel(), &services));
  EXPECT_THAT(services, ::testing::IsSupersetOf({"kvmesh.v1.CacheService", "grpc.health.v1.Health",
                                                 "grpc.reflection.v1alpha.ServerReflection"}));
}

// ghz and grpcurl find a method's messages through reflection: the health service's must be
// there too, and match the protocol's wire format.
TEST_F(ServiceTest, ReflectionDescribesTheHealthService) {
  std::vector<google::protobuf::FileDescriptorProto> files;
  KVMESH_ASSERT_OK(ReflectedFilesOfSymbol(node().channel(), "grpc.health.v1.Health", &files));
  ASSERT_FALSE(files.empty());
  const google::protobuf::FileDescriptorProto& file = files.front();
  EXPECT_EQ(file.package(), "grpc.health.v1");
  ASSERT_EQ(file.service_size(), 1);
  EXPECT_EQ(file.service(0).name(), "Health");
  std::vector<std::string> methods;
  for (const auto& method : file.service(0).method()) methods.push_back(method.name());
  EXPECT_THAT(methods, ::testing::UnorderedElementsAre("Check", "Watch"));
  // Reflection builds a pool of what it sent, as a reflection client does.
  google::protobuf::DescriptorPool pool;
  for (auto it = files.rbegin(); it != files.rend(); ++it) ASSERT_NE(pool.BuildFile(*it), nullptr);
  const google::protobuf::Descriptor* response =
      pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse");
  ASSERT_NE(response, nullptr);
  const google::protobuf::FieldDescriptor* status = response->FindFieldByName("status");
  ASSERT_NE(status, nullptr);
  EXPECT_EQ(status->number(), 1);
  EXPECT_EQ(status->enum_type()->FindValueByName("SERVING")->number(), 1);
  EXPECT_EQ(status->enum_type()->FindValueByName("NOT_SERVING")->number(), 2);
  const google::protobuf::Descriptor* request =
      pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest");
  ASSERT_NE(request, nullptr);
  EXPECT_EQ(request->FindFieldByName("service")->number(), 1);
  // An unknown symbol is an error from reflection, not an empty answer.
  EXPECT_EQ(ReflectedFilesOfSymbol(node().channel(), "no.such.Service", &files).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, CreateIsIdempotentAndGetListDeleteAgree) {
  const v1::CacheSpec spec = BasicSpec("svc-create");
  v1::CreateCacheResponse created;
  KVMESH_ASSERT_OK(CreateCache(stub(), spec, &created));
  EXPECT_TRUE(created.created());

  // The server echoes the spec with the unset window made explicit (FULL).
  const v1::CacheSpec& echoed = created.cache().spec();
  EXPECT_EQ(echoed.name(), "svc-create");
  EXPECT_EQ(echoed.dtype(), v1::DTYPE_F32);
  EXPECT_EQ(echoed.max_sequences(), 4);
  EXPECT_EQ(echoed.capacity(), 64);
  EXPECT_EQ(echoed.max_batch(), 32);
  ASSERT_EQ(echoed.groups_size(), 1);
  EXPECT_TRUE(echoed.groups(0).attention().window().has_full());
  v1::CacheSpec expected_spec = spec;
  expected_spec.mutable_groups(0)->mutable_attention()->mutable_window()->mutable_full();
  KVMESH_EXPECT_PROTO_EQ(echoed, expected_spec);

  const v1::CacheUsage& usage = created.cache().usage();
  ASSERT_EQ(usage.groups_size(), 1);
  EXPECT_EQ(usage.groups(0).group(), 0);
  EXPECT_EQ(usage.groups(0).cells_total(), 4 * 64);
  EXPECT_EQ(usage.groups(0).cells_used(), 0);
  EXPECT_EQ(usage.groups(0).memory(), 0);  // unlimited
  EXPECT_EQ(usage.groups(0).bytes(), 4 * 64 * int64_t{kBasicTokenBytes});
  EXPECT_EQ(usage.sequences_live(), 0);
  EXPECT_EQ(usage.bytes_held(), 4 * 64 * int64_t{kBasicTokenBytes});

  v1::CreateCacheResponse again;
  KVMESH_ASSERT_OK(CreateCache(stub(), spec, &again));
  EXPECT_FALSE(again.created());
  KVMESH_EXPECT_PROTO_EQ(again.cache(), created.cache());

  v1::CacheSpec different = spec;
  different.set_capacity(128);
  const grpc::Status conflict = CreateCache(stub(), different);
  EXPECT_EQ(conflict.error_code(), grpc::StatusCode::ALREADY_EXISTS) << StatusText(conflict);
  EXPECT_THAT(conflict.error_message(), HasSubstr("svc-create"));

  v1::GetCacheResponse got;
  KVMESH_ASSERT_OK(GetCache(stub(), "svc-create", &got));
  KVMESH_EXPECT_PROTO_EQ(got.cache(), created.cache());

  KVMESH_ASSERT_OK(CreateCache(stub(), BasicSpec("svc-create-b")));
  v1::ListCachesResponse list;
  KVMESH_ASSERT_OK(ListCaches(stub(), &list));
  std::vector<std::string> names;
  for (const v1::CacheInfo& info : list.caches()) names.push_back(info.spec().name());
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_THAT(names, ::testing::IsSupersetOf({"svc-create", "svc-create-b"}));
  for (const v1::CacheInfo& info : list.caches()) {
    if (info.spec().name() == "svc-create") {
      KVMESH_EXPECT_PROTO_EQ(info, created.cache());
    }
  }

  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-create"));
  const grpc::Status gone = GetCache(stub(), "svc-create", &got);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(gone.error_message(), HasSubstr("svc-create"));
  EXPECT_EQ(DeleteCache(stub(), "svc-create").error_code(), grpc::StatusCode::NOT_FOUND);
  KVMESH_ASSERT_OK(ListCaches(stub(), &list));
  for (const v1::CacheInfo& info : list.caches()) EXPECT_NE(info.spec().name(), "svc-create");

  // The name is free again, even for the spec that conflicted before.
  KVMESH_ASSERT_OK(CreateCache(stub(), different, &again));
  EXPECT_TRUE(again.created());
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-create"));
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-create-b"));
}

// ---- paged listings (docs/api.md#paging) ---------------------------------------------------

grpc::Status ListSequencesPage(Stub& stub, const std::string& cache, int32_t page_size,
                               const std::string& token, v1::ListSequencesResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ListSequencesRequest request;
  request.set_cache(cache);
  request.set_page_size(page_size);
  request.set_page_token(token);
  return stub.ListSequences(&context, request, response);
}

std::vector<int64_t> SeqsOf(const v1::ListSequencesResponse& response) {
  std::vector<int64_t> out;
  for (const v1::SequenceInfo& s : response.sequences()) out.push_back(s.seq());
  return out;
}

TEST_F(ServiceTest, ListSequencesComesInPages) {
  const v1::CacheSpec spec = BasicSpec("svc-pages", 8, 4, 8);
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  KVMESH_ASSERT_OK(Append(stub(), MakeMultiAppend(spec, {9, 2, 7, 0, 5}, {0, 0, 0, 0, 0})));

  // A page size of 2 over 5 sequences: three pages, in order, the last without a token.
  std::vector<std::vector<int64_t>> pages;
  std::string token;
  do {
    v1::ListSequencesResponse page;
    KVMESH_ASSERT_OK(ListSequencesPage(stub(), "svc-pages", 2, token, &page));
    pages.push_back(SeqsOf(page));
    ASSERT_NE(page.next_page_token(), token);
    token = page.next_page_token();
    ASSERT_LE(pages.size(), 3u);
  } while (!token.empty());
  EXPECT_THAT(pages, ElementsAre(ElementsAre(0, 2), ElementsAre(5, 7), ElementsAre(9)));

  // A page that ends exactly at the last sequence has no next page.
  v1::ListSequencesResponse all;
  KVMESH_ASSERT_OK(ListSequencesPage(stub(), "svc-pages", 5, "", &all));
  EXPECT_THAT(SeqsOf(all), ElementsAre(0, 2, 5, 7, 9));
  EXPECT_EQ(all.next_page_token(), "");
  // Above the maximum: taken as the maximum.
  KVMESH_ASSERT_OK(ListSequencesPage(stub(), "svc-pages", 1 << 30, "", &all));
  EXPECT_EQ(all.sequences_size(), 5);

  // A sequence removed between pages is not listed; the cursor goes on from where it was.
  v1::ListSequencesResponse first;
  KVMESH_ASSERT_OK(ListSequencesPage(stub(), "svc-pages", 2, "", &first));
  KVMESH_ASSERT_OK(Remove(stub(), "svc-pages", 5, 0, std::nullopt));
  v1::ListSequencesResponse second;
  KVMESH_ASSERT_OK(ListSequencesPage(stub(), "svc-pages", 2, first.next_page_token(), &second));
  EXPECT_THAT(SeqsOf(second), ElementsAre(7, 9));
  EXPECT_EQ(second.next_page_token(), "");

  // Bad page sizes and tokens are INVALID_ARGUMENT naming them; a token of another listing too.
  v1::ListSequencesResponse bad;
  grpc::Status status = ListSequencesPage(stub(), "svc-pages", -1, "", &bad);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("page_size = -1"));
  for (const std::string& token : {std::string("not a token!"), std::string("c2VxOi0x"),
                                   std::string("c2VxOjEyeA"), std::string(4000, 'A')}) {
    status = ListSequencesPage(stub(), "svc-pages", 2, token, &bad);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("page_token"));
    EXPECT_LT(status.error_message().size(), 400u);
  }
  KVMESH_ASSERT_OK(Snapshot(stub(), "svc-pages", 0, 0));
  KVMESH_ASSERT_OK(Snapshot(stub(), "svc-pages", 2, 0));
  v1::ListSnapshotsResponse snapshots;
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::ListSnapshotsRequest request;
    request.set_cache("svc-pages");
    request.set_page_size(1);
    KVMESH_ASSERT_OK(stub().ListSnapshots(&context, request, &snapshots));
  }
  ASSERT_EQ(snapshots.snapshots_size(), 1);
  ASSERT_NE(snapshots.next_page_token(), "");
  status = ListSequencesPage(stub(), "svc-pages", 2, snapshots.next_page_token(), &bad);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("not a page token of this listing"));
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::ListSnapshotsRequest request;
    request.set_cache("svc-pages");
    request.set_page_size(1);
    request.set_page_token(snapshots.next_page_token());
    v1::ListSnapshotsResponse rest;
    KVMESH_ASSERT_OK(stub().ListSnapshots(&context, request, &rest));
    ASSERT_EQ(rest.snapshots_size(), 1);
    EXPECT_GT(rest.snapshots(0).id(), snapshots.snapshots(0).id());
    EXPECT_EQ(rest.next_page_token(), "");
  }
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-pages"));
}

// Without page_size a page holds 1,024 sequences; at most 4,096 are listed per call.
TEST_F(ServiceTest, ListSequencesDefaultAndLargestPage) {
  const int32_t n = 4100;
  const v1::CacheSpec spec = BasicSpec("svc-page-sizes", n, 1, n);
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  std::vector<int64_t> seqs(n);
  std::iota(seqs.begin(), seqs.end(), 0);
  KVMESH_ASSERT_OK(Append(stub(), MakeMultiAppend(spec, seqs, std::vector<int32_t>(n, 0))));
  v1::ListSequencesResponse page;
  KVMESH_ASSERT_OK(ListSequencesPage(stub(), "svc-page-sizes", 0, "", &page));
  EXPECT_EQ(page.sequences_size(), 1024);
  EXPECT_NE(page.next_page_token(), "");
  KVMESH_ASSERT_OK(ListSequencesPage(stub(), "svc-page-sizes", 100000, "", &page));
  EXPECT_EQ(page.sequences_size(), 4096);
  ASSERT_NE(page.next_page_token(), "");
  KVMESH_ASSERT_OK(ListSequencesPage(stub(), "svc-page-sizes", 100000, page.next_page_token(), &page));
  EXPECT_THAT(SeqsOf(page), ElementsAre(4096, 4097, 4098, 4099));
  EXPECT_EQ(page.next_page_token(), "");
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-page-sizes"));
}

TEST_F(ServiceTest, ListCachesComesInPages) {
  for (const char* name : {"svc-page-c", "svc-page-a", "svc-page-b"}) {
    KVMESH_ASSERT_OK(CreateCache(stub(), BasicSpec(name)));
  }
  std::vector<std::string> names;
  std::string token;
  int calls = 0;
  do {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::ListCachesRequest request;
    request.set_page_size(1);
    request.set_page_token(token);
    v1::ListCachesResponse page;
    KVMESH_ASSERT_OK(stub().ListCaches(&context, request, &page));
    ASSERT_LE(page.caches_size(), 1);
    for (const v1::CacheInfo& info : page.caches()) names.push_back(info.spec().name());
    token = page.next_page_token();
    ASSERT_LT(++calls, 1000);
  } while (!token.empty());
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_THAT(names, ::testing::IsSupersetOf({"svc-page-a", "svc-page-b", "svc-page-c"}));
  EXPECT_EQ(calls, static_cast<int>(names.size()));
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::ListCachesRequest request;
    request.set_page_token("Y2FjaGU6");  // "cache:" and no key
    v1::ListCachesResponse page;
    const grpc::Status status = stub().ListCaches(&context, request, &page);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("page_token 'Y2FjaGU6'"));
  }
  for (const char* name : {"svc-page-c", "svc-page-a", "svc-page-b"}) {
    KVMESH_ASSERT_OK(DeleteCache(stub(), name));
  }
}

// A cache's bookkeeping counts against the node's metadata budget (512 MiB by default): a
// second cache of 2^20 sequences is refused at creation, naming the numbers.
TEST_F(ServiceTest, CachesBeyondTheMetadataBudgetAreRefused) {
  AttentionOptions a;
  a.num_layers = 1;
  a.num_kv_heads = 1;
  a.head_dim_k = 1;
  a.head_dim_v = 1;
  a.rope = v1::ROPE_TYPE_NONE;
  const v1::CacheSpec first = SpecProto("svc-meta-1", 1 << 20, 1, 16, {AttentionGroupProto(a)});
  KVMESH_ASSERT_OK(CreateCache(stub(), first));
  v1::CacheSpec second = first;
  second.set_name("svc-meta-2");
  const grpc::Status refused = CreateCache(stub(), second);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(refused);
  EXPECT_THAT(refused.error_message(),
              AllOf(HasSubstr("max_sequences = 1048576"), HasSubstr("metadata budget of 536870912")));
  EXPECT_THAT(ShortageText(refused), HasSubstr("METADATA_BUDGET_EXHAUSTED"));
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-meta-1"));
  KVMESH_ASSERT_OK(CreateCache(stub(), second));
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-meta-2"));
}

TEST_F(ServiceTest, AppendThenReadBackByteExact) {
  const v1::CacheSpec spec = BasicSpec("svc-append");
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));

  v1::AppendResponse appended;
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 3, Range(0, 10)), &appended));
  EXPECT_EQ(appended.usage().groups(0).cells_used(), 10);
  EXPECT_EQ(appended.usage().sequences_live(), 1);
  // One batch over two new sequences.
  KVMESH_ASSERT_OK(Append(stub(), MakeMultiAppend(spec, {5, 5, 6}, {0, 1, 0}), &appended));
  EXPECT_EQ(appended.usage().groups(0).cells_used(), 13);
  EXPECT_EQ(appended.usage().sequences_live(), 3);

  SequenceModel seq3, seq5, seq6;
  ModelAppend(spec, 3, Range(0, 10), 0, &seq3);
  ModelAppend(spec, 5, {0, 1}, 0, &seq5);
  ModelAppend(spec, 6, {0}, 0, &seq6);
  ExpectReadMatches(spec, 3, seq3);
  ExpectReadMatches(spec, 5, seq5);
  ExpectReadMatches(spec, 6, seq6);

  ReadOutput out;
  KVMESH_ASSERT_OK(Read(stub(), ReadRequest("svc-append", 3, 2, 5), &out));
  EXPECT_THAT(HeaderPositions(out.header), ElementsAre(ElementsAre(2, 3, 4)));
  EXPECT_EQ(out.payload, ExpectedReadPayload(spec, seq3, {{2, 3, 4}}));
  EXPECT_EQ(out.messages, 1);

  KVMESH_ASSERT_OK(Read(stub(), ReadRequest("svc-append", 3, 8), &out));
  EXPECT_THAT(HeaderPositions(out.header), ElementsAre(ElementsAre(8, 9)));
  EXPECT_EQ(out.payload, ExpectedReadPayload(spec, seq3, {{8, 9}}));

  // A range past the stored positions of a live sequence: an empty answer, not an error.
  KVMESH_ASSERT_OK(Read(stub(), ReadRequest("svc-append", 3, 20, 30), &out));
  EXPECT_THAT(HeaderPositions(out.header), ElementsAre(IsEmpty()));
  EXPECT_EQ(out.header.payload_bytes(), 0);
  EXPECT_THAT(out.payload, IsEmpty());

  const v1::ListSequencesResponse seqs = Sequences("svc-append");
  ASSERT_EQ(seqs.sequences_size(), 3);
  EXPECT_EQ(seqs.sequences(0).seq(), 3);
  EXPECT_EQ(seqs.sequences(0).offset(), 10);
  EXPECT_EQ(seqs.sequences(0).groups(0).stored(), 10);
  EXPECT_EQ(seqs.sequences(0).groups(0).shared(), 0);
  EXPECT_EQ(seqs.sequences(0).groups(0).first(), 0);
  EXPECT_EQ(seqs.sequences(0).groups(0).last(), 9);
  EXPECT_EQ(seqs.sequences(1).seq(), 5);
  EXPECT_EQ(seqs.sequences(1).offset(), 2);
  EXPECT_EQ(seqs.sequences(2).seq(), 6);
  EXPECT_EQ(seqs.sequences(2).offset(), 1);
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-append"));
}

// The tokens of `request` as token ranges: runs of consecutive positions of one sequence, the
// first `keep` tokens left as they are.
v1::AppendRequest AsRanges(v1::AppendRequest request, int keep) {
  const std::vector<v1::Token> tokens(request.tokens().begin(), request.tokens().end());
  request.clear_tokens();
  for (int i = 0; i < static_cast<int>(tokens.size()); ++i) {
    if (i < keep) {
      *request.add_tokens() = tokens[i];
      continue;
    }
    const int n = request.token_ranges_size();
    v1::TokenRange* last = n > 0 ? request.mutable_token_ranges(n - 1) : nullptr;
    if (last != nullptr && i > keep && last->seq() == tokens[i].seq() &&
        last->first() + last->count() == tokens[i].pos()) {
      last->set_count(last->count() + 1);
    } else {
      v1::TokenRange* r = request.add_token_ranges();
      r->set_seq(tokens[i].seq());
      r->set_first(tokens[i].pos());
      r->set_count(1);
    }
  }
  return request;
}

// A batch named by token ranges (after a few plain tokens) stores exactly what the same batch
// named token by token stores, unary and streamed.
TEST_F(ServiceTest, TokenRangesNameTheSameBatchAsTokens) {
  const v1::CacheSpec spec = BasicSpec("svc-ranges");
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  // seq 3: 0..9 with 0..1 as tokens and 2..9 as one range; seqs 5 and 6 interleaved in one batch
  // (5: 0, 1 as a range; 6: 0; then 5: 2..4 as a second range of seq 5).
  const v1::AppendRequest first = AsRanges(MakeAppend(spec, 3, Range(0, 10)), 2);
  ASSERT_EQ(first.tokens_size(), 2);
  ASSERT_EQ(first.token_ranges_size(), 1);
  EXPECT_EQ(first.token_ranges(0).count(), 8);
  KVMESH_ASSERT_OK(Append(stub(), first));
  const v1::AppendRequest mixed =
      AsRanges(MakeMultiAppend(spec, {5, 5, 6, 5, 5, 5}, {0, 1, 0, 2, 3, 4}), 0);
  ASSERT_EQ(mixed.token_ranges_size(), 3);
  KVMESH_ASSERT_OK(Append(stub(), mixed));
  // Streamed: seq 3 continues with 10..19 as one range in the header.
  const v1::AppendRequest streamed = AsRanges(MakeAppend(spec, 3, Range(10, 20)), 0);
  ASSERT_EQ(streamed.token_ranges_size(), 1);
  KVMESH_ASSERT_OK(AppendStream(stub(), StreamMessages(streamed, 100, 333)));

  SequenceModel seq3, seq5, seq6;
  ModelAppend(spec, 3, Range(0, 10), 0, &seq3);
  ModelAppend(spec, 3, Range(10, 20), 0, &seq3);
  ModelAppend(spec, 5, {0, 1, 2, 3, 4}, 0, &seq5);
  ModelAppend(spec, 6, {0}, 0, &seq6);
  ExpectReadMatches(spec, 3, seq3);
  ExpectReadMatches(spec, 5, seq5);
  ExpectReadMatches(spec, 6, seq6);
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-ranges"));
}

// Token ids travel on Tokens, on TokenRanges of unary Appends and of a stream's header, and the
// sequence's chain shows in ListSequences (docs/api.md#tokens).
TEST_F(ServiceTest, TokenIdsOnTokensAndRanges) {
  v1::CacheSpec spec = BasicSpec("svc-ids");
  spec.set_token_block_size(4);
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  v1::AppendRequest first = AsRanges(MakeAppend(spec, 3, Range(0, 10)), 2);
  first.mutable_tokens(0)->set_token_id(50);
  first.mutable_tokens(1)->set_token_id(51);
  for (int32_t p = 2; p < 10; ++p) first.mutable_token_ranges(0)->add_token_ids(50 + p);
  KVMESH_ASSERT_OK(Append(stub(), first));
  v1::AppendRequest streamed = AsRanges(MakeAppend(spec, 3, Range(10, 13)), 0);
  for (int32_t p = 10; p < 13; ++p) streamed.mutable_token_ranges(0)->add_token_ids(50 + p);
  KVMESH_ASSERT_OK(AppendStream(stub(), StreamMessages(streamed, 10, 64)));
  // seq 4 without ids: no chain.
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 4, Range(0, 5))));
  v1::ListSequencesResponse listed;
  KVMESH_ASSERT_OK(ListSequences(stub(), "svc-ids", &listed));
  ASSERT_EQ(listed.sequences_size(), 2);
  EXPECT_EQ(listed.sequences(0).tokens(), 13);
  EXPECT_EQ(listed.sequences(0).exact_tokens(), 13);
  EXPECT_EQ(listed.sequences(0).token_blocks(), 3);
  EXPECT_EQ(listed.sequences(1).tokens(), 0);
  // A shift ends the exact prefix where it removed.
  KVMESH_ASSERT_OK(Remove(stub(), "svc-ids", 3, 5, 7));
  KVMESH_ASSERT_OK(ListSequences(stub(), "svc-ids", &listed));
  EXPECT_EQ(listed.sequences(0).tokens(), 11);
  EXPECT_EQ(listed.sequences(0).exact_tokens(), 5);
  EXPECT_EQ(listed.sequences(0).token_blocks(), 1);
  // LookupPrefix finds seq 3's exact prefix (5 tokens) for a prompt that goes on.
  v1::LookupPrefixResponse found;
  KVMESH_ASSERT_OK(
      LookupPrefix(stub(), "svc-ids", {50, 51, 52, 53, 54, 55, 99, 99, 99}, &found, 4));
  ASSERT_EQ(found.matches_size(), 1);
  EXPECT_EQ(found.matches(0).seq(), 3);
  EXPECT_EQ(found.matches(0).length(), 5);
  EXPECT_EQ(found.matches(0).offset(), 11);
  EXPECT_TRUE(found.matches(0).can_resume());
  KVMESH_ASSERT_OK(LookupPrefix(stub(), "svc-ids", {1, 2, 3, 4, 5}, &found));
  EXPECT_EQ(found.matches_size(), 0);
  // The block size is part of the spec the node reports.
  v1::GetCacheResponse got;
  KVMESH_ASSERT_OK(GetCache(stub(), "svc-ids", &got));
  EXPECT_EQ(got.cache().spec().token_block_size(), 4);
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-ids"));
}

TEST_F(ServiceTest, AppendStreamWithManyChunksAndChunkedReads) {
  // F16, 2 layers x 4 heads x (64 + 64): 2048 bytes per token, 32 tokens = 64 KiB.
  AttentionOptions a;
  a.num_layers = 2;
  a.num_kv_heads = 4;
  a.head_dim_k = 64;
  a.head_dim_v = 64;
  a.rope_dims = 64;
  const v1::CacheSpec spec =
      SpecProto("svc-stream", 2, 128, 32, {AttentionGroupProto(a)}, v1::DTYPE_F16);
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));

  const v1::AppendRequest first = MakeAppend(spec, 0, Range(0, 32));
  ASSERT_EQ(first.payload().size(), 32u * 2048);
  // Header without data, then 1000-byte chunks (not aligned to rows).
  std::vector<v1::AppendStreamRequest> messages = StreamMessages(first, 0, 1000);
  ASSERT_EQ(messages.size(), 1u + (65536 + 999) / 1000);
  v1::AppendResponse response;
  KVMESH_ASSERT_OK(AppendStream(stub(), messages, &response));
  EXPECT_EQ(response.usage().groups(0).cells_used(), 32);
  // Header with the first 5000 bytes, then 7 KiB chunks.
  const v1::AppendRequest second = MakeAppend(spec, 0, Range(32, 64));
  KVMESH_ASSERT_OK(AppendStream(stub(), StreamMessages(second, 5000, 7 << 10), &response));
  EXPECT_EQ(response.usage().groups(0).cells_used(), 64);

  SequenceModel model;
  ModelAppend(spec, 0, Range(0, 64), 0, &model);
  ExpectReadMatches(spec, 0, model);

  // 128 KiB in 777-byte chunks: every message but the last is full; only the first has a
  // header.
  ReadOutput out;
  KVMESH_ASSERT_OK(Read(stub(), ReadRequest("svc-stream", 0, 0, std::nullopt, 777), &out));
  const size_t total = 64 * 2048;
  EXPECT_EQ(out.header.payload_bytes(), static_cast<int64_t>(total));
  EXPECT_EQ(out.messages, static_cast<int>((total + 776) / 777));
  EXPECT_TRUE(out.header_only_in_first);
  for (size_t i = 0; i + 1 < out.chunk_sizes.size(); ++i) ASSERT_EQ(out.chunk_sizes[i], 777u);
  EXPECT_EQ(out.chunk_sizes.back(), total - 777 * (out.chunk_sizes.size() - 1));
  EXPECT_TRUE(out.payload == ExpectedReadPayload(spec, model, {Range(0, 64)}));
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-stream"));
}

// The clients without copies (service/common/bulk_client.h) against a real node: what they
// send and receive equals what the generated stub does, in messages of any size, and their
// errors name what went wrong.
TEST_F(ServiceTest, BulkClientStreamsAsTheGeneratedStubDoes) {
  AttentionOptions a;
  a.num_layers = 2;
  a.num_kv_heads = 4;
  a.head_dim_k = 64;
  a.head_dim_v = 64;
  a.rope_dims = 64;
  const v1::CacheSpec spec =
      SpecProto("svc-bulk", 2, 128, 64, {AttentionGroupProto(a)}, v1::DTYPE_F16);
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  const v1::AppendRequest append = MakeAppend(spec, 0, Range(0, 40));
  auto header_of = [](const v1::AppendRequest& r) {
    v1::AppendHeader header;
    header.set_cache(r.cache());
    *header.mutable_tokens() = r.tokens();
    header.set_payload_bytes(static_cast<int64_t>(r.payload().size()));
    return header;
  };
  // 40 tokens of 2 KiB in 1000-byte messages (rows cut across messages).
  auto payload = std::make_shared<const std::string>(append.payload());
  v1::AppendResponse response;
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    KVMESH_ASSERT_OK(ToGrpcStatus(SendAppendStream(node().channel().get(), &context,
                                                   header_of(append), payload, 1000, &response)));
  }
  EXPECT_EQ(response.usage().groups(0).cells_used(), 40);
  SequenceModel model;
  ModelAppend(spec, 0, Range(0, 40), 0, &model);
  ExpectReadMatches(spec, 0, model);

  // The same Read both ways, in 777-byte messages.
  const v1::ReadRequest request = ReadRequest("svc-bulk", 0, 0, std::nullopt, 777);
  ReadOutput typed;
  KVMESH_ASSERT_OK(Read(stub(), request, &typed));
  v1::ReadHeader header;
  std::string bytes;
  int pieces = 0;
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    KVMESH_ASSERT_OK(ToGrpcStatus(ReceiveReadStream(
        node().channel().get(), &context, request, &header, [&](absl::Span<const uint8_t> piece) {
          bytes.append(reinterpret_cast<const char*>(piece.data()), piece.size());
          ++pieces;
        })));
  }
  EXPECT_EQ(header.SerializeAsString(), typed.header.SerializeAsString());
  EXPECT_TRUE(bytes == typed.payload);
  EXPECT_GE(pieces, typed.messages - 1);

  // Errors: the node's, as absl statuses; nothing changed.
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    const absl::Status missing =
        ReceiveReadStream(node().channel().get(), &context, ReadRequest("svc-bulk", 1), &header,
                          [](absl::Span<const uint8_t>) {});
    EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  }
  v1::AppendHeader wrong = header_of(MakeAppend(spec, 1, Range(0, 8)));
  wrong.set_payload_bytes(wrong.payload_bytes() + 1);
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    const absl::Status refused = SendAppendStream(
        node().channel().get(), &context, wrong,
        std::make_shared<const std::string>(wrong.payload_bytes(), '\0'), 4096, &response);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("header.payload_bytes"));
  }
  {
    grpc::ClientContext context;
    const absl::Status zero = SendAppendStream(node().channel().get(), &context, header_of(append),
                                               payload, 0, &response);
    EXPECT_EQ(zero.code(), absl::StatusCode::kInvalidArgument) << zero;
  }
  ExpectReadMatches(spec, 0, model);
  v1::GetCacheResponse cache;
  KVMESH_ASSERT_OK(GetCache(stub(), spec.name(), &cache));
  EXPECT_EQ(cache.cache().usage().groups(0).cells_used(), 40);
  KVMESH_ASSERT_OK(DeleteCache(stub(), spec.name()));
}

// AppendStream is served raw (the node reads each message's fields where they were received):
// it must take every encoding protobuf takes, with protobuf's meaning (a repeated header merges,
// a repeated data replaces, unknown fields of every wire type are skipped), refuse bytes that do
// not parse, naming the message, and leave the cache as it was then.
TEST_F(ServiceTest, RawAppendStreamMessages) {
  const std::string method = "/kvmesh.v1.CacheService/AppendStream";
  std::vector<std::string> responses;
  grpc::Status status =
      CallRaw(node().channel(), method, std::vector<std::string>{"\xff\xff\xff"}, &responses);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(),
              HasSubstr("AppendStream message 0 of 3 bytes does not parse"));

  // 2 layers x 2 heads x (4 + 4) x F16: 64 bytes per token, rows of 16 bytes.
  AttentionOptions a;
  a.num_layers = 2;
  a.num_kv_heads = 2;
  a.head_dim_k = 4;
  a.head_dim_v = 4;
  a.rope_dims = 4;
  const v1::CacheSpec spec =
      SpecProto("svc-raw-stream", 4, 64, 32, {AttentionGroupProto(a)}, v1::DTYPE_F16);
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  const v1::AppendRequest append = MakeAppend(spec, 0, Range(0, 20));
  const std::string& payload = append.payload();
  ASSERT_EQ(payload.size(), 20u * 64);
  auto with_header = [](const v1::AppendHeader& header) {
    v1::AppendStreamRequest m;
    *m.mutable_header() = header;
    return m.SerializeAsString();
  };
  auto with_data = [](const std::string& data) {
    v1::AppendStreamRequest m;
    m.set_data(data);
    return m.SerializeAsString();
  };
  v1::AppendHeader names;  // the header in two pieces, which merge
  names.set_cache(spec.name());
  *names.mutable_tokens() = append.tokens();
  v1::AppendHeader size;
  size.set_payload_bytes(static_cast<int64_t>(payload.size()));
  const std::string unknown_varint("\x48\x05", 2);               // field 9, varint
  const std::string unknown_bytes("\x7a\x03xyz", 5);             // field 15, 3 bytes
  const std::string unknown_fixed32("\x25\x01\x02\x03\x04", 5);  // field 4, fixed32
  const std::string unknown_fixed64("\x29\x01\x02\x03\x04\x05\x06\x07\x08", 9);  // field 5
  std::vector<std::string> messages = {
      with_header(names) + unknown_varint + with_data("replaced") + with_header(size) +
          with_data(payload.substr(0, 100)),
      unknown_bytes + with_data(payload.substr(100, 1000)) + unknown_fixed32,
      with_data(""),    // an empty piece
      unknown_fixed64,  // no data at all
      with_data(payload.substr(1100)),
  };
  status = CallRaw(node().channel(), method, messages, &responses);
  KVMESH_ASSERT_OK(status);
  ExpectAppendResponse(responses, 20);
  SequenceModel model;
  ModelAppend(spec, 0, Range(0, 20), 0, &model);
  ExpectReadMatches(spec, 0, model);

  // A later message that does not parse ends the stream; its cells are given back.
  const v1::AppendRequest next = MakeAppend(spec, 1, Range(0, 8));
  v1::AppendHeader header;
  header.set_cache(spec.name());
  *header.mutable_tokens() = next.tokens();
  header.set_payload_bytes(static_cast<int64_t>(next.payload().size()));
  for (const std::string& bad : {std::string("\x12\x40"
                                             "abc",
                                             5),                 // data runs past the end
                                 std::string("\x0b", 1),         // a group's wire type
                                 std::string("\x02\x00", 2)}) {  // field 0
    messages = {with_header(header) + with_data(next.payload().substr(0, 64)), bad};
    status = CallRaw(node().channel(), method, messages, &responses);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
    EXPECT_THAT(
        status.error_message(),
        HasSubstr(absl::StrCat("AppendStream message 1 of ", bad.size(), " bytes does not parse")));
    v1::GetCacheResponse cache;
    KVMESH_ASSERT_OK(GetCache(stub(), spec.name(), &cache));
    EXPECT_EQ(cache.cache().usage().groups(0).cells_used(), 20);
  }
  // A header in a later message is refused as before.
  messages = {with_header(header), with_header(header) + with_data(next.payload())};
  status = CallRaw(node().channel(), method, messages, &responses);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("message 1 carries a header"));
  ExpectReadMatches(spec, 0, model);
  KVMESH_ASSERT_OK(DeleteCache(stub(), spec.name()));
}

// A unary Append is served raw (its payload goes from gRPC's buffers into the cells): a request
// that does not parse is refused naming its size; fields in any order, unknown fields and a
// repeated payload are taken as protobuf takes them; and payloads of several MiB, which gRPC
// receives in many pieces, are stored byte-exact whether the node copies the pieces into the
// cells where they lie (Attention groups in host memory) or gathers them first (a cache with a
// ring, or any cache on a GPU).
TEST_F(ServiceTest, RawAppendRequests) {
  const std::string method = "/kvmesh.v1.CacheService/Append";
  std::vector<std::string> responses;
  grpc::Status status =
      CallRaw(node().channel(), method, std::string("\xff\xff\xff", 3), &responses);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("the AppendRequest of 3 bytes does not parse"));

  AttentionOptions a;
  a.rope_dims = 4;
  const v1::CacheSpec spec =
      SpecProto("svc-raw-append", 4, 64, 32, {AttentionGroupProto(a)}, v1::DTYPE_F16);
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  const v1::AppendRequest append = MakeAppend(spec, 0, Range(0, 20));
  v1::AppendRequest replaced;  // a payload that a later one replaces
  replaced.set_payload("replaced");
  v1::AppendRequest names;
  names.set_cache(spec.name());
  *names.mutable_tokens() = append.tokens();
  v1::AppendRequest payload;
  payload.set_payload(append.payload());
  const std::string unknown_varint("\x48\x05", 2);               // field 9, varint
  const std::string unknown_fixed32("\x25\x01\x02\x03\x04", 5);  // field 4, fixed32
  status = CallRaw(node().channel(), method,
                   replaced.SerializeAsString() + unknown_varint + payload.SerializeAsString() +
                       names.SerializeAsString() + unknown_fixed32,
                   &responses);
  KVMESH_ASSERT_OK(status);
  ExpectAppendResponse(responses, 20);
  SequenceModel model;
  ModelAppend(spec, 0, Range(0, 20), 0, &model);
  ExpectReadMatches(spec, 0, model);
  KVMESH_ASSERT_OK(DeleteCache(stub(), spec.name()));

  // 16 KiB per token of Attention: 400 tokens are 6.25 MiB (plus the ring's rows).
  AttentionOptions big;
  big.num_layers = 4;
  big.num_kv_heads = 8;
  big.head_dim_k = 128;
  big.head_dim_v = 128;
  big.rope_dims = 128;
  RotatingOptions ring;
  ring.max_size = 512;
  for (const bool with_ring : {false, true}) {
    SCOPED_TRACE(with_ring ? "with a ring (gathered)" : "Attention only");
    std::vector<v1::LayerGroup> groups = {AttentionGroupProto(big)};
    if (with_ring) groups.push_back(RotatingGroupProto(ring));
    const v1::CacheSpec large =
        SpecProto("svc-raw-append-large", 2, 512, 512, groups, v1::DTYPE_F16);
    KVMESH_ASSERT_OK(CreateCache(stub(), large));
    SequenceModel stored;
    for (const auto& [first, end] : {std::pair<int32_t, int32_t>{0, 400}, {400, 401}}) {
      const v1::AppendRequest request = MakeAppend(large, 0, Range(first, end));
      v1::AppendResponse response;
      KVMESH_ASSERT_OK(Append(stub(), request, &response));
      EXPECT_EQ(response.usage().groups(0).cells_used(), end);
      ModelAppend(large, 0, Range(first, end), 0, &stored);
    }
    ExpectReadMatches(large, 0, stored);
    KVMESH_ASSERT_OK(DeleteCache(stub(), large.name()));
  }
}

// Read is served raw (the node writes ReadResponse's bytes itself): a request that does not
// parse is refused with a message, and the bytes of a good one parse as ReadResponses whose
// data, in order, is the payload a typed client reads.
TEST_F(ServiceTest, RawReadRequestsAndResponses) {
  std::vector<std::string> responses;
  grpc::Status status = CallRaw(node().channel(), "/kvmesh.v1.CacheService/Read",
                                std::string("\xff\xff\xff", 3), &responses);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("the request of 3 bytes does not parse as kvmesh.v1.ReadRequest"));
  EXPECT_THAT(responses, IsEmpty());

  const v1::CacheSpec spec =
      SpecProto("svc-raw-read", 2, 64, 64, {AttentionGroupProto(AttentionOptions())});
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, Range(0, 40))));
  ReadOutput typed;
  v1::ReadRequest request = ReadRequest(spec.name(), 0);
  request.set_max_chunk_bytes(1000);  // several messages, each of several cells' views
  KVMESH_ASSERT_OK(Read(stub(), request, &typed));
  status = CallRaw(node().channel(), "/kvmesh.v1.CacheService/Read", request.SerializeAsString(),
                   &responses);
  KVMESH_ASSERT_OK(status);
  ASSERT_GT(responses.size(), 2u);
  std::string payload;
  for (size_t i = 0; i < responses.size(); ++i) {
    v1::ReadResponse response;
    ASSERT_TRUE(response.ParseFromString(responses[i])) << "message " << i;
    EXPECT_EQ(response.has_header(), i == 0) << "message " << i;
    EXPECT_LE(response.data().size(), 1000u);
    payload += response.data();
  }
  EXPECT_EQ(payload.size(), typed.payload.size());
  EXPECT_TRUE(payload == typed.payload);
  v1::ReadResponse first;
  ASSERT_TRUE(first.ParseFromString(responses[0]));
  EXPECT_EQ(first.header().payload_bytes(), static_cast<int64_t>(payload.size()));
  EXPECT_EQ(HeaderPositions(first.header()), HeaderPositions(typed.header));

  // A range that holds nothing: one message, the header alone.
  request = ReadRequest(spec.name(), 0, 100, 200);
  KVMESH_ASSERT_OK(CallRaw(node().channel(), "/kvmesh.v1.CacheService/Read",
                           request.SerializeAsString(), &responses));
  ASSERT_EQ(responses.size(), 1u);
  v1::ReadResponse empty;
  ASSERT_TRUE(empty.ParseFromString(responses[0]));
  EXPECT_TRUE(empty.has_header());
  EXPECT_EQ(empty.header().payload_bytes(), 0);
  EXPECT_TRUE(empty.data().empty());
  KVMESH_ASSERT_OK(DeleteCache(stub(), spec.name()));

  // A cache that does not lend cells (a Rotating group) copies the payload at once and sends
  // it in the same messages.
  RotatingOptions rotating;
  rotating.max_size = 64;
  const v1::CacheSpec ring = SpecProto("svc-raw-ring", 2, 64, 64, {RotatingGroupProto(rotating)});
  KVMESH_ASSERT_OK(CreateCache(stub(), ring));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(ring, 0, Range(0, 40))));
  KVMESH_ASSERT_OK(Read(stub(), ReadRequest(ring.name(), 0), &typed));  // one message
  request = ReadRequest(ring.name(), 0);
  request.set_max_chunk_bytes(100);
  KVMESH_ASSERT_OK(CallRaw(node().channel(), "/kvmesh.v1.CacheService/Read",
                           request.SerializeAsString(), &responses));
  ASSERT_GT(responses.size(), 2u);
  payload.clear();
  for (const std::string& bytes : responses) {
    v1::ReadResponse response;
    ASSERT_TRUE(response.ParseFromString(bytes));
    EXPECT_LE(response.data().size(), 100u);
    payload += response.data();
  }
  EXPECT_TRUE(payload == typed.payload);
  KVMESH_ASSERT_OK(DeleteCache(stub(), ring.name()));
}

TEST_F(ServiceTest, SlidingGroupReadHeaderVisibleAndCanResume) {
  AttentionOptions full;
  full.num_layers = 1;
  AttentionOptions sliding = full;
  sliding.sliding_window = 2;  // memory 0 = window, raised to window + 1 = 3 (2 sequences)
  const v1::CacheSpec spec =
      SpecProto("svc-sliding", 2, 32, 8, {AttentionGroupProto(full), AttentionGroupProto(sliding)});
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, Range(0, 6))));
  // Before this batch the sliding group drops positions < 6 - 3.
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, {6})));

  SequenceModel model;
  ModelAppend(spec, 0, Range(0, 7), 0, &model);
  for (int32_t pos = 0; pos < 3; ++pos) model[1].erase(pos);
  ExpectReadMatches(spec, 0, model);

  const v1::CacheUsage usage = Usage("svc-sliding");
  ASSERT_EQ(usage.groups_size(), 2);
  EXPECT_EQ(usage.groups(0).memory(), 0);
  EXPECT_EQ(usage.groups(0).cells_total(), 2 * 32);
  EXPECT_EQ(usage.groups(0).cells_used(), 7);
  EXPECT_EQ(usage.groups(1).memory(), 3);
  EXPECT_EQ(usage.groups(1).cells_total(), 2 * 3 + 8);
  EXPECT_EQ(usage.groups(1).cells_used(), 4);

  const v1::ListSequencesResponse seqs = Sequences("svc-sliding");
  ASSERT_EQ(seqs.sequences_size(), 1);
  EXPECT_EQ(seqs.sequences(0).offset(), 7);
  EXPECT_EQ(seqs.sequences(0).groups(1).group(), 1);
  EXPECT_EQ(seqs.sequences(0).groups(1).stored(), 4);
  EXPECT_EQ(seqs.sequences(0).groups(1).first(), 3);
  EXPECT_EQ(seqs.sequences(0).groups(1).last(), 6);

  // CanResume: max(0, pos - window) >= first (3) and pos <= last + 1 (7).
  for (const auto& [pos, expected] :
       std::vector<std::pair<int32_t, bool>>{{7, true}, {5, true}, {4, false}, {8, false}}) {
    bool can_resume = !expected;
    KVMESH_ASSERT_OK(CanResume(stub(), "svc-sliding", 0, pos, &can_resume));
    EXPECT_EQ(can_resume, expected) << "pos " << pos;
  }

  v1::VisibleRequest request;
  request.set_cache("svc-sliding");
  request.set_group(1);
  auto add_query = [&](int64_t seq, int32_t pos, bool non_causal) {
    v1::Query* q = request.add_queries();
    q->set_seq(seq);
    q->set_pos(pos);
    q->set_non_causal(non_causal);
  };
  add_query(0, 6, false);
  add_query(0, 5, false);
  add_query(0, 5, true);
  add_query(9, 5, false);  // a sequence that stores nothing sees nothing
  v1::VisibleResponse visible;
  KVMESH_ASSERT_OK(Visible(stub(), request, &visible));
  ASSERT_EQ(visible.visible_size(), 4);
  EXPECT_THAT(visible.visible(0).positions(), ElementsAre(4, 5, 6));
  EXPECT_THAT(visible.visible(1).positions(), ElementsAre(3, 4, 5));
  EXPECT_THAT(visible.visible(2).positions(), ElementsAre(3, 4, 5, 6));
  EXPECT_THAT(visible.visible(3).positions(), IsEmpty());

  request.set_group(0);
  KVMESH_ASSERT_OK(Visible(stub(), request, &visible));
  ASSERT_EQ(visible.visible_size(), 4);
  EXPECT_THAT(visible.visible(0).positions(), ElementsAreArray(Range(0, 7)));
  EXPECT_THAT(visible.visible(1).positions(), ElementsAreArray(Range(0, 6)));
  EXPECT_THAT(visible.visible(2).positions(), ElementsAreArray(Range(0, 7)));
  EXPECT_THAT(visible.visible(3).positions(), IsEmpty());

  // The same answers as ranges.
  request.set_as_ranges(true);
  for (int32_t group : {0, 1}) {
    request.set_group(group);
    KVMESH_ASSERT_OK(Visible(stub(), request, &visible));
    ASSERT_EQ(visible.visible_size(), 4);
    std::vector<std::vector<std::pair<int32_t, int32_t>>> got;
    for (const v1::Visibility& v : visible.visible()) {
      EXPECT_THAT(v.positions(), IsEmpty());
      std::vector<std::pair<int32_t, int32_t>>& ranges = got.emplace_back();
      for (const v1::PositionRange& r : v.ranges()) ranges.emplace_back(r.first(), r.last());
    }
    using Ranges = std::vector<std::pair<int32_t, int32_t>>;
    if (group == 0) {
      EXPECT_THAT(got, ElementsAre(Ranges{{0, 6}}, Ranges{{0, 5}}, Ranges{{0, 6}}, IsEmpty()));
    } else {
      EXPECT_THAT(got, ElementsAre(Ranges{{4, 6}}, Ranges{{3, 5}}, Ranges{{3, 6}}, IsEmpty()));
    }
  }
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-sliding"));
}

TEST_F(ServiceTest, ChunkedVisibleAndUnlimitedCanResume) {
  AttentionOptions chunked;
  chunked.chunk = 4;
  const v1::CacheSpec spec = SpecProto("svc-chunked", 2, 32, 16, {AttentionGroupProto(chunked)});
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 1, Range(0, 10))));
  v1::VisibleRequest request;
  request.set_cache("svc-chunked");
  for (int32_t pos : {3, 6, 9}) {
    v1::Query* q = request.add_queries();
    q->set_seq(1);
    q->set_pos(pos);
  }
  v1::VisibleResponse visible;
  KVMESH_ASSERT_OK(Visible(stub(), request, &visible));
  ASSERT_EQ(visible.visible_size(), 3);
  EXPECT_THAT(visible.visible(0).positions(), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(visible.visible(1).positions(), ElementsAre(4, 5, 6));
  EXPECT_THAT(visible.visible(2).positions(), ElementsAre(8, 9));

  // Unlimited memory: a sequence can always be resumed, even one that stores nothing.
  for (const auto& [seq, pos] :
       std::vector<std::pair<int64_t, int32_t>>{{1, 10}, {1, 3}, {77, 0}}) {
    bool can_resume = false;
    KVMESH_ASSERT_OK(CanResume(stub(), "svc-chunked", seq, pos, &can_resume));
    EXPECT_TRUE(can_resume) << "seq " << seq << " pos " << pos;
  }
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-chunked"));
}

// A scheduler reserves room for a long prompt before sending it in pieces: other sequences
// cannot take that room meanwhile, and are told so in numbers.
TEST_F(ServiceTest, ReserveHoldsRoomForALongPrompt) {
  const v1::CacheSpec spec = BasicSpec("svc-reserve");
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  const int64_t cells = Usage("svc-reserve").groups(0).cells_total();
  v1::CacheUsage usage;
  KVMESH_ASSERT_OK(Reserve(stub(), "svc-reserve", 1, static_cast<int32_t>(cells - 2), 0, &usage));
  EXPECT_EQ(usage.groups(0).cells_reserved(), cells - 2);
  EXPECT_EQ(usage.sequences_reserved(), 1);
  // Sequence 2 gets the 2 cells that are not reserved, then a refusal with the numbers.
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 2, Range(0, 2))));
  const grpc::Status refused = Append(stub(), MakeAppend(spec, 2, {2}));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(refused);
  EXPECT_EQ(ShortageText(refused),
            absl::StrCat("CELLS_EXHAUSTED group=0 needed=1 free=0 total=", cells));
  // Sequence 1 fills its room in pieces.
  for (int32_t begin = 0; begin < cells - 2; begin += 4) {
    const int32_t end = std::min<int32_t>(begin + 4, static_cast<int32_t>(cells - 2));
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 1, Range(begin, end))));
  }
  usage = Usage("svc-reserve");
  EXPECT_EQ(usage.groups(0).cells_reserved(), 0);
  EXPECT_EQ(usage.groups(0).cells_used(), cells);
  // positions 0 drops the reservation.
  KVMESH_ASSERT_OK(Reserve(stub(), "svc-reserve", 1, 0));
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-reserve"));
}

TEST_F(ServiceTest, CopyPrefixSharesCells) {
  const v1::CacheSpec spec = BasicSpec("svc-copy");
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 1, Range(0, 12))));
  SequenceModel src;
  ModelAppend(spec, 1, Range(0, 12), 0, &src);
  EXPECT_EQ(Usage("svc-copy").groups(0).cells_used(), 12);

  int32_t offset = -1;
  KVMESH_ASSERT_OK(CopyPrefix(stub(), "svc-copy", 1, 2, 8, /*require_src_offset=*/12, &offset));
  EXPECT_EQ(offset, 8);
  v1::CacheUsage usage = Usage("svc-copy");
  EXPECT_EQ(usage.groups(0).cells_used(), 12) << "a prefix copy shares cells, it does not copy";
  EXPECT_EQ(usage.sequences_live(), 2);
  v1::ListSequencesResponse seqs = Sequences("svc-copy");
  ASSERT_EQ(seqs.sequences_size(), 2);
  EXPECT_EQ(seqs.sequences(0).groups(0).stored(), 12);
  EXPECT_EQ(seqs.sequences(0).groups(0).shared(), 8);
  EXPECT_EQ(seqs.sequences(1).seq(), 2);
  EXPECT_EQ(seqs.sequences(1).offset(), 8);
  EXPECT_EQ(seqs.sequences(1).groups(0).stored(), 8);
  EXPECT_EQ(seqs.sequences(1).groups(0).shared(), 8);

  SequenceModel dst = src;
  for (auto& group : dst) group.erase(group.lower_bound(8), group.end());
  ExpectReadMatches(spec, 2, dst);
  ExpectReadMatches(spec, 1, src);

  // The copy grows on its own; the source is untouched.
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 2, {8, 9}, /*seed=*/7)));
  ModelAppend(spec, 2, {8, 9}, 7, &dst);
  EXPECT_EQ(Usage("svc-copy").groups(0).cells_used(), 14);
  ExpectReadMatches(spec, 2, dst);
  ExpectReadMatches(spec, 1, src);

  // A copy into a live sequence replaces its contents (its private cells are freed).
  KVMESH_ASSERT_OK(CopyPrefix(stub(), "svc-copy", 1, 2, 3));
  dst = src;
  for (auto& group : dst) group.erase(group.lower_bound(3), group.end());
  ExpectReadMatches(spec, 2, dst);
  EXPECT_EQ(Usage("svc-copy").groups(0).cells_used(), 12);

  // Length 0 empties dst: it is no longer a live sequence.
  KVMESH_ASSERT_OK(CopyPrefix(stub(), "svc-copy", 1, 2, 0));
  seqs = Sequences("svc-copy");
  ASSERT_EQ(seqs.sequences_size(), 1);
  EXPECT_EQ(seqs.sequences(0).seq(), 1);
  EXPECT_EQ(seqs.sequences(0).groups(0).shared(), 0);
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-copy"));
}

// Expected K element after a RoPE shift by `delta` positions (NORMAL: pairs 2i, 2i+1).
void RotateNormal(const std::vector<float>& head, int32_t dims, float base, int32_t delta,
                  std::vector<double>* out) {
  out->assign(head.begin(), head.end());
  for (int32_t i = 0; i < dims / 2; ++i) {
    const double angle = delta * std::pow(static_cast<double>(base), -2.0 * i / dims);
    const double x = head[2 * i], y = head[2 * i + 1];
    (*out)[2 * i] = x * std::cos(angle) - y * std::sin(angle);
    (*out)[2 * i + 1] = x * std::sin(angle) + y * std::cos(angle);
  }
}

TEST_F(ServiceTest, RemoveTruncatesAndShiftsWithRope) {
  const v1::CacheSpec spec = BasicSpec("svc-remove");
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 1, Range(0, 10))));
  SequenceModel model;
  ModelAppend(spec, 1, Range(0, 10), 0, &model);

  // Truncate: no end.
  KVMESH_ASSERT_OK(Remove(stub(), "svc-remove", 1, 6));
  for (auto& group : model) group.erase(group.lower_bound(6), group.end());
  ExpectReadMatches(spec, 1, model);
  EXPECT_EQ(Usage("svc-remove").groups(0).cells_used(), 6);
  EXPECT_EQ(Sequences("svc-remove").sequences(0).offset(), 6);

  // Removing nothing, or from a sequence that stores nothing, is a no-op.
  KVMESH_ASSERT_OK(Remove(stub(), "svc-remove", 1, 3, 3));
  KVMESH_ASSERT_OK(Remove(stub(), "svc-remove", 42, 0));
  ExpectReadMatches(spec, 1, model);

  // Middle: [1, 3) goes, old positions 3, 4, 5 become 1, 2, 3 with keys rotated by -2.
  KVMESH_ASSERT_OK(Remove(stub(), "svc-remove", 1, 1, 3));
  const std::vector<uint64_t> old_ids = {model[0][0], model[0][3], model[0][4], model[0][5]};
  model[0] = {{0, old_ids[0]}, {1, old_ids[1]}, {2, old_ids[2]}, {3, old_ids[3]}};
  ReadOutput out;
  KVMESH_ASSERT_OK(Read(stub(), ReadRequest("svc-remove", 1), &out));
  ASSERT_THAT(HeaderPositions(out.header), ElementsAre(ElementsAre(0, 1, 2, 3)));
  const std::string unrotated = ExpectedReadPayload(spec, model, {{0, 1, 2, 3}});
  ASSERT_EQ(out.payload.size(), unrotated.size());
  // Layout per layer: K [4 tokens][2 heads][8] then V [4][2][4], F32.
  const int kTokens = 4, kHeads = 2, kDimK = 8, kDimV = 4, kRopeDims = 4;
  size_t offset = 0;
  for (int layer = 0; layer < 2; ++layer) {
    for (int t = 0; t < kTokens; ++t) {
      for (int h = 0; h < kHeads; ++h) {
        std::vector<float> original(kDimK), got(kDimK);
        std::memcpy(original.data(), unrotated.data() + offset, kDimK * 4);
        std::memcpy(got.data(), out.payload.data() + offset, kDimK * 4);
        std::vector<double> expected;
        RotateNormal(original, kRopeDims, 10000.0f, t == 0 ? 0 : -2, &expected);
        for (int e = 0; e < kDimK; ++e) {
          if (t == 0 || e >= kRopeDims) {
            EXPECT_EQ(std::memcmp(&got[e], &original[e], 4), 0)
                << "layer " << layer << " token " << t << " head " << h << " element " << e
                << " must be unchanged";
          } else {
            EXPECT_NEAR(got[e], expected[e], 1e-5)
                << "layer " << layer << " token " << t << " head " << h << " element " << e;
          }
        }
        offset += kDimK * 4;
      }
    }
    const size_t v_bytes = size_t{kTokens} * kHeads * kDimV * 4;
    EXPECT_EQ(out.payload.compare(offset, v_bytes, unrotated, offset, v_bytes), 0)
        << "V rows of layer " << layer << " must move unchanged";
    offset += v_bytes;
  }
  const v1::ListSequencesResponse seqs = Sequences("svc-remove");
  EXPECT_EQ(seqs.sequences(0).offset(), 4);
  EXPECT_EQ(seqs.sequences(0).groups(0).stored(), 4);
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-remove"));
}

TEST_F(ServiceTest, MiddleRemoveCopiesSharedCellsFirst) {
  const v1::CacheSpec spec = BasicSpec("svc-remove-shared");
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 1, Range(0, 4))));
  KVMESH_ASSERT_OK(CopyPrefix(stub(), "svc-remove-shared", 1, 2, 4));
  SequenceModel copy;
  ModelAppend(spec, 1, Range(0, 4), 0, &copy);
  EXPECT_EQ(Usage("svc-remove-shared").groups(0).cells_used(), 4);

  // Sequence 1 moves 1..3 down; they are shared with 2, so they get private copies first.
  KVMESH_ASSERT_OK(Remove(stub(), "svc-remove-shared", 1, 0, 1));
  ExpectReadMatches(spec, 2, copy);  // the other sharer is untouched, keys not rotated
  const v1::ListSequencesResponse seqs = Sequences("svc-remove-shared");
  ASSERT_EQ(seqs.sequences_size(), 2);
  EXPECT_EQ(seqs.sequences(0).offset(), 3);
  EXPECT_EQ(seqs.sequences(0).groups(0).shared(), 0);
  EXPECT_EQ(seqs.sequences(1).groups(0).shared(), 0);
  EXPECT_EQ(Usage("svc-remove-shared").groups(0).cells_used(), 4 + 3);
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-remove-shared"));
}

TEST_F(ServiceTest, CancelledReadAndAppendStreamLeaveTheNodeServing) {
  const v1::CacheSpec spec = BasicSpec("svc-cancel", 2, 512, 512);
  KVMESH_ASSERT_OK(CreateCache(stub(), spec));
  KVMESH_ASSERT_OK(Append(stub(), MakeAppend(spec, 0, Range(0, 512))));
  v1::ListSequencesResponse before = Sequences("svc-cancel");

  {
    // 96 KiB in 64-byte chunks: the client goes away after the first message.
    grpc::ClientContext context;
    SetDeadline(&context);
    auto reader = stub().Read(&context, ReadRequest("svc-cancel", 0, 0, std::nullopt, 64));
    v1::ReadResponse message;
    ASSERT_TRUE(reader->Read(&message));
    EXPECT_TRUE(message.has_header());
    context.TryCancel();
    while (reader->Read(&message)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  {
    // A stream cancelled before its data is complete appends nothing.
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::AppendResponse response;
    auto writer = stub().AppendStream(&context, &response);
    const std::vector<v1::AppendStreamRequest> messages =
        StreamMessages(MakeAppend(spec, 1, Range(0, 8)), 100, 100);
    ASSERT_TRUE(writer->Write(messages[0]));
    ASSERT_TRUE(writer->Write(messages[1]));
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  KVMESH_EXPECT_PROTO_EQ(Sequences("svc-cancel"), before);
  SequenceModel model;
  ModelAppend(spec, 0, Range(0, 512), 0, &model);
  ExpectReadMatches(spec, 0, model);
  KVMESH_ASSERT_OK(DeleteCache(stub(), "svc-cancel"));
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
