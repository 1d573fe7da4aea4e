// ParseAppendStreamRequest (service/common/raw_message.h) against protobuf's own parser: for
// every encoding, cut into slices of every size down to one byte, and for every prefix of it,
// the raw parse succeeds exactly when protobuf's does and finds the same header and data.
#include "service/common/raw_message.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/support/slice.h>
#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {
namespace {

using ::testing::HasSubstr;

std::string Varint(uint64_t v) {
  std::string out;
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
  return out;
}

std::string Tag(uint64_t field, int wire_type) { return Varint(field << 3 | wire_type); }

std::string WithHeader(const v1::AppendHeader& header) {
  v1::AppendStreamRequest m;
  *m.mutable_header() = header;
  return m.SerializeAsString();
}

std::string WithData(const std::string& data) {
  v1::AppendStreamRequest m;
  m.set_data(data);
  return m.SerializeAsString();
}

// `bytes` in slices of `piece` bytes (the last shorter); piece 0: one slice.
std::vector<grpc::Slice> Cut(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  if (piece == 0) piece = bytes.size() + 1;
  for (size_t at = 0; at < bytes.size(); at += piece) {
    const std::string part = bytes.substr(at, piece);
    slices.emplace_back(part.data(), part.size());
  }
  return slices;
}

std::string Joined(const RawAppendStreamRequest& r) {
  std::string out;
  for (const absl::Span<const uint8_t> piece : r.data) {
    out.append(reinterpret_cast<const char*>(piece.data()), piece.size());
  }
  return out;
}

// Parses `bytes` both ways, cut every way; expects the same outcome and fields. Returns whether
// protobuf took it.
bool ExpectParsedAsProtobufDoes(const std::string& bytes, const std::string& what) {
  v1::AppendStreamRequest expected;
  const bool ok = expected.ParseFromString(bytes);
  for (size_t piece : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{7}, size_t{64}}) {
    const std::vector<grpc::Slice> slices = Cut(bytes, piece);
    RawAppendStreamRequest raw;
    const absl::Status status = ParseAppendStreamRequest(slices, &raw);
    EXPECT_EQ(status.ok(), ok) << what << ", pieces of " << piece << ": " << status;
    if (!ok || !status.ok()) continue;
    EXPECT_EQ(raw.has_header, expected.has_header()) << what;
    EXPECT_EQ(raw.header.SerializeAsString(), expected.header().SerializeAsString()) << what;
    EXPECT_EQ(Joined(raw), expected.data()) << what << ", pieces of " << piece;
    EXPECT_EQ(raw.data_bytes, expected.data().size()) << what;
  }
  return ok;
}

std::vector<std::string> Encodings() {
  v1::AppendHeader names;
  names.set_cache("cache-a");
  for (int32_t pos = 0; pos < 5; ++pos) {
    v1::Token* token = names.add_tokens();
    token->set_seq(3);
    token->set_pos(pos);
  }
  v1::AppendHeader size;
  size.set_payload_bytes(320);
  size.set_speculative(true);
  std::string data(200, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 1);
  const std::string group = Tag(9, 3) + Tag(1, 0) + Varint(300) + Tag(10, 3) + Tag(2, 2) +
                            Varint(2) + "xy" + Tag(10, 4) + Tag(9, 4);
  return {
      "",
      WithHeader(names) + WithData(data),
      // Headers merge, data replaces, unknown fields of every wire type are skipped.
      WithHeader(names) + Tag(9, 0) + Varint(5) + WithData("replaced") + WithHeader(size) +
          Tag(15, 2) + Varint(3) + "xyz" + WithData(data) + Tag(4, 5) + "\x01\x02\x03\x04" +
          Tag(5, 1) + std::string(8, '\x05'),
      // A group (with a nested group) is skipped whole, as protobuf skips an unknown group.
      group + WithData(data) + group,
      // Known fields with another wire type are unknown fields to protobuf.
      Tag(2, 0) + Varint(77) + WithData(data.substr(0, 9)) + Tag(1, 5) + "abcd",
      // The largest field number.
      Tag((uint64_t{1} << 29) - 1, 0) + Varint(1) + WithData("x"),
      WithData(""),
  };
}

TEST(RawAppendStreamTest, ParsesAsProtobufDoesInSlicesOfEverySize) {
  for (const std::string& bytes : Encodings()) {
    EXPECT_TRUE(ExpectParsedAsProtobufDoes(bytes, absl::StrCat(bytes.size(), " bytes")));
  }
}

TEST(RawAppendStreamTest, EveryPrefixIsJudgedAsProtobufJudgesIt) {
  int refused = 0;
  for (const std::string& bytes : Encodings()) {
    for (size_t n = 0; n < bytes.size(); ++n) {
      refused += !ExpectParsedAsProtobufDoes(bytes.substr(0, n),
                                             absl::StrCat("the first ", n, " of ", bytes.size()));
    }
  }
  EXPECT_GT(refused, 100);  // most cuts fall inside a field
}

TEST(RawAppendStreamTest, RandomBytesAreJudgedAsProtobufJudgesThem) {
  std::mt19937 rng(17);
  int taken = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes(rng() % 24, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    taken += ExpectParsedAsProtobufDoes(
        bytes, absl::StrCat("random input ", i, " (", absl::BytesToHexString(bytes), ")"));
  }
  EXPECT_GT(taken, 0);
}

TEST(RawAppendStreamTest, RefusalsNameWhatIsWrong) {
  auto refusal = [](const std::string& bytes) {
    const std::vector<grpc::Slice> slices = Cut(bytes, 1);
    RawAppendStreamRequest raw;
    const absl::Status status = ParseAppendStreamRequest(slices, &raw);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    return std::string(status.message());
  };
  EXPECT_THAT(refusal(Tag(2, 2) + Varint(uint64_t{1} << 62) + "abc"),
              HasSubstr("field 2 of 4611686018427387904 bytes runs past the message"));
  EXPECT_THAT(refusal(Tag(2, 2) + std::string(10, '\xff') + "\x01"), HasSubstr("truncated"));
  EXPECT_THAT(refusal(std::string("\x02\x00", 2)), HasSubstr("field 0"));
  EXPECT_THAT(refusal(Tag(7, 4)), HasSubstr("field 7 ends a group that never began"));
  EXPECT_THAT(refusal(Tag(7, 3) + Tag(8, 4)), HasSubstr("group 7 ends with the end of group 8"));
  EXPECT_THAT(refusal(Tag(7, 3) + Tag(1, 0) + Varint(1)), HasSubstr("group 7 has no end"));
  EXPECT_THAT(refusal(Tag(7, 6)), HasSubstr("field 7 has wire type 6"));
  EXPECT_THAT(refusal(Tag(1, 2) + Varint(2) + "\xff\xff"),
              HasSubstr("field 1 (header) of 2 bytes does not parse"));
  // Groups nested deeper than protobuf's recursion limit are refused, not followed.
  std::string deep;
  for (int i = 0; i < 200; ++i) deep += Tag(7, 3);
  for (int i = 0; i < 200; ++i) deep += Tag(7, 4);
  EXPECT_THAT(refusal(deep), HasSubstr("groups nest more than 100 deep"));
}

}  // namespace
}  // namespace kvmesh
