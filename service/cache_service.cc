// CacheServiceImpl's constructor and shared helpers, and its RPCs on caches (CreateCache,
// DeleteCache, GetCache, ListCaches), on sequences (CopyPrefix, Remove, CanResume,
// ListSequences, Reserve, SetRetention), LookupPrefix, WatchEvents and the cluster (Migrate,
// MigrateSnapshot, ListMembers, Drain).
#include "service/cache_service.h"

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
#include "service/cache_service_internal.h"
#include "service/cluster/cluster.h"
#include "service/common/convert.h"
#include "service/list_pages.h"
#include "service/peer_service.h"
#include "service/request_gate.h"

namespace kvmesh {
namespace {

// Reserve's TTL when a request leaves ttl_ms at 0, and the longest one accepted.
constexpr int64_t kDefaultReserveTtlMs = 60 * 1000;
constexpr int64_t kMaxReserveTtlMs = 60 * 60 * 1000;

}  // namespace

using cache_service_internal::kCancelledMessage;

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
