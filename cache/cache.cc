#include "cache/cache.h"

#include <algorithm>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "cache/attention_group.h"
#include "cache/status_macros.h"

namespace kvmesh {

namespace {

absl::Status CheckNonNegative(const char* what, int64_t value) {
  if (value < 0)
    return absl::InvalidArgumentError(absl::StrCat(what, " = ", value, " is negative"));
  return absl::OkStatus();
}

}  // namespace

Cache::Cache(const CacheSpec& spec) : spec_(spec) {}

Cache::~Cache() = default;

absl::StatusOr<std::unique_ptr<Cache>> Cache::Create(const CacheSpec& spec, Device* device) {
  RETURN_IF_ERROR(ValidateSpec(spec));
  const size_t needed = CacheBytes(spec);
  if (needed > device->budget_bytes() - std::min(device->budget_bytes(), device->used_bytes())) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cache '", spec.name, "' needs ", needed, " bytes on device ", device->name(), " but only ",
        device->budget_bytes() - std::min(device->budget_bytes(), device->used_bytes()), " of ",
        device->budget_bytes(), " bytes are free in the memory budget"));
  }
  std::unique_ptr<Cache> cache(new Cache(spec));
  MutexLock lock(&cache->mu_);
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    switch (spec.groups[g].kind) {
      case GroupKind::kAttention: {
        const AttentionGeometry geo = ComputeAttentionGeometry(spec, static_cast<int>(g));
        ASSIGN_OR_RETURN(DeviceArena arena, device->Allocate(geo.bytes));
        cache->groups_.push_back(
            std::make_unique<AttentionGroup>(static_cast<int>(g), spec, std::move(arena), device));
        break;
      }
    }
  }
  return cache;
}

absl::Status Cache::ValidateSeq(int64_t seq) const { return CheckNonNegative("seq", seq); }

absl::Status Cache::CheckUsableLocked() const {
  if (device_failure_.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("cache '", spec_.name, "' is unusable after a device error (",
                   device_failure_.ToString(), "); delete and recreate it"));
}

bool Cache::IsLiveLocked(int64_t seq) const {
  for (const auto& group : groups_) {
    if (group->Find(seq) != nullptr) return true;
  }
  return false;
}

int32_t Cache::LiveCountLocked() const {
  if (groups_.size() == 1) return static_cast<int32_t>(groups_[0]->sequences().size());
  absl::flat_hash_set<int64_t> live;
  for (const auto& group : groups_) {
    for (const auto& [seq, index] : group->sequences()) live.insert(seq);
  }
  return static_cast<int32_t>(live.size());
}

absl::Status Cache::Append(absl::Span<const Token> tokens, absl::Span<const uint8_t> payload) {
  if (tokens.empty()) return absl::InvalidArgumentError("tokens is empty");
  if (tokens.size() > static_cast<size_t>(spec_.max_batch)) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch of ", tokens.size(), " tokens exceeds max_batch = ", spec_.max_batch));
  }
  // Per sequence: the last position seen in the batch (to check ordering) and the lowest.
  absl::flat_hash_map<int64_t, int32_t> last_in_batch;
  absl::flat_hash_map<int64_t, int32_t> lowest;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const Token& t = tokens[i];
    if (t.seq < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "].seq = ", t.seq, " is negative"));
    }
    if (t.pos < 0 || t.pos == INT32_MAX) {
      // INT32_MAX is excluded so that a sequence's offset (last + 1) stays an int32.
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "].pos = ", t.pos, " is outside [0, ", INT32_MAX, ")"));
    }
    auto [it, inserted] = last_in_batch.emplace(t.seq, t.pos);
    if (!inserted) {
      if (t.pos == it->second) {
        return absl::InvalidArgumentError(absl::StrCat("tokens[", i, "]: position ", t.pos,
                                                       " of sequence ", t.seq,
                                                       " appears twice in the batch"));
      }
      if (t.pos < it->second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tokens[", i, "]: position ", t.pos, " of sequence ", t.seq, " follows position ",
            it->second, "; positions of a sequence must increase"));
      }
      it->second = t.pos;
    } else {
      lowest.emplace(t.seq, t.pos);
    }
  }
  const size_t expected = AppendPayloadBytes(spec_, tokens.size(), lowest.size());
  if (payload.size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat("payload is ", payload.size(), " bytes; ",
                                                   tokens.size(), " tokens need ", expected));
  }

  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckUsableLocked());
  for (size_t i = 0; i < tokens.size(); ++i) {
    for (const auto& group : groups_) {
      const AttentionGroup::Index* index = group->Find(tokens[i].seq);
      if (index != nullptr && index->contains(tokens[i].pos)) {
        return absl::InvalidArgumentError(absl::StrCat("tokens[", i, "]: sequence ", tokens[i].seq,
                                                       " already stores position ", tokens[i].pos));
      }
    }
  }
  int32_t new_sequences = 0;
  for (const auto& [seq, pos] : lowest) new_sequences += !IsLiveLocked(seq);
  const int32_t live = LiveCountLocked();
  if (live + new_sequences > spec_.max_sequences) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the batch adds ", new_sequences, " new sequences to ", live,
                     " live ones, more than max_sequences = ", spec_.max_sequences));
  }
  std::vector<AttentionGroup::AppendPlan> plans;
  plans.reserve(groups_.size());
  for (const auto& group : groups_) {
    plans.push_back(group->PlanAppend(lowest));
    RETURN_IF_ERROR(group->CheckAppend(plans.back(), static_cast<int64_t>(tokens.size())));
  }
  // Write every group before committing any, so a device error leaves the cache as it was
  // (but for pruning a group had to apply early to find cells; see WriteAppend).
  std::vector<std::vector<int32_t>> cells(groups_.size());
  const uint8_t* section = payload.data();
  for (size_t g = 0; g < groups_.size(); ++g) {
    const absl::Status written = groups_[g]->WriteAppend(plans[g], tokens, section, &cells[g]);
    if (!written.ok()) {
      for (size_t h = 0; h <= g; ++h) groups_[h]->AbandonAppend(cells[h]);
      return written;
    }
    section += groups_[g]->PayloadBytes(tokens.size());
  }
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g]->CommitAppend(plans[g], tokens, cells[g]);
  return absl::OkStatus();
}

absl::StatusOr<ReadResult> Cache::Read(int64_t seq, int32_t begin,
                                       std::optional<int32_t> end) const {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("begin", begin));
  if (end.has_value() && *end < begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("begin = ", begin, " is greater than end = ", *end));
  }
  ReaderMutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckUsableLocked());
  if (!IsLiveLocked(seq)) {
    return absl::NotFoundError(absl::StrCat("cache '", spec_.name, "' has no sequence ", seq));
  }
  ReadResult result;
  result.positions.resize(groups_.size());
  std::vector<std::vector<int32_t>> cells(groups_.size());
  size_t total = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    groups_[g]->Collect(seq, begin, end.has_value() ? int64_t{*end} : int64_t{INT32_MAX} + 1,
                        &result.positions[g], &cells[g]);
    total += groups_[g]->PayloadBytes(cells[g].size());
  }
  result.payload.resize(total);
  uint8_t* dst = reinterpret_cast<uint8_t*>(result.payload.data());
  for (size_t g = 0; g < groups_.size(); ++g) {
    RETURN_IF_ERROR(groups_[g]->Gather(cells[g], dst));
    dst += groups_[g]->PayloadBytes(cells[g].size());
  }
  return result;
}

absl::StatusOr<std::vector<std::vector<int32_t>>> Cache::Visible(
    int group, absl::Span<const Query> queries) const {
  if (group < 0 || group >= static_cast<int>(spec_.groups.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("group = ", group, " is out of range [0, ", spec_.groups.size(), ")"));
  }
  for (size_t i = 0; i < queries.size(); ++i) {
    if (queries[i].seq < 0 || queries[i].pos < 0) {
      return absl::InvalidArgumentError(absl::StrCat("queries[", i, "] has seq = ", queries[i].seq,
                                                     ", pos = ", queries[i].pos,
                                                     "; both must be >= 0"));
    }
  }
  ReaderMutexLock lock(&mu_);
  std::vector<std::vector<int32_t>> out;
  out.reserve(queries.size());
  for (const Query& q : queries) out.push_back(groups_[group]->Visible(q));
  return out;
}

absl::Status Cache::CopyPrefix(int64_t src_seq, int64_t dst_seq, int32_t length) {
  RETURN_IF_ERROR(CheckNonNegative("src_seq", src_seq));
  RETURN_IF_ERROR(CheckNonNegative("dst_seq", dst_seq));
  RETURN_IF_ERROR(CheckNonNegative("length", length));
  if (src_seq == dst_seq) {
    return absl::InvalidArgumentError(absl::StrCat("src_seq and dst_seq are both ", src_seq,
                                                   "; a prefix copy needs two sequences"));
  }
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckUsableLocked());
  bool dst_live_after = false;
  for (const auto& group : groups_) dst_live_after |= group->HasPrefix(src_seq, length);
  if (dst_live_after && !IsLiveLocked(dst_seq)) {
    const int32_t live = LiveCountLocked();
    if (live + 1 > spec_.max_sequences) {
      return absl::ResourceExhaustedError(
          absl::StrCat("copying a prefix into new sequence ", dst_seq, " would make ", live + 1,
                       " live sequences, more than max_sequences = ", spec_.max_sequences));
    }
  }
  for (const auto& group : groups_) group->ApplyCopyPrefix(src_seq, dst_seq, length);
  return absl::OkStatus();
}

absl::Status Cache::Remove(int64_t seq, int32_t begin, std::optional<int32_t> end) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("begin", begin));
  if (end.has_value() && *end < begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("begin = ", begin, " is greater than end = ", *end));
  }
  if (end.has_value() && *end == begin) return absl::OkStatus();
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckUsableLocked());
  for (const auto& group : groups_) RETURN_IF_ERROR(group->CheckRemove(seq, begin, end));
  absl::Status status;
  for (const auto& group : groups_) {
    const absl::Status s = group->ApplyRemove(seq, begin, end);
    if (status.ok()) status = s;
  }
  if (!status.ok()) device_failure_ = status;
  return status;
}

absl::StatusOr<bool> Cache::CanResume(int64_t seq, int32_t pos) const {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("pos", pos));
  ReaderMutexLock lock(&mu_);
  for (const auto& group : groups_) {
    if (!group->CanResume(seq, pos)) return false;
  }
  return true;
}

std::vector<SequenceInfo> Cache::ListSequences() const {
  ReaderMutexLock lock(&mu_);
  absl::btree_set<int64_t> seqs;
  for (const auto& group : groups_) {
    for (const auto& [seq, index] : group->sequences()) seqs.insert(seq);
  }
  std::vector<SequenceInfo> out;
  out.reserve(seqs.size());
  for (int64_t seq : seqs) {
    SequenceInfo info;
    info.seq = seq;
    for (const auto& group : groups_) {
      GroupSequenceInfo g;
      if (const AttentionGroup::Index* index = group->Find(seq)) {
        g.stored = static_cast<int32_t>(index->size());
        g.shared = group->SharedCells(*index);
        g.first = index->begin()->first;
        g.last = index->rbegin()->first;
        info.offset = std::max(info.offset, g.last + 1);
      }
      info.groups.push_back(g);
    }
    out.push_back(std::move(info));
  }
  return out;
}

CacheUsage Cache::Usage() const {
  ReaderMutexLock lock(&mu_);
  CacheUsage usage;
  for (const auto& group : groups_) {
    GroupUsage g;
    g.cells_total = group->geometry().cells;
    g.cells_used = g.cells_total - group->free_cells();
    g.memory = group->geometry().memory;
    g.bytes = group->arena_bytes();
    usage.bytes_held += g.bytes;
    usage.groups.push_back(g);
  }
  usage.sequences_live = LiveCountLocked();
  return usage;
}

}  // namespace kvmesh
