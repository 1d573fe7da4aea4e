#include "cache/event_log.h"

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvmesh {

namespace {

std::string NewBootId() {
  absl::BitGen gen;
  return absl::StrCat(absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16),
                      absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16));
}

}  // namespace

const char* EventKindName(EventKind kind) {
  switch (kind) {
    case EventKind::kBlocks:
      return "BLOCKS";
    case EventKind::kRemoved:
      return "REMOVED";
    case EventKind::kSnapshotCreated:
      return "SNAPSHOT_CREATED";
    case EventKind::kSnapshotDropped:
      return "SNAPSHOT_DROPPED";
    case EventKind::kMigratedIn:
      return "MIGRATED_IN";
    case EventKind::kMigratedOut:
      return "MIGRATED_OUT";
    case EventKind::kCacheCreated:
      return "CACHE_CREATED";
    case EventKind::kCacheDeleted:
      return "CACHE_DELETED";
    case EventKind::kDraining:
      return "DRAINING";
    case EventKind::kEvicted:
      return "EVICTED";
  }
  return "UNKNOWN";
}

size_t Event::bytes() const {
  return sizeof(Event) + tenant.capacity() + cache.capacity() + peer.capacity() +
         reason.capacity() + block_hashes.capacity() * sizeof(uint64_t);
}

EventLog::EventLog(Options options)
    : options_(options), boot_id_(options.boot_id.empty() ? NewBootId() : options.boot_id) {}

uint64_t EventLog::Publish(Event event) {
  uint64_t number = 0;
  {
    MutexLock lock(&mu_);
    number = next_++;
    event.number = number;
    event.time = absl::Now();
    bytes_ += event.bytes();
    events_.push_back(std::move(event));
    while (!events_.empty() &&
           (bytes_ > options_.max_bytes || events_.size() > options_.max_events)) {
      bytes_ -= events_.front().bytes();
      events_.pop_front();
      ++dropped_;
    }
  }
  published_.notify_all();
  return number;
}

absl::StatusOr<std::vector<Event>> EventLog::Read(uint64_t from, size_t max_events,
                                                  size_t max_bytes) const {
  ReaderMutexLock lock(&mu_);
  const uint64_t first = events_.empty() ? next_ : events_.front().number;
  if (from < first) {
    return absl::OutOfRangeError(absl::StrCat(
        "events ", from, " to ", first - 1, " are no longer kept (the log keeps the latest ",
        options_.max_events, " events within ", options_.max_bytes, " bytes)"));
  }
  std::vector<Event> out;
  size_t bytes = 0;
  for (size_t i = static_cast<size_t>(from - first); i < events_.size(); ++i) {
    if (out.size() >= max_events) break;
    const size_t b = events_[i].bytes();
    if (!out.empty() && bytes + b > max_bytes) break;
    bytes += b;
    out.push_back(events_[i]);
  }
  return out;
}

uint64_t EventLog::next_number() const {
  ReaderMutexLock lock(&mu_);
  return next_;
}

uint64_t EventLog::first_number() const {
  ReaderMutexLock lock(&mu_);
  return events_.empty() ? next_ : events_.front().number;
}

uint64_t EventLog::dropped() const {
  ReaderMutexLock lock(&mu_);
  return dropped_;
}

// The wait releases mu_ while it sleeps, which the analysis cannot follow.
uint64_t EventLog::Wait(uint64_t after, absl::Time deadline) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
  MutexLock lock(&mu_);
  const uint64_t wakes = wakes_;
  while (next_ <= after + 1 && wakes_ == wakes) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    published_.wait_for(mu_, absl::ToChronoNanoseconds(std::min(left, absl::Seconds(1))));
  }
  return next_;
}

void EventLog::Wake() {
  MutexLock lock(&mu_);
  ++wakes_;
  published_.notify_all();
}

EventLog::~EventLog() { MutexLock lock(&mu_); }

}  // namespace kvmesh
