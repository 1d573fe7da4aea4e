// CacheServiceImpl: kvmesh.v1.CacheService (docs/api.md) on gRPC's callback API, over
// the caches of a CacheRegistry.
//
// Every RPC validates its request before the engine sees it (INVALID_ARGUMENT naming the field
// and value), then runs the engine call on a bounded Executor: reactions on gRPC's threads
// never block on the engine. When the executor's queue is full the RPC fails at once with
// UNAVAILABLE (retry later), never by waiting.
//
//  - Unary RPCs, Read and WatchEvents are served through a RequestGate (service/request_gate.h),
//    which authenticates a call before it reads the request and checks the request against its
//    method's size limit before it is parsed; a unary method's executor task answers through the
//    UnaryCall. AppendStream authenticates before it reads its first message.
//  - Append and AppendStream pass the request's `speculative` flag to the engine; the payload
//    size they expect follows it (one Recurrent state per token when speculative).
//  - AppendStream checks the first message's header (cache, tokens, payload_bytes) before it
//    buffers any data, refuses data beyond header.payload_bytes as soon as it arrives, and
//    appends only when the stream ends with exactly payload_bytes.
//  - Memory in flight is bounded (docs/security.md#bounded-memory): an AppendStream reserves its
//    whole header.payload_bytes in Options::inflight before it reads any data, a unary Append
//    its payload, a Read its payload before the engine copies it out, a Visible its answer
//    before the engine lists it; what does not fit is RESOURCE_EXHAUSTED at once. An
//    AppendStream idle for Options::stream_idle_timeout is ended with DEADLINE_EXCEEDED, and a
//    Read whose client takes no message for as long is cancelled (its pinned cells released).
//  - Every name a request carries is checked with CheckNameLength before it is used.
//  - Read runs the engine read on the executor, then streams the header and the payload in
//    chunks of max_chunk_bytes (0: kDefaultReadChunkBytes), each message cut to fit the
//    server's send limit.
//
// Files: cache_service.cc holds the constructor, the shared helpers, the cache RPCs (CreateCache,
// DeleteCache, GetCache, ListCaches), the sequence RPCs (CopyPrefix, Remove, CanResume,
// ListSequences, Reserve, SetRetention), LookupPrefix, WatchEvents and the cluster RPCs
// (Migrate, MigrateSnapshot, ListMembers, Drain); cache_service_append.cc Append and
// AppendStream; cache_service_read.cc Read and Visible; cache_service_snapshots.cc Snapshot,
// Restore, MergeSnapshots, SplitSnapshot, DropSnapshot, ListSnapshots and CommitSpeculation.
// cache_service_internal.h holds the helpers they share.
//
// Thread safety: the service is thread-safe; gRPC calls it from any of its threads. The
// registry and the executor must outlive it, and the executor must keep running until the
// server has shut down (tasks in its queue finish the RPCs they belong to).
#ifndef KVMESH_SERVICE_CACHE_SERVICE_H_
#define KVMESH_SERVICE_CACHE_SERVICE_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache/cache.h"
#include "cache/cache_registry.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "service/auth.h"
#include "service/cluster/cluster_index.h"
#include "service/cluster/drain.h"
#include "service/cluster/drain_gate.h"
#include "service/cluster/reservations.h"
#include "service/common/raw_message.h"
#include "service/executor.h"
#include "service/idle_reaper.h"
#include "service/inflight_budget.h"
#include "service/request_gate.h"
#include "service/watch_events.h"

namespace kvmesh {

class Cluster;

// Read chunk size when a request leaves max_chunk_bytes at 0, and the largest one accepted.
inline constexpr int32_t kDefaultReadChunkBytes = 1 << 20;
inline constexpr int32_t kMaxReadChunkBytes = 64 << 20;

// Most positions one Visible call may list in all (--max-visible-positions): 4Mi positions take
// ~52 MiB while the answer is built and ~20 MiB on the wire; a scheduler asking about more
// splits its queries over several calls.
inline constexpr int64_t kDefaultMaxVisiblePositions = int64_t{1} << 22;
// Bytes a Visible answer holds per position listed while it is built: the engine's int32, the
// response's int32 and at most 5 bytes of varint once serialized.
inline constexpr uint64_t kVisibleBytesPerPosition = 13;
// The same per range of an answer in ranges (as_ranges): the engine's pair, the response's
// PositionRange message with its allocation and pointer, and at most 14 bytes serialized.
inline constexpr uint64_t kVisibleBytesPerRange = 96;
// Bytes per query of a Visible answer beyond its positions: the engine's vector and the
// response's Visibility message with their allocations.
inline constexpr uint64_t kVisibleBytesPerQuery = 128;

// What a unary request may be, in bytes, before the node parses it (RequestGate; docs/api.md,
// "Limits on every request"): requests that carry names and numbers; a Visible's queries
// (256 KiB is about 20k queries of a sequence and a range, or 131k empty ones, which parse into
// about 23 MiB with their answer); a LookupPrefix's prompt (2M tokens as packed varints). An
// Append may be as large as the server's message limit.
inline constexpr size_t kMaxSmallRequestBytes = size_t{64} << 10;
inline constexpr size_t kMaxVisibleRequestBytes = size_t{256} << 10;
inline constexpr size_t kMaxLookupRequestBytes = size_t{8} << 20;
// An AppendStream holding this much of the in-flight budget (one that buffers its payload, or
// a large first message) must keep to Options::stream_min_rate.
inline constexpr uint64_t kMinRateReservationBytes = uint64_t{1} << 20;
// A WatchEvents request: at most kMaxWatchedCaches names of at most 128 bytes.
inline constexpr size_t kMaxWatchRequestBytes = size_t{256} << 10;
// A Read's request (its positions), checked before it is parsed.
inline constexpr size_t kMaxReadRequestBytes = size_t{1} << 20;

// The Drain RPC's timeout when neither the request nor Options::drain_timeout gives one.
inline constexpr absl::Duration kDefaultDrainTimeout = absl::Seconds(60);

// v1::CacheService::CallbackService with every method but AppendStream served through the
// RequestGate (WithGenericMethod_X: the gate, a generic service registered beside this one,
// gets the calls) and AppendStream served raw (WithRawCallbackMethod_AppendStream). A method
// added to the service and left out here is served typed by nothing but the base's
// UNIMPLEMENTED; one left out of the gate's table answers UNIMPLEMENTED naming it.
namespace internal {
using S = v1::CacheService;
using CacheServiceBase = S::WithGenericMethod_CreateCache<
    S::WithGenericMethod_DeleteCache<S::WithGenericMethod_GetCache<S::WithGenericMethod_ListCaches<
        S::WithGenericMethod_Append<S::WithRawCallbackMethod_AppendStream<S::WithGenericMethod_Read<
            S::WithGenericMethod_Visible<S::WithGenericMethod_CopyPrefix<S::WithGenericMethod_Remove<
                S::WithGenericMethod_CanResume<S::WithGenericMethod_ListSequences<
                    S::WithGenericMethod_Snapshot<S::WithGenericMethod_Restore<
                        S::WithGenericMethod_MergeSnapshots<S::WithGenericMethod_SplitSnapshot<
                            S::WithGenericMethod_DropSnapshot<S::WithGenericMethod_ListSnapshots<
                                S::WithGenericMethod_CommitSpeculation<S::WithGenericMethod_Migrate<
                                    S::WithGenericMethod_MigrateSnapshot<
                                        S::WithGenericMethod_ListMembers<
                                            S::WithGenericMethod_Drain<S::WithGenericMethod_Reserve<
                                                S::WithGenericMethod_SetRetention<
                                                    S::WithGenericMethod_LookupPrefix<
                                                        S::WithGenericMethod_WatchEvents<
                                                            S::Service>>>>>>>>>>>>>>>>>>>>>>>>>>>;
}  // namespace internal

class CacheServiceImpl final : public internal::CacheServiceBase {
 public:
  struct Options {
    // The server's limit on one outgoing message; Read messages are cut to stay under it.
    size_t max_send_message_bytes = size_t{64} << 20;
    // The server's limit on one incoming message: the largest unary Append the gate reads.
    size_t max_receive_message_bytes = size_t{64} << 20;
    // The cluster operations (docs/cluster.md) and the executor they run on, or null: a node
    // without them serves local operations only and refuses cluster ones (FAILED_PRECONDITION).
    Cluster* cluster = nullptr;
    Executor* cluster_executor = nullptr;
    // Who callers are (tenants and tokens), not owned; null: development, every caller is an
    // admin of kDefaultTenant.
    const Authenticator* auth = nullptr;
    // Bytes of requests in flight (AppendStream bodies, unary Append payloads, Read payloads,
    // Visible answers), not owned; null: not bounded (an unlimited budget of the service's own).
    InflightBudget* inflight = nullptr;
    // An AppendStream that has sent no message for this long while the node waits for one is
    // ended with DEADLINE_EXCEEDED and its buffer freed; a Read whose write has not completed
    // for this long (its client takes nothing) is cancelled. absl::InfiniteDuration(): never.
    absl::Duration stream_idle_timeout = absl::Seconds(30);
    // An AppendStream that has run for stream_min_rate_grace and received less than
    // stream_min_rate bytes per second on average since its first message is ended with
    // RESOURCE_EXHAUSTED and its reservation freed; 0: no minimum.
    uint64_t stream_min_rate = 0;
    // (Only a stream that holds at least kMinRateReservationBytes of the in-flight budget: a
    // stream written into cells holds little of it, and may follow a slow producer.)
    absl::Duration stream_min_rate_grace = absl::Seconds(10);
    // Most positions one Visible call may list in all (RESOURCE_EXHAUSTED beyond).
    int64_t max_visible_positions = kDefaultMaxVisiblePositions;
    // Whether the node takes new caches and sequences (not owned; null: always), and what
    // empties it for the Drain RPC (not owned; null: Drain is FAILED_PRECONDITION), which runs
    // for drain_timeout when the request names no timeout.
    DrainGate* gate = nullptr;
    Drainer* drainer = nullptr;
    absl::Duration drain_timeout = absl::Seconds(60);
    // The node's event log, which WatchEvents serves (not owned; null: WatchEvents is
    // FAILED_PRECONDITION).
    EventLog* events = nullptr;
    // What the other members hold, for LookupPrefix with LOOKUP_SCOPE_CLUSTER (not owned; null:
    // FAILED_PRECONDITION on a node with a cluster).
    ClusterIndex* cluster_index = nullptr;
  };

  // `registry` and `executor` are not owned and must outlive the service.
  CacheServiceImpl(CacheRegistry* registry, Executor* executor, Options options);

  CacheServiceImpl(const CacheServiceImpl&) = delete;
  CacheServiceImpl& operator=(const CacheServiceImpl&) = delete;

  void HandleCreateCache(UnaryCall* call, const v1::CreateCacheRequest* request,
                         v1::CreateCacheResponse* response);
  void HandleDeleteCache(UnaryCall* call, const v1::DeleteCacheRequest* request,
                         v1::DeleteCacheResponse* response);
  void HandleGetCache(UnaryCall* call, const v1::GetCacheRequest* request,
                      v1::GetCacheResponse* response);
  void HandleListCaches(UnaryCall* call, const v1::ListCachesRequest* request,
                        v1::ListCachesResponse* response);
  // Served raw: the AppendRequest is parsed here with its payload left in the slices gRPC
  // received it in, and written from there into the cells the Append takes (where it can).
  void HandleAppend(UnaryCall* call, const grpc::ByteBuffer* request, grpc::ByteBuffer* response);
  // Served raw: the data of each AppendStreamRequest goes from the received slices into the
  // append (the cells it will take, where it can), and the AppendResponse is written here.
  grpc::ServerReadReactor<grpc::ByteBuffer>* AppendStream(grpc::CallbackServerContext* context,
                                                          grpc::ByteBuffer* response) override;
  // Through the gate, raw: ReadResponse's bytes are written by the node (the payload as slices
  // of the memory it lies in), and the request is parsed here.
  StreamReactor* StartRead(StreamCall* call, const grpc::ByteBuffer* request);
  void HandleVisible(UnaryCall* call, const v1::VisibleRequest* request,
                     v1::VisibleResponse* response);
  void HandleCopyPrefix(UnaryCall* call, const v1::CopyPrefixRequest* request,
                        v1::CopyPrefixResponse* response);
  void HandleRemove(UnaryCall* call, const v1::RemoveRequest* request,
                    v1::RemoveResponse* response);
  void HandleCanResume(UnaryCall* call, const v1::CanResumeRequest* request,
                       v1::CanResumeResponse* response);
  void HandleListSequences(UnaryCall* call, const v1::ListSequencesRequest* request,
                           v1::ListSequencesResponse* response);
  void HandleReserve(UnaryCall* call, const v1::ReserveRequest* request,
                     v1::ReserveResponse* response);
  void HandleSetRetention(UnaryCall* call, const v1::SetRetentionRequest* request,
                          v1::SetRetentionResponse* response);
  void HandleLookupPrefix(UnaryCall* call, const v1::LookupPrefixRequest* request,
                          v1::LookupPrefixResponse* response);
  // The generic service that serves every method but AppendStream (RequestGate): register it with
  // the server beside the service itself (ServerBuilder::RegisterCallbackGenericService).
  RequestGate* request_gate() { return gate_.get(); }

  // Through the gate: the request is parsed here, once the caller is known and the request is
  // within kMaxWatchRequestBytes.
  StreamReactor* StartWatchEvents(StreamCall* call, const grpc::ByteBuffer* request);
  // Ends every WatchEvents stream (UNAVAILABLE) and refuses new ones: call before the server's
  // Shutdown, or the streams, which never end by themselves, hold it for its grace period.
  void StopWatchers();
  // WatchEvents streams being served now.
  int watchers() const { return watchers_.running.load(); }
  void HandleSnapshot(UnaryCall* call, const v1::SnapshotRequest* request,
                      v1::SnapshotResponse* response);
  void HandleRestore(UnaryCall* call, const v1::RestoreRequest* request,
                     v1::RestoreResponse* response);
  void HandleMergeSnapshots(UnaryCall* call, const v1::MergeSnapshotsRequest* request,
                            v1::MergeSnapshotsResponse* response);
  void HandleSplitSnapshot(UnaryCall* call, const v1::SplitSnapshotRequest* request,
                           v1::SplitSnapshotResponse* response);
  void HandleDropSnapshot(UnaryCall* call, const v1::DropSnapshotRequest* request,
                          v1::DropSnapshotResponse* response);
  void HandleListSnapshots(UnaryCall* call, const v1::ListSnapshotsRequest* request,
                           v1::ListSnapshotsResponse* response);
  void HandleCommitSpeculation(UnaryCall* call, const v1::CommitSpeculationRequest* request,
                               v1::CommitSpeculationResponse* response);
  void HandleMigrate(UnaryCall* call, const v1::MigrateRequest* request,
                     v1::MigrateResponse* response);
  void HandleMigrateSnapshot(UnaryCall* call, const v1::MigrateSnapshotRequest* request,
                             v1::MigrateSnapshotResponse* response);
  void HandleListMembers(UnaryCall* call, const v1::ListMembersRequest* request,
                         v1::ListMembersResponse* response);
  void HandleDrain(UnaryCall* call, const v1::DrainRequest* request, v1::DrainResponse* response);

 private:
  class AppendStreamReactor;
  class ReadReactor;

  // Runs `fn` on the executor and finishes the call's default reactor with its status; fails
  // the call with UNAVAILABLE when the executor refuses the task.
  void RunUnary(UnaryCall* call, absl::AnyInvocable<absl::Status() &&> fn);
  // Runs `fn` on `executor` and answers `call` with its status; with CANCELLED when the call was
  // cancelled before `fn` could start, with BusyStatus() when the executor refuses the task.
  void RunOn(Executor* executor, UnaryCall* call, absl::AnyInvocable<absl::Status() &&> fn);

  // RunUnary for the RPCs on one cache: on the executor, finds `request->cache()` among the
  // caller's caches (FindCache's errors finish the call) and returns what `fn(Cache&)` or
  // `fn(Cache&, const Principal& caller)` returns.
  template <typename Request, typename Fn>
  void RunOnCache(UnaryCall* call, const Request* request, Fn fn) {
    grpc::CallbackServerContext* const context = call->context();
    RunUnary(call, [this, context, request, fn = std::move(fn)]() mutable -> absl::Status {
      Principal caller;
      absl::StatusOr<std::shared_ptr<Cache>> cache = FindCache(*context, request->cache(), &caller);
      if (!cache.ok()) return cache.status();
      if constexpr (std::is_invocable_v<Fn&, Cache&, const Principal&>) {
        return fn(**cache, caller);
      } else {
        return fn(**cache);
      }
    });
  }

  // A DrainGate ticket for an operation that writes `seqs` (an empty one without a gate, or
  // when every one of them stores something already).
  absl::StatusOr<DrainGate::Ticket> AdmitSequences(const Cache& cache,
                                                   absl::Span<const int64_t> seqs,
                                                   const char* what) const;

  // Append with the operation guard of its sequences (in `tenant`'s cache).
  // `append` does the engine's work: Cache::Append, or AppendWriter::Commit.
  absl::Status AppendGuarded(const std::string& tenant, Cache& cache,
                             absl::Span<const Token> tokens, const char* what,
                             absl::FunctionRef<absl::Status()> append);

  // The engine's work of a raw unary Append: Cache::AppendPieces of the payload where gRPC
  // received it. When the engine gathers the pieces (a second host copy of the payload),
  // `reservation` grows by the payload first.
  absl::Status AppendReceived(Cache& cache, absl::Span<const Token> tokens,
                              const RawAppendRequest& message,
                              InflightBudget::Reservation& reservation);

  // Runs `fn` on the cluster executor, as RunUnary; FAILED_PRECONDITION without a cluster.
  void RunCluster(UnaryCall* call, absl::AnyInvocable<absl::Status() &&> fn);

  // Marks an operation that changes `seqs` of `cache` (or consumes snapshots) as running, so that
  // a migration of them cannot start meanwhile; ABORTED while one of them is under migration.
  // A node without a cluster has no migrations: the guard is empty. `cache` is the cache's
  // Reservations::Key (tenant and name).
  absl::StatusOr<Reservations::Guard> Guard(Reservations::Kind kind, const std::string& cache,
                                            absl::Span<const int64_t> ids, const char* what) const;
  // Guard for one sequence, and for the snapshots `ids`.
  absl::StatusOr<Reservations::Guard> GuardSequence(const std::string& cache, int64_t seq,
                                                    const char* what) const;
  absl::StatusOr<Reservations::Guard> GuardSnapshots(const std::string& cache,
                                                     std::initializer_list<uint64_t> ids,
                                                     const char* what) const;

  // The caller of a call (Authenticator::Authenticate; every caller is an admin of
  // kDefaultTenant on a node without an authenticator).
  absl::StatusOr<Principal> Caller(const grpc::CallbackServerContext& context) const;

  // The cache named `name` of the call's caller, who is stored in *caller when not null:
  // the caller's errors, INVALID_ARGUMENT when the name is empty, NOT_FOUND when the caller's
  // tenant has no such cache.
  absl::StatusOr<std::shared_ptr<Cache>> FindCache(const grpc::CallbackServerContext& context,
                                                   const std::string& name,
                                                   Principal* caller = nullptr) const;

  // UNAVAILABLE with the executor's queue bound, for a task the executor refused.
  grpc::Status BusyStatus() const;

  CacheRegistry* const registry_;
  WatcherCount watchers_;
  Executor* const executor_;
  const Options options_;
  // options_.inflight, or an unlimited budget of our own when that is null.
  std::unique_ptr<InflightBudget> own_inflight_;
  InflightBudget* const inflight_;
  // Ends AppendStreams and Reads idle for options_.stream_idle_timeout.
  const std::unique_ptr<IdleReaper> idle_reaper_;
  // Serves the unary methods (built in the constructor).
  const std::unique_ptr<RequestGate> gate_;
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CACHE_SERVICE_H_
