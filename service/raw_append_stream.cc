#include "service/raw_append_stream.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "transport/slice_reader.h"

namespace kvmesh {

absl::Status ParseAppendStreamRequest(const std::vector<grpc::Slice>& slices,
                                      RawAppendStreamRequest* request) {
  SliceReader in(slices);
  std::vector<absl::Span<const uint8_t>> pieces;
  std::string header_bytes;
  while (!in.done()) {
    uint64_t tag;
    if (!in.Varint(&tag)) return absl::InvalidArgumentError("a truncated tag");
    const uint64_t field = tag >> 3;
    const int wire_type = static_cast<int>(tag & 7);
    if (field == 0) return absl::InvalidArgumentError("field 0");
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
      case 2: {
        if (!in.Varint(&value)) {
          read = false;
          break;
        }
        const bool known = field == 1 || field == 2;
        pieces.clear();
        if (!in.Take(value, known ? &pieces : nullptr)) {
          return absl::InvalidArgumentError(
              absl::StrCat("field ", field, " of ", value, " bytes runs past the message"));
        }
        if (field == 1) {
          request->has_header = true;
          header_bytes.clear();
          for (const absl::Span<const uint8_t> piece : pieces) {
            header_bytes.append(reinterpret_cast<const char*>(piece.data()), piece.size());
          }
          if (!request->header.MergeFromString(header_bytes)) {
            return absl::InvalidArgumentError(
                absl::StrCat("field 1 (header) of ", value, " bytes does not parse"));
          }
        } else if (field == 2) {
          request->data = pieces;
          request->data_bytes = value;
        }
        break;
      }
      case 5:
        read = in.Fixed32(&value32);
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("field ", field, " has wire type ", wire_type));
    }
    if (!read) return absl::InvalidArgumentError(absl::StrCat("field ", field, " is truncated"));
  }
  return absl::OkStatus();
}

}  // namespace kvmesh
