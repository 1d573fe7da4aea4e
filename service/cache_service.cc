#include "service/cache_service.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "cache/status_macros.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "service/cluster/cluster.h"
#include "service/common/convert.h"
#include "service/common/log.h"
#include "service/common/raw_message.h"
#include "service/list_pages.h"
#include "service/peer_service.h"
#include "service/request_gate.h"
#include "tests/sanitizers/tsan_handoff.h"

namespace kvmesh {
namespace {

// Room left in every Read message for the protobuf framing around its data.
constexpr size_t kReadMessageSlack = 1024;

int64_t DistinctSequences(absl::Span<const Token> tokens) {
  absl::flat_hash_set<int64_t> seqs;
  for (const Token& t : tokens) seqs.insert(t.seq);
  return static_cast<int64_t>(seqs.size());
}

// Checks the shape of an Append batch against the spec before any payload is touched: at
// least one token, at most max_batch, and `payload_bytes` (named `payload_field` in messages)
// equal to the spec's arithmetic for a plain or `speculative` Append. The engine checks the
// semantics (positions, capacity, pending tokens).
absl::Status CheckAppendShape(const CacheSpec& spec, absl::Span<const Token> tokens,
                              bool speculative, absl::string_view payload_field,
                              int64_t payload_bytes) {
  if (tokens.empty()) {
    return absl::InvalidArgumentError("tokens is empty: an Append needs at least one token");
  }
  if (tokens.size() > static_cast<size_t>(spec.max_batch)) {
    return absl::InvalidArgumentError(absl::StrCat("batch of ", tokens.size(),
                                                   " tokens exceeds max_batch = ", spec.max_batch,
                                                   " of cache '", spec.name, "'"));
  }
  const size_t expected = AppendPayloadBytes(spec, static_cast<int64_t>(tokens.size()),
                                             DistinctSequences(tokens), speculative);
  if (payload_bytes < 0 || static_cast<uint64_t>(payload_bytes) != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(payload_field, " = ", payload_bytes, " bytes, but ", tokens.size(),
                     speculative ? " speculative" : "", " tokens of cache '", spec.name, "' need ",
                     expected, " bytes"));
  }
  return absl::OkStatus();
}

absl::Span<const uint8_t> AsBytes(const std::string& s) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// INVALID_ARGUMENT naming `field` when `value` is negative: the engine's ids and offsets are
// never negative.
absl::Status CheckNotNegative(absl::string_view field, int64_t value) {
  if (value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, " = ", value, " is negative"));
  }
  return absl::OkStatus();
}

grpc::Status InvalidArgument(std::string message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::move(message));
}

// Reserve's TTL when a request leaves ttl_ms at 0, and the longest one accepted.
constexpr int64_t kDefaultReserveTtlMs = 60 * 1000;
constexpr int64_t kMaxReserveTtlMs = 60 * 60 * 1000;

// Heap bytes a parsed request holds for `n` elements of a repeated message field (one allocated
// message each, with malloc's header, and a pointer to it), plus the engine's copy of `n`
// `Engine` values: a request of many small tokens or queries parses to several times its size
// on the wire, so the in-flight budget counts this, not the wire size.
template <typename Proto, typename Engine>
uint64_t ParsedBytes(int64_t n) {
  return static_cast<uint64_t>(n) * (sizeof(Proto) + 16 + sizeof(void*) + sizeof(Engine));
}

// The entries an Append's message parses to (its tokens and token ranges), which the in-flight
// budget counts as soon as the message arrives, before its cache (and so max_batch) is known.
int64_t ParsedTokens(const google::protobuf::RepeatedPtrField<v1::Token>& tokens,
                     const google::protobuf::RepeatedPtrField<v1::TokenRange>& ranges) {
  return int64_t{tokens.size()} + ranges.size();
}

// The tokens an Append names (TokensFromProto, at most spec.max_batch). Ranges may name up to
// max_batch tokens in a few bytes: `reservation` first grows from the ParsedTokens counted on
// arrival to the tokens the ranges expand to (and *tokens_bytes with it, when given).
absl::StatusOr<std::vector<Token>> ExpandTokens(
    const google::protobuf::RepeatedPtrField<v1::Token>& tokens,
    const google::protobuf::RepeatedPtrField<v1::TokenRange>& ranges, const CacheSpec& spec,
    InflightBudget::Reservation* reservation, uint64_t* tokens_bytes) {
  const int64_t charged = ParsedTokens(tokens, ranges);
  const int64_t expanded = CountTokens(tokens, ranges, int64_t{spec.max_batch} + 1);
  if (expanded <= spec.max_batch && expanded > charged) {
    const uint64_t more =
        ParsedBytes<v1::Token, Token>(expanded) - ParsedBytes<v1::Token, Token>(charged);
    RETURN_IF_ERROR(reservation->Resize(
        reservation->bytes() + more,
        absl::StrCat("the ", expanded, " tokens the Append's token_ranges expand to")));
    if (tokens_bytes != nullptr) *tokens_bytes += more;
  }
  return TokensFromProto(tokens, ranges, spec.max_batch);
}

// Answers a unary call at once with `status`, for a request refused before any work.
void FinishNow(UnaryCall* call, const absl::Status& status) { call->Answer(ToGrpcStatus(status)); }

// What a Visible answer lists: positions, or ranges of them (as_ranges).
struct VisibleUnit {
  const char* name;         // "positions" or "ranges"
  uint64_t wire_bytes;      // most bytes one takes serialized
  uint64_t building_bytes;  // bytes one holds while the answer is built and sent
};
constexpr VisibleUnit kVisiblePositions = {"positions", 5, kVisibleBytesPerPosition};
constexpr VisibleUnit kVisibleRanges = {"ranges", 14, kVisibleBytesPerRange};

// Upper bound of a serialized VisibleResponse listing `entries` of `unit`: per query a
// Visibility's tag, length and packed-field header.
uint64_t VisibleWireBound(const VisibleUnit& unit, size_t queries, int64_t entries) {
  return unit.wire_bytes * static_cast<uint64_t>(entries) + 16 * static_cast<uint64_t>(queries) +
         16;
}

// Decides, before the engine lists anything, whether a Visible of `queries` queries that lists
// at most `entries` positions or ranges may run: within max_entries (--max-visible-positions),
// an answer that fits the send limit, and its memory reserved in `budget` (into *reservation).
absl::Status AdmitVisible(const std::string& tenant, const std::string& cache, int32_t group,
                          size_t queries, const VisibleUnit& unit, int64_t entries,
                          int64_t max_entries, size_t max_send_bytes, InflightBudget* budget,
                          InflightBudget::Reservation* reservation) {
  if (entries > max_entries) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Visible of ", queries, " queries in group ", group, " of cache '", cache,
        "' would list up to ", entries, " ", unit.name, ", more than this node's limit of ",
        max_entries, " per call (--max-visible-positions); split the queries over calls"));
  }
  const uint64_t wire = VisibleWireBound(unit, queries, entries);
  if (wire > max_send_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Visible of ", queries, " queries in group ", group, " of cache '", cache,
                     "' would list up to ", entries, " ", unit.name, " in an answer of up to ",
                     wire, " bytes, more than this node's message limit of ", max_send_bytes,
                     " bytes (--max-message-bytes); split the queries over calls"));
  }
  const uint64_t bytes = unit.building_bytes * static_cast<uint64_t>(entries) +
                         kVisibleBytesPerQuery * static_cast<uint64_t>(queries);
  ASSIGN_OR_RETURN(*reservation,
                   budget->Reserve(tenant, bytes,
                                   absl::StrCat("Visible of ", queries, " queries and up to ",
                                                entries, " ", unit.name)));
  return absl::OkStatus();
}

constexpr char kCancelledMessage[] = "call cancelled by the client";

const grpc::Status& CancelledStatus() {
  static const grpc::Status* const status =
      new grpc::Status(grpc::StatusCode::CANCELLED, kCancelledMessage);
  return *status;
}

}  // namespace

// ---- AppendStream -------------------------------------------------------------------------
//
// AppendStream is served raw (WithRawCallbackMethod_AppendStream): the node reads each
// AppendStreamRequest's fields where gRPC received them, so that the data goes from the
// received slices straight into the cells the Append will take (Cache::BeginAppend), without a
// parsed copy or a stream buffer in between.
//
// States: reading the first message (no header yet) -> checking the header and beginning the
// engine append on the executor (no read outstanding) -> reading data, each message written
// into the append as it arrives -> committing on the executor -> finished. Exactly one of
// gRPC's reactions or one executor task owns the reactor at a time: each hands over by starting
// the next operation (StartRead, Submit) as its last step.
//
// Memory: the first message and its parsed tokens are reserved in the in-flight budget as soon
// as it arrives. Once the header is checked, an append that writes into cells holds only its
// tokens (and one partial row) there: the cells are the cache's, taken when the header is
// checked. One that cannot (a cache with Rotating or Recurrent groups, or cells that would have
// to be freed by pruning a sliding window) buffers the payload: the whole header.payload_bytes
// is reserved (checked against the cache's largest batch first) before any further data is
// read. A stream that cannot get its bytes ends at once with RESOURCE_EXHAUSTED rather than
// waiting for them: a stream that waited would hold its first message (up to the message limit)
// and block others, and streams that each held part of the budget while waiting for the rest
// could stall one another. gRPC's flow control is the back-pressure: the node reads its next
// message only once the last one is written.
//
// Idle streams: while a read is outstanding the stream is registered with the service's
// IdleReaper, which may end it (DEADLINE_EXCEEDED) from its own thread, freeing its cells or
// buffer. `mu_` orders that with the reactions: the reaper ends a stream only while a read is
// outstanding, i.e. while no reaction or task owns it, and a read that completes after that sees
// `finished_` and stops.
class CacheServiceImpl::AppendStreamReactor final
    : public grpc::ServerReadReactor<grpc::ByteBuffer>,
      public IdleReaper::Stream {
 public:
  AppendStreamReactor(CacheServiceImpl* service, grpc::CallbackServerContext* context,
                      grpc::ByteBuffer* response)
      : service_(service), context_(context), response_(response) {
    service_->idle_reaper_->Add(this);
    // Who calls comes before anything the stream sends: a caller without a valid token learns
    // UNAUTHENTICATED, never how its messages would have been judged.
    absl::StatusOr<Principal> caller = service_->Caller(*context_);
    if (!caller.ok()) {
      Done(ToGrpcStatus(caller.status()));
      return;
    }
    tenant_ = caller->tenant;
    {
      MutexLock lock(&mu_);
      recheck_.emplace(service_->options_.auth, *context_, *std::move(caller));
    }
    ReadNext();
  }

  void OnReadDone(bool ok) override {
    TakeOver(this);
    bool finished;
    {
      MutexLock lock(&mu_);
      reading_ = false;
      finished = finished_;
      waited_ += absl::Now() - read_started_;
      if (ok) bytes_in_ += request_.Length();
    }
    if (finished) {
      HandOff(this);  // ended by the reaper while this read was outstanding; to OnDone
      return;
    }
    if (!ok) {
      OnEndOfStream();
      return;
    }
    const int64_t index = messages_++;
    if (const grpc::Status parsed = Parse(index); !parsed.ok()) {
      Done(parsed);
      return;
    }
    if (index == 0) {
      OnFirstMessage();
      return;
    }
    if (message_.has_header) {
      Done(InvalidArgument(absl::StrCat("AppendStream message ", index,
                                        " carries a header; only the first message may")));
      return;
    }
    // A device copy may wait for the device: on the executor, not on gRPC's thread (inline
    // only when the executor's queue is full).
    if (!writer_->in_host_memory() &&
        service_->executor_->Submit([this, index] { WriteDataAndReadNext(index); })) {
      return;
    }
    WriteDataAndReadNext(index);
  }

  void OnDone() override {
    TakeOver(this);
    service_->idle_reaper_->Remove(this);
    delete this;
  }

  // Ends the stream while it waits for the client's next message when it has waited for
  // `timeout`, when its caller's token was revoked, or when it holds at least
  // kMinRateReservationBytes of in-flight budget and sends slower than the node's minimum rate
  // (Options::stream_min_rate) in the time the node has waited for it. reservation_ is read
  // while a read is outstanding, when no owner changes it.
  bool Expire(absl::Time now, absl::Duration timeout) override {
    MutexLock lock(&mu_);
    if (finished_ || !reading_) return false;
    if (now - read_started_ >= timeout) {
      end_ = grpc::Status(
          grpc::StatusCode::DEADLINE_EXCEEDED,
          absl::StrCat("AppendStream sent no message for ", absl::ToInt64Milliseconds(timeout),
                       " ms (the node's --stream-idle-timeout-ms) after ", messages_,
                       " messages; the stream is closed and the ", Received(),
                       " bytes received are dropped: send the whole stream without long pauses"));
    } else if (absl::Status allowed = recheck_.has_value() ? recheck_->Check() : absl::OkStatus();
               !allowed.ok()) {
      end_ = ToGrpcStatus(
          absl::Status(allowed.code(), absl::StrCat("AppendStream ended: ", allowed.message())));
    } else if (const uint64_t rate = service_->options_.stream_min_rate;
               rate > 0 && reservation_.bytes() >= kMinRateReservationBytes &&
               waited_ + (now - read_started_) >= service_->options_.stream_min_rate_grace &&
               static_cast<double>(bytes_in_) <
                   static_cast<double>(rate) *
                       absl::ToDoubleSeconds(waited_ + (now - read_started_))) {
      // Only the time the node waited for the client counts: not the node's own work on the
      // stream (its executor's queue, device copies).
      end_ = grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("AppendStream sent ", bytes_in_, " bytes in the ",
                       absl::ToInt64Milliseconds(waited_ + (now - read_started_)),
                       " ms the node waited for it, slower than this node's minimum of ", rate,
                       " bytes per second (--stream-min-rate) for a stream that holds ",
                       reservation_.bytes(),
                       " bytes of in-flight budget; the stream is closed and the bytes received "
                       "are dropped"));
    } else {
      return false;
    }
    finished_ = true;
    return true;
  }

  void EndExpired(absl::Duration /*timeout*/) override {
    // No reaction or task owns the reactor (a read is outstanding, and its completion stops at
    // finished_), so what it holds is the reaper's to free. Giving cells back takes the cache's
    // lock, which an engine operation may hold for long: the executor does that (and then
    // finishes the call, so that the client learns of the end once its cells are free), not
    // the reaper's thread, which has other streams to end.
    if (writer_ != nullptr && writer_->in_cells() &&
        service_->executor_->Submit([this] { FinishExpired(); })) {
      return;
    }
    FinishExpired();
  }

 private:
  // EndExpired's work: frees what the stream holds and finishes the call with end_.
  void FinishExpired() {
    grpc::Status status;
    {
      MutexLock lock(&mu_);
      status = end_;
    }
    ReleaseMemory();
    HandOff(this);  // to OnReadDone and OnDone, which gRPC runs after this Finish
    Finish(status);
  }

  void ReadNext() {
    // The read starts under mu_, so the idle reaper cannot end the stream between the two.
    // gRPC never runs OnReadDone inline in StartRead (its tag is not inlineable, see grpcpp's
    // server_callback_handlers.h), so OnReadDone's wait for mu_ cannot deadlock.
    MutexLock lock(&mu_);
    reading_ = true;
    read_started_ = absl::Now();
    HandOff(this);
    StartRead(&request_);
  }

  void Done(const grpc::Status& status) {
    {
      MutexLock lock(&mu_);
      finished_ = true;
    }
    ReleaseMemory();
    HandOff(this);
    Finish(status);
  }

  // The cells or buffer, the message and the reservation go as soon as the outcome is known,
  // not when gRPC is done with the call.
  void ReleaseMemory() {
    writer_.reset();
    ClearMessage();
    reservation_.Reset();
  }

  void ClearMessage() {
    message_ = RawAppendStreamRequest();
    slices_.clear();
    request_.Clear();
    std::string().swap(flat_);
  }

  void WriteDataAndReadNext(int64_t index) {
    if (const grpc::Status written = WriteData(index); !written.ok()) {
      Done(written);
      return;
    }
    ReadNext();
  }

  // Payload bytes received: those written, and those of message 0 while its header is checked.
  uint64_t Received() const {
    return writer_ != nullptr ? writer_->written() : message_.data_bytes;
  }

  grpc::Status Parse(int64_t index) {
    message_ = RawAppendStreamRequest();
    slices_.clear();
    absl::Status status;
    if (!request_.Dump(&slices_).ok()) {
      status = absl::InvalidArgumentError("its bytes could not be read");
    } else {
      status = ParseAppendStreamRequest(slices_, &message_);
    }
    if (status.ok()) return grpc::Status::OK;
    return InvalidArgument(absl::StrCat("AppendStream message ", index, " of ", request_.Length(),
                                        " bytes does not parse: ", status.message()));
  }

  // Writes message `index`'s data into the append, then lets the message go.
  grpc::Status WriteData(int64_t index) {
    const uint64_t left = static_cast<uint64_t>(payload_bytes_) - writer_->written();
    if (message_.data_bytes > left) {
      return InvalidArgument(absl::StrCat(
          "AppendStream data exceeds header.payload_bytes = ", payload_bytes_, ": message ", index,
          " brings it to ", writer_->written() + message_.data_bytes, " bytes"));
    }
    // Into device memory, each Write is a copy that waits for the device: the message's pieces
    // (gRPC receives a large message in many slices) go as one.
    if (!writer_->in_host_memory() && message_.data.size() > 1) {
      flat_.reserve(message_.data_bytes);
      for (const absl::Span<const uint8_t> piece : message_.data) {
        flat_.append(reinterpret_cast<const char*>(piece.data()), piece.size());
      }
      message_.data.assign(1, AsBytes(flat_));
    }
    for (const absl::Span<const uint8_t> piece : message_.data) {
      if (absl::Status status = writer_->Write(piece); !status.ok()) {
        return ToGrpcStatus(status);
      }
    }
    ClearMessage();
    return grpc::Status::OK;
  }

  // What the stream holds in host memory once message 0 is written: its tokens, what the writer
  // holds (the payload buffer, or at most one partial row when the data goes into cells), and,
  // for cells in device memory, the copy a message is gathered into before it is written.
  uint64_t HeldBytes() const {
    uint64_t bytes = tokens_bytes_ + writer_->host_bytes();
    if (!writer_->in_host_memory()) {
      bytes += std::min<uint64_t>(static_cast<uint64_t>(payload_bytes_),
                                  service_->options_.max_send_message_bytes);
    }
    return bytes;
  }

  void OnFirstMessage() {
    if (!message_.has_header) {
      Done(InvalidArgument(
          "AppendStream message 0 has no header: the first message must carry one"));
      return;
    }
    payload_bytes_ = message_.header.payload_bytes();
    if (payload_bytes_ < 0) {
      Done(
          InvalidArgument(absl::StrCat("header.payload_bytes = ", payload_bytes_, " is negative")));
      return;
    }
    // The message is here already (its bytes and its parsed tokens, which the stream keeps):
    // count it before anything else can pile up behind it.
    const int64_t num_tokens =
        ParsedTokens(message_.header.tokens(), message_.header.token_ranges());
    tokens_bytes_ = ParsedBytes<v1::Token, Token>(num_tokens);
    absl::StatusOr<InflightBudget::Reservation> reservation =
        service_->inflight_->Reserve(tenant_, request_.Length() + tokens_bytes_,
                                     absl::StrCat("AppendStream message 0 of ", request_.Length(),
                                                  " bytes and ", num_tokens, " tokens"));
    if (!reservation.ok()) {
      Done(ToGrpcStatus(reservation.status()));
      return;
    }
    reservation_ = *std::move(reservation);
    if (!service_->executor_->Submit([this] { CheckHeader(); })) {
      Done(service_->BusyStatus());
    }
  }

  // On the executor: everything about the header that needs the cache, then the engine append
  // begins and message 0's data goes into it.
  void CheckHeader() {
    if (context_->IsCancelled()) {
      Done(CancelledStatus());
      return;
    }
    if (const absl::Status status = BeginAppend(); !status.ok()) {
      Done(ToGrpcStatus(status));
      return;
    }
    if (const grpc::Status written = WriteData(0); !written.ok()) {
      Done(written);
      return;
    }
    // Message 0 is gone: what the stream holds from now on.
    if (const absl::Status resized = reservation_.Resize(HeldBytes(), "AppendStream");
        !resized.ok()) {
      Done(ToGrpcStatus(resized));
      return;
    }
    ReadNext();
  }

  absl::Status BeginAppend() {
    const v1::AppendHeader& header = message_.header;
    ASSIGN_OR_RETURN(cache_, service_->FindCache(*context_, header.cache(), &caller_));
    const CacheSpec& spec = cache_->spec();
    // A speculative batch carries one Recurrent state per token: the largest payload of all.
    const size_t max_bytes =
        AppendPayloadBytes(spec, spec.max_batch, spec.max_batch, /*speculative=*/true);
    if (static_cast<uint64_t>(payload_bytes_) > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.payload_bytes = ", payload_bytes_, " exceeds the largest payload cache '",
          spec.name, "' accepts: ", max_bytes, " bytes for max_batch = ", spec.max_batch));
    }
    ASSIGN_OR_RETURN(tokens_, ExpandTokens(header.tokens(), header.token_ranges(), spec,
                                           &reservation_, &tokens_bytes_));
    const bool speculative = header.speculative();
    RETURN_IF_ERROR(
        CheckAppendShape(spec, tokens_, speculative, "header.payload_bytes", payload_bytes_));
    // A stream into a sequence that is migrating, or on a draining node, is refused before it
    // takes cells or sends its data, with the error its commit would get (which checks again).
    RETURN_IF_ERROR(service_->AppendGuarded(caller_.tenant, *cache_, tokens_, "AppendStream",
                                            [] { return absl::OkStatus(); }));
    ASSIGN_OR_RETURN(writer_, Cache::BeginAppend(cache_, tokens_,
                                                 static_cast<size_t>(payload_bytes_), speculative));
    // A buffered payload is reserved whole before the buffer takes any of it (the first Write
    // allocates it).
    return reservation_.Resize(
        HeldBytes() + request_.Length(),
        absl::StrCat(
            "AppendStream of ", payload_bytes_, " bytes to cache '", spec.name, "'",
            writer_->in_cells() ? "" : " (buffered: the cache cannot take its cells now)"));
  }

  void OnEndOfStream() {
    if (context_->IsCancelled()) {
      Done(CancelledStatus());
      return;
    }
    if (messages_ == 0) {
      Done(InvalidArgument(
          "AppendStream ended without a message: the first message must carry a header"));
      return;
    }
    if (writer_->written() != static_cast<uint64_t>(payload_bytes_)) {
      Done(InvalidArgument(absl::StrCat("AppendStream data adds up to ", writer_->written(),
                                        " bytes, but header.payload_bytes = ", payload_bytes_)));
      return;
    }
    if (!service_->executor_->Submit([this] { Commit(); })) {
      Done(service_->BusyStatus());
    }
  }

  // On the executor: the engine append happens.
  void Commit() {
    if (context_->IsCancelled()) {
      Done(CancelledStatus());
      return;
    }
    const absl::Status status = service_->AppendGuarded(
        caller_.tenant, *cache_, tokens_, "AppendStream", [this] { return writer_->Commit(); });
    writer_.reset();
    if (status.ok()) {
      v1::AppendResponse response;
      *response.mutable_usage() = UsageToProto(cache_->Usage());
      bool own_buffer;
      const grpc::Status serialized = grpc::SerializationTraits<v1::AppendResponse>::Serialize(
          response, response_, &own_buffer);
      if (!serialized.ok()) {
        Done(serialized);
        return;
      }
    }
    Done(ToGrpcStatus(status));
  }

  CacheServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_;

  grpc::ByteBuffer request_;         // the message read last
  std::vector<grpc::Slice> slices_;  // its slices, which message_.data views
  RawAppendStreamRequest message_;
  std::string flat_;      // message_'s data in one piece, for cells in device memory
  int64_t messages_ = 0;  // messages read so far
  int64_t payload_bytes_ = 0;
  std::string tenant_;  // the caller's, from the start
  Principal caller_;    // set with cache_
  std::shared_ptr<Cache> cache_;
  std::vector<Token> tokens_;
  std::unique_ptr<AppendWriter> writer_;     // once the header is checked
  uint64_t tokens_bytes_ = 0;                // ParsedBytes of the header's tokens (and tokens_)
  InflightBudget::Reservation reservation_;  // the message, tokens and buffer in host memory

  // Between the owner of the reactor and the reaper.
  Mutex mu_;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;  // a read is outstanding
  absl::Time read_started_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish was called or is being called
  absl::Duration waited_ ABSL_GUARDED_BY(mu_);  // for the client's messages, in all
  uint64_t bytes_in_ ABSL_GUARDED_BY(mu_) = 0;  // of every message received
  std::optional<CallerRecheck> recheck_ ABSL_GUARDED_BY(mu_);  // once the caller is known
  grpc::Status end_ ABSL_GUARDED_BY(mu_);                      // why the reaper ends the stream
};

// ---- Read ---------------------------------------------------------------------------------
//
// Read goes through the gate as a stream of bytes (RequestGate::AddServerStream): the node
// writes each ReadResponse's bytes itself, so that the payload goes to gRPC as slices of the
// memory it lies in (the pinned cells of a large read, the payload of a small one) instead of
// being gathered into a message and serialized into a second buffer. The bytes are those of
// ReadResponse as protobuf would write them: `header` (field 1) in the first message, `data` (field
// 2) in every message with data.
//
// The engine read runs on the executor, which then starts the first write; every later write
// is started by OnWriteDone of the one before (on the executor when the next chunk must be
// copied from a device). One operation at a time owns the reactor.
namespace {

// A slice's reference to the cursor whose memory it shows, dropped on whichever thread gRPC
// releases the slice; the last one ends the cursor (and unpins its cells).
void ReleaseCursorRef(void* ref) { delete static_cast<std::shared_ptr<ReadCursor>*>(ref); }

// A chunk's data in more pieces than this is copied into one slice instead.
constexpr size_t kMaxReadViewsPerChunk = 64;

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

}  // namespace

//
// A client that stops taking messages stalls the write in flight, and with it the cells a
// pinned read holds. The idle reaper cancels a Read whose write has not completed for
// --stream-idle-timeout-ms: gRPC then drops the write's slices, and the cells are unpinned.
class CacheServiceImpl::ReadReactor final : public StreamReactor, public IdleReaper::Stream {
 public:
  // `raw` is the request, of at most kMaxReadRequestBytes, of a caller the gate let through.
  ReadReactor(CacheServiceImpl* service, StreamCall* call, const grpc::ByteBuffer* raw)
      : StreamReactor(call), service_(service), context_(call->context()) {
    service_->idle_reaper_->Add(this);
    // The gate authenticated the call; this gives the caller's tenant.
    const absl::StatusOr<Principal> caller = service_->Caller(*context_);
    if (!caller.ok()) {
      Done(ToGrpcStatus(caller.status()));
      return;
    }
    tenant_ = caller->tenant;
    if (const grpc::Status parsed = Parse(*raw); !parsed.ok()) {
      Done(parsed);
      return;
    }
    const int32_t requested = request_.max_chunk_bytes();
    if (requested < 0 || requested > kMaxReadChunkBytes) {
      Done(
          InvalidArgument(absl::StrCat("max_chunk_bytes = ", requested, " is out of range [0, ",
                                       kMaxReadChunkBytes, "] (0: ", kDefaultReadChunkBytes, ")")));
      return;
    }
    const size_t limit = service->options_.max_send_message_bytes > 2 * kReadMessageSlack
                             ? service->options_.max_send_message_bytes - kReadMessageSlack
                             : kReadMessageSlack;
    chunk_bytes_ = std::min<size_t>(requested == 0 ? kDefaultReadChunkBytes : requested, limit);
    if (!service->executor_->Submit([this] { ReadAndStart(); })) {
      Done(service->BusyStatus());
    }
  }

  void OnWriteDone(bool ok) override {
    TakeOver(this);
    bool expired;
    {
      MutexLock lock(&mu_);
      writing_ = false;
      expired = expired_;
    }
    if (expired) {
      HandOff(this);  // the reaper cancelled the call (EndExpired finishes it); to OnDone
      return;
    }
    if (!ok) {
      // The stream is broken (cancelled or the client went away); nothing more can be sent.
      Done(CancelledStatus());
      return;
    }
    if (sent_ == total_) {
      Done(grpc::Status::OK);
      return;
    }
    // A chunk to copy (not in host memory, or in too many pieces) may wait for a device copy
    // on a GPU: on the executor, not on gRPC's thread (inline only when the executor's queue
    // is full).
    if (!CollectViews(std::min(chunk_bytes_, total_ - sent_)) &&
        service_->executor_->Submit([this] { WriteChunk(chunk_bytes_); })) {
      return;
    }
    WriteChunk(chunk_bytes_);
  }

  void OnDone() override {
    TakeOver(this);
    service_->idle_reaper_->Remove(this);
    delete this;
  }

  bool Expire(absl::Time now, absl::Duration timeout) override {
    MutexLock lock(&mu_);
    if (expired_ || !writing_ || now - write_started_ < timeout) return false;
    expired_ = true;
    return true;
  }

  void EndExpired(absl::Duration timeout) override {
    // The write in flight owns the reactor, but it has stalled; its completion (ok or not)
    // stops at expired_, and the call is finished here: OnDone cannot run before this Finish.
    // Only fields that no owner changes while a write is in flight are read (Expire took
    // mu_ after the owner's HandOff).
    TakeOver(this);
    Log(LogLevel::kWarning, "Read cancelled: the client took no message",
        {{"cache", request_.cache()},
         {"seq", absl::StrCat(request_.seq())},
         {"idle_ms", absl::StrCat(absl::ToInt64Milliseconds(timeout))},
         {"sent_bytes", absl::StrCat(sent_)},
         {"payload_bytes", absl::StrCat(total_)}});
    // Cancelling drops the stalled write and the slices it holds, so a pinned read's cells are
    // released; the client sees CANCELLED (a status could not reach it past the stalled data).
    context_->TryCancel();
    HandOff(this);
    Finish(
        grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                     absl::StrCat("Read took no message for ", absl::ToInt64Milliseconds(timeout),
                                  " ms (the node's --stream-idle-timeout-ms) after ", sent_, " of ",
                                  total_, " payload bytes; the call is cancelled")));
  }

 private:
  void Done(const grpc::Status& status) {
    HandOff(this);
    Finish(status);
  }

  grpc::Status Parse(const grpc::ByteBuffer& raw) {
    if (!raw.Valid()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the Read carries no ReadRequest");
    }
    return ParseRequest(raw, kMaxReadRequestBytes, "/kvmesh.v1.CacheService/Read", &request_);
  }

  // On the executor.
  void ReadAndStart() {
    if (context_->IsCancelled()) {
      Done(CancelledStatus());
      return;
    }
    absl::StatusOr<std::shared_ptr<Cache>> cache = service_->FindCache(*context_, request_.cache());
    if (!cache.ok()) {
      Done(ToGrpcStatus(cache.status()));
      return;
    }
    const std::optional<int32_t> end =
        request_.has_end() ? std::optional<int32_t>(request_.end()) : std::nullopt;
    // A payload of at most one chunk is copied out at once under the cache's shared lock and
    // counted in flight whole. A larger one, in a cache that lends cells, is read from pinned
    // cells chunk by chunk, one chunk in flight whatever its size; in other caches it is copied
    // out at once too, counted in flight until the last chunk is sent, and refused before the
    // engine copies it when it does not fit.
    const bool pin_large = (*cache)->lends_cells();
    bool large = false;
    absl::StatusOr<ReadResult> result =
        (*cache)->Read(request_.seq(), request_.begin(), end, [&](size_t bytes) -> absl::Status {
          if (pin_large && bytes > chunk_bytes_) {
            large = true;
            return absl::AbortedError("read from pinned cells instead");
          }
          ASSIGN_OR_RETURN(reservation_,
                           service_->inflight_->Reserve(
                               tenant_, bytes, absl::StrCat("Read of ", bytes, " payload bytes")));
          return absl::OkStatus();
        });
    if (large) {
      absl::StatusOr<std::unique_ptr<ReadCursor>> cursor =
          Cache::OpenRead(*cache, request_.seq(), request_.begin(), end);
      if (!cursor.ok()) {
        Done(ToGrpcStatus(cursor.status()));
        return;
      }
      cursor_ = *std::move(cursor);
      const size_t in_flight = std::min(cursor_->size(), chunk_bytes_);
      absl::StatusOr<InflightBudget::Reservation> reserved =
          service_->inflight_->Reserve(tenant_, in_flight,
                                       absl::StrCat("Read of ", cursor_->size(), " payload bytes (",
                                                    in_flight, " of them in flight at a time)"));
      if (!reserved.ok()) {
        Done(ToGrpcStatus(reserved.status()));
        return;
      }
      reservation_ = *std::move(reserved);
    } else {
      if (!result.ok()) {
        Done(ToGrpcStatus(result.status()));
        return;
      }
      cursor_ = NewCopiedReadCursor(*std::move(result));
    }
    total_ = cursor_->size();
    v1::ReadHeader header = ReadHeaderToProto(cursor_->header());
    header.set_payload_bytes(static_cast<int64_t>(total_));
    const size_t header_bytes = header.ByteSizeLong();
    if (header_bytes + 2 * kReadMessageSlack > service_->options_.max_send_message_bytes) {
      Done(grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("the Read header (", header_bytes,
                       " bytes of positions) does not fit the server's message limit of ",
                       service_->options_.max_send_message_bytes,
                       " bytes; read a smaller range [begin, end)")));
      return;
    }
    // The first message carries the header too, so its data is cut shorter.
    fields_.push_back(1 << 3 | 2);  // header: field 1, length-delimited
    AppendVarint(header_bytes, &fields_);
    header.AppendToString(&fields_);
    const size_t room =
        service_->options_.max_send_message_bytes - kReadMessageSlack - header_bytes;
    WriteChunk(std::min(chunk_bytes_, room));
  }

  // Writes the next message: the fields gathered in fields_ (the header's, first), then up to
  // max_bytes of the payload as views of its memory, or copied into a slice of its own when it
  // is not in host memory or lies in too many pieces.
  // Fills views_ with the payload's bytes [sent_, sent_ + n) as they lie in host memory; false
  // when they do not (a device) or lie in more than kMaxReadViewsPerChunk pieces: a copy then.
  bool CollectViews(size_t n) {
    views_.clear();
    for (size_t at = sent_; at < sent_ + n;) {
      const absl::Span<const uint8_t> view = cursor_->View(at, sent_ + n - at);
      if (view.empty() || views_.size() == kMaxReadViewsPerChunk) return false;
      views_.push_back(view);
      at += view.size();
    }
    return true;
  }

  void WriteChunk(size_t max_bytes) {
    const size_t n = std::min(max_bytes, total_ - sent_);
    std::vector<grpc::Slice> slices(1);  // [0]: fields_, once complete
    if (n > 0) {
      fields_.push_back(2 << 3 | 2);  // data: field 2, length-delimited
      AppendVarint(n, &fields_);
      if (CollectViews(n)) {
        // Each slice holds a reference to the cursor, so the bytes stay pinned and unchanged
        // whatever gRPC does with them after the write.
        for (const absl::Span<const uint8_t> view : views_) {
          slices.emplace_back(const_cast<uint8_t*>(view.data()), view.size(), &ReleaseCursorRef,
                              new std::shared_ptr<ReadCursor>(cursor_));
        }
      } else {
        grpc_slice copy = grpc_slice_malloc(n);
        const absl::Status read =
            cursor_->ReadAt(sent_, absl::MakeSpan(GRPC_SLICE_START_PTR(copy), n));
        slices.emplace_back(copy, grpc::Slice::STEAL_REF);
        if (!read.ok()) {
          Done(ToGrpcStatus(read));
          return;
        }
      }
    }
    slices[0] = grpc::Slice(fields_.data(), fields_.size());
    fields_.clear();
    message_ = grpc::ByteBuffer(slices.data(), slices.size());
    sent_ += n;
    // The status follows from OnWriteDone, not with the write: StartWriteAndFinish has no
    // OnWriteDone, so a stalled last write could not be told apart from a finished call (and
    // a write marked last is held back until Finish).
    // The write starts under mu_, so the idle reaper cannot take the call over between the
    // two. gRPC never runs OnWriteDone inline in StartWrite (its tag is not inlineable, see
    // grpcpp's server_callback_handlers.h), so OnWriteDone's wait for mu_ cannot deadlock.
    MutexLock lock(&mu_);
    writing_ = true;
    write_started_ = absl::Now();
    HandOff(this);  // nothing of this reactor but mu_ is touched from here until the reaction
    StartWrite(&message_);
  }

  CacheServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  v1::ReadRequest request_;
  size_t chunk_bytes_ = 0;
  // The payload: pinned cells (a large read of a cache that lends cells) or a copy. Shared with
  // the slices of the messages that show it.
  std::shared_ptr<ReadCursor> cursor_;
  size_t total_ = 0;                              // payload bytes of the whole read
  size_t sent_ = 0;                               // payload bytes handed to writes so far
  std::string fields_;                            // the next message's bytes before its data
  std::vector<absl::Span<const uint8_t>> views_;  // WriteChunk's, kept for its capacity
  grpc::ByteBuffer message_;                      // the message being written
  // A copied payload's bytes, or one chunk of a pinned read, in the in-flight budget.
  std::string tenant_;  // the caller's
  InflightBudget::Reservation reservation_;

  // Between the owner and the idle reaper.
  Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a write is in flight
  bool expired_ ABSL_GUARDED_BY(mu_) = false;  // the reaper has taken the call over
  absl::Time write_started_ ABSL_GUARDED_BY(mu_);
};

// ---- the service --------------------------------------------------------------------------

CacheServiceImpl::CacheServiceImpl(CacheRegistry* registry, Executor* executor, Options options)
    : registry_(registry),
      executor_(executor),
      options_(options),
      own_inflight_(options.inflight != nullptr
                        ? nullptr
                        : std::make_unique<InflightBudget>(UINT64_MAX, "--inflight-budget")),
      inflight_(options.inflight != nullptr ? options.inflight : own_inflight_.get()),
      idle_reaper_(std::make_unique<IdleReaper>(options.stream_idle_timeout)),
      gate_(std::make_unique<RequestGate>([this](const grpc::CallbackServerContext& context) {
        return Caller(context).status();
      })) {
  // Every unary method goes through the gate: the caller is known before the request is read,
  // and the request's size is checked against its method's limit before it is parsed.
  auto add = [this](const char* name, size_t max_request_bytes, auto handler) {
    gate_->Add(absl::StrCat("/", v1::CacheService::service_full_name(), "/", name),
               max_request_bytes, this, handler);
  };
  constexpr size_t kSmall = kMaxSmallRequestBytes;
  add("CreateCache", kSmall, &CacheServiceImpl::HandleCreateCache);
  add("DeleteCache", kSmall, &CacheServiceImpl::HandleDeleteCache);
  add("GetCache", kSmall, &CacheServiceImpl::HandleGetCache);
  add("ListCaches", kSmall, &CacheServiceImpl::HandleListCaches);
  add("Visible", kMaxVisibleRequestBytes, &CacheServiceImpl::HandleVisible);
  add("CopyPrefix", kSmall, &CacheServiceImpl::HandleCopyPrefix);
  add("Remove", kSmall, &CacheServiceImpl::HandleRemove);
  add("CanResume", kSmall, &CacheServiceImpl::HandleCanResume);
  add("ListSequences", kSmall, &CacheServiceImpl::HandleListSequences);
  add("Reserve", kSmall, &CacheServiceImpl::HandleReserve);
  add("SetRetention", kSmall, &CacheServiceImpl::HandleSetRetention);
  add("LookupPrefix", kMaxLookupRequestBytes, &CacheServiceImpl::HandleLookupPrefix);
  add("Snapshot", kSmall, &CacheServiceImpl::HandleSnapshot);
  add("Restore", kSmall, &CacheServiceImpl::HandleRestore);
  add("MergeSnapshots", kSmall, &CacheServiceImpl::HandleMergeSnapshots);
  add("SplitSnapshot", kSmall, &CacheServiceImpl::HandleSplitSnapshot);
  add("DropSnapshot", kSmall, &CacheServiceImpl::HandleDropSnapshot);
  add("ListSnapshots", kSmall, &CacheServiceImpl::HandleListSnapshots);
  add("CommitSpeculation", kSmall, &CacheServiceImpl::HandleCommitSpeculation);
  add("Migrate", kSmall, &CacheServiceImpl::HandleMigrate);
  add("MigrateSnapshot", kSmall, &CacheServiceImpl::HandleMigrateSnapshot);
  add("ListMembers", kSmall, &CacheServiceImpl::HandleListMembers);
  add("Drain", kSmall, &CacheServiceImpl::HandleDrain);
  gate_->AddRaw(absl::StrCat("/", v1::CacheService::service_full_name(), "/Append"),
                options_.max_receive_message_bytes,
                [this](UnaryCall* call, const grpc::ByteBuffer* request,
                       grpc::ByteBuffer* response) { HandleAppend(call, request, response); });
  gate_->AddServerStream(absl::StrCat("/", v1::CacheService::service_full_name(), "/Read"),
                         kMaxReadRequestBytes,
                         [this](StreamCall* call, const grpc::ByteBuffer* request) {
                           return StartRead(call, request);
                         });
  gate_->AddServerStream(absl::StrCat("/", v1::CacheService::service_full_name(), "/WatchEvents"),
                         kMaxWatchRequestBytes,
                         [this](StreamCall* call, const grpc::ByteBuffer* request) {
                           return StartWatchEvents(call, request);
                         });
}

grpc::Status CacheServiceImpl::BusyStatus() const {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      absl::StrCat("kvmesh-node is overloaded: its executor queue holds ",
                                   executor_->max_queued(), " tasks already; retry later"));
}

absl::StatusOr<Reservations::Guard> CacheServiceImpl::Guard(Reservations::Kind kind,
                                                            const std::string& cache,
                                                            absl::Span<const int64_t> ids,
                                                            const char* what) const {
  if (options_.cluster == nullptr) return Reservations::Guard();
  return options_.cluster->reservations()->BeginOperation(kind, cache, ids, what);
}

absl::StatusOr<Reservations::Guard> CacheServiceImpl::GuardSequence(const std::string& cache,
                                                                    int64_t seq,
                                                                    const char* what) const {
  const int64_t seqs[] = {seq};
  return Guard(Reservations::Kind::kSequence, cache, seqs, what);
}

absl::StatusOr<Reservations::Guard> CacheServiceImpl::GuardSnapshots(
    const std::string& cache, std::initializer_list<uint64_t> ids, const char* what) const {
  std::vector<int64_t> keys;  // reservations key snapshots by int64, as sequences
  for (const uint64_t id : ids) keys.push_back(static_cast<int64_t>(id));
  return Guard(Reservations::Kind::kSnapshot, cache, keys, what);
}

absl::Status CacheServiceImpl::AppendGuarded(const std::string& tenant, Cache& cache,
                                             absl::Span<const Token> tokens, const char* what,
                                             absl::FunctionRef<absl::Status()> append) {
  std::vector<int64_t> seqs;
  seqs.reserve(tokens.size());
  for (const Token& t : tokens) seqs.push_back(t.seq);
  std::sort(seqs.begin(), seqs.end());
  seqs.erase(std::unique(seqs.begin(), seqs.end()), seqs.end());
  ASSIGN_OR_RETURN(const Reservations::Guard guard,
                   Guard(Reservations::Kind::kSequence,
                         Reservations::Key(tenant, cache.spec().name), seqs, what));
  ASSIGN_OR_RETURN(const DrainGate::Ticket admitted, AdmitSequences(cache, seqs, what));
  return append();
}

absl::StatusOr<DrainGate::Ticket> CacheServiceImpl::AdmitSequences(const Cache& cache,
                                                                   absl::Span<const int64_t> seqs,
                                                                   const char* what) const {
  if (options_.gate == nullptr) return DrainGate::Ticket();
  return options_.gate->AdmitSequences(cache, seqs, what);
}

void CacheServiceImpl::RunCluster(UnaryCall* call, absl::AnyInvocable<absl::Status() &&> fn) {
  if (options_.cluster == nullptr || options_.cluster_executor == nullptr) {
    call->Answer(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                              "this node serves no cluster operations (no membership)"));
    return;
  }
  RunOn(options_.cluster_executor, call, std::move(fn));
}

void CacheServiceImpl::RunOn(Executor* executor, UnaryCall* call,
                             absl::AnyInvocable<absl::Status() &&> fn) {
  RunUnaryOn(executor, call, std::move(fn), kCancelledMessage, [this] { return BusyStatus(); });
}

absl::StatusOr<Principal> CacheServiceImpl::Caller(
    const grpc::CallbackServerContext& context) const {
  if (options_.auth == nullptr) return Principal{kDefaultTenant, Role::kAdmin};
  return options_.auth->Authenticate(context);
}

absl::StatusOr<std::shared_ptr<Cache>> CacheServiceImpl::FindCache(
    const grpc::CallbackServerContext& context, const std::string& name, Principal* caller) const {
  ASSIGN_OR_RETURN(Principal who, Caller(context));
  if (name.empty()) {
    return absl::InvalidArgumentError("cache is empty: name the cache to operate on");
  }
  RETURN_IF_ERROR(CheckNameLength("cache", name));
  absl::StatusOr<std::shared_ptr<Cache>> cache = registry_->Get(who.tenant, name);
  if (caller != nullptr) *caller = std::move(who);
  return cache;
}

void CacheServiceImpl::RunUnary(UnaryCall* call, absl::AnyInvocable<absl::Status() &&> fn) {
  RunOn(executor_, call, std::move(fn));
}

void CacheServiceImpl::HandleCreateCache(UnaryCall* call, const v1::CreateCacheRequest* request,
                                         v1::CreateCacheResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunUnary(call, [this, context, request, response]() -> absl::Status {
    ASSIGN_OR_RETURN(const Principal caller, Caller(*context));
    if (!request->has_spec()) return absl::InvalidArgumentError("spec is missing");
    ASSIGN_OR_RETURN(const CacheSpec spec, SpecFromProto(request->spec()));
    // A draining node creates no cache; asking for one it has stays idempotent.
    DrainGate::Ticket admitted;
    if (options_.gate != nullptr && !registry_->Get(caller.tenant, spec.name).ok()) {
      ASSIGN_OR_RETURN(admitted, options_.gate->Admit(absl::StrCat("new cache '", spec.name, "'")));
    }
    const TenantQuota quota =
        options_.auth != nullptr ? options_.auth->Quota(caller.tenant) : TenantQuota();
    ASSIGN_OR_RETURN(const CacheRegistry::CreateResult result,
                     registry_->Create(caller.tenant, spec, quota));
    *response->mutable_cache() = CacheInfoToProto(*result.cache);
    response->mutable_cache()->set_tenant(caller.tenant);
    response->set_created(result.created);
    return absl::OkStatus();
  });
}

void CacheServiceImpl::HandleDeleteCache(UnaryCall* call, const v1::DeleteCacheRequest* request,
                                         v1::DeleteCacheResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunUnary(call, [this, context, request]() -> absl::Status {
    ASSIGN_OR_RETURN(const Principal caller, Caller(*context));
    if (request->cache().empty()) {
      return absl::InvalidArgumentError("cache is empty: name the cache to delete");
    }
    RETURN_IF_ERROR(CheckNameLength("cache", request->cache()));
    return registry_->Delete(caller.tenant, request->cache());
  });
}

void CacheServiceImpl::HandleGetCache(UnaryCall* call, const v1::GetCacheRequest* request,
                                      v1::GetCacheResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(call, request,
                    [response](Cache& cache, const Principal& caller) -> absl::Status {
                      *response->mutable_cache() = CacheInfoToProto(cache);
                      response->mutable_cache()->set_tenant(caller.tenant);
                      return absl::OkStatus();
                    });
}

void CacheServiceImpl::HandleListCaches(UnaryCall* call, const v1::ListCachesRequest* request,
                                        v1::ListCachesResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunUnary(call, [this, context, request, response]() -> absl::Status {
    ASSIGN_OR_RETURN(const Principal caller, Caller(*context));
    // An admin that names no tenant (kvmesh-tenant) sees every tenant's caches.
    const bool everyone = caller.admin() && context->client_metadata().find(kTenantMetadata) ==
                                                context->client_metadata().end();
    return ListCachesPage(*registry_, caller.tenant, everyone, *request, response);
  });
}

namespace {

// A unary Append as gRPC received it: the request's slices, and the request parsed beside them
// with its payload left in them.
struct ReceivedAppend {
  std::vector<grpc::Slice> slices;
  RawAppendRequest message;
};

}  // namespace

void CacheServiceImpl::HandleAppend(UnaryCall* call, const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) {
  grpc::CallbackServerContext* const context = call->context();
  auto received = std::make_unique<ReceivedAppend>();
  absl::Status parsed;
  if (!request->Dump(&received->slices).ok()) {
    parsed = absl::InvalidArgumentError("its bytes could not be read");
  } else {
    parsed = ParseAppendRequest(received->slices, &received->message);
  }
  if (!parsed.ok()) {
    return FinishNow(call, absl::InvalidArgumentError(
                               absl::StrCat("the AppendRequest of ", request->Length(),
                                            " bytes does not parse: ", parsed.message())));
  }
  // gRPC holds the whole request already: count it until the call is done, and refuse it at
  // once when it does not fit rather than queue it for the engine.
  const RawAppendRequest& message = received->message;
  const int64_t num_tokens = ParsedTokens(message.request.tokens(), message.request.token_ranges());
  const absl::StatusOr<Principal> caller = Caller(*context);
  if (!caller.ok()) return FinishNow(call, caller.status());
  absl::StatusOr<InflightBudget::Reservation> reservation = inflight_->Reserve(
      caller->tenant, request->Length() + ParsedBytes<v1::Token, Token>(num_tokens),
      absl::StrCat("Append of ", message.payload_bytes, " payload bytes and ", num_tokens,
                   " tokens"));
  if (!reservation.ok()) return FinishNow(call, reservation.status());
  return RunUnary(
      call,
      [this, context, response, received = std::move(received),
       reservation = *std::move(reservation)]() mutable -> absl::Status {
        const v1::AppendRequest& request = received->message.request;
        Principal caller;
        ASSIGN_OR_RETURN(const std::shared_ptr<Cache> cache,
                         FindCache(*context, request.cache(), &caller));
        ASSIGN_OR_RETURN(const std::vector<Token> tokens,
                         ExpandTokens(request.tokens(), request.token_ranges(), cache->spec(),
                                      &reservation, nullptr));
        RETURN_IF_ERROR(CheckAppendShape(cache->spec(), tokens, request.speculative(), "payload",
                                         static_cast<int64_t>(received->message.payload_bytes)));
        RETURN_IF_ERROR(AppendGuarded(caller.tenant, *cache, tokens, "Append", [&] {
          return AppendReceived(*cache, tokens, received->message, reservation);
        }));
        v1::AppendResponse answer;
        *answer.mutable_usage() = UsageToProto(cache->Usage());
        bool own_buffer;
        return FromGrpcStatus(grpc::SerializationTraits<v1::AppendResponse>::Serialize(
            answer, response, &own_buffer));
      });
}

absl::Status CacheServiceImpl::AppendReceived(Cache& cache, absl::Span<const Token> tokens,
                                              const RawAppendRequest& message,
                                              InflightBudget::Reservation& reservation) {
  if (cache.GathersPieces(message.payload.size())) {
    // The engine gathers the pieces into one buffer: a second copy of the payload.
    RETURN_IF_ERROR(reservation.Resize(
        reservation.bytes() + message.payload_bytes,
        absl::StrCat("Append of ", message.payload_bytes, " payload bytes to cache '",
                     cache.spec().name, "' (gathered into one piece)")));
  }
  return cache.AppendPieces(tokens, message.payload, message.request.speculative());
}

grpc::ServerReadReactor<grpc::ByteBuffer>* CacheServiceImpl::AppendStream(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  return new AppendStreamReactor(this, context, response);
}

StreamReactor* CacheServiceImpl::StartRead(StreamCall* call, const grpc::ByteBuffer* request) {
  return new ReadReactor(this, call, request);
}

void CacheServiceImpl::HandleVisible(UnaryCall* call, const v1::VisibleRequest* request,
                                     v1::VisibleResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  // The parsed queries count at once, as an Append's payload does; the answer's size is bounded
  // before the engine lists anything (AdmitVisible). The reservations are captures, not
  // locals: they live until the call's task is gone, after Finish has serialized the answer.
  const absl::StatusOr<Principal> caller = Caller(*context);
  if (!caller.ok()) return FinishNow(call, caller.status());
  absl::StatusOr<InflightBudget::Reservation> queries_reservation =
      inflight_->Reserve(caller->tenant, ParsedBytes<v1::Query, Query>(request->queries_size()),
                         absl::StrCat("Visible of ", request->queries_size(), " queries"));
  if (!queries_reservation.ok()) return FinishNow(call, queries_reservation.status());
  return RunOnCache(
      call, request,
      [this, request, response, tenant = caller->tenant,
       queries_reservation = *std::move(queries_reservation),
       reservation = InflightBudget::Reservation()](Cache& cache) mutable -> absl::Status {
        ASSIGN_OR_RETURN(const std::vector<Query> queries, QueriesFromProto(request->queries()));
        const VisibleUnit& unit = request->as_ranges() ? kVisibleRanges : kVisiblePositions;
        auto admit = [&](int64_t entries) {
          return AdmitVisible(tenant, cache.spec().name, request->group(), queries.size(), unit,
                              entries, options_.max_visible_positions,
                              options_.max_send_message_bytes, inflight_, &reservation);
        };
        if (request->as_ranges()) {
          ASSIGN_OR_RETURN(const std::vector<std::vector<PositionRange>> visible,
                           cache.VisibleRanges(request->group(), queries, admit));
          for (const std::vector<PositionRange>& ranges : visible) {
            v1::Visibility* out = response->add_visible();
            out->mutable_ranges()->Reserve(static_cast<int>(ranges.size()));
            for (const PositionRange& range : ranges) {
              v1::PositionRange* r = out->add_ranges();
              r->set_first(range.first);
              r->set_last(range.last);
            }
          }
          return absl::OkStatus();
        }
        ASSIGN_OR_RETURN(const std::vector<std::vector<int32_t>> visible,
                         cache.Visible(request->group(), queries, admit));
        for (const std::vector<int32_t>& positions : visible) {
          response->add_visible()->mutable_positions()->Add(positions.begin(), positions.end());
        }
        return absl::OkStatus();
      });
}

void CacheServiceImpl::HandleCopyPrefix(UnaryCall* call, const v1::CopyPrefixRequest* request,
                                        v1::CopyPrefixResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  if (!request->source_node().empty() &&
      (options_.cluster == nullptr ||
       request->source_node() != options_.cluster->options().self_name)) {
    return RunCluster(call, [this, context, request, response]() -> absl::Status {
      ASSIGN_OR_RETURN(const Principal caller, Caller(*context));
      RETURN_IF_ERROR(
          CheckNames({{"cache", request->cache()}, {"source_node", request->source_node()}}));
      return options_.cluster->CopyPrefixFrom(
          caller.tenant, *request, options_.cluster->Deadline(ContextDeadline(*context)), response);
    });
  }
  return RunOnCache(
      call, request,
      [this, request, response](Cache& cache, const Principal& caller) -> absl::Status {
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSequence(Reservations::Key(caller.tenant, request->cache()),
                                       request->dst_seq(), "CopyPrefix"));
        const int64_t dst[] = {request->dst_seq()};
        ASSIGN_OR_RETURN(const DrainGate::Ticket admitted,
                         AdmitSequences(cache, dst, "CopyPrefix"));
        ASSIGN_OR_RETURN(const int32_t offset,
                         cache.CopyPrefix(request->src_seq(), request->dst_seq(), request->length(),
                                          request->require_src_offset()));
        response->set_offset(offset);
        return absl::OkStatus();
      });
}

void CacheServiceImpl::HandleRemove(UnaryCall* call, const v1::RemoveRequest* request,
                                    v1::RemoveResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  auto local = [this, context, request]() -> absl::Status {
    Principal caller;
    ASSIGN_OR_RETURN(const std::shared_ptr<Cache> cache,
                     FindCache(*context, request->cache(), &caller));
    ASSIGN_OR_RETURN(const Reservations::Guard guard,
                     GuardSequence(Reservations::Key(caller.tenant, request->cache()),
                                   request->seq(), "Remove"));
    const std::optional<int32_t> end =
        request->has_end() ? std::optional<int32_t>(request->end()) : std::nullopt;
    return cache->Remove(request->seq(), request->begin(), end);
  };
  if (request->scope() == v1::REMOVE_SCOPE_CLUSTER) {
    return RunCluster(call, [this, context, request, response, local]() -> absl::Status {
      // The local part runs on the engine executor's terms too: it is an engine call.
      ASSIGN_OR_RETURN(const Principal caller, Caller(*context));
      RETURN_IF_ERROR(CheckNameLength("cache", request->cache()));
      ASSIGN_OR_RETURN(*response,
                       options_.cluster->RemoveEverywhere(
                           caller.tenant, *request,
                           options_.cluster->Deadline(ContextDeadline(*context)), local));
      return absl::OkStatus();
    });
  }
  if (request->scope() != v1::REMOVE_SCOPE_LOCAL) {
    return RunUnary(call, [this, context, request]() -> absl::Status {
      RETURN_IF_ERROR(Caller(*context).status());  // who asks comes first
      return absl::InvalidArgumentError(
          absl::StrCat("scope = ", request->scope(), " is not a RemoveScope"));
    });
  }
  return RunUnary(call, std::move(local));
}

void CacheServiceImpl::HandleCanResume(UnaryCall* call, const v1::CanResumeRequest* request,
                                       v1::CanResumeResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(call, request, [request, response](Cache& cache) -> absl::Status {
    ASSIGN_OR_RETURN(const bool can_resume, cache.CanResume(request->seq(), request->pos()));
    response->set_can_resume(can_resume);
    return absl::OkStatus();
  });
}

void CacheServiceImpl::HandleListSequences(UnaryCall* call, const v1::ListSequencesRequest* request,
                                           v1::ListSequencesResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(call, request, [request, response](Cache& cache) -> absl::Status {
    return ListSequencesPage(cache, *request, response);
  });
}

void CacheServiceImpl::HandleReserve(UnaryCall* call, const v1::ReserveRequest* request,
                                     v1::ReserveResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request,
      [this, request, response](Cache& cache, const Principal& caller) -> absl::Status {
        const int64_t ttl_ms = request->ttl_ms() == 0 ? kDefaultReserveTtlMs : request->ttl_ms();
        if (ttl_ms < 0 || ttl_ms > kMaxReserveTtlMs) {
          return absl::InvalidArgumentError(absl::StrCat(
              "ttl_ms = ", request->ttl_ms(), " is outside [0, ", kMaxReserveTtlMs, "]"));
        }
        // Not into a sequence under migration; on a draining node, not for a new sequence.
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSequence(Reservations::Key(caller.tenant, request->cache()),
                                       request->seq(), "Reserve"));
        DrainGate::Ticket admitted;
        if (request->positions() > 0) {
          const int64_t seq[] = {request->seq()};
          ASSIGN_OR_RETURN(admitted, AdmitSequences(cache, seq, "Reserve"));
        }
        RETURN_IF_ERROR(cache.Reserve(request->seq(), request->positions(),
                                      absl::Now() + absl::Milliseconds(ttl_ms)));
        *response->mutable_usage() = UsageToProto(cache.Usage());
        return absl::OkStatus();
      });
}

void CacheServiceImpl::HandleSetRetention(UnaryCall* call, const v1::SetRetentionRequest* request,
                                          v1::SetRetentionResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request,
      [this, request, response](Cache& cache, const Principal& caller) -> absl::Status {
        if (request->ttl_ms() < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("ttl_ms = ", request->ttl_ms(), " is negative (0: no TTL)"));
        }
        // Not on a sequence under migration: the retention would stay behind with its source.
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSequence(Reservations::Key(caller.tenant, request->cache()),
                                       request->seq(), "SetRetention"));
        RETURN_IF_ERROR(
            cache.SetRetention(request->seq(), Retention{request->priority(), request->pinned(),
                                                         absl::Milliseconds(request->ttl_ms())}));
        std::optional<SequenceInfo> info = cache.GetSequence(request->seq());
        if (info.has_value()) *response->mutable_sequence() = SequenceInfoToProto(*info);
        return absl::OkStatus();
      });
}

void CacheServiceImpl::HandleLookupPrefix(UnaryCall* call, const v1::LookupPrefixRequest* request,
                                          v1::LookupPrefixResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  // The lookup itself, once the cache is found: this node's matches, then (cluster scope) the
  // other members' from the index, verified by their holders when asked.
  auto lookup = [this, context, request, response](const Cache& cache,
                                                   const Principal& caller) -> absl::Status {
    ASSIGN_OR_RETURN(const int max_matches, LookupMatchCount(request->max_matches()));
    if (!v1::LookupScope_IsValid(request->scope())) {
      return absl::InvalidArgumentError(
          absl::StrCat("scope = ", request->scope(), " is not a LookupScope (0 LOCAL, 1 CLUSTER)"));
    }
    ASSIGN_OR_RETURN(const std::vector<PrefixMatch> local,
                     cache.LookupPrefix(request->tokens(), max_matches));
    const std::string node =
        options_.cluster == nullptr ? std::string() : options_.cluster->options().self_name;
    AddPrefixMatches(node, local, response);
    if (request->scope() == v1::LOOKUP_SCOPE_LOCAL) return absl::OkStatus();
    if (options_.cluster_index == nullptr) {
      return absl::FailedPreconditionError(
          "scope = LOOKUP_SCOPE_CLUSTER: this node keeps no index of the cluster; ask with "
          "LOOKUP_SCOPE_LOCAL");
    }
    ASSIGN_OR_RETURN(const std::vector<uint64_t> hashes, cache.PromptHashes(request->tokens()));
    const int32_t block_size = cache.spec().token_block_size;
    ASSIGN_OR_RETURN(const std::vector<ClusterIndex::Candidate> candidates,
                     options_.cluster_index->Lookup(caller.tenant, request->cache(), block_size,
                                                    hashes, max_matches));
    if (!request->verify()) {
      for (const ClusterIndex::Candidate& c : candidates) {
        v1::PrefixMatch* out = response->add_matches();
        out->set_node(c.node);
        out->set_seq(c.seq);
        out->set_length(c.blocks * block_size);
        out->set_offset(c.offset);
      }
      SortPrefixMatches(max_matches, response);
      return absl::OkStatus();
    }
    // The members whose candidates could make the answer: those among the longest max_matches,
    // this node's matches counted. A candidate of B blocks may verify to up to (B + 1) blocks
    // less one token, so a local match counts before it only when it is at least that long.
    std::vector<std::string> nodes;
    for (size_t l = 0, c = 0; l + c < static_cast<size_t>(max_matches) && c < candidates.size();) {
      if (l < local.size() && local[l].length >= (candidates[c].blocks + 1) * block_size) {
        ++l;
        continue;
      }
      if (std::find(nodes.begin(), nodes.end(), candidates[c].node) == nodes.end()) {
        nodes.push_back(candidates[c].node);
      }
      ++c;
    }
    // Half the caller's time at most (and the control timeout): a member that does not answer
    // costs its candidates, listed in `unverified`, not the whole answer.
    const absl::Time now = absl::Now();
    absl::Duration budget = options_.cluster->options().control_timeout;
    if (const absl::Time until = ContextDeadline(*context); until != absl::InfiniteFuture()) {
      budget = std::min(budget, (until - now) / 2);
    }
    options_.cluster_index->Verify(nodes, caller.tenant, *request, now + budget, response);
    SortPrefixMatches(max_matches, response);
    return absl::OkStatus();
  };
  if (request->scope() == v1::LOOKUP_SCOPE_CLUSTER && request->verify()) {
    // Calls other members: on the cluster executor, never the engine's.
    return RunCluster(call, [this, context, request, lookup]() -> absl::Status {
      Principal caller;
      ASSIGN_OR_RETURN(const std::shared_ptr<Cache> cache,
                       FindCache(*context, request->cache(), &caller));
      return lookup(*cache, caller);
    });
  }
  // The index answers in microseconds: with the local lookups, on the engine executor.
  return RunOnCache(call, request, [lookup](Cache& cache, const Principal& caller) -> absl::Status {
    return lookup(cache, caller);
  });
}

StreamReactor* CacheServiceImpl::StartWatchEvents(StreamCall* call, const grpc::ByteBuffer* raw) {
  // The gate has authenticated the call and checked the request's size; this gives the
  // caller's tenant, and only then is the request parsed.
  const grpc::CallbackServerContext& context = *call->context();
  absl::StatusOr<Principal> caller = Caller(context);
  v1::WatchEventsRequest request;
  if (caller.ok()) {
    if (const grpc::Status parsed = ParseRequest(*raw, kMaxWatchRequestBytes,
                                                 "/kvmesh.v1.CacheService/WatchEvents", &request);
        !parsed.ok()) {
      caller = FromGrpcStatus(parsed);
    }
  }
  if (caller.ok() && options_.events == nullptr) {
    caller = absl::FailedPreconditionError("this node keeps no event log");
  }
  if (caller.ok() && watchers_.stopping.load()) {
    caller = absl::UnavailableError("the node is shutting down");
  }
  // A revoked token (or a tenant removed) at a reload of the token file ends the stream.
  std::function<absl::Status()> still_allowed;
  if (caller.ok() && options_.auth != nullptr) {
    auto recheck = std::make_shared<CallerRecheck>(options_.auth, context, *caller);
    still_allowed = [recheck] { return recheck->Check(); };
  }
  return StartWatch(call, request, std::move(caller), WatchScope::kTenant, registry_,
                    options_.events, &watchers_, std::move(still_allowed));
}

void CacheServiceImpl::StopWatchers() { watchers_.Stop(options_.events); }

// ---- snapshots and speculation --------------------------------------------------------------

void CacheServiceImpl::HandleSnapshot(UnaryCall* call, const v1::SnapshotRequest* request,
                                      v1::SnapshotResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(call, request, [request, response](Cache& cache) -> absl::Status {
    RETURN_IF_ERROR(CheckNotNegative("seq", request->seq()));
    RETURN_IF_ERROR(CheckNotNegative("from_offset", request->from_offset()));
    ASSIGN_OR_RETURN(const SnapshotInfo info,
                     cache.Snapshot(request->seq(), request->from_offset()));
    *response->mutable_snapshot() = SnapshotInfoToProto(info);
    return absl::OkStatus();
  });
}

void CacheServiceImpl::HandleRestore(UnaryCall* call, const v1::RestoreRequest* request,
                                     v1::RestoreResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request, [this, request](Cache& cache, const Principal& caller) -> absl::Status {
        RETURN_IF_ERROR(CheckNotNegative("seq", request->seq()));
        RETURN_IF_ERROR(CheckNotNegative("target", request->target()));
        const std::optional<uint64_t> snapshot_id =
            request->has_snapshot_id() ? std::optional<uint64_t>(request->snapshot_id())
                                       : std::nullopt;
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSequence(Reservations::Key(caller.tenant, request->cache()),
                                       request->seq(), "Restore"));
        const int64_t seq[] = {request->seq()};
        ASSIGN_OR_RETURN(const DrainGate::Ticket admitted, AdmitSequences(cache, seq, "Restore"));
        return cache.Restore(request->seq(), snapshot_id, request->target());
      });
}

void CacheServiceImpl::HandleMergeSnapshots(UnaryCall* call,
                                            const v1::MergeSnapshotsRequest* request,
                                            v1::MergeSnapshotsResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request,
      [this, request, response](Cache& cache, const Principal& caller) -> absl::Status {
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSnapshots(Reservations::Key(caller.tenant, request->cache()),
                                        {request->parent(), request->child()}, "MergeSnapshots"));
        ASSIGN_OR_RETURN(const SnapshotInfo merged,
                         cache.MergeSnapshots(request->parent(), request->child()));
        *response->mutable_snapshot() = SnapshotInfoToProto(merged);
        return absl::OkStatus();
      });
}

void CacheServiceImpl::HandleSplitSnapshot(UnaryCall* call, const v1::SplitSnapshotRequest* request,
                                           v1::SplitSnapshotResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request,
      [this, request, response](Cache& cache, const Principal& caller) -> absl::Status {
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSnapshots(Reservations::Key(caller.tenant, request->cache()),
                                        {request->snapshot_id()}, "SplitSnapshot"));
        ASSIGN_OR_RETURN(const SplitResult split,
                         cache.SplitSnapshot(request->snapshot_id(), request->at()));
        if (split.parent.has_value())
          *response->mutable_parent() = SnapshotInfoToProto(*split.parent);
        if (split.child.has_value()) *response->mutable_child() = SnapshotInfoToProto(*split.child);
        return absl::OkStatus();
      });
}

void CacheServiceImpl::HandleDropSnapshot(UnaryCall* call, const v1::DropSnapshotRequest* request,
                                          v1::DropSnapshotResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request, [this, request](Cache& cache, const Principal& caller) -> absl::Status {
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSnapshots(Reservations::Key(caller.tenant, request->cache()),
                                        {request->snapshot_id()}, "DropSnapshot"));
        return cache.DropSnapshot(request->snapshot_id());
      });
}

void CacheServiceImpl::HandleListSnapshots(UnaryCall* call, const v1::ListSnapshotsRequest* request,
                                           v1::ListSnapshotsResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(call, request, [request, response](Cache& cache) -> absl::Status {
    return ListSnapshotsPage(cache, *request, response);
  });
}

void CacheServiceImpl::HandleCommitSpeculation(UnaryCall* call,
                                               const v1::CommitSpeculationRequest* request,
                                               v1::CommitSpeculationResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunOnCache(
      call, request,
      [this, request, response](Cache& cache, const Principal& caller) -> absl::Status {
        RETURN_IF_ERROR(CheckNotNegative("seq", request->seq()));
        RETURN_IF_ERROR(CheckNotNegative("accepted", request->accepted()));
        ASSIGN_OR_RETURN(const Reservations::Guard guard,
                         GuardSequence(Reservations::Key(caller.tenant, request->cache()),
                                       request->seq(), "CommitSpeculation"));
        RETURN_IF_ERROR(cache.CommitSpeculation(request->seq(), request->accepted()));
        // The sequence's offset afterwards; a commit of 0 tokens may leave it storing nothing.
        int32_t offset = 0;
        for (const SequenceInfo& info : cache.ListSequences()) {
          if (info.seq == request->seq()) {
            offset = info.offset;
            break;
          }
        }
        response->set_offset(offset);
        return absl::OkStatus();
      });
}

}  // namespace kvmesh

namespace kvmesh {

// ---- cluster ---------------------------------------------------------------------------------

void CacheServiceImpl::HandleMigrate(UnaryCall* call, const v1::MigrateRequest* request,
                                     v1::MigrateResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunCluster(call, [this, context, request, response]() -> absl::Status {
    ASSIGN_OR_RETURN(const Principal caller, Caller(*context));
    RETURN_IF_ERROR(
        CheckNames({{"cache", request->cache()}, {"target_node", request->target_node()}}));
    ASSIGN_OR_RETURN(*response, options_.cluster->Migrate(
                                    caller.tenant, *request,
                                    options_.cluster->Deadline(ContextDeadline(*context))));
    return absl::OkStatus();
  });
}

void CacheServiceImpl::HandleMigrateSnapshot(UnaryCall* call,
                                             const v1::MigrateSnapshotRequest* request,
                                             v1::MigrateSnapshotResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunCluster(call, [this, context, request, response]() -> absl::Status {
    ASSIGN_OR_RETURN(const Principal caller, Caller(*context));
    RETURN_IF_ERROR(
        CheckNames({{"cache", request->cache()}, {"target_node", request->target_node()}}));
    ASSIGN_OR_RETURN(*response, options_.cluster->MigrateSnapshot(
                                    caller.tenant, *request,
                                    options_.cluster->Deadline(ContextDeadline(*context))));
    return absl::OkStatus();
  });
}

void CacheServiceImpl::HandleListMembers(UnaryCall* call, const v1::ListMembersRequest* request,
                                         v1::ListMembersResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunCluster(call, [this, context, response]() -> absl::Status {
    ASSIGN_OR_RETURN(const Principal caller, Caller(*context));
    *response = options_.cluster->DescribeMembers();
    if (!caller.admin()) {
      // A tenant learns which nodes exist and whether they serve (to place its sequences);
      // where they are, what they run on and why one fails are the operators' (admin) details.
      for (v1::Member& member : *response->mutable_members()) {
        member.clear_address();
        member.clear_backend();
        member.clear_transports();
        member.clear_detail();
      }
    }
    return absl::OkStatus();
  });
}

void CacheServiceImpl::HandleDrain(UnaryCall* call, const v1::DrainRequest* request,
                                   v1::DrainResponse* response) {
  [[maybe_unused]] grpc::CallbackServerContext* const context = call->context();
  return RunCluster(call, [this, context, request, response]() -> absl::Status {
    ASSIGN_OR_RETURN(const Principal caller, Caller(*context));
    if (!caller.admin()) {
      return absl::PermissionDeniedError(
          "Drain moves every tenant's data: only an admin token may call it");
    }
    if (options_.drainer == nullptr) {
      return absl::FailedPreconditionError("this node cannot drain (it has no drainer)");
    }
    if (request->timeout_ms() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("timeout_ms = ", request->timeout_ms(), " is negative"));
    }
    if (request->resume()) {
      ASSIGN_OR_RETURN(*response, options_.drainer->Resume());
      return absl::OkStatus();
    }
    // --drain-timeout-ms=0 turns the drain on SIGTERM off, not the RPC's default.
    const absl::Duration timeout =
        request->timeout_ms() > 0                       ? absl::Milliseconds(request->timeout_ms())
        : options_.drain_timeout > absl::ZeroDuration() ? options_.drain_timeout
                                                        : kDefaultDrainTimeout;
    // The drain ends a margin before the caller's deadline, so that the caller gets the answer
    // (where each sequence went) rather than DEADLINE_EXCEEDED.
    const absl::Time now = absl::Now();
    absl::Time end = now + timeout;
    const absl::Time caller_deadline = ContextDeadline(*context);
    if (caller_deadline != absl::InfiniteFuture()) {
      end =
          std::min(end, caller_deadline - std::max(absl::Seconds(1), (caller_deadline - now) / 20));
    }
    ASSIGN_OR_RETURN(*response, options_.drainer->Drain(end, Drainer::Mode::kRequest));
    return absl::OkStatus();
  });
}

}  // namespace kvmesh
