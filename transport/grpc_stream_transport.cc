#include "transport/grpc_stream_transport.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <grpc/slice.h>
#include <grpcpp/alarm.h>
#include <grpcpp/client_context.h>
#include <grpcpp/impl/codegen/rpc_method.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "cache/mutex.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "proto/wire/slice_reader.h"
#include "tests/sanitizers/tsan_handoff.h"
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

// PeerService/Fetch, called with raw messages on both ends.
const grpc::internal::RpcMethod& FetchMethod() {
  static const std::string* const name =
      new std::string(absl::StrCat("/", v1::PeerService::service_full_name(), "/Fetch"));
  static const grpc::internal::RpcMethod* const method =
      new grpc::internal::RpcMethod(name->c_str(), grpc::internal::RpcMethod::SERVER_STREAMING);
  return *method;
}

// A Chunk message (proto/kvmesh/v1/peer.proto), its data left where it lies in the slices.
struct ParsedChunk {
  int64_t offset = 0;
  bool has_crc32c = false;
  uint32_t crc32c = 0;
  bool has_data = false;
  std::vector<absl::Span<const uint8_t>> data;
  uint64_t data_bytes = 0;
};

// Parses a Chunk without copying its data. Unknown fields are skipped, as a protobuf parser
// would; INVALID_ARGUMENT (naming the field) for a message that does not parse.
absl::Status ParseChunk(const std::vector<grpc::Slice>& slices, ParsedChunk* chunk) {
  SliceReader in(slices);
  while (!in.done()) {
    uint64_t tag;
    if (!in.Varint(&tag)) return absl::InvalidArgumentError("truncated tag");
    const uint64_t field = tag >> 3;
    if (field == 0) return absl::InvalidArgumentError("field 0");
    const int wire_type = static_cast<int>(tag & 7);
    uint64_t value = 0;
    uint32_t value32 = 0;
    switch (wire_type) {
      case 0:  // varint
        if (!in.Varint(&value)) return absl::InvalidArgumentError(absl::StrCat("field ", field));
        if (field == 1) chunk->offset = static_cast<int64_t>(value);
        break;
      case 1:  // 64-bit
        if (!in.Take(8, nullptr)) return absl::InvalidArgumentError(absl::StrCat("field ", field));
        break;
      case 2: {  // length-delimited
        if (!in.Varint(&value)) return absl::InvalidArgumentError(absl::StrCat("field ", field));
        if (field == 2) {
          // A repeated bytes field replaces the earlier value.
          chunk->data.clear();
          chunk->has_data = true;
          chunk->data_bytes = value;
        }
        if (!in.Take(value, field == 2 ? &chunk->data : nullptr)) {
          return absl::InvalidArgumentError(
              absl::StrCat("field ", field, " of ", value, " bytes runs past the message"));
        }
        break;
      }
      case 5:  // 32-bit
        if (!in.Fixed32(&value32)) return absl::InvalidArgumentError(absl::StrCat("field ", field));
        if (field == 3) {
          chunk->has_crc32c = true;
          chunk->crc32c = value32;
        }
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("field ", field, " has wire type ", wire_type));
    }
    if ((field == 1 && wire_type != 0) || (field == 2 && wire_type != 2) ||
        (field == 3 && wire_type != 5)) {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", field, " has wire type ", wire_type));
    }
  }
  return absl::OkStatus();
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
  // Chunks arrive as raw messages: their data is read where gRPC received it, not copied into a
  // parsed message first.
  const std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel.get(), FetchMethod(),
                                                                    &context, request));
  const std::string from =
      absl::StrCat("Fetch of lease ", lease.id, " from ", DescribeSender(lease));
  grpc::ByteBuffer message;
  std::vector<grpc::Slice> slices;
  uint64_t received = 0;
  uint32_t crc = 0;      // of the whole payload, when the lease announced one
  absl::Status stopped;  // an error of this side that ends the stream early
  while (reader->Read(&message)) {
    slices.clear();
    ParsedChunk chunk;
    if (!message.Dump(&slices).ok()) {
      stopped = absl::DataLossError(
          absl::StrCat(from, ": a chunk after ", received, " bytes could not be read"));
      break;
    }
    stopped = ParseChunk(slices, &chunk);
    if (!stopped.ok()) {
      stopped = absl::DataLossError(absl::StrCat(from, ": the chunk after ", received,
                                                 " bytes does not parse: ", stopped.message()));
      break;
    }
    if (chunk.offset < 0 || static_cast<uint64_t>(chunk.offset) != received) {
      stopped = absl::DataLossError(absl::StrCat(from, ": chunk at offset ", chunk.offset, " but ",
                                                 received, " bytes were received before it"));
      break;
    }
    if (chunk.data_bytes > lease.payload_bytes - received) {
      stopped = absl::DataLossError(
          absl::StrCat(from, ": chunk at offset ", chunk.offset, " of ", chunk.data_bytes,
                       " bytes runs to offset ", received + chunk.data_bytes,
                       ", past the payload's ", lease.payload_bytes, " bytes"));
      break;
    }
    if (!chunk.has_data || chunk.data_bytes == 0) {
      stopped = absl::DataLossError(
          absl::StrCat(from, ": chunk at offset ", chunk.offset, " carries no data"));
      break;
    }
    // A sender that announced the whole payload's CRC-32C (an older node) may send chunks
    // without their own; the whole one is checked at the end.
    if (!chunk.has_crc32c && !lease.has_crc32c) {
      stopped = absl::DataLossError(
          absl::StrCat(from, ": chunk at offset ", chunk.offset, " carries no crc32c"));
      break;
    }
    // Each piece is checksummed and handed on while it is in the cache. A sink error stops
    // the hand-over but not the checksum: corrupted bytes explain a sink's complaint.
    uint32_t chunk_crc = 0;
    absl::Status sunk;
    for (absl::Span<const uint8_t> piece : chunk.data) {
      chunk_crc = Crc32cExtend(chunk_crc, piece);
      if (lease.has_crc32c) crc = Crc32cExtend(crc, piece);
      if (sunk.ok()) sunk = sink(piece);
    }
    if (chunk.has_crc32c && chunk_crc != chunk.crc32c) {
      stopped = absl::DataLossError(absl::StrCat(from, ": CRC-32C of the ", chunk.data_bytes,
                                                 " bytes of the chunk at offset ", chunk.offset,
                                                 " is ", Hex32(chunk_crc),
                                                 " but the sender computed ", Hex32(chunk.crc32c)));
      break;
    }
    stopped = sunk;
    if (!stopped.ok()) break;
    received += chunk.data_bytes;
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
    return absl::DataLossError(absl::StrCat(from, ": the stream ended after ", received, " of ",
                                            lease.payload_bytes, " bytes"));
  }
  if (lease.has_crc32c && crc != lease.crc32c) {
    return absl::DataLossError(absl::StrCat(from, ": CRC-32C of the ", received,
                                            " bytes received is ", Hex32(crc),
                                            " but Export announced ", Hex32(lease.crc32c)));
  }
  return absl::OkStatus();
}

// ---- sender --------------------------------------------------------------------------------
namespace {

// A chunk's data in more pieces than this is copied instead (4 MiB chunks: views of 64 KiB on
// average at least).
constexpr size_t kMaxViewsPerChunk = 64;

// Payload references held by slices of sent chunks (PayloadSlicesHeld).
std::atomic<int64_t> payload_slices{0};

void* NewPayloadRef(const std::shared_ptr<LeasedPayload>& payload) {
  payload_slices.fetch_add(1, std::memory_order_relaxed);
  return new std::shared_ptr<LeasedPayload>(payload);
}

// A slice's destroy callback, on whichever thread gRPC drops the slice.
void ReleasePayloadRef(void* ref) {
  delete static_cast<std::shared_ptr<LeasedPayload>*>(ref);
  payload_slices.fetch_sub(1, std::memory_order_release);
}

size_t PutVarint(uint64_t v, uint8_t* out) {
  size_t k = 0;
  while (v >= 0x80) {
    out[k++] = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  out[k++] = static_cast<uint8_t>(v);
  return k;
}

// A Chunk's fields up to its data's bytes: offset (1, varint), crc32c (3, fixed32), then the
// tag and length of data (2). Returns the bytes written (at most 28).
size_t EncodeChunkFields(uint64_t offset, uint32_t crc32c, uint64_t data_bytes, uint8_t* out) {
  size_t k = 0;
  out[k++] = 1 << 3 | 0;
  k += PutVarint(offset, out + k);
  out[k++] = 3 << 3 | 5;
  for (int i = 0; i < 4; ++i) out[k++] = static_cast<uint8_t>(crc32c >> (8 * i));
  out[k++] = 2 << 3 | 2;
  k += PutVarint(data_bytes, out + k);
  return k;
}

// One Fetch stream. Exactly one party owns the stream's progress at a time and is the only one
// to touch the chunk or start an operation: the constructor, then either the write in flight
// (its OnWriteDone), the chunk_delay alarm (its callback) or the read of a chunk queued on
// options_.run_read (ReadChunk, on the runner's thread). Each hands over by starting the next
// operation as its last step, and the owner calls Finish exactly once. OnCancel may run
// concurrently with the owner: it only records the cancellation and cancels a pending alarm
// (under mu_), so that the owner finishes promptly (a queued read checks it before reading);
// gRPC runs OnDone after every other reaction has returned, and neither alarm callbacks nor
// reads can be pending then (only an owner finishes).
// Base: grpc::ServerWriteReactor<grpc::ByteBuffer> (a raw Fetch method), or StreamReactor (a
// Fetch through the node's RequestGate); `args` are the base's constructor's.
template <typename Base>
class FetchReactor final : public Base {
 public:
  template <typename... BaseArgs>
  FetchReactor(const grpc::ByteBuffer& request, absl::Time deadline, LeaseLookup* leases,
               const SenderOptions& options, BaseArgs... args)
      : Base(args...), leases_(leases), options_(options), deadline_(deadline) {
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

  grpc::Status Start(const grpc::ByteBuffer& raw) {
    v1::FetchRequest request;
    std::vector<grpc::Slice> slices;
    std::string bytes;
    if (!raw.Dump(&slices).ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the FetchRequest cannot be read");
    }
    for (const grpc::Slice& slice : slices) {
      bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    if (!request.ParseFromString(bytes)) {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("the FetchRequest of ", bytes.size(), " bytes does not parse"));
    }
    lease_id_ = request.lease_id();
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

  // Owner: renews the lease and sends the next chunk: as views of the payload's memory, prepared
  // here, or copied with ReadAt by ReadChunk on options_.run_read's thread.
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
    // The data as it lies in the payload's memory, unless it is not in host memory, or in so
    // many small pieces that a slice each would cost more than a copy (or a chunk to corrupt).
    views_.clear();
    bool viewed = chunks_ != options_.corrupt_chunk;
    for (size_t at = offset_; viewed && at < offset_ + n;) {
      const absl::Span<const uint8_t> view = payload_->View(at, offset_ + n - at);
      if (view.empty() || views_.size() == kMaxViewsPerChunk) {
        viewed = false;
        break;
      }
      views_.push_back(view);
      at += view.size();
    }
    if (!viewed) {
      ScheduleRead();
      return;
    }
    std::vector<grpc::Slice> slices(1);  // [0]: the fields before the data, by StartChunk
    uint32_t crc = 0;
    // Each slice holds a reference to the payload, so the bytes outlive the write whatever
    // gRPC does with them.
    for (const absl::Span<const uint8_t> view : views_) {
      crc = Crc32cExtend(crc, view);
      slices.emplace_back(const_cast<uint8_t*>(view.data()), view.size(), &ReleasePayloadRef,
                          NewPayloadRef(payload_));
    }
    StartChunk(std::move(slices), crc, n);
  }

  // Owner: hands the read of the next chunk to options_.run_read (inline without one). A
  // refused read finishes the stream with the runner's status (UNAVAILABLE: the receiver's
  // caller retries the transfer later, as for any call an overloaded node refuses). Waiting
  // here for room instead would hold this gRPC thread, which is what the runner is for, and
  // reading inline instead would do the same whenever the runner is busiest.
  void ScheduleRead() {
    if (!options_.run_read) {
      ReadChunk();
      return;
    }
    // A copy: once the runner has the read, ReadChunk may finish the call and OnDone delete this
    // reactor (and options_ with it) before the runner returns.
    const ReadRunner run = options_.run_read;
    const std::string lease_id = lease_id_;
    const size_t offset = offset_;
    HandOff(this);  // to ReadChunk, unless the runner refuses it
    const absl::Status queued = run([this] { ReadChunk(); });
    if (queued.ok()) return;  // nothing of this reactor is touched from here
    TakeOver(this);           // refused: the read never runs, this is still the owner
    Done(grpc::Status(static_cast<grpc::StatusCode>(queued.code()),
                      absl::StrCat("lease ", lease_id, " at offset ", offset,
                                   ": the chunk's read was refused: ", queued.message())));
  }

  // Owner, on options_.run_read's thread (or gRPC's without one): copies the next chunk out of
  // the payload (ReadAt may wait for a device copy) and starts its write.
  void ReadChunk() {
    TakeOver(this);
    bool cancelled;
    {
      MutexLock lock(&mu_);
      cancelled = cancelled_;
    }
    if (cancelled) {
      // The receiver went away while the read was queued: skip the copy nobody will take.
      Done(CancelledStatus());
      return;
    }
    if (absl::Now() >= deadline_) {
      // The call's deadline passed while the read was queued: its receiver has returned, though
      // gRPC may not have told this reactor yet (OnCancel comes later on a loaded node).
      Done(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        absl::StrCat("lease ", lease_id_, " at offset ", offset_,
                                     ": the Fetch's deadline passed while its read was queued")));
      return;
    }
    const size_t n = std::min(chunk_bytes_, size_ - offset_);
    // One copy, into a slice of its own (allocated here, not when queued, so that queued reads
    // hold no memory).
    grpc_slice copy = grpc_slice_malloc(n);
    uint8_t* data = GRPC_SLICE_START_PTR(copy);
    std::vector<grpc::Slice> slices(1);  // [0]: the fields before the data, by StartChunk
    slices.emplace_back(copy, grpc::Slice::STEAL_REF);
    const absl::Status read = payload_->ReadAt(offset_, absl::Span<uint8_t>(data, n));
    if (!read.ok()) {
      Done(grpc::Status(
          static_cast<grpc::StatusCode>(read.code()),
          absl::StrCat("reading lease ", lease_id_, " at offset ", offset_, ": ", read.message())));
      return;
    }
    const uint32_t crc = Crc32cExtend(0, absl::Span<const uint8_t>(data, n));
    if (chunks_ == options_.corrupt_chunk) data[n / 2] ^= 0x01;  // n > 0 here
    StartChunk(std::move(slices), crc, n);
  }

  // Owner: completes the message (`slices` after their empty first one hold the chunk's `n`
  // bytes, whose CRC-32C is `crc`) and starts its write, handing the stream to OnWriteDone.
  void StartChunk(std::vector<grpc::Slice> slices, uint32_t crc, size_t n) {
    uint8_t fields[32];
    const size_t k = EncodeChunkFields(static_cast<uint64_t>(offset_), crc, n, fields);
    slices[0] = grpc::Slice(fields, k);
    chunk_ = grpc::ByteBuffer(slices.data(), slices.size());
    offset_ += n;
    ++chunks_;
    HandOff(this);  // nothing of this reactor is touched from here until OnWriteDone
    this->StartWrite(&chunk_);
  }

  // Owner: finishes the call. Nothing of the reactor is touched afterwards.
  void Done(const grpc::Status& status) {
    HandOff(this);
    this->Finish(status);
  }

  LeaseLookup* const leases_;
  const SenderOptions options_;
  const absl::Time deadline_;  // the call's
  std::string lease_id_;       // set by the constructor

  // Owned by the current owner (see the class comment).
  std::shared_ptr<LeasedPayload> payload_;
  size_t size_ = 0;
  size_t offset_ = 0;                             // of the next chunk
  size_t chunk_bytes_ = 0;                        // of every chunk but the last
  int64_t chunks_ = 0;                            // chunks sent so far
  grpc::ByteBuffer chunk_;                        // the message being written
  std::vector<absl::Span<const uint8_t>> views_;  // SendChunk's, kept for its capacity

  Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<grpc::Alarm> alarm_ ABSL_GUARDED_BY(mu_);  // the latest chunk_delay
};

}  // namespace

int64_t PayloadSlicesHeld() { return payload_slices.load(std::memory_order_acquire); }

bool AwaitPayloadSlicesReleased(absl::Time deadline) {
  while (PayloadSlicesHeld() != 0) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ServeFetch(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       LeaseLookup* leases,
                                                       const SenderOptions& options) {
  // Cancellation arrives through the reactor's OnCancel; a queued read also checks the deadline.
  return new FetchReactor<grpc::ServerWriteReactor<grpc::ByteBuffer>>(
      *request, absl::FromChrono(context->deadline()), leases, options);
}

StreamReactor* ServeFetch(StreamCall* call, const grpc::ByteBuffer* request, LeaseLookup* leases,
                          const SenderOptions& options) {
  return new FetchReactor<StreamReactor>(*request, absl::FromChrono(call->context()->deadline()),
                                         leases, options, call);
}

}  // namespace transport
}  // namespace kvmesh
