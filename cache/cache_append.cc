// The Cache's Appends: checks, the row scatter, AppendWriter (payloads that arrive in pieces)
// and speculation's commit (cache/cache.h, "Where things live").
#include "cache/cache.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cache/attention_group.h"
#include "cache/cache_internal.h"
#include "cache/layer_group.h"
#include "cache/recurrent_group.h"
#include "cache/rotating_group.h"
#include "cache/shortage.h"
#include "cache/snapshot_wire.h"
#include "cache/status_macros.h"

namespace kvmesh {

using cache_internal::CheckNonNegative;

// ---- Append -------------------------------------------------------------------------------

absl::Status Cache::CheckAppendBatch(absl::Span<const Token> tokens, size_t payload_bytes,
                                     bool speculative, AppendBatch* batch,
                                     absl::flat_hash_map<int64_t, int32_t>* count) const {
  if (tokens.empty()) return absl::InvalidArgumentError("tokens is empty");
  if (tokens.size() > static_cast<size_t>(spec_.max_batch)) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch of ", tokens.size(), " tokens exceeds max_batch = ", spec_.max_batch));
  }
  batch->tokens = tokens;
  batch->speculative = speculative;
  // Per sequence: the last position seen in the batch (to check ordering) and the lowest.
  absl::flat_hash_map<int64_t, int32_t> last_in_batch;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const Token& t = tokens[i];
    if (t.seq < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "].seq = ", t.seq, " is negative"));
    }
    if (t.id < 0 && t.id != kNoTokenId) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "].token_id = ", t.id, " is negative"));
    }
    if (t.pos < 0 || t.pos == INT32_MAX) {
      // INT32_MAX is excluded so that a sequence's offset (last + 1) stays an int32.
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "].pos = ", t.pos, " is outside [0, ", INT32_MAX, ")"));
    }
    auto [it, inserted] = last_in_batch.emplace(t.seq, t.pos);
    ++(*count)[t.seq];
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
      batch->lowest.emplace(t.seq, t.pos);
      batch->seqs.push_back(t.seq);
    }
  }
  const size_t expected = AppendPayloadBytes(spec_, static_cast<int64_t>(tokens.size()),
                                             static_cast<int64_t>(batch->seqs.size()), speculative);
  if (payload_bytes != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload is ", payload_bytes, " bytes; ", tokens.size(), " tokens of ", batch->seqs.size(),
        " sequences", speculative ? " (speculative)" : "", " need ", expected));
  }
  return absl::OkStatus();
}

namespace {

// Writes an Append's payload, arriving in pieces, into the cells reserved for it: in the Append
// layout, group after group, each group's planes one after the other, each plane one row per
// token. A row split between two pieces waits in `staging` until it is whole.
class RowScatter {
 public:
  RowScatter(const std::vector<std::unique_ptr<LayerGroup::Reservation>>* reservations,
             std::vector<std::vector<size_t>> row_bytes, size_t rows)
      : reservations_(reservations), row_bytes_(std::move(row_bytes)), rows_(rows) {
    size_t largest_row = 0;
    for (const auto& planes : row_bytes_) {
      for (size_t bytes : planes) largest_row = std::max(largest_row, bytes);
    }
    staging_.reserve(largest_row);
  }

  // The next bytes of the payload; no more than are left.
  absl::Status Write(absl::Span<const uint8_t> bytes) {
    while (!bytes.empty()) {
      const size_t row_bytes = row_bytes_[group_][plane_];
      if (!staging_.empty() || bytes.size() < row_bytes) {
        const size_t n = std::min(bytes.size(), row_bytes - staging_.size());
        staging_.insert(staging_.end(), bytes.begin(), bytes.begin() + n);
        bytes.remove_prefix(n);
        if (staging_.size() < row_bytes) break;
        absl::Status status = WriteRows(staging_.data(), 1);
        staging_.clear();
        RETURN_IF_ERROR(status);
        continue;
      }
      const size_t rows = std::min(bytes.size() / row_bytes, rows_ - row_);
      RETURN_IF_ERROR(WriteRows(bytes.data(), rows));
      bytes.remove_prefix(rows * row_bytes);
    }
    return absl::OkStatus();
  }

  size_t staging_capacity() const { return staging_.capacity(); }
  void FreeStaging() { std::vector<uint8_t>().swap(staging_); }

 private:
  // Whole rows at the cursor, which then moves past them.
  absl::Status WriteRows(const uint8_t* src, size_t rows) {
    RETURN_IF_ERROR((*reservations_)[group_]->WriteRows(plane_, row_, rows, src));
    row_ += rows;
    if (row_ == rows_) {
      row_ = 0;
      if (++plane_ == row_bytes_[group_].size()) {
        plane_ = 0;
        ++group_;
      }
    }
    return absl::OkStatus();
  }

  const std::vector<std::unique_ptr<LayerGroup::Reservation>>* const reservations_;
  const std::vector<std::vector<size_t>> row_bytes_;  // per group, per plane
  const size_t rows_;                                 // the batch's tokens
  size_t group_ = 0;
  size_t plane_ = 0;
  size_t row_ = 0;
  std::vector<uint8_t> staging_;
};

// Each group's planes' row bytes, as RowScatter takes them.
std::vector<std::vector<size_t>> RowBytes(const std::vector<std::unique_ptr<LayerGroup>>& groups) {
  std::vector<std::vector<size_t>> rows;
  for (const auto& group : groups) rows.push_back(group->SnapshotChunkFormat().row_bytes);
  return rows;
}

// Commits every reservation (a failed one does not stop the others); the first error.
absl::Status CommitReservations(
    const AppendBatch& batch,
    const std::vector<std::unique_ptr<LayerGroup::Reservation>>& reservations) {
  absl::Status status;
  for (const auto& reservation : reservations) {
    const absl::Status committed = reservation->Commit(batch);
    if (status.ok()) status = committed;
  }
  return status;
}

}  // namespace

absl::Status Cache::Append(absl::Span<const Token> tokens, absl::Span<const uint8_t> payload,
                           bool speculative) {
  const absl::Span<const uint8_t> pieces[] = {payload};
  return AppendPieces(tokens, pieces, speculative);
}

absl::Status Cache::AppendPieces(absl::Span<const Token> tokens,
                                 absl::Span<const absl::Span<const uint8_t>> pieces,
                                 bool speculative) {
  size_t payload_bytes = 0;
  for (const absl::Span<const uint8_t> piece : pieces) payload_bytes += piece.size();
  AppendBatch batch;
  absl::flat_hash_map<int64_t, int32_t> count;
  RETURN_IF_ERROR(CheckAppendBatch(tokens, payload_bytes, speculative, &batch, &count));
  // The payload in one piece: as it came, or gathered.
  std::string gathered;
  absl::Span<const uint8_t> whole = pieces.size() == 1 ? pieces[0] : absl::Span<const uint8_t>();
  auto gather = [&] {
    gathered.reserve(payload_bytes);
    for (const absl::Span<const uint8_t> piece : pieces) {
      gathered.append(reinterpret_cast<const char*>(piece.data()), piece.size());
    }
    whole = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(gathered.data()), payload_bytes);
  };
  // A cache that writes under its lock gathers the pieces before it takes the lock; cells on a
  // device, once they are reserved (below).
  const bool gathers = GathersPieces(pieces.size());
  if (gathers && !reserved_append_) gather();
  std::vector<size_t> section_bytes(spec_.groups.size());
  std::vector<std::unique_ptr<LayerGroup::Reservation>> reservations;
  std::vector<std::vector<size_t>> row_bytes;  // where the pieces go into the cells as they lie
  {
    MutexLock lock(&mu_);
    AwaitNotAppendingLocked(batch.seqs);
    const HeldBack held = HoldBackLocked(batch.seqs);
    ASSIGN_OR_RETURN(const Admission admission,
                     AdmitAppendLocked(batch, count, /*may_evict=*/true));
    for (size_t g = 0; g < groups_.size(); ++g) section_bytes[g] = groups_[g]->SectionBytes(batch);
    // After an eviction the bytes are written under the lock as well, so that no operation
    // sees the victims gone without the Append (and a failed write cannot leave them gone for
    // nothing, short of a device error).
    if (!reserved_append_ || admission == Admission::kEvictedAndPrepared) {
      if (pieces.size() != 1 && gathered.size() != payload_bytes) gather();
      return WriteAndCommitAppendLocked(batch, Sections(whole, section_bytes));
    }
    // Take the cells now and move the bytes with the lock released, so that operations on other
    // sequences do not wait behind the copy; those on the batch's sequences do (appending_).
    for (const auto& group : groups_) reservations.push_back(group->ReserveAppend(batch));
    appending_.insert(batch.seqs.begin(), batch.seqs.end());
    if (pieces.size() > 1 && !gathers) row_bytes = RowBytes(groups_);
  }

  absl::Status written;
  if (!row_bytes.empty()) {
    // Each piece from where it lies into the cells.
    RowScatter scatter(&reservations, std::move(row_bytes), batch.tokens.size());
    for (size_t i = 0; i < pieces.size() && written.ok(); ++i) written = scatter.Write(pieces[i]);
  } else {
    // Into device memory, each write is a copy that waits for the device: one per group, from
    // the payload gathered (with the lock released) when it came in pieces.
    if (gathers) gather();
    const std::vector<const uint8_t*> sections = Sections(whole, section_bytes);
    for (size_t g = 0; g < reservations.size() && written.ok(); ++g) {
      written = reservations[g]->Write(sections[g]);
    }
  }
  MutexLock lock(&mu_);
  for (int64_t seq : batch.seqs) appending_.erase(seq);
  appended_.notify_all();  // the waiters run once this commit has released mu_
  if (written.ok()) written = CheckUsableLocked();
  if (!written.ok()) {
    for (const auto& reservation : reservations) reservation->Abandon();
    return written;
  }
  // Other sequences' speculation may have begun or ended meanwhile; this batch's cannot.
  RefreshPendingFirstLocked(batch);
  return FinishReservedAppendLocked(batch, CommitReservations(batch, reservations));
}

absl::Status Cache::FinishReservedAppendLocked(const AppendBatch& batch, absl::Status status) {
  if (batch.speculative) {
    for (const Token& t : batch.tokens) pending_[t.seq].push_back(t.pos);
  }
  RecordTokensLocked(batch);
  return FailLocked(status);
}

std::vector<const uint8_t*> Cache::Sections(absl::Span<const uint8_t> payload,
                                            absl::Span<const size_t> section_bytes) {
  std::vector<const uint8_t*> sections(section_bytes.size());
  const uint8_t* section = payload.data();
  for (size_t g = 0; g < section_bytes.size(); ++g) {
    sections[g] = section;
    section += section_bytes[g];
  }
  return sections;
}

void Cache::RefreshPendingFirstLocked(AppendBatch& batch) const {
  batch.pending_first.clear();
  for (const auto& [seq, positions] : pending_) batch.pending_first.emplace(seq, positions[0]);
}

absl::Status Cache::PrepareAppendLocked(AppendBatch& batch) {
  RefreshPendingFirstLocked(batch);
  for (size_t g = 0; g < groups_.size(); ++g) {
    const absl::Status prepared = groups_[g]->PrepareAppend(batch);
    if (!prepared.ok()) {
      for (size_t h = 0; h <= g; ++h) groups_[h]->AbandonAppend();
      return prepared;
    }
  }
  return absl::OkStatus();
}

// ---- AppendWriter -------------------------------------------------------------------------

struct AppendWriter::State {
  std::shared_ptr<Cache> cache;
  std::vector<Token> tokens;  // batch.tokens views them
  AppendBatch batch;
  absl::flat_hash_map<int64_t, int32_t> count;
  size_t size = 0;
  size_t written = 0;
  absl::Status error;  // final
  bool used = false;   // committed, or failed
  // In cells: one reservation per group, and what writes into them.
  std::vector<std::unique_ptr<LayerGroup::Reservation>> reservations;
  std::unique_ptr<RowScatter> scatter;  // where Write() may stream into them
  bool in_cells = false;
  // Otherwise: the payload, allocated by the first Write.
  std::string buffer;
  bool host_memory = true;  // every reservation's cells are in host memory

  // Gives the cells back however the writer goes (a reservation never outlives its state).
  ~State() {
    if (!reservations.empty()) cache->AbandonReservedAppend(*this);
  }
};

absl::StatusOr<std::unique_ptr<AppendWriter>> Cache::BeginAppend(
    const std::shared_ptr<Cache>& cache, absl::Span<const Token> tokens, size_t payload_bytes,
    bool speculative, bool in_place) {
  auto state = std::make_unique<AppendWriter::State>();
  state->cache = cache;
  state->tokens.assign(tokens.begin(), tokens.end());
  state->size = payload_bytes;
  RETURN_IF_ERROR(cache->CheckAppendBatch(state->tokens, payload_bytes, speculative, &state->batch,
                                          &state->count));
  AppendBatch& batch = state->batch;
  batch.in_place = in_place;
  if (in_place && !cache->in_place_append_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cache '", cache->spec_.name, "' has a group whose rows cannot be written in place"));
  }
  {
    MutexLock lock(&cache->mu_);
    cache->AwaitNotAppendingLocked(batch.seqs);
    const HeldBack held = cache->HoldBackLocked(batch.seqs);
    // A writer that would need an eviction evicts nothing now: it buffers the payload, and its
    // Commit's Append evicts, atomically with appending (the writer may never commit).
    ASSIGN_OR_RETURN(const Admission admission,
                     cache->AdmitAppendLocked(batch, state->count, /*may_evict=*/false));
    if (admission == Admission::kWouldEvict) {
      if (in_place) {
        return absl::FailedPreconditionError(
            absl::StrCat("cache '", cache->spec_.name,
                         "' has room for the batch only by evicting other sequences, which a "
                         "plan does not do: Append it through gRPC"));
      }
      return std::unique_ptr<AppendWriter>(new AppendWriter(std::move(state)));
    }
    bool in_cells = in_place || cache->reserved_append_;
    for (const auto& group : cache->groups_) {
      if (!in_place) {
        in_cells = in_cells && group->CanReserveWithoutPruning(batch);
      } else if (absl::Status status = group->CheckReserve(batch); !status.ok()) {
        for (const auto& g : cache->groups_) g->AbandonAppend();
        return status;
      }
    }
    if (in_cells) {
      for (const auto& group : cache->groups_) {
        state->reservations.push_back(group->ReserveAppend(batch));
        state->host_memory = state->host_memory && state->reservations.back()->InHostMemory();
      }
      state->in_cells = true;
      // Write() streams into the cells where each group's section has a row per token.
      if (cache->reserved_append_) {
        state->scatter = std::make_unique<RowScatter>(
            &state->reservations, RowBytes(cache->groups_), batch.tokens.size());
      }
    } else {
      for (const auto& group : cache->groups_) group->AbandonAppend();
    }
  }
  return std::unique_ptr<AppendWriter>(new AppendWriter(std::move(state)));
}

absl::Status Cache::CommitReservedAppend(AppendWriter::State& state) {
  AppendBatch& batch = state.batch;
  MutexLock lock(&mu_);
  AwaitNotAppendingLocked(batch.seqs);
  absl::Status status = CheckAppendLocked(batch, state.count);
  for (size_t g = 0; g < groups_.size() && status.ok(); ++g) {
    status = groups_[g]->RecheckAppend(batch);
  }
  if (!status.ok()) {
    for (const auto& reservation : state.reservations) reservation->Abandon();
    state.reservations.clear();
    return status;
  }
  RefreshPendingFirstLocked(batch);
  const absl::Status committed = CommitReservations(batch, state.reservations);
  state.reservations.clear();
  return FinishReservedAppendLocked(batch, committed);
}

void Cache::AbandonReservedAppend(AppendWriter::State& state) {
  if (state.reservations.empty()) return;
  MutexLock lock(&mu_);
  for (const auto& reservation : state.reservations) reservation->Abandon();
  state.reservations.clear();
}

AppendWriter::AppendWriter(std::unique_ptr<State> state) : state_(std::move(state)) {}

AppendWriter::~AppendWriter() { Abandon(); }

size_t AppendWriter::size() const { return state_->size; }
size_t AppendWriter::written() const { return state_->written; }
bool AppendWriter::in_cells() const { return state_->in_cells; }
bool AppendWriter::in_host_memory() const { return state_->host_memory; }
size_t AppendWriter::host_bytes() const {
  if (!in_cells()) return state_->size;
  return state_->scatter != nullptr ? state_->scatter->staging_capacity() : 0;
}

void AppendWriter::Abandon() {
  state_->cache->AbandonReservedAppend(*state_);
  std::string().swap(state_->buffer);
  if (state_->scatter != nullptr) state_->scatter->FreeStaging();
}

absl::Status AppendWriter::Write(absl::Span<const uint8_t> bytes) {
  State& s = *state_;
  if (!s.error.ok()) return s.error;
  if (s.used) return absl::FailedPreconditionError("the Append was committed already");
  if (bytes.size() > s.size - s.written) {
    s.error = absl::InvalidArgumentError(absl::StrCat("payload data exceeds its ", s.size,
                                                      " bytes: a write of ", bytes.size(),
                                                      " bytes after ", s.written));
    s.used = true;
    Abandon();
    return s.error;
  }
  s.written += bytes.size();
  if (in_cells() && s.scatter == nullptr) {
    s.error = absl::FailedPreconditionError(
        "this Append's rows are written in place (a local plan), not through Write");
    s.used = true;
    Abandon();
    return s.error;
  }
  if (!in_cells()) {
    // Allocated whole once, so that it never reallocates (which would hold two copies).
    if (s.buffer.capacity() < s.size) s.buffer.reserve(s.size);
    s.buffer.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return absl::OkStatus();
  }
  const absl::Status status = s.scatter->Write(bytes);
  if (!status.ok()) {
    s.error = status;
    s.used = true;
    Abandon();
  }
  return status;
}

absl::StatusOr<std::vector<std::optional<SharedGroup>>> AppendWriter::StagingMemory() const {
  std::vector<std::optional<SharedGroup>> out(state_->reservations.size());
  Cache& cache = *state_->cache;
  MutexLock lock(&cache.mu_);
  for (size_t g = 0; g < out.size(); ++g) {
    const RowChunk* chunk = state_->reservations[g]->staging();
    if (chunk == nullptr) continue;
    SharedGroup shared;
    shared.kind = cache.groups_[g]->kind();
    ASSIGN_OR_RETURN(shared.memory, cache.groups_[g]->device()->Share(chunk->arena));
    shared.planes = chunk->planes;
    shared.cells = static_cast<int64_t>(state_->reservations[g]->cells().size());
    out[g] = std::move(shared);
  }
  return out;
}

std::vector<std::vector<int32_t>> AppendWriter::Cells() const {
  std::vector<std::vector<int32_t>> cells;
  if (!in_cells()) return cells;
  for (const auto& reservation : state_->reservations) {
    const absl::Span<const int32_t> group = reservation->cells();
    cells.emplace_back(group.begin(), group.end());
  }
  return cells;
}

absl::Status AppendWriter::CommitInPlace() {
  State& s = *state_;
  if (!s.error.ok()) return s.error;
  if (s.used) return absl::FailedPreconditionError("the Append was committed already");
  if (!in_cells()) {
    return absl::FailedPreconditionError(
        "the Append's rows do not go straight into cells: commit it with its payload");
  }
  if (s.written != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(s.written, " payload bytes were written through Write already"));
  }
  s.written = s.size;
  s.used = true;
  if (s.scatter != nullptr) s.scatter->FreeStaging();
  return s.cache->CommitReservedAppend(s);
}

absl::Status AppendWriter::Commit() {
  State& s = *state_;
  if (!s.error.ok()) return s.error;
  if (s.used) return absl::FailedPreconditionError("the Append was committed already");
  if (s.written != s.size) {
    return absl::FailedPreconditionError(
        absl::StrCat("payload data adds up to ", s.written, " bytes of ", s.size));
  }
  s.used = true;
  if (!in_cells()) {
    const absl::Status status = s.cache->Append(
        s.tokens,
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.buffer.data()), s.buffer.size()),
        s.batch.speculative);
    std::string().swap(s.buffer);
    return status;
  }
  return s.cache->CommitReservedAppend(s);
}

absl::Status Cache::CheckAppendLocked(const AppendBatch& batch,
                                      const absl::flat_hash_map<int64_t, int32_t>& count) const {
  RETURN_IF_ERROR(CheckUsableLocked());
  const absl::Span<const Token> tokens = batch.tokens;
  for (int64_t seq : batch.seqs) {
    if (!batch.speculative) RETURN_IF_ERROR(CheckNotPendingLocked(seq, "a plain Append"));
    const int32_t offset = OffsetLocked(seq);
    const int32_t first = batch.lowest.at(seq);
    if (batch.speculative) {
      if (first < offset) {
        return absl::InvalidArgumentError(
            absl::StrCat("speculative position ", first, " of sequence ", seq,
                         " is not past everything it stores (offset ", offset, ")"));
      }
      auto pending = pending_.find(seq);
      const size_t held = pending == pending_.end() ? 0 : pending->second.size();
      if (held + count.at(seq) > static_cast<size_t>(spec_.max_batch)) {
        return ResourceExhaustedWith(
            absl::StrCat("sequence ", seq, " would hold ", held + count.at(seq),
                         " pending speculative tokens, more than max_batch = ", spec_.max_batch),
            {Resource::kPendingTokens, -1, count.at(seq),
             std::max<int64_t>(0, spec_.max_batch - static_cast<int64_t>(held)), spec_.max_batch});
      }
    }
  }
  if (contiguous_) {
    absl::flat_hash_map<int64_t, int32_t> expected;
    for (size_t i = 0; i < tokens.size(); ++i) {
      auto [it, inserted] = expected.emplace(tokens[i].seq, 0);
      if (inserted) it->second = OffsetLocked(tokens[i].seq);
      if (tokens[i].pos != it->second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tokens[", i, "]: sequence ", tokens[i].seq, " has position ", tokens[i].pos, " where ",
            it->second, " is expected (its offset is ", OffsetLocked(tokens[i].seq),
            "); a cache with Rotating or Recurrent groups needs every Append to continue each "
            "sequence exactly at its offset, without gaps"));
      }
      ++it->second;
    }
  }
  int32_t new_sequences = 0;
  for (int64_t seq : batch.seqs) new_sequences += !IsLiveLocked(seq);
  const int32_t live = ClaimedCountLocked();
  if (live + new_sequences > spec_.max_sequences) {
    return ResourceExhaustedWith(
        absl::StrCat("the batch adds ", new_sequences, " new sequences to ", live, " live ones",
                     held_sequences_ > 0
                         ? absl::StrCat(" (", held_sequences_, " of them reserved, not yet live)")
                         : "",
                     ", more than max_sequences = ", spec_.max_sequences),
        {Resource::kSequences, -1, new_sequences, std::max(0, spec_.max_sequences - live),
         spec_.max_sequences});
  }
  return absl::OkStatus();
}

absl::Status Cache::WriteAndCommitAppendLocked(const AppendBatch& batch,
                                               absl::Span<const uint8_t* const> sections) {
  // Write every group before committing any: first those that write into fresh storage, then
  // those that overwrite in place, so that an error in the first kind leaves nothing changed.
  for (bool in_place : {false, true}) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (groups_[g]->WritesInPlace(batch) != in_place) continue;
      const absl::Status written = groups_[g]->WriteAppend(batch, sections[g]);
      if (!written.ok()) {
        for (const auto& group : groups_) group->AbandonAppend();
        return in_place ? FailLocked(written) : written;
      }
    }
  }
  for (const auto& group : groups_) group->CommitAppend(batch);
  if (batch.speculative) {
    for (const Token& t : batch.tokens) pending_[t.seq].push_back(t.pos);
  }
  RecordTokensLocked(batch);
  return absl::OkStatus();
}

absl::Status Cache::CommitSpeculation(int64_t seq, int32_t accepted) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("accepted", accepted));
  MutexLock lock(&mu_);
  AwaitNotAppendingLocked({seq});
  RETURN_IF_ERROR(CheckUsableLocked());
  auto it = pending_.find(seq);
  if (it == pending_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", seq, " has no pending speculative tokens to commit"));
  }
  const std::vector<int32_t>& pending = it->second;
  if (static_cast<size_t>(accepted) > pending.size()) {
    return absl::InvalidArgumentError(absl::StrCat("accepted = ", accepted, " is more than the ",
                                                   pending.size(), " pending tokens of sequence ",
                                                   seq));
  }
  auto check = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
    for (const auto& group : groups_) {
      RETURN_IF_ERROR(group->CheckCommitSpeculation(seq, accepted));
    }
    return absl::OkStatus();
  };
  // Under LRU a commit that needs a ring or a state slot makes room as an Append does.
  if (absl::Status room = check(); !room.ok()) {
    RETURN_IF_ERROR(MakeRoomLocked(std::move(room), {seq}, check));
  }
  absl::Status status;
  for (const auto& group : groups_) {
    const absl::Status s = group->CommitSpeculation(seq, pending, accepted);
    if (status.ok()) status = s;
  }
  if (TokenChain* chain = tokens_.FindMutable(seq); chain != nullptr) {
    chain->Settle(accepted > 0 ? pending[accepted - 1] + 1 : pending[0]);
  }
  pending_.erase(it);
  SyncTokensLocked(seq);
  TouchLocked({seq});
  ForgetIfDeadLocked(seq);
  return FailLocked(status);
}

}  // namespace kvmesh
