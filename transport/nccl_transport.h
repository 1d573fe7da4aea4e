// The nccl transport (docs/cluster.md, docs/api.md#transports): payloads move between the GPUs of two
// nodes over one two-rank NCCL communicator per node pair, set up and driven over the peer API
// (PeerService/NcclConnect, PeerService/NcclSend). Communicators are transport/nccl_comm.h's.
//
// Pair communicator. Rank 0 is the node whose name sorts first. The receiver of the first
// transfer between two nodes creates it: it makes an ncclUniqueId and a new generation, starts
// initializing its own rank (non-blocking), and calls NcclConnect on the other node, which
// initializes the other rank; both ranks must initialize at the same time, which is why the
// receiver starts its rank before it calls. Both nodes then keep the communicator under the
// pair's key in their pool and reuse it for transfers in either direction until it is idle for
// `idle_timeout` (closed by a reaper thread) or fails (aborted and dropped: the next transfer
// creates a new generation, and NcclConnect replaces whatever the other node still held).
// Crossing NcclConnects (both nodes creating at once): a node that is itself still
// initializing a newer generation refuses the older one with ABORTED, so both end up on the
// newer; the refused receiver retries once.
//
// Transfer. The receiver posts ncclRecv (through device staging into pinned host memory) and at
// the same time calls NcclSend{lease, to_node, generation} on the sender, which posts the
// matching ncclSend from the lease's payload and answers when its side has completed. A sender
// whose communicator with the receiver has another generation (or none) answers ABORTED, and
// the receiver aborts its own, reconnects and retries once (only while its sink has seen no
// bytes). Pieces are kNcclChunkBytes on both sides, and each piece on the wire is framed: its
// first chunk_bytes - 4 bytes (fewer in the last piece) are payload, its last 4 bytes the
// CRC-32C of those (little endian). The receiver checks each piece's CRC before its payload
// reaches the sink (DATA_LOSS naming the piece: nothing corrupt is handed on, as with
// grpc-stream's per-chunk CRC), then the size and the CRC-32C of the whole payload against the
// lease (DATA_LOSS on mismatch).
//
// Thread safety: thread-safe. Transfers over one pair communicator run one at a time; transfers
// with different peers run concurrently.
#ifndef KVMESH_TRANSPORT_NCCL_TRANSPORT_H_
#define KVMESH_TRANSPORT_NCCL_TRANSPORT_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/channel.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache/mutex.h"
#include "kvmesh/v1/peer.pb.h"
#include "transport/nccl_comm.h"
#include "transport/transport.h"

namespace kvmesh {
namespace transport {

class NcclTransport final : public Transport {
 public:
  // The channel to the PeerService at `address` (host:port); the caller caches channels. A null
  // channel fails the transfer with UNAVAILABLE.
  using ChannelFactory = std::function<std::shared_ptr<grpc::Channel>(const std::string& address)>;

  struct Options {
    std::string self_name;  // this node's name (decides its rank in each pair)
    int device = 0;         // the CUDA ordinal this node's communicators use
    ChannelFactory channels;
    // Initialization of a pair communicator may take at most this long (within the transfer's
    // own deadline).
    absl::Duration connect_timeout = absl::Seconds(30);
    // A pair communicator unused for this long is closed (checked every idle_timeout / 4;
    // zero or less: never).
    absl::Duration idle_timeout = absl::Minutes(5);
    // Polling and close bounds of the communicators (device and chunk size are set from the
    // fields above).
    NcclCommOptions comm;
    // The piece size of the wire protocol: kNcclChunkBytes, the same on every node. Tests make it
    // smaller on every node of a cluster, so that a payload has several pieces.
    size_t chunk_bytes = kNcclChunkBytes;
    // Testing only, on the sending side, as grpc-stream's SenderOptions: wait this long before
    // each piece, and flip one payload byte of piece `corrupt_piece` (0-based; -1: none) after
    // its CRC-32C was computed.
    absl::Duration piece_delay = absl::ZeroDuration();
    int64_t corrupt_piece = -1;
  };

  explicit NcclTransport(Options options);
  // Stops the reaper and closes every communicator.
  ~NcclTransport() override;

  const char* name() const override { return kNccl; }

  // Moves the lease's payload from its sender over the pair communicator (creating it first if
  // needed). Errors as in Transport::Receive; NcclConnect's and NcclSend's gRPC statuses keep
  // their codes (CANCELLED as UNAVAILABLE), naming the sender; communicator errors as in
  // NcclComm (DEADLINE_EXCEEDED, UNAVAILABLE, INTERNAL); INVALID_ARGUMENT for a lease whose
  // sender is this node.
  absl::Status Receive(const Lease& lease, Sink sink, absl::Time deadline) override;

  // Closes communicators idle for longer than options.idle_timeout; returns how many. The
  // reaper calls it; exposed for tests and shutdown paths.
  size_t CloseIdle();

  const Options& options() const { return options_; }
  NcclCommPool* pool() { return &pool_; }

 private:
  friend class NcclPeerSide;

  // The pool key of the pair (this node, peer) and this node's rank in it.
  std::string PairKey(const std::string& peer) const;
  int RankWith(const std::string& peer) const { return options_.self_name < peer ? 0 : 1; }
  // A ready communicator with `peer`: the pool's, or a new generation set up with NcclConnect.
  absl::StatusOr<std::shared_ptr<NcclComm>> GetOrConnect(const Lease& lease, absl::Time deadline);
  absl::StatusOr<std::shared_ptr<NcclComm>> Connect(const Lease& lease, absl::Time deadline);
  // One attempt; *sink_used tells whether the sink saw bytes (no retry then).
  absl::Status ReceiveOnce(const Lease& lease, Sink sink, absl::Time deadline, bool* sink_used);
  uint64_t NextGeneration();
  void ReapLoop();

  const Options options_;
  NcclCommPool pool_;
  std::atomic<uint64_t> last_generation_{0};
  // Serializes the creation of pair communicators by this node (rare), so that two transfers
  // from one new peer share one communicator instead of replacing each other's.
  Mutex connect_mu_;

  Mutex reaper_mu_;
  std::condition_variable_any reaper_wake_;
  bool stopping_ ABSL_GUARDED_BY(reaper_mu_) = false;
  std::thread reaper_;
};

// The sender side of the nccl transport: the node's PeerService delegates NcclConnect and
// NcclSend here (PeerServiceImpl::NcclHooks). Uses the transport's pool, so a pair has one
// communicator whichever node receives.
//
// Thread safety: thread-safe; `transport` must outlive it.
class NcclPeerSide {
 public:
  explicit NcclPeerSide(NcclTransport* transport) : transport_(transport) {}

  // Initializes this node's rank of the pair communicator with request.from_node (replacing
  // whatever communicator of another generation the pool holds for the pair) and returns when
  // the communicator is ready. OK at once for a generation already ready. INVALID_ARGUMENT for
  // a malformed request; ABORTED when this node is itself initializing a newer generation with
  // that node (crossing connects); DEADLINE_EXCEEDED / UNAVAILABLE / INTERNAL /
  // FAILED_PRECONDITION as in NcclComm. `interrupt` (optional) stops the wait early, as in Send.
  absl::Status Connect(const v1::NcclConnectRequest& request, absl::Time deadline,
                       const NcclInterrupt& interrupt = nullptr);

  // Sends the payload of lease request.lease_id to request.to_node over the pair communicator
  // of request.generation; returns once this side's send has completed. ABORTED when this node
  // holds no ready communicator of that generation with that node (the receiver reconnects);
  // the lease lookup's NOT_FOUND; communicator errors as in NcclComm. `interrupt` (optional)
  // lets the caller stop the send early, e.g. with CANCELLED once the receiver cancelled the
  // RPC (grpc::CallbackServerContext::IsCancelled); otherwise a receiver that gave up leaves this
  // side waiting for the deadline, or until its next NcclConnect replaces the communicator.
  absl::Status Send(const v1::NcclSendRequest& request, LeaseLookup* leases, absl::Time deadline,
                    const NcclInterrupt& interrupt = nullptr);

 private:
  NcclTransport* const transport_;
};

}  // namespace transport
}  // namespace kvmesh

#endif  // KVMESH_TRANSPORT_NCCL_TRANSPORT_H_
