// Model-based randomized test of the cache engine.
//
// A small reference model of ARCHITECTURE.md §3, written here without engine code, runs the
// same random operations as a real Cache on a HostDevice: per group a pool of reference-counted
// cells (so free cells are predicted exactly) and per sequence an ordered map position -> cell;
// a cell remembers which pattern row it holds and how far RoPE has shifted its key. After every
// step the test compares the status code of the operation and every observable: ListSequences,
// Usage, the bytes of every live sequence (byte-exact, RoPE-shifted keys within a tolerance of
// the float64 reference), Visible in every group and CanResume, for every sequence of the pool.
//
// Random specs are small (1-3 groups mixing FULL, SLIDING and CHUNKED windows, all dtypes and
// rope kinds) so that pools fill up and RESOURCE_EXHAUSTED happens. Positions go up to twice
// the capacity: the cell rule is the only limit on what a sequence stores.
//
// KVMESH_MODEL_ITERATIONS sets the number of episodes (random spec + operation sequence);
// KVMESH_MODEL_SEED the base seed. A failure prints the seed, the episode's spec and its
// operations up to the failing step.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "cache/cache.h"
#include "cache/device/host_device.h"
#include "gtest/gtest.h"
#include "tests/testing/pattern.h"
#include "tests/unit/rope_reference.h"

namespace kvmesh {
namespace {

using testutil::DecodeElement;
using testutil::Mix64;

constexpr int kDefaultEpisodes = 1000;
constexpr int kStepsPerEpisode = 80;

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
    default:
      return "OTHER";
  }
}

// The codes an operation may return. Usually one; two where the contract orders nothing
// between them (a Remove that both needs room and moves positions in a rope-NONE group).
struct Codes {
  std::vector<absl::StatusCode> allowed;
  Codes(absl::StatusCode c) : allowed{c} {}                          // NOLINT: implicit on purpose
  Codes(std::vector<absl::StatusCode> c) : allowed(std::move(c)) {}  // NOLINT
  bool ok() const { return allowed.size() == 1 && allowed[0] == absl::StatusCode::kOk; }
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

struct Cell {
  int refs = 0;
  uint64_t id = 0;    // pattern row id
  int64_t delta = 0;  // total RoPE shift of the key
  int shifts = 0;     // number of rounded shifts applied
};

struct ModelGroup {
  WindowSpec window;
  RopeSpec rope;
  int64_t total = 0;
  int64_t memory = kUnlimitedMemory;
  int64_t next_handle = 0;
  std::map<int64_t, Cell> cells;                       // live cells by handle
  std::map<int64_t, std::map<int32_t, int64_t>> seqs;  // seq -> pos -> handle

  bool limited() const { return memory != kUnlimitedMemory; }
  int64_t used() const { return static_cast<int64_t>(cells.size()); }
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
};

class Model {
 public:
  explicit Model(const CacheSpec& spec) : spec_(spec) {
    for (const GroupSpec& g : spec.groups) {
      ModelGroup m;
      m.window = g.attention.window;
      m.rope = g.attention.rope;
      if (m.window.kind == WindowKind::kSliding) {
        int64_t memory = m.window.memory == 0 ? m.window.window : m.window.memory;
        if (spec.max_sequences > 1) memory = std::max<int64_t>(memory, m.window.window + 1);
        m.memory = memory >= spec.capacity ? kUnlimitedMemory : memory;
      }
      m.total = m.limited() ? int64_t{spec.max_sequences} * m.memory + spec.max_batch
                            : int64_t{spec.max_sequences} * spec.capacity;
      groups_.push_back(std::move(m));
    }
  }

  const CacheSpec& spec() const { return spec_; }
  const std::vector<ModelGroup>& groups() const { return groups_; }

  std::set<int64_t> Live() const {
    std::set<int64_t> live;
    for (const ModelGroup& g : groups_) {
      for (const auto& entry : g.seqs) live.insert(entry.first);
    }
    return live;
  }

  // One past the largest stored position over all groups; 0 when none.
  int32_t Offset(int64_t seq) const {
    int32_t offset = 0;
    for (const ModelGroup& g : groups_) {
      if (const auto* m = g.Find(seq)) offset = std::max(offset, m->rbegin()->first + 1);
    }
    return offset;
  }

  bool StoredAnywhere(int64_t seq, int32_t pos) const {
    for (const ModelGroup& g : groups_) {
      const auto* m = g.Find(seq);
      if (m != nullptr && m->count(pos)) return true;
    }
    return false;
  }

  Codes Append(const std::vector<Token>& tokens, const std::vector<uint64_t>& ids,
               bool payload_ok) {
    if (tokens.empty() || static_cast<int64_t>(tokens.size()) > spec_.max_batch) {
      return absl::StatusCode::kInvalidArgument;
    }
    std::map<int64_t, int32_t> lowest;
    std::map<int64_t, int32_t> last;
    for (const Token& t : tokens) {
      if (t.seq < 0 || t.pos < 0) return absl::StatusCode::kInvalidArgument;
      auto it = last.find(t.seq);
      if (it != last.end() && t.pos <= it->second) return absl::StatusCode::kInvalidArgument;
      last[t.seq] = t.pos;
      lowest.emplace(t.seq, t.pos);  // the first is the lowest: positions increase
      if (StoredAnywhere(t.seq, t.pos)) return absl::StatusCode::kInvalidArgument;
    }
    if (!payload_ok) return absl::StatusCode::kInvalidArgument;

    std::vector<ModelGroup> next = groups_;
    for (ModelGroup& g : next) {
      if (g.limited()) Prune(g, lowest);
    }
    std::set<int64_t> live = Live();
    for (const auto& entry : lowest) live.insert(entry.first);
    if (static_cast<int64_t>(live.size()) > spec_.max_sequences) {
      return absl::StatusCode::kResourceExhausted;
    }
    for (const ModelGroup& g : next) {
      if (g.total - g.used() < static_cast<int64_t>(tokens.size())) {
        return absl::StatusCode::kResourceExhausted;
      }
    }
    for (ModelGroup& g : next) {
      for (size_t i = 0; i < tokens.size(); ++i) {
        Cell c;
        c.id = ids[i];
        g.seqs[tokens[i].seq][tokens[i].pos] = g.NewCell(c);
      }
    }
    groups_ = std::move(next);
    return absl::StatusCode::kOk;
  }

  Codes CopyPrefix(int64_t src, int64_t dst, int32_t length) {
    if (src < 0 || dst < 0 || length < 0 || src == dst) {
      return absl::StatusCode::kInvalidArgument;
    }
    bool dst_live_after = false;
    for (const ModelGroup& g : groups_) {
      const auto* m = g.Find(src);
      if (m != nullptr && m->begin()->first < length) dst_live_after = true;
    }
    const std::set<int64_t> live = Live();
    if (dst_live_after && !live.count(dst) &&
        static_cast<int64_t>(live.size()) + 1 > spec_.max_sequences) {
      return absl::StatusCode::kResourceExhausted;
    }
    for (ModelGroup& g : groups_) {
      auto it = g.seqs.find(dst);
      if (it != g.seqs.end()) {
        for (const auto& [pos, h] : it->second) g.Release(h);
        g.seqs.erase(it);
      }
      const auto* m = g.Find(src);
      if (m == nullptr) continue;
      std::map<int32_t, int64_t> copy;
      for (const auto& [pos, h] : *m) {
        if (pos >= length) break;
        ++g.cells.at(h).refs;
        copy[pos] = h;
      }
      if (!copy.empty()) g.seqs[dst] = std::move(copy);
    }
    return absl::StatusCode::kOk;
  }

  Codes Remove(int64_t seq, int32_t begin, std::optional<int32_t> end) {
    if (seq < 0 || begin < 0 || (end.has_value() && *end < begin)) {
      return absl::StatusCode::kInvalidArgument;
    }
    if (!Live().count(seq)) return absl::StatusCode::kOk;
    if (end.has_value() && *end == begin) return absl::StatusCode::kOk;
    bool no_rope_moves = false;
    bool no_room = false;
    for (const ModelGroup& g : groups_) {
      const auto* m = g.Find(seq);
      if (m == nullptr) continue;
      const bool moves = end.has_value() && m->rbegin()->first >= *end;
      if (moves && g.rope.type == RopeType::kNone) no_rope_moves = true;
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
      if (g.used() - freed + copies > g.total) no_room = true;
    }
    if (no_rope_moves && no_room) {
      return Codes({absl::StatusCode::kFailedPrecondition, absl::StatusCode::kResourceExhausted});
    }
    if (no_rope_moves) return absl::StatusCode::kFailedPrecondition;
    if (no_room) return absl::StatusCode::kResourceExhausted;

    for (ModelGroup& g : groups_) {
      auto it = g.seqs.find(seq);
      if (it == g.seqs.end()) continue;
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
    }
    return absl::StatusCode::kOk;
  }

  Codes ReadCode(int64_t seq, int32_t begin, std::optional<int32_t> end) const {
    if (seq < 0 || begin < 0 || (end.has_value() && *end < begin)) {
      return absl::StatusCode::kInvalidArgument;
    }
    if (!Live().count(seq)) return absl::StatusCode::kNotFound;
    return absl::StatusCode::kOk;
  }

  // (position, cell) of seq in group g within [begin, end).
  std::vector<std::pair<int32_t, Cell>> Rows(int g, int64_t seq, int32_t begin,
                                             std::optional<int32_t> end) const {
    std::vector<std::pair<int32_t, Cell>> rows;
    const auto* m = groups_[g].Find(seq);
    if (m == nullptr) return rows;
    for (const auto& [pos, h] : *m) {
      if (pos >= begin && (!end.has_value() || pos < *end)) {
        rows.emplace_back(pos, groups_[g].cells.at(h));
      }
    }
    return rows;
  }

  std::vector<int32_t> Visible(int g, const Query& q) const {
    std::vector<int32_t> out;
    const ModelGroup& group = groups_[g];
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
    for (const ModelGroup& g : groups_) {
      if (!g.limited()) continue;
      const auto* m = g.Find(seq);
      if (m == nullptr) return false;
      const int64_t first = m->begin()->first;
      const int64_t last = m->rbegin()->first;
      const int64_t window_start = std::max<int64_t>(0, int64_t{pos} - g.window.window);
      if (!(window_start >= first && pos <= last + 1)) return false;
    }
    return true;
  }

 private:
  // The seed's updateSlidingWindow for one group.
  static void Prune(ModelGroup& g, const std::map<int64_t, int32_t>& lowest) {
    for (auto it = g.seqs.begin(); it != g.seqs.end();) {
      std::map<int32_t, int64_t>& positions = it->second;
      auto low = lowest.find(it->first);
      const int64_t bound = low != lowest.end() ? int64_t{low->second} - g.memory
                                                : int64_t{positions.rbegin()->first} + 1 - g.memory;
      while (!positions.empty() && positions.begin()->first < bound) {
        g.Release(positions.begin()->second);
        positions.erase(positions.begin());
      }
      it = positions.empty() ? g.seqs.erase(it) : std::next(it);
    }
  }

  CacheSpec spec_;
  std::vector<ModelGroup> groups_;
};

// ---- expected bytes ------------------------------------------------------------------------

// Pattern rows by id, computed once per episode.
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

 private:
  const CacheSpec& spec_;
  std::unordered_map<uint64_t, std::vector<uint8_t>> rows_;
};

std::vector<uint8_t> BuildPayload(const CacheSpec& spec, RowMemo& memo,
                                  const std::vector<uint64_t>& ids) {
  std::vector<uint8_t> payload;
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    for (int layer = 0; layer < spec.groups[g].num_layers; ++layer) {
      for (bool key : {true, false}) {
        for (uint64_t id : ids) {
          const std::vector<uint8_t>& row = memo.Row(id, g, layer, key);
          payload.insert(payload.end(), row.begin(), row.end());
        }
      }
    }
  }
  return payload;
}

// Compares a Read result with the model's rows of each group.
::testing::AssertionResult CompareRead(
    const CacheSpec& spec, RowMemo& memo, const ReadResult& got,
    const std::vector<std::vector<std::pair<int32_t, Cell>>>& want) {
  if (got.positions.size() != spec.groups.size()) {
    return ::testing::AssertionFailure() << "header has " << got.positions.size() << " groups";
  }
  for (size_t g = 0; g < want.size(); ++g) {
    std::vector<int32_t> positions;
    for (const auto& row : want[g]) positions.push_back(row.first);
    if (got.positions[g] != positions) {
      std::ostringstream os;
      os << "group " << g << " positions {";
      for (int32_t p : got.positions[g]) os << p << ",";
      os << "}, model {";
      for (int32_t p : positions) os << p << ",";
      os << "}";
      return ::testing::AssertionFailure() << os.str();
    }
  }
  const size_t esize = testutil::ElementBytes(spec.dtype);
  size_t expected_size = 0;
  for (size_t g = 0; g < want.size(); ++g) {
    expected_size += spec.groups[g].num_layers * want[g].size() *
                     (testutil::KRowElements(spec, g) + testutil::VRowElements(spec, g)) * esize;
  }
  if (got.payload.size() != expected_size) {
    return ::testing::AssertionFailure()
           << "payload " << got.payload.size() << " bytes, model " << expected_size;
  }
  const uint8_t* p = reinterpret_cast<const uint8_t*>(got.payload.data());
  for (int g = 0; g < static_cast<int>(want.size()); ++g) {
    const AttentionSpec& a = spec.groups[g].attention;
    for (int layer = 0; layer < spec.groups[g].num_layers; ++layer) {
      for (bool key : {true, false}) {
        for (const auto& [pos, cell] : want[g]) {
          const std::vector<uint8_t>& orig = memo.Row(cell.id, g, layer, key);
          if (!key || cell.shifts == 0) {
            if (std::memcmp(p, orig.data(), orig.size()) != 0) {
              return ::testing::AssertionFailure()
                     << "group " << g << " layer " << layer << (key ? " K" : " V")
                     << " of position " << pos << " differs";
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

// ---- random specs and operations -----------------------------------------------------------

std::string Describe(const CacheSpec& spec) {
  static const char* kDtypes[] = {"F32", "F16", "BF16"};
  static const char* kRopes[] = {"NONE", "NORMAL", "NEOX"};
  std::ostringstream os;
  os << kDtypes[static_cast<int>(spec.dtype)] << " max_sequences=" << spec.max_sequences
     << " capacity=" << spec.capacity << " max_batch=" << spec.max_batch;
  for (const GroupSpec& g : spec.groups) {
    const AttentionSpec& a = g.attention;
    os << " | layers=" << g.num_layers << " heads=" << a.num_kv_heads << " k=" << a.head_dim_k
       << " v=" << a.head_dim_v << " ";
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
    os << " rope=" << kRopes[static_cast<int>(a.rope.type)];
    if (a.rope.type != RopeType::kNone) {
      os << "(dims=" << a.rope.dims << ",base=" << a.rope.base
         << ",freq_scale=" << a.rope.freq_scale << ")";
    }
  }
  return os.str();
}

CacheSpec RandomSpec(Rng& rng) {
  CacheSpec spec;
  spec.name = "model";
  spec.dtype = static_cast<DType>(rng.Below(3));
  spec.max_sequences = static_cast<int32_t>(rng.Between(1, 4));
  spec.capacity = static_cast<int32_t>(rng.Between(4, 20));
  spec.max_batch = static_cast<int32_t>(rng.Between(1, 8));
  const int num_groups = static_cast<int>(rng.Between(1, 3));
  for (int i = 0; i < num_groups; ++i) {
    GroupSpec g;
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
    const int64_t rope = rng.Below(10);
    if (rope >= 3) {
      a.rope.type = rope < 7 ? RopeType::kNormal : RopeType::kNeox;
      a.rope.dims = static_cast<int32_t>(2 * rng.Between(1, a.head_dim_k / 2));
      a.rope.base = rng.Chance(50) ? 10000.0f : (rng.Chance(50) ? 100.0f : 1e6f);
      a.rope.freq_scale = rng.Chance(60) ? 1.0f : (rng.Chance(50) ? 0.5f : 2.0f);
    }
    spec.groups.push_back(g);
  }
  return spec;
}

std::string TokensToString(const std::vector<Token>& tokens) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < tokens.size(); ++i) {
    os << (i ? " " : "") << tokens[i].seq << ":" << tokens[i].pos;
  }
  os << "]";
  return os.str();
}

std::string OptEnd(std::optional<int32_t> end) {
  return end.has_value() ? std::to_string(*end) : std::string("none");
}

class Episode {
 public:
  Episode(uint64_t seed, const CacheSpec& spec)
      : rng_(seed), spec_(spec), model_(spec), memo_(spec_), device_(size_t{1} << 30) {
    // A pool of sequence ids: more than max_sequences, one of them beyond 32 bits.
    pool_ = {0, 1, 2, 5, int64_t{1} << 33};
    pool_.resize(std::min<size_t>(pool_.size(), spec.max_sequences + 2));
  }

  ::testing::AssertionResult Run(int steps) {
    absl::StatusOr<std::unique_ptr<Cache>> created = Cache::Create(spec_, &device_);
    if (!created.ok()) return ::testing::AssertionFailure() << "Create: " << created.status();
    cache_ = std::move(created).value();
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
    return ::testing::AssertionSuccess();
  }

  // Counts of each outcome, to make sure the episodes reach the interesting states.
  std::map<std::string, int> outcomes;

 private:
  int64_t PickSeq() {
    if (rng_.Chance(5)) return 9;  // never used by Append: always unknown
    return rng_.Pick(pool_);
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
    const int64_t r = rng_.Below(100);
    if (r < 45) return StepAppend();
    if (r < 60) return StepCopyPrefix();
    if (r < 80) return StepRemove();
    if (r < 87) return StepRead();
    if (r < 94) return StepVisible();
    return StepCanResume();
  }

  ::testing::AssertionResult StepAppend() {
    // Mostly live sequences (so max_sequences is not what stops most batches), sometimes any.
    const std::set<int64_t> live = model_.Live();
    const bool any = live.empty() || rng_.Chance(30);
    const std::vector<int64_t> candidates =
        any ? pool_ : std::vector<int64_t>(live.begin(), live.end());
    std::vector<int64_t> seqs;
    const int nseq = static_cast<int>(rng_.Between(1, std::min<int64_t>(3, candidates.size())));
    while (static_cast<int>(seqs.size()) < nseq) {
      const int64_t s = rng_.Pick(candidates);
      if (std::find(seqs.begin(), seqs.end(), s) == seqs.end()) seqs.push_back(s);
    }
    // Positions per sequence, increasing.
    std::vector<std::vector<int32_t>> per_seq(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int32_t offset = model_.Offset(seqs[i]);
      int32_t start;
      const int64_t kind = rng_.Below(10);
      if (kind < 6) {
        start = offset;
      } else if (kind < 8) {
        start = offset + static_cast<int32_t>(rng_.Between(1, 4));
      } else if (kind < 9) {
        start = static_cast<int32_t>(rng_.Below(PosLimit()));
      } else {
        start = static_cast<int32_t>(rng_.Below(std::max<int32_t>(offset, 1)));
      }
      const int count = static_cast<int>(rng_.Between(1, spec_.max_batch));
      int32_t pos = start;
      for (int k = 0; k < count; ++k) {
        per_seq[i].push_back(pos);
        pos += rng_.Chance(85) ? 1 : 2;
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

    bool payload_ok = true;
    int payload_fault = 0;
    if (rng_.Chance(12)) {
      switch (rng_.Below(6)) {
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
          payload_ok = false;
          payload_fault = static_cast<int>(rng_.Between(1, 3));
          break;
        default:
          tokens.clear();
          break;
      }
    }
    std::vector<uint64_t> ids;
    for (size_t i = 0; i < tokens.size(); ++i) ids.push_back(next_id_++);
    std::vector<uint8_t> payload = BuildPayload(spec_, memo_, ids);
    if (payload_fault == 1) payload.push_back(0x7F);
    if (payload_fault == 2) payload.pop_back();
    if (payload_fault == 3) {
      std::vector<uint64_t> fewer(ids.begin(), ids.end() - 1);
      payload = BuildPayload(spec_, memo_, fewer);
    }
    std::string what = "Append(" + TokensToString(tokens) + ")";
    if (!payload_ok) what += " payload fault " + std::to_string(payload_fault);
    const Codes want = model_.Append(tokens, ids, payload_ok);
    return Check(what, want, cache_->Append(tokens, payload));
  }

  ::testing::AssertionResult StepCopyPrefix() {
    int64_t src = PickSeq();
    int64_t dst = PickSeq();
    if (rng_.Chance(5)) dst = src;
    int32_t length = static_cast<int32_t>(rng_.Below(model_.Offset(src) + 3));
    if (rng_.Chance(3)) length = -1;
    if (rng_.Chance(2)) src = -1;
    const std::string what = "CopyPrefix(" + std::to_string(src) + ", " + std::to_string(dst) +
                             ", " + std::to_string(length) + ")";
    const Codes want = model_.CopyPrefix(src, dst, length);
    return Check(what, want, cache_->CopyPrefix(src, dst, length));
  }

  ::testing::AssertionResult StepRemove() {
    int64_t seq = PickSeq();
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

  ::testing::AssertionResult StepRead() {
    int64_t seq = PickSeq();
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
    std::vector<std::vector<std::pair<int32_t, Cell>>> rows;
    for (size_t g = 0; g < spec_.groups.size(); ++g) {
      rows.push_back(model_.Rows(static_cast<int>(g), seq, begin, end));
    }
    r = CompareRead(spec_, memo_, *got, rows);
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
    absl::StatusOr<std::vector<std::vector<int32_t>>> got = cache_->Visible(group, queries);
    ::testing::AssertionResult r = Check(
        what, valid ? absl::StatusCode::kOk : absl::StatusCode::kInvalidArgument, got.status());
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

  ::testing::AssertionResult StepCanResume() {
    int64_t seq = PickSeq();
    int32_t pos = RandomQuery(seq).pos;
    if (rng_.Chance(4)) pos = -1;
    if (rng_.Chance(3)) seq = -1;
    const std::string what = "CanResume(" + std::to_string(seq) + ", " + std::to_string(pos) + ")";
    const bool valid = seq >= 0 && pos >= 0;
    absl::StatusOr<bool> got = cache_->CanResume(seq, pos);
    ::testing::AssertionResult r = Check(
        what, valid ? absl::StatusCode::kOk : absl::StatusCode::kInvalidArgument, got.status());
    if (!r || !got.ok()) return r;
    if (*got != model_.CanResume(seq, pos)) {
      return ::testing::AssertionFailure()
             << what << " = " << *got << ", model says " << model_.CanResume(seq, pos);
    }
    return r;
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
    size_t bytes_held = 0;
    for (size_t g = 0; g < spec_.groups.size(); ++g) {
      const ModelGroup& m = model_.groups()[g];
      const size_t bytes = static_cast<size_t>(spec_.groups[g].num_layers) * m.total *
                           (testutil::KRowElements(spec_, g) + testutil::VRowElements(spec_, g)) *
                           testutil::ElementBytes(spec_.dtype);
      bytes_held += bytes;
      if (usage.groups[g].bytes != bytes) {
        return ::testing::AssertionFailure()
               << "group " << g << " bytes " << usage.groups[g].bytes << ", expected " << bytes;
      }
      if (usage.groups[g].cells_total != m.total || usage.groups[g].cells_used != m.used() ||
          usage.groups[g].memory != m.memory) {
        return ::testing::AssertionFailure()
               << "group " << g << " cells " << usage.groups[g].cells_used << "/"
               << usage.groups[g].cells_total << " memory " << usage.groups[g].memory << ", model "
               << m.used() << "/" << m.total << " memory " << m.memory;
      }
    }
    if (usage.bytes_held != bytes_held || device_.used_bytes() != bytes_held) {
      return ::testing::AssertionFailure() << "bytes_held " << usage.bytes_held << ", device "
                                           << device_.used_bytes() << ", expected " << bytes_held;
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
          info.groups.size() != spec_.groups.size()) {
        return ::testing::AssertionFailure()
               << "ListSequences entry seq " << info.seq << " offset " << info.offset
               << ", model seq " << seq << " offset " << model_.Offset(seq);
      }
      for (size_t g = 0; g < spec_.groups.size(); ++g) {
        const ModelGroup& m = model_.groups()[g];
        GroupSequenceInfo want;
        if (const auto* positions = m.Find(seq)) {
          want.stored = static_cast<int32_t>(positions->size());
          want.first = positions->begin()->first;
          want.last = positions->rbegin()->first;
          for (const auto& entry : *positions) {
            if (m.cells.at(entry.second).refs > 1) ++want.shared;
          }
        }
        const GroupSequenceInfo& got = info.groups[g];
        if (got.stored != want.stored || got.shared != want.shared || got.first != want.first ||
            got.last != want.last) {
          return ::testing::AssertionFailure()
                 << "seq " << seq << " group " << g << ": stored " << got.stored << " shared "
                 << got.shared << " first " << got.first << " last " << got.last << ", model "
                 << want.stored << " " << want.shared << " " << want.first << " " << want.last;
        }
      }
    }
    // Bytes of every live sequence; NOT_FOUND for the others.
    for (int64_t seq : pool_) {
      absl::StatusOr<ReadResult> read = cache_->Read(seq, 0, std::nullopt);
      if (!live.count(seq)) {
        if (read.status().code() != absl::StatusCode::kNotFound) {
          return ::testing::AssertionFailure()
                 << "Read of empty seq " << seq << ": " << read.status();
        }
        continue;
      }
      if (!read.ok()) {
        return ::testing::AssertionFailure() << "Read(" << seq << "): " << read.status();
      }
      std::vector<std::vector<std::pair<int32_t, Cell>>> rows;
      for (size_t g = 0; g < spec_.groups.size(); ++g) {
        rows.push_back(model_.Rows(static_cast<int>(g), seq, 0, std::nullopt));
      }
      ::testing::AssertionResult r = CompareRead(spec_, memo_, *read, rows);
      if (!r) return r << " in Read(" << seq << ")";
      for (const auto& group_rows : rows) {
        for (const auto& row : group_rows) {
          if (row.second.shifts > 0) ++outcomes["rotated key rows compared"];
          if (row.second.shifts > 1) ++outcomes["twice-rotated key rows compared"];
        }
      }
    }
    // Visible and CanResume around each sequence's edges.
    for (size_t g = 0; g < spec_.groups.size(); ++g) {
      std::vector<Query> queries;
      for (int64_t seq : pool_) {
        for (int k = 0; k < 3; ++k) queries.push_back(RandomQuery(seq));
      }
      absl::StatusOr<std::vector<std::vector<int32_t>>> got =
          cache_->Visible(static_cast<int>(g), queries);
      if (!got.ok()) return ::testing::AssertionFailure() << "Visible: " << got.status();
      ::testing::AssertionResult r = CompareVisible(static_cast<int>(g), queries, *got);
      if (!r) return r;
    }
    for (int64_t seq : pool_) {
      const int32_t offset = model_.Offset(seq);
      std::vector<int32_t> positions = {0, offset, offset + 1, std::max(0, offset - 1),
                                        static_cast<int32_t>(rng_.Below(PosLimit() + 2))};
      for (const ModelGroup& m : model_.groups()) {
        if (!m.limited()) continue;
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
        if (*got != model_.CanResume(seq, pos)) {
          return ::testing::AssertionFailure()
                 << "CanResume(" << seq << ", " << pos << ") = " << *got << ", model "
                 << model_.CanResume(seq, pos);
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

  Rng rng_;
  const CacheSpec spec_;
  Model model_;
  RowMemo memo_;
  HostDevice device_;
  std::unique_ptr<Cache> cache_;
  std::vector<int64_t> pool_;
  std::vector<std::string> log_;
  uint64_t next_id_ = 1;
};

TEST(CacheModelTest, RandomOperationsMatchTheModel) {
  const int episodes = EnvInt("KVMESH_MODEL_ITERATIONS", kDefaultEpisodes);
  const uint64_t base_seed = EnvU64("KVMESH_MODEL_SEED", 20240601);
  std::map<std::string, int> outcomes;
  for (int e = 0; e < episodes; ++e) {
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
  }
  // The run reached the states the test is for (a weakened generator would fail here).
  if (episodes >= kDefaultEpisodes) {
    for (const char* outcome :
         {"Append OK", "Append INVALID_ARGUMENT", "Append RESOURCE_EXHAUSTED", "CopyPrefix OK",
          "CopyPrefix INVALID_ARGUMENT", "CopyPrefix RESOURCE_EXHAUSTED", "Remove OK",
          "Remove INVALID_ARGUMENT", "Remove FAILED_PRECONDITION", "Remove RESOURCE_EXHAUSTED",
          "Read OK", "Read NOT_FOUND", "Read INVALID_ARGUMENT", "Visible OK",
          "Visible INVALID_ARGUMENT", "CanResume OK", "CanResume INVALID_ARGUMENT",
          "rotated key rows compared", "twice-rotated key rows compared"}) {
      EXPECT_GT(outcomes[outcome], 0) << outcome;
    }
  }
  for (const auto& [k, v] : outcomes) std::printf("  %-32s %d\n", k.c_str(), v);
}

}  // namespace
}  // namespace kvmesh
