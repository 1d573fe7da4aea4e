#include "transport/grpc_stream_transport.h"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <utility>

#include <grpcpp/alarm.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "cache/mutex.h"
#include "cache/tsan_handoff.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "transport/checksum.h"

namespace kvmesh {
namespace transport {
namespace {

grpc::Status ToGrpc(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

std::string Hex32(uint32_t v) { return absl::StrCat("0x", absl::Hex(v, absl::kZeroPad8)); }

// ---- receiver ------------------------------------------------------------------------------

// "sender 'a' (10.0.0.2:7700)", for messages.
std::string DescribeSender(const Lease& lease) {
  return absl::StrCat("sender '", lease.sender_name, "' (", lease.sender_address, ")");
}

absl::Status FromFetchStatus(const grpc::Status& status, const Lease& lease, uint64_t received) {
  const std::string where =
      absl::StrCat("Fetch of lease ", lease.id, " from ", DescribeSender(lease), " after ",
                   received, " of ", lease.payload_bytes, " bytes");
  switch (status.error_code()) {
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return absl::DeadlineExceededError(
          absl::StrCat(where, ": deadline exceeded: ", status.error_message()));
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::CANCELLED:
      // CANCELLED reaches a client only when the server ends the call (it shut down): this
      // side cancels only on its own errors, which Receive returns before looking here.
      return absl::UnavailableError(
          absl::StrCat(where, ": the sender is unavailable: ", status.error_message()));
    default:
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          absl::StrCat(where, ": ", status.error_message()));
  }
}

}  // namespace

grpc::ChannelArguments GrpcStreamTransport::MakeChannelArguments(const Options& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_receive_message);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 1);
  const int32_t chunk = options.chunk_bytes > 0 ? options.chunk_bytes : kDefaultChunkBytes;
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, chunk);
  return args;
}

GrpcStreamTransport::GrpcStreamTransport(ChannelFactory channels, Options options)
    : channels_(std::move(channels)), options_(options) {}

absl::Status GrpcStreamTransport::Receive(const Lease& lease, Sink sink, absl::Time deadline) {
  const std::shared_ptr<grpc::Channel> channel = channels_(lease.sender_address);
  if (channel == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("Fetch of lease ", lease.id, ": no channel to ", DescribeSender(lease)));
  }
  const std::unique_ptr<v1::PeerService::Stub> stub = v1::PeerService::NewStub(channel);

  int32_t chunk_bytes = options_.chunk_bytes > 0 ? options_.chunk_bytes : kDefaultChunkBytes;
  if (options_.max_receive_message > 2 * kChunkOverheadBytes) {
    chunk_bytes = std::min(chunk_bytes, options_.max_receive_message - kChunkOverheadBytes);
  }
  v1::FetchRequest request;
  request.set_lease_id(lease.id);
  request.set_offset(0);
  request.set_chunk_bytes(chunk_bytes);

  grpc::ClientContext context;
  if (deadline != absl::InfiniteFuture()) context.set_deadline(absl::ToChronoTime(deadline));
  const std::unique_ptr<grpc::ClientReader<v1::Chunk>> reader = stub->Fetch(&context, request);

  v1::Chunk chunk;
  uint64_t received = 0;
  uint32_t crc = 0;
  absl::Status stopped;  // an error of this side that ends the stream early
  while (reader->Read(&chunk)) {
    const std::string& data = chunk.data();
    if (chunk.offset() < 0 || static_cast<uint64_t>(chunk.offset()) != received) {
      stopped = absl::DataLossError(absl::StrCat(
          "Fetch of lease ", lease.id, " from ", DescribeSender(lease), ": chunk at offset ",
          chunk.offset(), " but ", received, " bytes were received before it"));
      break;
    }
    if (data.size() > lease.payload_bytes - received) {
      stopped = absl::DataLossError(absl::StrCat(
          "Fetch of lease ", lease.id, " from ", DescribeSender(lease), ": chunk at offset ",
          chunk.offset(), " of ", data.size(), " bytes runs to offset ", received + data.size(),
          ", past the payload's ", lease.payload_bytes, " bytes"));
      break;
    }
    const absl::Span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(data.data()),
                                          data.size());
    crc = Crc32cExtend(crc, bytes);
    stopped = sink(bytes);
    if (!stopped.ok()) break;
    received += data.size();
  }
  if (!stopped.ok()) {
    // Tell the sender to stop; Finish then reports CANCELLED, which says nothing new.
    context.TryCancel();
    reader->Finish().IgnoreError();
    return stopped;
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return FromFetchStatus(status, lease, received);
  if (received != lease.payload_bytes) {
    return absl::DataLossError(absl::StrCat("Fetch of lease ", lease.id, " from ",
                                            DescribeSender(lease), ": the stream ended after ",
                                            received, " of ", lease.payload_bytes, " bytes"));
  }
  if (crc != lease.crc32c) {
    return absl::DataLossError(absl::StrCat(
        "Fetch of lease ", lease.id, " from ", DescribeSender(lease), ": CRC-32C of the ", received,
        " bytes received is ", Hex32(crc), " but Export announced ", Hex32(lease.crc32c)));
  }
  return absl::OkStatus();
}

// ---- sender --------------------------------------------------------------------------------
namespace {

// One Fetch stream. Exactly one party owns the stream's progress at a time and is the only one
// to touch the chunk or start an operation: the constructor, then either the write in flight
// (its OnWriteDone) or the chunk_delay alarm (its callback). Each hands over by starting the
// next operation as its last step, and the owner calls Finish exactly once. OnCancel may run
// concurrently with the owner: it only records the cancellation and cancels a pending alarm
// (under mu_), so that the owner finishes promptly; gRPC runs OnDone after every other reaction
// has returned, and alarm callbacks cannot be pending then (only an owner finishes).
class FetchReactor final : public grpc::ServerWriteReactor<v1::Chunk> {
 public:
  FetchReactor(const v1::FetchRequest& request, LeaseLookup* leases, const SenderOptions& options)
      : leases_(leases), options_(options), lease_id_(request.lease_id()) {
    const grpc::Status status = Start(request);
    if (!status.ok()) {
      Done(status);
      return;
    }
    Next();
  }

  void OnWriteDone(bool ok) override {
    TakeOver(this);
    if (!ok) {
      Done(CancelledStatus());  // the receiver went away; nothing more can be written
      return;
    }
    Next();
  }

  void OnCancel() override {
    grpc::Alarm* alarm = nullptr;
    {
      MutexLock lock(&mu_);
      cancelled_ = true;
      alarm = alarm_.get();
    }
    // Outside mu_: a cancelled alarm runs its callback (which takes mu_) on another thread. No
    // owner replaces alarm_ once cancelled_ is set, and OnDone waits for this reaction.
    if (alarm != nullptr) alarm->Cancel();
    HandOff(this);  // to OnDone, which gRPC runs after this reaction has returned
  }

  void OnDone() override {
    TakeOver(this);
    delete this;
  }

 private:
  static grpc::Status CancelledStatus() {
    return grpc::Status(grpc::StatusCode::CANCELLED, "Fetch cancelled: the receiver went away");
  }

  grpc::Status Start(const v1::FetchRequest& request) {
    absl::StatusOr<std::shared_ptr<LeasedPayload>> payload = leases_->Touch(lease_id_);
    if (!payload.ok()) return ToGrpc(payload.status());
    payload_ = *std::move(payload);
    size_ = payload_->size();
    if (request.offset() < 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("offset = ", request.offset(), " is negative"));
    }
    if (static_cast<uint64_t>(request.offset()) > size_) {
      return grpc::Status(grpc::StatusCode::OUT_OF_RANGE,
                          absl::StrCat("offset = ", request.offset(), " is past the end of lease ",
                                       lease_id_, "'s payload of ", size_, " bytes"));
    }
    offset_ = static_cast<size_t>(request.offset());
    const int32_t requested = request.chunk_bytes();
    if (requested < 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("chunk_bytes = ", requested, " is negative (0: the ",
                                       options_.default_chunk_bytes, "-byte default)"));
    }
    const int32_t wanted = requested == 0 ? options_.default_chunk_bytes : requested;
    chunk_bytes_ = static_cast<size_t>(std::max(1, std::min(wanted, options_.max_chunk_bytes)));
    return grpc::Status::OK;
  }

  // Owner: the next chunk now, after chunk_delay, or the end of the stream.
  void Next() {
    if (offset_ == size_) {
      Done(grpc::Status::OK);
      return;
    }
    if (options_.chunk_delay > absl::ZeroDuration()) {
      if (!StartDelay()) Done(CancelledStatus());
      return;
    }
    SendChunk();
  }

  // Owner: arms the chunk_delay alarm, whose callback becomes the owner; false when the call
  // is cancelled already. The caller must not touch the reactor after a true answer.
  bool StartDelay() {
    MutexLock lock(&mu_);
    if (cancelled_) return false;
    // Replacing the previous alarm is safe: it has fired, and gRPC keeps its internals alive
    // until its callback has returned. The callback takes mu_ first, so it waits for this
    // lock to be released before it can finish the call.
    alarm_ = std::make_unique<grpc::Alarm>();
    HandOff(this);
    alarm_->Set(absl::ToChronoTime(absl::Now() + options_.chunk_delay),
                [this](bool fired) { OnDelayDone(fired); });
    return true;
  }

  // Owner, on one of gRPC's executor threads.
  void OnDelayDone(bool fired) {
    TakeOver(this);
    bool cancelled;
    {
      MutexLock lock(&mu_);
      cancelled = cancelled_;
    }
    if (!fired || cancelled) {
      Done(CancelledStatus());
      return;
    }
    SendChunk();
  }

  // Owner: renews the lease, reads the next chunk into the message and starts its write.
  void SendChunk() {
    if (chunks_ > 0) {
      const absl::StatusOr<std::shared_ptr<LeasedPayload>> renewed = leases_->Touch(lease_id_);
      if (!renewed.ok()) {
        Done(grpc::Status(static_cast<grpc::StatusCode>(renewed.status().code()),
                          absl::StrCat("lease ", lease_id_, " ended mid-transfer at offset ",
                                       offset_, ": ", renewed.status().message())));
        return;
      }
    }
    const size_t n = std::min(chunk_bytes_, size_ - offset_);
    // The bytes field keeps its capacity from chunk to chunk, so after the first chunk the
    // resize neither allocates nor clears: ReadAt writes straight into the message.
    std::string* data = chunk_.mutable_data();
    data->resize(n);
    const absl::Status read =
        payload_->ReadAt(offset_, absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(data->data()), n));
    if (!read.ok()) {
      Done(grpc::Status(
          static_cast<grpc::StatusCode>(read.code()),
          absl::StrCat("reading lease ", lease_id_, " at offset ", offset_, ": ", read.message())));
      return;
    }
    if (chunks_ == options_.corrupt_chunk) (*data)[n / 2] ^= 0x01;  // n > 0 here
    chunk_.set_offset(static_cast<int64_t>(offset_));
    offset_ += n;
    ++chunks_;
    HandOff(this);  // nothing of this reactor is touched from here until OnWriteDone
    StartWrite(&chunk_);
  }

  // Owner: finishes the call. Nothing of the reactor is touched afterwards.
  void Done(const grpc::Status& status) {
    HandOff(this);
    Finish(status);
  }

  LeaseLookup* const leases_;
  const SenderOptions options_;
  const uint64_t lease_id_;

  // Owned by the current owner (see the class comment).
  std::shared_ptr<LeasedPayload> payload_;
  size_t size_ = 0;
  size_t offset_ = 0;       // of the next chunk
  size_t chunk_bytes_ = 0;  // of every chunk but the last
  int64_t chunks_ = 0;      // chunks sent so far
  v1::Chunk chunk_;

  Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<grpc::Alarm> alarm_ ABSL_GUARDED_BY(mu_);  // the latest chunk_delay
};

}  // namespace

grpc::ServerWriteReactor<v1::Chunk>* ServeFetch(grpc::CallbackServerContext* context,
                                                const v1::FetchRequest* request,
                                                LeaseLookup* leases, const SenderOptions& options) {
  (void)context;  // cancellation arrives through the reactor's OnCancel
  return new FetchReactor(*request, leases, options);
}

}  // namespace transport
}  // namespace kvmesh
