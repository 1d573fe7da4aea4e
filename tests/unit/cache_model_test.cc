// Model-based randomized test of the cache engine.
//
// A small reference model of docs/api.md and docs/semantics.md, written here without
// engine code, runs the same random operations as a real Cache on the device under test
// (tests/testing/test_device.h: HostDevice, or CudaDevice with KVMESH_TEST_DEVICE=cuda):
//   - Attention groups: a pool of reference-counted cells (so free cells are predicted exactly)
//     and per sequence an ordered map position -> cell; a cell remembers which pattern row it
//     holds and how far RoPE has shifted its key.
//   - Rotating groups: per sequence the committed offset and the rows of the window
//     [max(0, offset - max_size), offset).
//   - Recurrent groups: per sequence a state (pattern id, offset, VALID/INVALID) and the
//     reference-counted slot it uses (shared copy-on-write after CopyPrefix).
//   - Pending speculative tokens per sequence (position, row id, state id after the token).
//   - Snapshots: per group the rows / ring index / state they copied, and the token ids they
//     keep.
//   - Token ids per sequence (docs/api.md#tokens): the ids of positions [0, n), how many of them
//     are settled (not pending speculative tokens), and the taint (the first position whose K/V
//     saw something other than the ids before it), kept by every operation as the documents
//     say, independently of cache/token_chain.cc.
// Appends carry ids from a small alphabet (so that sequences share prefixes), on every token,
// some or none, and arrive whole, in pieces or through an AppendWriter; snapshots also travel
// as wire images (imported back as snapshots, and sequence export, import and RestoreImport).
// After every step the test compares the status code of the operation and every observable:
// ListSequences (offset, pending, stored/shared/first/last/state per group, token counts),
// Usage (cells per group, sequences live, snapshots, bytes), ListSnapshots (with token counts),
// the bytes of every live sequence (byte-exact; RoPE-shifted keys within a tolerance of the
// float64 reference; recurrent states byte-exact), Visible in every group and CanResume, every
// sequence's token chain (ids, settled, taint, exact, and its block hashes recomputed from the
// model's ids with the cache's TokenHasher), the block index's counts and a LookupPrefix, for
// every sequence of the pool.
//
// Random specs are small: half Attention-only (1-3 groups mixing FULL, SLIDING and CHUNKED
// windows), half hybrid (contiguous) caches that add Rotating groups with a small max_size (so
// rings wrap often) and Recurrent groups with and without delta state; all dtypes and rope kinds.
// Pools fill up so that RESOURCE_EXHAUSTED happens.
//
// Where docs/semantics.md leaves a case open the model accepts either answer (noted at the
// place: Visible on a Recurrent group may be empty or INVALID_ARGUMENT; a Read whose range stops
// short of an INVALID state may report it INVALID or NONE; codes of requests wrong in several
// ways). Readings the model takes where the text allows more than one:
//   - In the Rotating section "offset" is the ring's (committed tokens): the window
//     [max(0, offset - max_size), offset) and "wrapped" use it; pending tokens live outside.
//   - "Remove from 0 drops the sequence from the [Recurrent] group" when nothing is left (the
//     new offset is 0); Remove(seq, 0, end) that leaves later positions keeps an INVALID state
//     at offset - end, as the Attention positions move.
//   - CanResume(seq, 0) of a sequence without a state is true in a Recurrent group.
//   - With pending tokens a Recurrent group reports the state after the last one as VALID.
//
// KVMESH_MODEL_ITERATIONS sets the number of episodes (random spec + operation sequence);
// KVMESH_MODEL_SEED the base seed; KVMESH_MODEL_BUDGET_S the wall-clock budget (seconds) after
// which no episode starts. A failure prints the seed, the episode's spec and its operations up
// to the failing step.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "cache/cache.h"
#include "cache/device/device.h"
#include "gtest/gtest.h"
#include "tests/testing/pattern.h"
#include "tests/testing/test_device.h"
#include "tests/unit/rope_reference.h"

namespace kvmesh {
namespace {

using testutil::DecodeElement;
using testutil::Mix64;

constexpr int kDefaultEpisodes = 3000;
constexpr int kStepsPerEpisode = 90;
// Wall-clock budget of one run (KVMESH_MODEL_BUDGET_S): no episode starts after it is spent,
// so that sanitizer builds stay within the ctest timeout. A normal build runs all the default
// episodes well within it. Under ASan (about 5x slower) the two runs, host and simulated GPU,
// get 25 s each: CI's 50 minutes (docs/development.md) are tight, and longer runs are a soak's job.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVMESH_MODEL_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(KVMESH_MODEL_ASAN)
constexpr int kDefaultBudgetSeconds = 25;
#else
constexpr int kDefaultBudgetSeconds = 40;
#endif
// Runs of at least this many episodes must reach every outcome the test is for.
constexpr int kCoverageEpisodes = 1000;

constexpr absl::StatusCode kOk = absl::StatusCode::kOk;
constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
constexpr absl::StatusCode kNotFound = absl::StatusCode::kNotFound;
constexpr absl::StatusCode kExhausted = absl::StatusCode::kResourceExhausted;
constexpr absl::StatusCode kPrecondition = absl::StatusCode::kFailedPrecondition;
constexpr absl::StatusCode kAborted = absl::StatusCode::kAborted;

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::atoi(v);
}

uint64_t EnvU64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoull(v, nullptr, 0);
}

// Deterministic on every platform (std distributions are not).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return Mix64(state_++); }
  // Uniform in [0, n), n > 0.
  int64_t Below(int64_t n) { return static_cast<int64_t>(Next() % static_cast<uint64_t>(n)); }
  // Uniform in [lo, hi].
  int64_t Between(int64_t lo, int64_t hi) { return lo + Below(hi - lo + 1); }
  bool Chance(int percent) { return Below(100) < percent; }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[Below(static_cast<int64_t>(v.size()))];
  }

 private:
  uint64_t state_;
};

const char* CodeName(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return "OK";
    case absl::StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case absl::StatusCode::kNotFound:
      return "NOT_FOUND";
    case absl::StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case absl::StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case absl::StatusCode::kAborted:
      return "ABORTED";
    default:
      return "OTHER";
  }
}

const char* StateName(StateStatus s) {
  switch (s) {
    case StateStatus::kNone:
      return "NONE";
    case StateStatus::kValid:
      return "VALID";
    case StateStatus::kInvalid:
      return "INVALID";
  }
  return "?";
}

// The codes an operation may return. Usually one; several where the contract orders nothing
// between them (a request that is wrong in two ways may be refused for either).
struct Codes {
  std::vector<absl::StatusCode> allowed;
  Codes(absl::StatusCode c) : allowed{c} {}                          // NOLINT: implicit on purpose
  Codes(std::vector<absl::StatusCode> c) : allowed(std::move(c)) {}  // NOLINT
  explicit Codes(const std::set<absl::StatusCode>& c) : allowed(c.begin(), c.end()) {}
  bool ok() const { return allowed.size() == 1 && allowed[0] == kOk; }
  bool Allows(absl::StatusCode c) const {
    return std::find(allowed.begin(), allowed.end(), c) != allowed.end();
  }
  std::string ToString() const {
    std::string s;
    for (size_t i = 0; i < allowed.size(); ++i) {
      s += (i ? " or " : "") + std::string(CodeName(allowed[i]));
    }
    return s;
  }
};

// ---- the reference model -------------------------------------------------------------------

// One stored row of K/V: which pattern row it holds and how far RoPE has shifted its key.
struct Cell {
  int refs = 0;
  uint64_t id = 0;    // pattern row id
  int64_t delta = 0;  // total RoPE shift of the key
  int shifts = 0;     // number of rounded shifts applied
};

struct PendingToken {
  int32_t pos = 0;
  uint64_t id = 0;        // row id of the token
  uint64_t state_id = 0;  // recurrent state after the token
};

// A Rotating group's data for one sequence: rows of [max(0, offset - max_size), offset).
struct Ring {
  int32_t offset = 0;
  std::map<int32_t, uint64_t> rows;  // position -> row id
};

// A Recurrent group's state for one sequence.
struct RecState {
  int64_t slot = -1;  // slot handle; -1 when the state is INVALID (its slot was released)
  uint64_t state_id = 0;
  int32_t offset = 0;
  bool valid = false;
};

struct ModelGroup {
  GroupKind kind = GroupKind::kAttention;
  int32_t num_layers = 0;
  int64_t total = 0;  // cells / ring rows / slots

  // Attention.
  WindowSpec window;
  RopeSpec rope;
  int64_t memory = kUnlimitedMemory;
  int64_t next_handle = 0;
  std::map<int64_t, Cell> cells;                       // live cells by handle
  std::map<int64_t, std::map<int32_t, int64_t>> seqs;  // seq -> pos -> handle

  // Rotating.
  int32_t max_size = 0;
  std::map<int64_t, Ring> rings;

  // Recurrent.
  int64_t next_slot = 0;
  std::map<int64_t, int> slots;  // slot handle -> references
  std::map<int64_t, RecState> states;

  bool limited() const { return memory != kUnlimitedMemory; }
  int64_t used() const {
    switch (kind) {
      case GroupKind::kAttention:
        return static_cast<int64_t>(cells.size());
      case GroupKind::kRotating: {
        int64_t n = 0;
        for (const auto& entry : rings) n += static_cast<int64_t>(entry.second.rows.size());
        return n;
      }
      case GroupKind::kRecurrent:
        return static_cast<int64_t>(slots.size());
    }
    return 0;
  }
  void Release(int64_t h) {
    if (--cells.at(h).refs == 0) cells.erase(h);
  }
  int64_t NewCell(Cell c) {
    c.refs = 1;
    cells[next_handle] = c;
    return next_handle++;
  }
  const std::map<int32_t, int64_t>* Find(int64_t seq) const {
    auto it = seqs.find(seq);
    return it == seqs.end() ? nullptr : &it->second;
  }
  const Ring* FindRing(int64_t seq) const {
    auto it = rings.find(seq);
    return it == rings.end() ? nullptr : &it->second;
  }
  const RecState* FindState(int64_t seq) const {
    auto it = states.find(seq);
    return it == states.end() ? nullptr : &it->second;
  }
  void ReleaseSlot(int64_t s) {
    if (s >= 0 && --slots.at(s) == 0) slots.erase(s);
  }
  // Gives `seq` a VALID state in a slot of its own (a shared slot is never written).
  void SetState(int64_t seq, uint64_t state_id, int32_t offset) {
    RecState& st = states[seq];
    if (st.slot < 0 || slots.at(st.slot) > 1) {
      ReleaseSlot(st.slot);
      st.slot = next_slot++;
      slots[st.slot] = 1;
    }
    st.state_id = state_id;
    st.offset = offset;
    st.valid = true;
  }
  // Keeps only the window of the ring's offset.
  void Trim(Ring& r) const {
    const int32_t lo = std::max(0, r.offset - max_size);
    for (auto it = r.rows.begin(); it != r.rows.end();) {
      it = (it->first < lo || it->first >= r.offset) ? r.rows.erase(it) : std::next(it);
    }
  }
  // Drops everything `seq` holds in this group.
  void Drop(int64_t seq) {
    auto it = seqs.find(seq);
    if (it != seqs.end()) {
      for (const auto& [pos, h] : it->second) Release(h);
      seqs.erase(it);
    }
    rings.erase(seq);
    auto st = states.find(seq);
    if (st != states.end()) {
      ReleaseSlot(st->second.slot);
      states.erase(st);
    }
  }
};

// The ids a snapshot keeps of its sequence: those of positions [0, ids.size()), none pending,
// and the taint then (kNoTaint: none).
struct SnapTokens {
  std::vector<int32_t> ids;
  int32_t taint = kNoTaint;
  // The ids of positions below `length`, and the taint if below it.
  SnapTokens Prefix(int32_t length) const {
    SnapTokens out;
    out.ids.assign(ids.begin(), ids.begin() + std::min<int32_t>(Size(), std::max(length, 0)));
    if (taint < length) out.taint = taint;
    return out;
  }
  int32_t Size() const { return static_cast<int32_t>(ids.size()); }
};

// A sequence's token ids as docs/api.md#tokens describes them: known for positions
// [0, ids.size()); the first `settled` of them are not pending speculative tokens; from `taint`
// on (kNoTaint: nowhere) the K/V saw something other than the ids before it. A sequence whose
// ids and taint are both empty has no chain.
struct TokenRef {
  std::vector<int32_t> ids;
  int32_t settled = 0;
  int32_t taint = kNoTaint;

  bool empty() const { return ids.empty() && taint == kNoTaint; }
  int32_t Size() const { return static_cast<int32_t>(ids.size()); }
  int32_t exact() const { return std::min(settled, taint); }
  // Positions from `end` on are gone: their ids, and the taint if it lies there.
  void Truncate(int32_t end) {
    if (end < Size()) ids.resize(std::max(end, 0));
    settled = std::min(settled, Size());
    if (taint >= end) taint = kNoTaint;
  }
  // The settled ids of positions below `length`, and the taint if below it (what a snapshot
  // or a copy of the prefix keeps).
  SnapTokens Prefix(int32_t length) const {
    SnapTokens out;
    out.ids.assign(ids.begin(), ids.begin() + std::min(settled, std::max(length, 0)));
    if (taint < length) out.taint = taint;
    return out;
  }
  static TokenRef Settled(const SnapTokens& s) {
    TokenRef ref;
    ref.ids = s.ids;
    ref.settled = ref.Size();
    ref.taint = s.taint;
    return ref;
  }
};

// A snapshot's data in one group.
struct SnapGroup {
  std::map<int32_t, Cell> rows;  // Attention: rows with their RoPE state; Rotating: row ids
  int32_t ring_index = -1;       // Rotating
  bool has_state = false;        // Recurrent
  uint64_t state_id = 0;
};

struct ModelSnapshot {
  int64_t seq = 0;
  int32_t from = 0;
  int32_t to = 0;
  std::vector<SnapGroup> groups;
  SnapTokens tokens;
};

class Model {
 public:
  explicit Model(const CacheSpec& spec) : spec_(spec) {
    for (const GroupSpec& g : spec.groups) {
      ModelGroup m;
      m.kind = g.kind;
      m.num_layers = g.num_layers;
      switch (g.kind) {
        case GroupKind::kAttention: {
          m.window = g.attention.window;
          m.rope = g.attention.rope;
          if (m.window.kind == WindowKind::kSliding) {
            int64_t memory = m.window.memory == 0 ? m.window.window : m.window.memory;
            if (spec.max_sequences > 1) memory = std::max<int64_t>(memory, m.window.window + 1);
            m.memory = memory >= spec.capacity ? kUnlimitedMemory : memory;
          }
          m.total = m.limited() ? int64_t{spec.max_sequences} * m.memory + spec.max_batch
                                : int64_t{spec.max_sequences} * spec.capacity;
          break;
        }
        case GroupKind::kRotating:
          m.max_size = g.rotating.max_size;
          m.total = int64_t{spec.max_sequences} * m.max_size;
          break;
        case GroupKind::kRecurrent:
          m.total = spec.max_sequences;
          break;
      }
      groups_.push_back(std::move(m));
      has_kind_[static_cast<int>(g.kind)] = true;
    }
    contiguous_ = has_kind_[1] || has_kind_[2];
    // A sequence keeps the ids of as many positions as the largest Attention group has cells,
    // or capacity when that is more.
    int64_t limit = spec.capacity;
    for (const ModelGroup& g : groups_) {
      if (g.kind == GroupKind::kAttention) limit = std::max(limit, g.total);
    }
    token_limit_ = static_cast<int32_t>(std::min(limit, kMaxCellsPerGroup));
  }

  const CacheSpec& spec() const { return spec_; }
  const std::vector<ModelGroup>& groups() const { return groups_; }
  const std::map<uint64_t, ModelSnapshot>& snapshots() const { return snapshots_; }
  bool contiguous() const { return contiguous_; }
  bool HasKind(GroupKind k) const { return has_kind_[static_cast<int>(k)]; }

  const std::vector<PendingToken>* Pending(int64_t seq) const {
    auto it = pending_.find(seq);
    return it == pending_.end() ? nullptr : &it->second;
  }
  int32_t PendingCount(int64_t seq) const {
    const auto* p = Pending(seq);
    return p == nullptr ? 0 : static_cast<int32_t>(p->size());
  }
  bool AnyPending() const { return !pending_.empty(); }

  // The token ids of `seq`; null when it has no chain.
  const TokenRef* Tokens(int64_t seq) const {
    auto it = tokens_.find(seq);
    return it == tokens_.end() ? nullptr : &it->second;
  }

  std::set<int64_t> Live() const {
    std::set<int64_t> live;
    for (const ModelGroup& g : groups_) {
      for (const auto& entry : g.seqs) live.insert(entry.first);
      for (const auto& entry : g.rings) live.insert(entry.first);
      for (const auto& entry : g.states) live.insert(entry.first);
    }
    for (const auto& entry : pending_) live.insert(entry.first);
    return live;
  }
  bool IsLive(int64_t seq) const { return Live().count(seq) > 0; }

  // One past the largest position over all groups, pending included; 0 when none.
  int32_t Offset(int64_t seq) const {
    int32_t offset = 0;
    for (const ModelGroup& g : groups_) {
      if (const auto* m = g.Find(seq)) offset = std::max(offset, m->rbegin()->first + 1);
      if (const Ring* r = g.FindRing(seq)) offset = std::max(offset, r->offset);
      if (const RecState* s = g.FindState(seq)) offset = std::max(offset, s->offset);
    }
    if (const auto* p = Pending(seq)) offset = std::max(offset, p->back().pos + 1);
    return offset;
  }

  bool StoredAnywhere(int64_t seq, int32_t pos) const {
    for (const ModelGroup& g : groups_) {
      const auto* m = g.Find(seq);
      if (m != nullptr && m->count(pos)) return true;
      const Ring* r = g.FindRing(seq);
      if (r != nullptr && r->rows.count(pos)) return true;
    }
    if (const auto* p = Pending(seq)) {
      for (const PendingToken& t : *p) {
        if (t.pos == pos) return true;
      }
    }
    return false;
  }

  // Stored positions of a Rotating group: the ring's window plus pending tokens.
  std::map<int32_t, uint64_t> RotatingRows(const ModelGroup& g, int64_t seq) const {
    std::map<int32_t, uint64_t> rows;
    if (const Ring* r = g.FindRing(seq)) rows = r->rows;
    if (const auto* p = Pending(seq)) {
      for (const PendingToken& t : *p) rows[t.pos] = t.id;
    }
    return rows;
  }

  // The state a Recurrent group reports for `seq` (the one after the last pending token).
  StateStatus ReportedState(const ModelGroup& g, int64_t seq, uint64_t* state_id) const {
    if (const auto* p = Pending(seq)) {
      *state_id = p->back().state_id;
      return StateStatus::kValid;
    }
    const RecState* s = g.FindState(seq);
    if (s == nullptr) return StateStatus::kNone;
    *state_id = s->state_id;
    return s->valid ? StateStatus::kValid : StateStatus::kInvalid;
  }

  Codes Append(const std::vector<Token>& tokens, const std::vector<uint64_t>& ids,
               const std::vector<uint64_t>& state_ids, bool speculative, bool payload_ok) {
    std::set<absl::StatusCode> errors;
    bool plannable = true;  // the batch is well-formed enough to plan cells
    if (tokens.empty()) return kInvalid;
    if (static_cast<int64_t>(tokens.size()) > spec_.max_batch) {
      errors.insert(kInvalid);
      plannable = false;
    }
    std::map<int64_t, int32_t> lowest;
    std::map<int64_t, int32_t> last;
    std::map<int64_t, int32_t> count;
    std::vector<int64_t> order;  // distinct sequences in order of first appearance
    for (const Token& t : tokens) {
      if (t.id < 0 && t.id != kNoTokenId) errors.insert(kInvalid);
      if (t.seq < 0 || t.pos < 0) {
        errors.insert(kInvalid);
        plannable = false;
        continue;
      }
      auto it = last.find(t.seq);
      if (it != last.end()) {
        if (t.pos <= it->second) {
          errors.insert(kInvalid);
          plannable = false;
        } else if (contiguous_ && t.pos != it->second + 1) {
          errors.insert(kInvalid);
        }
      } else {
        order.push_back(t.seq);
        lowest[t.seq] = t.pos;
        const int32_t offset = Offset(t.seq);
        if (contiguous_ && t.pos != offset) errors.insert(kInvalid);
        if (speculative && t.pos < offset) errors.insert(kInvalid);
      }
      last[t.seq] = t.pos;
      ++count[t.seq];
      if (StoredAnywhere(t.seq, t.pos)) errors.insert(kInvalid);
    }
    if (!payload_ok) errors.insert(kInvalid);
    for (int64_t seq : order) {
      if (!speculative && PendingCount(seq) > 0) errors.insert(kAborted);
      if (speculative && PendingCount(seq) + count[seq] > spec_.max_batch) {
        errors.insert(kExhausted);
      }
    }
    std::vector<ModelGroup> next;
    if (plannable) {
      // Other sequences' room reservations, as they stand before the batch.
      std::set<int64_t> batch_seqs;
      for (const auto& entry : lowest) batch_seqs.insert(entry.first);
      std::vector<int64_t> held;
      for (const ModelGroup& g : groups_) held.push_back(HeldCells(g, batch_seqs));
      next = groups_;
      for (ModelGroup& g : next) {
        if (g.kind == GroupKind::kAttention && g.limited()) Prune(g, lowest);
      }
      std::set<int64_t> live = Live();
      for (const auto& entry : lowest) live.insert(entry.first);
      if (static_cast<int64_t>(live.size()) + HeldSequences(batch_seqs) > spec_.max_sequences) {
        errors.insert(kExhausted);
      }
      for (size_t i = 0; i < next.size(); ++i) {
        // The batch's cells less those the pruning freed (next is pruned, not appended yet).
        const int64_t taken =
            static_cast<int64_t>(tokens.size()) - groups_[i].used() + next[i].used();
        if (next[i].kind == GroupKind::kAttention && taken > Available(groups_[i], held[i])) {
          errors.insert(kExhausted);
        }
      }
    }
    if (!errors.empty()) return Codes(errors);

    for (ModelGroup& g : next) {
      switch (g.kind) {
        case GroupKind::kAttention:
          for (size_t i = 0; i < tokens.size(); ++i) {
            Cell c;
            c.id = ids[i];
            g.seqs[tokens[i].seq][tokens[i].pos] = g.NewCell(c);
          }
          break;
        case GroupKind::kRotating:
          if (speculative) break;
          for (size_t i = 0; i < tokens.size(); ++i) {
            Ring& r = g.rings[tokens[i].seq];
            r.rows[tokens[i].pos] = ids[i];
            r.offset = tokens[i].pos + 1;
            g.Trim(r);
          }
          break;
        case GroupKind::kRecurrent:
          if (speculative) break;
          for (size_t i = 0; i < order.size(); ++i) {
            g.SetState(order[i], state_ids[i], last[order[i]] + 1);
          }
          break;
      }
    }
    groups_ = std::move(next);
    if (speculative) {
      for (size_t i = 0; i < tokens.size(); ++i) {
        pending_[tokens[i].seq].push_back(PendingToken{tokens[i].pos, ids[i], state_ids[i]});
      }
    }
    for (const Token& t : tokens) {
      auto it = tokens_.find(t.seq);
      if (it == tokens_.end()) {
        // Only an id at position 0 starts a chain: later ids alone say nothing of the prefix.
        if (t.id == kNoTokenId || t.pos != 0) continue;
        it = tokens_.emplace(t.seq, TokenRef()).first;
      }
      TokenRef& ref = it->second;
      // A position below the ids stored again (one a sliding window pruned): the positions
      // after it that are still stored were computed after what was there before.
      if (t.pos < ref.Size()) {
        ref.ids.resize(t.pos);
        ref.settled = std::min(ref.settled, t.pos);
        ++token_events["ids cut by a position stored again"];
      }
      // An id extends the ids only just past them, and only as far as a sequence keeps ids.
      if (t.id != kNoTokenId && t.pos == ref.Size() && t.pos < token_limit_) {
        ref.ids.push_back(t.id);
        if (!speculative && ref.settled == t.pos) ref.settled = t.pos + 1;
      } else if (t.id != kNoTokenId && t.pos == ref.Size()) {
        ++token_events["ids past the limit dropped"];
      }
    }
    ClampTokens();
    return kOk;
  }

  Codes CommitSpeculation(int64_t seq, int32_t accepted) {
    std::set<absl::StatusCode> errors;
    if (seq < 0) return kInvalid;
    const int32_t pending = PendingCount(seq);
    if (pending == 0) errors.insert(kPrecondition);
    if (accepted < 0 || accepted > pending) errors.insert(kInvalid);
    if (!errors.empty()) return Codes(errors);
    const std::vector<PendingToken> tokens = pending_.at(seq);
    pending_.erase(seq);
    for (ModelGroup& g : groups_) {
      switch (g.kind) {
        case GroupKind::kAttention: {
          auto it = g.seqs.find(seq);
          for (int32_t i = accepted; i < pending; ++i) {
            g.Release(it->second.at(tokens[i].pos));
            it->second.erase(tokens[i].pos);
          }
          if (it->second.empty()) g.seqs.erase(it);
          break;
        }
        case GroupKind::kRotating:
          if (accepted == 0) break;
          for (int32_t i = 0; i < accepted; ++i) {
            Ring& r = g.rings[seq];
            r.rows[tokens[i].pos] = tokens[i].id;
            r.offset = tokens[i].pos + 1;
            g.Trim(r);
          }
          break;
        case GroupKind::kRecurrent:
          if (accepted == 0) break;
          g.SetState(seq, tokens[accepted - 1].state_id, tokens[accepted - 1].pos + 1);
          break;
      }
    }
    auto chain = tokens_.find(seq);
    if (chain != tokens_.end()) {
      // The accepted ids settle; those of the rejected tokens go.
      TokenRef& ref = chain->second;
      const int32_t end = accepted > 0 ? tokens[accepted - 1].pos + 1 : tokens[0].pos;
      if (end < ref.Size()) ref.ids.resize(end);
      ref.settled = ref.Size();
    }
    ClampTokens();
    return kOk;
  }

  // Cache::Reserve with an expiry that never comes (positions 0 drops the reservation).
  Codes Reserve(int64_t seq, int32_t positions) {
    if (seq < 0 || positions < 0) return kInvalid;
    if (positions == 0) {
      room_.erase(seq);
      return kOk;
    }
    const std::set<int64_t> live = Live();
    if (!live.count(seq) &&
        static_cast<int64_t>(live.size()) + HeldSequences({seq}) + 1 > spec_.max_sequences) {
      return kExhausted;
    }
    for (const ModelGroup& g : groups_) {
      if (g.kind != GroupKind::kAttention) continue;
      if (ToGrow(g, seq, positions) > Available(g, HeldCells(g, {seq}))) return kExhausted;
    }
    room_[seq] = positions;
    return kOk;
  }

  Codes CopyPrefix(int64_t src, int64_t dst, int32_t length, int32_t require_src_offset) {
    if (src < 0 || dst < 0 || length < 0 || src == dst || require_src_offset < 0 ||
        (length == 0 && require_src_offset > 0)) {
      return kInvalid;
    }
    std::set<absl::StatusCode> errors;
    if (PendingCount(src) > 0 || PendingCount(dst) > 0) errors.insert(kAborted);
    // With pending tokens (ABORTED anyway) the model's offset counts them; the cache may not.
    if (Offset(src) < require_src_offset) errors.insert(kPrecondition);
    bool dst_live_after = false;
    for (const ModelGroup& g : groups_) {
      const auto* m = g.Find(src);
      if (m != nullptr && m->begin()->first < length) dst_live_after = true;
      if (const Ring* r = g.FindRing(src)) {
        if (length < r->offset && r->offset > g.max_size) errors.insert(kPrecondition);
        if (length > 0) dst_live_after = true;
      }
      if (const RecState* s = g.FindState(src)) {
        if (length < s->offset) {
          errors.insert(kPrecondition);
        } else {
          dst_live_after = true;
        }
      }
    }
    const std::set<int64_t> live = Live();
    if (dst_live_after && !live.count(dst) &&
        static_cast<int64_t>(live.size()) + HeldSequences({dst}) + 1 > spec_.max_sequences) {
      errors.insert(kExhausted);
    }
    if (!errors.empty()) return Codes(errors);
    for (ModelGroup& g : groups_) {
      g.Drop(dst);
      if (const auto* m = g.Find(src)) {
        std::map<int32_t, int64_t> copy;
        for (const auto& [pos, h] : *m) {
          if (pos >= length) break;
          ++g.cells.at(h).refs;
          copy[pos] = h;
        }
        if (!copy.empty()) g.seqs[dst] = std::move(copy);
      }
      if (const Ring* r = g.FindRing(src)) {
        Ring copy = *r;
        if (length < copy.offset) {
          copy.offset = length;
          g.Trim(copy);
        }
        if (copy.offset > 0) g.rings[dst] = std::move(copy);
      }
      if (const RecState* s = g.FindState(src)) {
        RecState copy = *s;
        if (copy.slot >= 0) ++g.slots.at(copy.slot);
        g.states[dst] = copy;
      }
    }
    // dst gets src's settled ids below length (src has no pending ones here).
    if (const TokenRef* ref = Tokens(src)) {
      tokens_[dst] = TokenRef::Settled(ref->Prefix(length));
    } else {
      tokens_.erase(dst);
    }
    ClampTokens();
    return kOk;
  }

  Codes Remove(int64_t seq, int32_t begin, std::optional<int32_t> end) {
    if (seq < 0 || begin < 0 || (end.has_value() && *end < begin)) return kInvalid;
    if (!IsLive(seq)) return kOk;
    if (end.has_value() && *end == begin) {
      // Nothing to remove; whether the pending check comes first is not specified.
      if (PendingCount(seq) > 0) return Codes(std::vector<absl::StatusCode>{kOk, kAborted});
      return kOk;
    }
    if (PendingCount(seq) > 0) return kAborted;
    std::set<absl::StatusCode> errors;
    for (const ModelGroup& g : groups_) {
      if (g.kind == GroupKind::kRotating) {
        const Ring* r = g.FindRing(seq);
        if (r == nullptr || begin >= r->offset) continue;
        if (end.has_value() && *end < r->offset) {
          errors.insert(kPrecondition);  // a middle removal
        } else if (r->offset > g.max_size && begin != 0) {
          errors.insert(kPrecondition);  // truncating a wrapped ring
        }
        continue;
      }
      if (g.kind != GroupKind::kAttention) continue;
      const auto* m = g.Find(seq);
      if (m == nullptr) continue;
      const bool moves = end.has_value() && m->rbegin()->first >= *end;
      if (moves && g.rope.type == RopeType::kNone) errors.insert(kPrecondition);
      int64_t freed = 0;
      int64_t copies = 0;
      for (const auto& [pos, h] : *m) {
        const int refs = g.cells.at(h).refs;
        if (pos >= begin && (!end.has_value() || pos < *end)) {
          if (refs == 1) ++freed;
        } else if (end.has_value() && pos >= *end && refs > 1) {
          ++copies;
        }
      }
      if (copies - freed > Available(g, HeldCells(g, {seq}))) errors.insert(kExhausted);
    }
    if (!errors.empty()) return Codes(errors);

    const int32_t offset = Offset(seq);
    for (ModelGroup& g : groups_) {
      switch (g.kind) {
        case GroupKind::kAttention: {
          auto it = g.seqs.find(seq);
          if (it == g.seqs.end()) break;
          std::map<int32_t, int64_t> kept;
          for (const auto& [pos, h] : it->second) {
            if (pos < begin) {
              kept[pos] = h;
            } else if (!end.has_value() || pos < *end) {
              g.Release(h);
            } else {
              int64_t moved = h;
              if (g.cells.at(h).refs > 1) {
                moved = g.NewCell(g.cells.at(h));
                g.Release(h);
              }
              Cell& c = g.cells.at(moved);
              c.delta += begin - *end;
              c.shifts += 1;
              kept[pos - (*end - begin)] = moved;
            }
          }
          if (kept.empty()) {
            g.seqs.erase(it);
          } else {
            it->second = std::move(kept);
          }
          break;
        }
        case GroupKind::kRotating: {
          auto it = g.rings.find(seq);
          if (it == g.rings.end() || begin >= it->second.offset) break;
          if (begin == 0) {
            g.rings.erase(it);
          } else {
            it->second.offset = begin;
            g.Trim(it->second);
          }
          break;
        }
        case GroupKind::kRecurrent: {
          auto it = g.states.find(seq);
          if (it == g.states.end() || begin >= it->second.offset) break;
          RecState& s = it->second;
          g.ReleaseSlot(s.slot);
          s.slot = -1;
          s.valid = false;
          s.offset = (end.has_value() && *end < s.offset) ? s.offset - (*end - begin) : begin;
          // "Remove from 0 drops the sequence from the group entirely": read as a removal that
          // leaves nothing (offset 0). Remove(seq, 0, end) that leaves later positions moves
          // them to 0 like the Attention groups' and keeps an INVALID state.
          if (s.offset == 0) g.states.erase(it);
          break;
        }
      }
    }
    auto chain = tokens_.find(seq);
    if (chain != tokens_.end()) {
      TokenRef& ref = chain->second;
      if (end.has_value() && *end < offset) {
        // Positions after the range move down with their ids; what moved was computed with the
        // removed positions before it, so from `begin` on nothing is exact.
        if (begin < ref.Size()) {
          ref.ids.erase(ref.ids.begin() + begin, ref.ids.begin() + std::min(*end, ref.Size()));
          ref.settled = ref.Size();
        }
        ref.taint = std::min(ref.taint, begin);
      } else {
        ref.Truncate(begin);
      }
    }
    ClampTokens();
    return kOk;
  }

  Codes ReadCode(int64_t seq, int32_t begin, std::optional<int32_t> end) const {
    if (seq < 0 || begin < 0 || (end.has_value() && *end < begin)) return kInvalid;
    if (!IsLive(seq)) return kNotFound;
    return kOk;
  }

  // (position, cell) of seq in Attention or Rotating group g within [begin, end).
  std::vector<std::pair<int32_t, Cell>> Rows(int g, int64_t seq, int32_t begin,
                                             std::optional<int32_t> end) const {
    std::vector<std::pair<int32_t, Cell>> rows;
    const ModelGroup& group = groups_[g];
    auto in = [&](int32_t pos) { return pos >= begin && (!end.has_value() || pos < *end); };
    if (group.kind == GroupKind::kAttention) {
      if (const auto* m = group.Find(seq)) {
        for (const auto& [pos, h] : *m) {
          if (in(pos)) rows.emplace_back(pos, group.cells.at(h));
        }
      }
    } else if (group.kind == GroupKind::kRotating) {
      for (const auto& [pos, id] : RotatingRows(group, seq)) {
        Cell c;
        c.id = id;
        if (in(pos)) rows.emplace_back(pos, c);
      }
    }
    return rows;
  }

  // The state a Read of [begin, end) returns in Recurrent group g. `alternative` is set where
  // the documents allow a second answer.
  StateStatus ReadState(int g, int64_t seq, std::optional<int32_t> end, uint64_t* state_id,
                        std::optional<StateStatus>* alternative) const {
    const StateStatus s = ReportedState(groups_[g], seq, state_id);
    const bool reaches = !end.has_value() || *end >= Offset(seq);
    if (s == StateStatus::kValid) return reaches ? s : StateStatus::kNone;
    if (s == StateStatus::kInvalid && !reaches) *alternative = StateStatus::kNone;
    return s;
  }

  std::vector<int32_t> Visible(int g, const Query& q) const {
    std::vector<int32_t> out;
    const ModelGroup& group = groups_[g];
    if (group.kind == GroupKind::kRecurrent) return out;
    if (group.kind == GroupKind::kRotating) {
      for (const auto& entry : RotatingRows(group, q.seq)) {
        const int64_t p = entry.first;
        if (!q.non_causal && p > q.pos) continue;
        if (p <= int64_t{q.pos} - group.max_size) continue;
        out.push_back(static_cast<int32_t>(p));
      }
      return out;
    }
    const auto* m = group.Find(q.seq);
    if (m == nullptr) return out;
    for (const auto& entry : *m) {
      const int64_t p = entry.first;
      if (!q.non_causal && p > q.pos) continue;
      if (group.window.kind == WindowKind::kSliding && p < int64_t{q.pos} - group.window.window) {
        continue;
      }
      if (group.window.kind == WindowKind::kChunked &&
          p < int64_t{q.pos} - q.pos % group.window.chunk) {
        continue;
      }
      out.push_back(static_cast<int32_t>(p));
    }
    return out;
  }

  bool CanResume(int64_t seq, int32_t pos) const {
    const int32_t offset = Offset(seq);
    for (const ModelGroup& g : groups_) {
      switch (g.kind) {
        case GroupKind::kAttention: {
          if (!g.limited()) break;
          const auto* m = g.Find(seq);
          if (m == nullptr) return false;
          const int64_t first = m->begin()->first;
          const int64_t last = m->rbegin()->first;
          const int64_t window_start = std::max<int64_t>(0, int64_t{pos} - g.window.window);
          if (!(window_start >= first && pos <= last + 1)) return false;
          break;
        }
        case GroupKind::kRotating: {
          // "Wrapped means offset > max_size" with the Rotating section's offset, the ring's
          // (committed tokens; pending ones live outside the ring), as in its window
          // [max(0, offset - max_size), offset). pos == offset is the sequence's offset.
          const Ring* r = g.FindRing(seq);
          const bool wrapped = r != nullptr && r->offset > g.max_size;
          if (!(pos == offset || (pos < offset && !wrapped))) return false;
          break;
        }
        case GroupKind::kRecurrent: {
          uint64_t unused;
          const StateStatus s = ReportedState(g, seq, &unused);
          // A sequence that stores nothing starts at 0 from the initial state: the documents
          // only speak of stored states ("pos == offset and the state is VALID"); read as true.
          if (s == StateStatus::kNone && offset == 0 && pos == 0) break;
          if (!(pos == offset && s == StateStatus::kValid)) return false;
          break;
        }
      }
    }
    return true;
  }

  // ---- snapshots ----

  Codes Snapshot(int64_t seq, int32_t from, ModelSnapshot* out) const {
    std::set<absl::StatusCode> errors;
    if (seq < 0 || from < 0) errors.insert(kInvalid);
    if (seq >= 0 && !IsLive(seq)) errors.insert(kNotFound);
    if (seq >= 0 && IsLive(seq)) {
      if (PendingCount(seq) > 0) errors.insert(kAborted);
      if (from >= Offset(seq)) errors.insert(kPrecondition);
      for (const ModelGroup& g : groups_) {
        const RecState* s = g.FindState(seq);
        if (g.kind == GroupKind::kRecurrent && s != nullptr && !s->valid) {
          errors.insert(kPrecondition);
        }
      }
    }
    if (!errors.empty()) return Codes(errors);
    out->seq = seq;
    out->from = from;
    out->to = Offset(seq);
    out->groups.clear();
    for (const ModelGroup& g : groups_) {
      SnapGroup sg;
      switch (g.kind) {
        case GroupKind::kAttention:
          if (const auto* m = g.Find(seq)) {
            for (const auto& [pos, h] : *m) {
              if (pos >= from && pos < out->to) sg.rows[pos] = g.cells.at(h);
            }
          }
          break;
        case GroupKind::kRotating:
          if (const Ring* r = g.FindRing(seq)) {
            for (const auto& [pos, id] : r->rows) {
              Cell c;
              c.id = id;
              sg.rows[pos] = c;
            }
          }
          sg.ring_index = out->to % g.max_size;
          break;
        case GroupKind::kRecurrent:
          if (const RecState* s = g.FindState(seq)) {
            sg.has_state = true;
            sg.state_id = s->state_id;
          }
          break;
      }
      out->groups.push_back(std::move(sg));
    }
    if (const TokenRef* ref = Tokens(seq)) out->tokens = ref->Prefix(out->to);
    return kOk;
  }

  void AddSnapshot(uint64_t id, ModelSnapshot s) { snapshots_[id] = std::move(s); }
  void EraseSnapshot(uint64_t id) { snapshots_.erase(id); }

  // With `imported`, Restore of that snapshot, which the cache does not keep (RestoreImport).
  Codes Restore(int64_t seq, std::optional<uint64_t> id, int32_t target,
                const ModelSnapshot* imported = nullptr) {
    std::set<absl::StatusCode> errors;
    if (seq < 0 || target < 0) errors.insert(kInvalid);
    if (imported == nullptr && id.has_value() && !snapshots_.count(*id)) errors.insert(kNotFound);
    if (seq >= 0 && PendingCount(seq) > 0) errors.insert(kAborted);
    if (!errors.empty()) return Codes(errors);
    const int32_t offset = Offset(seq);
    if (imported == nullptr && !id.has_value()) {
      if (!IsLive(seq)) return target == 0 ? kOk : kPrecondition;
      for (const ModelGroup& g : groups_) {
        switch (g.kind) {
          case GroupKind::kAttention:
            if (target > offset) return kPrecondition;
            break;
          case GroupKind::kRotating:
            if (!(target == offset || (target < offset && offset <= g.max_size))) {
              return kPrecondition;
            }
            break;
          case GroupKind::kRecurrent:
            if (target != offset) return kPrecondition;
            break;
        }
      }
      for (ModelGroup& g : groups_) {
        if (g.kind == GroupKind::kAttention) {
          auto it = g.seqs.find(seq);
          if (it == g.seqs.end()) continue;
          for (auto p = it->second.begin(); p != it->second.end();) {
            if (p->first >= target) {
              g.Release(p->second);
              p = it->second.erase(p);
            } else {
              ++p;
            }
          }
          if (it->second.empty()) g.seqs.erase(it);
        } else if (g.kind == GroupKind::kRotating) {
          auto it = g.rings.find(seq);
          if (it == g.rings.end() || target >= it->second.offset) continue;
          it->second.offset = target;
          g.Trim(it->second);
          if (target == 0) g.rings.erase(it);
        }
      }
      auto chain = tokens_.find(seq);
      if (chain != tokens_.end()) chain->second.Truncate(target);
      ClampTokens();
      return kOk;
    }
    const ModelSnapshot& snap = imported != nullptr ? *imported : snapshots_.at(*id);
    if (target > snap.to) errors.insert(kPrecondition);
    if (HasKind(GroupKind::kAttention) && offset < snap.from) errors.insert(kPrecondition);
    for (const ModelGroup& g : groups_) {
      if (g.kind == GroupKind::kRotating && target < snap.to && snap.to > g.max_size) {
        errors.insert(kPrecondition);
      }
    }
    if (HasKind(GroupKind::kRecurrent) && target != snap.to) errors.insert(kPrecondition);
    // The resource checks below may come first too: plan in any case.

    std::vector<ModelGroup> next = groups_;
    const int32_t keep_below = std::min(snap.from, target);
    for (size_t gi = 0; gi < next.size(); ++gi) {
      ModelGroup& g = next[gi];
      const SnapGroup& sg = snap.groups[gi];
      switch (g.kind) {
        case GroupKind::kAttention: {
          std::map<int32_t, int64_t> kept;
          auto it = g.seqs.find(seq);
          if (it != g.seqs.end()) {
            for (const auto& [pos, h] : it->second) {
              if (pos < keep_below) {
                kept[pos] = h;
              } else {
                g.Release(h);
              }
            }
            g.seqs.erase(it);
          }
          for (const auto& [pos, cell] : sg.rows) {
            if (pos < target) kept[pos] = g.NewCell(cell);
          }
          if (!kept.empty()) g.seqs[seq] = std::move(kept);
          break;
        }
        case GroupKind::kRotating: {
          g.rings.erase(seq);
          Ring r;
          r.offset = target;
          for (const auto& [pos, cell] : sg.rows) {
            if (pos < target) r.rows[pos] = cell.id;
          }
          g.Trim(r);
          if (r.offset > 0) g.rings[seq] = std::move(r);
          break;
        }
        case GroupKind::kRecurrent:
          if (sg.has_state) g.SetState(seq, sg.state_id, snap.to);
          break;
      }
    }
    for (size_t k = 0; k < next.size(); ++k) {
      if (next[k].kind == GroupKind::kAttention &&
          next[k].used() - groups_[k].used() >
              Available(groups_[k], HeldCells(groups_[k], {seq}))) {
        errors.insert(kExhausted);
      }
    }
    const std::set<int64_t> live = Live();
    bool live_after = false;
    for (const ModelGroup& g : next) {
      if (g.Find(seq) != nullptr || g.FindRing(seq) != nullptr || g.FindState(seq) != nullptr) {
        live_after = true;
      }
    }
    if (live_after && !live.count(seq) &&
        static_cast<int64_t>(live.size()) + HeldSequences({seq}) + 1 > spec_.max_sequences) {
      errors.insert(kExhausted);
    }
    if (!errors.empty()) return Codes(errors);
    groups_ = std::move(next);
    RestoreTokens(seq, snap, target);
    ClampTokens();
    return kOk;
  }

  Codes Merge(uint64_t parent, uint64_t child, ModelSnapshot* out) const {
    std::set<absl::StatusCode> errors;
    if (parent == child) errors.insert(kInvalid);
    const auto p = snapshots_.find(parent);
    const auto c = snapshots_.find(child);
    if (p == snapshots_.end() || c == snapshots_.end()) errors.insert(kNotFound);
    if (!errors.empty()) return Codes(errors);
    if (HasKind(GroupKind::kAttention) && p->second.to != c->second.from) return kInvalid;
    out->seq = c->second.seq;
    // [parent.from, child.to); without Attention groups the ranges need not meet, and the
    // result starts at the lower of the two starts (docs/semantics.md).
    out->from = std::min(p->second.from, c->second.from);
    out->to = c->second.to;
    out->groups = c->second.groups;
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (groups_[g].kind != GroupKind::kAttention) continue;
      out->groups[g].rows = p->second.groups[g].rows;
      for (const auto& entry : c->second.groups[g].rows) {
        out->groups[g].rows[entry.first] = entry.second;
      }
    }
    out->tokens = MergeTokens(p->second, c->second);
    return kOk;
  }

  // On success `parent` and `child` hold the results (absent where none).
  Codes Split(uint64_t id, int32_t at, std::optional<ModelSnapshot>* parent,
              std::optional<ModelSnapshot>* child) const {
    const auto it = snapshots_.find(id);
    if (it == snapshots_.end()) return kNotFound;
    const ModelSnapshot& s = it->second;
    parent->reset();
    child->reset();
    if (HasKind(GroupKind::kRotating) || HasKind(GroupKind::kRecurrent) || at <= s.from) {
      *child = s;
    } else if (at >= s.to) {
      *parent = s;
    } else {
      ModelSnapshot a = s;
      ModelSnapshot b = s;
      a.to = at;
      b.from = at;
      a.tokens = s.tokens.Prefix(at);  // the child keeps all: they are what its data came after
      for (size_t g = 0; g < groups_.size(); ++g) {
        a.groups[g].rows.clear();
        b.groups[g].rows.clear();
        for (const auto& [pos, cell] : s.groups[g].rows) {
          (pos < at ? a : b).groups[g].rows[pos] = cell;
        }
      }
      *parent = std::move(a);
      *child = std::move(b);
    }
    return kOk;
  }

  // Whether a sequence import of `snap`'s rows finds free cells for all of them in every
  // Attention group, with every room reservation held back (the import's sequence is not known
  // yet); otherwise they go to the snapshot pool.
  bool ImportFitsInCells(const ModelSnapshot& snap) const {
    for (size_t g = 0; g < groups_.size(); ++g) {
      const int64_t rows = static_cast<int64_t>(snap.groups[g].rows.size());
      if (groups_[g].kind != GroupKind::kAttention || rows == 0) continue;
      if (rows > Available(groups_[g], HeldCells(groups_[g], {}))) return false;
    }
    return true;
  }

  // Every sequence whose exact ids share at least one whole block with `prompt` (as far as a
  // sequence keeps ids), with how far they agree: longest first, then by seq.
  std::vector<PrefixMatch> LookupPrefix(const std::vector<int32_t>& prompt) const {
    std::vector<PrefixMatch> matches;
    const int32_t n = std::min(static_cast<int32_t>(prompt.size()), token_limit_);
    for (const auto& [seq, ref] : tokens_) {
      int32_t same = 0;
      while (same < std::min(n, ref.exact()) && prompt[same] == ref.ids[same]) ++same;
      if (same < spec_.token_block_size) continue;
      PrefixMatch m;
      m.seq = seq;
      m.length = same;
      m.offset = Offset(seq);
      m.can_resume = CanResume(seq, same);
      matches.push_back(m);
    }
    std::sort(matches.begin(), matches.end(), [](const PrefixMatch& x, const PrefixMatch& y) {
      return x.length != y.length ? x.length > y.length : x.seq < y.seq;
    });
    return matches;
  }

  // How often restores and merges found the same ids below a snapshot's start, or others.
  mutable std::map<std::string, int> token_events;

 private:
  // Cells `seq` would still take in `g` to hold `positions` positions (a sliding window's
  // memory at most), as AttentionGroup::UnitsToGrow.
  static int64_t ToGrow(const ModelGroup& g, int64_t seq, int32_t positions) {
    const auto* m = g.Find(seq);
    const int64_t stored = m == nullptr ? 0 : static_cast<int64_t>(m->size());
    return std::max<int64_t>(0, std::min<int64_t>(positions, g.memory) - stored);
  }
  // What the room reservations of sequences outside `exclude` hold back in `g`.
  int64_t HeldCells(const ModelGroup& g, const std::set<int64_t>& exclude) const {
    if (g.kind != GroupKind::kAttention) return 0;
    int64_t held = 0;
    for (const auto& [seq, positions] : room_) {
      if (!exclude.count(seq)) held += ToGrow(g, seq, positions);
    }
    return held;
  }
  // The cells an operation may take in `g` (as it stands before the operation) when `held`
  // are held back for other sequences: none when the reservations hold more than is free (a
  // reserved sequence that shrank holds back more), but an operation that takes no cells net
  // still succeeds.
  static int64_t Available(const ModelGroup& g, int64_t held) {
    return std::max<int64_t>(0, g.total - g.used() - held);
  }
  // Sequence slots held back: reserved sequences outside `exclude` that are not live.
  int64_t HeldSequences(const std::set<int64_t>& exclude) const {
    const std::set<int64_t> live = Live();
    int64_t held = 0;
    for (const auto& [seq, positions] : room_) held += !exclude.count(seq) && !live.count(seq);
    return held;
  }

  std::map<int64_t, int32_t> room_;  // Reserve: positions by sequence

  // The seed's updateSlidingWindow for one group; a sequence with pending tokens keeps
  // everything from (first pending position - memory) on.
  void Prune(ModelGroup& g, const std::map<int64_t, int32_t>& lowest) const {
    for (auto it = g.seqs.begin(); it != g.seqs.end();) {
      std::map<int32_t, int64_t>& positions = it->second;
      auto low = lowest.find(it->first);
      int64_t bound = low != lowest.end() ? int64_t{low->second} - g.memory
                                          : int64_t{positions.rbegin()->first} + 1 - g.memory;
      if (const auto* p = Pending(it->first)) {
        bound = std::min(bound, int64_t{p->front().pos} - g.memory);
      }
      while (!positions.empty() && positions.begin()->first < bound) {
        g.Release(positions.begin()->second);
        positions.erase(positions.begin());
      }
      it = positions.empty() ? g.seqs.erase(it) : std::next(it);
    }
  }

  // A chain says nothing of positions a sequence does not store: it goes with the sequence
  // and is cut at its offset.
  void ClampTokens() {
    const std::set<int64_t> live = Live();
    for (auto it = tokens_.begin(); it != tokens_.end();) {
      const bool kept = live.count(it->first) > 0;
      if (kept) it->second.Truncate(Offset(it->first));
      it = !kept || it->second.empty() ? tokens_.erase(it) : std::next(it);
    }
  }

  // The ids of `seq` after a Restore of `snap` to `target`: seq keeps its positions below the
  // snapshot's start, and from there gets data that the snapshot's sequence computed after
  // its own ids below the start. That data continues seq's ids exactly only when those are
  // the same; otherwise nothing from the start on is exact.
  void RestoreTokens(int64_t seq, const ModelSnapshot& snap, int32_t target) {
    const int32_t from = snap.from;
    const SnapTokens& saved = snap.tokens;
    const TokenRef* old = Tokens(seq);
    SnapTokens restored = old != nullptr ? old->Prefix(from) : SnapTokens();
    const bool whole = restored.Size() == from;
    const bool same = whole && saved.Size() >= from &&
                      std::equal(restored.ids.begin(), restored.ids.end(), saved.ids.begin());
    if (whole && saved.Size() > from) {
      const int32_t end = std::min(saved.Size(), std::max(target, from));
      restored.ids.insert(restored.ids.end(), saved.ids.begin() + from, saved.ids.begin() + end);
    }
    if (!same) {
      restored.taint = std::min(restored.taint, from);
    } else if (restored.taint == kNoTaint) {
      // The snapshot's data starts at `from`: a taint below it marks what that data saw, and
      // the restored positions below `from` are the sequence's own.
      restored.taint = saved.taint == kNoTaint ? kNoTaint : std::max(saved.taint, from);
      if (saved.taint != kNoTaint) ++token_events["restores that keep the snapshot's taint"];
    }
    if (from > 0 && !saved.ids.empty()) {
      ++token_events[same ? "restores after the same ids" : "restores after other ids"];
    }
    tokens_[seq] = TokenRef::Settled(restored);  // ClampTokens drops it if empty
  }

  // The ids of a merge of `p` and `c`. Without Attention groups the merge is c's data alone.
  // With them it holds p's data below c's start and c's from there, which continues p's ids
  // exactly only when the two agree below the start; otherwise nothing from the start on is
  // exact.
  SnapTokens MergeTokens(const ModelSnapshot& p, const ModelSnapshot& c) const {
    if (!HasKind(GroupKind::kAttention)) return c.tokens;
    const int32_t start = c.from;
    SnapTokens merged = p.tokens.Prefix(start);
    if (merged.Size() < start) return merged;
    const bool same = c.tokens.Size() >= start &&
                      std::equal(merged.ids.begin(), merged.ids.end(), c.tokens.ids.begin());
    if (c.tokens.Size() > start) {
      merged.ids.insert(merged.ids.end(), c.tokens.ids.begin() + start, c.tokens.ids.end());
    }
    if (!same) {
      merged.taint = std::min(merged.taint, start);
    } else if (merged.taint == kNoTaint) {
      merged.taint = c.tokens.taint == kNoTaint ? kNoTaint : std::max(c.tokens.taint, start);
      if (c.tokens.taint != kNoTaint) ++token_events["merges that keep the child's taint"];
    }
    if (start > 0) ++token_events[same ? "merges of the same ids" : "merges of other ids"];
    return merged;
  }

  CacheSpec spec_;
  std::vector<ModelGroup> groups_;
  std::map<int64_t, std::vector<PendingToken>> pending_;
  std::map<uint64_t, ModelSnapshot> snapshots_;
  std::map<int64_t, TokenRef> tokens_;  // sequences with a chain
  int32_t token_limit_ = 0;             // the most ids a sequence keeps
  bool has_kind_[3] = {false, false, false};
  bool contiguous_ = false;
};

// ---- expected bytes ------------------------------------------------------------------------

// Pattern rows and states by id, computed once per episode.
class RowMemo {
 public:
  explicit RowMemo(const CacheSpec& spec) : spec_(spec) {}

  const std::vector<uint8_t>& Row(uint64_t id, int group, int layer, bool key) {
    // ids stay far below 2^40; groups < 64, layers < 1024.
    const uint64_t k = (id << 24) | (static_cast<uint64_t>(group) << 16) |
                       (static_cast<uint64_t>(layer) << 1) | (key ? 1 : 0);
    auto it = rows_.find(k);
    if (it == rows_.end()) {
      it = rows_.emplace(k, testutil::RowBytes(spec_, id, group, layer, key)).first;
    }
    return it->second;
  }

  const std::vector<uint8_t>& State(uint64_t id, int group, int layer) {
    const uint64_t k =
        (id << 24) | (static_cast<uint64_t>(group) << 16) | (static_cast<uint64_t>(layer) << 1);
    auto it = states_.find(k);
    if (it == states_.end()) {
      it = states_.emplace(k, testutil::StateLayerBytes(spec_, id, group, layer)).first;
    }
    return it->second;
  }

 private:
  const CacheSpec& spec_;
  std::unordered_map<uint64_t, std::vector<uint8_t>> rows_;
  std::unordered_map<uint64_t, std::vector<uint8_t>> states_;
};

// Bytes of one token's K and V over all layers of an Attention or Rotating group, and of one
// state over all layers of a Recurrent group, computed from the spec here (not spec.cc).
size_t TokenBytes(const CacheSpec& spec, int g) {
  const GroupSpec& group = spec.groups[g];
  if (group.kind == GroupKind::kRecurrent) return 0;
  return static_cast<size_t>(group.num_layers) *
         (testutil::KRowElements(spec, g) + testutil::VRowElements(spec, g)) *
         testutil::ElementBytes(spec.dtype);
}

size_t StateBytes(const CacheSpec& spec, int g) {
  const GroupSpec& group = spec.groups[g];
  if (group.kind != GroupKind::kRecurrent) return 0;
  const RecurrentSpec& r = group.recurrent;
  return static_cast<size_t>(group.num_layers) *
         (static_cast<size_t>(r.conv_tail) * r.conv_dim * testutil::ElementBytes(spec.dtype) +
          static_cast<size_t>(r.num_v_heads) * r.head_v_dim * r.head_k_dim * 4);
}

// The size an Append payload must have (docs/api.md#payload-layout).
size_t ExpectedPayloadBytes(const CacheSpec& spec, const std::vector<Token>& tokens,
                            bool speculative) {
  std::set<int64_t> seqs;
  for (const Token& t : tokens) seqs.insert(t.seq);
  const size_t states = speculative ? tokens.size() : seqs.size();
  size_t total = 0;
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    total += TokenBytes(spec, g) * tokens.size() + StateBytes(spec, g) * states;
  }
  return total;
}

// What one group of a Read must return.
struct WantGroup {
  std::vector<std::pair<int32_t, Cell>> rows;  // Attention / Rotating
  StateStatus state = StateStatus::kNone;      // Recurrent
  std::optional<StateStatus> alternative;      // a second acceptable state
  uint64_t state_id = 0;
};

// Compares a Read result with the model's rows and states of each group.
::testing::AssertionResult CompareRead(const CacheSpec& spec, RowMemo& memo, const ReadResult& got,
                                       const std::vector<WantGroup>& want) {
  if (got.positions.size() != spec.groups.size() || got.states.size() != spec.groups.size()) {
    return ::testing::AssertionFailure()
           << "header has " << got.positions.size() << " position lists and " << got.states.size()
           << " states for " << spec.groups.size() << " groups";
  }
  std::vector<StateStatus> states(want.size());
  for (size_t g = 0; g < want.size(); ++g) {
    std::vector<int32_t> positions;
    for (const auto& row : want[g].rows) positions.push_back(row.first);
    if (got.positions[g] != positions) {
      std::ostringstream os;
      os << "group " << g << " positions {";
      for (int32_t p : got.positions[g]) os << p << ",";
      os << "}, model {";
      for (int32_t p : positions) os << p << ",";
      os << "}";
      return ::testing::AssertionFailure() << os.str();
    }
    states[g] = want[g].state;
    if (got.states[g] != want[g].state) {
      if (want[g].alternative.has_value() && got.states[g] == *want[g].alternative) {
        states[g] = *want[g].alternative;
      } else {
        return ::testing::AssertionFailure()
               << "group " << g << " state " << StateName(got.states[g]) << ", model "
               << StateName(want[g].state);
      }
    }
  }
  const size_t esize = testutil::ElementBytes(spec.dtype);
  size_t expected_size = 0;
  for (size_t g = 0; g < want.size(); ++g) {
    expected_size += TokenBytes(spec, static_cast<int>(g)) * want[g].rows.size();
    if (states[g] == StateStatus::kValid) expected_size += StateBytes(spec, static_cast<int>(g));
  }
  if (got.payload.size() != expected_size) {
    return ::testing::AssertionFailure()
           << "payload " << got.payload.size() << " bytes, model " << expected_size;
  }
  const uint8_t* p = reinterpret_cast<const uint8_t*>(got.payload.data());
  for (int g = 0; g < static_cast<int>(want.size()); ++g) {
    if (spec.groups[g].kind == GroupKind::kRecurrent) {
      if (states[g] != StateStatus::kValid) continue;
      for (int layer = 0; layer < spec.groups[g].num_layers; ++layer) {
        const std::vector<uint8_t>& bytes = memo.State(want[g].state_id, g, layer);
        if (std::memcmp(p, bytes.data(), bytes.size()) != 0) {
          return ::testing::AssertionFailure()
                 << "group " << g << " layer " << layer << " recurrent state differs (model: state "
                 << want[g].state_id << ")";
        }
        p += bytes.size();
      }
      continue;
    }
    const AttentionSpec& a = spec.groups[g].attention;
    for (int layer = 0; layer < spec.groups[g].num_layers; ++layer) {
      for (bool key : {true, false}) {
        for (const auto& [pos, cell] : want[g].rows) {
          const std::vector<uint8_t>& orig = memo.Row(cell.id, g, layer, key);
          if (!key || cell.shifts == 0) {
            if (std::memcmp(p, orig.data(), orig.size()) != 0) {
              return ::testing::AssertionFailure()
                     << "group " << g << " layer " << layer << (key ? " K" : " V")
                     << " of position " << pos << " differs (model: row " << cell.id << ")";
            }
            p += orig.size();
            continue;
          }
          const size_t n = orig.size() / esize;
          std::vector<double> ref(n);
          for (size_t i = 0; i < n; ++i)
            ref[i] = DecodeElement(spec.dtype, orig.data() + i * esize);
          testutil::ReferenceRopeShift(a.rope, a.num_kv_heads, a.head_dim_k, cell.delta, &ref);
          const double tol = testutil::RopeTolerancePerShift(spec.dtype) * cell.shifts;
          for (size_t i = 0; i < n; ++i) {
            if (static_cast<int>(i % a.head_dim_k) >= a.rope.dims) {
              if (std::memcmp(p + i * esize, orig.data() + i * esize, esize) != 0) {
                return ::testing::AssertionFailure()
                       << "group " << g << " layer " << layer << " K of position " << pos
                       << ": element " << i << " past rope dims changed";
              }
              continue;
            }
            const double v = DecodeElement(spec.dtype, p + i * esize);
            if (!(std::fabs(v - ref[i]) <= tol * std::max(1.0, std::fabs(ref[i])))) {
              return ::testing::AssertionFailure()
                     << "group " << g << " layer " << layer << " K of position " << pos
                     << " element " << i << ": got " << v << ", reference " << ref[i] << " (delta "
                     << cell.delta << ", " << cell.shifts << " shifts)";
            }
          }
          p += orig.size();
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// The SnapshotInfo the engine must report for a model snapshot.
SnapshotInfo ExpectedInfo(const CacheSpec& spec, uint64_t id, const ModelSnapshot& s) {
  SnapshotInfo info;
  info.id = id;
  info.seq = s.seq;
  info.from = s.from;
  info.to = s.to;
  info.tokens = s.tokens.Size();
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    SnapshotGroupInfo gi;
    const SnapGroup& sg = s.groups[g];
    switch (spec.groups[g].kind) {
      case GroupKind::kAttention:
        gi.stored = static_cast<int32_t>(sg.rows.size());
        break;
      case GroupKind::kRotating:
        gi.stored = static_cast<int32_t>(sg.rows.size());
        gi.ring_index = sg.ring_index;
        break;
      case GroupKind::kRecurrent:
        gi.state = sg.has_state ? StateStatus::kValid : StateStatus::kNone;
        break;
    }
    info.bytes +=
        TokenBytes(spec, g) * sg.rows.size() + (sg.has_state ? StateBytes(spec, g) : size_t{0});
    info.groups.push_back(gi);
  }
  return info;
}

::testing::AssertionResult CompareSnapshotInfo(const SnapshotInfo& got, const SnapshotInfo& want) {
  std::ostringstream os;
  bool same = got.id == want.id && got.seq == want.seq && got.from == want.from &&
              got.to == want.to && got.bytes == want.bytes && got.tokens == want.tokens &&
              got.groups.size() == want.groups.size();
  for (size_t g = 0; same && g < want.groups.size(); ++g) {
    same = got.groups[g].stored == want.groups[g].stored &&
           got.groups[g].ring_index == want.groups[g].ring_index &&
           got.groups[g].state == want.groups[g].state;
  }
  if (same) return ::testing::AssertionSuccess();
  auto describe = [&os](const SnapshotInfo& s) {
    os << "{id " << s.id << " seq " << s.seq << " [" << s.from << ", " << s.to << ") bytes "
       << s.bytes << " tokens " << s.tokens << " groups";
    for (const SnapshotGroupInfo& g : s.groups) {
      os << " (stored " << g.stored << " ring " << g.ring_index << " " << StateName(g.state) << ")";
    }
    os << "}";
  };
  os << "snapshot ";
  describe(got);
  os << ", model ";
  describe(want);
  return ::testing::AssertionFailure() << os.str();
}

// ---- random specs and operations -----------------------------------------------------------

std::string DescribeRope(const RopeSpec& rope) {
  static const char* kRopes[] = {"NONE", "NORMAL", "NEOX"};
  std::ostringstream os;
  os << " rope=" << kRopes[static_cast<int>(rope.type)];
  if (rope.type != RopeType::kNone) {
    os << "(dims=" << rope.dims << ",base=" << rope.base << ",freq_scale=" << rope.freq_scale
       << ")";
  }
  return os.str();
}

std::string Describe(const CacheSpec& spec) {
  static const char* kDtypes[] = {"F32", "F16", "BF16"};
  std::ostringstream os;
  os << kDtypes[static_cast<int>(spec.dtype)] << " max_sequences=" << spec.max_sequences
     << " capacity=" << spec.capacity << " max_batch=" << spec.max_batch
     << " token_block_size=" << spec.token_block_size;
  for (const GroupSpec& g : spec.groups) {
    os << " | layers=" << g.num_layers << " ";
    switch (g.kind) {
      case GroupKind::kAttention: {
        const AttentionSpec& a = g.attention;
        os << "ATTENTION heads=" << a.num_kv_heads << " k=" << a.head_dim_k << " v=" << a.head_dim_v
           << " ";
        switch (a.window.kind) {
          case WindowKind::kFull:
            os << "FULL";
            break;
          case WindowKind::kSliding:
            os << "SLIDING(window=" << a.window.window << ",memory=" << a.window.memory << ")";
            break;
          case WindowKind::kChunked:
            os << "CHUNKED(" << a.window.chunk << ")";
            break;
        }
        os << DescribeRope(a.rope);
        break;
      }
      case GroupKind::kRotating: {
        const RotatingSpec& r = g.rotating;
        os << "ROTATING heads=" << r.num_kv_heads << " k=" << r.head_dim_k << " v=" << r.head_dim_v
           << " max_size=" << r.max_size << DescribeRope(r.rope);
        break;
      }
      case GroupKind::kRecurrent: {
        const RecurrentSpec& r = g.recurrent;
        os << "RECURRENT conv=" << r.conv_tail << "x" << r.conv_dim << " delta=" << r.num_v_heads
           << "x" << r.head_v_dim << "x" << r.head_k_dim;
        break;
      }
    }
  }
  return os.str();
}

RopeSpec RandomRope(Rng& rng, int32_t head_dim_k) {
  RopeSpec rope;
  const int64_t r = rng.Below(10);
  if (r >= 3) {
    rope.type = r < 7 ? RopeType::kNormal : RopeType::kNeox;
    rope.dims = static_cast<int32_t>(2 * rng.Between(1, head_dim_k / 2));
    rope.base = rng.Chance(50) ? 10000.0f : (rng.Chance(50) ? 100.0f : 1e6f);
    rope.freq_scale = rng.Chance(60) ? 1.0f : (rng.Chance(50) ? 0.5f : 2.0f);
  }
  return rope;
}

GroupSpec RandomAttention(Rng& rng, const CacheSpec& spec) {
  GroupSpec g;
  g.kind = GroupKind::kAttention;
  g.num_layers = static_cast<int32_t>(rng.Between(1, 2));
  AttentionSpec& a = g.attention;
  a.num_kv_heads = static_cast<int32_t>(rng.Between(1, 2));
  a.head_dim_k = static_cast<int32_t>(2 * rng.Between(1, 4));
  a.head_dim_v = static_cast<int32_t>(rng.Between(1, 4));
  switch (rng.Below(3)) {
    case 0:
      break;
    case 1: {
      a.window.kind = WindowKind::kSliding;
      a.window.window = static_cast<int32_t>(rng.Between(1, 8));
      switch (rng.Below(4)) {
        case 0:
          a.window.memory = 0;
          break;
        case 1:
          a.window.memory = a.window.window;
          break;
        case 2:
          a.window.memory = a.window.window + static_cast<int32_t>(rng.Between(1, 6));
          break;
        default:
          // memory >= capacity: unlimited.
          a.window.memory =
              std::max(a.window.window, spec.capacity + static_cast<int32_t>(rng.Below(2)));
          break;
      }
      break;
    }
    default:
      a.window.kind = WindowKind::kChunked;
      a.window.chunk = static_cast<int32_t>(rng.Between(1, 8));
      break;
  }
  a.rope = RandomRope(rng, a.head_dim_k);
  return g;
}

GroupSpec RandomRotating(Rng& rng, const CacheSpec& spec) {
  GroupSpec g;
  g.kind = GroupKind::kRotating;
  g.num_layers = static_cast<int32_t>(rng.Between(1, 2));
  RotatingSpec& r = g.rotating;
  r.num_kv_heads = static_cast<int32_t>(rng.Between(1, 2));
  r.head_dim_k = static_cast<int32_t>(2 * rng.Between(1, 4));
  r.head_dim_v = static_cast<int32_t>(rng.Between(1, 4));
  // Small rings so that they wrap often.
  r.max_size = static_cast<int32_t>(rng.Between(1, std::min(spec.capacity, 6)));
  r.rope = RandomRope(rng, r.head_dim_k);
  return g;
}

GroupSpec RandomRecurrent(Rng& rng) {
  GroupSpec g;
  g.kind = GroupKind::kRecurrent;
  g.num_layers = static_cast<int32_t>(rng.Between(1, 2));
  RecurrentSpec& r = g.recurrent;
  r.conv_tail = static_cast<int32_t>(rng.Between(1, 3));
  r.conv_dim = static_cast<int32_t>(rng.Between(1, 4));
  if (rng.Chance(50)) {
    r.num_v_heads = static_cast<int32_t>(rng.Between(1, 2));
    r.head_v_dim = static_cast<int32_t>(rng.Between(1, 3));
    r.head_k_dim = static_cast<int32_t>(rng.Between(1, 3));
  }
  return g;
}

// Small blocks, so that short sequences fill several and their hashes chain.
int32_t RandomTokenBlockSize(Rng& rng) { return static_cast<int32_t>(rng.Between(1, 5)); }

CacheSpec RandomSpec(Rng& rng) {
  CacheSpec spec;
  spec.name = "model";
  spec.dtype = static_cast<DType>(rng.Below(3));
  spec.max_sequences = static_cast<int32_t>(rng.Between(1, 4));
  spec.capacity = static_cast<int32_t>(rng.Between(4, 20));
  spec.max_batch = static_cast<int32_t>(rng.Between(1, 8));
  if (rng.Chance(45)) {  // Attention only
    const int num_groups = static_cast<int>(rng.Between(1, 3));
    for (int i = 0; i < num_groups; ++i) spec.groups.push_back(RandomAttention(rng, spec));
    spec.token_block_size = RandomTokenBlockSize(rng);
    return spec;
  }
  // Hybrid: at least one Rotating or Recurrent group.
  const int num_groups = static_cast<int>(rng.Between(1, 4));
  const int special = static_cast<int>(rng.Below(num_groups));
  for (int i = 0; i < num_groups; ++i) {
    int64_t kind = rng.Below(3);
    if (i == special && kind == 0) kind = rng.Between(1, 2);
    switch (kind) {
      case 0:
        spec.groups.push_back(RandomAttention(rng, spec));
        break;
      case 1:
        spec.groups.push_back(RandomRotating(rng, spec));
        break;
      default:
        spec.groups.push_back(RandomRecurrent(rng));
        break;
    }
  }
  spec.token_block_size = RandomTokenBlockSize(rng);
  return spec;
}

std::string TokensToString(const std::vector<Token>& tokens) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < tokens.size(); ++i) {
    os << (i ? " " : "") << tokens[i].seq << ":" << tokens[i].pos;
    if (tokens[i].id != kNoTokenId) os << "#" << tokens[i].id;
  }
  os << "]";
  return os.str();
}

std::string OptEnd(std::optional<int32_t> end) {
  return end.has_value() ? std::to_string(*end) : std::string("none");
}

class Episode {
 public:
  // One episode in 16 has no snapshot pool: every Snapshot that copies data is then
  // RESOURCE_EXHAUSTED. In one episode in 3 every token carries an id, so that sequences keep
  // long ids (in the others a batch without them ends a sequence's ids).
  Episode(uint64_t seed, const CacheSpec& spec)
      : rng_(seed),
        spec_(spec),
        model_(spec),
        memo_(spec_),
        no_snapshot_pool_(Mix64(seed ^ 0xB0D6E7) % 16 == 0),
        always_ids_(Mix64(seed ^ 0x1D5) % 3 == 0),
        device_(
            testutil::MakeTestDevice(size_t{1} << 30, no_snapshot_pool_ ? 0 : size_t{1} << 30)) {
    // A pool of sequence ids: more than max_sequences, one of them beyond 32 bits.
    pool_ = {0, 1, 2, 5, int64_t{1} << 33};
    pool_.resize(std::min<size_t>(pool_.size(), spec.max_sequences + 2));
  }

  ::testing::AssertionResult Run(int steps) {
    absl::StatusOr<std::unique_ptr<Cache>> created = Cache::Create(spec_, device_.get());
    if (!created.ok()) return ::testing::AssertionFailure() << "Create: " << created.status();
    cache_ = std::move(created).value();
    // Chains are hashed in the spec's blocks, seeded by the (default) tenant and cache name.
    const TokenHasher& hasher = cache_->token_hasher();
    if (hasher.block_size != spec_.token_block_size || hasher.bits != 64 ||
        hasher.seed != TokenHashSeed(kDefaultTenant, spec_.name)) {
      return ::testing::AssertionFailure()
             << "token hasher block_size " << hasher.block_size << " bits " << hasher.bits;
    }
    ::testing::AssertionResult initial = CompareAll();
    if (!initial) return initial << "\nin the empty cache";
    for (int step = 0; step < steps; ++step) {
      ::testing::AssertionResult r = Step();
      if (r) r = CompareAll();
      if (!r) {
        std::ostringstream os;
        os << "\nat step " << step << ", operations so far:";
        for (const std::string& line : log_) os << "\n  " << line;
        return r << os.str();
      }
    }
    for (const auto& [k, v] : model_.token_events) outcomes[k] += v;
    // Destroying the cache returns every byte, its snapshots' included.
    cache_.reset();
    if (device_->used_bytes(MemoryPool::kCache) != 0 ||
        device_->used_bytes(MemoryPool::kSnapshot) != 0) {
      return ::testing::AssertionFailure()
             << "after the cache is destroyed the device holds "
             << device_->used_bytes(MemoryPool::kCache) << " cache and "
             << device_->used_bytes(MemoryPool::kSnapshot) << " snapshot bytes";
    }
    return ::testing::AssertionSuccess();
  }

  // Counts of each outcome, to make sure the episodes reach the interesting states.
  std::map<std::string, int> outcomes;

 private:
  int64_t PickSeq() {
    if (rng_.Chance(5)) return 9;  // never used by Append: always unknown
    return rng_.Pick(pool_);
  }

  int64_t PickLiveSeq() {
    const std::set<int64_t> live = model_.Live();
    if (live.empty() || rng_.Chance(20)) return PickSeq();
    return rng_.Pick(std::vector<int64_t>(live.begin(), live.end()));
  }

  int32_t PosLimit() const { return 2 * spec_.capacity; }

  ::testing::AssertionResult Check(const std::string& what, const Codes& want,
                                   const absl::Status& got) {
    log_.push_back(what + " -> " + std::string(CodeName(got.code())));
    outcomes[what.substr(0, what.find('(')) + " " + CodeName(got.code())]++;
    if (!want.Allows(got.code())) {
      return ::testing::AssertionFailure()
             << what << " returned " << got << ", the model expects " << want.ToString();
    }
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult Step() {
    const int64_t r = rng_.Below(104);
    if (r < 33) return StepAppend();
    if (r < 40) return StepCommit();
    if (r < 49) return StepCopyPrefix();
    if (r < 62) return StepRemove();
    if (r < 67) return StepRead();
    if (r < 71) return StepVisible();
    if (r < 75) return StepCanResume();
    if (r < 81) return StepSnapshot();
    if (r < 84) return StepReserve();
    if (r < 92) return StepRestore();
    if (r < 95) return StepMerge();
    if (r < 98) return StepSplit();
    if (r < 100) return StepDrop();
    if (r < 102) return StepImage();
    return StepTransfer();
  }

  ::testing::AssertionResult StepAppend() {
    const bool speculative = rng_.Chance(22);
    // Mostly live sequences (so max_sequences is not what stops most batches), sometimes any;
    // a plain Append mostly to sequences without pending tokens.
    const std::set<int64_t> live = model_.Live();
    const bool any = live.empty() || rng_.Chance(30);
    std::vector<int64_t> candidates = any ? pool_ : std::vector<int64_t>(live.begin(), live.end());
    if (!speculative && rng_.Chance(85)) {
      std::vector<int64_t> idle;
      for (int64_t s : candidates) {
        if (model_.PendingCount(s) == 0) idle.push_back(s);
      }
      if (!idle.empty()) candidates = idle;
    }
    std::vector<int64_t> seqs;
    const int nseq = static_cast<int>(rng_.Between(1, std::min<int64_t>(3, candidates.size())));
    while (static_cast<int>(seqs.size()) < nseq) {
      const int64_t s = rng_.Pick(candidates);
      if (std::find(seqs.begin(), seqs.end(), s) == seqs.end()) seqs.push_back(s);
    }
    // Positions per sequence, increasing; in contiguous caches mostly exactly at the offset.
    const bool contiguous = model_.contiguous();
    std::vector<std::vector<int32_t>> per_seq(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int32_t offset = model_.Offset(seqs[i]);
      int32_t start;
      int max_count = spec_.max_batch;
      const int64_t kind = rng_.Below(contiguous ? 40 : 10);
      if (kind < 6 || kind >= 10) {
        start = offset;
      } else if (kind < 8) {
        start = offset + static_cast<int32_t>(rng_.Between(1, 4));
      } else if (kind < 9) {
        start = static_cast<int32_t>(rng_.Below(PosLimit()));
      } else {
        // Below the offset: mostly where nothing is stored (a gap, or what a window pruned), so
        // that such positions are stored again, below ids the sequence has.
        std::vector<int32_t> holes;
        for (int32_t p = 0; p < offset; ++p) {
          if (!model_.StoredAnywhere(seqs[i], p)) holes.push_back(p);
        }
        if (!holes.empty() && rng_.Chance(70)) {
          // Mostly no further than the hole reaches.
          start = rng_.Pick(holes);
          int32_t end = start;
          while (end < offset && !model_.StoredAnywhere(seqs[i], end)) ++end;
          if (end < offset) max_count = std::min(max_count, end - start);
        } else {
          start = static_cast<int32_t>(rng_.Below(std::max<int32_t>(offset, 1)));
        }
      }
      const int count = static_cast<int>(rng_.Between(1, max_count));
      int32_t pos = start;
      for (int k = 0; k < count; ++k) {
        per_seq[i].push_back(pos);
        pos += rng_.Chance(contiguous ? 98 : 85) ? 1 : 2;
      }
    }
    // Interleave, keeping each sequence's order.
    std::vector<Token> tokens;
    std::vector<size_t> next(seqs.size(), 0);
    for (;;) {
      std::vector<size_t> open;
      for (size_t i = 0; i < seqs.size(); ++i) {
        if (next[i] < per_seq[i].size()) open.push_back(i);
      }
      if (open.empty()) break;
      const size_t i = rng_.Pick(open);
      tokens.push_back(Token{seqs[i], per_seq[i][next[i]++]});
    }
    // Mostly within max_batch; sometimes one more.
    const size_t limit = spec_.max_batch + (rng_.Chance(5) ? 1 : 0);
    if (tokens.size() > limit) tokens.resize(limit);
    // Token ids: mostly on every token, sometimes on some, sometimes on none. They come from a
    // small alphabet and are mostly a function of the position, so that sequences often share
    // prefixes (a snapshot restored into another sequence then finds the same ids below its
    // start, or not).
    const int64_t with_ids = always_ids_ ? 0 : rng_.Below(100);
    for (Token& t : tokens) {
      if (with_ids >= 85 || (with_ids >= 70 && rng_.Chance(50))) continue;
      t.id = static_cast<int32_t>(rng_.Chance(60) ? (t.pos / 2) % 4 : rng_.Below(4));
    }

    int payload_fault = 0;
    if (rng_.Chance(12)) {
      switch (rng_.Below(7)) {
        case 0: {  // duplicate a token
          const size_t i = rng_.Below(tokens.size());
          tokens.insert(tokens.begin() + i, tokens[i]);
          break;
        }
        case 1: {  // a position out of order: swap the first two of one sequence
          for (size_t a = 0; a < tokens.size(); ++a) {
            for (size_t b = a + 1; b < tokens.size(); ++b) {
              if (tokens[a].seq == tokens[b].seq) {
                std::swap(tokens[a].pos, tokens[b].pos);
                a = b = tokens.size();
              }
            }
          }
          break;
        }
        case 2:
          tokens[rng_.Below(tokens.size())].pos = -1 - static_cast<int32_t>(rng_.Below(3));
          break;
        case 3:
          tokens[rng_.Below(tokens.size())].seq = -1;
          break;
        case 4:
          payload_fault = static_cast<int>(rng_.Between(1, 4));
          break;
        case 5:  // a negative id other than kNoTokenId
          tokens[rng_.Below(tokens.size())].id = -2 - static_cast<int32_t>(rng_.Below(3));
          break;
        default:
          tokens.clear();
          break;
      }
    }
    std::vector<uint64_t> ids;
    for (size_t i = 0; i < tokens.size(); ++i) ids.push_back(next_id_++);
    // Recurrent states: one per distinct sequence (first appearance), or one per token.
    std::vector<uint64_t> state_ids;
    std::vector<int64_t> distinct;
    for (const Token& t : tokens) {
      if (std::find(distinct.begin(), distinct.end(), t.seq) == distinct.end()) {
        distinct.push_back(t.seq);
      }
    }
    const size_t num_states = speculative ? tokens.size() : distinct.size();
    for (size_t i = 0; i < num_states; ++i) state_ids.push_back(next_id_++);
    std::vector<uint64_t> payload_states = state_ids;
    std::vector<uint64_t> payload_ids = ids;
    if (payload_fault == 3 && !payload_ids.empty()) payload_ids.pop_back();
    if (payload_fault == 4) {  // the other layout's number of states
      const size_t other = speculative ? distinct.size() : tokens.size();
      payload_states.resize(other, next_id_++);
    }
    std::vector<uint8_t> payload = testutil::AppendPayload(spec_, payload_ids, payload_states);
    if (payload_fault == 1) payload.push_back(0x7F);
    if (payload_fault == 2 && !payload.empty()) payload.pop_back();
    const bool payload_ok = payload.size() == ExpectedPayloadBytes(spec_, tokens, speculative);
    std::string what =
        std::string(speculative ? "AppendSpeculative(" : "Append(") + TokensToString(tokens) + ")";
    if (payload_fault != 0) what += " payload fault " + std::to_string(payload_fault);
    // The payload as one span, in pieces, or piece by piece through an AppendWriter: the same
    // Append whichever way it comes.
    std::vector<absl::Span<const uint8_t>> pieces;
    const int64_t way = rng_.Below(100);
    if (way >= 70) {
      size_t at = 0;
      const int cuts = static_cast<int>(rng_.Between(0, 2));
      for (int k = 0; k < cuts && at < payload.size(); ++k) {
        const size_t n = 1 + static_cast<size_t>(rng_.Below(payload.size() - at));
        pieces.push_back(absl::MakeConstSpan(payload).subspan(at, n));
        at += n;
      }
      pieces.push_back(absl::MakeConstSpan(payload).subspan(at));
      what += way < 85 ? " in " : " through a writer in ";
      what += std::to_string(pieces.size()) + " pieces";
      ++outcomes[way < 85 ? "appends in pieces" : "appends through a writer"];
    }
    const Codes want = model_.Append(tokens, ids, state_ids, speculative, payload_ok);
    absl::Status got;
    if (way < 70) {
      got = cache_->Append(tokens, payload, speculative);
    } else if (way < 85) {
      got = cache_->AppendPieces(tokens, pieces, speculative);
    } else {
      got = AppendThroughWriter(tokens, pieces, speculative);
    }
    return Check(what, want, got);
  }

  absl::Status AppendThroughWriter(const std::vector<Token>& tokens,
                                   const std::vector<absl::Span<const uint8_t>>& pieces,
                                   bool speculative) {
    size_t bytes = 0;
    for (absl::Span<const uint8_t> piece : pieces) bytes += piece.size();
    absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
        Cache::BeginAppend(cache_, tokens, bytes, speculative);
    if (!writer.ok()) return writer.status();
    for (absl::Span<const uint8_t> piece : pieces) {
      const absl::Status written = (*writer)->Write(piece);
      if (!written.ok()) return written;
    }
    return (*writer)->Commit();
  }

  ::testing::AssertionResult StepCommit() {
    int64_t seq = PickSeq();
    std::vector<int64_t> with_pending;
    for (int64_t s : pool_) {
      if (model_.PendingCount(s) > 0) with_pending.push_back(s);
    }
    if (!with_pending.empty() && rng_.Chance(80)) seq = rng_.Pick(with_pending);
    const int32_t pending = model_.PendingCount(seq);
    int32_t accepted = static_cast<int32_t>(rng_.Between(0, pending));
    if (rng_.Chance(8)) accepted = -1;
    if (rng_.Chance(8)) accepted = pending + 1;
    if (rng_.Chance(2)) seq = -1;
    const std::string what =
        "CommitSpeculation(" + std::to_string(seq) + ", " + std::to_string(accepted) + ")";
    const Codes want = model_.CommitSpeculation(seq, accepted);
    return Check(what, want, cache_->CommitSpeculation(seq, accepted));
  }

  ::testing::AssertionResult StepCopyPrefix() {
    int64_t src = PickLiveSeq();
    int64_t dst = PickSeq();
    if (rng_.Chance(5)) dst = src;
    const int32_t offset = model_.Offset(src);
    int32_t length = static_cast<int32_t>(rng_.Below(offset + 3));
    if (model_.contiguous() && rng_.Chance(50)) {
      length = offset + static_cast<int32_t>(rng_.Below(2));
    }
    if (rng_.Chance(3)) length = -1;
    if (rng_.Chance(2)) src = -1;
    // A scheduler's precondition, around what src reaches (as a stale index would have it).
    int32_t require = 0;
    if (rng_.Chance(30)) require = std::max(1, offset - 1 + static_cast<int32_t>(rng_.Below(3)));
    if (rng_.Chance(1)) require = -1;
    const std::string what = "CopyPrefix(" + std::to_string(src) + ", " + std::to_string(dst) +
                             ", " + std::to_string(length) + ", " + std::to_string(require) + ")";
    const Codes want = model_.CopyPrefix(src, dst, length, require);
    const absl::StatusOr<int32_t> got = cache_->CopyPrefix(src, dst, length, require);
    ::testing::AssertionResult checked = Check(what, want, got.status());
    if (checked && got.ok() && *got != model_.Offset(dst)) {
      return ::testing::AssertionFailure() << what << " returned offset " << *got
                                           << ", the model's dst offset is " << model_.Offset(dst);
    }
    return checked;
  }

  // A room reservation for some sequence (live or not), up to a few positions past its offset;
  // sometimes a drop (0) or a bad count. It never expires during the episode.
  ::testing::AssertionResult StepReserve() {
    const int64_t seq = PickSeq();
    int32_t positions =
        model_.Offset(seq) + static_cast<int32_t>(rng_.Below(spec_.capacity / 2 + 1));
    if (rng_.Chance(15)) positions = 0;
    if (rng_.Chance(3)) positions = -1;
    const std::string what =
        "Reserve(" + std::to_string(seq) + ", " + std::to_string(positions) + ")";
    const Codes want = model_.Reserve(seq, positions);
    return Check(what, want, cache_->Reserve(seq, positions, absl::Now() + absl::Hours(24)));
  }

  ::testing::AssertionResult StepRemove() {
    int64_t seq = PickLiveSeq();
    const int32_t offset = model_.Offset(seq);
    int32_t begin = 0;
    std::optional<int32_t> end;
    const int64_t kind = rng_.Below(20);
    if (kind < 6) {  // truncate
      begin = static_cast<int32_t>(rng_.Below(offset + 2));
    } else if (kind < 16) {  // middle
      begin = static_cast<int32_t>(rng_.Below(offset + 1));
      end = begin + static_cast<int32_t>(rng_.Between(1, std::max(1, offset - begin + 1)));
    } else if (kind < 17) {  // begin > end
      begin = static_cast<int32_t>(rng_.Between(1, offset + 1));
      end = begin - static_cast<int32_t>(rng_.Between(1, begin));
    } else if (kind < 18) {  // empty range
      begin = static_cast<int32_t>(rng_.Below(offset + 1));
      end = begin;
    } else if (kind < 19) {  // negative
      begin = -1;
      if (rng_.Chance(50)) end = 3;
      if (rng_.Chance(30)) {
        begin = 0;
        seq = -2;
      }
    } else {  // everything
      begin = 0;
    }
    const std::string what =
        "Remove(" + std::to_string(seq) + ", " + std::to_string(begin) + ", " + OptEnd(end) + ")";
    const Codes want = model_.Remove(seq, begin, end);
    return Check(what, want, cache_->Remove(seq, begin, end));
  }

  std::vector<WantGroup> WantRead(int64_t seq, int32_t begin, std::optional<int32_t> end) {
    std::vector<WantGroup> want(spec_.groups.size());
    for (size_t g = 0; g < spec_.groups.size(); ++g) {
      if (spec_.groups[g].kind == GroupKind::kRecurrent) {
        want[g].state = model_.ReadState(static_cast<int>(g), seq, end, &want[g].state_id,
                                         &want[g].alternative);
      } else {
        want[g].rows = model_.Rows(static_cast<int>(g), seq, begin, end);
      }
    }
    return want;
  }

  ::testing::AssertionResult StepRead() {
    int64_t seq = PickLiveSeq();
    const int32_t offset = model_.Offset(seq);
    int32_t begin = static_cast<int32_t>(rng_.Below(offset + 2));
    std::optional<int32_t> end;
    if (rng_.Chance(60)) end = begin + static_cast<int32_t>(rng_.Below(offset + 2));
    if (rng_.Chance(4)) begin = -1;
    if (rng_.Chance(4)) end = begin - 1;
    if (rng_.Chance(2)) seq = -1;
    const std::string what =
        "Read(" + std::to_string(seq) + ", " + std::to_string(begin) + ", " + OptEnd(end) + ")";
    const Codes want = model_.ReadCode(seq, begin, end);
    absl::StatusOr<ReadResult> got = cache_->Read(seq, begin, end);
    ::testing::AssertionResult r = Check(what, want, got.status());
    if (!r || !got.ok()) return r;
    r = CompareRead(spec_, memo_, *got, WantRead(seq, begin, end));
    if (!r) return r << " in " << what;
    return r;
  }

  Query RandomQuery(int64_t seq) {
    const int32_t offset = model_.Offset(seq);
    Query q;
    q.seq = seq;
    switch (rng_.Below(5)) {
      case 0:
        q.pos = 0;
        break;
      case 1:
        q.pos = std::max(0, offset - 1);
        break;
      case 2:
        q.pos = offset;
        break;
      case 3:
        q.pos = offset + 1;
        break;
      default:
        q.pos = static_cast<int32_t>(rng_.Below(PosLimit() + 4));
        break;
    }
    q.non_causal = rng_.Chance(25);
    return q;
  }

  ::testing::AssertionResult StepVisible() {
    int group = static_cast<int>(rng_.Below(spec_.groups.size()));
    if (rng_.Chance(4)) group = rng_.Chance(50) ? -1 : static_cast<int>(spec_.groups.size());
    std::vector<Query> queries;
    const int n = static_cast<int>(rng_.Between(1, 4));
    for (int i = 0; i < n; ++i) queries.push_back(RandomQuery(PickSeq()));
    if (rng_.Chance(4)) queries.back().pos = -1;
    if (rng_.Chance(3)) queries.front().seq = -1;
    bool valid = group >= 0 && group < static_cast<int>(spec_.groups.size());
    for (const Query& q : queries) valid = valid && q.seq >= 0 && q.pos >= 0;
    const std::string what = "Visible(group " + std::to_string(group) + ", " +
                             std::to_string(queries.size()) + " queries)";
    // Through the admission check, whose bound must cover what is listed (the node refuses
    // requests by it before any work).
    int64_t bound = -1;
    absl::StatusOr<std::vector<std::vector<int32_t>>> got =
        cache_->Visible(group, queries, [&bound](int64_t b) {
          bound = b;
          return absl::OkStatus();
        });
    if (got.ok()) {
      int64_t listed = 0;
      for (const std::vector<int32_t>& v : *got) listed += static_cast<int64_t>(v.size());
      if (listed > bound) {
        return ::testing::AssertionFailure()
               << what << " listed " << listed << " positions, more than its bound " << bound;
      }
    }
    Codes want = valid ? kOk : kInvalid;
    // A Recurrent group has no positions; the documents do not say whether Visible on one is an
    // empty answer or INVALID_ARGUMENT.
    if (valid && spec_.groups[group].kind == GroupKind::kRecurrent) {
      want = Codes(std::vector<absl::StatusCode>{kOk, kInvalid});
    }
    ::testing::AssertionResult r = Check(what, want, got.status());
    if (!r || !got.ok()) return r;
    return CompareVisible(group, queries, *got);
  }

  ::testing::AssertionResult CompareVisible(int group, const std::vector<Query>& queries,
                                            const std::vector<std::vector<int32_t>>& got) {
    if (got.size() != queries.size()) {
      return ::testing::AssertionFailure()
             << "Visible answered " << got.size() << " of " << queries.size() << " queries";
    }
    for (size_t i = 0; i < queries.size(); ++i) {
      const std::vector<int32_t> want = model_.Visible(group, queries[i]);
      if (got[i] != want) {
        std::ostringstream os;
        os << "Visible(group " << group << ", seq " << queries[i].seq << ", pos " << queries[i].pos
           << (queries[i].non_causal ? ", non-causal" : "") << ") = {";
        for (int32_t p : got[i]) os << p << ",";
        os << "}, model {";
        for (int32_t p : want) os << p << ",";
        os << "}";
        return ::testing::AssertionFailure() << os.str();
      }
    }
    return ::testing::AssertionSuccess();
  }

  // The same queries answered in ranges: maximal, ascending, the model's positions when
  // expanded, and no more of them than the bound handed to admission.
  ::testing::AssertionResult CompareVisibleRanges(int group, const std::vector<Query>& queries) {
    int64_t bound = -1;
    absl::StatusOr<std::vector<std::vector<PositionRange>>> got =
        cache_->VisibleRanges(group, queries, [&bound](int64_t b) {
          bound = b;
          return absl::OkStatus();
        });
    if (!got.ok()) return ::testing::AssertionFailure() << "VisibleRanges: " << got.status();
    std::vector<std::vector<int32_t>> expanded;
    int64_t listed = 0;
    for (const std::vector<PositionRange>& ranges : *got) {
      listed += static_cast<int64_t>(ranges.size());
      std::vector<int32_t>& positions = expanded.emplace_back();
      for (size_t i = 0; i < ranges.size(); ++i) {
        if (ranges[i].first > ranges[i].last ||
            (i > 0 && int64_t{ranges[i].first} <= int64_t{ranges[i - 1].last} + 1)) {
          return ::testing::AssertionFailure()
                 << "VisibleRanges: range " << i << " [" << ranges[i].first << ", "
                 << ranges[i].last << "] is empty, out of order or not maximal";
        }
        for (int64_t p = ranges[i].first; p <= ranges[i].last; ++p) {
          positions.push_back(static_cast<int32_t>(p));
        }
      }
    }
    if (listed > bound) {
      return ::testing::AssertionFailure()
             << "VisibleRanges listed " << listed << " ranges, more than its bound " << bound;
    }
    ++outcomes["Visible in ranges compared"];
    return CompareVisible(group, queries, expanded);
  }

  ::testing::AssertionResult CompareCanResume(int64_t seq, int32_t pos, bool got) {
    const bool want = model_.CanResume(seq, pos);
    if (got != want) {
      return ::testing::AssertionFailure()
             << "CanResume(" << seq << ", " << pos << ") = " << got << ", model says " << want;
    }
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult StepCanResume() {
    int64_t seq = PickSeq();
    int32_t pos = RandomQuery(seq).pos;
    if (rng_.Chance(4)) pos = -1;
    if (rng_.Chance(3)) seq = -1;
    const std::string what = "CanResume(" + std::to_string(seq) + ", " + std::to_string(pos) + ")";
    const bool valid = seq >= 0 && pos >= 0;
    absl::StatusOr<bool> got = cache_->CanResume(seq, pos);
    ::testing::AssertionResult r = Check(what, valid ? kOk : kInvalid, got.status());
    if (!r || !got.ok()) return r;
    return CompareCanResume(seq, pos, *got);
  }

  // ---- snapshots ----

  std::vector<uint64_t> SnapshotIds() const {
    std::vector<uint64_t> ids;
    for (const auto& entry : model_.snapshots()) ids.push_back(entry.first);
    return ids;
  }

  uint64_t PickSnapshotId() {
    const std::vector<uint64_t> ids = SnapshotIds();
    if (ids.empty() || rng_.Chance(8)) {
      return rng_.Chance(30) ? 0 : max_issued_ + 1 + static_cast<uint64_t>(rng_.Below(3));
    }
    return rng_.Pick(ids);
  }

  // A new id from the engine must be unused so far: ids start at 1 and are never reused.
  ::testing::AssertionResult CheckNewId(uint64_t id) {
    if (max_issued_ == 0 ? id != 1 : id <= max_issued_) {
      return ::testing::AssertionFailure()
             << "new snapshot id " << id << " after ids up to " << max_issued_;
    }
    max_issued_ = id;
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult StepSnapshot() {
    int64_t seq = PickLiveSeq();
    const int32_t offset = model_.Offset(seq);
    int32_t from = static_cast<int32_t>(rng_.Below(std::max(offset, 1)));
    const int64_t kind = rng_.Below(100);
    if (kind < 25) {
      // Continue a snapshot of this sequence, so that MergeSnapshots finds matching pairs;
      // sometimes one of another sequence, whose ids may differ below the start.
      const bool any = rng_.Chance(40);
      for (const auto& [id, s] : model_.snapshots()) {
        if ((any || s.seq == seq) && s.to < offset) from = s.to;
      }
    } else if (kind < 35) {
      from = 0;
    } else if (kind < 42) {
      from = offset;
    } else if (kind < 45) {
      from = offset + 1;
    } else if (kind < 48) {
      from = -1;
    } else if (const TokenRef* chain = model_.Tokens(seq); chain != nullptr && chain->taint > 0 &&
                                                           chain->taint != kNoTaint &&
                                                           rng_.Chance(50)) {
      from = static_cast<int32_t>(rng_.Below(chain->taint));  // ids tainted past the start
    }
    if (rng_.Chance(2)) seq = -1;
    const std::string what = "Snapshot(" + std::to_string(seq) + ", " + std::to_string(from) + ")";
    ModelSnapshot snap;
    Codes want = model_.Snapshot(seq, from, &snap);
    if (want.ok() && no_snapshot_pool_) {
      // Whether a snapshot of no bytes needs an allocation is not specified.
      want = ExpectedInfo(spec_, 0, snap).bytes > 0
                 ? Codes(kExhausted)
                 : Codes(std::vector<absl::StatusCode>{kOk, kExhausted});
    }
    absl::StatusOr<SnapshotInfo> got = cache_->Snapshot(seq, from);
    ::testing::AssertionResult r = Check(what, want, got.status());
    if (!r || !got.ok()) return r;
    log_.back() += " id " + std::to_string(got->id);
    r = CheckNewId(got->id);
    if (r) r = CompareSnapshotInfo(*got, ExpectedInfo(spec_, got->id, snap));
    if (!r) return r << " in " << what;
    model_.AddSnapshot(got->id, std::move(snap));
    return r;
  }

  ::testing::AssertionResult StepRestore() {
    std::optional<uint64_t> id;
    if (!rng_.Chance(25)) id = PickSnapshotId();
    // Often the newest snapshot (of a merge, a split or an import, say): a restore is where the
    // ids a snapshot keeps show.
    if (id.has_value() && !model_.snapshots().empty() && rng_.Chance(30)) {
      id = model_.snapshots().rbegin()->first;
    }
    int64_t seq = PickSeq();
    const auto snap = id.has_value() ? model_.snapshots().find(*id) : model_.snapshots().end();
    const bool known = snap != model_.snapshots().end();
    if (known && rng_.Chance(50)) seq = snap->second.seq;  // back into its own sequence
    const int32_t offset = model_.Offset(seq);
    int32_t target = 0;
    const int64_t kind = rng_.Below(100);
    if (known) {
      const ModelSnapshot& s = snap->second;
      if (kind < 55) {
        target = s.to;
      } else if (kind < 75) {
        target = static_cast<int32_t>(rng_.Between(0, s.to));
      } else if (kind < 83) {
        target = s.to + 1;
      } else if (kind < 90) {
        target = s.from;
      } else if (kind < 94) {
        target = -1;
      } else {
        target = static_cast<int32_t>(rng_.Below(s.to + 3));
      }
    } else {
      if (kind < 40) {
        target = offset;
      } else if (kind < 75) {
        target = static_cast<int32_t>(rng_.Below(offset + 1));
      } else if (kind < 85) {
        target = offset + 1;
      } else if (kind < 95) {
        target = 0;
      } else {
        target = -1;
      }
    }
    if (rng_.Chance(2)) seq = -1;
    const std::string what = "Restore(" + std::to_string(seq) + ", " +
                             (id.has_value() ? "snapshot " + std::to_string(*id) : "none") + ", " +
                             std::to_string(target) + ")";
    const Codes want = model_.Restore(seq, id, target);
    return Check(what, want, cache_->Restore(seq, id, target));
  }

  ::testing::AssertionResult StepMerge() {
    uint64_t parent = PickSnapshotId();
    uint64_t child = PickSnapshotId();
    if (rng_.Chance(60)) {
      std::vector<std::pair<uint64_t, uint64_t>> pairs;
      for (const auto& [a, sa] : model_.snapshots()) {
        for (const auto& [b, sb] : model_.snapshots()) {
          if (a != b && sa.to == sb.from) pairs.emplace_back(a, b);
        }
      }
      if (!pairs.empty()) std::tie(parent, child) = rng_.Pick(pairs);
    }
    if (rng_.Chance(4)) child = parent;
    return Merge(parent, child);
  }

  ::testing::AssertionResult Merge(uint64_t parent, uint64_t child) {
    const std::string what =
        "MergeSnapshots(" + std::to_string(parent) + ", " + std::to_string(child) + ")";
    ModelSnapshot merged;
    const Codes want = model_.Merge(parent, child, &merged);
    absl::StatusOr<SnapshotInfo> got = cache_->MergeSnapshots(parent, child);
    ::testing::AssertionResult r = Check(what, want, got.status());
    if (!r || !got.ok()) return r;
    log_.back() += " id " + std::to_string(got->id);
    r = CheckNewId(got->id);
    if (r) r = CompareSnapshotInfo(*got, ExpectedInfo(spec_, got->id, merged));
    if (!r) return r << " in " << what;
    model_.EraseSnapshot(parent);
    model_.EraseSnapshot(child);
    model_.AddSnapshot(got->id, std::move(merged));
    return r;
  }

  ::testing::AssertionResult StepSplit() {
    uint64_t id = PickSnapshotId();
    int32_t at = static_cast<int32_t>(rng_.Below(PosLimit()));
    const auto it = model_.snapshots().find(id);
    if (it != model_.snapshots().end() && rng_.Chance(85)) {
      at = static_cast<int32_t>(rng_.Between(std::max(0, it->second.from - 1), it->second.to + 1));
    }
    // Sometimes a snapshot whose ids are tainted past its start, cut below the taint: a clean
    // parent and a tainted child (few snapshots are tainted, and few cuts fall there), which
    // then merge back.
    std::vector<uint64_t> tainted;
    for (const auto& [k, s] : model_.snapshots()) {
      if (s.from < s.tokens.taint && s.tokens.taint < s.to) tainted.push_back(k);
    }
    const bool below_taint = !tainted.empty() && rng_.Chance(60);
    if (below_taint) {
      id = rng_.Pick(tainted);
      const ModelSnapshot& s = model_.snapshots().at(id);
      at = static_cast<int32_t>(rng_.Between(s.from + 1, s.tokens.taint));
    }
    const std::string what =
        "SplitSnapshot(" + std::to_string(id) + ", " + std::to_string(at) + ")";
    std::optional<ModelSnapshot> parent;
    std::optional<ModelSnapshot> child;
    const Codes want = model_.Split(id, at, &parent, &child);
    absl::StatusOr<SplitResult> got = cache_->SplitSnapshot(id, at);
    ::testing::AssertionResult r = Check(what, want, got.status());
    if (!r || !got.ok()) return r;
    if (got->parent.has_value() != parent.has_value() ||
        got->child.has_value() != child.has_value()) {
      return ::testing::AssertionFailure()
             << what << " gave " << (got->parent ? "a" : "no") << " parent and "
             << (got->child ? "a" : "no") << " child, model " << (parent ? "a" : "no")
             << " parent and " << (child ? "a" : "no") << " child";
    }
    model_.EraseSnapshot(id);
    if (parent.has_value()) {
      log_.back() += " parent " + std::to_string(got->parent->id);
      r = CheckNewId(got->parent->id);
      if (r) r = CompareSnapshotInfo(*got->parent, ExpectedInfo(spec_, got->parent->id, *parent));
      if (!r) return r << " in " << what << " (parent)";
      model_.AddSnapshot(got->parent->id, std::move(*parent));
    }
    if (child.has_value()) {
      log_.back() += " child " + std::to_string(got->child->id);
      r = CheckNewId(got->child->id);
      if (r) r = CompareSnapshotInfo(*got->child, ExpectedInfo(spec_, got->child->id, *child));
      if (!r) return r << " in " << what << " (child)";
      model_.AddSnapshot(got->child->id, std::move(*child));
    }
    // Sometimes the halves merge back at once: a merge of a parent and a child that agree
    // below the child's start, which otherwise few pairs of snapshots do.
    if (got->parent.has_value() && got->child.has_value() && (below_taint || rng_.Chance(30))) {
      return Merge(got->parent->id, got->child->id);
    }
    return r;
  }

  ::testing::AssertionResult StepDrop() {
    const uint64_t id = PickSnapshotId();
    const std::string what = "DropSnapshot(" + std::to_string(id) + ")";
    const bool known = model_.snapshots().count(id) > 0;
    ::testing::AssertionResult r = Check(what, known ? kOk : kNotFound, cache_->DropSnapshot(id));
    if (r && known) model_.EraseSnapshot(id);
    return r;
  }

  // Reads the whole wire image of `reader` and lets it go.
  ::testing::AssertionResult TakeImage(std::unique_ptr<SnapshotExportReader> reader,
                                       std::vector<uint8_t>* image) {
    image->assign(reader->size(), 0);
    const absl::Status read = reader->ReadAt(0, absl::MakeSpan(*image));
    if (!read.ok()) return ::testing::AssertionFailure() << "ReadAt of a wire image: " << read;
    return ::testing::AssertionSuccess();
  }

  // The codes of a write into the snapshot pool of `bytes` bytes.
  Codes PoolCodes(size_t bytes) const {
    if (!no_snapshot_pool_) return kOk;
    // Whether a snapshot of no bytes needs an allocation is not specified.
    return bytes > 0 ? Codes(kExhausted) : Codes(std::vector<absl::StatusCode>{kOk, kExhausted});
  }

  // A snapshot's wire image imported back into the cache (as another node with the same spec
  // would import it): a new snapshot equal to the first, token ids included. The export reader
  // keeps the data of a snapshot dropped while it is open.
  ::testing::AssertionResult StepImage() {
    const uint64_t id = PickSnapshotId();
    const auto snap = model_.snapshots().find(id);
    const bool known = snap != model_.snapshots().end();
    const std::string what = "OpenSnapshotExport(" + std::to_string(id) + ")";
    absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader = cache_->OpenSnapshotExport(id);
    ::testing::AssertionResult r = Check(what, known ? kOk : kNotFound, reader.status());
    if (!r || !reader.ok()) return r;
    const ModelSnapshot copy = snap->second;
    r = CompareSnapshotInfo((*reader)->info(), ExpectedInfo(spec_, id, copy));
    if (!r) return r << " in " << what;
    if (rng_.Chance(30)) {
      r = Check("DropSnapshot(" + std::to_string(id) + ")", kOk, cache_->DropSnapshot(id));
      if (!r) return r;
      model_.EraseSnapshot(id);
    }
    std::vector<uint8_t> image;
    r = TakeImage(std::move(reader).value(), &image);
    if (!r) return r;
    absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
        cache_->BeginSnapshotImport(image.size());
    if (!writer.ok()) {
      return ::testing::AssertionFailure() << "BeginSnapshotImport: " << writer.status();
    }
    const absl::Status written = (*writer)->Write(image);
    absl::StatusOr<SnapshotInfo> got =
        written.ok() ? (*writer)->Commit() : absl::StatusOr<SnapshotInfo>(written);
    const std::string import = "ImportSnapshot(image of " + std::to_string(id) + ")";
    r = Check(import, PoolCodes(ExpectedInfo(spec_, 0, copy).bytes), got.status());
    if (!r || !got.ok()) return r;
    log_.back() += " id " + std::to_string(got->id);
    r = CheckNewId(got->id);
    if (r) r = CompareSnapshotInfo(*got, ExpectedInfo(spec_, got->id, copy));
    if (!r) return r << " in " << import;
    model_.AddSnapshot(got->id, copy);
    return r;
  }

  // A sequence moved through its wire image without a snapshot left (OpenSequenceExport,
  // BeginSequenceImport, RestoreImport), here into a sequence of the same cache: Snapshot and
  // Restore of it. A cache of Attention groups only lends the export its cells and imports
  // into free cells when there are enough; others go through the snapshot pool.
  ::testing::AssertionResult StepTransfer() {
    const int64_t src = PickLiveSeq();
    const int32_t offset = model_.Offset(src);
    int32_t from = 0;
    if (rng_.Chance(40)) from = static_cast<int32_t>(rng_.Below(offset + 2));
    const int64_t dst = rng_.Chance(40) ? src : PickSeq();
    ModelSnapshot snap;
    Codes want = model_.Snapshot(src, from, &snap);
    const bool lends = !model_.contiguous();
    if (want.ok() && !lends) want = PoolCodes(ExpectedInfo(spec_, 0, snap).bytes);
    const std::string what =
        "SequenceExport(" + std::to_string(src) + ", " + std::to_string(from) + ")";
    absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader =
        Cache::OpenSequenceExport(cache_, src, from, std::nullopt);
    ::testing::AssertionResult r = Check(what, want, reader.status());
    if (!r || !reader.ok()) return r;
    const SnapshotInfo exported = (*reader)->info();
    // A cache that does not lend its cells exports through a snapshot it drops at once.
    if (exported.id != 0) r = CheckNewId(exported.id);
    if (r) r = CompareSnapshotInfo(exported, ExpectedInfo(spec_, exported.id, snap));
    if (!r) return r << " in " << what;
    std::vector<uint8_t> image;
    r = TakeImage(std::move(reader).value(), &image);
    if (!r) return r;

    absl::StatusOr<std::unique_ptr<SequenceImport>> import =
        Cache::BeginSequenceImport(cache_, image.size());
    if (!import.ok()) {
      return ::testing::AssertionFailure() << "BeginSequenceImport: " << import.status();
    }
    const bool in_cells = lends && model_.ImportFitsInCells(snap);
    const absl::Status written = (*import)->Write(image);
    absl::StatusOr<SnapshotInfo> committed =
        written.ok() ? (*import)->Commit() : absl::StatusOr<SnapshotInfo>(written);
    // Without a snapshot pool even an import into cells may be refused: the image's header is
    // bounded by what the pool's budget could hold before it is known where the rows go.
    Codes import_want = in_cells ? Codes(kOk) : PoolCodes(exported.bytes);
    if (in_cells && no_snapshot_pool_) {
      import_want = Codes(std::vector<absl::StatusCode>{kOk, kExhausted});
    }
    r = Check("SequenceImport(image of " + std::to_string(src) + ")", import_want,
              committed.status());
    if (!r || !committed.ok()) return r;
    if ((*import)->in_cells() != in_cells) {
      return ::testing::AssertionFailure()
             << "SequenceImport in_cells() " << (*import)->in_cells() << ", model " << in_cells;
    }
    r = CompareSnapshotInfo(*committed, ExpectedInfo(spec_, 0, snap));
    if (!r) return r << " in SequenceImport";
    if (in_cells) ++outcomes["sequence imports into cells"];

    int32_t target = snap.to;
    const int64_t kind = rng_.Below(100);
    if (kind < 30) {
      target = static_cast<int32_t>(rng_.Between(0, snap.to));
    } else if (kind < 35) {
      target = snap.to + 1;
    }
    const std::string restore = "RestoreImport(" + std::to_string(dst) + ", image of " +
                                std::to_string(src) + " [" + std::to_string(snap.from) + ", " +
                                std::to_string(snap.to) + "), " + std::to_string(target) + ")";
    const Codes restored = model_.Restore(dst, std::nullopt, target, &snap);
    return Check(restore, restored, cache_->RestoreImport(dst, **import, target));
  }

  // The token chain of every sequence of the pool (and of any other live one) against the
  // model's ids, and what ListSequences says of it.
  ::testing::AssertionResult CompareTokens(const std::vector<SequenceInfo>& listed) {
    const TokenHasher& hasher = cache_->token_hasher();
    std::set<int64_t> seqs(pool_.begin(), pool_.end());
    const std::set<int64_t> live = model_.Live();
    seqs.insert(live.begin(), live.end());
    std::map<int64_t, const SequenceInfo*> by_seq;
    for (const SequenceInfo& info : listed) by_seq[info.seq] = &info;
    size_t chains = 0;
    std::vector<uint64_t> all;  // every chain's hashes
    for (int64_t seq : seqs) {
      const TokenChain got = cache_->Tokens(seq);
      const TokenRef none;
      const TokenRef* ref = model_.Tokens(seq);
      const TokenRef& want = ref != nullptr ? *ref : none;
      // Hashes of the blocks wholly below exact, each seeded by the one before.
      std::vector<uint64_t> hashes;
      const int32_t b = spec_.token_block_size;
      for (int32_t k = 0; (k + 1) * b <= want.exact(); ++k) {
        hashes.push_back(hasher.Block(k == 0 ? hasher.seed : hashes.back(),
                                      absl::MakeConstSpan(want.ids).subspan(k * b, b)));
      }
      if (got.ids() != want.ids || got.settled() != want.settled || got.taint() != want.taint ||
          got.exact() != want.exact() || got.hashes() != hashes) {
        std::ostringstream os;
        auto describe = [&os](const std::vector<int32_t>& ids, int32_t settled, int32_t taint,
                              size_t blocks) {
          os << "{ids";
          for (int32_t id : ids) os << " " << id;
          os << ", settled " << settled << ", taint "
             << (taint == kNoTaint ? std::string("none") : std::to_string(taint)) << ", " << blocks
             << " blocks}";
        };
        os << "tokens of seq " << seq << ": ";
        describe(got.ids(), got.settled(), got.taint(), got.hashes().size());
        os << ", model ";
        describe(want.ids, want.settled, want.taint, hashes.size());
        if (got.hashes() != hashes && got.hashes().size() == hashes.size()) {
          os << " (hashes differ)";
        }
        return ::testing::AssertionFailure() << os.str();
      }
      auto it = by_seq.find(seq);
      if (it != by_seq.end() &&
          (it->second->tokens != want.Size() || it->second->exact_tokens != want.exact() ||
           it->second->token_blocks != static_cast<int32_t>(hashes.size()))) {
        return ::testing::AssertionFailure()
               << "ListSequences seq " << seq << ": tokens " << it->second->tokens << " exact "
               << it->second->exact_tokens << " blocks " << it->second->token_blocks << ", model "
               << want.Size() << " " << want.exact() << " " << hashes.size();
      }
      if (ref == nullptr) continue;
      ++chains;
      all.insert(all.end(), hashes.begin(), hashes.end());
      ++outcomes["token chains compared"];
      if (!hashes.empty()) ++outcomes["hashed token blocks compared"];
      if (want.taint != kNoTaint) ++outcomes["tainted token chains compared"];
      if (want.settled < want.Size()) ++outcomes["pending token ids compared"];
    }
    for (const auto& [id, s] : model_.snapshots()) {
      if (s.tokens.taint != kNoTaint) ++outcomes["tainted snapshot ids compared"];
    }
    // The block index holds each chain's hashes (distinct ones: 64-bit hashes of these few
    // short chains do not collide).
    const size_t entries = all.size();
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    const TokenIndexStats index = cache_->TokenIndex();
    if (index.sequences != chains || index.entries != entries || index.hashes != all.size()) {
      return ::testing::AssertionFailure()
             << "TokenIndex: " << index.sequences << " sequences, " << index.entries << " entries, "
             << index.hashes << " hashes; chains: " << chains << ", " << entries << ", "
             << all.size();
    }
    return ComparePrefixLookup(seqs);
  }

  // LookupPrefix of a prompt that continues (or leaves) some sequence's ids, asking for more
  // matches than there are sequences.
  ::testing::AssertionResult ComparePrefixLookup(const std::set<int64_t>& seqs) {
    std::vector<int32_t> prompt;
    const int64_t seq = rng_.Pick(std::vector<int64_t>(seqs.begin(), seqs.end()));
    if (const TokenRef* ref = model_.Tokens(seq)) {
      prompt = ref->ids;
      prompt.resize(rng_.Between(0, ref->Size()));
    }
    const int extra = static_cast<int>(rng_.Below(2 * spec_.token_block_size + 1));
    for (int k = 0; k < extra; ++k) {
      const int32_t pos = static_cast<int32_t>(prompt.size());
      prompt.push_back(static_cast<int32_t>(rng_.Chance(60) ? (pos / 2) % 4 : rng_.Below(4)));
    }
    const absl::StatusOr<std::vector<PrefixMatch>> got =
        cache_->LookupPrefix(prompt, static_cast<int>(seqs.size()) + 1);
    if (!got.ok()) return ::testing::AssertionFailure() << "LookupPrefix: " << got.status();
    const std::vector<PrefixMatch> want = model_.LookupPrefix(prompt);
    bool same = got->size() == want.size();
    for (size_t i = 0; same && i < want.size(); ++i) {
      const PrefixMatch& a = (*got)[i];
      const PrefixMatch& b = want[i];
      same = a.seq == b.seq && a.length == b.length && a.offset == b.offset &&
             a.can_resume == b.can_resume;
    }
    if (!same) {
      std::ostringstream os;
      auto describe = [&os](const std::vector<PrefixMatch>& matches) {
        os << "{";
        for (const PrefixMatch& m : matches) {
          os << " seq " << m.seq << " length " << m.length << " offset " << m.offset
             << (m.can_resume ? " resumable" : "") << ";";
        }
        os << " }";
      };
      os << "LookupPrefix of " << prompt.size() << " ids:";
      for (int32_t id : prompt) os << " " << id;
      os << ": ";
      describe(*got);
      os << ", model ";
      describe(want);
      return ::testing::AssertionFailure() << os.str();
    }
    if (!want.empty()) ++outcomes["prefix lookups that match compared"];
    if (want.size() > 1) ++outcomes["prefix lookups that match several compared"];
    return ::testing::AssertionSuccess();
  }

  // Every observable against the model.
  ::testing::AssertionResult CompareAll() {
    // Usage.
    const CacheUsage usage = cache_->Usage();
    const std::set<int64_t> live = model_.Live();
    if (usage.sequences_live != static_cast<int32_t>(live.size())) {
      return ::testing::AssertionFailure()
             << "sequences_live " << usage.sequences_live << ", model " << live.size();
    }
    if (usage.groups.size() != spec_.groups.size()) {
      return ::testing::AssertionFailure() << "usage has " << usage.groups.size() << " groups";
    }
    size_t arenas = 0;
    for (size_t g = 0; g < spec_.groups.size(); ++g) {
      const ModelGroup& m = model_.groups()[g];
      const size_t bytes = m.kind == GroupKind::kRecurrent
                               ? static_cast<size_t>(m.total) * StateBytes(spec_, g)
                               : static_cast<size_t>(m.total) * TokenBytes(spec_, g);
      arenas += bytes;
      if (usage.groups[g].bytes != bytes) {
        return ::testing::AssertionFailure()
               << "group " << g << " bytes " << usage.groups[g].bytes << ", expected " << bytes;
      }
      const bool memory_ok = m.kind != GroupKind::kAttention || usage.groups[g].memory == m.memory;
      if (usage.groups[g].cells_total != m.total || usage.groups[g].cells_used != m.used() ||
          !memory_ok) {
        return ::testing::AssertionFailure()
               << "group " << g << " cells " << usage.groups[g].cells_used << "/"
               << usage.groups[g].cells_total << " memory " << usage.groups[g].memory << ", model "
               << m.used() << "/" << m.total << " memory " << m.memory;
      }
    }
    // Pending speculative data is held in allocations of an unspecified size.
    const bool bytes_ok =
        model_.AnyPending() ? usage.bytes_held >= arenas : usage.bytes_held == arenas;
    if (!bytes_ok || device_->used_bytes() != usage.bytes_held) {
      return ::testing::AssertionFailure() << "bytes_held " << usage.bytes_held << ", device "
                                           << device_->used_bytes() << ", arenas " << arenas;
    }
    if (usage.snapshots != static_cast<int32_t>(model_.snapshots().size()) ||
        usage.snapshot_bytes != device_->used_bytes(MemoryPool::kSnapshot) ||
        (model_.snapshots().empty() && usage.snapshot_bytes != 0)) {
      return ::testing::AssertionFailure()
             << "snapshots " << usage.snapshots << " holding " << usage.snapshot_bytes
             << " bytes (snapshot pool " << device_->used_bytes(MemoryPool::kSnapshot)
             << "), model " << model_.snapshots().size();
    }
    // ListSnapshots.
    const std::vector<SnapshotInfo> snaps = cache_->ListSnapshots();
    if (snaps.size() != model_.snapshots().size()) {
      return ::testing::AssertionFailure()
             << "ListSnapshots has " << snaps.size() << ", model " << model_.snapshots().size();
    }
    {
      auto it = model_.snapshots().begin();
      for (const SnapshotInfo& info : snaps) {
        ::testing::AssertionResult r =
            CompareSnapshotInfo(info, ExpectedInfo(spec_, it->first, it->second));
        if (!r) return r << " in ListSnapshots";
        ++it;
      }
    }
    // GetSequence: exactly the ListSequences entry of a live sequence, nullopt for the others.
    {
      const std::vector<SequenceInfo> listed = cache_->ListSequences();
      std::map<int64_t, const SequenceInfo*> by_seq;
      for (const SequenceInfo& info : listed) by_seq[info.seq] = &info;
      for (int64_t seq : pool_) {
        const std::optional<SequenceInfo> one = cache_->GetSequence(seq);
        auto it = by_seq.find(seq);
        if (it == by_seq.end()) {
          if (one.has_value()) {
            return ::testing::AssertionFailure() << "GetSequence(" << seq << ") of an empty seq";
          }
          continue;
        }
        if (!one.has_value() || one->offset != it->second->offset ||
            one->pending != it->second->pending || one->tokens != it->second->tokens ||
            one->exact_tokens != it->second->exact_tokens ||
            one->token_blocks != it->second->token_blocks ||
            one->groups.size() != it->second->groups.size()) {
          return ::testing::AssertionFailure() << "GetSequence(" << seq
                                               << ") differs from its "
                                                  "ListSequences entry";
        }
        for (size_t g = 0; g < one->groups.size(); ++g) {
          const GroupSequenceInfo& a = one->groups[g];
          const GroupSequenceInfo& b = it->second->groups[g];
          if (a.stored != b.stored || a.shared != b.shared || a.first != b.first ||
              a.last != b.last || a.state != b.state) {
            return ::testing::AssertionFailure()
                   << "GetSequence(" << seq << ") group " << g << " differs from ListSequences";
          }
        }
      }
    }
    // ListSequences.
    const std::vector<SequenceInfo> seqs = cache_->ListSequences();
    if (seqs.size() != live.size()) {
      return ::testing::AssertionFailure()
             << "ListSequences has " << seqs.size() << ", model " << live.size();
    }
    auto it = live.begin();
    for (const SequenceInfo& info : seqs) {
      const int64_t seq = *it++;
      if (info.seq != seq || info.offset != model_.Offset(seq) ||
          info.pending != model_.PendingCount(seq) || info.groups.size() != spec_.groups.size()) {
        return ::testing::AssertionFailure()
               << "ListSequences entry seq " << info.seq << " offset " << info.offset << " pending "
               << info.pending << ", model seq " << seq << " offset " << model_.Offset(seq)
               << " pending " << model_.PendingCount(seq);
      }
      for (size_t g = 0; g < spec_.groups.size(); ++g) {
        const ModelGroup& m = model_.groups()[g];
        GroupSequenceInfo want;
        switch (m.kind) {
          case GroupKind::kAttention:
            if (const auto* positions = m.Find(seq)) {
              want.stored = static_cast<int32_t>(positions->size());
              want.first = positions->begin()->first;
              want.last = positions->rbegin()->first;
              for (const auto& entry : *positions) {
                if (m.cells.at(entry.second).refs > 1) ++want.shared;
              }
            }
            break;
          case GroupKind::kRotating: {
            const std::map<int32_t, uint64_t> rows = model_.RotatingRows(m, seq);
            if (!rows.empty()) {
              want.stored = static_cast<int32_t>(rows.size());
              want.first = rows.begin()->first;
              want.last = rows.rbegin()->first;
            }
            break;
          }
          case GroupKind::kRecurrent: {
            uint64_t unused;
            want.state = model_.ReportedState(m, seq, &unused);
            const RecState* s = m.FindState(seq);
            if (s != nullptr && s->slot >= 0 && m.slots.at(s->slot) > 1) want.shared = 1;
            break;
          }
        }
        const GroupSequenceInfo& got = info.groups[g];
        if (got.stored != want.stored || got.shared != want.shared || got.first != want.first ||
            got.last != want.last || got.state != want.state) {
          return ::testing::AssertionFailure()
                 << "seq " << seq << " group " << g << ": stored " << got.stored << " shared "
                 << got.shared << " first " << got.first << " last " << got.last << " state "
                 << StateName(got.state) << ", model " << want.stored << " " << want.shared << " "
                 << want.first << " " << want.last << " " << StateName(want.state);
        }
      }
    }
    ::testing::AssertionResult tokens = CompareTokens(seqs);
    if (!tokens) return tokens;
    // Cells (or slots) referenced by more than one sequence, per group: the engine keeps
    // these counts as references come and go; the model counts them afresh.
    const std::vector<int64_t> shared_cells = cache_->SharedCells();
    for (size_t g = 0; g < spec_.groups.size(); ++g) {
      const ModelGroup& m = model_.groups()[g];
      int64_t want = 0;
      if (m.kind == GroupKind::kAttention) {
        for (const auto& [handle, cell] : m.cells) want += cell.refs > 1;
      } else if (m.kind == GroupKind::kRecurrent) {
        for (const auto& [handle, refs] : m.slots) want += refs > 1;
      }
      if (shared_cells.at(g) != want) {
        return ::testing::AssertionFailure()
               << "group " << g << ": SharedCells() " << shared_cells[g] << ", model " << want;
      }
      if (want > 0) ++outcomes["shared cell counts compared"];
    }
    // Bytes of every live sequence; NOT_FOUND for the others.
    for (int64_t seq : pool_) {
      absl::StatusOr<ReadResult> read = cache_->Read(seq, 0, std::nullopt);
      if (!live.count(seq)) {
        if (read.status().code() != kNotFound) {
          return ::testing::AssertionFailure()
                 << "Read of empty seq " << seq << ": " << read.status();
        }
        continue;
      }
      if (!read.ok()) {
        return ::testing::AssertionFailure() << "Read(" << seq << "): " << read.status();
      }
      const std::vector<WantGroup> want = WantRead(seq, 0, std::nullopt);
      ::testing::AssertionResult r = CompareRead(spec_, memo_, *read, want);
      if (!r) return r << " in Read(" << seq << ")";
      for (size_t g = 0; g < want.size(); ++g) {
        for (const auto& row : want[g].rows) {
          if (row.second.shifts > 0) ++outcomes["rotated key rows compared"];
          if (row.second.shifts > 1) ++outcomes["twice-rotated key rows compared"];
        }
        const ModelGroup& m = model_.groups()[g];
        if (m.kind == GroupKind::kRotating) {
          const Ring* ring = m.FindRing(seq);
          if (ring != nullptr && ring->offset > m.max_size) ++outcomes["wrapped rings compared"];
        }
        if (m.kind == GroupKind::kRecurrent) {
          ++outcomes[std::string("recurrent states compared ") + StateName(want[g].state)];
          const RecState* s = m.FindState(seq);
          if (s != nullptr && s->slot >= 0 && m.slots.at(s->slot) > 1) {
            ++outcomes["shared recurrent slots compared"];
          }
        }
      }
      if (model_.PendingCount(seq) > 0) ++outcomes["sequences with pending tokens compared"];
    }
    // Visible and CanResume around each sequence's edges.
    for (size_t g = 0; g < spec_.groups.size(); ++g) {
      std::vector<Query> queries;
      for (int64_t seq : pool_) {
        for (int k = 0; k < 3; ++k) queries.push_back(RandomQuery(seq));
      }
      absl::StatusOr<std::vector<std::vector<int32_t>>> got =
          cache_->Visible(static_cast<int>(g), queries);
      if (!got.ok() && spec_.groups[g].kind == GroupKind::kRecurrent &&
          got.status().code() == kInvalid) {
        continue;  // see StepVisible
      }
      if (!got.ok()) return ::testing::AssertionFailure() << "Visible: " << got.status();
      ::testing::AssertionResult r = CompareVisible(static_cast<int>(g), queries, *got);
      if (!r) return r;
      r = CompareVisibleRanges(static_cast<int>(g), queries);
      if (!r) return r;
    }
    for (int64_t seq : pool_) {
      const int32_t offset = model_.Offset(seq);
      std::vector<int32_t> positions = {0, offset, offset + 1, std::max(0, offset - 1),
                                        static_cast<int32_t>(rng_.Below(PosLimit() + 2))};
      for (const ModelGroup& m : model_.groups()) {
        if (m.kind != GroupKind::kAttention || !m.limited()) continue;
        if (const auto* p = m.Find(seq)) {
          // The window-start edge: pos - window == first, and one below.
          const int32_t edge = p->begin()->first + m.window.window;
          positions.push_back(edge);
          positions.push_back(std::max(0, edge - 1));
        }
      }
      for (int32_t pos : positions) {
        absl::StatusOr<bool> got = cache_->CanResume(seq, pos);
        if (!got.ok()) return ::testing::AssertionFailure() << "CanResume: " << got.status();
        ::testing::AssertionResult r = CompareCanResume(seq, pos, *got);
        if (!r) return r;
      }
    }
    return ::testing::AssertionSuccess();
  }

  Rng rng_;
  const CacheSpec spec_;
  Model model_;
  RowMemo memo_;
  const bool no_snapshot_pool_;
  const bool always_ids_;
  std::unique_ptr<Device> device_;  // outlives cache_
  std::shared_ptr<Cache> cache_;
  std::vector<int64_t> pool_;
  std::vector<std::string> log_;
  uint64_t next_id_ = 1;
  uint64_t max_issued_ = 0;  // the largest snapshot id the engine has returned
};

TEST(CacheModelTest, RandomOperationsMatchTheModel) {
  const int episodes = EnvInt("KVMESH_MODEL_ITERATIONS", kDefaultEpisodes);
  const uint64_t base_seed = EnvU64("KVMESH_MODEL_SEED", 20240601);
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::seconds(EnvInt("KVMESH_MODEL_BUDGET_S", kDefaultBudgetSeconds));
  std::map<std::string, int> outcomes;
  int ran = 0;
  for (int e = 0; e < episodes; ++e, ++ran) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::printf("time budget spent after %d of %d episodes (KVMESH_MODEL_BUDGET_S)\n", e,
                  episodes);
      break;
    }
    const uint64_t seed = Mix64(base_seed + static_cast<uint64_t>(e));
    Rng spec_rng(seed ^ 0x5EC);
    const CacheSpec spec = RandomSpec(spec_rng);
    ASSERT_TRUE(ValidateSpec(spec).ok()) << ValidateSpec(spec) << "\n" << Describe(spec);
    SCOPED_TRACE("KVMESH_MODEL_SEED=" + std::to_string(base_seed) + " episode " +
                 std::to_string(e) + " (seed " + std::to_string(seed) +
                 "), spec: " + Describe(spec));
    Episode episode(seed, spec);
    ASSERT_TRUE(episode.Run(kStepsPerEpisode));
    for (const auto& [k, v] : episode.outcomes) outcomes[k] += v;
    ++outcomes[RequiresContiguousPositions(spec) ? "episodes hybrid" : "episodes attention-only"];
  }
  // The run reached the states the test is for (a weakened generator would fail here).
  if (ran >= kCoverageEpisodes) {
    for (const char* outcome : {"Append OK",
                                "Append INVALID_ARGUMENT",
                                "Append RESOURCE_EXHAUSTED",
                                "Append ABORTED",
                                "AppendSpeculative OK",
                                "AppendSpeculative INVALID_ARGUMENT",
                                "AppendSpeculative RESOURCE_EXHAUSTED",
                                "CommitSpeculation OK",
                                "CommitSpeculation FAILED_PRECONDITION",
                                "CommitSpeculation INVALID_ARGUMENT",
                                "Reserve OK",
                                "Reserve RESOURCE_EXHAUSTED",
                                "Reserve INVALID_ARGUMENT",
                                "CopyPrefix OK",
                                "CopyPrefix INVALID_ARGUMENT",
                                "CopyPrefix RESOURCE_EXHAUSTED",
                                "CopyPrefix FAILED_PRECONDITION",
                                "CopyPrefix ABORTED",
                                "Remove OK",
                                "Remove INVALID_ARGUMENT",
                                "Remove FAILED_PRECONDITION",
                                "Remove RESOURCE_EXHAUSTED",
                                "Remove ABORTED",
                                "Read OK",
                                "Read NOT_FOUND",
                                "Read INVALID_ARGUMENT",
                                "Visible OK",
                                "Visible INVALID_ARGUMENT",
                                "Visible in ranges compared",
                                "CanResume OK",
                                "CanResume INVALID_ARGUMENT",
                                "Snapshot OK",
                                "Snapshot NOT_FOUND",
                                "Snapshot FAILED_PRECONDITION",
                                "Snapshot ABORTED",
                                "Snapshot INVALID_ARGUMENT",
                                "Snapshot RESOURCE_EXHAUSTED",
                                "Restore OK",
                                "Restore FAILED_PRECONDITION",
                                "Restore NOT_FOUND",
                                "Restore ABORTED",
                                "Restore RESOURCE_EXHAUSTED",
                                "MergeSnapshots OK",
                                "MergeSnapshots INVALID_ARGUMENT",
                                "MergeSnapshots NOT_FOUND",
                                "SplitSnapshot OK",
                                "SplitSnapshot NOT_FOUND",
                                "DropSnapshot OK",
                                "DropSnapshot NOT_FOUND",
                                "rotated key rows compared",
                                "twice-rotated key rows compared",
                                "wrapped rings compared",
                                "recurrent states compared VALID",
                                "recurrent states compared INVALID",
                                "shared recurrent slots compared",
                                "shared cell counts compared",
                                "sequences with pending tokens compared",
                                "appends in pieces",
                                "appends through a writer",
                                "OpenSnapshotExport OK",
                                "ImportSnapshot OK",
                                "SequenceExport OK",
                                "SequenceImport OK",
                                "sequence imports into cells",
                                "RestoreImport OK",
                                "token chains compared",
                                "hashed token blocks compared",
                                "tainted token chains compared",
                                "pending token ids compared",
                                "tainted snapshot ids compared",
                                "restores after the same ids",
                                "restores after other ids",
                                "merges of the same ids",
                                "merges of other ids",
                                "merges that keep the child's taint",
                                "restores that keep the snapshot's taint",
                                "ids past the limit dropped",
                                "prefix lookups that match compared",
                                "prefix lookups that match several compared"}) {
      EXPECT_GT(outcomes[outcome], 0) << outcome;
    }
  }
  for (const auto& [k, v] : outcomes) std::printf("  %-50s %d\n", k.c_str(), v);
}

}  // namespace
}  // namespace kvmesh
