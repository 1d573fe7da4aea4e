#include "service/watch_events.h"

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cache/cache.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "service/common/convert.h"

namespace kvmesh {

namespace {

v1::EventKind KindToProto(EventKind kind) {
  switch (kind) {
    case EventKind::kBlocks:
      return v1::EVENT_KIND_BLOCKS;
    case EventKind::kRemoved:
      return v1::EVENT_KIND_REMOVED;
    case EventKind::kSnapshotCreated:
      return v1::EVENT_KIND_SNAPSHOT_CREATED;
    case EventKind::kSnapshotDropped:
      return v1::EVENT_KIND_SNAPSHOT_DROPPED;
    case EventKind::kMigratedIn:
      return v1::EVENT_KIND_MIGRATED_IN;
    case EventKind::kMigratedOut:
      return v1::EVENT_KIND_MIGRATED_OUT;
    case EventKind::kCacheCreated:
      return v1::EVENT_KIND_CACHE_CREATED;
    case EventKind::kCacheDeleted:
      return v1::EVENT_KIND_CACHE_DELETED;
    case EventKind::kDraining:
      return v1::EVENT_KIND_DRAINING;
    case EventKind::kEvicted:
      return v1::EVENT_KIND_EVICTED;
  }
  return v1::EVENT_KIND_UNSPECIFIED;
}

// Sends progress (`next`) without events at most this often while the log moves on with
// events the watcher does not see, so that its cursor stays near the log's head; and at least
// this often while nothing happens at all, so that a watcher tells a quiet node from one it can
// no longer reach (kWatchHeartbeat).
constexpr absl::Duration kProgressInterval = kWatchHeartbeat;

// A watcher, served through a RequestGate: its messages are serialized here and written to the
// call as bytes.
class WatchReactor final : public StreamReactor {
 public:
  WatchReactor(StreamCall* call, v1::WatchEventsRequest request, absl::StatusOr<Principal> caller,
               std::function<absl::Status()> still_allowed, WatchScope scope,
               CacheRegistry* registry, EventLog* log, WatcherCount* count)
      : StreamReactor(call),
        request_(std::move(request)),
        caller_(std::move(caller)),
        still_allowed_(std::move(still_allowed)),
        scope_(scope),
        registry_(registry),
        log_(log),
        count_(count) {
    // The thread waits for mu_ before it does anything, so that thread_ is set before it can
    // call Finish (and gRPC OnDone, which joins it).
    std::lock_guard<std::mutex> lock(mu_);
    thread_ = std::thread([this] {
      { std::lock_guard<std::mutex> started(mu_); }
      Run();
    });
  }

  // Both notify under mu_, which OnDone takes before it deletes the reactor: gRPC runs OnDone
  // after every other reaction has returned, but through synchronization inside libgrpc that
  // TSan cannot see, and a notify after the unlock would look like a race with the condition
  // variable's destruction.
  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    write_ok_ = ok;
    cv_.notify_all();
  }

  // Wakes the log under mu_ too: OnDone may run on another thread as soon as this returns, and
  // only mu_ orders this reaction's last read of the reactor before its deletion for TSan.
  // (Lock order: mu_, then the log's; the thread never holds mu_ while it waits on the log.)
  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    cv_.notify_all();
    if (log_ != nullptr) log_->Wake();
  }

  void OnDone() override {
    // Finish was the thread's last act: it is leaving, or (when gRPC runs this inline from
    // Finish) about to return without touching the reactor again.
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
    if (counted_.load()) count_->running.fetch_sub(1);
    { std::lock_guard<std::mutex> last(mu_); }
    delete this;
  }

 private:
  bool cancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }

  // Writes `message` and waits until it is sent; false when the call was cancelled or the
  // write failed.
  bool Write(v1::WatchEventsResponse message) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cancelled_) return false;
      writing_ = true;
    }
    message.set_boot_id(log_->boot_id());
    message_.Clear();  // the last write is done; Serialize needs an empty buffer
    bool own_buffer;
    if (!grpc::SerializationTraits<v1::WatchEventsResponse>::Serialize(message, &message_,
                                                                       &own_buffer)
             .ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      return false;
    }
    StartWrite(&message_);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return !writing_; });
    return write_ok_ && !cancelled_;
  }

  void End(grpc::Status status) { Finish(status); }

  // Whether the watcher sees `event`.
  bool Visible(const Event& event) const {
    if (event.cache.empty()) return caches_.empty();  // the node's own events
    if (scope_ == WatchScope::kTenant && event.tenant != caller_->tenant) return false;
    if (!caches_.empty() && !caches_.contains(event.cache)) return false;
    auto it = listed_.find(ListedKey(event.tenant, event.cache));
    return it == listed_.end() || event.number > it->second;
  }

  static std::string ListedKey(const std::string& tenant, const std::string& cache) {
    return absl::StrCat(tenant, std::string(1, '\0'), cache);
  }

  // The listing: every watched sequence's blocks, then `synced`. Returns false when the call
  // ended (the status in *status).
  bool List(uint64_t next, grpc::Status* status) {
    std::vector<CacheRegistry::Entry> caches;
    if (scope_ == WatchScope::kAllTenants) {
      caches = registry_->ListAll();
    } else if (caches_.empty()) {
      for (std::shared_ptr<Cache>& cache : registry_->List(caller_->tenant)) {
        caches.push_back({caller_->tenant, std::move(cache)});
      }
    } else {
      for (const std::string& name : caches_) {
        absl::StatusOr<std::shared_ptr<Cache>> cache = registry_->Get(caller_->tenant, name);
        if (!cache.ok()) {
          *status = ToGrpcStatus(cache.status());
          return false;
        }
        caches.push_back({caller_->tenant, *std::move(cache)});
      }
    }
    v1::WatchEventsResponse message;
    size_t bytes = 0;
    for (const CacheRegistry::Entry& entry : caches) {
      const Cache& cache = *entry.cache;
      ChainListing listing = cache.ListChains();
      listed_[ListedKey(entry.tenant, cache.spec().name)] = listing.last_event;
      for (SequenceBlocks& s : listing.sequences) {
        v1::Event* e = message.add_events();
        e->set_kind(v1::EVENT_KIND_BLOCKS);
        e->set_cache(cache.spec().name);
        if (scope_ == WatchScope::kAllTenants) e->set_tenant(entry.tenant);
        e->set_token_block_size(cache.spec().token_block_size);
        e->set_seq(s.seq);
        e->set_offset(s.offset);
        e->mutable_block_hashes()->Add(s.hashes.begin(), s.hashes.end());
        bytes += 64 + s.hashes.size() * sizeof(uint64_t);
        if (bytes >= kWatchMessageBytes) {
          if (!Write(std::move(message))) return Cancelled(status);
          message = v1::WatchEventsResponse();
          bytes = 0;
        }
      }
    }
    message.set_synced(true);
    message.set_next(next);
    if (!Write(std::move(message))) return Cancelled(status);
    return true;
  }

  bool Cancelled(grpc::Status* status) {
    *status = grpc::Status(grpc::StatusCode::CANCELLED, "the watcher went away");
    return false;
  }

  void Run() {
    grpc::Status status = Serve();
    End(status);
  }

  grpc::Status Serve() {
    if (!caller_.ok()) return ToGrpcStatus(caller_.status());
    if (request_.caches_size() > kMaxWatchedCaches) {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("caches names ", request_.caches_size(), " caches, more than the ",
                       kMaxWatchedCaches, " one watcher may follow; watch them all (no caches)"));
    }
    for (const std::string& name : request_.caches()) {
      if (name.empty()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "caches names an empty cache");
      }
      if (const absl::Status length = CheckNameLength("caches", name); !length.ok()) {
        return ToGrpcStatus(length);
      }
      // Also when resuming: a name the caller has no cache of is NOT_FOUND either way.
      if (const absl::StatusOr<std::shared_ptr<Cache>> cache =
              registry_->Get(caller_->tenant, name);
          !cache.ok()) {
        return ToGrpcStatus(cache.status());
      }
      caches_.insert(name);
    }
    if (count_->running.fetch_add(1) >= count_->max) {
      count_->running.fetch_sub(1);
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("this node serves ", count_->max,
                                       " WatchEvents streams already; retry later"));
    }
    counted_.store(true);
    uint64_t cursor = 0;
    if (!request_.boot_id().empty()) {
      if (request_.boot_id() != log_->boot_id()) {
        return grpc::Status(
            grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("boot_id ", request_.boot_id(), " is not this node's (", log_->boot_id(),
                         "): the node restarted and its events start over; watch again without a "
                         "boot_id for a listing"));
      }
      cursor = request_.next();
      const uint64_t first = log_->first_number();
      const uint64_t next = log_->next_number();
      if (cursor < 1 || cursor > next) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("next = ", cursor, " is outside [1, ", next,
                                         "], the events this node has numbered"));
      }
      if (cursor < first) {
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            absl::StrCat("events ", cursor, " to ", first - 1,
                                         " are no longer kept; watch again without a boot_id "
                                         "for a listing"));
      }
    } else {
      // The cursor is taken before the listing: whatever a cache publishes meanwhile is either
      // in its listing (its number at most the cache's last_event then) or after it.
      cursor = log_->next_number();
      grpc::Status listed;
      if (!List(cursor, &listed)) return listed;
    }
    absl::Time last_sent = absl::Now();
    while (!cancelled()) {
      // At least once per kProgressInterval: a caller whose token was revoked (or a peer removed
      // from the membership) loses the stream within about a second.
      if (still_allowed_ != nullptr) {
        if (const absl::Status allowed = still_allowed_(); !allowed.ok()) {
          return ToGrpcStatus(
              absl::Status(allowed.code(), absl::StrCat("WatchEvents ended: ", allowed.message())));
        }
      }
      if (count_->stopping.load()) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat("the node is shutting down; resume on a node that serves "
                                         "(from next = ",
                                         cursor, " if it is this one again)"));
      }
      absl::StatusOr<std::vector<Event>> events = log_->Read(cursor, 1024, kWatchMessageBytes);
      if (!events.ok()) {
        return grpc::Status(
            grpc::StatusCode::RESOURCE_EXHAUSTED,
            absl::StrCat("this watcher fell behind the node's events (", events.status().message(),
                         "); watch again without a boot_id for a listing"));
      }
      if (events->empty()) {
        if (absl::Now() - last_sent >= kProgressInterval) {
          v1::WatchEventsResponse heartbeat;
          heartbeat.set_next(cursor);
          if (!Write(std::move(heartbeat))) break;
          last_sent = absl::Now();
        }
        log_->Wait(cursor - 1, last_sent + kProgressInterval);
        continue;
      }
      v1::WatchEventsResponse message;
      for (const Event& event : *events) {
        cursor = event.number + 1;
        if (Visible(event)) EventToProto(event, scope_, message.add_events());
      }
      message.set_next(cursor);
      if (message.events().empty() && absl::Now() - last_sent < kProgressInterval) continue;
      if (!Write(std::move(message))) break;
      last_sent = absl::Now();
    }
    return grpc::Status(grpc::StatusCode::CANCELLED, "the watcher went away");
  }

  const v1::WatchEventsRequest request_;
  const absl::StatusOr<Principal> caller_;
  const std::function<absl::Status()> still_allowed_;
  const WatchScope scope_;
  CacheRegistry* const registry_;
  EventLog* const log_;
  WatcherCount* const count_;
  std::atomic<bool> counted_{false};  // read by OnDone
  absl::flat_hash_set<std::string> caches_;
  // Per cache listed: the number of its last event the listing reflects.
  absl::flat_hash_map<std::string, uint64_t> listed_;
  grpc::ByteBuffer message_;  // the one being written

  std::mutex mu_;
  std::condition_variable cv_;
  bool writing_ = false;
  bool write_ok_ = true;
  bool cancelled_ = false;
  std::thread thread_;
};

}  // namespace

void EventToProto(const Event& event, WatchScope scope, v1::Event* out) {
  out->set_number(event.number);
  if (scope == WatchScope::kAllTenants) out->set_tenant(event.tenant);
  out->set_token_block_size(event.token_block_size);
  out->set_time_unix_micros(absl::ToUnixMicros(event.time));
  out->set_kind(KindToProto(event.kind));
  out->set_cache(event.cache);
  out->set_seq(event.seq);
  out->set_offset(event.offset);
  out->set_kept_blocks(event.kept_blocks);
  out->mutable_block_hashes()->Add(event.block_hashes.begin(), event.block_hashes.end());
  out->set_begin(event.begin);
  out->set_end(event.end);
  out->set_snapshot(event.snapshot);
  out->set_peer(event.peer);
  out->set_reason(event.reason);
}

StreamReactor* StartWatch(StreamCall* call, const v1::WatchEventsRequest& request,
                          absl::StatusOr<Principal> caller, WatchScope scope,
                          CacheRegistry* registry, EventLog* log, WatcherCount* count,
                          std::function<absl::Status()> still_allowed) {
  return new WatchReactor(call, request, std::move(caller), std::move(still_allowed), scope,
                          registry, log, count);
}

}  // namespace kvmesh
