// Unit tests of kvmeshctl's helpers: shorthand parsers, argument parsing, pattern payloads.
#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/convert.h"
#include "service/ctl_args.h"
#include "service/ctl_parse.h"
#include "service/ctl_payload.h"

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
  auto s = ParseGroup("attention:layers=4,heads=2,head_dim_k=64,head_dim_v=32,window=sliding:1024:2048,rope=normal");
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
  for (const char* bad : {"rotating:layers=1", "attention:layers=x", "attention:foo=1",
                          "attention:window=sliding", "attention:window=chunked:1:2",
                          "attention:rope=yarn", "attention:rope=neox:1:2:3:4"}) {
    auto g = ParseGroup(bad);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_THAT(std::string(ParseGroup("attention:foo=1").status().message()),
              ::testing::HasSubstr("foo"));
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

TEST(FormatPositionsTest, Ranges) {
  EXPECT_EQ(FormatPositions({}), "-");
  EXPECT_EQ(FormatPositions({0, 1, 2, 5, 7, 8}), "0-2,5,7-8");
}

TEST(ArgsTest, FlagsAnywhereRepeatedAndBool) {
  const char* argv[] = {"kvmeshctl", "--json",   "create", "--group=a",  "--group", "b",
                        "--stream",  "--name", "x"};
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
  *proto.add_groups() = *ParseGroup("attention:layers=1,heads=1,head_dim_k=8,head_dim_v=2,window=sliding:4");
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
      spec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(all.data()), all.size()), 5, 1,
      4);
  EXPECT_EQ(slice, MakePatternPayload(spec, {1, 2, 3}, 1));
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

}  // namespace
}  // namespace ctl
}  // namespace kvmesh
