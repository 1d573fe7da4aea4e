// ParseAppendStreamRequest and ParseAppendRequest (service/common/raw_message.h) against
// protobuf's own parser: for every encoding, cut into slices of every size down to one byte, and
// for every prefix of it, the raw parse succeeds exactly when protobuf's does and finds the same
// fields and payload.
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
  EXPECT_THAT(refusal(Tag(2, 2) + Varint(1000) + "abc"),
              HasSubstr("field 2 of 1000 bytes runs past the message"));
  EXPECT_THAT(refusal(Tag(2, 2) + Varint(uint64_t{1} << 62) + "abc"),
              HasSubstr("field 2 has a length of 2 GiB or more, or of over 5 bytes"));
  EXPECT_THAT(refusal(Tag(2, 2) + "\xff"), HasSubstr("field 2 is truncated"));
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

// Lengths of length-delimited fields are read as protobuf reads them: a varint of at most 5
// bytes (padded ones included) below 2^31 - 16; longer or larger ones are refused, for the data,
// the header and unknown fields alike.
TEST(RawAppendStreamTest, LengthsAreReadAsProtobufReadsThem) {
  const std::string padded_one("\x81\x80\x80\x80\x00", 5);     // 1, in 5 bytes
  const std::string six_bytes("\x81\x80\x80\x80\x80\x00", 6);  // 1, in 6 bytes
  const std::string too_large("\xf0\xff\xff\xff\x07", 5);      // 2^31 - 16
  const std::string largest("\xef\xff\xff\xff\x07", 5);        // 2^31 - 17
  int taken = 0;
  for (const std::string& length : {padded_one, six_bytes, too_large, largest}) {
    for (uint64_t field : {uint64_t{1}, uint64_t{2}, uint64_t{15}}) {
      const std::string bytes = Tag(field, 2) + length + std::string(1, '\0');
      taken += ExpectParsedAsProtobufDoes(
          bytes, absl::StrCat("field ", field, ", length ", absl::BytesToHexString(length)));
    }
  }
  // The padded 1, as data and as an unknown field (one byte of header is no message).
  EXPECT_EQ(taken, 2);
  RawAppendStreamRequest raw;
  const std::vector<grpc::Slice> slices = Cut(Tag(2, 2) + six_bytes + "x", 1);
  EXPECT_THAT(std::string(ParseAppendStreamRequest(slices, &raw).message()),
              HasSubstr("field 2 has a length of 2 GiB or more, or of over 5 bytes"));
}

// ---- the unary AppendRequest: the payload in field 3, beside the other fields ---------------

std::string Joined(const std::vector<absl::Span<const uint8_t>>& pieces) {
  std::string out;
  for (const absl::Span<const uint8_t> piece : pieces) {
    out.append(reinterpret_cast<const char*>(piece.data()), piece.size());
  }
  return out;
}

bool ExpectAppendParsedAsProtobufDoes(const std::string& bytes, const std::string& what) {
  v1::AppendRequest expected;
  const bool ok = expected.ParseFromString(bytes);
  for (size_t piece : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{7}, size_t{64}}) {
    const std::vector<grpc::Slice> slices = Cut(bytes, piece);
    RawAppendRequest raw;
    raw.request.set_cache("left from before");  // cleared by the parse, as the payload's views
    raw.payload.emplace_back(reinterpret_cast<const uint8_t*>("stale"), 5);
    raw.payload_bytes = 5;
    const absl::Status status = ParseAppendRequest(slices, &raw);
    EXPECT_EQ(status.ok(), ok) << what << ", pieces of " << piece << ": " << status;
    if (!ok || !status.ok()) continue;
    EXPECT_TRUE(raw.request.payload().empty()) << what;
    EXPECT_EQ(raw.payload_bytes, expected.payload().size()) << what;
    // The fields and the unknown fields, in their order, with the payload put back.
    v1::AppendRequest got = raw.request;
    got.set_payload(Joined(raw.payload));
    EXPECT_EQ(got.SerializeAsString(), expected.SerializeAsString())
        << what << ", pieces of " << piece;
  }
  return ok;
}

std::vector<std::string> AppendEncodings() {
  v1::AppendRequest full;
  full.set_cache("cache-a");
  for (int32_t pos = 0; pos < 5; ++pos) {
    v1::Token* token = full.add_tokens();
    token->set_seq(3);
    token->set_pos(pos);
  }
  std::string payload(200, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 7 + 1);
  full.set_payload(payload);
  full.set_speculative(true);
  v1::AppendRequest token;
  v1::Token* t = token.add_tokens();
  t->set_seq(-4);
  t->set_pos(1 << 30);
  const std::string payload_field = Tag(3, 2) + Varint(payload.size()) + payload;
  const std::string group = Tag(9, 3) + Tag(1, 0) + Varint(300) + Tag(10, 3) + Tag(3, 2) +
                            Varint(2) + "xy" + Tag(10, 4) + Tag(9, 4);
  return {
      "",
      full.SerializeAsString(),
      // The payload first, fields after it; a repeated payload replaces the earlier one;
      // repeated tokens add up; unknown fields of every wire type are kept, as protobuf keeps them.
      payload_field + token.SerializeAsString() + Tag(9, 0) + Varint(5) + Tag(3, 2) + Varint(3) +
          "abc" + Tag(1, 2) + Varint(2) + "ab" + token.SerializeAsString() + Tag(4, 5) +
          "\x01\x02\x03\x04" + payload_field + Tag(5, 1) + std::string(8, '\x05'),
      // A group holding a field 3 is skipped whole: the payload is only ever at the top level.
      group + payload_field + group,
      // Field 3 with another wire type is an unknown field to protobuf.
      Tag(3, 0) + Varint(77) + full.SerializeAsString() + Tag(3, 5) + "abcd",
      // A string that is not UTF-8 (proto3 refuses it), and a token that does not parse.
      Tag(1, 2) + Varint(2) + "\xff\xfe" + payload_field,
      payload_field + Tag(2, 2) + Varint(2) + Tag(1, 1) + "x",
      Tag((uint64_t{1} << 29) - 1, 0) + Varint(1) + Tag(3, 2) + Varint(1) + "x",
      Tag(3, 2) + Varint(0),
      // A length of 1 in 5 bytes (taken), and in 6 (refused, as protobuf refuses it).
      Tag(3, 2) + std::string("\x81\x80\x80\x80\x00", 5) + "x",
      Tag(3, 2) + std::string("\x81\x80\x80\x80\x80\x00", 6) + "x",
  };
}

TEST(RawAppendRequestTest, ParsesAsProtobufDoesInSlicesOfEverySize) {
  int taken = 0;
  for (const std::string& bytes : AppendEncodings()) {
    taken += ExpectAppendParsedAsProtobufDoes(bytes, absl::StrCat(bytes.size(), " bytes"));
  }
  EXPECT_EQ(taken, static_cast<int>(AppendEncodings().size()) - 3);  // the three refused above
}

TEST(RawAppendRequestTest, EveryPrefixIsJudgedAsProtobufJudgesIt) {
  int refused = 0;
  for (const std::string& bytes : AppendEncodings()) {
    for (size_t n = 0; n < bytes.size(); ++n) {
      refused += !ExpectAppendParsedAsProtobufDoes(
          bytes.substr(0, n), absl::StrCat("the first ", n, " of ", bytes.size()));
    }
  }
  EXPECT_GT(refused, 100);
}

TEST(RawAppendRequestTest, RandomBytesAreJudgedAsProtobufJudgesThem) {
  std::mt19937 rng(29);
  int taken = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes(rng() % 24, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    // Half of them start with a payload field, so that the rest lands after one.
    if (i % 2 == 0) bytes = Tag(3, 2) + Varint(3) + "pay" + bytes;
    taken += ExpectAppendParsedAsProtobufDoes(
        bytes, absl::StrCat("random input ", i, " (", absl::BytesToHexString(bytes), ")"));
  }
  EXPECT_GT(taken, 0);
}

TEST(RawAppendRequestTest, RefusalsNameWhatIsWrong) {
  auto refusal = [](const std::string& bytes) {
    const std::vector<grpc::Slice> slices = Cut(bytes, 1);
    RawAppendRequest raw;
    const absl::Status status = ParseAppendRequest(slices, &raw);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    return std::string(status.message());
  };
  EXPECT_THAT(refusal(Tag(3, 2) + Varint(1000) + "abc"),
              HasSubstr("field 3 of 1000 bytes runs past the message"));
  EXPECT_THAT(refusal(Tag(1, 2) + Varint(2) + "\xff\xfe" + Tag(3, 2) + Varint(1) + "x"),
              HasSubstr("kvmesh.v1.AppendRequest's 4 bytes beside field 3 do not parse"));
  EXPECT_THAT(refusal(Tag(7, 3) + Tag(8, 4)), HasSubstr("group 7 ends with the end of group 8"));
}

}  // namespace
}  // namespace kvmesh
