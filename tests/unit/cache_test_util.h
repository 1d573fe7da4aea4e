// Helpers shared by the engine's unit tests: spec builders, Append with pattern payloads keyed
// by token ids, expected Read payloads, and whole-cache state capture for all-or-nothing checks.
#ifndef KVMESH_TESTS_UNIT_CACHE_TEST_UTIL_H_
#define KVMESH_TESTS_UNIT_CACHE_TEST_UTIL_H_

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "cache/cache.h"
#include "cache/device/device.h"
#include "cache/spec.h"
#include "gtest/gtest.h"
#include "tests/testing/pattern.h"
#include "tests/testing/test_device.h"
#include "tests/unit/rope_reference.h"

namespace kvmesh {
namespace testutil {

inline WindowSpec Full() { return WindowSpec{}; }

inline WindowSpec Sliding(int32_t window, int32_t memory = 0) {
  WindowSpec w;
  w.kind = WindowKind::kSliding;
  w.window = window;
  w.memory = memory;
  return w;
}

inline WindowSpec Chunked(int32_t chunk) {
  WindowSpec w;
  w.kind = WindowKind::kChunked;
  w.chunk = chunk;
  return w;
}

inline RopeSpec Rope(RopeType type, int32_t dims, float base = 10000.0f, float freq_scale = 1.0f) {
  RopeSpec r;
  r.type = type;
  r.dims = dims;
  r.base = base;
  r.freq_scale = freq_scale;
  return r;
}

inline GroupSpec Group(WindowSpec window, int32_t num_layers = 1, int32_t heads = 1,
                       int32_t head_dim_k = 4, int32_t head_dim_v = 4, RopeSpec rope = {}) {
  GroupSpec g;
  g.num_layers = num_layers;
  g.kind = GroupKind::kAttention;
  g.attention.num_kv_heads = heads;
  g.attention.head_dim_k = head_dim_k;
  g.attention.head_dim_v = head_dim_v;
  g.attention.window = window;
  g.attention.rope = rope;
  return g;
}

// A Rotating group (per-sequence ring of `max_size` rows).
inline GroupSpec RotatingGroup(int32_t max_size, int32_t num_layers = 1, int32_t heads = 1,
                               int32_t head_dim_k = 4, int32_t head_dim_v = 4, RopeSpec rope = {}) {
  GroupSpec g;
  g.num_layers = num_layers;
  g.kind = GroupKind::kRotating;
  g.rotating.num_kv_heads = heads;
  g.rotating.head_dim_k = head_dim_k;
  g.rotating.head_dim_v = head_dim_v;
  g.rotating.max_size = max_size;
  g.rotating.rope = rope;
  return g;
}

// A Recurrent group: conv [conv_tail][conv_dim] and delta [num_v_heads][head_v_dim][head_k_dim].
inline GroupSpec RecurrentGroup(int32_t num_layers = 1, int32_t conv_tail = 2, int32_t conv_dim = 3,
                                int32_t num_v_heads = 1, int32_t head_v_dim = 2,
                                int32_t head_k_dim = 2) {
  GroupSpec g;
  g.num_layers = num_layers;
  g.kind = GroupKind::kRecurrent;
  g.recurrent.conv_tail = conv_tail;
  g.recurrent.conv_dim = conv_dim;
  g.recurrent.num_v_heads = num_v_heads;
  g.recurrent.head_v_dim = head_v_dim;
  g.recurrent.head_k_dim = head_k_dim;
  return g;
}

inline CacheSpec Spec(DType dtype, int32_t max_sequences, int32_t capacity, int32_t max_batch,
                      std::vector<GroupSpec> groups, std::string name = "test") {
  CacheSpec s;
  s.name = std::move(name);
  s.dtype = dtype;
  s.max_sequences = max_sequences;
  s.capacity = capacity;
  s.max_batch = max_batch;
  s.groups = std::move(groups);
  return s;
}

// The id of the row data a test appends for (seq, pos); `salt` tells rewrites apart.
inline uint64_t TokenId(int64_t seq, int32_t pos, uint64_t salt = 0) {
  return Mix64(static_cast<uint64_t>(seq) * 0x9E3779B97F4A7C15ull ^
               (static_cast<uint64_t>(static_cast<uint32_t>(pos)) << 20) ^ (salt << 52));
}

// Tokens (seq, begin..end-1).
inline std::vector<Token> Tokens(int64_t seq, int32_t begin, int32_t end) {
  std::vector<Token> t;
  for (int32_t p = begin; p < end; ++p) t.push_back(Token{seq, p});
  return t;
}

inline std::vector<int32_t> Range(int32_t begin, int32_t end) {
  std::vector<int32_t> r;
  for (int32_t p = begin; p < end; ++p) r.push_back(p);
  return r;
}

// The id of the recurrent state a test appends for `seq` once it reaches `offset` (the state
// after the token at offset - 1); `salt` tells rewrites apart.
inline uint64_t StateId(int64_t seq, int32_t offset, uint64_t salt = 0) {
  return Mix64(TokenId(seq, offset, salt) ^ 0x57A7E57A7E5ull);
}

// The Append payload of `tokens` with rows TokenId(seq, pos, salt) and, for Recurrent groups,
// the state StateId(seq, last pos + 1, salt) per distinct sequence in order of first appearance
// (speculative: StateId(seq, pos + 1, salt) per token), so that a state's id names the offset
// it belongs to whichever way it was appended.
// pos + 1 without signed overflow: tests append INT32_MAX to see it refused, and the state id
// of such a payload does not matter.
inline int32_t NextOffset(int32_t pos) {
  return static_cast<int32_t>(static_cast<uint32_t>(pos) + 1u);
}

inline std::vector<uint8_t> PayloadFor(const CacheSpec& spec, absl::Span<const Token> tokens,
                                       uint64_t salt = 0, bool speculative = false) {
  std::vector<uint64_t> ids;
  for (const Token& t : tokens) ids.push_back(TokenId(t.seq, t.pos, salt));
  std::vector<uint64_t> states;
  if (speculative) {
    for (const Token& t : tokens) states.push_back(StateId(t.seq, NextOffset(t.pos), salt));
  } else {
    std::vector<int64_t> order;
    std::map<int64_t, int32_t> last;
    for (const Token& t : tokens) {
      auto [it, inserted] = last.emplace(t.seq, t.pos);
      if (inserted) {
        order.push_back(t.seq);
      } else {
        it->second = std::max(it->second, t.pos);
      }
    }
    for (int64_t seq : order) states.push_back(StateId(seq, NextOffset(last[seq]), salt));
  }
  return AppendPayload(spec, ids, states);
}

inline absl::Status AppendTokens(Cache& cache, const std::vector<Token>& tokens,
                                 uint64_t salt = 0) {
  const std::vector<uint8_t> payload = PayloadFor(cache.spec(), tokens, salt);
  return cache.Append(tokens, payload);
}

inline absl::Status AppendRange(Cache& cache, int64_t seq, int32_t begin, int32_t end,
                                uint64_t salt = 0) {
  return AppendTokens(cache, Tokens(seq, begin, end), salt);
}

// An Append of (seq, begin..end-1) whose tokens carry ids: prompt[pos] for each position.
inline absl::Status AppendPrompt(Cache& cache, int64_t seq, int32_t begin, int32_t end,
                                 const std::vector<int32_t>& prompt, uint64_t salt = 0) {
  std::vector<Token> tokens = Tokens(seq, begin, end);
  for (Token& t : tokens) t.id = prompt.at(static_cast<size_t>(t.pos));
  return AppendTokens(cache, tokens, salt);
}

// A speculative Append of (seq, begin..end-1), one state per token.
inline absl::Status AppendSpeculative(Cache& cache, int64_t seq, int32_t begin, int32_t end,
                                      uint64_t salt = 0) {
  const std::vector<Token> tokens = Tokens(seq, begin, end);
  const std::vector<uint8_t> payload = PayloadFor(cache.spec(), tokens, salt, true);
  return cache.Append(tokens, payload, /*speculative=*/true);
}

// Whether `text` contains `needle` not directly preceded or followed by a letter, digit or '_'
// (so "5" does not match inside "15" or "x5").
inline bool ContainsToken(const std::string& text, const std::string& needle) {
  auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    const bool left = at == 0 || !word(text[at - 1]) || !word(needle.front());
    const size_t end = at + needle.size();
    const bool right = end == text.size() || !word(text[end]) || !word(needle.back());
    if (left && right) return true;
  }
  return false;
}

// The status has `code` and its message names every one of `values`.
inline ::testing::AssertionResult IsError(const absl::Status& status, absl::StatusCode code,
                                          const std::vector<std::string>& values = {}) {
  if (status.code() != code) {
    return ::testing::AssertionFailure()
           << "got " << status << ", expected " << absl::StatusCodeToString(code);
  }
  const std::string message(status.message());
  for (const std::string& v : values) {
    if (!ContainsToken(message, v)) {
      return ::testing::AssertionFailure() << "message \"" << message << "\" does not name " << v;
    }
  }
  return ::testing::AssertionSuccess();
}

// Row ids of `seq` at `positions` (appended with salt 0, never shifted).
inline std::vector<uint64_t> Ids(int64_t seq, const std::vector<int32_t>& positions,
                                 uint64_t salt = 0) {
  std::vector<uint64_t> ids;
  for (int32_t p : positions) ids.push_back(TokenId(seq, p, salt));
  return ids;
}

// Byte equality that reports the first mismatch instead of dumping both buffers.
inline ::testing::AssertionResult SameBytes(const std::string& expected,
                                            const std::string& actual) {
  if (expected.size() != actual.size()) {
    return ::testing::AssertionFailure()
           << "size " << actual.size() << ", expected " << expected.size();
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i] != actual[i]) {
      return ::testing::AssertionFailure()
             << "first mismatch at byte " << i << " of " << expected.size() << ": got 0x"
             << std::hex << (static_cast<unsigned>(actual[i]) & 0xFF) << ", expected 0x"
             << (static_cast<unsigned>(expected[i]) & 0xFF);
    }
  }
  return ::testing::AssertionSuccess();
}

inline std::string ToString(const std::vector<int32_t>& v) {
  std::ostringstream os;
  os << "{";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
  os << "}";
  return os.str();
}

// What one stored row should hold: the pattern row `id`, its key rotated by `delta` positions
// through `shifts` RoPE shifts (each rounded to the dtype, so the tolerance grows with them).
struct ExpectedRow {
  uint64_t id = 0;
  int64_t delta = 0;
  int shifts = 0;
};

// Checks a Read payload against expected rows per group: V and unshifted K byte-exact; shifted
// K within RopeTolerancePerShift * shifts of the float64 reference, elements past rope.dims
// byte-exact.
inline ::testing::AssertionResult MatchesRows(const CacheSpec& spec, const std::string& payload,
                                              const std::vector<std::vector<ExpectedRow>>& rows) {
  const size_t esize = ElementBytes(spec.dtype);
  size_t expected_size = 0;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    expected_size += spec.groups[g].num_layers * rows[g].size() *
                     (KRowElements(spec, g) + VRowElements(spec, g)) * esize;
  }
  if (payload.size() != expected_size) {
    return ::testing::AssertionFailure()
           << "payload size " << payload.size() << ", expected " << expected_size;
  }
  const uint8_t* p = reinterpret_cast<const uint8_t*>(payload.data());
  for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
    const AttentionSpec& a = spec.groups[g].attention;
    for (int layer = 0; layer < spec.groups[g].num_layers; ++layer) {
      for (bool key : {true, false}) {
        for (size_t r = 0; r < rows[g].size(); ++r) {
          const ExpectedRow& want = rows[g][r];
          const std::vector<uint8_t> orig = RowBytes(spec, want.id, g, layer, key);
          const bool exact = !key || want.shifts == 0;
          if (exact) {
            if (std::memcmp(p, orig.data(), orig.size()) != 0) {
              return ::testing::AssertionFailure()
                     << "group " << g << " layer " << layer << (key ? " K" : " V") << " row " << r
                     << " differs (id " << want.id << ")";
            }
          } else {
            const size_t n = orig.size() / esize;
            std::vector<double> ref(n);
            for (size_t i = 0; i < n; ++i)
              ref[i] = DecodeElement(spec.dtype, orig.data() + i * esize);
            ReferenceRopeShift(a.rope, a.num_kv_heads, a.head_dim_k, want.delta, &ref);
            const double tol = RopeTolerancePerShift(spec.dtype) * want.shifts;
            for (size_t i = 0; i < n; ++i) {
              const bool rotated = static_cast<int>(i % a.head_dim_k) < a.rope.dims;
              if (!rotated) {
                if (std::memcmp(p + i * esize, orig.data() + i * esize, esize) != 0) {
                  return ::testing::AssertionFailure()
                         << "group " << g << " layer " << layer << " K row " << r << " element "
                         << i << " past rope dims changed";
                }
                continue;
              }
              const double got = DecodeElement(spec.dtype, p + i * esize);
              if (!(std::fabs(got - ref[i]) <= tol * std::max(1.0, std::fabs(ref[i])))) {
                return ::testing::AssertionFailure()
                       << "group " << g << " layer " << layer << " K row " << r << " element " << i
                       << ": got " << got << ", reference " << ref[i] << " (delta " << want.delta
                       << ", " << want.shifts << " shifts, tolerance " << tol << ")";
              }
            }
          }
          p += orig.size();
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// Rows of `seq` at `positions`, as appended with `salt` and never shifted.
inline std::vector<ExpectedRow> Unshifted(int64_t seq, const std::vector<int32_t>& positions,
                                          uint64_t salt = 0) {
  std::vector<ExpectedRow> rows;
  for (int32_t p : positions) rows.push_back(ExpectedRow{TokenId(seq, p, salt), 0, 0});
  return rows;
}

// Everything observable about a cache, for "the cache is exactly as before" checks.
struct CacheState {
  std::string description;  // ListSequences and Usage, printed
  std::map<int64_t, std::vector<std::vector<int32_t>>> positions;
  std::map<int64_t, std::string> payloads;
};

inline CacheState CaptureState(const Cache& cache) {
  CacheState s;
  std::ostringstream os;
  for (const SequenceInfo& info : cache.ListSequences()) {
    os << "seq " << info.seq << " offset " << info.offset << " pending " << info.pending
       << " tokens " << info.tokens << " exact " << info.exact_tokens << " blocks "
       << info.token_blocks << " priority " << info.priority << " pinned " << info.pinned
       << " ttl " << absl::FormatDuration(info.ttl);
    const TokenChain chain = cache.Tokens(info.seq);
    if (!chain.hashes().empty()) os << " last hash " << chain.hashes().back();
    if (!chain.ids().empty()) os << " last id " << chain.ids().back();
    os << ":";
    for (const GroupSequenceInfo& g : info.groups) {
      os << " [stored " << g.stored << " shared " << g.shared << " first " << g.first << " last "
         << g.last << " state " << StateStatusName(g.state) << "]";
    }
    os << "\n";
    absl::StatusOr<ReadResult> read = cache.Read(info.seq, 0, std::nullopt);
    if (read.ok()) {
      s.positions[info.seq] = read->positions;
      s.payloads[info.seq] = read->payload;
      os << "read states:";
      for (StateStatus st : read->states) os << " " << StateStatusName(st);
      os << "\n";
    } else {
      os << "read failed: " << read.status() << "\n";
    }
  }
  const CacheUsage usage = cache.Usage();
  os << "live " << usage.sequences_live << " bytes " << usage.bytes_held << " snapshots "
     << usage.snapshots << " snapshot bytes " << usage.snapshot_bytes << ":";
  for (const GroupUsage& g : usage.groups) {
    os << " [" << g.cells_used << "/" << g.cells_total << " memory " << g.memory << " bytes "
       << g.bytes << "]";
  }
  for (const SnapshotInfo& snap : cache.ListSnapshots()) {
    os << "\nsnapshot " << snap.id << " seq " << snap.seq << " [" << snap.from << ", " << snap.to
       << ") bytes " << snap.bytes;
  }
  s.description = os.str();
  return s;
}

inline ::testing::AssertionResult SameState(const CacheState& before, const CacheState& after) {
  if (before.description != after.description) {
    return ::testing::AssertionFailure() << "before:\n"
                                         << before.description << "\nafter:\n"
                                         << after.description;
  }
  if (before.positions != after.positions) {
    return ::testing::AssertionFailure() << "stored positions changed";
  }
  for (const auto& [seq, bytes] : before.payloads) {
    auto it = after.payloads.find(seq);
    if (it == after.payloads.end()) return ::testing::AssertionFailure() << "seq " << seq;
    ::testing::AssertionResult same = SameBytes(bytes, it->second);
    if (!same)
      return ::testing::AssertionFailure() << "seq " << seq << " bytes: " << same.message();
  }
  return ::testing::AssertionSuccess();
}

// Positions of `seq` in each group as reported by Read, or {} when Read fails.
inline std::vector<std::vector<int32_t>> StoredPositions(const Cache& cache, int64_t seq) {
  absl::StatusOr<ReadResult> read = cache.Read(seq, 0, std::nullopt);
  if (!read.ok()) return {};
  return read->positions;
}

// Read(seq, begin, end) returns `positions` per group and exactly the rows `ids[g]` (for a
// Recurrent group: the state ids[g], or none). `states` defaults to kValid for a Recurrent
// group with a state id, kNone otherwise.
inline ::testing::AssertionResult ReadIs(const Cache& cache, int64_t seq, int32_t begin,
                                         std::optional<int32_t> end,
                                         const std::vector<std::vector<int32_t>>& positions,
                                         const std::vector<std::vector<uint64_t>>& ids,
                                         std::vector<StateStatus> states = {}) {
  const CacheSpec& spec = cache.spec();
  if (states.empty()) {
    for (size_t g = 0; g < spec.groups.size(); ++g) {
      states.push_back(spec.groups[g].kind == GroupKind::kRecurrent && !ids[g].empty()
                           ? StateStatus::kValid
                           : StateStatus::kNone);
    }
  }
  absl::StatusOr<ReadResult> read = cache.Read(seq, begin, end);
  if (!read.ok()) return ::testing::AssertionFailure() << "Read: " << read.status();
  if (read->positions != positions) {
    ::testing::AssertionResult r = ::testing::AssertionFailure();
    r << "positions differ:";
    for (size_t g = 0; g < read->positions.size(); ++g) {
      r << " group " << g << " " << ToString(read->positions[g]);
    }
    return r;
  }
  if (read->states != states) {
    ::testing::AssertionResult r = ::testing::AssertionFailure();
    r << "states differ:";
    for (size_t g = 0; g < read->states.size(); ++g) {
      r << " group " << g << " " << StateStatusName(read->states[g]) << " (expected "
        << (g < states.size() ? StateStatusName(states[g]) : "none") << ")";
    }
    return r;
  }
  return SameBytes(ReadPayload(spec, ids), read->payload);
}

// The ListSequences entry of `seq`, if live.
inline std::optional<SequenceInfo> FindSequence(const Cache& cache, int64_t seq) {
  for (const SequenceInfo& info : cache.ListSequences()) {
    if (info.seq == seq) return info;
  }
  return std::nullopt;
}

// The device under test (MakeTestDevice: HostDevice, or CudaDevice with
// KVMESH_TEST_DEVICE=cuda) with room to spare, and a cache on it.
struct TestCache {
  explicit TestCache(const CacheSpec& spec, size_t budget = size_t{1} << 30)
      : TestCache(spec, budget, budget) {}
  TestCache(const CacheSpec& spec, size_t budget, size_t snapshot_budget)
      : device(MakeTestDevice(budget, snapshot_budget)) {
    absl::StatusOr<std::unique_ptr<Cache>> created = Cache::Create(spec, device.get());
    EXPECT_TRUE(created.ok()) << created.status();
    if (created.ok()) cache = std::move(created).value();
  }
  std::unique_ptr<Device> device;  // declared first: outlives the cache
  std::unique_ptr<Cache> cache;
};

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_UNIT_CACHE_TEST_UTIL_H_
