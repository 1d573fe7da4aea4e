// A table of malformed or unservable requests for every RPC, each with its exact status code and
// the values its message must name, run against a real kvmesh-node. Every case also checks that
// the node's state (caches, usage, sequences and their bytes, snapshots) is byte-identical
// before and after: a failed operation changes nothing.
#include <array>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_util.h"
#include "tests/integration/node_fixture.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::HasSubstr;

struct BadCase {
  std::string name;
  std::function<grpc::Status(Stub&)> call;
  grpc::StatusCode code;
  std::vector<std::string> message_has;  // substrings: the offending values
  // For a RESOURCE_EXHAUSTED the node decides: its details as ShortageText prints them.
  std::string shortage;
};

BadCase WithShortage(BadCase c, std::string shortage) {
  c.shortage = std::move(shortage);
  return c;
}

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

constexpr int32_t kInt32Max = 2147483647;

// The caches every case runs against (created in SetUpTestSuite). Tokens are 32 bytes:
// 1 layer x 1 head x (4 + 4) x F32.
//   bad:    4 sequences x 16, max_batch 4, RoPE NORMAL; seq 0 stores 0..3, seq 1 stores 0..1
//   norope: the same with RoPE NONE; seq 0 stores 0..5
//   full:   2 sequences x 4, max_batch 4; seq 0 stores 0..3, seq 1 stores 0..2 (1 cell free)
v1::CacheSpec SmallSpec(const std::string& name, int32_t max_sequences, int32_t capacity,
                        v1::RopeType rope) {
  AttentionOptions a;
  a.num_layers = 1;
  a.num_kv_heads = 1;
  a.head_dim_k = 4;
  a.head_dim_v = 4;
  a.rope = rope;
  a.rope_dims = 2;
  return SpecProto(name, max_sequences, capacity, 4, {AttentionGroupProto(a)});
}
v1::CacheSpec BadSpec() { return SmallSpec("bad", 4, 16, v1::ROPE_TYPE_NORMAL); }
v1::CacheSpec NoRopeSpec() { return SmallSpec("norope", 4, 16, v1::ROPE_TYPE_NONE); }
v1::CacheSpec FullSpec() { return SmallSpec("full", 2, 4, v1::ROPE_TYPE_NORMAL); }
constexpr size_t kTokenBytes = 32;

// hyb: F32, 4 sequences x 16, max_batch 4; full Attention, sliding Attention (window 2),
// Rotating (max_size 4), Recurrent (conv 2 x 3, delta 1 x 2 x 2): 96 bytes per token (3 x 32)
// and 40 bytes per state.
//   seq 0 stores 0..3; snapshot 1 is [0, 4), snapshot 2 is [1, 4)
//   seq 1 stores 0..1 and has 2..3 pending
//   seq 2 stored 0..1, then lost position 1: its state is INVALID
//   seq 3 stores 0..5 (its ring wrapped); snapshot 3 is [0, 6)
// rot: F32, 2 sequences x 16, max_batch 4; full Attention and Rotating (max_size 4):
//   seq 0 stores 0..5 (wrapped); snapshot 1 is [0, 6)
// bad: snapshot 1 is [2, 4) of seq 0.
v1::CacheSpec HybSpec() {
  AttentionOptions full;
  full.num_layers = 1;
  full.num_kv_heads = 1;
  AttentionOptions sliding = full;
  sliding.sliding_window = 2;
  return SpecProto(
      "hyb", 4, 16, 4,
      {AttentionGroupProto(full), AttentionGroupProto(sliding),
       RotatingGroupProto(RotatingOptions()), RecurrentGroupProto(RecurrentOptions())});
}
v1::CacheSpec RotSpec() {
  AttentionOptions full;
  full.num_layers = 1;
  full.num_kv_heads = 1;
  return SpecProto("rot", 2, 16, 4,
                   {AttentionGroupProto(full), RotatingGroupProto(RotatingOptions())});
}
constexpr size_t kHybTokenBytes = 96;
constexpr size_t kHybStateBytes = 40;

// A valid spec for a new cache, which each CreateCache case breaks in one way.
v1::CacheSpec FreshSpec() {
  AttentionOptions a;
  a.num_layers = 1;
  a.num_kv_heads = 1;
  a.head_dim_k = 4;
  a.head_dim_v = 4;
  a.rope = v1::ROPE_TYPE_NONE;
  return SpecProto("fresh", 2, 16, 4, {AttentionGroupProto(a)}, v1::DTYPE_F16);
}
v1::Attention* FreshAttention(v1::CacheSpec* spec) {
  return spec->mutable_groups(0)->mutable_attention();
}
// FreshSpec() with a valid Rotating (max_size 4) or Recurrent group added as groups[1].
v1::Rotating* AddRotating(v1::CacheSpec* spec) {
  *spec->add_groups() = RotatingGroupProto(RotatingOptions());
  return spec->mutable_groups(1)->mutable_rotating();
}
v1::Recurrent* AddRecurrent(v1::CacheSpec* spec) {
  *spec->add_groups() = RecurrentGroupProto(RecurrentOptions());
  return spec->mutable_groups(1)->mutable_recurrent();
}

grpc::Status CreateRaw(Stub& stub, const v1::CreateCacheRequest& request) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::CreateCacheResponse response;
  return stub.CreateCache(&context, request, &response);
}

// A case that creates FreshSpec() after `edit`.
BadCase CreateCase(std::string name, std::function<void(v1::CacheSpec*)> edit,
                   grpc::StatusCode code, std::vector<std::string> message_has) {
  return BadCase{std::move(name),
                 [edit](Stub& stub) {
                   v1::CacheSpec spec = FreshSpec();
                   edit(&spec);
                   return CreateCache(stub, spec);
                 },
                 code, std::move(message_has)};
}

v1::AppendRequest AppendOf(const std::string& cache, const std::vector<int64_t>& seqs,
                           const std::vector<int32_t>& positions, size_t payload_bytes) {
  v1::AppendRequest request;
  request.set_cache(cache);
  for (size_t i = 0; i < seqs.size(); ++i) {
    v1::Token* t = request.add_tokens();
    t->set_seq(seqs[i]);
    t->set_pos(positions[i]);
  }
  request.set_payload(std::string(payload_bytes, '\x5a'));
  return request;
}

// AppendOf with token ranges (seq, first, count) after the tokens.
v1::AppendRequest WithRanges(v1::AppendRequest request,
                             const std::vector<std::array<int64_t, 3>>& ranges) {
  for (const auto& [seq, first, count] : ranges) {
    v1::TokenRange* r = request.add_token_ranges();
    r->set_seq(seq);
    r->set_first(static_cast<int32_t>(first));
    r->set_count(static_cast<int32_t>(count));
  }
  return request;
}

BadCase AppendCase(std::string name, v1::AppendRequest request, grpc::StatusCode code,
                   std::vector<std::string> message_has) {
  return BadCase{std::move(name), [request](Stub& stub) { return Append(stub, request); }, code,
                 std::move(message_has)};
}

v1::AppendRequest SpeculativeAppendOf(const std::string& cache, const std::vector<int64_t>& seqs,
                                      const std::vector<int32_t>& positions, size_t payload_bytes) {
  v1::AppendRequest request = AppendOf(cache, seqs, positions, payload_bytes);
  request.set_speculative(true);
  return request;
}

v1::AppendStreamRequest Header(const std::string& cache, const std::vector<int64_t>& seqs,
                               const std::vector<int32_t>& positions, int64_t payload_bytes,
                               size_t data_bytes = 0) {
  v1::AppendStreamRequest message;
  v1::AppendHeader* header = message.mutable_header();
  header->set_cache(cache);
  for (size_t i = 0; i < seqs.size(); ++i) {
    v1::Token* t = header->add_tokens();
    t->set_seq(seqs[i]);
    t->set_pos(positions[i]);
  }
  header->set_payload_bytes(payload_bytes);
  message.set_data(std::string(data_bytes, '\x33'));
  return message;
}

v1::AppendStreamRequest Data(size_t bytes) {
  v1::AppendStreamRequest message;
  message.set_data(std::string(bytes, '\x44'));
  return message;
}

BadCase StreamCase(std::string name, std::vector<v1::AppendStreamRequest> messages,
                   grpc::StatusCode code, std::vector<std::string> message_has) {
  return BadCase{std::move(name), [messages](Stub& stub) { return AppendStream(stub, messages); },
                 code, std::move(message_has)};
}

BadCase ReadCase(std::string name, v1::ReadRequest request, grpc::StatusCode code,
                 std::vector<std::string> message_has) {
  return BadCase{std::move(name),
                 [request](Stub& stub) {
                   ReadOutput out;
                   return Read(stub, request, &out);
                 },
                 code, std::move(message_has)};
}

BadCase VisibleCase(std::string name, const std::string& cache, int32_t group,
                    std::vector<std::pair<int64_t, int32_t>> queries, grpc::StatusCode code,
                    std::vector<std::string> message_has) {
  v1::VisibleRequest request;
  request.set_cache(cache);
  request.set_group(group);
  for (const auto& [seq, pos] : queries) {
    v1::Query* q = request.add_queries();
    q->set_seq(seq);
    q->set_pos(pos);
  }
  return BadCase{std::move(name),
                 [request](Stub& stub) {
                   v1::VisibleResponse response;
                   return Visible(stub, request, &response);
                 },
                 code, std::move(message_has)};
}

const auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
const auto kNotFound = grpc::StatusCode::NOT_FOUND;
const auto kExhausted = grpc::StatusCode::RESOURCE_EXHAUSTED;
const auto kPrecondition = grpc::StatusCode::FAILED_PRECONDITION;
const auto kAborted = grpc::StatusCode::ABORTED;

// Rotating and Recurrent specs, speculative Appends, snapshots and speculation.
void AddSnapshotCases(std::vector<BadCase>* out) {
  std::vector<BadCase>& cases = *out;

  // ---- CreateCache: Rotating and Recurrent groups ----
  cases.push_back(CreateCase("CreateTokenBlockSizeNegative",
                             [](v1::CacheSpec* s) { s->set_token_block_size(-1); }, kInvalid,
                             {"token_block_size", "-1"}));
  cases.push_back(CreateCase("CreateTokenBlockSizeHuge",
                             [](v1::CacheSpec* s) { s->set_token_block_size(65537); }, kInvalid,
                             {"token_block_size", "65537", "65536"}));
  cases.push_back(CreateCase("CreateRotatingMaxSizeZero",
                             [](v1::CacheSpec* s) { AddRotating(s)->set_max_size(0); }, kInvalid,
                             {"groups[1].rotating.max_size = 0"}));
  cases.push_back(CreateCase("CreateRotatingMaxSizeAboveCapacity",
                             [](v1::CacheSpec* s) { AddRotating(s)->set_max_size(17); }, kInvalid,
                             {"groups[1].rotating.max_size = 17", "16"}));
  cases.push_back(CreateCase("CreateRotatingHeadsZero",
                             [](v1::CacheSpec* s) { AddRotating(s)->set_num_kv_heads(0); },
                             kInvalid, {"groups[1].rotating.num_kv_heads = 0"}));
  cases.push_back(CreateCase("CreateRotatingHeadDimVNegative",
                             [](v1::CacheSpec* s) { AddRotating(s)->set_head_dim_v(-4); }, kInvalid,
                             {"groups[1].rotating.head_dim_v = -4"}));
  cases.push_back(CreateCase("CreateRotatingRopeDimsOdd",
                             [](v1::CacheSpec* s) { AddRotating(s)->mutable_rope()->set_dims(3); },
                             kInvalid, {"groups[1].rotating.rope.dims = 3"}));
  cases.push_back(CreateCase("CreateRotatingRopeTypeUnknown",
                             [](v1::CacheSpec* s) {
                               AddRotating(s)->mutable_rope()->set_type(
                                   static_cast<v1::RopeType>(9));
                             },
                             kInvalid, {"groups[1].rotating.rope.type = 9"}));
  cases.push_back(CreateCase("CreateRecurrentConvTailZero",
                             [](v1::CacheSpec* s) { AddRecurrent(s)->set_conv_tail(0); }, kInvalid,
                             {"groups[1].recurrent.conv_tail = 0"}));
  cases.push_back(CreateCase("CreateRecurrentConvTailHuge",
                             [](v1::CacheSpec* s) { AddRecurrent(s)->set_conv_tail(1025); },
                             kInvalid, {"groups[1].recurrent.conv_tail = 1025"}));
  cases.push_back(CreateCase("CreateRecurrentConvDimNegative",
                             [](v1::CacheSpec* s) { AddRecurrent(s)->set_conv_dim(-2); }, kInvalid,
                             {"groups[1].recurrent.conv_dim = -2"}));
  cases.push_back(CreateCase("CreateRecurrentVHeadsNegative",
                             [](v1::CacheSpec* s) { AddRecurrent(s)->set_num_v_heads(-1); },
                             kInvalid, {"groups[1].recurrent.num_v_heads = -1"}));
  cases.push_back(CreateCase("CreateRecurrentDeltaDimsWithoutHeads",
                             [](v1::CacheSpec* s) { AddRecurrent(s)->set_num_v_heads(0); },
                             kInvalid, {"head_v_dim = 2", "head_k_dim = 2", "num_v_heads"}));
  cases.push_back(CreateCase("CreateRecurrentHeadKDimZero",
                             [](v1::CacheSpec* s) { AddRecurrent(s)->set_head_k_dim(0); }, kInvalid,
                             {"groups[1].recurrent.head_k_dim = 0"}));
  cases.push_back(CreateCase("CreateSecondGroupWithoutKind",
                             [](v1::CacheSpec* s) {
                               AddRecurrent(s);
                               s->mutable_groups(1)->clear_recurrent();
                             },
                             kInvalid, {"groups[1] has no kind"}));

  // ---- Append and AppendStream: contiguity, Recurrent states, speculation ----
  const size_t plain1 = kHybTokenBytes + kHybStateBytes;              // 136
  const size_t plain2 = 2 * kHybTokenBytes + kHybStateBytes;          // 232
  const size_t speculative2 = 2 * (kHybTokenBytes + kHybStateBytes);  // 272
  cases.push_back(AppendCase("AppendRecurrentStateMissing", AppendOf("hyb", {0}, {4}, 96), kInvalid,
                             {"payload = 96", "136"}));
  cases.push_back(AppendCase("AppendRecurrentStatePerTokenInPlainAppend",
                             AppendOf("hyb", {0, 0}, {4, 5}, speculative2), kInvalid,
                             {"payload = 272", "232"}));
  cases.push_back(AppendCase("AppendSpeculativeWithOneStatePerSequence",
                             SpeculativeAppendOf("hyb", {0, 0}, {4, 5}, plain2), kInvalid,
                             {"payload = 232", "272"}));
  cases.push_back(AppendCase("AppendNotContiguous", AppendOf("hyb", {0}, {5}, plain1), kInvalid,
                             {"sequence 0", "position 5", "offset is 4"}));
  cases.push_back(AppendCase("AppendNewSequenceNotAtZero", AppendOf("rot", {1}, {3}, 64), kInvalid,
                             {"sequence 1", "position 3", "offset is 0"}));
  cases.push_back(AppendCase("AppendSpeculativeNotContiguous",
                             SpeculativeAppendOf("hyb", {0}, {6}, plain1), kInvalid,
                             {"sequence 0", "position 6", "offset is 4"}));
  cases.push_back(AppendCase("AppendPlainWhilePending", AppendOf("hyb", {1}, {4}, plain1), kAborted,
                             {"sequence 1", "pending"}));
  cases.push_back(AppendCase("AppendSpeculativeBeyondMaxPending",
                             SpeculativeAppendOf("hyb", {1, 1, 1}, {4, 5, 6}, 3 * plain1),
                             kExhausted, {"sequence 1", "5 pending", "max_batch = 4"}));
  {
    v1::AppendStreamRequest header = Header("hyb", {0, 0}, {4, 5}, plain2);
    header.mutable_header()->set_speculative(true);
    cases.push_back(StreamCase("StreamSpeculativeWithOneStatePerSequence", {header, Data(plain2)},
                               kInvalid, {"header.payload_bytes = 232", "272"}));
  }
  // The largest payload a stream may announce is max_batch speculative tokens: 4 x 136.
  {
    v1::AppendStreamRequest header = Header("bad", {}, {}, 4 * kTokenBytes);
    v1::TokenRange* r = header.mutable_header()->add_token_ranges();
    r->set_seq(2);
    r->set_first(0);
    r->set_count(5);
    cases.push_back(StreamCase("StreamRangesAboveMaxBatch", {header, Data(4 * kTokenBytes)},
                               kInvalid, {"5 tokens", "5 in token_ranges", "max_batch = 4"}));
  }
  cases.push_back(StreamCase("StreamSpeculativeSizedPlainBatch",
                             {Header("hyb", {0, 0, 0, 0}, {4, 5, 6, 7}, 4 * plain1)}, kInvalid,
                             {"header.payload_bytes = 544", "424"}));
  cases.push_back(StreamCase("StreamPayloadBytesAboveSpeculativeMax",
                             {Header("hyb", {0}, {4}, 4 * plain1 + 1)}, kInvalid,
                             {"header.payload_bytes = 545", "544 bytes"}));
  cases.push_back(StreamCase("StreamPlainWhilePending",
                             {Header("hyb", {1}, {4}, plain1), Data(plain1)}, kAborted,
                             {"sequence 1", "pending"}));

  // ---- Snapshot ----
  auto snapshot = [](std::string cache, int64_t seq, int32_t from) {
    return [=](Stub& stub) { return Snapshot(stub, cache, seq, from); };
  };
  cases.push_back({"SnapshotUnknownCache", snapshot("nosuch", 0, 0), kNotFound, {"nosuch"}});
  cases.push_back({"SnapshotEmptyCacheName", snapshot("", 0, 0), kInvalid, {"cache is empty"}});
  cases.push_back({"SnapshotNegativeSeq", snapshot("hyb", -1, 0), kInvalid, {"seq = -1"}});
  cases.push_back(
      {"SnapshotNegativeFromOffset", snapshot("hyb", 0, -2), kInvalid, {"from_offset = -2"}});
  cases.push_back({"SnapshotUnknownSequence", snapshot("hyb", 7, 0), kNotFound, {"sequence 7"}});
  cases.push_back({"SnapshotFromAtOffset",
                   snapshot("hyb", 0, 4),
                   kPrecondition,
                   {"from_offset = 4", "offset 4 of sequence 0"}});
  cases.push_back({"SnapshotFromBeyondOffset",
                   snapshot("bad", 1, 9),
                   kPrecondition,
                   {"from_offset = 9", "offset 2 of sequence 1"}});
  cases.push_back(
      {"SnapshotWhilePending", snapshot("hyb", 1, 0), kAborted, {"sequence 1", "pending"}});
  cases.push_back({"SnapshotInvalidRecurrentState",
                   snapshot("hyb", 2, 0),
                   kPrecondition,
                   {"group 3", "sequence 2", "INVALID"}});

  // ---- Restore ----
  auto restore = [](std::string cache, int64_t seq, std::optional<uint64_t> id, int32_t target) {
    return [=](Stub& stub) { return Restore(stub, cache, seq, id, target); };
  };
  cases.push_back({"RestoreUnknownCache", restore("nosuch", 0, 1, 4), kNotFound, {"nosuch"}});
  cases.push_back({"RestoreEmptyCacheName", restore("", 0, 1, 4), kInvalid, {"cache is empty"}});
  cases.push_back({"RestoreNegativeSeq", restore("hyb", -3, 1, 4), kInvalid, {"seq = -3"}});
  cases.push_back({"RestoreNegativeTarget", restore("hyb", 0, 1, -1), kInvalid, {"target = -1"}});
  cases.push_back({"RestoreUnknownSnapshot", restore("hyb", 0, 99, 4), kNotFound, {"snapshot 99"}});
  cases.push_back({"RestoreSnapshotZero", restore("hyb", 0, 0, 4), kNotFound, {"snapshot 0"}});
  cases.push_back({"RestoreTargetBeyondSnapshotEnd",
                   restore("hyb", 0, 1, 5),
                   kPrecondition,
                   {"target = 5", "end 4 of snapshot 1"}});
  cases.push_back({"RestoreSequenceBelowSnapshotStart",
                   restore("bad", 3, 1, 4),
                   kPrecondition,
                   {"sequence 3 has offset 0", "start 2 of snapshot 1"}});
  cases.push_back({"RestoreClampsWrappedRotatingWindow",
                   restore("rot", 0, 1, 5),
                   kPrecondition,
                   {"group 1", "ends at 6", "target 5"}});
  cases.push_back({"RestoreRecurrentTargetNotSnapshotEnd",
                   restore("hyb", 0, 1, 3),
                   kPrecondition,
                   {"group 3", "target 4, not 3"}});
  cases.push_back(
      {"RestoreWhilePending", restore("hyb", 1, 1, 4), kAborted, {"sequence 1", "pending"}});
  cases.push_back({"RestoreBeyondMaxSequences",
                   restore("hyb", 5, 1, 4),
                   kExhausted,
                   {"sequence 5", "max_sequences = 4"}});
  cases.push_back({"RestoreLiveRecurrentBelowOffset",
                   restore("hyb", 0, std::nullopt, 2),
                   kPrecondition,
                   {"group 3", "offset 4 to 2"}});
  cases.push_back({"RestoreLiveWrappedRotating",
                   restore("rot", 0, std::nullopt, 5),
                   kPrecondition,
                   {"sequence 0", "offset 6", "rewinding to 5"}});
  cases.push_back({"RestoreLiveBeyondOffset",
                   restore("bad", 0, std::nullopt, 9),
                   kPrecondition,
                   {"target = 9", "offset 4 of sequence 0"}});
  cases.push_back({"RestoreLiveEmptySequenceNonZero",
                   restore("bad", 3, std::nullopt, 2),
                   kPrecondition,
                   {"target = 2", "offset 0 of sequence 3"}});
  cases.push_back({"RestoreLiveWhilePending",
                   restore("hyb", 1, std::nullopt, 4),
                   kAborted,
                   {"sequence 1", "pending"}});

  // ---- MergeSnapshots ----
  auto merge = [](std::string cache, uint64_t parent, uint64_t child) {
    return [=](Stub& stub) { return MergeSnapshots(stub, cache, parent, child); };
  };
  cases.push_back({"MergeUnknownCache", merge("nosuch", 1, 2), kNotFound, {"nosuch"}});
  cases.push_back({"MergeEmptyCacheName", merge("", 1, 2), kInvalid, {"cache is empty"}});
  cases.push_back({"MergeParentIsChild", merge("hyb", 1, 1), kInvalid, {"both snapshot 1"}});
  cases.push_back({"MergeUnknownParent", merge("hyb", 99, 1), kNotFound, {"snapshot 99"}});
  cases.push_back({"MergeUnknownChild", merge("hyb", 1, 98), kNotFound, {"snapshot 98"}});
  cases.push_back({"MergeSnapshotZero", merge("hyb", 0, 1), kNotFound, {"snapshot 0"}});
  cases.push_back({"MergeMismatchedBoundary",
                   merge("hyb", 1, 2),
                   kInvalid,
                   {"snapshot 1 covers [0, 4)", "snapshot 2 covers [1, 4)"}});
  cases.push_back({"MergeReversed",
                   merge("hyb", 2, 1),
                   kInvalid,
                   {"snapshot 2 covers [1, 4)", "snapshot 1 covers [0, 4)"}});

  // ---- SplitSnapshot, DropSnapshot, ListSnapshots ----
  auto split = [](std::string cache, uint64_t id, int32_t at) {
    return [=](Stub& stub) { return SplitSnapshot(stub, cache, id, at); };
  };
  cases.push_back({"SplitUnknownCache", split("nosuch", 1, 2), kNotFound, {"nosuch"}});
  cases.push_back({"SplitEmptyCacheName", split("", 1, 2), kInvalid, {"cache is empty"}});
  cases.push_back({"SplitUnknownSnapshot", split("hyb", 99, 2), kNotFound, {"snapshot 99"}});
  cases.push_back({"SplitSnapshotZero", split("bad", 0, 3), kNotFound, {"snapshot 0"}});
  auto drop = [](std::string cache, uint64_t id) {
    return [=](Stub& stub) { return DropSnapshot(stub, cache, id); };
  };
  cases.push_back({"DropUnknownCache", drop("nosuch", 1), kNotFound, {"nosuch"}});
  cases.push_back({"DropEmptyCacheName", drop("", 1), kInvalid, {"cache is empty"}});
  cases.push_back({"DropUnknownSnapshot", drop("hyb", 99), kNotFound, {"snapshot 99"}});
  cases.push_back({"DropSnapshotZero", drop("hyb", 0), kNotFound, {"snapshot 0"}});
  cases.push_back(
      {"DropSnapshotOfAnotherCache", drop("rot", 3), kNotFound, {"'rot'", "snapshot 3"}});
  auto list = [](std::string cache) {
    return [=](Stub& stub) {
      v1::ListSnapshotsResponse response;
      return ListSnapshots(stub, cache, &response);
    };
  };
  cases.push_back({"ListSnapshotsUnknownCache", list("nosuch"), kNotFound, {"nosuch"}});
  cases.push_back({"ListSnapshotsEmptyCacheName", list(""), kInvalid, {"cache is empty"}});

  // ---- CommitSpeculation ----
  auto commit = [](std::string cache, int64_t seq, int32_t accepted) {
    return [=](Stub& stub) { return CommitSpeculation(stub, cache, seq, accepted); };
  };
  cases.push_back({"CommitUnknownCache", commit("nosuch", 1, 1), kNotFound, {"nosuch"}});
  cases.push_back({"CommitEmptyCacheName", commit("", 1, 1), kInvalid, {"cache is empty"}});
  cases.push_back({"CommitNegativeSeq", commit("hyb", -1, 1), kInvalid, {"seq = -1"}});
  cases.push_back({"CommitNegativeAccepted", commit("hyb", 1, -1), kInvalid, {"accepted = -1"}});
  cases.push_back(
      {"CommitWithoutPending", commit("hyb", 0, 0), kPrecondition, {"sequence 0", "pending"}});
  cases.push_back(
      {"CommitUnknownSequence", commit("hyb", 9, 0), kPrecondition, {"sequence 9", "pending"}});
  cases.push_back({"CommitMoreThanPending",
                   commit("hyb", 1, 3),
                   kInvalid,
                   {"accepted = 3", "2 pending", "sequence 1"}});
}

std::vector<BadCase> Cases() {
  std::vector<BadCase> cases;

  // ---- CreateCache ----
  cases.push_back({"CreateSpecMissing",
                   [](Stub& stub) { return CreateRaw(stub, v1::CreateCacheRequest()); },
                   kInvalid,
                   {"spec is missing"}});
  cases.push_back(CreateCase("CreateNameEmpty", [](v1::CacheSpec* s) { s->set_name(""); }, kInvalid,
                             {"name is empty"}));
  cases.push_back(CreateCase("CreateNameBadCharacters",
                             [](v1::CacheSpec* s) { s->set_name("bad name!"); }, kInvalid,
                             {"bad name!"}));
  cases.push_back(CreateCase("CreateNameTooLong",
                             [](v1::CacheSpec* s) { s->set_name(std::string(129, 'n')); }, kInvalid,
                             {"129"}));
  cases.push_back(CreateCase("CreateDTypeUnspecified",
                             [](v1::CacheSpec* s) { s->set_dtype(v1::DTYPE_UNSPECIFIED); },
                             kInvalid, {"DTYPE_UNSPECIFIED"}));
  cases.push_back(CreateCase("CreateDTypeUnknown",
                             [](v1::CacheSpec* s) { s->set_dtype(static_cast<v1::DType>(7)); },
                             kInvalid, {"dtype = 7"}));
  cases.push_back(CreateCase(
      "CreateEvictionUnknown",
      [](v1::CacheSpec* s) { s->set_eviction(static_cast<v1::EvictionPolicy>(7)); }, kInvalid,
      {"eviction 7"}));
  cases.push_back(CreateCase("CreateNoGroups", [](v1::CacheSpec* s) { s->clear_groups(); },
                             kInvalid, {"groups is empty"}));
  cases.push_back(CreateCase("CreateGroupWithoutKind",
                             [](v1::CacheSpec* s) { s->mutable_groups(0)->clear_attention(); },
                             kInvalid, {"groups[0] has no kind"}));
  cases.push_back(CreateCase("CreateTooManyGroups",
                             [](v1::CacheSpec* s) {
                               while (s->groups_size() < 65) *s->add_groups() = s->groups(0);
                             },
                             kInvalid, {"65"}));
  cases.push_back(CreateCase("CreateNumLayersZero",
                             [](v1::CacheSpec* s) { s->mutable_groups(0)->set_num_layers(0); },
                             kInvalid, {"groups[0].num_layers = 0"}));
  cases.push_back(CreateCase("CreateHeadsZero",
                             [](v1::CacheSpec* s) { FreshAttention(s)->set_num_kv_heads(0); },
                             kInvalid, {"num_kv_heads = 0"}));
  cases.push_back(CreateCase("CreateHeadDimKZero",
                             [](v1::CacheSpec* s) { FreshAttention(s)->set_head_dim_k(0); },
                             kInvalid, {"head_dim_k = 0"}));
  cases.push_back(CreateCase("CreateHeadDimVZero",
                             [](v1::CacheSpec* s) { FreshAttention(s)->set_head_dim_v(0); },
                             kInvalid, {"head_dim_v = 0"}));
  cases.push_back(CreateCase("CreateCapacityZero", [](v1::CacheSpec* s) { s->set_capacity(0); },
                             kInvalid, {"capacity = 0"}));
  cases.push_back(CreateCase("CreateCapacityNegative",
                             [](v1::CacheSpec* s) { s->set_capacity(-5); }, kInvalid,
                             {"capacity = -5"}));
  cases.push_back(CreateCase("CreateMaxBatchZero", [](v1::CacheSpec* s) { s->set_max_batch(0); },
                             kInvalid, {"max_batch = 0"}));
  cases.push_back(CreateCase("CreateMaxSequencesZero",
                             [](v1::CacheSpec* s) { s->set_max_sequences(0); }, kInvalid,
                             {"max_sequences = 0"}));
  cases.push_back(CreateCase("CreateMaxBatchNegative",
                             [](v1::CacheSpec* s) { s->set_max_batch(-3); }, kInvalid,
                             {"max_batch = -3"}));
  cases.push_back(CreateCase("CreateSlidingWindowZero",
                             [](v1::CacheSpec* s) {
                               FreshAttention(s)->mutable_window()->mutable_sliding()->set_window(
                                   0);
                             },
                             kInvalid, {"window.sliding.window = 0"}));
  cases.push_back(
      CreateCase("CreateChunkZero",
                 [](v1::CacheSpec* s) { FreshAttention(s)->mutable_window()->mutable_chunked(); },
                 kInvalid, {"window.chunked.chunk = 0"}));
  cases.push_back(CreateCase("CreateMemoryBelowWindow",
                             [](v1::CacheSpec* s) {
                               v1::Window::Sliding* w =
                                   FreshAttention(s)->mutable_window()->mutable_sliding();
                               w->set_window(4);
                               w->set_memory(2);
                             },
                             kInvalid, {"memory = 2", "window = 4"}));
  auto rope = [](v1::RopeType type, int32_t dims, float base, float freq_scale) {
    return [=](v1::CacheSpec* s) {
      v1::Rope* r = FreshAttention(s)->mutable_rope();
      r->set_type(type);
      r->set_dims(dims);
      r->set_base(base);
      r->set_freq_scale(freq_scale);
    };
  };
  cases.push_back(CreateCase("CreateRopeDimsOdd", rope(v1::ROPE_TYPE_NORMAL, 3, 1e4f, 1), kInvalid,
                             {"rope.dims = 3"}));
  cases.push_back(CreateCase("CreateRopeDimsAboveHeadDim", rope(v1::ROPE_TYPE_NEOX, 8, 1e4f, 1),
                             kInvalid, {"rope.dims = 8", "head_dim_k = 4"}));
  cases.push_back(CreateCase("CreateRopeDimsZero", rope(v1::ROPE_TYPE_NORMAL, 0, 1e4f, 1), kInvalid,
                             {"rope.dims = 0"}));
  cases.push_back(CreateCase("CreateRopeTypeUnknown",
                             rope(static_cast<v1::RopeType>(9), 2, 1e4f, 1), kInvalid,
                             {"rope.type = 9"}));
  cases.push_back(CreateCase("CreateRopeBaseZero", rope(v1::ROPE_TYPE_NORMAL, 2, 0, 1), kInvalid,
                             {"rope.base = 0"}));
  cases.push_back(CreateCase("CreateRopeFreqScaleNegative", rope(v1::ROPE_TYPE_NORMAL, 2, 1e4f, -1),
                             kInvalid, {"rope.freq_scale = -1"}));
  cases.push_back(CreateCase(
      "CreateLayersHuge", [](v1::CacheSpec* s) { s->mutable_groups(0)->set_num_layers(kInt32Max); },
      kInvalid, {"num_layers = 2147483647"}));
  cases.push_back(CreateCase(
      "CreateHeadsHuge", [](v1::CacheSpec* s) { FreshAttention(s)->set_num_kv_heads(kInt32Max); },
      kInvalid, {"num_kv_heads = 2147483647"}));
  cases.push_back(CreateCase("CreateHeadDimHuge",
                             [](v1::CacheSpec* s) { FreshAttention(s)->set_head_dim_k(kInt32Max); },
                             kInvalid, {"head_dim_k = 2147483647"}));
  cases.push_back(CreateCase("CreateCapacityHuge",
                             [](v1::CacheSpec* s) { s->set_capacity(kInt32Max); }, kInvalid,
                             {"4294967294"}));  // cells = 2 x (2^31 - 1)
  cases.push_back(CreateCase("CreateMaxSequencesHuge",
                             [](v1::CacheSpec* s) { s->set_max_sequences(kInt32Max); }, kInvalid,
                             {"max_sequences = 2147483647"}));
  // Valid, but 2 GiB is beyond the node's --memory-budget=64MiB.
  cases.push_back(CreateCase("CreateBeyondMemoryBudget",
                             [](v1::CacheSpec* s) {
                               s->set_max_sequences(1);
                               s->set_capacity(8192);
                               s->set_max_batch(1);
                               s->mutable_groups(0)->set_num_layers(64);
                               FreshAttention(s)->set_num_kv_heads(8);
                               FreshAttention(s)->set_head_dim_k(128);
                               FreshAttention(s)->set_head_dim_v(128);
                             },
                             kExhausted, {"2147483648"}));
  cases.push_back(BadCase{"CreateExistingNameDifferentSpec",
                          [](Stub& stub) {
                            v1::CacheSpec spec = BadSpec();
                            spec.set_capacity(32);
                            return CreateCache(stub, spec);
                          },
                          grpc::StatusCode::ALREADY_EXISTS,
                          {"'bad'"}});

  // ---- DeleteCache, GetCache, ListSequences ----
  cases.push_back({"DeleteEmptyName",
                   [](Stub& stub) { return DeleteCache(stub, ""); },
                   kInvalid,
                   {"cache is empty"}});
  cases.push_back({"DeleteUnknown",
                   [](Stub& stub) { return DeleteCache(stub, "nosuch"); },
                   kNotFound,
                   {"nosuch"}});
  cases.push_back({"GetEmptyName",
                   [](Stub& stub) {
                     v1::GetCacheResponse response;
                     return GetCache(stub, "", &response);
                   },
                   kInvalid,
                   {"cache is empty"}});
  cases.push_back({"GetUnknown",
                   [](Stub& stub) {
                     v1::GetCacheResponse response;
                     return GetCache(stub, "nosuch", &response);
                   },
                   kNotFound,
                   {"nosuch"}});
  cases.push_back({"ListSequencesEmptyName",
                   [](Stub& stub) {
                     v1::ListSequencesResponse response;
                     return ListSequences(stub, "", &response);
                   },
                   kInvalid,
                   {"cache is empty"}});
  cases.push_back({"ListSequencesUnknown",
                   [](Stub& stub) {
                     v1::ListSequencesResponse response;
                     return ListSequences(stub, "nosuch", &response);
                   },
                   kNotFound,
                   {"nosuch"}});

  // ---- Append ----
  cases.push_back(AppendCase("AppendUnknownCache", AppendOf("nosuch", {2}, {0}, kTokenBytes),
                             kNotFound, {"nosuch"}));
  cases.push_back(AppendCase("AppendEmptyCacheName", AppendOf("", {2}, {0}, kTokenBytes), kInvalid,
                             {"cache is empty"}));
  cases.push_back(
      AppendCase("AppendNoTokens", AppendOf("bad", {}, {}, 0), kInvalid, {"tokens is empty"}));
  cases.push_back(AppendCase("AppendNegativeSeq", AppendOf("bad", {2, -1}, {0, 0}, 2 * kTokenBytes),
                             kInvalid, {"tokens[1].seq = -1"}));
  cases.push_back(AppendCase("AppendNegativePos", AppendOf("bad", {2}, {-5}, kTokenBytes), kInvalid,
                             {"tokens[0].pos = -5"}));
  cases.push_back(AppendCase("AppendDuplicatePositionInBatch",
                             AppendOf("bad", {2, 2}, {3, 3}, 2 * kTokenBytes), kInvalid,
                             {"position 3", "sequence 2", "twice"}));
  cases.push_back(AppendCase("AppendPositionsNotIncreasing",
                             AppendOf("bad", {2, 2}, {5, 4}, 2 * kTokenBytes), kInvalid,
                             {"position 4", "position 5", "sequence 2"}));
  cases.push_back(AppendCase("AppendPositionAlreadyStored", AppendOf("bad", {0}, {2}, kTokenBytes),
                             kInvalid, {"sequence 0", "already stores position 2"}));
  cases.push_back(AppendCase("AppendPositionAlreadyStoredAfterANewOne",
                             AppendOf("bad", {2, 1}, {0, 1}, 2 * kTokenBytes), kInvalid,
                             {"tokens[1]", "sequence 1", "position 1"}));
  cases.push_back(AppendCase("AppendPayloadOneByteShort",
                             AppendOf("bad", {2, 2}, {0, 1}, 2 * kTokenBytes - 1), kInvalid,
                             {"63", "64"}));
  cases.push_back(AppendCase("AppendPayloadOneByteLong",
                             AppendOf("bad", {2, 2}, {0, 1}, 2 * kTokenBytes + 1), kInvalid,
                             {"65", "64"}));
  cases.push_back(AppendCase("AppendPayloadEmpty", AppendOf("bad", {2}, {0}, 0), kInvalid,
                             {"payload = 0", "32"}));
  cases.push_back(AppendCase("AppendBatchAboveMaxBatch",
                             AppendOf("bad", {2, 2, 2, 2, 2}, {0, 1, 2, 3, 4}, 5 * kTokenBytes),
                             kInvalid, {"5 tokens", "max_batch = 4"}));
  cases.push_back(WithShortage(
      AppendCase("AppendBeyondFreeCells", AppendOf("full", {1, 1}, {3, 4}, 2 * kTokenBytes),
                 kExhausted, {"2 tokens", "1 of 8"}),
      "CELLS_EXHAUSTED group=0 needed=2 free=1 total=8"));
  cases.push_back(
      WithShortage(AppendCase("AppendBeyondMaxSequences", AppendOf("full", {2}, {0}, kTokenBytes),
                              kExhausted, {"max_sequences = 2"}),
                   "SEQUENCES_EXHAUSTED needed=1 free=0 total=2"));
  cases.push_back(WithShortage(AppendCase("AppendBeyondMaxSequencesInOneBatch",
                                          AppendOf("bad", {2, 3, 4}, {0, 0, 0}, 3 * kTokenBytes),
                                          kExhausted, {"3 new sequences", "max_sequences = 4"}),
                               "SEQUENCES_EXHAUSTED needed=3 free=2 total=4"));

  // Token ranges: each bad field named, and a count too large for max_batch refused before
  // anything is expanded (2^31 - 1 tokens would be 16 GiB of parsed tokens).
  cases.push_back(AppendCase("AppendRangeNegativeSeq",
                             WithRanges(AppendOf("bad", {}, {}, kTokenBytes), {{-2, 0, 1}}),
                             kInvalid, {"token_ranges[0].seq = -2"}));
  cases.push_back(AppendCase("AppendRangeNegativeFirst",
                             WithRanges(AppendOf("bad", {2}, {0}, 2 * kTokenBytes), {{2, -1, 1}}),
                             kInvalid, {"token_ranges[0].first = -1"}));
  cases.push_back(
      AppendCase("AppendRangeCountZero",
                 WithRanges(AppendOf("bad", {}, {}, kTokenBytes), {{2, 0, 1}, {3, 0, 0}}), kInvalid,
                 {"token_ranges[1].count = 0"}));
  cases.push_back(
      AppendCase("AppendRangePastTheLastPosition",
                 WithRanges(AppendOf("bad", {}, {}, kTokenBytes), {{2, kInt32Max - 1, 2}}),
                 kInvalid, {"token_ranges[0]", "2147483646"}));
  cases.push_back(
      AppendCase("AppendRangeHugeCount",
                 WithRanges(AppendOf("bad", {}, {}, kTokenBytes), {{2, 0, kInt32Max - 1}}),
                 kInvalid, {"2147483646 tokens", "max_batch = 4"}));
  cases.push_back(AppendCase("AppendRangesAboveMaxBatch",
                             WithRanges(AppendOf("bad", {2}, {0}, 5 * kTokenBytes), {{2, 1, 4}}),
                             kInvalid,
                             {"5 tokens", "1 in tokens", "4 in token_ranges", "max_batch = 4"}));
  // Token ids: negative ones, and a range whose ids do not match its count.
  {
    v1::AppendRequest negative = AppendOf("bad", {2, 2}, {0, 1}, 2 * kTokenBytes);
    negative.mutable_tokens(1)->set_token_id(-3);
    cases.push_back(
        AppendCase("AppendNegativeTokenId", negative, kInvalid, {"tokens[1].token_id = -3"}));
    v1::AppendRequest short_ids = WithRanges(AppendOf("bad", {}, {}, 2 * kTokenBytes), {{2, 0, 2}});
    short_ids.mutable_token_ranges(0)->add_token_ids(4);
    cases.push_back(AppendCase("AppendRangeTokenIdsShort", short_ids, kInvalid,
                               {"token_ranges[0]", "1 token_ids", "count = 2"}));
    v1::AppendRequest negative_range = short_ids;
    negative_range.mutable_token_ranges(0)->add_token_ids(-1);
    cases.push_back(AppendCase("AppendRangeNegativeTokenId", negative_range, kInvalid,
                               {"token_ranges[0].token_ids[1] = -1"}));
  }
  cases.push_back(AppendCase("AppendRangeOverlapsATokenOfTheBatch",
                             WithRanges(AppendOf("bad", {2}, {1}, 3 * kTokenBytes), {{2, 0, 2}}),
                             kInvalid, {"sequence 2"}));
  cases.push_back(AppendCase("AppendRangeRepeatsAStoredPosition",
                             WithRanges(AppendOf("bad", {}, {}, 2 * kTokenBytes), {{1, 1, 2}}),
                             kInvalid, {"sequence 1", "position 1"}));

  // ---- AppendStream ----
  cases.push_back(
      StreamCase("StreamWithoutMessages", {}, kInvalid, {"without a message", "header"}));
  cases.push_back(
      StreamCase("StreamWithoutHeader", {Data(32)}, kInvalid, {"message 0 has no header"}));
  cases.push_back(StreamCase("StreamUnknownCache", {Header("nosuch", {2}, {0}, 32), Data(32)},
                             kNotFound, {"nosuch"}));
  cases.push_back(StreamCase("StreamEmptyCacheName", {Header("", {2}, {0}, 32), Data(32)}, kInvalid,
                             {"cache is empty"}));
  cases.push_back(StreamCase("StreamNegativePayloadBytes", {Header("bad", {2}, {0}, -1)}, kInvalid,
                             {"header.payload_bytes = -1"}));
  cases.push_back(StreamCase("StreamPayloadBytesAboveMax",
                             {Header("bad", {2}, {0}, int64_t{1} << 40), Data(32)}, kInvalid,
                             {"1099511627776", "128"}));
  cases.push_back(StreamCase("StreamPayloadBytesDisagreesWithTokens",
                             {Header("bad", {2, 2}, {0, 1}, 63), Data(63)}, kInvalid,
                             {"header.payload_bytes = 63", "64"}));
  cases.push_back(StreamCase("StreamDataOneByteShort",
                             {Header("bad", {2, 2}, {0, 1}, 64, 32), Data(31)}, kInvalid,
                             {"63", "64"}));
  cases.push_back(StreamCase("StreamDataOneByteLong",
                             {Header("bad", {2, 2}, {0, 1}, 64, 32), Data(32), Data(1)}, kInvalid,
                             {"64", "message 2", "65"}));
  cases.push_back(StreamCase("StreamFirstMessageDataTooLong",
                             {Header("bad", {2, 2}, {0, 1}, 64, 65)}, kInvalid,
                             {"64", "message 0", "65"}));
  cases.push_back(StreamCase("StreamSecondHeader",
                             {Header("bad", {2}, {0}, 32, 16), Header("bad", {2}, {0}, 32, 16)},
                             kInvalid, {"message 1 carries a header"}));
  cases.push_back(
      StreamCase("StreamNoTokens", {Header("bad", {}, {}, 0)}, kInvalid, {"tokens is empty"}));
  cases.push_back(StreamCase("StreamNegativePos", {Header("bad", {2}, {-1}, 32), Data(32)},
                             kInvalid, {"tokens[0].pos = -1"}));
  cases.push_back(StreamCase("StreamBatchAboveMaxBatch",
                             {Header("bad", {2, 2, 2, 2, 2}, {0, 1, 2, 3, 4}, 160), Data(160)},
                             kInvalid, {"160", "max_batch = 4"}));
  cases.push_back(StreamCase("StreamPositionAlreadyStored", {Header("bad", {0}, {2}, 32, 32)},
                             kInvalid, {"already stores position 2"}));
  cases.push_back(StreamCase("StreamBeyondFreeCells",
                             {Header("full", {1, 1}, {3, 4}, 64), Data(64)}, kExhausted,
                             {"1 of 8"}));

  // ---- Read ----
  cases.push_back(ReadCase("ReadUnknownCache", ReadRequest("nosuch", 0), kNotFound, {"nosuch"}));
  cases.push_back(ReadCase("ReadEmptyCacheName", ReadRequest("", 0), kInvalid, {"cache is empty"}));
  cases.push_back(
      ReadCase("ReadMissingSequence", ReadRequest("bad", 7), kNotFound, {"sequence 7", "'bad'"}));
  cases.push_back(ReadCase("ReadNegativeSeq", ReadRequest("bad", -1), kInvalid, {"seq = -1"}));
  cases.push_back(
      ReadCase("ReadNegativeBegin", ReadRequest("bad", 0, -1), kInvalid, {"begin = -1"}));
  cases.push_back(ReadCase("ReadBeginAfterEnd", ReadRequest("bad", 0, 5, 2), kInvalid,
                           {"begin = 5", "end = 2"}));
  cases.push_back(ReadCase("ReadNegativeMaxChunkBytes", ReadRequest("bad", 0, 0, std::nullopt, -1),
                           kInvalid, {"max_chunk_bytes = -1"}));
  cases.push_back(ReadCase("ReadMaxChunkBytesAbove64MiB",
                           ReadRequest("bad", 0, 0, std::nullopt, (64 << 20) + 1), kInvalid,
                           {"max_chunk_bytes = 67108865"}));

  // ---- Visible ----
  cases.push_back(VisibleCase("VisibleUnknownCache", "nosuch", 0, {{0, 0}}, kNotFound, {"nosuch"}));
  cases.push_back(
      VisibleCase("VisibleEmptyCacheName", "", 0, {{0, 0}}, kInvalid, {"cache is empty"}));
  cases.push_back(
      VisibleCase("VisibleGroupOutOfRange", "bad", 1, {{0, 0}}, kInvalid, {"group = 1"}));
  cases.push_back(
      VisibleCase("VisibleGroupNegative", "bad", -1, {{0, 0}}, kInvalid, {"group = -1"}));
  cases.push_back(
      VisibleCase("VisibleNegativeSeq", "bad", 0, {{-1, 0}}, kInvalid, {"queries[0].seq = -1"}));
  cases.push_back(VisibleCase("VisibleNegativePos", "bad", 0, {{0, 1}, {0, -2}}, kInvalid,
                              {"queries[1].pos = -2"}));

  // ---- CopyPrefix ----
  auto copy = [](std::string cache, int64_t src, int64_t dst, int32_t length) {
    return [=](Stub& stub) { return CopyPrefix(stub, cache, src, dst, length); };
  };
  cases.push_back({"CopyPrefixUnknownCache", copy("nosuch", 0, 1, 1), kNotFound, {"nosuch"}});
  cases.push_back({"CopyPrefixEmptyCacheName", copy("", 0, 1, 1), kInvalid, {"cache is empty"}});
  cases.push_back({"CopyPrefixSrcEqualsDst", copy("bad", 0, 0, 2), kInvalid, {"both 0"}});
  cases.push_back({"CopyPrefixNegativeSrc", copy("bad", -1, 1, 2), kInvalid, {"src_seq = -1"}});
  cases.push_back({"CopyPrefixNegativeDst", copy("bad", 0, -3, 2), kInvalid, {"dst_seq = -3"}});
  cases.push_back({"CopyPrefixNegativeLength", copy("bad", 0, 1, -4), kInvalid, {"length = -4"}});
  auto copy_if = [](int64_t src, int32_t length, int32_t require) {
    return [=](Stub& stub) { return CopyPrefix(stub, "bad", src, 1, length, require); };
  };
  cases.push_back({"CopyPrefixSourceShorterThanRequired",
                   copy_if(0, 2, 5),
                   kPrecondition,
                   {"sequence 0", "offset 4", "below the required 5"}});
  cases.push_back({"CopyPrefixSourceGoneSinceIndexed",
                   copy_if(3, 2, 1),
                   kPrecondition,
                   {"sequence 3", "stores nothing"}});
  cases.push_back({"CopyPrefixNegativeRequiredOffset",
                   copy_if(0, 2, -1),
                   kInvalid,
                   {"require_src_offset = -1"}});
  cases.push_back({"CopyPrefixRequiredOffsetOfNothing",
                   copy_if(0, 0, 2),
                   kInvalid,
                   {"require_src_offset = 2", "length = 0"}});
  cases.push_back({"CopyPrefixBeyondMaxSequences",
                   copy("full", 0, 5, 2),
                   kExhausted,
                   {"sequence 5", "max_sequences = 2"}});

  // ---- Reserve ----
  auto reserve = [](std::string cache, int64_t seq, int32_t positions, int64_t ttl_ms) {
    return [=](Stub& stub) { return Reserve(stub, cache, seq, positions, ttl_ms); };
  };
  cases.push_back({"ReserveUnknownCache", reserve("nosuch", 0, 1, 0), kNotFound, {"nosuch"}});
  cases.push_back({"ReserveNegativeSeq", reserve("bad", -2, 1, 0), kInvalid, {"seq = -2"}});
  cases.push_back(
      {"ReserveNegativePositions", reserve("bad", 2, -5, 0), kInvalid, {"positions = -5"}});
  cases.push_back({"ReserveNegativeTtl", reserve("bad", 2, 1, -1), kInvalid, {"ttl_ms = -1"}});
  cases.push_back(
      {"ReserveTtlTooLong", reserve("bad", 2, 1, 3600001), kInvalid, {"ttl_ms = 3600001"}});
  // 16 cells x 4 sequences, 6 used: 58 free.
  cases.push_back(WithShortage({"ReserveMoreCellsThanFree",
                                reserve("bad", 2, 59, 0),
                                kExhausted,
                                {"59 positions of sequence 2", "58 are free"}},
                               "CELLS_EXHAUSTED group=0 needed=59 free=58 total=64"));
  cases.push_back(WithShortage({"ReserveBeyondMaxSequences",
                                reserve("full", 2, 1, 0),
                                kExhausted,
                                {"sequence 2", "max_sequences = 2"}},
                               "SEQUENCES_EXHAUSTED needed=1 free=0 total=2"));

  // ---- SetRetention ----
  auto set_retention = [](std::string cache, int64_t seq, int64_t ttl_ms) {
    return [=](Stub& stub) {
      grpc::ClientContext context;
      SetDeadline(&context);
      v1::SetRetentionRequest request;
      request.set_cache(cache);
      request.set_seq(seq);
      request.set_pinned(true);
      request.set_ttl_ms(ttl_ms);
      v1::SetRetentionResponse response;
      return stub.SetRetention(&context, request, &response);
    };
  };
  cases.push_back(
      {"SetRetentionUnknownCache", set_retention("nosuch", 0, 0), kNotFound, {"nosuch"}});
  cases.push_back(
      {"SetRetentionUnknownSeq", set_retention("bad", 7, 0), kNotFound, {"sequence 7"}});
  cases.push_back({"SetRetentionNegativeSeq", set_retention("bad", -3, 0), kInvalid, {"-3"}});
  cases.push_back(
      {"SetRetentionNegativeTtl", set_retention("bad", 0, -1), kInvalid, {"ttl_ms = -1"}});

  // ---- Remove ----
  auto remove = [](std::string cache, int64_t seq, int32_t begin, std::optional<int32_t> end) {
    return [=](Stub& stub) { return Remove(stub, cache, seq, begin, end); };
  };
  cases.push_back({"RemoveUnknownCache", remove("nosuch", 0, 0, {}), kNotFound, {"nosuch"}});
  cases.push_back({"RemoveEmptyCacheName", remove("", 0, 0, {}), kInvalid, {"cache is empty"}});
  cases.push_back({"RemoveNegativeSeq", remove("bad", -1, 0, {}), kInvalid, {"seq = -1"}});
  cases.push_back({"RemoveNegativeBegin", remove("bad", 0, -2, 3), kInvalid, {"begin = -2"}});
  cases.push_back(
      {"RemoveNegativeBeginTruncate", remove("bad", 0, -2, {}), kInvalid, {"begin = -2"}});
  cases.push_back(
      {"RemoveBeginAfterEnd", remove("bad", 0, 3, 1), kInvalid, {"begin = 3", "end = 1"}});
  cases.push_back({"RemoveMiddleWithRopeNone",
                   remove("norope", 0, 1, 3),
                   grpc::StatusCode::FAILED_PRECONDITION,
                   {"rope NONE", "[1, 3)", "sequence 0"}});

  // ---- CanResume ----
  auto can_resume = [](std::string cache, int64_t seq, int32_t pos) {
    return [=](Stub& stub) {
      bool unused = false;
      return CanResume(stub, cache, seq, pos, &unused);
    };
  };
  cases.push_back({"CanResumeUnknownCache", can_resume("nosuch", 0, 0), kNotFound, {"nosuch"}});
  cases.push_back({"CanResumeEmptyCacheName", can_resume("", 0, 0), kInvalid, {"cache is empty"}});
  cases.push_back({"CanResumeNegativeSeq", can_resume("bad", -1, 0), kInvalid, {"seq = -1"}});
  cases.push_back({"CanResumeNegativePos", can_resume("bad", 0, -7), kInvalid, {"pos = -7"}});

  // ---- LookupPrefix ----
  auto lookup = [](std::string cache, std::vector<int32_t> tokens, int32_t max_matches,
                   v1::LookupScope scope = v1::LOOKUP_SCOPE_LOCAL) {
    return [=](Stub& stub) {
      v1::LookupPrefixResponse unused;
      return LookupPrefix(stub, cache, tokens, &unused, max_matches, scope);
    };
  };
  cases.push_back({"LookupUnknownCache", lookup("nosuch", {1}, 0), kNotFound, {"nosuch"}});
  cases.push_back(
      {"LookupNegativeToken", lookup("bad", {1, 2, -4}, 0), kInvalid, {"tokens[2] = -4"}});
  cases.push_back({"LookupNegativeMaxMatches",
                   lookup("bad", {1}, -1),
                   kInvalid,
                   {"max_matches = -1", "[0, 64]"}});
  cases.push_back(
      {"LookupTooManyMatches", lookup("bad", {1}, 65), kInvalid, {"max_matches = 65", "[0, 64]"}});
  // With the cluster scope the same checks, on the cluster executor.
  cases.push_back({"LookupClusterUnknownCache",
                   lookup("nosuch", {1}, 1, v1::LOOKUP_SCOPE_CLUSTER),
                   kNotFound,
                   {"nosuch"}});
  cases.push_back({"LookupClusterNegativeToken",
                   lookup("bad", {7, -2}, 1, v1::LOOKUP_SCOPE_CLUSTER),
                   kInvalid,
                   {"tokens[1] = -2"}});
  cases.push_back({"LookupClusterTooManyMatches",
                   lookup("bad", {1}, 65, v1::LOOKUP_SCOPE_CLUSTER),
                   kInvalid,
                   {"max_matches = 65", "[0, 64]"}});
  cases.push_back({"LookupUnknownScope",
                   lookup("bad", {1}, 1, static_cast<v1::LookupScope>(9)),
                   kInvalid,
                   {"scope = 9"}});

  AddSnapshotCases(&cases);
  return cases;
}

class BadInputTest : public NodeSuite, public ::testing::WithParamInterface<BadCase> {
 protected:
  static void SetUpTestSuite() {
    StartNode({"--memory-budget=64MiB"});
    if (HasFatalFailure()) return;
    for (const v1::CacheSpec& spec : {BadSpec(), NoRopeSpec(), FullSpec(), HybSpec(), RotSpec()}) {
      KVMESH_ASSERT_OK(CreateCache(stub(), spec));
    }
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(BadSpec(), 0, {0, 1, 2, 3})));
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(BadSpec(), 1, {0, 1})));
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(NoRopeSpec(), 0, {0, 1, 2, 3})));
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(NoRopeSpec(), 0, {4, 5})));
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(FullSpec(), 0, {0, 1, 2, 3})));
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(FullSpec(), 1, {0, 1, 2})));
    v1::SnapshotInfo snapshot;
    KVMESH_ASSERT_OK(Snapshot(stub(), "bad", 0, 2, &snapshot));
    ASSERT_EQ(snapshot.id(), 1u);

    const v1::CacheSpec hyb = HybSpec();
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(hyb, 0, {0, 1, 2, 3})));
    KVMESH_ASSERT_OK(Snapshot(stub(), "hyb", 0, 0, &snapshot));
    ASSERT_EQ(snapshot.id(), 1u);
    KVMESH_ASSERT_OK(Snapshot(stub(), "hyb", 0, 1, &snapshot));
    ASSERT_EQ(snapshot.id(), 2u);
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(hyb, 1, {0, 1})));
    KVMESH_ASSERT_OK(Append(stub(), MakeSpeculativeAppend(hyb, 1, {2, 3})));
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(hyb, 2, {0, 1})));
    KVMESH_ASSERT_OK(Remove(stub(), "hyb", 2, 1));
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(hyb, 3, {0, 1, 2, 3})));
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(hyb, 3, {4, 5})));
    KVMESH_ASSERT_OK(Snapshot(stub(), "hyb", 3, 0, &snapshot));
    ASSERT_EQ(snapshot.id(), 3u);

    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(RotSpec(), 0, {0, 1, 2, 3})));
    KVMESH_ASSERT_OK(Append(stub(), MakeAppend(RotSpec(), 0, {4, 5})));
    KVMESH_ASSERT_OK(Snapshot(stub(), "rot", 0, 0, &snapshot));
    ASSERT_EQ(snapshot.id(), 1u);
  }

  // Everything a client can observe: the caches with spec and usage, and for each cache its
  // sequences and their bytes.
  static std::string State() {
    std::string state;
    v1::ListCachesResponse caches;
    const grpc::Status listed = ListCaches(stub(), &caches);
    EXPECT_TRUE(listed.ok()) << StatusText(listed);
    state += caches.DebugString();
    for (const v1::CacheInfo& info : caches.caches()) {
      v1::GetCacheResponse got;
      const grpc::Status get = GetCache(stub(), info.spec().name(), &got);
      EXPECT_TRUE(get.ok()) << StatusText(get);
      state += got.DebugString();
      v1::ListSequencesResponse seqs;
      const grpc::Status status = ListSequences(stub(), info.spec().name(), &seqs);
      EXPECT_TRUE(status.ok()) << StatusText(status);
      state += seqs.DebugString();
      v1::ListSnapshotsResponse snapshots;
      const grpc::Status listed_snapshots = ListSnapshots(stub(), info.spec().name(), &snapshots);
      EXPECT_TRUE(listed_snapshots.ok()) << StatusText(listed_snapshots);
      state += snapshots.DebugString();
      for (const v1::SequenceInfo& seq : seqs.sequences()) {
        ReadOutput out;
        const grpc::Status read = Read(stub(), ReadRequest(info.spec().name(), seq.seq()), &out);
        EXPECT_TRUE(read.ok()) << StatusText(read);
        absl::StrAppend(&state, "seq ", seq.seq(), ": ", out.header.DebugString(), out.payload);
      }
    }
    return state;
  }
};

TEST_P(BadInputTest, FailsWithItsCodeNamesTheValueAndChangesNothing) {
  const BadCase& c = GetParam();
  const std::string before = State();
  ASSERT_THAT(before, HasSubstr("sequences_live: 2"));  // the fixture's data is there

  const grpc::Status status = c.call(stub());
  EXPECT_EQ(status.error_code(), c.code) << StatusText(status);
  for (const std::string& part : c.message_has) {
    EXPECT_THAT(status.error_message(), HasSubstr(part));
  }
  if (!c.shortage.empty()) {
    EXPECT_EQ(ShortageText(status), c.shortage);
  }
  const std::string after = State();
  EXPECT_TRUE(after == before) << "the node's state changed; before:\n"
                               << before << "\nafter:\n"
                               << after;
}

INSTANTIATE_TEST_SUITE_P(AllRpcs, BadInputTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
