#include "transport/nccl_transport.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <utility>

#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>

#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "transport/checksum.h"

namespace kvmesh {
namespace transport {
namespace {

std::string Hex32(uint32_t v) { return absl::StrCat("0x", absl::Hex(v, absl::kZeroPad8)); }

// "sender 'a' (10.0.0.2:7700)", for messages.
std::string DescribeSender(const Lease& lease) {
  return absl::StrCat("sender '", lease.sender_name, "' (", lease.sender_address, ")");
}

// The status of a peer RPC that failed. CANCELLED reaches a client only when the server ends
// the call (it shut down; this side's own cancellations are reported before this is looked at),
// so it reads as UNAVAILABLE; every other code stays.
absl::Status FromPeerStatus(const grpc::Status& status, const char* rpc, const Lease& lease) {
  const std::string message = absl::StrCat(rpc, " for lease ", lease.id, " on ",
                                           DescribeSender(lease), ": ", status.error_message());
  if (status.error_code() == grpc::StatusCode::CANCELLED) {
    return absl::UnavailableError(message);
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), message);
}

// A unary call on gRPC's callback API, so that the calling thread can poll a communicator while
// the call runs. REQUIRES: Wait() returns before the object (and the request) is destroyed.
template <typename Response>
class PendingCall {
 public:
  explicit PendingCall(absl::Time deadline) { context_.set_deadline(absl::ToChronoTime(deadline)); }
  PendingCall(const PendingCall&) = delete;
  PendingCall& operator=(const PendingCall&) = delete;

  grpc::ClientContext* context() { return &context_; }
  Response* response() { return &response_; }
  std::function<void(grpc::Status)> OnDone() {
    return [this](grpc::Status status) {
      MutexLock lock(&mu_);
      status_ = std::move(status);
      done_ = true;
      finished_.notify_all();
    };
  }

  // The call's status once it has finished with an error; nullopt while it runs or after OK.
  std::optional<grpc::Status> Failure() {
    MutexLock lock(&mu_);
    if (done_ && !status_.ok()) return status_;
    return std::nullopt;
  }
  void Cancel() { context_.TryCancel(); }
  // Blocks until the call has finished (its deadline bounds that).
  grpc::Status Wait() {
    MutexLock lock(&mu_);
    while (!done_) finished_.wait(mu_);
    return status_;
  }

 private:
  grpc::ClientContext context_;
  Response response_;
  Mutex mu_;
  std::condition_variable_any finished_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

// Bytes of a piece's frame that are not payload: its CRC-32C.
constexpr size_t kFrameCrcBytes = 4;

// The size on the wire of a payload of `bytes` cut into pieces of `chunk` bytes.
size_t FramedSize(size_t bytes, size_t chunk) {
  const size_t data = chunk - kFrameCrcBytes;
  return bytes + kFrameCrcBytes * ((bytes + data - 1) / data);
}

// A lease's payload as the sender puts it on the wire: piece i holds payload bytes
// [i * (chunk - 4), +chunk - 4) followed by their CRC-32C. NcclComm reads it a whole piece at a
// time, at piece boundaries (it cuts transfers at the same chunk size).
class FramedPayload final : public LeasedPayload {
 public:
  FramedPayload(LeasedPayload* payload, size_t chunk, absl::Duration delay, int64_t corrupt)
      : payload_(payload), chunk_(chunk), delay_(delay), corrupt_(corrupt) {}

  size_t size() const override { return FramedSize(payload_->size(), chunk_); }

  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    const size_t piece = offset / chunk_;
    const size_t data_offset = piece * (chunk_ - kFrameCrcBytes);
    if (offset % chunk_ != 0 || dst.size() <= kFrameCrcBytes ||
        dst.size() - kFrameCrcBytes !=
            std::min(chunk_ - kFrameCrcBytes, payload_->size() - data_offset)) {
      return absl::InternalError(absl::StrCat("nccl framing: a read of ", dst.size(),
                                              " bytes at offset ", offset,
                                              " is not piece-aligned for pieces of ", chunk_));
    }
    if (delay_ > absl::ZeroDuration()) absl::SleepFor(delay_);
    const size_t n = dst.size() - kFrameCrcBytes;
    RETURN_IF_ERROR(payload_->ReadAt(data_offset, dst.subspan(0, n)));
    const uint32_t crc = Crc32cExtend(0, dst.subspan(0, n));
    for (size_t i = 0; i < kFrameCrcBytes; ++i) dst[n + i] = static_cast<uint8_t>(crc >> (8 * i));
    if (static_cast<int64_t>(piece) == corrupt_) dst[n / 2] ^= 0x01;
    return absl::OkStatus();
  }

 private:
  LeasedPayload* const payload_;
  const size_t chunk_;
  const absl::Duration delay_;
  const int64_t corrupt_;
};

}  // namespace

// ---- receiver ------------------------------------------------------------------------------

NcclTransport::NcclTransport(Options options)
    : options_(std::move(options)), pool_([this] {
        NcclCommOptions comm = options_.comm;
        comm.device = options_.device;
        comm.chunk_bytes = options_.chunk_bytes;
        return comm;
      }()) {
  // The framing needs room for payload in every piece; the node checks its flag (>= 4 KiB).
  if (options_.chunk_bytes <= 2 * kFrameCrcBytes) {
    std::fprintf(stderr, "NcclTransport: chunk_bytes %zu leaves no room for payload\n",
                 options_.chunk_bytes);
    std::abort();
  }
  if (options_.idle_timeout > absl::ZeroDuration()) reaper_ = std::thread([this] { ReapLoop(); });
}

NcclTransport::~NcclTransport() {
  {
    MutexLock lock(&reaper_mu_);
    stopping_ = true;
    reaper_wake_.notify_all();
  }
  if (reaper_.joinable()) reaper_.join();
  // pool_ closes the communicators as it goes.
}

void NcclTransport::ReapLoop() {
  const auto period = absl::ToChronoNanoseconds(options_.idle_timeout / 4);
  while (true) {
    {
      MutexLock lock(&reaper_mu_);
      if (!stopping_) reaper_wake_.wait_for(reaper_mu_, period);
      if (stopping_) return;
    }
    CloseIdle();
  }
}

size_t NcclTransport::CloseIdle() { return pool_.CloseIdle(options_.idle_timeout); }

std::string NcclTransport::PairKey(const std::string& peer) const {
  const std::string& self = options_.self_name;
  return self < peer ? absl::StrCat(self, "\n", peer) : absl::StrCat(peer, "\n", self);
}

uint64_t NcclTransport::NextGeneration() {
  // Wall-clock nanoseconds, strictly increasing within the process: a restarted node does not
  // reuse the generations of its previous life.
  const uint64_t now = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  uint64_t last = last_generation_.load();
  uint64_t next;
  do {
    next = std::max(now, last + 1);
  } while (!last_generation_.compare_exchange_weak(last, next));
  return next;
}

absl::StatusOr<std::shared_ptr<NcclComm>> NcclTransport::GetOrConnect(const Lease& lease,
                                                                      absl::Time deadline) {
  const std::string key = PairKey(lease.sender_name);
  // Ready, or being initialized by an NcclConnect from the peer: the transfer waits for it.
  std::shared_ptr<NcclComm> comm = pool_.Find(key);
  if (comm != nullptr && comm->healthy()) return comm;
  MutexLock lock(&connect_mu_);
  comm = pool_.Find(key);  // another transfer may have connected meanwhile
  if (comm != nullptr && comm->healthy()) return comm;
  if (comm != nullptr) pool_.Remove(key, comm.get());
  return Connect(lease, deadline);
}

absl::StatusOr<std::shared_ptr<NcclComm>> NcclTransport::Connect(const Lease& lease,
                                                                 absl::Time deadline) {
  const std::shared_ptr<grpc::Channel> channel =
      options_.channels ? options_.channels(lease.sender_address) : nullptr;
  if (channel == nullptr) {
    return absl::UnavailableError(absl::StrCat("NcclConnect for lease ", lease.id,
                                               ": no channel to ", DescribeSender(lease)));
  }
  const std::unique_ptr<v1::PeerService::Stub> stub = v1::PeerService::NewStub(channel);
  ASSIGN_OR_RETURN(std::string unique_id, NewNcclUniqueId());
  const uint64_t generation = NextGeneration();
  // This rank first: the other node's init blocks until both ranks have joined.
  ASSIGN_OR_RETURN(
      std::unique_ptr<NcclComm> started,
      NcclComm::Start(unique_id, 2, RankWith(lease.sender_name), generation, pool_.options()));
  std::shared_ptr<NcclComm> comm(std::move(started));
  const std::string key = PairKey(lease.sender_name);
  pool_.Put(key, comm);

  const absl::Time init_deadline = std::min(deadline, absl::Now() + options_.connect_timeout);
  v1::NcclConnectRequest request;
  request.set_from_node(options_.self_name);
  request.set_unique_id(unique_id);
  request.set_generation(generation);
  PendingCall<v1::NcclConnectResponse> call(init_deadline);
  stub->async()->NcclConnect(call.context(), &request, call.response(), call.OnDone());
  absl::Status status = comm->WaitReady(init_deadline, [&call, &lease]() -> absl::Status {
    std::optional<grpc::Status> failure = call.Failure();
    return failure ? FromPeerStatus(*failure, "NcclConnect", lease) : absl::OkStatus();
  });
  if (!status.ok()) call.Cancel();
  const grpc::Status rpc = call.Wait();
  if (status.ok() && !rpc.ok()) {
    // Both ranks initialized but the peer reported a failure after: do not trust it.
    status = FromPeerStatus(rpc, "NcclConnect", lease);
    comm->RequestAbort();
  }
  if (!status.ok()) {
    pool_.Remove(key, comm.get());
    return status;
  }
  return comm;
}

absl::Status NcclTransport::ReceiveOnce(const Lease& lease, Sink sink, absl::Time deadline,
                                        bool* sink_used) {
  ASSIGN_OR_RETURN(std::shared_ptr<NcclComm> comm, GetOrConnect(lease, deadline));
  const std::shared_ptr<grpc::Channel> channel =
      options_.channels ? options_.channels(lease.sender_address) : nullptr;
  if (channel == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("NcclSend for lease ", lease.id, ": no channel to ", DescribeSender(lease)));
  }
  const std::unique_ptr<v1::PeerService::Stub> stub = v1::PeerService::NewStub(channel);

  v1::NcclSendRequest request;
  request.set_lease_id(lease.id);
  request.set_to_node(options_.self_name);
  request.set_generation(comm->generation());
  PendingCall<v1::NcclSendResponse> call(deadline);
  stub->async()->NcclSend(call.context(), &request, call.response(), call.OnDone());

  uint32_t crc = 0;
  uint64_t received = 0;
  uint64_t pieces = 0;
  bool sink_failed = false;
  // Each piece is checked against its own CRC-32C before its payload goes to the sink.
  auto checked = [&](absl::Span<const uint8_t> frame) -> absl::Status {
    if (frame.size() <= kFrameCrcBytes) {
      return absl::DataLossError(absl::StrCat("nccl transfer of lease ", lease.id, " from ",
                                              DescribeSender(lease), ": piece ", pieces,
                                              " has only ", frame.size(), " bytes"));
    }
    const absl::Span<const uint8_t> piece = frame.subspan(0, frame.size() - kFrameCrcBytes);
    uint32_t expected = 0;
    for (size_t i = 0; i < kFrameCrcBytes; ++i) {
      expected |= uint32_t{frame[piece.size() + i]} << (8 * i);
    }
    const uint32_t actual = Crc32cExtend(0, piece);
    if (actual != expected) {
      return absl::DataLossError(absl::StrCat(
          "nccl transfer of lease ", lease.id, " from ", DescribeSender(lease), ": piece ", pieces,
          " (payload bytes ", received, " to ", received + piece.size(), ") has CRC-32C ",
          Hex32(actual), ", the sender computed ", Hex32(expected)));
    }
    ++pieces;
    crc = Crc32cExtend(crc, piece);
    received += piece.size();
    *sink_used = true;
    absl::Status status = sink(piece);
    sink_failed = !status.ok();
    return status;
  };
  absl::Status status = comm->Recv(
      1 - RankWith(lease.sender_name),
      NcclDestination::Host(FramedSize(lease.payload_bytes, options_.chunk_bytes), checked),
      deadline, [&call, &lease]() -> absl::Status {
        std::optional<grpc::Status> failure = call.Failure();
        return failure ? FromPeerStatus(*failure, "NcclSend", lease) : absl::OkStatus();
      });
  if (!status.ok()) call.Cancel();
  const grpc::Status rpc = call.Wait();
  if (!comm->healthy()) pool_.Remove(PairKey(lease.sender_name), comm.get());
  if (!status.ok()) {
    // The sink's own error, or a piece's CRC mismatch, unchanged.
    if (sink_failed || status.code() == absl::StatusCode::kDataLoss) return status;
    return absl::Status(status.code(),
                        absl::StrCat("nccl transfer of lease ", lease.id, " from ",
                                     DescribeSender(lease), " after ", received, " of ",
                                     lease.payload_bytes, " bytes: ", status.message()));
  }
  if (!rpc.ok()) return FromPeerStatus(rpc, "NcclSend", lease);
  if (received != lease.payload_bytes || crc != lease.crc32c) {
    return absl::DataLossError(absl::StrCat(
        "nccl transfer of lease ", lease.id, " from ", DescribeSender(lease), ": received ",
        received, " bytes with CRC-32C ", Hex32(crc), ", the sender announced ",
        lease.payload_bytes, " bytes with CRC-32C ", Hex32(lease.crc32c)));
  }
  return absl::OkStatus();
}

absl::Status NcclTransport::Receive(const Lease& lease, Sink sink, absl::Time deadline) {
  if (lease.sender_name == options_.self_name) {
    return absl::InvalidArgumentError(absl::StrCat("nccl transfer of lease ", lease.id,
                                                   ": the sender is this node ('",
                                                   lease.sender_name, "')"));
  }
  if (lease.payload_bytes == 0) {
    // Nothing to move (and no communicator needed); the checksum of nothing is 0.
    if (lease.crc32c != 0) {
      return absl::DataLossError(absl::StrCat("lease ", lease.id, " from ", DescribeSender(lease),
                                              " is empty but announces "
                                              "CRC-32C ",
                                              Hex32(lease.crc32c)));
    }
    return absl::OkStatus();
  }
  // The size comes from the peer: one whose framing would not fit a size_t is refused.
  if (lease.payload_bytes > SIZE_MAX / 2) {
    return absl::InvalidArgumentError(absl::StrCat("lease ", lease.id, " from ",
                                                   DescribeSender(lease), " announces ",
                                                   lease.payload_bytes, " bytes"));
  }
  bool sink_used = false;
  absl::Status status = ReceiveOnce(lease, sink, deadline, &sink_used);
  // ABORTED: the pair's communicator was replaced or the sender holds another generation; a
  // new one is made by the retry. Never once the sink has seen bytes: it would see them again.
  if (status.code() == absl::StatusCode::kAborted && !sink_used && absl::Now() < deadline) {
    status = ReceiveOnce(lease, sink, deadline, &sink_used);
  }
  return status;
}

// ---- sender ----------------------------------------------------------------------------------

absl::Status NcclPeerSide::Connect(const v1::NcclConnectRequest& request, absl::Time deadline,
                                   const NcclInterrupt& interrupt) {
  const std::string& self = transport_->options().self_name;
  const std::string& from = request.from_node();
  if (from.empty() || from == self) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclConnect: from_node '", from, "' is not another node"));
  }
  if (request.unique_id().size() != NCCL_UNIQUE_ID_BYTES) {
    return absl::InvalidArgumentError(absl::StrCat("NcclConnect: unique_id has ",
                                                   request.unique_id().size(), " bytes, not ",
                                                   NCCL_UNIQUE_ID_BYTES));
  }
  NcclCommPool* pool = transport_->pool();
  const std::string key = transport_->PairKey(from);
  const std::shared_ptr<NcclComm> existing = pool->Find(key);
  if (existing != nullptr && existing->healthy()) {
    if (existing->generation() == request.generation()) {
      return existing->WaitReady(deadline, interrupt);
    }
    if (!existing->ready() && existing->generation() > request.generation()) {
      return absl::AbortedError(absl::StrCat(
          "NcclConnect from node '", from, "' with generation ", request.generation(), ": node '",
          self, "' is initializing the newer generation ", existing->generation(), " with it"));
    }
  }
  ASSIGN_OR_RETURN(std::unique_ptr<NcclComm> started,
                   NcclComm::Start(request.unique_id(), 2, transport_->RankWith(from),
                                   request.generation(), pool->options()));
  std::shared_ptr<NcclComm> comm(std::move(started));
  pool->Put(key, comm);  // asks the generation it replaces to abort
  absl::Status status = comm->WaitReady(deadline, interrupt);
  if (!status.ok()) pool->Remove(key, comm.get());
  return status;
}

absl::Status NcclPeerSide::Send(const v1::NcclSendRequest& request, LeaseLookup* leases,
                                absl::Time deadline, const NcclInterrupt& interrupt) {
  const std::string& self = transport_->options().self_name;
  const std::string& to = request.to_node();
  if (to.empty() || to == self) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclSend: to_node '", to, "' is not another node"));
  }
  NcclCommPool* pool = transport_->pool();
  const std::string key = transport_->PairKey(to);
  const std::shared_ptr<NcclComm> comm = pool->Find(key);
  if (comm == nullptr || !comm->healthy() || comm->generation() != request.generation()) {
    return absl::AbortedError(absl::StrCat(
        "NcclSend of lease ", request.lease_id(), ": node '", self,
        "' has no nccl communicator of generation ", request.generation(), " with node '", to, "'",
        comm != nullptr && comm->healthy() ? absl::StrCat(" (it has ", comm->generation(), ")")
                                           : std::string(),
        "; reconnect"));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<LeasedPayload> payload, leases->Touch(request.lease_id()));
  const NcclTransport::Options& options = transport_->options();
  FramedPayload framed(payload.get(), options.chunk_bytes, options.piece_delay,
                       options.corrupt_piece);
  absl::Status status =
      comm->Send(1 - transport_->RankWith(to), NcclSource::Host(&framed), deadline, interrupt);
  if (!comm->healthy()) pool->Remove(key, comm.get());
  return status;
}

}  // namespace transport
}  // namespace kvmesh
