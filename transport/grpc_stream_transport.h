// The grpc-stream transport (docs/cluster.md): the payload of an export lease travels as a
// server stream of bounded chunks, PeerService/Fetch. Always available; it moves host memory and
// is the fallback when NCCL cannot be used.
//
// Receiver: GrpcStreamTransport::Receive calls Fetch on the sender with the transfer deadline on
// the call, checks that chunks arrive at consecutive offsets and never run past the lease's
// size, checks each chunk's CRC-32C while it hands the chunk's bytes to the sink, and checks the
// size (and the whole payload's CRC-32C when the lease has one) at the end.
//
// Sender: ServeFetch is the reactor behind the node's PeerService::Fetch. It prepares the next
// chunk only when gRPC has taken the previous one (OnWriteDone), so a stream holds at most one
// chunk beyond what HTTP/2's flow-control window admits, and renews the lease before every
// chunk. A chunk that must be copied (ReadAt: a device copy for a CUDA export) is read on a
// thread of the caller's (SenderOptions::run_read), never on one of gRPC's.
//
// Copies. Both ends use raw messages (grpc::ByteBuffer) and write and read the Chunk's fields
// themselves, so the payload's bytes are copied only by the kernel's socket writes and reads
// and once into the sink: the sender hands gRPC slices that point into the exported image
// (LeasedPayload::View; each slice keeps the payload alive), computing the chunk's CRC-32C from
// them as it goes, and the receiver checksums and sinks the slices that gRPC read from the
// socket, piece by piece while each is in the CPU's cache. A payload that is not in host memory
// is read into one buffer per chunk (ReadAt) instead, off gRPC's threads.
//
// Thread safety: GrpcStreamTransport is thread-safe (concurrent Receive calls are independent
// streams). ServeFetch may be called from any thread; its reactor synchronizes internally.
#ifndef KVMESH_TRANSPORT_GRPC_STREAM_TRANSPORT_H_
#define KVMESH_TRANSPORT_GRPC_STREAM_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <grpcpp/channel.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/server_callback.h>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "kvmesh/v1/peer.pb.h"
#include "transport/server_stream.h"
#include "transport/transport.h"

namespace kvmesh {
namespace transport {

// Chunk size when neither side asks for another: large enough that per-message costs vanish
// next to the copy, small enough that a stream holds little memory.
inline constexpr int32_t kDefaultChunkBytes = 4 << 20;

// What a Chunk message needs beyond its data (offset field, tags, length prefix), with room.
inline constexpr int32_t kChunkOverheadBytes = 64;

class GrpcStreamTransport final : public Transport {
 public:
  // The channel to the PeerService at `address` (host:port). The caller owns the cache of
  // channels (one per peer, reused across transfers); a null channel fails the transfer with
  // UNAVAILABLE. Called once per Receive, from Receive's thread.
  using ChannelFactory = std::function<std::shared_ptr<grpc::Channel>(const std::string& address)>;

  struct Options {
    // Chunk size asked of the sender (which may clamp it to its own maximum). <= 0: the default.
    int32_t chunk_bytes = kDefaultChunkBytes;
    // The largest message the factory's channels accept (GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH).
    // The requested chunk size is clamped so that a chunk with its framing fits.
    int32_t max_receive_message = 16 << 20;
  };

  // Channel arguments that the factory's channels should carry:
  //  - GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH = options.max_receive_message. Required: gRPC's
  //    default is 4 MiB, which a 4 MiB chunk plus its framing exceeds (RESOURCE_EXHAUSTED).
  //  - Large HTTP/2 windows: GRPC_ARG_HTTP2_BDP_PROBE on (gRPC's default, made explicit: the
  //    window grows to the measured bandwidth-delay product) and
  //    GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES = one chunk (the initial stream window), so that
  //    the first chunks on a new channel do not wait for window updates across the network.
  // A node may merge these into the arguments of its one channel per peer; control RPCs on the
  // same channel are unaffected. On loopback the window settings change nothing measurable.
  //
  // Throughput: on loopback the cost of a transfer is dominated not by the copies but by page
  // faults: glibc's malloc serves every multi-megabyte buffer that gRPC allocates (serialized
  // messages, socket reads) with a fresh mmap and unmaps it when freed. A node that moves
  // payloads should keep large blocks in the heap at start-up, e.g.
  // mallopt(M_MMAP_THRESHOLD, 32 << 20) and mallopt(M_TRIM_THRESHOLD, 1 << 30) (or
  // GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...): on the
  // 2-vCPU test machine that took a warm 64 MiB loopback transfer from 0.27-0.36 GB/s
  // (240-340 ms of CPU, both sides) to 0.6-2.4 GB/s (40-150 ms of CPU);
  // grpc_stream_transport_test prints both.
  static grpc::ChannelArguments MakeChannelArguments(const Options& options);

  explicit GrpcStreamTransport(ChannelFactory channels) : GrpcStreamTransport(channels, {}) {}
  GrpcStreamTransport(ChannelFactory channels, Options options);

  const char* name() const override { return kGrpcStream; }

  // Runs on the calling thread (a node's executor thread) and blocks for the whole transfer;
  // it uses gRPC's synchronous client API. Errors as in Transport::Receive, each naming the
  // sender and the lease; gRPC statuses map as follows: DEADLINE_EXCEEDED stays; UNAVAILABLE
  // and CANCELLED (the sender went away or shut down mid-transfer) are UNAVAILABLE; NOT_FOUND
  // (lease unknown, released or expired) stays; others keep their code. DATA_LOSS names the
  // offsets, sizes or checksums that disagree. The sink's own errors come back unchanged, and
  // the stream is cancelled so that the sender stops.
  absl::Status Receive(const Lease& lease, Sink sink, absl::Time deadline) override;

 private:
  const ChannelFactory channels_;
  const Options options_;
};

// ---- sender side ---------------------------------------------------------------------------

// Runs `read` later on a thread that may block (not one of gRPC's) and returns OK; or refuses
// it at once, without running or keeping it, and returns why (UNAVAILABLE for a full queue or
// a shutdown, naming the node and the limit). `read` starts the stream's next gRPC operation
// as its last step, so a refused read would leave the stream hanging if it were dropped
// silently: hence the status, which the sender finishes the stream with.
using ReadRunner = std::function<absl::Status(std::function<void()> read)>;

struct SenderOptions {
  // Where chunks that need a copy (LeasedPayload::ReadAt) are read: for a payload without a
  // View, a CUDA export, that is a Gather through pinned staging that waits for the device
  // (milliseconds, more behind a busy stream), which must not hold one of gRPC's callback
  // threads: they serve every other call of the server. Chunks sent as views of host memory
  // are prepared on gRPC's thread (a checksum over memory, no waiting). Empty: reads run inline
  // on gRPC's thread, which only payloads whose ReadAt never waits may rely on (tests with
  // host memory); a node always sets it.
  ReadRunner run_read;

  // Chunk size for a FetchRequest with chunk_bytes 0.
  int32_t default_chunk_bytes = kDefaultChunkBytes;
  // Larger requests are clamped to this (not refused). The server's send limit
  // (GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, unlimited by default) must admit it plus
  // kChunkOverheadBytes.
  int32_t max_chunk_bytes = 16 << 20;

  // Test knobs, for fault tests with real processes; leave them at their defaults otherwise.
  // chunk_delay: wait this long before reading each chunk (on a grpc::Alarm: no thread blocks),
  // so that a transfer can be caught mid-way.
  absl::Duration chunk_delay = absl::ZeroDuration();
  // corrupt_chunk: the index (0 = the first chunk this Fetch sends) of a chunk whose data gets
  // one byte flipped after its CRC-32C is computed (in a copy: the payload stays intact), so that
  // the receiver sees a mismatch. -1: none.
  int64_t corrupt_chunk = -1;
};

// Serves PeerService/Fetch: the node's CallbackService::Fetch returns
// ServeFetch(context, request, leases, options).
//
// The lease is renewed (LeaseLookup::Touch) when the call starts and again before every chunk
// after the first; a lease that Touch no longer finds ends the stream with its NOT_FOUND.
// Statuses: NOT_FOUND for an unknown lease; INVALID_ARGUMENT for a negative offset or
// chunk_bytes; OUT_OF_RANGE for an offset past the payload's end (an offset equal to the size
// sends no chunk and finishes OK); ReadAt's errors with their codes. When the receiver goes
// away (or the server shuts down) the stream stops at once: no further reads or writes (a read
// queued on run_read sees the cancellation and does not read), the call is finished once, and
// the payload's reference is dropped when gRPC is done with it. A read that run_read refuses
// ends the stream with run_read's status, naming the lease and the offset; the receiver sees
// UNAVAILABLE (retry later).
//
// The method is served raw: the node's service derives from PeerServiceWithRawFetch (below) and
// passes the request's ByteBuffer (a serialized FetchRequest; INVALID_ARGUMENT when it does not
// parse).
//
// Chunks of views are prepared inline on gRPC's callback thread: the checksum of a 4 MiB view of
// an immutable image in host memory takes well under a millisecond. Chunks read with ReadAt
// (no View, too many pieces, the corrupt_chunk knob) are read by options.run_read's thread,
// which also starts their write.
//
// REQUIRES: `leases` outlives the call (the server), and so does whatever options.run_read
// runs reads on: it must accept or refuse reads until the server has shut down (Server::Shutdown
// waits for streams whose read is queued), and run every read it accepted. `options` is copied.
grpc::ServerWriteReactor<grpc::ByteBuffer>* ServeFetch(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       LeaseLookup* leases,
                                                       const SenderOptions& options);
// The same for a Fetch served through the node's RequestGate (transport/server_stream.h): the
// gate has read `request` (valid while this runs) once it knew the caller.
StreamReactor* ServeFetch(StreamCall* call, const grpc::ByteBuffer* request, LeaseLookup* leases,
                          const SenderOptions& options);

// References to payloads held by slices of chunks that gRPC has not let go of yet (a chunk's data
// slices keep its payload, and so the export's memory, alive). gRPC may drop them on its own
// threads after Server::Wait has returned, while it tears connections down; a node destroys its
// server and then waits for this to reach 0 before it destroys what the payloads' memory comes
// from (the caches and the device).
int64_t PayloadSlicesHeld();
// Waits until PayloadSlicesHeld() is 0 (true) or `deadline` passes (false).
bool AwaitPayloadSlicesReleased(absl::Time deadline);

// PeerService on the callback API with Fetch raw: the generated CallbackService with its Fetch
// layer swapped for the raw one (stacking the raw layer on CallbackService instead would hide
// the callback Fetch, which clang's -Woverloaded-virtual rejects). Lists every RPC of
// PeerService: a new RPC must be added here, or it stays on the synchronous API, unimplemented.
using PeerServiceWithRawFetch = v1::PeerService::WithCallbackMethod_NodeInfo<
    v1::PeerService::WithCallbackMethod_Export<v1::PeerService::WithRawCallbackMethod_Fetch<
        v1::PeerService::WithCallbackMethod_Release<v1::PeerService::WithCallbackMethod_Pull<
            v1::PeerService::WithCallbackMethod_NcclConnect<
                v1::PeerService::WithCallbackMethod_NcclSend<
                    v1::PeerService::WithCallbackMethod_Remove<
                        v1::PeerService::WithCallbackMethod_Place<
                            v1::PeerService::WithCallbackMethod_WatchEvents<
                                v1::PeerService::WithCallbackMethod_LookupPrefix<
                                    v1::PeerService::Service>>>>>>>>>>>;

}  // namespace transport
}  // namespace kvmesh

#endif  // KVMESH_TRANSPORT_GRPC_STREAM_TRANSPORT_H_
