// The client side of kvmesh's bulk streams without copies in user space: AppendStream messages
// whose data are slices of the caller's payload (gRPC writes them to the socket from there), and
// a Read whose data is handed over where gRPC received it. A generated stub copies each piece
// twice on the way out (into the message, then into its serialized bytes) and twice on the way
// in (parsed, then appended). kvmeshctl and the RPC benchmark use these; the bytes on the wire
// are the generated stub's, so a node cannot tell them apart.
//
// Thread safety: each call is one RPC on the calling thread; calls may run concurrently.
#ifndef KVMESH_SERVICE_COMMON_BULK_CLIENT_H_
#define KVMESH_SERVICE_COMMON_BULK_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "grpcpp/client_context.h"
#include "grpcpp/impl/codegen/channel_interface.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {

// Runs CacheService/AppendStream: `header` (its payload_bytes as given) with the first message,
// then `payload` in messages of at most `chunk_bytes` (> 0) of data; an empty payload sends the
// header alone. The messages' data are slices of *payload, which they keep alive until gRPC lets
// them go. Stops writing once the node has ended the call. The RPC's status, in absl terms;
// *response is set on OK.
absl::Status SendAppendStream(grpc::ChannelInterface* channel, grpc::ClientContext* context,
                              const v1::AppendHeader& header,
                              std::shared_ptr<const std::string> payload, size_t chunk_bytes,
                              v1::AppendResponse* response);

// Runs CacheService/Read of `request`: *header from the first message, then the payload's bytes
// handed to `sink` in order, as pieces that lie in gRPC's receive buffers (valid during the call
// of `sink` only). The RPC's status when it fails; DATA_LOSS for a stream whose first message has
// no header, with a second header, a message that does not parse, or other than the payload
// bytes its header announced (the call is cancelled then).
absl::Status ReceiveReadStream(grpc::ChannelInterface* channel, grpc::ClientContext* context,
                               const v1::ReadRequest& request, v1::ReadHeader* header,
                               absl::FunctionRef<void(absl::Span<const uint8_t>)> sink);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_BULK_CLIENT_H_
