#include "service/common/raw_message.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"
#include "proto/wire/slice_reader.h"

namespace kvmesh {
namespace {

// Protobuf's limit on how deep groups nest (its default recursion limit).
constexpr int kMaxGroupDepth = 100;

// Reads a tag: its field number and wire type.
absl::Status ReadTag(SliceReader& in, uint64_t* field, int* wire_type) {
  // A tag is a varint of at most 5 bytes, of which protobuf keeps the low 32 bits.
  uint32_t tag = 0;
  for (int i = 0;; ++i) {
    uint8_t b;
    if (!in.Byte(&b)) return absl::InvalidArgumentError("a truncated tag");
    if (i == 4 && (b & 0x80) != 0) return absl::InvalidArgumentError("a tag of over 5 bytes");
    tag |= static_cast<uint32_t>(b & 0x7f) << (7 * i);
    if ((b & 0x80) == 0) break;
  }
  *field = tag >> 3;
  *wire_type = static_cast<int>(tag & 7);
  if (*field == 0) return absl::InvalidArgumentError("field 0");
  return absl::OkStatus();
}

// Reads the length of a length-delimited value as protobuf does (ReadSize): a varint of at most
// 5 bytes whose value is below 2^31 - 16 (protobuf keeps room for its parse limits below INT_MAX).
absl::Status ReadLength(SliceReader& in, uint64_t field, uint64_t* length) {
  *length = 0;
  for (int i = 0; i < 5; ++i) {
    uint8_t b;
    if (!in.Byte(&b))
      return absl::InvalidArgumentError(absl::StrCat("field ", field, " is truncated"));
    *length |= uint64_t{b & 0x7fu} << (7 * i);
    if ((b & 0x80) == 0) {
      if (*length > uint64_t{INT32_MAX} - 16) break;
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("field ", field, " has a length of 2 GiB or more, or of over 5 bytes"));
}

// Skips the value of an unknown field whose tag was read (a whole group for a start-group tag).
absl::Status SkipValue(SliceReader& in, uint64_t field, int wire_type, int depth) {
  uint64_t value;
  uint32_t value32;
  bool read = true;
  switch (wire_type) {
    case 0:
      read = in.Varint(&value);
      break;
    case 1:
      read = in.Take(8, nullptr);
      break;
    case 2:
      RETURN_IF_ERROR(ReadLength(in, field, &value));
      if (!in.Take(value, nullptr)) {
        return absl::InvalidArgumentError(
            absl::StrCat("field ", field, " of ", value, " bytes runs past the message"));
      }
      break;
    case 3: {
      if (depth >= kMaxGroupDepth) {
        return absl::InvalidArgumentError(
            absl::StrCat("groups nest more than ", kMaxGroupDepth, " deep"));
      }
      while (true) {
        if (in.done()) {
          return absl::InvalidArgumentError(absl::StrCat("group ", field, " has no end"));
        }
        uint64_t inner;
        int inner_type;
        RETURN_IF_ERROR(ReadTag(in, &inner, &inner_type));
        if (inner_type == 4) {
          if (inner != field) {
            return absl::InvalidArgumentError(
                absl::StrCat("group ", field, " ends with the end of group ", inner));
          }
          break;
        }
        RETURN_IF_ERROR(SkipValue(in, inner, inner_type, depth + 1));
      }
      break;
    }
    case 4:
      return absl::InvalidArgumentError(
          absl::StrCat("field ", field, " ends a group that never began"));
    case 5:
      read = in.Fixed32(&value32);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("field ", field, " has wire type ", wire_type));
  }
  if (!read) return absl::InvalidArgumentError(absl::StrCat("field ", field, " is truncated"));
  return absl::OkStatus();
}

// The value of a length-delimited field whose tag was read: its length, and its bytes as pieces
// of the slices (in place of what *pieces held).
absl::Status TakeLengthDelimited(SliceReader& in, uint64_t field, uint64_t* length,
                                 std::vector<absl::Span<const uint8_t>>* pieces) {
  RETURN_IF_ERROR(ReadLength(in, field, length));
  pieces->clear();
  if (!in.Take(*length, pieces)) {
    return absl::InvalidArgumentError(
        absl::StrCat("field ", field, " of ", *length, " bytes runs past the message"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseWithBytesInPlace(const std::vector<grpc::Slice>& slices, uint32_t data_field,
                                   google::protobuf::MessageLite* message,
                                   std::vector<absl::Span<const uint8_t>>* data,
                                   uint64_t* data_bytes) {
  data->clear();
  *data_bytes = 0;
  SliceReader in(slices);
  std::string rest;  // every field but data_field's, as they came
  std::vector<absl::Span<const uint8_t>> pieces;
  while (!in.done()) {
    const size_t mark = rest.size();
    in.set_capture(&rest);
    uint64_t field;
    int wire_type;
    RETURN_IF_ERROR(ReadTag(in, &field, &wire_type));
    if (field != data_field || wire_type != 2) {
      // Another field, or data_field with another wire type, which protobuf treats as unknown:
      // checked as protobuf would and kept for the message's own parse.
      RETURN_IF_ERROR(SkipValue(in, field, wire_type, 0));
      continue;
    }
    in.set_capture(nullptr);
    rest.resize(mark);
    uint64_t length;
    RETURN_IF_ERROR(TakeLengthDelimited(in, field, &length, &pieces));
    *data = pieces;  // a repeated bytes field keeps its last value
    *data_bytes = length;
  }
  in.set_capture(nullptr);
  if (!message->ParseFromString(rest)) {
    return absl::InvalidArgumentError(absl::StrCat("the ", message->GetTypeName(), "'s ",
                                                   rest.size(), " bytes beside field ", data_field,
                                                   " do not parse"));
  }
  return absl::OkStatus();
}

absl::Status ParseHeaderAndData(const std::vector<grpc::Slice>& slices,
                                google::protobuf::MessageLite* header, bool* has_header,
                                std::vector<absl::Span<const uint8_t>>* data,
                                uint64_t* data_bytes) {
  SliceReader in(slices);
  std::vector<absl::Span<const uint8_t>> pieces;
  std::string header_bytes;
  while (!in.done()) {
    uint64_t field;
    int wire_type;
    RETURN_IF_ERROR(ReadTag(in, &field, &wire_type));
    if ((field != 1 && field != 2) || wire_type != 2) {
      // Unknown, or a known field with another wire type, which protobuf treats as unknown.
      RETURN_IF_ERROR(SkipValue(in, field, wire_type, 0));
      continue;
    }
    uint64_t length;
    RETURN_IF_ERROR(TakeLengthDelimited(in, field, &length, &pieces));
    if (field == 1) {
      *has_header = true;
      header_bytes.clear();
      for (const absl::Span<const uint8_t> piece : pieces) {
        header_bytes.append(reinterpret_cast<const char*>(piece.data()), piece.size());
      }
      if (!header->MergeFromString(header_bytes)) {
        return absl::InvalidArgumentError(
            absl::StrCat("field 1 (header) of ", length, " bytes does not parse"));
      }
    } else {
      *data = pieces;
      *data_bytes = length;
    }
  }
  return absl::OkStatus();
}

}  // namespace kvmesh
