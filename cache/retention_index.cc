#include "cache/retention_index.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvmesh {

absl::Status RetentionIndex::Validate(const Retention& retention) {
  if (retention.ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ttl ", absl::FormatDuration(retention.ttl), " is negative"));
  }
  return absl::OkStatus();
}

void RetentionIndex::Set(int64_t seq, const Retention& retention) {
  if (retention.priority == 0 && !retention.pinned && retention.ttl == absl::ZeroDuration()) {
    retention_.erase(seq);
  } else {
    retention_[seq] = retention;
  }
}

Retention RetentionIndex::Get(int64_t seq) const {
  auto it = retention_.find(seq);
  return it == retention_.end() ? Retention() : it->second;
}

void RetentionIndex::Forget(int64_t seq) {
  retention_.erase(seq);
  MutexLock lock(&mu_);
  auto it = last_used_.find(seq);
  if (it == last_used_.end()) return;
  if (!it->second.pinned) order_.erase(Key(it->second.priority, it->second.time, seq));
  last_used_.erase(it);
}

std::optional<absl::Time> RetentionIndex::LastUse(int64_t seq) const {
  MutexLock lock(&mu_);
  auto it = last_used_.find(seq);
  if (it == last_used_.end()) return std::nullopt;
  return it->second.time;
}

std::vector<int64_t> RetentionIndex::Expired(absl::Time now) const {
  std::vector<int64_t> expired;
  MutexLock lock(&mu_);
  for (const auto& [seq, retention] : retention_) {
    if (retention.ttl <= absl::ZeroDuration()) continue;
    auto used = last_used_.find(seq);
    const absl::Time last = used == last_used_.end() ? absl::InfinitePast() : used->second.time;
    if (last + retention.ttl <= now) expired.push_back(seq);
  }
  std::sort(expired.begin(), expired.end());
  return expired;
}

void RetentionIndex::RecordUse(int64_t seq, absl::Time now) const {
  Use use{now, 0, false};
  if (auto retention = retention_.find(seq); retention != retention_.end()) {
    use.priority = retention->second.priority;
    use.pinned = retention->second.pinned;
  }
  auto [it, inserted] = last_used_.try_emplace(seq);
  if (!inserted && !it->second.pinned) {
    order_.erase(Key(it->second.priority, it->second.time, seq));
  }
  it->second = use;
  if (!use.pinned) order_.insert(Key(use.priority, use.time, seq));
}

RetentionIndex::Uses::Uses(const RetentionIndex* index, absl::Time now)
    : index_(index), now_(now), lock_(&index->mu_) {}

void RetentionIndex::Uses::Record(int64_t seq) { index_->RecordUse(seq, now_); }

RetentionIndex::Candidates::Candidates(const RetentionIndex* index)
    : index_(index), lock_(&index->mu_), next_(index->order_.begin()) {}

std::optional<int64_t> RetentionIndex::Candidates::Next() {
  if (next_ == index_->order_.end()) return std::nullopt;
  return std::get<2>(*next_++);
}

}  // namespace kvmesh
