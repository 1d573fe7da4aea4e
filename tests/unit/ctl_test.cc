// Unit tests of kvmeshctl's helpers: shorthand parsers, argument parsing, pattern payloads, the
// output of the cluster commands.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/common/convert.h"
#include "service/ctl/args.h"
#include "service/ctl/connection.h"
#include "service/ctl/format.h"
#include "service/ctl/parse.h"
#include "service/ctl/payload.h"

namespace kvmesh {
namespace ctl {
namespace {

using ::testing::ElementsAre;

TEST(ParseGroupTest, FullLlamaGroup) {
  auto g = ParseGroup("attention:layers=32,heads=8,head_dim=128,window=full,rope=neox:128:500000");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->num_layers(), 32);
  EXPECT_EQ(g->attention().num_kv_heads(), 8);
  EXPECT_EQ(g->attention().head_dim_k(), 128);
  EXPECT_EQ(g->attention().head_dim_v(), 128);
  EXPECT_TRUE(g->attention().window().has_full());
  EXPECT_EQ(g->attention().rope().type(), v1::ROPE_TYPE_NEOX);
  EXPECT_EQ(g->attention().rope().dims(), 128);
  EXPECT_EQ(g->attention().rope().base(), 500000.0f);
  EXPECT_EQ(g->attention().rope().freq_scale(), 1.0f);
}

TEST(ParseGroupTest, SlidingChunkedAndDefaults) {
  auto s = ParseGroup(
      "attention:layers=4,heads=2,head_dim_k=64,head_dim_v=32,window=sliding:1024:2048,rope="
      "normal");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->attention().window().sliding().window(), 1024);
  EXPECT_EQ(s->attention().window().sliding().memory(), 2048);
  EXPECT_EQ(s->attention().head_dim_v(), 32);
  EXPECT_EQ(s->attention().rope().type(), v1::ROPE_TYPE_NORMAL);
  EXPECT_EQ(s->attention().rope().dims(), 64);  // defaults to head_dim_k
  EXPECT_EQ(s->attention().rope().base(), 10000.0f);

  auto c = ParseGroup("attention:layers=1,heads=1,head_dim=8,window=chunked:16,rope=none");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->attention().window().chunked().chunk(), 16);
  EXPECT_FALSE(c->attention().has_rope());

  auto d = ParseGroup("attention:layers=1,heads=1,head_dim=8");
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->attention().window().has_full());
  EXPECT_FALSE(d->attention().has_rope());
}

TEST(ParseGroupTest, RejectsWithTheBadPart) {
  for (const char* bad : {"mamba:layers=1", "attention", "attention:layers=x", "attention:foo=1",
                          "attention:window=sliding", "attention:window=chunked:1:2",
                          "attention:rope=yarn", "attention:rope=neox:1:2:3:4"}) {
    auto g = ParseGroup(bad);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_THAT(std::string(ParseGroup("attention:foo=1").status().message()),
              ::testing::HasSubstr("foo"));
}

TEST(ParseGroupTest, Rotating) {
  auto g = ParseGroup("rotating:layers=4,heads=2,head_dim=64,max_size=512,rope=neox:32:1e6");
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(g->has_rotating());
  EXPECT_EQ(g->num_layers(), 4);
  EXPECT_EQ(g->rotating().num_kv_heads(), 2);
  EXPECT_EQ(g->rotating().head_dim_k(), 64);
  EXPECT_EQ(g->rotating().head_dim_v(), 64);
  EXPECT_EQ(g->rotating().max_size(), 512);
  EXPECT_EQ(g->rotating().rope().type(), v1::ROPE_TYPE_NEOX);
  EXPECT_EQ(g->rotating().rope().dims(), 32);
  EXPECT_EQ(g->rotating().rope().base(), 1e6f);

  auto d = ParseGroup(
      "rotating:layers=1,kv_heads=1,head_dim_k=16,head_dim_v=8,max_size=4,"
      "rope=normal");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->rotating().head_dim_v(), 8);
  EXPECT_EQ(d->rotating().rope().dims(), 16);  // defaults to head_dim_k
  auto n = ParseGroup("rotating:layers=1,heads=1,head_dim=8,max_size=4");
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_FALSE(n->rotating().has_rope());
}

TEST(ParseGroupTest, Recurrent) {
  auto conv = ParseGroup("recurrent:layers=10,conv_tail=2,conv_dim=2048");
  ASSERT_TRUE(conv.ok()) << conv.status();
  ASSERT_TRUE(conv->has_recurrent());
  EXPECT_EQ(conv->num_layers(), 10);
  EXPECT_EQ(conv->recurrent().conv_tail(), 2);
  EXPECT_EQ(conv->recurrent().conv_dim(), 2048);
  EXPECT_EQ(conv->recurrent().num_v_heads(), 0);

  auto delta = ParseGroup(
      "recurrent:layers=3,conv_tail=3,conv_dim=8192,v_heads=32,head_v_dim=128,head_k_dim=64");
  ASSERT_TRUE(delta.ok()) << delta.status();
  EXPECT_EQ(delta->recurrent().num_v_heads(), 32);
  EXPECT_EQ(delta->recurrent().head_v_dim(), 128);
  EXPECT_EQ(delta->recurrent().head_k_dim(), 64);
}

TEST(ParseGroupTest, NewKindsRejectWithKeyAndValue) {
  struct Case {
    const char* text;
    const char* want;  // substring of the message
  };
  for (const Case& c : std::vector<Case>{
           {"rotating:layers=1,heads=1,head_dim=8", "max_size"},
           {"rotating:layers=1,heads=1,head_dim=8,max_size=big",
            "max_size is not an integer: 'big'"},
           {"rotating:layers=1,heads=1,head_dim=8,max_size=4,window=full", "'window'"},
           {"rotating:layers=1,heads=1,head_dim=8,max_size=4,rope=yarn", "yarn"},
           {"recurrent:layers=1,conv_tail=2", "conv_dim"},
           {"recurrent:layers=1,conv_tail=2,conv_dim=abc", "conv_dim is not an integer: 'abc'"},
           {"recurrent:layers=1,conv_tail=x2,conv_dim=4", "conv_tail is not an integer: 'x2'"},
           {"recurrent:layers=1,conv_tail=2,conv_dim=4,heads=2", "'heads'"},
           {"recurrent:layers=1,conv_tail=2,conv_dim=4,v_heads=2", "head_v_dim and head_k_dim"},
           {"recurrent:layers=1,conv_tail=2,conv_dim=4,head_k_dim=2", "v_heads > 0"},
           {"recurrent:layers=1,conv_tail=2,conv_dim=4,v_heads=z",
            "v_heads is not an integer: 'z'"},
           {"recurrent:layers=1,conv_tail", "'conv_tail' is not KEY=VALUE"},
           {"attention:layers=1,max_size=4", "'max_size'"},
           {"lstm:layers=1", "'attention:', 'rotating:' or 'recurrent:'"},
       }) {
    auto g = ParseGroup(c.text);
    ASSERT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(g.status().message()), ::testing::HasSubstr(c.want)) << c.text;
  }
}

TEST(ParseGroupTest, HybridSpecConverts) {
  v1::CacheSpec proto;
  proto.set_name("lfm2");
  proto.set_dtype(v1::DTYPE_BF16);
  proto.set_max_sequences(4);
  proto.set_capacity(256);
  proto.set_max_batch(64);
  *proto.add_groups() = *ParseGroup("attention:layers=6,heads=8,head_dim=64,rope=neox:64:1000000");
  *proto.add_groups() = *ParseGroup("recurrent:layers=10,conv_tail=2,conv_dim=2048");
  *proto.add_groups() = *ParseGroup("rotating:layers=2,heads=2,head_dim=16,max_size=32");
  auto spec = SpecFromProto(proto);
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_EQ(spec->groups.size(), 3u);
  EXPECT_EQ(spec->groups[1].kind, GroupKind::kRecurrent);
  EXPECT_EQ(spec->groups[1].recurrent.conv_dim, 2048);
  EXPECT_EQ(spec->groups[2].kind, GroupKind::kRotating);
  EXPECT_EQ(spec->groups[2].rotating.max_size, 32);
}

TEST(ParseDTypeTest, Names) {
  EXPECT_EQ(*ParseDType("f16"), v1::DTYPE_F16);
  EXPECT_EQ(*ParseDType("BF16"), v1::DTYPE_BF16);
  EXPECT_EQ(*ParseDType("DTYPE_F32"), v1::DTYPE_F32);
  EXPECT_EQ(ParseDType("f8").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParsePositionsTest, RangesAndLists) {
  EXPECT_THAT(*ParsePositions("0:3"), ElementsAre(0, 1, 2));
  EXPECT_THAT(*ParsePositions("5,0:2,9"), ElementsAre(5, 0, 1, 9));
  for (const char* bad : {"", "3:3", "4:2", "-1:2", "a", "1:2:3", ","}) {
    EXPECT_EQ(ParsePositions(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// Found by tests/fuzz/ctl_parse_fuzzer (regressions/ctl_parse_fuzzer/positions-beyond-max-batch):
// "5:25572557" expanded to 25 million positions, and "0:2000000000" would have taken 8 GB before
// the server refused the batch. A list is refused, before any range is expanded, once it names
// more positions than the largest max_batch.
TEST(ParsePositionsTest, NoMorePositionsThanAnAppendTakes) {
  EXPECT_EQ(kMaxPositions, kMaxCellsPerGroup);
  auto refused = ParsePositions("5:25572557");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("more than 16777216 positions"));
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("'5:25572557'"));
  EXPECT_EQ(ParsePositions("0:2147483647").status().code(), absl::StatusCode::kInvalidArgument);
  // Counted over the whole list: 2 + 16777215 is one too many.
  auto total = ParsePositions("1,2,0:16777215");
  EXPECT_EQ(total.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(total.status().message()), ::testing::HasSubstr("'0:16777215'"));
  EXPECT_THAT(*ParsePositions("1,0:16"), ::testing::SizeIs(17));
}

TEST(FormatPositionsTest, Ranges) {
  EXPECT_EQ(FormatPositions({}), "-");
  EXPECT_EQ(FormatPositions({0, 1, 2, 5, 7, 8}), "0-2,5,7-8");
}

TEST(FormatRangesTest, SameTextAsThePositions) {
  google::protobuf::RepeatedPtrField<v1::PositionRange> ranges;
  EXPECT_EQ(FormatRanges(ranges), "-");
  for (const auto& [first, last] : std::vector<std::pair<int32_t, int32_t>>{
           {0, 2}, {5, 5}, {7, 8}, {INT32_MAX - 1, INT32_MAX}}) {
    v1::PositionRange* range = ranges.Add();
    range->set_first(first);
    range->set_last(last);
  }
  EXPECT_EQ(FormatRanges(ranges), "0-2,5,7-8,2147483646-2147483647");
}

TEST(ArgsTest, FlagsAnywhereRepeatedAndBool) {
  const char* argv[] = {"kvmeshctl", "--json",   "create", "--group=a", "--group",
                        "b",         "--stream", "--name", "x"};
  auto args = Args::Parse(9, argv, {"json", "stream"});
  ASSERT_TRUE(args.ok());
  EXPECT_EQ(args->command(), "create");
  EXPECT_TRUE(*args->GetBool("json"));
  EXPECT_TRUE(*args->GetBool("stream"));
  EXPECT_THAT(args->GetAll("group"), ElementsAre("a", "b"));
  EXPECT_EQ(*args->GetString("name"), "x");
  EXPECT_TRUE(args->CheckAllowed({"json", "stream", "group", "name"}).ok());
  EXPECT_EQ(args->CheckAllowed({"json"}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ArgsTest, TypedValuesAndErrors) {
  const char* argv[] = {"x", "--n=12", "--t=250ms", "--s=2.5", "--b=64KiB", "--bad=zz", "--last"};
  auto args = Args::Parse(7, argv, {});
  ASSERT_TRUE(args.ok());
  EXPECT_EQ(*args->GetInt("n"), 12);
  EXPECT_EQ(*args->GetInt("missing", 7), 7);
  EXPECT_EQ(args->GetInt("missing").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*args->GetDuration("t", std::nullopt), absl::Milliseconds(250));
  EXPECT_EQ(*args->GetDuration("s", std::nullopt), absl::Milliseconds(2500));
  EXPECT_EQ(*args->GetBytes("b"), 65536);
  EXPECT_EQ(args->GetInt("bad").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(args->GetBytes("bad").status().code(), absl::StatusCode::kInvalidArgument);
  // --last has no value: reported after the names are known to be allowed.
  absl::Status s = args->CheckAllowed({"n", "t", "s", "b", "bad", "last"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("--last needs a value"));
}

CacheSpec TwoGroupSpec() {
  v1::CacheSpec proto;
  proto.set_name("t");
  proto.set_dtype(v1::DTYPE_BF16);
  proto.set_max_sequences(2);
  proto.set_capacity(64);
  proto.set_max_batch(16);
  *proto.add_groups() = *ParseGroup("attention:layers=2,heads=2,head_dim=4,rope=neox");
  *proto.add_groups() =
      *ParseGroup("attention:layers=1,heads=1,head_dim_k=8,head_dim_v=2,window=sliding:4");
  return *SpecFromProto(proto);
}

TEST(PatternTest, ReadOfAnyBatchingVerifies) {
  const CacheSpec spec = TwoGroupSpec();
  const std::string all = MakePatternPayload(spec, {3, 4, 5, 6}, 9);
  ASSERT_EQ(all.size(), AppendPayloadBytes(spec, 4, 1));
  // Group 0 returns positions 3..6, group 1 only 5..6: a Read payload built from batches.
  const std::string a = MakePatternPayload(spec, {3, 4}, 9);
  const std::string b = MakePatternPayload(spec, {5, 6}, 9);
  const size_t g0_row = GroupTokenBytes(spec, 0) / 2 / 2;  // one layer's K row (K == V size)
  std::string read;
  for (int layer = 0; layer < 2; ++layer) {
    for (int plane = 0; plane < 2; ++plane) {
      read += a.substr((layer * 2 + plane) * 2 * g0_row, 2 * g0_row);
      read += b.substr((layer * 2 + plane) * 2 * g0_row, 2 * g0_row);
    }
  }
  read += b.substr(4 * 2 * g0_row);  // group 1 of the second batch
  PatternCheck ok = CheckPatternPayload(
      spec, {{3, 4, 5, 6}, {5, 6}},
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(read.data()), read.size()), 9);
  EXPECT_EQ(ok.mismatches, 0u) << ok.first_mismatch;
  EXPECT_EQ(ok.elements, read.size() / 2);

  PatternCheck other = CheckPatternPayload(
      spec, {{3, 4, 5, 6}, {5, 6}},
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(read.data()), read.size()), 10);
  EXPECT_GT(other.mismatches, other.elements / 2);

  read[read.size() - 1] ^= 1;
  PatternCheck one = CheckPatternPayload(
      spec, {{3, 4, 5, 6}, {5, 6}},
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(read.data()), read.size()), 9);
  EXPECT_EQ(one.mismatches, 1u);
  EXPECT_EQ(one.first_mismatch, "group 1 layer 0 V pos 6 element 1");

  PatternCheck short_payload = CheckPatternPayload(
      spec, {{3}, {}}, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(read.data()), 2), 9);
  EXPECT_GT(short_payload.mismatches, 0u);
}

TEST(PatternTest, SliceTokensEqualsPatternOfTheSlice) {
  const CacheSpec spec = TwoGroupSpec();
  const std::string all = MakePatternPayload(spec, {0, 1, 2, 3, 4}, 1);
  const std::string slice = SliceTokens(
      spec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(all.data()), all.size()), 5, 1, 4);
  EXPECT_EQ(slice, MakePatternPayload(spec, {1, 2, 3}, 1));
}

// Attention (2 layers) + Rotating (window 3) + Recurrent (2 layers, conv and delta), f16.
CacheSpec HybridSpec() {
  CacheSpec spec;
  spec.name = "h";
  spec.dtype = DType::kF16;
  spec.max_sequences = 2;
  spec.capacity = 64;
  spec.max_batch = 8;
  GroupSpec att;
  att.num_layers = 2;
  att.kind = GroupKind::kAttention;
  att.attention.num_kv_heads = 1;
  att.attention.head_dim_k = 4;
  att.attention.head_dim_v = 4;
  GroupSpec rot;
  rot.num_layers = 1;
  rot.kind = GroupKind::kRotating;
  rot.rotating.num_kv_heads = 1;
  rot.rotating.head_dim_k = 2;
  rot.rotating.head_dim_v = 2;
  rot.rotating.max_size = 3;
  GroupSpec rec;
  rec.num_layers = 2;
  rec.kind = GroupKind::kRecurrent;
  rec.recurrent.conv_tail = 2;
  rec.recurrent.conv_dim = 3;
  rec.recurrent.num_v_heads = 1;
  rec.recurrent.head_v_dim = 2;
  rec.recurrent.head_k_dim = 2;
  spec.groups = {att, rot, rec};
  return spec;
}

// Group g's section of an Append payload of `tokens` tokens and `states` recurrent states.
std::string Section(const CacheSpec& spec, const std::string& payload, size_t tokens, size_t states,
                    int g) {
  size_t begin = 0;
  for (int i = 0; i < g; ++i) {
    begin += GroupTokenBytes(spec, i) * tokens + GroupStateBytes(spec, i) * states;
  }
  return payload.substr(begin,
                        GroupTokenBytes(spec, g) * tokens + GroupStateBytes(spec, g) * states);
}

absl::Span<const uint8_t> Bytes(const std::string& s) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

TEST(PatternTest, HybridPayloadSizesAndStates) {
  const CacheSpec spec = HybridSpec();
  ASSERT_TRUE(ValidateSpec(spec).ok()) << ValidateSpec(spec);
  EXPECT_TRUE(HasRecurrentGroup(spec));
  EXPECT_FALSE(HasRecurrentGroup(TwoGroupSpec()));
  const size_t state = GroupStateBytes(spec, 2);
  ASSERT_EQ(state, 2u * (2 * 3 * 2 + 1 * 2 * 2 * 4));

  const std::string plain = MakePatternPayload(spec, {5, 6, 7}, 4);
  EXPECT_EQ(plain.size(), AppendPayloadBytes(spec, 3, 1));
  const std::string spec_payload = MakePatternPayload(spec, {5, 6, 7}, 4, /*speculative=*/true);
  EXPECT_EQ(spec_payload.size(), AppendPayloadBytes(spec, 3, 1, true));
  EXPECT_TRUE(MakePatternPayload(spec, {}, 4).empty());

  // K/V sections do not depend on speculation.
  for (int g = 0; g < 2; ++g) {
    EXPECT_EQ(Section(spec, plain, 3, 1, g), Section(spec, spec_payload, 3, 3, g)) << g;
  }
  // The speculative state after the token at position p is the plain state of a batch ending
  // at p: the state depends on (seed, offset reached) only.
  const std::string spec_states = Section(spec, spec_payload, 3, 3, 2);
  const size_t layer_state = state / 2;
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> upto;
    for (int32_t p = 0; p <= 5 + i; ++p) upto.push_back(p);
    const std::string states = Section(spec, MakePatternPayload(spec, upto, 4), upto.size(), 1, 2);
    for (int layer = 0; layer < 2; ++layer) {
      EXPECT_EQ(states.substr(layer * layer_state, layer_state),
                spec_states.substr((layer * 3 + i) * layer_state, layer_state))
          << "token " << i << " layer " << layer;
    }
  }
  // Different layers, seeds and offsets give different states.
  const std::string at8 = Section(spec, plain, 3, 1, 2);
  EXPECT_NE(at8.substr(0, layer_state), at8.substr(layer_state));
  EXPECT_NE(at8, Section(spec, MakePatternPayload(spec, {5, 6, 7}, 5), 3, 1, 2));
  EXPECT_NE(at8, Section(spec, MakePatternPayload(spec, {5, 6}, 4), 2, 1, 2));
}

TEST(PatternTest, HybridReadVerifies) {
  const CacheSpec spec = HybridSpec();
  // A sequence appended as [0, 3) then [3, 5) with seed 7: offset 5. The Read holds the
  // Attention positions 0..4, the Rotating window 2..4 and the Recurrent state at offset 5.
  const std::string first = MakePatternPayload(spec, {0, 1, 2}, 7);
  const std::string second = MakePatternPayload(spec, {3, 4}, 7);
  const std::string window = MakePatternPayload(spec, {2, 3, 4}, 7);
  const std::string all = MakePatternPayload(spec, {0, 1, 2, 3, 4}, 7);
  const std::string read =
      Section(spec, all, 5, 1, 0) + Section(spec, window, 3, 1, 1) + Section(spec, second, 2, 1, 2);
  const std::vector<std::vector<int32_t>> positions = {{0, 1, 2, 3, 4}, {2, 3, 4}, {}};
  PatternCheck ok =
      CheckPatternPayload(spec, positions, {std::nullopt, std::nullopt, 5}, Bytes(read), 7);
  EXPECT_EQ(ok.mismatches, 0u) << ok.first_mismatch;
  EXPECT_EQ(ok.elements, 2u * 8 * 5 + 1u * 4 * 3 + 2u * (6 + 4));

  // The state of the first Append belongs to offset 3: checking it as offset 5 fails.
  const std::string stale =
      Section(spec, all, 5, 1, 0) + Section(spec, window, 3, 1, 1) + Section(spec, first, 3, 1, 2);
  PatternCheck wrong_state =
      CheckPatternPayload(spec, positions, {std::nullopt, std::nullopt, 5}, Bytes(stale), 7);
  EXPECT_GT(wrong_state.mismatches, 10u);
  EXPECT_THAT(wrong_state.first_mismatch,
              ::testing::HasSubstr("group 2 layer 0 conv state (offset 5)"));
  PatternCheck as_three =
      CheckPatternPayload(spec, positions, {std::nullopt, std::nullopt, 3}, Bytes(stale), 7);
  EXPECT_EQ(as_three.mismatches, 0u) << as_three.first_mismatch;

  // One flipped byte in the last layer's delta state.
  std::string flipped = read;
  flipped[flipped.size() - 1] ^= 0x40;
  PatternCheck delta =
      CheckPatternPayload(spec, positions, {std::nullopt, std::nullopt, 5}, Bytes(flipped), 7);
  EXPECT_EQ(delta.mismatches, 1u);
  EXPECT_EQ(delta.first_mismatch, "group 2 layer 1 delta state (offset 5) element 3");

  // A rotating row from another seed.
  const std::string other_window = MakePatternPayload(spec, {2, 3, 4}, 8);
  const std::string bad_window = Section(spec, all, 5, 1, 0) +
                                 Section(spec, other_window, 3, 1, 1) +
                                 Section(spec, second, 2, 1, 2);
  PatternCheck rot =
      CheckPatternPayload(spec, positions, {std::nullopt, std::nullopt, 5}, Bytes(bad_window), 7);
  EXPECT_GT(rot.mismatches, 0u);
  EXPECT_THAT(rot.first_mismatch, ::testing::HasSubstr("group 1 layer 0 K pos 2"));

  // A state the header does not announce (or one announced but missing): a size mismatch.
  PatternCheck unannounced = CheckPatternPayload(spec, positions, Bytes(read), 7);
  EXPECT_EQ(unannounced.mismatches, unannounced.elements);
  EXPECT_THAT(unannounced.first_mismatch, ::testing::HasSubstr("bytes"));
  const std::string no_state = Section(spec, all, 5, 1, 0) + Section(spec, window, 3, 1, 1);
  PatternCheck missing =
      CheckPatternPayload(spec, positions, {std::nullopt, std::nullopt, 5}, Bytes(no_state), 7);
  EXPECT_EQ(missing.mismatches, missing.elements);
  EXPECT_GT(missing.elements, 0u);
  // Without the state (a Read whose range stops before the offset) the rest verifies.
  PatternCheck kv_only = CheckPatternPayload(spec, positions, Bytes(no_state), 7);
  EXPECT_EQ(kv_only.mismatches, 0u) << kv_only.first_mismatch;
}

TEST(PatternTest, HybridSliceTokens) {
  const CacheSpec spec = HybridSpec();
  const std::string spec_all = MakePatternPayload(spec, {0, 1, 2, 3, 4}, 3, true);
  EXPECT_EQ(SliceTokens(spec, Bytes(spec_all), 5, 1, 4, true),
            MakePatternPayload(spec, {1, 2, 3}, 3, true));
  // A plain batch holds one state (after its last token): the slice that ends the batch is
  // exact, earlier slices carry that same final state.
  const std::string plain = MakePatternPayload(spec, {0, 1, 2, 3, 4}, 3);
  EXPECT_EQ(SliceTokens(spec, Bytes(plain), 5, 2, 5), MakePatternPayload(spec, {2, 3, 4}, 3));
  const std::string head = SliceTokens(spec, Bytes(plain), 5, 0, 2);
  EXPECT_EQ(head.size(), AppendPayloadBytes(spec, 2, 1));
  EXPECT_EQ(Section(spec, head, 2, 1, 2), Section(spec, plain, 5, 1, 2));
  EXPECT_EQ(Section(spec, head, 2, 1, 0),
            Section(spec, MakePatternPayload(spec, {0, 1}, 3), 2, 1, 0));
}

TEST(Fnv1aTest, KnownValuesAndChunking) {
  const std::string s = "foobar";
  auto span = [](const std::string& x) {
    return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(x.data()), x.size());
  };
  EXPECT_EQ(Fnv1a64(span("")), 0xcbf29ce484222325ull);
  EXPECT_EQ(Fnv1a64(span("a")), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(Fnv1a64(span(s)), 0x85944171f73967e8ull);
  EXPECT_EQ(Fnv1a64(span("bar"), Fnv1a64(span("foo"))), Fnv1a64(span(s)));
}

TEST(ClusterFormatTest, TransferLine) {
  v1::TransferStats stats;
  stats.set_transport("grpc-stream");
  stats.set_bytes(int64_t{64} << 20);
  stats.set_micros(75300);
  EXPECT_EQ(TransferLine(stats), "grpc-stream, 64.0 MiB in 75.3 ms, 0.89 GB/s");
  stats.set_transport("nccl");
  stats.set_bytes(4096);
  stats.set_micros(0);
  EXPECT_EQ(TransferLine(stats), "nccl, 4096 B in 0.0 ms");
  EXPECT_EQ(TransferLine(v1::TransferStats()), "?, 0 B in 0.0 ms");
}

TEST(TokenRangesTest, TokenIdsRideAlongWithTheirRanges) {
  google::protobuf::RepeatedPtrField<v1::TokenRange> ranges;
  AddTokenRanges(7, {0, 1, 2, 5, 6}, &ranges, {10, 11, 12, 15, 16});
  ASSERT_EQ(ranges.size(), 2);
  EXPECT_THAT(ranges[0].token_ids(), ElementsAre(10, 11, 12));
  EXPECT_THAT(ranges[1].token_ids(), ElementsAre(15, 16));
  google::protobuf::RepeatedPtrField<v1::Token> tokens;
  v1::Token* t = tokens.Add();
  t->set_seq(1);
  t->set_pos(4);
  t->set_token_id(0);  // id 0 is an id: presence, not the value, says whether one was given
  tokens.Add()->set_seq(1);
  tokens[1].set_pos(5);
  absl::StatusOr<std::vector<Token>> got = TokensFromProto(tokens, ranges, 8);
  ASSERT_TRUE(got.ok()) << got.status();
  std::vector<int32_t> ids;
  for (const Token& token : *got) ids.push_back(token.id);
  EXPECT_THAT(ids, ElementsAre(0, kNoTokenId, 10, 11, 12, 15, 16));
}

TEST(TokenRangesTest, RunsOfPositionsRoundTrip) {
  google::protobuf::RepeatedPtrField<v1::TokenRange> ranges;
  AddTokenRanges(7, {}, &ranges);
  EXPECT_TRUE(ranges.empty());
  AddTokenRanges(7, {0, 1, 2, 5, 6, 9}, &ranges);
  AddTokenRanges(3, {2147483646}, &ranges);  // the last position there is
  ASSERT_EQ(ranges.size(), 4);
  EXPECT_EQ(ranges[0].first(), 0);
  EXPECT_EQ(ranges[0].count(), 3);
  EXPECT_EQ(ranges[1].first(), 5);
  EXPECT_EQ(ranges[1].count(), 2);
  EXPECT_EQ(ranges[2].first(), 9);
  EXPECT_EQ(ranges[2].count(), 1);
  EXPECT_EQ(ranges[3].seq(), 3);
  google::protobuf::RepeatedPtrField<v1::Token> tokens;
  v1::Token* t = tokens.Add();
  t->set_seq(1);
  t->set_pos(4);
  EXPECT_EQ(CountTokens(tokens, ranges, 100), 8);
  EXPECT_EQ(CountTokens(tokens, ranges, 5), 5);  // capped
  absl::StatusOr<std::vector<Token>> got = TokensFromProto(tokens, ranges, 8);
  ASSERT_TRUE(got.ok()) << got.status();
  std::vector<std::pair<int64_t, int32_t>> pairs;
  for (const Token& token : *got) pairs.emplace_back(token.seq, token.pos);
  EXPECT_THAT(
      pairs,
      ElementsAre(std::pair<int64_t, int32_t>{1, 4}, std::pair<int64_t, int32_t>{7, 0},
                  std::pair<int64_t, int32_t>{7, 1}, std::pair<int64_t, int32_t>{7, 2},
                  std::pair<int64_t, int32_t>{7, 5}, std::pair<int64_t, int32_t>{7, 6},
                  std::pair<int64_t, int32_t>{7, 9}, std::pair<int64_t, int32_t>{3, 2147483646}));
  // One more than max_batch: refused before anything is expanded.
  got = TokensFromProto(tokens, ranges, 7);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr("8 tokens"));
  // A range reaching position 2^31 - 1, where an offset would overflow.
  ranges[3].set_count(2);
  got = TokensFromProto(tokens, ranges, 100);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr("token_ranges[3]"));
  // A count of INT32_MAX does not overflow the sum.
  ranges[3].set_first(0);
  ranges[3].set_count(2147483647);
  EXPECT_EQ(CountTokens(tokens, ranges, int64_t{1} << 40), 7 + int64_t{2147483647});
}

TEST(ClusterFormatTest, ShortageLine) {
  EXPECT_EQ(ShortageLine({Resource::kCells, 0, 8, 7, 8}),
            "CELLS_EXHAUSTED in group 0: needed 8, free 7 of 8");
  EXPECT_EQ(ShortageLine({Resource::kSequences, -1, 1, 0, 2}),
            "SEQUENCES_EXHAUSTED: needed 1, free 0 of 2");
  // kvmeshctl gets it from the gRPC status: the details' round trip.
  const Shortage sent{Resource::kInflightBytes, -1, 1 << 20, 4096, 64 << 20};
  const absl::Status back = FromGrpcStatus(ToGrpcStatus(ResourceExhaustedWith("full", sent)));
  EXPECT_EQ(back.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(back.message(), "full");
  const std::optional<Shortage> got = GetShortage(back);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(ShortageLine(*got), "INFLIGHT_BUDGET_EXHAUSTED: needed 1048576, free 4096 of 67108864");
  // Details that are not kvmesh's, or not whole, are no shortage.
  google::rpc::ErrorInfo info = ShortageToErrorInfo(sent);
  ASSERT_TRUE(ShortageFromErrorInfo(info).has_value());
  info.set_reason("QUOTA_EXCEEDED");
  EXPECT_FALSE(ShortageFromErrorInfo(info).has_value());
  info = ShortageToErrorInfo(sent);
  info.set_domain("googleapis.com");
  EXPECT_FALSE(ShortageFromErrorInfo(info).has_value());
  info = ShortageToErrorInfo(sent);
  (*info.mutable_metadata())["free"] = "lots";
  EXPECT_FALSE(ShortageFromErrorInfo(info).has_value());
  info.mutable_metadata()->erase("free");
  EXPECT_FALSE(ShortageFromErrorInfo(info).has_value());
}

TEST(ClusterFormatTest, NodeResultLine) {
  v1::NodeResult ok;
  ok.set_node("a");
  EXPECT_EQ(NodeResultLine(ok), "a: OK");
  v1::NodeResult missing;
  missing.set_node("b");
  missing.set_code(static_cast<int>(absl::StatusCode::kNotFound));
  missing.set_message("cache 'x' does not exist");
  EXPECT_EQ(NodeResultLine(missing), "b: NOT_FOUND: cache 'x' does not exist");
}

TEST(ClusterFormatTest, MembersTable) {
  v1::ListMembersResponse response;
  v1::Member* a = response.add_members();
  a->set_name("a");
  a->set_address("10.0.0.1:7700");
  a->set_self(true);
  a->set_health(v1::MEMBER_HEALTH_SERVING);
  a->set_backend("cuda:0");
  a->add_transports("grpc-stream");
  a->add_transports("nccl");
  a->set_boot_id("0123456789abcdef0123456789abcdef");
  a->set_start_time_unix_ms(1795000000000);  // 2026-11-18T11:06:40Z
  v1::Member* b = response.add_members();
  b->set_name("node-b");
  b->set_address("10.0.0.2:7700");
  b->set_health(v1::MEMBER_HEALTH_UNREACHABLE);
  b->set_detail("DEADLINE_EXCEEDED: Deadline Exceeded");
  EXPECT_EQ(MembersTable(response),
            "NAME    ADDRESS        HEALTH       BACKEND  TRANSPORTS        BOOT      STARTED    "
            "           DETAIL\n"
            "a *     10.0.0.1:7700  SERVING      cuda:0   grpc-stream,nccl  01234567  "
            "2026-11-18T11:06:40Z  -\n"
            "node-b  10.0.0.2:7700  UNREACHABLE  -        -                 -         -         "
            "            DEADLINE_EXCEEDED: Deadline Exceeded\n");
  EXPECT_EQ(MemberHealthText(v1::MEMBER_HEALTH_NOT_SERVING), "NOT_SERVING");
  EXPECT_EQ(MemberHealthText(v1::MEMBER_HEALTH_UNKNOWN), "UNKNOWN");
}

TEST(ClusterFormatTest, ParseRemoveScope) {
  EXPECT_EQ(*ParseRemoveScope("cluster"), v1::REMOVE_SCOPE_CLUSTER);
  EXPECT_EQ(*ParseRemoveScope("CLUSTER"), v1::REMOVE_SCOPE_CLUSTER);
  EXPECT_EQ(*ParseRemoveScope("REMOVE_SCOPE_CLUSTER"), v1::REMOVE_SCOPE_CLUSTER);
  EXPECT_EQ(*ParseRemoveScope("local"), v1::REMOVE_SCOPE_LOCAL);
  auto bad = ParseRemoveScope("global");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "--scope='global': expected local or cluster");
}

// A file with `content` under $TEST_TMPDIR or /tmp, removed with the object.
class TempFile {
 public:
  explicit TempFile(const std::string& content) {
    const char* dir = std::getenv("TEST_TMPDIR");
    path_ = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/ctl_test-XXXXXX";
    const int fd = mkstemp(path_.data());
    if (fd >= 0) close(fd);
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << content;
  }
  ~TempFile() { unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

absl::StatusOr<ClientConnectionOptions> Connect(std::vector<std::string> flags,
                                                const char* env_token = nullptr) {
  std::vector<const char*> argv = {"kvmeshctl"};
  for (const std::string& f : flags) argv.push_back(f.c_str());
  argv.push_back("list");
  auto args = Args::Parse(static_cast<int>(argv.size()), argv.data(), {});
  if (!args.ok()) return args.status();
  return ConnectionFromArgs(*args, env_token);
}

TEST(ConnectionTest, NoFlagsIsPlaintextWithoutToken) {
  auto c = Connect({});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->tls.enabled());
  EXPECT_EQ(c->token, "");
  EXPECT_EQ(c->tenant, "");
  auto empty_env = Connect({}, "");
  ASSERT_TRUE(empty_env.ok()) << empty_env.status();
  EXPECT_EQ(empty_env->token, "");
}

TEST(ConnectionTest, TlsFlags) {
  auto c = Connect(
      {"--tls-ca=/ca.pem", "--tls-cert", "/c.pem", "--tls-key=/k.pem", "--tls-server-name=node-a"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->tls.enabled());
  EXPECT_EQ(c->tls.ca_file, "/ca.pem");
  EXPECT_EQ(c->tls.cert_file, "/c.pem");
  EXPECT_EQ(c->tls.key_file, "/k.pem");
  EXPECT_EQ(c->tls.server_name, "node-a");

  auto no_key = Connect({"--tls-cert=/c.pem"});
  EXPECT_EQ(no_key.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(no_key.status().message(), "--tls-cert is set but --tls-key is not: give both");
  auto no_cert = Connect({"--tls-key=/k.pem"});
  EXPECT_EQ(no_cert.status().message(), "--tls-key is set but --tls-cert is not: give both");
  auto empty = Connect({"--tls-ca="});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(empty.status().message(), "--tls-ca is empty");
}

TEST(ConnectionTest, TokenFromFileWinsOverEnvironment) {
  TempFile file("  s3cr3t-token_0123456789abcdef\n\n");
  auto c = Connect({"--token-file=" + file.path()}, "from-env");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->token, "s3cr3t-token_0123456789abcdef");
  auto env = Connect({}, " from-env\n");
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->token, "from-env");
}

TEST(ConnectionTest, BadTokenFiles) {
  auto missing = ReadTokenFile("/nonexistent/kvmesh-token");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(missing.status().message(),
            "cannot read --token-file '/nonexistent/kvmesh-token': No such file or directory");

  TempFile blank(" \n\t\n");
  auto empty = ReadTokenFile(blank.path());
  EXPECT_EQ(empty.status().message(), "--token-file '" + blank.path() + "' is empty");

  // The node's token file (hashes), given by mistake: refused, and its content is not echoed.
  TempFile node_file("token sha256:0123abcd team-a tenant\n");
  auto words = ReadTokenFile(node_file.path());
  EXPECT_EQ(words.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(words.status().message()),
              ::testing::HasSubstr("holds more than one word"));
  EXPECT_THAT(std::string(words.status().message()),
              ::testing::Not(::testing::HasSubstr("sha256")));

  TempFile control("tok\001en");
  auto bad = ReadTokenFile(control.path());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("byte 1 at offset 3"));

  auto bad_env = Connect({}, "tok\x7f");
  EXPECT_EQ(bad_env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad_env.status().message()), ::testing::StartsWith("KVMESH_TOKEN: "));
}

TEST(ConnectionTest, Tenant) {
  auto c = Connect({"--tenant=team-a"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tenant, "team-a");
  auto spaced = Connect({"--tenant=team a"});
  EXPECT_EQ(spaced.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(spaced.status().message(),
            "--tenant='team a' has a space or a character outside printable ASCII");
  auto empty = Connect({"--tenant="});
  EXPECT_EQ(empty.status().message(), "--tenant is empty");
}

}  // namespace
}  // namespace ctl
}  // namespace kvmesh
