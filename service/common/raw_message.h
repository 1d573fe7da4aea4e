// kvmesh's bulk messages read where gRPC received them (grpc::ByteBuffer::Dump): an
// AppendStreamRequest (the node's raw AppendStream) and a ReadResponse (a client's raw Read)
// share one shape, field 1 a small header message and field 2 the payload's bytes; a unary
// AppendRequest (the node's raw Append) has its payload in field 3 beside the other fields. The
// rest is parsed; the payload is left in place, as views of the received slices.
#ifndef KVMESH_SERVICE_COMMON_RAW_MESSAGE_H_
#define KVMESH_SERVICE_COMMON_RAW_MESSAGE_H_

#include <cstdint>
#include <vector>

#include <google/protobuf/message_lite.h>
#include <grpcpp/support/slice.h>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {

// Parses `slices` as a message whose field 1 is `header`'s type and field 2 is bytes, as protobuf
// would: unknown fields (groups too, nested at most 100 deep) are skipped, a repeated field 2
// replaces the earlier one and a repeated field 1 merges into *header. INVALID_ARGUMENT naming
// the field otherwise. On success *has_header says whether field 1 was there, *data views field
// 2's bytes in `slices` (which must outlive it) and *data_bytes is their count.
absl::Status ParseHeaderAndData(const std::vector<grpc::Slice>& slices,
                                google::protobuf::MessageLite* header, bool* has_header,
                                std::vector<absl::Span<const uint8_t>>* data, uint64_t* data_bytes);

// Parses `slices` as a message of `message`'s type whose field `data_field` is bytes, as protobuf
// would, except that field's value is left where it lies: *data views it in `slices` (which must
// outlive it; empty when the field is absent) and *data_bytes is its size. Every other field is
// parsed into *message (cleared first), whose data_field stays empty. INVALID_ARGUMENT when
// protobuf would not parse the message.
absl::Status ParseWithBytesInPlace(const std::vector<grpc::Slice>& slices, uint32_t data_field,
                                   google::protobuf::MessageLite* message,
                                   std::vector<absl::Span<const uint8_t>>* data,
                                   uint64_t* data_bytes);

// A unary AppendRequest (the node's raw Append): `request` without its payload, which `payload`
// views.
struct RawAppendRequest {
  v1::AppendRequest request;
  std::vector<absl::Span<const uint8_t>> payload;
  uint64_t payload_bytes = 0;
};

inline absl::Status ParseAppendRequest(const std::vector<grpc::Slice>& slices,
                                       RawAppendRequest* request) {
  return ParseWithBytesInPlace(slices, v1::AppendRequest::kPayloadFieldNumber, &request->request,
                               &request->payload, &request->payload_bytes);
}

// One such message, parsed.
template <typename Header>
struct RawHeaderAndData {
  bool has_header = false;
  Header header;
  std::vector<absl::Span<const uint8_t>> data;
  uint64_t data_bytes = 0;
};

template <typename Header>
absl::Status ParseRaw(const std::vector<grpc::Slice>& slices, RawHeaderAndData<Header>* message) {
  return ParseHeaderAndData(slices, &message->header, &message->has_header, &message->data,
                            &message->data_bytes);
}

using RawAppendStreamRequest = RawHeaderAndData<v1::AppendHeader>;
using RawReadResponse = RawHeaderAndData<v1::ReadHeader>;

inline absl::Status ParseAppendStreamRequest(const std::vector<grpc::Slice>& slices,
                                             RawAppendStreamRequest* request) {
  return ParseRaw(slices, request);
}

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_RAW_MESSAGE_H_
