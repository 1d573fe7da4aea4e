#include "service/cluster/drain.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "service/common/convert.h"
#include "service/common/metrics.h"

namespace kvmesh {

struct Drainer::Item {
  std::string tenant;
  std::shared_ptr<Cache> cache;
  bool sequence = true;  // else a snapshot
  int64_t seq = 0;
  uint64_t snapshot_id = 0;

  std::string Name() const {
    return sequence
               ? absl::StrCat("sequence ", seq, " of cache '", cache->spec().name, "'")
               : absl::StrCat("snapshot ", snapshot_id, " of cache '", cache->spec().name, "'");
  }
  std::string Key() const {
    return absl::StrCat(tenant, "/", cache->spec().name, sequence ? "/seq/" : "/snap/",
                        sequence ? seq : static_cast<int64_t>(snapshot_id));
  }
};

// A peer that may take a cache's items, as its Place answer described it.
struct Drainer::Candidate {
  MemberAddress member;
  bool exists = false;
  int64_t free_cells = 0;
  std::set<int64_t> seqs;  // sequence ids in use there
};

struct Drainer::Outcome {
  bool moved = false;
  bool gone = false;       // no longer here, moved by someone else or removed
  bool retryable = false;  // may succeed in a later pass
  std::string reason;
};

namespace {

// How long into a drain a peer that does not answer is waited for.
constexpr absl::Duration kUnreachablePeerWait = absl::Seconds(10);

// A failed Migrate after which the target may still have committed the sequence (the failure
// came on the way back, or the deadline fired as it committed).
bool IsUnclear(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
         code == absl::StatusCode::kCancelled || code == absl::StatusCode::kUnknown;
}

bool IsRetryable(absl::StatusCode code) {
  return code == absl::StatusCode::kAborted || code == absl::StatusCode::kUnavailable ||
         code == absl::StatusCode::kDeadlineExceeded;
}

std::string StatusText(const absl::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
}

}  // namespace

Drainer::Drainer(Options options, CacheRegistry* registry, Membership* membership, Cluster* cluster,
                 DrainGate* gate)
    : options_(std::move(options)),
      registry_(registry),
      membership_(membership),
      cluster_(cluster),
      gate_(gate) {}

void Drainer::Log(const std::string& line) const {
  if (options_.log) options_.log(line);
}

bool Drainer::Resumed(uint64_t epoch) const {
  ReaderMutexLock lock(&mu_);
  return resumes_ != epoch;
}

absl::StatusOr<v1::DrainResponse> Drainer::Resume() {
  {
    MutexLock lock(&mu_);
    if (terminating_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node '", options_.self_name, "' is shutting down (SIGTERM): it cannot be resumed"));
    }
    ++resumes_;
    gate_->Open();
  }
  wake_.notify_all();
  Log(absl::StrCat("node '", options_.self_name, "' resumed: it takes new caches and sequences"));
  v1::DrainResponse response;
  response.set_draining(false);
  return response;
}

absl::Time Drainer::Until(absl::Time deadline) const {
  ReaderMutexLock lock(&mu_);
  return std::min(deadline, cap_);
}

std::vector<Drainer::Item> Drainer::Inventory() const {
  std::vector<Item> items;
  for (const CacheRegistry::Entry& entry : registry_->ListAll()) {
    for (const SequenceInfo& info : entry.cache->ListSequences()) {
      Item item;
      item.tenant = entry.tenant;
      item.cache = entry.cache;
      item.seq = info.seq;
      items.push_back(std::move(item));
    }
    for (const SnapshotInfo& info : entry.cache->ListSnapshots()) {
      Item item;
      item.tenant = entry.tenant;
      item.cache = entry.cache;
      item.sequence = false;
      item.snapshot_id = info.id;
      items.push_back(std::move(item));
    }
  }
  return items;
}

std::vector<Drainer::Candidate> Drainer::Probe(const std::string& tenant, const Cache& cache,
                                               absl::Time deadline, bool wait_for_unreachable,
                                               std::string* reasons, bool* retryable) {
  std::vector<Candidate> candidates;
  std::vector<std::string> refusals;
  v1::PlaceRequest request;
  request.set_tenant(tenant);
  *request.mutable_spec() = SpecToProto(cache.spec());
  for (const MemberAddress& peer : membership_->Peers()) {
    absl::StatusOr<v1::PlaceResponse> place = cluster_->AskToPlace(peer, request, deadline);
    if (!place.ok()) {
      // A peer that does not answer is waited for only early in the drain (a pod of a rolling
      // update restarting), then left out: peers that stop together (a whole StatefulSet
      // deleted) would otherwise wait out each other's drains.
      *retryable |= place.status().code() == absl::StatusCode::kAborted ||
                    (wait_for_unreachable && IsRetryable(place.status().code()));
      refusals.push_back(StatusText(place.status()));
      continue;
    }
    if (place->draining()) {
      refusals.push_back(absl::StrCat("node '", peer.name, "' drains too"));
      continue;
    }
    Candidate candidate;
    candidate.member = peer;
    candidate.exists = place->exists();
    candidate.free_cells = place->free_cells();
    candidate.seqs.insert(place->seqs().begin(), place->seqs().end());
    candidates.push_back(std::move(candidate));
  }
  // The peers that have the cache, most free cells first; then the others, by name.
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     if (a.exists != b.exists) return a.exists;
                     if (a.exists && a.free_cells != b.free_cells) {
                       return a.free_cells > b.free_cells;
                     }
                     return a.member.name < b.member.name;
                   });
  *reasons = refusals.empty() ? "this node has no peers" : absl::StrJoin(refusals, "; ");
  return candidates;
}

bool Drainer::EnsureCache(const Item& item, Candidate& candidate, absl::Time deadline,
                          v1::DrainResponse* response, absl::Status* reason) {
  if (candidate.exists) return true;
  v1::PlaceRequest request;
  request.set_tenant(item.tenant);
  *request.mutable_spec() = SpecToProto(item.cache->spec());
  request.set_create(true);
  absl::StatusOr<v1::PlaceResponse> place =
      cluster_->AskToPlace(candidate.member, request, deadline);
  if (place.ok() && !place->exists()) {
    place = absl::UnavailableError(
        absl::StrCat("node '", candidate.member.name, "' drains and takes no cache"));
  }
  if (!place.ok()) {
    *reason = place.status();
    return false;
  }
  candidate.exists = true;
  candidate.free_cells = place->free_cells();
  candidate.seqs.insert(place->seqs().begin(), place->seqs().end());
  if (place->created()) {
    response->add_caches_created(
        absl::StrCat(candidate.member.name, "/", item.tenant, "/", item.cache->spec().name));
    Log(absl::StrCat("drain: created cache '", item.cache->spec().name, "' of tenant '",
                     item.tenant, "' on node '", candidate.member.name, "'"));
  }
  return true;
}

Drainer::Outcome Drainer::MoveSequence(const Item& item, const std::set<int64_t>& local_seqs,
                                       std::vector<Candidate>& candidates, absl::Time deadline,
                                       std::map<std::string, Unclear>* unclear,
                                       v1::DrainResponse* response) {
  Outcome outcome;
  std::vector<std::string> reasons;
  // One attempt: Migrate to `candidate` as `target_seq` under `migration_id`; the status.
  auto attempt = [&](Candidate& candidate, int64_t target_seq,
                     const std::string& migration_id) -> absl::Status {
    v1::MigrateRequest migrate;
    migrate.set_cache(item.cache->spec().name);
    migrate.set_seq(item.seq);
    migrate.set_target_node(candidate.member.name);
    migrate.set_target_seq(target_seq);
    migrate.set_keep_source(false);
    absl::StatusOr<v1::MigrateResponse> moved =
        cluster_->Migrate(item.tenant, migrate, deadline, /*target_seq_unused=*/true, migration_id);
    if (!moved.ok()) return moved.status();
    candidate.seqs.insert(target_seq);
    // free_cells stays as the peer said: it is the least over groups of different units
    // (cells, ring rows, state slots), good for ranking peers, not for bookkeeping. A peer
    // that fills up answers RESOURCE_EXHAUSTED, and the next one is tried.
    v1::DrainedSequence* done = response->add_sequences();
    done->set_tenant(item.tenant);
    done->set_cache(item.cache->spec().name);
    done->set_seq(item.seq);
    done->set_node(candidate.member.name);
    done->set_target_seq(target_seq);
    *done->mutable_transfer() = moved->transfer();
    Log(absl::StrCat("drain: moved ", item.Name(), " of tenant '", item.tenant, "' to node '",
                     candidate.member.name, "' as sequence ", target_seq, " (",
                     moved->transfer().bytes(), " bytes over ", moved->transfer().transport(),
                     ")"));
    return absl::OkStatus();
  };
  // An earlier attempt whose outcome is unclear goes first, to the same peer under the same
  // migration id: if that peer committed it, it says so now, and nothing is copied twice. A
  // peer that no longer answers (or drains) cannot say: the item goes on as a new one.
  auto pending = unclear->find(item.Key());
  if (pending != unclear->end()) {
    const Unclear earlier = pending->second;
    unclear->erase(pending);
    for (Candidate& candidate : candidates) {
      if (candidate.member.name != earlier.node) continue;
      const absl::Status status = attempt(candidate, earlier.target_seq, earlier.migration_id);
      if (status.ok()) {
        outcome.moved = true;
        return outcome;
      }
      if (IsUnclear(status.code())) {
        (*unclear)[item.Key()] = earlier;
        outcome.retryable = true;
        outcome.reason = StatusText(status);
        return outcome;
      }
      break;
    }
  }
  for (Candidate& candidate : candidates) {
    // (Snapshots need no cells: they go to the snapshot pool.)
    if (candidate.exists && candidate.free_cells == 0) {
      reasons.push_back(absl::StrCat("node '", candidate.member.name,
                                     "' has no free cell in cache '", item.cache->spec().name,
                                     "'"));
      continue;
    }
    absl::Status status;
    if (!EnsureCache(item, candidate, deadline, response, &status)) {
      outcome.retryable |= IsRetryable(status.code());
      reasons.push_back(StatusText(status));
      continue;
    }
    // Its own id when free there, else the next above every id in use there and every id of
    // this cache still here (which keep theirs when they can). A sequence the target starts
    // meanwhile makes the Pull ALREADY_EXISTS: take the next id then.
    int64_t target_seq = item.seq;
    std::string migration_id;
    for (int tries = 0; tries < 3; ++tries) {
      target_seq = item.seq;
      if (candidate.seqs.count(target_seq) > 0) {
        target_seq = std::max(*candidate.seqs.rbegin(),
                              local_seqs.empty() ? int64_t{0} : *local_seqs.rbegin()) +
                     1;
      }
      migration_id = absl::StrCat(options_.self_name, "/", item.cache->spec().name, "/", item.seq,
                                  "@drain-", absl::ToUnixNanos(absl::Now()));
      status = attempt(candidate, target_seq, migration_id);
      if (status.ok()) {
        outcome.moved = true;
        return outcome;
      }
      if (status.code() != absl::StatusCode::kAlreadyExists) break;
      candidate.seqs.insert(target_seq);
    }
    // The source's own refusals end the attempt: another peer would meet them too.
    if (status.code() == absl::StatusCode::kNotFound && !item.cache->IsLive(item.seq)) {
      outcome.gone = true;
      return outcome;
    }
    if (IsUnclear(status.code())) {
      // The peer may have committed it: ask it again, and no other, in the next pass.
      (*unclear)[item.Key()] = Unclear{candidate.member.name, target_seq, migration_id};
      outcome.retryable = true;
      reasons.push_back(StatusText(status));
      break;
    }
    outcome.retryable |= IsRetryable(status.code());
    reasons.push_back(StatusText(status));
    if (status.code() == absl::StatusCode::kAborted) break;  // pending tokens, under migration
  }
  outcome.reason = reasons.empty() ? "no peer can take it" : absl::StrJoin(reasons, "; ");
  return outcome;
}

Drainer::Outcome Drainer::MoveSnapshot(const Item& item, std::vector<Candidate>& candidates,
                                       absl::Time deadline, v1::DrainResponse* response) {
  Outcome outcome;
  std::vector<std::string> reasons;
  for (Candidate& candidate : candidates) {
    absl::Status status;
    if (!EnsureCache(item, candidate, deadline, response, &status)) {
      outcome.retryable |= IsRetryable(status.code());
      reasons.push_back(StatusText(status));
      continue;
    }
    v1::MigrateSnapshotRequest migrate;
    migrate.set_cache(item.cache->spec().name);
    migrate.set_snapshot_id(item.snapshot_id);
    migrate.set_target_node(candidate.member.name);
    migrate.set_keep_source(false);
    absl::StatusOr<v1::MigrateSnapshotResponse> moved =
        cluster_->MigrateSnapshot(item.tenant, migrate, deadline);
    if (moved.ok()) {
      v1::DrainedSnapshot* done = response->add_snapshots();
      done->set_tenant(item.tenant);
      done->set_cache(item.cache->spec().name);
      done->set_snapshot_id(item.snapshot_id);
      done->set_node(candidate.member.name);
      done->set_target_snapshot_id(moved->snapshot().id());
      *done->mutable_transfer() = moved->transfer();
      Log(absl::StrCat("drain: moved ", item.Name(), " of tenant '", item.tenant, "' to node '",
                       candidate.member.name, "' as snapshot ", moved->snapshot().id(), " (",
                       moved->transfer().bytes(), " bytes over ", moved->transfer().transport(),
                       ")"));
      outcome.moved = true;
      return outcome;
    }
    if (moved.status().code() == absl::StatusCode::kNotFound) {
      bool here = false;
      for (const SnapshotInfo& s : item.cache->ListSnapshots()) here |= s.id == item.snapshot_id;
      if (!here) {
        outcome.gone = true;
        return outcome;
      }
    }
    outcome.retryable |= IsRetryable(moved.status().code());
    reasons.push_back(StatusText(moved.status()));
    if (moved.status().code() == absl::StatusCode::kAborted) break;
  }
  outcome.reason = reasons.empty() ? "no peer can take it" : absl::StrJoin(reasons, "; ");
  return outcome;
}

absl::StatusOr<v1::DrainResponse> Drainer::Drain(absl::Time deadline, Mode mode) {
  uint64_t epoch = 0;
  {
    MutexLock lock(&mu_);
    if (mode == Mode::kRequest && (running_ || terminating_)) {
      return absl::AbortedError(absl::StrCat(
          "node '", options_.self_name, "' is draining already (",
          terminating_ ? "it shuts down" : "another Drain call", "); its log says what moved"));
    }
    if (mode == Mode::kShutdown) {
      // A drain in progress gives way by our deadline, and nothing resumes the node now.
      terminating_ = true;
      cap_ = std::min(cap_, deadline);
      wake_.notify_all();
      while (running_) wake_.wait(mu_);
    }
    running_ = true;
    // Under mu_, so that a Resume comes either before (and this drain sees its epoch) or after
    // (and stops it): never between reading the epoch and closing the gate.
    epoch = resumes_;
    gate_->Close();
  }
  v1::DrainResponse response = Run(deadline, epoch);
  if (options_.metrics != nullptr) {
    options_.metrics->Drain(response.stayed().empty() ? "complete" : "partial",
                            response.sequences_size(), response.snapshots_size());
  }
  {
    MutexLock lock(&mu_);
    running_ = false;
  }
  wake_.notify_all();
  return response;
}

v1::DrainResponse Drainer::Run(absl::Time deadline, uint64_t epoch) {
  const absl::Time start = absl::Now();
  v1::DrainResponse response;
  Log(absl::StrCat("node '", options_.self_name, "' drains: no new caches or sequences; moving ",
                   "its sequences and snapshots to peers until ",
                   absl::FormatTime("%H:%M:%E3S", Until(deadline), absl::UTCTimeZone()), " UTC"));
  if (!gate_->AwaitAdmitted(Until(deadline)) && !Resumed(epoch)) {
    Log("drain: operations that create sequences or pull data into them were still running "
        "at the deadline");
  }
  std::map<std::string, std::string> reasons;  // item key -> why it is still here
  std::map<std::string, Unclear> unclear;      // item key -> an attempt of unclear outcome
  while (absl::Now() < Until(deadline) && !Resumed(epoch)) {
    const std::vector<Item> items = Inventory();
    if (items.empty()) break;
    bool progress = false;
    bool retryable = false;
    // Items come grouped by cache: probe the peers once per cache and pass.
    for (size_t i = 0; i < items.size() && absl::Now() < Until(deadline) && !Resumed(epoch);) {
      size_t end = i;
      while (end < items.size() && items[end].cache == items[i].cache) ++end;
      std::set<int64_t> local_seqs;
      for (size_t k = i; k < end; ++k) {
        if (items[k].sequence) local_seqs.insert(items[k].seq);
      }
      std::string refusals;
      const bool early = absl::Now() < start + kUnreachablePeerWait;
      std::vector<Candidate> candidates =
          Probe(items[i].tenant, *items[i].cache, Until(deadline), early, &refusals, &retryable);
      for (size_t k = i; k < end && absl::Now() < Until(deadline) && !Resumed(epoch); ++k) {
        const Item& item = items[k];
        Outcome outcome;
        if (candidates.empty()) {
          outcome.reason = absl::StrCat("no peer can take it: ", refusals);
        } else {
          outcome = item.sequence ? MoveSequence(item, local_seqs, candidates, Until(deadline),
                                                 &unclear, &response)
                                  : MoveSnapshot(item, candidates, Until(deadline), &response);
        }
        if (outcome.moved || outcome.gone) {
          progress = true;
          reasons.erase(item.Key());
          continue;
        }
        retryable |= outcome.retryable;
        reasons[item.Key()] = outcome.reason;
      }
      i = end;
    }
    if (progress) continue;
    if (!retryable) break;
    MutexLock lock(&mu_);
    if (resumes_ != epoch) break;
    wake_.wait_until(mu_, absl::ToChronoTime(std::min(std::min(deadline, cap_),
                                                      absl::Now() + options_.retry_interval)));
  }
  for (const Item& item : Inventory()) {
    v1::DrainStayed* stayed = response.add_stayed();
    stayed->set_tenant(item.tenant);
    stayed->set_cache(item.cache->spec().name);
    if (item.sequence) {
      stayed->set_seq(item.seq);
    } else {
      stayed->set_snapshot_id(item.snapshot_id);
    }
    auto reason = reasons.find(item.Key());
    if (reason != reasons.end()) {
      stayed->set_reason(reason->second);
    } else if (Resumed(epoch)) {
      stayed->set_reason("not moved: the node was resumed");
    } else {
      stayed->set_reason("not moved: the drain's deadline passed first");
    }
    Log(absl::StrCat("drain: ", item.Name(), " of tenant '", item.tenant,
                     "' stays here: ", stayed->reason()));
  }
  response.set_draining(gate_->draining());
  response.set_micros(absl::ToInt64Microseconds(absl::Now() - start));
  Log(absl::StrCat("node '", options_.self_name, "' drained in ",
                   absl::FormatDuration(absl::Now() - start), ": ", response.sequences_size(),
                   " sequences and ", response.snapshots_size(), " snapshots moved, ",
                   response.stayed_size(), " items stayed"));
  return response;
}

}  // namespace kvmesh
