#include "service/cluster/cluster_index.h"

#include <algorithm>
#include <future>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/peer.grpc.pb.h"

namespace kvmesh {

namespace {

std::string CacheKey(const std::string& tenant, const std::string& cache) {
  return absl::StrCat(tenant, std::string(1, '\0'), cache);
}

}  // namespace

absl::StatusOr<int> LookupMatchCount(int32_t max_matches) {
  if (max_matches < 0 || max_matches > kMaxLookupMatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_matches = ", max_matches, " is outside [0, ", kMaxLookupMatches, "]"));
  }
  return max_matches == 0 ? 1 : max_matches;
}

// Follows one peer's events on a thread of its own (see the class comment of ClusterIndex).
class ClusterIndex::Watcher {
 public:
  Watcher(MemberAddress member, const Options& options)
      : member_(std::move(member)),
        options_(options),
        channel_(options.membership->OwnChannel(member_)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~Watcher() {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
      if (context_ != nullptr) context_->TryCancel();
    }
    wake_.notify_all();
    thread_.join();
  }
  Watcher(const Watcher&) = delete;
  Watcher& operator=(const Watcher&) = delete;

  const MemberAddress& member() const { return member_; }

  // Adds this peer's candidates, when its listing is complete.
  void Lookup(const std::string& key, int32_t block_size, absl::Span<const uint64_t> hashes,
              int max_matches, std::vector<Candidate>* out) const {
    ReaderMutexLock lock(&mu_);
    if (!synced_) return;
    ClusterIndex::Lookup(member_.name, data_, key, block_size, hashes, max_matches, out);
  }

  // Cancels the stream when nothing came on it for `timeout`.
  void CancelIfSilent(absl::Duration timeout) {
    MutexLock lock(&mu_);
    if (context_ == nullptr || silent_ || absl::Now() - last_message_ < timeout) return;
    silent_ = true;
    context_->TryCancel();
  }

  PeerState State() const {
    ReaderMutexLock lock(&mu_);
    PeerState state;
    state.node = member_.name;
    state.synced = synced_;
    if (synced_) {
      state.boot_id = data_.boot_id;
      for (const auto& [key, cache] : data_.caches) {
        state.sequences += static_cast<int64_t>(cache.sequences.size());
      }
      state.blocks = data_.blocks;
    }
    state.events = events_;
    state.resyncs = resyncs_;
    state.last_error = last_error_;
    return state;
  }

 private:
  void Run() {
    for (;;) {
      const std::string ended = Watch();
      MutexLock lock(&mu_);
      // Whatever the stream said is forgotten with it: a peer that restarted holds nothing of
      // it, and one that is unreachable cannot be asked to verify.
      data_ = PeerData();
      synced_ = false;
      last_error_ = ended;
      if (stopping_) return;
      ++resyncs_;
      const absl::Time until = absl::Now() + options_.retry_interval;
      while (!stopping_ && absl::Now() < until) {
        wake_.wait_for(mu_, absl::ToChronoNanoseconds(until - absl::Now()));
      }
      if (stopping_) return;
    }
  }

  // One stream, from a listing to its end; returns how it ended.
  std::string Watch() {
    std::unique_ptr<v1::PeerService::Stub> stub = v1::PeerService::NewStub(channel_);
    grpc::ClientContext context;
    {
      MutexLock lock(&mu_);
      if (stopping_) return "stopped";
      context_ = &context;
      last_message_ = absl::Now();
      silent_ = false;
    }
    std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
        stub->WatchEvents(&context, v1::PeerWatchEventsRequest());
    v1::WatchEventsResponse message;
    std::string ended;
    std::string boot_id;
    while (ended.empty() && reader->Read(&message)) {
      if (boot_id.empty()) boot_id = message.boot_id();
      MutexLock lock(&mu_);
      last_message_ = absl::Now();
      if (message.boot_id() != boot_id) {
        ended =
            absl::StrCat("the stream changed boot id from ", boot_id, " to ", message.boot_id());
      }
      data_.boot_id = boot_id;
      for (int i = 0; ended.empty() && i < message.events_size(); ++i) {
        const v1::Event& event = message.events(i);
        ++events_;
        if (!Apply(event, &data_)) {
          ended = absl::StrCat("event ", event.number(), " of cache '", event.cache(), "' keeps ",
                               event.kept_blocks(), " blocks of sequence ", event.seq(),
                               ", more than it had");
        }
      }
      if (!ended.empty()) {
        // Half applied: never served.
        data_ = PeerData();
        synced_ = false;
        break;
      }
      if (message.synced()) synced_ = true;
    }
    bool silent = false;
    {
      MutexLock lock(&mu_);
      context_ = nullptr;
      silent = silent_;
    }
    if (silent && ended.empty()) {
      (void)reader->Finish();
      return absl::StrCat("nothing from node '", member_.name, "' for ",
                          absl::FormatDuration(options_.silence_timeout));
    }
    if (!ended.empty()) {
      context.TryCancel();
      (void)reader->Finish();
      return ended;
    }
    const grpc::Status status = reader->Finish();
    return absl::StrCat("WatchEvents on node '", member_.name,
                        "' ended: ", static_cast<int>(status.error_code()), " ",
                        status.error_message());
  }

  const MemberAddress member_;
  const Options& options_;
  // Of its own (Membership::OwnChannel): the watcher calls the peer before it may listen.
  const std::shared_ptr<grpc::Channel> channel_;

  mutable Mutex mu_;
  std::condition_variable_any wake_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Time last_message_ ABSL_GUARDED_BY(mu_);  // of the current stream
  bool silent_ ABSL_GUARDED_BY(mu_) = false;      // it was cancelled for its silence
  PeerData data_ ABSL_GUARDED_BY(mu_);
  bool synced_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t events_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t resyncs_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

ClusterIndex::ClusterIndex(Options options) : options_(std::move(options)) {
  manager_ = std::thread([this] { ManagerLoop(); });
}

ClusterIndex::~ClusterIndex() { Stop(); }

void ClusterIndex::Stop() {
  std::map<std::string, std::unique_ptr<Watcher>> watchers;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (manager_.joinable()) manager_.join();
  {
    MutexLock lock(&mu_);
    watchers.swap(watchers_);
  }
  watchers.clear();  // each destructor cancels its stream and joins its thread
}

void ClusterIndex::ManagerLoop() {
  for (;;) {
    Reconcile();
    MutexLock lock(&mu_);
    const absl::Time until = absl::Now() + options_.refresh_interval;
    while (!stopping_ && absl::Now() < until) {
      wake_.wait_for(mu_, absl::ToChronoNanoseconds(until - absl::Now()));
    }
    if (stopping_) return;
  }
}

void ClusterIndex::Reconcile() {
  const std::vector<MemberAddress> peers = options_.membership->Peers();
  std::vector<std::unique_ptr<Watcher>> gone;
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    for (auto& [name, watcher] : watchers_) watcher->CancelIfSilent(options_.silence_timeout);
    for (auto it = watchers_.begin(); it != watchers_.end();) {
      const bool member = std::any_of(peers.begin(), peers.end(), [&](const MemberAddress& p) {
        return p == it->second->member();
      });
      if (member) {
        ++it;
      } else {
        gone.push_back(std::move(it->second));
        it = watchers_.erase(it);
      }
    }
    for (const MemberAddress& peer : peers) {
      if (watchers_.count(peer.name) == 0) {
        watchers_.emplace(peer.name, std::make_unique<Watcher>(peer, options_));
      }
    }
  }
  gone.clear();  // outside the lock: each joins its thread
}

bool ClusterIndex::Apply(const v1::Event& event, PeerData* data) {
  switch (event.kind()) {
    case v1::EVENT_KIND_BLOCKS: {
      CacheEntry& cache = data->caches[CacheKey(event.tenant(), event.cache())];
      if (event.token_block_size() > 0) cache.block_size = event.token_block_size();
      auto it = cache.sequences.find(event.seq());
      const size_t had = it == cache.sequences.end() ? 0 : it->second.hashes.size();
      if (event.kept_blocks() < 0 || static_cast<size_t>(event.kept_blocks()) > had) return false;
      if (it == cache.sequences.end()) {
        if (event.block_hashes().empty()) return true;
        it = cache.sequences.emplace(event.seq(), SequenceEntry()).first;
      }
      SequenceEntry& sequence = it->second;
      const size_t kept = static_cast<size_t>(event.kept_blocks());
      cache.index.Remove(event.seq(), absl::MakeConstSpan(sequence.hashes).subspan(kept));
      data->blocks -= static_cast<int64_t>(sequence.hashes.size() - kept);
      sequence.hashes.resize(kept);
      sequence.hashes.insert(sequence.hashes.end(), event.block_hashes().begin(),
                             event.block_hashes().end());
      cache.index.Add(event.seq(), event.block_hashes());
      data->blocks += event.block_hashes().size();
      sequence.offset = event.offset();
      if (sequence.hashes.empty()) cache.sequences.erase(it);
      return true;
    }
    case v1::EVENT_KIND_CACHE_CREATED: {
      CacheEntry& cache = data->caches[CacheKey(event.tenant(), event.cache())];
      cache.block_size = event.token_block_size();
      return true;
    }
    case v1::EVENT_KIND_CACHE_DELETED: {
      auto it = data->caches.find(CacheKey(event.tenant(), event.cache()));
      if (it != data->caches.end()) {
        for (const auto& [seq, sequence] : it->second.sequences) {
          data->blocks -= static_cast<int64_t>(sequence.hashes.size());
        }
        data->caches.erase(it);
      }
      return true;
    }
    default:
      // Removals, migrations and snapshots change blocks through BLOCKS events of their own.
      return true;
  }
}

void ClusterIndex::Lookup(const std::string& node, const PeerData& data, const std::string& key,
                          int32_t block_size, absl::Span<const uint64_t> hashes, int max_matches,
                          std::vector<Candidate>* out) {
  auto found = data.caches.find(key);
  if (found == data.caches.end() || found->second.block_size != block_size) return;
  const CacheEntry& cache = found->second;
  size_t depth = 0;
  while (depth < hashes.size() && cache.index.Find(hashes[depth]) != nullptr) ++depth;
  // As Cache::LookupPrefix, deepest level first; a sequence's own hashes must equal the
  // prompt's up to the level (a collision at one block alone does not make a candidate).
  int64_t budget = std::max<int64_t>(64, int64_t{4} * max_matches);
  int found_here = 0;
  absl::flat_hash_set<int64_t> seen;
  for (size_t level = depth; level-- > 0 && budget > 0 && found_here < max_matches;) {
    const BlockIndex::Holders& held = *cache.index.Find(hashes[level]);
    std::vector<int64_t> holders(held.begin(), held.end());
    std::sort(holders.begin(), holders.end());
    for (int64_t seq : holders) {
      if (found_here >= max_matches) break;
      if (seen.contains(seq)) continue;
      if (budget-- <= 0) break;
      const SequenceEntry& sequence = cache.sequences.at(seq);
      if (sequence.hashes.size() <= level ||
          !std::equal(hashes.begin(), hashes.begin() + level + 1, sequence.hashes.begin())) {
        continue;
      }
      seen.insert(seq);
      out->push_back({node, seq, static_cast<int32_t>(level + 1), sequence.offset});
      ++found_here;
    }
  }
}

absl::StatusOr<std::vector<ClusterIndex::Candidate>> ClusterIndex::Lookup(
    const std::string& tenant, const std::string& cache, int32_t block_size,
    absl::Span<const uint64_t> hashes, int max_matches) const {
  std::vector<Candidate> candidates;
  const std::string key = CacheKey(tenant, cache);
  {
    ReaderMutexLock lock(&mu_);
    if (stopping_) {
      return absl::UnavailableError(
          "the node is shutting down and no longer follows its peers; ask another member");
    }
    for (const auto& [name, watcher] : watchers_) {
      watcher->Lookup(key, block_size, hashes, max_matches, &candidates);
    }
  }
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.blocks != b.blocks) return a.blocks > b.blocks;
    if (a.node != b.node) return a.node < b.node;
    return a.seq < b.seq;
  });
  return candidates;
}

void ClusterIndex::Verify(const std::vector<std::string>& nodes, const std::string& tenant,
                          const v1::LookupPrefixRequest& lookup, absl::Time deadline,
                          v1::LookupPrefixResponse* response) const {
  v1::PeerLookupPrefixRequest request;
  *request.mutable_lookup() = lookup;
  request.mutable_lookup()->set_scope(v1::LOOKUP_SCOPE_LOCAL);
  request.mutable_lookup()->set_verify(false);
  request.set_tenant(tenant);
  std::vector<std::future<grpc::Status>> calls;
  std::vector<v1::LookupPrefixResponse> answers(nodes.size());
  calls.reserve(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    calls.push_back(std::async(std::launch::async, [&, i]() -> grpc::Status {
      const absl::StatusOr<MemberAddress> member = options_.membership->Find(nodes[i]);
      if (!member.ok()) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(member.status().message()));
      }
      std::unique_ptr<v1::PeerService::Stub> stub =
          v1::PeerService::NewStub(options_.membership->Channel(*member));
      grpc::ClientContext context;
      if (deadline != absl::InfiniteFuture()) context.set_deadline(absl::ToChronoTime(deadline));
      return stub->LookupPrefix(&context, request, &answers[i]);
    }));
  }
  for (size_t i = 0; i < nodes.size(); ++i) {
    const grpc::Status status = calls[i].get();
    if (!status.ok()) {
      v1::NodeResult* failed = response->add_unverified();
      failed->set_node(nodes[i]);
      failed->set_code(static_cast<int>(status.error_code()));
      failed->set_message(status.error_message());
      continue;
    }
    for (v1::PrefixMatch& match : *answers[i].mutable_matches()) {
      match.set_node(nodes[i]);
      match.set_verified(true);
      *response->add_matches() = std::move(match);
    }
  }
}

std::vector<ClusterIndex::PeerState> ClusterIndex::Peers() const {
  std::vector<PeerState> peers;
  ReaderMutexLock lock(&mu_);
  for (const auto& [name, watcher] : watchers_) peers.push_back(watcher->State());
  return peers;
}

void AddPrefixMatches(const std::string& node, const std::vector<PrefixMatch>& matches,
                      v1::LookupPrefixResponse* response) {
  for (const PrefixMatch& m : matches) {
    v1::PrefixMatch* out = response->add_matches();
    out->set_node(node);
    out->set_seq(m.seq);
    out->set_length(m.length);
    out->set_offset(m.offset);
    out->set_can_resume(m.can_resume);
    out->set_verified(true);
  }
}

void SortPrefixMatches(int max_matches, v1::LookupPrefixResponse* response) {
  auto* matches = response->mutable_matches();
  std::sort(matches->begin(), matches->end(),
            [](const v1::PrefixMatch& a, const v1::PrefixMatch& b) {
              if (a.length() != b.length()) return a.length() > b.length();
              if (a.verified() != b.verified()) return a.verified();
              if (a.node() != b.node()) return a.node() < b.node();
              return a.seq() < b.seq();
            });
  while (matches->size() > max_matches) matches->RemoveLast();
}

}  // namespace kvmesh
