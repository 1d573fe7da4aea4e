// CacheServiceImpl's Append and AppendStream RPCs: the AppendStream reactor, the raw unary
// Append, and the engine append they share.
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
#include "service/cache_service.h"
#include "service/cache_service_internal.h"
#include "service/common/convert.h"
#include "service/common/raw_message.h"
#include "tests/sanitizers/tsan_handoff.h"

namespace kvmesh {

using cache_service_internal::CancelledStatus;
using cache_service_internal::FinishNow;
using cache_service_internal::InvalidArgument;
using cache_service_internal::ParsedBytes;

namespace {

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
}  // namespace kvmesh
