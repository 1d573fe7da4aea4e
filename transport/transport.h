// Transports move the payload of an export lease from the node that holds the data (the
// sender) to the node that asked for it (the receiver). See docs/cluster.md for the pull
// protocol they serve; the peer API is proto/kvmesh/v1/peer.proto.
//
// The receiver side is a Transport: given the lease that the sender's Export granted, it moves
// the payload and hands it, in order, to a sink. The sender side of each transport is served by
// the node's PeerService (Fetch for grpc-stream, NcclSend for nccl) over a LeaseLookup.
//
// Every transfer is checked end to end with CRC-32C, computed by the sender from the exported
// bytes and by the receiver over what it passed to the sink (DATA_LOSS on mismatch): per chunk
// for grpc-stream (each Chunk carries its own), over the whole payload as Export announced it
// for nccl. A sink that has seen bytes of a failed transfer must discard them.
//
// Thread safety: Transport and LeaseLookup implementations are thread-safe.
#ifndef KVMESH_TRANSPORT_TRANSPORT_H_
#define KVMESH_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace kvmesh {
namespace transport {

inline constexpr char kGrpcStream[] = "grpc-stream";
inline constexpr char kNccl[] = "nccl";

// What the receiver knows of a lease once the sender's Export answered.
struct Lease {
  std::string sender_name;     // the sender's node name
  std::string sender_address;  // host:port of the sender's gRPC server (PeerService)
  std::string id;  // ExportResponse.lease_id
  uint64_t payload_bytes = 0;
  // CRC-32C of the whole payload, when Export announced one (it does for nccl; grpc-stream
  // checks every chunk's own and, when has_crc32c, this one too).
  bool has_crc32c = false;
  uint32_t crc32c = 0;
};

// Receives consecutive pieces of the payload, in order. An error stops the transfer and is
// returned by Receive as it is.
using Sink = absl::FunctionRef<absl::Status(absl::Span<const uint8_t>)>;

class Transport {
 public:
  virtual ~Transport() = default;

  // kGrpcStream or kNccl.
  virtual const char* name() const = 0;

  // Moves the payload of `lease` from its sender into `sink`. Errors: DATA_LOSS when the bytes
  // do not match the lease's size or checksum; DEADLINE_EXCEEDED when `deadline` passes first
  // (a frozen sender never hangs the call); UNAVAILABLE when the sender cannot be reached or
  // goes away mid-transfer; NOT_FOUND when the sender no longer knows the lease (expired);
  // the sink's own errors unchanged.
  virtual absl::Status Receive(const Lease& lease, Sink sink, absl::Time deadline) = 0;
};

// ---- sender side ---------------------------------------------------------------------------

// The bytes a lease exports.
class LeasedPayload {
 public:
  virtual ~LeasedPayload() = default;
  virtual size_t size() const = 0;
  // Copies bytes [offset, offset + dst.size()) into dst. May be called from several threads at
  // once (distinct transfers of one lease); implementations serialize internally if needed.
  virtual absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) = 0;
  // Bytes from `offset` on where they lie in host memory, without a copy: a contiguous run of
  // at most `max_bytes`, valid and unchanged while this payload exists. Empty when the bytes are
  // not in host memory (or offset >= size()): use ReadAt. Thread-safe.
  virtual absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const {
    (void)offset;
    (void)max_bytes;
    return {};
  }
};

// How the sender side of a transport finds the payload of a lease.
class LeaseLookup {
 public:
  virtual ~LeaseLookup() = default;
  // The payload of lease `id`, renewing the lease (its expiry moves to now + its lease time).
  // NOT_FOUND for an unknown, released or expired lease.
  virtual absl::StatusOr<std::shared_ptr<LeasedPayload>> Touch(const std::string& id) = 0;
};

}  // namespace transport
}  // namespace kvmesh

#endif  // KVMESH_TRANSPORT_TRANSPORT_H_
