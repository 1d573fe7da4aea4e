// CacheServiceImpl's RPCs that hand data out: Read (its reactor and StartRead) and Visible
// (HandleVisible and the bounds of its answer).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "cache/status_macros.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "service/cache_service.h"
#include "service/cache_service_internal.h"
#include "service/common/convert.h"
#include "service/common/log.h"
#include "service/request_gate.h"
#include "tests/sanitizers/tsan_handoff.h"

namespace kvmesh {

using cache_service_internal::CancelledStatus;
using cache_service_internal::FinishNow;
using cache_service_internal::InvalidArgument;
using cache_service_internal::ParsedBytes;

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

// Room left in every Read message for the protobuf framing around its data.
constexpr size_t kReadMessageSlack = 1024;

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

StreamReactor* CacheServiceImpl::StartRead(StreamCall* call, const grpc::ByteBuffer* request) {
  return new ReadReactor(this, call, request);
}

// ---- Visible ------------------------------------------------------------------------------

namespace {

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

}  // namespace

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

}  // namespace kvmesh
