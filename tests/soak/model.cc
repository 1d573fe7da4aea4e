#include "tests/soak/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "service/common/convert.h"
#include "tests/testing/pattern.h"

namespace kvmesh {
namespace soak {
namespace {

using testutil::DecodeElement;
using testutil::ElementBytes;

v1::LayerGroup AttentionGroup(int32_t layers, int32_t heads, int32_t dim_k, int32_t dim_v,
                              v1::RopeType rope, int32_t rope_dims, float base, float scale,
                              int32_t chunk) {
  v1::LayerGroup group;
  group.set_num_layers(layers);
  v1::Attention* a = group.mutable_attention();
  a->set_num_kv_heads(heads);
  a->set_head_dim_k(dim_k);
  a->set_head_dim_v(dim_v);
  if (chunk > 0) a->mutable_window()->mutable_chunked()->set_chunk(chunk);
  a->mutable_rope()->set_type(rope);
  a->mutable_rope()->set_dims(rope_dims);
  a->mutable_rope()->set_base(base);
  a->mutable_rope()->set_freq_scale(scale);
  return group;
}

// Relative rounding step of one element of `dtype` (half an ulp at 1, doubled for safety).
double Epsilon(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return std::ldexp(1.0, -22);
    case DType::kF16:
      return std::ldexp(1.0, -9);
    case DType::kBF16:
      return std::ldexp(1.0, -6);
  }
  return 1;
}

// Compares one K row of `group`/`layer` at `pos` with what `row` must read back as. Appends to
// `errors` when it differs.
void CheckKRow(const CacheSpec& spec, int group, int layer, int32_t pos, const Row& row,
               const uint8_t* got, std::vector<std::string>* errors) {
  const std::vector<uint8_t> want = testutil::RowBytes(spec, row.id, group, layer, true);
  if (row.moves == 0) {
    if (std::memcmp(want.data(), got, want.size()) != 0) {
      errors->push_back(absl::StrCat("group ", group, " layer ", layer, " position ", pos,
                                     ": K bytes differ (row never moved)"));
    }
    return;
  }
  const AttentionSpec& a = spec.groups[group].attention;
  const size_t eb = ElementBytes(spec.dtype);
  const int32_t dims = a.rope.dims;
  const int32_t half = dims / 2;
  const double delta = static_cast<double>(pos) - row.appended_pos;
  const double tolerance = Epsilon(spec.dtype) * (row.moves + 1);
  for (int32_t h = 0; h < a.num_kv_heads; ++h) {
    const size_t base = static_cast<size_t>(h) * a.head_dim_k;
    // The unrotated tail must be exact.
    const size_t tail = (base + dims) * eb;
    const size_t end = (base + a.head_dim_k) * eb;
    if (std::memcmp(want.data() + tail, got + tail, end - tail) != 0) {
      errors->push_back(absl::StrCat("group ", group, " layer ", layer, " position ", pos, " head ",
                                     h, ": K bytes past rope dims differ (moved row)"));
      return;
    }
    for (int32_t i = 0; i < half; ++i) {
      const size_t i0 = base + (a.rope.type == RopeType::kNeox ? i : 2 * i);
      const size_t i1 = base + (a.rope.type == RopeType::kNeox ? i + half : 2 * i + 1);
      const double x0 = DecodeElement(spec.dtype, want.data() + i0 * eb);
      const double x1 = DecodeElement(spec.dtype, want.data() + i1 * eb);
      const double theta = delta * static_cast<double>(a.rope.freq_scale) *
                           std::pow(static_cast<double>(a.rope.base), -2.0 * i / dims);
      const double c = std::cos(theta), s = std::sin(theta);
      const double e0 = x0 * c - x1 * s, e1 = x0 * s + x1 * c;
      const double g0 = DecodeElement(spec.dtype, got + i0 * eb);
      const double g1 = DecodeElement(spec.dtype, got + i1 * eb);
      const double norm = std::sqrt(x0 * x0 + x1 * x1);
      if (!(std::fabs(g0 - e0) <= tolerance * norm) || !(std::fabs(g1 - e1) <= tolerance * norm)) {
        errors->push_back(absl::StrCat(
            "group ", group, " layer ", layer, " position ", pos, " head ", h, " pair ", i, ": K (",
            g0, ", ", g1, ") but the pattern rotated by ", delta, " is (", e0, ", ", e1,
            ") (moved ", row.moves, " times, tolerance ", tolerance * norm, ")"));
        return;
      }
    }
  }
}

}  // namespace

v1::CacheSpec ModelSpec(const std::string& name, Flavour flavour) {
  v1::CacheSpec spec;
  spec.set_name(name);
  spec.set_max_sequences(kModelMaxSequences);
  spec.set_capacity(kModelCapacity);
  spec.set_max_batch(kModelMaxBatch);
  if (flavour == Flavour::kAttention) {
    spec.set_dtype(v1::DTYPE_F16);
    *spec.add_groups() =
        AttentionGroup(2, 2, 64, 64, v1::ROPE_TYPE_NEOX, 32, 10000.0f, 1.0f, /*chunk=*/0);
    *spec.add_groups() =
        AttentionGroup(1, 2, 64, 32, v1::ROPE_TYPE_NORMAL, 16, 500000.0f, 0.5f, kChunk);
  } else {
    spec.set_dtype(v1::DTYPE_BF16);
    *spec.add_groups() =
        AttentionGroup(2, 2, 64, 64, v1::ROPE_TYPE_NEOX, 64, 10000.0f, 1.0f, /*chunk=*/0);
    v1::LayerGroup recurrent;
    recurrent.set_num_layers(2);
    recurrent.mutable_recurrent()->set_conv_tail(3);
    recurrent.mutable_recurrent()->set_conv_dim(32);
    recurrent.mutable_recurrent()->set_num_v_heads(2);
    recurrent.mutable_recurrent()->set_head_v_dim(8);
    recurrent.mutable_recurrent()->set_head_k_dim(8);
    *spec.add_groups() = recurrent;
  }
  return spec;
}

bool ApplyRemove(Flavour flavour, SeqModel* seq, int32_t begin, std::optional<int32_t> end) {
  const int32_t offset = seq->offset();
  if (begin >= offset || (end.has_value() && *end == begin)) return !seq->rows.empty();
  std::map<int32_t, Row> kept;
  for (const auto& [pos, row] : seq->rows) {
    if (pos < begin) {
      kept[pos] = row;
    } else if (end.has_value() && pos >= *end) {
      Row moved = row;
      moved.moves++;
      kept[pos - (*end - begin)] = moved;
    }
  }
  seq->rows = std::move(kept);
  if (flavour == Flavour::kHybrid && seq->state != State::kNone) seq->state = State::kInvalid;
  return !seq->rows.empty();
}

std::vector<int32_t> ExpectedVisible(const CacheModel& cache, int group, const SeqModel* seq,
                                     int32_t pos, bool non_causal) {
  std::vector<int32_t> out;
  if (seq == nullptr) return out;
  const WindowSpec& window = cache.engine.groups[group].attention.window;
  const int32_t low = window.kind == WindowKind::kChunked ? pos - pos % window.chunk : 0;
  for (const auto& [p, row] : seq->rows) {
    if (p >= low && (non_causal || p <= pos)) out.push_back(p);
  }
  return out;
}

int64_t TokenBytes(const CacheSpec& spec) {
  int64_t bytes = 0;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    if (spec.groups[g].kind == GroupKind::kRecurrent) continue;
    bytes += static_cast<int64_t>(spec.groups[g].num_layers) *
             (testutil::KRowElements(spec, static_cast<int>(g)) +
              testutil::VRowElements(spec, static_cast<int>(g))) *
             ElementBytes(spec.dtype);
  }
  return bytes;
}

int64_t StateBytes(const CacheSpec& spec) {
  int64_t bytes = 0;
  for (const GroupSpec& g : spec.groups) {
    if (g.kind != GroupKind::kRecurrent) continue;
    const RecurrentSpec& r = g.recurrent;
    bytes += static_cast<int64_t>(g.num_layers) *
             (static_cast<int64_t>(r.conv_tail) * r.conv_dim * ElementBytes(spec.dtype) +
              static_cast<int64_t>(r.num_v_heads) * r.head_v_dim * r.head_k_dim * 4);
  }
  return bytes;
}

std::string CheckRead(const CacheModel& cache, const SeqModel& seq, int32_t begin,
                      std::optional<int32_t> end, const v1::ReadHeader& header,
                      const std::string& payload) {
  const CacheSpec& spec = cache.engine;
  const int groups = static_cast<int>(spec.groups.size());
  if (header.groups_size() != groups) {
    return absl::StrCat("header has ", header.groups_size(), " groups, the cache ", groups);
  }
  std::vector<int32_t> positions;
  for (const auto& [pos, row] : seq.rows) {
    if (pos >= begin && (!end.has_value() || pos < *end)) positions.push_back(pos);
  }
  const bool reaches = !end.has_value() || *end >= seq.offset();
  const State state = reaches ? seq.state : State::kNone;
  int64_t expected_bytes = 0;
  for (int g = 0; g < groups; ++g) {
    const v1::GroupPositions& got = header.groups(g);
    if (got.group() != g) return absl::StrCat("header group ", g, " says group ", got.group());
    if (spec.groups[g].kind == GroupKind::kRecurrent) {
      const v1::StateStatus want = state == State::kValid     ? v1::STATE_STATUS_VALID
                                   : state == State::kInvalid ? v1::STATE_STATUS_INVALID
                                                              : v1::STATE_STATUS_NONE;
      if (got.positions_size() != 0 || got.state() != want) {
        return absl::StrCat("group ", g, " (recurrent): ", got.positions_size(),
                            " positions, state ", v1::StateStatus_Name(got.state()),
                            "; expected none and ", v1::StateStatus_Name(want));
      }
      if (state == State::kValid) {
        expected_bytes += static_cast<int64_t>(spec.groups[g].num_layers) *
                          testutil::StateLayerBytes(spec, 0, g, 0).size();
      }
      continue;
    }
    const std::vector<int32_t> listed(got.positions().begin(), got.positions().end());
    if (listed != positions) {
      return absl::StrCat("group ", g, " lists positions [", absl::StrJoin(listed, ","),
                          "], expected [", absl::StrJoin(positions, ","), "]");
    }
    if (got.state() != v1::STATE_STATUS_NONE) {
      return absl::StrCat("group ", g, " (attention) has state ",
                          v1::StateStatus_Name(got.state()));
    }
    expected_bytes += static_cast<int64_t>(positions.size()) * spec.groups[g].num_layers *
                      (testutil::KRowElements(spec, g) + testutil::VRowElements(spec, g)) *
                      ElementBytes(spec.dtype);
  }
  if (header.payload_bytes() != expected_bytes ||
      static_cast<int64_t>(payload.size()) != expected_bytes) {
    return absl::StrCat("payload_bytes ", header.payload_bytes(), ", data ", payload.size(),
                        " bytes; expected ", expected_bytes);
  }
  std::vector<std::string> errors;
  const uint8_t* p = reinterpret_cast<const uint8_t*>(payload.data());
  for (int g = 0; g < groups && errors.size() < 3; ++g) {
    if (spec.groups[g].kind == GroupKind::kRecurrent) {
      if (state != State::kValid) continue;
      for (int layer = 0; layer < spec.groups[g].num_layers; ++layer) {
        const std::vector<uint8_t> want = testutil::StateLayerBytes(spec, seq.state_id, g, layer);
        if (std::memcmp(want.data(), p, want.size()) != 0) {
          errors.push_back(absl::StrCat("group ", g, " layer ", layer, ": state bytes differ"));
        }
        p += want.size();
      }
      continue;
    }
    const size_t k_bytes = testutil::KRowElements(spec, g) * ElementBytes(spec.dtype);
    const size_t v_bytes = testutil::VRowElements(spec, g) * ElementBytes(spec.dtype);
    for (int layer = 0; layer < spec.groups[g].num_layers; ++layer) {
      for (int32_t pos : positions) {
        CheckKRow(spec, g, layer, pos, seq.rows.at(pos), p, &errors);
        p += k_bytes;
      }
      for (int32_t pos : positions) {
        const std::vector<uint8_t> want =
            testutil::RowBytes(spec, seq.rows.at(pos).id, g, layer, false);
        if (std::memcmp(want.data(), p, v_bytes) != 0) {
          errors.push_back(
              absl::StrCat("group ", g, " layer ", layer, " position ", pos, ": V bytes differ"));
        }
        p += v_bytes;
      }
    }
  }
  return absl::StrJoin(errors, "; ");
}

std::string CheckSnapshotInfo(const CacheModel& cache, const SnapModel& snap,
                              const v1::SnapshotInfo& info) {
  if (info.from_offset() != snap.from || info.to_offset() != snap.to) {
    return absl::StrCat("snapshot ", info.id(), " covers [", info.from_offset(), ", ",
                        info.to_offset(), "), expected [", snap.from, ", ", snap.to, ")");
  }
  for (const v1::SnapshotGroup& g : info.groups()) {
    if (g.group() < 0 || g.group() >= static_cast<int>(cache.engine.groups.size())) {
      return absl::StrCat("snapshot ", info.id(), " names group ", g.group());
    }
    if (cache.engine.groups[g.group()].kind == GroupKind::kRecurrent) {
      if (g.state() != v1::STATE_STATUS_VALID) {
        return absl::StrCat("snapshot ", info.id(), " group ", g.group(), " state ",
                            v1::StateStatus_Name(g.state()), ", expected VALID");
      }
    } else if (g.stored() != static_cast<int32_t>(snap.rows.size())) {
      return absl::StrCat("snapshot ", info.id(), " group ", g.group(), " stores ", g.stored(),
                          " positions, expected ", snap.rows.size());
    }
  }
  return "";
}

std::string CheckSequences(const CacheModel& cache, const NodeModel& node,
                           const v1::ListSequencesResponse& response) {
  std::vector<int64_t> got, want;
  for (const v1::SequenceInfo& s : response.sequences()) got.push_back(s.seq());
  for (const auto& [seq, model] : node.seqs) want.push_back(seq);
  if (got != want) {
    return absl::StrCat("live sequences [", absl::StrJoin(got, ","), "], expected [",
                        absl::StrJoin(want, ","), "]");
  }
  for (const v1::SequenceInfo& s : response.sequences()) {
    const SeqModel& model = node.seqs.at(s.seq());
    if (s.offset() != model.offset() || s.pending() != 0) {
      return absl::StrCat("sequence ", s.seq(), ": offset ", s.offset(), " pending ", s.pending(),
                          ", expected offset ", model.offset(), " pending 0");
    }
    if (s.groups_size() != static_cast<int>(cache.engine.groups.size())) {
      return absl::StrCat("sequence ", s.seq(), ": ", s.groups_size(), " groups");
    }
    for (const v1::GroupSequence& g : s.groups()) {
      if (cache.engine.groups[g.group()].kind == GroupKind::kRecurrent) {
        const v1::StateStatus want_state =
            model.state == State::kValid ? v1::STATE_STATUS_VALID : v1::STATE_STATUS_INVALID;
        if (g.state() != want_state) {
          return absl::StrCat("sequence ", s.seq(), " group ", g.group(), ": state ",
                              v1::StateStatus_Name(g.state()), ", expected ",
                              v1::StateStatus_Name(want_state));
        }
        continue;
      }
      const int32_t first = model.rows.empty() ? -1 : model.rows.begin()->first;
      const int32_t last = model.rows.empty() ? -1 : model.rows.rbegin()->first;
      if (g.stored() != static_cast<int32_t>(model.rows.size()) || g.first() != first ||
          g.last() != last) {
        return absl::StrCat("sequence ", s.seq(), " group ", g.group(), ": stored ", g.stored(),
                            " first ", g.first(), " last ", g.last(), ", expected ",
                            model.rows.size(), " ", first, " ", last);
      }
    }
  }
  return "";
}

}  // namespace soak
}  // namespace kvmesh
