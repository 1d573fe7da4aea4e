#include "tests/fuzz/fuzz_support.h"

#include <cstdio>
#include <cstdlib>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cache/status_macros.h"

namespace kvmesh {
namespace fuzz {
namespace {

GroupSpec Attention(int32_t layers, int32_t heads, int32_t dk, int32_t dv, WindowSpec window,
                    RopeSpec rope) {
  GroupSpec g;
  g.num_layers = layers;
  g.kind = GroupKind::kAttention;
  g.attention.num_kv_heads = heads;
  g.attention.head_dim_k = dk;
  g.attention.head_dim_v = dv;
  g.attention.window = window;
  g.attention.rope = rope;
  return g;
}

GroupSpec Rotating(int32_t layers, int32_t heads, int32_t dk, int32_t dv, int32_t max_size,
                   RopeSpec rope) {
  GroupSpec g;
  g.num_layers = layers;
  g.kind = GroupKind::kRotating;
  g.rotating.num_kv_heads = heads;
  g.rotating.head_dim_k = dk;
  g.rotating.head_dim_v = dv;
  g.rotating.max_size = max_size;
  g.rotating.rope = rope;
  return g;
}

GroupSpec Recurrent(int32_t layers, int32_t conv_tail, int32_t conv_dim, int32_t v_heads,
                    int32_t head_v_dim, int32_t head_k_dim) {
  GroupSpec g;
  g.num_layers = layers;
  g.kind = GroupKind::kRecurrent;
  g.recurrent.conv_tail = conv_tail;
  g.recurrent.conv_dim = conv_dim;
  g.recurrent.num_v_heads = v_heads;
  g.recurrent.head_v_dim = head_v_dim;
  g.recurrent.head_k_dim = head_k_dim;
  return g;
}

WindowSpec Sliding(int32_t window, int32_t memory) {
  WindowSpec w;
  w.kind = WindowKind::kSliding;
  w.window = window;
  w.memory = memory;
  return w;
}

WindowSpec Chunked(int32_t chunk) {
  WindowSpec w;
  w.kind = WindowKind::kChunked;
  w.chunk = chunk;
  return w;
}

RopeSpec Rope(RopeType type, int32_t dims, float base = 10000.0f) {
  RopeSpec r;
  r.type = type;
  r.dims = dims;
  r.base = base;
  return r;
}

WireCase Case(std::string name, DType dtype, std::vector<GroupSpec> groups,
              size_t snapshot_budget = size_t{1} << 20) {
  WireCase c;
  c.spec.name = std::move(name);
  c.spec.dtype = dtype;
  c.spec.max_sequences = 4;
  c.spec.capacity = 24;
  c.spec.max_batch = 16;
  c.spec.groups = std::move(groups);
  c.cache_budget = size_t{4} << 20;
  c.snapshot_budget = snapshot_budget;
  return c;
}

}  // namespace

void Fail(absl::string_view what) {
  std::fprintf(stderr, "fuzz invariant broken: %.*s\n", static_cast<int>(what.size()), what.data());
  std::fflush(stderr);
  std::abort();
}

const std::vector<WireCase>& WireCases() {
  static const std::vector<WireCase>* const cases = [] {
    auto* v = new std::vector<WireCase>;
    const WindowSpec full;
    // 0: one full-attention group, NEOX rope over part of the head.
    v->push_back(
        Case("full", DType::kF16, {Attention(2, 1, 4, 4, full, Rope(RopeType::kNeox, 2))}));
    // 1: sliding (window 4, memory 6) and chunked groups, K and V of different widths.
    v->push_back(Case("windows", DType::kBF16,
                      {Attention(1, 2, 2, 4, Sliding(4, 6), Rope(RopeType::kNormal, 2)),
                       Attention(1, 1, 2, 2, Chunked(3), RopeSpec())}));
    // 2: a rotating ring of 5 rows.
    v->push_back(
        Case("ring", DType::kF32, {Rotating(2, 1, 2, 2, 5, Rope(RopeType::kNeox, 2, 500.0f))}));
    // 3: recurrent with a gated-delta state, beside full attention (an LFM2/Qwen3-Next shape).
    v->push_back(Case("hybrid", DType::kF16,
                      {Attention(1, 1, 2, 2, full, RopeSpec()), Recurrent(2, 2, 3, 1, 2, 2)}));
    // 4: every kind at once; conv state only.
    v->push_back(Case("all", DType::kBF16,
                      {Recurrent(1, 1, 2, 0, 0, 0), Rotating(1, 1, 2, 2, 3, RopeSpec()),
                       Attention(1, 1, 2, 2, Sliding(3, 0), Rope(RopeType::kNeox, 2))}));
    // 5: full attention on a device whose snapshot pool holds 4 KiB: imports that describe
    //    more rows than that are RESOURCE_EXHAUSTED.
    v->push_back(
        Case("tight", DType::kF32, {Attention(1, 1, 4, 4, full, RopeSpec())}, size_t{4} << 10));
    for (const WireCase& c : *v) {
      const absl::Status valid = ValidateSpec(c.spec);
      if (!valid.ok()) Fail(absl::StrCat("wire case '", c.spec.name, "': ", valid.ToString()));
    }
    return v;
  }();
  return *cases;
}

int32_t PrefillTokens(const CacheSpec& spec) { return std::min<int32_t>(6, spec.max_batch); }

std::string PrefillPayload(const CacheSpec& spec, int32_t tokens, uint8_t salt) {
  std::string payload(AppendPayloadBytes(spec, tokens, 1), '\0');
  // Bytes that are finite in every dtype (no NaN or Inf patterns) and differ from row to row.
  for (size_t i = 0; i < payload.size(); ++i) {
    payload[i] = static_cast<char>(((i * 37 + salt) % 61) & 0x3f);
  }
  return payload;
}

absl::Status Prefill(Cache& cache) {
  const int32_t n = PrefillTokens(cache.spec());
  std::vector<Token> tokens(n);
  for (int32_t i = 0; i < n; ++i) tokens[i] = Token{0, i};
  const std::string payload = PrefillPayload(cache.spec(), n, 1);
  RETURN_IF_ERROR(cache.Append(
      tokens,
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size())));
  return cache.Snapshot(0, 0).status();
}

std::string CacheDigest(const Cache& cache) {
  std::string out;
  for (const SequenceInfo& s : cache.ListSequences()) {
    absl::StrAppend(&out, "seq ", s.seq, " offset ", s.offset, " pending ", s.pending,
                    " tokens ", s.tokens, "/", s.exact_tokens, "/", s.token_blocks, " kept ",
                    s.priority, s.pinned ? " pinned " : " ", absl::FormatDuration(s.ttl), ":");
    for (const GroupSequenceInfo& g : s.groups) {
      absl::StrAppend(&out, " [", g.stored, " ", g.shared, " ", g.first, " ", g.last, " ",
                      StateStatusName(g.state), "]");
    }
    absl::StatusOr<ReadResult> read = cache.Read(s.seq, 0, std::nullopt);
    if (read.ok()) {
      absl::StrAppend(&out, " read");
      for (size_t g = 0; g < read->positions.size(); ++g) {
        absl::StrAppend(&out, " g", g, " ", StateStatusName(read->states[g]), " {");
        for (int32_t p : read->positions[g]) absl::StrAppend(&out, p, ",");
        absl::StrAppend(&out, "}");
      }
      // FNV-1a of the bytes: a digest stays printable, and any changed byte changes it.
      uint64_t hash = 0xcbf29ce484222325ull;
      for (char c : read->payload) hash = (hash ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
      absl::StrAppend(&out, " payload ", read->payload.size(), " bytes fnv ",
                      absl::Hex(hash, absl::kZeroPad16));
    } else {
      absl::StrAppend(&out, " read: ", read.status().ToString());
    }
    out += '\n';
  }
  for (const SnapshotInfo& s : cache.ListSnapshots()) {
    absl::StrAppend(&out, "snapshot ", s.id, " seq ", s.seq, " [", s.from, ", ", s.to, ") ",
                    s.bytes, " bytes:");
    for (const SnapshotGroupInfo& g : s.groups) {
      absl::StrAppend(&out, " [", g.stored, " ", g.ring_index, " ", StateStatusName(g.state), "]");
    }
    out += '\n';
  }
  // Not export_bytes: an export's data stays pinned until the sender's side of its last Fetch
  // has finished, a moment after the receiver has it all; the harnesses check instead that
  // every byte comes back once the caches are gone.
  const CacheUsage usage = cache.Usage();
  absl::StrAppend(&out, "usage live ", usage.sequences_live, " reserved ",
                  usage.sequences_reserved, " held ", usage.bytes_held, " snapshots ",
                  usage.snapshots, " ", usage.snapshot_bytes, ":");
  for (const GroupUsage& g : usage.groups) {
    absl::StrAppend(&out, " [", g.cells_total, " ", g.cells_used, " ", g.cells_reserved, " ",
                    g.memory, " ", g.bytes, "]");
  }
  return out;
}

}  // namespace fuzz
}  // namespace kvmesh
