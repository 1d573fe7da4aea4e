// The node's AppendStream is served raw (service/cache_service.h): its requests are read here
// from the slices gRPC received, the data left where it lies.
#ifndef KVMESH_SERVICE_RAW_APPEND_STREAM_H_
#define KVMESH_SERVICE_RAW_APPEND_STREAM_H_

#include <cstdint>
#include <vector>

#include <grpcpp/support/slice.h>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {

// The fields of one AppendStreamRequest as it lies in the received slices: the header parsed
// (a small message), the data left in place.
struct RawAppendStreamRequest {
  bool has_header = false;
  v1::AppendHeader header;
  std::vector<absl::Span<const uint8_t>> data;
  uint64_t data_bytes = 0;
};

// Parses as protobuf would: unknown fields (groups too, nested at most 100 deep) are skipped, a
// repeated `data` replaces the earlier one and a repeated `header` merges into it.
// INVALID_ARGUMENT naming the field otherwise. The views in request->data point into `slices`.
absl::Status ParseAppendStreamRequest(const std::vector<grpc::Slice>& slices,
                                      RawAppendStreamRequest* request);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_RAW_APPEND_STREAM_H_
